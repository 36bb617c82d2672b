"""A longer, several-seed run of bench/flow.py's part (b), MixGRPO window (and DiffusionNFT) vs all-step training, for
the gain-per-second figure that 60 s per arm leaves unresolved. Not part of `make bench` (about 7 minutes per arm and
seed at the default budget).

Run: python bench/_flow_window_long.py [--budget 180] [--seeds 0 1] [--arms window nft]; writes
bench/sections/flow_window_long.md (with --arms nft alone: flow_nft_long.md).
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
from bench._flow_arms import NFT, Evaluator, change, gain, make_run, val_spec
from bench._flow_verdict import resolved
from bench.common import machine, md_table, now_utc, quiet_process, write_section, write_summary
from pipelines.flow.build import shapes_prompts

WINDOW = "window (MixGRPO)"
ARM_NAMES = {"window": WINDOW, "nft": NFT}


def one_seed(base: dict, seed: int, budget: float, evaluator: Evaluator, tmp: Path, names: list[str]) -> dict:
    setting = {"prompts_per_iter": 4, "k_chunk": 1, "seed": seed}
    probe = make_run(tmp / f"base{seed}", base, plan=None, plan_kwargs=None, setting=setting, seed=seed)
    base_acc = evaluator(probe)
    del probe
    arms = {n: flow.WINDOW_ARMS[n] for n in (flow.BASE, *names)}
    saved, flow.WINDOW_ARMS = flow.WINDOW_ARMS, arms  # bench_window races the arms listed there
    try:
        win = flow.bench_window(base, setting, tmp / f"s{seed}", evaluator, base_acc, budget)
    finally:
        flow.WINDOW_ARMS = saved
    return {n: a for n, a in win["arms"].items()}


def _add_rows(rows: list[list], ratios: dict, seed: int, arms: dict) -> None:
    """Append one seed's rows per raced arm (partial, strict: iterations, change, gain per minute, ratio) and its
    partial ratio."""
    slope = {n: {m: gain(a.curve, m, "second") * 6000 for m in ("partial", "strict")} for n, a in arms.items()}
    for n in [a for a in arms if a != flow.BASE]:
        for m in ("partial", "strict"):
            a, b = slope[flow.BASE][m], slope[n][m]
            ok = a > 0 and resolved(arms[flow.BASE].curve, m)  # a ratio over a change inside 2 s.e. is noise
            ratio = f"{b / a:.2f}x" if ok else "n/a (all-step's change is under 2 s.e.)"
            if ok and m == "partial":
                ratios.setdefault(n, []).append(b / a)
            rows.append(
                [
                    seed,
                    n,
                    m,
                    f"{arms[flow.BASE].step} / {arms[n].step}",
                    f"{change(arms[flow.BASE].curve, m)} / {change(arms[n].curve, m)}",
                    f"{a:+.2f} / {b:+.2f}",
                    ratio,
                ]
            )


def _section(args: argparse.Namespace, rows: list[list], ratios: dict, lr: str, seconds: float) -> str:
    """The section's markdown: command, setting, the per-seed table and the partial-accuracy ratios."""
    names = [ARM_NAMES[a] for a in args.arms]
    targets = {
        WINDOW: f"issue 9 target >= {flow.TARGETS['window']:.0f}x",
        NFT: f"issue 15 target >= {flow.TARGETS['nft']:.0f}x",
    }
    verdicts = [
        f"{n}: "
        + (", ".join(f"{r:.2f}x" for r in ratios[n]) if ratios.get(n) else "none (all-step's gain unresolved)")
        + f" ({targets[n]})"
        for n in names
    ]
    return "\n".join(
        [
            (
                f"## Flow, supplementary: {' and '.join(names)} vs all-step training over a longer budget and several seeds"
                + (", constant learning rate" if args.constant_lr else "")
            ),
            "",
            (
                f"`python bench/_flow_window_long.py --budget {args.budget:.0f} --seeds {' '.join(map(str, args.seeds))}"
                f" --arms {' '.join(args.arms)}{' --constant-lr' if args.constant_lr else ''}`, "
                f"{now_utc()}, {seconds:.0f} s; not run by `make bench` (too long for its budget), so this "
                f"section stays from its last run. Machine: {machine()}."
            ),
            "",
            (
                f"bench/flow.py's part (b) with the all-step arm and {', '.join(names)}, {args.budget:.0f} training "
                f"seconds per arm and seed (part (b) uses 60 s and seed 0): same recipe, arms racing side by side, "
                f"evaluation on 160 held-out images at 0, 1/2 and 1 of the budget, gain per second = least-squares "
                f"slope of accuracy on training seconds; learning rate {lr}."
            ),
            "",
            md_table(
                [
                    "seed",
                    "arm B",
                    "accuracy",
                    "iterations, all-step / B",
                    "change in points (+- s.e.), all-step / B",
                    "gain, points per minute, all-step / B",
                    "B / all-step gain per second",
                ],
                rows,
            ),
            "",
            "Partial-accuracy ratio over the seeds where all-step gained (by 2 s.e. or more): "
            + "; ".join(verdicts)
            + ".",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=180.0, help="training seconds per arm and seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--arms", nargs="+", choices=list(ARM_NAMES), default=["window"], help="raced beside all-step")
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
    rows, ratios = [], {}
    names = [ARM_NAMES[a] for a in args.arms]
    with tempfile.TemporaryDirectory(prefix="bench_flow_long_") as tmp:
        for seed in args.seeds:
            arms = one_seed(copy.deepcopy(base), seed, args.budget, evaluator, Path(tmp), names)
            _add_rows(rows, ratios, seed, arms)
            print(rows[-2 * len(names) :], flush=True)
    md = _section(args, rows, ratios, lr, time.perf_counter() - t0)
    name = ("flow_nft_long" if args.arms == ["nft"] else "flow_window_long") + (
        "_constant_lr" if args.constant_lr else ""
    )
    write_section(name, md)
    summary = []
    for key in args.arms:
        n = ARM_NAMES[key]
        comparison = (
            f"flow: {n} vs all-step, reward gain per second, {args.budget:.0f} s per arm, seeds "
            f"{', '.join(map(str, args.seeds))}{', constant lr' if args.constant_lr else ''} (supplementary: "
            f"`python bench/{Path(__file__).name}`, not run by make bench)"
        )
        measured = "partial accuracy " + "; ".join(
            f"seed {r[0]}: {r[6]}, change all-step / {key} {r[4]} points"
            for r in rows
            if r[1] == n and r[2] == "partial"
        )
        summary.append((comparison, measured, f">= {flow.TARGETS[key]:.0f}x"))
    write_summary(name, summary)
    print(md)


if __name__ == "__main__":
    main()
