"""What the drafter's and the verifier's engines share (drafter/engine.py's DraftEngine, verifier/engine.py's
VerifyEngine), both WorkerEngines (role.py) that run a model engine.

Sessions on that model, a queue of callers' requests batched across sessions (no batching thread: one caller at a time
runs batches for everyone queued while the others wait, batch_window.py), and what a warm-up leaves running in the
background: the cost probe (cost_probe.py), which measures on a session of its own, and the idle upkeep
(idle_upkeep.py). A role says what its request is, what one batch does, and what its costs are.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from specmesh.runtime.engine import ModelEngine, as_engine
from specmesh.wire.history import EMPTY_HASH, TokenHistory
from specmesh.worker.batch_window import BatchTurns, wait_for_active_sessions
from specmesh.worker.config import BatchingConfig
from specmesh.worker.cost_probe import (BackgroundCostProbe, RequestActivity, costs_now_or_in_background,
                                        probe_context, timed)
from specmesh.worker.idle_upkeep import IdleUpkeep, spare_context_upkeep
from specmesh.worker.role import ModelDescription
from specmesh.worker.session_store import Session, SessionLimits, SessionStore, kv_sessions, request_session

if TYPE_CHECKING:
    import torch

R = TypeVar("R", bound="QueuedRequest")


@dataclass
class QueuedRequest:
    """What every role's call carries: its session, and the client's view of that session's history, which
    `request_session` brings the session up to. A role's request adds its own fields after these."""

    session_id: str
    base_length: int
    base_hash: int
    new_tokens: list[int]
    # A cost probe's session, kept outside the store: the probe adds no session to Info's count, evicts none and is
    # no traffic (neither in the metrics nor a session the batch window waits for). A probe runs alone.
    probe_session: Session | None = field(default=None, repr=False, kw_only=True)
    done: bool = field(default=False, kw_only=True)
    error: BaseException | None = field(default=None, kw_only=True)
    session: Session | None = field(default=None, repr=False, kw_only=True)  # set while its batch runs


class BatchingWorkerEngine:
    """A role's engine over a model engine, batching its sessions' calls. Subclasses set `role` and implement
    `_publish_costs`; their warm_up ends with `_start_background_work`."""

    role: str  # "drafter" or "verifier": in its logs, and the key of its cached costs

    def __init__(self, loaded: ModelEngine, limits: SessionLimits, batching: BatchingConfig) -> None:
        self.loaded = loaded = as_engine(loaded)  # the model engine: transformers, llama.cpp or ik_llama.cpp
        self.description = ModelDescription.of(loaded)
        self.sessions = SessionStore(limits, kv_sessions(loaded))
        self.max_batch_size = min(batching.max_batch_size, loaded.max_batch_size)
        self.max_batch_wait_s = batching.max_batch_wait_s
        self._model_lock = threading.Lock()  # one forward pass at a time: CPU threads are already all in use
        self._turns = BatchTurns()  # one caller runs batches for everyone queued; the others wait for their answers
        self._queue_lock = threading.Lock()
        self._arrived = threading.Condition(self._queue_lock)  # notified when a request is queued
        self._queue: deque = deque()
        self._answered_at: dict[str, float] = {}  # session -> when it last got an answer (monotonic)
        # How long the last batch took (each role says what a batch is): sessions answered within a few of those are
        # the active ones a new batch waits for (batch_window.py).
        self._last_batch_s = 0.0
        self._activity = RequestActivity()  # when the background cost probe may run
        self._cost_probe: BackgroundCostProbe | None = None
        self._upkeep: IdleUpkeep | None = None  # what the engine prepares while idle (a spare ik context)
        self._probe_session: Session | None = None  # the cost probe's, while it measures

    def _holding_the_model(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the model's thread, holding the model: all torch work there, none on the caller's thread."""
        with self._model_lock:
            return self.loaded.run_on_model_thread(fn, *args)

    # ------------------------------------------------------------------ the queue

    def _queue_request(self, request: QueuedRequest) -> None:
        with self._arrived:
            self._queue.append(request)
            self._arrived.notify_all()

    def _take_queued(self, sessions: set[str], room: int) -> list:
        """Called holding the queue lock: up to `room` queued requests, oldest first, at most one per session and none
        of `sessions` (which the taken ones join). A session's calls run in order: a retry can arrive while its first
        attempt is still queued or running."""
        taken, later = [], deque()
        while self._queue and len(taken) < room:
            request = self._queue.popleft()
            (later if request.session_id in sessions else taken).append(request)
            sessions.add(request.session_id)
        self._queue.extendleft(reversed(later))
        return taken

    def _wait_for_active_sessions(self) -> None:
        """Called holding the queue lock, before a new batch (specmesh/worker/batch_window.py)."""
        wait_for_active_sessions(self._arrived, lambda: (r.session_id for r in self._queue), self._answered_at,
                                 self.max_batch_size, self.max_batch_wait_s, self._last_batch_s)

    def _answered(self, session_id: str, at: float) -> None:
        """A session's call was answered `at` (monotonic): it may well come back soon (batch_window.py)."""
        with self._queue_lock:
            self._answered_at[session_id] = at

    # ------------------------------------------------------------------ a batch

    def _sync_session(self, request: QueuedRequest) -> bool:
        """Bring the request's session up to the client's history; a request that cannot be synced fails alone."""
        try:
            request.session = request_session(self.sessions, request)
        except Exception as e:  # ResyncRequired, ValueError: answered to this caller only
            request.error = e
            return False
        return True

    def _batched_logits(self, group: list[QueuedRequest], requests: list[list[int]], last_ns: list[int],
                        batch_sizes) -> list[torch.Tensor] | None:
        """One forward pass over the group's sessions (`ModelEngine.batched_logits`), its size observed in the
        `batch_sizes` histogram unless only probes ran; None when it failed, and then every request of the group
        fails and its session ends."""
        try:
            all_logits = self.loaded.batched_logits([r.session.sequence for r in group], requests, last_ns)
        except Exception as e:
            for request in group:
                # The caches may hold a partial update: drop them, the clients' next calls resync.
                self.sessions.end(request.session_id)
                request.error = e
            return None
        traffic = [r for r in group if r.probe_session is None]
        if traffic:
            batch_sizes.observe(len(traffic))
        return all_logits

    # ------------------------------------------------------------------ sessions and background work

    def end_session(self, session_id: str) -> bool:
        """Forget a session: its KV cache, and that it may come back soon (no batch waits for it). Counted as a
        request: the idle upkeep looks again once it is over (a context the session held may now leave room for a
        spare, which the upkeep declined to make while the session held it)."""
        with self._activity.request():
            with self._queue_lock:
                self._answered_at.pop(session_id, None)
            return self.sessions.end(session_id)

    def _start_background_work(self, probes: Mapping[Hashable, Callable[[], float | None]],
                               to_costs: Callable[[dict], Any]) -> None:
        """The end of a warm-up: report the costs cached for this model and machine, or start measuring them with
        `probes` in the background (the coordinator's prior for its draft length policy; see
        specmesh/worker/cost_probe.py); then make a spare context and keep one while idle, where the engine has them."""
        self._cost_probe = costs_now_or_in_background(self.role, self.loaded, self._activity, probes,
                                                      to_costs=to_costs, publish=self._publish_costs,
                                                      finish=self._drop_probe_session)
        self._upkeep = spare_context_upkeep(self.role, self.loaded, self._activity, self._model_lock)

    def stop_background_work(self) -> None:
        """Stop measuring the costs, if it still is, and the idle upkeep (within one call each): for the server's
        stop."""
        if self._cost_probe is not None:
            self._cost_probe.stop()
        if self._upkeep is not None:
            self._upkeep.stop()

    def _publish_costs(self, costs: Any) -> None:
        """Costs as measured or cached (JSON): Info reports them from now on."""
        raise NotImplementedError

    def _time_probe(self, run: Callable[[R], None], request: Callable[[int, int, list[int], bool], R]) -> float | None:
        """One call of the cost probe (cost_probe.py's BackgroundCostProbe), on the model thread holding the model:
        the seconds `run` takes on `request(base_length, base_hash, new_tokens, prefill=False)`, from the probe context
        on a session of the probe's own; None when it made that session and prefilled the context instead
        (`prefill=True`, the first call). Every call starts from the same context, so the probe stays within any
        context limit."""
        context = probe_context(self.loaded.vocab_size)
        if self._probe_session is None:  # new_sequence on the model thread, as a request's session is made
            self._probe_session = kv_sessions(self.loaded)()
            run(request(0, EMPTY_HASH, context, True))
            return None
        return timed(run, request(len(context), TokenHistory(context).hash_at(len(context)), [], False))

    def _drop_probe_session(self) -> None:
        """The cost probe is over: its session's KV cache goes (the engine frees a dropped sequence). Counted as a
        request, as end_session is: the idle upkeep declines a spare context while the probe's session holds one, and
        without a request it would not look again (a first session that ended while the probe still measured left the
        worker with no spare until the next request, which then waited for a new context)."""
        with self._activity.request():
            self._probe_session = None
