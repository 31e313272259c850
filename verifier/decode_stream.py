"""Target-only decoding streamed by the verifier (the Decode rpc): Verify steps without drafts, back to back.

Where a generation drafts nothing (no drafter, or the cost policy ruled drafting out), every round is one target step.
Driven by the coordinator, each step also pays a round trip: protobuf, gRPC on both sides, the coordinator's loop and
a thread hand-off, while the model idles. Here the verifier runs the steps itself and streams each token as it is
committed; the model thread computes step i + 1 while the gRPC thread sends token i.

Each step is an ordinary Verify step with no drafts (same session, same (seed, position) randomness, batched with
other sessions' calls), so a stream gives exactly the tokens a run of Verify calls would. The steps form a chain
(VerifyEngine.verify_chain): as a step is answered, on the model thread, the next one is queued, and the model thread
runs it without handing the model back to another thread in between.
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


class _Position:
    """Where a stream stands: its committed length and rolling hash, what the next step adds, steps taken."""

    def __init__(self, steps: DecodeSteps) -> None:
        self.steps = steps
        self.length, self.prefix_hash, self.fresh, self.taken = steps.base_length, steps.base_hash, steps.new_tokens, 0

    def advance(self, outcome: VerifyOutcome) -> tuple[int, int] | None:
        """Commit a step's outcome: the next step's (base_length, base_hash), or None after a stop token or the last
        step. Each step builds on the previous one's commit (a session evicted or changed meanwhile answers resync,
        as a Verify would)."""
        token = outcome.verdict.next_token
        for committed in (*self.fresh, token):
            self.prefix_hash = extend_hash(self.prefix_hash, committed)
        self.length, self.fresh, self.taken = outcome.committed_length, (), self.taken + 1
        if token in self.steps.stop_token_ids or self.taken >= self.steps.max_tokens:
            return None
        return self.length, self.prefix_hash


_END = object()


def decode_stream(engine: VerifyEngine, steps: DecodeSteps, is_active: Callable[[], bool],
                  before_step: Callable[[], None]) -> Iterator[VerifyOutcome]:
    """Up to steps.max_tokens Verify steps without drafts, each one's outcome as it is committed. `before_step` runs
    before each step, as the servicer's checks run before each Verify (it raises to end the stream); the first on a
    producer thread, the later ones on the model thread, between two steps. The chain ends within a step once the
    caller has gone (is_active turns False) or before_step raises."""
    outcomes: queue.SimpleQueue = queue.SimpleQueue()
    position = _Position(steps)

    def next_step(result: VerifyOutcome | BaseException) -> tuple[int, int] | None:  # on the model thread
        try:
            if isinstance(result, BaseException):
                raise result
            outcomes.put(result)
            following = position.advance(result)
            if following is None or not is_active():
                outcomes.put(_END)
                return None
            before_step()
            return following
        except BaseException as e:  # handed to the caller, who answers with its status
            outcomes.put(e)
            return None

    def produce() -> None:
        try:
            before_step()
            engine.verify_chain(steps.session_id, steps.base_length, steps.base_hash, list(steps.new_tokens),
                                steps.params, steps.seed, is_active, next_step)
        except BaseException as e:  # handed to the caller, who answers with its status
            outcomes.put(e)

    threading.Thread(target=produce, name="decode-stream", daemon=True).start()
    while (item := outcomes.get()) is not _END:
        if isinstance(item, BaseException):
            raise item
        yield item
