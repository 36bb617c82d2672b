"""Rule rewards (rewards.rules and their registered wrappers) against hand-worked edge cases."""

import math
import threading

import pytest
import torch

import rewards
from rewards import rules


# ---- format -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, strict, lenient",
    [
        ("<think>r</think>\n<answer>a</answer>", True, True),
        ("  <think>r</think><answer> a </answer>\n", True, True),
        ("<think>r</think><answer>a</answer> trailing", False, True),
        ("intro <think>r</think> mid <answer>a</answer>", False, True),
        ("<think>r</think><answer>a</answer><answer>b</answer>", False, True),  # .*? fullmatch would accept this
        ("<think>r</think><answer> </answer>", False, False),  # empty answer
        ("<answer>a</answer>", False, False),
        ("<answer>a</answer><think>r</think>", False, False),  # wrong order
        ("", False, False),
    ],
)
def test_format_modes(text, strict, lenient):
    assert rules.format_ok(text, mode="strict") is strict
    assert rules.format_ok(text, mode="lenient") is lenient


def test_format_empty_think_only_when_allowed():
    text = "<think>\n\n</think>\n<answer>42</answer>"  # TON's thought dropout output
    assert not rules.format_ok(text)
    assert rules.format_ok(text, allow_empty_think=True)
    r = rewards.load("format", allow_empty_think=True)
    assert r([text, "no tags"]).tolist() == [1.0, 0.0]


def test_format_bad_mode_fails_at_load():
    with pytest.raises(ValueError, match="strict"):
        rewards.load("format", mode="loose")


# ---- accuracy (fallback path is always exercised with use_math_verify=False) -------------------------------
@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        ("1/2", "0.5", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\boxed{3}", "3", True),
        ("$3$.", "3", True),
        ("1,000", "1000", True),
        ("50%", "0.5", True),
        ("x + 1", "X+1", True),  # normalised string match
        ("3", "4", False),
        ("", "", False),  # an empty answer never matches (Visual-RFT#176 substring hack)
        ("   ", "3", False),
        ("1/0", "1/0", True),  # identical strings match even if not numbers
        ("2/0", "1/0", False),
    ],
)
def test_math_equal_fallback(pred, gold, equal):
    assert rules.math_equal(pred, gold, use_math_verify=False) is equal


def test_parse_number_exact():
    # 3/4 = 0.75 exactly; 1e3 = 1000; -2.5; 12.5% = 1/8
    assert rules.parse_number("3/4") == rules.parse_number("0.75")
    assert float(rules.parse_number("1e3")) == 1000.0
    assert float(rules.parse_number("-2.5")) == -2.5
    assert float(rules.parse_number("12.5%")) == 0.125
    assert rules.parse_number("three") is None


def test_accuracy_reward_uses_answer_block():
    r = rewards.load("accuracy", use_math_verify=False)
    texts = ["<think>2+2=5?</think><answer>4</answer>", "<think>it is 4</think><answer>5</answer>", "4"]
    assert r(texts, answers=["4", "4", "4"]).tolist() == [1.0, 0.0, 1.0]


def test_accuracy_needs_answers():
    with pytest.raises(ValueError, match="answers"):
        rewards.load("accuracy")(["4"])


def test_accuracy_math_verify_path_when_installed():
    pytest.importorskip("math_verify")
    assert rules.math_equal("\\frac{2}{4}", "$\\frac{1}{2}$")
    assert not rules.math_equal("\\frac{3}{4}", "$\\frac{1}{2}$")


def test_math_verify_timeout_holds_outside_the_main_thread(monkeypatch):
    # signal.alarm (math-verify's timeout) works only in the main thread; the reward server scores in worker
    # threads. A verify that never returns must still give a verdict: the fallback comparison after `timeout`.
    math_verify = pytest.importorskip("math_verify")
    never = threading.Event()
    monkeypatch.setattr(math_verify, "verify", lambda *a, **k: never.wait())  # blocks until the test ends
    out = {}
    worker = threading.Thread(
        target=lambda: out.update(
            same=rules.math_equal("\\frac{1}{2}", "0.5", timeout=0.05),  # fallback: 1/2 == 0.5 exactly
            differ=rules.math_equal("\\frac{1}{3}", "0.5", timeout=0.05),
        )
    )
    worker.start()
    worker.join(60)  # a hang guard, not a timing check: without the timeout this join would never succeed
    never.set()
    assert not worker.is_alive() and out == {"same": True, "differ": False}


# ---- multiple choice / numeric ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, letter",
    [
        ("B", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("B) a cat", "B"),
        ("B: a cat", "B"),
        ("b", "B"),
        ("A, B", None),
        ("AB", None),
        ("A or B", None),
        ("B. or C", None),
        ("", None),
        ("The answer is B", None),
    ],
)
def test_choice_letter(text, letter):
    assert rules.choice_letter(text) == letter


def test_multiple_choice_rejects_hacks():
    r = rewards.load("multiple_choice")
    texts = ["<answer>B</answer>", "<answer>A, B, C, D</answer>", "<answer></answer>", "<answer>(b)</answer>"]
    assert r(texts, answers=["B"] * 4).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_numeric_tolerance():
    # |3.14 - 3.14159| = 0.00159: within atol 0.01, outside atol 1e-3; rtol 1e-3 allows 0.00314
    assert rules.numeric_close("3.14", 3.14159, atol=0.01)
    assert not rules.numeric_close("3.14", 3.14159, atol=1e-3)
    assert rules.numeric_close("3.14", 3.14159, atol=0.0, rtol=1e-3)
    assert not rules.numeric_close("about three", 3)
    r = rewards.load("numeric", atol=0.5)
    assert r(["<answer>10.4</answer>", "<answer>10.6</answer>"], answers=[10, 10]).tolist() == [1.0, 0.0]


# ---- box IoU --------------------------------------------------------------------------------------------------
def test_box_iou_hand_values():
    # (0,0,10,10) vs (5,5,15,15): inter 5*5 = 25, union 100 + 100 - 25 = 175 -> 1/7
    assert rules.box_iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(1 / 7)
    # VLM-R1's pixel-inclusive IoU gives 0 here; the continuous one: inter 1, union 100 + 121 - 1 = 220
    assert rules.box_iou([0, 0, 10, 10], [9, 9, 20, 20]) == pytest.approx(1 / 220)
    assert rules.box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert rules.box_iou([0, 0, 1, 1], [2, 2, 3, 3]) == 0.0
    assert rules.box_iou([5, 5, 5, 5], [5, 5, 5, 5]) == 0.0  # empty union
    assert rules.box_iou([10, 0, 0, 10], [0, 0, 10, 10]) == 0.0  # reversed box


def test_box_rescale_and_reward():
    # model saw 200x100 (w, h); GT frame is 100x200: x halves, y doubles
    assert rules.rescale_box([20, 10, 60, 20], (200, 100), (100, 200)) == [10, 20, 30, 40]
    r = rewards.load("box_iou")
    out = r(
        ["<answer>[20, 10, 60, 20]</answer>", "<answer>no box</answer>"],
        boxes=[[10, 20, 30, 40]] * 2,
        input_sizes=[(200, 100)] * 2,
        image_sizes=[(100, 200)] * 2,
    )
    assert out.tolist() == [1.0, 0.0]
    thr = rewards.load("box_iou", threshold=0.5)
    # vs (0,0,10,8): (0,0,10,10) -> 80/100 = 0.8 >= 0.5; (0,0,10,3) -> 30/80 = 0.375 < 0.5
    assert thr(["[0,0,10,10]", "[0,0,10,3]"], boxes=[[0, 0, 10, 8]] * 2).tolist() == [1.0, 0.0]


# ---- temporal IoU and TempSamp shaping -------------------------------------------------------------------------
def test_temporal_iou_hand_values():
    # (2,6) vs (4,10): inter 6-4 = 2, union 10-2 = 8
    assert rules.temporal_iou((2, 6), (4, 10)) == 0.25
    assert rules.temporal_iou((0, 1), (2, 3)) == 0.0
    assert rules.temporal_iou((5, 5), (5, 5)) == 0.0  # empty union scores 0, not 1 (VideoChat-R1 returns 1.0)
    assert rules.temporal_iou((6, 2), (2, 6)) == 0.0  # reversed prediction


@pytest.mark.parametrize(
    "text, span",
    [
        ("from 3.5 to 7.25 seconds", (3.5, 7.25)),
        ("3 and 9", (3.0, 9.0)),
        ("[1.0, 2.0]", (1.0, 2.0)),
        ("12.5 - 14", (12.5, 14.0)),
        ("starts at 4s, ends at 8s", (4.0, 8.0)),
        ("none", None),
    ],
)
def test_parse_span(text, span):
    assert rules.parse_span(text) == span


def test_tempsamp_shaping_hand_values():
    # TempSamp-R1: iou >= th: th + 0.01 * log(1 + iou - th);  else th - (e^(a(th - iou)) - 1) / (e^a - 1)
    # iou 0.9, th 0.8: 0.8 + 0.01 * ln(1.1) = 0.8 + 0.000953102 = 0.800953102
    assert rules.tempsamp_shaping(0.9) == pytest.approx(0.800953102, abs=1e-9)
    # iou 0.5: e^0.3 - 1 = 0.3498588076, e - 1 = 1.7182818285 -> 0.8 - 0.2036125... = 0.5963875
    assert rules.tempsamp_shaping(0.5) == pytest.approx(0.8 - 0.3498588076 / 1.7182818285, abs=1e-9)
    assert rules.tempsamp_shaping(0.8) == pytest.approx(0.8)  # continuous at the threshold
    # iou 0: 0.8 - (e^0.8 - 1)/(e - 1) = 0.8 - 1.2255409285/1.7182818285 = 0.0867...
    assert rules.tempsamp_shaping(0.0) == pytest.approx(0.8 - 1.2255409285 / 1.7182818285, abs=1e-9)


def test_temporal_iou_reward_with_shaping():
    texts = ["<answer>2 to 6</answer>", "<answer>nothing</answer>"]
    assert rewards.load("temporal_iou")(texts, spans=[(4, 10)] * 2).tolist() == [0.25, 0.0]
    shaped = rewards.load("temporal_iou", shaping="tempsamp")(texts, spans=[(4, 10)] * 2)
    expect = [0.8 - math.expm1(0.55) / math.expm1(1.0), 0.8 - math.expm1(0.8) / math.expm1(1.0)]
    torch.testing.assert_close(shaped, torch.tensor(expect, dtype=torch.float32))


def test_temporal_recall_at_m():
    # IoUs vs span (4, 10): [4,10] -> 1; [2,6] -> overlap 2 / union 8 = 0.25; [5,10] -> 5/6 = 0.833; [7,10] -> 3/6 = 0.5
    texts = [
        "<answer>4 to 10</answer>",
        "<answer>2 to 6</answer>",
        "<answer>5 to 10</answer>",
        "<answer>7 to 10</answer>",
        "<answer>no span</answer>",
    ]
    r05 = rewards.load("temporal_iou", recall_at=0.5)(texts, spans=[(4, 10)] * 5)
    assert r05.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]  # IoU exactly 0.5 counts (R@m is IoU >= m)
    r07 = rewards.load("temporal_iou", recall_at=0.7)(texts, spans=[(4, 10)] * 5)
    assert r07.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="recall_at"):
        rewards.load("temporal_iou", recall_at=1.5)


# ---- length ------------------------------------------------------------------------------------------------------
def test_cosine_length_hand_values():
    # correct: 0.5 + 0.5 * (1 + cos(pi L / Lmax)) / 2 -> L=0: 1.0, L=Lmax/2: 0.75, L=Lmax: 0.5
    assert rules.cosine_length(0, True, max_len=100) == pytest.approx(1.0)
    assert rules.cosine_length(50, True, max_len=100) == pytest.approx(0.75)
    assert rules.cosine_length(100, True, max_len=100) == pytest.approx(0.5)
    assert rules.cosine_length(500, True, max_len=100) == pytest.approx(0.5)
    # wrong: 0 - 0.5 * (1 + cos) / 2 -> L=0: -0.5 (short wrong answers are worst), L=Lmax: 0.0
    assert rules.cosine_length(0, False, max_len=100) == pytest.approx(-0.5)
    assert rules.cosine_length(100, False, max_len=100) == pytest.approx(0.0)


def test_cosine_length_reward_uses_real_correctness():
    # VLM-R1's bug scored every answer as correct; here a wrong answer of the same length scores lower
    r = rewards.load("cosine_length", max_len=100)
    out = r(["<answer>4</answer>", "<answer>5</answer>"], answers=["4", "4"], lengths=[50, 50])
    assert out.tolist() == pytest.approx([0.75, -0.25])
    out = r(["a", "b"], correct=[True, False], lengths=[0, 0])
    assert out.tolist() == pytest.approx([1.0, -0.5])


def test_overlong_penalty_hand_values():
    # Lmax 100, cache 20: 0 up to 80, (80 - L) / 20 between, -1 beyond
    got = [rules.overlong_penalty(n, max_len=100, cache_len=20) for n in (10, 80, 90, 100, 101)]
    assert got == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="cache_len"):
        rewards.load("overlong", max_len=10, cache_len=20)


# ---- edit distance, WER, OCR target ----------------------------------------------------------------------------
def test_edit_distance_and_wer():
    assert rules.edit_distance("kitten", "sitting") == 3
    assert rules.edit_distance("", "abc") == 3
    assert rules.edit_distance(["a", "b"], ["a", "b"]) == 0
    assert rules.word_error_rate("the cat sat", "the cat sat down") == 0.25  # one deletion / 4 words
    assert rules.word_error_rate("", "") == 0.0
    r = rewards.load("wer")
    assert r(["the cat sat", "x y z w v u t s"], answers=["the cat sat down", "a"]).tolist() == [0.75, 0.0]


def test_ocr_similarity_and_quotes():
    assert rules.quoted_text('a neon sign that says "OPEN 24h" at night') == "OPEN 24h"
    assert rules.quoted_text('a “curly” and "straight" pair') == "curly straight"
    assert rules.quoted_text("no quotes") is None
    # 'hel1oworld' vs 'helloworld': one substitution over 10 characters
    assert rules.ocr_similarity("Hel1o World", "hello world") == pytest.approx(0.9)
    assert rules.ocr_similarity("completely different and long", "ab") == 0.0
    assert rules.ocr_similarity("", "") == 1.0
    # extra text around the target: 'openextra' vs 'open' needs 5 deletions, capped at len 4 -> 1 - 4/4 = 0;
    # Flow-GRPO's substring rule scores it 1.0
    assert rules.ocr_similarity("OPEN extra", "open") == 0.0
    assert rules.ocr_similarity("OPEN extra", "open", substring=True) == 1.0
    assert rules.ocr_similarity("OPFN", "open", substring=True) == pytest.approx(0.75)  # 1 substitution of 4


def test_rule_rewards_reject_non_text_and_unknown_fields():
    with pytest.raises(ValueError, match="text"):
        rewards.load("format")([torch.zeros(3, 4, 4)])
    with pytest.raises(ValueError, match="no field 'answer'"):
        rewards.load("accuracy")(["4"], answer=["4"])
    with pytest.raises(ValueError, match="2 entries for 1 samples"):
        rewards.load("accuracy")(["4"], answers=["4", "5"])
