"""The SFT targets of the ShapesWorld video model (mmgrpo_shapes/programs/pretrain_video.py): a think, then the answer.

Grounding, direction and order think in a time line, one mark per 0.5 s temporal group ("0.0-0.5+1.0+...8.0"): Qwen2-VL
gives its language model no absolute time, only M-RoPE's relative positions, and a tiny model did not learn to turn
"which temporal group matched" into seconds or an order (assets/README.md); written a group at a time, each mark is
read from the group at a fixed offset back.
"""

import re
from typing import Any

from mmgrpo_shapes.scenes import COLORS

THINK = {"count": "Count them."}
"""the fixed think of QA types without a time line (direction and order think in one: `qa_line`)"""
MOVE_MARKS = {"left": "<", "right": ">", "up": "^", "down": "v"}
"""direction's time line marks a group where the asked object moves with its direction's arrow"""
COLOR_MARKS = {c: c[0] for c in COLORS}
"""order's time line marks a group where only one of the two objects is on with its colour's initial"""
assert len(set(COLOR_MARKS.values())) == len(COLORS), "order marks need distinct colour initials"
GROUP_SECONDS = 0.5  # one temporal group (2 frames at 4 fps): the time step of grounding's think line


def time_line(span: list[float], duration: float) -> str:
    """Grounding's think: each temporal group's start time, then "+" inside `span`, "-" outside; then the clip's end.
    [1.0, 2.0] in 3 s -> "0.0-0.5-1.0+1.5+2.0-2.5-3.0". Why: Qwen2-VL has no absolute time in its positions, and a tiny
    LM did not learn to read it off M-RoPE (assets/README.md); here each "+"/"-" is read from the group at a fixed
    offset back (text and temporal positions both advance one per step), and the span's ends are the labels at its
    edges, copied (as timestamps interleaved with frames do for Qwen3-VL and NumPro)."""
    start, end = span
    groups = round(duration / GROUP_SECONDS)
    marks = "".join(
        f"{g * GROUP_SECONDS:.1f}{'+' if start <= g * GROUP_SECONDS < end else '-'}" for g in range(groups)
    )
    return f"{marks}{groups * GROUP_SECONDS:.1f}"


def _marks(duration: float, mark) -> str:
    """`time_line`'s layout with any per-group mark: "0.0{mark(0)}0.5{mark(1)}...{end}"."""
    groups = round(duration / GROUP_SECONDS)
    return "".join(f"{g * GROUP_SECONDS:.1f}{mark(g)}" for g in range(groups)) + f"{groups * GROUP_SECONDS:.1f}"


def _states(timeline: list[dict[str, Any]], name: str, groups: int) -> list[str]:
    """Per temporal group, the object `name`'s state: "absent", "still" or its direction while it moves (2-frame
    groups; the data's events sit on frame pairs, so a group is wholly in or out of each)."""
    appear, disappear, move = 0, 2 * groups, None
    for e in timeline:
        if e["object"] == name:
            if e["event"] == "appears":
                appear = e["start_frame"]
            elif e["event"] == "disappears":
                disappear = e["start_frame"]
            else:
                move = (e["start_frame"], e["end_frame"], e["event"][6:])
    out = []
    for g in range(groups):
        f = 2 * g
        moving = move is not None and move[0] <= f < move[1]
        out.append(move[2] if moving else "still" if appear <= f < disappear else "absent")
    return out


def qa_line(rec: dict[str, Any]) -> str:
    """Direction's and order's think, in grounding's time-line layout (same reading skill, one group per mark).
    Direction ("In which direction does the red circle move?"): "-" absent, "+" still, an arrow (`MOVE_MARKS`)
    while it moves, e.g. "0.0-0.5+1.0>1.5>2.0+2.5-...8.0" -> right. Order ("Which appears first / starts moving
    first, the A or the B?"): the initial of A's colour when only A is visible (moving), of B's when only B, "=" both,
    "-" neither; the answer is the object whose initial comes first. Why colour initials, not "a"/"b" for the first
    and second named: the model marked the right groups but swapped a and b (which name came first is one more
    binding), while a colour initial is read straight from the group (colours are distinct within a clip, and
    their initials are distinct: `COLOR_MARKS`)."""
    groups = round(rec["duration"] / GROUP_SECONDS)
    q = rec["question"]
    names = re.findall(r"the ((?:\w+) (?:circle|square|triangle))", q)
    if rec["type"] == "direction":
        states = _states(rec["timeline"], names[0], groups)
        return _marks(rec["duration"], lambda g: MOVE_MARKS.get(states[g], "-" if states[g] == "absent" else "+"))
    a, b = (_states(rec["timeline"], n, groups) for n in names[:2])
    ma, mb = (COLOR_MARKS[n.split()[0]] for n in names[:2])
    on = (lambda s: s != "absent") if "appears" in q else (lambda s: s not in ("absent", "still"))
    return _marks(
        rec["duration"],
        lambda g: {(True, True): "=", (True, False): ma, (False, True): mb}.get((on(a[g]), on(b[g])), "-"),
    )


def think_text(rec: dict[str, Any]) -> str:
    """The SFT think: a time line (grounding `time_line`, direction and order `qa_line`) or a fixed think (count)."""
    if rec["type"] == "grounding":
        return time_line(rec["spans"], rec["duration"])
    return THINK.get(rec["type"]) or qa_line(rec)


def target_text(rec: dict[str, Any]) -> str:
    """The SFT completion: `think_text`, then the span ("2.50 to 3.50") or the answer."""
    if rec["type"] == "grounding":
        start, end = rec["spans"]
        return f"<think>{think_text(rec)}</think><answer>{start:.2f} to {end:.2f}</answer>"
    return f"<think>{think_text(rec)}</think><answer>{rec['answers']}</answer>"
