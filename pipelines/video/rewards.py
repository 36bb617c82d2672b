"""Video rewards registered in rewards.REWARDS on import of pipelines.video: `video_task` (routes each sample to the
reward of its task: temporal IoU, multiple choice, numeric, free-form accuracy), `temporal_contrast` (T-GRPO's bonus)
and `time_line_marks` (partial credit for a think written as a time line, per temporal group).

The bonus maths live in pipelines/video/advantages.py; these wrappers only route samples and fields.
"""

import re
from typing import Any

import torch

from pipelines.video.advantages import logp_gap_bonus, temporal_gate_bonus
from rewards.api import REWARDS, Reward, load
from rewards.rules import extract_tag


def _as_spec(spec: str | dict) -> tuple[str, dict]:
    if isinstance(spec, str):
        return spec, {}
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(f"reward spec {spec!r} must be a name or a dict with 'name' and optional 'kwargs'")
    return spec["name"], dict(spec.get("kwargs") or {})


class VideoTask(Reward):
    """Per-sample routing on field `category`: grounding -> temporal_iou (field spans), multiple_choice, numeric,
    anything else -> accuracy (field answers)."""

    fields = ("spans", "answers", "category")

    def __init__(self, *, shaping: str, threshold: float, alpha: float, atol: float, rtol: float):
        self.by_task = {
            "grounding": load("temporal_iou", shaping=shaping, threshold=threshold, alpha=alpha),
            "multiple_choice": load("multiple_choice"),
            "numeric": load("numeric", atol=atol, rtol=rtol),
        }
        self.default = load("accuracy")
        self.preprocess = f"temporal IoU (shaping {shaping}) / option letter / number / answer match by category"

    def score(self, samples, prompts, spans=None, answers=None, category=None):
        n = len(samples)
        cats = list(category) if category is not None else ["grounding" if spans is not None else "free_form"] * n
        out = torch.zeros(n)
        for cat in sorted(set(cats)):
            idx = [i for i, c in enumerate(cats) if c == cat]
            reward = self.by_task.get(cat, self.default)
            key = "spans" if cat == "grounding" else "answers"
            values = spans if key == "spans" else answers
            if values is None or any(values[i] is None for i in idx):
                raise ValueError(f"video_task: {cat!r} samples need field {key!r} (one entry per sample)")
            out[idx] = reward([samples[i] for i in idx], **{key: [values[i] for i in idx]})
        return out


@REWARDS.register("video_task", input="text", range="[0, 1]", paper="Video-R1; VideoChat-R1; TempSamp-R1")
def video_task_reward(
    *, shaping: str = "none", threshold: float = 0.8, alpha: float = 1.0, atol: float = 1e-6, rtol: float = 0.0
) -> Reward:
    """Video task reward: temporal IoU (spans) for grounding, option letter / number / answer match for QA."""
    return VideoTask(shaping=shaping, threshold=threshold, alpha=alpha, atol=atol, rtol=rtol)


class TemporalContrast(Reward):
    """T-GRPO's temporal bonus as its own reward column (groupwise): gate on shuffled-frame rollouts (field
    `shuffled_samples`, pipeline temporal=generate) or the per-sample log-prob gap (field `temporal_gap`,
    temporal=logp_gap). Pair it with advantage `grpo_bonus` so the bonus is added after the std normalisation."""

    kind = "groupwise"

    def __init__(self, accuracy: Reward, *, mu: float, alpha: float, min_accuracy: float, gap_scale: float):
        self.accuracy, self.mu, self.alpha, self.min_accuracy, self.gap_scale = (
            accuracy,
            mu,
            alpha,
            min_accuracy,
            gap_scale,
        )
        self.fields = tuple(dict.fromkeys((*accuracy.fields, "shuffled_samples", "temporal_gap", "temporal_off")))
        self.preprocess = f"{accuracy.name} on ordered vs shuffled frames; bonus {alpha}"

    def _acc(self, samples: list, fields: dict[str, Any]) -> torch.Tensor:
        mine = {k: v for k, v in fields.items() if k in self.accuracy.fields}
        return self.accuracy(samples, **mine)

    def score(
        self, samples, prompts, *, group_size, shuffled_samples=None, temporal_gap=None, temporal_off=None, **fields
    ):
        if temporal_off and shuffled_samples is None and temporal_gap is None:
            # `mmgrpo eval`: the policy turns the shuffled-frame pass off (a training signal); no bonus is earned
            return torch.zeros(len(samples))
        acc = self._acc(samples, fields).view(-1, group_size)  # [B, G]
        if temporal_gap is not None:
            gap = torch.as_tensor(temporal_gap, dtype=torch.float32).view(-1, group_size)  # [B, G]
            bonus = logp_gap_bonus(acc, gap, alpha=self.alpha, scale=self.gap_scale, min_accuracy=self.min_accuracy)
            return bonus.reshape(-1)
        if shuffled_samples is None:
            raise ValueError(
                "temporal_contrast needs the shuffled-frame signal: set pipeline.kwargs.temporal to "
                "'generate' (T-GRPO) or 'logp_gap' (no extra generation)"
            )
        rows = []
        for b in range(acc.shape[0]):
            first = b * group_size
            shuffled = list(shuffled_samples[first])
            gt = {k: [v[first]] * len(shuffled) for k, v in fields.items() if v is not None}
            rows.append(self._acc(shuffled, gt))
        shuffled_acc = torch.stack(rows)  # [B, S]
        bonus = temporal_gate_bonus(acc, shuffled_acc, mu=self.mu, alpha=self.alpha, min_accuracy=self.min_accuracy)
        return bonus.reshape(-1)


@REWARDS.register("temporal_contrast", input="text", range="[0, alpha]", paper="Video-R1 T-GRPO (arXiv:2503.21776)")
def temporal_contrast_reward(
    *,
    accuracy: str | dict = "video_task",
    mu: float = 0.8,
    alpha: float = 0.3,
    min_accuracy: float = 0.1,
    gap_scale: float = 1.0,
) -> Reward:
    """T-GRPO temporal bonus column: alpha for correct answers when ordered frames beat shuffled ones (groupwise)."""
    name, kwargs = _as_spec(accuracy)
    return TemporalContrast(load(name, **kwargs), mu=mu, alpha=alpha, min_accuracy=min_accuracy, gap_scale=gap_scale)


_GROUP = re.compile(r"(\d+\.\d)(\D)")  # a temporal group's start label ("2.5"), then its one-character mark


def line_marks(text: str, reference: str) -> float:
    """Jaccard over marked groups: of the temporal groups that the completion's think or the reference time line marks
    (anything but "-", which means nothing there), the share both mark alike; 1 when neither marks any, 0 without a
    think. Think "0.0-0.5+1.0<1.5-" vs reference "0.0-0.5+1.0>1.5-2.0": marked {0.5, 1.0}, alike {0.5} -> 1/2.
    Why not all groups: most are "-" in both, so a plain share is ~0.9 whatever the few deciding marks say."""
    want = dict(_GROUP.findall(reference))
    think = extract_tag(text, "think")
    if not want or think is None:
        return 0.0
    got: dict[str, str] = {}
    for label, mark in _GROUP.findall(think):
        got.setdefault(label, mark)  # a label written twice counts once, as first written
    marked = {label for label, mark in [*want.items(), *got.items()] if mark != "-"}
    if not marked:
        return 1.0
    return sum(got.get(label) == want.get(label) for label in marked) / len(marked)


class TimeLineMarks(Reward):
    """Per-group partial credit on field `reference_think` (a time line; a think without one, or None, scores 0)."""

    fields = ("reference_think",)
    preprocess = "the think's per-group marks against the reference time line"

    def score(self, samples, prompts, reference_think=None):
        # no field at all: a batch of records without a reference (count questions only)
        refs = reference_think if reference_think is not None else [None] * len(samples)
        return torch.tensor([line_marks(s, ref) if ref else 0.0 for s, ref in zip(samples, refs, strict=True)])


@REWARDS.register(
    "time_line_marks", input="text", range="[0, 1]", paper="process reward (Lightman et al., arXiv:2305.20050)"
)
def time_line_marks_reward() -> Reward:
    """Process reward for time-line thinks: the share of temporal groups marked as the reference marks them."""
    return TimeLineMarks()
