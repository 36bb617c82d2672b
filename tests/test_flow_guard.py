"""GRPO-Guard / TempFlow-GRPO wiring in the flow policy: what `ratio_norm` and `step_weights` hand to the loss.

GRPO-Guard arXiv:2510.22319 (exact RatioNorm, 1/|dt| reweighting); TempFlow-GRPO arXiv:2508.04324 (noise-aware
weights). Tiny random SD3 pipeline, float32/float64 hand checks.
"""

import pytest
import torch

import pipelines.flow  # noqa: F401
from mmgrpo import losses
from mmgrpo.errors import UserError
from pipelines.flow import sde
from pipelines.flow.build import tiny_task
from pipelines.flow.objectives import guard_log_ratio

PROMPTS = [{"prompt": "a red circle"}, {"prompt": "a blue square"}]


def _policy(path, **kw):
    task = tiny_task(path, **{"reference": False, **kw})
    return task.policy, task.module


def _nudge_lora(module):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def test_ratio_norm_passes_exact_inputs_and_equals_eps_dot_mean_shift(tiny_sd3):
    pol, module = _policy(tiny_sd3, ratio_norm=True)
    r = pol.rollout(PROMPTS, 2, [3, 4])
    n, k = r.old_logp.shape
    assert r.extras["old_mean"].shape == r.extras["x_t"].shape
    lp, aux = pol.logp(module, r, torch.arange(n))
    kw = aux["loss_kwargs"]
    assert set(kw) == {"std", "mean_sq_dist", "k_offset"} and kw["k_offset"] == 0
    # before any update the means are the stored ones: d2 = 0 and the normalised log-ratio is exactly 0
    assert float(kw["mean_sq_dist"].detach().abs().max()) < 1e-10
    want_std = sde.step_std(
        "flow_grpo", r.extras["sigma"].reshape(-1), r.extras["sigma_next"].reshape(-1), noise_level=0.7
    ).view(n, k)
    torch.testing.assert_close(kw["std"].double(), want_std, rtol=1e-6, atol=0)
    _nudge_lora(module)
    lp, aux = pol.logp(module, r, torch.arange(n))
    kw = aux["loss_kwargs"]
    assert kw["mean_sq_dist"].requires_grad and float(kw["mean_sq_dist"].detach().min()) > 0
    # identity (working): with x' = mu_old + s eps, s (logp - old_logp) + d2 / (2 s)
    #   = [(x' - mu_old)^2 - (x' - mu)^2 + (mu - mu_old)^2] / (2 s) (element mean) = mean_d eps (mu - mu_old)
    log_r = guard_log_ratio(
        lp.double(), r.old_logp.double(), r.mask, std=kw["std"].double(), mean_sq_dist=kw["mean_sq_dist"].double()
    )
    out, _, _ = pol._score(module, r, torch.arange(n), slice(None))
    mu_old = r.extras["old_mean"].reshape(out.mean.shape).double()
    s = out.std.double().view(-1, *([1] * (out.mean.dim() - 1)))
    eps = (r.extras["x_next"].reshape(out.mean.shape).double() - mu_old) / s
    want = (eps * (out.mean.double() - mu_old)).flatten(1).mean(1).view(n, k)
    torch.testing.assert_close(log_r, want, rtol=1e-3, atol=1e-6)


def test_guard_step_weights_switch_scales_the_loss_by_one_over_dt(tiny_sd3):
    pol, module = _policy(tiny_sd3, ratio_norm=True, step_weights="guard")
    r = pol.rollout(PROMPTS, 2, [3, 4])
    n, k = r.old_logp.shape
    _nudge_lora(module)
    lp, aux = pol.logp(module, r, torch.arange(n))
    kw = aux["loss_kwargs"]
    dt = (r.extras["sigma"] - r.extras["sigma_next"]).double()  # [n, k]
    torch.testing.assert_close(kw["weight"].double(), 1 / dt, rtol=1e-6, atol=0)
    adv = torch.linspace(-1, 1, n)
    weighted, _ = losses.compute("guard_clipped", lp, r.old_logp, adv, r.mask, **kw)
    plain, _ = losses.compute(
        "guard_clipped", lp, r.old_logp, adv, r.mask, **{key: v for key, v in kw.items() if key != "weight"}
    )
    torch.testing.assert_close(weighted.double(), plain.double() / dt, rtol=1e-5, atol=1e-12)
    # a k-chunk gets the weights of its own steps
    lp1, aux1 = pol.logp(module, r, torch.arange(n), k_slice=slice(1, 2))
    torch.testing.assert_close(aux1["loss_kwargs"]["weight"], kw["weight"][:, 1:2])
    # the loss logs its per-step monitor of the normalised ratio r_hat (what it clips), keyed by the true step
    _, metrics = losses.compute("guard_clipped", lp, r.old_logp, adv, r.mask, **kw)
    log_r = guard_log_ratio(
        lp.detach().double(),
        r.old_logp.double(),
        r.mask,
        std=kw["std"].double(),
        mean_sq_dist=kw["mean_sq_dist"].detach().double(),
    )
    for j in range(k):
        torch.testing.assert_close(
            metrics[f"guard/ratio/k{j}/mean"].double(), log_r[:, j].exp().mean(), rtol=1e-5, atol=0
        )
        assert f"guard/ratio/k{j}/clip_upper" in metrics and f"guard/ratio/k{j}/clip_lower" in metrics
    _, m1 = losses.compute("guard_clipped", lp1, r.old_logp[:, 1:2], adv, r.mask[:, 1:2], **aux1["loss_kwargs"])
    assert {key for key in m1 if key.startswith("guard/ratio/")} == {
        f"guard/ratio/k1/{x}" for x in ("mean", "std", "clip_upper", "clip_lower")
    }


def test_noise_aware_and_normalized_weights_follow_the_schedule(tiny_sd3):
    pol, module = _policy(tiny_sd3, step_weights="noise_aware")
    r = pol.rollout(PROMPTS, 2, [3, 4])
    n = r.old_logp.shape[0]
    _, aux = pol.logp(module, r, torch.arange(n))
    assert set(aux["loss_kwargs"]) == {"weight", "k_offset"}  # no ratio_norm: only the weights reach the loss
    w = aux["loss_kwargs"]["weight"].double()
    # Flow-GRPO std_t = eta sqrt(s / (1 - s)) sqrt(dt) (eta cancels); the weight is std_t over the schedule mean
    s, s_next = pol.sigmas[:-1].double(), pol.sigmas[1:].double()
    std = sde.step_std("flow_grpo", s, s_next, noise_level=0.7)
    torch.testing.assert_close(w, (std / std.mean())[r.extras["step"]], rtol=1e-6, atol=0)
    inner = s < 1  # sigma = 1 is special-cased by Flow-GRPO (sde.flow_grpo); check the others by hand
    hand = (s / (1 - s) * (s - s_next)).sqrt()
    torch.testing.assert_close((std / std.mean())[inner], (hand / std.mean() * 0.7)[inner], rtol=1e-9, atol=0)
    pol2, module2 = _policy(tiny_sd3, step_weights="guard_normalized")
    r2 = pol2.rollout(PROMPTS, 2, [3, 4])
    _, aux2 = pol2.logp(module2, r2, torch.arange(n))
    table = 1 / (s - s_next)
    torch.testing.assert_close(
        aux2["loss_kwargs"]["weight"].double(), (table / table.mean())[r2.extras["step"]], rtol=1e-6, atol=0
    )


def test_plain_policy_passes_no_loss_kwargs(tiny_sd3):
    pol, module = _policy(tiny_sd3)
    r = pol.rollout(PROMPTS, 2, [3, 4])
    assert "old_mean" not in r.extras
    _, aux = pol.logp(module, r, torch.arange(4))
    assert "loss_kwargs" not in aux


@pytest.mark.parametrize(
    "kw,match", [({"step_weights": "dt"}, "step_weights"), ({"objective": "nft", "ratio_norm": True}, "ratio_norm")]
)
def test_guard_switches_are_validated(tiny_sd3, kw, match):
    with pytest.raises(UserError, match=match):
        _policy(tiny_sd3, **kw)
