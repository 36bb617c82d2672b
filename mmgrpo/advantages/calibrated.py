"""Estimators that change the group statistics themselves: Gaussian G^2RPO (rank -> N(0, 1)), NGRPO (virtual best)."""

import torch
from torch import Tensor

from mmgrpo.advantages._common import ADVANTAGES, _check_norm, _check_number, _check_rewards, _flat, _out


@ADVANTAGES.register("gaussian", input="scalar")
def gaussian(rewards: Tensor) -> Tensor:
    """Gaussian G^2RPO: each group's rewards mapped onto the standard normal by 1-D optimal transport.

    OpenVLThinkerV2 arXiv:2604.08539 ("forcing the advantage distribution ... to converge to N(0, 1)"; not the flow
    models' Granular G^2RPO). The G rewards, as an empirical distribution of G equal masses, are moved onto the G
    quantile midpoints z_k = Phi^-1((k - 1/2) / G), k = 1..G, in sorted order: the monotone (optimal) transport.
    Tied rewards share their slots' barycentre: a sample with l rewards below it and e equal to it (itself
    included) gets A = mean(z_{l+1}, ..., z_{l+e}). So A depends on ranks only (outliers cannot stretch the
    scale), every group sums to exactly 0 (the z_k are symmetric), a flat group gives 0, and equal-size groups of
    any task share one advantage scale. Quantile midpoints and the barycentre for ties are our reading: the
    abstract names the distribution matching, not the discretisation.

    Args:
        rewards: [B, G] scalar rewards.

    Returns:
        [B, G] float32 advantages (0 for G = 1).
    """
    r = _check_rewards(rewards)
    g = r.shape[1]
    k = torch.arange(1, g + 1, dtype=r.dtype, device=r.device)  # [G]
    z = torch.special.ndtri((k - 0.5) / g)  # [G] quantile midpoints of N(0, 1), ascending
    cum = torch.cat([z.new_zeros(1), z.cumsum(0)])  # [G + 1], cum[m] = z_1 + ... + z_m
    below = (r[:, None, :] < r[:, :, None]).sum(-1)  # [B, G] rewards strictly below each sample
    equal = (r[:, None, :] == r[:, :, None]).sum(-1)  # [B, G] rewards tied with it, itself included
    adv = (cum[below + equal] - cum[below]) / equal.to(r.dtype)  # [B, G] barycentre of the occupied slots
    return _out(torch.where(_flat(r), 0.0, adv))


@ADVANTAGES.register("ngrpo", input="scalar", flat_below="max_reward")
def ngrpo(rewards: Tensor, *, max_reward: float = 1.0, eps: float = 1e-6, ddof: int = 1) -> Tensor:
    """NGRPO advantage calibration: group statistics taken with one virtual sample scoring the maximum reward.

    NGRPO arXiv:2509.18851 ("hypothesizes the existence of a virtual maximum-reward sample"). With
    r' = (r_b1, ..., r_bG, max_reward): A_bg = (r_bg - mean(r')) / (std(r', ddof) + eps). An all-wrong group
    (every r = 0 < max_reward) then gets negative advantages instead of 0, so failures still teach; a group that
    is all at max_reward stays flat and gets exactly 0. NGRPO's other half, asymmetric clipping, is algo.loss
    clipped with clip_high > clip_low. Registered with flat_below="max_reward": sample.filter_zero_std then drops
    only the groups all at max_reward.

    Args:
        rewards: [B, G] scalar rewards, none above max_reward.
        max_reward: the best reward the task can give (1 for 0/1 accuracy).
        eps, ddof: as in `grpo` (std over the G + 1 values).

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards)
    _check_norm("group", eps, ddof)
    top = _check_number("max_reward", max_reward, low=-float("inf"))
    if bool((r > top).any()):
        raise ValueError(
            f"rewards reach {r.max().item()}, above max_reward={top}: set max_reward to the task's "
            f"best possible reward"
        )
    ext = torch.cat([r, r.new_full((r.shape[0], 1), top)], dim=1)  # [B, G + 1]
    flat = _flat(ext)  # [B, 1] every sample already at max_reward
    centred = r - ext.mean(-1, keepdim=True)  # [B, G]
    scale = ext.std(-1, correction=ddof, keepdim=True) + eps  # [B, 1]
    return _out(torch.where(flat, 0.0, centred / torch.where(flat, 1.0, scale)))
