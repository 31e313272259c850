"""Limits both ends of an RPC agree on.

The largest k a worker accepts unless told otherwise (--max-draft-tokens); each worker reports its own in Info and
the coordinator keeps every request within the smaller of the drafter's and the verifier's.
"""

DEFAULT_MAX_DRAFT_TOKENS = 32
