"""The built-in default model pair: same tokenizer (151,936 tokens), the draft agrees with the target's greedy token on
about 93% of positions on code."""

DEFAULT_DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct"
DEFAULT_TARGET_MODEL = "qwen2.5-coder-1.5b-instruct"

# The largest k a worker accepts unless told otherwise (--max-draft-tokens); each worker reports its own in Info and
# the coordinator keeps every request within the smaller of the drafter's and the verifier's.
DEFAULT_MAX_DRAFT_TOKENS = 32
