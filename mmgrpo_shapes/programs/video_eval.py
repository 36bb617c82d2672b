"""Scores of the ShapesWorld video model (pretrain_video.py): greedy answers under real, blank, other-clip or
shuffled frames, per question type (mIoU and R@0.5 for grounding, exact-answer accuracy for direction, order and
count), and the image-blind baselines they are compared with (assets/README.md)."""

import functools
from collections import Counter, defaultdict
from typing import Any

import numpy as np
from torch import nn

import rewards
from mmgrpo_shapes.programs.tiny_vlm import predict
from mmgrpo_shapes.programs.video_probe import condition_records, frame_encoder
from mmgrpo_shapes.video import VIDEO_TYPES
from mmgrpo_shapes.video_think import target_text
from mmgrpo_shapes.vqa import question_template

NUM_FRAMES = 32
"""frames per clip and frames sampled (configs/video: shapes_frames = num_frames = 32)"""
MAX_NEW_TOKENS = 96
"""grounding's target on an 8 s clip, the 67-character time line (`time_line`), the span, the tags and <|im_end|>, is 84
tokens (the tokenizer is character-level); the longest QA target, an order question's time line and "yellow
triangle", is 87 (configs/video: max_new_tokens 96 for grounding and for QA)"""


def score(texts: list[str], recs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per-type means: format (strict), mIoU and R@0.5 (grounding) or accuracy (QA types), and n."""
    fmt = rewards.load("format", mode="strict")(texts, prompts=None).tolist()
    iou, acc = rewards.load("temporal_iou"), rewards.load("accuracy")
    table: dict[str, dict[str, float]] = {}
    for kind in VIDEO_TYPES:
        idx = [i for i, r in enumerate(recs) if r["type"] == kind]
        if not idx:
            continue
        sub = [texts[i] for i in idx]
        row = {"n": len(idx), "format": sum(fmt[i] for i in idx) / len(idx)}
        if kind == "grounding":
            v = iou(sub, prompts=None, spans=[recs[i]["spans"] for i in idx]).float()
            row |= {"miou": float(v.mean()), "r@0.5": float((v >= 0.5).float().mean())}
        else:
            row["accuracy"] = float(acc(sub, prompts=None, answers=[recs[i]["answers"] for i in idx]).float().mean())
        table[kind] = row
    return table


def evaluate(
    model: nn.Module, processor, recs: list[dict[str, Any]], *, condition: str = "real", blank: str | None = None
) -> dict[str, dict[str, float]]:
    """Greedy per-type scores on `recs` with real, blank, other-clip or shuffled frames (video_probe.CONDITIONS)."""
    encode = frame_encoder(processor, NUM_FRAMES, shuffle=condition == "shuffled")
    texts = predict(
        model,
        encode,
        processor.tokenizer,
        condition_records(recs, condition, blank=blank),
        max_new_tokens=MAX_NEW_TOKENS,
    )
    return score(texts, recs)


def mean_iou(spans: list, gts: list) -> Any:
    """[K] mean temporal IoU of each candidate span (rows of `spans` [K, 2]) over the ground truths `gts` [N, 2]:
    inter / union as rewards.rules.temporal_iou (0 for an empty union), vectorised."""
    p, g = np.asarray(spans, float)[:, None], np.asarray(gts, float)[None]  # [K, 1, 2], [1, N, 2]
    inter = np.clip(np.minimum(p[..., 1], g[..., 1]) - np.maximum(p[..., 0], g[..., 0]), 0, None)  # [K, N]
    union = np.maximum(p[..., 1], g[..., 1]) - np.minimum(p[..., 0], g[..., 0])  # [K, N]
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0).mean(1)  # [K]


def blind_baselines(train: list[dict[str, Any]], recs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Image-blind predictors fitted on `train`, scored on `recs`: grounding - the best constant span on a 0.25 s grid
    overall and per query template (move / visible), and the whole clip; QA - the majority answer per question
    template (colour and shape words masked) and per type."""

    def template(r):
        return (
            question_template(r["question"])
            if r["type"] != "grounding"
            else ("move" if "move" in r["question"] else "visible")
        )

    dur = recs[0]["duration"]
    grid = [(a / 4, b / 4) for a in range(int(4 * dur) + 1) for b in range(a + 1, int(4 * dur) + 1)]
    by = defaultdict(list)
    for r in train:
        by[(r["type"], template(r))].append(r.get("spans") or r.get("answers"))
        by[(r["type"], "")].append(r.get("spans") or r.get("answers"))

    @functools.cache
    def fit(kind, key):
        answers = by.get((kind, key)) or by[(kind, "")]
        if kind == "grounding":
            return grid[int(mean_iou(grid, answers).argmax())]
        return Counter(answers).most_common(1)[0][0]

    predictors = {"per_template": lambda r: fit(r["type"], template(r)), "per_type": lambda r: fit(r["type"], "")}
    out = {}
    for name, guess in predictors.items():
        texts = [target_text({**r, "spans": guess(r), "answers": guess(r)}) for r in recs]
        out[name] = score(texts, recs)
    ground = [r for r in recs if r["type"] == "grounding"]
    if ground:
        out["whole_clip"] = score([target_text({**r, "spans": (0.0, r["duration"])}) for r in ground], ground)
        out["constants"] = {k[1] or "all": list(fit("grounding", k[1])) for k in by if k[0] == "grounding"}
    return out


def format_table(table: dict[str, dict[str, float]]) -> str:
    lines = []
    for kind, row in table.items():
        lines.append(
            f"{kind:<10} " + " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        )
    return "\n".join(lines)
