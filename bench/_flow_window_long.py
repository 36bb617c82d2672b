"""A longer, several-seed run of bench/flow.py's part (b), MixGRPO window vs all-step training, for the gain-per-second
figure that 60 s per arm leaves unresolved. Not part of `make bench` (about 7 minutes per seed at the default budget).

Run: python bench/_flow_window_long.py [--budget 180] [--seeds 0 1]; writes bench/sections/flow_window_long.md.
The arms, recipe, evaluation and gain-per-second slope are bench/flow.py's; only the budget and seeds differ.
"""

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from bench import flow
from bench._flow_arms import Evaluator, change, gain, make_run, val_spec
from bench.common import machine, md_table, now_utc, quiet_process, write_section, write_summary
from pipelines.flow.build import shapes_prompts

WINDOW = "window (MixGRPO)"


def one_seed(base: dict, seed: int, budget: float, evaluator: Evaluator, tmp: Path) -> dict:
    setting = {"prompts_per_iter": 4, "k_chunk": 1, "seed": seed}
    probe = make_run(tmp / f"base{seed}", base, plan=None, plan_kwargs=None, setting=setting, seed=seed)
    base_acc = evaluator(probe)
    del probe
    arms = {n: flow.WINDOW_ARMS[n] for n in (flow.BASE, WINDOW)}
    saved, flow.WINDOW_ARMS = flow.WINDOW_ARMS, arms  # bench_window races the arms listed there
    try:
        win = flow.bench_window(base, setting, tmp / f"s{seed}", evaluator, base_acc, budget)
    finally:
        flow.WINDOW_ARMS = saved
    return {n: a for n, a in win["arms"].items()}


def _add_rows(rows: list[list], ratios: list[float], seed: int, arms: dict) -> None:
    """Append one seed's rows (partial, strict: iterations, change, gain per minute, ratio) and its partial ratio."""
    slope = {n: {m: gain(a.curve, m, "second") * 6000 for m in ("partial", "strict")} for n, a in arms.items()}
    for m in ("partial", "strict"):
        a, b = slope[flow.BASE][m], slope[WINDOW][m]
        ratio = f"{b / a:.2f}x" if a > 0 else "n/a (all-step <= 0)"
        if a > 0 and m == "partial":
            ratios.append(b / a)
        rows.append(
            [
                seed,
                m,
                f"{arms[flow.BASE].step} / {arms[WINDOW].step}",
                f"{change(arms[flow.BASE].curve, m)} / {change(arms[WINDOW].curve, m)}",
                f"{a:+.2f} / {b:+.2f}",
                ratio,
            ]
        )


def _section(args: argparse.Namespace, rows: list[list], ratios: list[float], lr: str, seconds: float) -> str:
    """The section's markdown: command, setting, the per-seed table and the partial-accuracy ratios."""
    return "\n".join(
        [
            (
                "## Flow, supplementary: MixGRPO window vs all-step training over a longer budget and several seeds"
                + (", constant learning rate" if args.constant_lr else "")
            ),
            "",
            (
                f"`python bench/_flow_window_long.py --budget {args.budget:.0f} --seeds {' '.join(map(str, args.seeds))}"
                f"{' --constant-lr' if args.constant_lr else ''}`, "
                f"{now_utc()}, {seconds:.0f} s; not run by `make bench` (too long for its budget), so this "
                f"section stays from its last run. Machine: {machine()}."
            ),
            "",
            (
                f"bench/flow.py's part (b) with only the all-step and window arms, {args.budget:.0f} training seconds per "
                f"arm and seed (part (b) uses 60 s and seed 0): same recipe, arms racing side by side, evaluation on 160 "
                f"held-out "
                f"images at 0, 1/2 and 1 of the budget, gain per second = least-squares slope of accuracy on training "
                f"seconds; learning rate {lr}."
            ),
            "",
            md_table(
                [
                    "seed",
                    "accuracy",
                    "iterations, all-step / window",
                    "change in points (+- s.e.), all-step / window",
                    "gain, points per minute, all-step / window",
                    "window / all-step gain per second",
                ],
                rows,
            ),
            "",
            (
                "Partial-accuracy ratio over the seeds where all-step gained: "
                + (
                    ", ".join(f"{r:.2f}x" for r in ratios)
                    if ratios
                    else "none (all-step gained nothing in every seed)"
                )
                + f"; issue 9 target >= {flow.TARGETS['window']:.0f}x."
            ),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=180.0, help="training seconds per arm and seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument(
        "--constant-lr",
        action="store_true",
        help="constant learning rate instead of the recipe's cosine over its 72 iterations (which decays "
        "a faster arm's rate sooner in wall time); writes flow_window_long_constant_lr",
    )
    args = ap.parse_args(argv)
    quiet_process()
    flow.quiet()
    t0 = time.perf_counter()

    base = yaml.safe_load(flow.RECIPE.read_text())
    if args.constant_lr:
        base["optim"]["schedule"] = "constant"
    lr = f"{base['optim']['lr']} {base['optim']['schedule']}" + (
        f" over {base['run']['steps']} iterations" if base["optim"]["schedule"] != "constant" else ""
    )
    evaluator = Evaluator(shapes_prompts(val_spec(base)), 8)
    rows, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="bench_flow_long_") as tmp:
        for seed in args.seeds:
            arms = one_seed(copy.deepcopy(base), seed, args.budget, evaluator, Path(tmp))
            _add_rows(rows, ratios, seed, arms)
            print(rows[-2:], flush=True)
    md = _section(args, rows, ratios, lr, time.perf_counter() - t0)
    name = "flow_window_long" + ("_constant_lr" if args.constant_lr else "")
    write_section(name, md)
    comparison = (
        f"flow: MixGRPO window vs all-step, reward gain per second, {args.budget:.0f} s per arm, seeds "
        f"{', '.join(map(str, args.seeds))}{', constant lr' if args.constant_lr else ''} (supplementary: "
        f"`python bench/{Path(__file__).name}`, not run by make bench)"
    )
    measured = "partial accuracy " + "; ".join(f"seed {r[0]}: {r[5]}" for r in rows if r[1] == "partial")
    write_summary(name, [(comparison, measured, f">= {flow.TARGETS['window']:.0f}x")])
    print(md)


if __name__ == "__main__":
    main()
