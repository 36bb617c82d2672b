"""Golden tests for pipelines.flow.objectives: GRPO-Guard RatioNorm and reweighting, TempFlow weights, the per-step
ratio monitor and DiffusionNFT's loss.

Expected values are worked out by hand in float64 (working in the comments), not copied from running the code.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from mmgrpo import losses
from pipelines.flow.objectives import (
    guard_clipped,
    guard_log_ratio,
    guard_step_weights,
    nft_loss,
    nft_optimality,
    noise_aware_weights,
    per_step_ratio_metrics,
)
from pipelines.flow.sde import step

F64 = torch.float64
LN = math.log


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ---------------- GRPO-Guard RatioNorm (arXiv:2510.22319) ----------------


def test_guard_log_ratio_exact_golden():
    # s (logp - old) + d2 / (2 s) = 0.5 * (-1 + 0.5) + 0.04 / (2 * 0.5) = -0.25 + 0.04 = -0.21
    out = guard_log_ratio(t([[-1.0]]), t([[-0.5]]), t([[True]]), std=t([[0.5]]), mean_sq_dist=t([[0.04]]))
    assert_close(out, t([[-0.21]]))


def test_guard_log_ratio_fallback_centres_each_step_over_unmasked_samples():
    # d = [[1, 2], [3, 6]]: column means [2, 4] -> [[-1, -2], [1, 2]]
    d = t([[1.0, 2.0], [3.0, 6.0]])
    assert_close(
        guard_log_ratio(d, torch.zeros(2, 2, dtype=F64), torch.ones(2, 2, dtype=torch.bool)),
        t([[-1.0, -2.0], [1.0, 2.0]]),
    )
    # row 1 of column 0 masked: centre 1 from row 0 alone -> [[0, -2], [0 (masked), 2]]
    mask = t([[True, True], [False, True]], torch.bool)
    assert_close(guard_log_ratio(d, torch.zeros(2, 2, dtype=F64), mask), t([[0.0, -2.0], [0.0, 2.0]]))


def test_guard_normalised_log_ratio_has_zero_mean_under_the_rollout_noise():
    # Roll out two Flow-GRPO steps (K = 2, different noise levels) with v_old, score them under v_theta = v_old + a
    # perturbation. The raw log-ratio is left-shifted by -d2 / (2 s^2); RatioNorm's is reduce_d eps * dmu, mean 0.
    # Step 0: dmu = dt (1 + s_t^2 (1 - s) / (2 s)) dv = 0.1245 dv, s = 0.664: the shift is ~24 standard errors.
    torch.manual_seed(0)
    n, d = 4000, 16
    raw, normed = [], []
    for s, s_next in ((0.9, 0.8), (0.3, 0.2)):
        x, v_old = torch.randn(n, d, dtype=F64), torch.randn(n, d, dtype=F64)
        v_new = v_old + torch.randn(n, d, dtype=F64)
        old = step("flow_grpo", x, v_old, s, s_next, noise_level=0.7, generator=torch.Generator().manual_seed(1))
        new = step("flow_grpo", x, v_new, s, s_next, noise_level=0.7, prev_sample=old.prev_sample)
        d2 = ((new.mean - old.mean) ** 2).mean(-1)  # [N]
        lr = guard_log_ratio(
            new.logp[:, None],
            old.logp[:, None],
            torch.ones(n, 1, dtype=torch.bool),
            std=old.std[:, None],
            mean_sq_dist=d2[:, None],
        )[:, 0]  # [N]
        eps = (old.prev_sample - old.mean) / old.std[:, None]
        assert_close(lr, (eps * (new.mean - old.mean)).mean(-1))  # the closed form
        raw.append(new.logp - old.logp)
        normed.append(lr)
        se = lr.std() / math.sqrt(n)
        assert abs(lr.mean()) < 4 * se  # mean ~ 0
        assert (new.logp - old.logp).mean() < -10 * (new.logp - old.logp).std() / math.sqrt(n)  # the left shift
    # step consistency: the raw log-ratio's spread differs across steps far more than the normalised one's
    raw_spread = raw[1].std() / raw[0].std()
    norm_spread = normed[1].std() / normed[0].std()
    assert raw_spread > 2 * norm_spread


def test_guard_log_ratio_rejects_half_inputs_and_zero_std():
    ones = torch.ones(1, 1, dtype=F64)
    with pytest.raises(ValueError, match="both std and mean_sq_dist"):
        guard_log_ratio(ones, ones, ones.bool(), std=ones)
    with pytest.raises(ValueError, match="std must be > 0"):
        guard_log_ratio(ones, ones, ones.bool(), std=0 * ones, mean_sq_dist=ones)


def test_guard_clipped_golden_with_weight_and_gradient():
    # fallback centring: d = [0.2, -0.2] has mean 0 -> log r_hat = d, r_hat = [e^0.2 = 1.2214, e^-0.2 = 0.8187]
    # clip 0.1 -> [0.9, 1.1]; A = [1, 1]: loss = -min(r, clip(r)) = [-1.1, -0.8187]; weight 2 -> [-2.2, -1.6375]
    logp = t([[0.2], [-0.2]]).requires_grad_()
    loss, m = guard_clipped(
        logp,
        torch.zeros(2, 1, dtype=F64),
        t([1.0, 1.0]),
        torch.ones(2, 1, dtype=torch.bool),
        clip_low=0.1,
        clip_high=0.1,
        weight=t([2.0]),
    )
    assert_close(loss, t([[-2.2], [-2.0 * math.exp(-0.2)]]))
    assert_close(m["clip/upper_frac"], t(0.5))
    assert_close(m["guard/raw_log_ratio_mean"], t(0.0))
    loss.sum().backward()
    # sample 0 clipped -> 0; sample 1: d(-2 r)/d logp = -2 r (the centre is detached)
    assert_close(logp.grad, t([[0.0], [-2.0 * math.exp(-0.2)]]))


def test_guard_clipped_is_registered_and_runs_through_losses_compute():
    assert "guard_clipped" in losses.POLICY_LOSSES
    logp = torch.zeros(3, 2)
    loss, m = losses.compute(
        "guard_clipped", logp, logp, torch.ones(3), torch.ones(3, 2, dtype=torch.bool), clip_low=2e-6, clip_high=2e-6
    )
    assert_close(loss, -torch.ones(3, 2))  # ratio exactly 1 before the first update
    assert m["ratio/mean"] == 1
    with pytest.raises(ValueError, match="weight"):
        guard_clipped(logp, logp, torch.ones(3), torch.ones(3, 2, dtype=torch.bool), weight=torch.ones(3))


def test_guard_step_weights_golden():
    # dt = [0.25, 0.5] -> 1/|dt| = [4, 2]; normalised by the mean 3 -> [4/3, 2/3]
    assert_close(guard_step_weights(t([1.0, 0.75]), t([0.75, 0.25])), t([4.0, 2.0]))
    assert_close(guard_step_weights(t([1.0, 0.75]), t([0.75, 0.25]), normalize=True), t([4 / 3, 2 / 3]))
    with pytest.raises(ValueError, match="sigma > sigma_next"):
        guard_step_weights(t([0.5]), t([0.5]))


def test_noise_aware_weights_golden():
    # Flow-GRPO std = eta sqrt(s / (1 - s')) sqrt(s - s') at s=1 (1 - s' rule): eta * 2 * 0.5 = eta;
    # at s = 0.5: eta * 1 * 0.5 = eta / 2 -> weights [1, 0.5] / 0.75 = [4/3, 2/3] (eta cancels)
    assert_close(noise_aware_weights(t([1.0, 0.5]), t([0.75, 0.25]), noise_level=0.7), t([4 / 3, 2 / 3]))
    # DanceGRPO: std = eta sqrt(dt): dt [0.25, 0.04] -> [0.5, 0.2] / 0.35
    assert_close(noise_aware_weights(t([1.0, 0.5]), t([0.75, 0.46]), kind="dance"), t([0.5 / 0.35, 0.2 / 0.35]))
    with pytest.raises(ValueError, match="deterministic"):
        noise_aware_weights(t([1.0]), t([0.5]), kind="ode")


# ---------------- per-step ratio monitor ----------------


def test_per_step_ratio_metrics_golden():
    # column 0 (rows 0, 1; row 2 masked): r = [1.0, 0.8]: mean 0.9, std 0.1, upper 0, lower (0.8 < 0.9) 1/2
    # column 1: r = [1.2, 1.0, 0.5]: mean 0.9, var (0.09 + 0.01 + 0.16) / 3, upper 1/3, lower 1/3
    lr = t([[LN(1.0), LN(1.2)], [LN(0.8), LN(1.0)], [LN(1.5), LN(0.5)]])
    mask = t([[True, True], [True, True], [False, True]], torch.bool)
    m = per_step_ratio_metrics(lr, mask, clip_low=0.1, clip_high=0.1, k_offset=3)
    assert sorted(m) == sorted(f"ratio/k{k}/{s}" for k in (3, 4) for s in ("mean", "std", "clip_upper", "clip_lower"))
    assert_close(m["ratio/k3/mean"], t(0.9))
    assert_close(m["ratio/k3/std"], t(0.1))
    assert_close(m["ratio/k3/clip_upper"], t(0.0))
    assert_close(m["ratio/k3/clip_lower"], t(0.5))
    assert_close(m["ratio/k4/mean"], t(0.9))
    assert_close(m["ratio/k4/std"], t(math.sqrt(0.26 / 3)))
    assert_close(m["ratio/k4/clip_upper"], t(1 / 3))
    assert_close(m["ratio/k4/clip_lower"], t(1 / 3))
    empty = per_step_ratio_metrics(lr, torch.zeros(3, 2, dtype=torch.bool))
    assert empty == {}


# ---------------- DiffusionNFT (arXiv:2509.16117) ----------------


def test_nft_optimality_golden():
    # r = clip(A, +-5) / 10 + 0.5
    assert_close(nft_optimality(t([-10.0, -2.5, 0.0, 5.0])), t([0.0, 0.25, 0.5, 1.0]))


V = [[1.0, 0.0], [0.0, 2.0]]
V_OLD = [[0.0, 0.0], [1.0, 1.0]]
TARGET = [[1.0, 1.0], [0.0, 0.0]]


def test_nft_loss_velocity_weighting_golden_and_gradient():
    # beta = 0.5. sample 0 (r = 1): v+ = 0.5 v_old + 0.5 v = [0.5, 0]; e+ = [-0.5, -1] -> L+ = 1.25 / 2 = 0.625;
    #   loss = (1 * 0.625) / 0.5 = 1.25
    # sample 1 (r = 0.25): v+ = [0.5, 1.5], e+ = [0.5, 1.5] -> L+ = 2.5 / 2 = 1.25; v- = 1.5 v_old - 0.5 v = [1.5, 0.5]
    #   -> L- = 1.25; loss = (0.25 * 1.25 + 0.75 * 1.25) / 0.5 = 2.5
    v = t(V).requires_grad_()
    loss, m = nft_loss(v, t(V_OLD), t(TARGET), t([0.5, 1.0]), t([1.0, 0.25]), beta=0.5, weighting="velocity")
    assert_close(loss, t([1.25, 2.5]))
    assert_close(m["nft/pos"], t((0.625 + 1.25) / 2))
    # d loss0 / d v = r / beta * beta * 2 e+ / D = e+ = [-0.5, -1]
    # d loss1 / d v = (0.25 * 2 * 0.5 e+ - 0.75 * 2 * 0.5 e-) / (2 * 0.5) = 0.25 e+ - 0.75 e- = [-1, 0]
    loss.sum().backward()
    assert_close(v.grad, t([[-0.5, -1.0], [0.125 - 1.125, 0.375 - 0.375]]))


def test_nft_loss_adaptive_weighting_golden():
    # x0 error = t * e. sample 0 (t = 0.5, r = 1): t e+ = [-0.25, -0.5]: mean sq 0.15625 / mean abs 0.375 = 5/12;
    #   loss = (5/12) / 0.5 = 5/6
    # sample 1 (t = 1): L+ = 1.25 / mean|e+| (1.0) = 1.25, L- = 1.25 / 1.0 = 1.25 -> loss 2.5
    loss, _ = nft_loss(t(V), t(V_OLD), t(TARGET), t([0.5, 1.0]), t([1.0, 0.25]), beta=0.5)
    assert_close(loss, t([5 / 6, 2.5]))


def test_nft_loss_per_step_shapes_and_no_grad_into_old_velocity():
    v, v_old = torch.randn(3, 2, 4, requires_grad=True), torch.randn(3, 2, 4, requires_grad=True)
    loss, _ = nft_loss(v, v_old, torch.randn(3, 2, 4), torch.rand(3, 2), torch.full((3, 1), 0.5))
    assert loss.shape == (3, 2)
    loss.sum().backward()
    assert v_old.grad is None and v.grad is not None


def test_nft_loss_at_beta_one_positive_branch_is_flow_matching():
    # beta = 1, r = 1: v+ = v, so the velocity-weighted loss is the plain flow-matching MSE mean((v - target)^2)
    v, tgt = torch.randn(2, 5, dtype=F64), torch.randn(2, 5, dtype=F64)
    loss, _ = nft_loss(v, torch.randn(2, 5, dtype=F64), tgt, t([0.3, 0.7]), t([1.0, 1.0]), weighting="velocity")
    assert_close(loss, ((v - tgt) ** 2).mean(-1))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"beta": 0.0}, "beta > 0"), ({"weighting": "x0"}, "weighting"), ({"r": t([1.5, 0.0])}, r"\[0, 1\]")],
)
def test_nft_loss_validation(kwargs, match):
    args = {"r": t([1.0, 0.0])}
    args.update(kwargs)
    r = args.pop("r")
    with pytest.raises(ValueError, match=match):
        nft_loss(t(V), t(V_OLD), t(TARGET), t([0.5, 1.0]), r, **args)
    with pytest.raises(ValueError, match="leading"):
        nft_loss(t(V), t(V_OLD), t(TARGET), t([0.5, 1.0, 0.2]), t([1.0, 0.0, 0.0]))


def test_nft_policy_loss_maps_advantages_masks_and_needs_the_flow_inputs():
    # K = 1 step per sample, V / V_OLD / TARGET as above, velocity weighting, beta 0.5, adv_clip_max 5:
    # A = [5, -2.5] -> r = [1, 0.25] (nft_optimality), so the per-sample losses are the golden [1.25, 2.5] above;
    # the second sample is masked out -> [1.25, 0]
    v = t(V).view(2, 1, 2)
    mask = torch.tensor([[True], [False]])
    loss, m = losses.compute(
        "nft",
        torch.zeros(2, 1),
        torch.zeros(2, 1),
        t([5.0, -2.5]),
        mask,
        velocity=v,
        old_velocity=t(V_OLD).view(2, 1, 2),
        target=t(TARGET).view(2, 1, 2),
        t=t([[0.5], [1.0]]),
        beta=0.5,
        weighting="velocity",
    )
    assert_close(loss, t([[1.25], [0.0]]))
    assert_close(m["nft/r_mean"], t(1.0))
    with pytest.raises(ValueError, match="objective=nft"):
        losses.compute("nft", torch.zeros(2, 1), torch.zeros(2, 1), t([1.0, 0.0]), mask)


def test_flow_settings_take_the_objective_names_from_the_registry(monkeypatch):
    """FlowSettings.check accepts every name in OBJECTIVES (a plugin's too) and lists them when it rejects one."""
    from mmgrpo.errors import UserError
    from pipelines.flow.objectives import OBJECTIVES
    from pipelines.flow.settings import FlowSettings

    with pytest.raises(UserError, match=r"objective \('mine'\) must be grpo or nft \("):
        FlowSettings(model="tiny:sd3", objective="mine").check()
    monkeypatch.setitem(OBJECTIVES._items, "mine", object)
    FlowSettings(model="tiny:sd3", objective="mine").check()
    with pytest.raises(UserError, match=r"objective \('other'\) must be grpo or mine or nft \("):
        FlowSettings(model="tiny:sd3", objective="other").check()
