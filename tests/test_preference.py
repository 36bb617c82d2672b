"""DPO (arXiv:2305.18290), VerIPO's pair verifier (arXiv:2505.19000) and the phase schedule: golden numbers worked
by hand in float64, validation of the schedule before any model loads, and the GRPO -> DPO loop on the toy task."""

import json
import math
from pathlib import Path

import pytest
import torch

from mmgrpo import advantages, losses, phases
from mmgrpo.config import load_config
from mmgrpo.errors import UserError
from mmgrpo.trainer import train

ROOT = Path(__file__).resolve().parents[1]
VERIPO = str(ROOT / "configs" / "toy_veripo.yaml")
FAST = ["run.progress=false", "run.report=false", "run.checkpoint_every=0", "sample.batch_size=16"]
FAST += ["sample.group_size=4", "algo.micro_batch_size=16"]


def _dpo(logp, ref, adv, **kw):
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss, metrics = losses.compute("dpo", logp, ref, adv, mask, **kw)
    return losses.aggregate(loss, mask, "seq_mean_token_mean"), metrics


def test_dpo_golden_value_and_gradient():
    # one group of G=2, K=2: chosen = row 0 (adv +1), rejected = row 1 (adv -1)
    # S_c - S_c^ref = (-1 - 2) - (-1.5 - 2) = 0.5;  S_r - S_r^ref = (-0.5 - 1.5) - (-0.5 - 1) = -0.5;  h = 1.0
    # beta = 0.5: loss = -log sigmoid(0.5) = log(1 + e^-0.5) = log(1.6065306597126334) = 0.47407698418010663
    # d loss / d h = -beta * sigmoid(-beta h) = -0.5 * 0.3775406687981454 = -0.1887703343990727;
    # dh/dlogp = +1 on each chosen token, -1 on each rejected token; seq_mean_token_mean over the pair's two rows
    # writes the pair loss on both rows and divides by 2, so the aggregate's gradient is the pair loss's
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0], [-0.5, -1.0]], dtype=torch.float64)
    total, m = _dpo(logp, ref, torch.tensor([1.0, -1.0], dtype=torch.float64), group_size=2, beta=0.5)
    assert total.item() == pytest.approx(0.47407698418010663, abs=1e-12)
    total.backward()
    g = 0.1887703343990727
    torch.testing.assert_close(logp.grad, torch.tensor([[-g, -g], [g, g]], dtype=torch.float64), atol=1e-12, rtol=0)
    assert m["dpo/margin"].item() == pytest.approx(1.0, abs=1e-12)
    assert m["dpo/accuracy"].item() == 1.0
    assert m["dpo/chosen_reward"].item() == pytest.approx(0.25, abs=1e-12)  # beta * 0.5 (TRL's chosen reward)
    assert m["dpo/rejected_reward"].item() == pytest.approx(-0.25, abs=1e-12)


def test_dpo_label_smoothing_and_unpaired_groups():
    # conservative DPO, ls = 0.1: 0.9 * log(1 + e^-0.5) + 0.1 * log(1 + e^0.5)
    #   = 0.9 * 0.47407698418010663 + 0.1 * 0.97407698418010663 = 0.52407698418010663
    # a second group with equal advantages has no pair: its rows get loss 0
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [-3.0, -1.0], [-2.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -2.0], [-0.5, -1.0], [-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.3, 0.3], dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.bool)
    loss, m = losses.compute("dpo", logp, ref, adv, mask, group_size=2, beta=0.5, label_smoothing=0.1)
    assert loss[0, 0].item() == pytest.approx(0.52407698418010663, abs=1e-12)
    assert torch.equal(loss[2:], torch.zeros(2, 2, dtype=torch.float64))
    assert m["dpo/pair_frac"].item() == 0.5


def test_dpo_picks_best_and_worst_and_ignores_masked_rows():
    # G=3, adv (0.2, 0.9, -0.4): chosen row 1, rejected row 2, row 0 untouched. Row 2 fully masked instead: the
    # rejected one becomes row 0 (masked rows never pair). h = (S_1 - S_1^ref) - (S_0 - S_0^ref) = 1 - (-1) = 2
    logp = torch.tensor([[-1.0], [-1.0], [-5.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0], [-2.0], [0.0]], dtype=torch.float64)
    adv = torch.tensor([0.2, 0.9, -0.4], dtype=torch.float64)
    loss, _ = losses.compute("dpo", logp, ref, adv, torch.ones(3, 1, dtype=torch.bool), group_size=3, beta=1.0)
    assert loss[0].item() == 0.0 and loss[1].item() == loss[2].item() > 0
    mask = torch.tensor([[True], [True], [False]])
    loss, m = losses.compute("dpo", logp, ref, adv, mask, group_size=3, beta=1.0)
    assert m["dpo/margin"].item() == pytest.approx(2.0, abs=1e-12)
    assert loss[0].item() == pytest.approx(math.log1p(math.exp(-2.0)), abs=1e-12) and loss[2].item() == 0.0


def test_dpo_rejects_bad_arguments():
    z, m = torch.zeros(4, 1), torch.ones(4, 1, dtype=torch.bool)
    for kw, word in (({"group_size": 3}, "group_size"), ({"group_size": 2, "beta": 0}, "beta")):
        with pytest.raises(ValueError, match=word):
            losses.compute("dpo", z, z, torch.zeros(4), m, **kw)
    with pytest.raises(ValueError, match="label_smoothing"):
        losses.compute("dpo", z, z, torch.zeros(4), m, group_size=2, label_smoothing=0.5)


def test_verifier_pairs_golden():
    # group 0: best 0.9 first at index 1, worst 0.2 at index 0, gap 0.7 >= 0.5 -> (-1, +1, 0, 0)
    # group 1: all equal -> no pair;  group 2: gap 0.3 < 0.5 -> no pair (with margin 0.2: +1 at 1, -1 at 3)
    r = torch.tensor([[0.2, 0.9, 0.5, 0.9], [0.4, 0.4, 0.4, 0.4], [0.1, 0.3, 0.2, 0.0]], dtype=torch.float64)
    adv = advantages.compute("verifier_pairs", r, margin=0.5)
    assert adv.tolist() == [[-1.0, 1.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4]
    assert advantages.loss_mask("verifier_pairs", r, margin=0.5).tolist() == [
        [True, True, False, False],
        [False] * 4,
        [False] * 4,
    ]
    assert advantages.compute("verifier_pairs", r, margin=0.2)[2].tolist() == [0.0, 1.0, 0.0, -1.0]
    with pytest.raises(ValueError, match="margin"):
        advantages.compute("verifier_pairs", r, margin=-1.0)


def test_phase_schedule_cycles_and_overrides_only_what_it_names():
    cfg = load_config(VERIPO)  # phases: 4 GRPO steps, then 2 DPO steps
    assert [phases.phase_index(cfg.algo.phases, s) for s in range(13)] == [0, 0, 0, 0, 1, 1] * 2 + [0]
    dpo_step = phases.config_at(cfg, 5).algo
    assert (dpo_step.advantage, dpo_step.loss, dpo_step.aggregation) == (
        "verifier_pairs",
        "dpo",
        "seq_mean_token_mean",
    )
    assert dpo_step.loss_kwargs == {"beta": 0.1} and dpo_step.phases == []
    grpo_step = phases.config_at(cfg, 6).algo
    assert (grpo_step.advantage, grpo_step.loss, grpo_step.loss_kwargs) == ("grpo", "clipped", cfg.algo.loss_kwargs)
    assert phases.config_at(load_config(VERIPO, ["algo.phases=[]"]), 5).algo.loss == "clipped"


@pytest.mark.parametrize(
    "override,words",
    [
        ("algo.phases.1.loss=dpx", ["algo.phases.1.loss", "'dpx'", "did you mean 'dpo'"]),
        ("algo.phases.1.aggregation=token_mean", ["algo.phases.1.aggregation", "seq_mean_token_mean"]),
        ("algo.phases.0.steps=0", ["algo.phases.0.steps (0)", ">= 1"]),
        ("algo.phases.1.loss_kwargs={beta: -1}", ["algo.phases.1.loss_kwargs", "beta=-1"]),
        ("algo.phases.1.advantage_kwargs={margn: 1}", ["algo.phases.1.advantage_kwargs", "did you mean 'margin'"]),
        ("algo.phases.0.lr=1", ["algo.phases.0.lr", "valid keys here"]),
    ],
)
def test_bad_phase_fails_before_the_model_loads(override, words):
    with pytest.raises(UserError) as err:
        load_config(VERIPO, [override])
    assert all(w in str(err.value) for w in words), str(err.value)


def test_dpo_first_step_is_log_two_against_the_reference(tmp_path):
    """DPO alone from step 0: the policy IS the reference, so every pair's margin is 0 and the loss over the
    verifier's pairs is exactly log 2 (one micro-batch, so loss/policy is the whole aggregate)."""
    extra = ["algo.phases=[]", "algo.advantage=verifier_pairs", "algo.advantage_kwargs={margin: 0.1}"]
    extra += ["algo.loss=dpo", "algo.loss_kwargs={beta: 0.1}", "algo.aggregation=seq_mean_token_mean"]
    cfg = load_config(VERIPO, [f"run.output_dir={tmp_path}", "run.steps=1", *FAST, *extra])
    row = json.loads((Path(train(cfg)["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])
    assert row["dpo/pair_frac"] > 0 and row["dpo/margin"] == pytest.approx(0.0, abs=1e-6)
    assert row["loss/policy"] == pytest.approx(math.log(2.0), abs=1e-6)


def test_veripo_recipe_trains_grpo_then_dpo(tmp_path):
    """Two steps of the recipe with a 1 + 1 schedule: step 0 is GRPO (on-policy ratio 1), step 1 DPO on pairs."""
    one_each = "algo.phases=[{steps: 1}, {steps: 1, advantage: verifier_pairs, advantage_kwargs: {margin: 0.1}, "
    one_each += "loss: dpo, loss_kwargs: {beta: 0.1}, aggregation: seq_mean_token_mean}]"
    cfg = load_config(VERIPO, [f"run.output_dir={tmp_path}", "run.steps=2", *FAST, one_each])
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == [0.0, 1.0] and all(r["skipped"] == 0.0 for r in rows)
    assert rows[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-6) and "dpo/margin" not in rows[0]
    assert rows[1]["dpo/pair_frac"] > 0 and math.isfinite(rows[1]["dpo/margin"]) and "ratio/mean" not in rows[1]
    assert rows[1]["dpo/margin"] != 0.0  # one GRPO step moved the policy away from the frozen reference
