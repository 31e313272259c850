"""The Python API for embedding the coordinator:

    from coordinator import Coordinator, GenerationOptions
    with Coordinator(verifier="127.0.0.1:50052", drafter="127.0.0.1:50051") as c:
        result = c.generate("Write a haiku about gRPC", GenerationOptions(max_new_tokens=64))
        print(result.text, result.stats)

With `suffix_drafter=` as well (a `drafter serve --method suffix`), drafting is hybrid (coordinator/drafting/hybrid.py):
the suffix drafter's draft where its match is long enough, the draft model's elsewhere where that pays.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import grpc

from coordinator.cancel import CancelToken, GenerationCancelled
from coordinator.drafting.policies import DEFAULT_POLICY, POLICIES
from coordinator.fleet.drafter_prefixes import DrafterPrefixes
from coordinator.fleet.pools import WorkerPool
from coordinator.drafting.hybrid import MODEL, SUFFIX, HybridDraftSource
from coordinator.drafting.costs import CostEstimate
from coordinator.drafting.priors import cost_prior, measures_costs_later
from coordinator.drafting.learned import OPENING, OVERHEAD_S, STREAM, SourceLearning
from coordinator.drafting.learning_store import learning_store
from coordinator.loop import DraftLength, LoopConfig, LoopResult, speculative_decode
from coordinator.record import Recorder
from coordinator.stream_flush import DEFAULT_STREAM_FLUSH_S, check_stream_flush_s
from coordinator.fleet.channel import new_session_id
from coordinator.fleet.resilience import NoWorkerAvailable, ResilienceConfig
from coordinator.fleet.remote_sessions import DegradingDraftSession, FailoverTargetSession, FaultStats, LazyDraftSource
from coordinator.text_stream import TextStream
from coordinator.translation import TokenTranslator, TranslatingDraftSource
from coordinator.fleet.worker_client import WorkerError
from specmesh.runtime.tokenizer import load_tokenizer
from specmesh.ops import logs
from specmesh.ops import metrics
from specmesh.decoding.sampling import SamplingParams
from specmesh.wire.security import ClientSecurity, load_token
from specmesh.wire.validation import MAX_SEED


# A worker whose costs were not cached measures them after it reports SERVING (specmesh/worker/cost_probe.py): while
# one that runs a model reports none, its Info is read again before a generation, at most this often.
COST_REFRESH_S = 5.0
COST_REFRESH_TIMEOUT_S = 2.0
COST_WAIT_POLL_S = 0.5  # wait_for_costs: an Info call every half second (the probes wait for a quiet machine)
# Hybrid drafting: the draft model's session opens on the recent tokens only, from a start that moves by this many
# (remote_sessions.window_start): its first round prefills what the drafter's prefix cache does not hold.
HYBRID_MODEL_WINDOW = 256
# What prefilling a token costs the draft model, as a share of drafting one (its one-token step), until an opening of
# its session measured it (SourceLearning, OPENING): the real 0.5B drafter (Q4_0, repacked, 2-core Zen 4) prefilled
# 2.8 ms a token (a 363-token window in 1.0 s, alike in passes of 31 to 512 tokens) against 8.5 ms a drafted token.
OPENING_TOKEN_SHARE = 1 / 3
MODEL_OPENING = "model-opening"  # SourceLearning's key for what openings measured (a factor over the prior's price)
STREAMED = "streamed"  # SourceLearning's key for what a hybrid's streamed tokens took (a factor over v(0))

log = logging.getLogger("specmesh.coordinator")

MAX_NEW_TOKENS = 1 << 20  # far beyond any model's context; the verifier's context limit applies first


def opening_s_per_token(costs: CostEstimate | None, learned: dict[str, float] | None) -> float | None:
    """What prefilling a token of its window costs the draft model where its session opens: its drafted token's cost
    times OPENING_TOKEN_SHARE, times what earlier openings measured against that (`learned`); None without costs."""
    if costs is None:
        return None
    return costs.draft_s_per_token * OPENING_TOKEN_SHARE * (learned or {}).get(MODEL_OPENING, 1.0)


class TokenizerMismatch(WorkerError):
    """A drafter the coordinator cannot pair with the verifier: the same tokenizer with a wider vocabulary (it could
    propose ids the verifier has no logits for), or another tokenizer that cannot be loaded here to translate."""


class GenerationFailed(RuntimeError):
    """A generation stopped because a worker failed; `partial` holds what was generated before."""

    def __init__(self, message: str, partial: "GenerationResult") -> None:
        super().__init__(message)
        self.partial = partial


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = 256
    draft_tokens: int | None = None  # None: adaptive draft length; 0: target-only decoding
    draft_policy: str = DEFAULT_POLICY  # adaptive k: "heuristic" (HF's +2/-1) or "cost" (coordinator/drafting/)
    pipeline: bool = False  # draft the next round while the target verifies this one (coordinator/loop.py)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: 0 when greedy, random when sampling (reported in the result)
    stop: tuple[str, ...] = ()
    chat: bool = True  # apply the model's chat template when it has one
    # Target-only stretches stream from the verifier; it may hold tokens this long and send them together, so that
    # both sides' gRPC threads wake once a message instead of once a token (on a CPU host they take their time from
    # the model's threads). The first token of each stretch is sent at once. Not applied with stop strings: only the
    # coordinator sees those, and held tokens would delay the stop. 0: every token at once.
    stream_flush_s: float = DEFAULT_STREAM_FLUSH_S
    # In a generation that drafts, the verifier's streamed steps check a guess of the next token where their spare
    # row makes it free (LoopConfig.stream_guesses, DecodeRequest.guess). False: the streams as target-only decodes.
    stream_guesses: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}, got {self.max_new_tokens}")
        if self.draft_tokens is not None and not 0 <= self.draft_tokens <= 64:
            raise ValueError(f"draft_tokens must be in 0..64, got {self.draft_tokens}")
        if self.draft_policy not in POLICIES:
            raise ValueError(f"draft_policy must be one of {', '.join(POLICIES)}, got {self.draft_policy!r}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in 0..2**64-1, got {self.seed}")
        check_stream_flush_s(self.stream_flush_s)
        self.sampling  # validates temperature, top_p, top_k

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos", "length", "stop", "error" or "cancelled"
    stats: dict = field(default_factory=dict)
    rounds: list = field(default_factory=list)  # coordinator.drafting.RoundRecord per round


def drafting_note(loop: LoopResult, degraded_rounds: int = 0) -> str | None:
    """What the summary line says instead of an acceptance rate and a mean accepted length when the generation
    drafted in fewer than half of its rounds (those figures then describe a handful of drafts, or none): what the
    policy decided and why. None when it drafted in most rounds."""
    if loop.drafting_off:
        return loop.draft_decision  # why, with the numbers
    rounds = loop.rounds
    drafted_rounds = sum(1 for r in rounds if r.drafted)
    if not rounds or drafted_rounds * 2 >= len(rounds):
        return None
    if not loop.draft_policy:
        return loop.draft_decision  # no drafter
    drafts, accepted = sum(r.drafted for r in rounds), sum(r.accepted for r in rounds)
    why = []
    if degraded_rounds:
        why.append(f"{degraded_rounds} rounds without a drafter answering")
    if loop.draft_policy == "cost":
        # The other rounds without drafts are the policy's k = 0: drafts did not pay at the acceptance it measured. A
        # drafted round after a round without drafts (round 0 aside) is it trying again: a probe.
        probes = sum(1 for before, r in zip(rounds[1:], rounds[2:]) if r.drafted and not before.drafted)
        why.append(f"k = 0 elsewhere: drafts did not pay at the measured acceptance; {probes} probe rounds")
    measured = f"acceptance {accepted / drafts:.1%} over {drafts} drafts" if drafts else "no drafts"
    return (f"{loop.draft_decision}: drafted in {drafted_rounds} of {len(rounds)} rounds"
            + (f" ({'; '.join(why)})" if why else "") + f"; {measured}")


def summarize(loop: LoopResult, elapsed_s: float, seed: int, faults: FaultStats, engines: dict | None = None) -> dict:
    rounds = len(loop.rounds)
    drafted = sum(r.drafted for r in loop.rounds)
    accepted = sum(r.accepted for r in loop.rounds)
    new_tokens = len(loop.tokens)
    return {
        "new_tokens": new_tokens,
        "elapsed_s": round(elapsed_s, 4),
        "tokens_per_s": round(new_tokens / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        "rounds": rounds,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        # vLLM's definitions: accepted / drafted, and tokens committed per round (1 + accepted per round).
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_accepted_length": round(new_tokens / rounds, 4) if rounds else 0.0,
        # What the draft-length policy decided (and, in draft_note, why it drafted little or nothing, when it did).
        "draft_decision": loop.draft_decision,
        "drafted_rounds": sum(1 for r in loop.rounds if r.drafted),
        "draft_note": drafting_note(loop, faults.degraded_rounds),
        "draft_s": round(sum(r.draft_s for r in loop.rounds), 4),
        "verify_s": round(sum(r.verify_s for r in loop.rounds), 4),
        "seed": seed,
        **faults.as_dict(),
        **(engines or {}),
    }


class Coordinator:
    """Connects to a pool of verifiers and optionally a pool of drafters, checks they are compatible, runs
    generations. Addresses are HOST:PORT, or dns:///NAME:PORT for every address a name resolves to."""

    def __init__(self, verifier: str | Sequence[str], drafter: str | Sequence[str] | None = None, tokenizer=None,
                 resilience: ResilienceConfig = ResilienceConfig(), connect_timeout_s: float = 30.0,
                 security: ClientSecurity | None = None, record: str | None = None,
                 unreachable_timeout_s: float | None = None, drafter_tokenizer=None,
                 suffix_drafter: str | Sequence[str] | None = None) -> None:
        """`security`: TLS files and bearer token for reaching the workers (default: plaintext, with the token from
        $SPECMESH_TOKEN_FILE / $SPECMESH_TOKEN when set). TLS settings that do not match a worker's fail at once
        (WorkerError naming the cause); workers that refuse connections fail after `unreachable_timeout_s` (None:
        after `connect_timeout_s`, like workers that are still loading). `tokenizer` and `drafter_tokenizer` default
        to the tokenizers of the models the workers name in Info; the drafter's is loaded only when it differs from
        the target's (drafting across tokenizers, coordinator/translation.py). `suffix_drafter`: the addresses of a
        suffix drafter (`drafter serve --method suffix`, the target's tokenizer) for hybrid drafting."""
        self.resilience = resilience
        self.recorder = Recorder(record) if record else None
        security = security if security is not None else ClientSecurity(token=load_token())
        self.verifiers = WorkerPool([verifier] if isinstance(verifier, str) else verifier, "verifier", resilience,
                                    security=security)
        self.drafters = self.suffix_drafters = None
        try:
            if drafter:
                self.drafters = WorkerPool([drafter] if isinstance(drafter, str) else drafter, "drafter",
                                           resilience, self.verifiers.transitions, security)
            if suffix_drafter:
                self.suffix_drafters = WorkerPool([suffix_drafter] if isinstance(suffix_drafter, str)
                                                  else suffix_drafter, "drafter", resilience,
                                                  self.verifiers.transitions, security)
            self.verifier_info = self._info(self.verifiers, connect_timeout_s, unreachable_timeout_s)
            self.drafter_info = (self._info(self.drafters, connect_timeout_s, unreachable_timeout_s)
                                 if self.drafters else None)
            self.suffix_drafter_info = (self._info(self.suffix_drafters, connect_timeout_s, unreachable_timeout_s)
                                        if self.suffix_drafters else None)
            if self.suffix_drafter_info is not None and not shares_tokenizer(self.suffix_drafter_info,
                                                                             self.verifier_info):
                raise TokenizerMismatch(f"suffix drafter model {self.suffix_drafter_info.model_name!r} does not use "
                                        f"the tokenizer of verifier model {self.verifier_info.model_name!r}: start it "
                                        f"with the target's model (drafter serve --method suffix --model TARGET)")
            shared = self.drafter_info is not None and shares_tokenizer(self.drafter_info, self.verifier_info)
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.verifier_info.model_name)
            # A drafter with another tokenizer drafts through text (coordinator/translation.py).
            self.translator = None
            if self.drafter_info is not None and not shared:
                self.translator = TokenTranslator(self.tokenizer, drafter_tokenizer if drafter_tokenizer is not None
                                                  else self._drafter_tokenizer())
        except BaseException:
            self.close()
            raise
        self.eos_token_ids = frozenset(self.verifier_info.eos_token_ids)
        # Network time of one call to each side (the fastest of a few health checks): the cost policy adds it to
        # every round, which is what speculation amortises on split hosts.
        self.round_trip_s = {"verifier": round_trip_s(self.verifiers),
                             **({"drafter": round_trip_s(self.drafters)} if self.drafters else {})}
        self._model_round_trip_s = dict(self.round_trip_s)  # the draft model's, where the suffix drafter's replace it
        if self.suffix_drafters is not None:
            self.round_trip_s["drafter"] = round_trip_s(self.suffix_drafters)
        # Per draft source, how much more than the workers' costs a recent greedy generation's drafted rounds took (a
        # suffix drafter's as a slowdown, a draft model's as an overhead a round), fading with the generations since
        # (coordinator/drafting/learned.py). The next greedy generations start from it, so a cost that rules
        # drafting out costs the probes of one generation, not of every one, and a source is tried again within a
        # few requests. Kept in a file per set of workers, for the next coordinator processes (learning_store).
        self.learning = SourceLearning(store=learning_store(self.verifier_info, self.drafter_info,
                                                            self.suffix_drafter_info))
        # What the draft model's workers likely still hold of the sessions opened through this coordinator: what
        # opening the next one would prefill (the hybrid opens it only where that can pay).
        self.drafter_prefixes = DrafterPrefixes()
        self._costs_read_at = time.monotonic()
        self._costs_lock = threading.Lock()
        self._set_cost_priors()
        if self.costs_pending():
            log.info("the workers have not measured their costs yet (they do once SERVING, unless cached): until "
                     "they report them, the cost policy drafts nothing (the heuristic policy and a fixed k draft)")
        # Limits agreed with the workers: no request may exceed what either side accepts (Info).
        self.propose_limit = min([info.max_draft_tokens for info in (self.drafter_info, self.suffix_drafter_info)
                                  if info is not None] or [1 << 30])
        self.draft_limit = min(self.verifier_info.max_draft_tokens, self.propose_limit)
        self.context_limit = self.verifier_info.max_context_length
        # Which model runtime each side runs (transformers, llamacpp; "" for a model-free drafter), for the stats, and
        # whether the drafter's token ids are the target's ("shared") or translated through text ("translated").
        self.engines = {"verifier_engine": self.verifier_info.engine,
                        **({"verifier_engine_build": self.verifier_info.engine_build}
                           if self.verifier_info.engine_build else {}),
                        **({"drafter_engine_build": self.drafter_info.engine_build}
                           if self.drafter_info is not None and self.drafter_info.engine_build else {}),
                        **({"drafter_engine": self.drafter_info.engine,
                            "draft_tokenizer": "shared" if self.translator is None else "translated"}
                           if self.drafter_info is not None else {}),
                        **({"suffix_drafter": True} if self.suffix_drafters is not None else {})}
        metrics.register_state(f"coordinator:{id(self)}", self._state_metrics)

    def _set_cost_priors(self) -> None:
        """The cost policy's prior from the workers' Info: `cost_prior`, and for hybrid drafting the draft model's
        own (`model_costs`). Hybrid drafting works with the suffix drafter's costs (its drafts
        come first); the draft model joins only where its own costs say some draft length can pay even with every
        draft accepted. Without the workers' costs there is no prior: the cost policy times its own rounds."""
        model_costs = prior = cost_prior(self.verifier_info, self.drafter_info, self._model_round_trip_s)
        if self.suffix_drafters is not None:
            model_off = model_costs.drafting_off(DraftLength.maximum) if model_costs is not None else None
            if model_off is not None:
                log.info("hybrid drafting, cost policy: without the draft model (%s; %s)", model_off, model_off.details())
            prior = cost_prior(self.verifier_info, self.suffix_drafter_info, self.round_trip_s)
        self.model_costs, self.cost_prior = model_costs, prior

    def costs_pending(self) -> bool:
        """Whether a worker that runs a model reports no costs yet (it is measuring them)."""
        return any(measures_costs_later(info) for info in (self.verifier_info, self.drafter_info,
                                                            self.suffix_drafter_info))

    def wait_for_costs(self, timeout_s: float) -> bool:
        """Wait until every worker that runs a model reports its costs (measured while it serves nothing): True once
        they all do, False after `timeout_s`. For a short-lived coordinator (`coordinator generate` on local workers),
        whose workers would otherwise stop before measuring: a GGUF worker caches its costs, and the next start
        reports them at once."""
        deadline = time.monotonic() + timeout_s
        while self.costs_pending():
            if time.monotonic() >= deadline:
                return False
            time.sleep(COST_WAIT_POLL_S)
            self._refresh_costs(min_interval_s=0.0)  # now, not COST_REFRESH_S after the last read
        return True

    def _refresh_costs(self, min_interval_s: float = COST_REFRESH_S) -> None:
        """Before a generation: read the Info of the workers again while they measure their costs, at most every
        min_interval_s (a call of a few milliseconds), so that later generations start from the cost prior. A
        worker that does not answer in time keeps what it reported."""
        if not self.costs_pending() or time.monotonic() - self._costs_read_at < min_interval_s:
            return
        if not self._costs_lock.acquire(blocking=False):
            return  # another generation is reading them
        try:
            self._costs_read_at = time.monotonic()
            for name, pool in (("verifier_info", self.verifiers), ("drafter_info", self.drafters),
                               ("suffix_drafter_info", self.suffix_drafters)):
                endpoint = pool.first_serving() if measures_costs_later(getattr(self, name)) else None
                if endpoint is not None:
                    try:
                        setattr(self, name, endpoint.info(COST_REFRESH_TIMEOUT_S))
                    except WorkerError as e:
                        log.debug("could not read the costs of %s: %s", endpoint.address, e)
            self._set_cost_priors()
            if not self.costs_pending():
                log.info("the workers report their costs: the cost policy starts from them")
        finally:
            self._costs_lock.release()

    def _state_metrics(self):
        pools = [p for p in (self.verifiers, self.drafters, self.suffix_drafters) if p is not None]
        endpoints = [e for p in pools for e in p.endpoints]
        states = {"closed": 0, "half-open": 1, "open": 2}
        yield metrics.gauge("specmesh_breaker_state", "0 closed, 1 half-open, 2 open", ["role", "endpoint"],
                            [([e.role, e.address], states.get(e.breaker.state, 2)) for e in endpoints])
        yield metrics.gauge("specmesh_endpoint_serving", "1 while grpc.health.v1 reports SERVING",
                            ["role", "endpoint"], [([e.role, e.address], int(e.serving)) for e in endpoints])
        yield metrics.gauge("specmesh_endpoint_sessions", "generations pinned to the endpoint", ["role", "endpoint"],
                            [([e.role, e.address], e.sessions) for e in endpoints])

    def _drafter_tokenizer(self):
        name = self.drafter_info.model_name
        try:
            return load_tokenizer(name)
        except Exception as e:  # an unknown spec, a path only the drafter's host has, no network
            raise TokenizerMismatch(
                f"drafter model {name!r} uses another tokenizer than verifier model {self.verifier_info.model_name!r}; "
                f"translating its drafts needs that tokenizer here, and loading it failed: {e}") from e

    @staticmethod
    def _info(pool: WorkerPool, timeout_s: float, unreachable_timeout_s: float | None):
        endpoint = pool.wait_any_serving(timeout_s, unreachable_timeout_s)  # WorkerError early if unreachable
        if endpoint is None:
            errors = pool.connect_errors()
            raise WorkerError(f"no {pool.role} SERVING within {timeout_s:.0f} s at "
                              f"{', '.join(e.address for e in pool.endpoints)}"
                              + (f" (last error: {errors})" if errors else ""))
        return endpoint.info()  # raises WorkerError saying what failed

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        metrics.unregister_state(f"coordinator:{id(self)}")
        for pool in (self.verifiers, self.drafters, self.suffix_drafters):
            if pool is not None:
                pool.close()

    @property
    def breaker_transitions(self):
        """Counter of (endpoint, old state, new state) -> count, for every breaker of this coordinator."""
        return self.verifiers.transitions.counts

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        if chat and getattr(self.tokenizer, "chat_template", None):  # instruct models; base models get the text
            return self.encode_messages([{"role": "user", "content": prompt}])
        return self.tokenizer(prompt)["input_ids"]

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat, with the model's chat template (a plain "role: content" transcript without one)."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.tokenizer(text)["input_ids"]

    def generate(self, prompt: str | list[int], options: GenerationOptions = GenerationOptions(),
                 on_text: Callable[[str], None] | None = None,
                 cancel: CancelToken | None = None) -> GenerationResult:
        """Generate a completion; `on_text` receives text as it is accepted. A prompt may be given as token ids.

        Raises GenerationFailed (with the partial result) when no verifier could serve a step within the retry
        budget, and GenerationCancelled (with the partial result) soon after `cancel` is cancelled: the RPCs in
        flight are cancelled and the workers' sessions ended."""
        prompt_ids = list(prompt) if isinstance(prompt, list) else self.encode_prompt(prompt, options.chat)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self._refresh_costs()
        seed = options.seed if options.seed is not None else (random.getrandbits(63) if options.temperature else 0)
        use_drafter = (self.drafters is not None or self.suffix_drafters is not None) and options.draft_tokens != 0
        # What earlier generations measured of each draft source, faded by the generations since (greedy only: a
        # seeded sampled generation repeats exactly only where k never depends on timing).
        learned = self.learning.start_generation() if use_drafter and options.sampling.is_greedy else {}
        config = LoopConfig(max_new_tokens=self.token_budget(len(prompt_ids), options.max_new_tokens),
                            eos_token_ids=self.eos_token_ids, draft_length=self.draft_length(options, learned),
                            pipeline=options.pipeline,
                            max_propose_tokens=self.propose_limit if use_drafter else None,
                            stream_flush_s=0.0 if options.stop else options.stream_flush_s,
                            stream_guesses=options.stream_guesses)
        session_id = new_session_id()
        logs.session_id.set(session_id)
        faults = FaultStats()
        target = FailoverTargetSession(self.verifiers, session_id, prompt_ids, options.sampling, seed,
                                       self.resilience, faults, cancel)
        drafter = (self._draft_source(session_id, prompt_ids, options, seed, faults, cancel, learned)
                   if use_drafter else None)
        stream = TextStream(self.tokenizer, options.stop, on_text)
        loop = LoopResult()
        started = time.perf_counter()
        try:
            speculative_decode(drafter, target, config, on_tokens=stream.push, result=loop)
        except (grpc.RpcError, NoWorkerAvailable, GenerationCancelled) as e:
            stream.finish()
            cancelled = isinstance(e, GenerationCancelled)
            partial = GenerationResult(stream.text, loop.tokens, len(prompt_ids), "cancelled" if cancelled else "error",
                                       summarize(loop, time.perf_counter() - started, seed, faults, self.engines),
                                       loop.rounds)
            metrics.record_generation(partial, time.perf_counter() - started)
            self._finished(session_id, prompt, prompt_ids, options, partial)
            if cancelled:
                raise GenerationCancelled(f"generation cancelled after {len(loop.tokens)} tokens: {e}", partial) from e
            reason = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            raise GenerationFailed(f"generation failed after {len(loop.tokens)} tokens: {reason}", partial) from e
        finally:
            target.end()
            if drafter is not None:
                drafter.end()
        self._learn(config.draft_length, loop, drafter)
        text = stream.finish()
        stats = summarize(loop, time.perf_counter() - started, seed, faults, self.engines)
        if target.stream_guesses:  # tokens the streams' free guesses committed (DecodeRequest.guess)
            stats.update(stream_guesses=target.stream_guesses, stream_guesses_accepted=target.stream_guesses_accepted)
        if learned:  # what it started from, of what earlier generations measured (SourceLearning)
            stats.update(learned={source: round(value, 6) for source, value in sorted(learned.items())})
        if isinstance(drafter, HybridDraftSource):  # which drafter drafted how many rounds
            stats.update(suffix_rounds=drafter.suffix_rounds, model_rounds=drafter.model_rounds,
                         model_openings_declined=drafter.openings_declined)
        result = GenerationResult(text, loop.tokens, len(prompt_ids), loop.finish_reason, stats, loop.rounds)
        metrics.record_generation(result, time.perf_counter() - started)
        self._finished(session_id, prompt, prompt_ids, options, result)
        return result

    def _draft_source(self, session_id: str, prompt_ids: list[int], options: GenerationOptions, seed: int,
                      faults: FaultStats, cancel: CancelToken | None, learned: dict[str, float] | None = None):
        """The drafter session in target tokens: the remote session itself, or that session (in drafter tokens)
        behind the translation through text; opened on the first round that drafts (LazyDraftSource), so that a
        generation that never drafts sends the drafter nothing. With a suffix drafter, the hybrid of it and (where
        that pays, by its costs and what earlier generations learned of its overhead a round: `learned`) the model
        drafter's session."""
        def opener(pool: WorkerPool) -> Callable[[list[int]], DegradingDraftSession]:
            return lambda prompt: DegradingDraftSession(pool, session_id, prompt, options.sampling, seed,
                                                        self.resilience, faults, cancel)
        model = None
        # Under the cost policy the draft model drafts the k its own costs find best (each round priced with the
        # overhead earlier generations measured, until this one's rounds measure it), and is left out where no k can
        # pay; a fixed k or the heuristic ask it for the round's k.
        costs = self.model_costs if options.draft_tokens is None and options.draft_policy == "cost" else None
        overhead, streamed = (learned or {}).get(MODEL), (learned or {}).get(STREAMED)
        if costs is not None and streamed is not None:  # target-only decoding at what earlier generations' streams took
            costs = replace(costs, streamed_token_s=streamed * costs.verify_s(0))
        model_off = costs is not None and (costs if overhead is None else costs.with_draft_overhead(overhead)) \
            .drafting_off(DraftLength.maximum) is not None
        if self.drafters is not None and (self.suffix_drafters is None or not model_off):
            open_session = opener(self.drafters)
            # Hybrid: the draft model drafts where the suffix drafter has no match, from the recent context; a long
            # conversation's whole prompt would cost its prefill on the drafter (seconds) in the first model round.
            model = LazyDraftSource(prompt_ids, open_session if self.translator is None else (
                lambda history: TranslatingDraftSource(self.translator, history, open_session)),
                window=HYBRID_MODEL_WINDOW if self.suffix_drafters is not None else None,
                prefixes=self.drafter_prefixes if self.suffix_drafters is not None else None)
        if self.suffix_drafters is None:
            return model
        # Greedy only: a seeded sampled generation repeats exactly only where its k depends on nothing else (the
        # prefixes depend on other requests).
        opening = opening_s_per_token(costs, learned) if options.sampling.is_greedy else None
        return HybridDraftSource(LazyDraftSource(prompt_ids, opener(self.suffix_drafters)), model, model_costs=costs,
                                 timed=options.sampling.is_greedy, learned_overhead_s=overhead,
                                 token_budget=options.max_new_tokens if opening is not None else None,
                                 opening_s_per_token=opening)

    def check(self, prompt_tokens: int, options: GenerationOptions) -> None:
        """Raise ValueError if a request cannot run within the workers' limits (what generate would refuse)."""
        self.draft_length(options)
        self.token_budget(prompt_tokens, options.max_new_tokens)

    def draft_length(self, options: GenerationOptions, learned: dict[str, float] | None = None) -> DraftLength:
        """The draft length policy within the workers' limits; an explicit k above them is refused up front (the
        drafter would refuse every call and the generation would silently run without drafts). `learned`: the
        drafting slowdown earlier generations measured, by source (SourceLearning.start_generation)."""
        k = options.draft_tokens
        if k is not None and k > self.draft_limit and (self.drafters is not None or self.suffix_drafters is not None):
            raise ValueError(f"draft_tokens {k} exceeds what the workers accept: max_draft_tokens "
                             f"{self.propose_limit} (drafter), {self.verifier_info.max_draft_tokens} (verifier); start "
                             f"them with a larger --max-draft-tokens")
        if k is not None:
            return DraftLength.fixed(k)
        # Pipelining asks the drafter for one token more than the round drafts (the bet's bonus-token guess).
        maximum = max(1, min(DraftLength.maximum, self.draft_limit - (1 if options.pipeline else 0)))
        prior, timed = self.cost_prior, options.sampling.is_greedy
        # The prior's costs are the suffix drafter's where drafting is hybrid (the draft model gates itself).
        source = SUFFIX if self.suffix_drafters is not None else ""
        slowdown = (learned or {}).get(source)
        if prior is not None and timed and slowdown is not None:
            prior = replace(prior, drafting_slowdown=slowdown)
        return DraftLength(initial=min(DraftLength.initial, maximum), maximum=maximum, policy=options.draft_policy,
                           prior=prior, pipelined=options.pipeline, timed=timed,
                           costs_pending=prior is None and self.costs_pending(), source=source)

    def _learn(self, length: DraftLength, loop: LoopResult, drafter) -> None:
        """Keep what this generation measured of each draft source for the next ones (SourceLearning)."""
        slowdown = length.measured_slowdown(loop.rounds)
        if slowdown is not None:
            self.learning.record(length.source, slowdown)
        if isinstance(drafter, HybridDraftSource) and (model := drafter.model_overhead_s()) is not None:
            self.learning.record(MODEL, model, OVERHEAD_S)
        if isinstance(drafter, HybridDraftSource) and drafter.model_costs is not None and (
                streamed := drafter.streamed_token_s()) is not None:
            self.learning.record(STREAMED, streamed / drafter.model_costs.verify_s(0), STREAM)
        if isinstance(drafter, HybridDraftSource) and drafter.opening_measured_s_per_token is not None and (
                prior := opening_s_per_token(self.model_costs, {})):
            self.learning.record(MODEL_OPENING, drafter.opening_measured_s_per_token / prior, OPENING)

    def token_budget(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """max_new_tokens, cut to what the verifier's context holds after the prompt (finish reason "length")."""
        room = self.context_limit - prompt_tokens if self.context_limit else max_new_tokens
        if room < 1:
            raise ValueError(f"the prompt has {prompt_tokens} tokens: the verifier's context holds "
                             f"{self.context_limit}, no room to generate")
        return min(max_new_tokens, room)

    def _finished(self, session_id: str, prompt, prompt_ids: list[int], options: GenerationOptions,
                  result: GenerationResult) -> None:
        log.info("generation %s: %d tokens, %s", result.finish_reason, len(result.token_ids),
                 ", ".join(f"{k}={v}" for k, v in result.stats.items()), extra={"stats": result.stats})
        if self.recorder is not None:
            self.recorder.write(session_id=session_id, prompt=prompt, prompt_ids=prompt_ids, options=options,
                                result=result)


def round_trip_s(pool: WorkerPool, probes: int = 5) -> float:
    """The fastest of a few health checks to the pool's first serving endpoint, seconds (0 when none answers): the
    network and RPC time of a call that does no work."""
    endpoint = next((e for e in pool.endpoints if e.serving), pool.endpoints[0])
    best = math.inf
    for _ in range(probes):
        started = time.perf_counter()
        if endpoint.client.is_serving(timeout_s=2.0):
            best = min(best, time.perf_counter() - started)
    return 0.0 if best == math.inf else best


def shares_tokenizer(drafter_info, verifier_info) -> bool:
    """True when the drafter's token ids mean what the verifier's do (same tokenizer fingerprint): the fast path,
    drafts go to the verifier as they are. False: they are translated through text (coordinator/translation.py)."""
    if drafter_info.tokenizer_fingerprint != verifier_info.tokenizer_fingerprint:
        log.info("drafter model %r and verifier model %r use different tokenizers (fingerprints %s vs %s): drafts are "
                 "translated through text", drafter_info.model_name, verifier_info.model_name,
                 drafter_info.tokenizer_fingerprint[:12], verifier_info.tokenizer_fingerprint[:12])
        return False
    if drafter_info.vocab_size > verifier_info.vocab_size:
        raise TokenizerMismatch(
            f"drafter model {drafter_info.model_name!r} has a larger vocabulary ({drafter_info.vocab_size}) than "
            f"verifier model {verifier_info.model_name!r} ({verifier_info.vocab_size})")
    return True
