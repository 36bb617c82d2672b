"""Rollout budget allocators: how many samples each prompt of a step gets (registry ALLOCATORS), Knapsack RL's value.

An allocator is a pure function of the prompts' estimated success rates and costs; the collector (mmgrpo/collect.py)
rolls each group out at its size and pads the batch to [B, G] with masked samples and NaN rewards.
"""

import math

import torch
from torch import Tensor

from mmgrpo.advantages import ADVANTAGES, batch_coupled
from mmgrpo.errors import UserError
from mmgrpo.registry import Registry

ALLOCATORS = Registry("rollout allocator")
_INFO = ("paper", "variance")


def knapsack_value(n: Tensor, p: Tensor, *, info: str = "paper") -> Tensor:
    """Knapsack RL's value of n rollouts on a prompt with success rate p: P(non-zero GRPO gradient) x InfoGain.

    Paper: arXiv:2509.25849 (task value). Formula: V(n, p) = (1 - p^n - (1 - p)^n) * g(p), g(p) = p (1 - p)^2
    (info="paper", the paper's InfoGain approximation) or p (1 - p) (info="variance", the Bernoulli variance VADE
    ranks by). Broadcasts n and p; float64.
    """
    if info not in _INFO:
        raise ValueError(f"info={info!r} is not supported; choose from {', '.join(map(repr, _INFO))}")
    n, p = torch.as_tensor(n, dtype=torch.float64), torch.as_tensor(p, dtype=torch.float64)
    gain = p * (1 - p) ** 2 if info == "paper" else p * (1 - p)
    return (1 - p**n - (1 - p) ** n) * gain


@ALLOCATORS.register("uniform")
def uniform(p: Tensor, cost: Tensor, *, group_size: int) -> Tensor:
    """Every prompt gets sample.group_size samples (the default: a dense [B, G] batch, no padding)."""
    return torch.full((len(p),), int(group_size), dtype=torch.long)


def _check_knapsack(b: int, cost: Tensor, group_size: int, budget: int, min_size: int) -> None:
    if not 1 <= min_size <= group_size:
        raise ValueError(
            f"min_size={min_size} must lie in [1, group_size={group_size}] (sample.group_size is the largest group)"
        )
    if cost.shape != (b,) or bool((cost < 1).any()):
        raise ValueError(
            f"cost must be [B]=({b},) integers >= 1 (per-rollout cost of each prompt), got {cost.tolist()}"
        )
    least = int(cost.sum()) * min_size
    if budget < least:
        raise ValueError(
            f"budget={budget} cannot give every prompt min_size={min_size} rollouts (that costs {least}); raise the "
            f"budget or lower min_size"
        )


@ALLOCATORS.register("knapsack", paper="arXiv:2509.25849")
def knapsack(
    p: Tensor,
    cost: Tensor,
    *,
    group_size: int,
    budget: int | None = None,
    min_size: int = 2,
    info: str = "paper",
) -> Tensor:
    """Knapsack RL: the group sizes n_b in [min_size, group_size] maximising sum_b V(n_b, p_b) s.t. sum_b n_b c_b <=
    budget, solved exactly by dynamic programming over the integer budget.

    Paper: arXiv:2509.25849 (exploration budget allocation as a knapsack; value = P(non-zero gradient) x InfoGain).
    Formula: max sum_b V(n_b, p_b), V from knapsack_value; ties go to the smaller group, so a prompt whose value is 0
    (p at 0 or 1) keeps min_size and its share of the budget goes to the others.

    Args:
        p: [B] estimated success rates in [0, 1] (the sampler's Beta posterior means).
        cost: [B] integer cost of one rollout of each prompt (1 = count rollouts; tokens or frames otherwise).
        group_size: the largest group (the padded width, sample.group_size).
        budget: total cost per step; None = half of what group_size for every prompt would cost.
        min_size: the smallest group (2: a GRPO group needs two samples to have a spread).
        info: "paper" (p (1 - p)^2) or "variance" (p (1 - p)).

    Returns:
        [B] int64 group sizes.
    """
    p = torch.as_tensor(p, dtype=torch.float64).reshape(-1)
    cost = torch.as_tensor(cost).reshape(-1).to(torch.long)
    b = len(p)
    budget = int(cost.sum()) * group_size // 2 if budget is None else int(budget)
    _check_knapsack(b, cost, group_size, budget, min_size)
    sizes = torch.arange(min_size, group_size + 1)  # [S]
    dp = torch.zeros(budget + 1, dtype=torch.float64)  # [W+1] best value of the items so far within capacity w
    choice = torch.zeros(b, budget + 1, dtype=torch.long)  # [B, W+1] the size taken by item b at capacity w
    for i in range(b):
        best = torch.full_like(dp, -math.inf)  # [W+1]
        values = knapsack_value(sizes, p[i], info=info)  # [S]
        for n, v in zip(sizes.tolist(), values.tolist()):
            w = n * int(cost[i])
            if w > budget:
                break
            cand = torch.full_like(dp, -math.inf)
            cand[w:] = dp[: budget + 1 - w] + v  # [W+1]
            better = cand > best  # strict: the smaller size wins ties
            best = torch.where(better, cand, best)
            choice[i] = torch.where(better, n, choice[i])
        dp = best
    out, w = torch.zeros(b, dtype=torch.long), budget
    for i in reversed(range(b)):
        out[i] = choice[i, w]
        w -= int(out[i]) * int(cost[i])
    return out


def allocate(run, prompt_ids: list[int], prompts: list[dict]) -> Tensor | None:
    """Group sizes [B] of this step's global prompt batch, or None when every prompt gets sample.group_size."""
    s = run.cfg.sample
    if s.allocator == "uniform":
        return None
    if run.accelerator.num_processes > 1:
        raise UserError(
            f"sample.allocator={s.allocator!r} gives prompts different group sizes, which this engine supports on "
            f"one process only; launch without accelerate's multi-process or set sample.allocator=uniform"
        )
    kw = dict(s.allocator_kwargs)
    field = kw.pop("cost_field", None)
    alpha, beta = run.sampler.posterior()  # [P] Beta posterior of every prompt's success rate
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    p = alpha[ids] / (alpha[ids] + beta[ids])  # [B] posterior means
    cost = torch.tensor([math.ceil(float(q[field])) if field else 1 for q in prompts], dtype=torch.long)  # [B]
    return ALLOCATORS.get(s.allocator)(p, cost, group_size=s.group_size, **kw)


def check(cfg, sampler_cls) -> None:
    """sample.allocator: a registered name with valid kwargs; a non-uniform one needs a sampler with a posterior and
    no refill. Raises UserError before any model loads."""
    s = cfg.sample
    if s.allocator not in ALLOCATORS:
        raise UserError(f"sample.allocator: {ALLOCATORS.unknown_message(s.allocator)}")
    kw = {k: v for k, v in s.allocator_kwargs.items() if k != "cost_field"}
    try:
        ALLOCATORS.check_kwargs(s.allocator, kw, field="sample.allocator_kwargs", skip=("p", "cost", "group_size"))
    except ValueError as err:
        raise UserError(str(err)) from None
    try:
        b = s.batch_size // s.group_size
        ALLOCATORS.get(s.allocator)(torch.full((b,), 0.5), torch.ones(b), group_size=s.group_size, **kw)
    except (ValueError, TypeError) as err:
        raise UserError(f"sample.allocator_kwargs ({s.allocator_kwargs}): {' '.join(str(err).split())}") from None
    if s.allocator == "uniform":
        return
    if not hasattr(sampler_cls, "posterior"):
        raise UserError(
            f"sample.allocator={s.allocator!r} reads each prompt's success rate from the sampler's Beta posterior; "
            f"sample.sampler={s.sampler!r} keeps none: set sample.sampler=vade"
        )
    for where, a in [("algo", cfg.algo)] + [(f"algo.phases.{i}", p) for i, p in enumerate(cfg.algo.phases)]:
        name = a.advantage or cfg.algo.advantage
        kw = cfg.algo.advantage_kwargs if a.advantage_kwargs is None else a.advantage_kwargs
        if name in ADVANTAGES and batch_coupled(name, kw):
            raise UserError(
                f"{where}.advantage={name!r} with {where}.advantage_kwargs={kw} uses one statistic over the whole "
                f"batch, which groups of different sizes (sample.allocator={s.allocator!r}) do not share; use "
                f"std=group (or batch_norm=false), or sample.allocator=uniform"
            )
    if s.refill:
        raise UserError(
            f"sample.refill=true with sample.allocator={s.allocator!r}: refill assembles whole groups of "
            f"sample.group_size; set sample.refill=false (the allocator already spends the budget where groups vary)"
        )
