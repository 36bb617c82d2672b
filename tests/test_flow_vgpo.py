"""VGPO (arXiv:2512.12387): the value-anchored estimator and the per-step tree values, float64 goldens worked by hand,
the reduction to the group estimator without branching, and the policy hook (ratio 1, per-step advantages)."""

import math

import pytest
import torch
from torch.testing import assert_close

import pipelines.flow  # noqa: F401
from mmgrpo.advantages import compute, value_anchored
from mmgrpo.errors import UserError
from pipelines.flow.build import check_flow_kwargs
from pipelines.flow.plan import make_plan
from pipelines.flow.vgpo import step_values, vgpo_step_advantages

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def _plan(name, g, **kw):
    return make_plan(name, num_steps=3, group_size=g, sde="flow_grpo", iteration=0, same_noise=False, seeds=[0], **kw)


def test_vgpo_group_golden():
    # rewards [1, 0, 0, 1], anchor 0, s = 0.5: mean 0.5, std (ddof 1) = sqrt(1/3), sigma^2 + s^2 = 1/3 + 1/4 = 7/12
    # a_w = (1/4) / (7/12) = 3/7; A = (r - 0.5 + 3/7 * 0.5) / sqrt(7/12)
    # r = 1: 0.7142857 / 0.7637626 = 0.9352195; r = 0: -0.2857143 / 0.7637626 = -0.3740878
    adv = compute("vgpo", t([[1.0, 0.0, 0.0, 1.0]]), anchor=0.0, scale=0.5)
    hi, lo = (0.5 + 1.5 / 7) / math.sqrt(7 / 12), (-0.5 + 1.5 / 7) / math.sqrt(7 / 12)
    assert adv.dtype == torch.float32
    assert_close(adv.double(), t([[hi, lo, lo, hi]]), rtol=0, atol=1e-6)
    assert abs(hi - 0.9352195) < 1e-6 and abs(lo + 0.3740878) < 1e-6
    # a flat group keeps a signal: [0.7, 0.7], anchor 0.2, s 0.5 -> sigma 0, a_w 1: (0.7 - 0.2) / 0.5 = 1
    assert_close(compute("vgpo", t([[0.7, 0.7]]), anchor=0.2, scale=0.5).double(), t([[1.0, 1.0]]))
    # and one below the anchor is pushed away: (0.1 - 0.2) / 0.5 = -0.2; G = 1 the same
    assert_close(compute("vgpo", t([[0.1], [0.7]]), anchor=0.2, scale=0.5).double(), t([[-0.2], [1.0]]))


def test_fixed_alpha_zero_and_no_scale_is_grpo():
    r = t([[3.0, 1.0, 2.0], [0.0, 4.0, 2.0]])
    want = compute("grpo", r, std="group", eps=0.0)
    assert_close(compute("vgpo", r, scale=0.0, alpha=0.0), want)
    # value_anchored with fixed alpha 1 and s = 0: (q - anchor) / sigma
    assert_close(value_anchored(t([2.0]), t([1.0]), t([0.5]), anchor=1.5, scale=0.0, alpha=1.0), t([1.0]))


@pytest.mark.parametrize("kw,match", [({"scale": 0.0}, "scale=0"), ({"alpha": 1.5}, "alpha"), ({"ddof": 2}, "ddof")])
def test_vgpo_bad_kwargs(kw, match):
    with pytest.raises(ValueError, match=match):
        compute("vgpo", t([[1.0, 0.0]]), **kw)


def test_tree_step_values_and_advantages_golden():
    # roots 1, fanout 2, splits at steps 0 and 1, T = 3, G = 4, rewards [1, 0, 0, 0]
    # depth(0) = 1, depth(1) = depth(2) = 2; nodes: root 0.25; depth 1 [0.5, 0.0]; leaves [1, 0, 0, 0]
    # leaf 0: step 0 q 0.5 v 0.25; steps 1, 2 q 1 v 0.5.  leaf 1: step 0 as leaf 0; steps 1, 2 q 0 v 0.5
    # leaves 2, 3: step 0 q 0 v 0.25; steps 1, 2 q 0 v 0
    plan, trained = _plan("tree", 4, split_steps=[0, 1], fanout=2)
    steps = torch.stack([row.nonzero().flatten() for row in trained])  # [4, 3]
    q, v = step_values(plan, t([[1.0, 0.0, 0.0, 0.0]]), steps)
    assert_close(q, t([[0.5, 1, 1], [0.5, 0, 0], [0, 0, 0], [0, 0, 0]]))
    assert_close(v, t([[0.25, 0.5, 0.5], [0.25, 0.5, 0.5], [0.25, 0, 0], [0.25, 0, 0]]))
    # the relative gains of a leaf's distinct edges telescope to r - mean: 0.25 + 0.5 = 1 - 0.25
    assert (q - v)[0, 0] + (q - v)[0, 1] == 0.75
    # std([1, 0, 0, 0], ddof 1) = sqrt(0.75 / 3) = 0.5; s = 0.5 -> sqrt(0.5), a_w = 0.5, anchor 0: A = (q - v / 2) sqrt 2
    adv = vgpo_step_advantages(plan, t([[1.0, 0.0, 0.0, 0.0]]), steps, anchor=0.0, scale=0.5)
    r2 = math.sqrt(2)
    want = [[0.375 * r2, 0.75 * r2, 0.75 * r2], [0.375 * r2, -0.25 * r2, -0.25 * r2], [-0.125 * r2, 0, 0],
            [-0.125 * r2, 0, 0]]  # fmt: skip
    assert adv.dtype == torch.float32
    assert_close(adv.double(), t(want), rtol=0, atol=1e-6)


def test_flat_tree_keeps_the_anchor_signal_at_every_step():
    plan, trained = _plan("tree", 4, split_steps=[0, 1], fanout=2)
    steps = torch.stack([row.nonzero().flatten() for row in trained])
    adv = vgpo_step_advantages(plan, t([[0.7] * 4]), steps, anchor=0.2, scale=0.5)  # (0.7 - 0.2) / 0.5
    assert_close(adv.double(), torch.ones(4, 3, dtype=F64))


def test_without_branching_every_step_gets_the_group_estimator():
    plan, trained = _plan("independent", 3, train="all")
    steps = torch.stack([row.nonzero().flatten() for row in trained])  # [6, 3] for one prompt... seeds=[0]: [3, 3]
    r = t([[0.9, 0.2, 0.4]])
    adv = vgpo_step_advantages(plan, r, steps, anchor=0.5, scale=0.3)
    assert_close(adv, compute("vgpo", r, anchor=0.5, scale=0.3).reshape(-1, 1).expand(3, 3))


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"value_anchor": {"anchr": 0.5}}, "unknown: \\['anchr'\\]"),
        ({"value_anchor": {"scale": -1.0}}, "scale=-1.0"),
        ({"value_anchor": {}, "plan": "singular", "plan_kwargs": {"granularities": [1, 2]}}, "granularities"),
    ],
)
def test_value_anchor_misuse_fails_before_loading(kw, match):
    with pytest.raises(UserError, match=match) as err:
        check_flow_kwargs(**kw)
    assert "\n" not in str(err.value)


def test_policy_uses_vgpo_step_credit_on_a_tree(monkeypatch):
    from pathlib import Path

    from pipelines.flow.build import tiny_task

    # the tiny SD3 cached where the recipe tests build it (tiny:sd3 is built once per checkout)
    monkeypatch.setenv("MMGRPO_CACHE", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "mmgrpo"))
    task = tiny_task(
        "tiny:sd3",
        plan="tree",
        plan_kwargs={"split_steps": [0, 2]},
        value_anchor={"anchor": 0.0, "scale": 0.5},
    )
    pol = task.policy
    assert pol.wants_step_advantages
    r = pol.rollout([{"prompt": "a"}], 4, [0])
    logp, _ = pol.logp(task.module, r, torch.arange(4))
    assert_close(logp[r.mask], r.old_logp[r.mask], rtol=0, atol=1e-5)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    adv = pol.step_advantages(r, rewards)
    want = vgpo_step_advantages(pol.last_plan, rewards, r.extras["step"], anchor=0.0, scale=0.5)
    assert adv.shape == r.mask.shape and torch.equal(adv, want)
