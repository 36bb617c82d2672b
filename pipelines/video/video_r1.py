"""Video-R1's data format (Video-R1-260k.json: a JSON list of {problem_id, problem, data_type, problem_type, options,
solution: "<answer>B</answer>", path, data_source}) converted to the video pipeline's JSONL rows
({video, question, answer, type}), so configs/video/qwen25vl_7b_video_r1.yaml trains on it as published.

As Video-R1's own prompt, a multiple-choice question carries its options after the problem ("Options:" then one per
line); the answer is the solution's <answer> text. Image rows (data_type "image") are left out: this pipeline is
video-only. problem_type maps to the rewards the pipeline routes by: "multiple choice" -> multiple_choice (option
letter), "numerical" and "regression" -> numeric, "OCR" and "free-form" -> free_form (answer match).

Run: python -m pipelines.video.video_r1 Video-R1-data/Video-R1-260k.json data/video_r1/train.jsonl
"""

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from mmgrpo.errors import UserError

TYPES = {
    "multiple choice": "multiple_choice",
    "numerical": "numeric",
    "regression": "numeric",
    "ocr": "free_form",
    "free-form": "free_form",
}


def convert_row(row: Any, where: str) -> dict[str, Any] | None:
    """One Video-R1 row as a pipeline row, or None for an image row."""
    if not isinstance(row, dict):
        raise UserError(
            f"{where}: expected a Video-R1 object with problem, problem_type, solution and path, got "
            f"{type(row).__name__}"
        )
    if str(row.get("data_type", "video")).lower() == "image":
        return None
    for key in ("problem", "problem_type", "solution", "path"):
        if not isinstance(row.get(key), str):
            raise UserError(
                f"{where}: field {key!r} must be a string, got {row.get(key)!r}; Video-R1 rows have "
                f"problem, problem_type, solution ('<answer>...</answer>') and path"
            )
    kind = TYPES.get(row["problem_type"].strip().lower())
    if kind is None:
        raise UserError(f"{where}: problem_type {row['problem_type']!r} is not one of {sorted(TYPES)}")
    found = re.findall(r"<answer>(.*?)</answer>", row["solution"], flags=re.DOTALL)
    answer = (found[-1] if found else row["solution"]).strip()
    question = row["problem"].strip()
    options = row.get("options") or []
    if kind == "multiple_choice":
        if not options or not all(isinstance(o, str) for o in options):
            raise UserError(f"{where}: a multiple-choice row needs options ['A. ...', 'B. ...'], got {options!r}")
        question += "\nOptions:\n" + "\n".join(o.strip() for o in options)
    out = {"video": row["path"], "question": question, "answer": answer, "type": kind}
    if row.get("problem_id") is not None:
        out["id"] = str(row["problem_id"])
    return out


def convert(src: str | Path, dst: str | Path) -> tuple[int, int]:
    """Write the video rows of a Video-R1 JSON list (or JSONL) to `dst` as JSONL; returns (written, image rows
    left out). Relative `path`s are made relative to `dst`'s folder, so the rows find their videos."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise UserError(f"{src} is not a file; pass Video-R1-260k.json (a JSON list) or a JSONL of its rows")
    text = src.read_text()
    try:
        rows = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [json.loads(x) for x in text.splitlines() if x.strip()]
        )
    except json.JSONDecodeError as err:
        raise UserError(
            f"{src}: not valid JSON ({err.msg} at line {err.lineno}); pass the Video-R1 JSON list"
        ) from None
    dst.parent.mkdir(parents=True, exist_ok=True)
    written = skipped = 0
    with open(dst, "w") as f:
        for i, row in enumerate(rows):
            out = convert_row(row, f"{src}[{i}]")
            if out is None:
                skipped += 1
                continue
            video = Path(out["video"])
            if not video.is_absolute():  # Video-R1's paths are relative to the JSON's folder
                out["video"] = str((src.parent / video).resolve())
            f.write(json.dumps(out) + "\n")
            written += 1
    return written, skipped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="Video-R1-260k.json (or any JSON list / JSONL of Video-R1 rows)")
    p.add_argument("dst", help="the JSONL to write (pipeline.kwargs.data)")
    args = p.parse_args(argv)
    try:
        written, skipped = convert(args.src, args.dst)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written} video rows to {args.dst} ({skipped} image rows left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
