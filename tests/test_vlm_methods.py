"""Method hooks of the VLM pipeline: GRPO-CARE's answer likelihood (arXiv:2506.16141) under an EMA reference and its
route to the `grpo_care` reward, and TON's thought dropout (arXiv:2505.16854) with the empty-think format option."""

import math

import pytest
import torch

import rewards
from pipelines.vlm.build import build_vlm
from pipelines.vlm.methods import CareLikelihood, answer_token_mask, mean_likelihood, thought_dropout


def test_answer_token_mask_golden():
    pieces = [
        ["<think>", "x", "</think>", "<answer>", "4", "2", "</answer>"],
        ["<answe", "r>4", "2</answer>"],  # tags split over tokens: "<answer>" ends inside token 1, content 8..10
        ["no tags at all"],
        ["<answer>", " ", "</answer>"],  # empty answer: nothing to score
        ["<answer>1</answer>", "<answer>", "7", "</answer>"],  # the last block counts
    ]
    mask = answer_token_mask(pieces)
    assert mask.tolist() == [
        [False, False, False, False, True, True, False],
        [False, True, True, False, False, False, False],
        [False] * 7,
        [False] * 7,
        [False, False, True, False, False, False, False],
    ]


def test_mean_likelihood_golden():
    # row 0: exp((log 0.5 + log 0.25) / 2) = sqrt(0.125) = 0.35355339; row 1 has no answer token -> 0
    logp = torch.tensor([[math.log(0.5), math.log(0.25), -3.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    out = mean_likelihood(logp, mask)
    assert out.tolist() == pytest.approx([0.35355339, 0.0], abs=1e-7)
    with pytest.raises(ValueError, match="mask"):
        mean_likelihood(logp, mask[:, :2])


def test_care_ema_update_golden():
    care = CareLikelihood(decay=0.9, every=2)
    care.update({"w": torch.tensor([0.0])})  # call 0: the EMA starts at the weights
    care.update({"w": torch.tensor([10.0])})  # call 1: not a multiple of every=2, no update
    assert care.ema["w"].item() == 0.0
    care.update({"w": torch.tensor([10.0])})  # call 2: ema = 0.9 * 0 + 0.1 * 10 = 1.0
    assert care.ema["w"].item() == pytest.approx(1.0)
    care.update({"w": torch.tensor([10.0])}, step=7)  # call 3: not a multiple of 2
    care.update({"w": torch.tensor([10.0])}, step=8)  # call 4: ema = 0.9 * 1 + 0.1 * 10 = 1.9
    care.update({"w": torch.tensor([10.0])}, step=8)  # a refill round of the same step: ignored
    assert care.ema["w"].item() == pytest.approx(1.9) and care.calls == 5
    with pytest.raises(ValueError, match="decay"):
        CareLikelihood(decay=1.0)


def test_care_likelihood_reaches_the_grpo_care_reward(tmp_path):
    task = build_vlm(
        seed=0,
        device=torch.device("cpu"),
        cache_dir=str(tmp_path),
        train_size=2,
        eval_size=1,
        max_new_tokens=6,
        care_likelihood=True,
        care_ema_every=1,
        care_ema_decay=0.5,
    )
    pol = task.policy
    tok = pol.tokenizer
    texts = ["<think>ab</think><answer>4</answer>", "<think>c</think><answer>5</answer>", "<think>d</think>"]
    ids = [tok(t)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")] for t in texts]
    k = max(map(len, ids))
    comps = torch.tensor([i + [tok.pad_token_id] * (k - len(i)) for i in ids])
    lengths = torch.tensor([len(i) for i in ids])
    encs = [pol.encode(task.train_data[0])] * 3
    before = {k_: v.clone() for k_, v in pol.state_dict().items()}
    like = pol.care.likelihood(pol, encs, comps, lengths, 3)  # first call: EMA == current weights
    logp = pol._score(pol.module, encs, comps, lengths, 3)  # no grad
    answer_at = [texts[i].index("<answer>") for i in range(2)]
    # the answer is one byte token right after the <answer> tag token: p = exp(logp of that token)
    pos = [len(tok(texts[i][: answer_at[i]])["input_ids"]) + 1 for i in range(2)]
    expect = [math.exp(float(logp[i, pos[i]])) for i in range(2)] + [0.0]
    assert like.tolist() == pytest.approx(expect, rel=1e-5)
    assert all(torch.equal(before[k_], v) for k_, v in pol.state_dict().items())  # weights restored after the swap
    # the pipeline hands it to rewards as field `likelihood`; grpo_care adds coef * acc to consistent correct answers
    reward = rewards.load("grpo_care", margin=0.01, coef=0.5)
    scores = reward(texts, None, answers=["4", "5", "6"], likelihood=like.tolist(), group_size=3)
    best = max(expect[:2])
    bonus = [0.5 if expect[i] >= best - 0.01 else 0.0 for i in range(2)]
    assert scores.tolist() == pytest.approx([1.0 + bonus[0], 1.0 + bonus[1], 0.0])
    # after an update the EMA moves towards the new weights and the rollout exposes the field
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.1)
    pol.set_iteration(4)
    ro = pol.rollout(task.train_data[:1], 2, [3])
    assert len(ro.extras["reward_fields"]["likelihood"]) == 2 and ro.extras["reward_fields"]["step"] == [4, 4]
    assert all(0.0 <= v <= 1.0 for v in ro.extras["reward_fields"]["likelihood"])
    name = next(iter(pol.care.ema))
    current = dict(pol.module.named_parameters())[name]
    assert not torch.equal(pol.care.ema[name], current)  # halfway (decay 0.5), not a copy


def test_thought_dropout_and_empty_think_format():
    recs = [{"prompt": f"q{i}", "answers": str(i), "reasoning": "count them"} for i in range(200)]
    kept = thought_dropout(recs, p=0.0)
    assert kept[3]["target"] == "<think>\ncount them\n</think><answer>3</answer>"
    dropped = thought_dropout(recs, p=1.0)
    assert dropped[3]["target"] == "<think>\n\n</think><answer>3</answer>"
    half = thought_dropout(recs, p=0.5, seed=1)
    n_empty = sum(r["target"].startswith("<think>\n\n</think>") for r in half)
    assert 70 < n_empty < 130  # Binomial(200, 0.5): mean 100, sd ~7
    assert thought_dropout(recs, p=0.5, seed=1) == half
    strict, ton = rewards.load("format"), rewards.load("format", allow_empty_think=True)
    assert strict([dropped[3]["target"]]).tolist() == [0.0] and ton([dropped[3]["target"]]).tolist() == [1.0]
    with pytest.raises(ValueError, match="p"):
        thought_dropout(recs, p=1.5)
