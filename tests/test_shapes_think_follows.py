"""shapes_think_follows: whether a ShapesWorld VQA answer is the one its own think implies (Faithful GRPO's
answer-reasoning consistency, arXiv:2604.08476), checked against answers worked out by hand."""

import pytest

import rewards
from mmgrpo_shapes.vqa_think import objects_think, position_think, think_follows_score
from pipelines.vlm.data import shapes_vqa_records


def done(think: str, answer: str) -> str:
    return f"<think>{think}</think><answer>{answer}</answer>"


@pytest.mark.parametrize(
    "prompt, text, want",
    [
        # the list "rc1 bc3 gs2": 2 circles, 1 green object, 3 in total
        ("How many circles are there?", done("rc1 bc3 gs2", "2"), 1.0),
        ("How many circles are there?", done("rc1 bc3 gs2", "two"), 1.0),  # number words normalised
        ("How many circles are there?", done("rc1 bc3 gs2", "3"), 0.0),
        ("How many green objects are there?", done("rc1 bc3 gs2", "1"), 1.0),
        ("How many objects are there in total?", done("rc1 bc3 gs2", "3"), 1.0),
        ("Is there a blue circle?", done("rc1 bc3 gs2", "yes"), 1.0),
        ("Is there a blue square?", done("rc1 bc3 gs2", "yes"), 0.0),  # no bs mark: the list says no
        ("How many more circles than squares are there?", done("rc1 bc3 gs2", "1"), 1.0),  # 2 - 1
        ("If two more squares were added, how many squares would there be?", done("rc1 bc3 gs2", "3"), 1.0),
        # a wrong list with the answer it implies still follows: the score is about the step, not the scene
        ("How many circles are there?", done("rc1", "1"), 1.0),
        ("How many circles are there?", done("Count them.", "0"), 0.0),  # no marks: nothing to follow
        ("How many circles are there?", "<think>rc1 bc3</think>", 0.0),  # no answer
        ("How many circles are there?", "<answer>2</answer>", 0.0),  # no think
        # position: "x rc1 bs3": the circle's column 1 < the square's 3, so "left of" is yes
        ("Is the red circle left of the blue square?", done("x rc1 bs3", "yes"), 1.0),
        ("Is the red circle left of the blue square?", done("x rc1 bs3", "no"), 0.0),
        ("Is the red circle left of the blue square?", done("x rc2 bs2", "no"), 0.0),  # one cell: undecided
        ("What color is the circle?", done("Find it.", "red"), 0.0),  # nothing to follow
    ],
)
def test_follows_by_hand(prompt, text, want):
    assert think_follows_score(text, prompt) == want


def test_every_list_and_position_answer_of_the_pipeline_follows_from_its_sft_think():
    """The SFT target of every count, existence, arithmetic and position record follows from its own think; colour
    and shape score 0. If a template or an answer rule changed without the other, this fails."""
    recs = shapes_vqa_records("train", 400, seed=0)
    for r in recs:
        think = position_think(r) if r["category"] == "position" else objects_think(r["objects"])
        got = think_follows_score(done(think, r["answers"]), r["prompt"])
        if r["category"] in ("color", "shape"):
            assert got == 0.0
        elif r["category"] == "position" and think.split()[1][-1] == think.split()[2][-1]:
            assert got == 0.0  # both objects in one cell: the cells cannot decide
        else:
            assert got == 1.0, (r["prompt"], think, r["answers"])


def test_the_registered_reward_scores_a_batch():
    reward = rewards.load("shapes_think_follows")
    texts = [done("rc1 bc3", "2"), done("rc1 bc3", "1"), done("Find it.", "red")]
    prompts = ["How many circles are there?"] * 2 + ["What color is the circle?"]
    assert list(reward(texts, prompts=prompts)) == [1.0, 0.0, 0.0]
