"""The SFT think of the ShapesWorld VQA model (mmgrpo_shapes/programs/pretrain_vlm.py): a fixed text per question
type, and for position the two objects' token rows or columns (`position_think`)."""

import re
from typing import Any

import torch
from torch import Tensor

from mmgrpo_shapes.vqa import check_answer, extract_answer

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


LIST_TYPES = ("count", "existence", "arithmetic")
"""the question types whose answer follows from the scene's object list (`objects_think`, pretrain_vlm --list-think)"""

LIST_PROMPT = re.compile(r"^(How many|Is there|If two more) ")


def scene_marks(objects: list[dict[str, Any]]) -> list[str]:
    """The scene's object marks (`cell_mark` along cx), left to right (then top to bottom): ["rc1", "gt2", "bs3"]."""
    objs = sorted(objects, key=lambda o: (cell_mark(o, "cx")[1], o["cy"], o["cx"]))
    return [cell_mark(o, "cx")[0] for o in objs]


def objects_think(objects: list[dict[str, Any]], prompt: str | None = None) -> str:
    """The scene's object list as a think: each object's colour and shape initials and its token column, left to
    right (then top to bottom), e.g. "rc1 gt2 bs3". Why: count, existence and arithmetic answers follow from this list
    (count the marks that match, look one up, add two counts), so RL has steps to check (`think_objects_score`) where
    a fixed "Count them." leaves it one number per sample; the marks are `cell_mark`'s, the skill where questions
    and position thinks already teach. With `prompt`, each mark is followed by its `mark_flag` for that question
    and the spaces go: "rc1+gt2.bs3+" for "How many circles are there?" (pretrain_vlm --list-think flags)."""
    marks = scene_marks(objects)
    if prompt is None:
        return " ".join(marks)
    return "".join(m + mark_flag(prompt, m) for m in marks)


def think_objects_score(text: str, prompt: str, objects: list[dict[str, Any]]) -> float:
    """How well a count, existence or arithmetic think lists the scene: the marks it shares with `objects_think`
    (as multisets) over the larger of the two lists' lengths, in [0, 1]; 0 for other questions or without a
    <think>. E.g. for a red circle at cx 0.3 and a blue square at cx 0.9 ("rc1 bs3"), "rc1 bs3" scores 1,
    "rc1" 1/2, "rc1 bs3 gt0" 2/3, "rc2 bs3" 1/2; flags are not scored ("rc1+bs3." scores 1).
    Why: the larger length charges both missed and invented objects, the GenEval-style count score
    found / max(found, asked) of the T2I verifier."""
    if LIST_PROMPT.match(prompt.strip()) is None:
        return 0.0
    said, want = list_marks(text), scene_marks(objects)
    if not said or not want:
        return 0.0
    shared = sum(min(said.count(m), want.count(m)) for m in set(want))
    return shared / max(len(said), len(want))


MARK = r"(?<![a-z])([a-z]{2}\d)"
"""an object mark in a think: colour initial, shape initial, cell digit, not preceded by a letter"""


def list_marks(text: str) -> list[str]:
    """The object marks ("rc1") a completion's <think> writes, in order, with or without flags ("rc1+gt2." ->
    ["rc1", "gt2"]); [] without a <think>."""
    think = re.search(r"<think>(.*?)</think>", text, flags=re.DOTALL)
    return re.findall(MARK, think.group(1)) if think else []


def list_flags(text: str) -> list[str]:
    """The flag after each mark of a completion's <think> ("rc1+gt2.bs3" -> ["+", ".", ""]); [] without one."""
    think = re.search(r"<think>(.*?)</think>", text, flags=re.DOTALL)
    return [flag for _, flag in re.findall(MARK + r"([+.-]?)", think.group(1))] if think else []


def _question_terms(prompt: str) -> tuple[str, dict[str, str], dict[str, str]] | None:
    """(kind, what a "+" mark has, what a "-" mark has) of a list question: kind "count", "exists", "more" or
    "plus2"; each dict maps "shape" / "color" to a word (an empty "+" dict: every object); None for others."""
    q = prompt.strip()
    if m := re.fullmatch(r"How many (\w+)s are there\?", q):
        return "count", {"shape": m.group(1)}, {}
    if m := re.fullmatch(r"How many (\w+) objects are there\?", q):
        return "count", {"color": m.group(1)}, {}
    if q == "How many objects are there in total?":
        return "count", {}, {}
    if m := re.fullmatch(r"Is there a (\w+) (\w+)\?", q):
        return "exists", {"color": m.group(1), "shape": m.group(2)}, {}
    if m := re.fullmatch(r"How many (\w+)s and (\w+)s are there altogether\?", q):
        return "count", {"shape": (m.group(1), m.group(2))}, {}
    if m := re.fullmatch(r"How many more (\w+)s than (\w+)s are there\?", q):
        return "more", {"shape": m.group(1)}, {"shape": m.group(2)}
    if m := re.fullmatch(r"If two more (\w+)s were added, how many \w+s would there be\?", q):
        return "plus2", {"shape": m.group(1)}, {}
    return None


def _has(mark: str, want: dict[str, Any]) -> bool:
    """Whether a mark ("rc1") has every asked colour and shape (a tuple of shapes: any of them)."""
    shapes = want.get("shape", ())
    shapes = (shapes,) if isinstance(shapes, str) else shapes
    color = want.get("color")
    return (not shapes or mark[1] in {s[0] for s in shapes}) and (color is None or mark[0] == color[0])


def mark_flag(prompt: str, mark: str) -> str:
    """A mark's flag for a list question: "+" when it counts towards the answer, "-" when it counts against it (the
    second shape of "How many more circles than squares"), "." otherwise. E.g. "How many circles are there?": "rc1"
    -> "+", "bs3" -> "."; raises for questions that are not count, existence or arithmetic."""
    terms = _question_terms(prompt)
    if terms is None:
        raise ValueError(f"{prompt!r} is not a count, existence or arithmetic question: it has no object-list flags")
    _, plus, minus = terms
    if _has(mark, plus):
        return "+"
    return "-" if minus and _has(mark, minus) else "."


def answer_from_list(prompt: str, marks: list[str]) -> str | None:
    """The answer a count, existence or arithmetic question has if the scene were exactly `marks` (colour initial,
    shape initial, column); None for other questions. E.g. "How many circles are there?" with ["rc1", "bc3"] -> "2",
    "Is there a blue square?" -> "no". Used to ask whether a model's answer follows its own list."""
    terms = _question_terms(prompt)
    return None if terms is None else answer_from_flags(prompt, [mark_flag(prompt, m) for m in marks])


def answer_from_flags(prompt: str, flags: list[str]) -> str | None:
    """The answer a list question's flags give: the number of "+" ("count"), "yes" if any ("exists"), "+" minus "-"
    ("more"), "+" plus two ("plus2"); None for other questions. E.g. "Is there a blue square?" with [".", "+"] ->
    "yes"; "How many more circles than squares are there?" with ["+", "+", "-"] -> "1"."""
    terms = _question_terms(prompt)
    if terms is None:
        return None
    kind, plus, minus = terms[0], flags.count("+"), flags.count("-")
    if kind == "exists":
        return "yes" if plus else "no"
    return str({"count": plus, "more": plus - minus, "plus2": plus + 2}[kind])


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


def think_follows_score(text: str, prompt: str) -> float:
    """1 when a completion's answer is the one its own think implies, else 0 (Faithful GRPO's answer-reasoning
    consistency, arXiv:2604.08476): for count, existence and arithmetic the answer `answer_from_list` computes from
    the think's marks, for position the yes/no its two cells give (`answer_follows_cells`); 0 for colour and shape
    (nothing to follow), or without a think, marks or an answer. E.g. "How many circles are there?" with
    "<think>rc1 bc3</think><answer>2</answer>" scores 1, with "<answer>3</answer>" 0. Why: a right list and a
    right answer each earn their reward, but only this one rewards the step between them, the skill the base
    lacks (its answers follow its lists 0.56 of the time)."""
    if position_question(prompt) is not None:
        return float(answer_follows_cells(text) is True)
    marks, got = list_marks(text), extract_answer(text)
    want = answer_from_list(prompt, marks) if marks else None
    return float(want is not None and got is not None and check_answer(got, want))
