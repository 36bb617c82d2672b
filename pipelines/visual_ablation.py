"""Visual-input ablations of prompt records for "is it looking?" evaluations, shared by the VLM and video pipelines.

A record keeps its question and ground truth; only its pixels change: "blank" gives every image (or every frame of
its video) a canvas of the same size in the picture's background colour, "shuffle" gives it another record's image
or video (a fixed derangement of the evaluated records: nobody keeps their own). Image size and frame count are kept,
so the visual token count and the prompt are the same as with the real input.
"""

import random
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from mmgrpo_shapes.video import write_mp4
from pipelines.video.io import read_frames, video_info
from pipelines.vlm.data import load_image, record_images

ABLATIONS = ("blank", "shuffle")
"""`mmgrpo eval ablate=` names; the conditions they produce are called "blank" and "shuffled" in tables"""
CONDITION = {"blank": "blank", "shuffle": "shuffled"}
VISUAL_KEYS = ("image", "video")
"""record fields that hold the pixels: pipelines/vlm/data.py's "image" (one or a list), pipelines/video/data.py's
"video" (a file path)"""


def derangement(n: int, seed: int) -> list[int]:
    """A permutation p of range(n) with p[i] != i for every i (Sattolo's algorithm: one random n-cycle), seeded."""
    if n < 2:
        raise ValueError(f"a shuffle needs at least 2 records, got {n}; evaluate more records (limit=)")
    rng = random.Random(seed)
    p = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.randrange(i)  # j < i (not <= i): this is what makes it a single cycle
        p[i], p[j] = p[j], p[i]
    return p


def background(pixels: np.ndarray) -> np.ndarray:
    """The picture's background colour: per-channel median of its border pixels (uint8 [3]) of [H, W, 3]."""
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])  # [2W + 2H, 3]
    return np.median(border, axis=0).round().astype(np.uint8)


def blank_image(image: Any) -> np.ndarray:
    """uint8 [H, W, 3] filled with the background colour of `image` (any form pipelines/vlm/data.py reads)."""
    pixels = np.asarray(load_image(image))  # [H, W, 3]
    return np.broadcast_to(background(pixels), pixels.shape).copy()


def _blank_video(path: str, workdir: Path, made: dict[tuple, str]) -> str:
    """A clip of the same frame count, fps and size as `path` (odd sides + 1), every frame its first frame's
    background colour."""
    info = video_info(path)
    frames, _ = read_frames(info.path, [0], info=info)  # [1, H, W, 3]
    colour = tuple(int(c) for c in background(frames[0]))
    key = (info.num_frames, round(info.fps, 6), info.height, info.width, colour)
    if key not in made:
        out = workdir / f"blank_{len(made):04d}.mp4"
        # yuv420p needs even sides: an odd one grows by a pixel (the processor resizes to its patch grid anyway)
        clip = np.empty(
            (info.num_frames, info.height + info.height % 2, info.width + info.width % 2, 3), dtype=np.uint8
        )  # [T, H, W, 3]
        clip[:] = colour
        write_mp4(out, clip, Fraction(info.fps).limit_denominator(1001))
        made[key] = str(out)
    return made[key]


def ablate_records(
    records: list[dict[str, Any]], ablation: str, *, seed: int = 0, workdir: str | Path | None = None
) -> list[dict[str, Any]]:
    """Copies of `records` with their pixels ablated ("blank" | "shuffle"); blank videos are written to `workdir`."""
    if ablation not in ABLATIONS:
        raise ValueError(f"ablation {ablation!r} is unknown; choose from {', '.join(ABLATIONS)}")
    for i, rec in enumerate(records):
        if not any(rec.get(k) is not None for k in VISUAL_KEYS):
            raise ValueError(f"record {rec.get('id', i)!r} has no {' or '.join(VISUAL_KEYS)}: nothing to ablate")
    if ablation == "shuffle":
        perm = derangement(len(records), seed)
        return [_with_pixels_of(rec, records[j]) for rec, j in zip(records, perm)]
    # the directory is made only when a video is blanked: image records need none, and a stray temp dir per call
    # would pile up in /tmp
    if workdir is None and any(rec.get("video") is not None for rec in records):
        workdir = tempfile.mkdtemp(prefix="mmgrpo-blank-")
    if workdir is not None:
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
    made: dict[tuple, str] = {}
    out = []
    for rec in records:
        new = dict(rec)
        if rec.get("image") is not None:
            image = rec["image"]
            new["image"] = [blank_image(x) for x in image] if isinstance(image, list | tuple) else blank_image(image)
        if rec.get("video") is not None:
            new["video"] = _blank_video(rec["video"], workdir, made)
        out.append(new)
    return out


def _with_pixels_of(rec: dict[str, Any], donor: dict[str, Any]) -> dict[str, Any]:
    new = dict(rec)
    for k in VISUAL_KEYS:
        if k in donor or k in rec:
            new[k] = donor.get(k)
    return new


def preview(record: dict[str, Any], frames: int = 6) -> dict[str, Any]:
    """What a report shows of a record's input: {"image": first image} or {"frames": [frames x uint8 [H, W, 3]]}."""
    images = record_images(record)
    if images:
        return {"image": np.asarray(load_image(images[0]))}
    if record.get("video") is None:
        return {}

    info = video_info(record["video"])
    idx = np.linspace(0, info.num_frames - 1, min(frames, info.num_frames)).round().astype(int)  # [F]
    pixels, _ = read_frames(info.path, idx, info=info)  # [F, H, W, 3]
    # a 2-pixel grey gap after each frame, so the strip a gallery concatenates reads as separate frames
    pixels = np.pad(pixels, ((0, 0), (0, 0), (0, 2), (0, 0)), constant_values=96)  # [F, H, W + 2, 3]
    return {"frames": list(pixels)}
