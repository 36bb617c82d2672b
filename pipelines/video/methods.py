"""Per-record helpers of the video methods: TempSamp-R1's ground-truth completion text, T-GRPO's frame shuffle, and
DeepVideo-R1's difficulty-aware augmentation (a hint for groups that all fail, noisier frames for groups that all pass).

Numpy and plain Python only; the policy decides when to call them.
"""

import string
from typing import Any

import numpy as np

SPAN_TEMPLATE = "<think>Find the event.</think><answer>{start:.2f} to {end:.2f}</answer>"
"""the format the grounding prompt asks for (a short think, then `<answer>start to end</answer>`), 31 byte-level
tokens. The shipped assets/shapes-video now thinks in a time line (mmgrpo_shapes/programs/pretrain_video.py `time_line`), so
with it an injected answer is off-distribution in its think (the answer part matches); pass gt_span_template to
change it."""
ANSWER_TEMPLATE = "<think>Find the answer.</think><answer>{answer}</answer>"
TEMPLATE_FIELDS = {"span_template": ("start", "end"), "answer_template": ("answer",)}
"""the fields each template must use (str.format names)"""
THINK_FIELD = "think"
"""the field any template may also use: the record's `reference_think` (ShapesWorld records carry the SFT model's
think, e.g. its time line), so the injected completion is written as the policy writes (`<think>{think}</think>...`)"""


def ground_truth_text(
    record: dict[str, Any], *, span_template: str = SPAN_TEMPLATE, answer_template: str = ANSWER_TEMPLATE
) -> str:
    """The completion TempSamp-R1 injects for `record`: its spans (grounding) or answer, through a template (and its
    `reference_think` where the template has `{think}`)."""
    think = record.get("reference_think")
    if record.get("spans") is not None:
        template, values = span_template, {"start": float(record["spans"][0]), "end": float(record["spans"][1])}
    elif record.get("answers") is not None:
        template, values = answer_template, {"answer": record["answers"]}
    else:
        raise ValueError(
            f"record {record.get('id')!r} has neither spans nor answers: nothing to inject as ground truth"
        )
    if THINK_FIELD in {f for _, f, _, _ in string.Formatter().parse(template)} and think is None:
        raise ValueError(
            f"record {record.get('id')!r} has no reference_think for the template's {{{THINK_FIELD}}}: give each record "
            f"one, or drop {{{THINK_FIELD}}} from the template"
        )
    return template.format(**values, **{THINK_FIELD: think})  # unused names are ignored by str.format


def check_template(name: str, template: str) -> None:
    """Raise ValueError unless `template` names each of its fields (TEMPLATE_FIELDS[name]), optionally `{think}`, and
    no other."""
    fields = TEMPLATE_FIELDS[name]
    example = SPAN_TEMPLATE if name == "span_template" else ANSWER_TEMPLATE
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        template.format(**{f: "A" if f == "answer" else 1.0 for f in fields}, **{THINK_FIELD: "-"})
    except (KeyError, IndexError, ValueError) as err:
        used = {f"<{type(err).__name__}: {err}>"}
    if used - {THINK_FIELD} != set(fields):
        raise ValueError(
            f"{name} ({template!r}) must use the fields {{{'}, {'.join(fields)}}}, may use {{{THINK_FIELD}}}, and no "
            f"other (found {sorted(used)}), e.g. {example!r}"
        )


def shuffle_order(num_frames: int, seed: int) -> np.ndarray:
    """A seeded permutation of the frames that is never the identity (for T >= 2): T-GRPO's shuffled video."""
    perm = np.random.default_rng(seed).permutation(num_frames)
    if num_frames > 1 and (perm == np.arange(num_frames)).all():
        perm = np.roll(perm, 1)
    return perm


def difficulty(scores: list[float], *, easy_min: float, hard_max: float) -> str | None:
    """ "easy" when every score of the group is >= easy_min, "hard" when every one is <= hard_max, else None.

    DeepVideo-R1 (arXiv:2506.07464): such groups carry no advantage (all-equal rewards), so they are re-posed.
    """
    if not scores:
        return None
    if min(scores) >= easy_min:
        return "easy"
    if max(scores) <= hard_max:
        return "hard"
    return None


def with_hint(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of `record` whose prompt carries a hint: the event's length (grounding) or the answer's first character.

    Ground-truth fields are untouched, so the rewards score the re-posed group against the same answer.
    """
    if record.get("spans") is not None:
        start, end = (float(v) for v in record["spans"])
        hint = f"Hint: the event lasts about {end - start:.1f} seconds."
    else:
        answer = str(record.get("answers", "")).strip()
        hint = f"Hint: the answer starts with '{answer[:1]}'." if answer else ""
    return {**record, "prompt": f"{record['prompt']}\n{hint}" if hint else record["prompt"]}


def noisier(frames: np.ndarray, *, std: float, seed: int) -> np.ndarray:
    """Frames with Gaussian pixel noise (std in [0, 255] units): a harder view of the same events and timestamps."""
    rng = np.random.default_rng(seed)
    noisy = frames.astype(np.float32) + rng.normal(0.0, std, size=frames.shape).astype(np.float32)
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8)
