"""SAGE-GRPO's micro level: the curvature-corrected ("precise manifold-aware") SDE step and the gradient-norm equaliser.

The step kind "sage" registers in sde.STEPS (stateless, exact log-prob through sde.step); no model, no diffusers.
"""

import math

import torch
from torch import Tensor

from mmgrpo.losses import POLICY_LOSSES, policy_loss
from pipelines.flow.sde import STEPS, _check_flow, _checked, _view


def _log_gain(sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """L = log((1 - sigma_next) / (1 - sigma)) = int_{sigma_next}^{sigma} dsigma / (1 - sigma); at sigma = 1 (where the
    integral diverges) the first step's Flow-GRPO convention, (sigma - sigma_next) / (1 - sigma_next)."""
    at_one = sigma >= 1
    safe = torch.where(at_one, torch.zeros_like(sigma), sigma)  # [N] keeps log finite where the other branch is used
    exact = torch.log1p(-sigma_next) - torch.log1p(-safe)
    return torch.where(at_one, (sigma - sigma_next) / (1 - sigma_next), exact)  # [N]


@STEPS.register("sage", paper="arXiv:2603.21872", args="sigma")
def sage_moments(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float):
    """SAGE-GRPO precise manifold-aware SDE: Flow-GRPO's diffusion g^2 = eta^2 sigma / (1 - sigma) integrated exactly.

    Paper: SAGE-GRPO arXiv:2603.21872 (Eq. 6 is not reproduced in the abstract; this is our reading of "integrating
    the diffusion coefficient over each step" with "a logarithmic curvature correction log((1 - s') / (1 - s))").
    Formula: L = log((1 - sigma_next) / (1 - sigma)); var = eta^2 (L - (sigma - sigma_next)) = int g^2 dsigma over the
    step; mean = x + dt v - (eta^2 / 2) L x1_hat, x1_hat = x + (1 - sigma) v, dt = sigma_next - sigma (the score
    drift g^2 / (2 sigma) * x1_hat = eta^2 / (2 (1 - sigma)) x1_hat integrated over the step with v and x1_hat held).
    Both agree with Flow-GRPO's Euler step to first order in dt; Euler's left-endpoint g^2 is the interval's largest,
    so var < Flow-GRPO's eta^2 sigma / (1 - sigma) |dt|: less excess noise where sigma is high. At sigma = 1 (the
    integral diverges) the first step uses Flow-GRPO's 1 - sigma_next: var = eta^2 sigma (sigma - sigma_next) /
    (1 - sigma_next), the drift coefficient likewise.
    """
    _check_flow(sigma, sigma_next, "sage")
    hs, hn = _checked(sigma, sigma_next)
    if bool(((hs == 1) & (hn == 1)).any()):
        raise ValueError("sage at sigma=1 needs sigma_next < 1 (the step uses 1 - sigma_next there), got both 1")
    gain = _log_gain(sigma, sigma_next)  # [N]
    var = torch.where(sigma >= 1, sigma * gain, gain - (sigma - sigma_next)) * noise_level**2  # [N]
    s, d = _view(sigma, x.dim()), _view(sigma_next - sigma, x.dim())
    x1_hat = x + (1 - s) * v  # noise estimate
    mean = x + d * v - (noise_level**2 / 2) * _view(gain, x.dim()) * x1_hat
    return mean, torch.sqrt(var.clamp_min(0))


def _mean_gain(kind: str, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
    """|d mean / d v| per step [K] for a flow kind (the mean is affine in v): probe with x = 0, v = 1."""
    ones, zeros = torch.ones(len(sigma), 1, dtype=sigma.dtype), torch.zeros(len(sigma), 1, dtype=sigma.dtype)
    return STEPS.get(kind)(zeros, ones, sigma, sigma_next, noise_level=noise_level)[0].abs().squeeze(1)


def equaliser_weights(sigma: Tensor, sigma_next: Tensor, *, kind: str = "sage", noise_level: float) -> Tensor:
    """SAGE-GRPO gradient-norm equaliser: per-step loss weights [K] that give every trained step the same expected
    gradient norm, mean 1 over the schedule.

    Paper: SAGE-GRPO arXiv:2603.21872 ("a gradient norm equalizer to stabilize ... updates across timesteps"; the
    formula is our reading). d logp / d v = (x' - mean) / std^2 * d mean / d v, and x' - mean ~ std, so its norm
    scales as c_t / std_t with c_t = |d mean / d v|: w_t = (std_t / c_t) / mean_k (std_k / c_k). Steps with std = 0
    carry no gradient and get weight 0. Analytic, per schedule: no extra backward.
    Args: sigma, sigma_next [K] (the schedule's pairs); kind: a flow STEPS kind; noise_level: its eta.
    Returns: [K] float64.
    """
    sigma = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)  # [K]
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float64).reshape(-1)  # [K]
    std = STEPS.get(kind)(
        torch.zeros(len(sigma), 1, dtype=torch.float64),
        torch.zeros(len(sigma), 1, dtype=torch.float64),
        sigma,
        sigma_next,
        noise_level=noise_level,
    )[1]  # [K]
    gain = _mean_gain(kind, sigma, sigma_next, noise_level)  # [K]
    raw = torch.where((std > 0) & (gain > 0), std / gain.clamp_min(1e-300), torch.zeros_like(std))  # [K]
    live = raw > 0
    if not bool(live.any()):
        raise ValueError(
            f"equaliser_weights: every step of kind {kind!r} is deterministic (std = 0); nothing to weigh"
        )
    return raw / raw[live].mean()


@POLICY_LOSSES.register("weighted_clipped", paper="arXiv:2603.21872")
def weighted_clipped(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weight: Tensor | None = None,
    k_offset: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped surrogate times a per-step weight: how SAGE-GRPO's gradient-norm equaliser enters the loss.

    Paper: SAGE-GRPO arXiv:2603.21872; PPO arXiv:1707.06347. Formula: loss = w_k * -min(r A, clip(r, 1 - clip_low,
    1 + clip_high) A), r = exp(logp - old_logp) (the raw ratio, unlike guard_clipped's RatioNorm); w from the flow
    policy's step_weights (grad_equalizer: sage.equaliser_weights), 1 without one.
    Args: logp, old_logp, mask [N, K]; adv [N] or [N, K]; weight [K] or [N, K]; k_offset is accepted (the flow
    policy passes it with any weight) and unused. Returns: loss [N, K] and policy_loss's metrics.
    """
    loss, metrics = policy_loss(logp, old_logp, adv, mask, clip_low=clip_low, clip_high=clip_high)
    if weight is None:
        return loss, metrics
    weight = torch.as_tensor(weight, dtype=loss.dtype, device=loss.device)
    if weight.shape not in (loss.shape[1:], loss.shape):
        raise ValueError(
            f"weight {tuple(weight.shape)} must be [K]=({loss.shape[1]},) or [N, K]={tuple(loss.shape)}; "
            f"pass one weight per trained step"
        )
    return loss * weight, metrics


def sage_noise_ratio(sigma: float, sigma_next: float) -> float:
    """var(sage) / var(flow_grpo) for one step (the noise the integral removes), e.g. for docs: < 1 for sigma < 1."""
    euler = sigma / (1 - sigma) * (sigma - sigma_next)
    precise = math.log((1 - sigma_next) / (1 - sigma)) - (sigma - sigma_next)
    return precise / euler
