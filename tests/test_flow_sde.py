"""Golden tests for pipelines.flow.sde: every step kind, log-density, re-scoring, generators, schedule, exact KL.

Expected values are worked out by hand in float64 (working in the comments); diffusers is the reference for "ode",
"ddim" and sigmas(), torch.distributions.Normal for the log-density.
"""

import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from torch.testing import assert_close

from pipelines.flow import sde
from pipelines.flow.sde import STEPS, ddim_step, kl_gaussian, sigmas, step

F64 = torch.float64
LN2PI = math.log(2 * math.pi)


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# the tiny batch used by the golden tests: 2 samples x 2 elements
X = [[1.0, -2.0], [0.5, 0.0]]
V = [[0.5, 1.0], [-1.0, 2.0]]
SIG, SIG_NEXT = [1.0, 0.5], [0.75, 0.25]


def test_registry_lists_the_five_kinds():
    assert STEPS.names() == ["cps", "dance", "ddim", "flow_grpo", "ode", "sage"]
    with pytest.raises(ValueError, match="unknown sde step 'flow-grpo'.*did you mean 'flow_grpo'"):
        step("flow-grpo", t(X), t(V), 0.5, 0.25, noise_level=0.7)


def test_flow_grpo_golden():
    # Flow-GRPO arXiv:2505.05470 Eq. 9, eta = 0.5, dt = -0.25 for both samples.
    # sample 0, sigma = 1: s_t = 0.5 * sqrt(1 / (1 - sigma_next = 0.25)) = 1.0 (Flow-GRPO's sigmas[1] rule);
    #   std = 1 * sqrt(0.25) = 0.5; mean = x (1 + 1 * -0.25 / 2) + v (1 + 0) * -0.25 = 0.875 x - 0.25 v
    #   = [0.875 - 0.125, -1.75 - 0.25] = [0.75, -2.0]
    # sample 1, sigma = 0.5: s_t = 0.5 * sqrt(0.5 / 0.5) = 0.5; std = 0.5 * 0.5 = 0.25;
    #   x coef = 1 + 0.25 * -0.25 / 1 = 0.9375; v coef = (1 + 0.25 * 0.5 / 1) * -0.25 = -0.28125
    #   mean = [0.46875 + 0.28125, 0 - 0.5625] = [0.75, -0.5625]
    prev = t([[1.0, -2.0], [0.5, -0.5625]])
    out = step("flow_grpo", t(X), t(V), t(SIG), t(SIG_NEXT), noise_level=0.5, prev_sample=prev)
    assert_close(out.mean, t([[0.75, -2.0], [0.75, -0.5625]]))
    assert_close(out.std, t([0.5, 0.25]))
    # residuals: sample 0 [0.25, 0] / 0.5 = z [0.5, 0]; sample 1 [-0.25, 0] / 0.25 = z [-1, 0]
    # logp_mean = mean(-z^2 / 2) - log std - log(2 pi) / 2
    lp0 = -0.0625 - math.log(0.5) - LN2PI / 2
    lp1 = -0.25 - math.log(0.25) - LN2PI / 2
    assert_close(out.logp, t([lp0, lp1]))
    out_sum = step("flow_grpo", t(X), t(V), t(SIG), t(SIG_NEXT), noise_level=0.5, prev_sample=prev, reduce="sum")
    sum0, sum1 = -0.125 + 2 * (-math.log(0.5) - LN2PI / 2), -0.5 + 2 * (-math.log(0.25) - LN2PI / 2)
    assert_close(out_sum.logp, t([sum0, sum1]))


def test_dance_golden():
    # DanceGRPO arXiv:2505.07818 flux_step with sde_solver: eta = 0.5, dsigma = -0.25, std = 0.5 * sqrt(0.25) = 0.25
    # mean = x + dsigma v + (-0.5 eta^2 score) dsigma = x - 0.25 v + 0.03125 score, score = -(x - (1-s) x0_hat) / s^2
    # sample 0 (s=1): x0_hat = x - v = [0.5, -3]; score = -x = [-1, 2]
    #   mean = [1 - 0.125 - 0.03125, -2 - 0.25 + 0.0625] = [0.84375, -2.1875]
    # sample 1 (s=0.5): x0_hat = x - 0.5 v = [1, -1]; x - 0.5 x0_hat = [0, 0.5]; score = [0, -2]
    #   mean = [0.5 + 0.25, 0 - 0.5 - 0.0625] = [0.75, -0.5625]
    prev = t([[0.84375, -2.1875], [1.0, -0.5625]])
    out = step("dance", t(X), t(V), t(SIG), t(SIG_NEXT), noise_level=0.5, prev_sample=prev)
    assert_close(out.mean, t([[0.84375, -2.1875], [0.75, -0.5625]]))
    assert_close(out.std, t([0.25, 0.25]))
    # sample 0 sits on its mean: logp = -log 0.25 - log(2 pi)/2; sample 1: z = [1, 0] -> mean(-z^2/2) = -0.25
    base = -math.log(0.25) - LN2PI / 2
    assert_close(out.logp, t([base, -0.25 + base]))


def test_cps_golden():
    # Flow-CPS arXiv:2509.05952: eta = 0.5 -> sin(pi/4) = cos(pi/4) = sqrt(2)/2 =: c
    # std = sigma_next c; mean = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) x1_hat, the root = sigma_next c
    # sample 0: x0_hat = x - v = [0.5, -3], x1_hat = x + 0 v = [1, -2]; mean = 0.25 x0_hat + 0.75 c x1_hat
    # sample 1: x0_hat = x - 0.5 v = [1, -1], x1_hat = x + 0.5 v = [0, 1]; mean = 0.75 x0_hat + 0.25 c x1_hat
    c = math.sqrt(2) / 2
    mean = t([[0.125 + 0.75 * c, -0.75 - 1.5 * c], [0.75, -0.75 + 0.25 * c]])
    prev = mean + t([[0.75 * c, 0.0], [0.0, 0.0]])  # sample 0: z = [1, 0]
    out = step("cps", t(X), t(V), t(SIG), t(SIG_NEXT), noise_level=0.5, prev_sample=prev)
    assert_close(out.mean, mean)
    assert_close(out.std, t([0.75 * c, 0.25 * c]))
    assert_close(out.logp, t([-0.25 - math.log(0.75 * c) - LN2PI / 2, -math.log(0.25 * c) - LN2PI / 2]))
    # coefficient preservation: x0 keeps 1 - sigma_next, noise sqrt(keep^2 + std^2) = sigma_next
    assert_close(torch.sqrt(out.std**2 + (t(SIG_NEXT) * c) ** 2), t(SIG_NEXT))


def test_ddim_golden():
    # DDPO arXiv:2305.13301 / DDIM Eq. 12, eta = 1, eps = V.
    # sample 0: a = 0.25, a_prev = 0.64: var = 0.36/0.75 * (1 - 0.25/0.64) = 0.48 * 0.609375 = 0.2925
    #   x0_hat = (x - sqrt(0.75) eps) / 0.5; mean = 0.8 x0_hat + sqrt(1 - 0.64 - 0.2925 = 0.0675) eps
    # sample 1: a = 0.5, a_prev = 1 (last step): var = 0 -> deterministic, mean = x0_hat = sqrt(2) x - eps, logp = 0
    x0 = [(1 - math.sqrt(0.75) * 0.5) / 0.5, (-2 - math.sqrt(0.75) * 1.0) / 0.5]
    mean0 = [0.8 * x0[0] + math.sqrt(0.0675) * 0.5, 0.8 * x0[1] + math.sqrt(0.0675) * 1.0]
    mean1 = [math.sqrt(2) * 0.5 + 1.0, -2.0]
    prev = t([[mean0[0] + math.sqrt(0.2925), mean0[1]], [5.0, 5.0]])  # sample 0: z = [1, 0]
    out = ddim_step(t(X), t(V), t([0.25, 0.5]), t([0.64, 1.0]), eta=1.0, prev_sample=prev)
    assert_close(out.mean, t([mean0, mean1]))
    assert_close(out.std, t([math.sqrt(0.2925), 0.0]))
    assert_close(out.logp, t([-0.25 - 0.5 * math.log(0.2925) - LN2PI / 2, 0.0]))
    same = step("ddim", t(X), t(V), t([0.25, 0.5]), t([0.64, 1.0]), noise_level=1.0, prev_sample=prev)
    assert_close(same.logp, out.logp)


def test_ddim_matches_diffusers_ddim_scheduler_with_the_same_noise():
    sched = DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    sched.set_timesteps(10)
    x = torch.randn(2, 3, 4)
    for tt in sched.timesteps:
        eps, noise = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        ref = sched.step(eps, tt, x, eta=1.0, variance_noise=noise).prev_sample
        prev_t = int(tt) - 1000 // 10
        a = sched.alphas_cumprod[int(tt)]
        a_prev = sched.alphas_cumprod[prev_t] if prev_t >= 0 else sched.final_alpha_cumprod
        out = ddim_step(x, eps, a, a_prev, eta=1.0)
        assert_close(out.mean + out.std[:, None, None] * noise, ref, atol=1e-5, rtol=1e-5)
        x = ref


def test_ode_equals_diffusers_flow_match_euler_step_over_a_full_schedule():
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(12)
    x = torch.randn(2, 4, 3, 3)
    for i, tt in enumerate(sched.timesteps):
        v = torch.randn(2, 4, 3, 3)
        ref = sched.step(v, tt, x).prev_sample
        out = step("ode", x, v, sched.sigmas[i], sched.sigmas[i + 1], noise_level=0.0)
        assert (out.prev_sample - ref).abs().max() <= 1e-6
        assert torch.equal(out.logp, torch.zeros(2)) and torch.equal(out.std, torch.zeros(2))
        x = ref


def test_flow_grpo_with_zero_noise_is_the_ode_step():
    x, v = torch.randn(3, 5), torch.randn(3, 5)
    s, s_next = torch.tensor([1.0, 0.6, 0.1]), torch.tensor([0.8, 0.3, 0.0])
    sde_out = step("flow_grpo", x, v, s, s_next, noise_level=0.0)
    ode_out = step("ode", x, v, s, s_next, noise_level=0.0)
    assert_close(sde_out.prev_sample, ode_out.prev_sample, atol=1e-7, rtol=0)
    assert torch.equal(sde_out.logp, torch.zeros(3))


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_logp_equals_torch_normal_and_rescoring_gives_ratio_one(kind, reduce):
    x, v = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3)
    s, s_next = torch.tensor([0.9, 0.7, 0.5, 0.3]), torch.tensor([0.8, 0.5, 0.45, 0.1])
    out = step(kind, x, v, s, s_next, noise_level=0.7, reduce=reduce, generator=torch.Generator().manual_seed(3))
    ref = torch.distributions.Normal(out.mean, out.std.view(-1, 1, 1, 1)).log_prob(out.prev_sample)
    ref = ref.mean((1, 2, 3)) if reduce == "mean" else ref.sum((1, 2, 3))
    assert_close(out.logp, ref)
    again = step(kind, x, v, s, s_next, noise_level=0.7, reduce=reduce, prev_sample=out.prev_sample)
    assert torch.equal(again.logp, out.logp)  # ratio exactly 1


def test_bf16_inputs_are_scored_in_float32_after_the_storage_cast():
    x, v = torch.randn(3, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    out = step("flow_grpo", x, v, 0.6, 0.5, noise_level=0.7)
    assert out.prev_sample.dtype == torch.bfloat16 and out.logp.dtype == torch.float32
    assert out.mean.dtype == torch.float32
    again = step("flow_grpo", x, v, 0.6, 0.5, noise_level=0.7, prev_sample=out.prev_sample)
    assert torch.equal(again.logp, out.logp)


def test_logp_has_gradient_wrt_velocity_only():
    x, v = torch.randn(2, 4), torch.randn(2, 4, requires_grad=True)
    out = step("flow_grpo", x, v, 0.5, 0.4, noise_level=0.7)
    assert not out.prev_sample.requires_grad
    out.logp.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_sampled_noise_scale_is_the_scored_scale():
    # BranchGRPO scored with std but sampled with split_noise_scale * std. Here E[logp] over the own samples must be
    # the negative entropy -1/2 - log std - log(2 pi)/2 (mean reduction), which fails for any other sampling scale:
    # a x4 scale would give E[-z^2/2] = -8 instead of -0.5.
    x, v = torch.zeros(1, 40000, dtype=F64), torch.zeros(1, 40000, dtype=F64)
    for kind in ("flow_grpo", "dance", "cps", "sage"):
        out = step(kind, x, v, 0.6, 0.5, noise_level=0.7, generator=torch.Generator().manual_seed(0))
        assert (out.prev_sample - out.mean).std().item() == pytest.approx(out.std.item(), rel=0.02)
        neg_entropy = -0.5 - math.log(out.std.item()) - LN2PI / 2
        assert out.logp.item() == pytest.approx(neg_entropy, abs=0.02)


def test_per_sample_generators_make_noise_independent_of_the_batch():
    x, v = torch.randn(3, 6), torch.randn(3, 6)
    gens = [torch.Generator().manual_seed(s) for s in (11, 12, 13)]
    full = step("flow_grpo", x, v, 0.7, 0.6, noise_level=0.7, generator=gens)
    alone = step("flow_grpo", x[1:2], v[1:2], 0.7, 0.6, noise_level=0.7, generator=[torch.Generator().manual_seed(12)])
    assert torch.equal(full.prev_sample[1:2], alone.prev_sample)
    swapped = step(
        "flow_grpo",
        x[[2, 1]],
        v[[2, 1]],
        0.7,
        0.6,
        noise_level=0.7,
        generator=[torch.Generator().manual_seed(13), torch.Generator().manual_seed(12)],
    )
    assert torch.equal(swapped.prev_sample, full.prev_sample[[2, 1]])
    one = step("flow_grpo", x, v, 0.7, 0.6, noise_level=0.7, generator=torch.Generator().manual_seed(5))
    one_again = step("flow_grpo", x, v, 0.7, 0.6, noise_level=0.7, generator=torch.Generator().manual_seed(5))
    assert torch.equal(one.prev_sample, one_again.prev_sample)
    with pytest.raises(ValueError, match="2 generators for N=3"):
        step("flow_grpo", x, v, 0.7, 0.6, noise_level=0.7, generator=gens[:2])


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_sigmas_equal_diffusers_schedule(shift):
    for n in (1, 10, 28):
        sched = FlowMatchEulerDiscreteScheduler(shift=shift)
        sched.set_timesteps(n)
        assert_close(sigmas(n, shift), sched.sigmas, atol=1e-6, rtol=0)


def test_sigmas_dynamic_shift_equal_diffusers_for_both_grids():
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    sched.set_timesteps(8, mu=0.9)
    assert_close(sigmas(8, dynamic=0.9), sched.sigmas, atol=1e-6, rtol=0)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 8, 8), mu=1.15)  # what FluxPipeline passes
    assert_close(sigmas(8, dynamic=1.15, grid="uniform"), sched.sigmas, atol=1e-6, rtol=0)


def test_step_std_matches_the_step():
    s, s_next = sigmas(6, 3.0)[:-1], sigmas(6, 3.0)[1:]
    out = step("flow_grpo", torch.zeros(6, 2), torch.zeros(6, 2), s, s_next, noise_level=0.7)
    assert_close(sde.step_std("flow_grpo", s, s_next, noise_level=0.7), out.std.double())


def test_kl_gaussian_golden_and_flow_grpo_relation():
    # mean - ref = [1, 2], std 0.5: (mean - ref)^2 / (2 * 0.25) = [2, 8] -> mean 5, sum 10
    mean, ref = t([[1.0, 2.0]]), t([[0.0, 0.0]])
    assert_close(kl_gaussian(mean, ref, 0.5), t([5.0]))
    assert_close(kl_gaussian(mean, ref, t([0.5]), "sum"), t([10.0]))
    # Flow-GRPO's KL mean((mu - mu_ref)^2) / (2 s_t^2) with std = s_t sqrt(|dt|) is the exact KL times |dt|
    s_t, dt = 0.8, 0.1
    flow_grpo_kl = ((mean - ref) ** 2).mean() / (2 * s_t**2)
    assert_close(kl_gaussian(mean, ref, s_t * math.sqrt(dt)) * dt, flow_grpo_kl.reshape(1))
    assert_close(kl_gaussian(mean, mean, 0.0), t([0.0]))
    assert kl_gaussian(mean, ref, 0.0).isinf().all()


def test_kl_gaussian_matches_monte_carlo():
    torch.manual_seed(1)
    mean, ref, std = torch.randn(2, 3, dtype=F64), torch.randn(2, 3, dtype=F64), t([0.7, 1.3])
    draws = mean + std[:, None] * torch.randn(200000, 2, 3, dtype=F64)  # [M, N, D]
    p = torch.distributions.Normal(mean, std[:, None])
    q = torch.distributions.Normal(ref, std[:, None])
    mc = (p.log_prob(draws) - q.log_prob(draws)).sum(-1).mean(0)  # [N]
    assert_close(kl_gaussian(mean, ref, std, "sum"), mc, atol=0.02, rtol=0.01)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "flow_grpo", "sigma": [0.5, 0.5], "sigma_next": [0.6, 0.4]}, "0 <= sigma_next <= sigma <= 1"),
        ({"kind": "flow_grpo", "sigma": [1.2, 0.5], "sigma_next": [0.6, 0.4]}, "0 <= sigma_next <= sigma <= 1"),
        ({"kind": "flow_grpo", "sigma": [0.0, 0.0], "sigma_next": [0.0, 0.0]}, "divides by sigma"),
        ({"kind": "flow_grpo", "sigma": [0.5, 0.5, 0.5], "sigma_next": 0.4}, r"\[N\]=\(2,\)"),
        ({"kind": "cps", "noise_level": 1.5}, "0 <= noise_level <= 1"),
        ({"kind": "ddim", "sigma": 0.9, "sigma_next": 0.5}, "alphas_cumprod"),
        ({"noise_level": -0.1}, "noise_level must be >= 0"),
        ({"reduce": "token"}, "reduce must be"),
        ({"prev_sample": torch.zeros(2, 3)}, r"prev_sample \(2, 3\) != sample \(2, 2\)"),
    ],
)
def test_invalid_inputs_raise_clear_errors(kwargs, match):
    args = {"kind": "flow_grpo", "sigma": 0.5, "sigma_next": 0.4, "noise_level": 0.7}
    args.update(kwargs)
    kind, s, s_next = args.pop("kind"), args.pop("sigma"), args.pop("sigma_next")
    with pytest.raises(ValueError, match=match):
        step(kind, t(X), t(V), torch.as_tensor(s, dtype=F64), torch.as_tensor(s_next, dtype=F64), **args)


def test_velocity_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"velocity \(2, 3\) != sample \(2, 2\)"):
        step("ode", t(X), torch.zeros(2, 3, dtype=F64), 0.5, 0.4, noise_level=0.0)
