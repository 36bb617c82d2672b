"""The shapes_think_cells reward: a ShapesWorld position think's cell marks checked against the scene."""

import pytest

import rewards
from mmgrpo.collect import reward_fields
from mmgrpo_shapes.vqa_think import answer_follows_cells, position_think, think_cells_score
from pipelines.vlm.data import shapes_vqa_records

# yellow triangle cx 0.30 -> column floor(4 * 0.30) = 1, cy 0.74 -> row 2; blue square cx 0.80 -> column 3,
# cy 0.10 -> row 0 (4 x 4 visual tokens, vqa_think.GRID)
OBJECTS = [
    {"shape": "square", "color": "blue", "cx": 0.80, "cy": 0.10, "size": 0.1},
    {"shape": "triangle", "color": "yellow", "cx": 0.30, "cy": 0.74, "size": 0.1},
]
LEFT = "Is the yellow triangle left of the blue square?"
ABOVE = "Is the blue square above the yellow triangle?"


@pytest.mark.parametrize(
    "prompt, think, want",
    [
        (LEFT, "x yt1 bs3", 1.0),  # both columns right
        (LEFT, "x yt1 bs2", 0.5),  # the square's column wrong
        (LEFT, "x yt2 bs2", 0.0),
        (LEFT, "y yt1 bs3", 0.0),  # rows are not what "left of" asks
        (LEFT, "x bs3 yt1", 0.0),  # the named order: the triangle first
        (LEFT, "x yt1", 0.5),  # one mark written, and right
        (ABOVE, "y bs0 yt2", 1.0),  # "above" reads rows, square first as named
        (ABOVE, "y bs0 yt1", 0.5),
        ("Is there a red circle?", "Search.", 0.0),  # nothing to check
    ],
)
def test_cell_marks_by_hand(prompt, think, want):
    assert think_cells_score(f"<think>{think}</think><answer>yes</answer>", prompt, OBJECTS) == want


def test_no_think_scores_zero_and_a_missing_object_is_named():
    assert think_cells_score("<answer>yes</answer>", LEFT, OBJECTS) == 0.0
    with pytest.raises(ValueError, match="red circle"):
        think_cells_score("<think>x rc1 bs3</think>", "Is the red circle left of the blue square?", OBJECTS)


def test_reward_set_reads_the_pipelines_objects_and_leaves_other_rewards_alone():
    # the pipeline's own records: position_think (the SFT target) scores 1 on position questions, other types 0
    recs = shapes_vqa_records("train", 60, seed=0)
    assert all("objects" in r for r in recs) and any(r["category"] == "position" for r in recs)
    texts = [
        f"<think>{position_think(r) if r['category'] == 'position' else 'Find it.'}</think><answer>{r['answers']}</answer>"
        for r in recs
    ]
    prompts, fields = reward_fields(recs, 1)
    rs = rewards.RewardSet([{"name": "accuracy"}, {"name": "shapes_think_cells", "weight": 0.5}])
    per, total = rs(texts, prompts, group_size=1, **fields)  # [N, 2], [N]
    pos = [r["category"] == "position" for r in recs]
    assert per[:, 0].tolist() == [1.0] * len(recs)  # accuracy ignores the objects field
    assert per[:, 1].tolist() == [1.0 if p else 0.0 for p in pos]
    assert total.tolist() == [1.5 if p else 1.0 for p in pos]
    with pytest.raises(ValueError, match="objects"):
        rewards.load("shapes_think_cells")(texts[:1], prompts[:1])


@pytest.mark.parametrize(
    "text, want",
    [
        ("<think>x yt1 bs3</think><answer>yes</answer>", True),  # 1 < 3: the first is further left, "yes" follows
        ("<think>x yt1 bs3</think><answer>no</answer>", False),
        ("<think>y bs0 yt2</think><answer>yes</answer>", True),  # row 0 is the top: above
        ("<think>x yt3 bs1</think><answer>yes</answer>", False),
        ("<think>x yt3 bs1</think><answer>no</answer>", True),
        ("<think>x yt2 bs2</think><answer>no</answer>", None),  # the same cell: nothing to follow
        ("<think>Search.</think><answer>yes</answer>", None),
        ("<think>x yt1 bs3</think>", None),
    ],
)
def test_answer_follows_its_cells_by_hand(text, want):
    assert answer_follows_cells(text) is want


def test_reading_report_on_the_shipped_model_names_both_steps():
    import re
    from pathlib import Path

    from mmgrpo_shapes.programs.vqa_report import reading_report

    line = reading_report(str(Path(__file__).resolve().parents[1] / "assets" / "shapes-vlm"), "test", 24)
    pattern = r"where questions: accuracy ([\d.]+) \(n (\d+)\); position thinks exact ([\d.]+), cell marks right ([\d.]+) \(n (\d+)\), answer follows its cells ([\d.]+) \(n (\d+)\)"
    m = re.fullmatch(pattern, line)
    assert m, line
    assert int(m.group(5)) >= 1 and int(m.group(7)) <= int(m.group(5))
    assert float(m.group(3)) <= float(m.group(4)) <= 1.0  # an exact think has both marks right
