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
