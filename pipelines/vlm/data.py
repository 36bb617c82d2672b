"""Prompt records for the VLM pipeline: ShapesWorld VQA generated on the fly, a JSONL file of image paths, or a Hugging
Face dataset ("hf:NAME", "hf:NAME:SPLIT" or "hf:DIR" saved with save_to_disk; needs the `datasets` package).

A record is {"prompt": question, "image": path | array | list, "answers": str, optional "boxes", "category", "id"
(ShapesWorld adds "objects", the scene);
every key but "prompt" reaches the rewards as a field. Images are checked at load time, naming the bad row.
"""

import io
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mmgrpo.errors import UserError
from mmgrpo_shapes.vqa import QUESTION_TYPES, make_vqa
from pipelines.vlm.wrapping import unwrap

SHAPES_VQA = "shapes_vqa"
WHERE_KEY = "_where"
"""record key holding the row's location ("data.jsonl:3 (id 'q7')"); no reward declares it, so none receives it"""
HF_PREFIX = "hf:"
HF_SPLITS = {"train": "train", "val": "validation"}
"""the Hugging Face split read for our train / val split when the spec names none"""
QUESTION_KEYS = ("question", "problem", "prompt")
ANSWER_KEYS = ("answers", "answer", "solution")


def shapes_vqa_records(
    split: str, n: int, *, seed: int = 0, resolution: int = 32, question_types: list[str] | None = None
) -> list[dict[str, Any]]:
    """`n` ShapesWorld VQA records of `split` ("train" | "val" | "test"), images as uint8 [H, W, 3] arrays."""
    types = tuple(question_types) if question_types else QUESTION_TYPES
    rows = make_vqa(split, n, seed=seed, resolution=resolution, types=types)
    return [
        {
            "prompt": r["question"],
            "image": r["image"],
            "answers": r["answer"],
            "category": r["type"],
            "id": r["id"],
            "objects": r["objects"],  # the scene, for process rewards that check a think (shapes_think_cells)
        }
        for r in rows
    ]


MAX_ASPECT_RATIO = 200
"""Qwen2-VL's processor (smart_resize) refuses max(h, w) / min(h, w) > 200: such images are refused at load time"""
VISION_SPECIAL_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
)
"""the Qwen2/2.5/3-VL chat and vision tokens: user text holding one makes the processor miscount image/video tokens
(or opens a fake turn), so a record whose text contains one is refused at load time (not escaped: such text is almost
always an already-templated prompt)"""


def to_rgb(im):
    """A PIL image as 8-bit RGB: EXIF orientation applied, 16-bit / int / float modes scaled (not clipped) to 0-255,
    transparency composited on white (as qwen-vl-utils does), CMYK and palette converted."""
    im = ImageOps.exif_transpose(im)  # a phone JPEG stored sideways with an Orientation tag trains upright
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        arr = np.asarray(im, dtype=np.float64)  # [H, W]
        if im.mode.startswith("I;16") or (im.mode == "I" and arr.size and arr.min() >= 0 and arr.max() <= 65535):
            arr = arr / 257.0  # 16-bit range onto 8 bits: 65535 -> 255 (PNG's own scaling, PNG spec 12.6)
        elif im.mode == "F" and arr.size and arr.min() >= 0 and arr.max() <= 1:
            arr = arr * 255.0
        elif arr.size and arr.max() > arr.min():
            arr = (arr - arr.min()) / (arr.max() - arr.min()) * 255.0  # any other range: its min..max onto 0..255
        else:
            arr = np.zeros_like(arr)
        im = Image.fromarray(np.clip(np.round(arr), 0, 255).astype(np.uint8), mode="L")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = im.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.getchannel("A"))
        return white
    return im.convert("RGB")


def load_image(image: Any):
    """A PIL RGB image from a path, a PIL image, Hugging Face {"bytes": ...}, or an HxWx3 uint8 array (see to_rgb)."""
    if isinstance(image, dict) and image.get("bytes") is not None:
        with Image.open(io.BytesIO(image["bytes"])) as im:
            return to_rgb(im)
    if isinstance(image, Image.Image):
        return to_rgb(image)
    if isinstance(image, str | Path):
        with Image.open(image) as im:
            return to_rgb(im)
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


def _aspect_problem(width: int, height: int, what: str) -> str | None:
    if min(width, height) < 1:
        return f"{what} is empty ({width}x{height} pixels); replace it"
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        return (
            f"{what} is {width}x{height} pixels: aspect ratio {max(width, height) / min(width, height):.0f} exceeds "
            f"the {MAX_ASPECT_RATIO} the Qwen-VL processor accepts; crop or pad it"
        )
    return None


def _image_problem(image: Any) -> str | None:
    """Why `image` cannot be used, or None when it opens, decodes and the processor would accept its shape."""
    if isinstance(image, dict):  # Hugging Face Image bytes: decode once now, so a corrupt one names its row
        try:
            im = load_image(image)
            im.load()
        except (OSError, UnidentifiedImageError, ValueError) as err:
            return f"image bytes cannot be read ({type(err).__name__}: {err}); re-encode the image"
        return _aspect_problem(*im.size, "image bytes")
    if isinstance(image, Image.Image):
        return _aspect_problem(*image.size, "image")
    if not isinstance(image, str | Path):
        arr = np.asarray(image)
        return _aspect_problem(arr.shape[1], arr.shape[0], "image array") if arr.ndim == 3 else None
    path = Path(image)
    if path.is_dir():
        return f"image {str(path)!r} is a directory, not an image file"
    if not path.is_file():
        return f"image {str(path)!r} does not exist"
    try:
        with Image.open(path) as im:
            rgb = to_rgb(im)
            rgb.load()
    except (OSError, UnidentifiedImageError, ValueError) as err:
        return f"image {str(path)!r} cannot be read ({type(err).__name__}: {err}); re-save it as PNG or JPEG"
    return _aspect_problem(*rgb.size, f"image {str(path)!r}")


def text_problem(text: str, what: str = "question", tokens: tuple[str, ...] = VISION_SPECIAL_TOKENS) -> str | None:
    """Why user text cannot go into the chat template: it holds one of the model's special tokens."""
    found = [t for t in tokens if t in text]
    if found:
        return (
            f"the {what} contains the special token {found[0]!r}, which the processor would read as a real "
            f"image/video slot or turn marker; remove it"
        )
    return None


def _image_value(image: Any, where: str, root: Path) -> Any:
    """A path (resolved against `root`), a PIL image or {"bytes"} from a row's image entry; else UserError naming `where`."""
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
    rec = {
        "prompt": str(question),
        "image": resolved if len(resolved) != 1 else resolved[0],
        "answers": answer if isinstance(answer, str) else json.dumps(answer),
    }
    rec["category"] = str(row.get("category", row.get("type", "all")))
    rec.update({k: v for k, v in row.items() if k not in skip and k not in rec})
    rec[WHERE_KEY] = where  # file:line (id) for problems found once the processor is known (prompt length)
    return rec


def _checked(
    rows: Iterator[tuple[str, str, Any]],
    root: Path,
    *,
    source: str,
    skip_bad_images: bool,
    limit: int | None,
    fix: str,
) -> list[dict[str, Any]]:
    """Records from (where, short label, row) triples; a bad image raises naming the row, or skips it when asked."""
    records, skipped = [], []
    for where, label, row in rows:
        rec = _parse_row(row, where, root)
        problems = [q for q in [text_problem(rec["prompt"]), *map(_image_problem, record_images(rec))] if q]
        if problems and not skip_bad_images:
            path_problem = "does not exist" in problems[0] or "is a directory" in problems[0]
            hint = f"; {fix} or" if path_problem else ", or"  # the other problems end with their own fix
            raise UserError(f"{where}: {problems[0]}{hint} set pipeline.kwargs.skip_bad_images=true to skip such rows")
        if problems:
            skipped.append(f"{label}: {problems[0]}")
            continue
        records.append(rec)
        if limit is not None and len(records) >= limit:
            break
    if skipped:
        warnings.warn(
            f"{source}: skipped {len(skipped)} row(s) the model cannot take (first: {skipped[0]})", stacklevel=3
        )
    return records


def _with_id(where: str, row: Any) -> str:
    return f"{where} (id {row['id']!r})" if isinstance(row, dict) and "id" in row else where


def jsonl_records(
    path: str | Path, *, skip_bad_images: bool = False, limit: int | None = None, field: str = "pipeline.kwargs.data"
) -> list[dict[str, Any]]:
    """Records of a JSONL file; a missing or unreadable image raises naming the row, or skips it when asked.

    Row keys: image (path or list, relative to the file's folder), question (or problem / prompt), answer (or answers /
    solution), optional boxes, category, id; any other key is kept and reaches the rewards as a field.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"{field} ({str(path)!r}) is neither a file, {SHAPES_VQA!r} nor {HF_PREFIX}NAME; pass a JSONL "
            f"file of {{image, question, answer}} rows, a Hugging Face dataset or data={SHAPES_VQA}"
        )

    def rows() -> Iterator[tuple[str, str, Any]]:
        with open(p) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(
                        f"{p}:{line_no}: not valid JSON ({err.msg} at column {err.colno}); fix that line"
                    ) from None
                yield _with_id(f"{p}:{line_no}", row), f"line {line_no}", row

    return _checked(
        rows(),
        p.parent,
        source=str(p),
        skip_bad_images=skip_bad_images,
        limit=limit,
        fix=f"fix the path (relative paths start at {str(p.parent)!r})",
    )


def hf_records(
    spec: str,
    *,
    split: str,
    skip_bad_images: bool = False,
    limit: int | None = None,
    field: str = "pipeline.kwargs.data",
) -> list[dict[str, Any]]:
    """Records of a Hugging Face dataset: "hf:NAME[:SPLIT]" (datasets.load_dataset) or "hf:DIR[:SPLIT]" (load_from_disk).

    Columns as in JSONL rows; image columns may be decoded images, {"bytes", "path"} values or paths (relative to the
    working directory). Without SPLIT our train / val split reads the dataset's train / validation split.
    """
    try:
        # lazy: datasets is optional (not a dependency); only hf: records need it
        import datasets
    except ImportError:
        raise UserError(
            f"{field} ({spec!r}) needs the datasets package (pip install datasets), or export the rows to "
            f"a JSONL file of {{image, question, answer}}"
        ) from None
    name, _, hf_split = spec[len(HF_PREFIX) :].partition(":")
    hf_split = hf_split or HF_SPLITS.get(split, split)
    try:
        if Path(name).is_dir():
            ds = datasets.load_from_disk(name)
            ds = ds[hf_split] if isinstance(ds, dict) else ds  # a DatasetDict is a dict of splits
        else:
            ds = datasets.load_dataset(name, split=hf_split)
    except Exception as err:  # noqa: BLE001  hub, cache and split errors alike become one line naming the spec
        raise UserError(
            f"{field} ({spec!r}) could not be loaded ({type(err).__name__}: {err}); check the name and "
            f"split (hf:NAME:SPLIT), or with HF_HUB_OFFLINE=1 download it once or pass a save_to_disk "
            f"directory"
        ) from None
    rows = ((_with_id(f"{spec} [{hf_split}] row {i}", row), f"row {i}", row) for i, row in enumerate(ds))
    return _checked(
        rows,
        Path.cwd(),
        source=f"{spec} [{hf_split}]",
        skip_bad_images=skip_bad_images,
        limit=limit,
        fix="fix the dataset's image",
    )


EVAL_SPLITS = ("val", "test", "train")


def check_eval_split(split: str) -> None:
    """`pipeline.kwargs.eval_split` names the split `mmgrpo eval` and the end-of-run table score: val while tuning,
    test once for the held-out number a report states."""
    if split not in EVAL_SPLITS:
        raise UserError(
            f"pipeline.kwargs.eval_split={split!r} is not a split; use one of {', '.join(EVAL_SPLITS)} (val while "
            f"tuning, test for the held-out number you report)"
        )


def load_records(
    data: str,
    *,
    split: str,
    size: int | None,
    seed: int,
    resolution: int,
    question_types: list[str] | None,
    skip_bad_images: bool,
    field: str,
) -> list[dict[str, Any]]:
    """Records from `data`: "shapes_vqa" (split, size records), "hf:..." or a JSONL path (first `size` rows if set)."""
    if data == SHAPES_VQA:
        if size is None or size < 1:
            raise UserError(f"{field}={SHAPES_VQA} needs a size >= 1 (train_size / eval_size), got {size}")
        return shapes_vqa_records(split, size, seed=seed, resolution=resolution, question_types=question_types)
    if data.startswith(HF_PREFIX):
        return hf_records(data, split=split, skip_bad_images=skip_bad_images, limit=size, field=field)
    return jsonl_records(data, skip_bad_images=skip_bad_images, limit=size, field=field)


def prompt_tokens(processor: Any, chat: str, images: list) -> tuple[int, int]:
    """(prompt tokens, of which image tokens) of a chat-template text whose images expand to the processor's count."""
    ids = processor.tokenizer(chat, add_special_tokens=False)["input_ids"]
    if not images:
        return len(ids), 0
    count = getattr(processor, "_get_num_multimodal_tokens", None)
    if count is not None:  # from the image sizes alone: no pixel work
        per_image = count(image_sizes=[(im.height, im.width) for im in images]).num_image_tokens
    else:
        per_image = [
            int(t.prod()) // processor.image_processor.merge_size**2
            for t in processor(text=[chat], images=images, return_tensors="pt")["image_grid_thw"]
        ]
    return len(ids) - len(images) + sum(per_image), sum(per_image)  # each image slot holds one placeholder token


def model_special_tokens(processor: Any) -> tuple[str, ...]:
    """The loaded processor's special tokens (its image/video placeholders included): none may appear in user text."""
    tok = getattr(processor, "tokenizer", processor)
    names = [
        *getattr(tok, "all_special_tokens", ()),
        getattr(processor, "image_token", None),
        getattr(processor, "video_token", None),
    ]
    return tuple(sorted({t for t in names if isinstance(t, str) and t}, key=len, reverse=True))


def check_prompt_lengths(
    records: list[dict[str, Any]],
    count: Callable[[dict[str, Any]], tuple[int, int]],
    *,
    positions: int | None,
    max_prompt_length: int | None,
    max_new_tokens: int,
    skip: bool,
    field: str,
    skip_key: str = "skip_bad_images",
    media: str = "image",
    special_tokens: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """The records the loaded model can take: no `special_tokens` in the question (the processor's own, beyond the
    Qwen ones checked at load), and `count(record)` -> (prompt tokens, of which image/video tokens) <=
    max_prompt_length with prompt + max_new_tokens <= the model's positions. A bad record raises UserError naming its
    row, or is skipped (and counted in a warning) when `skip`. Nothing is truncated: image tokens never can be."""
    limits = (
        [(max_prompt_length, f"pipeline.kwargs.max_prompt_length={max_prompt_length}")] if max_prompt_length else []
    )
    if positions:
        why = f"the model's {positions} positions minus max_new_tokens {max_new_tokens}"
        limits.append((positions - max_new_tokens, why))
    kept, skipped = [], []
    for i, rec in enumerate(records):
        where = rec.get(WHERE_KEY) or f"{field} record {i} (id {rec.get('id', i)!r})"
        problem = text_problem(str(rec.get("question", rec.get("prompt", ""))), tokens=special_tokens)
        if problem is None and limits:
            n, n_media = count(rec)
            over = next(((lim, why) for lim, why in limits if n > lim), None)
            problem = over and (
                f"the prompt is {n} tokens ({n_media} of them {media} tokens), over the {over[0]} "
                f"allowed by {over[1]}; shorten the question, use fewer/smaller {media}s "
                f"(max_pixels) or change pipeline.kwargs.max_prompt_length / max_new_tokens"
            )
        if problem is None:
            kept.append(rec)
        elif not skip:
            raise UserError(f"{where}: {problem}, or set pipeline.kwargs.{skip_key}=true to skip such rows")
        else:
            skipped.append(f"{where}: {problem}")
    if records and not kept:
        raise UserError(f"{field}: the model can take none of the records (first: {skipped[0]})")
    if skipped:
        warnings.warn(
            f"{field}: skipped {len(skipped)} record(s) the model cannot take (first: {skipped[0]})", stacklevel=2
        )
    return kept


def model_positions(hf, max_model_len: int | None = None) -> int | None:
    """The most tokens (prompt + completion) the language model has positions for, or None when it does not say."""
    cfg = unwrap(hf).config
    n = getattr(getattr(cfg, "text_config", cfg), "max_position_embeddings", None)
    n = n or getattr(cfg, "max_position_embeddings", None)
    return min(x for x in (n, max_model_len) if x) if (n or max_model_len) else None
