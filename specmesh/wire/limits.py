"""Limits both ends of an RPC agree on.

The largest k a worker accepts unless told otherwise (--max-draft-tokens); each worker reports its own in Info and
the coordinator keeps every request within the smaller of the drafter's and the verifier's.
"""

DEFAULT_MAX_DRAFT_TOKENS = 32
# DecodeRequest.flush_interval_ms at most: held longer, a client's step deadline (30 s by default) would come near.
MAX_FLUSH_INTERVAL_MS = 10_000
