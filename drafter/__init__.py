"""The drafter service: a small model proposing k tokens per round over gRPC."""
