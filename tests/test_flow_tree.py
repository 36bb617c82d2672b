"""BranchGRPO edge credit (pipelines/flow/tree.py, FlowPolicy): each distinct parent -> child transition of a tree is
one loss element with the child's depth advantage (arXiv:2509.06040, "each transition is trained with the child's
advantage"), kept in the first leaf below it that survives width pruning, and only trained pairs reach the
transformer. Hand-worked masks, a brute-force edge enumeration, and float64 gradients against a per-edge loss.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import pipelines.flow  # noqa: F401
from mmgrpo import losses
from mmgrpo.trainer import _loss_for
from mmgrpo.types import Rollout
from pipelines.flow import plan as P
from pipelines.flow import sde
from pipelines.flow.build import tiny_task
from pipelines.flow.policy import FlowPolicy


def _tree(num_steps, group_size, seeds, **kw):
    return P.make_plan(
        "tree",
        num_steps=num_steps,
        group_size=group_size,
        sde="flow_grpo",
        iteration=0,
        same_noise=False,
        seeds=seeds,
        **kw,
    )


def _steps(trained):
    return torch.stack([row.nonzero().flatten() for row in trained])  # [N, K] as PlanResult.steps


def _paths(trained):
    return torch.ones(trained.shape[0], int(trained[0].sum()), dtype=torch.bool)  # [N, K] every leaf's whole path


def _brute_once(plan, steps, mask, g):
    """Independent enumeration: walk rows in order, keep an element the first time its (prompt, step, node) shows."""
    splits = sorted(t for t, f in plan.branches.items() if f > 1)
    seen, out = set(), torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            t = int(steps[i, j])
            below = 1
            for s in splits:  # leaves under a node alive after step t: the product of the later fan-outs
                below *= plan.branches[s] if s > t else 1
            edge = (i // g, t, (i % g) // below)
            if mask[i, j] and edge not in seen:
                seen.add(edge)
                out[i, j] = True
    return out


def test_once_credit_by_hand_keeps_the_first_surviving_leaf():
    # one root, splits at steps 0 and 2 (fan-out 2), T = 4, G = 4: steps 0-1 have nodes {0, 1} (leaves {0,1}, {2,3}),
    # steps 2-3 one node per leaf. Unpruned: leaves 0 and 2 carry the shared edges, leaves 1 and 3 only their own.
    plan, trained = _tree(4, 4, [1], split_steps=[0, 2])
    steps = _steps(trained)
    once = P.credit_edges_once(plan, steps, trained, 4)
    assert once.int().tolist() == [[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]  # 12 = 2 + 2 + 4 + 4
    # branch_best on r = [1, 2, 3, 5] keeps leaves 1 and 3: the shared edges move to them (first surviving leaf)
    pruned = P.width_prune_mask(
        dataclasses.replace(plan, width_prune="branch_best"), torch.tensor([[1.0, 2.0, 3.0, 5.0]]), trained
    )
    assert P.credit_edges_once(plan, steps, pruned, 4).int().tolist() == [[0] * 4, [1] * 4, [0] * 4, [1] * 4]
    # per_leaf keeps the old weighting: the plan records it, the policy then leaves the paths as they are
    assert _tree(4, 4, [1], split_steps=[0, 2], edge_credit="per_leaf")[0].edge_credit == "per_leaf"
    assert plan.edge_credit == "once"
    with pytest.raises(ValueError, match="edge_credit='twice'"):
        _tree(4, 4, [1], split_steps=[0, 2], edge_credit="twice")


CASES = [  # (num_steps, group_size, seeds, plan kwargs, rewards seed)
    (16, 16, [5], {"split_steps": [0, 4, 8, 12]}, None),  # bench/flow.py's tree
    (16, 16, [5, 6], {"split_steps": [0, 4, 8, 12], "prune_depths": [1, 4]}, None),
    (6, 8, [1, 2], {"split_steps": [0, 2, 3], "width_prune": "branch_best"}, 0),
    (
        6,
        8,
        [1, 2],
        {"split_steps": [1, 3], "roots": 2, "width_prune": "extremes", "width_keep": 1, "prune_depths": [0]},
        1,
    ),
    (5, 9, [3], {"split_steps": [0, 2], "fanout": 3, "width_prune": "extremes", "width_keep": 0.3}, 2),
]


@pytest.mark.parametrize("t,g,seeds,kw,rseed", CASES)
def test_once_credit_trains_each_distinct_edge_exactly_once(t, g, seeds, kw, rseed):
    plan, trained = _tree(t, g, seeds, **kw)
    steps, trained = _steps(trained), _paths(trained)
    paths = trained
    if rseed is not None:  # width pruning: random rewards, ties impossible
        rewards = torch.rand(len(seeds), g, generator=torch.Generator().manual_seed(rseed))
        paths = P.width_prune_mask(plan, rewards, trained)
    once = P.credit_edges_once(plan, steps, paths, g)
    edges = P.trained_edges(plan, steps, paths, g)
    assert P.trained_edges(plan, steps, once, g) == edges  # no edge lost ...
    assert int(once.sum()) == len(edges)  # ... and none counted twice
    assert bool((once <= paths).all()) and torch.equal(once, _brute_once(plan, steps, paths, g))


def test_bench_tree_counts_120_distinct_transitions_instead_of_256():
    # splits at 0, 4, 8, 12 with fan-out 2: 2, 4, 8, 16 nodes alive during 4 steps each -> 4 * (2 + 4 + 8 + 16) = 120
    # distinct transitions per prompt; every leaf's path is 16 steps x 16 leaves = 256 elements
    plan, trained = _tree(16, 16, [5], split_steps=[0, 4, 8, 12])
    assert int(trained.sum()) == 256
    assert int(P.credit_edges_once(plan, _steps(trained), trained, 16).sum()) == 120
    # depth pruning [1]: the 4 steps at depth 1 (2 nodes each) leave -> 112
    plan, trained = _tree(16, 16, [5], split_steps=[0, 4, 8, 12], prune_depths=[1])
    assert int(P.credit_edges_once(plan, _steps(trained), _paths(trained), 16).sum()) == 112


def test_step_advantages_applies_pruning_then_credit_and_is_idempotent():
    plan, trained = _tree(4, 4, [1], split_steps=[0, 2], width_prune="branch_best")
    steps = _steps(trained)
    paths = trained.clone()
    ro = Rollout(
        samples=[None] * 4,
        old_logp=torch.zeros(4, 4),
        mask=P.credit_edges_once(plan, steps, paths, 4),
        extras={"step": steps, "path_mask": paths},
    )
    pol = SimpleNamespace(last_plan=plan, value_anchor=None)
    r = torch.tensor([[1.0, 2.0, 3.0, 5.0]])
    adv = FlowPolicy.step_advantages(pol, ro, r)
    want = [[0] * 4, [1] * 4, [0] * 4, [1] * 4]  # leaves 1 and 3 survive; they now carry the shared edges
    assert ro.mask.int().tolist() == want
    torch.testing.assert_close(FlowPolicy.step_advantages(pol, ro, r), adv, rtol=0, atol=0)
    assert ro.mask.int().tolist() == want
    per_leaf = SimpleNamespace(last_plan=dataclasses.replace(plan, edge_credit="per_leaf"), value_anchor=None)
    ro.extras.pop("path_mask")
    ro.mask = paths.clone()
    FlowPolicy.step_advantages(per_leaf, ro, r)
    assert torch.equal(ro.mask, P.width_prune_mask(plan, r, paths))


# ---- on a tiny diffusers model

PROMPTS = [{"prompt": "a red circle"}, {"prompt": "a blue square"}]


def _task(path, **kw):
    return tiny_task(path, **{"plan": "tree", "plan_kwargs": {"split_steps": [0, 2]}, **kw})


def _nudge(module, scale=0.05):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def _trainer_grads(task, ro, adv, mask, g, k_chunk, micro):
    """The engine's own loss (mmgrpo.trainer._loss_for, token_mean, global denominator) over micro-batches and
    k-chunks, gradients accumulated as update() does."""
    algo = SimpleNamespace(
        loss="clipped",
        loss_kwargs={"clip_low": 0.02, "clip_high": 0.02},
        aggregation="token_mean",
        norm_len=None,
        kl_coef=0.0,
        kl_kind="k3",
    )
    run = SimpleNamespace(
        cfg=SimpleNamespace(algo=algo, sample=SimpleNamespace(group_size=g)),
        policy=task.policy,
        model=task.module,
        accelerator=SimpleNamespace(num_processes=1),
    )
    task.module.zero_grad(set_to_none=True)
    mb = torch.arange(mask.shape[0])
    mb = mb[mask.any(1)]
    denom = losses.denominator(mask[mb], "token_mean")
    k = mask.shape[1]
    for idx in mb.split(micro):
        for lo in range(0, k, k_chunk):
            loss, _, _ = _loss_for(
                run, SimpleNamespace(rollout=ro), idx, slice(lo, lo + k_chunk), adv, mask, None, denom
            )
            loss.backward()
    return _grads(task.module)


@pytest.mark.parametrize(
    "g,plan_kwargs", [(4, {"split_steps": [0, 2]}), (8, {"split_steps": [0, 1, 2], "width_prune": "branch_best"})]
)
def test_loss_gradient_equals_a_hand_built_per_edge_loss_float64(tiny_sd3, g, plan_kwargs):
    task = _task(tiny_sd3, dtype=torch.float64, plan_kwargs=plan_kwargs)
    pol, module = task.policy, task.module
    ro = pol.rollout(PROMPTS, g, [3, 4])
    rewards = torch.rand(2, g, generator=torch.Generator().manual_seed(g), dtype=torch.float64)  # [B, G]
    adv = pol.step_advantages(ro, rewards)  # [N, K] depth advantages; sets the once-credited mask
    paths = ro.extras["path_mask"]
    if plan_kwargs.get("width_prune"):
        paths = P.width_prune_mask(pol.last_plan, rewards, paths)
    steps = ro.extras["step"]
    _nudge(module)  # ratios away from 1 so the clip matters for some edges
    got = _trainer_grads(task, ro, adv, ro.mask, g, k_chunk=1, micro=3)

    # by hand: every distinct edge once, scored from the LAST surviving leaf below it (the engine uses the first;
    # both rows store the same transition), clipped surrogate -min(r A, clip(r, 1 +- 0.02) A) with the child's depth
    # advantage, summed and divided by the number of edges
    edges = {}
    for i in range(paths.shape[0]):
        for j in range(paths.shape[1]):
            if paths[i, j]:  # node at step t = leaf // (leaves below it: 2 per later split)
                t = int(steps[i, j])
                below = 2 ** sum(s > t for s in plan_kwargs["split_steps"])
                edges[(i // g, t, (i % g) // below)] = (i, j)
    assert len(edges) == int(ro.mask.sum()) and len(edges) < int(paths.sum())
    module.zero_grad(set_to_none=True)
    ex, total = ro.extras, 0.0
    for i, j in edges.values():
        cond = {key[5:]: v[i : i + 1] for key, v in ex.items() if key.startswith("cond_")}
        x, sig, sig_next = ex["x_t"][i, j][None], ex["sigma"][i, j][None], ex["sigma_next"][i, j][None]
        v = pol.model.velocity(module, x, sig, cond)
        out = sde.step(
            "flow_grpo", x, v, sig, sig_next, noise_level=pol.noise_level, prev_sample=ex["x_next"][i, j][None]
        )
        ratio = torch.exp(out.logp[0] - ro.old_logp[i, j].double())
        a = adv[i, j]
        total = total - torch.minimum(ratio * a, ratio.clamp(0.98, 1.02) * a)
    (total / len(edges)).backward()
    want = _grads(module)
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 1e-6
    for name in want:  # 1e-6 of the largest entry: diffusers embeds timesteps in float32 even in a float64 model
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6 * scale)
    # the old per-leaf weighting (every path element) gives a different gradient: the test can fail
    per_leaf = _trainer_grads(task, ro, adv, paths, g, k_chunk=1, micro=3)
    assert max(float((per_leaf[n] - want[n]).abs().max()) for n in want) > 0.05 * scale


def test_logp_scores_only_trained_pairs_and_matches_the_full_computation(tiny_sd3):
    task = _task(tiny_sd3, ratio_norm=True, step_weights="guard", reference=True)
    pol, module = task.policy, task.module
    ro = pol.rollout(PROMPTS, 4, [3, 4])
    n, k = ro.mask.shape
    assert 0 < int(ro.mask.sum()) < n * k  # once credit: shared edges in one row only
    full = Rollout(samples=ro.samples, old_logp=ro.old_logp, mask=torch.ones_like(ro.mask), extras=dict(ro.extras))
    rows = []
    hook = module.register_forward_pre_hook(
        lambda mod, args, kw: rows.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        idx = torch.arange(n)
        ref_full = pol.ref_logp(full, idx)
        rows.clear()
        ref_part = pol.ref_logp(ro, idx)
        assert sum(rows) == int(ro.mask.sum())  # the reference too skips untrained pairs
        m = ro.mask
        torch.testing.assert_close(ref_part[m], ref_full[m], rtol=0, atol=0)
        _nudge(module)
        for ids, ks in ((torch.arange(n), slice(None)), (torch.tensor([5, 0, 3, 6]), slice(1, 3))):
            rows.clear()
            lp, aux = pol.logp(module, ro, ids, k_slice=ks)
            sel = ro.mask[ids][:, ks]  # [n', k']
            assert sum(rows) == int(sel.sum())  # the transformer received exactly the trained pairs
            lp_f, aux_f = pol.logp(module, full, ids, k_slice=ks)
            # same pairs scored in another batch composition: float32 matmul rounding only
            torch.testing.assert_close(lp[sel], lp_f[sel], rtol=0, atol=1e-5)
            assert torch.equal(lp[~sel].detach(), ro.old_logp[ids][:, ks][~sel])  # untrained: the old log-prob
            torch.testing.assert_close(aux["kl"][sel], aux_f["kl"][sel], rtol=1e-4, atol=1e-9)
            assert bool((aux["kl"][~sel] == 0).all())
            kw, kw_f = aux["loss_kwargs"], aux_f["loss_kwargs"]
            assert kw["k_offset"] == kw_f["k_offset"] == (ks.start or 0)
            assert torch.equal(kw["weight"], kw_f["weight"])
            for key in ("std", "mean_sq_dist"):
                assert kw[key].shape == (len(ids), sel.shape[1])
                torch.testing.assert_close(kw[key][sel], kw_f[key][sel], rtol=1e-4, atol=1e-9)
            # the loss (masked like the trainer) and its gradient are those of the full computation
            module.zero_grad(set_to_none=True)
            loss_p = losses.compute("guard_clipped", lp, ro.old_logp[ids][:, ks], torch.ones_like(lp), sel, **kw)[0]
            losses.aggregate(loss_p, sel, "token_mean").backward()
            g_part = _grads(module)
            module.zero_grad(set_to_none=True)
            loss_f = losses.compute(
                "guard_clipped", lp_f, ro.old_logp[ids][:, ks], torch.ones_like(lp_f), sel, **kw_f
            )[0]
            losses.aggregate(loss_f, sel, "token_mean").backward()
            for name, g in _grads(module).items():
                torch.testing.assert_close(g_part[name], g, rtol=1e-3, atol=1e-7)
        # a chunk with no trained pair: no model call, old log-probs, and the trainer's backward still runs
        rows.clear()
        lp, _ = pol.logp(module, ro, torch.tensor([1, 3]), k_slice=slice(0, 1))  # leaves 1, 3 share step 0's edges
        assert rows == [] and lp.requires_grad and torch.equal(lp.detach(), ro.old_logp[[1, 3], :1])
        lp.sum().backward()
    finally:
        hook.remove()


def test_tree_rollout_ratio_is_one_with_pruning_and_chunks(tiny_sd3):
    task = _task(tiny_sd3, plan_kwargs={"split_steps": [0, 2], "width_prune": "extremes", "prune_depths": [1]})
    pol = task.policy
    ro = pol.rollout(PROMPTS, 4, [7, 8])
    pol.step_advantages(ro, torch.tensor([[0.1, 0.4, 0.3, 0.9], [0.5, 0.2, 0.6, 0.0]]))
    assert 0 < int(ro.mask.sum()) < int(ro.extras["path_mask"].sum())
    for ks in (None, slice(0, 1), slice(1, 2)):
        lp, _ = pol.logp(task.module, ro, torch.arange(8), k_slice=ks)
        old = ro.old_logp[:, ks] if ks is not None else ro.old_logp
        torch.testing.assert_close(torch.exp(lp - old), torch.ones_like(old), rtol=0, atol=1e-5)


def test_bad_edge_credit_fails_at_build_in_one_line(tiny_sd3):
    from mmgrpo.errors import UserError

    with pytest.raises(UserError, match=r"plan_kwargs.edge_credit \('twice'\) must be once"):
        _task(tiny_sd3, plan_kwargs={"split_steps": [0, 2], "edge_credit": "twice"})
    with pytest.raises(UserError, match="'independent' takes no keyword 'edge_credit'"):
        _task(tiny_sd3, plan="independent", plan_kwargs={"edge_credit": "once"})


def test_prob_fusion_from_the_recipe_weighs_children_by_their_split_step_logp(tiny_sd3):
    # BranchGRPO --tree_prob_weighted (anchors.md 4): r(node) = softmax(alpha * logp(child)) . r(child), the child's
    # logp being its split step's transition. 2 roots, splits at steps 0 and 2 (fan-out 2): 8 leaves, depth-1 nodes
    # {0,1} {2,3} {4,5} {6,7}; leaf logp at step 2 set to 0 except leaves 1 and 4 = log 3 (weights 0.25 / 0.75).
    task = _task(tiny_sd3, prompts=["a"], plan_kwargs={"split_steps": [0, 2], "roots": 2, "fusion": "prob"})
    pol = task.policy
    ro = pol.rollout(PROMPTS[:1], 8, [3])
    assert ro.extras["step"][0].tolist() == [0, 1, 2, 3]
    ro.old_logp = torch.zeros(8, 4)
    ro.old_logp[[1, 4], 2] = torch.log(torch.tensor(3.0))
    rewards = torch.tensor([[0.0, 1.0, 2.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
    adv = pol.step_advantages(ro, rewards)  # [8, 4]
    # depth 1 fused: [0.75 (0.25*0 + 0.75*1), 2, 0.75 (0.75*1 + 0.25*0), 0]; mean 0.875, unbiased var 2.0625/3,
    # std 0.8291562: A = [-0.1507557, 1.3568010, -0.1507557, -1.0552897] (mean fusion would give [.5, 2, .5, 0])
    depth1 = torch.tensor([-0.1507557, 1.3568010, -0.1507557, -1.0552897]).repeat_interleave(2)  # [8]
    torch.testing.assert_close(adv[:, 0], depth1, rtol=0, atol=1e-5)
    torch.testing.assert_close(adv[:, 1], depth1, rtol=0, atol=1e-5)
    # depth 2 = the leaves: mean 0.75, unbiased var 5.5/7, std 0.8864053; leaf 0: -0.75 / 0.8864053
    assert float(adv[0, 2]) == pytest.approx(-0.8461141, abs=1e-5) and float(adv[2, 3]) == pytest.approx(
        1.4101902, abs=1e-5
    )
    mean_adv = dataclasses.replace(pol.last_plan, fusion="mean")
    pol.last_plan = (
        mean_adv  # same rollout, mean fusion: depth 1 becomes [.5, 2, .5, 0] -> [-.2886751, 1.4433757, ...]
    )
    assert float(pol.step_advantages(ro, rewards)[0, 0]) == pytest.approx(-0.2886751, abs=1e-5)


def test_prob_fusion_settings_are_checked():
    with pytest.raises(ValueError, match="fusion='max' must be mean"):
        _tree(4, 4, [0], split_steps=[0, 2], fusion="max")
    with pytest.raises(ValueError, match=r"drops split steps \[2\]"):
        _tree(4, 4, [0], split_steps=[0, 2], fusion="prob", prune_depths=[2])
    plan, _ = _tree(4, 4, [0], split_steps=[0, 2], fusion="prob", fusion_alpha=2, prune_depths=[1])
    assert plan.fusion == "prob" and plan.fusion_alpha == 2.0
