"""Golden-value and property tests for mmgrpo.advantages.

Expected numbers are worked by hand in float64 (working in the comments) or by naive per-group Python loops.
"""

import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from mmgrpo import advantages as A
from mmgrpo.advantages import ADVANTAGES, compute, loss_mask

F64 = torch.float64
SQRT_1_3 = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]: mean .5, sum sq dev 4 x .25 = 1, / (4 - 1)


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    # outputs are float32, so compare at float32 precision against the float64 hand values
    assert actual.dtype == torch.float32
    assert_close(actual.double(), t(expected), rtol=1e-6, atol=atol)


def sample_input(name: str, B: int = 3, G: int = 4) -> torch.Tensor:
    kind = ADVANTAGES.meta(name)["input"]
    if kind == "multi":
        return torch.rand(B, G, 2)
    if kind == "pairwise":
        upper = torch.randint(0, 3, (B, G, G)).double() / 2  # 0, .5, 1
        P = torch.triu(upper, 1)
        return P + torch.tril(1 - P.transpose(1, 2), -1)  # consistent: P_ij + P_ji = 1
    return torch.rand(B, G)


# ----------------------------------------------------------------------------- registry and API


def test_names_describe_meta():
    expected = {"grpo", "rloo", "mc_grpo", "gdpo", "winrate", "asymmetric", "passk"}
    assert expected <= set(A.names())
    assert set(A.describe()) == set(A.names())
    for name in A.names():
        assert ADVANTAGES.meta(name)["input"] in {"scalar", "multi", "pairwise"}
        assert "arXiv:" in (ADVANTAGES.get(name).__doc__ or ""), name
        assert A.describe()[name]


def test_unknown_name_lists_choices():
    with pytest.raises(ValueError, match="choose from: .*grpo.*rloo"):
        compute("grpoo", torch.zeros(1, 2))
    with pytest.raises(ValueError, match="choose from"):
        loss_mask("nope", torch.zeros(1, 2))


def test_bad_keyword_is_named():
    with pytest.raises(ValueError, match="'stdd'.*did you mean 'std'"):
        compute("grpo", torch.zeros(1, 2), stdd="group")
    with pytest.raises(ValueError, match="'std'"):
        compute("rloo", torch.zeros(1, 2), std="group")
    with pytest.raises(ValueError, match="base_kwargs.*'bogus'"):
        compute("asymmetric", torch.zeros(1, 2), base_kwargs={"bogus": 1})


@pytest.mark.parametrize(
    "kw, word",
    [
        ({"std": "global"}, "std"),
        ({"ddof": 2}, "ddof"),
        ({"ddof": True}, "ddof"),
        ({"eps": -1e-6}, "eps"),
        ({"eps": float("nan")}, "eps"),
        ({"singleton": "one"}, "singleton"),
    ],
)
def test_grpo_bad_values(kw, word):
    with pytest.raises(ValueError, match=word):
        compute("grpo", torch.zeros(2, 3), **kw)


@pytest.mark.parametrize("name", ["grpo", "rloo", "mc_grpo", "passk", "gdpo", "winrate", "asymmetric"])
def test_output_float32_shape_and_input_dtypes(name):
    x = sample_input(name)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        adv = compute(name, x.to(dtype))
        assert adv.dtype == torch.float32 and adv.shape == (3, 4) and torch.isfinite(adv).all()
    assert loss_mask(name, x).shape == (3, 4) and loss_mask(name, x).dtype == torch.bool


def test_integer_and_bool_rewards_accepted():
    # 0/1 correctness as bool: [T, F, F, T] -> same as [[1, 0, 0, 1]]: +-.5 / (sqrt(1/3) + 1e-6)
    a = 0.5 / (SQRT_1_3 + 1e-6)
    close(compute("grpo", torch.tensor([[True, False, False, True]])), [[a, -a, -a, a]])
    close(compute("grpo", torch.tensor([[1, 0, 0, 1]])), [[a, -a, -a, a]])


@pytest.mark.parametrize("name", ["grpo", "rloo", "mc_grpo", "passk", "asymmetric"])
def test_nan_rewards_raise_with_count_and_place(name):
    r = torch.zeros(2, 3)
    r[1, 2] = float("nan")
    r[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"1 NaN and 1 infinite.*\(0, 0\).*\(1, 2\)"):
        compute(name, r)


@pytest.mark.parametrize(
    "bad, word",
    [
        (torch.zeros(0, 4), "empty"),
        (torch.zeros(2, 0), "empty"),
        (torch.zeros(8), r"\[B, G\].*\(8,\)"),
        (torch.zeros(2, 3, 1), r"\(2, 3, 1\)"),
        ([[1.0, 0.0]], "torch.Tensor"),
    ],
)
def test_bad_reward_tensors(bad, word):
    with pytest.raises(ValueError, match=word):
        compute("grpo", bad)


# ----------------------------------------------------------------------------- grpo (arXiv:2402.03300, 2503.20783)


def test_grpo_golden_group_std():
    # [[1,0,0,1]]: mean .5, std(ddof=1) sqrt(1/3) = .57735 -> adv +-.5 / (.57735 + 1e-6) = +-.866024
    # [[3,5]]: mean 4, std(ddof=1) = sqrt((1 + 1) / 1) = sqrt 2 -> adv -+1 / (1.41421 + 1e-6) = -+.707106
    a, b = 0.5 / (SQRT_1_3 + 1e-6), 1 / (math.sqrt(2) + 1e-6)
    close(compute("grpo", t([[1, 0, 0, 1]])), [[a, -a, -a, a]])
    close(compute("grpo", t([[3, 5]])), [[-b, b]])
    assert abs(a - 0.866024) < 1e-6


def test_grpo_golden_ddof0_eps0():
    # population std of [1,0,0,1] = sqrt(1 / 4) = .5 -> adv exactly +-1 with eps = 0 (Flow-GRPO uses np.std)
    close(compute("grpo", t([[1, 0, 0, 1]]), ddof=0, eps=0.0), [[1, -1, -1, 1]], atol=0)


def test_grpo_golden_batch_std():
    # group means .5 and 4 -> centred [[.5, -.5], [-1, 1]]
    # batch std(ddof=1) of [1, 0, 3, 5]: mean 2.25, dev -1.25 -2.25 .75 2.75, sq sum 1.5625 + 5.0625 + .5625 + 7.5625
    #   = 14.75, / 3 -> std sqrt(4.91667) = 2.217356
    s = math.sqrt(14.75 / 3)
    close(compute("grpo", t([[1, 0], [3, 5]]), std="batch", eps=0.0), [[0.5 / s, -0.5 / s], [-1 / s, 1 / s]])
    # Flow-GRPO default: global std, ddof 0, eps 1e-4: std sqrt(14.75 / 4) = 1.920286
    s0 = math.sqrt(14.75 / 4) + 1e-4
    expected = [[0.5 / s0, -0.5 / s0], [-1 / s0, 1 / s0]]
    close(compute("grpo", t([[1, 0], [3, 5]]), std="batch", ddof=0, eps=1e-4), expected)


def test_grpo_dr_grpo_none():
    # Dr. GRPO: no division: [[1,0,0,1]] -> +-.5 ; [[3,5]] -> -+1
    close(compute("grpo", t([[1, 0, 0, 1]]), std="none"), [[0.5, -0.5, -0.5, 0.5]], atol=0)
    close(compute("grpo", t([[3, 5]]), std="none"), [[-1, 1]], atol=0)


@pytest.mark.parametrize("std", ["group", "batch", "none"])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_grpo_equal_rewards_exact_zero(std, ddof, eps):
    # 3 x 0.1 sums to 0.30000000000000004, so a naive (r - mean) is -1.4e-17, and / (0 + 0) would be -inf or NaN
    r = t([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]])
    adv = compute("grpo", r, std=std, ddof=ddof, eps=eps)
    assert torch.equal(adv, torch.zeros(2, 3))
    # a flat group next to a varied one stays exactly 0 under every scale
    adv = compute("grpo", t([[0.1, 0.1, 0.1], [0.0, 1.0, 0.5]]), std=std, ddof=ddof, eps=eps)
    assert torch.equal(adv[0], torch.zeros(3)) and torch.isfinite(adv).all()


def test_grpo_singleton_group():
    r = t([[0.7], [0.2]])
    for std in ("group", "batch", "none"):
        assert torch.equal(compute("grpo", r, std=std), torch.zeros(2, 1))
    close(compute("grpo", r, singleton="raw"), [[0.7], [0.2]])  # verl: mean 0, std 1 -> the raw score


def _grpo_loop(rows: list[list[float]], std: str, ddof: int, eps: float) -> list[list[float]]:
    stdev = statistics.stdev if ddof == 1 else statistics.pstdev
    batch = stdev([x for row in rows for x in row])
    out = []
    for row in rows:
        m = statistics.mean(row)
        s = {"group": stdev(row), "batch": batch, "none": 1.0 - eps}[std]
        out.append([(x - m) / (s + eps) for x in row])
    return out


@pytest.mark.parametrize("std", ["group", "batch", "none"])
@pytest.mark.parametrize("ddof", [0, 1])
def test_grpo_matches_naive_loop(std, ddof):
    r = torch.rand(5, 6, dtype=F64)
    expected = _grpo_loop(r.tolist(), std, ddof, 1e-6)
    close(compute("grpo", r, std=std, ddof=ddof), expected)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("grpo", {}),
        ("grpo", {"std": "batch"}),
        ("grpo", {"std": "none"}),
        ("rloo", {}),
        ("winrate", {}),
        ("gdpo", {}),
        ("mc_grpo", {"scale": "none"}),
    ],
)
def test_zero_mean_per_group(name, kw):
    x = sample_input(name, B=4, G=5)
    adv = compute(name, x, **kw).double()
    if name == "mc_grpo":  # median-centred: not zero-mean, but the median itself is 0 for odd G
        assert torch.equal(adv.sort(-1).values[:, 2], torch.zeros(4, dtype=F64))
        return
    assert_close(adv.mean(-1), torch.zeros(4, dtype=F64), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- rloo (arXiv:2402.14740)


def test_rloo_golden():
    # [[1,0,0,1]]: sample 0 baseline (0+0+1)/3 = 1/3 -> 2/3; sample 1 baseline (1+0+1)/3 = 2/3 -> -2/3
    close(compute("rloo", t([[1, 0, 0, 1]])), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    # [[3,5,10]]: 3 - (5+10)/2 = -4.5; 5 - (3+10)/2 = -1.5; 10 - (3+5)/2 = 6
    close(compute("rloo", t([[3, 5, 10]])), [[-4.5, -1.5, 6.0]])


def test_rloo_edge_cases_and_loop():
    assert torch.equal(compute("rloo", t([[0.3], [0.9]])), torch.zeros(2, 1))
    assert torch.equal(compute("rloo", t([[0.1, 0.1, 0.1]])), torch.zeros(1, 3))
    r = torch.rand(4, 5, dtype=F64)
    expected = [[x - (sum(row) - x) / (len(row) - 1) for x in row] for row in r.tolist()]
    close(compute("rloo", r), expected)


# ----------------------------------------------------------------------------- mc_grpo (arXiv:2601.22582)


def test_mc_grpo_odd_golden_and_pivot():
    # [[3,1,2]]: median 2 -> centred [1,-1,0]; |dev| [1,1,0] -> MAD 1 -> adv [1, -1, 0] / (1 + 1e-3)
    r = t([[3, 1, 2]])
    close(compute("mc_grpo", r), [[1 / 1.001, -1 / 1.001, 0.0]])
    assert loss_mask("mc_grpo", r).tolist() == [[True, True, False]]
    assert loss_mask("mc_grpo", r, exclude_pivot=False).tolist() == [[True, True, True]]
    close(compute("mc_grpo", r, scale="none"), [[1, -1, 0]], atol=0)


def test_mc_grpo_binary_ties_pivot_and_mad_zero():
    # [[1,0,0]]: median 0, |dev| [1,0,0] -> MAD 0 -> adv [1/1e-3, 0, 0] = [1000, 0, 0] (the authors' code does this)
    # two samples equal the median: the pivot is the lowest index among them (index 1)
    r = t([[1, 0, 0]])
    close(compute("mc_grpo", r), [[1000.0, 0.0, 0.0]], atol=1e-3)
    assert loss_mask("mc_grpo", r).tolist() == [[True, False, True]]
    # [[5,2,2,2,9]], scale="std": median 2 -> centred [3,0,0,0,7]; std(ddof=1): mean 4, dev 1 -2 -2 -2 5,
    #   sq sum 38, / 4 = 9.5 -> 3.082207; pivot = index 1
    r = t([[5, 2, 2, 2, 9]])
    s = math.sqrt(9.5) + 1e-3
    close(compute("mc_grpo", r, scale="std"), [[3 / s, 0, 0, 0, 7 / s]])
    assert loss_mask("mc_grpo", r).tolist() == [[True, False, True, True, True]]
    # all equal: exactly 0, one pivot (index 0)
    assert torch.equal(compute("mc_grpo", t([[2, 2, 2]])), torch.zeros(1, 3))
    assert loss_mask("mc_grpo", t([[2, 2, 2]])).tolist() == [[False, True, True]]


def test_mc_grpo_even_group_no_pivot():
    # [[4,1,3,0]]: sorted 0 1 3 4 -> median (1+3)/2 = 2 -> centred [2,-1,1,-2]; |dev| sorted 1 1 2 2 -> MAD 1.5
    r = t([[4, 1, 3, 0]])
    close(compute("mc_grpo", r), [[2 / 1.501, -1 / 1.501, 1 / 1.501, -2 / 1.501]])
    assert loss_mask("mc_grpo", r).all()


def test_mc_grpo_singleton_and_validation():
    assert torch.equal(compute("mc_grpo", t([[0.4]])), torch.zeros(1, 1))
    assert loss_mask("mc_grpo", t([[0.4]])).tolist() == [[False]]  # the lone sample is its own pivot; adv is 0 anyway
    with pytest.raises(ValueError, match="eps.*mad"):
        compute("mc_grpo", t([[1, 0, 0]]), eps=0.0)
    with pytest.raises(ValueError, match="scale"):
        compute("mc_grpo", t([[1, 0, 0]]), scale="iqr")


def test_mc_grpo_matches_naive_loop():
    r = torch.rand(4, 5, dtype=F64)
    r[0, 1] = r[0, 3]  # a tie
    adv, mask = compute("mc_grpo", r), loss_mask("mc_grpo", r)
    for b, row in enumerate(r.tolist()):
        med = statistics.median(row)
        mad = statistics.median([abs(x - med) for x in row])
        assert_close(adv[b].double(), t([(x - med) / (mad + 1e-3) for x in row]), rtol=1e-6, atol=1e-5)
        pivot = row.index(med)
        assert mask[b].tolist() == [g != pivot for g in range(5)]


# ----------------------------------------------------------------------------- passk (arXiv:2503.19595 via verl)


def test_passk_golden():
    # [[.2,.9,.5,.4]]: best index 1, runner-up .5 -> margin .4; group std(ddof=1): mean .5, dev -.3 .4 0 -.1,
    #   sq sum .26, / 3 -> std .294392 -> .4 / (.294392 + 1e-6) = 1.358728
    r = t([[0.2, 0.9, 0.5, 0.4]])
    a = 0.4 / (math.sqrt(0.26 / 3) + 1e-6)
    close(compute("passk", r), [[0, a, 0, 0]])
    close(compute("passk", r, std="none"), [[0, 0.4, 0, 0]])
    # a tie for the best gives margin 0 -> all zero (also with eps = 0)
    assert torch.equal(compute("passk", t([[0.2, 0.9, 0.5, 0.9]]), eps=0.0), torch.zeros(1, 4))
    assert torch.equal(compute("passk", t([[1.0]])), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="std"):
        compute("passk", r, std="batch")


# ----------------------------------------------------------------------------- gdpo (arXiv:2601.05242)


def test_gdpo_two_rewards_golden():
    # two distinct values in a G = 2 group z-score to +-1/sqrt 2 (std(ddof=1) = |a-b|/sqrt 2); eps = 0
    # prompt 0: r1 [1,0] -> [+h,-h], r2 [0,1] -> [-h,+h]; weights [1, .5] -> [h/2, -h/2]       (h = 1/sqrt 2)
    # prompt 1: r1 [1,1] flat -> [0,0], r2 [5,3] -> [+h,-h] -> [h/2, -h/2]
    # batch [h/2, -h/2, h/2, -h/2]: mean 0, std(ddof=1) sqrt(4 (1/8) / 3) = sqrt(1/6) -> sqrt(1/8) / sqrt(1/6)
    #   = sqrt(3/4) = .866025
    r = t([[[1, 0], [0, 1]], [[1, 5], [1, 3]]])
    a = math.sqrt(0.75)
    close(compute("gdpo", r, weights=[1.0, 0.5], eps=0.0), [[a, -a], [a, -a]])
    q = 0.5 / math.sqrt(2)
    close(compute("gdpo", r, weights=[1.0, 0.5], eps=0.0, batch_norm=False), [[q, -q], [q, -q]])
    # equal weights: prompt 0's two rewards cancel (h - h = 0): 0 for both, unlike a sum-then-normalise GRPO
    close(compute("gdpo", r, weights=torch.tensor([1.0, 1.0]), eps=0.0, batch_norm=False), [[0, 0], [2 * q, -2 * q]])


def test_gdpo_three_samples_golden():
    # r1 [1,0,0]: mean 1/3, dev 2/3 -1/3 -1/3, var (4/9 + 1/9 + 1/9) / 2 = 1/3 -> z1 [2/sqrt3, -1/sqrt3, -1/sqrt3]
    # r2 [0,0,3]: mean 1, dev -1 -1 2, var 6/2 = 3 -> z2 [-1/sqrt3, -1/sqrt3, 2/sqrt3]
    # weights [2, 1] -> [3/sqrt3, -3/sqrt3, 0] = [sqrt3, -sqrt3, 0]; batch std(ddof=1) = sqrt(6/2) = sqrt3 -> [1,-1,0]
    r = t([[[1, 0], [0, 0], [0, 3]]])
    s3 = math.sqrt(3)
    close(compute("gdpo", r, weights=[2, 1], eps=0.0, batch_norm=False), [[s3, -s3, 0]])
    close(compute("gdpo", r, weights=[2, 1], eps=0.0), [[1, -1, 0]])


def test_gdpo_edges():
    assert torch.equal(compute("gdpo", torch.ones(2, 3, 2)), torch.zeros(2, 3))
    assert torch.equal(compute("gdpo", torch.rand(2, 1, 3)), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="R=2"):
        compute("gdpo", torch.rand(2, 3, 2), weights=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"\[B, G, R\]"):
        compute("gdpo", torch.rand(2, 3))
