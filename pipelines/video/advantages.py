"""Video-method maths on [B, G] tensors: TempSamp-R1's soft advantage, a bonus added after normalisation (so T-GRPO's
temporal bonus survives std normalisation), and T-GRPO's two bonuses. Registered in mmgrpo's ADVANTAGES on import.

Pure functions: no model, no reward calls. The rewards that produce the bonus columns live in pipelines/video/rewards.py.
"""

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from mmgrpo.advantages import ADVANTAGES, _check_norm, _check_number, _check_rewards, _flat, _normalise, _out


def _weights(w: Sequence[float] | Tensor | None, r: int, dtype: torch.dtype) -> Tensor:
    out = torch.ones(r, dtype=dtype) if w is None else torch.as_tensor(w, dtype=dtype).cpu()
    if out.shape != (r,) or not torch.isfinite(out).all():
        raise ValueError(f"weights {out.tolist()} must be R={r} finite numbers, one per reward column")
    return out


def _column(arg: str, c: int, r: int) -> int:
    if isinstance(c, bool) or not isinstance(c, int) or not -r <= c < r:
        raise ValueError(f"{arg}={c!r} is not a reward column of R={r} (use 0..{r - 1} or negative from the end)")
    return c % r


def soft_shaping(iou: Tensor, *, threshold: float = 0.8, alpha: float = 1.0, top_scale: float = 0.01) -> Tensor:
    """TempSamp-R1's asymmetric reward transform (arXiv:2509.18056), elementwise.

    r' = th + top_scale * log(1 + r - th) if r >= th, else th - (exp(alpha * (th - r)) - 1) / (exp(alpha) - 1):
    above the threshold rewards are compressed (the ground truth cannot dominate the group), below it they are spread.
    """
    above = threshold + top_scale * torch.log1p((iou - threshold).clamp(min=0))
    below = threshold - torch.expm1(alpha * (threshold - iou).clamp(min=0)) / math.expm1(alpha)
    return torch.where(iou >= threshold, above, below)


@ADVANTAGES.register("tempsamp", input="multi")
def tempsamp(
    rewards: Tensor,
    *,
    weights: Sequence[float] | Tensor | None = None,
    column: int = 0,
    shaping: bool = True,
    threshold: float = 0.8,
    alpha: float = 1.0,
    top_scale: float = 0.01,
    baseline: Literal["group", "on_policy"] = "group",
    gt_slot: int = -1,
    std: Literal["group", "none"] = "group",
    eps: float = 1e-6,
    ddof: int = 1,
) -> Tensor:
    """TempSamp-R1 soft advantage: shape the IoU column asymmetrically, weight-sum the columns, normalise per group.

    TempSamp-R1 arXiv:2509.18056 (mixed-policy groups: G - 1 sampled + 1 ground truth in slot `gt_slot`).
    A_bg = (s_bg - m_b) / (std_g(s_b) + eps), s = sum_k w_k r'_k with r'_column = soft_shaping(r_column); m_b = the
    mean of the whole group ("group", the paper) or of its on-policy members only ("on_policy": the ground truth's
    high reward no longer drags the baseline up, so fewer sampled answers flip to negative). Flat groups give 0.

    Args:
        rewards: [B, G, R] per-reward scores; column `column` is the raw temporal IoU in [0, 1].
        weights: R weights (the trainer passes the reward weights).  column: the IoU column.
        shaping: False when the reward already shaped it (temporal_iou with shaping="tempsamp").
        threshold, alpha, top_scale: the transform's th, curvature below th, and log scale above th (paper: 0.01).
        baseline: "group" or "on_policy" (needs `gt_slot`, the ground-truth member of every group).
        std: "group" divides by the whole group's std, "none" does not.  eps, ddof: as in `grpo`.
    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards, input="multi")
    _check_norm(std, eps, ddof, stds=("group", "none"))
    if baseline not in ("group", "on_policy"):
        raise ValueError(f"baseline={baseline!r} must be 'group' (TempSamp-R1) or 'on_policy'")
    _B, G, R = r.shape
    col = _column("column", column, R)
    _check_number("alpha", alpha, low=1e-12)
    if shaping:
        r = r.clone()
        r[..., col] = soft_shaping(r[..., col], threshold=threshold, alpha=alpha, top_scale=top_scale)
    s = (r * _weights(weights, R, r.dtype).to(r.device)).sum(-1)  # [B, G]
    if G == 1:
        return _out(torch.zeros_like(s))
    if baseline == "group":
        return _out(_normalise(s, std=std, eps=eps, ddof=ddof))
    slot = _column("gt_slot", gt_slot, G)
    on = torch.ones(G, dtype=torch.bool, device=s.device)
    on[slot] = False
    mean = s[:, on].mean(-1, keepdim=True)  # [B, 1] on-policy baseline
    scale = s.std(-1, correction=ddof, keepdim=True) + eps if std == "group" else torch.ones_like(mean)  # [B, 1]
    return _out(torch.where(_flat(s), 0.0, (s - mean) / torch.where(_flat(s), 1.0, scale)))


@ADVANTAGES.register("grpo_bonus", input="multi")
def grpo_bonus(
    rewards: Tensor,
    *,
    weights: Sequence[float] | Tensor | None = None,
    bonus_columns: Sequence[int] = (-1,),
    center_bonus: bool = True,
    std: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-6,
    ddof: int = 1,
) -> Tensor:
    """GRPO on the task rewards, plus bonus columns added AFTER the normalisation, so no std can cancel them.

    Video-R1 (T-GRPO, arXiv:2503.21776) adds its temporal bonus before normalising; with binary accuracy that bonus
    only rescales the group and the advantages come out unchanged. Here:
    A_bg = grpo(sum_{k not in S} w_k r_bgk) + sum_{k in S} w_k (r_bgk - c * mean_g r_bgk), c = 1 if center_bonus.
    Centred, every group stays zero-mean and a flat group stays 0; with binary accuracy the bonus then scales the
    advantages of the groups that earned it by (1 + w * alpha * std) instead of vanishing.

    Args:
        rewards: [B, G, R] per-reward scores.  weights: R weights (the trainer passes the reward weights).
        bonus_columns: the columns added after normalisation (default: the last reward listed).
        center_bonus: subtract each bonus column's group mean.  std, eps, ddof: the normalisation, as in `grpo`.
    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards, input="multi")
    _check_norm(std, eps, ddof)
    _B, G, R = r.shape
    cols = sorted({_column("bonus_columns", c, R) for c in bonus_columns})
    if len(cols) == R:
        raise ValueError(
            f"bonus_columns {list(bonus_columns)} cover all R={R} rewards; leave at least one task reward to normalise"
        )
    w = _weights(weights, R, r.dtype).to(r.device)
    is_bonus = torch.zeros(R, dtype=torch.bool, device=r.device)
    is_bonus[cols] = True
    task = (r * torch.where(is_bonus, 0.0, w)).sum(-1)  # [B, G]
    bonus = (r * torch.where(is_bonus, w, 0.0)).sum(-1)  # [B, G]
    if G == 1:
        return _out(torch.zeros_like(task))
    if center_bonus:
        bonus = bonus - bonus.mean(-1, keepdim=True)  # [B, G]
    return _out(_normalise(task, std=std, eps=eps, ddof=ddof) + bonus)


def temporal_gate_bonus(
    acc: Tensor, shuffled_acc: Tensor, *, mu: float = 0.8, alpha: float = 0.3, min_accuracy: float = 0.1
) -> Tensor:
    """T-GRPO's bonus (Video-R1, arXiv:2503.21776): reward correct answers when ordered frames beat shuffled ones.

    p = mean_g acc, p~ = mean over the shuffled-frame rollouts; bonus_i = alpha if p >= mu * p~ and acc_i > min_accuracy.

    Args:
        acc: [B, G] accuracy of the rollouts on ordered frames.  shuffled_acc: [B, S] of the rollouts on shuffled ones.
    Returns:
        [B, G] bonus (0 or alpha).
    """
    if acc.dim() != 2 or shuffled_acc.dim() != 2 or acc.shape[0] != shuffled_acc.shape[0]:
        raise ValueError(
            f"acc {tuple(acc.shape)} and shuffled_acc {tuple(shuffled_acc.shape)} must be [B, G] and "
            f"[B, S] with the same B"
        )
    gate = acc.mean(1, keepdim=True) >= mu * shuffled_acc.mean(1, keepdim=True)  # [B, 1]
    return torch.where(gate & (acc > min_accuracy), alpha, 0.0).to(acc.dtype)  # [B, G]


def logp_gap_bonus(
    acc: Tensor, gap: Tensor, *, alpha: float = 0.3, scale: float = 1.0, min_accuracy: float = 0.1
) -> Tensor:
    """The generation-free temporal bonus: correct answers that ordered frames make more likely than shuffled ones.

    No paper: a cheap variant of T-GRPO (arXiv:2503.21776) reusing the rollout's completions.
    bonus_i = alpha * [acc_i > min_accuracy] * clip(gap_i / scale, 0, 1), gap_i = mean over the answer tokens of
    log pi(y_t | ordered frames) - log pi(y_t | shuffled frames).

    Args:
        acc: [B, G] accuracy.  gap: [B, G] mean per-token log-prob gap (nats).
    Returns:
        [B, G] bonus in [0, alpha].
    """
    if acc.shape != gap.shape:
        raise ValueError(f"acc {tuple(acc.shape)} != gap {tuple(gap.shape)}")
    if scale <= 0:
        raise ValueError(f"gap_scale={scale} must be > 0 (nats of log-prob gap that earn the full bonus)")
    return alpha * (acc > min_accuracy).to(gap.dtype) * (gap / scale).clamp(0.0, 1.0)  # [B, G]
