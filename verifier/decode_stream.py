"""Target-only decoding streamed by the verifier (the Decode rpc): Verify steps without drafts, back to back.

Where a generation drafts nothing (no drafter, or the cost policy ruled drafting out), every round is one target step.
Driven by the coordinator, each step also pays a round trip: protobuf, gRPC on both sides, the coordinator's loop and
a thread hand-off, while the model idles. Here the verifier runs the steps itself and streams each token as it is
committed; a producer thread computes step i + 1 while the gRPC thread sends token i.

Each step is an ordinary VerifyEngine.verify with no drafts (same session, same (seed, position) randomness, batched
with other sessions' calls), so a stream gives exactly the tokens a run of Verify calls would.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from specmesh.decoding.sampling import SamplingParams
from specmesh.wire.history import extend_hash
from verifier.engine import VerifyEngine, VerifyOutcome


@dataclass(frozen=True)
class DecodeSteps:
    session_id: str
    base_length: int
    base_hash: int
    new_tokens: tuple[int, ...]
    max_tokens: int
    stop_token_ids: frozenset[int]
    params: SamplingParams
    seed: int

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


def decode_steps(engine: VerifyEngine, steps: DecodeSteps, is_active: Callable[[], bool],
                 before_step: Callable[[], None]) -> Iterator[VerifyOutcome]:
    """Up to steps.max_tokens Verify steps without drafts, each one's outcome as it is committed. The first step
    syncs the session with the client's history; each later one builds on the previous step's commit (its length and
    rolling hash: a session evicted or changed meanwhile answers resync, as a Verify would). `before_step` runs before
    each step, as the servicer's checks run before each Verify (it raises to end the stream)."""
    length, prefix_hash, fresh = steps.base_length, steps.base_hash, list(steps.new_tokens)
    for _ in range(steps.max_tokens):
        before_step()
        outcome = engine.verify(steps.session_id, length, prefix_hash, fresh, [], [], steps.params, steps.seed,
                                is_active=is_active)
        token = outcome.verdict.next_token
        for committed in (*fresh, token):
            prefix_hash = extend_hash(prefix_hash, committed)
        length, fresh = outcome.committed_length, []
        yield outcome
        if token in steps.stop_token_ids:
            return


_END = object()


def decode_stream(engine: VerifyEngine, steps: DecodeSteps, is_active: Callable[[], bool],
                  before_step: Callable[[], None]) -> Iterator[VerifyOutcome]:
    """decode_steps on a producer thread: the caller's sending of one token overlaps the computing of the next. The
    producer ends within a step once the caller has gone (is_active turns False) or before_step raises."""
    outcomes: queue.SimpleQueue = queue.SimpleQueue()

    def produce() -> None:
        try:
            for outcome in decode_steps(engine, steps, is_active, before_step):
                outcomes.put(outcome)
                if not is_active():
                    return
            outcomes.put(_END)
        except BaseException as e:  # handed to the caller, who answers with its status
            outcomes.put(e)

    threading.Thread(target=produce, name="decode-stream", daemon=True).start()
    while (item := outcomes.get()) is not _END:
        if isinstance(item, BaseException):
            raise item
        yield item
