"""Work a worker does for its next requests while it serves none: today, an ik engine's spare context (one made at
warm-up, the next ones while idle).

A task runs only once no request has been queued or running for QUIET_BEFORE_UPKEEP_S, holding the model as a request
does, so a request that arrives meanwhile waits for at most that one task. A task says whether it did anything; when
it did not, the next check comes after the next request (a request is what uses up what a task prepares), never on a
timer: an idle worker's threads stay asleep.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from specmesh.worker.cost_probe import RequestActivity, stop_at_exit

log = logging.getLogger(__name__)

QUIET_BEFORE_UPKEEP_S = 0.1  # as a cost probe call waits: the next step of a stream or a burst is not held up
STOP_WAIT_S = 10.0  # how long stopping waits for the task in flight


class IdleUpkeep:
    """Runs `task` on a daemon thread whenever `activity` has been quiet, until it reports nothing left to do; again
    after each later request. A task that raises is logged and never run again (the worker serves as without it)."""

    def __init__(self, role: str, activity: RequestActivity, task: Callable[[], bool],
                 after_a_request: bool = False) -> None:
        """`after_a_request`: the task has just been done (nothing to do until a request comes)."""
        self.role, self._activity, self._task = role, activity, task
        self._done_at = activity.arrivals if after_a_request else -1
        self._stopped = threading.Event()
        self.runs = 0  # tasks that did something
        self.thread = threading.Thread(target=self._run, name=f"{role}-idle-upkeep", daemon=True)

    def start(self) -> IdleUpkeep:
        stop_at_exit(self)
        self.thread.start()
        return self

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop: returns once the thread has ended (within one task), or after `wait_s`. Not from the model thread,
        whose turn a task in flight may be waiting for."""
        self._stopped.set()
        self._activity.wake()
        if wait_s > 0 and self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(wait_s)

    def _run(self) -> None:
        done_at = self._done_at  # the arrival count when the task last had nothing to do
        while not self._stopped.is_set():
            if done_at >= 0 and not self._activity.wait_for_arrival(done_at, self._stopped):
                return
            arrivals = self._activity.wait_until_quiet(QUIET_BEFORE_UPKEEP_S, self._stopped)
            if arrivals is None:
                return
            try:
                did = self._task()
            except Exception as e:  # noqa: BLE001 - whatever it was, requests are served as without it
                log.warning("%s: idle upkeep failed, not tried again: %s", self.role, e, exc_info=True)
                return
            if did:
                self.runs += 1
            else:
                done_at = arrivals


def spare_context_upkeep(role: str, loaded, activity: RequestActivity, model_lock: threading.Lock) -> IdleUpkeep | None:
    """For an engine with spare contexts to keep (ik: IkLlamaEngine.keep_spare_context): a spare made now, at the end
    of the warm-up, before the worker reports SERVING (the first request may come at once: `make run` sends it 80 ms
    after SERVING), and its upkeep, started. None for the others (one context made at load: llama.cpp; no contexts:
    transformers)."""
    keep = getattr(loaded, "keep_spare_context", None)
    if keep is None:
        return None

    def keep_spare() -> bool:
        with model_lock:
            return loaded.run_on_model_thread(keep)
    started = time.perf_counter()
    if keep_spare():
        log.info("%s: a spare context for the first request made in %.2f s", role, time.perf_counter() - started)
    return IdleUpkeep(role, activity, keep_spare, after_a_request=True).start()
