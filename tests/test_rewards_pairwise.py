"""Pref-GRPO pairwise win-rate reward: preference matrices and win rates against hand-worked groups."""

import math

import pytest
import torch

import rewards
from rewards.pairwise import PairwiseReward, parse_preference, prefs_from_scores, win_rates


def test_prefs_and_win_rates_by_hand():
    # group scores [3, 1, 2, 2]: sample 0 beats all (3/3 = 1); sample 1 loses all (0);
    # samples 2 and 3 beat sample 1, lose to 0, tie each other: (1 + 0 + 0.5) / 3 = 0.5
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0]])
    prefs = prefs_from_scores(scores)
    assert prefs.shape == (1, 4, 4)
    assert prefs[0, 2, 3] == 0.5 and prefs[0, 0, 1] == 1.0 and prefs[0, 1, 0] == 0.0
    assert win_rates(prefs).tolist() == [[1.0, 0.0, 0.5, 0.5]]
    # tie_eps 1.5 makes every gap below 1.5 a tie: sample 0 vs 1 (gap 2) still a win
    # sample 0: (1 + 0.5 + 0.5) / 3 = 2/3; sample 1: (0 + 0.5 + 0.5) / 3 = 1/3; samples 2, 3: 0.5
    soft = win_rates(prefs_from_scores(scores, tie_eps=1.5))
    assert soft[0].tolist() == pytest.approx([2 / 3, 1 / 3, 0.5, 0.5])


def test_soft_preferences_sum_to_one():
    s = torch.tensor([[0.0, 1.0]])
    p = prefs_from_scores(s, temperature=1.0)
    # P(1 beats 0) = sigmoid(1) = 0.7310586
    assert p[0, 1, 0].item() == pytest.approx(1 / (1 + math.exp(-1)))
    assert (p[0, 0, 1] + p[0, 1, 0]).item() == pytest.approx(1.0)
    # group of 1: nothing to compare, 0.5
    assert win_rates(torch.zeros(2, 1, 1)).tolist() == [[0.5], [0.5]]


@pytest.mark.parametrize(
    "text, p",
    [
        ("<think>...</think><answer>Image 1 is better</answer>", 1.0),
        ("Image 2 is better.", 0.0),
        ("1", 1.0),
        ("B", 0.0),
        ("The second one", 0.0),
        ("It's a tie", 0.5),
        ("Image 1 and Image 2 are equal", 0.5),
        ("I cannot decide", 0.5),
        ("", 0.5),
    ],
)
def test_parse_preference(text, p):
    assert parse_preference(text) == p


def test_judge_counts_pairs_ties_and_unparsable():
    calls = []

    def judge(a, b, prompt):  # prefers the larger number; 2 vs 3 is unparsable
        calls.append((a, b))
        if {a, b} == {2, 3}:
            return "no idea"
        return "Image 1 is better" if a > b else "Image 2 is better"

    r = PairwiseReward(judge=judge, symmetric=False)
    prefs, win = r.win_matrix([1, 2, 3, 10, 20, 30], group_size=3)
    assert prefs.shape == (2, 3, 3) and win.shape == (2, 3)
    # group 1: 1 loses both (0); 2 beats 1, 2-vs-3 unparsable (0.5) -> 0.75; 3 beats 1, 0.5 -> 0.75
    # group 2: strict order 10 < 20 < 30 -> 0, 0.5, 1
    assert win.tolist() == [[0.0, 0.75, 0.75], [0.0, 0.5, 1.0]]
    assert len(calls) == 2 * 3  # C(3,2) = 3 pairs per group, one call each
    out = r([1, 2, 3, 10, 20, 30], group_size=3)
    assert out.tolist() == [0.0, 0.75, 0.75, 0.0, 0.5, 1.0] and r.kind == "groupwise"


def test_symmetric_judge_removes_position_bias():
    r = PairwiseReward(judge=lambda a, b, p: "Image 1 is better", symmetric=True)  # always picks the first shown
    assert r.win_matrix(["x", "y"], group_size=2)[1].tolist() == [[0.5, 0.5]]


def test_pairwise_registered_over_a_pointwise_scorer():
    texts = ["<answer>4</answer>", "<answer>5</answer>", "<answer>4</answer>", "<answer>7</answer>"]
    r = rewards.load("pairwise", base="accuracy", base_kwargs={"use_math_verify": False})
    assert r.fields == ("answers",)
    # accuracy [1, 0, 1, 0] in one group: correct ones beat 2 wrong, tie 1 correct -> (1 + 1 + 0.5) / 3 = 5/6
    out = r(texts, answers=["4"] * 4, group_size=4)
    assert out.tolist() == pytest.approx([5 / 6, 1 / 6, 5 / 6, 1 / 6])
    per, total = rewards.RewardSet([{"name": "pairwise", "kwargs": {"base": "format"}}])(texts, group_size=2)
    assert per.shape == (4, 1) and total.tolist() == [0.5] * 4  # all format 0 -> all ties
    with pytest.raises(ValueError, match="group_size"):
        r(texts, answers=["4"] * 4)
