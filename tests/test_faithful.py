"""Faithful GRPO (arXiv:2604.08476): the constrained advantage and its dual ascent worked by hand in float64, the
validation of its columns before any model loads, and multipliers that survive a checkpoint exactly."""

import json
import math
from pathlib import Path

import pytest
import torch

from mmgrpo import advantages
from mmgrpo.advantages.constrained import _dual_ascent
from mmgrpo.config import load_config
from mmgrpo.errors import UserError
from mmgrpo.trainer import train

ROOT = Path(__file__).resolve().parents[1]
FAITHFUL = str(ROOT / "configs" / "toy_faithful.yaml")
FAST = ["run.progress=false", "run.report=false", "sample.batch_size=16", "sample.group_size=4"]
FAST += ["algo.micro_batch_size=16", "run.resume=auto"]


def test_faithful_golden():
    # one group of G=3, columns (task, constraint): task (1, 0, 0), constraint (0, 1, 1), lam = 0.5, eps = 0
    # task: mean 1/3, centred (2/3, -1/3, -1/3), std (ddof 1) = sqrt((4/9 + 1/9 + 1/9) / 2) = 1/sqrt(3)
    #   z_task = (2/sqrt(3), -1/sqrt(3), -1/sqrt(3));  the constraint is its mirror: z_c = -z_task
    # A = (z_task + 0.5 z_c) / (1 + 0.5) = 0.5 z_task / 1.5 = z_task / 3 = (2/(3 sqrt 3), -1/(3 sqrt 3), -1/(3 sqrt 3))
    #   = (0.38490017945975047, -0.19245008972987523, -0.19245008972987523); normalize=False: 0.5 z_task
    r = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]], dtype=torch.float64)
    kw = {"constraints": [1], "thresholds": [0.9], "multipliers": [0.5], "eps": 0.0}
    adv = advantages.compute("faithful", r, **kw)
    third = 1 / (3 * math.sqrt(3))
    torch.testing.assert_close(adv, torch.tensor([[2 * third, -third, -third]]), rtol=0, atol=1e-7)
    raw = advantages.compute("faithful", r, **kw, normalize=False)
    torch.testing.assert_close(raw, torch.tensor([[1.0, -0.5, -0.5]]) / math.sqrt(3), rtol=0, atol=1e-7)
    # lam = 0 is GRPO on the task column alone (the constraint has no say until it is violated)
    zero = advantages.compute("faithful", r, constraints=[1], thresholds=[0.9], multipliers=[0.0], eps=0.0)
    torch.testing.assert_close(zero, advantages.compute("grpo", r[..., 0], eps=0.0), rtol=0, atol=0)


def test_dual_ascent_golden():
    # batch mean of the constraint = 2/3; lam <- max(0, lam + lr (tau - 2/3)), lr = 0.3
    #   tau 0.9 (violated): 0.5 + 0.3 * 0.2333... = 0.57;  tau 0.5 (met): 0.5 - 0.3 * 0.1666... = 0.45
    #   lam 0.01, tau 0.5: 0.01 - 0.05 < 0 -> 0 (multipliers stay >= 0)
    r = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]], dtype=torch.float64)
    up = _dual_ascent(r, constraints=[1], thresholds=[0.9], multipliers=[0.5], dual_lr=0.3)["multipliers"]
    assert up == pytest.approx([0.57], abs=1e-15)
    down = _dual_ascent(r, constraints=[1], thresholds=[0.5], multipliers=[0.5], dual_lr=0.3)["multipliers"]
    assert down == pytest.approx([0.45], abs=1e-15)
    assert _dual_ascent(r, constraints=[1], thresholds=[0.5], multipliers=[0.01], dual_lr=0.3)["multipliers"] == [0.0]
    # ragged groups: NaN padding is no sample (mean over the 2 real ones = 0.5)
    pad = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [float("nan")] * 2]], dtype=torch.float64)
    assert _dual_ascent(pad, constraints=[1], thresholds=[0.9], multipliers=[0.0], dual_lr=1.0)["multipliers"] == (
        pytest.approx([0.4], abs=1e-15)
    )


@pytest.mark.parametrize(
    "override,words",
    [
        ("algo.advantage_kwargs={constraints: [2], thresholds: [0.9]}", ["constraints=[2]", "[0, 2)"]),
        ("algo.advantage_kwargs={constraints: [1], thresholds: [0.9, 0.5]}", ["thresholds", "one value per"]),
        ("algo.advantage_kwargs={constraints: [0, 1], thresholds: [0.9, 0.9]}", ["no task reward"]),
        ("algo.advantage_kwargs={dual_lr: -1}", ["dual_lr=-1"]),
    ],
)
def test_bad_constraints_fail_before_the_model_loads(override, words):
    with pytest.raises(UserError) as err:
        load_config(FAITHFUL, [override])
    assert all(w in str(err.value) for w in words), str(err.value)


def _multipliers(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["adv/faithful/multipliers/0"] for r in rows]


def test_multipliers_resume_exactly(tmp_path):
    """Three steps straight vs two steps, stop, resume for the third: the same multipliers at every step (the dual
    state rides in the checkpoint; a fresh start would restart from the config's 0)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(load_config(FAITHFUL, [f"run.output_dir={straight}", "run.steps=3", *FAST]))
    train(load_config(FAITHFUL, [f"run.output_dir={split}", "run.steps=2", *FAST]))
    train(load_config(FAITHFUL, [f"run.output_dir={split}", "run.steps=3", *FAST]))
    lam = _multipliers(straight)
    assert lam[0] > 0 and len(set(lam)) == 3  # the constraint starts violated, so lam moves every step
    assert _multipliers(split) == lam
