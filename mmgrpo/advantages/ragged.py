"""Ragged groups: rewards [B, G] (or [B, G, R]) padded with NaN at the end of each row, one group size per prompt.

Every estimator is a per-group function of a dense [B, G] block, so groups of equal size are stacked into one block
and the estimator runs on it unchanged: on a batch with no padding, `by_size` makes the one call `compute` would.
"""

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from mmgrpo.advantages._common import ADVANTAGES


def group_sizes(rewards: Tensor) -> Tensor:
    """[B] number of real samples per group: the leading non-NaN entries (of the first column for [B, G, R]).

    Raises ValueError when a NaN sits before a real sample (padding must be at the end of the row)."""
    real = ~torch.isnan(rewards if rewards.dim() == 2 else rewards[..., 0])  # [B, G]
    sizes = real.sum(-1)  # [B]
    lead = torch.arange(real.shape[1], device=real.device) < sizes[:, None]  # [B, G]
    if not torch.equal(real, lead):
        rows = (real != lead).any(-1).nonzero().flatten().tolist()
        raise ValueError(
            f"ragged rewards must be padded with NaN at the end of each group; groups {rows[:5]} have a NaN before a "
            f"real reward (a reward that returned NaN is a scoring failure, not padding)"
        )
    return sizes


def batch_coupled(name: str, kw: dict) -> bool:
    """Whether estimator `name` with kwargs `kw` uses a statistic over the whole batch (std="batch", GDPO's batch
    whitening, or such a base under asymmetric): per-size blocks would each get their own, so ragged groups refuse."""
    params = inspect.signature(ADVANTAGES.get(name)).parameters

    def value(key: str):
        return kw.get(key, params[key].default if key in params else None)

    if value("std") == "batch" or value("batch_norm") is True:
        return True
    base = value("base")
    return isinstance(base, str) and base in ADVANTAGES and batch_coupled(base, value("base_kwargs") or {})


def by_size(rewards: Tensor, fn: Callable[[Tensor], Tensor], *, fill: float | bool = 0.0) -> Tensor:
    """fn applied to each block of equal-size groups: [B_s, s(, R)] -> [B_s, s], scattered back into [B, G] with
    `fill` on the padding. One block (no padding) is exactly fn(rewards)."""
    sizes = group_sizes(rewards)  # [B]
    b, g = rewards.shape[:2]
    if bool((sizes == g).all()):
        return fn(rewards)
    if bool((sizes == 0).any()):
        raise ValueError(f"groups {(sizes == 0).nonzero().flatten().tolist()[:5]} have no sample; drop them first")
    out = None
    for s in sorted(set(sizes.tolist())):
        rows = (sizes == s).nonzero().flatten()  # [B_s]
        block = fn(rewards[rows, :s])  # [B_s, s]
        if out is None:
            out = torch.full((b, g), fill, dtype=block.dtype, device=block.device)  # [B, G]
        out[rows, :s] = block
    return out
