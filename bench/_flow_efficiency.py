"""Issue 15 item 3: reward gain per training second on the `make demo` recipe (configs/flow/shapes_t2i_nft.yaml)
against all-step Flow-GRPO, over a budget long enough for all-step to learn: window (MixGRPO), pruned tree
(BranchGRPO) and the recipe itself (DiffusionNFT).

Every arm is the demo recipe (model, prompts, 8 x 8 samples a step, constant lr 1e-3, partial credit minus 0.05 per
unrequested object) with only the rollout plan and objective changed; the GRPO arms use Flow-GRPO's clipped loss and
one optimizer step per batch (two collapsed it in the T2I study). The arms race in one process, one thread,
always the one with the least training time next (so load hits all alike); each is scored at every 1/--marks of the
budget on 160 held-out images (20 validation prompts x 8 fixed seeds, ODE). Gain per second = least-squares slope of
accuracy on training seconds, as a ratio to all-step's over a budget where all-step has clearly learned (change
>= 5 points and >= 2 standard errors at its end): the whole budget if so, else its longest such prefix of marks; time
to +5 = the first mark whose change is >= 5 points and >= 2 standard errors.

Run:  python bench/_flow_efficiency.py [--seeds 0 1] [--budget 1200] [--marks 4]   (one race per seed, appended to
      bench/sections/flow_efficiency.jsonl; a seed already stored at that budget is skipped unless --again)
      python bench/_flow_efficiency.py --report          (the section and summary rows from what is stored)
About 4 x budget + 5 minutes per seed; not part of `make bench` (run_all skips names starting with "_"):
`make bench-efficiency` re-runs seeds 0, 1 and 2 (--again) in two processes side by side (0 then 2, and 1) and
rewrites the section and summary rows.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from bench._flow_arms import TARGETS, TREE_ARMS, Arm, Evaluator, delta, interleave, make_run, median, val_spec
from bench.common import REPO, fit_slope, machine, md_table, now_utc, quiet_process, write_section, write_summary
from pipelines.flow.build import shapes_prompts

RECIPE = REPO / "configs" / "flow" / "shapes_t2i_nft.yaml"
STORE = REPO / "bench" / "sections" / "flow_efficiency.jsonl"
GRPO = {"loss": "clipped", "loss_kwargs": {"clip_low": 0.2, "clip_high": 0.2}, "num_minibatches": 1}
BASE = "all steps (Flow-GRPO)"
RECIPE_ARM = "DiffusionNFT (the demo recipe)"
# name: (plan, plan_kwargs, pipeline kwargs, algo overrides); None = the recipe unchanged
ARMS = {
    BASE: ("independent", {"train": "all"}, {"objective": "grpo"}, GRPO),
    "window (MixGRPO)": (
        "independent",
        {"train": "window", "window_size": 2, "window_every": 4},
        {"objective": "grpo", "same_noise_per_group": True},  # MixGRPO's --init_same_noise, as bench/flow.py
        GRPO,
    ),
    "tree, pruned (BranchGRPO)": ("tree", TREE_ARMS["tree, pruned"][1], {"objective": "grpo"}, GRPO),
    RECIPE_ARM: None,
}
TARGET = {"window (MixGRPO)": f">= {TARGETS['window']:.0f}x", RECIPE_ARM: f">= {TARGETS['nft']:.0f}x"}
METRICS = ("partial", "strict")
SETTING = {"prompts_per_iter": 8, "k_chunk": 1}  # the recipe's 8 prompts; one trained step per backward in every arm


def race(base: dict, seed: int, budget: float, marks: int, evaluator: Evaluator, tmp: Path) -> dict:
    """All arms from the same base weights and seed, interleaved until each spent `budget` training seconds."""
    setting = {**SETTING, "seed": seed}
    arms = {}
    for i, (name, spec) in enumerate(ARMS.items()):
        plan, kw, extra, algo = spec if spec is not None else (None, None, None, None)
        run = make_run(tmp / f"s{seed}a{i}", base, plan=plan, plan_kwargs=kw, setting=setting, seed=seed,
                       pipeline_kwargs=extra, algo=algo)  # fmt: skip
        arms[name] = Arm(name, run)
    start = evaluator(arms[BASE].run)  # every arm starts from the shipped weights: one base score serves all
    for a in arms.values():
        a.curve.append((0.0, 0, start))
    outs = interleave(arms, budget, marks, evaluator, f"seed {seed}")
    return {n: summary(arms[n], outs[n]) for n in arms}


def summary(arm: Arm, outs: list[dict]) -> dict:
    """What the report needs of one arm: its curve (seconds, iterations, change +- s.e. per metric) and profile."""
    curve = []
    for i, (s, it, _) in enumerate(arm.curve):
        point = {"seconds": s, "iterations": it}
        for m in METRICS:
            d, se = delta([arm.curve[0], arm.curve[i]], m) if i else (0.0, 0.0)
            point[m] = {"acc": arm.curve[i][2][m], "change": d, "se": se}
        curve.append(point)
    keys = ("rollout_s", "update_s", "trained", "rollout_rows", "train_rows")
    return {"curve": curve, "profile": {k: median([o[k] for o in outs]) for k in keys}}


def slope(curve: list[dict], metric: str) -> float:
    """Points per minute: least-squares slope of the change on training seconds."""
    return 60 * fit_slope([(p["seconds"], p[metric]["change"]) for p in curve])


def clear(point: dict, metric: str, points: float = 5.0) -> bool:
    """A change that is clearly learned: >= `points` and >= 2 standard errors."""
    c = point[metric]
    return c["change"] >= points and c["change"] >= 2 * c["se"]


def time_to(curve: list[dict], metric: str, points: float = 5.0) -> float | None:
    """Training seconds at the first mark whose change is clear (>= `points`, >= 2 s.e.; None: never)."""
    return next((p["seconds"] for p in curve[1:] if clear(p, metric, points)), None)


def learned_marks(curve: list[dict], metric: str) -> int:
    """How many marks (the start included) make the longest budget at whose end all-step's change is clear; 0 if none.
    Issue 15 asks for the ratio "over a budget where all-step has clearly learned": where all-step's end is not clear,
    this is the budget that does what it asks, cut by all-step's curve alone (never by the arm it is compared to)."""
    return max((i + 1 for i, p in enumerate(curve) if i and clear(p, metric)), default=0)


def gain_text(a: list[dict], b: list[dict], metric: str) -> str:
    """Gain per second of `b` over all-step `a`: over the whole budget if all-step's end is clear, else over the
    longest budget that is (marked "to N s"), else why there is none."""
    k = learned_marks(a, metric)
    if not k:
        return "n/a (all-step never clearly +5)"
    ratio = f"{slope(b[:k], metric) / slope(a[:k], metric):.2f}x"
    return ratio if k == len(a) else f"{ratio} to {a[k - 1]['seconds']:.0f} s"


def ratios(arms: dict, name: str, metric: str) -> tuple[str, str]:
    """(gain-per-second ratio over all-step, time-to-+5 ratio) as text, or why there is none."""
    a, b = arms[BASE]["curve"], arms[name]["curve"]
    gain = gain_text(a, b, metric)
    ta, tb = time_to(a, metric), time_to(b, metric)
    if tb is None:
        return gain, "n/a (never +5)"
    return gain, (f"{ta / tb:.2f}x" if ta is not None else f">= {curve_end(a) / tb:.2f}x (all-step never +5)")


def curve_end(curve: list[dict]) -> float:
    return curve[-1]["seconds"]


def fmt_change(p: dict) -> str:
    return f"{p['change']:+.1f} +- {p['se']:.1f}"


def rows_for(row: dict) -> list[list]:
    arms, out = row["arms"], []
    for name, arm in arms.items():
        c = arm["curve"]
        for m in METRICS:
            gain, t5 = ratios(arms, name, m) if name != BASE else ("1x", "1x")
            best = max(c[1:], key=lambda p: p[m]["change"])
            t = time_to(c, m)
            out.append([row["seed"], name, m, c[-1]["iterations"], f"{c[0][m]['acc']:.3f} -> {c[-1][m]['acc']:.3f}",
                        fmt_change(c[-1][m]), f"{fmt_change(best[m])} at {best['seconds']:.0f} s",
                        f"{slope(c, m):+.2f}", gain, "never" if t is None else f"{t:.0f} s", t5])  # fmt: skip
    return out


def profile_rows(stored: list[dict]) -> list[list]:
    out = []
    for name in ARMS:
        ps = [r["arms"][name]["profile"] for r in stored]
        med = {k: sum(p[k] for p in ps) / len(ps) for k in ps[0]}
        out.append([name, f"{med['rollout_s']:.1f}", f"{med['update_s']:.1f}", f"{med['rollout_s'] + med['update_s']:.1f}",
                    int(med["rollout_rows"]), int(med["train_rows"]), int(med["trained"])])  # fmt: skip
    return out


def verdicts(stored: list[dict]) -> list[tuple[str, str, str]]:
    """Per raced arm: the seeds' gain-per-second and time-to-+5 ratios on the reward (partial) and strict."""
    out = []
    for name in [n for n in ARMS if n != BASE]:
        parts = []
        for m in METRICS:
            per = [f"seed {r['seed']} " + " / ".join(ratios(r["arms"], name, m)) for r in stored]
            parts.append(f"{m}: " + "; ".join(per))
        out.append((name, " | ".join(parts), TARGET.get(name, "(no target)")))
    return out


def load_store() -> list[dict]:
    return [json.loads(line) for line in STORE.read_text().splitlines()] if STORE.exists() else []


def newest(rows: list[dict]) -> list[dict]:
    """One race per (budget, seed), the last stored (a re-run with --again replaces the older), by budget then seed."""
    last = {(r["budget"], r["seed"]): r for r in rows}
    return sorted(last.values(), key=lambda r: (r["budget"], r["seed"]))


def races(stored: list[dict]) -> str:
    """When, how long and on which machine each seed raced: seeds may run on different days and machines, and an
    iteration's seconds (so the iterations in a budget) are the machine's."""
    return " ".join(f"Seed {r['seed']}: {r['when']}, {r['seconds']:.0f} s, {r['machine']}." for r in stored)


def report() -> tuple[str, list[dict]]:
    stored = newest(load_store())
    if not stored:
        raise SystemExit(f"nothing stored in {STORE}: run python bench/{Path(__file__).name} --seeds 0 1 first")
    budget = stored[-1]["budget"]
    stored = [r for r in stored if r["budget"] == budget]
    seeds = " ".join(str(r["seed"]) for r in stored)
    head = ["seed", "arm", "accuracy", "iterations", "start -> end", "change at end, points", "best change",
            "gain, points per minute", "gain per second / all-step's", "time to +5 points", "all-step's time to +5 / arm's"]  # fmt: skip
    marks = stored[-1]["marks"]
    command = (
        f"`python bench/_flow_efficiency.py --seeds {seeds} --budget {budget:.0f} --marks {marks}`; not run by "
        f"`make bench` (about {4 * budget / 60 + 5:.0f} minutes per seed), so this section stays from its last run. "
        f"{races(stored)}"
    )
    setting = (
        "Every arm is `configs/flow/shapes_t2i_nft.yaml` (8 prompts x 8 samples a step, constant lr 1e-3, partial "
        "credit minus 0.05 per unrequested object as the reward) with the plan and objective changed: all-step, "
        "window (2 of 8 steps, moving every 4 iterations, same-noise groups) and pruned tree train Flow-GRPO's "
        "clipped loss with one optimizer step per batch; DiffusionNFT is the recipe as `make demo` runs it (4 noise "
        "levels per sample, 2 optimizer steps per batch). Same seed and base weights in every arm, k_chunk 1, "
        f"{budget:.0f} training seconds each, raced in one process (one thread); held-out score on 160 images (20 "
        f"validation prompts x 8 fixed seeds, ODE) at every 1/{marks} of the budget. 'partial' is the reward (with "
        "the penalty), 'strict' the verifier's all-or-nothing credit. The gain ratio is over a budget where "
        "all-step has clearly learned (change >= 5 points and >= 2 s.e. at its end): the whole budget, or where "
        "all-step's end is not clear the longest budget that is, cut at one of all-step's marks ('to N s')."
    )
    profile = (
        "Per iteration (mean over seeds of each arm's median): seconds in rollout and update, transformer rows "
        "(latents, CFG's two passes counted) without and with gradient, and trained transitions or NFT points."
    )
    title = "## Flow, supplementary: efficiency on the demo recipe (DiffusionNFT) against all-step Flow-GRPO"
    cols = ["arm", "rollout s", "update s", "iteration s", "rollout rows", "train rows", "trained"]
    table = md_table(head, [x for r in stored for x in rows_for(r)])
    md = "\n\n".join([title, command, setting, table, profile, md_table(cols, profile_rows(stored))])
    return md, stored


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--budget", type=float, default=1200.0, help="training seconds per arm and seed")
    ap.add_argument("--marks", type=int, default=4, help="held-out scores per arm (at every 1/marks of the budget)")
    ap.add_argument("--report", action="store_true", help="only write the section from the stored races")
    ap.add_argument("--again", action="store_true", help="race the seeds even when stored (the newest race counts)")
    args = ap.parse_args(argv)
    if not args.report:
        quiet_process()
        base = yaml.safe_load(RECIPE.read_text())
        evaluator = Evaluator(shapes_prompts(val_spec(base)), 8)
        done = set() if args.again else {(r["seed"], r["budget"]) for r in load_store()}
        for seed in [s for s in args.seeds if (s, args.budget) not in done]:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="bench_flow_eff_") as tmp:
                arms = race(base, seed, args.budget, args.marks, evaluator, Path(tmp))
            row = {"seed": seed, "budget": args.budget, "marks": args.marks, "arms": arms, "when": now_utc(),
                   "seconds": time.perf_counter() - t0, "machine": machine()}  # fmt: skip
            with STORE.open("a") as f:  # one line per race: seeds can run in parallel processes
                f.write(json.dumps(row) + "\n")
    md, stored = report()
    write_section("flow_efficiency", md)
    what = "flow: {} vs all-step Flow-GRPO on the demo recipe, gain per second / time to +5 points, {:.0f} s per arm"
    rows = [
        (what.format(n, stored[-1]["budget"]) + " (`python bench/_flow_efficiency.py`)", m, t)
        for n, m, t in verdicts(stored)
    ]
    write_summary("flow_efficiency", rows)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
