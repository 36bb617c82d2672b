"""G2RPO multi-granularity completions in the rollout plan (pipelines/flow/granular.py, plan.py): completion paths,
the executor against separate and hand-run completions, exact model-call counts, the summed advantage by hand,
singular-plan config errors, and the policy (ratio 1, credit once per member, per-member advantages)."""

import pytest
import torch

from pipelines.flow import plan as P
from pipelines.flow import sde

T = 6
SIG = sde.sigmas(T, 3.0)
KINDS = ("ode", "flow_grpo", "ode", "ode", "ode", "ode")  # one SDE step (1), then the ODE tail from sigma index 2


def _velocity(x, sigma, prompt, cond):
    # toy model: linear in x, depends on sigma and the prompt's conditioning; row-wise, so batching cannot change it
    return 0.5 * x - sigma.view(-1, 1, 1) + 0.01 * cond[prompt].view(-1, 1, 1)


def _run(plan, seeds, calls=None):
    n = len(seeds) * plan.group_size
    trained = torch.tensor([t == 1 for t in range(T)]).repeat(n, 1)  # [N, T]
    cond = torch.tensor(seeds, dtype=torch.float32)

    def velocity(x, s, p):
        if calls is not None:
            calls.append(s.clone())
        return _velocity(x, s, p, cond)

    return P.execute(
        plan, seeds=seeds, shape=(2, 3), sigmas=SIG, trained=trained, velocity=velocity, step=sde.step, noise_level=0.7
    )


def test_completion_paths_end_at_sigma_zero():
    assert P.completion_indices(2, 6, 1) == [2, 3, 4, 5, 6]
    assert P.completion_indices(2, 6, 2) == [2, 4, 6]
    assert P.completion_indices(2, 6, 3) == [2, 5, 6]  # 8 would overshoot: 6 is appended
    assert P.completion_indices(5, 6, 4) == [5, 6]


def test_granularity_leaves_and_checks():
    plan = P.RolloutPlan(KINDS, roots=1, branches={1: 3}, granularities=(1, 2, 3))
    plan.check()
    assert (plan.members, plan.group_size, plan.split_step) == (3, 9, 1)
    assert [plan.fanout_after(t) for t in range(T)] == [9, 3, 1, 1, 1, 1]  # 3 members x 3 granularities at step 0
    for g in [(0, 1), (1, 1), (1.5,), ()]:
        with pytest.raises(ValueError, match="granularities"):
            P.RolloutPlan(KINDS, roots=1, branches={1: 3}, granularities=g).check()
    with pytest.raises(ValueError, match="tail after the SDE step"):  # SDE at the last step: no ODE tail
        P.RolloutPlan(("ode",) * 5 + ("flow_grpo",), branches={5: 2}, granularities=(1, 2)).check()
    with pytest.raises(ValueError, match="no step is SDE"):
        P.RolloutPlan(("ode",) * T, granularities=(1, 2)).check()
    with pytest.raises(ValueError, match="width_prune"):
        P.RolloutPlan(KINDS, branches={1: 2}, granularities=(1, 2), width_prune="extremes").check()
    with pytest.raises(ValueError, match="split step 1"):  # the tail has no log-prob to train
        P.execute(
            plan,
            seeds=[1],
            shape=(2, 3),
            sigmas=SIG,
            trained=torch.ones(9, T, dtype=torch.bool),
            velocity=lambda x, s, p: x,
            step=sde.step,
            noise_level=0.7,
        )


def test_granularities_equal_each_stride_run_alone_and_by_hand():
    strides, seeds = (1, 2, 3), [4, 7]
    both = _run(P.RolloutPlan(KINDS, roots=1, branches={1: 3}, granularities=strides), seeds)
    assert both.final.shape == (2 * 9, 2, 3) and both.steps.tolist() == [[1]] * 18
    for j, s in enumerate(strides):
        alone = _run(P.RolloutPlan(KINDS, roots=1, branches={1: 3}, granularities=(s,)), seeds)
        for a, b in [
            (both.final[j::3], alone.final),
            (both.x_next[j::3], alone.x_next),
            (both.logp[j::3], alone.logp),
        ]:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        # by hand: Euler steps x += (sigma_next - sigma) v along the stride's sigma indices from the SDE step's output
        x = both.x_next[j::3, 0].clone()  # [6, 2, 3] at sigma index 2
        prompt = torch.arange(2).repeat_interleave(3)
        for a, b in zip(P.completion_indices(2, T, s)[:-1], P.completion_indices(2, T, s)[1:]):
            x = x + (SIG[b] - SIG[a]) * _velocity(x, SIG[a].expand(6), prompt, torch.tensor([4.0, 7.0]))
        torch.testing.assert_close(both.final[j::3], x, rtol=0, atol=1e-6)
    # the granularity leaves of a member share everything up to the split
    torch.testing.assert_close(both.x_next[0::3], both.x_next[1::3], rtol=0, atol=0)
    assert not torch.allclose(both.final[0], both.final[1])


def test_model_calls_counted_exactly():
    # 2 prompts, 3 members, strides 1, 2, 3 after the SDE step at 1 (sigma indices 2 -> 6), counted by hand:
    #   steps 0 and 1 on the one shared node per prompt: 2 * 2 = 4
    #   per member: 1 shared call at sigma index 2, then stride 1 [2,3,4,5,6] 3 more, stride 2 [2,4,6] 1 more,
    #   stride 3 [2,5,6] 1 more = 6 calls; 6 members -> 36.  Total 40 (separate runs: 28 + 16 + 16 = 60).
    calls = []
    plan = P.RolloutPlan(KINDS, roots=1, branches={1: 3}, granularities=(1, 2, 3))
    res = _run(plan, [4, 7], calls)
    assert res.nfe == P.count_nfe(plan, 2) == sum(len(c) for c in calls) == 40
    assert [len(c) for c in calls] == [2, 2, 6, 18, 6, 6]  # one batched call per round after the shared one
    # round 2 batches the three strides in one call, each row at its own sigma: index 3 (stride 1), 4 (2), 5 (3)
    torch.testing.assert_close(calls[3][:3], SIG[[3, 4, 5]], rtol=0, atol=0)
    for s, alone in [(1, 28), (2, 16), (3, 16)]:
        one = P.RolloutPlan(KINDS, roots=1, branches={1: 3}, granularities=(s,))
        assert _run(one, [4, 7]).nfe == P.count_nfe(one, 2) == alone
    default = P.RolloutPlan(KINDS, roots=1, branches={1: 3})
    assert P.count_nfe(default, 2) == 2 * 2 + 6 * 4  # today's count: every step on every member


def test_granular_advantages_by_hand():
    # G2RPO (arXiv:2510.01982): A_i = sum_j (r_ij - mean_j) / (std_j + 1e-8), unbiased std over the G members.
    # Prompt 0, G = 3 members, M = 2 strides, leaf = member * 2 + j:
    #   j = 0: r = [1, 2, 3]     mean 2, std sqrt((1 + 0 + 1) / 2) = 1              -> [-1, 0, 1] / (1 + 1e-8)
    #   j = 1: r = [.5, .5, 2]   mean 1, std sqrt((.25 + .25 + 1) / 2) = 0.8660254   -> [-.5, -.5, 1] / (0.8660254 + 1e-8)
    #   sum (1 / (1 + 1e-8) = 0.99999999, 0.5 / (0.8660254 + 1e-8) = 0.5773502625): [-1.5773502525, -0.5773502625,
    #   2.1547005150]
    # Prompt 1: j = 0: r = [0, 0, 1] mean 1/3, std sqrt((1/9 + 1/9 + 4/9) / 2) = 0.5773503 -> [-.57735, -.57735, 1.1547]
    #   j = 1: all 0.7, std 0 < 1e-6 -> contributes 0
    r = torch.tensor([[1.0, 0.5, 2.0, 0.5, 3.0, 2.0], [0.0, 0.7, 0.0, 0.7, 1.0, 0.7]], dtype=torch.float64)
    s1, s3 = 0.75**0.5, (1 / 3) ** 0.5
    want = torch.tensor(
        [
            [-1 / (1 + 1e-8) - 0.5 / (s1 + 1e-8), -0.5 / (s1 + 1e-8), 1 / (1 + 1e-8) + 1 / (s1 + 1e-8)],
            [-(1 / 3) / (s3 + 1e-8), -(1 / 3) / (s3 + 1e-8), (2 / 3) / (s3 + 1e-8)],
        ],
        dtype=torch.float64,
    )
    got = P.granular_advantages(r, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got[0].tolist() == pytest.approx([-1.5773502525, -0.5773502625, 2.1547005150], abs=1e-9)
    # one granularity is GRPO's group advantage (unbiased std): prompt 0 [-1, 0, 1], prompt 1 [-1/3, -1/3, 2/3] / std
    one = torch.tensor([[-1.0, 0.0, 1.0], [-1 / 3, -1 / 3, 2 / 3]], dtype=torch.float64)
    one = one / torch.tensor([[1 + 1e-8], [s3 + 1e-8]], dtype=torch.float64)
    torch.testing.assert_close(P.granular_advantages(r[:, ::2], 1), one, rtol=0, atol=1e-12)
    assert P.granular_advantages(r[:, :2], 2).eq(0).all()  # one member: nothing to compare against
    with pytest.raises(ValueError, match="multiple of 4"):
        P.granular_advantages(r, 4)
    # per transition: every row of a member carries its advantage
    plan = P.RolloutPlan(KINDS, branches={1: 3}, granularities=(1, 2))
    rows = P.granular_step_advantages(plan, r, 1)  # [12, 1]
    assert rows.shape == (12, 1) and torch.equal(rows[0::2], rows[1::2])
    torch.testing.assert_close(rows[0::2].view(2, 3), want, rtol=0, atol=1e-12)
    assert P.credited_leaves(plan, 6).tolist() == [True, False] * 3


def _plan(**kw):
    base = {
        "num_steps": T,
        "group_size": 6,
        "sde": "flow_grpo",
        "iteration": 1,
        "same_noise": False,
        "seeds": [1, 2],
        "branch_steps": [0, 2],
    }
    base.update(kw)
    return P.make_plan("singular", **base)


def test_singular_plan_granularities_from_config():
    plan, trained = _plan(granularities=[1, 2])
    assert plan.kinds == ("ode", "ode", "flow_grpo", "ode", "ode", "ode") and plan.branches == {2: 3}
    assert plan.granularities == (1, 2) and plan.group_size == 6 and trained.shape == (12, T)
    assert trained[:, 2].all() and trained.sum() == 12
    with pytest.raises(ValueError, match=r"group_size=5 must be divisible by len\(granularities\)=2"):
        _plan(group_size=5, granularities=[1, 2])
    with pytest.raises(ValueError, match="list of ODE strides"):
        _plan(granularities=2)
    with pytest.raises(ValueError, match="tail after the SDE step"):
        _plan(granularities=[1, 2], branch_steps=[T - 1])
    # [1] is today's singular plan, field for field and mask for mask
    one, one_mask = _plan(granularities=[1])
    today, today_mask = _plan()
    assert one == today and not one.coarse and torch.equal(one_mask, today_mask)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pipelines.flow.tiny import save_tiny

    return save_tiny("sd3", tmp_path_factory.mktemp("tiny") / "sd3")


def test_policy_ratio_one_credit_once_and_member_advantages(tiny):
    from pipelines.flow.build import build_flow

    torch.manual_seed(0)
    task = build_flow(
        seed=0,
        device=torch.device("cpu"),
        model=tiny,
        prompts=["a red circle", "a blue square"],
        resolution=32,
        num_steps=4,
        max_sequence_length=8,
        lora_rank=4,
        guidance_scale=3.0,
        plan="singular",
        plan_kwargs={"branch_steps": [1], "granularities": [1, 2]},
    )
    pol = task.policy
    assert pol.wants_step_advantages
    r = pol.rollout([{"prompt": "a red circle"}, {"prompt": "a blue square"}], 4, [3, 4])  # 2 members x 2 strides
    assert r.old_logp.shape == (8, 1) and r.extras["step"].eq(1).all()
    assert r.mask[:, 0].tolist() == [True, False] * 4  # the shared transition trains once per member
    torch.testing.assert_close(r.extras["x_next"][0::2], r.extras["x_next"][1::2], rtol=0, atol=0)
    assert not torch.allclose(r.samples[0], r.samples[1])  # stride 1 and stride 2 finish differently
    # model calls: steps 0-1 on 1 node per prompt, then per member 1 shared + stride 1 [2,3,4] 1 more + [2,4] 0 more
    assert r.metrics["rollout/nfe_per_sample"] * 8 == P.count_nfe(pol.last_plan, 2) == 2 * 2 + 4 * 2
    lp, _ = pol.logp(task.module, r, torch.arange(8))
    torch.testing.assert_close(torch.exp(lp - r.old_logp), torch.ones(8, 1), rtol=0, atol=1e-5)
    rewards = torch.tensor([[0.1, 0.3, 0.9, 0.2], [0.5, 0.5, 0.4, 0.8]])  # [B, G * M]
    adv = pol.step_advantages(r, rewards)
    torch.testing.assert_close(adv.view(2, 2, 2)[..., 0], P.granular_advantages(rewards, 2), rtol=0, atol=0)
    assert torch.equal(adv[0::2], adv[1::2])


def test_granularities_on_another_plan_fail_at_build():
    from mmgrpo.errors import UserError
    from pipelines.flow.build import build_flow

    with pytest.raises(UserError, match="'tree' takes no keyword 'granularities'"):
        build_flow(
            seed=0,
            device=torch.device("cpu"),
            model="tiny:sd3",
            prompts=["a cat"],
            plan="tree",
            plan_kwargs={"granularities": [1, 2]},
        )
    with pytest.raises(UserError, match="objective nft trains no SDE step"):
        build_flow(
            seed=0,
            device=torch.device("cpu"),
            model="tiny:sd3",
            prompts=["a cat"],
            plan="singular",
            plan_kwargs={"granularities": [1, 2]},
            objective="nft",
        )
