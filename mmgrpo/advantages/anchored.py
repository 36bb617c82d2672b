"""Value-anchored advantages (VGPO): a relative value gain plus an absolute anchor that survives flat groups.

Pure tensor maths: `value_anchored` (any value estimates) and the registered group estimator `vgpo`; no trainer state.
"""

import torch
from torch import Tensor

from mmgrpo.advantages._common import ADVANTAGES, _check_number, _check_rewards, _out


def _check_anchor(anchor: float, scale: float, alpha: float | None) -> None:
    _check_number("anchor", anchor, low=-float("inf"))
    if _check_number("scale", scale) == 0 and alpha is None:
        raise ValueError(
            "scale=0 with alpha=None leaves the absolute weight s^2 / (sigma^2 + s^2) undefined on flat "
            "groups; give scale > 0 in reward units (e.g. 0.1 for a [0, 1] reward) or a fixed alpha"
        )
    if alpha is not None:
        _check_number("alpha", alpha, high=1.0)


def value_anchored(
    q: Tensor, v: Tensor, spread: Tensor, *, anchor: float = 0.0, scale: float = 0.1, alpha: float | None = None
) -> Tensor:
    """VGPO's value-anchored advantage of a decision with value after it q and before it v, in a group of spread sigma.

    Paper: VGPO arXiv:2512.12387 (the abstract's "group normalization ... enhanced by absolute values"; the formula is
    our reading, the abstract gives none). Formula: A = (q - (1 - a_w) v - a_w anchor) / sqrt(sigma^2 + s^2) with the
    adaptive weight a_w = s^2 / (sigma^2 + s^2) (or a fixed alpha). A diverse group (sigma >> s) gives GRPO's
    (q - v) / sigma; a flat group (sigma = 0, every q = v) gives (v - anchor) / s instead of 0, so a group that all
    scores above the anchor is still reinforced and one below it still pushed away: the signal does not fade as
    reward diversity is used up. The relative part (q - v) sums over a path to r - V_0 (a telescoping value gain).

    Args:
        q, v: value estimates after / before each decision, broadcastable to one shape (e.g. [B, G]).
        spread: the group's reward std sigma >= 0, broadcastable to q (e.g. [B, 1]).
        anchor: the absolute reference reward (e.g. the base model's mean reward, or a target).
        scale: s > 0, the absolute scale in reward units; s = 0 needs a fixed alpha (then plain (q - v) / sigma).
        alpha: None for the adaptive weight, else a fixed weight in [0, 1].

    Returns:
        float64 advantages with the broadcast shape of q, v and spread.
    """
    _check_anchor(anchor, scale, alpha)
    var = spread.double() ** 2  # [B, 1]
    denom = torch.sqrt(var + scale**2)
    if alpha is None:
        weight = scale**2 / denom**2
    else:
        weight = torch.full_like(var, float(alpha))
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    adv = (q.double() - (1 - weight) * v.double() - weight * anchor) / safe
    return torch.where(denom > 0, adv, torch.zeros_like(adv))  # s = 0 and a flat group: nothing to say


@ADVANTAGES.register("vgpo", input="scalar")
def vgpo(
    rewards: Tensor, *, anchor: float = 0.0, scale: float = 0.1, alpha: float | None = None, ddof: int = 1
) -> Tensor:
    """VGPO group estimator: `value_anchored` with q = r, v = the group mean, sigma = the group std.

    Paper: VGPO arXiv:2512.12387. Formula: A = (r - (1 - a_w) mean_g - a_w anchor) / sqrt(std_g^2 + s^2),
    a_w = s^2 / (std_g^2 + s^2). The per-denoising-step values of the flow pipeline (tree rollouts,
    pipelines/flow/vgpo.py) use the same function with subtree values. G = 1 or a flat group: (r - anchor) / s.

    Args:
        rewards: [B, G] scalar rewards.
        anchor, scale, alpha: see `value_anchored`.
        ddof: 1 (unbiased) or 0 for the group std.

    Returns:
        [B, G] float32 advantages; not zero-mean per group unless the group mean equals the anchor.
    """
    r = _check_rewards(rewards)
    if isinstance(ddof, bool) or ddof not in (0, 1):
        raise ValueError(f"ddof={ddof!r} must be 0 (population std) or 1 (unbiased)")
    std = r.std(-1, correction=ddof, keepdim=True) if r.shape[1] > ddof else torch.zeros_like(r[:, :1])  # [B, 1]
    std = torch.where(r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True), 0.0, std)  # flat: exactly 0
    return _out(value_anchored(r, r.mean(-1, keepdim=True), std, anchor=anchor, scale=scale, alpha=alpha))
