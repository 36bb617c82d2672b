"""Which prompts to roll out next and which groups to train on: zero-variance filtering and prompt samplers.

DAPO refill (roll out more rounds until B groups have reward variance) lives in `mmgrpo.collect`, the one place
the trainer gathers groups.

Bookkeeping on `[B, G]` rewards and prompt indices only; no model, no modality and no trainer state lives here.
"""

import torch
from torch import Tensor

# ---------------------------------------------------------------- zero-variance filter


def group_keep_mask(rewards: Tensor, *, atol: float = 0.0, rtol: float = 1e-6, below: float | None = None) -> Tensor:
    """True for the groups whose rewards are not all equal, i.e. that give a non-zero GRPO advantage.

    DAPO dynamic sampling (arXiv:2503.14476), decided on the outcome spread rather than the mean, so it also holds for
    continuous rewards (a mean in (0, 1) says nothing about the spread: OpenRLHF#1270, EasyR1's mean-based filter).
    Formula: keep_b = (max_g r_bg - min_g r_bg) > atol + rtol * max_g |r_bg|, over the finite rewards of the group.
    Gate on the outcome you want variance in: with shaped rewards (accuracy + a small length term) pass the accuracy
    column, or an atol above the shaping, else all-wrong groups keep "phantom" advantages (verl-recipe#125).

    Args:
        rewards: [B, G] (or [B, G, R]: kept when any of the R rewards varies); NaN/inf entries (ragged groups
            padded with NaN) are ignored.
        atol, rtol: tolerance under which rewards count as equal (torch.isclose-style).
        below: also keep a flat group whose rewards all lie under this value by more than the tolerance, for
            estimators that give such a group a gradient (NGRPO's virtual best sample: an all-wrong group gets
            negative advantages). None: flat groups are dropped.
    Returns:
        bool [B] on the rewards' device. A group with fewer than two finite rewards (G = 1) is never kept.
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol={atol}, rtol={rtol}: tolerances must be >= 0")
    r = torch.as_tensor(rewards).detach().to(torch.float64)
    if r.dim() == 2:
        r = r.unsqueeze(-1)  # [B, G, 1]
    if r.dim() != 3:
        raise ValueError(f"rewards must be [B, G] or [B, G, R], got shape {tuple(r.shape)}")
    if r.shape[1] == 0:
        return torch.zeros(r.shape[0], dtype=torch.bool, device=r.device)
    finite = torch.isfinite(r)  # [B, G, R]
    hi = torch.where(finite, r, -torch.inf).amax(dim=1)  # [B, R]
    lo = torch.where(finite, r, torch.inf).amin(dim=1)  # [B, R]
    enough = finite.sum(dim=1) >= 2  # [B, R]
    spread = torch.where(enough, hi - lo, 0.0)  # [B, R]
    scale = torch.where(enough, torch.maximum(hi.abs(), lo.abs()), 0.0)  # [B, R]
    keep = (enough & (spread > atol + rtol * scale)).any(dim=-1)  # [B]
    if below is not None:
        gap = below - hi  # [B, R] distance of the group's best reward under `below`
        keep = keep | (enough & (gap > atol + rtol * abs(below))).all(dim=-1)  # [B]
    return keep


def zero_std_fraction(rewards: Tensor, *, atol: float = 0.0, rtol: float = 1e-6) -> float:
    """Fraction of groups with no reward spread (the ones `group_keep_mask` drops); 0.0 for an empty batch.

    Log it as `adv/zero_std_frac`: it is the share of the batch that gives no gradient under GRPO.
    """
    keep = group_keep_mask(rewards, atol=atol, rtol=rtol)  # [B]
    return 0.0 if keep.numel() == 0 else 1.0 - keep.double().mean().item()


# ---------------------------------------------------------------- trajectory diversity (MMR1 VAS)


def distinct_1(samples: list, group_size: int) -> Tensor:
    """Per group, the share of distinct whitespace tokens among all tokens of its G text samples (distinct-1,
    Li et al. 2016, arXiv:1510.03055): MMR1's trajectory-diversity term D_i in [0, 1] (arXiv:2509.21268 weights
    lexical diversity next to the outcome variance). A group with no token at all scores 0.

    Args:
        samples: [B*G] strings, a group's G samples contiguous (as in `Rollout.samples`).
    Returns:
        float64 [B].
    Raises:
        ValueError when a sample is not a string (images, latents: give the policy a `diversity(rollout, G)`).
    """
    if len(samples) % group_size:
        raise ValueError(f"{len(samples)} samples is not a whole number of groups of {group_size}")
    out = []
    for b in range(len(samples) // group_size):
        group = samples[b * group_size : (b + 1) * group_size]
        if not all(isinstance(x, str) for x in group):
            kind = type(next(x for x in group if not isinstance(x, str))).__name__
            raise ValueError(f"distinct-1 diversity needs text samples, got {kind}")
        tokens = [t for x in group for t in x.split()]
        out.append(len(set(tokens)) / len(tokens) if tokens else 0.0)
    return torch.tensor(out, dtype=torch.float64)  # [B]


# prompt samplers live in mmgrpo/samplers.py; re-exported here so `mmgrpo.sampling` stays the one entry point
from mmgrpo.samplers import (
    SAMPLERS,
    PromptSampler,
    UniformSampler,
    VadeSampler,
    VasSampler,
    make_sampler,
    names,
)

__all__ = [
    "SAMPLERS",
    "PromptSampler",
    "UniformSampler",
    "VadeSampler",
    "VasSampler",
    "distinct_1",
    "group_keep_mask",
    "make_sampler",
    "names",
    "zero_std_fraction",
]
