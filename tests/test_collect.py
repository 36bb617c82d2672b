"""Joining rollout rounds (DAPO refill): ragged K is padded with masked elements, per-sample extras follow."""

import torch

from mmgrpo.collect import cat_rollouts, reward_fields, select_groups
from mmgrpo.types import Rollout


def _rollout(n: int, k: int, tag: str) -> Rollout:
    return Rollout(samples=[f"{tag}{i}" for i in range(n)], old_logp=torch.full((n, k), -1.0),
                   mask=torch.ones(n, k, dtype=torch.bool),
                   extras={"tokens": torch.arange(n * k).view(n, k), "reward_fields": {"lengths": [k] * n},
                           "temperature": 0.7}, metrics={"rollout/length_mean": float(k)})


def test_cat_pads_ragged_k_and_keeps_extras_aligned():
    r = cat_rollouts([_rollout(2, 3, "a"), _rollout(2, 5, "b")])
    assert r.samples == ["a0", "a1", "b0", "b1"]
    assert r.old_logp.shape == (4, 5) and r.mask.shape == (4, 5)
    assert r.mask[:2, 3:].sum() == 0 and r.mask[2:].all()  # the padding of short rounds is masked out
    assert r.extras["reward_fields"]["lengths"] == [3, 3, 5, 5]
    assert r.extras["temperature"] == 0.7 and r.metrics["rollout/length_mean"] == 4.0


def test_select_groups_takes_whole_groups_in_order():
    r = select_groups(_rollout(6, 2, "s"), [2, 0], group_size=2)
    assert r.samples == ["s4", "s5", "s0", "s1"]
    assert r.extras["tokens"][:, 0].tolist() == [8, 10, 0, 2]
    assert r.extras["reward_fields"]["lengths"] == [2, 2, 2, 2]


def test_reward_fields_repeat_each_prompt_group_size_times():
    texts, fields = reward_fields([{"prompt": "p", "answers": "1"}, {"prompt": "q", "answers": "2"}], 2)
    assert texts == ["p", "p", "q", "q"] and fields == {"answers": ["1", "1", "2", "2"]}
