"""mmgrpo_shapes/programs/rl_report.py: the seeds' RL table from `mmgrpo eval` JSON (issue 14, item 4)."""

import json

import pytest

from mmgrpo_shapes.programs import rl_report


def _write(run, label, real, blank):
    (run / "eval").mkdir(parents=True, exist_ok=True)
    conds = {"real": {"all": {"accuracy": real}}, "blank": {"all": {"accuracy": blank}}}
    (run / "eval" / f"{label}.json").write_text(json.dumps({"conditions": conds}))


def test_gains_per_seed_and_their_spread(tmp_path):
    # seed a: 0.50 -> 0.70 (+0.20), blank 0.30 -> 0.25 (-0.05); seed b: 0.60 -> 0.70 (+0.10), blank 0.30 -> 0.35
    # (+0.05). Mean gain +0.15, sample sd sqrt(((0.05)^2 + (0.05)^2) / 1) = 0.0707; blank mean 0.00, sd 0.0707.
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "base", 0.5, 0.3)
    _write(a, "step_00000100", 0.7, 0.25)
    _write(b, "base", 0.6, 0.3)
    _write(b, "step_00000100", 0.7, 0.35)
    cols = rl_report.gains([a, b], "accuracy")["all"]
    assert cols["gain"] == pytest.approx([0.2, 0.1]) and cols["blank_gain"] == pytest.approx([-0.05, 0.05])
    row = rl_report.table([a, b], "accuracy").splitlines()[2]
    assert row == "| all | 2 | 0.550 | 0.700 | +0.150 ± 0.071 | +0.000 ± 0.071 | +0.200 / +0.100 |"


def test_missing_eval_names_the_command(tmp_path):
    with pytest.raises(SystemExit) as err:
        rl_report.load(tmp_path)
    assert "ckpt=none" in str(err.value) and "eval/base.json" in str(err.value)


def test_plain_weights_unless_ema_is_asked(tmp_path):
    # "step_00000100_ema.json" sorts after "step_00000100.json": the plain weights' +0.20 must not become the EMA's
    # +0.30 unless --ema asks for it (0.50 -> 0.70 plain, 0.50 -> 0.80 EMA).
    _write(tmp_path, "base", 0.5, 0.3)
    _write(tmp_path, "step_00000100", 0.7, 0.3)
    _write(tmp_path, "step_00000100_ema", 0.8, 0.3)
    assert rl_report.gains([tmp_path], "accuracy")["all"]["gain"] == pytest.approx([0.2])
    assert rl_report.gains([tmp_path], "accuracy", ema=True)["all"]["gain"] == pytest.approx([0.3])


def test_ema_without_its_eval_names_the_command(tmp_path):
    _write(tmp_path, "base", 0.5, 0.3)
    _write(tmp_path, "step_00000100", 0.7, 0.3)
    with pytest.raises(SystemExit) as err:
        rl_report.load(tmp_path, ema=True)
    assert "ema=true" in str(err.value) and "step_*_ema.json" in str(err.value)
