"""Joining rollout rounds (DAPO refill): ragged K is padded with masked elements, per-sample extras follow; the
trainer's refill path (`collect`) keeps the first varied groups in arrival order."""

from types import SimpleNamespace

import pytest
import torch

from mmgrpo import sampling
from mmgrpo.collect import _flat_bound, cat_rollouts, collect, reward_fields, select_groups
from mmgrpo.types import Rollout


def _rollout(n: int, k: int, tag: str) -> Rollout:
    return Rollout(
        samples=[f"{tag}{i}" for i in range(n)],
        old_logp=torch.full((n, k), -1.0),
        mask=torch.ones(n, k, dtype=torch.bool),
        extras={"tokens": torch.arange(n * k).view(n, k), "reward_fields": {"lengths": [k] * n}, "temperature": 0.7},
        metrics={"rollout/length_mean": float(k)},
    )


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


# ---------------------------------------------------------------- the trainer's refill path (collect), end to end


class _Scripted:
    """Prompt sampler that hands out fixed id lists, one per round, and records what it was fed."""

    def __init__(self, rounds: list[list[int]], diversity_weight: float = 0.0):
        self.rounds, self.fed, self.diversity_weight = list(rounds), [], diversity_weight

    def sample(self, b: int) -> list[int]:
        ids = self.rounds.pop(0)
        assert len(ids) == b
        return ids

    def update(self, ids, rewards, **kw):
        self.fed.append((list(ids), rewards.clone(), kw.get("diversity")))


class _Policy:
    """Sample j of prompt p is the text "p<p> s<j>"; its reward is set by the prompt's record."""

    def rollout(self, prompts, g, seeds):
        samples = [f"{p['prompt']} s{j}" for p in prompts for j in range(g)]
        n = len(samples)
        return Rollout(
            samples=samples,
            old_logp=torch.zeros(n, 2),
            mask=torch.ones(n, 2, dtype=torch.bool),
            extras={"sample_id": torch.arange(n)},
        )


def _reward_set(samples, texts, group_size, scores):
    # flat prompts score 0.5 for every sample; varied ones score j / G for sample j
    total = torch.tensor([s[int(x.split(" s")[1])] for x, s in zip(samples, scores)])  # [N]
    return total[:, None], total


def _run(
    rounds: list[list[int]], *, refill: bool, max_rounds: int = 3, diversity_weight: float = 0.0, advantage="grpo"
):
    g, flat = 2, {0, 1, 2}
    data = [{"prompt": f"p{i}", "scores": [0.5, 0.5] if i in flat else [0.0, 1.0]} for i in range(8)]
    said = []
    run = SimpleNamespace(
        cfg=SimpleNamespace(
            run=SimpleNamespace(seed=0),
            sample=SimpleNamespace(
                group_size=g,
                batch_size=3 * g,
                filter_zero_std=True,
                refill=refill,
                max_refill_rounds=max_rounds,
                allocator="uniform",
            ),
            algo=SimpleNamespace(advantage=advantage, advantage_kwargs={}),
        ),
        accelerator=SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu")),
        sampler=_Scripted(rounds, diversity_weight),
        task=SimpleNamespace(train_data=data),
        policy=_Policy(),
        reward_set=_reward_set,
        say=said.append,
    )
    return collect(run, step=0), run, said


def test_refill_keeps_the_first_varied_groups_in_arrival_order():
    # round 0: prompts 0 (flat), 3, 1 (flat) -> kept [3]; round 1: 2 (flat), 4, 5 -> kept [4, 5]: 3 groups, stop
    batch, run, said = _run([[0, 3, 1], [2, 4, 5], [6, 7, 0]], refill=True)
    assert batch.rounds == 2 and batch.prompt_ids == [3, 4, 5] and batch.keep.tolist() == [True, True, True]
    assert batch.rollout.samples == ["p3 s0", "p3 s1", "p4 s0", "p4 s1", "p5 s0", "p5 s1"]
    assert batch.total.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]  # rewards follow their samples
    assert batch.rollout.extras["sample_id"].tolist() == [2, 3, 2, 3, 4, 5]  # round 0's 2,3 then round 1's 2..5
    assert [f[0] for f in run.sampler.fed] == [[0, 3, 1], [2, 4, 5]]  # the sampler learns from flat groups too
    assert run.sampler.rounds == [[6, 7, 0]] and said == []


def test_refill_pads_with_masked_flat_groups_when_rounds_run_out():
    # max 1 refill round: round 0 keeps [3], round 1 keeps nothing -> groups 3 | flat 0, 1 (masked out), warned
    batch, _, said = _run([[0, 3, 1], [2, 1, 0]], refill=True, max_rounds=1)
    assert batch.rounds == 2 and batch.prompt_ids == [3, 0, 1] and batch.keep.tolist() == [True, False, False]
    assert len(said) == 1 and "only 1 of 3 groups had reward variance after 2 rollout rounds" in said[0]


def test_without_refill_flat_groups_are_masked_in_one_round():
    batch, _, _ = _run([[0, 3, 1]], refill=False)
    assert batch.rounds == 1 and batch.prompt_ids == [0, 3, 1] and batch.keep.tolist() == [False, True, False]


def test_ngrpo_keeps_flat_groups_below_its_best_reward():
    # the flat prompts score 0.5, under NGRPO's default max_reward 1: its virtual best sample gives them a gradient,
    # so the filter keeps every group of round 0 and refill stops after one round
    batch, _, said = _run([[0, 3, 1]], refill=True, advantage="ngrpo")
    assert batch.rounds == 1 and batch.prompt_ids == [0, 3, 1] and batch.keep.tolist() == [True, True, True]
    assert said == []


def test_flat_bound_follows_the_estimator():
    def algo(name, **kw):
        return SimpleNamespace(advantage=name, advantage_kwargs=kw)

    assert _flat_bound(algo("grpo")) is None  # a flat group gives grpo exactly 0
    assert _flat_bound(algo("ngrpo")) == 1.0  # ngrpo's default max_reward
    assert _flat_bound(algo("ngrpo", max_reward=1.5)) == 1.5


def test_diversity_reaches_the_sampler():
    # distinct-1 of group "p3 s0", "p3 s1": tokens p3, s0, p3, s1 -> 3 distinct of 4 = 0.75 (every group alike)
    _, run, _ = _run([[0, 3, 1]], refill=False, diversity_weight=0.2)
    assert run.sampler.fed[0][2].tolist() == [0.75, 0.75, 0.75]
    assert sampling.distinct_1(["a b", "a a", "", ""], 2).tolist() == [2 / 4, 0.0]
    with pytest.raises(ValueError, match="text samples"):
        sampling.distinct_1([torch.zeros(2), "a"], 2)
