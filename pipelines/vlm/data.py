"""Prompt records for the VLM pipeline: ShapesWorld VQA generated on the fly, a JSONL file of image paths, or a Hugging
Face dataset ("hf:NAME", "hf:NAME:SPLIT" or "hf:DIR" saved with save_to_disk; needs the `datasets` package).

A record is {"prompt": question, "image": path | array | list, "answers": str, optional "boxes", "category", "id"};
every key but "prompt" reaches the rewards as a field. Images are checked at load time, naming the bad row.
"""

import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mmgrpo.errors import UserError

SHAPES_VQA = "shapes_vqa"
HF_PREFIX = "hf:"
HF_SPLITS = {"train": "train", "val": "validation"}
"""the Hugging Face split read for our train / val split when the spec names none"""
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
    """A PIL RGB image from a path, a PIL image, Hugging Face {"bytes": ...}, or an HxWx3 uint8 array."""
    from PIL import Image

    if isinstance(image, dict) and image.get("bytes") is not None:
        with Image.open(io.BytesIO(image["bytes"])) as im:
            return im.convert("RGB")
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


def _image_problem(image: Any) -> str | None:
    """Why `image` (a path or a decoded image) cannot be used, or None when it opens and decodes."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, dict):  # Hugging Face Image bytes: decode once now, so a corrupt one names its row
        try:
            load_image(image).load()
        except (OSError, UnidentifiedImageError, ValueError) as err:
            return f"image bytes cannot be read ({type(err).__name__}: {err})"
        return None
    if not isinstance(image, str | Path):
        return None  # decoded in memory already (PIL image, array)
    path = Path(image)
    if not path.is_file():
        return f"image {str(path)!r} does not exist"
    try:
        with Image.open(path) as im:
            im.convert("RGB").load()
    except (OSError, UnidentifiedImageError, ValueError) as err:
        return f"image {str(path)!r} cannot be read ({type(err).__name__}: {err})"
    return None


def _image_value(image: Any, where: str, root: Path) -> Any:
    """A path (resolved against `root`), a PIL image or {"bytes"} from a row's image entry; else UserError naming `where`."""
    from PIL import Image

    if isinstance(image, str):
        return str(image if Path(image).is_absolute() else root / image)
    if isinstance(image, dict) and image.get("bytes") is not None:  # an undecoded Hugging Face Image value
        return image
    if isinstance(image, dict) and isinstance(image.get("path"), str):
        return _image_value(image["path"], where, root)
    if isinstance(image, Image.Image):
        return image
    raise UserError(f"{where}: image must be a path, a list of paths or a decoded image, got {type(image).__name__}")


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
    listed = list(images) if isinstance(images, list | tuple) else [] if images is None else [images]
    resolved = [_image_value(x, where, root) for x in listed]
    skip = {*QUESTION_KEYS, *ANSWER_KEYS, "image", "images", "type"}
    rec = {"prompt": str(question), "image": resolved if len(resolved) != 1 else resolved[0],
           "answers": answer if isinstance(answer, str) else json.dumps(answer)}
    rec["category"] = str(row.get("category", row.get("type", "all")))
    rec.update({k: v for k, v in row.items() if k not in skip and k not in rec})
    return rec


def _checked(rows: Iterator[tuple[str, str, Any]], root: Path, *, source: str, skip_bad_images: bool,
             limit: int | None, fix: str) -> list[dict[str, Any]]:
    """Records from (where, short label, row) triples; a bad image raises naming the row, or skips it when asked."""
    records, skipped = [], []
    for where, label, row in rows:
        rec = _parse_row(row, where, root)
        problems = [q for q in map(_image_problem, record_images(rec)) if q]
        if problems and not skip_bad_images:
            raise UserError(f"{where}: {problems[0]}; {fix} or set pipeline.kwargs.skip_bad_images=true to skip such "
                            f"rows")
        if problems:
            skipped.append(f"{label}: {problems[0]}")
            continue
        records.append(rec)
        if limit is not None and len(records) >= limit:
            break
    if skipped:
        warnings.warn(f"{source}: skipped {len(skipped)} row(s) with missing or unreadable images "
                      f"(first: {skipped[0]})", stacklevel=3)
    return records


def _with_id(where: str, row: Any) -> str:
    return f"{where} (id {row['id']!r})" if isinstance(row, dict) and "id" in row else where


def jsonl_records(path: str | Path, *, skip_bad_images: bool = False, limit: int | None = None,
                  field: str = "pipeline.kwargs.data") -> list[dict[str, Any]]:
    """Records of a JSONL file; a missing or unreadable image raises naming the row, or skips it when asked.

    Row keys: image (path or list, relative to the file's folder), question (or problem / prompt), answer (or answers /
    solution), optional boxes, category, id; any other key is kept and reaches the rewards as a field.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{field} ({str(path)!r}) is neither a file, {SHAPES_VQA!r} nor {HF_PREFIX}NAME; pass a JSONL "
                        f"file of {{image, question, answer}} rows, a Hugging Face dataset or data={SHAPES_VQA}")

    def rows() -> Iterator[tuple[str, str, Any]]:
        with open(p) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(f"{p}:{line_no}: not valid JSON ({err.msg} at column {err.colno}); fix that "
                                    f"line") from None
                yield _with_id(f"{p}:{line_no}", row), f"line {line_no}", row

    return _checked(rows(), p.parent, source=str(p), skip_bad_images=skip_bad_images, limit=limit,
                    fix=f"fix the path (relative paths start at {str(p.parent)!r})")


def hf_records(spec: str, *, split: str, skip_bad_images: bool = False, limit: int | None = None,
               field: str = "pipeline.kwargs.data") -> list[dict[str, Any]]:
    """Records of a Hugging Face dataset: "hf:NAME[:SPLIT]" (datasets.load_dataset) or "hf:DIR[:SPLIT]" (load_from_disk).

    Columns as in JSONL rows; image columns may be decoded images, {"bytes", "path"} values or paths (relative to the
    working directory). Without SPLIT our train / val split reads the dataset's train / validation split.
    """
    try:
        import datasets
    except ImportError:
        raise UserError(f"{field} ({spec!r}) needs the datasets package (pip install datasets), or export the rows to "
                        f"a JSONL file of {{image, question, answer}}") from None
    name, _, hf_split = spec[len(HF_PREFIX):].partition(":")
    hf_split = hf_split or HF_SPLITS.get(split, split)
    try:
        if Path(name).is_dir():
            ds = datasets.load_from_disk(name)
            ds = ds[hf_split] if isinstance(ds, dict) else ds  # a DatasetDict is a dict of splits
        else:
            ds = datasets.load_dataset(name, split=hf_split)
    except Exception as err:  # noqa: BLE001  hub, cache and split errors alike become one line naming the spec
        raise UserError(f"{field} ({spec!r}) could not be loaded ({type(err).__name__}: {err}); check the name and "
                        f"split (hf:NAME:SPLIT), or with HF_HUB_OFFLINE=1 download it once or pass a save_to_disk "
                        f"directory") from None
    rows = ((_with_id(f"{spec} [{hf_split}] row {i}", row), f"row {i}", row) for i, row in enumerate(ds))
    return _checked(rows, Path.cwd(), source=f"{spec} [{hf_split}]", skip_bad_images=skip_bad_images, limit=limit,
                    fix="fix the dataset's image")


def load_records(data: str, *, split: str, size: int | None, seed: int, resolution: int,
                 question_types: list[str] | None, skip_bad_images: bool, field: str) -> list[dict[str, Any]]:
    """Records from `data`: "shapes_vqa" (split, size records), "hf:..." or a JSONL path (first `size` rows if set)."""
    if data == SHAPES_VQA:
        if size is None or size < 1:
            raise UserError(f"{field}={SHAPES_VQA} needs a size >= 1 (train_size / eval_size), got {size}")
        return shapes_vqa_records(split, size, seed=seed, resolution=resolution, question_types=question_types)
    if data.startswith(HF_PREFIX):
        return hf_records(data, split=split, skip_bad_images=skip_bad_images, limit=size, field=field)
    return jsonl_records(data, skip_bad_images=skip_bad_images, limit=size, field=field)
