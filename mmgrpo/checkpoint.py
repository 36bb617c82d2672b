"""Checkpoints that never lose work: written to a temporary directory, checksummed, then renamed atomically.

A checkpoint is valid only when its manifest exists and every file matches its recorded size and sha256.
"""

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
PREFIX = "step_"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-{PREFIX}{step:08d}"


def write_rank_files(root: Path, step: int, rank: int) -> None:
    """Per-rank state (RNG) into the temporary directory; every rank calls this before rank 0 finalises."""
    d = tmp_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), d / f"rng_rank{rank}.pt")


def write_main_files(
    root: Path,
    step: int,
    *,
    weights: dict[str, torch.Tensor],
    state: dict[str, Any],
    config_yaml: str,
    ema: dict[str, torch.Tensor] | None = None,
    metrics_jsonl: str = "",
    export: Callable[[Path], None] | None = None,
) -> None:
    """Rank 0: weights (safetensors), optimizer/scheduler/sampler/trainer state, the resolved config, the metrics
    logged so far and, when the policy has an `export` hook, its deployable format (e.g. a peft adapter) in export/."""
    d = tmp_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(d / "weights.safetensors"))
    if ema is not None:
        save_file({k: v.detach().contiguous().cpu() for k, v in ema.items()}, str(d / "ema.safetensors"))
    torch.save(state, d / "state.pt")
    (d / "config.yaml").write_text(config_yaml)
    (d / "metrics.jsonl").write_text(metrics_jsonl)
    if export is not None:
        (d / "export").mkdir(exist_ok=True)
        export(d / "export")


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def finalize(root: Path, step: int, keep_last: int, run_id: str | None = None) -> Path:
    """Rank 0, after every rank wrote its files: manifest, fsync, atomic rename, prune this run's old checkpoints.

    Only checkpoints whose manifest names the same `run_id` are pruned or replaced, so a checkpoint of another run
    is never deleted (run.output_dir refuses to hold two runs, and this keeps it so even when that check is
    bypassed)."""
    d = tmp_dir(root, step)
    files = {p.relative_to(d).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(d)}
    manifest = d / MANIFEST
    manifest.write_text(json.dumps({"step": step, "run": run_id, "files": files}, indent=1))
    for p in _files(d):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    final = root / f"{PREFIX}{step:08d}"
    if final.exists():
        if check(final) is None and owner(final) != run_id:
            shutil.rmtree(d, ignore_errors=True)
            raise RuntimeError(f"checkpoint {final} belongs to another run ({owner(final)}); not replacing it")
        shutil.rmtree(final)
    os.replace(d, final)
    _fsync_dir(root)
    mine = [p for p in list_checkpoints(root) if int(p.name[len(PREFIX) :]) <= step and owner(p) == run_id]
    for old in mine[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


_UNKNOWN = object()


def owner(path: Path) -> str | None | object:
    """The run id a checkpoint's manifest records (None for checkpoints written before run ids existed); an object
    equal to no id when the manifest is missing or unreadable."""
    try:
        meta = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return _UNKNOWN
    return meta.get("run") if isinstance(meta, dict) else _UNKNOWN


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clear_tmp(root: Path) -> None:
    """Remove half-written temporary checkpoints left by a crash (they were never valid)."""
    if root.is_dir():
        for p in root.glob(f".tmp-{PREFIX}*"):
            shutil.rmtree(p, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    """Final checkpoint directories under root, oldest first (validity not checked)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[5:].isdigit())


def check(path: Path) -> str | None:
    """None when the checkpoint is complete and intact, else the reason it is not."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        meta = json.loads(manifest.read_text())
        files = meta["files"]
    except (ValueError, KeyError) as err:
        return f"unreadable manifest.json ({err})"
    for name, info in files.items():
        p = path / name
        if not p.is_file():
            return f"missing {name}"
        if p.stat().st_size != info["size"]:
            return f"{name} has {p.stat().st_size} bytes, manifest says {info['size']}"
        if _sha256(p) != info["sha256"]:
            return f"{name} checksum mismatch"
    return None


def latest_valid(root: Path, log=print) -> Path | None:
    """The newest intact checkpoint; corrupt or partial ones are skipped with a message, never loaded."""
    for path in reversed(list_checkpoints(root)):
        reason = check(path)
        if reason is None:
            return path
        log(f"skipping checkpoint {path}: {reason}")
    return None


def load(path: Path, rank: int) -> dict[str, Any]:
    """Everything a resume needs: weights, optional EMA, trainer state, metrics so far and this rank's RNG state."""
    metrics = path / "metrics.jsonl"
    out = {
        "weights": load_file(str(path / "weights.safetensors")),
        "state": torch.load(path / "state.pt", weights_only=False),
        "metrics_jsonl": metrics.read_text() if metrics.is_file() else "",
    }
    if (path / "ema.safetensors").is_file():
        out["ema"] = load_file(str(path / "ema.safetensors"))
    rng = path / f"rng_rank{rank}.pt"
    out["rng"] = torch.load(rng, weights_only=False) if rng.is_file() else None
    return out
