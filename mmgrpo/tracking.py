"""Run outputs people read: metrics.jsonl (always), accelerate trackers (when asked), sample galleries.

Gallery items are dicts with "prompt", "reward" and one of "text", "image" (PIL, HxWx3 uint8, or [3,H,W] float).
"""

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image


def parse_metrics(text: str) -> list[dict[str, Any]]:
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash
    return rows


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return parse_metrics(path.read_text()) if path.is_file() else []


class MetricsLog:
    """Append-only metrics.jsonl; on resume, rows after the checkpoint's step are dropped (nothing counted twice).

    `saved` is the checkpoint's copy of the rows logged before it; it wins when the run directory's file holds fewer
    of them (resuming a checkpoint into a fresh output_dir, or after metrics.jsonl was lost)."""

    def __init__(self, run_dir: Path, accelerator=None, resume_step: int | None = None, saved: str = ""):
        self.path = run_dir / "metrics.jsonl"
        self.accelerator = accelerator
        rows: list[dict[str, Any]] = []
        if resume_step is not None:
            rows = [r for r in read_metrics(self.path) if r.get("step", -1) < resume_step]
            kept = [r for r in parse_metrics(saved) if r.get("step", -1) < resume_step]
            rows = kept if len(kept) > len(rows) else rows
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def text(self) -> str:
        return self.path.read_text() if self.path.is_file() else ""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {
            k: (float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()
        }
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
            f.flush()
        if self.accelerator is not None and self.accelerator.trackers:
            self.accelerator.log({k: v for k, v in clean.items() if v is not None}, step=step)


def _to_pil(image: Any):
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, torch.Tensor):
        t = image.detach().float().cpu()
        if t.dim() == 3 and t.shape[0] in (1, 3):
            t = t.permute(1, 2, 0)
        arr = (t.clamp(0, 1) * 255).round().byte().numpy() if t.max() <= 1.0 else t.clamp(0, 255).byte().numpy()
        image = arr
    arr = np.asarray(image)
    return Image.fromarray(arr.squeeze(-1) if arr.ndim == 3 and arr.shape[-1] == 1 else arr)


def save_gallery(d: Path, items: list[dict[str, Any]]) -> Path:
    """Write items into directory d: images as PNG, everything else in items.json."""
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, item in enumerate(items):
        row = {k: v for k, v in item.items() if k not in ("image", "frames")}
        if "image" in item:
            name = f"{i:03d}.png"
            _to_pil(item["image"]).save(d / name)
            row["image"] = name
        if "frames" in item:
            name = f"{i:03d}_frames.png"
            frames = [np.asarray(_to_pil(f)) for f in item["frames"]]
            _to_pil(np.concatenate(frames, axis=1)).save(d / name)
            row["image"] = name
        rows.append(row)
    (d / "items.json").write_text(json.dumps(rows, indent=1, default=str))
    return d
