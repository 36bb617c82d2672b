"""Golden-value tests for mmgrpo.advantages' preference and shaped estimators: winrate, asymmetric, Gaussian G^2RPO
and NGRPO (the group-normalised ones are in test_advantages.py, whose helpers these share).

Expected numbers are worked by hand in float64 (working in the comments) or by naive per-group Python loops.
"""

import math
import statistics

import pytest
import torch
from test_advantages import SQRT_1_3, _grpo_loop, close, sample_input, t

from mmgrpo import advantages as A
from mmgrpo.advantages import compute, loss_mask

# ----------------------------------------------------------------------------- winrate (Pref-GRPO arXiv:2508.20751)


def test_winrate_golden_with_tie():
    # sample 0 beats 1, ties 2; sample 1 beats 2. Diagonal ignored (NaN allowed).
    # win rates: w0 = (1 + .5)/2 = .75, w1 = (0 + 1)/2 = .5, w2 = (.5 + 0)/2 = .25
    # mean .5, std(ddof=1) = sqrt((.0625 + 0 + .0625) / 2) = .25 -> adv [.25, 0, -.25] / (.25 + 1e-8)
    nan = float("nan")
    P = t([[[nan, 1, 0.5], [0, nan, 1], [0.5, 0, nan]]])
    a = 0.25 / (0.25 + 1e-8)
    close(compute("winrate", P), [[a, 0, -a]])
    close(compute("winrate", P, std="none"), [[0.25, 0, -0.25]])
    # every pair tied: equal win rates -> exactly 0
    assert torch.equal(compute("winrate", torch.full((1, 3, 3), 0.5)), torch.zeros(1, 3))


def test_winrate_matches_naive_loop():
    P = sample_input("winrate", B=3, G=5)
    wins = [[sum(P[b, i, j].item() for j in range(5) if j != i) / 4 for i in range(5)] for b in range(3)]
    close(compute("winrate", P), _grpo_loop(wins, "group", 1, 1e-8))


def test_winrate_validation():
    with pytest.raises(ValueError, match=r"square.*\(1, 3, 2\)"):
        compute("winrate", torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        compute("winrate", t([[[0, 2], [0, 0]]]))
    with pytest.raises(ValueError, match=r"1 NaN.*\(0, 0, 1\)"):
        compute("winrate", t([[[0, float("nan")], [0, 0]]]))
    assert torch.equal(compute("winrate", torch.zeros(2, 1, 1)), torch.zeros(2, 1))


# ----------------------------------------------------------------------------- asymmetric (A-GRAE arXiv:2602.05548)


@pytest.mark.parametrize("progress, pos, neg", [(0.0, 0.5, 1.0), (0.5, 0.75, 0.75), (1.0, 1.0, 0.5)])
def test_asymmetric_schedule(progress, pos, neg):
    # base grpo on [[1,0,0,1]] -> +-a, a = .5 / (sqrt(1/3) + 1e-6); pos .5 -> 1 and neg 1 -> .5, linear in progress
    a = 0.5 / (SQRT_1_3 + 1e-6)
    kw = dict(pos_scale=0.5, pos_scale_end=1.0, neg_scale=1.0, neg_scale_end=0.5, progress=progress)
    close(compute("asymmetric", t([[1, 0, 0, 1]]), **kw), [[pos * a, -neg * a, -neg * a, pos * a]])


def test_asymmetric_base_gate_and_mask():
    r = t([[1, 0, 0, 1]])
    # default scales = identity on the base
    assert torch.equal(compute("asymmetric", r, base="rloo"), compute("rloo", r))
    # accuracy gate: mean reward .5 / alpha 1 -> positives x .5; alpha .25 -> min(1, 2) = 1
    close(compute("asymmetric", r, base="rloo", accuracy_gate=1.0), [[1 / 3, -2 / 3, -2 / 3, 1 / 3]])
    close(compute("asymmetric", r, base="rloo", accuracy_gate=0.25), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    # base kwargs pass through; the loss mask follows the base (mc_grpo pivot of [[3,1,2]] is index 2)
    close(
        compute("asymmetric", t([[3, 1, 2]]), base="mc_grpo", base_kwargs={"scale": "none"}, neg_scale=0.5),
        [[1, -0.5, 0]],
    )
    assert loss_mask("asymmetric", t([[3, 1, 2]]), base="mc_grpo").tolist() == [[True, True, False]]
    # a multi-reward base works too
    assert compute("asymmetric", torch.rand(2, 3, 2), base="gdpo").shape == (2, 3)


@pytest.mark.parametrize(
    "kw, word",
    [
        ({"progress": 1.5}, "progress"),
        ({"pos_scale": -1.0}, "pos_scale"),
        ({"neg_scale_end": float("inf")}, "neg_scale"),
        ({"base": "asymmetric"}, "recurse"),
        ({"base": "nope"}, "choose from"),
        ({"accuracy_gate": 0.0}, "accuracy_gate"),
    ],
)
def test_asymmetric_validation(kw, word):
    with pytest.raises(ValueError, match=word):
        compute("asymmetric", t([[1, 0, 0, 1]]), **kw)


def test_asymmetric_agrae_full_recipe_golden():
    # A-GRAE code: grpo base, difficulty weight, positives gated by batch accuracy (alpha 1)
    # [[1,0,0,1]]: base +-a, a = .5 / (sqrt(1/3) + 1e-6); p = .5, acc = .5, sqrt p = .707107
    # D = .5 * .5 / (1 - .707107 + 1e-6) + .5 * .5 / (.707107 + 1e-6) = .853550 + .353553 ~ (1 + sqrt 2) / 2
    # gate = min(1, .5 / 1) = .5 -> [.5 D a, -D a, -D a, .5 D a]
    a = 0.5 / (SQRT_1_3 + 1e-6)
    d = 0.25 / (1 - math.sqrt(0.5) + 1e-6) + 0.25 / (math.sqrt(0.5) + 1e-6)
    assert abs(d - (1 + math.sqrt(2)) / 2) < 1e-5
    adv = compute("asymmetric", t([[1, 0, 0, 1]]), accuracy_gate=1.0, difficulty_focus=True)
    close(adv, [[0.5 * d * a, -d * a, -d * a, 0.5 * d * a]])


def test_asymmetric_difficulty_matches_naive_loop():
    rows = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    acc = sum(map(sum, rows)) / 12  # batch accuracy 4 / 12
    expected = []
    for row in rows:
        m, s = statistics.mean(row), statistics.stdev(row)
        root = math.sqrt(m)
        w = (1 - acc) * 0.5 / (1 - root + 1e-6) + acc * 0.5 / (root + 1e-6)
        base = [0.0 if s == 0 else (x - m) / (s + 1e-6) * w for x in row]
        expected.append([x * min(1.0, acc / 0.5) if x > 0 else x for x in base])
    close(compute("asymmetric", t(rows), accuracy_gate=0.5, difficulty_focus=True), expected)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        compute("asymmetric", t([[2, 0, 0, 1]]), difficulty_focus=True)


def test_prefs_from_scores_feeds_winrate_from_a_pointwise_reward():
    # scores [1, 0, 1]: P_ij = 1 above, 0.5 tie, 0 below -> rows [.5 1 .5], [0 .5 0], [.5 1 .5]
    P = A.prefs_from_scores(torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64))
    assert P[0].tolist() == [[0.5, 1.0, 0.5], [0.0, 0.5, 0.0], [0.5, 1.0, 0.5]]
    # win rates (off-diagonal row sums / 2): 0.75, 0, 0.75; mean 0.5; deviations .25, -.5, .25 -> squares
    # .0625 + .25 + .0625 = .375, / (3 - 1) = .1875 -> std = sqrt(.1875) (ddof 1, Pref-GRPO arXiv:2508.20751)
    s = math.sqrt(0.1875)
    close(compute("winrate", P), [[0.25 / s, -0.5 / s, 0.25 / s]], atol=1e-7)


# ----------------------------------------------------------------------------- Gaussian G^2RPO (arXiv:2604.08539)


def test_gaussian_golden_ranks_to_normal_quantiles():
    # G = 4 quantile midpoints: Phi^-1(1/8, 3/8, 5/8, 7/8) = -1.15035, -0.31864, 0.31864, 1.15035
    q = [statistics.NormalDist().inv_cdf((k - 0.5) / 4) for k in range(1, 5)]
    # distinct rewards 0.1, 0.5, 0.9, 0.3 rank 1, 3, 4, 2 -> z_1, z_3, z_4, z_2 (any spacing gives the same)
    close(
        compute("gaussian", torch.tensor([[0.1, 0.5, 0.9, 0.3], [-50.0, 0.5, 100.0, 0.3]])),
        [[q[0], q[2], q[3], q[1]]] * 2,
    )
    # one correct, three wrong: the three ties share slots 1-3, barycentre (z_1 + z_2 + z_3) / 3 = -0.38345;
    # the correct one gets z_4 = 1.15035; the group still sums to 0; a flat group gets 0
    tied = (q[0] + q[1] + q[2]) / 3
    out = compute("gaussian", torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]))
    close(out, [[q[3], tied, tied, tied], [0.0] * 4])
    assert abs(float(out[0].double().sum())) < 1e-6


# ----------------------------------------------------------------------------- NGRPO calibration (arXiv:2509.18851)


def test_ngrpo_golden_virtual_best_sample():
    # all wrong [0, 0, 0, 0] + virtual 1: mean 0.2, var (ddof 1) = (4 * 0.04 + 0.64) / 4 = 0.2 -> A = -0.2 / sqrt(0.2)
    # one right [1, 0, 0, 0] + 1: mean 0.4, var = (2 * 0.36 + 3 * 0.16) / 4 = 0.3 -> A = 0.6 / sqrt(.3), -0.4 / sqrt(.3)
    # all right: every value at max_reward, flat -> 0
    out = compute("ngrpo", torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]), eps=0.0)
    a, s = -0.2 / math.sqrt(0.2), math.sqrt(0.3)
    close(out, [[a] * 4, [0.6 / s, -0.4 / s, -0.4 / s, -0.4 / s], [0.0] * 4])
    # max_reward 2, ddof 0, rewards [1, 1]: values [1, 1, 2], mean 4/3, population std sqrt(2/9) -> A = -1/sqrt(2)
    close(compute("ngrpo", torch.tensor([[1.0, 1.0]]), max_reward=2.0, ddof=0, eps=0.0), [[-1 / math.sqrt(2)] * 2])
    with pytest.raises(ValueError, match="above max_reward"):
        compute("ngrpo", torch.tensor([[1.5, 0.0]]))
