"""Flow-pipeline benchmarks on ShapesWorld: BranchGRPO tree vs independent rollouts, MixGRPO window and
Flow-GRPO-Fast vs all-step training.

Every arm is `configs/flow/shapes_t2i.yaml` (the `make demo` recipe: assets/shapes-t2i, shapes_geneval partial reward,
LoRA r16, CFG 2, 8 steps) with only the rollout plan, the prompts per iteration and k_chunk changed.
Run: python bench/flow.py [--quick]; writes bench/sections/flow.md (its part of results.md) and bench/plots/flow_*.png.
"""

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import yaml

from bench.common import (
    REPO,
    fit_slope,
    fmt_ratio,
    machine,
    matmul_gflops,
    md_table,
    now_utc,
    pyplot,
    quiet_process,
    save_plot,
    summarise,
    write_section,
)

RECIPE = REPO / "configs" / "flow" / "shapes_t2i.yaml"
TARGETS = {"tree": 3.0, "window": 2.0}  # issue 9: tree >= 3x faster per iteration; window >= 2x gain per second
TREE_ARMS = {"independent": ("independent", {"train": "all"}),
             "tree": ("tree", {"fanout": 2}),
             "tree, pruned": ("tree", {"fanout": 2, "prune_depths": [3], "width_prune": "branch_best",
                                       "width_keep": 1}),
             "tree, late splits": ("tree", {"fanout": 2, "split_steps": [4, 5, 6]})}
WINDOW_ARMS = {"window (MixGRPO)": ("independent", {"train": "window", "window_size": 2, "window_every": 4}),
               "fast (Flow-GRPO-Fast, the recipe)": None}  # None: the recipe's own plan and plan_kwargs
BASE = "all steps"


# ---- the runs, one training iteration, the evaluation


def val_spec(tree: dict) -> str:
    """The recipe's eval categories on ShapesWorld's validation split (the recipe's own eval uses the test split)."""
    parts = tree["pipeline"]["kwargs"]["eval_data"].split(":")
    return ":".join(["shapes", "val", *parts[2:]])


def make_run(out_dir: Path, base: dict, *, plan: str | None, plan_kwargs: dict | None, setting: dict, seed: int):
    """A `mmgrpo.setup.Run` of the recipe `base` (no progress bar, report or checkpoints): one arm of a benchmark.

    Changed from the recipe: the plan (None keeps the recipe's), prompts per iteration, k_chunk (the same in every
    arm, so no arm pays for a bigger backward than another) and run.seed."""
    from mmgrpo.config import load_config
    from mmgrpo.setup import setup

    tree = copy.deepcopy(base)
    tree["run"].update({"output_dir": str(out_dir), "seed": seed, "checkpoint_every": 0, "gallery_every": 0,
                        "resume": "never", "progress": False, "report": False, "log_every": 10**6})
    kw = tree["pipeline"]["kwargs"]
    if plan is not None:
        kw.update({"plan": plan, "plan_kwargs": plan_kwargs})
    kw["k_chunk"] = setting["k_chunk"]
    tree["sample"]["batch_size"] = setting["prompts_per_iter"] * tree["sample"]["group_size"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    return setup(load_config(out_dir / "bench.yaml"))


class Counter:
    """Rows (latents) through the transformer, split into no-grad (rollout) and grad (training) calls; CFG's two
    passes count as two rows."""

    def __init__(self, module: torch.nn.Module):
        self.rollout = self.train = 0
        module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        if torch.is_grad_enabled():
            self.train += int(x.shape[0])
        else:
            self.rollout += int(x.shape[0])

    def take(self) -> tuple[int, int]:
        out, self.rollout, self.train = (self.rollout, self.train), 0, 0
        return out


class Arm:
    """One side of a comparison: its Run, iteration count, training seconds spent and evaluation curve."""

    def __init__(self, name: str, run: Any):
        self.name, self.run, self.step, self.spent = name, run, 0, 0.0
        self.counter = Counter(run.policy.transformer)
        self.curve: list[tuple[float, int, dict[str, float]]] = []  # (seconds spent, iterations, accuracies)
        self.plan = None

    def iterate(self) -> dict[str, float]:
        """One training iteration exactly as `mmgrpo.trainer.train` runs it (minus logging and checkpoints)."""
        from mmgrpo.collect import collect
        from mmgrpo.trainer import compute_advantages, update

        run = self.run
        self.counter.take()  # drop rows counted by evaluations since the last iteration
        t0 = time.perf_counter()
        run.policy.set_iteration(self.step)
        batch = collect(run, self.step)
        t1 = time.perf_counter()
        adv, use, _ = compute_advantages(run, batch, progress=0.0)
        update(run, batch, adv, use, self.step)
        run.scheduler.step()
        t2 = time.perf_counter()
        self.step += 1
        self.spent += t2 - t0
        self.plan = run.policy.last_plan
        rows = self.counter.take()
        return {"seconds": t2 - t0, "rollout_s": t1 - t0, "update_s": t2 - t1, "rollout_rows": rows[0],
                "train_rows": rows[1], "trained": int(batch.rollout.mask.sum())}

    def evaluate(self, evaluator: "Evaluator") -> dict[str, float]:
        acc = evaluator(self.run)
        self.curve.append((self.spent, self.step, acc))
        return acc


class Evaluator:
    """Strict and partial verifier accuracy of ODE samples (noise 0, independent noises, as pipelines.flow.compare)
    on fixed validation prompts with fixed per-prompt seeds: the same images for every arm at every time."""

    def __init__(self, records: list[dict], per_prompt: int, seed: int = 1234, chunk: int = 4):
        self.records, self.per_prompt, self.chunk = records, per_prompt, chunk
        self.seeds = [seed + i for i in range(len(records))]
        self.seconds: list[float] = []

    @torch.no_grad()
    def __call__(self, run: Any) -> dict[str, float]:
        from mmgrpo.collect import reward_fields

        t0, pol = time.perf_counter(), run.policy
        saved = (pol.noise_level, pol.plan_name, pol.plan_kwargs, pol.iteration, pol.last_plan)
        pol.noise_level, pol.plan_name, pol.plan_kwargs = 0.0, "independent", {"train": "all"}
        scores = []
        try:
            for lo in range(0, len(self.records), self.chunk):
                recs = self.records[lo: lo + self.chunk]
                ro = pol.rollout(recs, self.per_prompt, self.seeds[lo: lo + self.chunk])
                texts, fields = reward_fields(recs, self.per_prompt)
                per_reward, _ = run.reward_set(ro.samples, texts, group_size=self.per_prompt, **fields)
                scores.append(per_reward.double())  # [n_chunk, R]
        finally:
            pol.noise_level, pol.plan_name, pol.plan_kwargs, pol.iteration, pol.last_plan = saved
        self.seconds.append(time.perf_counter() - t0)
        scores = torch.cat(scores)  # [n, R]
        out: dict[str, Any] = {name: float(scores[:, r].mean()) for r, name in enumerate(run.reward_set.names)}
        out["per_image"] = {name: scores[:, r] for r, name in enumerate(run.reward_set.names)}
        return out


def forward_flops(run: Any) -> float:
    """FLOPs of one transformer evaluation (one latent, no CFG) at the recipe's resolution and prompt length."""
    from torch.utils.flop_counter import FlopCounterMode

    pol = run.policy
    cond = pol.model.encode(["a red circle"])
    x = torch.zeros(1, *pol.model.latent_shape())
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        pol.model.forward(pol.transformer, x, torch.tensor([0.5]), cond)
    return float(fc.get_total_flops())


def quiet() -> None:
    """Silence diffusers/transformers progress bars and loading notices in the bench output."""
    import diffusers
    import transformers

    for lib in (diffusers, transformers):
        lib.utils.logging.set_verbosity_error()
        lib.utils.logging.disable_progress_bar()


def median(xs: list[float]) -> float:
    return summarise(xs)["median"]


# ---- (a) tree vs independent rollouts at equal leaves and steps; (b) window and fast vs all steps


def bench_tree(base: dict, setting: dict, tmp: Path, evaluator: Evaluator, base_acc: dict) -> dict:
    """Round-robin training iterations of every arm (order reversed every round, so drift hits all alike); the
    per-round ratio is independent's seconds over the arm's. The independent arm is also (b)'s all-step arm."""
    arms = {n: Arm(n, make_run(tmp / f"a{i}", base, plan=p, plan_kwargs=k, setting=setting, seed=setting["seed"]))
            for i, (n, (p, k)) in enumerate(TREE_ARMS.items())}
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
        if i == total // 2 - 1:
            arms["independent"].evaluate(evaluator)  # a mid point of (b)'s all-step curve
    for a in arms.values():
        a.evaluate(evaluator)
    ind = [o["seconds"] for o in outs["independent"]]
    pairs = {n: summarise([a / o["seconds"] for a, o in zip(ind, outs[n])]) for n in list(arms)[1:]}
    return {"arms": arms, "outs": outs, "pairs": pairs}


def bench_window(base: dict, setting: dict, tmp: Path, evaluator: Evaluator, base_acc: dict, budget: float) -> dict:
    """Fresh window and fast arms, interleaved (always the one with the least training time next) until each spent
    `budget` seconds, evaluated at half and full budget; gain per second = slope of accuracy on training seconds."""
    arms = {}
    for i, (n, spec) in enumerate(WINDOW_ARMS.items()):
        plan, kw = spec if spec is not None else (None, None)
        arms[n] = Arm(n, make_run(tmp / f"b{i}", base, plan=plan, plan_kwargs=kw, setting=setting,
                                  seed=setting["seed"]))
        arms[n].curve.append((0.0, 0, base_acc))
    iter_s: dict[str, list[float]] = {n: [] for n in arms}
    roll_s: dict[str, list[float]] = {n: [] for n in arms}
    marks = {n: budget / 2 for n in arms}
    while min(a.spent for a in arms.values()) < budget:
        n = min(arms, key=lambda m: arms[m].spent)
        out = arms[n].iterate()
        iter_s[n].append(out["seconds"])
        roll_s[n].append(out["rollout_s"])
        if arms[n].spent >= marks[n]:
            arms[n].evaluate(evaluator)
            marks[n] += budget / 2
            print(f"(b) {n}: {arms[n].step} iterations, {arms[n].spent:.0f} s", flush=True)
    return {"arms": arms, "iter_s": iter_s, "roll_s": roll_s}


# ---- the report


def unique_transitions(plan, trained_steps: list[int], prompts: int) -> int:
    """Distinct (node, step) transitions a tree trains: shared prefixes counted once, as BranchGRPO's update would."""
    alive, total = prompts * plan.roots, 0
    for t in range(plan.num_steps):
        alive *= plan.branches.get(t, 1)
        total += alive if t in trained_steps else 0
    return total


def gain(curve: list, metric: str, per: str) -> float:
    """Accuracy gain per iteration (end minus start over iterations) or per training second (least-squares slope)."""
    if per == "iteration":
        return (curve[-1][2][metric] - curve[0][2][metric]) / max(1, curve[-1][1])
    return fit_slope([(s, acc[metric]) for s, _, acc in curve])


def delta(curve: list, metric: str) -> tuple[float, float]:
    """End minus start of a curve in points and the standard error of the mean paired per-image difference (same
    prompts and noises at both ends, so only the weights differ)."""
    d = 100 * (curve[-1][2]["per_image"][metric] - curve[0][2]["per_image"][metric])  # [n]
    return float(d.mean()), float(d.std(unbiased=True)) / len(d) ** 0.5 if len(d) > 1 else float("nan")


def change(curve: list, metric: str) -> str:
    return "{:+.1f} +- {:.1f}".format(*delta(curve, metric))


def ends(curve: list, metric: str) -> str:
    return f"{curve[0][2][metric]:.3f} -> {curve[-1][2][metric]:.3f} ({change(curve, metric)})"


def _ratio(b: float, a: float, unit: float = 1.0) -> str:
    if a <= 0:
        return f"n/a (A's gain {a * unit:+.4f} <= 0; B's {b * unit:+.4f})"
    return f"{b / a:.2f} ({b * unit:+.4f} vs {a * unit:+.4f})"


def tree_section(res: dict, setting: dict, fwd: float, gflops: float) -> tuple[str, dict]:
    from pipelines.flow.plan import count_nfe, depth_of_steps

    rows, figs, arms = [], {}, res["arms"]
    for n, outs in res["outs"].items():
        roll, train = median([o["rollout_rows"] for o in outs]), median([o["train_rows"] for o in outs])
        sec = median([o["seconds"] for o in outs])
        flops = fwd * (roll + 3 * train)  # a backward costs about two forwards
        figs[n] = {"roll": roll, "train": train, "sec": sec, "rollout_s": median([o["rollout_s"] for o in outs]),
                   "update_s": median([o["update_s"] for o in outs]), "trained": median([o["trained"] for o in outs])}
        rows.append([n, int(roll), int(train), int(figs[n]["trained"]),
                     f"{figs[n]['rollout_s']:.2f} + {figs[n]['update_s']:.2f}", f"{flops / 1e9:.1f}",
                     f"{flops / sec / 1e9 / gflops:.0%}"])
    ind = figs["independent"]
    g_ind = {m: gain(arms["independent"].curve, m, "iteration") for m in ("partial", "strict")}
    table = []
    for n, p in res["pairs"].items():
        g = {m: gain(arms[n].curve, m, "iteration") for m in ("partial", "strict")}
        table.append([n, (f"{(ind['roll'] + ind['train']) / (figs[n]['roll'] + figs[n]['train']):.2f}x "
                          f"(rollout only {ind['roll'] / figs[n]['roll']:.2f}x)"), fmt_ratio(p),
                      f">= {TARGETS['tree']:.0f}x" if n == "tree" else "(variant)",
                      _ratio(g["partial"], g_ind["partial"], 100), _ratio(g["strict"], g_ind["strict"], 100)])
    plan, late = arms["tree"].plan, arms["tree, late splits"].plan
    depth = depth_of_steps(plan).tolist()
    every = list(range(plan.num_steps))
    uniq = unique_transitions(plan, every, setting["prompts_per_iter"])
    uniq_late = unique_transitions(late, every, setting["prompts_per_iter"])
    tr, n_ind = figs["tree"], ind["trained"]
    proj = tr["rollout_s"] + tr["update_s"] * uniq / tr["trained"]
    credit = (f"Each distinct transition is trained once ({int(tr['trained'])} trained = the tree's {uniq} distinct "
              f"ones)" if tr["trained"] <= uniq else
              f"The engine trained {int(tr['trained'])} transitions where the tree has {uniq} distinct ones (a "
              f"shared transition once per leaf below it); training each once would bring the tree to about "
              f"{ind['sec'] / proj:.1f}x (projection)")
    iters = arms["independent"].step
    lines = [md_table(["comparison (B over A = independent)", "network evaluations per iteration, A / B",
                       "seconds per iteration, A / B (measured)", "target",
                       f"partial-accuracy gain per iteration, B / A ({iters} iterations, points)",
                       "strict-accuracy gain per iteration, B / A (points)"], table), "",
             (f"Raw data (medians; seconds are this machine's, not the code's): evaluations are latents through the "
              f"transformer, CFG's two passes counted (rollout = no grad, train = with grad); trained = unmasked "
              f"(sample, step) transitions in the loss; FLOPs = forward FLOPs per latent ({fwd / 1e6:.1f} MFLOP, "
              f"torch FlopCounter) x (rollout + 3 x train); achieved = FLOP/s over this process's measured fp32 "
              f"matmul rate ({gflops:.1f} GFLOP/s)."), "",
             md_table(["arm", "rollout evaluations", "train evaluations", "trained transitions",
                       "seconds: rollout + update", "GFLOP per iteration", "achieved / matmul rate"], rows), "",
             md_table(["arm", "partial accuracy: start -> end (change, points +- s.e.)", "strict accuracy"],
                      [[n, ends(a.curve, "partial"), ends(a.curve, "strict")] for n, a in arms.items()]), "",
             (f"Tree: splits at steps {sorted(plan.branches)} (fan-out 2, {plan.group_size} leaves, depths "
              f"{depth}); pruned = BranchGRPO's width pruning (branch_best, 1 leaf of each sibling pair "
              f"back-propagated) plus depth pruning (depth 3, steps {[t for t in range(len(depth)) if depth[t] == 3]}"
              f", not trained); rollouts unchanged; late splits = splits at {sorted(late.branches)}. {credit}. At "
              f"equal leaves and steps the tree has {uniq} distinct transitions against independent's {int(n_ind)}, "
              f"so its trained transitions can shrink at most {n_ind / uniq:.2f}x (its rollout evaluations "
              f"{n_ind / count_nfe(plan, setting['prompts_per_iter']):.2f}x: siblings share the call at a split); "
              f"the late-split tree has {uniq_late} ({n_ind / uniq_late:.2f}x), but its leaves share the first "
              f"{min(late.branches)} of the {late.num_steps} steps, so a group's samples differ only in the last "
              f"{late.num_steps - min(late.branches)}.")]
    b = setting["prompts_per_iter"]
    bound = {"tree": n_ind / uniq, "late": n_ind / uniq_late, "roll": n_ind / count_nfe(plan, b),
             "roll_late": n_ind / count_nfe(late, b)}
    return "\n".join(lines), {"figs": figs, "bound": bound}


def window_section(tree: dict, win: dict) -> tuple[str, dict]:
    a = tree["arms"]["independent"]
    base_iter = [o["seconds"] for o in tree["outs"]["independent"]]
    curves = {BASE: a.curve, **{n: w.curve for n, w in win["arms"].items()}}
    slopes = {n: {m: gain(c, m, "second") for m in ("partial", "strict")} for n, c in curves.items()}
    rows = []
    for n in win["arms"]:
        speed = median(base_iter) / median(win["iter_s"][n])
        rows.append([n, _ratio(slopes[n]["partial"], slopes[BASE]["partial"], 6000),
                     _ratio(slopes[n]["strict"], slopes[BASE]["strict"], 6000), f"{speed:.2f}x",
                     f">= {TARGETS['window']:.0f}x" if n.startswith("window") else "(variant)"])
    trail = lambda c, m: " -> ".join(f"{acc[m]:.3f}" for _, _, acc in c)
    raw = [[n, c[-1][1], f"{c[-1][0]:.0f}", f"{trail(c, 'partial')} ({change(c, 'partial')})",
            f"{trail(c, 'strict')} ({change(c, 'strict')})"] for n, c in curves.items()]
    md = "\n".join([
        md_table(["comparison (B over A = all steps)",
                  "partial-accuracy gain per training second, B / A (points per minute)",
                  "strict-accuracy gain per training second, B / A (points per minute)",
                  "iterations per second, B / A (median iteration)", "target"], rows), "",
        md_table(["arm", "iterations", "training seconds",
                  "partial accuracy at 0, 1/2, 1 of the budget (change, points +- s.e.)", "strict accuracy"], raw), "",
        ("The all-step arm is (a)'s independent arm (same settings and seed; its training seconds, warm-up "
         "included, set the budget of the others). Gain per second = least-squares slope of accuracy on the arm's "
         "own training seconds (evaluation excluded).")])
    return md, {"curves": curves, "slopes": slopes}


def plots(figs: dict, curves: dict) -> list[str]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(figs)
    ax.barh(names, [figs[n]["rollout_s"] for n in names], label="rollout + reward")
    ax.barh(names, [figs[n]["update_s"] for n in names], left=[figs[n]["rollout_s"] for n in names], label="update")
    for i, n in enumerate(names):
        ax.text(figs[n]["sec"], i, f"  {int(figs[n]['roll'])}+{int(figs[n]['train'])} evals", va="center")
    ax.set_xlabel("seconds per training iteration (median, this machine)")
    ax.set_title("Flow (ShapesWorld): tree vs independent, equal leaves and steps")
    ax.set_xlim(0, 1.45 * max(figs[n]["sec"] for n in names))
    ax.legend(loc="upper right")
    paths = [save_plot(fig, "flow_tree")]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for j, (n, c) in enumerate(curves.items()):
        for metric, style in (("partial", "-"), ("strict", ":")):
            ax.plot([p[0] for p in c], [p[2][metric] for p in c], f"C{j}{style}", marker="o",
                    label=f"{n}, {metric}")
    ax.set_xlabel("training seconds spent by the arm")
    ax.set_ylabel("validation accuracy (ODE, fixed noises)")
    ax.set_title("Flow (ShapesWorld): accuracy vs training time")
    ax.legend(fontsize=7)
    paths.append(save_plot(fig, "flow_window"))
    return [p.name for p in paths]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts, iterations and eval images: a smoke run")
    ap.add_argument("--rounds", type=int, default=None, help="counted round-robin iterations per arm in part (a)")
    ap.add_argument("--budget", type=float, default=None,
                    help="training seconds per arm in part (b) (default: what (a)'s independent arm spent)")
    args = ap.parse_args(argv)
    quiet_process()
    quiet()
    t_start = time.perf_counter()
    from pipelines.flow.build import shapes_prompts

    base = yaml.safe_load(RECIPE.read_text())
    setting = {"prompts_per_iter": 2 if args.quick else 4, "rounds": args.rounds or (2 if args.quick else 10),
               "warmup": 1, "k_chunk": 1, "seed": 0}
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
        budget = args.budget or tree["arms"]["independent"].spent
        win = bench_window(base, setting, Path(tmp), evaluator, base_acc, budget)
    tree_md, extra = tree_section(tree, setting, fwd, gflops)
    window_md, wextra = window_section(tree, win)
    pngs = plots(extra["figs"], wextra["curves"])
    kw, g = base["pipeline"]["kwargs"], base["sample"]["group_size"]
    cmd = f"python bench/flow.py{' --quick' if args.quick else ''}"
    setting_md = (
        f"Setting: every arm is `configs/flow/shapes_t2i.yaml` (the `make demo` recipe) with only the rollout plan "
        f"changed: the shipped ShapesWorld text-to-image model (assets/shapes-t2i, SD3 transformer in pixel space, "
        f"{n_params['transformer'] / 1e6:.2f} M parameters, LoRA r{kw['lora_rank']} = "
        f"{n_params['trainable'] / 1e6:.2f} M trained, AdamW lr {base['optim']['lr']} {base['optim']['schedule']} "
        f"over the recipe's {base['run']['steps']} steps), {kw['resolution']} px, {kw['num_steps']} denoising "
        f"steps, CFG {kw['guidance_scale']} in rollout and training, {kw['sde']} SDE (noise {kw['noise_level']}), "
        f"{g} samples per prompt, prompts from ShapesWorld's train split "
        f"({kw['data'].split(':')[2].replace(',', ', ')}), reward = shapes_geneval partial credit (strict logged), "
        f"GRPO advantages, clipped loss, one update per rollout, no KL. Changed from the recipe to fit the budget: "
        f"{setting['prompts_per_iter']} prompts per iteration (the recipe has {base['sample']['batch_size'] // g}), "
        f"k_chunk {setting['k_chunk']} in every arm (one trained step per backward: with k_chunk null the all-step "
        f"arm's 8-step backward ran about 2x slower per transition on this CPU, which would flatter the others), "
        f"seed {setting['seed']}. Evaluation: {len(records)} prompts of `{spec}` (never trained on) x {per_prompt} "
        f"fixed seeds = {len(records) * per_prompt} images, ODE sampling, strict and partial verifier accuracy "
        f"(about {median(evaluator.seconds):.0f} s per evaluation, excluded from every timing).")
    wa = WINDOW_ARMS["window (MixGRPO)"][1]
    window_title = (
        f"### (b) Window (MixGRPO: SDE on {wa['window_size']} of {kw['num_steps']} steps, ODE outside, moving every "
        f"{wa['window_every']} iterations) and few-step (Flow-GRPO-Fast as the recipe runs it: "
        f"{kw['plan_kwargs']['sde_steps']} SDE step, branch at step {kw['plan_kwargs']['branch_range']}) vs "
        f"all-step training, {budget:.0f} training seconds per arm")
    md = "\n".join([
        "## Flow: tree vs independent rollouts; window and few-step vs all-step training (ShapesWorld)", "",
        f"`{cmd}`, {now_utc()}, {time.perf_counter() - t_start:.0f} s. Machine: {machine()}.", "",
        setting_md, "",
        (f"### (a) Tree (BranchGRPO) vs independent rollouts, {g} leaves and {kw['num_steps']} steps each, "
         f"{setting['rounds']} counted round-robin iterations per arm after {setting['warmup']} warm-up"), "",
        tree_md, "", window_title, "", window_md, "",
        "Plots: " + ", ".join(f"![{p}](plots/{p})" for p in pngs), "",
        "### Targets (issue 9) and what stands in the way", "",
        _verdict(tree, extra, wextra, win),
    ])
    path = write_section("flow", md)
    print(md)
    print(f"\nwrote {path}")


def _verdict(tree: dict, extra: dict, wextra: dict, win: dict) -> str:
    t, tp, lt = tree["pairs"]["tree"], tree["pairs"]["tree, pruned"], tree["pairs"]["tree, late splits"]
    figs = extra["figs"]
    ind, tr = figs["independent"], figs["tree"]
    w = "window (MixGRPO)"
    sl = wextra["slopes"]
    a, b = sl[BASE]["partial"], sl[w]["partial"]
    if a > 0:
        w_line = f"measured {b / a:.2f}x ({'met' if b / a >= TARGETS['window'] else 'missed'}, partial accuracy)"
    else:
        w_line = (f"not measurable as a ratio: the all-step arm's partial accuracy moved {a * 6000:+.2f} points per "
                  f"minute (<= 0) against the window's {b * 6000:+.2f}")
    speed = median([o["seconds"] for o in tree["outs"]["independent"]]) / median(win["iter_s"][w])
    z = lambda d, se: abs(d) / se if se > 0 else (0.0 if d == 0 else float("inf"))
    zmax = lambda curves: max(z(*delta(c, m)) for c in curves for m in ("partial", "strict"))
    z_a, z_b = zmax([arm.curve for arm in tree["arms"].values()]), zmax(wextra["curves"].values())
    stable = lambda z: f"{z:.1f} standard errors" + ("; so the ratios are not yet stable figures" if z < 2 else "")
    return "\n".join([
        (f"- Tree >= 3x faster per iteration at equal leaves and steps: measured {t['median']:.2f}x "
         f"({'met' if t['median'] >= TARGETS['tree'] else 'missed'}; min {t['min']:.2f}, max {t['max']:.2f}); with "
         f"width and depth pruning {tp['median']:.2f}x. The rollout saving is real ({ind['roll'] / tr['roll']:.2f}x "
         f"fewer rollout evaluations; update {tr['update_s']:.1f} s against independent's {ind['update_s']:.1f} s, "
         f"{int(tr['trained'])} trained transitions against {int(ind['trained'])}). With splits at "
         f"{sorted(tree['arms']['tree'].plan.branches)} the tree has only {extra['bound']['tree']:.2f}x fewer "
         f"distinct transitions than independent rollouts and {extra['bound']['roll']:.2f}x fewer rollout "
         f"evaluations, which cap the counted work's saving at "
         f"{max(extra['bound']['tree'], extra['bound']['roll']):.2f}x whatever the engine does; 3x at equal leaves "
         f"and steps needs fewer distinct transitions (late splits: {lt['median']:.2f}x measured, bounds "
         f"{extra['bound']['late']:.2f}x trained and {extra['bound']['roll_late']:.2f}x rollout) or pruning (fewer "
         f"backward passes). "
         f"Gain per iteration: the largest accuracy change in (a) is {stable(z_a)}."),
        (f"- Window >= 2x reward gain per second: {w_line}. Window iterations are {speed:.2f}x faster: only the "
         f"window's {WINDOW_ARMS[w][1]['window_size']} steps are back-propagated, but the rollout still evaluates "
         f"every step ({median(win['roll_s'][w]):.1f} of its {median(win['iter_s'][w]):.1f} s per iteration; "
         f"MixGRPO-Flash's higher-order ODE solver outside the window is not implemented), so 2x per second needs "
         f"a gain per iteration at least {TARGETS['window'] / speed:.2f}x all-step's. One seed and a short budget: "
         f"the largest accuracy change in (b) is {stable(z_b)}."),
    ])


if __name__ == "__main__":
    main()
