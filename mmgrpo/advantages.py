"""Advantage estimators: pure functions from group rewards [B, G] (or [B, G, R], [B, G, G]) to float32 [B, G].

All are registered in ADVANTAGES and reached through `compute(name, rewards, **kw)`; no trainer state or configs here.
"""

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from mmgrpo.registry import Registry

ADVANTAGES = Registry("advantage estimator")

# meta["input"] says which reward tensor an estimator takes; meta["mask"] (optional) is a loss-mask hook
_INPUT_NDIM = {"scalar": 2, "multi": 3, "pairwise": 3}
_INPUT_SHAPE = {"scalar": "[B, G]", "multi": "[B, G, R]", "pairwise": "[B, G, G]"}


# ----------------------------------------------------------------------------- helpers: validation and shared maths


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


# ----------------------------------------------------------------------------- estimators


@ADVANTAGES.register("grpo", input="scalar")
def grpo(
    rewards: Tensor,
    *,
    std: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-6,
    ddof: int = 1,
    singleton: Literal["zero", "raw"] = "zero",
) -> Tensor:
    """Group-relative advantage: reward minus its group mean, divided by a std (or not: Dr. GRPO).

    GRPO arXiv:2402.03300; std="none" is Dr. GRPO arXiv:2503.20783.
    A_bg = (r_bg - mean_g(r_b)) / (S + eps), S = std of group b ("group"), of all B*G rewards ("batch"), or 1 with
    eps=0 ("none"). All-equal groups give exactly 0.

    Args:
        rewards: [B, G] scalar rewards, any real dtype.
        std: "group" (TRL, verl, DanceGRPO), "batch" (Flow-GRPO `global_std`, TRL `scale_rewards="batch"`), "none".
        eps: added to S: verl/EasyR1 1e-6 (default), TRL/Flow-GRPO 1e-4, DanceGRPO/Pref-GRPO 1e-8, OpenRLHF 1e-9.
        ddof: 1 = unbiased (torch.std default; TRL, verl, EasyR1, DanceGRPO, Pref-GRPO: the majority, hence the
            default); 0 = population (np.std; Flow-GRPO).
        singleton: G = 1 has no baseline: "zero" (TRL) gives 0, "raw" (verl: mean 0, std 1) the raw reward.

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards)
    _check_norm(std, eps, ddof)
    _check_choice("singleton", singleton, ("zero", "raw"))
    if r.shape[1] == 1:
        return _out(r if singleton == "raw" else torch.zeros_like(r))
    return _out(_normalise(r, std=std, eps=eps, ddof=ddof))


@ADVANTAGES.register("rloo", input="scalar")
def rloo(rewards: Tensor) -> Tensor:
    """REINFORCE leave-one-out: reward minus the mean of the other G - 1 rewards of its group.

    RLOO arXiv:2402.14740.
    A_bi = r_bi - sum_{j != i} r_bj / (G - 1) = G / (G - 1) * (r_bi - mean_g(r_b)); G = 1 gives 0.

    Args:
        rewards: [B, G] scalar rewards.

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards)
    G = r.shape[1]
    if G == 1:
        return _out(torch.zeros_like(r))
    adv = (r - r.mean(-1, keepdim=True)) * (G / (G - 1))  # [B, G]
    return _out(torch.where(_flat(r), 0.0, adv))


def _mc_grpo_mask(rewards: Tensor, *, exclude_pivot: bool = True, **_: object) -> Tensor:
    r = _check_rewards(rewards)
    keep = torch.ones_like(r, dtype=torch.bool)  # [B, G]
    if exclude_pivot and r.shape[1] % 2:
        keep &= ~_pivot(r)
    return keep


@ADVANTAGES.register("mc_grpo", input="scalar", mask=_mc_grpo_mask)
def mc_grpo(
    rewards: Tensor,
    *,
    scale: Literal["mad", "std", "none"] = "mad",
    eps: float = 1e-3,
    ddof: int = 1,
    exclude_pivot: bool = True,
    rescale_nonzero: bool = False,
) -> Tensor:
    """Median-centred GRPO: reward minus its group median, scaled by the MAD; the median sample (pivot) gets 0.

    MC-GRPO arXiv:2601.22582 (roll out G + 1 so the group is odd; the pivot is left out of the loss).
    A_bg = (r_bg - med_b) / (S_b + eps), S_b = median_g |r_bg - med_b| ("mad"), group std ("std") or 1 with eps=0.

    Defaults follow the authors' code (MAD + 1e-3); their trainer also multiplies each group's non-zero advantages
    by G / (their count) (`rescale_nonzero=True`). Caution: the MAD is 0 when over half a group ties (common with
    0/1 rewards), giving (r - med) / eps = +-1000; Adam absorbs that scale, a KL term does not: prefer scale="std" or
    "none" for binary rewards. Even G: median = mean of the two middle values, no pivot. Odd G: the pivot is the
    lowest-index sample equal to the median (exactly one); `loss_mask` drops it when `exclude_pivot`.

    Args:
        rewards: [B, G] scalar rewards (G odd in the paper's setting).
        scale: "mad" (paper), "std" (group std with `ddof`), "none" (median-centred only).
        eps: added to S; must be > 0 with "mad" (the MAD is often 0).
        ddof: for scale="std" only.
        exclude_pivot: read by `loss_mask` only.
        rescale_nonzero: multiply the group's non-zero advantages (samples not tied with the median) by G / their
            count, as the authors' trainer does; all-equal groups stay 0.

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards)
    _check_choice("scale", scale, ("mad", "std", "none"))
    _check_norm("group", eps, ddof)
    if scale == "mad" and eps <= 0:
        raise ValueError(f"eps={eps!r} must be > 0 with scale='mad': the MAD is 0 when over half a group ties")
    for arg, value in (("exclude_pivot", exclude_pivot), ("rescale_nonzero", rescale_nonzero)):
        if not isinstance(value, bool):
            raise ValueError(f"{arg}={value!r} must be True or False")
    if r.shape[1] == 1:
        return _out(torch.zeros_like(r))
    med = _median(r)  # [B, 1]
    centred = r - med  # [B, G]; exactly 0 on samples equal to the median
    if rescale_nonzero:
        nonzero = (centred != 0).sum(-1, keepdim=True)  # [B, 1]
        centred = centred * (r.shape[1] / nonzero.clamp_min(1))  # [B, G]
    if scale == "none":
        return _out(centred)
    S = _median((r - med).abs()) if scale == "mad" else r.std(-1, correction=ddof, keepdim=True)  # [B, 1]
    denom = torch.where(_flat(r), 1.0, S + eps)  # [B, 1]
    return _out(centred / denom)


@ADVANTAGES.register("passk", input="scalar")
def passk(
    rewards: Tensor, *, std: Literal["group", "none"] = "group", eps: float = 1e-6, ddof: int = 1
) -> Tensor:
    """Pass@k advantage: only the best sample of a group moves, by its margin over the runner-up.

    Pass@k training as in verl `grpo_passk`, which cites arXiv:2503.19595.
    A_b,best = (r_(1) - r_(2)) / (std_g(r_b) + eps), every other sample 0 (r_(1) >= r_(2): the top two rewards).
    Ties for the maximum give a zero margin; the best index is the lowest one. Not zero-mean by design.

    Args:
        rewards: [B, G] scalar rewards.
        std: "group" divides the margin by the group std (verl default), "none" leaves it raw.
        eps, ddof: added to the std; its correction (1 = unbiased, as verl).

    Returns:
        [B, G] float32 advantages.
    """
    r = _check_rewards(rewards)
    _check_norm(std, eps, ddof, stds=("group", "none"))
    if r.shape[1] == 1:
        return _out(torch.zeros_like(r))
    top2 = r.topk(2, dim=-1).values  # [B, 2]
    margin = top2[:, :1] - top2[:, 1:]  # [B, 1]
    if std == "group":
        denom = r.std(-1, correction=ddof, keepdim=True) + eps  # [B, 1]
        margin = torch.where(margin == 0, 0.0, margin / torch.where(margin == 0, 1.0, denom))
    best = r.argmax(-1, keepdim=True)  # [B, 1]
    return _out(torch.zeros_like(r).scatter_(-1, best, margin))


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


def _lerp(start: float, end: float | None, progress: float) -> float:
    return start if end is None else start + (end - start) * progress


def _asymmetric_mask(rewards: Tensor, *, base: str = "grpo", base_kwargs: dict | None = None, **_: object) -> Tensor:
    return loss_mask(base, rewards, **(base_kwargs or {}))


def _difficulty_weight(r: Tensor) -> Tensor:
    """A-GRAE's easy-to-hard weight [B, 1] from group accuracy p_b and batch accuracy acc (rewards in [0, 1])."""
    if bool((r < 0).any() or (r > 1).any()):
        raise ValueError("difficulty_focus needs rewards in [0, 1] (accuracies); rescale them or turn it off")
    root = r.mean(-1, keepdim=True).sqrt()  # [B, 1]
    acc = r.mean()
    # 1e-6 as in the authors' code; groups with p in {0, 1} are flat, so their advantage is 0 whatever the weight
    return (1 - acc) * 0.5 / (1 - root + 1e-6) + acc * 0.5 / (root + 1e-6)  # [B, 1]


@ADVANTAGES.register("asymmetric", input="scalar", mask=_asymmetric_mask)
def asymmetric(
    rewards: Tensor,
    *,
    base: str = "grpo",
    base_kwargs: dict | None = None,
    pos_scale: float = 1.0,
    pos_scale_end: float | None = None,
    neg_scale: float = 1.0,
    neg_scale_end: float | None = None,
    accuracy_gate: float | None = None,
    difficulty_focus: bool = False,
    progress: float = 0.0,
) -> Tensor:
    """Asymmetric advantages: a base estimator's output with positives and negatives scaled apart, on a schedule.

    A-GRAE arXiv:2602.05548 (suppressing the advantages of correct samples early encourages exploration).
    A = s_pos(p) * gate * max(D * A_base, 0) + s_neg(p) * min(D * A_base, 0), s(p) = s + (s_end - s) * p (s if no
    end), gate = clip(mean(r) / accuracy_gate, 0, 1) or 1, D = difficulty weight or 1.

    Schedule by training progress (`pos_scale=0.5, pos_scale_end=1.0` suppresses positives early) or, as the paper's
    code, by batch accuracy: `accuracy_gate=1.0` (math; 0.5 geometry/medical). `difficulty_focus` adds its curriculum
    weight D_b = (1 - acc) / (2 (1 - sqrt p_b)) + acc / (2 sqrt p_b) (p_b group mean, acc batch mean reward): easy
    groups first, hard ones as accuracy rises. Authors' recipe: accuracy_gate=1.0, difficulty_focus=True on "grpo".
    Accuracy options need [B, G] rewards in [0, 1]. Not zero-mean once the two scales differ: that is the point.

    Args:
        rewards: what `base` takes ([B, G] for the default).
        base: a registered estimator name (not "asymmetric").
        base_kwargs: keyword arguments for `base`, checked against its signature (`progress` is passed on).
        pos_scale, pos_scale_end: multiplier of positive advantages at progress 0 and 1 (linear in between), >= 0.
        neg_scale, neg_scale_end: the same for negative advantages.
        accuracy_gate: if set (> 0), positives are also multiplied by clip(mean reward / accuracy_gate, 0, 1).
        difficulty_focus: multiply by A-GRAE's difficulty weight D_b before the sign-dependent scaling.
        progress: fraction of training done, in [0, 1]; the trainer fills it in.

    Returns:
        [B, G] float32 advantages.
    """
    if base == "asymmetric":
        raise ValueError("base='asymmetric' would recurse; pick a plain estimator such as 'grpo' or 'rloo'")
    fn = ADVANTAGES.get(base)
    kw = dict(base_kwargs or {})
    _check_kwargs(base, kw, field="base_kwargs")
    progress = _check_number("progress", progress, high=1.0)
    if "progress" in inspect.signature(fn).parameters:
        kw.setdefault("progress", progress)
    for arg, value in (("pos_scale", pos_scale), ("neg_scale", neg_scale), ("pos_scale_end", pos_scale_end),
                       ("neg_scale_end", neg_scale_end)):
        if value is not None:
            _check_number(arg, value)
    if not isinstance(difficulty_focus, bool):
        raise ValueError(f"difficulty_focus={difficulty_focus!r} must be True or False")
    adv = fn(rewards, **kw)
    adv = adv.to(_work_dtype(adv.device))  # [B, G]
    pos, neg = _lerp(pos_scale, pos_scale_end, progress), _lerp(neg_scale, neg_scale_end, progress)
    if accuracy_gate is not None or difficulty_focus:
        r = _check_rewards(rewards)  # the accuracy options read the raw [B, G] rewards
        if difficulty_focus:
            adv = adv * _difficulty_weight(r)  # [B, G]
        if accuracy_gate is not None:
            pos = pos * float((r.mean() / _check_number("accuracy_gate", accuracy_gate, low=1e-12)).clamp(0, 1))
    return _out(torch.where(adv > 0, adv * pos, adv * neg))


# ----------------------------------------------------------------------------- public entry points


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


def names() -> list[str]:
    """Registered estimator names, sorted."""
    return ADVANTAGES.names()


def describe() -> dict[str, str]:
    """name -> one-line summary (first docstring line)."""
    return ADVANTAGES.describe()
