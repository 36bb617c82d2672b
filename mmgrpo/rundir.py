"""Who may write a run directory: a new run refuses a directory that holds another run, and says how to go on.

A run never truncates another run's metrics.jsonl, rewrites its config.yaml or prunes its checkpoints.
"""

import shlex
import shutil
from pathlib import Path

import yaml

from mmgrpo import checkpoint
from mmgrpo.config import Config
from mmgrpo.errors import UserError

RUN_FILES = ("config.yaml", "metrics.jsonl", "report.html", "gallery", "checkpoints")
"""what a run writes into run.output_dir and what marks the directory as holding a run"""
OVERWRITTEN = (*RUN_FILES, "eval")
"""what run.overwrite=true deletes: the run's files plus its evaluations (`mmgrpo eval` writes eval/ into the run,
and an earlier run's eval/*.json would otherwise head the new run's report); other files are left alone. eval/ alone
does not mark a run: `mmgrpo eval ckpt=none` into a fresh directory must not block the train that follows."""


def _rows(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text(errors="replace").splitlines() if line.strip())
    except OSError:
        return 0


def describe(run_dir: Path) -> str | None:
    """What earlier run lives in run_dir ("2 checkpoints up to step_00000002, 2 metric rows"), or None."""
    if not run_dir.is_dir():
        return None
    ckpts = checkpoint.list_checkpoints(run_dir / "checkpoints")
    rows = _rows(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else 0
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not ckpts and not rows and not found:
        return None
    parts = [f"{len(ckpts)} checkpoint(s) up to {ckpts[-1].name}" if ckpts else "no checkpoint"]
    parts.append(f"{rows} metric row(s)")
    return ", ".join(parts)


def _same_config(saved: Path, cfg: Config) -> bool:
    """True when saved config.yaml is this config (resume and overwrite aside): the same run restarted."""
    try:
        old = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return False
    new = cfg.to_dict()
    for tree in (old, new):
        if isinstance(tree, dict) and isinstance(tree.get("run"), dict):
            tree["run"] = {k: v for k, v in tree["run"].items() if k not in ("resume", "overwrite")}
    return old == new


def claim(cfg: Config) -> None:
    """Refuse (UserError, one line) to start a run where it would overwrite another run's files.

    Allowed: an empty or new directory; run.resume=auto continuing the run that lives there (or restarting it
    when it was stopped before its first checkpoint with the same config); run.resume=<the newest valid checkpoint
    there>; run.overwrite=true (the earlier run is deleted once the new one has built its model)."""
    run_dir = Path(cfg.run.output_dir)
    held = describe(run_dir)
    if held is None or cfg.run.overwrite:
        return
    root = run_dir / "checkpoints"
    ckpts = checkpoint.list_checkpoints(root)
    valid = next((p for p in reversed(ckpts) if checkpoint.check(p) is None), None)
    resume = cfg.run.resume
    if resume == "auto":
        if valid is not None:
            return
        if not ckpts and _same_config(run_dir / "config.yaml", cfg):
            return  # the same run, stopped before its first checkpoint: nothing to resume, nothing else to keep
        why = "none of its checkpoints is valid" if ckpts else "its config differs and it has no checkpoint"
    elif resume == "never":
        why = "run.resume=never would start over on top of it"
    else:
        path = Path(resume)
        if valid is not None and path.resolve() == valid.resolve():
            return
        inside = path.resolve().parent == root.resolve()
        why = (
            f"run.resume={resume} is not its newest valid checkpoint ({valid.name if valid else 'none'}); "
            f"continuing from it here would overwrite the later ones"
            if inside
            else f"run.resume={resume} belongs to another run"
        )
    raise UserError(
        f"run.output_dir ({str(run_dir)!r}) already holds a run ({held}) and {why}; continue it with "
        f"run.resume=auto, start another with run.output_dir=<new dir>, or delete it and start over with "
        f"run.overwrite=true"
    )


def clear(run_dir: Path) -> list[str]:
    """run.overwrite=true: delete the earlier run's files (OVERWRITTEN only); returns what was deleted."""
    gone = []
    for name in OVERWRITTEN:
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        gone.append(name)
    return gone


def resume_command(config: str, overrides: list[str], ckpt: Path) -> str:
    """The exact command that continues from checkpoint `ckpt` (earlier run.resume/overwrite overrides dropped)."""
    keep = [o for o in overrides if o.split("=", 1)[0].strip() not in ("run.resume", "run.overwrite")]
    return shlex.join(["mmgrpo", "train", config, *keep, f"run.resume={ckpt}"])
