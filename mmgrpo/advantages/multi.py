"""Estimators on several rewards [B, G, R] or pairwise preferences [B, G, G]: GDPO and Pref-GRPO's win rate."""

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from mmgrpo.advantages._common import (
    ADVANTAGES,
    _check_norm,
    _check_rewards,
    _normalise,
    _out,
    _whiten,
)


@ADVANTAGES.register("gdpo", input="multi")
def gdpo(
    rewards: Tensor,
    *,
    weights: Sequence[float] | Tensor | None = None,
    eps: float = 1e-6,
    ddof: int = 1,
    batch_norm: bool = True,
) -> Tensor:
    """GDPO decoupled multi-reward normalisation: z-score each reward within its group, weight-sum, z-score the batch.

    GDPO arXiv:2601.05242 (TRL `multi_objective_aggregation="normalize_then_sum"`, verl `gdpo`).
    A = whiten_batch(sum_k w_k * (r_k - mean_g(r_k)) / (std_g(r_k) + eps)); whiten_batch(x) = (x - mean) / (std + eps)
    over all B*G samples. A reward whose group is all equal contributes 0 for that group.

    Args:
        rewards: [B, G, R] rewards, one column per reward function.
        weights: R weights (sequence or 1-D tensor); default all 1 (plain sum, as the paper).
        eps, ddof: added to / correction of every std (both normalisations).
        batch_norm: apply the final batch whitening (the paper's step 3); False returns the weighted sum.

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards, input="multi")
    _check_norm("group", eps, ddof)
    if not isinstance(batch_norm, bool):
        raise ValueError(f"batch_norm={batch_norm!r} must be True or False")
    B, G, R = r.shape
    w = torch.ones(R, dtype=r.dtype) if weights is None else torch.as_tensor(weights, dtype=r.dtype).cpu()
    if w.shape != (R,) or not torch.isfinite(w).all():
        raise ValueError(f"weights {w.tolist()} must be R={R} finite numbers, one per reward column of {(B, G, R)}")
    if G == 1:
        return _out(torch.zeros(B, G, dtype=r.dtype, device=r.device))
    per_reward = r.transpose(1, 2).reshape(B * R, G)  # [B*R, G]: each (prompt, reward) pair is its own group
    z = _normalise(per_reward, std="group", eps=eps, ddof=ddof).reshape(B, R, G).transpose(1, 2)  # [B, G, R]
    combined = (z * w.to(r.device)).sum(-1)  # [B, G]
    return _out(_whiten(combined, eps=eps, ddof=ddof) if batch_norm else combined)


@ADVANTAGES.register("winrate", input="pairwise")
def winrate(
    prefs: Tensor,
    *,
    std: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-8,
    ddof: int = 1,
) -> Tensor:
    """Pairwise-preference advantage: each sample's win rate against the rest of its group, then GRPO-normalised.

    Pref-GRPO arXiv:2508.20751.
    w_bi = sum_{j != i} P_bij / (G - 1); A = (w - mean_g(w)) / (std_g(w) + eps), defaults as Pref-GRPO's code (ddof 1,
    eps 1e-8). Row i alone gives sample i's rate; with P_ij + P_ji = 1 that is Pref-GRPO's wins / comparisons.

    Args:
        prefs: [B, G, G], P_bij = 1 if sample i beats j, 0 if it loses, 0.5 for a tie; values in [0, 1] off the
            diagonal; the diagonal is ignored (may be NaN).
        std, eps, ddof: as in `grpo`.

    Returns:
        [B, G] float32 advantages (0 for G = 1: nothing to compare with).
    """
    P = _check_rewards(prefs, input="pairwise", what="prefs")
    _check_norm(std, eps, ddof)
    B, G, _ = P.shape
    off = ~torch.eye(G, dtype=torch.bool, device=P.device)  # [G, G]
    if ((P < 0) | (P > 1))[:, off].any():
        lo, hi = P[:, off].min().item(), P[:, off].max().item()
        raise ValueError(f"prefs off the diagonal must lie in [0, 1] (1 win, 0.5 tie, 0 loss); got range [{lo}, {hi}]")
    if G == 1:
        return _out(torch.zeros(B, 1, dtype=P.dtype, device=P.device))
    wins = torch.where(off, P, 0.0).sum(-1) / (G - 1)  # [B, G]
    return _out(_normalise(wins, std=std, eps=eps, ddof=ddof))


def prefs_from_scores(scores: Tensor) -> Tensor:
    """Preferences [B, G, G] implied by scalar scores [B, G]: P_bij = 1 if r_bi > r_bj, 0.5 on a tie, 0 if lower.

    How the trainer feeds `winrate` from a pointwise reward (Pref-GRPO arXiv:2508.20751 with a pointwise scorer: the
    advantage then depends only on each sample's rank in its group). The diagonal is 0.5 and ignored by `winrate`.
    """
    r = scores.unsqueeze(-1), scores.unsqueeze(-2)  # [B, G, 1], [B, 1, G]
    return (r[0] > r[1]).to(scores.dtype) + 0.5 * (r[0] == r[1]).to(scores.dtype)  # [B, G, G]
