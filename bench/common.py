"""The benchmark harness: side-by-side ratios (alternating A and B), the machine's description, results.md sections.

Every figure a bench script reports is a ratio of two things measured in the same run; absolute times stay raw data.
"""

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmgrpo.trainer import train_step

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
SECTIONS_DIR = BENCH_DIR / "sections"
PLOTS_DIR = BENCH_DIR / "plots"
RESULTS = BENCH_DIR / "results.md"
ORDER = (
    "flow",
    "flow_window_long",
    "flow_window_long_constant_lr",
    "flow_nft_long",
    "flow_efficiency",
    "vlm_prefix",
    "vlm_vs_trl",
    "vlm",
    "video",
    "video_cache",
    "scaling",
)
"""Sections that come first in results.md, in this order; any other section follows alphabetically."""


# ---- measuring


def measure_pair(
    fn_a: Callable[[], Any],
    fn_b: Callable[[], Any],
    *,
    repeats: int = 5,
    warmup: int = 1,
    ratio: str = "a/b",
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Time A and B alternately and summarise the per-pair ratio.

    Pairs run A,B then B,A then A,B ... so slow drift of the machine (other jobs, thermal) hits both sides equally.
    Warm-up pairs run first (same alternation) and are not counted.
    Formula: ratio_i = t_a[i] / t_b[i] ("a/b": how many times faster B is) or t_b[i] / t_a[i] ("b/a").
    Args:
        fn_a, fn_b: zero-argument callables; their return values are kept in "out_a" / "out_b".
        repeats: counted pairs (>= 1). warmup: uncounted pairs first (>= 0).
        ratio: "a/b" or "b/a".
        clock: seconds counter (injectable for tests).
    Returns:
        dict with median, min, max (of the ratios), ratios [repeats], times_a, times_b [repeats], order (the
        sequence of "a"/"b" calls, warm-up included), out_a, out_b [repeats], repeats, warmup, ratio.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0; e.g. repeats=5, warmup=1")
    if ratio not in ("a/b", "b/a"):
        raise ValueError(f"ratio={ratio!r} must be 'a/b' (B's speed-up over A) or 'b/a'")
    fns = {"a": fn_a, "b": fn_b}
    order: list[str] = []
    times: dict[str, list[float]] = {"a": [], "b": []}
    outs: dict[str, list[Any]] = {"a": [], "b": []}
    for i in range(warmup + repeats):
        for side in ("a", "b") if i % 2 == 0 else ("b", "a"):
            t0 = clock()
            out = fns[side]()
            dt = clock() - t0
            order.append(side)
            if i >= warmup:
                times[side].append(dt)
                outs[side].append(out)
    num, den = (times["a"], times["b"]) if ratio == "a/b" else (times["b"], times["a"])
    ratios = [n / d if d > 0 else float("inf") for n, d in zip(num, den)]
    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "ratios": ratios,
        "times_a": times["a"],
        "times_b": times["b"],
        "order": order,
        "out_a": outs["a"],
        "out_b": outs["b"],
        "repeats": repeats,
        "warmup": warmup,
        "ratio": ratio,
    }


def training_iteration(run: Any, step: int) -> tuple[Any, float, float]:
    """One training iteration of a `mmgrpo.setup.Run`: `mmgrpo.trainer.train_step`, the very call the training loop
    makes (minus logging and checkpoints). Returns (the collected batch, rollout seconds, update seconds), the
    update's being the advantages and the optimizer steps."""
    t0 = time.perf_counter()
    batch, metrics, _ = train_step(run, step)
    total = time.perf_counter() - t0
    upd = metrics.get("time/advantages", 0.0) + metrics.get("time/update", 0.0)
    return batch, total - upd, upd


def summarise(values: list[float]) -> dict[str, float]:
    """median, min and max of a non-empty list (for ratios measured some other way than measure_pair)."""
    if not values:
        raise ValueError("summarise needs at least one value")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fit_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x over (x, y) points; 0 when every x is the same.

    Formula: sum((x - mean x)(y - mean y)) / sum((x - mean x)^2).
    """
    if not points:
        raise ValueError("fit_slope needs at least one (x, y) point")
    xs, ys = [float(p[0]) for p in points], [float(p[1]) for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0


def fmt_ratio(r: dict[str, Any], digits: int = 2) -> str:
    """ "2.31x (min 2.10, max 2.52, n=5)" from a measure_pair / summarise result."""
    n = r.get("n", r.get("repeats", len(r.get("ratios", []))))
    f = f"{{:.{digits}f}}"
    return f"{f.format(r['median'])}x (min {f.format(r['min'])}, max {f.format(r['max'])}, n={n})"


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


# ---- the machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line: CPU model, cores usable/total, load average, torch version and threads, GPU if any, Python."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu_model()}, {usable}/{os.cpu_count()} cores usable, load average {load} (1/5/15 min), "
        f"torch {torch.__version__} with {torch.get_num_threads()} thread(s), {gpu}, "
        f"Python {platform.python_version()}"
    )


def matmul_gflops(n: int = 512, repeats: int = 5) -> float:
    """This process's measured fp32 matrix-multiply rate in GFLOP/s (best of `repeats`), for achieved fractions."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        )
        # the run's own outputs (sections, plots, results.md, the docs' table) do not make the code dirty
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!bench/sections",
                ":!bench/plots",
                ":!bench/results.md",
                ":!docs/performance.md",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "") if out.returncode == 0 else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ---- results.md


def write_section(name: str, markdown: str, *, sections_dir: Path | None = None) -> Path:
    """Store one script's section (markdown, starting with its own `## ` title) for results.md; returns its path."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"section name {name!r} must be a plain file stem such as 'flow'")
    d = Path(sections_dir) if sections_dir is not None else SECTIONS_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.md"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # own name: seeds may race in parallel processes
    tmp.write_text(markdown.rstrip() + "\n")
    os.replace(tmp, path)
    return path


def write_summary(name: str, rows: list[tuple[str, str, str]], *, sections_dir: Path | None = None) -> Path:
    """Store one script's rows of the performance table (results.md's summary and docs/performance.md's copy of it).

    rows: (comparison, measured, target) strings, e.g. ("VLM: prefix-shared vs plain ...", "3.06x faster", ">= 4x").
    """
    if not rows or any(len(r) != 3 for r in rows):
        raise ValueError(f"summary rows for {name!r} must be non-empty (comparison, measured, target) triples")
    d = Path(sections_dir) if sections_dir is not None else SECTIONS_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.summary.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps([list(map(str, r)) for r in rows], indent=1) + "\n")
    os.replace(tmp, path)
    return path


def summary_table(*, sections_dir: Path | None = None, order: tuple[str, ...] = ORDER) -> str:
    """The performance table: every stored summary's rows, sections in results.md's order ("" when none)."""
    d = Path(sections_dir) if sections_dir is not None else SECTIONS_DIR
    files = {p.name[: -len(".summary.json")]: p for p in d.glob("*.summary.json")} if d.is_dir() else {}
    rows = [row for n in section_order(list(files), order) for row in json.loads(files[n].read_text())]
    return md_table(["comparison", "measured (median of alternating repeats)", "issue 9 target"], rows) if rows else ""


README_START, README_END = "<!-- bench:summary:start -->", "<!-- bench:summary:end -->"


def update_readme(table: str, readme: Path | None = None) -> bool:
    """Replace the table between the bench:summary markers (docs/performance.md) with `table`; False without them."""
    path = Path(readme) if readme is not None else REPO / "docs" / "performance.md"
    text = path.read_text()
    i, j = text.find(README_START), text.find(README_END)
    if i < 0 or j < i:
        return False
    new = text[: i + len(README_START)] + "\n" + table.strip() + "\n" + text[j:]
    if new != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # own name: seeds may race in parallel processes
        tmp.write_text(new)
        os.replace(tmp, path)
    return True


def section_order(names: list[str], order: tuple[str, ...] = ORDER) -> list[str]:
    """Known sections in `order`, then the others alphabetically."""
    known = [n for n in order if n in names]
    return known + sorted(n for n in names if n not in order)


def assemble_results(
    *, header: str, sections_dir: Path | None = None, out: Path | None = None, order: tuple[str, ...] = ORDER
) -> str:
    """results.md = header + every stored section in a stable order; written to `out` (default bench/results.md)."""
    d = Path(sections_dir) if sections_dir is not None else SECTIONS_DIR
    names = [p.stem for p in d.glob("*.md")] if d.is_dir() else []
    table = summary_table(sections_dir=d, order=order)
    tail = "Details, raw data and what stands in the way of each missed target follow."
    summary = [f"## Summary\n\n{table}\n\n{tail}"] if table else []
    parts = [header.rstrip()] + summary + [(d / f"{n}.md").read_text().rstrip() for n in section_order(names, order)]
    text = "\n\n".join(parts) + "\n"
    target = Path(out) if out is not None else RESULTS
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return text


def results_header(machine_line: str, when: str, commit: str) -> str:
    return (
        f"# Benchmark results\n\nGenerated by `make bench` (`python bench/run_all.py`) on {when}, "
        f"commit {commit}.\n"
        f"Machine: {machine_line} (each section states the threads it used).\n\n"
        "Every figure is a ratio of two variants measured side by side in the same run (alternating A and B, "
        "the median over repeats quoted, min and max shown). Absolute seconds depend on this machine and on "
        "what else runs on it, so they are given only as raw data. Re-run on your machine with `make bench`."
    )


# ---- plots


def save_plot(fig: Any, name: str) -> Path:
    """Save a matplotlib figure as bench/plots/<name>.png (and close it); returns the path."""
    # lazy: matplotlib is heavy to import (~0.6 s); only the plots need it
    import matplotlib.pyplot as plt

    PLOTS_DIR.mkdir(parents=True, exist_ok=True)
    path = PLOTS_DIR / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    # lazy: matplotlib is heavy to import (~0.6 s); only the plots need it
    import matplotlib

    matplotlib.use("Agg")
    # lazy: pyplot after matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def quiet_process(threads: int = 1, niceness: int = 10) -> None:
    """What every benchmark script does first: few threads (the machine is shared, and ratios are steadier) and a
    low priority, so a run disturbs other work less than other work disturbs it."""
    torch.set_num_threads(threads)
    if hasattr(os, "nice") and os.nice(0) < niceness:
        os.nice(niceness - os.nice(0))
