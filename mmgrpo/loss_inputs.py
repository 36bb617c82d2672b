"""What every per-element policy loss shares: [N, K] input checks, the float dtype, masked means, ratio metrics.

Used by mmgrpo/losses.py, reinforce.py and preference.py; no registry and no loss here.
"""

import torch
from torch import Tensor

# exp(20) ~ 4.9e8: far past any clip range, and exp() of the clamped value cannot overflow (verl clamps the same)
_MAX_LOG_RATIO = 20.0


def _float_dtype(t: Tensor) -> torch.dtype:
    # upcast half precision: bf16 keeps ~3 significant digits, too few for ratios near 1 +- 0.2
    return torch.promote_types(t.dtype, torch.float32)


def _check_inputs(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Validate shapes; return the bool mask [N, K] and adv as [N, K] with masked elements zeroed (no NaN leaks)."""
    if logp.dim() != 2:
        raise ValueError(
            f"logp must be [N, K] (sequences x tokens or denoising steps), got shape "
            f"{tuple(logp.shape)}; for one element per sample pass logp.unsqueeze(-1)"
        )
    if old_logp.shape != logp.shape:
        raise ValueError(
            f"old_logp {tuple(old_logp.shape)} != logp {tuple(logp.shape)}: both are per-element "
            f"log-probs of the same rollout; recompute old_logp over the same [N, K] elements"
        )
    if mask.shape != logp.shape:
        raise ValueError(
            f"mask {tuple(mask.shape)} != logp {tuple(logp.shape)}: the mask marks which of logp's "
            f"elements count; build it with logp's [N, K] shape"
        )
    n, k = logp.shape
    if adv.shape == (n,):
        adv = adv[:, None].expand(n, k)  # [N, K]
    elif adv.shape != (n, k):
        raise ValueError(
            f"adv {tuple(adv.shape)} must be [N]=({n},) or [N, K]=({n}, {k}) to match logp "
            f"{tuple(logp.shape)}; pass one advantage per sequence or one per element"
        )
    valid = mask.bool()  # [N, K]
    dtype = _float_dtype(logp)
    return valid, torch.where(valid, adv.to(dtype), 0.0)  # [N, K]


def _masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, x, 0.0).sum() / valid.sum().clamp_min(1)


@torch.no_grad()
def _ratio_metrics(ratio: Tensor, log_ratio: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """ratio mean and population std over unmasked elements, and k3 KL(pi_old || pi_theta) from the token log-ratio."""
    mean = _masked_mean(ratio, valid)
    lr = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [N, K]
    return {
        "ratio/mean": mean,
        "ratio/std": _masked_mean((ratio - mean) ** 2, valid).sqrt(),
        "kl/old_approx": _masked_mean(lr.exp() - 1 - lr, valid),
    }
