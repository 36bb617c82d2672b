"""Rollout plans (pipelines/flow/plan.py): trees without branching equal independent rollouts, shared prefixes,
step selections (all, random fraction, MixGRPO window, Fast, G2RPO singular) and BranchGRPO depth advantages."""

import pytest
import torch

from pipelines.flow import plan as P
from pipelines.flow import sde

T = 4
SIG = sde.sigmas(T, 3.0)


def _velocity(x, sigma, prompt, cond=None):
    # a toy "model": linear in x, depends on the noise level and the prompt's conditioning, like a transformer
    c = torch.zeros(len(x)) if cond is None else cond[prompt]
    return 0.5 * x - sigma.view(-1, 1, 1) + 0.01 * c.view(-1, 1, 1)


def _run(plan, seeds, trained=None):
    n = len(seeds) * plan.group_size
    trained = torch.ones(n, T, dtype=torch.bool) if trained is None else trained
    cond = torch.tensor(seeds, dtype=torch.float32)  # conditioning follows the prompt, not its batch position
    return P.execute(
        plan,
        seeds=seeds,
        shape=(2, 3),
        sigmas=SIG,
        trained=trained,
        velocity=lambda x, s, p: _velocity(x, s, p, cond),
        step=sde.step,
        noise_level=0.7,
    )


def test_tree_without_branching_equals_independent_rollouts():
    kinds = ("flow_grpo",) * T
    indep = _run(P.RolloutPlan(kinds, roots=4), [11, 12])
    chain = _run(P.RolloutPlan(kinds, roots=4, branches={1: 1, 3: 1}), [11, 12])  # fan-out 1 everywhere: a chain
    for a, b in [
        (indep.final, chain.final),
        (indep.x_t, chain.x_t),
        (indep.x_next, chain.x_next),
        (indep.logp, chain.logp),
    ]:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert indep.nfe == chain.nfe == 2 * 4 * T


def test_each_prompt_rolls_out_the_same_alone_or_batched():
    plan = P.RolloutPlan(("flow_grpo",) * T, roots=1, branches={1: 2, 2: 2})
    both = _run(plan, [5, 9])
    alone = _run(plan, [9])
    torch.testing.assert_close(both.final[4:], alone.final, rtol=0, atol=1e-6)


def test_branching_shares_prefix_and_counts_model_calls():
    plan = P.RolloutPlan(("ode", "ode", "flow_grpo", "flow_grpo"), roots=1, branches={2: 2})
    res = _run(plan, [3], trained=torch.tensor([[False, False, True, True]] * 2))
    # both leaves enter step 2 with the same latent (one model call), then differ by their own noise
    torch.testing.assert_close(res.x_t[0, 0], res.x_t[1, 0], rtol=0, atol=0)
    assert not torch.allclose(res.final[0], res.final[1])
    assert res.nfe == 1 + 1 + 1 + 2 == P.count_nfe(plan, 1)  # steps 0-2 on the root, step 3 on two children
    assert res.steps.tolist() == [[2, 3], [2, 3]]


def test_stored_transitions_rescore_to_ratio_one():
    res = _run(P.RolloutPlan(("flow_grpo",) * T, roots=2, branches={1: 2}), [1])
    n, k = res.logp.shape
    s = SIG[res.steps].reshape(-1)
    x, xn = res.x_t.reshape(n * k, 2, 3), res.x_next.reshape(n * k, 2, 3)
    prompt = torch.zeros(n * k, dtype=torch.long)
    v = _velocity(x, s, prompt, torch.tensor([1.0]))  # the same conditioning as at rollout (seed 1)
    again = sde.step("flow_grpo", x, v, s, SIG[res.steps + 1].reshape(-1), noise_level=0.7, prev_sample=xn)
    torch.testing.assert_close(again.logp.view(n, k), res.logp, rtol=0, atol=1e-6)


def test_ode_branch_point_is_rejected():
    with pytest.raises(ValueError, match="ODE"):
        P.RolloutPlan(("ode",) * T, roots=1, branches={0: 2}).check()


def test_window_start_moves_and_rolls_back():
    # MixGRPO progressive: T=10, size 4 -> last start 6, positions 0..6; moves by 1 every 25 iterations
    kw = {"num_steps": 10, "size": 4, "every": 25}
    assert [P.window_start(i, **kw) for i in (0, 24, 25, 150, 174, 175)] == [0, 0, 1, 6, 6, 0]
    # size 2, stride 3: starts 0, 3, 6 (last = 8, (8 - 0) // 3 + 1 = 3 positions); iteration 50 -> 5 % 3 = 2 -> 6
    assert P.window_start(50, num_steps=10, size=2, every=10, stride=3) == 6
    assert P.window_start(60, num_steps=10, size=2, every=10, stride=3) == 0


def _plan(name, **kw):
    base = {"num_steps": 6, "group_size": 4, "sde": "flow_grpo", "iteration": 0, "same_noise": False, "seeds": [1, 2]}
    base.update(kw)
    return P.make_plan(name, **base)


def test_window_plan_is_sde_inside_ode_outside():
    plan, trained = _plan("independent", train="window", window_size=2, window_every=3, iteration=7)
    # iteration 7 // 3 = 2 -> window starts at step 2: steps 2, 3
    assert plan.kinds == ("ode", "ode", "flow_grpo", "flow_grpo", "ode", "ode")
    assert trained.shape == (8, 6) and trained[:, 2:4].all() and trained.sum() == 16
    assert plan.roots == 4 and not plan.branches


def test_same_noise_branches_at_step_zero():
    plan, _ = _plan("independent", same_noise=True)
    assert plan.roots == 1 and plan.branches == {0: 4} and plan.group_size == 4


def test_same_noise_window_shares_the_ode_prefix():
    # MixGRPO with one noise per group: steps 0-1 are ODE from the same noise, so the group splits at step 2 (its
    # first SDE step) and the prefix runs once per prompt; step 2's velocity is shared too (the members differ only by
    # their step-2 noise): 3 + 4 * 3 = 15 calls per prompt, not 6 * 4 = 24
    plan, trained = _plan(
        "independent", train="window", window_size=2, window_every=3, iteration=7, same_noise=True, num_steps=T + 2
    )
    assert plan.branches == {2: 4} and plan.roots == 1
    assert P.count_nfe(plan, 2) == 2 * (3 + 4 * 3)
    sig = sde.sigmas(T + 2, 3.0)
    res = P.execute(
        plan,
        seeds=[1, 2],
        shape=(2, 3),
        sigmas=sig,
        trained=trained,
        velocity=_velocity,
        step=sde.step,
        noise_level=0.7,
    )
    assert res.nfe == 30
    x_in = res.x_t[:, 0]  # [N, 2, 3] latents entering step 2: one per prompt, shared by its 4 members
    assert torch.equal(x_in[:4], x_in[:1].expand(4, 2, 3)) and not torch.equal(x_in[0], x_in[4])
    assert not torch.equal(res.x_next[0, 0], res.x_next[1, 0])  # members differ from their first SDE step on


def test_same_noise_window_equals_the_unshared_computation():
    # The shared ODE prefix is an exact saving: run every one of the G members through every step by hand (G copies
    # of the prompt's initial noise; member j's SDE noise at step t from its own generator mix_seed(seed, t + 1, j),
    # the key the executor gives child j of the split) and get the same leaves, transitions and log-probs
    g, t_total, seeds = 4, T + 2, [1, 2]
    plan, trained = _plan(
        "independent", train="window", window_size=2, window_every=3, iteration=7, same_noise=True, num_steps=t_total
    )  # ODE 0-1, SDE 2-3, ODE 4-5
    sig = sde.sigmas(t_total, 3.0).double()
    vel = lambda x, s, p: torch.tanh(1.3 * x) - s.view(-1, 1, 1) * x + 0.1 * p.view(-1, 1, 1)  # nonlinear in x
    res = P.execute(
        plan,
        seeds=seeds,
        shape=(2, 3),
        sigmas=sig,
        trained=trained,
        velocity=vel,
        step=sde.step,
        noise_level=0.7,
        dtype=torch.float64,
    )
    for b, seed in enumerate(seeds):
        x0 = torch.randn((2, 3), generator=torch.Generator().manual_seed(P.mix_seed(seed, 0, 0)))
        x = x0.double().expand(g, 2, 3).clone()  # [G, 2, 3] every member from the prompt's one noise
        rows = slice(b * g, (b + 1) * g)
        for t in range(t_total):
            v = vel(x, sig[t].expand(g), torch.full((g,), b))
            gens = (
                None
                if plan.kinds[t] == "ode"
                else [torch.Generator().manual_seed(P.mix_seed(seed, t + 1, j)) for j in range(g)]
            )
            out = sde.step(
                plan.kinds[t], x, v, sig[t].expand(g), sig[t + 1].expand(g), noise_level=0.7, generator=gens
            )
            if t in (2, 3):
                torch.testing.assert_close(res.x_t[rows, t - 2], x, rtol=0, atol=0)
                torch.testing.assert_close(res.x_next[rows, t - 2], out.prev_sample, rtol=0, atol=0)
                torch.testing.assert_close(res.logp[rows, t - 2], out.logp.float(), rtol=0, atol=0)
            x = out.prev_sample
        torch.testing.assert_close(res.final[rows], x, rtol=0, atol=0)
    assert res.nfe == 2 * (3 + g * 3) < 2 * g * t_total  # the saving: 30 model calls instead of 48


def test_random_fraction_trains_k_steps_per_sample():
    _, trained = _plan("independent", train="random", fraction=0.5)
    assert (trained.sum(1) == 3).all()  # round(0.5 * 6)
    assert len({tuple(r.tolist()) for r in trained}) > 1  # each sample draws its own steps (DanceGRPO)
    _, again = _plan("independent", train="random", fraction=0.5)
    assert torch.equal(trained, again)  # seeded by the prompt seeds: identical on every rank and rerun


def test_fast_and_singular_plans():
    plan, trained = _plan("fast", sde_steps=2, branch_range=[1, 3], iteration=5)
    s = plan.kinds.index("flow_grpo")
    assert 1 <= s <= 3 and plan.kinds[s + 1] == "flow_grpo" and plan.kinds.count("flow_grpo") == 2
    assert plan.branches == {s: 4} and plan.roots == 1
    assert trained[:, s : s + 2].all() and trained.sum(1).eq(2).all()
    plan, trained = _plan("singular", branch_steps=[0, 2, 4], iteration=4)  # 4 % 3 = 1 -> step 2
    assert plan.kinds == ("ode", "ode", "flow_grpo", "ode", "ode", "ode") and plan.branches == {2: 4}
    assert trained[:, 2].all() and trained.sum() == 8


def test_tree_plan_and_depth_pruning():
    plan, trained = _plan("tree", split_steps=[0, 3], fanout=2, prune_depths=[1])
    assert plan.branches == {0: 2, 3: 2} and plan.group_size == 4
    # depth = splits at or before t: steps 0-2 depth 1 (pruned), 3-5 depth 2
    assert P.depth_of_steps(plan).tolist() == [1, 1, 1, 2, 2, 2]
    assert trained[0].tolist() == [False, False, False, True, True, True]
    with pytest.raises(ValueError, match="group_size"):
        _plan("tree", fanout=3)


def test_depth_advantages_without_branching_are_grpo():
    # rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.8660 (GRPO, ddof=1)
    plan = P.RolloutPlan(("flow_grpo",) * 3, roots=4)
    steps = torch.tensor([[0, 2]] * 4)
    adv = P.depth_advantages(plan, torch.tensor([[1.0, 0.0, 0.0, 1.0]]), steps)
    expect = torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254])[:, None].expand(4, 2)
    torch.testing.assert_close(adv, expect, rtol=0, atol=1e-6)


def test_depth_advantages_on_a_tree():
    # BranchGRPO arXiv:2509.06040: one root, splits at steps 0 and 2 (fan-out 2), leaves r = [1, 2, 3, 5]
    # depth 1 nodes (steps 0-1): mean fusion [1.5, 4]; mean 2.75, unbiased std sqrt(2 * 1.25^2) = 1.76777
    #   -> adv [-0.70711, 0.70711]
    # depth 2 = leaves (steps 2-3): mean 2.75, std sqrt((3.0625 + 0.5625 + 0.0625 + 5.0625) / 3) = 1.70783
    #   -> adv [-1.02470, -0.43916, 0.14639, 1.31747]
    plan = P.RolloutPlan(("dance",) * 4, roots=1, branches={0: 2, 2: 2})
    steps = torch.tensor([[1, 3]] * 4)
    adv = P.depth_advantages(plan, torch.tensor([[1.0, 2.0, 3.0, 5.0]]), steps)
    expect = torch.tensor([[-0.70711, -1.02470], [-0.70711, -0.43916], [0.70711, 0.14639], [0.70711, 1.31747]])
    torch.testing.assert_close(adv, expect, rtol=0, atol=1e-4)


def test_probability_weighted_fusion():
    # one split at step 0 into 2 children, each leaf its own node: r = [0, 1], edge log-probs [0, log 3]
    # softmax([0, log 3]) = [0.25, 0.75] -> root reward 0.75 (mean fusion would give 0.5)
    plan = P.RolloutPlan(("dance",) * 2, roots=1, branches={0: 2})
    lp = torch.zeros(1, 2, 2)
    lp[0, 1, 0] = torch.log(torch.tensor(3.0))
    fused = P.node_rewards(plan, torch.tensor([[0.0, 1.0]]), fusion="prob", leaf_logp=lp)
    torch.testing.assert_close(fused[0], torch.tensor([[0.75]]))
    torch.testing.assert_close(P.node_rewards(plan, torch.tensor([[0.0, 1.0]]))[0], torch.tensor([[0.5]]))


def test_width_pruning_by_hand_on_a_small_tree():
    # BranchGRPO arXiv:2509.06040 (repo --width_pruning_mode 1 / 2): one root, splits at steps 0 and 2 (fan-out 2),
    # T = 4, leaves r = [1, 2, 3, 5]; leaf i's node at step t is i // fanout_after(t): steps 0-1 -> i // 2, 2-3 -> i.
    plan, trained = _plan("tree", num_steps=4, seeds=[1], split_steps=[0, 2], width_prune="branch_best")
    r = torch.tensor([[1.0, 2.0, 3.0, 5.0]])
    # branch_best: sibling sets of the last split {0, 1} and {2, 3}; best of each = leaves 1 (r=2) and 3 (r=5)
    assert P.width_keep_leaves(plan, r).tolist() == [[False, True, False, True]]
    steps = torch.arange(4).repeat(4, 1)  # [N, K]: every leaf trains all four steps
    mask = P.width_prune_mask(plan, r, trained)
    assert mask.tolist() == [[False] * 4, [True] * 4, [False] * 4, [True] * 4]
    # surviving edges: shared depth-1 nodes 0 and 1 at steps 0, 1 (each via one kept leaf), leaves 1 and 3 at 2, 3
    assert P.trained_edges(plan, steps, mask, 4) == {
        (0, 0, 0),
        (0, 1, 0),
        (0, 0, 1),
        (0, 1, 1),
        (0, 2, 1),
        (0, 3, 1),
        (0, 2, 3),
        (0, 3, 3),
    }
    # unpruned: 2 + 2 shared prefix edges + 4 * 2 leaf edges = 12 distinct transitions; pruned: 8
    assert len(P.trained_edges(plan, steps, trained, 4)) == 12
    # extremes, one per side: worst leaf 0 (r=1) and best leaf 3 (r=5); their prefixes are nodes 0 and 1
    ext, _ = _plan("tree", num_steps=4, seeds=[1], split_steps=[0, 2], width_prune="extremes", width_keep=1)
    assert P.width_keep_leaves(ext, r).tolist() == [[True, False, False, True]]
    # the fraction 0.5 of G = 4 -> round(0.5 * 4 / 2) = 1 per side, the same leaves; ties keep the lower index
    half, _ = _plan("tree", num_steps=4, seeds=[1], split_steps=[0, 2], width_prune="extremes", width_keep=0.5)
    assert P.width_keep_leaves(half, torch.tensor([[2.0, 2.0, 2.0, 2.0]])).tolist() == [[True, False, False, True]]
    # one whole subtree pruned: with r = [1, 5, 0, 0] extremes keeps leaf 1 (best) and leaf 2 (first worst)
    assert P.width_keep_leaves(ext, torch.tensor([[1.0, 5.0, 0.0, 0.0]])).tolist() == [[False, True, True, False]]


def test_width_pruning_cuts_trained_elements_not_rollout_evaluations():
    kw = {"num_steps": T, "group_size": 8, "seeds": [3, 4], "split_steps": [0, 1, 2]}
    full, m_full = _plan("tree", **kw)
    pruned, m_pruned = _plan("tree", width_prune="branch_best", **kw)
    a, b = _run(full, [3, 4], m_full), _run(pruned, [3, 4], m_pruned)
    assert a.nfe == b.nfe == P.count_nfe(full, 2) == 2 * (1 + 2 + 4 + 8)  # every leaf still rolled out
    torch.testing.assert_close(a.final, b.final, rtol=0, atol=0)
    rewards = -(b.final.flatten(1) ** 2).mean(1).view(2, 8)  # [B, G] any per-leaf score
    mask = P.width_prune_mask(pruned, rewards, m_pruned)
    assert int(m_full.sum()) == 16 * T and int(mask.sum()) == 8 * T  # one leaf of each sibling pair survives
    assert mask.view(2, 4, 2, T).any(-1).sum(-1).eq(1).all()  # exactly one leaf per last-split sibling set
    full_edges = P.trained_edges(full, b.steps, m_full, 8)
    kept_edges = P.trained_edges(pruned, b.steps, mask, 8)
    # per prompt: steps 0, 1, 2 have 2, 4, 8 nodes; last step 8 -> kept 2 + 4 + 4 + 4 = 14 of 2 + 4 + 8 + 8 = 22
    assert len(full_edges) == 2 * 22 and len(kept_edges) == 2 * 14 and kept_edges < full_edges


def test_width_pruning_rejects_bad_settings():
    with pytest.raises(ValueError, match="width_prune='best'"):
        _plan("tree", split_steps=[0, 3], width_prune="best")
    with pytest.raises(ValueError, match="width_keep=0"):
        _plan("tree", split_steps=[0, 3], width_prune="extremes", width_keep=0)
    with pytest.raises(ValueError, match="width_keep=1.5"):
        _plan("tree", split_steps=[0, 3], width_prune="extremes", width_keep=1.5)
    with pytest.raises(ValueError, match="needs a split"):
        _plan("tree", group_size=4, roots=4, width_prune="branch_best")


def test_policy_masks_pruned_leaves_when_advantages_are_computed():
    # the trainer calls step_advantages once rewards exist; the pruned rows of rollout.mask must turn False there
    from types import SimpleNamespace

    from mmgrpo.types import Rollout
    from pipelines.flow.policy import FlowPolicy

    plan, trained = _plan("tree", num_steps=4, seeds=[1], split_steps=[0, 2], width_prune="branch_best")
    steps = torch.arange(4).repeat(4, 1)  # [N, K]
    ro = Rollout(samples=[None] * 4, old_logp=torch.zeros(4, 4), mask=trained.clone(), extras={"step": steps})
    adv = FlowPolicy.step_advantages(
        SimpleNamespace(last_plan=plan, value_anchor=None), ro, torch.tensor([[1.0, 2.0, 3.0, 5.0]])
    )
    assert ro.mask.any(1).tolist() == [False, True, False, True]
    # the advantages themselves are unchanged by pruning (values of test_depth_advantages_on_a_tree)
    torch.testing.assert_close(adv[:, 1], torch.tensor([-0.70711, -0.70711, 0.70711, 0.70711]), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "plan,kw,match",
    [
        ("independent", {"train": "window", "window_size": 99}, "window size=99"),
        ("independent", {"train": "windo"}, "train='windo'"),
        ("tree", {"width_prune": "bestt"}, "width_prune='bestt'"),
        ("tree", {"split_steps": [0, 99]}, "branch 99"),
        ("tree", {"fusion": "max"}, "fusion='max'"),
        ("fast", {"branch_range": [0, 9]}, "branch_range"),
        ("singular", {"branch_steps": [7]}, "branch_steps"),
        ("singular", {"granularities": [1, 2], "branch_steps": [3]}, "tail after the SDE step"),
    ],
)
def test_bad_plan_values_fail_at_build_before_the_model_loads(plan, kw, match):
    from mmgrpo.errors import UserError
    from pipelines.flow.build import build_flow

    # the model does not exist: the plan error must come first, in one line naming the field
    with pytest.raises(UserError, match=match) as err:
        build_flow(
            seed=0,
            device=torch.device("cpu"),
            model="nobody/not-a-model",
            prompts=["a"],
            num_steps=4,
            plan=plan,
            plan_kwargs=kw,
        )
    assert "\n" not in str(err.value) and str(err.value).startswith("pipeline.kwargs.plan_kwargs")


def test_group_size_that_does_not_fit_the_plan_is_a_user_error_at_rollout():
    from mmgrpo.errors import UserError
    from pipelines.flow.build import build_flow

    task = build_flow(
        seed=0,
        device=torch.device("cpu"),
        model="tiny:sd3",
        prompts=["a"],
        num_steps=4,
        resolution=32,
        max_sequence_length=8,
        lora_rank=4,
        guidance_scale=1.0,
        plan="tree",
        plan_kwargs={"split_steps": [0, 2]},
    )
    with pytest.raises(UserError, match=r"sample.group_size=6: tree plan: group_size=6 must equal"):
        task.policy.rollout([{"prompt": "a"}], 6, [0])


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps", "ddim"])
def test_rollout_loop_reads_nothing_back_from_the_device(kind):
    # On the meta device a tensor has no values, so any check that reads one back (.item(), bool(), a blocking
    # .to()) raises: a whole tree rollout (ODE, SDE, a split, per-sample generators) running there shows the loop
    # never waits for the device; step() checks the sigmas it was given on the host instead
    plan = P.RolloutPlan(
        ("ode" if kind != "ddim" else kind, kind, kind, "ode" if kind != "ddim" else kind), roots=1, branches={1: 2}
    )  # DDIM's alphas are no flow sigmas: no ODE step with it
    sig = sde.sigmas(T, 3.0) if kind != "ddim" else torch.tensor([0.2, 0.4, 0.6, 0.8, 0.95])
    trained = torch.tensor([[False, True, True, False]] * 4)
    vel = lambda x, s, p: 0.5 * x - s.view(-1, 1, 1) + 0.01 * p.view(-1, 1, 1)
    res = P.execute(
        plan,
        seeds=[1, 2],
        shape=(2, 3),
        sigmas=sig,
        trained=trained,
        velocity=vel,
        step=sde.step,
        noise_level=0.7,
        device="meta",
    )
    assert res.final.device.type == "meta" and res.x_t.shape == (4, 2, 2, 3) and res.logp.shape == (4, 2)
    x = torch.zeros(2, 3, device="meta")
    bad = (
        (torch.tensor([0.5, 0.5]), torch.tensor([0.6, 0.4]))
        if kind != "ddim"
        else (torch.tensor([0.5, 0.5]), torch.tensor([0.4, 0.6]))
    )  # one sample's step goes the wrong way
    with pytest.raises(ValueError, match=kind):
        sde.step(kind, x, x, *bad, noise_level=0.7)
    with pytest.raises(RuntimeError, match="meta"):  # device sigmas are still checked, by reading them back
        sde.step(kind, x, x, bad[0].to("meta"), bad[1].to("meta"), noise_level=0.7)


def test_window_tail_stride_runs_a_coarser_ode_after_the_window():
    # MixGRPO-Flash's idea, first order: T = 8, window on steps 1-2 (iteration 2 // 2 = 1), tail_stride 2: after the
    # window the ODE visits sigma indices 3, 5, 7, 8 (3 steps instead of 5), so a member takes 3 + 3 = 6 model calls
    t_total, seeds = 8, [4]
    kw = {"train": "window", "window_size": 2, "window_every": 2, "iteration": 2, "num_steps": t_total, "seeds": seeds}
    plan, trained = _plan("independent", tail_stride=2, **kw)
    assert plan.granularities == (2,) and plan.roots == 4 and trained[:, 1:3].all() and trained.sum() == 8
    sig = sde.sigmas(t_total, 3.0).double()
    vel = lambda x, s, p: torch.tanh(1.3 * x) - s.view(-1, 1, 1) * x
    run = lambda p, tr: P.execute(
        p,
        seeds=seeds,
        shape=(2, 3),
        sigmas=sig,
        trained=tr,
        velocity=vel,
        step=sde.step,
        noise_level=0.7,
        dtype=torch.float64,
    )
    coarse, full = run(plan, trained), run(*_plan("independent", **kw))
    assert coarse.nfe == 4 * 6 == P.count_nfe(plan, 1) and full.nfe == 4 * 8
    # the window's transitions are the full plan's (same noises), only the tail differs
    for a, b in [(coarse.x_t, full.x_t), (coarse.x_next, full.x_next), (coarse.logp, full.logp)]:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    x = full.x_next[:, 1]  # [4, 2, 3] after step 2; Euler by hand on sigma indices 3 -> 5 -> 7 -> 8
    for i, j in [(3, 5), (5, 7), (7, 8)]:
        x = x + (sig[j] - sig[i]) * vel(x, sig[i].expand(4), None)
    torch.testing.assert_close(coarse.final, x, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(coarse.final, full.final)
    # the coarse tail reads nothing back from the device either (see the meta-device test below)
    meta = P.execute(
        plan,
        seeds=seeds,
        shape=(2, 3),
        sigmas=sig.float(),
        trained=trained,
        step=sde.step,
        velocity=lambda x, s, p: 0.5 * x - s.view(-1, 1, 1),
        noise_level=0.7,
        device="meta",
    )
    assert meta.final.device.type == "meta" and meta.nfe == coarse.nfe
    # a window that ends at the last step has no tail to coarsen; other step selections refuse the option
    assert _plan("independent", tail_stride=2, **{**kw, "iteration": 12})[0].granularities == (1,)  # steps 6-7
    with pytest.raises(ValueError, match="tail_stride"):
        _plan("independent", train="all", tail_stride=2)
