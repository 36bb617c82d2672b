"""Object-list thinks for count, existence and arithmetic (pretrain_vlm --list-think) and the shapes_think_objects
reward that checks them against the scene."""

import itertools

import pytest

import rewards
from mmgrpo.collect import reward_fields
from mmgrpo_shapes.programs import pretrain_vlm as P
from mmgrpo_shapes.vqa_think import LIST_TYPES, answer_from_list, objects_think, think_objects_score
from pipelines.vlm.data import shapes_vqa_records

# 4 x 4 visual tokens (vqa_think.GRID): column = floor(4 * cx). Red circle cx 0.30 -> column 1 (cy 0.20), yellow
# triangle cx 0.30 -> column 1 (cy 0.74, below the circle, so listed after it), blue square cx 0.80 -> column 3:
# the list, left to right then top to bottom, is "rc1 yt1 bs3".
OBJECTS = [
    {"shape": "square", "color": "blue", "cx": 0.80, "cy": 0.10, "size": 0.1},
    {"shape": "triangle", "color": "yellow", "cx": 0.30, "cy": 0.74, "size": 0.1},
    {"shape": "circle", "color": "red", "cx": 0.30, "cy": 0.20, "size": 0.1},
]
TOTAL = "How many objects are there in total?"


def test_the_list_by_hand():
    assert objects_think(OBJECTS) == "rc1 yt1 bs3"
    assert objects_think(OBJECTS[:1]) == "bs3"


@pytest.mark.parametrize(
    "prompt, think, want",
    [
        (TOTAL, "rc1 yt1 bs3", 1.0),
        (TOTAL, "bs3 rc1 yt1", 1.0),  # order is not scored, only which marks
        (TOTAL, "yt1 bs3", 2 / 3),  # one object missed: 2 shared / max(2, 3)
        (TOTAL, "rc1 yt1 bs3 gc0", 3 / 4),  # one invented: 3 / max(4, 3)
        (TOTAL, "rc1 rc1 yt1", 2 / 3),  # the circle listed twice counts once: (1 + 1) / 3
        (TOTAL, "rc2 yt1 bs3", 2 / 3),  # the circle's column wrong
        (TOTAL, "Count them.", 0.0),  # no marks
        ("Is there a blue square?", "rc1 yt1 bs3", 1.0),
        ("If two more circles were added, how many circles would there be?", "rc1", 1 / 3),
        ("What color is the circle?", "rc1 yt1 bs3", 0.0),  # colour, shape, position: nothing to check
        ("Is the red circle left of the blue square?", "rc1 yt1 bs3", 0.0),
    ],
)
def test_list_scores_by_hand(prompt, think, want):
    assert think_objects_score(f"<think>{think}</think><answer>3</answer>", prompt, OBJECTS) == pytest.approx(want)


def test_no_think_scores_zero():
    assert think_objects_score("<answer>3</answer>", TOTAL, OBJECTS) == 0.0


@pytest.mark.parametrize(
    "prompt, want",
    [
        ("How many circles are there?", "2"),  # cc0 and rc1
        ("How many cyan objects are there?", "2"),  # cc0 cs2: the colour initial, not the circle's c
        ("How many squares are there?", "2"),  # cs2 bs3
        ("How many objects are there in total?", "4"),
        ("Is there a blue square?", "yes"),
        ("Is there a blue circle?", "no"),
        ("How many squares and triangles are there altogether?", "2"),  # 2 squares + 0 triangles
        ("How many more squares than circles are there?", "0"),  # 2 - 2 (rc1, cc0)
        ("If two more triangles were added, how many triangles would there be?", "2"),  # 0 + 2
        ("What color is the circle?", None),
    ],
)
def test_answers_from_a_list_by_hand(prompt, want):
    marks = ["cc0", "rc1", "cs2", "bs3"]
    assert answer_from_list(prompt, marks) == want


def test_every_list_question_of_the_pipeline_follows_from_its_scenes_list():
    recs = [r for r in shapes_vqa_records("train", 400, seed=0) if r["category"] in LIST_TYPES]
    assert {r["category"] for r in recs} == set(LIST_TYPES)
    for r in recs:
        assert answer_from_list(r["prompt"], objects_think(r["objects"]).split()) == r["answers"], r["prompt"]


def test_list_think_in_the_sft_stream_also_on_blank_canvases():
    """--list-think: count, existence and arithmetic think their scene's list; a blanked type keeps its scene's list
    with the objects gone (as blank position keeps its cells), the other types keep their fixed thinks."""
    kw = dict(seed=5, chunk=64)
    real = list(itertools.islice(P.train_stream("vqa", **kw), 60))
    listed = list(itertools.islice(P.train_stream("vqa", blank=("arithmetic",), list_think=True, **kw), 60))
    assert [r["prompt"] for r in real] == [r["prompt"] for r in listed]
    for r, b in zip(real, listed):
        if r["category"] in LIST_TYPES:
            assert b["think"] == objects_think(r["objects"])
            assert (b["objects"] == []) == (r["category"] == "arithmetic")
        else:
            assert P.target_text("vqa", b) == P.target_text("vqa", r)
    assert {"arithmetic", "count"} <= {r["category"] for r in real}


def test_reward_set_scores_the_pipelines_records():
    recs = shapes_vqa_records("train", 60, seed=0)
    texts = [
        f"<think>{objects_think(r['objects']) if r['category'] in LIST_TYPES else 'Find it.'}</think>"
        f"<answer>{r['answers']}</answer>"
        for r in recs
    ]
    prompts, fields = reward_fields(recs, 1)
    rs = rewards.RewardSet([{"name": "accuracy"}, {"name": "shapes_think_objects", "weight": 0.5}])
    per, total = rs(texts, prompts, group_size=1, **fields)  # [N, 2], [N]
    listed = [r["category"] in LIST_TYPES for r in recs]
    assert per[:, 1].tolist() == [1.0 if x else 0.0 for x in listed]
    assert total.tolist() == [1.5 if x else 1.0 for x in listed]
    with pytest.raises(ValueError, match="objects"):
        rewards.load("shapes_think_objects")(texts[:1], prompts[:1])


def test_list_line_separates_reading_the_scene_from_using_the_list():
    """Three existence completions on OBJECTS ("rc1 yt1 bs3"), worked by hand: 1 writes the exact list and answers
    what it implies (yes); 2 writes the exact list and answers against it; 3 misses the square and answers what its
    list implies (no, wrong). Exact 2/3; the list implies the right answer 2/3; the answer follows it 2/3."""
    from mmgrpo_shapes.programs.vqa_report import list_line

    rec = {"category": "existence", "prompt": "Is there a blue square?", "answers": "yes", "objects": OBJECTS}
    texts = [
        "<think>rc1 yt1 bs3</think><answer>yes</answer>",
        "<think>rc1 yt1 bs3</think><answer>no</answer>",
        "<think>rc1 yt1</think><answer>no</answer>",
    ]
    line = list_line(texts, [rec] * 3)
    assert "object lists exact 0.667" in line and "answer follows its list 0.667" in line
    assert "list score 0.889" in line  # (1 + 1 + 2/3) / 3
    assert line.endswith("existence 0.667 / 0.667 / 0.667 (n 3)")
