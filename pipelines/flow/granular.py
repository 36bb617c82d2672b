"""G2RPO's multi-granularity pieces of the rollout plan (arXiv:2510.01982): ODE completions of one member at several
strides after its SDE step, and the advantage that sums the group-normalised rewards of every granularity.

`pipelines.flow.plan` re-exports these; the plan (`RolloutPlan.granularities`) decides when they run.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from pipelines.flow.tree import normalise_over


def completion_indices(start: int, end: int, stride: int) -> list[int]:
    """Sigma indices of a stride-`stride` ODE completion: start, start + s, ..., and always `end` (appended if skipped).

    G2RPO (arXiv:2510.01982) completes on sigma_schedule[:step+2] ++ sigma_schedule[step+2::g] (anchors.md 7): its
    first ODE step after the SDE step keeps stride 1, the coarse stride starts one index later, and the last index
    may stop short of sigma 0. Here the stride starts right after the SDE step and every completion ends exactly at sigma 0,
    so each granularity's leaf is a finished sample.
    """
    idx = list(range(start, end + 1, stride))
    return idx if idx[-1] == end else [*idx, end]


def complete_granularities(
    plan, x: Tensor, prompt: Tensor, sigmas: Tensor, velocity: Callable, step: Callable, noise_level: float, device
) -> tuple[Tensor, int]:
    """ODE completions of every member x [P, ...] at each granularity -> leaves [P * M, ...] and the model calls.

    The M completions of a member start from the same latent at the same sigma: that velocity is computed once;
    afterwards all unfinished rows share one velocity call per round, each at its own sigma."""
    m, start = len(plan.granularities), plan.split_step + 1
    paths = [completion_indices(start, plan.num_steps, s) for s in plan.granularities]
    length = torch.tensor([len(p) for p in paths])  # [M]
    sigmas = sigmas.cpu()  # step() checks host sigmas and copies them without waiting for the device
    table = torch.stack([sigmas[p + [p[-1]] * (int(length.max()) - len(p))] for p in paths])  # [M, L] padded
    v = velocity(
        x, sigmas[start].expand(len(x)).to(device, non_blocking=True), prompt.to(device, non_blocking=True)
    )  # [P, ...] shared by the M copies
    calls = len(x)
    x, v, prompt = x.repeat_interleave(m, 0), v.repeat_interleave(m, 0), prompt.repeat_interleave(m)  # [P * M, ...]
    gran = torch.arange(len(x)) % m  # [P * M] granularity of each leaf
    for i in range(int(length.max()) - 1):
        rows = (length[gran] > i + 1).nonzero().flatten()  # leaves whose path has a step i -> i + 1
        sig, sig_next = table[gran[rows], i], table[gran[rows], i + 1]  # [R] on the host
        on_dev = rows.to(x.device, non_blocking=True)  # [R]
        if i > 0:
            v = velocity(
                x[on_dev], sig.to(device, non_blocking=True), prompt[rows].to(device, non_blocking=True)
            )  # [R, ...] one call, per-row sigma
            calls += len(rows)
        out = step("ode", x[on_dev], v, sig, sig_next, noise_level=noise_level, generator=None)
        x = x.index_copy(0, on_dev, out.prev_sample)
    return x, calls


def granular_advantages(rewards: Tensor, m: int, *, eps: float = 1e-8) -> Tensor:
    """G2RPO's multi-granularity advantage integration [B, G] from leaf rewards [B, G * M] (arXiv:2510.01982).

    A_i = sum_j (r_ij - mean_i' r_i'j) / (std_i' r_i'j + eps): each granularity j normalised over the G members
    (unbiased std; a granularity with std < 1e-6 or one member contributes 0), summed over j. Leaf = member * M + j.
    """
    b, n = rewards.shape
    if m < 1 or n % m:
        raise ValueError(f"granular_advantages: {n} leaves per group is not a multiple of {m} granularities")
    r = rewards.reshape(b, n // m, m)  # [B, G, M]
    return normalise_over(r, 1, eps).sum(-1)  # [B, G]


def credited_leaves(plan, n: int) -> Tensor:
    """[N] bool: the leaf that trains each member's shared transitions (j = 0), so none is counted M times."""
    return torch.arange(n) % len(plan.granularities) == 0


def granular_step_advantages(plan, rewards: Tensor, k: int) -> Tensor:
    """[N, K]: each member's `granular_advantages` on every row of its leaves (rows j > 0 are masked out)."""
    m = len(plan.granularities)
    a = granular_advantages(rewards, m)  # [B, G]
    return a.repeat_interleave(m, 1).reshape(-1, 1).expand(-1, k).contiguous()  # [N, K]
