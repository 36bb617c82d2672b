"""Per-micro-batch metric accumulation of the update and the per-decision ratio monitor (GRPO-Guard).

Small host-free helpers of mmgrpo/trainer.py; no loss maths here (mmgrpo/losses.py).
"""

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class _Acc:
    """Running, element-weighted means of per-micro-batch metrics, kept as float64 device tensors: the host reads
    them once, in means(), instead of once per metric and micro-batch (each read waits for the GPU to drain).

    A value may be a pair (value, present): its weight is then weight * present (per-step metrics of a K chunk)."""

    sums: dict[str, Tensor] = field(default_factory=dict)
    weights: dict[str, Tensor] = field(default_factory=dict)

    def add(self, metrics: dict[str, Any], weight: Tensor | float) -> None:
        for k, v in metrics.items():
            v, on = v if isinstance(v, tuple) else (v, True)
            v = torch.as_tensor(v).detach().double()
            w = torch.as_tensor(weight).to(v.device, non_blocking=True).double() * on
            # weight 0 (padding pieces, fully masked micro-batches) must not let 0 * NaN poison the sum
            self.sums[k] = self.sums.get(k, 0.0) + torch.where(w > 0, v * w, 0.0)
            self.weights[k] = self.weights.get(k, 0.0) + w

    def means(self) -> dict[str, float]:
        if not self.sums:
            return {}
        keys = list(self.sums)
        dev = self.sums[keys[0]].device
        pairs = torch.stack([torch.stack([self.sums[k].to(dev), self.weights[k].to(dev)]) for k in keys]).tolist()
        return {k: s / w for k, (s, w) in zip(keys, pairs) if w > 0}


def _per_element(
    logp: Tensor, old: Tensor, m: Tensor, k0: int, clip_low: float = 0.2, clip_high: float = 0.2
) -> dict[str, tuple[Tensor, Tensor]]:
    """Per decision index (e.g. denoising step), for pipelines that ask: the raw ratio's mean, population std and
    the fractions above 1 + clip_high and below 1 - clip_low (the over-optimisation monitor of GRPO-Guard).

    Each value comes with a flag, "index j has an unmasked element here", which weights it in the running mean
    (testing the flag on the host would wait for the device once per index)."""
    ratio = torch.exp((logp - old).clamp(-20, 20))  # [n, k]
    cnt = m.sum(0).clamp(min=1)  # [k]
    mean = torch.where(m, ratio, 0.0).sum(0) / cnt  # [k]
    std = (torch.where(m, (ratio - mean) ** 2, 0.0).sum(0) / cnt).sqrt()  # [k]
    upper = (m & (ratio > 1 + clip_high)).to(ratio.dtype).sum(0) / cnt  # [k]
    lower = (m & (ratio < 1 - clip_low)).to(ratio.dtype).sum(0) / cnt  # [k]
    present = m.any(0)  # [k]
    out = {}
    for j in range(mean.numel()):
        k, on = k0 + j, present[j]
        out.update(
            {
                f"ratio/k{k}": (mean[j], on),
                f"ratio/k{k}/std": (std[j], on),
                f"ratio/k{k}/clip_upper": (upper[j], on),
                f"ratio/k{k}/clip_lower": (lower[j], on),
            }
        )
    return out
