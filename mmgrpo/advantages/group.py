"""Estimators on one scalar reward per sample [B, G]: GRPO, RLOO, MC-GRPO and pass@k."""

from typing import Literal

import torch
from torch import Tensor

from mmgrpo.advantages._common import (
    ADVANTAGES,
    _check_choice,
    _check_norm,
    _check_rewards,
    _flat,
    _median,
    _normalise,
    _out,
    _pivot,
)


@ADVANTAGES.register("grpo", input="scalar")
def grpo(
    rewards: Tensor,
    *,
    std: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-6,
    ddof: int = 1,
    singleton: Literal["zero", "raw"] = "zero",
) -> Tensor:
    """Group-relative advantage: reward minus its group mean, divided by a std (or not: Dr. GRPO).

    GRPO arXiv:2402.03300; std="none" is Dr. GRPO arXiv:2503.20783.
    A_bg = (r_bg - mean_g(r_b)) / (S + eps), S = std of group b ("group"), of all B*G rewards ("batch"), or 1 with
    eps=0 ("none"). All-equal groups give exactly 0.

    Args:
        rewards: [B, G] scalar rewards, any real dtype.
        std: "group" (TRL, verl, DanceGRPO), "batch" (Flow-GRPO `global_std`, TRL `scale_rewards="batch"`), "none".
        eps: added to S: verl/EasyR1 1e-6 (default), TRL/Flow-GRPO 1e-4, DanceGRPO/Pref-GRPO 1e-8, OpenRLHF 1e-9.
        ddof: 1 = unbiased (torch.std default; TRL, verl, EasyR1, DanceGRPO, Pref-GRPO: the majority, hence the
            default); 0 = population (np.std; Flow-GRPO).
        singleton: G = 1 has no baseline: "zero" (TRL) gives 0, "raw" (verl: mean 0, std 1) the raw reward.

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards)
    _check_norm(std, eps, ddof)
    _check_choice("singleton", singleton, ("zero", "raw"))
    if r.shape[1] == 1:
        return _out(r if singleton == "raw" else torch.zeros_like(r))
    return _out(_normalise(r, std=std, eps=eps, ddof=ddof))


@ADVANTAGES.register("rloo", input="scalar")
def rloo(rewards: Tensor) -> Tensor:
    """REINFORCE leave-one-out: reward minus the mean of the other G - 1 rewards of its group.

    RLOO arXiv:2402.14740.
    A_bi = r_bi - sum_{j != i} r_bj / (G - 1) = G / (G - 1) * (r_bi - mean_g(r_b)); G = 1 gives 0.

    Args:
        rewards: [B, G] scalar rewards.

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards)
    G = r.shape[1]
    if G == 1:
        return _out(torch.zeros_like(r))
    adv = (r - r.mean(-1, keepdim=True)) * (G / (G - 1))  # [B, G]
    return _out(torch.where(_flat(r), 0.0, adv))


def _mc_grpo_mask(rewards: Tensor, *, exclude_pivot: bool = True, **_: object) -> Tensor:
    r = _check_rewards(rewards)
    keep = torch.ones_like(r, dtype=torch.bool)  # [B, G]
    if exclude_pivot and r.shape[1] % 2:
        keep &= ~_pivot(r)
    return keep


@ADVANTAGES.register("mc_grpo", input="scalar", mask=_mc_grpo_mask)
def mc_grpo(
    rewards: Tensor,
    *,
    scale: Literal["mad", "std", "none"] = "mad",
    eps: float = 1e-3,
    ddof: int = 1,
    exclude_pivot: bool = True,
    rescale_nonzero: bool = False,
) -> Tensor:
    """Median-centred GRPO: reward minus its group median, scaled by the MAD; the median sample (pivot) gets 0.

    MC-GRPO arXiv:2601.22582 (roll out G + 1 so the group is odd; the pivot is left out of the loss).
    A_bg = (r_bg - med_b) / (S_b + eps), S_b = median_g |r_bg - med_b| ("mad"), group std ("std") or 1 with eps=0.

    Defaults follow the authors' code (MAD + 1e-3); their trainer also multiplies each group's non-zero advantages
    by G / (their count) (`rescale_nonzero=True`). Caution: the MAD is 0 when over half a group ties (common with
    0/1 rewards), giving (r - med) / eps = +-1000; Adam absorbs that scale, a KL term does not: prefer scale="std" or
    "none" for binary rewards. Even G: median = mean of the two middle values, no pivot. Odd G: the pivot is the
    lowest-index sample equal to the median (exactly one); `loss_mask` drops it when `exclude_pivot`.

    Args:
        rewards: [B, G] scalar rewards (G odd in the paper's setting).
        scale: "mad" (paper), "std" (group std with `ddof`), "none" (median-centred only).
        eps: added to S; must be > 0 with "mad" (the MAD is often 0).
        ddof: for scale="std" only.
        exclude_pivot: read by `loss_mask` only.
        rescale_nonzero: multiply the group's non-zero advantages (samples not tied with the median) by G / their
            count, as the authors' trainer does; all-equal groups stay 0.

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards)
    _check_choice("scale", scale, ("mad", "std", "none"))
    _check_norm("group", eps, ddof)
    if scale == "mad" and eps <= 0:
        raise ValueError(f"eps={eps!r} must be > 0 with scale='mad': the MAD is 0 when over half a group ties")
    for arg, value in (("exclude_pivot", exclude_pivot), ("rescale_nonzero", rescale_nonzero)):
        if not isinstance(value, bool):
            raise ValueError(f"{arg}={value!r} must be True or False")
    if r.shape[1] == 1:
        return _out(torch.zeros_like(r))
    med = _median(r)  # [B, 1]
    centred = r - med  # [B, G]; exactly 0 on samples equal to the median
    if rescale_nonzero:
        nonzero = (centred != 0).sum(-1, keepdim=True)  # [B, 1]
        centred = centred * (r.shape[1] / nonzero.clamp_min(1))  # [B, G]
    if scale == "none":
        return _out(centred)
    S = _median((r - med).abs()) if scale == "mad" else r.std(-1, correction=ddof, keepdim=True)  # [B, 1]
    denom = torch.where(_flat(r), 1.0, S + eps)  # [B, 1]
    return _out(centred / denom)


@ADVANTAGES.register("passk", input="scalar")
def passk(rewards: Tensor, *, std: Literal["group", "none"] = "group", eps: float = 1e-6, ddof: int = 1) -> Tensor:
    """Pass@k advantage: only the best sample of a group moves, by its margin over the runner-up.

    Pass@k training as in verl `grpo_passk`, which cites arXiv:2503.19595.
    A_b,best = (r_(1) - r_(2)) / (std_g(r_b) + eps), every other sample 0 (r_(1) >= r_(2): the top two rewards).
    Ties for the maximum give a zero margin; the best index is the lowest one. Not zero-mean by design.

    Args:
        rewards: [B, G] scalar rewards.
        std: "group" divides the margin by the group std (verl default), "none" leaves it raw.
        eps, ddof: added to the std; its correction (1 = unbiased, as verl).

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards)
    _check_norm(std, eps, ddof, stds=("group", "none"))
    if r.shape[1] == 1:
        return _out(torch.zeros_like(r))
    top2 = r.topk(2, dim=-1).values  # [B, 2]
    margin = top2[:, :1] - top2[:, 1:]  # [B, 1]
    if std == "group":
        denom = r.std(-1, correction=ddof, keepdim=True) + eps  # [B, 1]
        margin = torch.where(margin == 0, 0.0, margin / torch.where(margin == 0, 1.0, denom))
    best = r.argmax(-1, keepdim=True)  # [B, 1]
    return _out(torch.zeros_like(r).scatter_(-1, best, margin))
