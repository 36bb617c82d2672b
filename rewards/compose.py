"""Composition: RewardSet (named weighted rewards -> [N, R] and total), Trust-GRPO weighting, GRPO-CARE bonus.

The maths (trust_weight, consistency_bonus) are pure functions on [B, G]; the wrappers only route samples and fields.
"""

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rewards.api import REWARDS, Reward, RewardError, as_sample_list, load


def _spec(i: int, spec: Any) -> tuple[str, float, dict, str]:
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(
            f"reward spec {i} must be a dict with a 'name' (and optional 'weight', 'kwargs', 'label'), got {spec!r}"
        )
    extra = set(spec) - {"name", "weight", "kwargs", "label"}
    if extra:
        raise ValueError(
            f"reward spec {i} ({spec['name']!r}) has unknown key(s) {sorted(extra)}; use name, weight, kwargs, label"
        )
    weight = spec.get("weight", 1.0)
    if not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ValueError(f"reward spec {i} ({spec['name']!r}): weight={weight!r} must be a finite number")
    kwargs = dict(spec.get("kwargs") or {})
    return spec["name"], float(weight), kwargs, str(spec.get("label") or spec["name"])


def _with_defaults(name: str, kwargs: dict, defaults: dict) -> dict:
    """Add device/dtype to kwargs when the factory accepts them and the spec did not set them."""
    if name.startswith(("http://", "https://")):
        return kwargs
    params = inspect.signature(REWARDS.get(name)).parameters
    return {**{k: v for k, v in defaults.items() if k in params and k not in kwargs}, **kwargs}


class RewardSet:
    """Named rewards with weights: `reward_set(samples, prompts, group_size=G, **fields) -> ([N, R], [N])`.

    The per-reward scores [N, R] are what GDPO normalises one by one; total = per_reward @ weights.
    Specs: [{"name": "pickscore", "weight": 1.0, "kwargs": {...}}, ...]; a name may also be an HTTP URL.
    Each reward receives only the fields it declares. NaN/inf scores pass through untouched (the trainer reports them).
    """

    def __init__(
        self, specs: Sequence[dict | str], *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ):
        if not specs:
            raise ValueError("RewardSet needs at least one reward spec, e.g. [{'name': 'format', 'weight': 1.0}]")
        parsed = [_spec(i, s) for i, s in enumerate(specs)]
        for name, _, kwargs, _ in parsed:
            if not name.startswith(("http://", "https://")):
                REWARDS.get(name)  # unknown name -> ValueError listing the choices, before any model loads
                REWARDS.check_kwargs(name, kwargs, field=f"reward {name!r} kwargs")
        # labels name the columns (metrics reward/<label>/mean); one reward may appear twice with other kwargs
        self.names = [label for _, _, _, label in parsed]
        if len(set(self.names)) != len(self.names):
            raise ValueError(
                f"reward labels must be unique in a RewardSet, got {self.names}; give repeated "
                "rewards a 'label', e.g. {name: shapes_geneval, label: strict, kwargs: {mode: strict}}"
            )
        self.weights = torch.tensor([w for _, w, _, _ in parsed], dtype=torch.float32)  # [R]
        defaults = {"device": device, "dtype": dtype}
        self.rewards = [load(name, **_with_defaults(name, kw, defaults)) for name, _, kw, _ in parsed]

    def __len__(self) -> int:
        return len(self.rewards)

    def __call__(
        self, samples: Any, prompts: Sequence[str] | None = None, *, group_size: int | None = None, **fields: Any
    ) -> tuple[Tensor, Tensor]:
        samples = as_sample_list(samples)
        cols = [
            self._score_one(name, r, samples, prompts, group_size, fields) for name, r in zip(self.names, self.rewards)
        ]
        per_reward = torch.stack(cols, dim=1)  # [N, R]
        total = per_reward @ self.weights  # [N]
        return per_reward, total

    def _score_one(self, name: str, reward: Reward, samples: list, prompts, group_size, fields) -> Tensor:
        mine = {k: v for k, v in fields.items() if k in getattr(reward, "fields", ())}
        if reward.kind == "groupwise":
            mine["group_size"] = group_size
        try:
            return reward(samples, prompts, **mine)
        except Exception as err:
            index = _find_failing(reward, samples, prompts, mine) if reward.kind == "pointwise" else None
            where = f"on sample {index}" if index is not None else "on the batch (no single sample fails alone)"
            raise RewardError(
                f"reward {name!r} failed {where} ({type(err).__name__}): {err}", reward_name=name, sample_index=index
            ) from err


def _find_failing(reward: Reward, samples: list, prompts, fields: dict) -> int | None:
    """Re-score one sample at a time (only after the batch call failed) and return the first failing index."""
    if len(samples) < 2:
        return 0
    for i in range(len(samples)):
        one = {
            k: (v[i : i + 1] if v is not None and hasattr(v, "__getitem__") and not isinstance(v, str) else v)
            for k, v in fields.items()
        }
        try:
            reward(samples[i : i + 1], None if prompts is None else list(prompts)[i : i + 1], **one)
        except Exception:  # noqa: BLE001  whatever the batch raised, a sample raising alone is the culprit
            return i
    return None


def trust_weight(
    answer: Tensor,
    thinking: Tensor,
    *,
    step: int,
    anneal_steps: float = 300.0,
    base: float = 0.3,
    correct_threshold: float = 0.5,
    solved: float = 0.9,
    failed: float = 0.1,
) -> Tensor:
    """Per-group weight of the thinking reward in SophiaVL-R1's Trust-GRPO (arXiv:2505.17018).

    w = base * exp(-step / T) * (exp(mean_think_correct - mean_think_wrong) if that gap < 0 else 1), and w = 0 for
    a group whose answers all score >= solved or all <= failed: the authors' reward code
    (kxfan2002/SophiaVL-R1, verl/workers/reward/custom.py) gives such groups no thinking reward, so a flat group
    keeps a zero advantage. A group mixing partial scores with no wrong (or no correct) answer keeps trust 1.

    Args:
        answer: [B, G] outcome scores; >= correct_threshold counts as correct.
        thinking: [B, G] thinking-reward scores in [0, 1].
        solved, failed: all-solved / all-failed bounds of the answer score (the authors' 0.9 and 0.1).
    Returns:
        [B, 1] weight applied to the thinking reward of every sample of the group.
    """
    if answer.shape != thinking.shape or answer.dim() != 2:
        raise ValueError(f"answer {tuple(answer.shape)} and thinking {tuple(thinking.shape)} must both be [B, G]")
    if anneal_steps <= 0:
        raise ValueError(f"anneal_steps={anneal_steps} must be > 0")
    correct = (answer >= correct_threshold).to(thinking.dtype)  # [B, G]
    wrong = 1.0 - correct  # [B, G]
    n_c, n_w = correct.sum(1), wrong.sum(1)  # [B]
    mean_c = (thinking * correct).sum(1) / n_c.clamp(min=1)  # [B]
    mean_w = (thinking * wrong).sum(1) / n_w.clamp(min=1)  # [B]
    gap = torch.where((n_c > 0) & (n_w > 0), mean_c - mean_w, torch.zeros_like(mean_c))  # [B]
    trust = torch.exp(gap.clamp(max=0.0))  # [B]
    flat = (answer >= solved).all(1) | (answer <= failed).all(1)  # [B] all solved or all failed
    trust = torch.where(flat, torch.zeros_like(trust), trust)  # [B]
    return (base * math.exp(-step / anneal_steps) * trust).unsqueeze(1)  # [B, 1]


def consistency_bonus(
    accuracy: Tensor, likelihood: Tensor, *, margin: float = 0.01, coef: float = 0.5, min_accuracy: float = 0.1
) -> Tensor:
    """GRPO-CARE's consistency bonus (arXiv:2506.16141) for samples whose answer follows from their reasoning.

    accurate_i = acc_i > min_accuracy and acc_i >= mean_g(acc); bonus_i = coef * acc_i
    if accurate_i and p_i >= mean_{accurate}(p) - margin, else 0 (p = reference likelihood of the answer).

    Args:
        accuracy: [B, G] answer scores.  likelihood: [B, G] reference-model answer likelihood given the reasoning.
    Returns:
        [B, G] bonus to add to the reward.
    """
    if accuracy.shape != likelihood.shape or accuracy.dim() != 2:
        raise ValueError(f"accuracy {tuple(accuracy.shape)} and likelihood {tuple(likelihood.shape)} must be [B, G]")
    accurate = (accuracy > min_accuracy) & (accuracy >= accuracy.mean(1, keepdim=True))  # [B, G]
    acc_f = accurate.to(likelihood.dtype)  # [B, G]
    ref = (likelihood * acc_f).sum(1, keepdim=True) / acc_f.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
    gets = accurate & (likelihood >= ref - margin)  # [B, G]
    return torch.where(gets, coef * accuracy, torch.zeros_like(accuracy))  # [B, G]


def _pick(fields: dict, reward: Reward) -> dict:
    return {k: v for k, v in fields.items() if k in reward.fields}


class TrustGRPO(Reward):
    """answer + trust_weight * thinking, per group (SophiaVL-R1); needs fields of both rewards plus `step`."""

    kind = "groupwise"

    def __init__(
        self,
        answer: Reward,
        thinking: Reward,
        *,
        anneal_steps: float,
        base: float,
        correct_threshold: float,
        gate: float,
    ):
        self.answer, self.thinking = answer, thinking
        self.anneal_steps, self.base, self.correct_threshold, self.gate = anneal_steps, base, correct_threshold, gate
        self.input = answer.input
        self.fields = tuple(dict.fromkeys((*answer.fields, *thinking.fields, "step")))
        self.required = ("step",)
        self.preprocess = f"answer={answer.name} + trust * thinking={thinking.name}"

    def score(self, samples, prompts, *, group_size, step, **fields):
        a = self.answer(samples, prompts, **_pick(fields, self.answer))  # [N]
        t = self.thinking(samples, prompts, **_pick(fields, self.thinking))  # [N]
        t = torch.where(a >= self.gate, t, torch.zeros_like(t))  # SophiaVL skips the thinking RM for wrong answers
        a2, t2 = a.view(-1, group_size), t.view(-1, group_size)  # [B, G]
        w = trust_weight(
            a2,
            t2,
            step=int(step[0] if isinstance(step, list | tuple) else step),
            anneal_steps=self.anneal_steps,
            base=self.base,
            correct_threshold=self.correct_threshold,
        )
        return (a2 + w * t2).reshape(-1)  # [N]


@REWARDS.register(
    "trust_grpo",
    input="text",
    kind="groupwise",
    range="answer range + [0, base]",
    paper="SophiaVL-R1 (arXiv:2505.17018)",
)
def trust_grpo(
    *,
    answer: str | dict = "accuracy",
    thinking: str | dict = "format",
    anneal_steps: float = 300.0,
    base: float = 0.3,
    correct_threshold: float = 0.5,
    gate: float = 0.2,
) -> Reward:
    """Trust-GRPO: outcome reward + annealed, trust-weighted thinking reward (groupwise; field `step`)."""

    def sub(spec):
        name, _, kwargs, _ = _spec(0, spec)
        return load(name, **kwargs)

    return TrustGRPO(
        sub(answer),
        sub(thinking),
        anneal_steps=anneal_steps,
        base=base,
        correct_threshold=correct_threshold,
        gate=gate,
    )


class CareBonus(Reward):
    """accuracy + GRPO-CARE consistency bonus; the pipeline passes field `likelihood` (EMA-reference answer prob)."""

    kind = "groupwise"

    def __init__(self, accuracy: Reward, *, margin: float, coef: float, min_accuracy: float):
        self.accuracy, self.margin, self.coef, self.min_accuracy = accuracy, margin, coef, min_accuracy
        self.input = accuracy.input
        self.fields = tuple(dict.fromkeys((*accuracy.fields, "likelihood")))
        self.required = ("likelihood",)
        self.preprocess = f"{accuracy.name} + consistency bonus"

    def score(self, samples, prompts, *, group_size, likelihood, **fields):
        acc = self.accuracy(samples, prompts, **_pick(fields, self.accuracy))
        p = torch.as_tensor(likelihood, dtype=torch.float32).reshape(-1, group_size)  # [B, G]
        a = acc.view(-1, group_size)  # [B, G]
        bonus = consistency_bonus(a, p, margin=self.margin, coef=self.coef, min_accuracy=self.min_accuracy)
        return (a + bonus).reshape(-1)  # [N]


@REWARDS.register(
    "grpo_care",
    input="text",
    kind="groupwise",
    range="accuracy range * (1 + coef)",
    paper="GRPO-CARE (arXiv:2506.16141)",
)
def grpo_care(
    *, accuracy: str | dict = "accuracy", margin: float = 0.01, coef: float = 0.5, min_accuracy: float = 0.1
) -> Reward:
    """GRPO-CARE: accuracy plus a consistency bonus from field `likelihood` (groupwise hook for the VLM pipeline)."""
    name, _, kwargs, _ = _spec(0, accuracy)
    return CareBonus(load(name, **kwargs), margin=margin, coef=coef, min_accuracy=min_accuracy)
