"""Run every benchmark script in bench/ (each in its own niced subprocess, with a timeout) and write bench/results.md.

Run: python bench/run_all.py [--only flow vlm] [--timeout 900] [--assemble]; `make bench` calls it with no arguments.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    BENCH_DIR,
    REPO,
    assemble_results,
    git_commit,
    machine,
    now_utc,
    results_header,
    summary_table,
    update_readme,
    write_section,
)

SKIP = {"common", "run_all"}


def discover(bench_dir: Path = BENCH_DIR) -> list[str]:
    """Benchmark names: bench/<name>.py except the harness files and names starting with an underscore."""
    return sorted(p.stem for p in bench_dir.glob("*.py") if p.stem not in SKIP and not p.stem.startswith("_"))


def failure_section(name: str, why: str, tail: str) -> str:
    """The section written in place of a script's own when it fails or times out."""
    body = "\n".join(tail.strip().splitlines()[-15:])
    return (
        f"## {name}: no result\n\n`python bench/{name}.py` {why} ({now_utc()}); its section is missing from "
        f"this run. Last lines of its output:\n\n```\n{body}\n```"
    )


def run_one(name: str, timeout: float, nice: int = 10) -> tuple[bool, float]:
    """Run bench/<name>.py in a subprocess (niced, offline); on failure write a section saying so."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [sys.executable, str(BENCH_DIR / f"{name}.py")]
    if nice and hasattr(os, "nice"):
        cmd = ["nice", "-n", str(nice), *cmd]
    t0 = time.perf_counter()
    print(f"== bench/{name}.py (timeout {timeout:.0f} s)", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        write_section(name, failure_section(name, f"timed out after {timeout:.0f} s", out))
        print(f"   timed out after {timeout:.0f} s", flush=True)
        return False, time.perf_counter() - t0
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        write_section(name, failure_section(name, f"exited with code {proc.returncode}", proc.stderr or proc.stdout))
        print(f"   failed (exit {proc.returncode}) after {dt:.0f} s:\n{(proc.stderr or '')[-2000:]}", flush=True)
        return False, dt
    print(f"   done in {dt:.0f} s", flush=True)
    return True, dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", default=None, help="benchmark names to run (default: all)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per script before it is stopped")
    ap.add_argument("--list", action="store_true", help="print the benchmark names and exit")
    ap.add_argument(
        "--assemble", action="store_true", help="run nothing: rebuild results.md and the table from bench/sections"
    )
    args = ap.parse_args(argv)
    names = discover()
    if args.list:
        print("\n".join(names))
        return 0
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            print(f"--only {' '.join(unknown)}: no such benchmark; choose from {', '.join(names)}", file=sys.stderr)
            return 2
        names = [n for n in names if n in args.only]
    if args.assemble:
        names = []
    results = [run_one(n, args.timeout) for n in names]  # every script runs, even after a failure
    ok = all(r[0] for r in results)
    header = results_header(machine(), now_utc(), git_commit())
    assemble_results(header=header)
    print(f"wrote {BENCH_DIR / 'results.md'}")
    if update_readme(summary_table()):
        print("updated docs/performance.md's performance table from it")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
