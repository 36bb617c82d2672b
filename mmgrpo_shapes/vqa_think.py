"""The SFT think of the ShapesWorld VQA model (mmgrpo_shapes/programs/pretrain_vlm.py): a fixed text per question
type, and for position the two objects' token rows or columns (`position_think`)."""

import re
from typing import Any

import torch
from torch import Tensor

THINK = {
    "count": "Count them.",
    "color": "Find it.",
    "shape": "Find it.",
    "existence": "Search.",
    "arithmetic": "Count, sum.",
}
"""the fixed reasoning text per VQA question type but position (`position_think`): short, so every completion fits the recipes' max_new_tokens=24"""

GRID = 4
"""visual tokens per side (8 x 8 patches merged 2 x 2): the rows and columns the dense position targets teach"""


def cell_mark(obj: dict[str, Any], key: str) -> tuple[str, int]:
    """An object's mark in a think, its colour and shape initials then its token cell along `key` ("cx": column, "cy":
    row), e.g. ("rc1", 1) for a red circle at cx 0.3; centre 1.0 falls in the last cell."""
    cell = min(GRID - 1, int(obj[key] * GRID))
    return f"{obj['color'][0]}{obj['shape'][0]}{cell}", cell


def position_think(record: dict[str, Any]) -> str:
    """Position's think: per named object, its colour and shape initials and its token column ("left of") or row
    ("above"), e.g. "x gt0 bs2" -> yes. Why: with a fixed "Compare." the model scored 0.58 on test although its tower
    reads its own row and column at 1.00 (--dense-position). With bare digits ("x 0 2") it read the two objects'
    cells but often in the wrong order (which name came first is one more binding: test 0.46); written after the
    object's initials, each digit is read from the token of the object just named. Two objects share a column in 2
    of 3,000 train questions (answers are only asked when the relation clearly holds), so the digits decide nearly
    every answer."""
    axis, key, *names = position_question(record["prompt"])
    objs = [next(o for o in record["objects"] if f"{o['color']} {o['shape']}" == name) for name in names]
    return f"{axis} {' '.join(cell_mark(o, key)[0] for o in objs)}"


POSITION_PROMPT = re.compile(r"^Is the (\w+ \w+) (left of|above) the (\w+ \w+)\?$")


def position_question(prompt: str) -> tuple[str, str, str, str] | None:
    """(axis "x" | "y", object key "cx" | "cy", first name, second name) of a position question, else None."""
    m = POSITION_PROMPT.match(prompt.strip())
    if m is None:
        return None
    axis, key = ("x", "cx") if m.group(2) == "left of" else ("y", "cy")
    return axis, key, m.group(1), m.group(3)


def _think_marks(text: str, axis: str | None = None) -> list[str]:
    """The marks a completion's position think writes after its axis ("x yt1 bs3" -> ["yt1", "bs3"]); [] without a
    <think>, or when its first word is not `axis` (any of x, y if None)."""
    think = re.search(r"<think>(.*?)</think>", text, flags=re.DOTALL)
    words = think.group(1).split() if think else []
    return words[1:3] if words[:1] and words[0] in ((axis,) if axis else ("x", "y")) else []


def think_text(record: dict[str, Any]) -> str:
    """The SFT think of a VQA record: its own (`where_record`), position's cells, or the type's fixed text."""
    if record.get("think"):
        return record["think"]
    return position_think(record) if record["category"] == "position" else THINK[record["category"]]


def key_token_weights(tokens: list[str], key_weight: float) -> Tensor:
    """[T] SFT loss weight of each completion token: `key_weight` for the tokens that decide the answer (every token
    inside <answer>...</answer>, and the think's digits: position's cells), 1 elsewhere. Why: position's two cell
    digits are 2 of ~25 tokens in a sixth of the questions, and teacher-forced the shipped model (2026-11-27) wrote
    the first one right 38% of the time (chance 25%), the same imbalance the video model's arrows had until they
    were weighted (pretrain_video.key_token_weights)."""
    out, inside = [], False
    for t in tokens:
        if t in ("<answer>", "</answer>"):
            inside = t == "<answer>"
            out.append(1.0)
            continue
        out.append(key_weight if inside or t.isdigit() else 1.0)
    return torch.tensor(out)


def where_record(record: dict[str, Any], rng) -> dict[str, Any] | None:
    """An SFT-only reading question on `record`'s image: "Which column is the red circle in?" (or row), think "x rc1",
    answer "1": one uniquely named object's token cell, the two steps a position think takes per object (find the
    object by its colour and shape, read its cell). None when no object's colour and shape are unique.
    Why: position's think names two cells in a sixth of the questions, and the model that writes them still wrote
    mostly 0 and 2 whatever the scene (assets/README.md, VLM section); this asks for one cell per question, with the
    answer decided by that digit alone."""
    objs = record["objects"]
    names = [f"{o['color']} {o['shape']}" for o in objs]
    unique = [o for o, n in zip(objs, names) if names.count(n) == 1]
    if not unique:
        return None
    obj = unique[int(rng.integers(len(unique)))]
    axis, key, word = ("x", "cx", "column") if rng.random() < 0.5 else ("y", "cy", "row")
    mark, cell = cell_mark(obj, key)
    think = f"{axis} {mark}"
    prompt = f"Which {word} is the {obj['color']} {obj['shape']} in?"
    return dict(record, prompt=prompt, answers=str(cell), category="where", think=think)


def think_cells_score(text: str, prompt: str, objects: list[dict[str, Any]]) -> float:
    """The share of a position think's two marks that name the right token cell: 0, 0.5 or 1; 0 for any other
    question (nothing to check) or a completion without a <think>. E.g. for "Is the red circle left of the blue
    square?" with the objects at cx 0.3 and 0.9, "x rc1 bs3" scores 1.0 and "x rc1 bs2" 0.5 (position_think's
    format: the axis, then each object's initials and its column or row).
    Why: a process reward on the think's visual claims, checked against the scene (Faithful GRPO's grounding,
    arXiv:2604.08476, with the scene in place of a judge): an answer is one yes/no bit, the two cells are the
    steps the model must read from the pixels to get it right."""
    q = position_question(prompt)
    if q is None:
        return 0.0
    axis, key, *names = q
    by_name = {f"{o['color']} {o['shape']}": o for o in objects}
    if any(n not in by_name for n in names):
        raise ValueError(f"prompt {prompt!r} names an object that is not in the record's objects {sorted(by_name)}")
    want = [cell_mark(by_name[n], key)[0] for n in names]
    return sum(g == w for g, w in zip(_think_marks(text, axis), want)) / 2


def answer_follows_cells(text: str) -> bool | None:
    """Whether a position completion's yes/no answer follows its own think's two cells: "yes" exactly when the first
    named object's column (row) is lower, i.e. further left (higher); None without two different cell digits or an
    answer. E.g. "<think>x yt1 bs3</think><answer>yes</answer>" -> True, "... x yt3 bs1 ... yes" -> False."""
    cells = [m[-1] for m in _think_marks(text) if re.fullmatch(r"[a-z]{2}\d", m)]
    answer = re.search(r"<answer>\s*(yes|no)\s*</answer>", text)
    if len(cells) != 2 or answer is None or cells[0] == cells[1]:
        return None
    return (answer.group(1) == "yes") == (int(cells[0]) < int(cells[1]))
