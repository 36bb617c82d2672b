"""A flow rollout plan and its executor: `RolloutPlan` (where groups branch, the fan-out, ODE or SDE per step, which
granularities complete it), `execute` (runs it, shared prefixes once, per-node seeded noise), `PlanResult` and
`count_nfe`. The plans by name (`SCHEDULES`, `make_plan`) are in `pipelines.flow.plan`, which re-exports these.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pipelines.flow.granular import complete_granularities, completion_indices
from pipelines.flow.tree import EDGE_CREDIT


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
                raise ValueError(
                    f"plan branches at step {t} with fan-out {f}, but step {t} is ODE, so every child "
                    f"would be identical; make step {t} an SDE step"
                )
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
            raise ValueError(
                f"plan granularities={list(g)} complete with ODE after the last SDE step, but {where}: "
                f"nothing is left to complete; the tail after the SDE step(s) must be ODE"
            )
        if self.width_prune is not None:
            raise ValueError(
                f"plan width_prune={self.width_prune!r} prunes tree leaves; it does not combine with "
                f"granularities={list(g)}, unset one of them"
            )


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


def _check_inputs(plan: RolloutPlan, b: int, sigmas: Tensor, trained: Tensor) -> tuple[int, int]:
    """Check the plan, sigmas and trained mask for b prompts; return (K trained steps per leaf, steps run before the
    granularity completions)."""
    plan.check()
    g, t_total = plan.group_size, plan.num_steps
    if sigmas.shape != (t_total + 1,):
        raise ValueError(f"sigmas {tuple(sigmas.shape)} must be [num_steps + 1 = {t_total + 1}]")
    if trained.shape != (b * g, t_total):
        raise ValueError(f"trained {tuple(trained.shape)} must be [N = {b * g}, T = {t_total}]")
    k = int(trained[0].sum()) if len(trained) else 0
    if (trained.sum(1) != k).any():
        raise ValueError(f"every leaf must train the same number of steps, got counts {trained.sum(1).tolist()}")
    stop = plan.split_step + 1 if plan.coarse else t_total  # granularities: the tail runs in _complete
    if plan.coarse and trained[:, stop:].any():
        raise ValueError(
            f"plan granularities={list(plan.granularities)}: only steps up to the split step "
            f"{stop - 1} can train; the ODE tail differs per granularity and carries no log-prob"
        )
    return k, stop


def execute(
    plan: RolloutPlan,
    *,
    seeds: list[int],
    shape: tuple[int, ...],
    sigmas: Tensor,
    trained: Tensor,
    velocity: Callable[[Tensor, Tensor, Tensor], Tensor],
    step: Callable,
    noise_level: float,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    keep_mean: bool = False,
) -> PlanResult:
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
    k, stop = _check_inputs(plan, len(seeds), sigmas, trained)
    b = len(seeds)
    prompt = torch.arange(b).repeat_interleave(plan.roots)  # [M]
    key = torch.arange(plan.roots).repeat(b)  # [M]
    x = torch.stack([torch.randn(shape, generator=gen) for gen in _generators(seeds, prompt, key, -1)])
    x = x.to(device=device, dtype=dtype)  # [M, ...]
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
    return PlanResult(
        final=x, x_t=x_t, x_next=x_next, steps=steps, logp=logp, nfe=nfe, mean=mean if keep_mean else None
    )


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
    return (
        torch.stack(xs).view(shape),
        torch.stack(xn).view(shape),
        steps,
        torch.stack(lp).view(n, k).float(),
        torch.stack(mu).view(shape) if mu else None,
    )


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
