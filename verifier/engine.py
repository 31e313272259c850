"""Verification of draft tokens in ONE target forward pass on a session's KV cache, free of gRPC.

Concurrent Verify calls of different sessions are batched into one forward pass (specmesh/runtime/batched_forward.py). There
is no batching thread: each call queues its request, and whichever caller gets the model next runs everything queued
so far (continuous batching). A lone session never waits. With several sessions active, a pass waits up to
`max_batch_wait_s` for the active sessions that are not queued yet: without that, sessions whose calls come back
right after their answers ping-pong (A runs while B queues, then B while A queues) and never share a pass.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specmesh.decoding.acceptance import Verdict, decide
from specmesh.decoding.sampling import SamplingParams, SparseDist
from specmesh.ops import metrics
from specmesh.runtime.batched_forward import MAX_BATCHED_FRESH_TOKENS, fresh_length
from specmesh.runtime.engine import ModelEngine, as_engine
from specmesh.wire.contract import Cancelled
from specmesh.wire.history import EMPTY_HASH, TokenHistory
from specmesh.worker.batch_window import BatchTurns, wait_for_active_sessions
from specmesh.worker.cost_probe import (PROBE_DRAFTS, PROBE_VERIFY_DRAFTS, BackgroundCostProbe, RequestActivity,
                                        costs_now_or_in_background, probe_context, timed)
from specmesh.worker.idle_upkeep import IdleUpkeep, spare_context_upkeep
from specmesh.worker.role import ModelDescription
from specmesh.worker.session_store import Session, SessionLimits, SessionStore, kv_sessions, request_session
from verifier.config import BatchingConfig


@dataclass(frozen=True)
class VerifyOutcome:
    verdict: Verdict
    committed_length: int


@dataclass
class _Request:
    session_id: str
    base_length: int
    base_hash: int
    new_tokens: list[int]
    drafts: list[int]
    dists: list[SparseDist]
    params: SamplingParams
    seed: int
    is_active: Callable[[], bool] | None = None  # False once the caller has gone (cancelled, deadline passed)
    # A cost probe's session, kept outside the store: the probe adds no session to Info's count, evicts none and is
    # no traffic (neither in the metrics nor a session the batch window waits for).
    probe_session: Session | None = field(default=None, repr=False)
    done: bool = False
    outcome: VerifyOutcome | None = None
    error: BaseException | None = None
    # A Decode stream's step (verify_chain): called on the model thread once this step is answered or has failed,
    # it gives the stream's next step, queued at once, or None when the stream is over.
    then: Callable[[_Request], _Request | None] | None = field(default=None, repr=False)
    # Filled while its batch runs.
    session: Session | None = field(default=None, repr=False)
    start: int = 0


class VerifyEngine:
    """The verifier's engine (a WorkerEngine, specmesh/worker/role.py): Verify calls, batched across sessions."""

    def __init__(self, loaded: ModelEngine, limits: SessionLimits = SessionLimits(),
                 batching: BatchingConfig = BatchingConfig()) -> None:
        self.max_batch_wait_s = batching.max_batch_wait_s
        self.loaded = loaded = as_engine(loaded)  # the model engine: transformers or llama.cpp
        self.description = ModelDescription.of(loaded)
        self.sessions = SessionStore(limits, kv_sessions(loaded))
        self.max_batch_size = min(batching.max_batch_size, loaded.max_batch_size)
        self._model_lock = threading.Lock()  # one forward pass at a time
        self._turns = BatchTurns()  # one caller runs a batch for everyone queued; the others wait for their answers
        self._queue_lock = threading.Lock()
        self._arrived = threading.Condition(self._queue_lock)  # notified when a request is queued
        self._queue: deque[_Request] = deque()
        self._answered_at: dict[str, float] = {}  # session -> when it last got an answer (monotonic)
        self._last_pass_s = 0.0
        # (drafts, seconds): cached, or measured in the background after warm-up; () until then. Replaced whole, never
        # changed in place: whoever reads it sees no curve or all of it.
        self.verify_costs: tuple[tuple[int, float], ...] = ()
        self._activity = RequestActivity()  # when the background cost probe may run
        self._cost_probe: BackgroundCostProbe | None = None
        self._upkeep: IdleUpkeep | None = None  # what the engine prepares while idle (a spare ik context)
        self._probe_session: Session | None = None  # the cost probe's, while it measures

    def verify(self, session_id: str, base_length: int, base_hash: int, new_tokens: list[int],
               drafts: list[int], dists: list[SparseDist], params: SamplingParams, seed: int,
               is_active: Callable[[], bool] | None = None) -> VerifyOutcome:
        """`is_active`: checked when the request's turn comes; a caller that has gone by then costs no forward pass."""
        request = _Request(session_id, base_length, base_hash, list(new_tokens), list(drafts), list(dists), params,
                           seed, is_active)
        self._queue_and_wait(request, lambda: request.done)
        if request.error is not None:
            raise request.error
        assert request.outcome is not None
        return request.outcome

    def verify_chain(self, session_id: str, base_length: int, base_hash: int, new_tokens: list[int],
                     params: SamplingParams, seed: int, is_active: Callable[[], bool],
                     next_step: Callable[[VerifyOutcome | BaseException], tuple[int, int] | None]) -> None:
        """Verify steps without drafts, one after the other (a Decode stream, verifier/decode_stream.py): each is an
        ordinary Verify call of the session, batched with other sessions' calls. `next_step` is called on the model
        thread with each step's outcome (or its error) and gives the next step's (base_length, base_hash), or None to
        stop; it must not raise. The next step is queued before the model thread takes its next batch, so a stream
        costs no thread hand-off between its steps (on ik, 2 cores, where ggml's worker still spins after a pass, the
        gap between two decodes went from 0.83-1.25 ms to 0.40-0.45 ms). Returns when the chain is over."""
        over = threading.Event()

        def step(base_length: int, base_hash: int, fresh: list[int]) -> _Request:
            return _Request(session_id, base_length, base_hash, fresh, [], [], params, seed, is_active, then=answered)

        def answered(request: _Request) -> _Request | None:
            following = next_step(request.error if request.error is not None else request.outcome)
            if following is None:
                over.set()
                return None
            return step(*following, [])

        self._queue_and_wait(step(base_length, base_hash, list(new_tokens)), over.is_set)

    def _queue_and_wait(self, request: _Request, answered: Callable[[], bool]) -> None:
        """Queue `request`, then run batches in turn with the other callers until `answered()`."""
        with self._activity.request():
            with self._arrived:
                self._queue.append(request)
                self._arrived.notify_all()
            self._turns.run_until_answered(answered, self._run_queued)

    def _run_queued(self) -> None:
        with self._model_lock:
            # Syncing, the forward pass and acceptance all on the model's thread: no torch work on this one.
            self.loaded.run_on_model_thread(self._run_batches)

    def _run_batches(self) -> None:
        """Batches while a stream's next step is queued by the last one: it runs now, with whatever else is queued,
        without handing the model back to a caller's thread and back again."""
        while self._run_batch(self._take_batch()):
            self._turns.answered_some()

    def _take_batch(self) -> list[_Request]:
        """Up to max_batch_size queued requests, oldest first, at most one per session (a session's calls must run in
        order: a retry can arrive while its first attempt is still queued)."""
        with self._arrived:
            self._wait_for_active_sessions()
            batch, sessions, later = [], set(), deque()
            while self._queue and len(batch) < self.max_batch_size:
                request = self._queue.popleft()
                (later if request.session_id in sessions else batch).append(request)
                sessions.add(request.session_id)
            self._queue.extendleft(reversed(later))
            return batch

    def _wait_for_active_sessions(self) -> None:
        """Called holding the queue lock, before a new batch (specmesh/worker/batch_window.py)."""
        wait_for_active_sessions(self._arrived, lambda: (r.session_id for r in self._queue), self._answered_at,
                                 self.max_batch_size, self.max_batch_wait_s, self._last_pass_s)

    def _run_batch(self, batch: list[_Request]) -> bool:
        """Whether a stream's next step was queued (verify_chain)."""
        try:
            for request in batch:
                if request.is_active is not None and not request.is_active():
                    request.error = Cancelled("the call was cancelled or its deadline passed while queued")
            ready = [r for r in batch if r.error is None and self._sync(r)]
            # A long prompt (prefill) runs on its own: batched rows compute logits for every fresh column.
            prefills = [r for r in ready if self._fresh_length(r) > MAX_BATCHED_FRESH_TOKENS]
            decodes = [r for r in ready if r not in prefills]
            for group in [*([r] for r in prefills), *([decodes] if decodes else [])]:
                self._verify_together(group)
            self.sessions.enforce_memory()
        finally:
            chained = []
            for request in batch:
                if not request.done and request.error is None:
                    request.error = RuntimeError("verification did not complete")
                request.done = True
                request.session = None
                if request.then is not None and (following := request.then(request)) is not None:
                    chained.append(following)
            if chained:
                with self._arrived:
                    self._queue.extend(chained)
        return bool(chained)

    def _sync(self, request: _Request) -> bool:
        """Bring the request's session up to the client's history; a request that cannot be synced fails alone."""
        try:
            request.session = request_session(self.sessions, request)
        except Exception as e:  # ResyncRequired, ValueError: answered to this caller only
            request.error = e
            return False
        request.start = len(request.session.history)
        return True

    @staticmethod
    def _tokens(request: _Request) -> list[int]:
        return request.session.history.tokens + request.drafts

    def _fresh_length(self, request: _Request) -> int:
        return fresh_length(request.session.sequence, self._tokens(request), len(request.drafts) + 1)

    def _verify_together(self, group: list[_Request]) -> None:
        started = time.monotonic()
        try:
            # Row i of each logits tensor is the target's distribution for position start + i: k drafts + bonus.
            all_logits = self.loaded.batched_logits([r.session.sequence for r in group],
                                                    [self._tokens(r) for r in group],
                                                    [len(r.drafts) + 1 for r in group])
        except Exception as e:
            for request in group:
                # The caches may hold a partial update: drop them, the clients' next calls resync.
                self.sessions.end(request.session_id)
                request.error = e
            return
        self._last_pass_s = time.monotonic() - started
        traffic = [r for r in group if r.probe_session is None]
        if traffic:
            metrics.VERIFY_BATCH_SIZE.observe(len(traffic))
        for request, target_logits in zip(group, all_logits):
            try:
                verdict = decide(request.drafts, request.dists, target_logits, request.params, request.seed,
                                 request.start)
            except Exception as e:
                request.error = e
                continue
            session = request.session
            # Keep the KV of the accepted drafts only; the next token's KV is computed on the next call.
            session.sequence.rollback(request.start + verdict.accepted)
            session.history.extend([*request.drafts[:verdict.accepted], verdict.next_token])
            request.outcome = VerifyOutcome(verdict, len(session.history))
            request.done = True
            if request.probe_session is None:
                with self._queue_lock:
                    self._answered_at[request.session_id] = time.monotonic()

    def end_session(self, session_id: str) -> bool:
        """Forget a session: its KV cache, and that it may come back soon (no pass waits for it)."""
        with self._queue_lock:
            self._answered_at.pop(session_id, None)
        return self.sessions.end(session_id)

    def warm_up(self) -> None:
        """Run one single and, when batching is on, one batched verification so the first real calls are not slow;
        then report the costs cached for this model and machine, or start measuring them in the background (the
        coordinator's prior for its draft length policy; see specmesh/worker/cost_probe.py)."""
        self.stop_background_work()  # a warm-up again measures again: one probe at a time
        # On the probe's context: the cost probe's session then resumes from what the warm-up left cached, and never
        # takes the spare context the idle upkeep keeps for the first request (ik).
        context = probe_context(self.loaded.vocab_size)
        self.verify("warm-up", 0, EMPTY_HASH, context[:-2], context[-2:], [], SamplingParams(), 0)
        if self.max_batch_size > 1:
            pair = [_Request(f"warm-up-{i}", 0, EMPTY_HASH, [0, 1, 2 + i], [4], [], SamplingParams(), 0)
                    for i in range(2)]
            with self._model_lock:
                self.loaded.run_on_model_thread(self._run_batch, pair)
            for request in pair:
                if request.error is not None:
                    raise request.error
                self.end_session(request.session_id)
        self.end_session("warm-up")
        probes = {k: (lambda k=k: self._probe_verify(k)) for k in PROBE_VERIFY_DRAFTS}
        self._cost_probe = costs_now_or_in_background(
            "verifier", self.loaded, self._activity, probes, publish=self._publish_costs,
            to_costs=lambda seconds: [[k, s] for k, s in sorted(seconds.items())], finish=self._drop_probe_session)
        self._upkeep = spare_context_upkeep("verifier", self.loaded, self._activity, self._model_lock)

    def stop_background_work(self) -> None:
        """Stop measuring the costs, if it still is, and the idle upkeep (within one call each): for the server's
        stop."""
        if self._cost_probe is not None:
            self._cost_probe.stop()
        if self._upkeep is not None:
            self._upkeep.stop()

    def _publish_costs(self, costs) -> None:
        """Costs as cached (JSON: [[drafts, seconds], ...]): Info reports them from now on."""
        self.verify_costs = tuple((int(k), float(s)) for k, s in costs)

    @property
    def verify_base_s(self) -> float:
        """Seconds of a verify without drafts (0 until measured)."""
        return dict(self.verify_costs).get(0, 0.0)

    @property
    def verify_per_draft_s(self) -> float:
        """The line through 0 and PROBE_DRAFTS drafts, per draft: what verifiers reported before verify_costs
        (0 until measured)."""
        costs = dict(self.verify_costs)
        return max(costs[PROBE_DRAFTS] - costs[0], 0.0) / PROBE_DRAFTS if costs else 0.0

    def _probe_verify(self, drafts: int) -> float | None:
        """One call of the cost probe (specmesh/worker/cost_probe.py's BackgroundCostProbe): the seconds of a verify
        with `drafts` drafts on the probe context, holding the model like a request, in a pass of its own (never
        batched with requests); None when it prefilled that context instead (the first call). Every probe verifies
        from the same context (the session rolls back to it), so the probe stays within any context limit."""
        with self._model_lock:
            return self.loaded.run_on_model_thread(self._probe_verify_on_model_thread, drafts)

    def _probe_verify_on_model_thread(self, drafts: int) -> float | None:
        context = probe_context(self.loaded.vocab_size)
        if self._probe_session is None:  # new_sequence on the model thread, as a request's session is made
            self._probe_session = kv_sessions(self.loaded)()
            self._run_probe(_Request("cost-probe", 0, EMPTY_HASH, context, [], [], SamplingParams(), 0,
                                     probe_session=self._probe_session))
            return None
        context_hash = TokenHistory(context).hash_at(len(context))
        return timed(self._run_probe, _Request("cost-probe", len(context), context_hash, [], [1] * drafts, [],
                                               SamplingParams(), 0, probe_session=self._probe_session))

    def _run_probe(self, request: _Request) -> None:
        self._run_batch([request])
        if request.error is not None:
            raise request.error

    def _drop_probe_session(self) -> None:
        self._probe_session = None  # its KV cache goes with it (the engine frees a dropped sequence)
