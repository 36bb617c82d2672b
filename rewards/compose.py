"""Composition rewards: Trust-GRPO weighting and the GRPO-CARE bonus; RewardSet re-exported from the core.

The maths (trust_weight, consistency_bonus) are pure functions on [B, G]; the wrappers only route samples and fields.
RewardSet (named weighted rewards -> [N, R] and total) is the engine's, so it lives in mmgrpo/reward.py.
"""

import math

import torch
from torch import Tensor

from mmgrpo.reward import RewardSet, parse_spec  # noqa: F401  RewardSet re-exported: rewards.compose.RewardSet
from rewards.api import REWARDS, Reward, load


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
        name, _, kwargs, _ = parse_spec(0, spec)
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
    name, _, kwargs, _ = parse_spec(0, accuracy)
    return CareBonus(load(name, **kwargs), margin=margin, coef=coef, min_accuracy=min_accuracy)
