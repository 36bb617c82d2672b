"""SAGE-GRPO (arXiv:2603.21872): the curvature-corrected step (float64 goldens worked by hand, exact re-scoring), the
gradient-norm equaliser, and the dual trust region (moving anchor, per-update KL) on a tiny SD3 policy."""

import math
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import pipelines.flow  # noqa: F401  registers the "sage" step kind and the weighted_clipped loss
from mmgrpo import losses
from mmgrpo.errors import UserError
from pipelines.flow.build import check_flow_kwargs
from pipelines.flow.sage import equaliser_weights, sage_noise_ratio
from pipelines.flow.sde import step, step_std

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def test_sage_step_golden():
    # sigma 0.5 -> 0.25, eta 0.7, x = 1, v = 0.5: L = log(0.75 / 0.5) = log 1.5 = 0.4054651
    # var = 0.49 (L - 0.25) = 0.0761779, std = 0.2760034 (Flow-GRPO's Euler var: 0.49 * 0.5/0.5 * 0.25 = 0.1225)
    # x1_hat = 1 + 0.5 * 0.5 = 1.25; mean = 1 - 0.25 * 0.5 - 0.245 * L * 1.25 = 0.7508263
    lg = math.log(1.5)
    out = step("sage", t([[1.0]]), t([[0.5]]), 0.5, 0.25, noise_level=0.7, prev_sample=t([[0.8]]))
    std = math.sqrt(0.49 * (lg - 0.25))
    mean = 1 - 0.125 - 0.245 * lg * 1.25
    assert abs(std - 0.2760034) < 1e-6 and abs(mean - 0.7508263) < 1e-6
    assert_close(out.std, t([std]))
    assert_close(out.mean, t([[mean]]))
    assert_close(out.logp, t([-((0.8 - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)]))
    assert sage_noise_ratio(0.5, 0.25) == pytest.approx((lg - 0.25) / 0.25, rel=1e-12)  # 0.62 of Euler


def test_sage_first_step_from_sigma_one_equals_flow_grpo():
    # at sigma = 1 the integral diverges; both use 1 - sigma_next: var = 0.49 * 1 * 0.25 / 0.25 = 0.49
    x, v = t([[0.3, -1.2]]), t([[0.7, 0.1]])
    a = step("sage", x, v, 1.0, 0.75, noise_level=0.7, prev_sample=x)
    b = step("flow_grpo", x, v, 1.0, 0.75, noise_level=0.7, prev_sample=x)
    assert_close(a.std, t([0.7]))
    assert_close(a.mean, b.mean)
    assert_close(a.std, b.std)


def test_sage_injects_less_noise_than_euler_and_agrees_to_first_order():
    s = torch.linspace(0.95, 0.1, 12, dtype=F64)
    sage, euler = (
        step_std("sage", s[:-1], s[1:], noise_level=0.7),
        step_std("flow_grpo", s[:-1], s[1:], noise_level=0.7),
    )
    assert bool((sage < euler).all())
    fine = step_std("sage", t([0.5]), t([0.5 - 1e-6]), noise_level=0.7) / step_std(
        "flow_grpo", t([0.5]), t([0.5 - 1e-6]), noise_level=0.7
    )
    assert fine.item() == pytest.approx(1.0, abs=1e-5)


def test_sage_resamples_and_rescores_exactly():
    x, v = torch.randn(3, 4, 5), torch.randn(3, 4, 5)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    first = step("sage", x, v, torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.0]), noise_level=0.7,
                 generator=gens)  # fmt: skip
    again = step("sage", x, v, torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.0]), noise_level=0.7,
                 prev_sample=first.prev_sample)  # fmt: skip
    assert torch.equal(first.logp, again.logp)


def test_equaliser_weights_golden():
    # dance, eta 1: pairs (0.8, 0.4), (0.4, 0.0): std = sqrt(0.4) both; |d mean / d v| = |dt| (1 + (1 - s) / (2 s))
    # = 0.4 * 1.125 = 0.45 and 0.4 * 1.75 = 0.7; w ~ 1/0.45, 1/0.7 -> mean 1: 1.4/1.15, 0.9/1.15
    w = equaliser_weights(t([0.8, 0.4]), t([0.4, 0.0]), kind="dance", noise_level=1.0)
    assert_close(w, t([1.4 / 1.15, 0.9 / 1.15]))
    # a deterministic last step (CPS at sigma_next = 0) gets weight 0, the rest keep mean 1
    w = equaliser_weights(t([0.8, 0.4]), t([0.4, 0.0]), kind="cps", noise_level=0.8)
    assert w[1] == 0 and w[0] == pytest.approx(1.0)


def test_weighted_clipped_is_clipped_times_weight():
    logp, old = torch.tensor([[0.1, -0.3], [0.0, 0.2]]), torch.zeros(2, 2)
    adv, mask = torch.tensor([1.0, -2.0]), torch.ones(2, 2, dtype=torch.bool)
    base, _ = losses.compute("clipped", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    got, _ = losses.compute("weighted_clipped", logp, old, adv, mask, weight=torch.tensor([2.0, 0.5]), k_offset=0)
    assert_close(got, base * torch.tensor([2.0, 0.5]))


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"anchor_every": -1}, "anchor_every"),
        ({"trust_step": 0.5, "reference": False}, "needs reference: true"),
        ({"step_weights": "equalise"}, "grad_equalizer"),
    ],
)
def test_trust_region_misuse_fails_before_loading(kw, match):
    with pytest.raises(UserError, match=match) as err:
        check_flow_kwargs(**kw)
    assert "\n" not in str(err.value)


@pytest.fixture
def tiny_sd3(monkeypatch):
    monkeypatch.setenv("MMGRPO_CACHE", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "mmgrpo"))
    return "tiny:sd3"


def _nudge(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))


def test_moving_anchor_and_per_update_kl_on_a_tiny_policy(tiny_sd3):
    from pipelines.flow.build import tiny_task

    task = tiny_task(tiny_sd3, sde="sage", anchor_every=2, trust_step=1.0, step_weights="grad_equalizer")
    pol, idx = task.policy, torch.arange(2)
    pol.set_iteration(0)
    r = pol.rollout([{"prompt": "a"}], 2, [0])
    logp, _ = pol.logp(task.module, r, idx)
    assert_close(logp[r.mask], r.old_logp[r.mask], rtol=0, atol=1e-5)  # ratio 1 before any update
    _nudge(task.module)  # "an update"
    ref = pol.ref_logp(r, idx)  # still the base model (adapter off): it scored the rollout
    assert_close(ref[r.mask], r.old_logp[r.mask], rtol=0, atol=1e-5)
    new, aux = pol.logp(task.module, r, idx)
    # reference and rollout policy are both the base here: KL = KL_ref + 1.0 * KL_old = 2 KL_ref
    assert bool((aux["kl"][r.mask] > 0).all())
    assert aux["loss_kwargs"]["weight"].shape == r.mask.shape
    pol.set_iteration(1)  # not due yet
    assert pol.anchor.state is None
    pol.set_iteration(2)  # the anchor moves to the nudged weights: the reference now scores like the policy
    assert pol.anchor.state is not None
    before = {n: p.detach().clone() for n, p in task.module.named_parameters() if p.requires_grad}
    ref = pol.ref_logp(r, idx)
    assert_close(ref[r.mask], new.detach()[r.mask], rtol=0, atol=1e-5)
    assert all(torch.equal(p, before[n]) for n, p in task.module.named_parameters() if p.requires_grad)
    _, aux2 = pol.logp(task.module, r, idx)
    # KL to the anchor is now 0: only the per-update term (to the base rollout policy) remains, half of before
    assert_close(aux2["kl"][r.mask], aux["kl"][r.mask] / 2, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("lora", [True, False])
def test_moving_anchor_is_in_the_checkpoint_state(tiny_sd3, lora):
    # a run interrupted after the anchor moved resumes against the same reference: save at step 2 (anchor moved to
    # the nudged weights), load into a fresh policy, and the reference scores equal the uninterrupted run's
    from pipelines.flow.build import tiny_task

    kw = dict(sde="sage", anchor_every=2, trust_step=1.0) | ({} if lora else {"lora_rank": 0})
    task = tiny_task(tiny_sd3, **kw)
    pol, idx = task.policy, torch.arange(2)
    pol.set_iteration(0)
    r = pol.rollout([{"prompt": "a"}], 2, [0])
    _nudge(task.module) if lora else _nudge_full(task.module)
    pol.set_iteration(2)
    ref = pol.ref_logp(r, idx)
    state = pol.state_dict()
    assert int(state["anchor.at"]) == 2 and any(k.startswith("anchor.") and k != "anchor.at" for k in state)
    fresh = tiny_task(tiny_sd3, **kw)
    fresh.policy.load_state_dict(state)
    assert fresh.policy.anchor.at == 2
    fresh.policy.set_iteration(3)  # not due: the loaded anchor stays
    assert_close(fresh.policy.ref_logp(r, idx)[r.mask], ref[r.mask], rtol=0, atol=1e-6)
    plain = tiny_task(tiny_sd3, **({} if lora else {"lora_rank": 0}))  # a policy without a moving anchor ignores it
    plain.policy.load_state_dict(state)
    assert plain.policy.anchor.at is None


def _nudge_full(module):
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
