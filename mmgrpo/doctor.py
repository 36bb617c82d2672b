"""`mmgrpo doctor`: a GPU smoke test. On a CUDA machine it trains tiny random models for two steps through every
CUDA-only path (bf16 autocast, xformers, flash attention, DDP and FSDP over NCCL, vLLM rollouts) and prints a table of
what ran, what was skipped and why; on a CPU machine it says so in one line.

Each path is the real CLI (`python -m mmgrpo.cli train ...`, or `accelerate launch` for the multi-GPU ones) in a
subprocess with its own temporary run directory; nothing is downloaded (tiny models are built locally).
"""

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FLOW = "configs/flow/sd3_tiny_cpu.yaml"
VLM = "configs/vlm/shapes_vqa.yaml"
TINY_FLOW = ("sample.batch_size=4", "sample.group_size=2", "algo.micro_batch_size=2")
TINY_VLM = (
    "pipeline.kwargs.model=tiny-random-qwen2-vl",
    "pipeline.kwargs.train_size=8",
    "pipeline.kwargs.eval_size=4",
    "pipeline.kwargs.max_new_tokens=8",
    "sample.batch_size=4",
    "sample.group_size=2",
    "algo.micro_batch_size=2",
)


@dataclass(frozen=True)
class Caps:
    """What this machine offers, probed without touching a GPU kernel (see `probe`)."""

    cuda: bool
    gpus: int = 0
    bf16: bool = False
    nccl: bool = False
    packages: frozenset[str] = frozenset()
    """installed optional packages among xformers, flash_attn, vllm"""
    device: str = ""


def probe() -> Caps:
    """The capabilities of this machine: CUDA devices, bf16 support, NCCL, and the optional kernel/rollout packages."""
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    packages = frozenset(p for p in ("xformers", "flash_attn", "vllm") if importlib.util.find_spec(p) is not None)
    return Caps(
        cuda=cuda,
        gpus=gpus,
        bf16=cuda and torch.cuda.is_bf16_supported(),
        nccl=torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        packages=packages,
        device=torch.cuda.get_device_name(0) if cuda else "",
    )


def _needs(
    *, bf16: bool = False, gpus: int = 1, nccl: bool = False, package: str = ""
) -> Callable[[Caps], str | None]:
    """A requirement test: None when `caps` meets it, else the reason the check is skipped."""

    def why_not(caps: Caps) -> str | None:
        if caps.gpus < gpus:
            return f"needs {gpus} CUDA devices, this machine has {caps.gpus}"
        if bf16 and not caps.bf16:
            return "the GPU has no bf16 support (Ampere or newer needed)"
        if nccl and not caps.nccl:
            return "torch was built without NCCL"
        if package and package not in caps.packages:
            return f"the {package} package is not installed (pip install {package.replace('_', '-')})"
        return None

    return why_not


@dataclass(frozen=True)
class Check:
    """One CUDA-only path: a recipe, its overrides, how to launch it, and what it needs."""

    name: str
    config: str
    overrides: tuple[str, ...]
    needs: Callable[[Caps], str | None]
    accelerate: str | None = None
    """an accelerate config (multi-GPU launch over `gpus` processes), or None for a plain single-process run"""
    gpus: int = 1


CHECKS = (
    Check("flow bf16 autocast", FLOW, (*TINY_FLOW, "run.mixed_precision=bf16"), _needs(bf16=True)),
    Check(
        "flow xformers attention", FLOW, (*TINY_FLOW, "pipeline.kwargs.attention=xformers"), _needs(package="xformers")
    ),
    Check("vlm bf16 autocast", VLM, (*TINY_VLM, "run.mixed_precision=bf16"), _needs(bf16=True)),
    Check(
        "vlm flash attention 2",
        VLM,
        (*TINY_VLM, "pipeline.kwargs.attn_implementation=flash_attention_2", "pipeline.kwargs.model_dtype=bfloat16"),
        _needs(bf16=True, package="flash_attn"),
    ),
    Check("vlm vLLM rollout", VLM, (*TINY_VLM, "pipeline.kwargs.rollout_backend=vllm"), _needs(package="vllm")),
    Check("flow DDP over NCCL (2 GPUs)", FLOW, TINY_FLOW, _needs(gpus=2, nccl=True), "configs/accelerate/ddp.yaml", 2),
    Check(
        "vlm FSDP2 over NCCL (2 GPUs)",
        VLM,
        TINY_VLM,
        _needs(gpus=2, nccl=True, bf16=True),
        "configs/accelerate/fsdp.yaml",
        2,
    ),
)


def plan(caps: Caps, checks: tuple[Check, ...] = CHECKS) -> list[tuple[Check, str | None]]:
    """Each check with the reason it is skipped on this machine (None: it runs)."""
    return [(c, "no CUDA device" if not caps.cuda else c.needs(caps)) for c in checks]


def command(check: Check, out_dir: str | Path, steps: int = 2) -> list[str]:
    """The exact command line of a check (a plain CLI run, or `accelerate launch` over check.gpus processes)."""
    run = [f"run.output_dir={out_dir}", f"run.steps={steps}", f"run.checkpoint_every={steps}", "run.resume=never"]
    train = ["-m", "mmgrpo.cli", "train", check.config, *check.overrides, *run]
    if check.accelerate is None:
        return [sys.executable, *train]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        check.accelerate,
        "--num_processes",
        str(check.gpus),
        *train,
    ]


@dataclass
class Result:
    name: str
    status: str
    """ran | FAILED | skipped"""
    detail: str
    seconds: float = 0.0
    log: str = field(default="")


def run_check(check: Check, work: Path, *, steps: int, timeout: float) -> Result:
    """Run one check to the end; the result's detail is the CLI's final line (or the error's last line)."""
    out = work / check.name.replace(" ", "_").replace("(", "").replace(")", "")
    log = out.with_suffix(".log")
    start = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(
            command(check, out, steps), cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return Result(check.name, "FAILED", f"no result within {timeout:g} s", time.perf_counter() - start)
    seconds = time.perf_counter() - start
    log.write_text(proc.stdout + proc.stderr)
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    done = [ln for ln in lines if ln.startswith("done:")]
    if proc.returncode == 0 and done:
        return Result(check.name, "ran", done[-1], seconds, str(log))
    last = lines[-1] if lines else f"exit code {proc.returncode} and no output"
    return Result(check.name, "FAILED", f"exit {proc.returncode}: {last[:160]}", seconds, str(log))


def format_table(results: list[Result]) -> str:
    width = max(len(r.name) for r in results)
    rows = [f"{'path':<{width}}  {'status':<7}  {'time':>6}  detail"]
    for r in results:
        took = f"{r.seconds:5.1f}s" if r.status != "skipped" else ""
        rows.append(f"{r.name:<{width}}  {r.status:<7}  {took:>6}  {r.detail}")
    return "\n".join(rows)


def cmd_doctor(args: argparse.Namespace, caps: Caps | None = None) -> int:
    """Print the table (or the CPU line); exit 0 when nothing failed, 1 otherwise."""
    caps = caps or probe()
    if not caps.cuda:
        print(
            "mmgrpo doctor: no CUDA device here (torch sees none), so the CUDA-only paths (bf16 autocast, xformers, "
            "flash attention, DDP/FSDP over NCCL, vLLM) cannot run; CPU training is unaffected"
        )
        return 0
    checks = tuple(c for c in CHECKS if not args.only or any(o in c.name for o in args.only))
    print(
        f"mmgrpo doctor: {caps.gpus} x {caps.device}; optional packages: "
        f"{', '.join(sorted(caps.packages)) or 'none'}; {args.steps} steps per path",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="mmgrpo-doctor-"))
    results = []
    for check, reason in plan(caps, checks):
        if reason is not None:
            results.append(Result(check.name, "skipped", reason))
            continue
        print(f"  running {check.name} ...", flush=True)
        results.append(run_check(check, work, steps=args.steps, timeout=args.timeout))
    print(format_table(results))
    failed = [r for r in results if r.status == "FAILED"]
    if failed or args.keep:
        print(f"run directories and logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def add_subcommand(subparsers) -> None:
    """`mmgrpo doctor [--only NAME ...] [--steps 2] [--timeout 900] [--keep]`."""
    sp = subparsers.add_parser("doctor", help="GPU smoke test: two steps through every CUDA-only path, as a table")
    sp.add_argument("--only", nargs="*", default=None, help="run only the paths whose name contains one of these")
    sp.add_argument("--steps", type=_positive, default=2, help="training steps per path (default 2)")
    sp.add_argument("--timeout", type=_positive, default=900, help="seconds allowed per path (default 900)")
    sp.add_argument("--keep", action="store_true", help="keep the run directories and logs")
    sp.set_defaults(func=cmd_doctor)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return value
