"""Draft generation with a draft model on a session's KV cache, free of gRPC.

Concurrent Propose calls of different sessions draft together: each draft step is ONE forward pass over every session
drafting at that moment (specmesh/runtime/batched_forward.py on the transformers engine, one `llama_decode` with a
sequence id per row on llama.cpp, a pass per session on ik_llama.cpp; the same engine call the verifier batches with).
Scheduling is per step, as in Orca's iteration-level batching: a call that arrives while others draft joins them at
the next step, and a row that has its k tokens (or fails, or whose caller has gone) leaves and is answered at once,
while the others go on to their own k. As in the verifier there is no batching thread: each caller queues its request;
one caller at a time runs steps for everyone until its own request is answered, and then hands over to a caller still
waiting (specmesh/worker/batching_engine.py). Callers whose rows are done are woken at once, so that their next calls
can join the rows still drafting. A lone call never waits; a new batch (nothing drafting) waits up to
`max_batch_wait_s` for sessions answered recently, which are usually at the verifier and about to come back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from drafter.config import BatchingConfig
from drafter.proposer import Proposal
from specmesh.decoding.sampling import SamplingParams, SparseDist, draft_sample
from specmesh.ops import metrics
from specmesh.runtime.batched_forward import MAX_BATCHED_FRESH_TOKENS, fresh_length
from specmesh.runtime.engine import ModelEngine
from specmesh.wire.contract import Cancelled
from specmesh.wire.history import EMPTY_HASH
from specmesh.worker.batching_engine import BatchingWorkerEngine, QueuedRequest
from specmesh.worker.cost_probe import PROBE_DRAFTS, probe_context
from specmesh.worker.session_store import SessionLimits


@dataclass
class _Request(QueuedRequest):
    """One Propose call, and while it drafts, its row in the batch. A cost probe's (`probe_session`) never joins the
    drafting rows: it drafts alone, holding the model."""

    k: int
    params: SamplingParams
    seed: int
    is_active: Callable[[], bool] = lambda: True  # False once the caller has gone (cancelled, deadline passed)
    proposal: Proposal | None = None
    # Filled when it joins the drafting rows.
    committed_length: int = 0
    sequence: list[int] = field(default_factory=list)  # the committed history, then the drafts so far
    tokens: list[int] = field(default_factory=list)
    dists: list[SparseDist] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.error is not None or len(self.tokens) >= self.k


class DraftEngine(BatchingWorkerEngine):
    """A Proposer (drafter/proposer.py) drafting k tokens autoregressively with the draft model.

    The drafts stay in the session's KV cache; the next call's context sync says which of them were accepted, and the
    cache rolls back to the longest prefix shared with the new committed history (explicit rollback of the rest).
    """

    role = "drafter"

    def __init__(self, loaded: ModelEngine, limits: SessionLimits = SessionLimits(),
                 batching: BatchingConfig = BatchingConfig()) -> None:
        super().__init__(loaded, limits, batching)
        self._drafting: list[_Request] = []  # the batch's rows; only touched holding the model lock
        self._busy_since = 0.0  # when the current batch got its first row; it lasts until it has no rows
        self.draft_per_token_s = 0.0  # cached, or measured in the background after warm-up; 0 until then

    def propose(self, session_id: str, base_length: int, base_hash: int, new_tokens: list[int], k: int,
                params: SamplingParams, seed: int, is_active: Callable[[], bool] = lambda: True) -> Proposal:
        request = _Request(session_id, base_length, base_hash, list(new_tokens), k, params, seed, is_active)
        with self._activity.request():
            self._queue_request(request)
            return self._answer(request)

    def _answer(self, request: _Request) -> Proposal:
        self._turns.run_until_answered(lambda: request.done, lambda: self._step_on_model_thread(request))
        if request.error is not None:
            raise request.error
        assert request.proposal is not None
        return request.proposal

    def _step_on_model_thread(self, request: _Request) -> None:
        # Every step's torch work (forward pass and sampling) on the model's thread, none on this one.
        self._holding_the_model(self._step_until_done, request)

    # ------------------------------------------------------------------ one step for every drafting row

    def _step_until_done(self, request: _Request) -> None:
        while not request.done:
            self._step()

    def _step(self) -> None:
        """Called holding the model lock: admit queued calls, then draft one token for every row (a long prompt's
        prefill on its own: batched rows compute logits for every fresh column), then answer the rows that are done."""
        try:
            self._admit()
            for request in self._drafting:
                if not request.finished and not request.is_active():  # free the model for calls that still matter
                    request.error = Cancelled("the call was cancelled or its deadline passed while drafting")
            rows = [r for r in self._drafting if not r.finished]
            prefills = [r for r in rows if fresh_length(r.session.sequence, r.sequence, 1) > MAX_BATCHED_FRESH_TOKENS]
            decodes = [r for r in rows if r not in prefills]
            for group in [*([r] for r in prefills), *([decodes] if decodes else [])]:
                self._draft_together(group)
        except Exception as e:  # a bug, not a request's fault: no row may wait for a step that will never come
            for request in self._drafting:
                if not request.finished:
                    request.error = e
        finally:
            self._answer_finished()

    def _admit(self) -> None:
        """Queued calls join the rows, oldest first, up to max_batch_size rows and one per session."""
        with self._arrived:
            if not self._drafting:
                self._wait_for_active_sessions()
            joining = self._take_queued({r.session_id for r in self._drafting},
                                        self.max_batch_size - len(self._drafting))
        if joining and not self._drafting:
            self._busy_since = time.monotonic()
        self._drafting.extend(joining)  # first: whatever happens next, a row is answered (see _step)
        for request in joining:
            if not request.is_active():
                request.error = Cancelled("the call was cancelled or its deadline passed while queued")
            else:
                self._sync(request)

    def _sync(self, request: _Request) -> None:
        if self._sync_session(request):
            request.sequence = list(request.session.history.tokens)
            request.committed_length = len(request.sequence)

    def _draft_together(self, group: list[_Request]) -> None:
        """One forward pass: the next token's logits for each row's sequence, then one draft token per row."""
        all_logits = self._batched_logits(group, [r.sequence for r in group], [1] * len(group),
                                          metrics.DRAFT_BATCH_SIZE)
        if all_logits is None:
            return
        for request, logits in zip(group, all_logits):
            try:
                draft = draft_sample(logits[0], request.params, request.seed, position=len(request.sequence))
            except Exception as e:
                request.error = e
                continue
            request.tokens.append(draft.token)
            if draft.dist is not None:
                request.dists.append(draft.dist)
            request.sequence.append(draft.token)

    def _answer_finished(self) -> None:
        finished = [r for r in self._drafting if r.finished]
        if not finished:
            return
        self._drafting = [r for r in self._drafting if not r.finished]
        now = time.monotonic()
        for request in finished:
            if request.error is None:
                request.proposal = Proposal(tuple(request.tokens), tuple(request.dists), request.committed_length)
                self._answered(request.session_id, now)
            request.session = None
            request.done = True  # last: the caller may read the answer as soon as this is set
        self._turns.answered_some()
        self.sessions.enforce_memory()
        if not self._drafting:
            self._last_batch_s = now - self._busy_since  # a batch: from its first row to no rows

    # ------------------------------------------------------------------ warm-up and cost probe

    def warm_up(self) -> None:
        """One batched (when batching is on) and one single proposal so the first real calls are not slow; then report
        the seconds per draft token cached for this model and machine, or start measuring them in the background (the
        coordinator's prior for its draft length policy; see specmesh/worker/cost_probe.py)."""
        self.stop_background_work()  # a warm-up again measures again: one probe at a time
        if self.max_batch_size > 1:
            pair = [_Request(f"warm-up-{i}", 0, EMPTY_HASH, [0, 1, 2 + i], 2, SamplingParams(), 0) for i in range(2)]
            for request in pair:
                self._queue_request(request)
            for request in pair:
                self._answer(request)
                self.end_session(request.session_id)
        self.propose("warm-up", 0, EMPTY_HASH, probe_context(self.loaded.vocab_size), 1, SamplingParams(), 0)
        self.end_session("warm-up")
        self._start_background_work({"propose": self._probe_propose},
                                    to_costs=lambda seconds: seconds["propose"] / PROBE_DRAFTS)

    def _publish_costs(self, seconds_per_token) -> None:
        self.draft_per_token_s = float(seconds_per_token)  # Info reports it from now on

    def _probe_propose(self) -> float | None:
        """One call of the cost probe: the seconds of a proposal of PROBE_DRAFTS tokens on the probe context, holding
        the model like a stepping caller and drafting alone. The drafts are never accepted: each proposal drafts from
        the same context."""
        return self._holding_the_model(self._probe_propose_on_model_thread)

    def _probe_propose_on_model_thread(self) -> float | None:
        def request(base_length: int, base_hash: int, new_tokens: list[int], prefill: bool) -> _Request:
            return _Request("cost-probe", base_length, base_hash, new_tokens, 1 if prefill else PROBE_DRAFTS,
                            SamplingParams(), 0, probe_session=self._probe_session)

        return self._time_probe(self._draft_alone, request)

    def _draft_alone(self, request: _Request) -> None:
        """Draft a probe's k tokens, one step at a time with no other row (called holding the model lock)."""
        self._sync(request)
        while not request.finished:
            self._draft_together([request])
        if request.error is not None:
            raise request.error
