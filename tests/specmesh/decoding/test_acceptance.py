"""Tests for specmesh.decoding.sampling and specmesh.decoding.acceptance.

The statistical tests are fully seeded (trial i uses seed i), so on a given
platform they are deterministic and cannot flake.  The statistic is Pearson's
chi-square of the emitted-token counts against the target's warped
distribution p, compared with the alpha = 0.001 critical value for
(non-zero cells - 1) degrees of freedom; a count in a cell where p is exactly
0 fails outright.  A test that deliberately breaks the procedure checks that
the statistic has the power to notice.
"""

from __future__ import annotations

from array import array

import pytest
import torch

from specmesh.decoding.acceptance import Verdict, decide, greedy_verdict, sampled_verdict
from specmesh.decoding.sampling import (
    SamplingParams,
    SparseDist,
    Stream,
    draft_sample,
    sample_index,
    target_sample,
    truncate_distribution,
    uniform,
    warp_probs,
)

F64 = torch.float64

# Upper 0.001 quantiles of the chi-square distribution (standard tables);
# cross-checked against the regularised incomplete gamma function below.
CHI2_CRIT_001 = {
    1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
    8: 26.124, 9: 27.877, 10: 29.588, 35: 66.619, 41: 74.745,
}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # Thousands of tiny tensor ops: with the 2 shared cores, intra-op thread
    # hand-offs cost far more than the maths.  Restore for other test files.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# --------------------------------------------------------------------------
# Statistical helpers


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom over the cells where p > 0.

    A count in a cell with p == 0 is an impossible outcome: statistic = inf.
    """
    counts = counts.to(F64).flatten()
    p = expected_probs.to(F64).flatten()
    n = float(counts.sum())
    if bool((counts[p == 0] > 0).any()):
        return float("inf"), 0
    live = p > 0
    expected = n * p[live]
    # The chi-square approximation needs >= 5 expected per cell; guard the test design.
    assert float(expected.min()) >= 5.0, "test design: too few expected counts in some cell"
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    return stat, int(live.sum()) - 1


def assert_distributed_as(counts: torch.Tensor, p: torch.Tensor) -> None:
    stat, df = chi_square(counts, p)
    print(f"chi2={stat:.2f} df={df} crit={CHI2_CRIT_001.get(df)} n={int(counts.sum())}")
    assert stat < CHI2_CRIT_001[df], f"chi2={stat:.1f} >= {CHI2_CRIT_001[df]} (df={df}); counts={counts.tolist()}"


def generate(seed, n_tokens, k, params, draft_logits_fn, target_logits_fn, start=7,
             max_entries=256, verdict_fn=sampled_verdict):
    """A minimal speculative decoding loop: rounds of k drafts then one verdict.

    The *_logits_fn take the generated prefix (list of tokens after the prompt)
    and return logits [V], so tests can make p and q context-dependent.
    """
    out: list[int] = []
    while len(out) < n_tokens:
        pos = start + len(out)  # absolute position of the next token
        drafts, dists = [], []
        for j in range(k):
            d = draft_sample(draft_logits_fn(out + drafts), params, seed, pos + j, max_entries=max_entries)
            drafts.append(d.token)
            dists.append(d.dist)
        rows = torch.stack([target_logits_fn(out + drafts[:i]) for i in range(k + 1)])
        v = verdict_fn(drafts, dists, rows, params, seed, pos)
        out += drafts[: v.accepted] + [v.next_token]
    return out[:n_tokens]


def first_token_counts(n, params, q_logits, p_logits, max_entries=256, verdict_fn=sampled_verdict, start=7):
    """Counts of the first emitted token over seeds 0..n-1, one k=1 round each."""
    rows = torch.stack([p_logits, p_logits])  # p does not depend on context here
    counts = [0] * p_logits.numel()
    for seed in range(n):
        d = draft_sample(q_logits, params, seed, start, max_entries=max_entries)
        v = verdict_fn([d.token], [d.dist], rows, params, seed, start)
        counts[d.token if v.accepted else v.next_token] += 1
    return torch.tensor(counts, dtype=F64)


# p (V = 8): a spread target with two unlikely tokens (6, 7: p ~ 0.0075, 0.0045).
P_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -2.0, -2.5], dtype=F64)
# q concentrated exactly where p is tiny: ~99% of q on tokens 6 and 7.
Q_FAR = torch.tensor([-3.0, -3.0, -3.0, -3.0, -3.0, -3.0, 3.0, 2.5], dtype=F64)
Q_FLIP = P_LOGITS.flip(0)
# Overlaps p only partly after the top-k/top-p warpers (q keeps 6, 2, 1, 4;
# p keeps 0..3), so accepts, rejects and q-mass outside p's support all occur.
Q_MIX = torch.tensor([0.0, 1.5, 2.0, -1.0, 1.0, 0.5, 2.5, -0.5], dtype=F64)
WARPED = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
T1 = SamplingParams(temperature=1.0)


def test_chi2_table_matches_incomplete_gamma():
    # P(X > c) = Q(df/2, c/2) for X ~ chi2(df); each tabulated c must give 0.001.
    for df, c in CHI2_CRIT_001.items():
        tail = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=F64), torch.tensor(c / 2, dtype=F64)))
        assert tail == pytest.approx(0.001, rel=0.01), df


# --------------------------------------------------------------------------
# SamplingParams / uniform / warp_probs


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_greedy():
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.5, top_k=3, top_p=0.5).is_greedy


def test_uniform_deterministic_in_range_and_stream_separated():
    us = [uniform(seed, pos, s) for seed in (0, 1, 2**64 - 1) for pos in range(50) for s in Stream]
    assert all(0.0 <= u < 1.0 for u in us)
    assert us == [uniform(seed, pos, s) for seed in (0, 1, 2**64 - 1) for pos in range(50) for s in Stream]
    assert len(set(us)) == len(us)  # seeds, positions and streams all matter
    many = torch.tensor([uniform(3, pos, Stream.ACCEPT) for pos in range(20_000)], dtype=F64)
    assert abs(float(many.mean()) - 0.5) < 0.01  # sd of the mean ~0.002
    # 10 equal bins, chi2 against uniform.
    assert_distributed_as(torch.bincount((many * 10).long(), minlength=10), torch.full((10,), 0.1, dtype=F64))


@pytest.mark.parametrize("seed, pos", [(-1, 0), (2**64, 0), (0, -1), (1.5, 0), (0, 2**64)])
def test_uniform_validates(seed, pos):
    with pytest.raises(ValueError):
        uniform(seed, pos, Stream.DRAFT)


def test_warp_temperature_and_dtype():
    logits = torch.tensor([1.0, 2.0, 3.0, -1.0], dtype=torch.bfloat16)
    p = warp_probs(logits, SamplingParams(temperature=2.0))
    assert p.dtype == F64
    torch.testing.assert_close(p, torch.softmax(logits.to(F64) / 2.0, -1))
    assert p.sum().item() == pytest.approx(1.0)


def test_warp_top_k_keeps_ties_and_renormalises():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, 2.0], dtype=F64)
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    # 2nd-largest value (2.0) is tied: both copies stay, as in HF.
    assert (p > 0).tolist() == [False, True, False, True, True]
    torch.testing.assert_close(p[[1, 3, 4]], torch.softmax(logits[[1, 3, 4]], -1))
    # top_k >= V is a no-op.
    torch.testing.assert_close(warp_probs(logits, SamplingParams(1.0, top_k=9)), torch.softmax(logits, -1))


def test_warp_top_p_smallest_set_and_keeps_one():
    probs = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
    logits = probs.log()
    kept = lambda top_p: (warp_probs(logits, SamplingParams(1.0, top_p=top_p)) > 0).tolist()
    assert kept(0.5) == [False, True, False]  # 0.5 alone reaches 0.5
    assert kept(0.51) == [False, True, True]
    assert kept(0.81) == [True, True, True]
    assert kept(1e-9) == [False, True, False]  # always at least one
    p = warp_probs(logits, SamplingParams(1.0, top_p=0.6))
    torch.testing.assert_close(p, torch.tensor([0.0, 0.625, 0.375], dtype=F64))


def test_warp_greedy_one_hot_batched():
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 9.0, 1.0]])
    p = warp_probs(logits, SamplingParams())
    assert p.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]  # ties -> first index


def test_warp_batched_equals_rowwise():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(0.7, top_k=20, top_p=0.8)
    batched = warp_probs(logits, params)
    for i in range(4):
        assert torch.equal(batched[i], warp_probs(logits[i], params))


@pytest.mark.parametrize("as_tensor", [True, False])  # tensor and host-sequence paths
def test_sample_index_inverse_cdf_and_zero_weights(as_tensor):
    wrap = (lambda v: torch.tensor(v, dtype=F64)) if as_tensor else tuple
    w = wrap([0.0, 1.0, 0.0, 3.0, 0.0])  # unnormalised
    assert sample_index(w, 0.0) == 1
    assert sample_index(w, 0.2499) == 1
    assert sample_index(w, 0.25) == 3
    assert sample_index(w, 1.0 - 2**-53) == 3  # never the trailing zero
    for bad, u in [([0.0, 0.0], 0.5), ([1.0, -0.5], 0.5), ([1.0], 1.0), ([1.0], -0.1)]:
        with pytest.raises(ValueError):
            sample_index(wrap(bad), u)


def test_sample_index_paths_agree():
    g = torch.Generator().manual_seed(3)
    w = torch.rand(300, generator=g, dtype=F64) * (torch.rand(300, generator=g) > 0.5)
    for j in range(500):
        u = uniform(0, j, Stream.DRAFT)
        assert sample_index(w, u) == sample_index(tuple(w.tolist()), u)


# --------------------------------------------------------------------------
# SparseDist / truncate_distribution


def test_sparse_dist_rounds_to_float32_and_normalises():
    d = SparseDist((4, 1), (0.1, 0.3))
    assert d.probs == tuple(array("f", [0.1, 0.3]).tolist())
    assert d.prob_of(4) == d.probs[0] / (d.probs[0] + d.probs[1])
    assert d.prob_of(2) == 0.0
    dense = d.dense(6)
    assert dense.dtype == F64 and dense.sum().item() == pytest.approx(1.0)
    assert dense[4].item() == d.prob_of(4) and dense[1].item() == d.prob_of(1)
    with pytest.raises(ValueError):
        d.dense(4)  # token 4 out of range
    for ids, probs in [((1, 1), (0.5, 0.5)), ((1,), (0.5, 0.5)), ((), ()), ((1,), (-0.1,)), ((1,), (0.0,))]:
        with pytest.raises(ValueError):
            SparseDist(ids, probs)


def test_truncate_distribution_bounds_coverage_and_float32():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(1000, generator=g, dtype=F64) * 2, -1)
    d = truncate_distribution(probs, top_p=0.999, max_entries=10)
    assert len(d.token_ids) == 10  # capped
    assert list(d.token_ids) == torch.topk(probs, 10).indices.tolist()

    d = truncate_distribution(probs, top_p=0.9, max_entries=1000)
    kept = probs[list(d.token_ids)]
    assert kept.sum().item() >= 0.9  # covers top_p ...
    assert kept.sum().item() - kept.min().item() < 0.9  # ... with the smallest such set
    assert kept.min().item() >= probs[[i for i in range(1000) if i not in set(d.token_ids)]].max().item()
    assert all(array("f", [v]).tolist()[0] == v for v in d.probs)  # float32-exact
    # Tokens with zero probability are never shipped; at least one is always kept.
    d = truncate_distribution(torch.tensor([0.0, 1.0, 0.0], dtype=F64), top_p=1.0)
    assert d.token_ids == (1,)
    assert len(truncate_distribution(probs, top_p=1e-9).token_ids) == 1


def test_draft_sample_greedy_and_sampled():
    logits = torch.tensor([0.5, 2.0, -1.0], dtype=F64)
    assert draft_sample(logits, SamplingParams(), 0, 0) == draft_sample(logits, SamplingParams(), 0, 0)
    g = draft_sample(logits, SamplingParams(), 0, 0)
    assert g.token == 1 and g.dist is None
    s = draft_sample(logits, T1, 5, 3)
    assert s == draft_sample(logits, T1, 5, 3)  # deterministic
    assert s.token in s.dist.token_ids and s.dist.prob_of(s.token) > 0


# --------------------------------------------------------------------------
# Greedy verdicts


def _rows(argmaxes, vocab=5):
    rows = torch.zeros(len(argmaxes), vocab)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1.0
    return rows


def test_greedy_all_accepted_gives_bonus():
    assert greedy_verdict([3, 1, 4], _rows([3, 1, 4, 2])) == Verdict(3, 2)


def test_greedy_mismatch_first_and_middle():
    assert greedy_verdict([3, 1, 4], _rows([0, 1, 4, 2])) == Verdict(0, 0)
    assert greedy_verdict([3, 1, 4], _rows([3, 2, 4, 2])) == Verdict(1, 2)


def test_greedy_k0_and_decide_dispatch():
    assert greedy_verdict([], _rows([4])) == Verdict(0, 4)
    assert decide([3], None, _rows([3, 1]), SamplingParams(), 0, 0) == Verdict(1, 1)


def test_decide_validates_shapes():
    p = T1
    with pytest.raises(ValueError, match="k\\+1"):
        decide([1, 2], None, _rows([1, 2]), SamplingParams(), 0, 0)
    with pytest.raises(ValueError, match="k\\+1"):
        decide([1], [SparseDist((1,), (1.0,))], torch.zeros(3, 5), p, 0, 0)
    with pytest.raises(ValueError, match="SparseDist"):
        decide([1, 2], [SparseDist((1,), (1.0,))], torch.zeros(3, 5), p, 0, 0)
    with pytest.raises(ValueError, match="SparseDist"):
        decide([1], None, torch.zeros(2, 5), p, 0, 0)
    with pytest.raises(ValueError, match="out of range"):
        decide([7], [SparseDist((7,), (1.0,))], torch.zeros(2, 5), p, 0, 0)


# --------------------------------------------------------------------------
# Sampled verdicts: deterministic properties


def test_k0_equals_target_sample():
    params = SamplingParams(0.8, top_k=6, top_p=0.95)
    for seed in range(200):
        v = decide([], [], P_LOGITS[None], params, seed, 11)
        assert v == Verdict(0, target_sample(P_LOGITS, params, seed, 11))


def test_token_outside_q_is_rejected():
    # q(x) == 0 means x could not have been drawn from q: must reject even
    # though p(x) is large; the correction then comes from p - q.
    q = SparseDist((1,), (1.0,))
    for seed in range(50):
        v = sampled_verdict([0], [q], torch.stack([P_LOGITS, P_LOGITS]), T1, seed, 0)
        assert v.accepted == 0 and v.next_token != 1


def test_large_vocab_smoke():
    vocab, k = 151_936, 4
    g = torch.Generator().manual_seed(0)
    target = torch.randn(k + 1, vocab, generator=g).to(torch.bfloat16)
    params = SamplingParams(0.9, top_k=50, top_p=0.95)
    drafts = [draft_sample(target[i], params, 1, 100 + i) for i in range(k)]
    v = decide([d.token for d in drafts], [d.dist for d in drafts], target, params, 1, 100)
    # q was drawn from the same warped logits, so essentially all accept.
    assert v.accepted == k
    assert warp_probs(target[k], params)[v.next_token] > 0


# --------------------------------------------------------------------------
# Sampled verdicts: statistical exactness (emitted tokens ~ p)


@pytest.mark.parametrize(
    "q_logits, params, n",
    [
        # Trial counts are sized to the 2 shared CPU cores (~0.5 ms/trial).
        # The hard case gets the most: at N = 10000 the subtle bug tested
        # below (resampling from p) gives E[chi2] ~ 125 against 24.3.
        pytest.param(Q_FAR, T1, 10_000, id="q-far-from-p"),
        pytest.param(Q_FLIP, T1, 4_000, id="q-reversed"),
        pytest.param(P_LOGITS, T1, 3_000, id="q-equals-p"),  # ~always accepts
        pytest.param(Q_MIX, WARPED, 5_000, id="warped-topk-topp"),
    ],
)
def test_first_token_distributed_as_p(q_logits, params, n):
    counts = first_token_counts(n, params, q_logits, P_LOGITS)
    assert_distributed_as(counts, warp_probs(P_LOGITS, params))


def test_truncated_q_still_exact():
    # q keeps only its 2 most likely tokens of 8; the other 6 tokens must come
    # entirely from the residual p - q.
    assert len(draft_sample(Q_FLIP, T1, 0, 0, max_entries=2).dist.token_ids) == 2
    counts = first_token_counts(5_000, T1, Q_FLIP, P_LOGITS, max_entries=2)
    assert_distributed_as(counts, warp_probs(P_LOGITS, T1))


# Context-dependent target and drafter for the joint test: the second token's
# distributions are rotated by the first token (more demanding than a fixed p).
V2 = 6
P2_FIRST = torch.tensor([1.0, 0.6, 0.2, -0.2, 0.4, 0.0], dtype=F64)
P2_SECOND = torch.tensor([0.8, -0.4, 0.3, 0.0, 0.5, -0.3], dtype=F64)
Q2_FIRST = torch.tensor([-1.0, 0.0, 1.5, 0.3, -0.5, 1.0], dtype=F64)
Q2_SECOND = torch.tensor([1.2, 1.0, -1.0, -1.5, 0.0, 0.2], dtype=F64)


def _target2(prefix):
    return P2_FIRST if not prefix else P2_SECOND.roll(prefix[0])


def _draft2(prefix):
    return Q2_FIRST if not prefix else Q2_SECOND.roll(2 * prefix[0])


@pytest.mark.parametrize("k", [1, 2])  # k=1 emits the bonus as token 2; k=2 accepts 2 drafts
def test_first_two_tokens_jointly_distributed_as_p(k):
    n = 3_000  # 36 cells, smallest expected count ~24
    counts = torch.zeros(V2, V2, dtype=F64)
    for seed in range(n):
        a, b = generate(seed, 2, k, T1, _draft2, _target2)
        counts[a, b] += 1
    p_first = warp_probs(P2_FIRST, T1)
    joint = torch.stack([p_first[a] * warp_probs(_target2([a]), T1) for a in range(V2)])
    assert_distributed_as(counts, joint)


# --------------------------------------------------------------------------
# The statistic has power: deliberately wrong procedures are caught.


def _always_accept(drafts, dists, rows, params, seed, pos):
    return Verdict(len(drafts), target_sample(rows[-1], params, seed, pos + len(drafts)))


def _resample_from_p(drafts, dists, rows, params, seed, pos):
    # Classic bug: on rejection draw from p instead of the residual max(0, p - q).
    v = sampled_verdict(drafts, dists, rows, params, seed, pos)
    if v.accepted < len(drafts):
        v = Verdict(v.accepted, target_sample(rows[v.accepted], params, seed, pos + v.accepted))
    return v


# Expected chi2 = df + n * sum((p_bug - p)^2 / p) on the q-far case: always
# accepting emits ~q (80.6 per trial: ~160000 at n = 2000); resampling from p
# (0.0118 per trial: ~54 at n = 4000) against the critical value 24.3.
@pytest.mark.parametrize("wrong, n", [(_always_accept, 2_000), (_resample_from_p, 4_000)])
def test_wrong_procedures_are_detected(wrong, n):
    counts = first_token_counts(n, T1, Q_FAR, P_LOGITS, verdict_fn=wrong)
    stat, df = chi_square(counts, warp_probs(P_LOGITS, T1))
    print(f"wrong procedure: chi2={stat:.2f} df={df} crit={CHI2_CRIT_001[df]} n={n}")
    assert stat > CHI2_CRIT_001[df], stat


# --------------------------------------------------------------------------
# Drafting across tokenizers (coordinator/translation.py): the drafter samples from q over ITS vocabulary, the token
# is translated into the target's (many drafter tokens to one target token, some to tokens p finds unlikely), and the
# verifier gets it as a deterministic proposal, q = 1 on the translated token. Emitted tokens must still be ~p.

DRAFTER_VOCAB_LOGITS = torch.tensor([2.5, 2.0, 1.0, 0.5, 0.0, -0.5, 1.5, -1.0, 0.3, -2.0, 2.2, 0.8], dtype=F64)
TO_TARGET = [6, 7, 6, 0, 1, 2, 3, 4, 5, 6, 7, 0]  # drafter token -> target token


def _translated_target(prefix):
    return P_LOGITS if not prefix else P_LOGITS.roll(prefix[-1])


def _drafter_own_vocab(prefix):
    return DRAFTER_VOCAB_LOGITS if not prefix else DRAFTER_VOCAB_LOGITS.roll(3 * prefix[-1])


def translated_drafts(n_tokens, seed, k, start=7):
    """A minimal loop over translated drafts, p and q depending on the previous token."""
    out: list[int] = []
    while len(out) < n_tokens:
        pos = start + len(out)
        drafts = []
        for j in range(k):  # the drafter's own randomness, keyed by position like a real drafter's
            d = draft_sample(_drafter_own_vocab(out + drafts), T1, seed, pos + j)
            drafts.append(TO_TARGET[d.token])
        dists = [SparseDist((x,), (1.0,)) for x in drafts]
        rows = torch.stack([_translated_target(out + drafts[:i]) for i in range(k + 1)])
        v = sampled_verdict(drafts, dists, rows, T1, seed, pos)
        out += drafts[:v.accepted] + [v.next_token]
    return out[:n_tokens]


def _deterministic(x, drafter_draw):
    return SparseDist((x,), (1.0,))


def _drafters_own_q(x, drafter_draw):
    # Wrong: the drafter's probability of its own token, as if it were q(x) (the rest of q on the next token).
    qx = drafter_draw.dist.prob_of(drafter_draw.token)
    return SparseDist((x, (x + 1) % P_LOGITS.numel()), (qx, 1.0 - qx))


def translated_first_token_counts(n, dist_for):
    rows = torch.stack([P_LOGITS, P_LOGITS])
    counts = torch.zeros(P_LOGITS.numel(), dtype=F64)
    for seed in range(n):
        d = draft_sample(DRAFTER_VOCAB_LOGITS, T1, seed, 7)
        x = TO_TARGET[d.token]
        v = sampled_verdict([x], [dist_for(x, d)], rows, T1, seed, 7)
        counts[x if v.accepted else v.next_token] += 1
    return counts


def test_translated_deterministic_proposals_emit_p():
    assert_distributed_as(translated_first_token_counts(6_000, _deterministic), warp_probs(P_LOGITS, T1))


def test_translated_drafts_with_the_drafters_own_q_are_detected():
    # Power: keeping the drafter's q for a translated token biases the output (chi2 ~1300 here against 24.3).
    stat, df = chi_square(translated_first_token_counts(6_000, _drafters_own_q), warp_probs(P_LOGITS, T1))
    assert stat > CHI2_CRIT_001[df], stat


@pytest.mark.parametrize("k", [1, 2])
def test_translated_deterministic_proposals_jointly_emit_p(k):
    n = 4_000
    p_first = warp_probs(P_LOGITS, T1)
    joint = torch.stack([p_first[a] * warp_probs(_translated_target([a]), T1) for a in range(P_LOGITS.numel())])
    counts = torch.zeros_like(joint)
    for seed in range(n):
        a, b = translated_drafts(2, seed, k=k)
        counts[a, b] += 1
    # 64 cells, some expecting < 1 count: the rare ones are pooled into one cell that expects >= 5.
    rare = joint * n < 5
    pooled_counts = torch.cat([counts[~rare], counts[rare].sum().reshape(1)])
    pooled_p = torch.cat([joint[~rare], joint[rare].sum().reshape(1)])
    assert_distributed_as(pooled_counts, pooled_p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_greedy_argmax_is_torch_argmax_ties_and_nan_included(dtype):
    """The numpy fast path (CPU float32/float64) picks what torch.argmax picks: the first maximum, the first NaN."""
    from specmesh.decoding.sampling import greedy_argmax

    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (6, 50), generator=gen).to(dtype)  # small integers: many ties
    logits[2, 7] = logits[2, 30] = float("nan")
    logits[4] = 1.0
    assert greedy_argmax(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_argmax(logits.t()) == logits.t().argmax(dim=-1).tolist()  # strided rows
    assert all(greedy_argmax(row) == int(torch.argmax(row)) for row in logits)
    assert greedy_argmax(logits[2]) == 7
