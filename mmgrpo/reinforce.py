"""REINFORCE-style policy losses with clipped, detached importance weights (no trust-region min): DISPO.

Importing this module registers "dispo" in mmgrpo.losses.POLICY_LOSSES (mmgrpo/__init__.py imports it).
"""

import torch
from torch import Tensor

from mmgrpo.loss_inputs import _MAX_LOG_RATIO, _check_inputs, _float_dtype, _masked_mean, _ratio_metrics
from mmgrpo.losses import POLICY_LOSSES


@POLICY_LOSSES.register("dispo", paper="arXiv:2602.00983")
def dispo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    correct_low: float = 0.2,
    correct_high: float = 0.28,
    incorrect_low: float = 0.2,
    incorrect_high: float = 0.28,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DISPO: REINFORCE with the importance weight clipped by four bounds, up/down for correct and incorrect.

    Paper: DISPO arXiv:2602.00983 (CISPO-style weight, decoupled bounds). Formula per element:
    loss = -sg(w) * A * logp, w = clip(r, 1 - lo, 1 + hi), r = exp(logp - old_logp), with (lo, hi) =
    (correct_low, correct_high) where A > 0 and (incorrect_low, incorrect_high) where A < 0. Every element keeps
    a gradient, -w * A (the CISPO form, as verl's cispo loss writes it: -A * sg(clip(r)) * logp); only its weight
    is bounded. "Correct" is read from the advantage sign (above the group baseline), which is what the loss sees.
    Defaults are DAPO's (0.2, 0.28) for both; the paper tunes the four separately: a tight incorrect_high gave
    repetitive outputs and a tight incorrect_low vanishing lengths in its ablations.

    Args:
        logp, old_logp: [N, K]; adv: [N] or [N, K]; mask: [N, K].
        correct_low, correct_high, incorrect_low, incorrect_high: >= 0 (low <= 1); the weight range of each side.

    Returns:
        loss [N, K] (0 on masked elements) and detached metrics: ratio/mean, ratio/std, kl/old_approx, and
        clip/{correct,incorrect}_{upper,lower}_frac (share of unmasked elements whose weight was clipped there).
    """
    valid, adv = _check_inputs(logp, old_logp, adv, mask)
    bounds = {
        "correct_low": correct_low,
        "correct_high": correct_high,
        "incorrect_low": incorrect_low,
        "incorrect_high": incorrect_high,
    }
    for name, value in bounds.items():
        if not 0 <= value <= (1 if name.endswith("low") else float("inf")):
            raise ValueError(
                f"{name}={value} must be >= 0{' and <= 1' if name.endswith('low') else ''}: the weight "
                f"is clipped to [1 - low, 1 + high]; e.g. 0.2"
            )
    dtype = _float_dtype(logp)
    log_ratio = torch.where(valid, logp.to(dtype) - old_logp.to(dtype), 0.0)  # [N, K]
    ratio = log_ratio.detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()  # [N, K]
    pos = adv > 0  # [N, K]
    lo = torch.where(pos, 1 - correct_low, 1 - incorrect_low)  # [N, K]
    hi = torch.where(pos, 1 + correct_high, 1 + incorrect_high)  # [N, K]
    weight = torch.minimum(torch.maximum(ratio, lo), hi)  # [N, K], detached
    loss = torch.where(valid, -weight * adv * torch.where(valid, logp.to(dtype), 0.0), 0.0)  # [N, K]
    with torch.no_grad():
        metrics = _ratio_metrics(ratio, log_ratio.detach(), valid)
        neg = adv < 0
        for side, on in (("correct", pos), ("incorrect", neg)):
            metrics[f"clip/{side}_upper_frac"] = _masked_mean((on & (ratio > hi)).to(dtype), valid)
            metrics[f"clip/{side}_lower_frac"] = _masked_mean((on & (ratio < lo)).to(dtype), valid)
    return loss, metrics
