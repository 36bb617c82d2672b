"""Flow objectives: what FlowPolicy trains on (OBJECTIVES: grpo, nft) and the [N, K] maths of GRPO-Guard and TempFlow.

The losses are pure tensor maths, no model (K = trained steps); DiffusionNFT's lives in nft.py. Importing this module
registers "guard_clipped" and "nft" in mmgrpo.losses.POLICY_LOSSES and both objectives in OBJECTIVES.
"""

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from mmgrpo.losses import POLICY_LOSSES, policy_loss
from mmgrpo.registry import Registry
from mmgrpo.types import Rollout
from pipelines.flow.nft import NFT, nft, nft_loss, nft_optimality
from pipelines.flow.objective_api import FlowObjective, ObjectivePolicy
from pipelines.flow.plan import PlanResult, RolloutPlan
from pipelines.flow.sde import step_std

__all__ = [
    "NFT",
    "OBJECTIVES",
    "FlowObjective",
    "Likelihood",
    "ObjectivePolicy",
    "guard_clipped",
    "guard_log_ratio",
    "guard_step_weights",
    "make_objective",
    "nft",
    "nft_loss",
    "nft_optimality",
    "noise_aware_weights",
    "per_step_ratio_metrics",
]

OBJECTIVES = Registry("flow objective")


@OBJECTIVES.register("grpo", paper="arXiv:2505.05470")
class Likelihood:
    """objective grpo: the kept SDE transitions, scored by their Gaussian log-probs (algo.loss clipped, guard_clipped).

    Paper: Flow-GRPO arXiv:2505.05470. The scoring path is the policy's own (FlowPolicy.transition_*): it needs the
    policy's reference, adapters, trust region and GRPO-Guard switches.
    """

    def trained(self, trained: Tensor) -> Tensor:
        return trained

    def rollout(
        self,
        policy: ObjectivePolicy,
        plan: RolloutPlan,
        res: PlanResult,
        samples: list,
        cond: dict[str, Tensor],
        group_size: int,
        seeds: list[int],
    ) -> Rollout:
        return policy.transition_rollout(plan, res, samples, cond, group_size)

    def logp(
        self, policy: ObjectivePolicy, model: nn.Module, rollout: Rollout, idx: Tensor, ks: slice
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return policy.transition_logp(model, rollout, idx, ks)

    def ref_logp(self, policy: ObjectivePolicy, rollout: Rollout, idx: Tensor) -> Tensor | None:
        return policy.transition_ref_logp(rollout, idx)


OBJECTIVES.register("nft", NFT, paper="arXiv:2509.16117")


def make_objective(name: str, **settings: Any) -> FlowObjective:
    """The objective registered as `name`, built from the flow settings its constructor names (nft: nft_steps);
    the others are not its business. An unknown name raises ValueError listing the choices."""
    cls = OBJECTIVES.get(name)
    params = inspect.signature(cls).parameters
    return cls(**{key: value for key, value in settings.items() if key in params})


def _check_nk(x: Tensor, like: Tensor, name: str) -> None:
    if x.shape != like.shape:
        raise ValueError(f"{name} {tuple(x.shape)} != logp {tuple(like.shape)}: pass one value per (sample, step)")


def guard_log_ratio(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    *,
    std: Tensor | None = None,
    mean_sq_dist: Tensor | None = None,
) -> Tensor:
    """GRPO-Guard's RatioNorm: the per-step log-ratio with its mean shift removed and a step-consistent scale.

    Paper: GRPO-Guard arXiv:2510.22319 (code: flow_grpo scripts/train_sd3_GRPO_Guard.py).
    Formula (exact, std and mean_sq_dist given): log r_hat = s (logp - old_logp) + d2 / (2 s), where s is the
    transition std (StepOut.std) and d2 = reduce_d (mean_theta - mean_old)^2 with logp's reduction. For a stored
    x' = mean_old + s eps this equals reduce_d eps * (mean_theta - mean_old): zero mean under the rollout noise
    (the raw log-ratio has mean -d2 / (2 s^2) < 0, the left shift), and no 1/s blow-up at low-noise steps.
    Its gradient wrt mean_theta is eps (per element, /D for "mean"), so d2 carries gradient as in the paper's code.
    Formula (fallback, either missing): log r_hat = d - mean_i d at each step k, d = logp - old_logp, the mean over
    the unmasked samples of this call (detached): it removes the left shift only, not the per-step scale.

    Args:
        logp, old_logp: [N, K] per-step log-probs (current policy with grad, rollout policy).
        mask: [N, K] bool or 0/1.
        std: [N, K] transition std per element (> 0 where unmasked), or None.
        mean_sq_dist: [N, K] reduce_d (mean_theta - mean_old)^2 with grad, or None.

    Returns:
        [N, K] normalised log-ratio (0 on masked elements).
    """
    _check_nk(old_logp, logp, "old_logp")
    _check_nk(mask, logp, "mask")
    valid = mask.bool()  # [N, K]
    dtype = torch.promote_types(logp.dtype, torch.float32)
    d = torch.where(valid, logp.to(dtype) - old_logp.to(dtype), 0.0)  # [N, K]
    if (std is None) != (mean_sq_dist is None):
        raise ValueError(
            "guard_log_ratio needs both std and mean_sq_dist (exact RatioNorm) or neither (batch "
            "centring); got only one"
        )
    if std is None:
        count = valid.sum(0).clamp_min(1)  # [K]
        centre = (d.sum(0) / count).detach()  # [K]
        return torch.where(valid, d - centre, 0.0)  # [N, K]
    _check_nk(std, logp, "std")
    _check_nk(mean_sq_dist, logp, "mean_sq_dist")
    s = std.to(dtype)
    if bool((valid & ~(s > 0)).any()):
        raise ValueError("std must be > 0 on unmasked steps: a deterministic (ODE) step has no ratio; mask it out")
    safe = torch.where(valid, s, torch.ones_like(s))  # [N, K]
    return torch.where(valid, safe * d + mean_sq_dist.to(dtype) / (2 * safe), 0.0)  # [N, K]


def guard_step_weights(sigma: Tensor, sigma_next: Tensor, *, normalize: bool = False) -> Tensor:
    """GRPO-Guard's gradient reweighting over noise levels: w = 1 / |dt| per trained step.

    Paper: GRPO-Guard arXiv:2510.22319; its code divides the step's policy loss by sqrt(|dt|)^2 = |dt|.
    Formula: w_k = 1 / (sigma_k - sigma_next_k); normalize=True divides by the mean of w (the relative weighting
    without the overall 1/|dt| learning-rate factor the paper's code applies).
    Args: sigma, sigma_next: [K] or [N, K] with sigma > sigma_next. Returns: weights of the same shape (float64).
    """
    sigma, sigma_next = torch.as_tensor(sigma, dtype=torch.float64), torch.as_tensor(sigma_next, dtype=torch.float64)
    if sigma.shape != sigma_next.shape or not bool((sigma > sigma_next).all()):
        raise ValueError(
            f"guard_step_weights needs same-shape sigma > sigma_next, got {sigma.tolist()} and "
            f"{sigma_next.tolist()}; pass sigmas[:-1], sigmas[1:] of the trained steps"
        )
    w = 1.0 / (sigma - sigma_next)
    return w / w.mean() if normalize else w


def noise_aware_weights(
    sigma: Tensor, sigma_next: Tensor, *, kind: str = "flow_grpo", noise_level: float = 0.7
) -> Tensor:
    """TempFlow-GRPO noise-aware step weights: each step's exploration noise over the mean noise of the steps.

    Paper: TempFlow-GRPO arXiv:2508.04324 (no code released; formula from the paper's description, as read by
    third-party re-implementations). Formula: w_k = std_k / mean_k std_k with std_k = the transition std of `kind`
    (Flow-GRPO: s_t sqrt(|dt|)), so high-noise early steps weigh more; noise_level cancels for flow_grpo and dance.
    Args: sigma, sigma_next [K] (the trained steps); kind: a STEPS name; noise_level: that kind's eta.
    Returns: [K] float64 weights with mean 1 (multiply the per-step loss; they are constants, no grad).
    """
    std = step_std(kind, sigma, sigma_next, noise_level=noise_level)  # [K]
    if not bool((std.mean() > 0).item()):
        raise ValueError(
            f"noise_aware_weights: every step of kind {kind!r} is deterministic (std = 0); "
            f"use an SDE kind and noise_level > 0"
        )
    return std / std.mean()


@POLICY_LOSSES.register("guard_clipped", paper="arXiv:2510.22319")
def guard_clipped(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 1e-4,
    clip_high: float = 1e-4,
    std: Tensor | None = None,
    mean_sq_dist: Tensor | None = None,
    weight: Tensor | None = None,
    k_offset: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO-Guard regulated clipping: the clipped surrogate on the RatioNorm ratio, times optional step weights.

    Paper: GRPO-Guard arXiv:2510.22319. Formula: loss = w * -min(r_hat A, clip(r_hat, 1 - clip_low, 1 + clip_high) A),
    r_hat = exp(guard_log_ratio(...)), w = weight (guard_step_weights for the paper's 1/|dt|, or
    noise_aware_weights). Exact RatioNorm needs the per-element std and mean_sq_dist tensors from the flow policy;
    without them the per-step batch centring fallback is used (see guard_log_ratio). The paper's SD3.5-M configs
    clip the exact ratio at 2e-6 (OCR, GenEval) and 4e-6 (PickScore) with mean-reduced log-probs; the default 1e-4
    is Flow-GRPO's range for raw log-ratios, which the fallback keeps.

    Args:
        logp, old_logp: [N, K]; adv: [N] or [N, K]; mask: [N, K].
        clip_low, clip_high: >= 0 clip range of r_hat.
        std, mean_sq_dist: [N, K] or None (see guard_log_ratio).
        weight: [K] or [N, K] per-step weight, or None for 1.
        k_offset: step index of column 0 (the flow policy passes it); when given, the per-step monitor of r_hat
            (per_step_ratio_metrics: what this loss clips) is added under guard/ratio/k<j>/...

    Returns:
        loss [N, K] (0 on masked elements) and the detached metrics of mmgrpo.losses.policy_loss computed on r_hat
        (ratio/mean, ratio/std, clip/upper_frac, clip/lower_frac, ...), plus guard/raw_log_ratio_mean.
    """
    log_r = guard_log_ratio(logp, old_logp, mask, std=std, mean_sq_dist=mean_sq_dist)  # [N, K]
    loss, metrics = policy_loss(log_r, torch.zeros_like(log_r), adv, mask, clip_low=clip_low, clip_high=clip_high)
    if weight is not None:
        weight = torch.as_tensor(weight, dtype=loss.dtype, device=loss.device)
        if weight.shape not in (loss.shape[1:], loss.shape):
            raise ValueError(
                f"weight {tuple(weight.shape)} must be [K]=({loss.shape[1]},) or [N, K]="
                f"{tuple(loss.shape)}; pass one weight per trained step"
            )
        loss = loss * weight
    with torch.no_grad():
        valid = mask.bool()
        raw = torch.where(valid, logp.detach() - old_logp.detach(), 0.0)
        metrics["guard/raw_log_ratio_mean"] = raw.sum() / valid.sum().clamp_min(1)
    if k_offset is not None:
        per_step = per_step_ratio_metrics(
            log_r.detach(), mask, clip_low=clip_low, clip_high=clip_high, k_offset=int(k_offset)
        )
        metrics.update({f"guard/{key}": v for key, v in per_step.items()})
    return loss, metrics


@torch.no_grad()
def per_step_ratio_metrics(
    log_ratio: Tensor, mask: Tensor, *, clip_low: float = 1e-4, clip_high: float = 1e-4, k_offset: int = 0
) -> dict[str, Tensor]:
    """The over-optimisation monitor: per step j, the ratio's mean and std and the fractions beyond each clip bound.

    Paper: the diagnostics of GRPO-Guard arXiv:2510.22319 (ratio mean below 1 and step-dependent variance).
    Formula: r = exp(log_ratio) over the unmasked samples of step j; std is the population std; upper = frac(r >
    1 + clip_high), lower = frac(r < 1 - clip_low), whatever the advantage's sign (the paper's clipfrac_gt/lt_one).
    Args: log_ratio [N, K] (raw logp - old_logp, or guard_log_ratio); mask [N, K]; k_offset: index of column 0
    when K is a chunk of the steps. Returns: {"ratio/k{j}/mean", "ratio/k{j}/std", "ratio/k{j}/clip_upper",
    "ratio/k{j}/clip_lower"} as 0-dim tensors, for steps with at least one unmasked sample.
    """
    _check_nk(mask, log_ratio, "mask")
    valid = mask.bool()  # [N, K]
    r = log_ratio.to(torch.promote_types(log_ratio.dtype, torch.float32)).clamp(-20, 20).exp()  # [N, K]
    count = valid.sum(0)  # [K]
    n = count.clamp_min(1)
    mean = torch.where(valid, r, 0.0).sum(0) / n  # [K]
    std = (torch.where(valid, (r - mean) ** 2, 0.0).sum(0) / n).sqrt()  # [K]
    upper = (valid & (r > 1 + clip_high)).to(r.dtype).sum(0) / n  # [K]
    lower = (valid & (r < 1 - clip_low)).to(r.dtype).sum(0) / n  # [K]
    out = {}
    for j in range(log_ratio.shape[1]):
        if count[j] > 0:
            k = j + k_offset
            out.update(
                {
                    f"ratio/k{k}/mean": mean[j],
                    f"ratio/k{k}/std": std[j],
                    f"ratio/k{k}/clip_upper": upper[j],
                    f"ratio/k{k}/clip_lower": lower[j],
                }
            )
    return out
