"""Flagged object-list thinks (pretrain_vlm --list-think flags): each mark followed by whether it counts for the
question, so the answer is a count of flags rather than a match of two-letter marks against the question's words."""

import itertools

import pytest

from mmgrpo_shapes.programs import pretrain_vlm as P
from mmgrpo_shapes.vqa_think import (
    LIST_TYPES,
    answer_from_flags,
    answer_from_list,
    list_flags,
    list_marks,
    mark_flag,
    objects_think,
    think_objects_score,
)
from pipelines.vlm.data import shapes_vqa_records

# the scene of test_shapes_think_objects: red circle column 1 (cy 0.20), yellow triangle column 1 (cy 0.74), blue
# square column 3, so the list is "rc1 yt1 bs3".
OBJECTS = [
    {"shape": "square", "color": "blue", "cx": 0.80, "cy": 0.10, "size": 0.1},
    {"shape": "triangle", "color": "yellow", "cx": 0.30, "cy": 0.74, "size": 0.1},
    {"shape": "circle", "color": "red", "cx": 0.30, "cy": 0.20, "size": 0.1},
]


@pytest.mark.parametrize(
    "prompt, want",
    [
        ("How many circles are there?", "rc1+yt1.bs3."),  # only the circle counts
        ("How many yellow objects are there?", "rc1.yt1+bs3."),  # the colour initial
        ("How many objects are there in total?", "rc1+yt1+bs3+"),  # every object
        ("Is there a blue square?", "rc1.yt1.bs3+"),  # colour and shape both
        ("Is there a blue circle?", "rc1.yt1.bs3."),  # a red circle and a blue square: neither is both
        ("How many circles and squares are there altogether?", "rc1+yt1.bs3+"),  # either shape
        ("How many more squares than triangles are there?", "rc1.yt1-bs3+"),  # "+" the first, "-" the second
        ("If two more triangles were added, how many triangles would there be?", "rc1.yt1+bs3."),
    ],
)
def test_flagged_lists_by_hand(prompt, want):
    assert objects_think(OBJECTS, prompt) == want


@pytest.mark.parametrize(
    "prompt, flags, want",
    [
        ("How many circles are there?", ["+", ".", "+"], "2"),  # two "+"
        ("How many objects are there in total?", ["+", "+", "+", "+"], "4"),
        ("Is there a blue square?", [".", "+"], "yes"),  # any "+"
        ("Is there a blue square?", [".", "."], "no"),
        ("How many more squares than triangles are there?", ["+", "+", "-", "."], "1"),  # 2 - 1
        ("If two more triangles were added, how many triangles would there be?", ["+"], "3"),  # 1 + 2
        ("How many circles and squares are there altogether?", [], "0"),
        ("What color is the circle?", ["+"], None),  # not a list question
    ],
)
def test_answers_from_flags_by_hand(prompt, flags, want):
    assert answer_from_flags(prompt, flags) == want


def test_mark_flag_refuses_other_questions():
    with pytest.raises(ValueError, match="not a count, existence or arithmetic question"):
        mark_flag("What color is the circle?", "rc1")


def test_marks_and_flags_read_back_from_a_completion():
    text = "<think>rc1+yt1.bs3-</think><answer>0</answer>"
    assert list_marks(text) == ["rc1", "yt1", "bs3"]
    assert list_flags(text) == ["+", ".", "-"]
    assert list_flags("<think>rc1 yt1</think>") == ["", ""]  # unflagged marks
    assert list_marks("<think>x rrc1 bs2</think>") == ["bs2"]  # a letter before the mark: not a mark
    assert list_flags("<answer>3</answer>") == []
    # the list score reads the marks only: the flags are not scene claims
    assert think_objects_score(text, "How many objects are there in total?", OBJECTS) == 1.0


def test_every_list_question_of_the_pipeline_follows_from_its_flags():
    recs = [r for r in shapes_vqa_records("train", 400, seed=0) if r["category"] in LIST_TYPES]
    for r in recs:
        text = f"<think>{objects_think(r['objects'], r['prompt'])}</think>"
        assert answer_from_flags(r["prompt"], list_flags(text)) == r["answers"], r["prompt"]
        assert answer_from_list(r["prompt"], list_marks(text)) == r["answers"], r["prompt"]


def test_flagged_thinks_in_the_sft_stream_fit_the_recipes_max_new_tokens():
    """--list-think flags: list types think flagged lists, also when blanked; the longest completion (4 objects:
    <think> + 16 + </think> + <answer> + answer + </answer>, one token per character) fits max_new_tokens=24."""
    kw = dict(seed=0, chunk=64, blank=("arithmetic",), list_think="flags")
    stream = list(itertools.islice(P.train_stream("vqa", **kw), 200))
    listed = [r for r in stream if r["category"] in LIST_TYPES]
    assert {r["category"] for r in listed} == set(LIST_TYPES)
    for r in listed:
        assert set(list_flags(f"<think>{r['think']}</think>")) <= {"+", ".", "-"}
        assert len(r["think"]) + len(r["answers"]) + 4 <= 24 - 1  # the end-of-turn token too
    blanked = [r for r in listed if r["category"] == "arithmetic"]
    assert blanked and all(r["objects"] == [] for r in blanked)
    assert all(
        answer_from_flags(r["prompt"], list_flags(f"<think>{r['think']}</think>")) == r["answers"] for r in blanked
    )


def test_list_line_reports_the_two_flag_steps():
    """Three flagged existence completions on OBJECTS, "Is there a blue square?", worked by hand: 1 flags its marks
    right ("rc1.yt1.bs3+") and answers what the flags give (yes); 2 flags the square "." (wrong for its marks) and
    answers what its flags give (no); 3 flags right but answers "no" against its "+". Flags right 2/3; the answer
    follows its flags 2/3. Unflagged completions add nothing to the line."""
    from mmgrpo_shapes.programs.vqa_report import list_line

    rec = {"category": "existence", "prompt": "Is there a blue square?", "answers": "yes", "objects": OBJECTS}
    texts = [
        "<think>rc1.yt1.bs3+</think><answer>yes</answer>",
        "<think>rc1.yt1.bs3.</think><answer>no</answer>",
        "<think>rc1.yt1.bs3+</think><answer>no</answer>",
    ]
    line = list_line(texts, [rec] * 3)
    assert "object lists exact 1.000" in line  # every list names the three objects
    assert line.endswith("flags right for its marks 0.667, answer follows its flags 0.667")
    assert "flags" not in list_line(["<think>rc1 yt1 bs3</think><answer>yes</answer>"], [rec])
