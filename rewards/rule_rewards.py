"""Registered batch wrappers around the pure rule functions in rewards.rules (text completions in, [N] out).

Each factory takes keyword hyper-parameters and returns a Reward; the per-sample logic lives in rewards.rules.
"""

from collections.abc import Callable
from typing import Any

from rewards import rules
from rewards.api import REWARDS, FunctionReward, Reward


def _per_sample(
    name: str,
    fn: Callable[..., float],
    *,
    fields: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
    preprocess: str = "",
) -> Reward:
    """A text Reward applying fn(text, **{field: value_i}) to each sample."""

    def batch(samples, prompts, **given):
        out = []
        for i, text in enumerate(samples):
            if not isinstance(text, str):
                raise ValueError(f"reward {name!r} scores text completions; sample {i} is {type(text).__name__}")
            out.append(float(fn(text, **{k: v[i] for k, v in given.items() if v is not None})))
        return out

    return FunctionReward(batch, name=name, input="text", fields=fields, required=required, preprocess=preprocess)


@REWARDS.register("format", input="text", range="{0, 1}", paper="DeepSeek-R1 / R1-V; TON (arXiv:2505.16854)")
def format_reward(
    *, mode: str = "strict", allow_empty_think: bool = False, think_tag: str = "think", answer_tag: str = "answer"
) -> Reward:
    """Think/answer format: 1 if the completion is <think>..</think><answer>..</answer> (strict or lenient), else 0."""
    rules.format_ok("", mode=mode)  # validates mode now, not at the first batch

    def fn(text):
        return rules.format_ok(
            text, mode=mode, allow_empty_think=allow_empty_think, think=think_tag, answer=answer_tag
        )

    return _per_sample(
        "format", fn, preprocess=f"regex ({mode}); empty think {'allowed' if allow_empty_think else 'not allowed'}"
    )


@REWARDS.register("accuracy", input="text", range="{0, 1}", paper="R1-V / VLM-R1 (math-verify)")
def accuracy_reward(*, timeout: float = 5.0, tag: str = "answer", use_math_verify: bool = True) -> Reward:
    """Answer accuracy: math-verify equivalence (timeout) with an exact/numeric/fraction fallback; field `answers`."""

    def fn(text, answers):
        return rules.math_equal(
            rules.answer_text(text, tag), str(answers), timeout=timeout, use_math_verify=use_math_verify
        )

    return _per_sample(
        "accuracy",
        fn,
        fields=("answers",),
        required=("answers",),
        preprocess=f"last <{tag}> block (or whole text), math-verify then normalised match",
    )


@REWARDS.register("multiple_choice", input="text", range="{0, 1}", paper="Video-R1 (arXiv:2503.21776)")
def multiple_choice_reward(*, tag: str = "answer") -> Reward:
    """Multiple choice: 1 if the answer is exactly one option letter equal to the key; multi-letter hedges score 0."""

    def fn(text, answers):
        gold = rules.choice_letter(str(answers))
        if gold is None:
            raise ValueError(f"answers entry {answers!r} is not a single option letter like 'B'")
        return rules.choice_letter(rules.answer_text(text, tag)) == gold

    return _per_sample(
        "multiple_choice",
        fn,
        fields=("answers",),
        required=("answers",),
        preprocess=f"last <{tag}> block must be one letter: 'B', '(B)', 'B. text'",
    )


@REWARDS.register("numeric", input="text", range="{0, 1}", paper="Video-R1 (arXiv:2503.21776)")
def numeric_reward(*, atol: float = 1e-6, rtol: float = 0.0, tag: str = "answer") -> Reward:
    """Numeric answer within tolerance: |p - g| <= atol + rtol * |g|; field `answers`."""
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol={atol} and rtol={rtol} must be >= 0")

    def fn(text, answers):
        return rules.numeric_close(rules.answer_text(text, tag), answers, atol=atol, rtol=rtol)

    return _per_sample(
        "numeric",
        fn,
        fields=("answers",),
        required=("answers",),
        preprocess="numbers, fractions, percentages parsed exactly",
    )


@REWARDS.register("box_iou", input="text", range="[0, 1]", paper="VLM-R1 (arXiv:2504.07615)")
def box_iou_reward(*, threshold: float | None = None, tag: str = "answer") -> Reward:
    """Box IoU of the predicted [x1,y1,x2,y2] vs field `boxes`; optional rescale input_sizes -> image_sizes (w, h)."""

    def fn(text, boxes, input_sizes=None, image_sizes=None):
        pred = rules.parse_box(rules.answer_text(text, tag))
        if pred is None:
            return 0.0
        if (input_sizes is None) != (image_sizes is None):
            raise ValueError(
                "pass both input_sizes (the frame the model saw) and image_sizes (the box frame) or neither"
            )
        if input_sizes is not None:
            pred = rules.rescale_box(pred, input_sizes, image_sizes)
        iou = rules.box_iou(pred, [float(v) for v in boxes])
        return iou if threshold is None else float(iou >= threshold)

    return _per_sample(
        "box_iou",
        fn,
        fields=("boxes", "input_sizes", "image_sizes"),
        required=("boxes",),
        preprocess="first [x1,y1,x2,y2] in the answer; continuous IoU",
    )


@REWARDS.register(
    "temporal_iou",
    input="text",
    range="[0, 1] (tempsamp: about [0.09, 0.81])",
    paper="VideoChat-R1; TempSamp-R1 shaping",
)
def temporal_iou_reward(
    *,
    shaping: str = "none",
    threshold: float = 0.8,
    alpha: float = 1.0,
    tag: str = "answer",
    recall_at: float | None = None,
) -> Reward:
    """Temporal IoU of the predicted (start, end) vs field `spans`; empty union scores 0; optional TempSamp shaping.

    recall_at=m turns it into the grounding metric R@m (Charades-STA's R@0.5): 1 when IoU >= m, else 0; its mean
    over a set is the recall, as `mmgrpo eval` reports it beside the mIoU."""
    if shaping not in ("none", "tempsamp"):
        raise ValueError(f"shaping={shaping!r} must be 'none' or 'tempsamp'")
    if recall_at is not None and not 0 < recall_at <= 1:
        raise ValueError(f"recall_at={recall_at!r} must be in (0, 1], e.g. 0.5 for R@0.5")

    def fn(text, spans):
        pred = rules.parse_span(rules.answer_text(text, tag))
        iou = 0.0 if pred is None else rules.temporal_iou(pred, [float(v) for v in spans])
        if recall_at is not None:
            return float(iou >= recall_at)
        return iou if shaping == "none" else rules.tempsamp_shaping(iou, threshold=threshold, alpha=alpha)

    return _per_sample(
        "temporal_iou", fn, fields=("spans",), required=("spans",), preprocess="'X to Y' seconds from the answer"
    )


def _lengths(samples: list[str], lengths: Any) -> list[int]:
    return [len(s) for s in samples] if lengths is None else [int(v) for v in lengths]


@REWARDS.register("cosine_length", input="text", range="[-0.5, 1] by default", paper="arXiv:2502.03373")
def cosine_length_reward(
    *,
    max_len: int = 1024,
    correct_range: tuple[float, float] = (0.5, 1.0),
    wrong_range: tuple[float, float] = (-0.5, 0.0),
    timeout: float = 5.0,
) -> Reward:
    """Cosine length reward using real correctness (field `correct`, or `answers` checked by accuracy)."""

    def batch(samples, prompts, lengths=None, correct=None, answers=None):
        if correct is None and answers is None:
            raise ValueError(
                "cosine_length needs field correct=[...] or answers=[...] to know which answers are right"
            )
        if correct is None:
            correct = [
                rules.math_equal(rules.answer_text(s), str(a), timeout=timeout) for s, a in zip(samples, answers)
            ]
        return [
            rules.cosine_length(
                n, bool(c), max_len=max_len, correct_range=tuple(correct_range), wrong_range=tuple(wrong_range)
            )
            for n, c in zip(_lengths(samples, lengths), correct)
        ]

    return FunctionReward(
        batch,
        name="cosine_length",
        fields=("lengths", "correct", "answers"),
        preprocess="length = field lengths (tokens) or characters",
    )


@REWARDS.register("overlong", input="text", range="[-1, 0]", paper="DAPO (arXiv:2503.14476)")
def overlong_reward(*, max_len: int = 1024, cache_len: int = 256) -> Reward:
    """DAPO soft overlong penalty: 0 until max_len - cache_len, linear down to -1 at max_len, -1 beyond."""
    rules.overlong_penalty(0, max_len=max_len, cache_len=cache_len)

    def batch(samples, prompts, lengths=None):
        return [rules.overlong_penalty(n, max_len=max_len, cache_len=cache_len) for n in _lengths(samples, lengths)]

    return FunctionReward(
        batch, name="overlong", fields=("lengths",), preprocess="length = field lengths (tokens) or characters"
    )


@REWARDS.register("wer", input="text", range="[0, 1]", paper="Video-R1 OCR reward (arXiv:2503.21776)")
def wer_reward(*, tag: str = "answer") -> Reward:
    """1 - word error rate against field `answers`, clipped to [0, 1]."""

    def fn(text, answers):
        return max(0.0, 1.0 - rules.word_error_rate(rules.answer_text(text, tag), str(answers)))

    return _per_sample("wer", fn, fields=("answers",), required=("answers",), preprocess="whitespace words")


@REWARDS.register("edit_similarity", input="text", range="[0, 1]", paper="Flow-GRPO OCR (arXiv:2505.05470)")
def edit_similarity_reward(*, tag: str = "answer") -> Reward:
    """1 - normalised character edit distance to field `answers` (lower-case, whitespace removed)."""

    def fn(text, answers):
        return rules.ocr_similarity(rules.answer_text(text, tag), str(answers))

    return _per_sample(
        "edit_similarity", fn, fields=("answers",), required=("answers",), preprocess="lower-case, whitespace removed"
    )
