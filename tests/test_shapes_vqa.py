"""Tests for the ShapesWorld VQA set: answers on hand-built scenes, determinism, splits, JSONL writer, normaliser."""

import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from mmgrpo_shapes.scenes import SHAPES, Scene, SceneObject, list_prompts
from mmgrpo_shapes.verifier import detect
from mmgrpo_shapes.vqa import (
    QUESTION_TYPES,
    TEMPLATE_ANSWERS,
    check_answer,
    extract_answer,
    make_vqa,
    question_template,
    read_vqa_jsonl,
    scene_questions,
    write_vqa_jsonl,
)


@pytest.fixture
def scene():
    # two red circles (top-left, bottom-left) and one blue square (right)
    return Scene(
        (
            SceneObject("circle", "red", 0.2, 0.2, 0.12),
            SceneObject("circle", "red", 0.2, 0.8, 0.12),
            SceneObject("square", "blue", 0.75, 0.5, 0.15),
        ),
        None,
        32,
    )


def _qa(scene):
    qas = scene_questions(scene, np.random.default_rng(0))
    return {q: a for pairs in qas.values() for q, a in pairs}, qas


def test_answers_on_hand_built_scene(scene):
    qa, _ = _qa(scene)
    assert qa["How many circles are there?"] == "2"
    assert qa["How many squares are there?"] == "1"
    assert qa["How many triangles are there?"] == "0"
    assert qa["How many red objects are there?"] == "2"
    assert qa["How many objects are there in total?"] == "3"
    assert qa["What color is the square?"] == "blue"
    assert qa["What shape is the blue object?"] == "square"
    assert qa["Is there a blue square?"] == "yes" and qa["Is there a red circle?"] == "yes"
    # 2 circles + 1 square = 3; 2 - 1 = 1; 1 + 2 = 3
    assert qa["How many circles and squares are there altogether?"] == "3"
    assert qa["How many more circles than squares are there?"] == "1"
    assert qa["If two more squares were added, how many squares would there be?"] == "3"


def test_ambiguous_questions_are_not_asked(scene):
    qa, qas = _qa(scene)
    # two circles: "what color is the circle" and positions of "the red circle" have no unique answer
    assert "What color is the circle?" not in qa
    assert "What shape is the red object?" not in qa
    assert not any("red circle" in q for q, _ in qas["position"])
    # the only unique objects are the blue square: no pair, no position question
    assert qas["position"] == []


def test_position_and_existence_answers():
    s = Scene((SceneObject("circle", "red", 0.2, 0.5, 0.12), SceneObject("triangle", "green", 0.8, 0.5, 0.12)))
    qa, qas = _qa(s)
    assert qa["Is the red circle left of the green triangle?"] == "yes"
    assert qa["Is the green triangle left of the red circle?"] == "no"
    # same height: neither "above" nor "below" is clear, so it is not asked
    assert "Is the red circle above the green triangle?" not in qa
    ex = qas["existence"]
    assert sum(a == "yes" for _, a in ex) == sum(a == "no" for _, a in ex) == 2
    for q, a in ex:
        name = q[len("Is there a ") : -1]
        assert (a == "yes") == (name in ("red circle", "green triangle"))


def test_make_vqa_is_deterministic_and_split_aligned():
    a = make_vqa("val", 20, seed=1)
    b = make_vqa("val", 20, seed=1)
    c = make_vqa("val", 20, seed=2)
    assert [r["question"] for r in a] == [r["question"] for r in b]
    assert all(np.array_equal(x["image"], y["image"]) for x, y in zip(a, b))
    assert [r["question"] for r in a] != [r["question"] for r in c]
    val_prompts = set(list_prompts("val"))
    # scenes of T2I prompts come from the split's prompts only; the others are random scenes (prompt None)
    assert all((r["prompt"] is None or r["prompt"] in val_prompts) and r["split"] == "val" for r in a)
    assert any(r["prompt"] is not None for r in a) and any(r["prompt"] is None for r in a)
    assert {r["type"] for r in make_vqa("train", 60)} == set(QUESTION_TYPES)


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_answers_are_balanced_per_template(split):
    # decks: in any prefix, per type, per template and per answer the counts differ by at most one
    recs = make_vqa(split, 400, seed=7)
    types = Counter(r["type"] for r in recs)
    assert set(types) == set(QUESTION_TYPES) and max(types.values()) - min(types.values()) <= 1
    by = defaultdict(Counter)
    for r in recs:
        template = question_template(r["question"])
        assert r["answer"] in TEMPLATE_ANSWERS[r["type"]][template], (r["question"], r["answer"])
        by[template][r["answer"]] += 1
    for template, counts in by.items():
        kind = next(k for k, v in TEMPLATE_ANSWERS.items() if template in v)
        full = [counts[a] for a in TEMPLATE_ANSWERS[kind][template]]
        assert max(full) - min(full) <= 1, (template, counts)


def test_blind_predictors_sit_at_chance():
    # the majority answer per template (or per type) fitted on train scores chance on test: 1 / answers per template
    train = make_vqa("train", 600, seed=0)
    test = make_vqa("test", 300, seed=0)
    for key in (lambda r: question_template(r["question"]), lambda r: r["type"]):
        fit = defaultdict(Counter)
        for r in train:
            fit[key(r)][r["answer"]] += 1
        for kind in QUESTION_TYPES:
            rows = [r for r in test if r["type"] == kind]
            acc = np.mean([fit[key(r)].most_common(1)[0][0] == r["answer"] for r in rows])
            chance = np.mean([1 / len(TEMPLATE_ANSWERS[kind][question_template(r["question"])]) for r in rows])
            assert acc <= chance + 0.02, (kind, acc, chance)


def test_question_templates_mask_colours_and_shapes():
    assert question_template("What color is the triangle?") == "What color is the _?"
    assert question_template("How many red objects are there?") == "How many _ objects are there?"
    assert question_template("Is the blue square above the red circle?") == "Is the _ _ above the _ _?"
    # every question a scene supports has a known template and a listed answer
    _, qas = _qa(Scene((SceneObject("circle", "red", 0.2, 0.2, 0.12), SceneObject("square", "blue", 0.75, 0.5, 0.15))))
    for kind, pairs in qas.items():
        for q, a in pairs:
            assert a in TEMPLATE_ANSWERS[kind][question_template(q)], (q, a)


def test_count_answers_agree_with_the_detector():
    # the dataset's answers are about what is drawn: the verifier's detector sees the same counts
    for r in make_vqa("test", 40, seed=3, types=("count",)):
        q = r["question"]
        dets = detect(r["image"])
        if q.startswith("How many objects"):
            assert int(r["answer"]) == len(dets)
        elif q[len("How many ") : -len("s are there?")] in SHAPES:
            shape = q[len("How many ") : -len("s are there?")]
            assert int(r["answer"]) == sum(d["shape"] == shape for d in dets), q


def test_writer_round_trip(tmp_path):
    recs = make_vqa("train", 5, seed=0)
    path = write_vqa_jsonl(recs, tmp_path, name="shapes_vqa_train")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert [r["image"] for r in rows] == [f"images/{r['id']}.png" for r in recs]
    assert all({"image", "question", "answer", "type"} <= set(r) for r in rows)
    back = read_vqa_jsonl(path)
    assert all(np.array_equal(x["image"], y["image"]) for x, y in zip(back, recs))
    assert [x["answer"] for x in back] == [y["answer"] for y in recs]


@pytest.mark.parametrize(
    "pred, ref, ok",
    [
        ("<think>two red circles</think><answer>Two</answer>", "2", True),
        ("<answer>3</answer>", "2", False),
        ("2.0", "2", True),
        ("Red.", "red", True),
        ("the blue square", "blue square", True),
        ("circles", "circle", True),
        ("Yes", "yes", True),
        ("no", "yes", False),
        ("<answer> left </answer>", "left", True),
    ],
)
def test_check_answer(pred, ref, ok):
    assert check_answer(pred, ref) is ok


def test_extract_answer_takes_the_last_block():
    assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_answer("no tags") is None


def test_unknown_question_type_raises():
    with pytest.raises(ValueError, match="types"):
        make_vqa("train", 2, types=("colour",))
