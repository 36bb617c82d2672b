"""RewardSet, RewardError, Trust-GRPO weighting, GRPO-CARE bonus, JPEG rewards and the registry API."""

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from rewards.api import REWARDS, FunctionReward


@pytest.fixture
def temp_reward():
    """Register throw-away rewards for one test and remove them afterwards."""
    added = []

    def add(name, fn, **kw):
        REWARDS.register(name, lambda: FunctionReward(fn, name=name, **kw))
        added.append(name)

    yield add
    for name in added:
        REWARDS._items.pop(name, None)
        REWARDS._meta.pop(name, None)


def test_api_lists_and_describes():
    names = rewards.names()
    assert {"format", "accuracy", "box_iou", "temporal_iou", "jpeg_compressibility", "trust_grpo"} <= set(names)
    desc = rewards.describe()
    assert set(desc) == set(names) and all(desc[n] and "\n" not in desc[n] for n in names)
    r = rewards.load("format")
    assert (r.name, r.kind, r.input) == ("format", "pointwise", "text") and r.preprocess


def test_declared_kind_matches_the_loaded_reward():
    # the registry metadata (what `rewards list` shows) and the Reward object agree on groupwise vs pointwise
    loadable = {"pairwise": {"base": "format"}, "trust_grpo": {}, "grpo_care": {}, "format": {}, "wer": {}}
    for name, kw in loadable.items():
        declared = rewards.info(name).get("kind", "pointwise")
        assert rewards.load(name, **kw).kind == declared, name
    assert rewards.info("pairwise_judge")["kind"] == "groupwise"


_TEXTS = ["<think>r</think><answer>B</answer>", "<answer>[0, 0, 2, 2]</answer>"]
_CONTRACT = {  # every reward that needs no model: fields for two samples
    "format": {},
    "accuracy": {"answers": ["B", "4"]},
    "multiple_choice": {"answers": ["B", "C"]},
    "numeric": {"answers": [1, 2]},
    "box_iou": {"boxes": [[0, 0, 1, 1], [0, 0, 2, 2]]},
    "temporal_iou": {"spans": [(0, 1), (0, 2)]},
    "cosine_length": {"correct": [True, False]},
    "overlong": {"lengths": [10, 2000]},
    "wer": {"answers": ["B", "x"]},
    "edit_similarity": {"answers": ["B", "x"]},
    "trust_grpo": {"answers": ["B", "4"], "step": 0, "group_size": 2},
    "grpo_care": {"answers": ["B", "4"], "likelihood": [0.5, 0.4], "group_size": 2},
}


@pytest.mark.parametrize("name", sorted(_CONTRACT))
def test_reward_contract(name):
    # declared kind/input/preprocessing, and a float32 [N] tensor back for every model-free rule reward
    r = rewards.load(name)
    out = r(_TEXTS, ["q", "q"], **_CONTRACT[name])
    assert out.dtype == torch.float32 and out.shape == (2,) and torch.isfinite(out).all()
    assert r.input == rewards.info(name)["input"] and r.kind in ("pointwise", "groupwise") and r.preprocess


def test_docs_table_has_every_reward():
    # Done-when of the rewards issue: the rewards reference (docs/rewards.md, the one copy) lists every reward with
    # input, range, source, load
    from pathlib import Path

    section = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text()
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    names = [n for n in rewards.names() if REWARDS.get(n).__module__.startswith("rewards.")]
    for name in names:
        row = [r for r in rows if f"`{name}`" in r.split("|")[1]]
        assert row, f"docs/rewards.md table has no row for {name!r}"
        cells = [c.strip() for c in row[0].strip("|").split("|")]
        assert len(cells) == 5 and all(cells), (
            f"docs/rewards.md row for {name!r} needs reward, input, range, source, load"
        )
        assert f'load("{name}"' in cells[4] or f"load('{name}'" in cells[4], (
            f"docs/rewards.md row for {name!r}: how to load"
        )


def test_load_unknown_and_bad_kwargs():
    with pytest.raises(ValueError, match="unknown reward 'formt'.*did you mean 'format'"):
        rewards.load("formt")
    with pytest.raises(ValueError, match="takes no keyword 'mdoe'.*did you mean 'mode'"):
        rewards.load("format", mdoe="strict")


def test_reward_set_weighted_sum():
    texts = ["<think>r</think><answer>4</answer>", "<think>r</think><answer>5</answer>", "4"]
    rs = rewards.RewardSet(
        [{"name": "format", "weight": 0.5}, {"name": "accuracy", "weight": 2.0, "kwargs": {"use_math_verify": False}}]
    )
    per, total = rs(texts, ["q"] * 3, group_size=3, answers=["4", "4", "4"])
    # format [1, 1, 0], accuracy [1, 0, 1] -> total 0.5*f + 2*a = [2.5, 0.5, 2.0]
    assert per.dtype == torch.float32 and per.shape == (3, 2)
    assert per.tolist() == [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    assert total.tolist() == [2.5, 0.5, 2.0]
    assert rs.names == ["format", "accuracy"]
    assert rs.weights.tolist() == [0.5, 2.0]


def test_reward_set_validation_messages():
    with pytest.raises(ValueError, match="unknown reward 'pickscor'.*choose from"):
        rewards.RewardSet([{"name": "pickscor"}])
    with pytest.raises(ValueError, match="reward 'format' kwargs.*'strictness'"):
        rewards.RewardSet([{"name": "format", "kwargs": {"strictness": 1}}])
    with pytest.raises(ValueError, match="unknown key"):
        rewards.RewardSet([{"name": "format", "wieght": 1.0}])
    with pytest.raises(ValueError, match="weight"):
        rewards.RewardSet([{"name": "format", "weight": float("nan")}])
    with pytest.raises(ValueError, match="at least one"):
        rewards.RewardSet([])


def test_reward_error_names_reward_and_sample():
    rs = rewards.RewardSet(["format", "box_iou"])
    texts = ["[0,0,1,1]", "[0,0,1,1]", "[0,0,1,1]"]
    with pytest.raises(rewards.RewardError, match=r"reward 'box_iou' failed on sample 1 .*4 numbers") as info:
        rs(texts, boxes=[[0, 0, 1, 1], [0, 0, 1], [0, 0, 1, 1]])  # sample 1's ground truth has 3 numbers
    assert info.value.reward_name == "box_iou" and info.value.sample_index == 1


def test_nan_passes_through(temp_reward):
    temp_reward("test_nan_reward", lambda s, p: [float("nan"), 1.0])
    per, total = rewards.RewardSet(["test_nan_reward", "format"])(["a", "b"])
    assert math.isnan(per[0, 0]) and math.isnan(total[0]) and per[1, 0] == 1.0


def test_reward_returning_wrong_count_is_an_error(temp_reward):
    temp_reward("test_short_reward", lambda s, p: [1.0])
    with pytest.raises(rewards.RewardError, match="returned 1 scores for 2 samples"):
        rewards.RewardSet(["test_short_reward"])(["a", "b"])


def test_trust_weight_hand_values():
    # group 1: correct thinking mean (0.2+0.4)/2 = 0.3 < wrong mean (0.8+0.6)/2 = 0.7 -> trust e^-0.4
    # group 2: correct mean 0.9 > wrong mean 0.1 -> trust 1
    answer = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    thinking = torch.tensor([[0.2, 0.4, 0.8, 0.6], [0.9, 0.1, 0.9, 0.1]])
    w = rewards.trust_weight(answer, thinking, step=0, anneal_steps=300, base=0.3)
    assert w.shape == (2, 1)
    assert w[:, 0].tolist() == pytest.approx([0.3 * math.exp(-0.4), 0.3])
    w_late = rewards.trust_weight(answer, thinking, step=300, anneal_steps=300, base=0.3)
    assert w_late[:, 0].tolist() == pytest.approx([0.3 * math.exp(-0.4) * math.exp(-1), 0.3 * math.exp(-1)])
    # all-correct and all-wrong groups get thinking weight 0 (SophiaVL-R1's custom.py: answer >= 0.9 for all, or
    # <= 0.1 for all); a group of partial scores (0.6, 0.7: correct, but not all solved) keeps trust 1 -> 0.3
    answer = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.1, 0.0], [0.6, 0.7, 1.0]])
    w_flat = rewards.trust_weight(answer, torch.tensor([[0.1, 0.2, 0.3]] * 3), step=0)
    assert w_flat[:, 0].tolist() == pytest.approx([0.0, 0.0, 0.3])
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        rewards.trust_weight(torch.ones(4), torch.ones(4), step=0)


def test_trust_grpo_reward_end_to_end():
    # one group of 4; answer = accuracy, thinking = format (1 when think/answer tags are right)
    texts = [
        "<think>a</think><answer>4</answer>",
        "4",
        "<think>a</think><answer>5</answer>",
        "<think>b</think><answer>6</answer>",
    ]
    r = rewards.load(
        "trust_grpo",
        answer={"name": "accuracy", "kwargs": {"use_math_verify": False}},
        thinking="format",
        anneal_steps=100.0,
        base=0.3,
        gate=0.0,
    )
    out = r(texts, answers=["4"] * 4, step=[0] * 4, group_size=4)
    # acc [1,1,0,0]; format [1,0,1,1]; correct think mean 0.5 < wrong think mean 1.0 -> w = 0.3 e^-0.5
    w = 0.3 * math.exp(-0.5)
    assert out.tolist() == pytest.approx([1 + w, 1.0, w, w])
    gated = rewards.load(
        "trust_grpo", answer={"name": "accuracy", "kwargs": {"use_math_verify": False}}, thinking="format", gate=0.2
    )(texts, answers=["4"] * 4, step=[0] * 4, group_size=4)
    # with the 0.2 gate the wrong answers get no thinking reward: think [1,0,0,0], correct mean 0.5 > 0 -> w = 0.3
    assert gated.tolist() == pytest.approx([1.3, 1.0, 0.0, 0.0])


def test_trust_grpo_all_correct_group_scores_flat():
    # the audit's case: 4 correct answers, format thinking [0.9, 0.1, 0.5, 0.3] used to give 1 + 0.3 * t =
    # [1.27, 1.03, 1.15, 1.09] and non-zero advantages; SophiaVL-R1 zeroes the thinking reward -> [1, 1, 1, 1]
    a = torch.ones(1, 4)
    t = torch.tensor([[0.9, 0.1, 0.5, 0.3]])
    w = rewards.trust_weight(a, t, step=0)
    assert (a + w * t).tolist() == [[1.0, 1.0, 1.0, 1.0]]
    # one wrong answer (score 0) with thinking 0 (gated): correct mean (0.9+0.1+0.5)/3 = 0.5 > 0 -> w = 0.3
    a2 = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    t2 = torch.tensor([[0.9, 0.1, 0.5, 0.0]])
    assert (a2 + rewards.trust_weight(a2, t2, step=0) * t2)[0].tolist() == pytest.approx([1.27, 1.03, 1.15, 0.0])


def test_consistency_bonus_hand_values():
    # acc [1,1,0,1]: mean 0.75 -> accurate {0,1,3}; their likelihood mean (0.9+0.5+0.8)/3 = 0.7333
    # bonus where p >= 0.7333 - 0.01: samples 0 (0.9) and 3 (0.8) -> 0.5 * acc
    acc = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    p = torch.tensor([[0.9, 0.5, 0.1, 0.8]])
    assert rewards.consistency_bonus(acc, p).tolist() == [[0.5, 0.0, 0.0, 0.5]]
    r = rewards.load("grpo_care", accuracy={"name": "accuracy", "kwargs": {"use_math_verify": False}})
    out = r(["4", "4", "5", "4"], answers=["4"] * 4, likelihood=[0.9, 0.5, 0.1, 0.8], group_size=4)
    assert out.tolist() == [1.5, 1.0, 0.0, 1.5]


def test_groupwise_needs_group_size():
    r = rewards.load("grpo_care")
    with pytest.raises(ValueError, match="group_size"):
        r(["4", "4"], answers=["4", "4"], likelihood=[1, 1])
    with pytest.raises(ValueError, match="divide"):
        r(["4", "4", "4"], answers=["4"] * 3, likelihood=[1, 1, 1], group_size=2)


# ---- JPEG (DDPO) ---------------------------------------------------------------------------------------------------
def _independent_jpeg_kb(arr: np.ndarray, quality: int = 95) -> float:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
    return len(buf.getvalue()) / 1000.0


def test_jpeg_rewards_match_pil_and_accept_all_image_types():
    rng = np.random.default_rng(0)
    flat = np.full((32, 32, 3), 128, dtype=np.uint8)
    noisy = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    comp = rewards.load("jpeg_compressibility")
    incomp = rewards.load("jpeg_incompressibility", quality=80)
    expect = [-_independent_jpeg_kb(flat), -_independent_jpeg_kb(noisy)]
    assert comp([flat, noisy]).tolist() == pytest.approx(expect, rel=1e-6)
    assert comp([flat, noisy])[0] > comp([flat, noisy])[1]  # a flat image compresses better
    as_tensor = torch.from_numpy(noisy).permute(2, 0, 1).float() / 255.0  # [3, H, W] in [0, 1]
    assert comp([as_tensor]).item() == pytest.approx(expect[1], rel=1e-6)
    assert comp([Image.fromarray(noisy)]).item() == pytest.approx(expect[1], rel=1e-6)
    assert incomp([noisy]).item() == pytest.approx(_independent_jpeg_kb(noisy, 80), rel=1e-6)
    with pytest.raises(ValueError, match="quality"):
        rewards.load("jpeg_compressibility", quality=0)


def test_labels_let_one_reward_appear_twice():
    from rewards import RewardSet

    rs = RewardSet(
        [
            {"name": "format", "kwargs": {"mode": "strict"}},
            {"name": "format", "label": "format_lenient", "weight": 0.0, "kwargs": {"mode": "lenient"}},
        ]
    )
    assert rs.names == ["format", "format_lenient"] and rs.weights.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="give repeated rewards a 'label'"):
        RewardSet([{"name": "format"}, {"name": "format"}])
