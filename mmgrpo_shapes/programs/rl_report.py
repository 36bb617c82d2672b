"""Issue 14's RL table from several seeds' `mmgrpo eval` JSON: per category, the base and after-RL score with real
images or frames, the gain with real and with blank inputs, as mean and sample std over the runs (seeds).

Each run directory holds `eval/base.json` (`mmgrpo eval <run>/config.yaml ckpt=none ablate=auto ...`) and the
newest `eval/step_*.json` (`ckpt=latest`, the same overrides; with `--ema`, the newest `step_*_ema.json` that
`ckpt=latest ema=true` writes). Both are paired on the same records and sampling seed,
so a gain is the RL update's effect, not the eval's sampling noise.

Run: python -m mmgrpo_shapes.programs.rl_report /tmp/vlmrl/s0 /tmp/vlmrl/s1 /tmp/vlmrl/s2 --metric accuracy
"""

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def load(run: Path, ema: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(base, after) eval results of one run directory, after = the plain weights' newest step or, with `ema`, the EMA
    weights'; a missing file is named with the command that writes it. Why the split: "step_N_ema.json" sorts after
    "step_N.json", so the newest of all would report the EMA weights whenever a run was also scored with ema=true."""
    base = run / "eval" / "base.json"
    after = sorted(p for p in (run / "eval").glob("step_*.json") if p.stem.endswith("_ema") == ema)
    if not base.is_file() or not after:
        want, flag = ("step_*_ema.json", " ema=true") if ema else ("step_*.json", "")
        sys.exit(
            f"{run}: needs eval/base.json and eval/{want}; run `mmgrpo eval {run}/config.yaml ckpt=none "
            f"ablate=auto` and `... ckpt=latest{flag}` first"
        )
    return json.loads(base.read_text()), json.loads(after[-1].read_text())


def gains(runs: list[Path], metric: str, ema: bool = False) -> dict[str, dict[str, list[float]]]:
    """category -> {"base", "after", "gain", "blank_gain"}: one value per run."""
    out: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        base, after = load(run, ema)
        for cat, row in after["conditions"]["real"].items():
            b = base["conditions"]["real"][cat][metric]
            cols = out.setdefault(cat, {"base": [], "after": [], "gain": [], "blank_gain": []})
            cols["base"].append(b)
            cols["after"].append(row[metric])
            cols["gain"].append(row[metric] - b)
            if "blank" in after["conditions"]:
                blank = after["conditions"]["blank"][cat][metric] - base["conditions"]["blank"][cat][metric]
                cols["blank_gain"].append(blank)
    return out


def fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):+.3f} ± {sd:.3f}" if len(xs) > 1 else f"{xs[0]:+.3f}"


def table(runs: list[Path], metric: str, ema: bool = False) -> str:
    """A markdown table: category, n runs, base, after, gain (real), gain (blank), gain ratio."""
    rows = [
        "| category | runs | base | after RL | gain, real | gain, blank | per run (real) |",
        "|---|---|---|---|---|---|---|",
    ]
    for cat, c in sorted(gains(runs, metric, ema).items(), key=lambda kv: (kv[0] != "all", kv[0])):
        mean = statistics.mean
        per_run = " / ".join(f"{g:+.3f}" for g in c["gain"])
        rows.append(
            f"| {cat} | {len(c['gain'])} | {mean(c['base']):.3f} | {mean(c['after']):.3f} | {fmt(c['gain'])} "
            f"| {fmt(c['blank_gain'])} | {per_run} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (one per seed)")
    p.add_argument("--metric", default="accuracy", help="the reward column to compare (accuracy, video_task, ...)")
    p.add_argument("--ema", action="store_true", help="after RL = the EMA weights' eval (ckpt=latest ema=true)")
    args = p.parse_args(argv)
    print(table(args.runs, args.metric, args.ema))


if __name__ == "__main__":
    main()
