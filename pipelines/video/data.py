"""Prompt records for the video pipeline: a JSONL file of {video, question, answer | spans} rows, or ShapesWorld clips
("shapes_video") generated once into a cache directory. Videos are checked at load time, naming the bad row.

A record is {"prompt", "video" (absolute path), "duration", "category", "id", and "spans" [start, end] seconds for
grounding or "answers" for QA}: field names are the rewards' (`temporal_iou` reads spans, the QA rewards answers).
ShapesWorld records also carry "reference_think", the think the SFT model was taught (`mmgrpo_shapes.video_think`:
a time line for grounding, direction and order), for the process reward `time_line_marks` and injected ground truth.
"""

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from mmgrpo.errors import UserError
from mmgrpo_shapes.video import QUESTION_SET_VERSION, make_video_set
from mmgrpo_shapes.video_think import think_text
from pipelines.video.io import check_videos, frame_indices, video_info
from pipelines.vlm.data import WHERE_KEY, text_problem

log = logging.getLogger(__name__)

SHAPES_VIDEO = "shapes_video"
QUESTION_KEYS = ("question", "problem", "prompt", "query")
ANSWER_KEYS = ("answers", "answer", "solution")
SPAN_KEYS = ("spans", "timestamps", "span", "timestamp")
TASK_HINTS = {
    "grounding": "Give the start and end time in seconds inside the answer tags, as <answer>start to end</answer>.",
    "multiple_choice": "Answer with the option letter only.",
    "numeric": "Answer with a number only.",
}
"""appended to the question per task, so the answer parses (rewards read `<answer>start to end</answer>`, a letter,
or a number)"""
SHAPES_TASKS = {"grounding": "grounding", "count": "numeric", "direction": "free_form", "order": "free_form"}


def _span(value: Any, where: str) -> list[float]:
    try:
        pair = [float(v) for v in value]
    except (TypeError, ValueError):
        pair = []
    if len(pair) != 2 or pair[1] < pair[0] or pair[0] < 0:
        raise UserError(f"{where}: spans {value!r} must be [start, end] seconds with 0 <= start <= end")
    return pair


def _task(row: dict[str, Any], has_span: bool) -> str:
    kind = str(row.get("problem_type", row.get("type", row.get("category", ""))) or "").lower().replace(" ", "_")
    if has_span:
        return "grounding"
    return {
        "multiple_choice": "multiple_choice",
        "mc": "multiple_choice",
        "numerical": "numeric",
        "numeric": "numeric",
        "count": "numeric",
    }.get(kind, kind or "free_form")


def parse_row(row: Any, where: str, root: Path) -> dict[str, Any]:
    """One JSONL row as a record; grounding rows give `spans` (or an [s, e] answer with type grounding)."""
    if not isinstance(row, dict):
        raise UserError(
            f"{where}: expected a JSON object with video, question and answer/spans, got {type(row).__name__}"
        )
    question = next((row[k] for k in QUESTION_KEYS if row.get(k) is not None), None)
    if question is None:
        raise UserError(f"{where}: no question; give it under one of {', '.join(QUESTION_KEYS)}")
    video = row.get("video", row.get("video_path", row.get("path")))
    if not isinstance(video, str):
        raise UserError(f"{where}: video must be a path string, got {video!r}")
    spans = next((row[k] for k in SPAN_KEYS if row.get(k) is not None), None)
    answer = next((row[k] for k in ANSWER_KEYS if row.get(k) is not None), None)
    kind = str(row.get("type", row.get("problem_type", ""))).lower()
    if spans is None and kind == "grounding" and isinstance(answer, list | tuple):
        spans, answer = answer, None
    if spans is None and answer is None:
        raise UserError(f"{where}: no ground truth; give spans [start, end] (grounding) or an answer (QA)")
    task = _task(row, spans is not None)
    rec: dict[str, Any] = {"video": str(video if Path(video).is_absolute() else root / video), "category": task}
    if spans is not None:
        rec["spans"] = _span(spans, where)
    if answer is not None:
        rec["answers"] = answer if isinstance(answer, str) else json.dumps(answer)
    rec["id"] = str(row.get("id", where))
    rec["question"] = str(question)
    if row.get("duration") is not None:
        rec["duration"] = float(row["duration"])
    return rec


def finish(rec: dict[str, Any], *, time_prompt: bool) -> dict[str, Any]:
    """Add duration (from the header when missing) and the prompt: question, duration line, task hint."""
    if "duration" not in rec:
        rec["duration"] = video_info(rec["video"]).duration
    parts = [rec["question"]]
    if time_prompt:  # Qwen2-VL has no absolute time in its positions; the duration anchors "X to Y" seconds
        parts.append(f"The video is {rec['duration']:.1f} seconds long.")
    if rec["category"] in TASK_HINTS:
        parts.append(TASK_HINTS[rec["category"]])
    rec["prompt"] = "\n".join(parts)
    return rec


def jsonl_records(
    path: str | os.PathLike,
    *,
    limit: int | None = None,
    skip_bad_videos: bool = False,
    time_prompt: bool = True,
    field: str = "pipeline.kwargs.data",
) -> list[dict[str, Any]]:
    """Records of a JSONL file; a missing, corrupt or zero-length video raises naming the row, or is skipped."""
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"{field} ({str(path)!r}) is neither a file nor {SHAPES_VIDEO!r}; pass a JSONL file of "
            f"{{video, question, answer | spans}} rows or data={SHAPES_VIDEO}"
        )
    recs, wheres = [], []
    with open(p) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); fix that line") from None
            if isinstance(row, dict) and row.get("id") is not None:
                where = f"{where} (id {row['id']!r})"
            rec = parse_row(row, where, p.parent)
            problem = text_problem(rec["question"])
            if problem and not skip_bad_videos:
                raise UserError(f"{where}: {problem}, or set pipeline.kwargs.skip_bad_videos=true to skip such rows")
            if problem:
                log.warning("skipped %s: %s", where, problem)
                continue
            rec[WHERE_KEY] = where  # for problems found once the processor is known (prompt length)
            recs.append(rec)
            wheres.append(where)
            if limit is not None and len(recs) >= limit:
                break
    keep = check_videos([r["video"] for r in recs], skip=skip_bad_videos, where=wheres)
    return [finish(recs[i], time_prompt=time_prompt) for i in keep]


def shapes_video_dir(
    split: str,
    n: int,
    *,
    seed: int,
    types: tuple[str, ...],
    num_frames: int,
    fps: int,
    resolution: int,
    cache_dir: str | os.PathLike | None,
) -> Path:
    """ShapesWorld clips of `split` written once under the cache (keyed by every generation setting) and reused."""
    root = Path(cache_dir or os.environ.get("MMGRPO_CACHE") or Path.home() / ".cache" / "mmgrpo")
    setting = f"n{n}-s{seed}-{'+'.join(types)}-f{num_frames}-fps{fps}-r{resolution}"
    key = f"shapes_video-v{QUESTION_SET_VERSION}-{split}-{setting}"
    out = root / key
    if not (out / f"{split}.jsonl").is_file():
        tmp = root / f".{key}.tmp{os.getpid()}"
        make_video_set(split, n, tmp, seed=seed, num_frames=num_frames, fps=fps, resolution=resolution, types=types)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, out)  # atomic: a concurrent builder never sees half a set
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first; its copy is complete
    return out


def shapes_video_records(
    split: str,
    n: int,
    *,
    seed: int = 0,
    types: tuple[str, ...] = ("grounding",),
    num_frames: int = 24,
    fps: int = 4,
    resolution: int = 64,
    cache_dir: str | os.PathLike | None = None,
    time_prompt: bool = True,
) -> list[dict[str, Any]]:
    """`n` ShapesWorld video records (grounding -> spans; count -> numeric answers; direction/order -> free form)."""
    out = shapes_video_dir(
        split,
        n,
        seed=seed,
        types=tuple(types),
        num_frames=num_frames,
        fps=fps,
        resolution=resolution,
        cache_dir=cache_dir,
    )
    recs = []
    for line in (out / f"{split}.jsonl").read_text().splitlines():
        row = json.loads(line)
        kind, row["type"] = row["type"], SHAPES_TASKS[row["type"]]
        rec = parse_row(row, f"{out}/{split}.jsonl:{row['id']}", out)
        # the SFT model's think: `time_line_marks`' reference, and `{think}` in injected ground truth (TempSamp-R1)
        rec["reference_think"] = think_text({**row, "type": kind, "spans": rec.get("spans")})
        recs.append(finish(rec, time_prompt=time_prompt))
    return recs


def load_records(
    data: str,
    *,
    split: str,
    size: int | None,
    seed: int,
    shapes_types: list[str] | None,
    shapes_frames: int,
    shapes_resolution: int,
    skip_bad_videos: bool,
    time_prompt: bool,
    cache_dir: str | None,
    field: str,
) -> list[dict[str, Any]]:
    """Records from `data`: "shapes_video" (generated, `size` clips) or a JSONL path (first `size` rows if set)."""
    if data == SHAPES_VIDEO:
        if size is None or size < 1:
            raise UserError(f"{field}={SHAPES_VIDEO} needs a size >= 1 (train_size / eval_size), got {size}")
        return shapes_video_records(
            split,
            size,
            seed=seed,
            types=tuple(shapes_types or ("grounding",)),
            num_frames=shapes_frames,
            resolution=shapes_resolution,
            cache_dir=cache_dir,
            time_prompt=time_prompt,
        )
    return jsonl_records(data, limit=size, skip_bad_videos=skip_bad_videos, time_prompt=time_prompt, field=field)


COUNTED_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")
"""processors whose video token count follows from the frame count and size alone (checked against their output)"""


def video_prompt_tokens(policy: Any, record: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, of which video tokens) of a record as `policy.encode` builds it. Qwen2-VL / Qwen2.5-VL count
    from the video header (sampled frame count, frame size) without decoding; other processors (Qwen3-VL adds
    per-frame timestamps to the text) go through policy.encode, which decodes the frames."""
    proc, f, s = policy.processor, policy.frames, policy.s
    if type(proc).__name__ not in COUNTED_PROCESSORS:
        ids = policy.encode(record)["input_ids"]  # [1, L]
        return ids.shape[1], int((ids == proc.tokenizer.convert_tokens_to_ids(proc.video_token)).sum())
    info = video_info(record["video"], backend=f.backend)
    t = len(frame_indices(info, f))
    # the chat text exactly as VideoPolicy.encode writes it (copied: pipelines may copy, see style.md 3.7)
    text = record["prompt"] if not s.instruction else f"{record['prompt']}\n{s.instruction}"
    messages = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
    messages.append({"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]})
    chat = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    n_text = len(proc.tokenizer(chat, add_special_tokens=False)["input_ids"])
    n_video = proc._get_num_multimodal_tokens(video_sizes=[(t, info.height, info.width)]).num_video_tokens[0]
    return n_text - 1 + n_video, n_video  # the one <|video_pad|> placeholder expands to n_video tokens
