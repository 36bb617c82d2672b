"""Video-method maths against hand-worked float64 values: TempSamp-R1's soft advantage, T-GRPO's bonuses, the bonus
added after normalisation (and Video-R1's cancellation it avoids), the video rewards and the per-record helpers."""

import json
import math

import numpy as np
import pytest
import torch

import pipelines.video  # noqa: F401  registers the video advantages and rewards
from mmgrpo.advantages import ADVANTAGES, compute
from pipelines.video import methods as vm
from pipelines.video.advantages import logp_gap_bonus, soft_shaping, temporal_gate_bonus
from rewards import RewardSet, load
from rewards.rules import tempsamp_shaping


def close(a, b, tol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0
    )


# ----------------------------------------------------------------------------- TempSamp-R1 (arXiv:2509.18056)


def test_soft_shaping_hand_values():
    # th = 0.8, alpha = 1: above th 0.8 + 0.01 ln(1 + r - 0.8); below 0.8 - (e^(0.8 - r) - 1) / (e - 1)
    #   0.9 -> 0.8 + 0.01 ln 1.1 = 0.800953102;  1.0 -> 0.8 + 0.01 ln 1.2 = 0.801823216
    #   0.5 -> 0.8 - (e^0.3 - 1)/(e - 1) = 0.8 - 0.349858808/1.718281828 = 0.596390323
    #   0.0 -> 0.8 - (e^0.8 - 1)/(e - 1) = 0.8 - 1.225540928/1.718281828 = 0.086763726
    iou = torch.tensor([0.9, 1.0, 0.5, 0.0, 0.8], dtype=torch.float64)
    close(soft_shaping(iou), [0.800953102, 0.801823216, 0.596390323, 0.086763726, 0.8])
    # and the rewards package's per-sample implementation agrees on a grid
    grid = torch.linspace(0, 1, 21, dtype=torch.float64)
    close(soft_shaping(grid, alpha=2.0), [tempsamp_shaping(float(x), alpha=2.0) for x in grid], tol=1e-12)


def test_tempsamp_advantage_hand_worked():
    # one group: 3 sampled + ground truth (slot 3); columns [IoU, format], weights [1, 0.1]
    # shaped IoU (above) + 0.1 * format [1, 1, 0, 1] -> s = [0.900953102, 0.696390323, 0.086763726, 0.901823216]
    # mean 0.646482592, sample std (ddof 1) 0.385456467; A = (s - mean) / (std + 1e-6)
    #   = [0.660177923, 0.129476624, -1.452089823, 0.662435276]
    r = torch.tensor([[[0.9, 1], [0.5, 1], [0.0, 0], [1.0, 1]]], dtype=torch.float64)
    close(compute("tempsamp", r, weights=[1.0, 0.1]), [[0.660177923, 0.129476624, -1.452089823, 0.662435276]])
    # on-policy baseline: mean of the 3 sampled s = 0.561369050, same std -> [0.880989681, 0.350288383,
    # -1.231278064, 0.883247035]: the ground truth no longer pushes the 0.5-IoU answer towards 0
    close(
        compute("tempsamp", r, weights=[1.0, 0.1], baseline="on_policy", gt_slot=-1),
        [[0.880989681, 0.350288383, -1.231278064, 0.883247035]],
    )
    # shaping=False on already-shaped rewards gives the same numbers (no double shaping)
    shaped = r.clone()
    shaped[..., 0] = soft_shaping(r[..., 0])
    close(compute("tempsamp", shaped, weights=[1.0, 0.1], shaping=False), compute("tempsamp", r, weights=[1.0, 0.1]))


def test_tempsamp_edge_cases():
    flat = torch.full((2, 4, 1), 0.3)
    assert torch.equal(compute("tempsamp", flat), torch.zeros(2, 4))  # flat group -> exactly 0
    assert torch.equal(compute("tempsamp", torch.rand(2, 1, 1)), torch.zeros(2, 1))  # G = 1: no baseline
    with pytest.raises(ValueError, match="column"):
        compute("tempsamp", torch.rand(1, 4, 2), column=2)
    with pytest.raises(ValueError, match="baseline"):
        compute("tempsamp", torch.rand(1, 4, 1), baseline="mixed")
    assert ADVANTAGES.meta("tempsamp")["input"] == "multi"


# ----------------------------------------------------------------------------- T-GRPO (Video-R1, arXiv:2503.21776)


def test_video_r1_bonus_is_cancelled_by_std_normalisation_but_not_after_it():
    # accuracy [1, 0, 0, 1], format 1 for all, bonus 0.3 on the correct answers (the gate passed)
    acc, fmt, bonus = [1.0, 0.0, 0.0, 1.0], [1.0] * 4, [0.3, 0.0, 0.0, 0.3]
    # Video-R1 adds the bonus before normalising: r = [2.3, 1, 1, 2.3], mean 1.65, std 0.750555 -> +-0.650/0.750555
    # = +-0.866024; without it r = [2, 1, 1, 2], mean 1.5, std 0.577350 -> +-0.866024: the same (up to eps)
    with_bonus = compute("grpo", torch.tensor([[a + f + b for a, f, b in zip(acc, fmt, bonus)]]))
    without = compute("grpo", torch.tensor([[a + f for a, f in zip(acc, fmt)]]))
    close(with_bonus, without, tol=1e-5)
    # grpo_bonus normalises the task rewards and adds the centred bonus afterwards:
    # +-0.866024 + (0.3 - 0.15) or (0 - 0.15) = [1.016024, -1.016024, -1.016024, 1.016024]
    r = torch.tensor([[acc, fmt, bonus]], dtype=torch.float64).transpose(1, 2)  # [1, 4, 3]
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    close(compute("grpo_bonus", r, bonus_columns=[2]), [[a + 0.15, -a - 0.15, -a - 0.15, a + 0.15]])
    # not centred: the raw bonus on top: [a + 0.3, -a, -a, a + 0.3]
    close(compute("grpo_bonus", r, bonus_columns=[2], center_bonus=False), [[a + 0.3, -a, -a, a + 0.3]])
    # the bonus weight applies: weight 2 on the bonus column doubles its contribution
    close(compute("grpo_bonus", r, weights=[1, 1, 2]), [[a + 0.3, -a - 0.3, -a - 0.3, a + 0.3]])


def test_grpo_bonus_edges():
    r = torch.zeros(1, 4, 2)
    r[0, :, 1] = 0.3  # flat task reward, every sample got the bonus: centred -> exactly 0
    assert torch.equal(compute("grpo_bonus", r), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="cover all"):
        compute("grpo_bonus", torch.rand(1, 4, 1))


def test_temporal_gate_bonus_hand():
    acc = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0]])
    # row 0: p = 0.5, shuffled p~ = 1.0 -> 0.5 >= 0.8 * 1.0 fails -> no bonus
    # row 1: p = 0.5, shuffled p~ = 0.5 -> 0.5 >= 0.4 -> 0.3 on the correct answers (acc > 0.1)
    shuffled = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    close(temporal_gate_bonus(acc, shuffled), [[0, 0, 0, 0], [0.3, 0, 0, 0.3]])


def test_logp_gap_bonus_hand():
    # alpha 0.3, scale 0.5: bonus = 0.3 * [acc > 0.1] * clip(gap / 0.5, 0, 1)
    # gaps [0.25, 1.0, -0.2, 0.25], acc [1, 1, 1, 0] -> [0.3 * 0.5, 0.3 * 1, 0, 0] = [0.15, 0.3, 0, 0]
    acc = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    gap = torch.tensor([[0.25, 1.0, -0.2, 0.25]])
    close(logp_gap_bonus(acc, gap, scale=0.5), [[0.15, 0.3, 0.0, 0.0]])
    with pytest.raises(ValueError, match="gap_scale"):
        logp_gap_bonus(acc, gap, scale=0.0)


# ----------------------------------------------------------------------------- rewards


def test_video_task_routes_by_category():
    samples = ["<answer>1 to 3</answer>", "<answer>B</answer>", "<answer>3</answer>", "<answer>left</answer>"]
    fields = {
        "spans": [[2.0, 4.0], None, None, None],
        "answers": [None, "B", "3", "left"],
        "category": ["grounding", "multiple_choice", "numeric", "free_form"],
    }
    # grounding: [1, 3] vs [2, 4]: inter 1, union 3 -> 1/3
    close(load("video_task")(samples, **fields), [1 / 3, 1.0, 1.0, 1.0], tol=1e-6)
    with pytest.raises(ValueError, match="spans"):
        load("video_task")(samples[:1], spans=[None], answers=[None], category=["grounding"])


def test_time_line_marks_by_hand():
    ref = "0.0-0.5+1.0>1.5>2.0-2.5"  # groups 0.5 still, 1.0 and 1.5 moving right
    samples = [
        "<think>0.0-0.5+1.0>1.5>2.0-2.5</think><answer>right</answer>",  # marked {0.5, 1.0, 1.5}, all alike: 3/3
        "<think>0.0-0.5+1.0<1.5<2.0-2.5</think><answer>left</answer>",  # alike only 0.5: 1/3
        "<think>0.0+0.5+1.0>1.5-2.0-2.5</think>",  # marked {0.0, 0.5, 1.0, 1.5}, alike {0.5, 1.0}: 2/4
        "<think>0.0-0.5+1.0>1.5>2.0-2.0>2.5</think>",  # 2.0 written twice: the first ("-") counts -> 3/3
        "<answer>right</answer>",  # no think: 0
        "<think>0.0-0.5-1.0-</think>",  # nothing marked on either side (reference below): 1
        "<think>0.0-0.5+1.0>1.5>2.0-2.5</think>",  # no reference (a count question): 0
    ]
    refs = [ref] * 5 + ["0.0-0.5-1.0", None]
    close(load("time_line_marks")(samples, reference_think=refs), [1.0, 1 / 3, 0.5, 1.0, 0.0, 1.0, 0.0])
    close(load("time_line_marks")(samples[:2]), [0.0, 0.0])  # a batch without the field (count questions only)


def test_shapes_records_carry_their_sft_time_line(tmp_path):
    from mmgrpo_shapes.video_think import target_text
    from pipelines.video.data import shapes_video_records

    recs = shapes_video_records(
        "test", 8, types=("grounding", "direction", "order", "count"), num_frames=16, resolution=32, cache_dir=tmp_path
    )
    rows = {json.loads(line)["id"]: json.loads(line) for line in next(tmp_path.rglob("test.jsonl")).open()}
    for rec in recs:
        row = rows[rec["id"]]
        target = target_text({**row, "spans": rec.get("spans"), "answers": row.get("answer")})
        assert rec["reference_think"] == target.split("<think>")[1].split("</think>")[0], rec["id"]
        # TempSamp's injected ground truth written as the SFT model writes: the target itself
        assert vm.ground_truth_text(rec, span_template=THINK_SPAN, answer_template=THINK_ANSWER) == target
        assert load("time_line_marks")([target], reference_think=[rec["reference_think"]]).item() == (
            0.0 if row["type"] == "count" else 1.0  # count's think ("Count them.") has no time line
        )
    assert {rows[r["id"]]["type"] for r in recs} == {"grounding", "direction", "order", "count"}
    with pytest.raises(ValueError, match="no reference_think"):
        vm.ground_truth_text({"id": "x", "answers": "left"}, answer_template=THINK_ANSWER)
    vm.check_template("span_template", THINK_SPAN)
    vm.check_template("answer_template", THINK_ANSWER)


THINK_SPAN = "<think>{think}</think><answer>{start:.2f} to {end:.2f}</answer>"
THINK_ANSWER = "<think>{think}</think><answer>{answer}</answer>"


def test_temporal_contrast_reward_both_signals():
    texts = ["<answer>0 to 2</answer>", "<answer>5 to 6</answer>"] * 2  # B = 2 groups of G = 2
    spans = [[0.0, 2.0]] * 4
    cat = ["grounding"] * 4
    rs = RewardSet([{"name": "temporal_contrast", "kwargs": {"min_accuracy": 0.5}}])
    # generate: group 0's shuffled rollouts are all wrong (p~ = 0) -> gate passes, the correct one gets 0.3;
    # group 1's shuffled rollouts are all right (p~ = 1, p = 0.5 < 0.8) -> no bonus
    shuffled = [["<answer>5 to 6</answer>"]] * 2 + [["<answer>0 to 2</answer>"]] * 2
    per, _ = rs(texts, group_size=2, spans=spans, category=cat, shuffled_samples=shuffled)
    close(per[:, 0], [0.3, 0.0, 0.0, 0.0])
    # logp_gap: gaps [2, 2, 0.5, -1] with gap_scale 1: correct answers get 0.3 * clip(gap) -> [0.3, 0, 0.15, 0]
    per, _ = rs(texts, group_size=2, spans=spans, category=cat, temporal_gap=[2.0, 2.0, 0.5, -1.0])
    close(per[:, 0], [0.3, 0.0, 0.15, 0.0])
    with pytest.raises(Exception, match="temporal"):
        rs(texts, group_size=2, spans=spans, category=cat)
    # `mmgrpo eval` turns the shuffled pass off on purpose (VideoPolicy.for_evaluation): no bonus, no error
    per, _ = rs(texts, group_size=2, spans=spans, category=cat, temporal_off=[True] * 4)
    close(per[:, 0], [0.0] * 4)


# ----------------------------------------------------------------------------- per-record helpers


def test_ground_truth_text_parses_back_to_the_span():
    text = vm.ground_truth_text({"spans": [2.5, 3.75]})
    assert text.endswith("<answer>2.50 to 3.75</answer>")
    assert load("temporal_iou")([text], spans=[[2.5, 3.75]]).item() == 1.0
    assert load("format")([text]).item() == 1.0
    assert vm.ground_truth_text({"answers": "B"}).endswith("<answer>B</answer>")
    with pytest.raises(ValueError, match="neither"):
        vm.ground_truth_text({"id": "x"})


def test_default_span_template_is_the_prompt_and_sft_format():
    from mmgrpo_shapes.programs.pretrain_vlm import GROUNDING_TEMPLATE
    from pipelines.video.data import TASK_HINTS

    assert vm.SPAN_TEMPLATE == GROUNDING_TEMPLATE  # the VLM grounding model's SFT format
    think, answer = vm.SPAN_TEMPLATE.split("</think>")
    assert think.startswith("<think>")
    # the prompt's own instruction for grounding answers
    assert answer.replace("{start:.2f}", "start").replace("{end:.2f}", "end") in TASK_HINTS["grounding"]
    custom = vm.ground_truth_text({"spans": [1, 2.5]}, span_template="<answer>{start:.1f} to {end:.1f}</answer>")
    assert custom == "<answer>1.0 to 2.5</answer>"


@pytest.mark.parametrize(
    "template",
    ["<answer>{start}</answer>", "{start} {end} {answer}", "{start:.2f} to {end", "{0} to {1}", "{start:d} to {end}"],
)
def test_bad_span_templates_are_named(template):
    with pytest.raises(
        ValueError, match=r"span_template .* must use the fields \{start\}, \{end\}, may use \{think\}"
    ):
        vm.check_template("span_template", template)
    vm.check_template("span_template", vm.SPAN_TEMPLATE)
    vm.check_template("answer_template", vm.ANSWER_TEMPLATE)


def test_shuffle_order_is_a_non_identity_permutation():
    for seed in range(50):
        p = vm.shuffle_order(4, seed)
        assert sorted(p) == [0, 1, 2, 3] and not (p == np.arange(4)).all()
    assert list(vm.shuffle_order(1, 0)) == [0]


def test_difficulty_hint_noise():
    assert vm.difficulty([1.0, 0.95], easy_min=0.9, hard_max=0.0) == "easy"
    assert vm.difficulty([0.0, 0.0], easy_min=0.9, hard_max=0.0) == "hard"
    assert vm.difficulty([0.0, 1.0], easy_min=0.9, hard_max=0.0) is None
    rec = {"prompt": "When?", "spans": [1.0, 3.5]}
    hinted = vm.with_hint(rec)
    assert hinted["prompt"] == "When?\nHint: the event lasts about 2.5 seconds." and hinted["spans"] == rec["spans"]
    assert vm.with_hint({"prompt": "How many?", "answers": "3"})["prompt"].endswith("starts with '3'.")
    frames = np.full((2, 4, 4, 3), 128, np.uint8)
    noisy = vm.noisier(frames, std=10.0, seed=0)
    assert noisy.dtype == np.uint8 and noisy.shape == frames.shape and not np.array_equal(noisy, frames)
    assert abs(float(noisy.astype(float).std()) - 10.0) < 2.0
