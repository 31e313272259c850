"""One generation's drafter and verifier sessions over worker pools: retries, failover, degradation.

The verifier session is pinned to one verifier for KV-cache locality. When that verifier dies, drains (health
NOT_SERVING) or trips its breaker, the session moves to another healthy verifier, which rebuilds its cache from the
full token history: no token is lost, and since random numbers come from (seed, position), a retried step decides
exactly as the failed one would have. The drafter session never fails a generation: when no drafter can answer, the
round degrades to k = 0 (target-only decoding, same output) until a drafter's breaker half-opens and a probe succeeds.
Both stop at once when the generation's CancelToken is cancelled (coordinator/cancel.py): the RPC in flight is
cancelled and GenerationCancelled ends the generation.

The drafter session is opened on the first round that drafts (LazyDraftSource): a generation that never drafts sends
the drafter nothing. A drafter that fell more than MAX_DRAFTER_BACKLOG tokens behind since its last call (rounds
without drafts in between: the cost policy's k = 0 before a probe, a drafter outage) does not catch up on all of them
inside the round: it skips them, and its context goes on from the last RESTART_CONTEXT tokens, a short prefill (the
draft model guesses from recent context). What it held stays (a drafter that holds nothing of the session, after an
outage, gets only those tokens). Output never depends on the drafter's context: the verifier checks every draft.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import tenacity

from coordinator.cancel import CancelToken
from coordinator.fleet.drafter_prefixes import DrafterPrefixes
from coordinator.fleet.pools import Endpoint, WorkerPool
from coordinator.loop import Draft, DraftSource
from coordinator.fleet.channel import SyncedHistory, is_resync
from coordinator.fleet.resilience import BREAKER_FAILURES, NoWorkerAvailable, ResilienceConfig, is_retryable
from coordinator.fleet.token_stream import TokenStream
from specmesh.decoding.acceptance import Verdict
from specmesh.decoding.sampling import SamplingParams
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.wire.convert import dists_from_wire, dists_to_wire, sampling_to_wire
from specmesh.wire.history import TokenHistory

log = logging.getLogger("specmesh.sessions")

# Tokens committed since the drafter's last call that it may catch up on inside a round; beyond that it skips to the
# last RESTART_CONTEXT tokens (a probe costs about a round, never a long prefill).
MAX_DRAFTER_BACKLOG = 64
RESTART_CONTEXT = 32


@dataclass
class FaultStats:
    retries: int = 0          # RPC attempts repeated after a retryable error
    failovers: int = 0        # times the verifier session moved to another verifier
    degraded_rounds: int = 0  # rounds decoded without drafts because no drafter answered
    resyncs: int = 0          # calls repeated with the full history because a server did not hold the session

    def as_dict(self) -> dict:
        return {"retries": self.retries, "failovers": self.failovers, "degraded_rounds": self.degraded_rounds,
                "resyncs": self.resyncs}


class PinnedSession:
    """A session's link to one endpoint of a pool, moved when that endpoint becomes unusable."""

    def __init__(self, pool: WorkerPool, prompt: Sequence[int], stats: FaultStats,
                 cancel: CancelToken | None = None) -> None:
        self.pool = pool
        self.cancel = cancel
        self.sync = SyncedHistory(prompt, stats)
        self.endpoint: Endpoint | None = None
        self.visited: set[str] = set()

    def attach(self, avoid: Endpoint | None = None) -> Endpoint:
        endpoint = self.pool.pick(avoid=avoid, tokens=self.sync.history.tokens)
        if endpoint is not self.endpoint:
            self.detach()
            endpoint.sessions += 1
            self.endpoint = endpoint
            self.visited.add(endpoint.address)
            self.sync.server_length = 0  # a different server: it gets the full history on the next call
        return endpoint

    def current(self) -> Endpoint:
        if self.endpoint is not None and self.endpoint.usable():
            return self.endpoint
        return self.attach(avoid=self.endpoint)

    def detach(self) -> None:
        if self.endpoint is not None:
            self.endpoint.sessions -= 1
            self.endpoint = None

    def end(self, session_id: str) -> None:
        if self.endpoint is not None and self.sync.server_length:  # what its prefix cache now holds (prefix affinity)
            self.endpoint.recent_histories.append(tuple(self.sync.history.tokens[:self.sync.server_length]))
        for endpoint in self.pool.endpoints:
            if endpoint.address in self.visited:
                endpoint.end_session(session_id)
        self.detach()

    def begin(self, endpoint: Endpoint) -> Endpoint:
        endpoint.breaker.begin_call()
        return endpoint

    def invoke(self, method, request, timeout: float):
        """One RPC, cancellable through the session's CancelToken when it has one."""
        if self.cancel is None:
            return method(request, timeout=timeout)
        return self.cancel.call(method, request, timeout)

    def record(self, endpoint: Endpoint, error: grpc.RpcError | None) -> None:
        if error is None:
            endpoint.breaker.record_success()
        elif error.code() in BREAKER_FAILURES:  # a bad request is the caller's fault, not the worker's
            endpoint.breaker.record_failure()


class FailoverTargetSession:
    def __init__(self, pool: WorkerPool, session_id: str, prompt: Sequence[int], params: SamplingParams,
                 seed: int, config: ResilienceConfig, stats: FaultStats, cancel: CancelToken | None = None) -> None:
        self.link = PinnedSession(pool, prompt, stats, cancel)
        self.session_id, self._params, self._seed, self._config, self.stats = session_id, params, seed, config, stats
        # Guesses its Decode streams verified, and how many the target accepted (decode's `guess`).
        self.stream_guesses = self.stream_guesses_accepted = 0

    def _next_endpoint(self, failed: list[Endpoint]) -> Endpoint:
        """The verifier for the next attempt: the pinned one, or after a failure another one when there is one."""
        if self.link.cancel is not None:
            self.link.cancel.check()
        previous = self.link.endpoint
        try:
            endpoint = self.link.begin(self.link.attach(avoid=failed[-1]) if failed else self.link.current())
        except NoWorkerAvailable:
            self.stats.retries += 1  # nothing to call right now: wait (backoff) for a verifier to come back
            raise
        if previous is not None and endpoint is not previous:
            self.stats.failovers += 1
            log.warning("session %s moves from verifier %s to %s", self.session_id[:8], previous.address,
                        endpoint.address)
        return endpoint

    def _failed(self, endpoint: Endpoint, error: grpc.RpcError, failed: list[Endpoint]) -> None:
        self.link.record(endpoint, error)
        if is_retryable(error):
            failed.append(endpoint)
            self.stats.retries += 1

    def _retrying(self) -> tenacity.Retrying:
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_retryable),
            stop=tenacity.stop_after_delay(self._config.retry_budget_s),
            # Doubling from backoff_initial_s, plus up to that much jitter so sessions do not retry in lockstep.
            wait=tenacity.wait_exponential_jitter(multiplier=self._config.backoff_initial_s,
                                                  max=self._config.backoff_max_s,
                                                  jitter=self._config.backoff_initial_s),
            # A cancel cuts the backoff short; the next attempt then raises GenerationCancelled.
            sleep=self.link.cancel.sleep if self.link.cancel is not None else tenacity.nap.sleep,
            reraise=True)

    def _commit(self, tokens: Sequence[int], server_length: int) -> None:
        """The verifier commits what it decides itself, so the next call sends nothing new."""
        history = self.link.sync.history
        history.extend(tokens)
        # A disagreement about the history: rebuild it from scratch on the next call.
        self.link.sync.server_length = len(history) if server_length == len(history) else 0

    def _verify_once(self, draft: Draft, failed: list[Endpoint]) -> pb.VerifyResponse:
        endpoint = self._next_endpoint(failed)

        def rpc(context: pb.ContextSync) -> pb.VerifyResponse:
            return self.link.invoke(endpoint.stub.Verify, pb.VerifyRequest(
                session_id=self.session_id, context=context, draft_tokens=list(draft.tokens),
                draft_distributions=dists_to_wire(draft.dists),
                sampling=sampling_to_wire(self._params), seed=self._seed),
                self._config.attempt_timeout(self._config.verify_timeout_s, len(context.new_tokens)))
        try:
            response = self.link.sync.call(rpc)
        except grpc.RpcError as e:
            self._failed(endpoint, e, failed)
            raise
        self.link.record(endpoint, None)
        return response

    def verify(self, draft: Draft) -> Verdict:
        response = self._retrying()(self._verify_once, draft, [])
        verdict = Verdict(accepted=response.accepted, next_token=response.next_token)
        self._commit([*draft.tokens[:verdict.accepted], verdict.next_token], response.committed_length)
        return verdict

    def _decode_by_rounds(self, max_tokens: int, stop_token_ids: frozenset[int]) -> Iterator[int]:
        for _ in range(max_tokens):
            token = self.verify(Draft()).next_token
            yield token
            if token in stop_token_ids:
                return

    def _open_decode(self, max_tokens: int, stop_token_ids: frozenset[int], flush_interval_s: float, guess: bool,
                     failed: list[Endpoint]) -> tuple[Endpoint, TokenStream, pb.DecodeResponse]:
        """A Decode stream on the next verifier, with its first token: a refused call (resync, a verifier that is
        gone) fails here, where it is retried."""
        endpoint = self._next_endpoint(failed)

        def rpc(context: pb.ContextSync) -> tuple[TokenStream, pb.DecodeResponse]:
            if self.link.cancel is not None:
                self.link.cancel.check()
            call = endpoint.stub.Decode(pb.DecodeRequest(
                session_id=self.session_id, context=context, max_tokens=max_tokens,
                stop_token_ids=sorted(stop_token_ids), sampling=sampling_to_wire(self._params), seed=self._seed,
                flush_interval_ms=round(flush_interval_s * 1000), guess=guess))
            stream = TokenStream(call, self._config.attempt_timeout(self._config.verify_timeout_s,
                                                                    len(context.new_tokens)),
                                 self._config.verify_timeout_s, self.link.cancel)
            first = stream.next()
            if first is None:
                raise RuntimeError(f"verifier {endpoint.address} ended a Decode stream without a token")
            return stream, first
        try:
            stream, first = self.link.sync.call(rpc)
        except grpc.RpcError as e:
            self._failed(endpoint, e, failed)
            raise
        return endpoint, stream, first

    def decode(self, max_tokens: int, stop_token_ids: frozenset[int] = frozenset(),
               flush_interval_s: float = 0.0, guess: bool = False) -> Iterator[list[int]]:
        """Target-only decoding streamed by the verifier (Decode): the tokens of each message as the verifier sends
        them, up to max_tokens or a stop token; one a message, or with flush_interval_s > 0 those the verifier held
        that long (DecodeRequest.flush_interval_ms). Exactly the tokens of max_tokens verify() calls without drafts;
        with `guess`, the verifier checks a guess of the next token in each step where it costs nothing
        (DecodeRequest.guess; counted in stream_guesses and stream_guesses_accepted).
        A stream that breaks is re-opened from the tokens received so far, under verify()'s retry policy: on another
        verifier when its own became unusable. Closing the generator (a stop string) ends the stream."""
        taken, failed = 0, []
        while taken < max_tokens:
            try:
                endpoint, stream, response = self._retrying()(self._open_decode, max_tokens - taken,
                                                              stop_token_ids, flush_interval_s, guess, failed)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("verifier without Decode (an older version): target-only decoding goes round by round")
                yield from ([token] for token in self._decode_by_rounds(max_tokens - taken, stop_token_ids))
                return
            failed = []
            try:
                while response is not None:
                    tokens = [response.token, *response.more_tokens]
                    if taken + len(tokens) > max_tokens or any(t in stop_token_ids for t in tokens[:-1]):
                        raise RuntimeError(f"verifier {endpoint.address} sent tokens past the end of its Decode "
                                           f"stream ({max_tokens} tokens, stop tokens {sorted(stop_token_ids)})")
                    self._commit(tokens, response.committed_length)
                    taken += len(tokens)
                    self.stream_guesses += response.guesses
                    self.stream_guesses_accepted += response.guesses_accepted
                    yield tokens
                    if taken >= max_tokens or tokens[-1] in stop_token_ids:
                        self.link.record(endpoint, None)
                        return
                    response = stream.next()
                raise RuntimeError(f"verifier {endpoint.address} ended a Decode stream after {taken} of "
                                   f"{max_tokens} tokens")
            except grpc.RpcError as e:
                if is_resync(e):  # the verifier dropped the session between two steps: re-open with everything
                    self.link.sync.server_length = 0
                    self.stats.resyncs += 1
                    continue
                self._failed(endpoint, e, failed)
                if not is_retryable(e):
                    raise
                log.warning("session %s: the Decode stream from verifier %s broke after %d tokens (%s): re-opened",
                            self.session_id[:8], endpoint.address, taken, e.code().name)
            finally:
                stream.close()

    def end(self) -> None:
        self.link.end(self.session_id)


class DegradingDraftSession:
    def __init__(self, pool: WorkerPool, session_id: str, prompt: Sequence[int], params: SamplingParams,
                 seed: int, config: ResilienceConfig, stats: FaultStats, cancel: CancelToken | None = None) -> None:
        self.link = PinnedSession(pool, prompt, stats, cancel)
        self.session_id, self._params, self._seed, self._config, self.stats = session_id, params, seed, config, stats
        # How much of the history the drafter has been brought up to (the prompt counts as given: a first call
        # prefills it, as the verifier does); what was committed after it is the backlog.
        self.caught_up = len(prompt)
        self.restarts = 0  # times it skipped a backlog (to the recent tokens) instead of catching up

    def _skip_backlog(self) -> None:
        """More than MAX_DRAFTER_BACKLOG tokens committed since the drafter's last call: skip them, so that its
        history goes on from the last RESTART_CONTEXT of them after what it holds, instead of prefilling them all in
        this round. What it holds stays: a restart from the recent tokens alone overwrote the session's cells, and
        with them the prefix the worker's cache would have kept for the conversation's next turn (whose session then
        prefilled its whole window). Drafts are only proposals, so the gap changes acceptance at most, never the
        output."""
        sync = self.link.sync
        behind = len(sync.history) - self.caught_up
        if behind <= MAX_DRAFTER_BACKLOG:
            return
        # 0 where the drafter holds nothing of the session (a failed call detached it: it may have restarted)
        held = min(sync.server_length, self.caught_up) if self.link.endpoint is not None else 0
        sync.history = TokenHistory([*sync.history.tokens[:held], *sync.history.tokens[-RESTART_CONTEXT:]])
        sync.server_length = self.caught_up = held
        self.restarts += 1
        log.debug("drafter %d tokens behind: it skips to the last %d after the %d it holds", behind,
                  RESTART_CONTEXT, held)

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        if self.link.cancel is not None:
            self.link.cancel.check()
        self._skip_backlog()
        try:
            endpoint = self.link.begin(self.link.current())
        except NoWorkerAvailable:
            self.stats.degraded_rounds += 1
            return Draft()  # no drafter: this round is plain target decoding

        def rpc(context: pb.ContextSync) -> pb.ProposeResponse:
            if after:  # drafting past uncommitted tokens (pipelining): they ride along as if committed
                context = pb.ContextSync(base_length=context.base_length, base_hash=context.base_hash,
                                         new_tokens=[*context.new_tokens, *after])
            return self.link.invoke(endpoint.stub.Propose, pb.ProposeRequest(
                session_id=self.session_id, context=context, num_tokens=k,
                sampling=sampling_to_wire(self._params), seed=self._seed),
                self._config.attempt_timeout(self._config.propose_timeout_s, len(context.new_tokens)))
        try:
            response = self.link.sync.call(rpc)
        except grpc.RpcError as e:
            self.link.record(endpoint, e)
            # Whatever went wrong (the drafter died, or cannot take this history: a smaller vocabulary or context
            # than the target's), the generation goes on: this round is plain target decoding.
            log.warning("drafter %s failed (%s): this round decodes without drafts", endpoint.address, e.code().name)
            self.link.detach()
            self.stats.degraded_rounds += 1
            return Draft()
        self.link.record(endpoint, None)
        # The drafter now holds the committed history (+ `after`, which the next call's sync cuts off again if it was
        # not committed: syncing from the committed length truncates the server's history there).
        self.link.sync.server_length = self.caught_up = len(self.link.sync.history)
        return Draft(tuple(response.tokens), dists_from_wire(response.distributions))

    def update(self, committed: Sequence[int]) -> None:
        self.link.sync.history.extend(committed)

    def end(self) -> None:
        self.link.end(self.session_id)


def window_start(length: int, window: int) -> int:
    """Where a window of recent tokens starts in a history of `length`: at the last multiple of `window` that leaves
    at least `window` tokens (so it holds window to 2 x window - 1 of them). The start stays put while a conversation
    grows by up to `window` tokens, so the next turn's session starts with the tokens the last one held, which the
    worker's prefix cache has kept: it prefills only what is new. A window of the last `window` tokens moved with every
    turn, and each turn prefilled all of it (on the real draft model, Zen 4: 0.9 s for 256 tokens)."""
    return max(0, (length - window) // window * window)


class LazyDraftSource:
    """A DraftSource opened on its first propose: until then it only keeps the committed tokens, which become the
    opened source's prompt. A generation that never drafts (drafting off, or no round with k > 0) opens no drafter
    session and sends the drafter nothing. `open_source(history)` opens it (a DegradingDraftSession, or the
    translation in front of one)."""

    def __init__(self, prompt: Sequence[int], open_source: Callable[[list[int]], DraftSource],
                 window: int | None = None, prefixes: DrafterPrefixes | None = None) -> None:
        """`window`: open the source on the recent tokens only, from the last multiple of `window` that leaves at
        least `window` of them (window_start; None: all of them). `prefixes`: what the drafter's workers likely hold
        from earlier sessions (opening_tokens); the sessions opened here are added to it."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.history: list[int] = list(prompt)
        self._open, self.window, self.prefixes = open_source, window, prefixes
        self.source: DraftSource | None = None
        self._held: list[int] | None = None  # what the opened session was sent, as `prefixes` remembers it
        self._cached = (-1, 0, 0)  # opening_tokens' last look-up: (window start, tokens held, window length)

    def _window_start(self) -> int:
        return window_start(len(self.history), self.window) if self.window else 0

    def opening_tokens(self) -> int:
        """Tokens the session's opening would prefill on the drafter: its window, less the prefix the drafter's
        workers likely hold from an earlier session (`prefixes`; without it, none); 0 once open."""
        if self.source is not None:
            return 0
        start = self._window_start()
        length = len(self.history) - start
        if self.prefixes is None:
            return length
        # Asked every round while the model waits: the held prefix is looked up again only where it could have grown
        # (it reached the end of the window last time) or the window moved.
        checked_start, cached, checked_length = self._cached
        if checked_start != start or cached >= checked_length:
            cached = self.prefixes.cached(self.history[start:])
            self._cached = (start, cached, length)
        return length - cached

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        if self.source is None:
            window = self.history[self._window_start():]
            self.source = self._open(window)
            if self.prefixes is not None:
                self._held = list(window)
                self.prefixes.opened(self._held)
            self.history = []
        return self.source.propose(k, after)

    def update(self, committed: Sequence[int]) -> None:
        if self.source is None:
            self.history.extend(committed)
        else:
            self.source.update(committed)
            if self._held is not None:
                self._held.extend(committed)

    def end(self) -> None:
        if self.source is not None:
            self.source.end()
