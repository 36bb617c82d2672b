"""DiffusionNFT (arXiv:2509.16117): its loss maths and the flow objective that feeds it forward-process points.

Likelihood-free: no SDE transition is kept or scored. FlowPolicy reaches this only through the objective interface
(objectives.FlowObjective, registered as "nft" in objectives.OBJECTIVES); importing it registers the "nft" loss.
"""

import torch
from torch import Tensor, nn

from mmgrpo.losses import POLICY_LOSSES
from mmgrpo.types import Rollout
from pipelines.flow import plan as plans
from pipelines.flow.models import FlowModel
from pipelines.flow.objective_api import ObjectivePolicy
from pipelines.flow.plan import PlanResult, RolloutPlan


def nft_optimality(adv: Tensor, *, adv_clip_max: float = 5.0) -> Tensor:
    """DiffusionNFT's optimality probability r in [0, 1] from advantages: r = clip(A, +-c) / (2c) + 1/2.

    Paper: DiffusionNFT arXiv:2509.16117 (code: NVlabs/DiffusionNFT scripts/train_nft_sd3.py, c = adv_clip_max = 5).
    Args: adv: any shape. Returns: r of the same shape.
    """
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}; DiffusionNFT uses 5")
    return (adv.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max / 2 + 0.5).clamp(0, 1)


def _check_nft_inputs(
    velocity: Tensor, old_velocity: Tensor, target: Tensor, t: Tensor, r: Tensor, beta: float, weighting: str
) -> None:
    """nft_loss's argument checks: matching shapes, t the leading dims, beta > 0, a known weighting, r in [0, 1]."""
    if velocity.shape != old_velocity.shape or velocity.shape != target.shape:
        raise ValueError(
            f"velocity {tuple(velocity.shape)}, old_velocity {tuple(old_velocity.shape)} and target "
            f"{tuple(target.shape)} must match"
        )
    nb = t.dim()
    if velocity.shape[:nb] != t.shape or velocity.dim() == nb:
        raise ValueError(f"t {tuple(t.shape)} must be the leading (batch) dims of velocity {tuple(velocity.shape)}")
    if not beta > 0 or weighting not in ("adaptive", "velocity"):
        raise ValueError(
            f"nft_loss needs beta > 0 and weighting in ('adaptive', 'velocity'), got {beta}, {weighting!r}"
        )
    if bool(((r < 0) | (r > 1)).any()):
        raise ValueError("r must lie in [0, 1] (an optimality probability); map advantages with nft_optimality")


def _nft_branch_loss(e: Tensor, tt: Tensor, dims: tuple[int, ...], weighting: str, eps: float) -> Tensor:
    """L(e) [*B] of one implicit policy's velocity error e [*B, ...]: mean_d e^2 ("velocity"), or the squared x0
    error over its detached mean absolute value ("adaptive", x0 error = t e with tt = t broadcast to e)."""
    if weighting == "velocity":
        return (e**2).mean(dims)  # [*B]
    x0_err = tt * e
    w = x0_err.detach().abs().mean(dims).clamp_min(eps)  # [*B]
    return (x0_err**2).mean(dims) / w  # [*B]


def nft_loss(
    velocity: Tensor,
    old_velocity: Tensor,
    target: Tensor,
    t: Tensor,
    r: Tensor,
    *,
    beta: float = 1.0,
    weighting: str = "adaptive",
    eps: float = 1e-5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DiffusionNFT's forward-process objective: pull an implicit positive policy to good samples, push a negative one.

    Paper: DiffusionNFT arXiv:2509.16117, Eq. 8 (CFG-free and likelihood-free: only clean samples x0 and rewards).
    Formula: v+ = (1 - beta) v_old + beta v, v- = (1 + beta) v_old - beta v, e+- = v+- - target;
    loss = [r L(e+) + (1 - r) L(e-)] / beta with L(e) = mean_d e^2 (weighting="velocity", the paper's form) or
    L(e) = mean_d (t e)^2 / max(mean_d |t e|, eps) (weighting="adaptive", the released code: squared x0 error over its
    detached mean absolute x0 error, since x0_hat - x0 = -t e). The code's final * adv_clip_max is a constant scale
    left out. Inputs come from x_t = (1 - t) x0 + t noise with target = noise - x0 (the flow-matching velocity).

    Args:
        velocity: [*B, ...] the trained model's velocity at x_t (with grad); B = t.shape, e.g. [N] or [N, K].
        old_velocity: same shape, the sampling (old) policy's velocity at the same x_t (detached here).
        target: same shape, noise - x0.
        t: [*B] noise levels in [0, 1].
        r: broadcastable to [*B], optimality probabilities in [0, 1] (nft_optimality).
        beta: > 0 NFT step size (1.0; 0.1 for OCR in the paper). Not the KL coefficient.
        weighting: "adaptive" or "velocity".
        eps: floor of the adaptive weight.

    Returns:
        loss [*B] and detached metrics nft/pos, nft/neg (mean L+, L-), nft/old_deviation (mean (v - v_old)^2).
    """
    _check_nft_inputs(velocity, old_velocity, target, t, r, beta, weighting)
    dtype = torch.promote_types(velocity.dtype, torch.float32)
    v, v_old, tgt = velocity.to(dtype), old_velocity.detach().to(dtype), target.to(dtype)
    dims = tuple(range(t.dim(), v.dim()))
    tt = t.to(dtype).reshape(*t.shape, *([1] * len(dims)))
    losses = [
        _nft_branch_loss(v_pm - tgt, tt, dims, weighting, eps)  # [*B] each: L(e+), L(e-)
        for v_pm in ((1 - beta) * v_old + beta * v, (1 + beta) * v_old - beta * v)
    ]
    r = torch.as_tensor(r, dtype=dtype, device=v.device)
    loss = (r * losses[0] + (1 - r) * losses[1]) / beta  # [*B]
    metrics = {
        "nft/pos": losses[0].detach().mean(),
        "nft/neg": losses[1].detach().mean(),
        "nft/old_deviation": ((v.detach() - v_old) ** 2).mean(),
    }
    return loss, metrics


@POLICY_LOSSES.register("nft", paper="arXiv:2509.16117")
def nft(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    velocity: Tensor | None = None,
    old_velocity: Tensor | None = None,
    target: Tensor | None = None,
    t: Tensor | None = None,
    beta: float = 1.0,
    weighting: str = "adaptive",
    adv_clip_max: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DiffusionNFT as a policy loss: r = nft_optimality(A) per sample, loss = nft_loss(v, v_old, target, t, r).

    Paper: DiffusionNFT arXiv:2509.16117, Eq. 8. The flow policy with `objective: nft` supplies velocity, old_velocity,
    target [N, K, ...] and t [N, K] (K forward-process noise levels per clean sample); logp/old_logp are unused.
    Args: adv [N] or [N, K]; mask [N, K]. Returns loss [N, K] (0 where masked) and nft/* metrics.
    """
    if velocity is None or old_velocity is None or target is None or t is None:
        raise ValueError(
            "algo.loss=nft needs the flow pipeline with pipeline.kwargs.objective=nft (it supplies the "
            "forward-process velocities); set both, or use algo.loss=clipped"
        )
    a = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv  # [N, K]
    r = nft_optimality(a.to(velocity.dtype), adv_clip_max=adv_clip_max)  # [N, K]
    loss, metrics = nft_loss(velocity, old_velocity, target, t, r, beta=beta, weighting=weighting)  # [N, K]
    loss = torch.where(mask.bool(), loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    metrics["nft/r_mean"] = r.detach()[mask.bool()].mean() if mask.any() else r.new_zeros(())
    return loss, metrics


class NFT:
    """objective nft: DiffusionNFT's training inputs, K forward-process points per clean sample, for algo.loss nft.

    Paper: DiffusionNFT arXiv:2509.16117 (CFG-free and likelihood-free: only the clean samples x0 and rewards).
    Formula: x_t = (1 - t) x0 + t eps, target = eps - x0, v_old = the sampling weights' CFG-free velocity at x_t,
    with K = nft_steps levels t drawn without replacement from the sampling schedule's sigmas (every one > 0).
    """

    def __init__(self, *, nft_steps: int = 2):
        self.steps = nft_steps

    def trained(self, trained: Tensor) -> Tensor:
        """[N, T] no transition is kept: the rollout needs only the clean samples."""
        return torch.zeros_like(trained)

    @torch.no_grad()
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
        """The forward-process points of the clean samples res.final, drawn with per-sample generators seeded from
        the prompt's seed, the member and the policy's iteration; `cond` holds "cond_<key>" per sample."""
        x0, grid = res.final, policy.sigmas[:-1]  # x0 [N, ...], grid [T]
        n, k = x0.shape[0], self.steps
        gens = [
            torch.Generator().manual_seed(plans.mix_seed(seeds[i // group_size], 17, i % group_size, policy.iteration))
            for i in range(n)
        ]
        idx = torch.stack([torch.randperm(len(grid), generator=g)[:k] for g in gens])  # [N, K]
        eps = torch.stack([torch.randn((k, *x0.shape[1:]), generator=g) for g in gens]).to(x0)  # [N, K, ...]
        t = grid[idx].to(x0)  # [N, K]
        tt = t.view(n, k, *([1] * (x0.dim() - 1)))
        x_t = (1 - tt) * x0[:, None] + tt * eps  # [N, K, ...]
        v_old = torch.cat(
            [
                forward_velocity(
                    policy.model,
                    policy.transformer,
                    x_t[i : i + 16],
                    t[i : i + 16],
                    {key[5:]: v[i : i + 16] for key, v in cond.items()},
                )
                for i in range(0, n, 16)
            ]
        )  # [N, K, ...]
        extras = {"x_t": x_t, "nft_target": eps - x0[:, None], "nft_v_old": v_old, "sigma": t, "step": idx, **cond}
        metrics = {
            "rollout/nfe_per_sample": res.nfe / n + k,
            "rollout/sde_steps": 0.0,
            "rollout/first_trained_step": -1.0,
        }
        return Rollout(
            samples=samples,
            old_logp=torch.zeros(n, k),
            mask=torch.ones(n, k, dtype=torch.bool),
            extras=extras,
            metrics=metrics,
        )

    def logp(
        self, policy: ObjectivePolicy, model: nn.Module, rollout: Rollout, idx: Tensor, ks: slice
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """No likelihood: zeros [n, k], and the "nft" loss's velocity, old_velocity, target and t in loss_kwargs."""
        ex = rollout.extras
        cond = {key[5:]: v[idx] for key, v in ex.items() if key.startswith("cond_")}
        t = ex["sigma"][idx][:, ks]  # [n, k]
        v = forward_velocity(policy.model, model, ex["x_t"][idx][:, ks], t, cond)  # [n, k, ...]
        kw = {
            "velocity": v,
            "old_velocity": ex["nft_v_old"][idx][:, ks],
            "target": ex["nft_target"][idx][:, ks],
            "t": t,
        }
        return torch.zeros(t.shape, device=v.device), {"loss_kwargs": kw}

    def ref_logp(self, policy: ObjectivePolicy, rollout: Rollout, idx: Tensor) -> None:
        """None: DiffusionNFT's loss has no KL term, so no reference log-prob is computed."""


def forward_velocity(
    flow_model: FlowModel, module: nn.Module, x_t: Tensor, t: Tensor, cond: dict[str, Tensor]
) -> Tensor:
    """CFG-free velocity [n, k, ...] of `module` at forward-process points x_t [n, k, ...], t [n, k] through the
    FlowModel adapter `flow_model`; cond is per sample (repeated over the k points)."""
    n, k = t.shape
    flat = {key: v.repeat_interleave(k, 0) for key, v in cond.items()}
    return flow_model.forward(module, x_t.reshape(n * k, *x_t.shape[2:]), t.reshape(-1), flat).view(x_t.shape)
