"""mmgrpo.stats: exact McNemar, sign and Wilcoxon signed-rank p-values against values worked out by hand."""

import itertools

import numpy as np
import pytest

from mmgrpo.stats import binom_two_sided, mcnemar_exact, paired_test, sign_test, wilcoxon_signed_rank


@pytest.mark.parametrize(
    "b, c, expected",
    [
        # McNemar 1947 / Agresti (2013) 11.1.4, exact form: p = 2 * sum_{i <= min(b,c)} C(b+c, i) / 2^(b+c), capped at 1
        (0, 5, 2 * 1 / 32),  # n=5: P(X<=0) = 1/32 -> 0.0625
        (5, 0, 2 * 1 / 32),  # symmetric in b and c
        (1, 9, 2 * (1 + 10) / 1024),  # n=10: P(X<=1) = (C(10,0)+C(10,1))/1024 = 11/1024 -> 0.021484375
        (2, 8, 2 * (1 + 10 + 45) / 1024),  # P(X<=2) = 56/1024 -> 0.109375
        (3, 3, 1.0),  # n=6: 2 * (1+6+15+20)/64 = 84/64 > 1 -> capped at 1
        (0, 0, 1.0),  # no discordant pair: no evidence either way
        (0, 12, 2 / 4096),  # n=12, all one way: 2 / 2^12 = 0.00048828125
    ],
)
def test_mcnemar_exact_small_n(b, c, expected):
    assert mcnemar_exact(b, c) == pytest.approx(expected, rel=1e-12)


def test_binomial_rejects_impossible_counts():
    with pytest.raises(ValueError, match="0 <= k <= n"):
        binom_two_sided(4, 3)


def test_sign_test_drops_zeros():
    # [1]*6 + [-1] + [0]: the zero is dropped, n=7 with 1 negative: 2 * (C(7,0)+C(7,1)) / 128 = 16/128 = 0.125
    assert sign_test([1, 1, 1, 1, 1, 1, -1, 0]) == pytest.approx(0.125, rel=1e-12)
    assert sign_test([0.0, 0.0]) == 1.0


@pytest.mark.parametrize(
    "diffs, w_plus, p",
    [
        # Wilcoxon 1945; two-sided exact p = 2 min(P(W+ <= w), P(W+ >= w)), 2^n equally likely sign patterns
        ([1, 2, 3, 4, 5], 15.0, 2 / 32),  # ranks 1..5 all positive: only the full set sums to 15 -> 1/32 per tail
        ([-1, 2, 3, 4, 5], 14.0, 4 / 32),  # W+ = 14: sums >= 14 are {1..5}=15 and {2..5}=14 -> 2/32 per tail
        # |d| = .1 .2 .3 .5 .7 .9 -> ranks 1..6; negatives .2 (rank 2) and .1 (rank 1): W- = 3, W+ = 21 - 3 = 18.
        # P(W+ >= 18) = P(W- <= 3): subsets of {1..6} summing to <= 3 are {}, {1}, {2}, {3}, {1,2}: 5/64 -> p = 10/64
        ([0.5, -0.2, 0.3, 0.9, -0.1, 0.7], 18.0, 10 / 64),
        # ties: |d| = 1 1 2 2 2 -> midranks 1.5 1.5 4 4 4; the -1 gives W+ = 15 - 1.5 = 13.5. Sums of subsets of
        # {1.5, 1.5, 4, 4, 4} that are >= 13.5: all (15) and the two sets missing one 1.5 (13.5) -> 3/32 -> p = 6/32
        ([1, -1, 2, 2, 2], 13.5, 6 / 32),
        # zeros dropped (Wilcoxon's convention): six positive differences remain, W+ = 21, p = 2 / 64
        ([0, 0, 1, 2, 3, 4, 5, 6], 21.0, 2 / 64),
        ([0.0, 0.0, 0.0], 0.0, 1.0),  # nothing to rank
        ([0.3, -0.3], 1.5, 1.0),  # midranks 1.5, 1.5; W+ = 1.5 sits at the centre: both tails 3/4 -> 1
    ],
)
def test_wilcoxon_exact_worked_cases(diffs, w_plus, p):
    w, got = wilcoxon_signed_rank(diffs)
    assert w == w_plus
    assert got == pytest.approx(p, rel=1e-12)


def test_wilcoxon_normal_approximation():
    # ranks 1..5 all positive: E[W+] = 15/2 = 7.5, Var = sum(r^2)/4 = 55/4 = 13.75, z = 7.5/3.70810 = 2.022600,
    # p = 2 (1 - Phi(2.022600)) = 0.0431144 (statistics.NormalDist().cdf, no continuity correction)
    w, p = wilcoxon_signed_rank([1, 2, 3, 4, 5], exact_max=0)
    assert w == 15.0 and p == pytest.approx(0.04311444678307552, rel=1e-9)


def _brute_force_p(d: np.ndarray) -> float:
    """Enumerate all 2^n sign patterns of the midranks (the definition of the exact conditional test)."""
    from mmgrpo.stats import _midranks

    d = d[d != 0]
    r = _midranks(np.abs(d))
    w = r[d > 0].sum()
    sums = np.array([sum(ri for ri, s in zip(r, signs) if s) for signs in itertools.product((0, 1), repeat=d.size)])
    return min(1.0, 2 * min((sums <= w + 1e-9).mean(), (sums >= w - 1e-9).mean()))


def test_wilcoxon_matches_enumeration_with_ties_and_zeros():
    rng = np.random.default_rng(0)
    for _ in range(20):
        d = rng.integers(-3, 4, size=int(rng.integers(1, 11))).astype(np.float64) / 4  # many ties and zeros
        assert wilcoxon_signed_rank(d)[1] == pytest.approx(_brute_force_p(d), rel=1e-9, abs=1e-12)


def test_wilcoxon_exact_is_fast_at_the_cutoff():
    d = np.random.default_rng(1).normal(0.05, 1.0, size=400)
    w, p = wilcoxon_signed_rank(d)
    w_n, p_n = wilcoxon_signed_rank(d, exact_max=0)
    assert w == w_n and abs(p - p_n) < 0.01  # exact and normal agree closely at n = 400


def test_paired_test_picks_mcnemar_for_binary_and_wilcoxon_otherwise():
    real = [1, 1, 1, 1, 1, 0, 1, 0]
    blank = [0, 0, 0, 0, 1, 0, 1, 1]
    out = paired_test(real, blank)
    # n10 (real right only) = 4, n01 (blank right only) = 1: 2 * (C(5,0)+C(5,1))/32 = 12/32; diff (3-6)/8 = -0.375
    assert out["test"] == "mcnemar" and (out["n10"], out["n01"]) == (4, 1)
    assert out["p"] == pytest.approx(12 / 32) and out["diff"] == pytest.approx(-0.375)
    iou = paired_test([0.5, 0.4, 0.9], [0.1, 0.4, 0.2])
    # differences -0.4, 0, -0.7: the zero is dropped, W+ = 0 of n=2: 2 * 1/4 = 0.5
    assert iou["test"] == "wilcoxon" and iou["p"] == pytest.approx(0.5) and iou["nonzero"] == 2
    assert paired_test([], [])["n"] == 0
    with pytest.raises(ValueError, match="one score per unit"):
        paired_test([1, 0], [1])
