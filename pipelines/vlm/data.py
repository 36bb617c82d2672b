"""Prompt records for the VLM pipeline: ShapesWorld VQA generated on the fly, or a JSONL file of image paths.

A record is {"prompt": question, "image": path | array | list, "answers": str, optional "boxes", "category", "id"};
every key but "prompt" reaches the rewards as a field. Images are checked at load time, naming the bad row.
"""

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from mmgrpo.errors import UserError

SHAPES_VQA = "shapes_vqa"
QUESTION_KEYS = ("question", "problem", "prompt")
ANSWER_KEYS = ("answers", "answer", "solution")


def shapes_vqa_records(split: str, n: int, *, seed: int = 0, resolution: int = 32,
                       question_types: list[str] | None = None) -> list[dict[str, Any]]:
    """`n` ShapesWorld VQA records of `split` ("train" | "val" | "test"), images as uint8 [H, W, 3] arrays."""
    from pipelines.shapes.vqa import QUESTION_TYPES, make_vqa

    types = tuple(question_types) if question_types else QUESTION_TYPES
    rows = make_vqa(split, n, seed=seed, resolution=resolution, types=types)
    return [{"prompt": r["question"], "image": r["image"], "answers": r["answer"], "category": r["type"],
             "id": r["id"]} for r in rows]


def load_image(image: Any):
    """A PIL RGB image from a path, a PIL image, or an HxWx3 uint8 array."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, str | Path):
        with Image.open(image) as im:
            return im.convert("RGB")
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[-1] != 3:
        raise ValueError(f"image array must be [H, W, 3], got shape {arr.shape}")
    return Image.fromarray(arr.astype(np.uint8))


def record_images(record: dict[str, Any]) -> list[Any]:
    """The record's images as a list (a record may hold one image or a list of them)."""
    image = record.get("image")
    if image is None:
        return []
    return list(image) if isinstance(image, list | tuple) else [image]


def max_images(records: list[dict[str, Any]]) -> int:
    """The most images any record holds (vLLM reserves room for that many per prompt)."""
    return max((len(record_images(r)) for r in records), default=0)


def _image_problem(path: Path) -> str | None:
    """Why the image at `path` cannot be used, or None when it opens and decodes."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        return f"image {str(path)!r} does not exist"
    try:
        with Image.open(path) as im:
            im.convert("RGB").load()
    except (OSError, UnidentifiedImageError, ValueError) as err:
        return f"image {str(path)!r} cannot be read ({type(err).__name__}: {err})"
    return None


def _first(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((row[k] for k in keys if row.get(k) is not None), None)


def _parse_row(row: Any, where: str, root: Path) -> dict[str, Any]:
    """One JSONL row as a record (image paths resolved against the file's folder); raise UserError naming `where`."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object with image, question and answer, got {type(row).__name__}")
    question, answer = _first(row, QUESTION_KEYS), _first(row, ANSWER_KEYS)
    if question is None:
        raise UserError(f"{where}: no question; give it under one of {', '.join(QUESTION_KEYS)}")
    if answer is None:
        raise UserError(f"{where}: no answer; give it under one of {', '.join(ANSWER_KEYS)}")
    images = _first(row, ("image", "images"))
    paths = [images] if isinstance(images, str) else list(images or [])
    if not all(isinstance(p, str) for p in paths):
        raise UserError(f"{where}: image must be a path or a list of paths, got {images!r}")
    resolved = [str(p if Path(p).is_absolute() else root / p) for p in paths]
    skip = {*QUESTION_KEYS, *ANSWER_KEYS, "image", "images", "type"}
    rec = {"prompt": str(question), "image": resolved if len(resolved) != 1 else resolved[0],
           "answers": answer if isinstance(answer, str) else json.dumps(answer)}
    rec["category"] = str(row.get("category", row.get("type", "all")))
    rec.update({k: v for k, v in row.items() if k not in skip and k not in rec})
    return rec


def jsonl_records(path: str | Path, *, skip_bad_images: bool = False, limit: int | None = None,
                  field: str = "pipeline.kwargs.data") -> list[dict[str, Any]]:
    """Records of a JSONL file; a missing or unreadable image raises naming the row, or skips it when asked.

    Row keys: image (path or list, relative to the file's folder), question (or problem / prompt), answer (or answers /
    solution), optional boxes, category, id; any other key is kept and reaches the rewards as a field.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{field} ({str(path)!r}) is neither a file nor {SHAPES_VQA!r}; pass a JSONL file of "
                        f"{{image, question, answer}} rows or data={SHAPES_VQA}")
    records, skipped = [], []
    with open(p) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); fix that line") from None
            if isinstance(row, dict) and "id" in row:
                where += f" (id {row['id']!r})"
            rec = _parse_row(row, where, p.parent)
            problems = [q for q in map(_image_problem, map(Path, record_images(rec))) if q]
            if problems and not skip_bad_images:
                raise UserError(f"{where}: {problems[0]}; fix the path (relative paths start at {str(p.parent)!r}) "
                                f"or set pipeline.kwargs.skip_bad_images=true to skip such rows")
            if problems:
                skipped.append(f"line {line_no}: {problems[0]}")
                continue
            records.append(rec)
            if limit is not None and len(records) >= limit:
                break
    if skipped:
        warnings.warn(f"{p}: skipped {len(skipped)} row(s) with missing or unreadable images "
                      f"(first: {skipped[0]})", stacklevel=2)
    return records


def load_records(data: str, *, split: str, size: int | None, seed: int, resolution: int,
                 question_types: list[str] | None, skip_bad_images: bool, field: str) -> list[dict[str, Any]]:
    """Records from `data`: "shapes_vqa" (split, size records) or a JSONL path (first `size` rows when size is set)."""
    if data == SHAPES_VQA:
        if size is None or size < 1:
            raise UserError(f"{field}={SHAPES_VQA} needs a size >= 1 (train_size / eval_size), got {size}")
        return shapes_vqa_records(split, size, seed=seed, resolution=resolution, question_types=question_types)
    return jsonl_records(data, skip_bad_images=skip_bad_images, limit=size, field=field)
