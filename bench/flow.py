"""Flow-pipeline benchmarks on ShapesWorld: BranchGRPO tree vs independent rollouts, MixGRPO window and
Flow-GRPO-Fast vs all-step training.

Every arm is `configs/flow/shapes_t2i.yaml` (the `make demo` recipe: assets/shapes-t2i, shapes_geneval partial reward,
LoRA r16, CFG 2, 8 steps) with only the rollout plan, the prompts per iteration and k_chunk changed (and the
MixGRPO arm's same-noise groups, as MixGRPO's recipe has them). The arms and their pieces live in bench/_flow_arms.py,
the report's sections in bench/_flow_report.py, the verdict on the targets in bench/_flow_verdict.py.
Run: python bench/flow.py [--quick]; writes bench/sections/flow.md (its part of results.md) and bench/plots/flow_*.png.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import yaml

# bench_window reads WINDOW_ARMS through this module's name: _flow_window_long swaps flow.WINDOW_ARMS for its two arms
from bench._flow_arms import (  # noqa: F401  (re-exported for _flow_window_long and the tests)
    BASE,
    TARGETS,
    TREE_ARMS,
    WINDOW_ARMS,
    Arm,
    Evaluator,
    forward_flops,
    interleave,
    make_run,
    unique_transitions,
    val_spec,
)
from bench._flow_report import plots, setting_md, tree_section, window_section
from bench._flow_verdict import summary_rows, verdict
from bench.common import (
    REPO,
    machine,
    matmul_gflops,
    now_utc,
    quiet_process,
    summarise,
    write_section,
    write_summary,
)
from pipelines.flow.build import shapes_prompts

RECIPE = REPO / "configs" / "flow" / "shapes_t2i.yaml"


def quiet() -> None:
    """Silence diffusers/transformers progress bars and loading notices in the bench output."""
    # lazy: diffusers and transformers are heavy to import; only main() needs them (to quiet their logs)
    import diffusers
    import transformers

    for lib in (diffusers, transformers):
        lib.utils.logging.set_verbosity_error()
        lib.utils.logging.disable_progress_bar()


# ---- (a) tree vs independent rollouts at equal leaves and steps; (b) window and fast vs all steps


def bench_tree(base: dict, setting: dict, tmp: Path, evaluator: Evaluator, base_acc: dict) -> dict:
    """Round-robin training iterations of every arm (order reversed every round, so drift hits all alike); the
    per-round ratio is independent's seconds over the arm's."""
    arms = {
        n: Arm(n, make_run(tmp / f"a{i}", base, plan=p, plan_kwargs=k, setting=setting, seed=setting["seed"]))
        for i, (n, (p, k)) in enumerate(TREE_ARMS.items())
    }
    for a in arms.values():
        a.curve.append((0.0, 0, base_acc))
    outs: dict[str, list[dict]] = {n: [] for n in arms}
    warm, total = setting["warmup"], setting["warmup"] + setting["rounds"]
    for i in range(total):
        for n in list(arms) if i % 2 == 0 else list(arms)[::-1]:
            out = arms[n].iterate()
            if i >= warm:
                outs[n].append(out)
        print(f"(a) round {i + 1}/{total}: " + ", ".join(f"{n} {arms[n].spent:.0f} s" for n in arms), flush=True)
    for a in arms.values():
        a.evaluate(evaluator)
    ind = [o["seconds"] for o in outs["independent"]]
    pairs = {n: summarise([a / o["seconds"] for a, o in zip(ind, outs[n])]) for n in list(arms)[1:]}
    return {"arms": arms, "outs": outs, "pairs": pairs}


def bench_window(base: dict, setting: dict, tmp: Path, evaluator: Evaluator, base_acc: dict, budget: float) -> dict:
    """Fresh all-step, window, fast and DiffusionNFT arms, interleaved (always the one with the least training time next, so load
    hits all alike) until each spent `budget` seconds, evaluated at half and full budget; gain per second = slope of
    accuracy on training seconds."""
    arms = {}
    for i, (n, spec) in enumerate(WINDOW_ARMS.items()):
        plan, kw, extra, algo = (*spec, None)[:4] if spec is not None else (None, None, None, None)
        arms[n] = Arm(
            n,
            make_run(
                tmp / f"b{i}",
                base,
                plan=plan,
                plan_kwargs=kw,
                setting=setting,
                seed=setting["seed"],
                pipeline_kwargs=extra,
                algo=algo,
            ),
        )
        arms[n].curve.append((0.0, 0, base_acc))
    outs = interleave(arms, budget, 2, evaluator, "(b)")
    return {"arms": arms, "outs": outs}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts, iterations and eval images: a smoke run")
    ap.add_argument("--rounds", type=int, default=None, help="counted round-robin iterations per arm in part (a)")
    ap.add_argument("--budget", type=float, default=None, help="training seconds per arm in part (b) (default 60)")
    return ap.parse_args(argv)


def _run(base: dict, setting: dict, args: argparse.Namespace) -> dict:
    """Parts (a) and (b) from one shared start: the evaluator, the base accuracy, FLOPs and parameters of one probe
    run, then the tree and window races."""
    spec = val_spec(base)
    records = shapes_prompts(spec)
    per_prompt = 2 if args.quick else 8
    if args.quick:
        records = records[::5]
    evaluator = Evaluator(records, per_prompt)
    gflops = matmul_gflops()
    with tempfile.TemporaryDirectory(prefix="bench_flow_") as tmp:
        probe = make_run(Path(tmp) / "base", base, plan=None, plan_kwargs=None, setting=setting, seed=0)
        base_acc = evaluator(probe)  # every arm starts from these weights (LoRA B = 0), so one evaluation serves all
        fwd = forward_flops(probe)
        n_params = probe.policy.num_params
        del probe
        tree = bench_tree(base, setting, Path(tmp), evaluator, base_acc)
        budget = args.budget or setting["budget"]
        win = bench_window(base, setting, Path(tmp), evaluator, base_acc, budget)
    return dict(
        spec=spec, evaluator=evaluator, gflops=gflops, fwd=fwd, n_params=n_params, tree=tree, win=win, budget=budget
    )


def _titles(base: dict, setting: dict, budget: float) -> tuple[str, str]:
    """The headings of parts (a) and (b), with the recipe's leaves and steps and the window arm's settings."""
    kw, g = base["pipeline"]["kwargs"], base["sample"]["group_size"]
    wa = WINDOW_ARMS["window (MixGRPO)"][1]
    tree_title = (
        f"### (a) Tree (BranchGRPO) vs independent rollouts, {g} leaves and {kw['num_steps']} steps each, "
        f"{setting['rounds']} counted round-robin iterations per arm after {setting['warmup']} warm-up"
    )
    window_title = (
        f"### (b) Window (MixGRPO: SDE on {wa['window_size']} of {kw['num_steps']} steps, ODE outside, same-noise "
        f"groups, moving every {wa['window_every']} iterations) and few-step (Flow-GRPO-Fast as the recipe runs it: "
        f"{kw['plan_kwargs']['sde_steps']} SDE step, branch at step {kw['plan_kwargs']['branch_range']}) vs "
        f"all-step training, {budget:.0f} training seconds per arm"
    )
    return tree_title, window_title


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    quiet_process()
    quiet()
    t_start = time.perf_counter()

    base = yaml.safe_load(RECIPE.read_text())
    setting = {
        "prompts_per_iter": 2 if args.quick else 4,
        "rounds": args.rounds or (2 if args.quick else 10),
        "warmup": 1,
        "k_chunk": 1,
        "seed": 0,
        "budget": 10.0 if args.quick else 60.0,
    }
    r = _run(base, setting, args)
    tree, budget = r["tree"], r["budget"]
    tree_md, extra = tree_section(tree, setting, r["fwd"], r["gflops"])
    window_md, wextra = window_section(r["win"])
    pngs = plots(extra["figs"], wextra["curves"])
    kw, g = base["pipeline"]["kwargs"], base["sample"]["group_size"]
    cmd = f"python bench/flow.py{' --quick' if args.quick else ''}"
    tree_title, window_title = _titles(base, setting, budget)
    md = "\n".join(
        [
            "## Flow: tree vs independent rollouts; window and few-step vs all-step training (ShapesWorld)",
            "",
            f"`{cmd}`, {now_utc()}, {time.perf_counter() - t_start:.0f} s. Machine: {machine()}.",
            "",
            setting_md(base, setting, r["n_params"], r["spec"], r["evaluator"]),
            "",
            tree_title,
            "",
            tree_md,
            "",
            window_title,
            "",
            window_md,
            "",
            "Plots: " + ", ".join(f"![{p}](plots/{p})" for p in pngs),
            "",
            "### Targets (issue 9) and what stands in the way",
            "",
            verdict(tree, extra, wextra),
        ]
    )
    path = write_section("flow", md)
    write_summary("flow", summary_rows(tree, wextra, g, kw["num_steps"], budget))
    print(md)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
