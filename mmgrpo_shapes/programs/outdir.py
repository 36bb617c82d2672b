"""Where the pretraining programs write their model: a folder no other run owns, replaced whole or not at all.

`claim` runs before training: a `--out` that already holds files (the shipped `assets/shapes-*` model, or another
run's) is refused unless `--overwrite` says so. `write_whole` runs at every save: the folder is written beside the
target and swapped in by renames, so a crash mid-save leaves the previous best model intact.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path


def claim(out: str | Path, overwrite: bool, program: str) -> Path:
    """Return `out` as a Path; exit 2 with one line when it already holds files and `overwrite` is False."""
    path = Path(out)
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if path.exists() and not path.is_dir():
        print(f"{program}: --out {path} is a file, not a folder; name a folder for the model", file=sys.stderr)
        raise SystemExit(2)
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        print(
            f"{program}: --out {path} already holds {shown}; training would replace it. Name a new folder, "
            "or pass --overwrite to replace that model (as when re-making a shipped asset)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return path


def write_whole(out: str | Path, write: Callable[[Path], None]) -> None:
    """Call `write(folder)` on a fresh sibling folder, then swap it in for `out` (the old one is removed last)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of this same process id: never another live run's
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rename(old)  # until the next rename the previous model lives on under `old`, whole
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def save_pretrained_whole(model, processor, out: str | Path, info: dict) -> None:
    """A transformers model, its processor and the run's log (train_log.json), written whole into `out`."""

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        (folder / "train_log.json").write_text(json.dumps(info, indent=1))

    write_whole(out, write)  # a crash mid-save keeps the previous best whole
