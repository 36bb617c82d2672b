"""The T2I study's bookkeeping (bench/_t2i_study.py, bench/_t2i_study_report.py): arms load as valid recipes, a
cosine arm is horizon-bound, changes are per seed against the same seed's base, monitors average the right steps,
the LoRA norm is the norm of B A. No model runs here."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _t2i_study as study
from bench import _t2i_study_report as report


def _row(arm, seed, steps, strict, partial=0.5, cat_strict=None):
    test = {"all": {"strict": strict, "partial": partial, "objects": 2.0, "diversity": 0.3, "n": 320}}
    if cat_strict is not None:
        test["colors"] = {"strict": cat_strict, "partial": partial, "objects": 2.0, "diversity": 0.3, "n": 48}
    return {"arm": arm, "seed": seed, "steps": steps, "mult": steps // 72, "test": test, "lora_norm": 0.0}


def test_every_arm_is_a_valid_recipe():
    from mmgrpo import validate

    for overrides in study.ARMS.values():
        validate.validate(study.load(overrides))  # raises UserError naming the field on a bad arm


def test_horizon_bound_follows_the_schedule():
    assert study.horizon_bound(study.load(["optim.schedule=cosine"]))
    assert not study.horizon_bound(study.load(["optim.schedule=constant"]))


def test_change_is_per_seed_against_that_seeds_base():
    # seed 0: 0.30 -> 0.50 (+20.0 points); seed 1: 0.20 -> 0.25 (+5.0); seed 2 has no base row and is left out
    rows = [
        _row("a", 0, 0, 0.30),
        _row("a", 1, 0, 0.20),
        _row("a", 0, 72, 0.50),
        _row("a", 1, 72, 0.25),
        _row("a", 2, 72, 0.90),
    ]
    g = report._group(rows)
    assert report.change(g[("a", 72)], g[("a", 0)], "all", "strict") == pytest.approx([20.0, 5.0])
    assert report._cell([20.0, 5.0]) == "+12.5 [+5.0, +20.0]"
    line = report.summary_table(rows).splitlines()[2]
    assert line.startswith("| a | 72 | 0,1,2 | 0.550 | +12.5 [+5.0, +20.0] |")


def test_worst_category_is_the_largest_drop():
    # colors: seed 0 0.60 -> 0.50 = -10.0 points, the only category, so it is the worst one
    rows = [_row("a", 0, 0, 0.3, cat_strict=0.60), _row("a", 0, 72, 0.4, cat_strict=0.50)]
    assert report.summary_table(rows).splitlines()[2].endswith("| colors -10.0 |")


def test_monitors_average_the_window(tmp_path):
    lines = [{"step": s, "reward/partial/mean": float(s), "ratio/std": 0.0} for s in range(10)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines))
    out = study.monitors(path, 6, 9)  # steps 6, 7, 8 -> mean 7
    assert out["train_partial"] == pytest.approx(7.0)
    assert out["ratio_std"] == 0.0 and "kl" not in out


def test_lora_norm_is_the_norm_of_b_times_a(tmp_path, monkeypatch):
    # one layer: B = [[1], [2]], A = [[3, 4]] -> BA = [[3, 4], [6, 8]], ||BA||_F = sqrt(9+16+36+64) = sqrt(125)
    weights = {"x.lora_A.weight": torch.tensor([[3.0, 4.0]]), "x.lora_B.weight": torch.tensor([[1.0], [2.0]])}
    from mmgrpo import checkpoint

    monkeypatch.setattr(checkpoint, "load", lambda path, rank: {"weights": weights})
    assert study.lora_norm(tmp_path) == pytest.approx(125**0.5)
    assert study.lora_norm(None) == 0.0


def test_plotted_series_is_mean_and_sd_over_the_base_seeds():
    # seed 0: 0.30 -> 0.50 (+20.0), seed 1: 0.20 -> 0.25 (+5.0): mean 12.5, sd sqrt((7.5^2 + 7.5^2) / 1) = 10.6066;
    # at 144 steps only seed 0 ran, so that length is left out (the mean would move with which seeds ran)
    rows = [_row("a", 0, 0, 0.30), _row("a", 1, 0, 0.20), _row("a", 0, 72, 0.50), _row("a", 1, 72, 0.25)]
    rows.append(_row("a", 0, 144, 0.60))
    pts = report.series(rows, "a")
    assert [p[0] for p in pts] == [0, 72]
    assert pts[0][1:3] == (0.0, 0.0) and pts[0][4] == 2
    assert pts[1][1] == pytest.approx(12.5) and pts[1][2] == pytest.approx(10.6066, abs=1e-4)
    assert pts[1][3] == pytest.approx(2.0)


def test_report_keeps_the_hand_written_part(tmp_path):
    doc = tmp_path / "study.md"
    doc.write_text("# Study\n\nfindings\n\n" + report.MARK + "\n\nold tables\n")
    report.write_report([_row("a", 0, 0, 0.3), _row("a", 0, 72, 0.4)], doc)
    text = doc.read_text()
    assert text.startswith("# Study\n\nfindings") and "old tables" not in text
    assert text.index("Held-out change") < text.index("per category") < text.index("Monitors")
    assert (tmp_path / "img" / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot the page links
