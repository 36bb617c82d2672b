"""The estimator registry and the validation and group maths every estimator shares (no estimator lives here)."""

import inspect
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from mmgrpo.registry import Registry

ADVANTAGES = Registry("advantage estimator")

# meta["input"] says which reward tensor an estimator takes; meta["mask"] (optional) is a loss-mask hook
_INPUT_NDIM = {"scalar": 2, "multi": 3, "pairwise": 3}
_INPUT_SHAPE = {"scalar": "[B, G]", "multi": "[B, G, R]", "pairwise": "[B, G, G]"}


def _work_dtype(device: torch.device) -> torch.dtype:
    # float64 so that golden values hold to 1e-12; MPS has no float64
    return torch.float32 if device.type == "mps" else torch.float64


def _check_rewards(rewards: Tensor, *, input: str = "scalar", what: str = "rewards") -> Tensor:
    """Validate shape and finiteness; return the rewards upcast to the working dtype."""
    shape = _INPUT_SHAPE[input]
    if not isinstance(rewards, Tensor):
        raise ValueError(f"{what} must be a torch.Tensor shaped {shape}, got {type(rewards).__name__}")
    if rewards.is_complex():
        raise ValueError(f"{what} must be real, got dtype {rewards.dtype}")
    if rewards.dim() != _INPUT_NDIM[input]:
        raise ValueError(f"{what} must be shaped {shape}, got {tuple(rewards.shape)} (B prompts x G samples)")
    if rewards.shape[0] == 0 or rewards.shape[1] == 0 or rewards.numel() == 0:
        raise ValueError(f"{what} {tuple(rewards.shape)} is empty; need at least one prompt (B) and one sample (G)")
    if input == "pairwise" and rewards.shape[1] != rewards.shape[2]:
        raise ValueError(f"{what} must be square [B, G, G], got {tuple(rewards.shape)}")
    r = rewards.to(_work_dtype(rewards.device))
    bad = ~torch.isfinite(r)
    if input == "pairwise":  # the diagonal (self-comparison) is ignored, so it may hold anything
        bad &= ~torch.eye(r.shape[1], dtype=torch.bool, device=r.device)
    if bad.any():
        n_nan, n_inf = int(torch.isnan(r)[bad].sum()), int(torch.isinf(r)[bad].sum())
        where = [tuple(i) for i in bad.nonzero().tolist()]
        more = f" (first 5 of {len(where)})" if len(where) > 5 else ""
        raise ValueError(
            f"{what} holds {n_nan} NaN and {n_inf} infinite value(s) at {where[:5]}{more}; advantages need finite "
            f"rewards: re-score or drop those samples (the trainer skips such updates)"
        )
    return r


def _check_choice(arg: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{arg}={value!r} is not supported; choose from {', '.join(map(repr, choices))}")


def _check_number(arg: str, value: object, *, low: float = 0.0, high: float = float("inf")) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or not low <= float(value) <= high:
        raise ValueError(f"{arg}={value!r} must be a finite number in [{low}, {high}]")
    return float(value)


def _check_norm(std: str, eps: float, ddof: int, stds: Sequence[str] = ("group", "batch", "none")) -> None:
    _check_choice("std", std, stds)
    _check_number("eps", eps)
    if isinstance(ddof, bool) or ddof not in (0, 1):
        raise ValueError(f"ddof={ddof!r} must be 0 (population std, Flow-GRPO) or 1 (unbiased, torch/TRL/verl)")


def _flat(r: Tensor) -> Tensor:
    """True for groups whose rewards are all equal, shape [B, 1]; such groups get exactly 0."""
    return r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True)  # [B, 1]


def _normalise(r: Tensor, *, std: str, eps: float, ddof: int) -> Tensor:
    """(r - group mean) / (scale + eps) on [B, G] with G >= 2; all-equal groups give exactly 0 (even with eps=0)."""
    flat = _flat(r)  # [B, 1]
    # float sums do not cancel exactly (3 x 0.1 != 0.3), so flat groups are zeroed explicitly, not by arithmetic
    centred = torch.where(flat, 0.0, r - r.mean(-1, keepdim=True))  # [B, G]
    if std == "none":
        return centred
    if std == "group":
        scale = r.std(-1, correction=ddof, keepdim=True)  # [B, 1]
    else:  # "batch": one std over every reward in the batch, centring stays per group (TRL, Flow-GRPO global_std)
        scale = r.std(correction=ddof).expand(r.shape[0], 1)  # [B, 1]
    denom = torch.where(flat, 1.0, scale + eps)  # a non-flat group has scale > 0, so only flat ones could divide by 0
    return centred / denom  # [B, G]


def _whiten(x: Tensor, *, eps: float, ddof: int) -> Tensor:
    """(x - mean) / (std + eps) over the whole tensor; a constant tensor gives exactly 0."""
    if bool(x.amax() == x.amin()):
        return torch.zeros_like(x)
    return (x - x.mean()) / (x.std(correction=ddof) + eps)


def _median(r: Tensor) -> Tensor:
    """True median over the last dim (mean of the two middle values for even G), shape [B, 1]."""
    s = r.sort(-1).values  # [B, G]
    G = r.shape[-1]
    if G % 2:
        return s[:, G // 2 : G // 2 + 1]  # [B, 1]
    return (s[:, G // 2 - 1 : G // 2] + s[:, G // 2 : G // 2 + 1]) / 2  # [B, 1]


def _pivot(r: Tensor) -> Tensor:
    """One-hot [B, G] of the pivot for odd G: the lowest-index sample whose reward equals the group median."""
    is_med = r == _median(r)  # [B, G]; for odd G the median is a member, so each row has at least one True
    first = is_med.to(torch.int8).argmax(-1, keepdim=True)  # [B, 1]; argmax returns the first maximal index
    return torch.zeros_like(is_med).scatter_(-1, first, True)  # [B, G]


def _out(adv: Tensor) -> Tensor:
    return adv.to(torch.float32)


def _check_kwargs(name: str, kw: dict, field: str = "kwargs") -> None:
    # the first parameter (the reward tensor) is positional in compute(), so it is not a keyword choice
    first = next(iter(inspect.signature(ADVANTAGES.get(name)).parameters))
    ADVANTAGES.check_kwargs(name, kw, field=field, skip=(first,))


# ----------------------------------------------------------------------------- entry points (re-exported)


def compute(name: str, rewards: Tensor, **kw: object) -> Tensor:
    """Advantages of estimator `name` as float32 [B, G]; unknown names and keywords raise ValueError.

    Contract with the trainer: an estimator whose signature has `progress` (fraction of training done, in [0, 1])
    gets it filled in automatically; every other keyword comes from the config's advantage kwargs.
    """
    fn = ADVANTAGES.get(name)
    _check_kwargs(name, kw)
    return _out(fn(rewards, **kw))


def loss_mask(name: str, rewards: Tensor, **kw: object) -> Tensor:
    """Bool [B, G]: which samples enter the loss under estimator `name` (all True unless its `mask` hook says no)."""
    _check_kwargs(name, kw)
    meta = ADVANTAGES.meta(name)
    hook: Callable[..., Tensor] | None = meta.get("mask")
    if hook is not None:  # a hook validates its own input: asymmetric's depends on its base
        return hook(rewards, **kw)
    r = _check_rewards(rewards, input=meta.get("input", "scalar"))
    return torch.ones(r.shape[:2], dtype=torch.bool, device=r.device)
