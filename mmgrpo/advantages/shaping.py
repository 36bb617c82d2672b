"""Estimators that reshape another estimator's output: A-GRAE's asymmetric, scheduled scaling."""

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from mmgrpo.advantages._common import (
    ADVANTAGES,
    _check_kwargs,
    _check_number,
    _check_rewards,
    _out,
    _work_dtype,
    loss_mask,
)


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


def _check_scales(*, difficulty_focus: object, **scales: float | None) -> None:
    for arg, value in scales.items():
        if value is not None:
            _check_number(arg, value)
    if not isinstance(difficulty_focus, bool):
        raise ValueError(f"difficulty_focus={difficulty_focus!r} must be True or False")


def _base_estimator(base: str, base_kwargs: dict | None, progress: float) -> tuple[Callable, dict, float]:
    """asymmetric's base estimator, its checked kwargs (`progress` passed on if it takes one) and the checked progress."""
    if base == "asymmetric":
        raise ValueError("base='asymmetric' would recurse; pick a plain estimator such as 'grpo' or 'rloo'")
    fn = ADVANTAGES.get(base)
    kw = dict(base_kwargs or {})
    _check_kwargs(base, kw, field="base_kwargs")
    progress = _check_number("progress", progress, high=1.0)
    if "progress" in inspect.signature(fn).parameters:
        kw.setdefault("progress", progress)
    return fn, kw, progress


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
    fn, kw, progress = _base_estimator(base, base_kwargs, progress)
    _check_scales(
        pos_scale=pos_scale,
        neg_scale=neg_scale,
        pos_scale_end=pos_scale_end,
        neg_scale_end=neg_scale_end,
        difficulty_focus=difficulty_focus,
    )
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
