"""Target-only decoding streamed by the verifier (the Decode rpc): Verify steps without drafts, back to back.

Where a generation drafts nothing (no drafter, or the cost policy ruled drafting out), every round is one target step.
Driven by the coordinator, each step also pays a round trip: protobuf, gRPC on both sides, the coordinator's loop and
a thread hand-off, while the model idles. Here the verifier runs the steps itself and streams each token as it is
committed; the model thread computes step i + 1 while the gRPC thread sends token i. With a flush interval it holds
the tokens and hands them over a few at a time, so that the gRPC threads on both sides wake once a message rather than
once a token (coordinator/stream_flush.py).

Each step is an ordinary Verify step with no drafts (same session, same (seed, position) randomness, batched with
other sessions' calls), so a stream gives exactly the tokens a run of Verify calls would. Asked to (`guess`), a
greedy step on an engine whose one-token step runs a spare row anyway verifies a guess of the next token in that row
(VerifyEngine.verify_chain): a step then commits one token or two, each the target's own. The steps form a chain
(VerifyEngine.verify_chain): as a step is answered, on the model thread, the next one is queued, and the model thread
runs it without handing the model back to another thread in between.
"""

from __future__ import annotations

import queue
import threading
import time
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
    # 0: each step's outcome is handed over as it is committed. > 0: outcomes are held up to this long and handed
    # over together (the first and the last at once; see _Held).
    flush_interval_s: float = 0.0
    # Each step may verify a guess of the next token where that costs nothing (VerifyEngine.verify_chain; greedy):
    # a right guess commits it and the target's next token in one step.
    guess: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.flush_interval_s >= 0 and self.flush_interval_s < float("inf")):
            raise ValueError(f"flush_interval_s must be a non-negative number of seconds, got {self.flush_interval_s}")


class _Position:
    """Where a stream stands: its committed length and rolling hash, what the next step adds, steps taken."""

    def __init__(self, steps: DecodeSteps) -> None:
        self.steps = steps
        self.length, self.prefix_hash, self.fresh, self.taken = steps.base_length, steps.base_hash, steps.new_tokens, 0

    def advance(self, outcome: VerifyOutcome) -> tuple[int, int] | None:
        """Commit a step's outcome: the next step's (base_length, base_hash), or None after a stop token or the last
        token. Each step builds on the previous one's commit (a session evicted or changed meanwhile answers resync,
        as a Verify would)."""
        for committed in (*self.fresh, *outcome.committed):
            self.prefix_hash = extend_hash(self.prefix_hash, committed)
        self.length, self.fresh = outcome.committed_length, ()
        self.taken += len(outcome.committed)
        if outcome.verdict.next_token in self.steps.stop_token_ids or self.taken >= self.steps.max_tokens:
            return None
        return self.length, self.prefix_hash

    def may_guess(self) -> bool:
        """Whether the next step may guess: a right guess commits two tokens, so two must be left to take."""
        return self.steps.guess and self.steps.max_tokens - self.taken >= 2


_END = object()


class _Held:
    """Outcomes committed but not yet handed over. One is held only while the next step, expected to take as long as
    the last one did, would still end within the interval of the oldest held one's commit."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s, self.outcomes = interval_s, []
        self.since = self.last = 0.0  # the oldest held outcome's commit; the previous outcome's
        self.handed_any = False

    def add(self, outcome: VerifyOutcome, last: bool) -> list[VerifyOutcome] | None:
        """Hold `outcome`; the outcomes to hand over now, if it is time (None otherwise)."""
        now = time.monotonic()
        step_s, self.last = now - self.last, now
        if not self.outcomes:
            self.since = now
        self.outcomes.append(outcome)
        if last or not self.handed_any or now - self.since + step_s > self.interval_s:
            return self.take()
        return None

    def take(self) -> list[VerifyOutcome] | None:
        due, self.outcomes = self.outcomes, []
        self.handed_any = self.handed_any or bool(due)
        return due or None


def decode_stream(engine: VerifyEngine, steps: DecodeSteps, is_active: Callable[[], bool],
                  before_step: Callable[[], None]) -> Iterator[list[VerifyOutcome]]:
    """Up to steps.max_tokens Verify steps without drafts, their outcomes in order as they are committed: in lists
    of one, or with steps.flush_interval_s, of those held meanwhile. `before_step` runs before each step, as the
    servicer's checks run before each Verify (it raises to end the stream); the first on a producer thread, the later
    ones on the model thread, between two steps. The chain ends within a step once the caller has gone (is_active
    turns False) or before_step raises; outcomes held then are handed over first."""
    outcomes: queue.SimpleQueue = queue.SimpleQueue()
    position = _Position(steps)
    held = _Held(steps.flush_interval_s)

    def hand_over(due: list[VerifyOutcome] | None) -> None:
        if due:  # one put a message: the reading thread wakes once for all of them
            outcomes.put(due)

    def next_step(result: VerifyOutcome | BaseException) -> tuple[int, int] | None:  # on the model thread
        try:
            if isinstance(result, BaseException):
                raise result
            following = position.advance(result)
            last = following is None or not is_active()
            hand_over(held.add(result, last))
            if last:
                outcomes.put(_END)
                return None
            before_step()
            return following
        except BaseException as e:  # handed to the caller, who answers with its status
            hand_over(held.take())
            outcomes.put(e)
            return None

    def produce() -> None:
        try:
            before_step()
            engine.verify_chain(steps.session_id, steps.base_length, steps.base_hash, list(steps.new_tokens),
                                steps.params, steps.seed, is_active, next_step, position.may_guess,
                                steps.stop_token_ids)
        except BaseException as e:  # handed to the caller, who answers with its status
            outcomes.put(e)

    threading.Thread(target=produce, name="decode-stream", daemon=True).start()
    while (item := outcomes.get()) is not _END:
        if isinstance(item, BaseException):
            raise item
        yield item
