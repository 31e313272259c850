"""How long the verifier may hold the tokens of a target-only stream before sending them together.

A stream of one token a message wakes the verifier's gRPC threads and the coordinator's (its channel's poller, the
reading thread, the loop) once a token. On a CPU host where the model's threads fill the cores, each wake-up takes a
core from a forward pass in progress, and the pass then waits at its next barrier for the thread it displaced.
Measured on the 2-core ik pair (docs/engines.md): one token a message cost 0.94 ms of CPU a token outside the model's
threads (coordinator and verifier), holding up to 0.1 s 0.48 ms; target-only went from 0.89x to 0.94x of ik's own
loop in alternated bench runs (docs/benchmarks.md).
"""

from specmesh.wire.limits import MAX_FLUSH_INTERVAL_MS

DEFAULT_STREAM_FLUSH_S = 0.1  # a text stream still updates several times a second
MAX_STREAM_FLUSH_S = MAX_FLUSH_INTERVAL_MS / 1000  # what the verifier accepts


def check_stream_flush_s(seconds: float, name: str = "stream_flush_s") -> None:
    """ValueError unless `seconds` is a flush interval the verifier accepts; `name` is what the caller calls it."""
    if not 0 <= seconds <= MAX_STREAM_FLUSH_S:  # NaN fails too
        raise ValueError(f"{name} must be between 0 and {MAX_STREAM_FLUSH_S * 1000:g} ms, got {seconds * 1000:g} ms")
