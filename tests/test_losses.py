"""Golden tests for mmgrpo.losses: clipped surrogate (token, GSPO, dual clip), Reg-GRPO, aggregation, KL estimators.

Expected values are worked out by hand in float64 (working in the comments), not copied from running the code.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from mmgrpo import losses
from mmgrpo.losses import aggregate, denominator, kl, policy_loss, reg_grpo

F64 = torch.float64
MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
LN = math.log


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ---------------- clipped surrogate, token level (PPO arXiv:1707.06347) ----------------


def test_clipped_token_golden_both_signs_in_and_out_of_range():
    # row 0: A = +2, ratios [1, 1.1, 1.5]; row 1: A = -1, ratios [0.5, 0.9, 1.5]; clip 0.2 -> [0.8, 1.2]
    logp = t([[LN(1.0), LN(1.1), LN(1.5)], [LN(0.5), LN(0.9), LN(1.5)]]).requires_grad_()
    old = torch.zeros(2, 3, dtype=F64)
    adv = t([2.0, -1.0])
    loss, m = policy_loss(logp, old, adv, torch.ones(2, 3, dtype=torch.bool))
    # row 0: clipped ratios [1, 1.1, 1.2]; -min(rA, cA) = -[2, 2.2, 2.4]
    # row 1: clipped [0.8, 0.9, 1.2]; rA = [-0.5, -0.9, -1.5], cA = [-0.8, -0.9, -1.2]; -min = [0.8, 0.9, 1.5]
    assert_close(loss, t([[-2.0, -2.2, -2.4], [0.8, 0.9, 1.5]]))
    # d loss / d logp = -A * r where the unclipped branch is taken, 0 where the clip is active:
    # row 0: [-2, -2.2, 0] (1.5 > 1.2 clipped); row 1: [0 (0.5 < 0.8 clipped), 0.9, 1.5 (A < 0 never upper-clipped)]
    loss.sum().backward()
    assert_close(logp.grad, t([[-2.0, -2.2, 0.0], [0.0, 0.9, 1.5]]))
    ratios = [1.0, 1.1, 1.5, 0.5, 0.9, 1.5]
    mean = sum(ratios) / 6  # 6.5 / 6
    std = math.sqrt(sum((r - mean) ** 2 for r in ratios) / 6)
    k3 = sum(r - 1 - math.log(r) for r in ratios) / 6
    assert m["ratio/mean"].item() == pytest.approx(mean, abs=1e-12)
    assert m["ratio/std"].item() == pytest.approx(std, abs=1e-12)
    assert m["kl/old_approx"].item() == pytest.approx(k3, abs=1e-12)
    # upper: A > 0 and r > 1.2 -> only 1.5 in row 0; lower: A < 0 and r < 0.8 -> only 0.5 in row 1
    assert m["clip/upper_frac"].item() == pytest.approx(1 / 6)
    assert m["clip/lower_frac"].item() == pytest.approx(1 / 6)
    assert m["clip/dual_frac"].item() == 0.0
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_clipped_asymmetric_clip_low_high():
    # ratio 1.25 with A = +1 and 0.85 with A = -1
    logp = t([[LN(1.25)], [LN(0.85)]])
    old, adv, mask = torch.zeros(2, 1, dtype=F64), t([1.0, -1.0]), torch.ones(2, 1)
    # clip_low 0.1, clip_high 0.3 -> range [0.9, 1.3]: 1.25 inside -> -1.25; 0.85 < 0.9 -> clipped 0.9 -> +0.9
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.3)
    assert_close(loss, t([[-1.25], [0.9]]))
    assert (m["clip/upper_frac"].item(), m["clip/lower_frac"].item()) == (0.0, 0.5)
    # symmetric 0.2 -> [0.8, 1.2]: 1.25 -> clipped -1.2; 0.85 inside -> +0.85
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert_close(loss, t([[-1.2], [0.85]]))
    assert (m["clip/upper_frac"].item(), m["clip/lower_frac"].item()) == (0.5, 0.0)


def test_dual_clip_bounds_negative_advantage_loss():
    # ratios [e^2 = 7.389, 2.0] for A = -1 and e^2 for A = +1; dual_clip c = 3
    logp = t([[2.0, LN(2.0)], [2.0, 2.0]]).requires_grad_()
    old = torch.zeros(2, 2, dtype=F64)
    loss, m = policy_loss(logp, old, t([-1.0, 1.0]), torch.ones(2, 2), dual_clip=3.0)
    # A = -1: clipped loss = max(7.389, 1.2) = 7.389 > c*|A| = 3 -> 3; ratio 2: max(2, 1.2) = 2 < 3 -> 2
    # A = +1: -min(7.389, 1.2) = -1.2, the dual clip does not touch positive advantages
    assert_close(loss, t([[3.0, 2.0], [-1.2, -1.2]]))
    assert m["clip/dual_frac"].item() == pytest.approx(1 / 4)
    assert m["clip/upper_frac"].item() == pytest.approx(2 / 4)
    # the dual-clipped element is a constant: zero gradient; ratio 2 with A = -1 keeps -A*r = 2
    loss.sum().backward()
    assert_close(logp.grad, t([[0.0, 2.0], [0.0, 0.0]]))
    # without dual clip the same element costs e^2
    loss, _ = policy_loss(logp.detach(), old, t([-1.0, 1.0]), torch.ones(2, 2))
    assert loss[0, 0].item() == pytest.approx(math.exp(2.0))


# ---------------- GSPO sequence level (arXiv:2507.18071) ----------------


def test_gspo_sequence_ratio_golden():
    # row 0: log-ratios [ln 2, 0, <masked garbage>] -> mean over 2 valid = ln2/2 -> s = sqrt(2) = 1.41421; A = +1
    #   -> clipped to 1.2 -> loss -1.2 on both valid elements
    # row 1: log-ratios [0.1, -0.1, 0.3] -> mean 0.1 -> s = e^0.1 = 1.10517; A = -1 -> in range -> loss +1.10517
    logp = t([[LN(2.0), 0.0, float("nan")], [0.1, -0.1, 0.3]])
    old = t([[0.0, 0.0, float("inf")], [0.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    loss, m = policy_loss(logp, old, t([1.0, -1.0]), mask, level="sequence")
    e01 = math.exp(0.1)
    assert_close(loss, t([[-1.2, -1.2, 0.0], [e01, e01, e01]]))
    # ratio metrics are over the 5 unmasked elements, each carrying its sequence's ratio
    assert m["ratio/mean"].item() == pytest.approx((2 * math.sqrt(2) + 3 * e01) / 5)
    assert m["clip/upper_frac"].item() == pytest.approx(2 / 5)


def _gspo_reference(logp, old, adv, mask, clip):
    """Hand-written GSPO (TRL importance_sampling_level='sequence' form): the sequence ratio carries the gradient."""
    m = mask.to(F64)
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))  # [N]
    per_seq = -torch.minimum(s * adv, torch.clamp(s, 1 - clip, 1 + clip) * adv)  # [N]
    return per_seq, m


@pytest.mark.parametrize("mode", MODES)
def test_gspo_gradient_matches_handwritten_sequence_objective(mode):
    n, k = 6, 5
    old = torch.randn(n, k, dtype=F64) * 0.1
    base = old + torch.randn(n, k, dtype=F64) * 0.15
    mask = torch.rand(n, k) > 0.3
    mask[:, 0] = True
    adv = torch.randn(n, dtype=F64)
    ours = base.clone().requires_grad_()
    loss, _ = policy_loss(ours, old, adv, mask, level="sequence", clip_low=0.2, clip_high=0.2)
    aggregate(loss, mask, mode, norm_len=k).backward()
    ref = base.clone().requires_grad_()
    per_seq, m = _gspo_reference(ref, old, adv, mask, 0.2)
    # each mode written out on the per-sequence loss broadcast over its |y_i| valid elements
    lens = m.sum(-1)
    total = {
        "token_mean": (per_seq * lens).sum() / lens.sum(),
        "seq_mean_token_mean": per_seq.mean(),
        "seq_mean_token_sum": (per_seq * lens).sum() / n,
        "seq_mean_token_sum_norm": (per_seq * lens).sum() / (n * k),
    }[mode]
    total.backward()
    assert_close(ours.grad, ref.grad)


# ---------------- Reg-GRPO (DeepVideo-R1, arXiv:2506.07464 Eq. 8 / A.4) ----------------


def test_reg_grpo_golden_sum():
    # one group of G = 3; rho = sum of valid log-ratios: [0.1+0.2, 0+0, -0.3 (+masked garbage)] = [0.3, 0, -0.3]
    # mean 0, var (ddof=1) = (0.09 + 0 + 0.09) / 2 = 0.09 -> std 0.3 (eps = 0) -> predicted adv [1, 0, -1]
    # target A = [1, 0.5, -1.5] -> squared errors [0, 0.25, 0.25]
    logp = t([[0.1, 0.2], [0.0, 0.0], [-0.3, float("-inf")]])
    old = torch.zeros(3, 2, dtype=F64)
    mask = t([[1, 1], [1, 1], [1, 0]]).bool()
    loss, m = reg_grpo(logp, old, t([1.0, 0.5, -1.5]), mask, group_size=3, eps=0.0)
    assert_close(loss, t([[0.0, 0.0], [0.25, 0.25], [0.25, 0.0]]))
    # the paper's 1/G sum_i: seq_mean_token_mean = (0 + 0.25 + 0.25) / 3
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx(1 / 6)
    assert m["reg/sq_err"].item() == pytest.approx(1 / 6)


def test_reg_grpo_golden_mean_and_groups_independent():
    # reduce="mean": rho = [0.3/2, 0/2, -0.3/1] = [0.15, 0, -0.3]; mean -0.05; deviations [0.2, 0.05, -0.25]
    # var (ddof=1) = (0.04 + 0.0025 + 0.0625) / 2 = 0.0525 -> pred = dev / sqrt(0.0525)
    logp = t([[0.1, 0.2], [0.0, 0.0], [-0.3, 0.0]])
    mask = t([[1, 1], [1, 1], [1, 0]])
    adv = t([1.0, 0.0, -1.0])
    s = math.sqrt(0.0525)
    want = [(1.0 - 0.2 / s) ** 2, (0.0 - 0.05 / s) ** 2, (-1.0 + 0.25 / s) ** 2]
    loss, _ = reg_grpo(logp, torch.zeros(3, 2, dtype=F64), adv, mask, group_size=3, reduce="mean", eps=0.0)
    assert_close(loss[:, 0], t(want))
    # a second group appended after the first does not change the first group's losses (groups are consecutive)
    logp2 = torch.cat([logp, t([[1.0, 2.0], [3.0, 0.0], [0.5, 0.5]])])
    loss2, _ = reg_grpo(
        logp2,
        torch.zeros(6, 2, dtype=F64),
        torch.cat([adv, t([0.3, -0.6, 0.3])]),
        torch.cat([mask, torch.ones(3, 2, dtype=F64)]),
        group_size=3,
        reduce="mean",
        eps=0.0,
    )
    assert_close(loss2[:3], loss)


def test_reg_grpo_on_policy_gradient_is_finite_and_reinforce_like():
    # logp == old: rho = 0, var = 0, pred = 0 / sqrt(0 + eps^2) = 0; loss_i = A_i^2
    # d pred_i / d rho_j = (delta_ij - 1/G) / eps; with seq_mean_token_mean L = (1/G) sum_i (A_i - pred_i)^2:
    # dL/drho_j = -(2 / (G eps)) * (A_j - mean A); A = [1, -1], G = 2, eps = 0.01 -> [-100, +100] on every token
    logp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, _ = reg_grpo(logp, torch.zeros(2, 3, dtype=F64), t([1.0, -1.0]), mask, group_size=2, eps=0.01)
    assert_close(loss, torch.ones(2, 3, dtype=F64))
    aggregate(loss, mask, "seq_mean_token_mean").backward()
    assert_close(logp.grad, t([[-100.0] * 3, [100.0] * 3]))


def test_reg_grpo_needs_group_size():
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="group_size"):
        reg_grpo(x, x, torch.zeros(4), torch.ones(4, 2))
    with pytest.raises(ValueError, match="N=4"):
        reg_grpo(x, x, torch.zeros(4), torch.ones(4, 2), group_size=3)


# ---------------- aggregation ----------------


AGG_LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
AGG_MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("token_mean", 7 / 3),  # (1 + 2 + 4) / 3 valid elements
        ("seq_mean_token_mean", 2.75),  # ((1 + 2) / 2 + 4 / 1) / 2 non-empty rows; row 3 is fully masked
        ("seq_mean_token_sum", 3.5),  # (3 + 4) / 2
        ("seq_mean_token_sum_norm", 0.875),  # (1 + 2 + 4) / (2 rows x norm_len 4)
    ],
)
def test_aggregate_golden(mode, want):
    assert aggregate(t(AGG_LOSS), t(AGG_MASK), mode, norm_len=4).item() == pytest.approx(want)


def test_aggregate_errors():
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(t(AGG_LOSS), t(AGG_MASK), "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="norm_len"):
        denominator(t(AGG_MASK), "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="did you mean .token_mean.*choose from: seq_mean_token_mean"):
        aggregate(t(AGG_LOSS), t(AGG_MASK), "token-mean")
    with pytest.raises(ValueError, match=r"mask \(2, 3\) != loss \(3, 3\)"):
        aggregate(t(AGG_LOSS), t(AGG_MASK[:2]), "token_mean")
    # with a global denominator norm_len is not needed
    assert aggregate(t(AGG_LOSS), t(AGG_MASK), "seq_mean_token_sum_norm", denom=14.0).item() == pytest.approx(0.5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_accumulated_micro_batches_equal_one_batch(mode, level):
    n, k = 7, 6
    old = torch.randn(n, k, dtype=F64) * 0.1
    base = old + torch.randn(n, k, dtype=F64) * 0.3
    adv = torch.randn(n, dtype=F64)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 4])  # micro-batches hold 10 and 11 valid tokens; row 3 is empty
    mask = torch.arange(k)[None, :] < lengths[:, None]

    full = base.clone().requires_grad_()
    loss, _ = policy_loss(full, old, adv, mask, level=level, clip_low=0.1, clip_high=0.15, dual_clip=2.0)
    value_full = aggregate(loss, mask, mode, norm_len=k)
    value_full.backward()

    micro = base.clone().requires_grad_()
    denom = denominator(mask, mode, norm_len=k)
    parts = [slice(0, 3), slice(3, 7)]
    assert sum(denominator(mask[p], mode, norm_len=k) for p in parts) == denom  # additive (all-reduce SUM)
    total = 0.0
    for p in parts:
        mb_loss, _ = policy_loss(
            micro[p], old[p], adv[p], mask[p], level=level, clip_low=0.1, clip_high=0.15, dual_clip=2.0
        )
        value = aggregate(mb_loss, mask[p], mode, denom=denom)
        value.backward()
        total = total + value.detach()
    assert_close(total, value_full.detach())
    assert_close(micro.grad, full.grad)
    if mode != "seq_mean_token_sum_norm":
        # the test can fail: local denominators (3 vs 11 tokens, 3 vs 3 rows...) give a different sum
        local = sum(aggregate(loss[p].detach(), mask[p], mode, norm_len=k) for p in parts)
        assert not torch.allclose(local, value_full.detach())


def test_accumulation_reg_grpo_whole_groups():
    old = torch.zeros(8, 3, dtype=F64)
    base = torch.randn(8, 3, dtype=F64) * 0.2
    mask = torch.rand(8, 3) > 0.3
    adv = torch.randn(8, dtype=F64)
    full = base.clone().requires_grad_()
    aggregate(reg_grpo(full, old, adv, mask, group_size=4)[0], mask, "seq_mean_token_mean").backward()
    micro = base.clone().requires_grad_()
    denom = denominator(mask, "seq_mean_token_mean")
    for p in (slice(0, 4), slice(4, 8)):
        aggregate(
            reg_grpo(micro[p], old[p], adv[p], mask[p], group_size=4)[0], mask[p], "seq_mean_token_mean", denom=denom
        ).backward()
    assert_close(micro.grad, full.grad)


# ---------------- masking: fully masked rows and garbage never leak ----------------


@pytest.mark.parametrize(
    "name,kw", [("clipped", {}), ("clipped", {"level": "sequence", "dual_clip": 3.0}), ("reg_grpo", {"group_size": 2})]
)
def test_fully_masked_rows_and_garbage_give_no_nan(name, kw):
    logp = torch.tensor([[0.1, float("nan"), float("inf")], [float("-inf"), float("nan"), 5.0]], requires_grad=True)
    old = torch.tensor([[0.0, float("inf"), 1.0], [0.0, 0.0, float("nan")]])
    adv = torch.tensor([[1.0, float("nan"), 2.0], [float("inf"), 0.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [0, 0, 0]])  # row 1 fully masked
    loss, metrics = losses.compute(name, logp, old, adv, mask, **kw)
    assert torch.isfinite(loss).all() and (loss[mask == 0] == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    for mode in MODES:
        value = aggregate(loss, mask, mode, norm_len=3)
        assert torch.isfinite(value)
        (grad,) = torch.autograd.grad(value, logp, retain_graph=True)
        assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch_gives_zero_loss_and_zero_grad(mode):
    logp = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    loss, metrics = policy_loss(logp, torch.zeros(3, 4), torch.ones(3), mask)
    value = aggregate(loss, mask, mode, norm_len=4)
    value.backward()
    assert value.item() == 0.0 and (logp.grad == 0).all()
    assert all(v.item() == 0.0 for v in metrics.values())
    assert denominator(mask, mode, norm_len=4) == 0


# ---------------- advantage broadcast, dtype, registry, validation ----------------


@pytest.mark.parametrize(
    "name,kw", [("clipped", {}), ("clipped", {"level": "sequence"}), ("reg_grpo", {"group_size": 2})]
)
def test_adv_per_sequence_equals_broadcast_per_element(name, kw):
    old = torch.randn(4, 5, dtype=F64) * 0.1
    base = old + torch.randn(4, 5, dtype=F64) * 0.3
    mask = torch.rand(4, 5) > 0.2
    adv = torch.randn(4, dtype=F64)
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    la, ma = losses.compute(name, a, old, adv, mask, **kw)
    lb, mb = losses.compute(name, b, old, adv[:, None].expand(4, 5), mask, **kw)
    assert_close(la, lb)
    assert_close(ma, mb)
    la.sum().backward()
    lb.sum().backward()
    assert_close(a.grad, b.grad)


def test_half_precision_inputs_are_upcast():
    logp = torch.zeros(2, 3, dtype=torch.bfloat16)
    loss, m = policy_loss(logp, logp, torch.ones(2), torch.ones(2, 3))
    assert loss.dtype == torch.float32 and m["ratio/mean"].dtype == torch.float32
    assert kl(logp, logp, "k3").dtype == torch.float32


def test_registry_and_compute():
    assert {"clipped", "reg_grpo"} <= set(losses.names())
    assert set(losses.AGGREGATIONS.names()) == set(MODES)
    assert losses.KL.names() == ["k1", "k2", "k3"]
    logp, old = torch.randn(2, 3), torch.zeros(2, 3)
    direct, _ = policy_loss(logp, old, torch.ones(2), torch.ones(2, 3), clip_high=0.28)
    via, _ = losses.compute("clipped", logp, old, torch.ones(2), torch.ones(2, 3), clip_high=0.28)
    assert_close(direct, via)
    with pytest.raises(ValueError, match="choose from: clipped, .*reg_grpo"):  # pipelines may register more
        losses.compute("clip", logp, old, torch.ones(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="did you mean 'clip_high'"):
        losses.compute("clipped", logp, old, torch.ones(2), torch.ones(2, 3), clip_hihg=0.3)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"mask": torch.ones(2, 4)}, r"mask \(2, 4\) != logp \(2, 3\)"),
        ({"adv": torch.ones(3)}, r"adv \(3,\) must be \[N\]=\(2,\) or \[N, K\]=\(2, 3\)"),
        ({"old_logp": torch.ones(2)}, r"old_logp \(2,\) != logp \(2, 3\)"),
        ({"clip_low": -0.1}, "clip_low must be >= 0.*-0.1"),
        ({"clip_high": -1}, "clip_high must be >= 0"),
        ({"dual_clip": 1.0}, "dual_clip must be > 1.*got 1.0"),
        ({"level": "seq"}, "level must be 'token'.*'seq'"),
    ],
)
def test_validation_errors(kw, match):
    args = {"logp": torch.zeros(2, 3), "old_logp": torch.zeros(2, 3), "adv": torch.ones(2), "mask": torch.ones(2, 3)}
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        policy_loss(**args)
    with pytest.raises(ValueError, match=r"logp must be \[N, K\]"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.ones(3), torch.ones(3))


# ---------------- KL estimators (Schulman, joschu.net/blog/kl-approx.html) ----------------


def test_kl_golden():
    # element 0: logp = 0, ref = ln 2 -> d = ref - logp = ln 2 = 0.693147
    #   k1 = -ln 2; k2 = (ln 2)^2 / 2 = 0.240227; k3 = e^{ln 2} - ln 2 - 1 = 1 - ln 2 = 0.306853
    # element 1: logp = ln 2, ref = 0 -> d = -ln 2
    #   k1 = ln 2; k2 = 0.240227; k3 = 1/2 + ln 2 - 1 = ln 2 - 0.5 = 0.193147
    logp, ref = t([[0.0, LN(2)]]), t([[LN(2), 0.0]])
    assert_close(kl(logp, ref, "k1"), t([[-LN(2), LN(2)]]))
    assert_close(kl(logp, ref, "k2"), t([[LN(2) ** 2 / 2, LN(2) ** 2 / 2]]))
    assert_close(kl(logp, ref, "k3"), t([[1 - LN(2), LN(2) - 0.5]]))
    # k3 gradient wrt logp: d/dlogp [e^{ref-logp} - (ref - logp) - 1] = 1 - e^{ref - logp} = [1 - 2, 1 - 0.5]
    x = logp.clone().requires_grad_()
    kl(x, ref, "k3").sum().backward()
    assert_close(x.grad, t([[-1.0, 0.5]]))


def test_kl_clamp_and_errors():
    # d = 30: exact k3 = e^30 - 31 = 1.0686e13; verl-style clamp: d -> 20, then the estimate -> 10
    logp, ref = t([[0.0]]), t([[30.0]])
    assert kl(logp, ref, "k3").item() == pytest.approx(math.exp(30) - 31)
    assert kl(logp, ref, "k3", clamp=10.0).item() == 10.0
    assert kl(logp, ref, "k1", clamp=10.0).item() == -10.0  # k1 = -d = -20 -> clamped to -10
    with pytest.raises(ValueError, match="choose from: k1, k2, k3"):
        kl(logp, ref, "k4")
    with pytest.raises(ValueError, match=r"ref_logp \(1, 2\) != logp \(1, 1\)"):
        kl(logp, t([[0.0, 0.0]]), "k3")


# ---------------------------------------------------------------- DISPO (arXiv:2602.00983)


def test_dispo_golden_four_bounds():
    # rows: (A, r) = (+1, 1.5), (+1, 0.5), (-1, 1.5), (-1, 0.5); old_logp 0 so logp = log r
    # bounds: correct [1 - 0.1, 1 + 0.3] = [0.9, 1.3]; incorrect [1 - 0.4, 1 + 0.2] = [0.6, 1.2]
    # weights: clip(1.5) = 1.3, clip(0.5) = 0.9, clip(1.5) = 1.2, clip(0.5) = 0.6
    # loss = -w * A * log r: -1.3 log 1.5, -0.9 log 0.5, 1.2 log 1.5, 0.6 log 0.5; gradient d/dlogp = -w * A
    logp = t([[math.log(1.5)], [math.log(0.5)], [math.log(1.5)], [math.log(0.5)]]).requires_grad_(True)
    adv = t([1.0, 1.0, -1.0, -1.0])
    loss, m = losses.compute(
        "dispo",
        logp,
        torch.zeros_like(logp),
        adv,
        torch.ones(4, 1, dtype=torch.bool),
        correct_low=0.1,
        correct_high=0.3,
        incorrect_low=0.4,
        incorrect_high=0.2,
    )
    want = [-1.3 * math.log(1.5), -0.9 * math.log(0.5), 1.2 * math.log(1.5), 0.6 * math.log(0.5)]
    assert_close(loss[:, 0], t(want))
    loss.sum().backward()
    assert_close(logp.grad[:, 0], t([-1.3, -0.9, 1.2, 0.6]))  # every element keeps a (bounded) gradient
    assert [
        float(m[f"clip/{k}"])
        for k in ("correct_upper_frac", "correct_lower_frac", "incorrect_upper_frac", "incorrect_lower_frac")
    ] == [0.25, 0.25, 0.25, 0.25]
    # inside every range the weight is the ratio itself: r = 1 gives -A * logp = 0 at logp = 0, gradient -A
    lp = t([[0.0]]).requires_grad_(True)
    losses.compute("dispo", lp, torch.zeros_like(lp), t([2.0]), torch.ones(1, 1, dtype=torch.bool))[0].sum().backward()
    assert_close(lp.grad, t([[-2.0]]))
    with pytest.raises(ValueError, match="incorrect_low"):
        losses.compute("dispo", lp, lp.detach(), t([1.0]), torch.ones(1, 1, dtype=torch.bool), incorrect_low=1.5)


# ---------------------------------------------------------------- KL in the reward (verl use_kl_in_reward)


def test_kl_reward_penalty_golden():
    # sample 0: old - ref per token = [0.5, -0.5, (masked) 9] -> k1 sums 0.5 - 0.5 = 0; k3 per token with
    # d = ref - old: e^d - 1 - d: d = -0.5 -> e^-0.5 - 0.5 = 0.10653; d = 0.5 -> e^0.5 - 1.5 = 0.14872
    # sample 1: one token, old - ref = 1 -> k1 = 1; k3 = e^-1 - 1 + 1 = 0.36788
    old = t([[0.0, -1.0, 5.0], [0.0, 0.0, 0.0]])
    ref = t([[-0.5, -0.5, -4.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert_close(losses.kl_reward_penalty(old, ref, mask, coef=0.1, kind="k1"), t([0.0, 0.1]))
    k3 = [math.exp(-0.5) - 0.5 + math.exp(0.5) - 1.5, math.exp(-1.0)]
    assert_close(losses.kl_reward_penalty(old, ref, mask, coef=2.0, kind="k3"), t([2 * k3[0], 2 * k3[1]]))
    with pytest.raises(ValueError, match="coef"):
        losses.kl_reward_penalty(old, ref, mask, coef=-1.0)
