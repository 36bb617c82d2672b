"""Constrained group advantages (Faithful GRPO): the task reward plus Lagrange-weighted constraint scores, each
normalised within its group, with the multipliers moved by dual ascent between steps.

The multipliers are the estimator's keyword `multipliers`; its `update` hook returns their next value, which the
trainer feeds back in and saves in every checkpoint (mmgrpo/credit.py, mmgrpo/setup.py). No trainer state here.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from mmgrpo.advantages._common import ADVANTAGES, _check_norm, _check_number, _check_rewards, _normalise, _out


def _parts(r: Tensor, weights, constraints, thresholds, multipliers) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(task [B, G] = weighted sum of the non-constraint columns, constraint scores [B, G, C], thresholds [C],
    multipliers [C]) after checking the column indices and lengths."""
    R = r.shape[-1]
    cols = [int(c) for c in constraints]
    if not cols or len(set(cols)) != len(cols) or any(not -R <= c < R for c in cols):
        raise ValueError(
            f"constraints={list(constraints)} must be distinct reward column indices in [0, {R}) (the rewards' order "
            f"in the config); e.g. constraints=[1] for the second reward"
        )
    cols = [c % R for c in cols]
    task_cols = [c for c in range(R) if c not in cols]
    if not task_cols:
        raise ValueError(f"constraints={cols} leave no task reward among the {R} columns; keep at least one")
    lam = torch.zeros(len(cols), dtype=r.dtype) if multipliers is None else torch.as_tensor(multipliers, dtype=r.dtype)
    tau = torch.as_tensor(thresholds, dtype=r.dtype)
    if tau.shape != (len(cols),) or lam.shape != (len(cols),) or bool((lam < 0).any()):
        raise ValueError(
            f"thresholds {tau.tolist()} and multipliers {lam.tolist()} need one value per constraint column {cols} "
            f"(multipliers >= 0)"
        )
    w = torch.ones(R, dtype=r.dtype) if weights is None else torch.as_tensor(weights, dtype=r.dtype)
    task = (r[..., task_cols] * w[task_cols].to(r.device)).sum(-1)  # [B, G]
    return task, r[..., cols], tau, lam


@torch.no_grad()
def _dual_ascent(
    rewards: Tensor,
    *,
    constraints: Sequence[int] = (1,),
    thresholds: Sequence[float] = (0.9,),
    multipliers: Sequence[float] | None = None,
    dual_lr: float = 0.1,
    **_: object,
) -> dict[str, list[float]]:
    """lam_k <- max(0, lam_k + dual_lr * (tau_k - mean over the batch's real samples of c_k)): a violated batch-level
    constraint (mean score below its threshold) raises its weight, a satisfied one lowers it towards 0."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    _, cons, tau, lam = _parts(r.nan_to_num(0.0), None, constraints, thresholds, multipliers)
    real = ~torch.isnan(r[..., 0])  # [B, G]: NaN pads ragged groups
    mean = (cons * real[..., None]).sum((0, 1)) / real.sum().clamp_min(1)  # [C]
    return {"multipliers": (lam + dual_lr * (tau - mean)).clamp_min(0.0).tolist()}


@ADVANTAGES.register("faithful", input="multi", paper="arXiv:2604.08476", update=_dual_ascent)
def faithful(
    rewards: Tensor,
    *,
    weights: Sequence[float] | Tensor | None = None,
    constraints: Sequence[int] = (1,),
    thresholds: Sequence[float] = (0.9,),
    multipliers: Sequence[float] | None = None,
    dual_lr: float = 0.1,
    eps: float = 1e-6,
    ddof: int = 1,
    normalize: bool = True,
) -> Tensor:
    """Faithful GRPO: group-normalised task reward plus Lagrange-weighted group-normalised constraint scores.

    Paper: FGRPO arXiv:2604.08476 (consistency and grounding as constraints by Lagrangian dual ascent inside the
    group advantage). Formula: A = (z(task) + sum_k lam_k z(c_k)) / (1 + sum_k lam_k) (normalize=False drops the
    divisor), z = (x - mean_g) / (std_g + eps) per group (all-equal -> 0), task = sum of the weighted non-constraint
    reward columns, c_k the constraint columns (a judge's or a rule's score in [0, 1]); after each step
    lam_k <- max(0, lam_k + dual_lr (tau_k - mean_batch c_k)). The paper names the mechanism but this file's exact
    normalisation (per-column z-scores, the 1 + sum lam divisor keeping A's scale) is our reading of it.

    Args:
        rewards: [B, G, R] per-reward scores in the config's order.  weights: R weights (the task's mix; the trainer
            passes the rewards' weights).  constraints: column indices of the constraint scores.  thresholds: tau_k,
            the batch mean each constraint must reach.  multipliers: lam_k >= 0 (null: 0; the trainer feeds back
            the dual-ascent value).  dual_lr: the dual step size.  eps, ddof: of the group std.  normalize: divide
            by 1 + sum lam.

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards, input="multi")
    _check_norm("group", eps, ddof)
    _check_number("dual_lr", dual_lr)
    task, cons, _, lam = _parts(r, weights, constraints, thresholds, multipliers)
    B, G, C = cons.shape
    if G == 1:
        return _out(torch.zeros(B, G, dtype=r.dtype, device=r.device))
    z_task = _normalise(task, std="group", eps=eps, ddof=ddof)  # [B, G]
    z_cons = _normalise(cons.transpose(1, 2).reshape(B * C, G), std="group", eps=eps, ddof=ddof)  # [B*C, G]
    z_cons = z_cons.reshape(B, C, G).transpose(1, 2)  # [B, G, C]
    lam = lam.to(r.device)
    adv = z_task + (z_cons * lam).sum(-1)  # [B, G]
    return _out(adv / (1 + lam.sum()) if normalize else adv)
