"""Knapsack RL (arXiv:2509.25849): the value function and the allocator on cases solved by hand, against brute force;
ragged groups: every registered estimator equals its dense self on equal-size groups and its per-group self on
ragged ones; the collector and trainer on the toy task with sizes chosen from VADE's posterior."""

import itertools
import json
from pathlib import Path

import pytest
import torch

from mmgrpo import advantages, budget
from mmgrpo.config import load_config
from mmgrpo.errors import UserError
from mmgrpo.trainer import train

ROOT = Path(__file__).resolve().parents[1]
KNAPSACK = str(ROOT / "configs" / "toy_knapsack.yaml")


def test_value_golden():
    # V(n, p) = (1 - p^n - (1-p)^n) * p (1-p)^2
    # p = 0.5, n = 3: (1 - 0.125 - 0.125) * 0.5 * 0.25 = 0.75 * 0.125 = 0.09375
    # p = 0.9, n = 2: (1 - 0.81 - 0.01) * 0.9 * 0.01 = 0.18 * 0.009 = 0.00162
    # info="variance", p = 0.2, n = 2: (1 - 0.04 - 0.64) * 0.2 * 0.8 = 0.32 * 0.16 = 0.0512
    v = budget.knapsack_value(torch.tensor([3, 2]), torch.tensor([0.5, 0.9], dtype=torch.float64))
    torch.testing.assert_close(v, torch.tensor([0.09375, 0.00162], dtype=torch.float64), rtol=0, atol=1e-15)
    assert budget.knapsack_value(2, 0.2, info="variance").item() == pytest.approx(0.0512, abs=1e-15)
    assert budget.knapsack_value(5, 0.0).item() == 0.0 and budget.knapsack_value(5, 1.0).item() == 0.0


def test_knapsack_golden_cases_solved_by_hand():
    # (a) p = (0.5, 0.9), unit costs, sizes in [2, 4], budget 6. Values V(n):
    #     p=0.5: n=2 0.0625, n=3 0.09375, n=4 0.109375;  p=0.9: n=2 0.00162, n=3 0.00243, n=4 0.0030942
    #     feasible (n1, n2) with n1 + n2 <= 6: (2,2) 0.06412, (2,3) 0.06493, (3,2) 0.09537, (2,4) 0.06559,
    #     (4,2) 0.110995, (3,3) 0.09618 -> (4, 2): the uncertain prompt takes the spare rollouts
    assert budget.knapsack(torch.tensor([0.5, 0.9]), torch.ones(2), group_size=4, budget=6).tolist() == [4, 2]
    # (b) same prompts, costs (2, 1), budget 9: 2 n1 + n2 <= 9 rules out n1 = 4 (8 + 2 > 9); best of the rest is
    #     (3, 3) 0.09618 over (3, 2) 0.09537 and (2, 4) 0.06559
    assert budget.knapsack(torch.tensor([0.5, 0.9]), torch.tensor([2, 1]), group_size=4, budget=9).tolist() == [3, 3]
    # (c) p = (0.5, 0.2, 0.95), unit costs, sizes in [2, 6], budget 12. p=0.95 is worth ~0 (gain 0.002375): it
    #     keeps 2. The other 10 units split between p=0.5 and p=0.2; marginal gains of one more rollout:
    #     p=0.5: 3 0.03125, 4 0.015625, 5 0.0078125, 6 0.00390625 (gain 0.125 x 0.25, 0.125, 0.0625, 0.03125)
    #     p=0.2: 3 0.02048, 4 0.0139264, 5 0.0106496, 6 0.0084214 (gain 0.128 x 0.16, 0.1088, 0.0832, 0.065792)
    #     both decrease (concave), so the best 6 extra units are the 6 largest: 0.03125, 0.02048, 0.015625,
    #     0.0139264, 0.0106496, 0.0084214 -> p=0.5 gets 4 and the hard p=0.2 gets 6
    p = torch.tensor([0.5, 0.2, 0.95])
    assert budget.knapsack(p, torch.ones(3), group_size=6, budget=12).tolist() == [4, 6, 2]


def _brute(p, cost, g, w, lo):
    best, arg = -1.0, None
    for sizes in itertools.product(range(lo, g + 1), repeat=len(p)):
        if sum(n * c for n, c in zip(sizes, cost)) <= w:
            v = sum(budget.knapsack_value(n, q).item() for n, q in zip(sizes, p))
            if v > best + 1e-15:
                best, arg = v, sizes
    return best, arg


def test_knapsack_equals_brute_force_on_random_cases():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.rand(3, generator=gen, dtype=torch.float64)
        cost = torch.randint(1, 4, (3,), generator=gen)
        w = int(torch.randint(int(cost.sum()) * 2, int(cost.sum()) * 5 + 1, (1,), generator=gen))
        sizes = budget.knapsack(p, cost, group_size=5, budget=w)
        best, _ = _brute(p.tolist(), cost.tolist(), 5, w, 2)
        got = budget.knapsack_value(sizes, p).sum().item()
        assert int((sizes * cost).sum()) <= w and got == pytest.approx(best, abs=1e-12)


def test_knapsack_rejects_infeasible_budgets():
    with pytest.raises(ValueError, match="budget=3 cannot give every prompt min_size=2"):
        budget.knapsack(torch.tensor([0.5, 0.5]), torch.ones(2), group_size=4, budget=3)
    with pytest.raises(ValueError, match="min_size"):
        budget.knapsack(torch.tensor([0.5]), torch.ones(1), group_size=4, min_size=5)


def _dense_cases():
    gen = torch.Generator().manual_seed(1)
    r = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    multi = torch.rand(3, 4, 2, generator=gen, dtype=torch.float64)
    for name in advantages.names():
        kind = advantages.ADVANTAGES.meta(name).get("input", "scalar")
        kw = {"weights": [1.0, 0.5]} if kind == "multi" else {}
        rewards = multi if kind == "multi" else r
        yield name, kind, rewards, kw


@pytest.mark.parametrize("name,kind,rewards,kw", list(_dense_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_estimator_is_unchanged_on_equal_size_groups(name, kind, rewards, kw):
    prep = advantages.prefs_from_scores if kind == "pairwise" else (lambda x: x)
    try:
        dense = advantages.compute(name, prep(rewards), **kw)
    except (ValueError, TypeError) as err:
        pytest.skip(f"{name} needs inputs a made-up batch does not give: {err}")
    assert torch.equal(advantages.by_size(rewards, lambda x: advantages.compute(name, prep(x), **kw)), dense)
    mask = advantages.by_size(rewards, lambda x: advantages.loss_mask(name, prep(x), **kw), fill=False)
    assert torch.equal(mask, advantages.loss_mask(name, prep(rewards), **kw))


@pytest.mark.parametrize("name,kind,rewards,kw", list(_dense_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_estimator_on_ragged_groups_equals_each_group_alone(name, kind, rewards, kw):
    """Groups of sizes (4, 2, 3) padded with NaN: each group's advantages are the estimator on that group alone
    (the per-group loop, verl's reference pattern), padding gets 0 and is out of the loss mask."""
    if advantages.batch_coupled(name, kw):
        pytest.skip(f"{name} normalises over the whole batch; ragged groups refuse it at validation")
    prep = advantages.prefs_from_scores if kind == "pairwise" else (lambda x: x)
    sizes = [4, 2, 3]
    ragged = rewards.clone()
    for b, s in enumerate(sizes):
        ragged[b, s:] = float("nan")
    try:
        out = advantages.by_size(ragged, lambda x: advantages.compute(name, prep(x), **kw))
        mask = advantages.by_size(ragged, lambda x: advantages.loss_mask(name, prep(x), **kw), fill=False)
    except (ValueError, TypeError) as err:
        pytest.skip(f"{name} needs inputs a made-up batch does not give: {err}")
    for b, s in enumerate(sizes):
        alone = advantages.compute(name, prep(rewards[b : b + 1, :s]), **kw)[0]
        assert torch.equal(out[b, :s], alone) and torch.equal(out[b, s:], torch.zeros(4 - s))
        assert not mask[b, s:].any()


def test_padding_must_sit_at_the_end():
    r = torch.tensor([[1.0, float("nan"), 0.0, 1.0]])
    with pytest.raises(ValueError, match="padded with NaN at the end"):
        advantages.group_sizes(r)


@pytest.mark.parametrize(
    "override,words",
    [
        (["sample.sampler=uniform"], ["sample.sampler='uniform'", "sample.sampler=vade"]),
        (["sample.filter_zero_std=true", "sample.refill=true"], ["sample.refill=true", "sample.refill=false"]),
        (["algo.advantage_kwargs={std: batch}"], ["algo.advantage='grpo'", "std=group"]),
        (["sample.allocator_kwargs={budget: 3}"], ["sample.allocator_kwargs", "budget=3"]),
        (["sample.allocator=knapsak"], ["sample.allocator", "did you mean 'knapsack'"]),
        (["sample.allocator_kwargs={budgt: 3}"], ["sample.allocator_kwargs", "did you mean 'budget'"]),
    ],
)
def test_bad_allocation_fails_before_the_model_loads(override, words):
    with pytest.raises(UserError) as err:
        load_config(KNAPSACK, override)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_knapsack_recipe_trains_with_ragged_groups(tmp_path):
    """Two steps: step 0 sits at VADE's prior (all p = 0.5: equal sizes), then the posterior spreads the budget;
    padded rows never reach the loss (ratio 1 on-policy, every metric finite) and the weights move."""
    over = [f"run.output_dir={tmp_path}", "run.steps=2", "run.progress=false", "run.report=false"]
    over += ["sample.batch_size=32", "sample.group_size=8", "sample.allocator_kwargs={budget: 16}"]
    cfg = load_config(KNAPSACK, over)
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    budget_ = cfg.sample.allocator_kwargs["budget"]
    assert all(r["skipped"] == 0.0 and r["ratio/mean"] == pytest.approx(1.0, abs=1e-6) for r in rows)
    ragged = [r for r in rows if "rollout/group_size_min" in r]
    assert ragged and ragged[-1]["rollout/group_size_min"] < ragged[-1]["rollout/group_size_max"]
    b = cfg.sample.batch_size // cfg.sample.group_size
    assert all(r["rollout/group_size_mean"] * b <= budget_ for r in ragged)  # the budget holds (unit cost)
    for r in ragged:  # throughput counts the rollouts made, not the padded slots
        assert r["perf/samples_per_sec"] * r["time/step"] == pytest.approx(r["rollout/group_size_mean"] * b)
    assert all(0 <= r["reward/total_mean"] <= 1 for r in rows)  # NaN padding is out of the reward means
