"""Rollout plans for flow models: where groups branch, the fan-out, ODE or SDE per step, and which steps are trained.

One executor covers independent groups, same-noise groups, BranchGRPO trees and singular-step (G2RPO / Fast) groups.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mmgrpo.registry import Registry

SCHEDULES = Registry("flow step schedule")
"""name -> fn(num_steps, *, iteration, **kw) -> (sde_steps [T] bool, trained [T] bool); see `step_schedule`."""


@dataclass(frozen=True)
class RolloutPlan:
    """The shape of one prompt's rollout tree; every prompt of a batch shares it.

    `roots` initial noises per prompt; before step t in `branches` every live node splits into `branches[t]`
    children that share x_t (one model call) and differ by their own SDE noise at t. Leaves = roots * prod(fan-outs).
    """

    kinds: tuple[str, ...]
    """[T] step kind: "ode" or an SDE kind of `pipelines.flow.sde`"""
    roots: int = 1
    branches: dict[int, int] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.kinds)

    @property
    def group_size(self) -> int:
        return self.roots * math.prod(self.branches.values())

    def fanout_after(self, t: int) -> int:
        """How many leaves each node alive at step t (after its split) ends up with."""
        return math.prod(f for s, f in self.branches.items() if s > t)

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
            device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> PlanResult:
    """Run `plan` for len(seeds) prompts; shared prefixes are computed once.

    Args:
        seeds: [B] one seed per prompt.
        shape: one latent's shape (no batch dim).
        sigmas: [T+1] noise levels from ~1 down to 0.
        trained: [N, T] bool, which transitions of each leaf to keep (same count K per leaf).
        velocity: fn(x [M, ...], sigma [M], prompt [M] long) -> v [M, ...].
        step: `sde.step`-like fn(kind, x, v, sigma, sigma_next, noise_level=, generator=) -> (prev_sample, logp, ...).
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
    keep: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
    nfe = 0
    for t in range(t_total):
        sig = sigmas[t].expand(len(x)).to(device)  # [M]
        v = velocity(x, sig, prompt.to(device))  # [M, ...]
        nfe += len(x)
        f = plan.branches.get(t, 1)
        if f > 1:  # children share x_t and its velocity: one model call per parent
            x, v = x.repeat_interleave(f, 0), v.repeat_interleave(f, 0)
            prompt = prompt.repeat_interleave(f)
            key = key.repeat_interleave(f) * f + torch.arange(f).repeat(len(key))
            sig = sig.repeat_interleave(f)
        gens = None if plan.kinds[t] == "ode" else _generators(seeds, prompt, key, t)
        out = step(plan.kinds[t], x, v, sig, sigmas[t + 1].expand(len(x)).to(device), noise_level=noise_level,
                   generator=gens)
        if trained[:, t].any():
            keep[t] = (x, out.prev_sample, out.logp)
        x = out.prev_sample
    x_t, x_next, steps, logp = _gather(plan, keep, x, trained, k)
    return PlanResult(final=x, x_t=x_t, x_next=x_next, steps=steps, logp=logp, nfe=nfe)


def _gather(plan: RolloutPlan, keep: dict, final: Tensor, trained: Tensor, k: int):
    """Per leaf, its ancestors' trained transitions in step order: (x_t, x_next [N, K, ...], steps, logp [N, K])."""
    n = final.shape[0]
    if k == 0:
        empty = final.new_zeros((n, 0, *final.shape[1:]))
        return empty, empty, torch.zeros(n, 0, dtype=torch.long), final.new_zeros(n, 0, dtype=torch.float32)
    steps = torch.stack([row.nonzero().flatten() for row in trained])  # [N, K]
    fan = torch.tensor([plan.fanout_after(t) for t in range(plan.num_steps)])  # [T]
    node = torch.arange(n)[:, None] // fan[steps]  # [N, K] index among the nodes alive at that step
    xs, xn, lp = [], [], []
    for i in range(n):
        for j in range(k):
            x_t, x_next, logp = keep[int(steps[i, j])]
            c = int(node[i, j])
            xs.append(x_t[c])
            xn.append(x_next[c])
            lp.append(logp[c])
    shape = (n, k, *final.shape[1:])
    return (torch.stack(xs).view(shape), torch.stack(xn).view(shape), steps,
            torch.stack(lp).view(n, k).float())


def _nfe(plan: RolloutPlan, b: int) -> int:
    """Model evaluations of a plan for b prompts: nodes alive before each step's split."""
    alive, total = b * plan.roots, 0
    for t in range(plan.num_steps):
        total += alive
        alive *= plan.branches.get(t, 1)
    return total
