"""Is a ShapesWorld video model looking? Re-score it with blank, other-clip and shuffled frames, and measure how far
the vision tower's output and the next-token log-probs move when the frames are blanked; a linear probe reads the
visible colours of each temporal token group from the tower's output.

All inputs go through `VideoPolicy.encode` (the rollouts' prompt and frame path); "blank" swaps each record's video
for a clip of the same length with no objects, "other" for the next record's video, "shuffled" permutes the frames
(T-GRPO's `shuffle_order`).

Run: python -m mmgrpo_shapes.programs.video_probe assets/shapes-video --frames 32 --n 200
"""

import argparse
import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import rewards
from mmgrpo_shapes.programs.pretrain_vlm import GROUNDING_TEMPLATE, predict
from mmgrpo_shapes.scenes import COLORS
from mmgrpo_shapes.video import VIDEO_TYPES, Clip, write_mp4
from pipelines.video.build import FORMAT_INSTRUCTION
from pipelines.video.data import SHAPES_TASKS, finish, parse_row, shapes_video_dir

CONDITIONS = ("real", "blank", "other", "shuffled")


def frame_encoder(processor, num_frames: int, *, shuffle: bool = False):
    """The rollout policy's `encode(record)` (default instruction, `num_frames` uniform frames), bound to `processor`."""
    # lazy: pipelines.video.policy imports transformers; importing the probe's helpers (pretrain_video) stays light
    from pipelines.video.policy import FrameSettings, VideoPolicy

    ns = SimpleNamespace(
        processor=processor,
        device=torch.device("cpu"),
        frames=FrameSettings(num_frames=num_frames),
        s=SimpleNamespace(instruction=FORMAT_INSTRUCTION, system_prompt=None),
        m=SimpleNamespace(augment_noise=0.0),
    )
    if shuffle:
        return lambda rec: VideoPolicy.encode(ns, rec, shuffle_seed=hash(rec["id"]) % 2**31)
    return lambda rec: VideoPolicy.encode(ns, rec)


def blank_video(num_frames: int, fps: int, resolution: int, out_dir: str | Path) -> str:
    """An mp4 of `num_frames` background-only frames (a clip with no objects), written once under `out_dir`."""
    path = Path(out_dir) / f"blank-f{num_frames}-fps{fps}-r{resolution}.mp4"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_mp4(path, Clip((), num_frames, fps, resolution).frames(), fps)
    return str(path)


def condition_records(recs: list[dict[str, Any]], condition: str, *, blank: str) -> list[dict[str, Any]]:
    """The records with their frames swapped for `condition` ("real" and "shuffled" keep them)."""
    if condition == "blank":
        return [{**r, "video": blank} for r in recs]
    if condition == "other":  # the next record's clip: real frames, the wrong ones
        return [{**r, "video": recs[(i + 1) % len(recs)]["video"]} for i, r in enumerate(recs)]
    return list(recs)


def _inputs(enc: dict[str, Any]) -> dict[str, Tensor]:
    return {k: v for k, v in enc.items() if not k.startswith("_")}


@torch.no_grad()
def tower_features(model: nn.Module, enc: dict[str, Tensor]) -> Tensor:
    """[G, M, D] merged vision tokens of one encoded clip: G temporal groups, M = tokens per group, D = LM width."""
    out = model.model.get_video_features(enc["pixel_values_videos"], enc["video_grid_thw"])
    feats = out.pooler_output[0]  # [G * M, D]
    g = int(enc["video_grid_thw"][0, 0])
    return feats.reshape(g, -1, feats.shape[-1])  # [G, M, D]


@torch.no_grad()
def target_logprobs(model: nn.Module, enc: dict[str, Tensor], target: Tensor) -> Tensor:
    """[K] log p(target_k | prompt, target_<k) of a completion (ids [K]) under one encoded prompt."""
    ids = torch.cat([enc["input_ids"], target[None]], 1)  # [1, P + K]
    inputs = {**enc, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "mm_token_type_ids" in enc:
        inputs["mm_token_type_ids"] = nn.functional.pad(enc["mm_token_type_ids"], (0, target.shape[0]))
    logits = model(**inputs).logits[0, enc["input_ids"].shape[1] - 1 : -1].float()  # [K, V]
    return logits.log_softmax(-1).gather(1, target[:, None])[:, 0]  # [K]


def lifetimes(timeline: list[dict[str, Any]], num_frames: int) -> dict[str, tuple[int, int]]:
    """object name -> (appear, disappear) frames of a clip's timeline (visible on [appear, disappear))."""
    life: dict[str, list[int]] = {}
    for e in timeline:
        span = life.setdefault(e["object"], [0, num_frames])
        if e["event"] == "appears":
            span[0] = e["start_frame"]
        elif e["event"] == "disappears":
            span[1] = e["start_frame"]
    return {k: (a, d) for k, (a, d) in life.items()}


def visible_colours(timeline: list[dict[str, Any]], frame_ids: list[int], num_frames: int) -> np.ndarray:
    """[G, C] 0/1: colour c is visible on either frame of temporal group g, the sampled frames taken in pairs."""
    pairs = np.asarray(frame_ids).reshape(-1, 2)  # [G, 2] the frames each temporal patch holds
    out = np.zeros((len(pairs), len(COLORS)), dtype=np.float32)
    for obj, (a, d) in lifetimes(timeline, num_frames).items():
        c = list(COLORS).index(obj.split()[0])
        out[:, c] = ((pairs >= a) & (pairs < d)).any(1)
    return out


def linear_probe(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, *, steps: int = 300) -> float:
    """Balanced accuracy (mean of per-label TPR and TNR) of a logistic-regression probe, multi-label targets."""
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
    head = nn.Linear(x_train.shape[1], y_train.shape[1])
    opt = torch.optim.Adam(head.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        loss = nn.functional.binary_cross_entropy_with_logits(head((x_train - mu) / sd), y_train)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = head((x_test - mu) / sd) > 0  # [N, C]
    pos, neg = y_test > 0.5, y_test < 0.5
    tpr = (pred & pos).sum() / pos.sum().clamp(min=1)
    tnr = (~pred & neg).sum() / neg.sum().clamp(min=1)
    return float((tpr + tnr) / 2)


def _frame_ids(enc: dict[str, Any], rec: dict[str, Any]) -> list[int]:
    fps = rec["num_frames"] / rec["duration"]
    return [round(float(t) * fps) for t in enc["_timestamps"]]


def set_records(out: str | Path, split: str) -> list[dict[str, Any]]:
    """Records of a written ShapesWorld video set as the pipeline builds them (pipelines/video/data.py), plus the
    row's `type` (grounding/direction/order/count), `timeline` and `num_frames` for per-type scores and probes."""
    recs = []
    for line in (Path(out) / f"{split}.jsonl").read_text().splitlines():
        row = json.loads(line)
        kind = row["type"]
        rec = finish(
            parse_row({**row, "type": SHAPES_TASKS[kind]}, f"{out}/{split}.jsonl:{row['id']}", Path(out)),
            time_prompt=True,
        )
        recs.append(rec | {"type": kind, "timeline": row["timeline"], "num_frames": row["num_frames"]})
    return recs


def pipeline_records(
    split: str, n: int, *, types: tuple[str, ...], num_frames: int, seed: int = 0, resolution: int = 64
) -> list[dict[str, Any]]:
    """The `n` records `data: shapes_video` gives a recipe (one question per clip), with type and timeline."""
    out = shapes_video_dir(
        split, n, seed=seed, types=tuple(types), num_frames=num_frames, fps=4, resolution=resolution, cache_dir=None
    )
    return set_records(out, split)


def probe_tower(model: nn.Module, encode, train: list[dict], test: list[dict]) -> dict[str, float]:
    """Balanced accuracy of linear probes for 'colour c visible in temporal group g': on each group's merged tokens
    (concatenated) of this model's tower, and of a tower with the same architecture and random weights."""

    def data(m, recs):
        xs, ys = [], []
        for r in recs:
            enc = encode(r)
            xs.append(tower_features(m, enc).flatten(1))  # [G, M * D]
            ys.append(torch.from_numpy(visible_colours(r["timeline"], _frame_ids(enc, r), r["num_frames"])))
        return torch.cat(xs), torch.cat(ys)

    rand = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for mod in rand.model.visual.modules():
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
    return {name: linear_probe(*data(m, train), *data(m, test)) for name, m in (("trained", model), ("random", rand))}


def diagnose(
    model: nn.Module, processor, recs: list[dict[str, Any]], *, num_frames: int, blank: str, targets: list[str]
) -> dict[str, float]:
    """Relative change of the tower's output and mean |change| of the target completions' per-token log-probs when
    each record's frames are blanked (real vs blank), over `recs` with their SFT targets."""
    encode, tok = frame_encoder(processor, num_frames), processor.tokenizer
    rel, dlogp, maxd = [], [], []
    for r, text in zip(recs, targets):
        real, empty = encode(r), encode({**r, "video": blank})
        fr, fb = tower_features(model, real), tower_features(model, empty)
        rel.append(float((fr - fb).norm() / fr.norm()))
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        d = (target_logprobs(model, _inputs(real), ids) - target_logprobs(model, _inputs(empty), ids)).abs()
        dlogp.append(float(d.mean()))
        maxd.append(float(d.max()))
    return {
        "tower_rel_change": float(np.mean(rel)),
        "target_logp_abs_change": float(np.mean(dlogp)),
        "target_logp_max_abs_change": float(np.max(maxd)),
        "n": len(recs),
    }


def main(argv: list[str] | None = None) -> None:
    # lazy: transformers is heavy to import; only loading the probed model needs it
    from transformers import AutoModelForImageTextToText, AutoProcessor

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--frames", type=int, default=32, help="frames sampled per clip (the recipe's num_frames)")
    p.add_argument("--clip-frames", type=int, default=32, help="frames per clip (the recipe's shapes_frames)")
    p.add_argument("--types", default="grounding", help="comma-separated question types")
    p.add_argument("--n", type=int, default=100, help="test records for the conditions and the log-prob change")
    p.add_argument("--probe-n", type=int, default=150, help="train clips for the linear probe (test: --n // 2)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    types = tuple(t for t in args.types.split(",") if t in VIDEO_TYPES)
    processor = AutoProcessor.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model).eval()
    recs = pipeline_records("test", args.n, types=types, num_frames=args.clip_frames)
    blank = blank_video(args.clip_frames, 4, 64, Path.home() / ".cache" / "mmgrpo" / "blank")
    encode = frame_encoder(processor, args.frames)
    report: dict[str, Any] = {"args": vars(args)}
    texts = {}
    for cond in CONDITIONS:
        enc = frame_encoder(processor, args.frames, shuffle=cond == "shuffled")
        texts[cond] = predict(
            model, enc, processor.tokenizer, condition_records(recs, cond, blank=blank), max_new_tokens=32
        )
    report["identical_to_real"] = {
        c: float(np.mean([a == b for a, b in zip(texts["real"], texts[c])])) for c in CONDITIONS[1:]
    }
    if "grounding" in types:
        for cond in CONDITIONS:
            ious = [temporal_iou_text(t, r["spans"]) for t, r in zip(texts[cond], recs)]
            report[f"miou_{cond}"] = float(np.mean(ious))
        tgt = [GROUNDING_TEMPLATE.format(start=r["spans"][0], end=r["spans"][1]) for r in recs]
    else:
        tgt = [f"<think>Look.</think><answer>{r['answers']}</answer>" for r in recs]
    report["blank_change"] = diagnose(
        model, processor, recs[:50], num_frames=args.frames, blank=blank, targets=tgt[:50]
    )
    train = pipeline_records("train", args.probe_n, types=types, num_frames=args.clip_frames)
    report["probe_visible_colour"] = probe_tower(model, encode, train, recs[: max(args.n // 2, 20)])
    print(json.dumps(report, indent=1), flush=True)


def temporal_iou_text(text: str, span) -> float:
    return float(rewards.load("temporal_iou")([text], prompts=None, spans=[span])[0])


if __name__ == "__main__":
    main()
