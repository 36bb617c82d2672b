"""Stateless denoising transitions with exact Gaussian log-densities: Flow-GRPO, DanceGRPO, CPS, ODE and DDIM steps.

Pure tensor maths like diffusers' scheduler `step()` but with per-sample sigmas and no state; no model, no diffusers.
"""

import contextvars
import math
from typing import NamedTuple

import torch
from torch import Tensor

from mmgrpo.registry import Registry

STEPS = Registry("sde step")
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class StepOut(NamedTuple):
    """One transition x_t -> x_{t-1} ~ N(mean, std^2 I) and the log-density of prev_sample under it."""

    prev_sample: Tensor
    """[N, ...] the next sample, in `sample`'s dtype (scored after that cast, so re-scoring it gives the same logp)"""
    logp: Tensor
    """[N] log N(prev_sample; mean, std^2), normalising constant included, reduced over non-batch dims"""
    mean: Tensor
    """[N, ...] the transition mean in the compute dtype (float32, or float64 for float64 inputs); carries grad"""
    std: Tensor
    """[N] the transition standard deviation (0 for a deterministic step)"""


# ---- validation helpers ----


def _per_sample(x: Tensor | float, n: int, name: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    x = torch.as_tensor(x, dtype=dtype, device=device)
    if x.dim() == 0:
        return x.expand(n)
    if x.shape != (n,):
        raise ValueError(
            f"{name} must be a scalar or one value per sample [N]=({n},), got shape {tuple(x.shape)}; "
            f"pass sigmas[step_index] per sample"
        )
    return x


_HOST_SIGMAS: contextvars.ContextVar = contextvars.ContextVar("sde_host_sigmas", default=None)
"""(sigma, sigma_next) [N] on the CPU while step() runs a kind on an accelerator with sigmas it was given on the
host: the kinds validate those copies, so a rollout step never waits for the device to answer a check."""


def _checked(sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
    """The sigmas a kind validates: step()'s host copies when it set them, else the arguments themselves."""
    host = _HOST_SIGMAS.get()
    return host if host is not None and host[0].shape == sigma.shape else (sigma, sigma_next)


def _check_flow(sigma: Tensor, sigma_next: Tensor, kind: str, *, positive: bool = False) -> None:
    sigma, sigma_next = _checked(sigma, sigma_next)
    if not bool(((0 <= sigma_next) & (sigma_next <= sigma) & (sigma <= 1)).all()):
        raise ValueError(
            f"{kind} needs 0 <= sigma_next <= sigma <= 1 (sigma goes 1 -> 0), got sigma="
            f"{sigma.tolist()}, sigma_next={sigma_next.tolist()}; pass sigmas[i], sigmas[i + 1]"
        )
    if positive and not bool((sigma > 0).all()):
        raise ValueError(
            f"{kind} divides by sigma, got sigma={sigma.tolist()}; the step from sigma=0 is empty, "
            f"stop the schedule at the last sigma > 0"
        )


def _view(x: Tensor, ndim: int) -> Tensor:
    return x.view(-1, *([1] * (ndim - 1)))  # [N, 1, ..., 1]


def _reduce(x: Tensor, reduce: str) -> Tensor:
    dims = tuple(range(1, x.dim()))
    if not dims:
        return x
    return x.mean(dims) if reduce == "mean" else x.sum(dims)


# ---- the kinds: each returns the transition's (mean [N, ...], std [N]); sampling and scoring live in step() ----


def _sde_mean(x: Tensor, v: Tensor, sigma: Tensor, dt: Tensor, noise_t: Tensor) -> Tensor:
    """Euler-Maruyama mean of the reverse SDE with diffusion noise_t: x + dt * (v + noise_t^2 / (2 sigma) * x1_hat)."""
    s, d, g = _view(sigma, x.dim()), _view(dt, x.dim()), _view(noise_t, x.dim())
    x1_hat = x + (1 - s) * v  # noise estimate; the marginal score is -x1_hat / sigma
    return x + d * (v + g**2 / (2 * s) * x1_hat)


@STEPS.register("flow_grpo", paper="arXiv:2505.05470", args="sigma")
def flow_grpo_moments(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float):
    """Flow-GRPO SDE step: noise sigma_t = noise_level * sqrt(sigma / (1 - sigma)), Euler-Maruyama with score drift.

    Paper: Flow-GRPO arXiv:2505.05470, Eq. 9 (code: flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, sde_type="sde").
    Formula: mean = x (1 + s_t^2 dt / (2 sigma)) + v (1 + s_t^2 (1 - sigma) / (2 sigma)) dt, std = s_t sqrt(-dt),
    dt = sigma_next - sigma. At sigma = 1 the 1 - sigma in s_t is replaced by 1 - sigma_next, which is Flow-GRPO's
    1 - sigmas[1] for the first step of a schedule (it uses the schedule's second sigma there).
    """
    _check_flow(sigma, sigma_next, "flow_grpo", positive=True)
    hs, hn = _checked(sigma, sigma_next)
    if bool(((hs == 1) & (hn == 1)).any()):
        raise ValueError("flow_grpo at sigma=1 needs sigma_next < 1 (s_t uses 1 - sigma_next there), got both 1")
    denom = torch.where(sigma == 1, 1 - sigma_next, 1 - sigma)  # [N]
    noise_t = noise_level * torch.sqrt(sigma / denom)  # [N]
    dt = sigma_next - sigma  # [N]
    return _sde_mean(x, v, sigma, dt, noise_t), noise_t * torch.sqrt(-dt)


@STEPS.register("dance", paper="arXiv:2505.07818", args="sigma")
def dance_moments(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float):
    """DanceGRPO SDE step: constant noise sigma_t = noise_level, drift corrected by the score -x1_hat / sigma.

    Paper: DanceGRPO arXiv:2505.07818 (code: fastvideo/train_grpo_flux.py::flux_step, sde_solver=True).
    Formula: mean = x + dt v - 0.5 eta^2 score dt with score = -(x - (1 - sigma) x0_hat) / sigma^2 = -x1_hat / sigma,
    std = eta sqrt(sigma - sigma_next). DanceGRPO's own log-prob loses its constant terms to a dangling line (they
    are a separate expression statement); here the full Gaussian is used.
    """
    _check_flow(sigma, sigma_next, "dance", positive=True)
    dt = sigma_next - sigma  # [N]
    noise_t = torch.full_like(sigma, float(noise_level))  # [N]
    return _sde_mean(x, v, sigma, dt, noise_t), noise_t * torch.sqrt(-dt)


@STEPS.register("cps", paper="arXiv:2509.05952", args="sigma")
def cps_moments(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float):
    """Coefficients-preserving sampling: x0 and noise coefficients of x_{t-1} stay (1 - sigma_next, sigma_next).

    Paper: Flow-CPS arXiv:2509.05952 (code: flow_grpo sd3_sde_with_logprob.py, sde_type="cps").
    Formula: std = sigma_next sin(eta pi / 2), mean = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) x1_hat,
    x0_hat = x - sigma v, x1_hat = x + (1 - sigma) v. Flow-GRPO scores CPS with -mean((x' - mean)^2), constants and
    the 1 / (2 std^2) dropped; here the exact Gaussian log-density is used, so clip ranges do not carry over.
    """
    _check_flow(sigma, sigma_next, "cps")
    if not 0 <= noise_level <= 1:
        raise ValueError(
            f"cps needs 0 <= noise_level <= 1 (std = sigma_next * sin(noise_level * pi / 2)), got "
            f"{noise_level}; the CPS paper recommends 0.8"
        )
    std = sigma_next * math.sin(noise_level * math.pi / 2)  # [N]
    s, s_next = _view(sigma, x.dim()), _view(sigma_next, x.dim())
    keep = _view(torch.sqrt((sigma_next**2 - std**2).clamp_min(0)), x.dim())
    return (1 - s_next) * (x - s * v) + keep * (x + (1 - s) * v), std


@STEPS.register("ode", paper="arXiv:2210.02747", args="sigma")
def ode_moments(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, noise_level: float):
    """Deterministic Euler step, equal to diffusers' FlowMatchEulerDiscreteScheduler.step: x + (sigma_next - sigma) v.

    Paper: flow matching arXiv:2210.02747. std = 0, so step() returns logp = 0 (the point-mass convention below);
    noise_level is ignored.
    """
    _check_flow(sigma, sigma_next, "ode")
    return x + _view(sigma_next - sigma, x.dim()) * v, torch.zeros_like(sigma)


@STEPS.register("ddim", paper="arXiv:2305.13301", args="alpha_bar")
def ddim_moments(x: Tensor, eps: Tensor, alpha_bar: Tensor, alpha_bar_prev: Tensor, *, noise_level: float):
    """DDPO's DDIM step with eta for epsilon-prediction models (sigma -> alpha_bar_t, sigma_next -> alpha_bar_prev).

    Paper: DDPO arXiv:2305.13301 (ddpo_pytorch/diffusers_patch/ddim_with_logprob.py), DDIM arXiv:2010.02502 Eq. 12.
    Formula: var = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev), std = eta sqrt(var),
    x0_hat = (x - sqrt(1 - a_t) eps) / sqrt(a_t), mean = sqrt(a_prev) x0_hat + sqrt(1 - a_prev - std^2) eps,
    with a_t = alphas_cumprod[t] and a_prev = alphas_cumprod[t_prev] (the scheduler's final_alpha_cumprod at the end).
    No clip_sample / thresholding (Stable Diffusion uses neither).
    """
    ha, hp = _checked(alpha_bar, alpha_bar_prev)
    if not bool(((0 < ha) & (ha <= hp) & (hp <= 1) & (ha < 1)).all()):
        raise ValueError(
            f"ddim needs 0 < alpha_bar < 1 and alpha_bar <= alpha_bar_prev <= 1 (pass alphas_cumprod "
            f"values, not sigmas), got {ha.tolist()}, {hp.tolist()}"
        )
    if not 0 <= noise_level <= 1:
        raise ValueError(f"ddim needs 0 <= eta <= 1 (eta > 1 makes 1 - a_prev - std^2 negative), got {noise_level}")
    var = (1 - alpha_bar_prev) / (1 - alpha_bar) * (1 - alpha_bar / alpha_bar_prev)  # [N]
    std = noise_level * torch.sqrt(var)  # [N]
    a, a_prev = _view(alpha_bar, x.dim()), _view(alpha_bar_prev, x.dim())
    x0_hat = (x - torch.sqrt(1 - a) * eps) / torch.sqrt(a)
    direction = _view(torch.sqrt((1 - alpha_bar_prev - std**2).clamp_min(0)), x.dim())
    return torch.sqrt(a_prev) * x0_hat + direction * eps, std


# ---- the entry point ----


def _noise(shape: tuple, generator, device: torch.device, dtype: torch.dtype) -> Tensor:
    """N(0, I) noise as diffusers' randn_tensor: one generator, or one per sample (then independent of the batch)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(
                f"generator list has {len(generator)} generators for N={shape[0]} samples; pass one "
                f"per sample (or a single torch.Generator)"
            )
        parts = [torch.randn((1, *shape[1:]), generator=g, device=g.device, dtype=dtype) for g in generator]
        return torch.cat(parts).to(device, non_blocking=True)  # a host -> device copy that does not wait
    rand_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=rand_device, dtype=dtype).to(device)


def gaussian_logp(x: Tensor, mean: Tensor, std: Tensor, reduce: str = "mean") -> Tensor:
    """log N(x; mean, std^2 I) per sample, constant included; samples with std = 0 get 0 (point-mass convention).

    Formula: mean_or_sum_d [ -(x - mean)^2 / (2 std^2) - log std - log sqrt(2 pi) ].
    Args: x, mean [N, ...]; std [N]; reduce "mean" or "sum" over non-batch dims. Returns [N]; x is not differentiated.
    """
    pos = std > 0  # [N]
    safe = _view(torch.where(pos, std, torch.ones_like(std)), mean.dim())
    elem = -((x.detach() - mean) ** 2) / (2 * safe**2) - torch.log(safe) - _HALF_LOG_2PI
    return torch.where(pos, _reduce(elem, reduce), torch.zeros((), dtype=mean.dtype, device=mean.device))  # [N]


def _check_step_inputs(
    sample: Tensor, velocity: Tensor, prev_sample: Tensor | None, noise_level: float, reduce: str
) -> None:
    """step()'s argument checks, each naming the argument, what it got and what to pass."""
    if velocity.shape != sample.shape:
        raise ValueError(
            f"velocity {tuple(velocity.shape)} != sample {tuple(sample.shape)}: the model output must "
            f"have the latent's shape"
        )
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"prev_sample {tuple(prev_sample.shape)} != sample {tuple(sample.shape)}: score the stored "
            f"next latent of this same step"
        )
    if sample.dim() < 1 or sample.shape[0] == 0:
        raise ValueError(f"sample must be [N, ...] with N >= 1, got shape {tuple(sample.shape)}")
    if not noise_level >= 0:
        raise ValueError(f"noise_level must be >= 0 (0 gives the deterministic step), got {noise_level}")
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' (per-element average, as Flow-GRPO) or 'sum', got {reduce!r}")


def _moments(
    fn, x: Tensor, v: Tensor, sigma: Tensor | float, sigma_next: Tensor | float, noise_level: float
) -> tuple[Tensor, Tensor]:
    """A kind's (mean [N, ...], std [N]) at x, v (already in the compute dtype), the sigmas made per-sample [N].

    On an accelerator with sigmas given on the host, the kind validates the host copies (_HOST_SIGMAS) and the
    device gets a non-blocking copy, so a rollout step never waits for the device to answer a check."""
    n, dev, dtype = x.shape[0], x.device, x.dtype
    on_host = lambda t: not isinstance(t, Tensor) or t.device.type == "cpu"
    token = None
    if dev.type != "cpu" and on_host(sigma) and on_host(sigma_next):  # check the host copies, copy without a wait
        host = (
            _per_sample(sigma, n, "sigma", dtype, torch.device("cpu")),
            _per_sample(sigma_next, n, "sigma_next", dtype, torch.device("cpu")),
        )  # [N], [N]
        token = _HOST_SIGMAS.set(host)
        sigma, sigma_next = (h.to(dev, non_blocking=True) for h in host)
    sigma = _per_sample(sigma, n, "sigma", dtype, dev)  # [N]
    sigma_next = _per_sample(sigma_next, n, "sigma_next", dtype, dev)  # [N]
    try:
        return fn(x, v, sigma, sigma_next, noise_level=noise_level)
    finally:
        if token is not None:
            _HOST_SIGMAS.reset(token)


def step(
    kind: str,
    sample: Tensor,
    velocity: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    *,
    noise_level: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    reduce: str = "mean",
) -> StepOut:
    """Sample (prev_sample=None) or re-score (prev_sample given) one transition of kind `kind` from STEPS.

    Papers: see each kind (STEPS.describe()). Formula: prev = mean + std * eps, eps ~ N(0, I);
    logp = reduce_d log N(prev; mean, std^2), the same std for sampling and scoring (no BranchGRPO scale mismatch).
    Computed in float32 (float64 for float64 inputs); prev_sample is cast to sample.dtype BEFORE it is scored, so
    storing it and re-scoring gives exactly the same logp (ratio 1 before the first update).
    Deterministic steps (std = 0: "ode", noise_level = 0, CPS/DDIM at their last step) sample prev = mean and
    score logp = 0 whatever prev_sample holds: they carry no policy gradient; mask them out of the loss.

    Args:
        kind: a STEPS name: "flow_grpo", "dance", "cps", "ode" or "ddim".
        sample: [N, ...] current sample x_t.
        velocity: [N, ...] model output: velocity v (x_t = (1 - sigma) x0 + sigma noise, v ~ noise - x0);
            for "ddim" the epsilon prediction.
        sigma, sigma_next: scalars or [N]; sigmas[i], sigmas[i + 1] with sigma going 1 -> 0. For "ddim" they are
            alphas_cumprod[t] and alphas_cumprod[t_prev] (see ddim_step for named arguments).
        noise_level: >= 0; eta of the kind (Flow-GRPO 0.7, DanceGRPO 0.3, CPS 0.8, DDIM eta 1.0).
        prev_sample: [N, ...] a stored transition to score, or None to sample one.
        generator: None, a torch.Generator, or a list of N generators (one per sample, diffusers' randn_tensor
            convention: sample i's noise then depends only on generator i, not on the batch it sits in).
        reduce: "mean" (Flow-GRPO, DanceGRPO, DDPO: mean over elements) or "sum" (the log-density of the whole
            latent); the clip range of a ratio loss depends on this choice.

    Returns:
        StepOut(prev_sample [N, ...] in sample.dtype, logp [N], mean [N, ...], std [N]).
    """
    fn = STEPS.get(kind)
    _check_step_inputs(sample, velocity, prev_sample, noise_level, reduce)
    # bf16 cannot hold the drift term x * s_t^2 dt / (2 sigma) accurately: always compute in >= float32
    dtype = torch.promote_types(torch.promote_types(sample.dtype, velocity.dtype), torch.float32)
    mean, std = _moments(fn, sample.to(dtype), velocity.to(dtype), sigma, sigma_next, noise_level)
    if prev_sample is None:
        with torch.no_grad():
            eps = _noise(tuple(sample.shape), generator, sample.device, dtype)
            prev_sample = (mean + _view(std, mean.dim()) * eps).to(sample.dtype)
    logp = gaussian_logp(prev_sample.to(dtype), mean, std, reduce)  # [N]
    return StepOut(prev_sample.detach(), logp, mean, std)


def ddim_step(
    sample: Tensor,
    eps: Tensor,
    alpha_bar: Tensor | float,
    alpha_bar_prev: Tensor | float,
    *,
    eta: float = 1.0,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    reduce: str = "mean",
) -> StepOut:
    """step("ddim", ...) with DDPO's names: alpha_bar = alphas_cumprod[t], alpha_bar_prev = alphas_cumprod[t_prev].

    Paper: DDPO arXiv:2305.13301. For t_prev < 0 pass the scheduler's final_alpha_cumprod (1.0 with
    set_alpha_to_one=True; alphas_cumprod[0] for SD 1.x, which sets it False). See ddim_moments and step().
    """
    return step(
        "ddim",
        sample,
        eps,
        alpha_bar,
        alpha_bar_prev,
        noise_level=eta,
        prev_sample=prev_sample,
        generator=generator,
        reduce=reduce,
    )


def step_std(kind: str, sigma: Tensor, sigma_next: Tensor, *, noise_level: float) -> Tensor:
    """The transition std [K] of `kind` at each (sigma, sigma_next) pair, without a model (e.g. for step weights)."""
    sigma = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)  # [K]
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float64, device=sigma.device).reshape(-1)  # [K]
    if sigma.shape != sigma_next.shape:
        raise ValueError(f"sigma {tuple(sigma.shape)} != sigma_next {tuple(sigma_next.shape)}: one pair per step")
    zeros = torch.zeros(sigma.shape[0], 1, dtype=torch.float64, device=sigma.device)
    return STEPS.get(kind)(zeros, zeros, sigma, sigma_next, noise_level=noise_level)[1]


def kl_gaussian(mean: Tensor, ref_mean: Tensor, std: Tensor | float, reduce: str = "mean") -> Tensor:
    """Exact KL(N(mean, std^2 I) || N(ref_mean, std^2 I)) per sample: reduce_d (mean - ref_mean)^2 / (2 std^2).

    Paper: the Gaussian KL with equal covariances; as used by Flow-GRPO arXiv:2505.05470 Eq. 12. Pass the
    transition std (StepOut.std = s_t sqrt(|dt|)). Flow-GRPO's code divides by 2 s_t^2 instead, dropping |dt|: its
    value is this KL times |dt| (so its beta means beta / |dt| here). Equal means give 0 even where std = 0;
    different means with std = 0 give inf (two point masses).
    Args: mean, ref_mean [N, ...]; std [N] or a scalar; reduce "mean" (per element, as logp) or "sum".
    Returns: [N] in >= float32.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(
            f"ref_mean {tuple(ref_mean.shape)} != mean {tuple(mean.shape)}: score the same latents "
            f"under the reference model"
        )
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}; use the reduction of your logp")
    dtype = torch.promote_types(mean.dtype, torch.float32)
    std = _per_sample(std, mean.shape[0], "std", dtype, mean.device)  # [N]
    if bool((std < 0).any()):
        raise ValueError(f"std must be >= 0, got {std.tolist()}")
    sq = _reduce((mean.to(dtype) - ref_mean.to(dtype)) ** 2, reduce)  # [N]
    pos = std > 0
    zero_std = torch.where(sq > 0, torch.full_like(sq, float("inf")), torch.zeros_like(sq))
    return torch.where(pos, sq / (2 * torch.where(pos, std, torch.ones_like(std)) ** 2), zero_std)  # [N]


def sigmas(
    num_steps: int,
    shift: float = 1.0,
    *,
    dynamic: float | None = None,
    grid: str = "scheduler",
    num_train_timesteps: int = 1000,
) -> Tensor:
    """The sigma schedule [T+1] (1 -> 0, float32) of diffusers' FlowMatchEulerDiscreteScheduler.set_timesteps.

    Paper: SD3 arXiv:2403.03206 (shift); Formula: s = linspace(1, sigma_min, T) with sigma_min = shift(1/T_train)
    (grid="scheduler", what SD3 pipelines get) or s = linspace(1, 1/T, T) (grid="uniform", the sigmas FluxPipeline
    passes); then shift(s) = shift s / (1 + (shift - 1) s), or with dynamic=mu the exponential resolution shift
    e^mu / (e^mu + 1/s - 1) (use_dynamic_shifting=True; shift is then unused and sigma_min = 1/T_train); append 0.
    The scheduler applies `shift` once to its training sigmas and again here, so sigma_min is shifted twice, as there.

    Args:
        num_steps: T >= 1 denoising steps.
        shift: > 0 static shift (SD3 3.0); ignored when dynamic is given.
        dynamic: mu of the resolution-dependent shift (FLUX, SD3 with use_dynamic_shifting), or None.
        grid: "scheduler" or "uniform" (see Formula).
        num_train_timesteps: the scheduler's num_train_timesteps.

    Returns:
        [T+1] float32, sigmas[0] = 1 (for shift >= 1 / the default grid) and sigmas[T] = 0.
    """
    if num_steps < 1 or shift <= 0 or num_train_timesteps < 1:
        raise ValueError(
            f"sigmas needs num_steps >= 1, shift > 0 and num_train_timesteps >= 1, got {num_steps}, "
            f"{shift}, {num_train_timesteps}"
        )
    if grid not in ("scheduler", "uniform"):
        raise ValueError(f"grid must be 'scheduler' (diffusers' default) or 'uniform' (FluxPipeline), got {grid!r}")
    s_min = 1.0 / num_train_timesteps
    if dynamic is None:
        s_min = shift * s_min / (1 + (shift - 1) * s_min)
    if grid == "scheduler":
        s = torch.linspace(1.0, s_min, num_steps, dtype=torch.float64)  # [T]
    else:
        s = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)  # [T]
    if dynamic is None:
        s = shift * s / (1 + (shift - 1) * s)
    else:
        s = math.exp(dynamic) / (math.exp(dynamic) + (1 / s - 1))
    return torch.cat([s.float(), torch.zeros(1)])  # [T+1]
