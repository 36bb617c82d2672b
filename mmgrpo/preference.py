"""Preference optimisation inside the group loop: sigmoid DPO on sequence log-probs, and VerIPO's pair verifier.

Importing this module registers the loss "dpo" and the estimator "verifier_pairs" (mmgrpo/__init__.py imports it).
The loss reads the frozen reference's log-probs in `old_logp`: the trainer puts them there for every loss registered
with reference=True. The GRPO <-> DPO alternation is a schedule of phases (mmgrpo/phases.py), not a loop here.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from mmgrpo.advantages import ADVANTAGES, _check_number, _check_rewards, _out
from mmgrpo.loss_inputs import _check_inputs, _float_dtype
from mmgrpo.losses import POLICY_LOSSES


def _check_dpo(n: int, group_size: int | None, beta: float, label_smoothing: float) -> None:
    if group_size is None or group_size < 2 or n % group_size:
        raise ValueError(
            f"dpo pairs samples within groups: it needs group_size >= 2 dividing N={n}, got group_size="
            f"{group_size}; the trainer passes sample.group_size (keep whole groups in each micro-batch)"
        )
    if not beta > 0:
        raise ValueError(f"beta={beta} must be > 0 (DPO's KL strength: the logit is beta * margin); e.g. 0.1")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(
            f"label_smoothing={label_smoothing} must be in [0, 0.5) (conservative DPO's label-flip rate); e.g. 0"
        )


def _pairs(score: Tensor, live: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per group [B, G]: index of the highest and lowest score among live rows (first on ties), and whether they
    differ (a group with one live row or all scores equal has no pair)."""
    hi = torch.where(live, score, -torch.inf).argmax(-1)  # [B]; argmax returns the first maximal index
    lo = torch.where(live, score, torch.inf).argmin(-1)  # [B]
    paired = score.gather(-1, hi[:, None]).squeeze(-1) > score.gather(-1, lo[:, None]).squeeze(-1)  # [B]
    paired &= live.gather(-1, hi[:, None]).squeeze(-1) & live.gather(-1, lo[:, None]).squeeze(-1)
    return hi, lo, paired


@POLICY_LOSSES.register("dpo", paper="arXiv:2305.18290", reference=True, aggregation="seq_mean_token_mean")
def dpo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    group_size: int | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sigmoid DPO on each group's chosen/rejected pair of sequences, against a frozen reference.

    Paper: DPO arXiv:2305.18290 Eq. 7 (label_smoothing: conservative DPO, as TRL's loss_type="sigmoid").
    Formula per pair: loss = -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h), h = (S_c - S_c^ref) -
    (S_r - S_r^ref), S = sum_k mask * logp (the sequence log-prob). Chosen c / rejected r = the group's sample with
    the largest / smallest advantage (first on ties; the verifier_pairs estimator marks them +1 / -1); a group whose
    advantages are all equal has no pair and gives 0. `old_logp` holds the REFERENCE log-probs (the trainer passes
    them for this loss, registered with reference=True). The pair loss is written on every unmasked element of both
    sequences, so aggregate(..., "seq_mean_token_mean") over rows that are paired (verifier_pairs' loss mask keeps
    only those) is exactly the mean over pairs, value and gradient; validation requires that aggregation.

    Args:
        logp: [N, K] policy log-probs (grad); old_logp: [N, K] reference log-probs; adv: [N] or [N, K] (a row's
            score is its mean over unmasked elements); mask: [N, K]. N = B * group_size, groups contiguous.
        group_size: G >= 2.  beta: > 0.  label_smoothing: in [0, 0.5).

    Returns:
        loss [N, K] and detached metrics over paired groups: dpo/margin (mean h), dpo/accuracy (share with h > 0),
        dpo/chosen_reward and dpo/rejected_reward (beta * (S - S^ref), as TRL logs), dpo/pair_frac (groups paired).
    """
    valid, adv = _check_inputs(logp, old_logp, adv, mask)
    n, k = logp.shape
    _check_dpo(n, group_size, beta, label_smoothing)
    dtype = _float_dtype(logp)
    b, g = n // group_size, group_size
    log_ratio = torch.where(valid, logp.to(dtype) - old_logp.to(dtype), 0.0)  # [N, K]
    seq = log_ratio.sum(-1).view(b, g)  # [B, G] S - S^ref
    live = valid.any(-1).view(b, g)  # [B, G]
    score = (adv.sum(-1) / valid.sum(-1).clamp_min(1)).view(b, g)  # [B, G]
    hi, lo, paired = _pairs(score.detach(), live)
    s_c, s_r = seq.gather(-1, hi[:, None]).squeeze(-1), seq.gather(-1, lo[:, None]).squeeze(-1)  # [B]
    h = s_c - s_r  # [B]
    pair_loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)  # [B]
    pair_loss = torch.where(paired, pair_loss, 0.0)  # [B]
    rows = torch.zeros(b, g, dtype=dtype, device=logp.device)  # [B, G]
    rows = rows.scatter(-1, hi[:, None], pair_loss[:, None]).scatter(-1, lo[:, None], pair_loss[:, None])
    loss = torch.where(valid, rows.view(n, 1).expand(n, k), 0.0)  # [N, K]
    with torch.no_grad():
        cnt = paired.sum().clamp_min(1)
        metrics = {
            "dpo/margin": torch.where(paired, h, 0.0).sum() / cnt,
            "dpo/accuracy": (paired & (h > 0)).sum().to(dtype) / cnt,
            "dpo/chosen_reward": beta * torch.where(paired, s_c, 0.0).sum() / cnt,
            "dpo/rejected_reward": beta * torch.where(paired, s_r, 0.0).sum() / cnt,
            "dpo/pair_frac": paired.to(dtype).mean(),
        }
    return loss, {k_: v.detach() for k_, v in metrics.items()}


def _pair_labels(rewards: Tensor, margin: float) -> Tensor:
    r = _check_rewards(rewards)  # [B, G] float64
    _check_number("margin", margin)
    hi, lo = r.argmax(-1, keepdim=True), r.argmin(-1, keepdim=True)  # [B, 1] first maximal / minimal sample
    gap = r.gather(-1, hi) - r.gather(-1, lo)  # [B, 1]
    ok = (gap > 0) & (gap >= margin)  # [B, 1]
    labels = torch.zeros_like(r).scatter(-1, hi, 1.0).scatter(-1, lo, -1.0)  # [B, G]
    return torch.where(ok, labels, 0.0)  # [B, G]


def _pair_mask(rewards: Tensor, *, margin: float = 0.5) -> Tensor:
    """Only the pair's two samples enter the loss (so seq_mean_token_mean averages over pairs)."""
    return _pair_labels(rewards, margin) != 0  # [B, G]


@ADVANTAGES.register("verifier_pairs", input="scalar", paper="arXiv:2505.19000", mask=_pair_mask)
def verifier_pairs(rewards: Tensor, *, margin: float = 0.5) -> Tensor:
    """VerIPO's rollout-aware verifier as labels: +1 on the group's best sample, -1 on its worst, 0 elsewhere.

    Paper: VerIPO arXiv:2505.19000 (GRPO -> verifier -> DPO: contrastive pairs built from the group's rollouts).
    Formula: c = argmax_g r_g, w = argmin_g r_g (first on ties); A_c = +1, A_w = -1 when r_c - r_w >= margin and
    r_c > r_w, else the whole group is 0 (no pair). The paper's verifier is a small LLM judging the reasoning's
    consistency: put such a judge among the rewards and its score takes part in r. Pair it with algo.loss=dpo.

    Args:
        rewards: [B, G] total rewards.  margin: >= 0, the smallest reward gap that makes a pair.

    Returns:
        [B, G] labels in {-1, 0, +1}; its loss mask keeps only the labelled samples.
    """
    return _out(_pair_labels(rewards, margin))
