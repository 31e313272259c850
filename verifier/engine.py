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
from collections.abc import Callable
from dataclasses import dataclass, field

from specmesh.decoding.acceptance import Verdict, decide
from specmesh.decoding.prompt_lookup import NgramConfig, NgramIndex
from specmesh.decoding.sampling import SamplingParams, SparseDist
from specmesh.ops import metrics
from specmesh.runtime.batched_forward import MAX_BATCHED_FRESH_TOKENS, fresh_length
from specmesh.runtime.engine import ModelEngine
from specmesh.wire.contract import Cancelled
from specmesh.wire.history import EMPTY_HASH
from specmesh.worker.batching_engine import BatchingWorkerEngine, QueuedRequest
from specmesh.worker.cost_probe import PROBE_DRAFTS, PROBE_VERIFY_DRAFTS, probe_context
from specmesh.worker.session_store import Session, SessionLimits
from verifier.config import BatchingConfig


@dataclass(frozen=True)
class VerifyOutcome:
    verdict: Verdict
    committed_length: int
    # A Decode stream's step with a guess (verify_chain): the guess, if the target accepted it (it was committed
    # before verdict.next_token); and how many guesses the step made (0 or 1).
    accepted_guesses: tuple[int, ...] = ()
    guesses: int = 0

    @property
    def committed(self) -> tuple[int, ...]:
        """The tokens a stream's step committed, in order."""
        return (*self.accepted_guesses, self.verdict.next_token)


# A stream's guess of the next token: what followed the latest earlier occurrence of the longest suffix of the history,
# up to 4 tokens, seen before (prompt lookup with no minimum match: a wrong guess costs nothing where guesses are free).
# Longer matches are rarer; past 4 tokens they rarely pick another continuation.
GUESS_LOOKUP = NgramConfig(min_ngram=1, max_ngram=4)


def next_token_guess(session: Session, excluded: frozenset[int]) -> list[int]:
    """[the guess] for `session`'s next token, or [] where its last token never occurred before or the guess is in
    `excluded` (stop tokens: a stream ends at one, so a guess there would commit past the end). The session keeps its
    lookup index: O(1) a step after the first (specmesh/decoding/prompt_lookup.py)."""
    if session.lookup is None:
        session.lookup = NgramIndex(GUESS_LOOKUP)
    session.lookup.update(session.history)
    guess = session.lookup.propose(session.history.tokens, 1)
    return [] if not guess or guess[0] in excluded else guess


@dataclass
class _Request(QueuedRequest):
    drafts: list[int]
    dists: list[SparseDist]
    params: SamplingParams
    seed: int
    is_active: Callable[[], bool] | None = None  # False once the caller has gone (cancelled, deadline passed)
    outcome: VerifyOutcome | None = None
    # A Decode stream's step (verify_chain): called on the model thread once this step is answered or has failed,
    # it gives the stream's next step, queued at once, or None when the stream is over.
    then: Callable[[_Request], _Request | None] | None = field(default=None, repr=False)
    start: int = 0  # the session's history length when its batch ran: where the drafts start
    # A stream's step that may guess the next token (verify_chain): the tokens it must not guess (stop tokens); None:
    # no guess.
    guess_excluding: frozenset[int] | None = None


class VerifyEngine(BatchingWorkerEngine):
    """The verifier's engine (a WorkerEngine, specmesh/worker/role.py): Verify calls, batched across sessions."""

    role = "verifier"

    def __init__(self, loaded: ModelEngine, limits: SessionLimits = SessionLimits(),
                 batching: BatchingConfig = BatchingConfig()) -> None:
        super().__init__(loaded, limits, batching)
        # (drafts, seconds): cached, or measured in the background after warm-up; () until then. Replaced whole, never
        # changed in place: whoever reads it sees no curve or all of it.
        self.verify_costs: tuple[tuple[int, float], ...] = ()

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
                     next_step: Callable[[VerifyOutcome | BaseException], tuple[int, int] | None],
                     may_guess: Callable[[], bool] = lambda: False, excluded: frozenset[int] = frozenset()) -> None:
        """Verify steps without drafts, one after the other (a Decode stream, verifier/decode_stream.py): each is an
        ordinary Verify call of the session, batched with other sessions' calls. `next_step` is called on the model
        thread with each step's outcome (or its error) and gives the next step's (base_length, base_hash), or None to
        stop; it must not raise. The next step is queued before the model thread takes its next batch, so a stream
        costs no thread hand-off between its steps (on ik, 2 cores, where ggml's worker still spins after a pass, the
        gap between two decodes went from 0.83-1.25 ms to 0.40-0.45 ms). Returns when the chain is over.

        Where `may_guess()` says so before a step, greedy, and the engine's one-token step runs a spare row anyway
        (`guesses_are_free`), the step verifies a guess of the next token from the session's history
        (next_token_guess; never one in `excluded`): accepted, the step commits two tokens for the
        price of one. Every token is still the target's own greedy choice."""
        over = threading.Event()

        def step(base_length: int, base_hash: int, fresh: list[int]) -> _Request:
            return _Request(session_id, base_length, base_hash, fresh, [], [], params, seed, is_active, then=answered,
                            guess_excluding=excluded if may_guess() else None)

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
            self._queue_request(request)
            self._turns.run_until_answered(answered, self._run_queued)

    def _run_queued(self) -> None:
        # Syncing, the forward pass and acceptance all on the model's thread: no torch work on this one.
        self._holding_the_model(self._run_batches)

    def _run_batches(self) -> None:
        """Batches while a stream's next step is queued by the last one: it runs now, with whatever else is queued,
        without handing the model back to a caller's thread and back again."""
        while self._run_batch(self._take_batch()):
            self._turns.answered_some()

    def _take_batch(self) -> list[_Request]:
        """Up to max_batch_size queued requests, oldest first, at most one per session."""
        with self._arrived:
            self._wait_for_active_sessions()
            return self._take_queued(set(), self.max_batch_size)

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
        if not self._sync_session(request):
            return False
        request.start = len(request.session.history)
        if request.guess_excluding is not None and request.params.is_greedy and self.guesses_are_free:
            request.drafts = next_token_guess(request.session, request.guess_excluding)
        return True

    @property
    def guesses_are_free(self) -> bool:
        """Whether a one-token step already runs two rows (ik_llama.cpp repacked and exact: a one-row pass takes
        another kernel, so the step recomputes the previous token's cell beside the new one): a guess of the next token
        can take the spare row at no cost. Elsewhere a second row costs a share of a step (the verify curve's v(1)
        over v(0)), so a stream does not guess."""
        return getattr(self.loaded, "min_pass_rows", 1) >= 2

    @staticmethod
    def _tokens(request: _Request) -> list[int]:
        return request.session.history.tokens + request.drafts

    def _fresh_length(self, request: _Request) -> int:
        return fresh_length(request.session.sequence, self._tokens(request), len(request.drafts) + 1)

    def _verify_together(self, group: list[_Request]) -> None:
        started = time.monotonic()
        # Row i of each logits tensor is the target's distribution for position start + i: k drafts + bonus.
        all_logits = self._batched_logits(group, [self._tokens(r) for r in group], [len(r.drafts) + 1 for r in group],
                                          metrics.VERIFY_BATCH_SIZE)
        if all_logits is None:
            return
        self._last_batch_s = time.monotonic() - started  # a batch: one forward pass
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
            guesses = len(request.drafts) if request.guess_excluding is not None else 0
            request.outcome = VerifyOutcome(verdict, len(session.history),
                                            tuple(request.drafts[:verdict.accepted]) if guesses else (), guesses)
            request.done = True
            if request.probe_session is None:
                self._answered(request.session_id, time.monotonic())

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
            self._holding_the_model(self._run_batch, pair)
            for request in pair:
                if request.error is not None:
                    raise request.error
                self.end_session(request.session_id)
        self.end_session("warm-up")
        self._start_background_work({k: (lambda k=k: self._probe_verify(k)) for k in PROBE_VERIFY_DRAFTS},
                                    to_costs=lambda seconds: [[k, s] for k, s in sorted(seconds.items())])

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
        """One call of the cost probe: the seconds of a verify with `drafts` drafts on the probe context, holding the
        model like a request, in a pass of its own (never batched with requests). Every probe verifies from the same
        context (the session rolls back to it)."""
        return self._holding_the_model(self._probe_verify_on_model_thread, drafts)

    def _probe_verify_on_model_thread(self, drafts: int) -> float | None:
        def request(base_length: int, base_hash: int, new_tokens: list[int], prefill: bool) -> _Request:
            return _Request("cost-probe", base_length, base_hash, new_tokens, [] if prefill else [1] * drafts, [],
                            SamplingParams(), 0, probe_session=self._probe_session)

        return self._time_probe(self._run_probe, request)

    def _run_probe(self, request: _Request) -> None:
        self._run_batch([request])
        if request.error is not None:
            raise request.error
