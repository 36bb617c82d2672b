"""Scaling benchmark: seconds per training iteration as G, denoising steps, prefix length and video frames grow.

Run: python bench/scaling.py [--quick]; writes bench/sections/scaling.md and bench/plots/scaling.png.
"""

import argparse
import itertools
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import yaml

from bench.common import (
    fit_slope,
    machine,
    matmul_gflops,
    md_table,
    now_utc,
    pyplot,
    quiet_process,
    save_plot,
    summarise,
    training_iteration,
    write_section,
    write_summary,
)
from bench.vlm_prefix import Case, bench_vlm, load
from bench.vlm_vs_trl import mmgrpo_arm, register_reward
from mmgrpo.config import load_config
from mmgrpo.setup import setup


def sweep(fns: dict[int, Callable[[], Any]], *, rounds: int, warmup: int = 1) -> dict[int, list[float]]:
    """Seconds per call of each point, the points run round-robin (forward, then reversed, ...) so that drift of the
    machine hits every point alike; warm-up rounds first, not counted."""
    keys = list(fns)
    times: dict[int, list[float]] = {k: [] for k in keys}
    for i in range(warmup + rounds):
        for k in keys if i % 2 == 0 else keys[::-1]:
            t0 = time.perf_counter()
            fns[k]()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return times


def loglog(times: dict[int, list[float]]) -> dict[str, Any]:
    """Medians, the least-squares slope of log(seconds) on log(x), and the slope between consecutive points."""
    xs = sorted(times)
    med = {x: summarise(times[x])["median"] for x in xs}
    pts = [(math.log(x), math.log(med[x])) for x in xs]
    local = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(pts)]
    return {
        "xs": xs,
        "median": med,
        "min": {x: min(times[x]) for x in xs},
        "max": {x: max(times[x]) for x in xs},
        "slope": fit_slope(pts),
        "local": local,
    }


def quiet_libraries() -> None:
    """Silence diffusers/transformers progress bars and loading notices in the bench output."""
    # lazy: diffusers and transformers are heavy to import; only main() needs them (to quiet their logs)
    import diffusers
    import transformers

    for lib in (diffusers, transformers):
        lib.utils.logging.set_verbosity_error()
        lib.utils.logging.disable_progress_bar()


def count_flops(fn: Callable[[], Any]) -> float:
    """FLOPs of one call as torch's FlopCounterMode counts them (matmuls, convolutions and attention, forward and
    backward; elementwise work is not counted). SDPA runs on its math backend here: torch counts nothing for the CPU
    flash kernel, and the math backend counts each call's whole query x key rectangle, masked part included."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        fn()
    return float(fc.get_total_flops())


# ---- the four axes


class Iteration:
    """One training iteration exactly as `mmgrpo.trainer.train` runs it (minus logging and checkpoints)."""

    def __init__(self, run: Any):
        self.run, self.step = run, 0

    def __call__(self) -> None:
        training_iteration(self.run, self.step)
        self.step += 1


def quiet_run(tree: dict, out_dir: Path):
    """`mmgrpo.setup.Run` of a config tree with no progress bar, report, checkpoints or logging."""
    tree["run"].update(
        {
            "output_dir": str(out_dir),
            "seed": 0,
            "steps": 10_000,
            "checkpoint_every": 0,
            "gallery_every": 0,
            "resume": "never",
            "progress": False,
            "report": False,
            "log_every": 10_000,
        }
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    return setup(load_config(out_dir / "bench.yaml"))


def axis_steps(tmp: Path, steps: list[int]) -> dict[int, Callable[[], Any]]:
    """Flow pipeline: the `make demo` recipe (shipped ShapesWorld model) with independent rollouts trained on every
    step, 1 prompt x G = 8, one full iteration per call."""
    iters = {}
    for t in steps:
        tree = yaml.safe_load((REPO / "configs/flow/shapes_t2i.yaml").read_text())
        kw = tree["pipeline"]["kwargs"]
        kw.update(
            {
                "model": str(REPO / kw["model"]),
                "num_steps": t,
                "plan": "independent",
                "plan_kwargs": {"train": "all"},
                "k_chunk": 1,
            }
        )
        tree["sample"]["batch_size"] = tree["sample"]["group_size"] = 8
        tree["algo"]["micro_batch_size"] = 8
        iters[t] = Iteration(quiet_run(tree, tmp / f"flow_{t}"))
    return iters


def axis_group(tmp: Path, groups: list[int], hidden: int, layers: int) -> dict[int, Callable[[], Any]]:
    """VLM pipeline, one prompt per iteration, G completions of at most 32 tokens; one full iteration per call."""
    model = bench_vlm(hidden, layers)
    iters = {}
    for g in groups:
        s = {"prompts": 1, "group": g, "max_new_tokens": 32, "resolution": 224, "lr": 1e-5, "prefix_sharing": "auto"}
        iters[g] = Iteration(mmgrpo_arm(tmp / f"vlm_g{g}", model, s))
    return iters


def axis_prefix(prefixes: list[int], hidden: int, layers: int) -> dict[int, Callable[[], Any]]:
    """VLM update only: prefix-shared forward+backward of G = 8 completions of 128 tokens after a P-token prompt."""
    proc, model = load(bench_vlm(hidden, layers))
    cases = {p: Case(model, proc, p) for p in prefixes}
    return {p: (lambda c=c: c.step(True)) for p, c in cases.items()}


def video_run(out_dir: Path, model: str, frames: int):
    tree = {
        "run": {},
        "pipeline": {
            "name": "video",
            "kwargs": {
                "model": model,
                "data": "shapes_video",
                "train_size": 1,
                "eval_size": 1,
                "shapes_frames": 32,
                "shapes_resolution": 224,
                "num_frames": frames,
                "min_frames": 1,
                "max_frames": 64,
                "lora_rank": 0,
                "max_new_tokens": 32,
                "stop": None,
                "reference": "none",
            },
        },
        "sample": {"batch_size": 8, "group_size": 8},
        "algo": {
            "advantage": "grpo",
            "loss": "clipped",
            "loss_kwargs": {"clip_low": 0.2, "clip_high": 0.2},
            "micro_batch_size": 8,
            "kl_coef": 0.0,
        },
        "optim": {"lr": 1e-5, "grad_clip": 1.0},
        "rewards": [{"name": register_reward(), "weight": 1.0}],
    }
    return quiet_run(tree, out_dir)


def axis_frames(tmp: Path, frames: list[int], hidden: int, layers: int) -> dict[int, Callable[[], Any]]:
    """Video pipeline (ShapesWorld video, 224 px frames), G = 8, one full iteration per call."""
    model = bench_vlm(hidden, layers)
    return {f: Iteration(video_run(tmp / f"video_f{f}", model, f)) for f in frames}


# ---- the section


EXPECT = {
    "G": (
        "linear: G completions sampled and trained; with grouped attention each completion attends to the prefix "
        "and itself, so the shared row's attention grows linearly in G too"
    ),
    "denoising steps": "linear: one transformer evaluation per step and sample, in the rollout and in the update",
    "prefix length": ("linear in the MLP and projections, quadratic in attention: the prefix attends to itself"),
    "frames": "linear in the vision tower and the projections per frame token, quadratic in attention",
}


def plot(axes: dict[str, dict[str, Any]]) -> str:
    plt = pyplot()
    fig, subs = plt.subplots(1, len(axes), figsize=(3.6 * len(axes), 3.4), squeeze=False, gridspec_kw={"wspace": 0.4})
    for ax, (name, a) in zip(subs[0], axes.items()):
        xs = a["fit"]["xs"]
        med = [a["fit"]["median"][x] for x in xs]
        err = [[m - a["fit"]["min"][x] for x, m in zip(xs, med)], [a["fit"]["max"][x] - m for x, m in zip(xs, med)]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label="measured (median, min-max)")
        k = a["fit"]["slope"]
        x0, y0 = xs[0], med[0]
        ax.plot(xs, [y0 * (x / x0) for x in xs], ":", color="grey", label="slope 1 (linear)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(plt.matplotlib.ticker.FormatStrFormatter("%.1f"))
        ax.set_xlabel(name)
        ax.set_title(f"{name}: fitted slope {k:.2f}", fontsize=10)
        ax.legend(fontsize=7)
    subs[0][0].set_ylabel("seconds per call (this machine)")
    return save_plot(fig, "scaling").name


def _rows(axes: dict[str, dict[str, Any]], gflops: float) -> list[list[Any]]:
    """One table row per axis: points, time ratios and slopes, GFLOP per call, FLOP slope, achieved rate."""
    rows = []
    for name, a in axes.items():
        f = a["fit"]
        rel = " : ".join(f"{f['median'][x] / f['median'][f['xs'][0]]:.2f}" for x in f["xs"])
        fl = a["flops"]
        gflop = " : ".join(f"{fl['median'][x] / 1e9:.1f}" for x in fl["xs"])
        achieved = " : ".join(f"{fl['median'][x] / f['median'][x] / 1e9 / gflops:.0%}" for x in f["xs"])
        rows.append(
            [
                name,
                a["what"],
                ", ".join(map(str, f["xs"])),
                rel,
                f"{f['slope']:.2f}",
                ", ".join(f"{s:.2f}" for s in f["local"]),
                gflop,
                f"{fl['slope']:.2f}",
                achieved,
                EXPECT[name],
            ]
        )
    return rows


def section(
    axes: dict[str, dict[str, Any]], failed: dict[str, str], *, cmd: str, seconds: float, model: str, gflops: float
) -> str:
    rows = _rows(axes, gflops)
    lines = [
        "## Scaling: seconds per iteration as G, denoising steps, prefix length and frames grow",
        "",
        f"`{cmd}`, {now_utc()}, {seconds:.0f} s. Machine: {machine()}.",
        "",
        (
            f"Each axis varies one quantity and keeps the rest fixed; the points of an axis run round-robin (forward, "
            f"then reversed) after a warm-up round, so the machine's drift hits them alike. The figures are ratios to "
            f"the "
            f"axis's first point and the slope of log(seconds) on log(x) (1 = linear, 2 = quadratic). VLM axes: {model}; "
            f"flow axis: the `make demo` recipe (configs/flow/shapes_t2i.yaml, the shipped 3.69 M-parameter ShapesWorld "
            f"SD3, 32 px, LoRA r16, CFG 2) with independent rollouts trained on every step, 1 prompt x G = 8."
        ),
        "",
        md_table(
            [
                "axis",
                "what one call is",
                "points",
                "seconds relative to the first point (median)",
                "fitted log-log slope",
                "slope between consecutive points",
                "GFLOP per call",
                "FLOP log-log slope",
                "achieved / matmul rate",
                "what the algorithm costs",
            ],
            rows,
        ),
        "",
        (
            f"FLOPs: one extra, untimed call per point under torch's FlopCounterMode (matmuls, convolutions and "
            f"attention on SDPA's math backend, forward and backward; elementwise work not counted). "
            f"Achieved = FLOP/s over this process's "
            f"measured fp32 matmul rate ({gflops:.1f} GFLOP/s). Where the FLOP slope is below the time slope, the time "
            f"grows faster than the counted work: the reading below checks that gap."
        ),
        "",
    ]
    if failed:
        lines += ["Not measured in this run: " + "; ".join(f"{k} ({v})" for k, v in failed.items()) + ".", ""]
    if axes:
        lines += [f"Plot: ![scaling.png](plots/{plot(axes)})", ""]
    lines += ["### Reading (issue 9: no superlinear term where the algorithm is linear)", "", verdict(axes)]
    return "\n".join(lines)


def verdict(axes: dict[str, dict[str, Any]]) -> str:
    out = []
    for name, a in axes.items():
        k, last, kf = a["fit"]["slope"], a["fit"]["local"][-1], a["flops"]["slope"]
        head = f"- {name}: fitted slope {k:.2f}, {last:.2f} over the last doubling, counted FLOPs {kf:.2f}: "
        if last <= 1.15:
            out.append(
                head + "no superlinear term over this range (below 1 where fixed per-iteration costs, such as "
                "the parts that do not grow with this axis, still weigh)."
            )
        elif max(k, last) <= kf + 0.15:
            out.append(
                head + "superlinear, but no faster than the counted work: the growth is the computation's own "
                f"(what it costs: {EXPECT[name]})."
            )
        else:
            out.append(
                head + "time grows faster than the counted work: overhead that grows with this axis, a defect "
                "to profile."
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller points: a smoke run of the script")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args(argv)
    quiet_process()
    quiet_libraries()
    t_start = time.perf_counter()
    rounds = args.rounds or (1 if args.quick else 3)
    hidden, layers = (128, 2) if args.quick else (256, 4)
    q = args.quick
    plan = {
        "G": (
            "full VLM iteration (1 prompt, <= 32 new tokens)",
            lambda tmp: axis_group(tmp, [2, 4] if q else [2, 4, 8, 16], hidden, layers),
        ),
        "denoising steps": (
            "full flow iteration (G = 8)",
            lambda tmp: axis_steps(tmp, [4, 8] if q else [4, 8, 16, 32]),
        ),
        "prefix length": (
            "VLM update: shared forward+backward, G = 8, 128-token completions",
            lambda tmp: axis_prefix([256, 512] if q else [256, 512, 1024, 2048], hidden, layers),
        ),
        "frames": (
            "full video iteration (G = 8, 224 px frames)",
            lambda tmp: axis_frames(tmp, [2, 4] if q else [2, 4, 8, 16], hidden, layers),
        ),
    }
    axes, failed = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        for name, (what, fn) in plan.items():
            try:
                fns = fn(Path(tmp))
                times = sweep(fns, rounds=rounds)
                flops = {k: [count_flops(f)] for k, f in fns.items()}  # one extra, untimed call per point
                axes[name] = {"what": what, "fit": loglog(times), "flops": loglog(flops)}
                print(f"{name}: slope {axes[name]['fit']['slope']:.2f}", flush=True)
            except Exception as err:  # noqa: BLE001 - one broken pipeline must not hide the other axes
                traceback.print_exc()
                failed[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    cmd = f"python bench/scaling.py{' --quick' if q else ''}"
    model = (
        f"the random Qwen2-VL of the prefix benchmark (text hidden {hidden}, {layers} layers, float32, SDPA, "
        f"full fine-tuning)"
    )
    md = section(axes, failed, cmd=cmd, seconds=time.perf_counter() - t_start, model=model, gflops=matmul_gflops())
    path = write_section("scaling", md)
    if axes:
        slopes = ", ".join(f"{n} {a['fit']['slope']:.2f} (FLOPs {a['flops']['slope']:.2f})" for n, a in axes.items())
        comparison = (
            "scaling: seconds per iteration as G, denoising steps, prefix length and frames grow "
            "(fitted log-log slope of time, and of counted FLOPs; 1 = linear)"
        )
        measured = slopes + (f"; failed: {', '.join(failed)}" if failed else "")
        target = "plotted with the fitted slope; no superlinear term where the algorithm is linear"
        write_summary("scaling", [(comparison, measured, target)])
    print(md)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
