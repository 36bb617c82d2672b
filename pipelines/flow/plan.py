"""Rollout plans for flow models: where groups branch, the fan-out, ODE or SDE per step, and which steps are trained.

One executor covers independent groups, same-noise groups, BranchGRPO trees and singular-step (G2RPO / Fast) groups,
the latter optionally completed at several ODE granularities (G2RPO's multi-granularity advantage integration).
The tree maths (depths, fused rewards, per-depth advantages, width pruning, edge credit) live in
`pipelines.flow.tree` and are re-exported here.
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class RolloutPlan:
    """The shape of one prompt's rollout tree; every prompt of a batch shares it.

    `roots` initial noises per prompt; before step t in `branches` every live node splits into `branches[t]`
    children that share x_t (one model call) and differ by their own SDE noise at t. Each resulting member then
    finishes once per entry of `granularities`: leaves = roots * prod(fan-outs) * len(granularities), the
    granularity leaves of a member contiguous (leaf = member * M + j).
    """

    kinds: tuple[str, ...]
    """[T] step kind: "ode" or an SDE kind of `pipelines.flow.sde`"""
    roots: int = 1
    branches: dict[int, int] = field(default_factory=dict)
    width_prune: str | None = None
    """BranchGRPO width pruning applied once rewards are known (see `width_keep_leaves`); None trains every leaf"""
    width_keep: float = 1
    """int >= 1: leaves kept per sibling set (branch_best) or per side (extremes); float in (0, 1): that fraction"""
    granularities: tuple[int, ...] = (1,)
    """G2RPO: ODE completion strides after the last SDE step (see `completion_indices`); (1,) = every step"""
    edge_credit: str = "per_leaf"
    """once: a transition shared by several leaves is one loss element (`credit_edges_once`); per_leaf: one per leaf
    below it. The tree plan defaults to once (BranchGRPO); other plans share no trained transition"""
    fusion: str = "mean"
    """BranchGRPO reward fusion up the tree (`node_rewards`): mean, or prob (softmax(fusion_alpha * child logp))"""
    fusion_alpha: float = 1.0

    @property
    def num_steps(self) -> int:
        return len(self.kinds)

    @property
    def members(self) -> int:
        """Distinct SDE paths per prompt: roots * prod(fan-outs)."""
        return self.roots * math.prod(self.branches.values())

    @property
    def group_size(self) -> int:
        return self.members * len(self.granularities)

    @property
    def coarse(self) -> bool:
        """True when the tail after the last SDE step runs the granularity completion instead of every step."""
        return tuple(self.granularities) != (1,)

    @property
    def split_step(self) -> int | None:
        """The last SDE step (None when every step is ODE); the granularity completions start after it."""
        sde_steps = [t for t, k in enumerate(self.kinds) if k != "ode"]
        return sde_steps[-1] if sde_steps else None

    def fanout_after(self, t: int) -> int:
        """How many leaves each node alive at step t (after its split) ends up with."""
        m = len(self.granularities) if self.coarse and t <= self.split_step else 1
        return math.prod(f for s, f in self.branches.items() if s > t) * m

    def check(self) -> None:
        """Raise ValueError if a branch point is out of range, has fan-out < 1 or is deterministic."""
        if self.roots < 1:
            raise ValueError(f"plan roots={self.roots} must be >= 1 initial noises per prompt")
        for t, f in self.branches.items():
            if not 0 <= t < self.num_steps or f < 1:
                raise ValueError(f"plan branch {t}: {f} needs 0 <= step < num_steps={self.num_steps} and fan-out >= 1")
            if f > 1 and self.kinds[t] == "ode":
                raise ValueError(f"plan branches at step {t} with fan-out {f}, but step {t} is ODE, so every child "
                                 f"would be identical; make step {t} an SDE step")
        if self.edge_credit not in EDGE_CREDIT:
            raise ValueError(f"plan edge_credit={self.edge_credit!r} must be one of {', '.join(EDGE_CREDIT)}")
        self._check_granularities()

    def _check_granularities(self) -> None:
        g = tuple(self.granularities)
        if not g or len(set(g)) != len(g) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in g):
            raise ValueError(f"plan granularities={list(g)} must be distinct integer ODE strides >= 1, e.g. [1, 2]")
        if not self.coarse:
            return
        t = self.split_step
        if t is None or t == self.num_steps - 1:
            where = "no step is SDE" if t is None else f"the last SDE step is the last step ({t})"
            raise ValueError(f"plan granularities={list(g)} complete with ODE after the last SDE step, but {where}: "
                             f"nothing is left to complete; the tail after the SDE step(s) must be ODE")
        if self.width_prune is not None:
            raise ValueError(f"plan width_prune={self.width_prune!r} prunes tree leaves; it does not combine with "
                             f"granularities={list(g)}, unset one of them")


@dataclass
class PlanResult:
    """What running a plan produced, for N = B * G leaves (prompt-major, groups contiguous)."""

    final: Tensor
    """[N, ...] the last latents"""
    x_t: Tensor
    """[N, K, ...] latents entering each trained step"""
    x_next: Tensor
    """[N, K, ...] the sampled next latents"""
    steps: Tensor
    """[N, K] long: step index of each trained transition"""
    logp: Tensor
    """[N, K] log-prob of each trained transition at sampling time"""
    nfe: int
    """model evaluations (each counts one latent, CFG not included)"""
    mean: Tensor | None = None
    """[N, K, ...] the sampling policy's transition means (keep_mean=True; GRPO-Guard's exact RatioNorm)"""


def mix_seed(*parts: int) -> int:
    """A 62-bit seed from integers (one prompt seed, a step, a node key): splitmix-style, platform independent."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & ((1 << 62) - 1)


def _generators(seeds: list[int], prompt: Tensor, key: Tensor, t: int) -> list[torch.Generator]:
    # a node's noise depends only on (its prompt's seed, the step, its key): batching and ranks cannot change it
    return [torch.Generator().manual_seed(mix_seed(seeds[p], t + 1, k)) for p, k in zip(prompt.tolist(), key.tolist())]


def execute(plan: RolloutPlan, *, seeds: list[int], shape: tuple[int, ...], sigmas: Tensor, trained: Tensor,
            velocity: Callable[[Tensor, Tensor, Tensor], Tensor], step: Callable, noise_level: float,
            device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
            keep_mean: bool = False) -> PlanResult:
    """Run `plan` for len(seeds) prompts; shared prefixes are computed once.

    Args:
        seeds: [B] one seed per prompt.
        shape: one latent's shape (no batch dim).
        sigmas: [T+1] noise levels from ~1 down to 0.
        trained: [N, T] bool, which transitions of each leaf to keep (same count K per leaf).
        velocity: fn(x [M, ...], sigma [M], prompt [M] long) -> v [M, ...].
        step: `sde.step`-like fn(kind, x, v, sigma, sigma_next, noise_level=, generator=) -> (prev_sample, logp, ...).
        keep_mean: also return each trained transition's mean (PlanResult.mean), one more [N, K, ...] tensor.
    Returns:
        PlanResult with leaves in prompt-major order.
    """
    plan.check()
    b, g, t_total = len(seeds), plan.group_size, plan.num_steps
    if sigmas.shape != (t_total + 1,):
        raise ValueError(f"sigmas {tuple(sigmas.shape)} must be [num_steps + 1 = {t_total + 1}]")
    if trained.shape != (b * g, t_total):
        raise ValueError(f"trained {tuple(trained.shape)} must be [N = {b * g}, T = {t_total}]")
    k = int(trained[0].sum()) if len(trained) else 0
    if (trained.sum(1) != k).any():
        raise ValueError(f"every leaf must train the same number of steps, got counts {trained.sum(1).tolist()}")
    prompt = torch.arange(b).repeat_interleave(plan.roots)  # [M]
    key = torch.arange(plan.roots).repeat(b)  # [M]
    x = torch.stack([torch.randn(shape, generator=gen) for gen in _generators(seeds, prompt, key, -1)])
    x = x.to(device=device, dtype=dtype)  # [M, ...]
    stop = plan.split_step + 1 if plan.coarse else t_total  # granularities: the tail runs in _complete
    if plan.coarse and trained[:, stop:].any():
        raise ValueError(f"plan granularities={list(plan.granularities)}: only steps up to the split step "
                         f"{stop - 1} can train; the ODE tail differs per granularity and carries no log-prob")
    keep: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
    nfe = 0
    sigmas = sigmas.cpu()  # step() checks host sigmas and copies them without waiting for the device
    for t in range(stop):
        sig = sigmas[t].expand(len(x))  # [M]
        v = velocity(x, sig.to(device, non_blocking=True), prompt.to(device, non_blocking=True))  # [M, ...]
        nfe += len(x)
        f = plan.branches.get(t, 1)
        if f > 1:  # children share x_t and its velocity: one model call per parent
            x, v = x.repeat_interleave(f, 0), v.repeat_interleave(f, 0)
            prompt = prompt.repeat_interleave(f)
            key = key.repeat_interleave(f) * f + torch.arange(f).repeat(len(key))
            sig = sig.repeat_interleave(f)
        gens = None if plan.kinds[t] == "ode" else _generators(seeds, prompt, key, t)
        out = step(plan.kinds[t], x, v, sig, sigmas[t + 1].expand(len(x)), noise_level=noise_level, generator=gens)
        if trained[:, t].any():
            keep[t] = (x, out.prev_sample, out.logp, out.mean if keep_mean else None)
        x = out.prev_sample
    if plan.coarse:
        x, calls = complete_granularities(plan, x, prompt, sigmas, velocity, step, noise_level, device)
        nfe += calls
    x_t, x_next, steps, logp, mean = _gather(plan, keep, x, trained, k)
    return PlanResult(final=x, x_t=x_t, x_next=x_next, steps=steps, logp=logp, nfe=nfe,
                      mean=mean if keep_mean else None)


def _gather(plan: RolloutPlan, keep: dict, final: Tensor, trained: Tensor, k: int):
    """Per leaf, its ancestors' trained transitions in step order: (x_t, x_next [N, K, ...], steps, logp [N, K],
    mean [N, K, ...] or None)."""
    n = final.shape[0]
    if k == 0:
        empty = final.new_zeros((n, 0, *final.shape[1:]))
        return empty, empty, torch.zeros(n, 0, dtype=torch.long), final.new_zeros(n, 0, dtype=torch.float32), empty
    steps = torch.stack([row.nonzero().flatten() for row in trained])  # [N, K]
    fan = torch.tensor([plan.fanout_after(t) for t in range(plan.num_steps)])  # [T]
    node = torch.arange(n)[:, None] // fan[steps]  # [N, K] index among the nodes alive at that step
    xs, xn, lp, mu = [], [], [], []
    for i in range(n):
        for j in range(k):
            x_t, x_next, logp, mean = keep[int(steps[i, j])]
            c = int(node[i, j])
            xs.append(x_t[c])
            xn.append(x_next[c])
            lp.append(logp[c])
            if mean is not None:
                mu.append(mean[c])
    shape = (n, k, *final.shape[1:])
    return (torch.stack(xs).view(shape), torch.stack(xn).view(shape), steps,
            torch.stack(lp).view(n, k).float(), torch.stack(mu).view(shape) if mu else None)


def count_nfe(plan: RolloutPlan, b: int) -> int:
    """Model evaluations of a plan for b prompts: nodes alive before each step's split; with granularities, one
    shared call per member where the completions start, then one per leaf per further completion step."""
    alive, total = b * plan.roots, 0
    stop = plan.split_step + 1 if plan.coarse else plan.num_steps
    for t in range(stop):
        total += alive
        alive *= plan.branches.get(t, 1)
    if plan.coarse:  # a path of L sigma indices takes L - 1 steps, the first on the shared velocity
        total += alive * (1 + sum(len(completion_indices(stop, plan.num_steps, s)) - 2 for s in plan.granularities))
    return total


# ---- plans by name: fn(*, num_steps, group_size, sde, iteration, same_noise, seeds, **kw) -> (plan, trained)


def _rng(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(mix_seed(*parts))


def window_start(iteration: int, *, num_steps: int, size: int, every: int, stride: int = 1, start: int = 0,
                 last: int | None = None) -> int:
    """MixGRPO's progressive sliding window: first step of the SDE window at `iteration` (arXiv:2507.21802).

    start + (iteration // every) * stride, rolled back to `start` once it passes `last` (default num_steps - size).
    """
    last = num_steps - size if last is None else last
    if size < 1 or size > num_steps or every < 1 or stride < 1 or not 0 <= start <= last <= num_steps - size:
        raise ValueError(f"window size={size}, every={every}, stride={stride}, start={start}, last={last} must satisfy "
                         f"1 <= size <= num_steps={num_steps}, every >= 1, stride >= 1, 0 <= start <= last <= T - size")
    positions = (last - start) // stride + 1
    return start + ((iteration // every) % positions) * stride


@SCHEDULES.register("independent")
def independent(*, num_steps: int, group_size: int, sde: str, iteration: int, same_noise: bool, seeds: list[int],
                train: str = "all", fraction: float = 0.6, skip_last: bool = False, window_size: int = 4,
                window_every: int = 25, window_stride: int = 1, window_start_step: int = 0,
                window_last: int | None = None, tail_stride: int = 1) -> tuple[RolloutPlan, Tensor]:
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
        w0 = window_start(iteration, num_steps=num_steps, size=window_size, every=window_every, stride=window_stride,
                          start=window_start_step, last=window_last)
        trained = [w0 <= t < w0 + window_size for t in range(num_steps)]
        sde_steps = trained  # ODE outside the window: MixGRPO's mixed sampler
    else:
        raise ValueError(f"plan train={train!r} is not a step selection; choose all, random or window")
    if tail_stride != 1 and (train != "window" or isinstance(tail_stride, bool) or not isinstance(tail_stride, int)
                             or tail_stride < 1):
        raise ValueError(f"plan tail_stride={tail_stride!r} needs train=window and an integer stride >= 1 (the ODE "
                         f"after the window takes every tail_stride-th step); got train={train!r}")
    kinds = tuple(sde if on else "ode" for on in sde_steps)
    if same_noise:  # one noise per group: the ODE steps before the first SDE step are identical, so run them once
        first = next((t for t, kind in enumerate(kinds) if kind != "ode"), 0)
        plan = RolloutPlan(kinds, roots=1, branches={first: group_size})
    else:
        plan = RolloutPlan(kinds, roots=group_size)
    if tail_stride > 1 and not trained[-1]:  # the coarse ODE tail is G2RPO's completion at one granularity
        plan = dataclasses.replace(plan, granularities=(tail_stride,))
    mask = torch.tensor(trained).repeat(len(seeds) * group_size, 1)  # [N, T]
    if rows is not None:
        for i, r in enumerate(rows):
            mask[i, r] = True
    return plan, mask


@SCHEDULES.register("fast")
def fast(*, num_steps: int, group_size: int, sde: str, iteration: int, same_noise: bool, seeds: list[int],
         sde_steps: int = 2, branch_range: tuple[int, int] | list[int] | None = None) -> tuple[RolloutPlan, Tensor]:
    """Flow-GRPO-Fast: one shared ODE prefix per prompt, the group branches at a random step, 1-2 SDE steps, ODE after.

    The branch step is drawn per iteration from branch_range (default [0, num_steps - sde_steps]); only SDE steps train.
    """
    lo, hi = branch_range if branch_range is not None else (0, num_steps - sde_steps)
    if not 0 <= lo <= hi <= num_steps - sde_steps or sde_steps < 1:
        raise ValueError(f"fast plan branch_range=({lo}, {hi}) with sde_steps={sde_steps} must lie in "
                         f"[0, num_steps - sde_steps = {num_steps - sde_steps}]")
    s = lo + int(torch.randint(hi - lo + 1, (1,), generator=_rng(iteration, 11)))
    on = [s <= t < s + sde_steps for t in range(num_steps)]
    plan = RolloutPlan(tuple(sde if o else "ode" for o in on), roots=1, branches={s: group_size})
    return plan, torch.tensor(on).repeat(len(seeds) * group_size, 1)


@SCHEDULES.register("singular")
def singular(*, num_steps: int, group_size: int, sde: str, iteration: int, same_noise: bool, seeds: list[int],
             branch_steps: list[int] | None = None,
             granularities: list[int] | None = None) -> tuple[RolloutPlan, Tensor]:
    """G2RPO singular stochastic sampling: one SDE step per group off a shared ODE trajectory (arXiv:2510.01982).

    The SDE step cycles through branch_steps (default the first half of the steps), one per iteration. With
    granularities [s_1, ..., s_M] each of the group_size / M members finishes with an ODE of every stride s_j
    (group_size counts the leaves); `granular_advantages` then sums their group-normalised rewards.
    """
    steps = list(branch_steps) if branch_steps is not None else list(range(max(1, num_steps // 2)))
    if not steps or not all(0 <= s < num_steps for s in steps):
        raise ValueError(f"singular plan branch_steps={steps} must be non-empty steps in [0, {num_steps})")
    if granularities is not None and not isinstance(granularities, list | tuple):
        raise ValueError(
            f"singular plan granularities={granularities!r} must be a list of ODE strides, e.g. [1, 2]")
    grans = tuple(granularities) if granularities is not None else (1,)
    if not grans or group_size % len(grans):
        raise ValueError(f"singular plan: sample.group_size={group_size} must be divisible by len(granularities)="
                         f"{len(grans)} ({list(grans)}); group_size counts leaves = members x granularities")
    plan, trained = fast(num_steps=num_steps, group_size=group_size // len(grans), sde=sde, iteration=0,
                         same_noise=True, seeds=seeds, sde_steps=1, branch_range=(steps[iteration % len(steps)],) * 2)
    plan = dataclasses.replace(plan, granularities=grans)
    plan.check()
    return plan, trained[:1].repeat(len(seeds) * group_size, 1)


@SCHEDULES.register("tree")
def tree(*, num_steps: int, group_size: int, sde: str, iteration: int, same_noise: bool, seeds: list[int],
         split_steps: list[int] | None = None, fanout: int = 2, roots: int = 1,
         prune_depths: list[int] | None = None, width_prune: str | None = None,
         width_keep: float = 1, edge_credit: str = "once", fusion: str = "mean",
         fusion_alpha: float = 1.0) -> tuple[RolloutPlan, Tensor]:
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
    if n_splits < 0 or roots * fanout ** n_splits != group_size:
        raise ValueError(f"tree plan: group_size={group_size} must equal roots={roots} * fanout={fanout}^splits")
    if split_steps is None:
        split_steps = [round(i * num_steps / max(1, n_splits)) for i in range(n_splits)] if n_splits else []
    if len(split_steps) != n_splits:
        raise ValueError(f"tree plan split_steps={split_steps} must list {n_splits} steps for group_size={group_size}")
    plan = RolloutPlan(tuple([sde] * num_steps), roots=roots, branches={int(s): fanout for s in split_steps},
                       width_prune=width_prune, width_keep=width_keep, edge_credit=edge_credit, fusion=fusion,
                       fusion_alpha=float(fusion_alpha))
    check_width(plan)
    if edge_credit not in EDGE_CREDIT:
        raise ValueError(f"tree plan edge_credit={edge_credit!r} must be one of {', '.join(EDGE_CREDIT)}")
    if fusion not in ("mean", "prob"):
        raise ValueError(f"tree plan fusion={fusion!r} must be mean (a node's reward is its leaves' mean) or prob "
                         f"(softmax(fusion_alpha * child log-prob) weighted, BranchGRPO --tree_prob_weighted)")
    depth = depth_of_steps(plan)
    on = [int(depth[t]) not in set(prune_depths or ()) for t in range(num_steps)]
    k = sum(on)
    if k == 0:
        raise ValueError(f"tree plan prune_depths={prune_depths} prunes every step; keep at least one depth")
    # prob fusion weighs the children made at split step s by its log-prob, needed if the parents' depth trains
    lost = [s for s in plan.branches if fusion == "prob" and not on[s]
            and any(on[t] and depth[t] == depth[s] - 1 for t in range(num_steps))]
    if lost:
        raise ValueError(f"tree plan fusion=prob weighs children by the log-prob of their split step, but "
                         f"prune_depths={prune_depths} drops split steps {lost} whose parents train")
    return plan, torch.tensor(on).repeat(len(seeds) * group_size, 1)


def make_plan(name: str, *, num_steps: int, group_size: int, sde: str, iteration: int, same_noise: bool,
              seeds: list[int], **kwargs) -> tuple[RolloutPlan, Tensor]:
    """The named plan and its [N, T] trained mask for this iteration (see SCHEDULES)."""
    fn = SCHEDULES.get(name)
    plan, trained = fn(num_steps=num_steps, group_size=group_size, sde=sde, iteration=iteration, same_noise=same_noise,
                       seeds=seeds, **kwargs)
    if plan.group_size != group_size:
        raise ValueError(f"plan {name!r} yields {plan.group_size} leaves per prompt but sample.group_size={group_size}")
    return plan, trained
