"""Rollout plans for flow models: where groups branch, the fan-out, ODE or SDE per step, and which steps are trained.

One executor covers independent groups, same-noise groups, BranchGRPO trees and singular-step (G2RPO / Fast) groups,
the latter optionally completed at several ODE granularities (G2RPO's multi-granularity advantage integration).
This module holds the plans by name (`SCHEDULES`, `make_plan`); the plan type and its executor (`RolloutPlan`,
`execute`, `PlanResult`, `count_nfe`, `mix_seed`) live in `pipelines.flow.rollout_plan`, the tree maths (depths, fused
rewards, per-depth advantages, width pruning, edge credit) in `pipelines.flow.tree`, the granularity completions in
`pipelines.flow.granular`; all are re-exported here.
"""

import dataclasses
import math

import torch
from torch import Tensor

from mmgrpo.registry import Registry
from pipelines.flow.granular import (  # noqa: F401
    complete_granularities,
    completion_indices,
    credited_leaves,
    granular_advantages,
    granular_step_advantages,
)
from pipelines.flow.rollout_plan import (  # noqa: F401
    PlanResult,
    RolloutPlan,
    count_nfe,
    execute,
    mix_seed,
)
from pipelines.flow.tree import (  # noqa: F401
    EDGE_CREDIT,
    WIDTH_PRUNE,
    check_width,
    credit_edges_once,
    depth_advantages,
    depth_of_steps,
    edge_keys,
    node_rewards,
    trained_edges,
    width_keep_leaves,
    width_prune_mask,
)

SCHEDULES = Registry("flow step schedule")
"""name -> fn(num_steps, *, iteration, **kw) -> (sde_steps [T] bool, trained [T] bool); see `step_schedule`."""


# ---- plans by name: fn(*, num_steps, group_size, sde, iteration, same_noise, seeds, **kw) -> (plan, trained)


def _rng(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(mix_seed(*parts))


def window_start(
    iteration: int, *, num_steps: int, size: int, every: int, stride: int = 1, start: int = 0, last: int | None = None
) -> int:
    """MixGRPO's progressive sliding window: first step of the SDE window at `iteration` (arXiv:2507.21802).

    start + (iteration // every) * stride, rolled back to `start` once it passes `last` (default num_steps - size).
    """
    last = num_steps - size if last is None else last
    if size < 1 or size > num_steps or every < 1 or stride < 1 or not 0 <= start <= last <= num_steps - size:
        raise ValueError(
            f"window size={size}, every={every}, stride={stride}, start={start}, last={last} must satisfy "
            f"1 <= size <= num_steps={num_steps}, every >= 1, stride >= 1, 0 <= start <= last <= T - size"
        )
    positions = (last - start) // stride + 1
    return start + ((iteration // every) % positions) * stride


@SCHEDULES.register("independent")
def independent(
    *,
    num_steps: int,
    group_size: int,
    sde: str,
    iteration: int,
    same_noise: bool,
    seeds: list[int],
    train: str = "all",
    fraction: float = 0.6,
    skip_last: bool = False,
    window_size: int = 4,
    window_every: int = 25,
    window_stride: int = 1,
    window_start_step: int = 0,
    window_last: int | None = None,
    tail_stride: int = 1,
) -> tuple[RolloutPlan, Tensor]:
    """Independent groups: train all SDE steps (Flow-GRPO), a random fraction (DanceGRPO) or a window (MixGRPO).

    tail_stride s > 1 (window only): MixGRPO-Flash's idea (arXiv:2507.21802) with a first-order solver: after the
    window the ODE takes every s-th sigma of the schedule (and always the last), so fewer model calls finish each
    sample; the samples change, nothing trained does (Flash itself runs 2nd-order DPM-Solver++ over 40% of the steps).
    """
    t_all = num_steps - int(skip_last)
    sde_steps = [True] * num_steps
    rows = None
    if train == "all":
        trained = [t < t_all for t in range(num_steps)]
    elif train == "random":
        k = max(1, round(fraction * t_all))
        rows = [torch.randperm(t_all, generator=_rng(s, 7, j))[:k] for s in seeds for j in range(group_size)]
        trained = [False] * num_steps
    elif train == "window":
        w0 = window_start(
            iteration,
            num_steps=num_steps,
            size=window_size,
            every=window_every,
            stride=window_stride,
            start=window_start_step,
            last=window_last,
        )
        trained = [w0 <= t < w0 + window_size for t in range(num_steps)]
        sde_steps = trained  # ODE outside the window: MixGRPO's mixed sampler
    else:
        raise ValueError(f"plan train={train!r} is not a step selection; choose all, random or window")
    _check_tail_stride(tail_stride, train)
    kinds = tuple(sde if on else "ode" for on in sde_steps)
    plan = _independent_plan(kinds, trained, group_size=group_size, same_noise=same_noise, tail_stride=tail_stride)
    mask = torch.tensor(trained).repeat(len(seeds) * group_size, 1)  # [N, T]
    if rows is not None:
        for i, r in enumerate(rows):
            mask[i, r] = True
    return plan, mask


def _check_tail_stride(tail_stride: int, train: str) -> None:
    """A tail_stride other than 1 needs the window selection and an integer stride >= 1."""
    if tail_stride != 1 and (
        train != "window" or isinstance(tail_stride, bool) or not isinstance(tail_stride, int) or tail_stride < 1
    ):
        raise ValueError(
            f"plan tail_stride={tail_stride!r} needs train=window and an integer stride >= 1 (the ODE "
            f"after the window takes every tail_stride-th step); got train={train!r}"
        )


def _independent_plan(
    kinds: tuple[str, ...], trained: list[bool], *, group_size: int, same_noise: bool, tail_stride: int
) -> RolloutPlan:
    """The independent groups' plan: group_size roots, or one root branching at the first SDE step (same_noise)."""
    if same_noise:  # one noise per group: the ODE steps before the first SDE step are identical, so run them once
        first = next((t for t, kind in enumerate(kinds) if kind != "ode"), 0)
        plan = RolloutPlan(kinds, roots=1, branches={first: group_size})
    else:
        plan = RolloutPlan(kinds, roots=group_size)
    if tail_stride > 1 and not trained[-1]:  # the coarse ODE tail is G2RPO's completion at one granularity
        plan = dataclasses.replace(plan, granularities=(tail_stride,))
    return plan


@SCHEDULES.register("fast")
def fast(
    *,
    num_steps: int,
    group_size: int,
    sde: str,
    iteration: int,
    same_noise: bool,
    seeds: list[int],
    sde_steps: int = 2,
    branch_range: tuple[int, int] | list[int] | None = None,
) -> tuple[RolloutPlan, Tensor]:
    """Flow-GRPO-Fast: one shared ODE prefix per prompt, the group branches at a random step, 1-2 SDE steps, ODE after.

    The branch step is drawn per iteration from branch_range (default [0, num_steps - sde_steps]); only SDE steps train.
    """
    lo, hi = branch_range if branch_range is not None else (0, num_steps - sde_steps)
    if not 0 <= lo <= hi <= num_steps - sde_steps or sde_steps < 1:
        raise ValueError(
            f"fast plan branch_range=({lo}, {hi}) with sde_steps={sde_steps} must lie in "
            f"[0, num_steps - sde_steps = {num_steps - sde_steps}]"
        )
    s = lo + int(torch.randint(hi - lo + 1, (1,), generator=_rng(iteration, 11)))
    on = [s <= t < s + sde_steps for t in range(num_steps)]
    plan = RolloutPlan(tuple(sde if o else "ode" for o in on), roots=1, branches={s: group_size})
    return plan, torch.tensor(on).repeat(len(seeds) * group_size, 1)


@SCHEDULES.register("singular")
def singular(
    *,
    num_steps: int,
    group_size: int,
    sde: str,
    iteration: int,
    same_noise: bool,
    seeds: list[int],
    branch_steps: list[int] | None = None,
    granularities: list[int] | None = None,
) -> tuple[RolloutPlan, Tensor]:
    """G2RPO singular stochastic sampling: one SDE step per group off a shared ODE trajectory (arXiv:2510.01982).

    The SDE step cycles through branch_steps (default the first half of the steps), one per iteration. With
    granularities [s_1, ..., s_M] each of the group_size / M members finishes with an ODE of every stride s_j
    (group_size counts the leaves); `granular_advantages` then sums their group-normalised rewards.
    """
    steps = list(branch_steps) if branch_steps is not None else list(range(max(1, num_steps // 2)))
    if not steps or not all(0 <= s < num_steps for s in steps):
        raise ValueError(f"singular plan branch_steps={steps} must be non-empty steps in [0, {num_steps})")
    if granularities is not None and not isinstance(granularities, list | tuple):
        raise ValueError(f"singular plan granularities={granularities!r} must be a list of ODE strides, e.g. [1, 2]")
    grans = tuple(granularities) if granularities is not None else (1,)
    if not grans or group_size % len(grans):
        raise ValueError(
            f"singular plan: sample.group_size={group_size} must be divisible by len(granularities)="
            f"{len(grans)} ({list(grans)}); group_size counts leaves = members x granularities"
        )
    plan, trained = fast(
        num_steps=num_steps,
        group_size=group_size // len(grans),
        sde=sde,
        iteration=0,
        same_noise=True,
        seeds=seeds,
        sde_steps=1,
        branch_range=(steps[iteration % len(steps)],) * 2,
    )
    plan = dataclasses.replace(plan, granularities=grans)
    plan.check()
    return plan, trained[:1].repeat(len(seeds) * group_size, 1)


@SCHEDULES.register("tree")
def tree(
    *,
    num_steps: int,
    group_size: int,
    sde: str,
    iteration: int,
    same_noise: bool,
    seeds: list[int],
    split_steps: list[int] | None = None,
    fanout: int = 2,
    roots: int = 1,
    prune_depths: list[int] | None = None,
    width_prune: str | None = None,
    width_keep: float = 1,
    edge_credit: str = "once",
    fusion: str = "mean",
    fusion_alpha: float = 1.0,
) -> tuple[RolloutPlan, Tensor]:
    """BranchGRPO tree: `roots` noises per prompt, every node splits into `fanout` at each split step (arXiv:2509.06040).

    SDE at every step; steps at a depth listed in prune_depths are not trained (depth pruning cuts backward only).
    width_prune (branch_best | extremes) masks whole leaves once rewards are in (`width_prune_mask`); rollouts unchanged.
    edge_credit once (default, BranchGRPO): each distinct parent -> child transition is one loss element with the
    child's advantage, kept in the row of the first leaf below it that survives width pruning, and scored once;
    per_leaf: every leaf trains its whole path, so an edge over L leaves weighs L times (a root edge of a 16-leaf tree
    16 times). The returned [N, T] mask is the leaf paths; the policy applies the edge credit to the rollout's mask.
    With once, a sequence-mean algo.aggregation would weigh an edge by 1 / (its row's edge count): use token_mean.
    fusion mean | prob (BranchGRPO --tree_prob_weighted, alpha = fusion_alpha) fuses leaf rewards up the tree.
    """
    n_splits = round(math.log(group_size / roots, fanout)) if group_size % roots == 0 and fanout > 1 else -1
    if n_splits < 0 or roots * fanout**n_splits != group_size:
        raise ValueError(f"tree plan: group_size={group_size} must equal roots={roots} * fanout={fanout}^splits")
    if split_steps is None:
        split_steps = [round(i * num_steps / max(1, n_splits)) for i in range(n_splits)] if n_splits else []
    if len(split_steps) != n_splits:
        raise ValueError(f"tree plan split_steps={split_steps} must list {n_splits} steps for group_size={group_size}")
    plan = RolloutPlan(
        tuple([sde] * num_steps),
        roots=roots,
        branches={int(s): fanout for s in split_steps},
        width_prune=width_prune,
        width_keep=width_keep,
        edge_credit=edge_credit,
        fusion=fusion,
        fusion_alpha=float(fusion_alpha),
    )
    check_width(plan)
    if edge_credit not in EDGE_CREDIT:
        raise ValueError(f"tree plan edge_credit={edge_credit!r} must be one of {', '.join(EDGE_CREDIT)}")
    if fusion not in ("mean", "prob"):
        raise ValueError(
            f"tree plan fusion={fusion!r} must be mean (a node's reward is its leaves' mean) or prob "
            f"(softmax(fusion_alpha * child log-prob) weighted, BranchGRPO --tree_prob_weighted)"
        )
    on = _tree_trained_steps(plan, prune_depths, fusion)
    return plan, torch.tensor(on).repeat(len(seeds) * group_size, 1)


def _tree_trained_steps(plan: RolloutPlan, prune_depths: list[int] | None, fusion: str) -> list[bool]:
    """[T] which steps of a tree plan train: every step whose depth is not in prune_depths (checked against fusion)."""
    num_steps = plan.num_steps
    depth = depth_of_steps(plan)
    on = [int(depth[t]) not in set(prune_depths or ()) for t in range(num_steps)]
    k = sum(on)
    if k == 0:
        raise ValueError(f"tree plan prune_depths={prune_depths} prunes every step; keep at least one depth")
    # prob fusion weighs the children made at split step s by its log-prob, needed if the parents' depth trains
    lost = [
        s
        for s in plan.branches
        if fusion == "prob" and not on[s] and any(on[t] and depth[t] == depth[s] - 1 for t in range(num_steps))
    ]
    if lost:
        raise ValueError(
            f"tree plan fusion=prob weighs children by the log-prob of their split step, but "
            f"prune_depths={prune_depths} drops split steps {lost} whose parents train"
        )
    return on


def make_plan(
    name: str,
    *,
    num_steps: int,
    group_size: int,
    sde: str,
    iteration: int,
    same_noise: bool,
    seeds: list[int],
    **kwargs,
) -> tuple[RolloutPlan, Tensor]:
    """The named plan and its [N, T] trained mask for this iteration (see SCHEDULES)."""
    fn = SCHEDULES.get(name)
    plan, trained = fn(
        num_steps=num_steps,
        group_size=group_size,
        sde=sde,
        iteration=iteration,
        same_noise=same_noise,
        seeds=seeds,
        **kwargs,
    )
    if plan.group_size != group_size:
        raise ValueError(
            f"plan {name!r} yields {plan.group_size} leaves per prompt but sample.group_size={group_size}"
        )
    return plan, trained
