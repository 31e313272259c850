"""Waiting for a condition by polling: the one wait-until loop behind every "wait until SERVING"."""

from __future__ import annotations

from collections.abc import Callable

import tenacity


def wait_until(condition: Callable[[], object], timeout_s: float, interval_s: float = 0.05,
               on_wait: Callable[[], None] | None = None) -> bool:
    """Call `condition` every `interval_s` until it returns something true (True) or `timeout_s` passes (False).

    `on_wait` runs between tries (progress output, or a check that raises to give up early, such as a worker process
    that exited); exceptions from either callable propagate."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_result(lambda done: not done),
        stop=tenacity.stop_after_delay(timeout_s),
        wait=tenacity.wait_fixed(interval_s),
        before_sleep=(lambda _state: on_wait()) if on_wait is not None else None,
        retry_error_callback=lambda _state: False)
    return bool(retrying(condition))
