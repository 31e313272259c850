"""Hybrid drafting: a suffix drafter (drafts from what was generated before, microseconds a round) first, a draft model
where the suffix drafter has nothing long enough, and only where the draft model pays.

Per round the suffix drafter is asked first: it drafts only where the recent tokens match something it has seen (this
request's prompt and output, earlier requests' outputs) and drafts longer the longer the match. The draft model's
drafts cost c target steps per token, so it gets the k its own costs find best (`model_costs`: the workers' measured
costs, with the acceptance of its recent rounds and the overhead they measured), and none when that best k is 0.
The suffix draft is the round's draft when it has all k tokens asked for (a long match: a repeated edit, a quoted
document), or at least `min_suffix_tokens` and verifying it commits tokens at least as fast as a model round would,
each source at the acceptance its own recent rounds measured (the suffix drafter's shorter drafts', and the model's:
`suffix_draft_pays`); then the draft model stays out of the round's critical path. That second condition is what
keeps a suffix drafter's coincidental short matches (2 to 5 tokens of code that occurred before, mostly rejected)
from taking the rounds of a model whose drafts were all being accepted. Where the model has no k that pays, a suffix
draft of any length is the round's where verifying it commits tokens at least as fast as target-only decoding would:
on prose, matches of a few common tokens are mostly rejected (12-17% in `coordinator bench-serve`'s prose turns), and
a verify of three drafts costs 1.5 target steps where streaming the next token costs one.

The model's acceptance is its recent rounds' (ACCEPTANCE_WINDOW), estimated as the cost policy's is (accepted drafts
against rounds stopped early). Once it has put the model off, the model is asked again after MODEL_PROBE_TOKENS tokens
without it (a probe), judged afresh from its prior as at the start of a generation, since the text it is asked about
is new; a probe rejected outright leaves it off until the next, after twice the wait. Where the prior's acceptance
prices the model off from the start, its first round is a probe. A probe drafts what the model would on text it
follows (the k best at PLAUSIBLE_ACCEPTANCE): one draft said too little to turn it back on.
Without probes, on the real pair a first model round rejected on a code prompt left the rest of it to target-only
decoding (1.0x), on text whose later model rounds were accepted 80% of the time.

What the model's rounds measure belongs to the model alone (coordinator/drafting/learned.py): its acceptance, and how
much longer its rounds took than its costs price them, as seconds a round (`model_overhead_s`: the Propose call, the
cores changing hands between verifier and drafter, catching up). Every model round but the generation's first (its
session's opening, measured apart) is timed, the rounds after a suffix round or a stream too: those first catch the
model up on what they committed (a pass over 2-30 tokens), and where the sources alternate that is what a model round
costs. Timed only in runs of model rounds (what this replaced), the model was priced at 10-13 ms a round beyond its
costs on the row-invariant ik build (2-core Zen 4), where its rounds after a switch took 20-110 ms more; it kept
drafting where its rounds lost to streaming, and single prompts ran 0.71-0.83x target-only in `coordinator bench`.
The overhead is a fixed cost per round, not per token: on the real pair (2 shared cores) model rounds of
1, 2 and 3 drafts took 21, 35 and 45 ms against 12 ms a draft token measured alone, so about 9 ms a round. Priced as
a factor on every draft token (1.75x at k = 1, and more once one slow round counts), drafts looked dearer the longer
they were, and the model drafted 1 token where 3 paid. A round is timed whole, from the Propose call to the verdict:
the verify right after the drafter ran is slower too (on the real pair, Zen 4: 53 ms for one draft against the 46 ms
its curve prices, while a verify after a suffix round took what the curve says), and timing the Propose alone left
the model drafting one token a round on prose at 60% acceptance, 0.9x target-only. The overhead is the lower median of
the recent rounds' extra, so a round slowed by something else (the machine) does not price the rest: with two rounds
timed, the faster one. On fresh workers (`coordinator generate` starting them) a first generation's third model
round took 110 ms where its costs priced 58 and the second 61: the median of the two put the model off for the rest of
the generation, 0.84x target-only where the same prompt ran 1.13x on the next generation. A slow model round
never makes the suffix drafter's free drafts look expensive.
What the model competes with, target-only decoding, is priced the same way once two stretches without drafts have
measured it: at what their tokens took (`streamed_token_s`), not at the verifier's v(0) measured on an idle machine.

The first round leaves the model out (the suffix drafter's draft, or none): the draft model's session opens on its
first round and prefills the prompt, and the verifier's prefill, which gives the first token, would wait for it. On
the real pair (Zen 4, `coordinator bench-serve`) that put 0.3 s on a 44-token prompt's time to first token and 1.6 s
on a 269-token prompt's; from the second round on, the model's prefill waits for the first token instead.

The model's session opens (its first round in a generation) only where that can pay: the opening prefills what the
drafter lacks of the model's window (what the drafter's workers likely hold is mirrored from the sessions this
coordinator opened: coordinator/fleet/drafter_prefixes.py), and what the model's rounds save a token over streaming,
times the tokens left of the generation's budget, must cover that prefill at its price (a third of a drafted token's
cost until an opening measured it; what openings measure carries to the next generations). In `coordinator
bench-serve` on the real pair (Zen 4) each turn's opening prefilled 150-400 tokens (0.4-1.2 s) for answers of 20-130
tokens, where model rounds saved a few ms a token: questions over a document ran 0.88x target-only.

When neither has a draft, the round would be one target step with a Verify call per token: the hybrid asks the loop
instead to decode the next few tokens as one stream (Draft.wait_tokens), asking the suffix drafter again after 1, 2,
4, ... up to MAX_WAIT_TOKENS tokens while it keeps finding nothing (a match found resets the wait): on text that
repeats nothing, the suffix drafter costs a call every MAX_WAIT_TOKENS tokens and target-only decoding streams.

Both drafters learn every committed token; at the end the suffix drafter is brought up to the whole output (one last
call) so that its tree across requests holds all of it. Each draft carries its own distributions (the suffix
drafter's point-mass q, the model's q), so sampling stays exact whichever drafted the round.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from coordinator.drafting.costs import PLAUSIBLE_ACCEPTANCE, CostEstimate
from coordinator.drafting.learned import MAX_OVERHEAD_S
from coordinator.loop import Draft, DraftSource

log = logging.getLogger("specmesh.coordinator")

SUFFIX, MODEL = "suffix", "model"  # the sources, as RoundRecord.source and SourceLearning name them
MIN_SUFFIX_TOKENS = 2  # a one-token suffix draft is a weak match: the model's k tokens are likelier to pay
PRIOR_WEIGHT = 4  # pseudo-drafts of the prior acceptance in a source's measured acceptance
SUFFIX_PRIOR_ACCEPTANCE = PLAUSIBLE_ACCEPTANCE  # a suffix match is trusted until its rounds say otherwise
ACCEPTANCE_WINDOW = 8  # a source's recent rounds whose verdicts give its acceptance: the text changes character
MODEL_PROBE_TOKENS = 16  # the model off by its acceptance: tokens without it before a round asks it again (a probe)
MODEL_PROBE_MAX_TOKENS = 128  # ... doubling after each probe rejected outright, up to this many
MAX_WAIT_TOKENS = 16  # nothing to draft: the longest stretch decoded before the suffix drafter is asked again
OVERHEAD_WINDOW = 8  # recent timed model rounds whose extra over their price gives the model's overhead
STREAM_WINDOW = 8  # recent stretches without drafts whose seconds a token price target-only decoding
MIN_OVERHEAD_ROUNDS = 2  # model rounds (the opening one aside) timed before their overhead counts
MIN_OPENING_MEASURED = 32  # tokens an opening prefills for its time to say what a prefilled token costs


class HybridDraftSource:
    def __init__(self, suffix: DraftSource, model: DraftSource | None,
                 min_suffix_tokens: int = MIN_SUFFIX_TOKENS, model_costs: CostEstimate | None = None,
                 timed: bool = True, clock: Callable[[], float] = time.perf_counter,
                 learned_overhead_s: float | None = None, token_budget: int | None = None,
                 opening_s_per_token: float | None = None) -> None:
        """`model_costs`: the draft model's and verifier's measured costs (None: the model drafts the round's k, no
        cost gate). `learned_overhead_s`: what earlier generations measured of the model's overhead a round, assumed
        until this generation's rounds measure it. `timed`: the model's k may follow its measured overhead (greedy:
        a seeded sampled generation repeats exactly only where k never depends on timing); it is measured either
        way. `token_budget` (the generation's max new tokens) and `opening_s_per_token` (what prefilling a token
        costs the drafter): the model's session opens only where what it saves in the tokens left can pay for
        prefilling what the drafter lacks of its window (opening_pays; either None: no such gate)."""
        if min_suffix_tokens < 1:
            raise ValueError(f"min_suffix_tokens must be >= 1, got {min_suffix_tokens}")
        if learned_overhead_s is not None and learned_overhead_s < 0:
            raise ValueError(f"learned_overhead_s must be >= 0, got {learned_overhead_s}")
        self.suffix, self.model, self.min_suffix_tokens = suffix, model, min_suffix_tokens
        self.model_costs, self.timed, self.learned_overhead_s = model_costs, timed, learned_overhead_s
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if opening_s_per_token is not None and not opening_s_per_token >= 0:
            raise ValueError(f"opening_s_per_token must be >= 0, got {opening_s_per_token}")
        self.token_budget, self.opening_s_per_token = token_budget, opening_s_per_token
        self._committed = 0  # tokens this generation committed
        self.openings_declined = 0  # rounds the model would have drafted but its session's opening could not pay
        # The model's opening round, under verification: (its Propose's start, the tokens it prefilled, its drafts)
        self._opening: tuple[float, int, int] | None = None
        self.opening_measured_s_per_token: float | None = None  # what this generation's opening measured
        self._clock = clock
        self.suffix_rounds = 0  # rounds drafted by the suffix drafter
        self.model_rounds = 0  # rounds drafted by the draft model
        self.model_drafted = self.model_accepted = 0
        self._model_draft: tuple[int, ...] | None = None  # the model's draft under verification
        self._suffix_draft: tuple[int, ...] | None = None  # the suffix drafter's short draft under verification
        # (drafted, accepted) of each source's recent rounds: the acceptance each is judged by
        self._verdicts: dict[str, deque[tuple[int, int]]] = {SUFFIX: deque(maxlen=ACCEPTANCE_WINDOW),
                                                             MODEL: deque(maxlen=ACCEPTANCE_WINDOW)}
        self._without_model = 0  # tokens committed since the model's last round
        self._failed_probes = 0  # model probes in a row rejected outright
        self._probing = False  # the model's draft under verification is a probe
        self._off_until_probe = False  # the last probe was rejected outright: the model waits for the next
        # (seconds the model's round took, seconds its costs price it at), per model round after its first (which
        # opens the drafter session and prefills the prompt: a one-off, like the verifier's prefill); a round is timed
        # from its Propose call to its verdict (update)
        self._model_timings: list[tuple[float, float]] = []
        self._timing: tuple[float, float] | None = None  # the model round under verification: (started, priced)
        self._stream_started: float | None = None  # the stretch without drafts under way: when it was asked for
        self._stream_timings: deque[float] = deque(maxlen=STREAM_WINDOW)  # seconds a token, per stretch
        self._misses = 0  # suffix calls in a row that found nothing to draft (the wait before the next one doubles)
        self._unsynced = 0  # tokens committed since the suffix drafter's last call
        # The first round leaves the model out: its session would prefill the prompt before the verifier's prefill
        # could start, and the first token would wait for both.
        self._first_round = True

    def model_overhead_s(self) -> float | None:
        """Seconds the model's recent rounds took beyond what `model_costs` price them at (the lower median over the
        last OVERHEAD_WINDOW, catching up included, at least 0, at most MAX_OVERHEAD_S); None until
        MIN_OVERHEAD_ROUNDS rounds measured it."""
        recent = self._model_timings[-OVERHEAD_WINDOW:]
        if self.model_costs is None or len(recent) < MIN_OVERHEAD_ROUNDS:
            return None
        return min(max(statistics.median_low(took - priced for took, priced in recent), 0.0), MAX_OVERHEAD_S)

    def model_k(self, k: int) -> int:
        """How many tokens the draft model should draft in a round of at most k: the best by its costs at the
        acceptance its rounds have had (the prior's until there are some), each round priced with the overhead its
        rounds measured (what earlier generations measured until then)."""
        costs = self.priced_model()
        return k if costs is None else costs.best_k(k)

    def acceptance(self, source: str) -> float:
        """A source's per-token acceptance over its recent rounds, with PRIOR_WEIGHT pseudo-drafts of its prior (the
        workers' for the model, SUFFIX_PRIOR_ACCEPTANCE for the suffix drafter).

        The model's is the geometric model's maximum-likelihood estimate, as the cost policy's (measured_acceptance):
        each accepted draft a success, each round that stopped before its last draft one failure. The drafts after
        the first rejected one were never judged: counted as rejected, one early miss in a round of 6 read as six, and
        on the real pair (Zen 4, code) a 6-draft round rejected at its first token, after 12 drafts all accepted, put
        the model off for 20 tokens, streamed at 41-48 ms each where its rounds committed one every 32-35 ms.
        The suffix drafter's: accepted over drafted, over its drafts shorter than their round's k (the ones judged
        against the model; a long match is another matter). A suffix match is right or wrong as a whole (a wrong one
        mostly from its first token), so its share of drafts accepted is its matches' hit rate, and the geometric
        E(k) at it stays below what its right matches commit: the suffix drafter is not overrated against the
        model."""
        verdicts = self._verdicts[source]
        accepted = sum(a for _, a in verdicts)
        if source == MODEL and self.model_costs is not None:
            prior = self.model_costs.acceptance
            successes = accepted + PRIOR_WEIGHT * prior
            failures = sum(a < d for d, a in verdicts) + PRIOR_WEIGHT * (1.0 - prior)
            return successes / max(successes + failures, 1e-9)
        return (accepted + PRIOR_WEIGHT * SUFFIX_PRIOR_ACCEPTANCE) / (sum(d for d, _ in verdicts) + PRIOR_WEIGHT)

    def priced_model(self) -> CostEstimate | None:
        """The model's costs at its measured acceptance, each round priced with its measured overhead (what earlier
        generations measured until then); None without costs."""
        if self.model_costs is None:
            return None
        costs = self.model_costs.at_acceptance(self.acceptance(MODEL))
        overhead = self.model_overhead_s() if self.timed else None
        if overhead is None and self.timed:
            overhead = self.learned_overhead_s
        streamed = self.streamed_token_s() if self.timed else None
        if streamed is not None:
            costs = replace(costs, streamed_token_s=streamed)
        return costs if overhead is None else costs.with_draft_overhead(overhead)

    def streamed_token_s(self) -> float | None:
        """Seconds a token of this generation's recent stretches without drafts took (the lower median over the last
        STREAM_WINDOW), what the model's rounds are weighed against; None until MIN_OVERHEAD_ROUNDS stretches
        measured it (then `model_costs.streamed_token_s`, what earlier generations' streams took, where the caller
        learned it; else the verifier's v(0)). The model's rounds are priced at what they measure (their overhead),
        so target-only decoding is too: on the real pair (Zen 4) the hybrid's streamed tokens took 46 ms (median;
        short stretches, each a stream of its own) against the 38.6 ms v(0) the verifier's probe measured on an idle
        machine, while its model rounds were priced with the 14-22 ms a round they took beyond their costs. One-draft
        rounds at 70% acceptance, a token every 38 ms against 46 streamed, then looked no faster than target-only."""
        if len(self._stream_timings) < MIN_OVERHEAD_ROUNDS:
            return None
        return statistics.median_low(self._stream_timings)

    def suffix_draft_pays(self, suffix_tokens: int, model_k: int) -> bool:
        """Whether verifying the suffix drafter's draft of `suffix_tokens` commits tokens at least as fast as the
        alternative would: a model round of model_k, or target-only decoding where model_k is 0, each at its source's
        measured acceptance. The suffix draft costs only its verify (it is already drafted); without the model's costs
        it always wins."""
        costs = self.priced_model()
        if costs is None:
            return True
        suffix = costs.at_acceptance(self.acceptance(SUFFIX))
        suffix_rate = suffix.expected_tokens(suffix_tokens) / max(
            suffix.verify_round_trip_s + suffix.verify_s(suffix_tokens), 1e-9)
        return suffix_rate >= costs.tokens_per_s(model_k)

    def _model_probe_due(self, k: int) -> bool:
        """The model is off: whether to ask it this round. Where its acceptance put it off (its opening rounds
        may have been unlucky, or the text changed: prose, then code), once it has been off for a while, each probe
        rejected outright doubling the wait; and where the prior's acceptance keeps it off from the start, its first
        round is a probe: the prior is a guess, and what the model is worth on this text only its rounds can tell.
        Never where its costs rule it out (no k pays even at PLAUSIBLE_ACCEPTANCE)."""
        wait = min(MODEL_PROBE_TOKENS << self._failed_probes, MODEL_PROBE_MAX_TOKENS)
        costs = self.priced_model()
        due = self.model_rounds == 0 or self._without_model >= wait
        return due and costs is not None and costs.could_pay(k, PLAUSIBLE_ACCEPTANCE)

    def _round_priced_s(self, asked: int, drafted: int) -> float:
        """What `model_costs` price a model round at, whole: `asked` drafts, then the verify of the `drafted` ones."""
        costs = self.model_costs
        return (costs.draft_round_trip_s + asked * costs.draft_s_per_token + costs.verify_round_trip_s
                + costs.verify_s(drafted))

    def _opening_tokens(self) -> int:
        """What opening the model's session would prefill (LazyDraftSource.opening_tokens); 0 for a model source
        that does not say (one already open)."""
        opening_tokens = getattr(self.model, "opening_tokens", None)
        return opening_tokens() if opening_tokens is not None else 0

    def opening_pays(self, model_k: int) -> bool:
        """Whether the model's session, not yet open in this generation, may open for a round of model_k drafts:
        where what its rounds save over the alternative (streaming the target, at its measured price) in the tokens
        left of the budget at least pays for prefilling what the drafter lacks of the model's window
        (LazyDraftSource.opening_tokens) at `opening_s_per_token`. The budget is what the generation may still make,
        an answer may stop sooner: the gate is a bound, refusing only openings that cannot pay. On the real pair
        (2-core Zen 4, `coordinator bench-serve`) a turn's opening prefilled the last answer and the new question
        (about 150 tokens, 0.4 s), or a whole 350-400 token window where a new document came or the window moved on
        (1.0-1.2 s: 25-30 streamed tokens), in turns of 20-130 tokens where the model's rounds saved a few ms a
        token at most: prose conversations ran 0.90-0.96x target-only, questions over a document 0.88x."""
        if self.token_budget is None or self.opening_s_per_token is None or model_k < 1:
            return True
        tokens = self._opening_tokens()
        costs = self.priced_model()
        if not tokens or costs is None:
            return True
        saved_a_token = 1.0 / costs.tokens_per_s(0) - 1.0 / max(costs.tokens_per_s(model_k), 1e-9)
        left = self.token_budget - self._committed
        return saved_a_token * left >= tokens * self.opening_s_per_token

    def probe_k(self, k: int) -> int:
        """A probe's draft length: the k that pays best at PLAUSIBLE_ACCEPTANCE (at least 1), what the model would
        draft on text it follows. A probe judges the model from its prior and the probe's verdict alone, and a
        one-draft probe said too little to move it: on the real pair (Zen 4, code) the model's first round, priced
        off at the prior's 70%, and every probe after it drafted one token, all accepted, and each left the estimate
        at 76%, still off; those generations streamed at 41-48 ms a token where fixed k = 2 committed one every
        33 ms. Two accepted drafts move it to 80%, where the model pays; one rejected first draft still puts it off."""
        costs = self.priced_model()
        return 1 if costs is None else max(costs.at_acceptance(PLAUSIBLE_ACCEPTANCE).best_k(k), 1)

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        self._model_draft = self._suffix_draft = None
        # Not timed: a round without a verdict (it failed), and, pipelined, a round during whose verify the next
        # round's draft was bet on (this call, with `after`): the round then took the bet's time too.
        self._timing = self._stream_started = self._opening = None
        draft = self.suffix.propose(k, after)
        self._unsynced = 0
        first_round, self._first_round = self._first_round and not after, False
        model_k = self.model_k(k) if self.model is not None and not self._off_until_probe and not first_round else 0
        probing = model_k == 0 and self.model is not None and not first_round and self._model_probe_due(k)
        if probing:  # the text since its last round is new to it: judged afresh, from its prior, as at the start
            self._verdicts[MODEL].clear()
            self._off_until_probe = False
            model_k = max(self.model_k(k), self.probe_k(k))
        if model_k and not self.opening_pays(model_k):  # the model's session would cost more to open than it saves
            self.openings_declined += 1
            model_k, probing = 0, False
        full = len(draft.tokens) >= k  # a match long enough to fill the round: trusted as it is
        # Against the model, a suffix draft needs min_suffix_tokens; against target-only decoding, any length.
        long_enough = model_k == 0 or len(draft.tokens) >= self.min_suffix_tokens
        if draft.tokens and (full or long_enough and self.suffix_draft_pays(len(draft.tokens), model_k)):
            self.suffix_rounds += 1
            self._misses = 0
            if not after and not full:
                self._suffix_draft = draft.tokens
            return replace(draft, source=SUFFIX)
        if first_round and self.model is not None:  # the model's turn comes next round: not the suffix drafter's miss
            return Draft()
        if model_k == 0:
            self._misses += 1
            self._stream_started = None if after else self._clock()
            return Draft(wait_tokens=min(1 << (self._misses - 1), MAX_WAIT_TOKENS))
        if probing:
            log.debug("hybrid: probing the draft model after %d tokens without it", self._without_model)
        self._probing = probing
        self._without_model = 0
        self.model_rounds += 1
        started = self._clock()
        opening = self._opening_tokens()
        draft = self.model.propose(model_k, after)
        # Its time beyond a model round's: the opening's, a prefilled token (a few tokens would price the round's
        # overhead instead).
        if opening >= MIN_OPENING_MEASURED and not after and self.model_costs is not None:
            self._opening = (started, opening, len(draft.tokens))
        if not after:  # a pipelined bet is not this round's draft
            self._model_draft = draft.tokens
            # Every round is timed but the generation's first (its session's opening, measured as such): a round
            # after a suffix round or a stream first catches the model up on what they committed (a pass over
            # 2-30 tokens), and that is what a model round costs where the sources alternate. The lower median
            # prices the rounds the model mostly has: runs of model rounds where it follows the text, catch-ups where
            # it only fills the gaps between suffix rounds and streams.
            if self.model_rounds > 1 and self.model_costs is not None:
                self._timing = (started, self._round_priced_s(model_k, len(draft.tokens)))
        return replace(draft, source=MODEL)

    def update(self, committed: Sequence[int]) -> None:
        if self._opening is not None:  # the opening round's Propose and verify, less what a model round costs
            started, tokens, drafted = self._opening
            usual = self._round_priced_s(drafted, drafted)
            self.opening_measured_s_per_token = max(self._clock() - started - usual, 0.0) / tokens
            self._opening = None
        if self._timing is not None:  # the verdict of a timed model round: what it took, from its Propose call
            started, priced = self._timing
            self._model_timings.append((self._clock() - started, priced))
            self._timing = None
        if self._stream_started is not None and committed:  # a stretch without drafts: its seconds a token
            self._stream_timings.append((self._clock() - self._stream_started) / len(committed))
            self._stream_started = None
        # How much of the round's draft the target kept: the acceptance its source is judged by.
        for source, draft in ((MODEL, self._model_draft), (SUFFIX, self._suffix_draft)):
            if draft:
                accepted = 0
                while accepted < min(len(draft), len(committed)) and draft[accepted] == committed[accepted]:
                    accepted += 1
                accepted = min(accepted, len(committed) - 1)
                self._verdicts[source].append((len(draft), accepted))
                if source == MODEL:
                    self.model_drafted += len(draft)
                    self.model_accepted += accepted
                    if self._probing:
                        # A probe rejected outright puts the model off until the next. One that leaves the model
                        # priced off all the same failed too: either way the next probe waits twice as long. On
                        # the real pair (row-invariant build, Zen 4, prose) probes accepting a draft or two, too
                        # few for the model to pay against 32 ms streamed steps, came every 16 tokens: 11 model
                        # rounds in a 160-token answer, each catching the draft model up first, and 17% of the
                        # generation's time in Propose calls: 0.92x target-only.
                        brought_back = accepted > 0 and self.model_k(len(draft)) > 0
                        self._failed_probes = 0 if brought_back else self._failed_probes + 1
                        self._off_until_probe, self._probing = accepted == 0, False
        self._model_draft = self._suffix_draft = None
        self._without_model += len(committed)
        self._committed += len(committed)
        self._unsynced += len(committed)
        self.suffix.update(committed)
        if self.model is not None:
            self.model.update(committed)

    def end(self) -> None:
        """End both sessions; first bring the suffix drafter up to the whole output (a Propose of one token, its
        draft unused): what a session held when it ends is what its tree across requests learns."""
        try:
            if self._unsynced:
                self.suffix.propose(1)
        except Exception as e:  # noqa: BLE001 - best effort: the generation is over, its output already complete
            log.debug("the suffix drafter's last sync failed: %s", e)
        finally:
            for source in (self.suffix, self.model):
                if source is not None and hasattr(source, "end"):
                    source.end()
