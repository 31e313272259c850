"""How long a new cross-session batch waits for more sessions: shared by the verifier's passes and the drafter's
draft steps, which batch the same way (no batching thread; a lone call never waits)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable


def wait_for_active_sessions(arrived: threading.Condition, queued_sessions: Callable[[], Iterable[str]],
                             answered_at: dict[str, float], max_batch_size: int, max_batch_wait_s: float,
                             last_batch_s: float) -> None:
    """Called holding `arrived`'s lock, before a new batch: give sessions answered within the last few batches up
    to `max_batch_wait_s` to queue their next call, so that they start together instead of one batch apart.
    `answered_at` (session id -> when its last call was answered) is pruned of sessions gone quiet."""
    if max_batch_size == 1 or max_batch_wait_s == 0:
        return
    now = time.monotonic()
    horizon = max(1.0, 3 * last_batch_s)
    for session_id in [s for s, t in answered_at.items() if now - t > horizon]:
        del answered_at[session_id]
    deadline = now + max_batch_wait_s
    while True:
        queued = set(queued_sessions())
        expected = min(max_batch_size, len(queued | answered_at.keys()))
        remaining = deadline - time.monotonic()
        if len(queued) >= expected or remaining <= 0:
            return
        arrived.wait(remaining)


class BatchTurns:
    """Callers take turns running batches for everyone queued: one runs while the others wait, each until its own
    request is answered (by whichever batch) or the model is free for it to run the next batch itself.

    A caller answered by another's batch must not need the model to find out: blocked on the model's lock, it would
    wait out the next batch (one the running caller starts at once, waiting in the batch window for exactly these
    callers) before it could even return its answer. Measured on three concurrent 24-token Decode streams (1.5B
    target, float32): 72 steps took 35 passes that way on an idle machine and 53 on a loaded one, against 25 (the
    fewest: a first call runs alone) once waiting callers no longer needed the model."""

    def __init__(self) -> None:
        self._changed = threading.Condition()  # notified when requests are answered or a batch ends
        self._running = False  # a caller is running a batch (guarded by _changed)

    def run_until_answered(self, answered: Callable[[], bool], run_batch: Callable[[], None]) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: answered() or not self._running)
                if answered():
                    return
                self._running = True
            try:
                run_batch()
            finally:
                with self._changed:
                    self._running = False
                    self._changed.notify_all()

    def answered_some(self) -> None:
        """Wake the callers whose requests a batch still running has answered."""
        with self._changed:
            self._changed.notify_all()
