"""Tiny ShapesWorld VLMs: a Qwen2-VL trained by supervised fine-tuning on ShapesWorld VQA (`--task vqa`) or on
ShapesWorld video temporal grounding (`--task grounding`), answering `<think>...</think><answer>...</answer>`.

Prompts are built by the RL policies' own `encode` (pipelines/vlm/policy.py, pipelines/video/policy.py) with the
default instruction, so the model is trained on exactly the inputs GRPO rollouts later give it. Loss: token-mean
cross-entropy on the completion (+ <|im_end|>) only; the shipped weights are the EMA with the best validation score.

Run: nice -n 10 python -m mmgrpo_shapes.programs.pretrain_vlm --task vqa --out assets/shapes-vlm --overwrite --minutes 45
"""

import copy
import json
import math
import random
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import rewards
from mmgrpo_shapes.dense import TowerTap, batch_targets, log_losses, optimizer, stage_one
from mmgrpo_shapes.programs import pretrain_vlm_args
from mmgrpo_shapes.programs.outdir import claim, save_pretrained_whole
from mmgrpo_shapes.programs.tiny_vlm import build_model, collate, predict, weighted_sft_loss
from mmgrpo_shapes.vqa import question_template, swap_images
from mmgrpo_shapes.vqa_think import LIST_TYPES, key_token_weights, objects_think, think_text, where_record
from pipelines.video.build import FORMAT_INSTRUCTION as VIDEO_INSTRUCTION
from pipelines.video.data import shapes_video_records
from pipelines.vlm.build import FORMAT_INSTRUCTION as VQA_INSTRUCTION
from pipelines.vlm.data import shapes_vqa_records
from rewards.rules import temporal_iou

GROUNDING_TEMPLATE = "<think>Find the event.</think><answer>{start:.2f} to {end:.2f}</answer>"
"""31 tokens with the byte-level tokenizer (tags are one token each): fits configs/video's max_new_tokens=32"""
VIDEO_FRAMES = {"num_frames": 8, "shapes_frames": 24, "shapes_resolution": 64}
"""the frame settings of configs/video/shapes_grounding.yaml (8 of 24 frames at 4 fps, 64 px)"""


# ----- model
def encoder(task: str, processor) -> Any:
    """The rollout policy's `encode(record)` with its default settings, bound to `processor` (no model needed)."""
    if task == "vqa":
        # lazy: pipelines.vlm.policy imports transformers; `import pretrain_vlm` (its --help, its data) stays light
        from pipelines.vlm.policy import VLMPolicy as cls
    else:
        # lazy: pipelines.video.policy imports transformers; `import pretrain_vlm` (its --help, its data) stays light
        from pipelines.video.policy import FrameSettings
        from pipelines.video.policy import VideoPolicy as cls
    instruction = VQA_INSTRUCTION if task == "vqa" else VIDEO_INSTRUCTION
    ns = SimpleNamespace(
        processor=processor, device=torch.device("cpu"), s=SimpleNamespace(instruction=instruction, system_prompt=None)
    )
    if task == "grounding":
        ns.frames, ns.m = FrameSettings(num_frames=VIDEO_FRAMES["num_frames"]), SimpleNamespace(augment_noise=0.0)
    return lambda record: cls.encode(ns, record)


# ----- data
def target_text(task: str, record: dict[str, Any]) -> str:
    """The SFT completion: the think (vqa_think.think_text), then the answer (VQA) or the span (grounding)."""
    if task == "vqa":
        return f"<think>{think_text(record)}</think><answer>{record['answers']}</answer>"
    start, end = record["spans"]
    return GROUNDING_TEMPLATE.format(start=float(start), end=float(end))


def records(task: str, split: str, n: int, *, seed: int, resolution: int = 32) -> list[dict[str, Any]]:
    """`n` records of `split` exactly as the pipelines build them (VQA rendered at `resolution` px; grounding clips
    cached as mp4)."""
    if task == "vqa":  # the pipeline's own records, whose objects also give the dense targets
        return shapes_vqa_records(split, n, seed=seed, resolution=resolution)
    return shapes_video_records(
        split,
        n,
        seed=seed,
        types=("grounding",),
        num_frames=VIDEO_FRAMES["shapes_frames"],
        resolution=VIDEO_FRAMES["shapes_resolution"],
    )


def example(task: str, encode, tok, record: dict[str, Any]) -> dict[str, Tensor]:
    """One training example: the prompt's processor tensors plus `completion` ids (target + <|im_end|>)."""
    enc = {k: v for k, v in encode(record).items() if not k.startswith("_")}
    ids = tok(target_text(task, record), add_special_tokens=False)["input_ids"]
    enc["completion"] = torch.tensor(ids + [tok.convert_tokens_to_ids("<|im_end|>")])
    return enc


# ----- evaluation
def score(task: str, texts: list[str], recs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per-category means of the pipelines' rewards: format (strict) and accuracy (VQA) or temporal IoU + R@0.5."""
    fmt = rewards.load("format", mode="strict")([t for t in texts], prompts=None).tolist()
    if task == "vqa":
        main = {"accuracy": rewards.load("accuracy")(texts, prompts=None, answers=[r["answers"] for r in recs])}
    else:
        iou = rewards.load("temporal_iou")(texts, prompts=None, spans=[r["spans"] for r in recs])
        main = {"miou": iou, "r@0.5": (torch.as_tensor(iou) >= 0.5).float()}
    cols = {"format": fmt, **{k: torch.as_tensor(v).tolist() for k, v in main.items()}}
    table: dict[str, dict[str, float]] = {}
    for cat in ["all"] + sorted({str(r.get("category", "all")) for r in recs}):
        idx = [i for i, r in enumerate(recs) if cat == "all" or str(r.get("category")) == cat]
        if task == "grounding" and cat != "all":  # split grounding queries into "move" and "visible"
            continue
        table[cat] = {k: sum(v[i] for i in idx) / len(idx) for k, v in cols.items()} | {"n": len(idx)}
    if task == "grounding":
        for kind in ("move", "visible"):
            idx = [i for i, r in enumerate(recs) if kind in r["question"]]
            if idx:
                table[kind] = {k: sum(v[i] for i in idx) / len(idx) for k, v in cols.items()} | {"n": len(idx)}
    return table


def evaluate(
    path_or_model, task: str, split: str = "test", n: int = 200, *, seed: int = 0, processor=None, images: str = "real"
) -> dict[str, dict[str, float]]:
    """Greedy per-category scores of a saved folder (or a model + processor) on `n` fixed records of `split`, with
    their real images or the blank / shuffled ones of `swap_images`."""
    if isinstance(path_or_model, str | Path):
        # lazy: transformers is heavy to import; only loading a saved model needs it
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(path_or_model)
        model = AutoModelForImageTextToText.from_pretrained(path_or_model)
    else:
        model = path_or_model
    recs = records(task, split, n, seed=seed)
    texts = predict(
        model,
        encoder(task, processor),
        processor.tokenizer,
        swap_images(recs, images),
        max_new_tokens=24 if task == "vqa" else 32,
    )
    return score(task, texts, recs)


def blind_baseline(
    task: str, split: str = "test", n: int = 300, *, n_train: int = 3000, by: str = "template"
) -> dict[str, dict]:
    """Scores of the best image-blind answer per question template (by="template"; by="type": per question type,
    i.e. the answer prior of each type), fitted on n_train train records: the majority answer (VQA) or the constant
    span on a 0.25 s grid with the highest mean IoU (grounding)."""

    def key(r: dict[str, Any]) -> str:
        return question_template(r["prompt"]) if by == "template" else str(r.get("category"))

    train_by = defaultdict(list)
    for r in records(task, "train", n_train, seed=0):
        train_by[key(r)].append(r["answers"] if task == "vqa" else r["spans"])
    fallback = [a for v in train_by.values() for a in v]
    grid = [(a / 4, b / 4) for a in range(25) for b in range(a + 1, 25)]
    best = {}
    for k, answers in list(train_by.items()) + [("", fallback)]:
        if task == "vqa":
            best[k] = Counter(answers).most_common(1)[0][0]
        else:
            best[k] = max(grid, key=lambda span: sum(temporal_iou(span, g) for g in answers))
    recs = records(task, split, n, seed=0)
    texts = []
    for r in recs:
        guess = best.get(key(r), best[""])
        rec = {**r, "answers": guess} if task == "vqa" else {"spans": guess}  # the think may read the record
        texts.append(target_text(task, rec))
    return score(task, texts, recs)


def format_table(table: dict[str, dict[str, float]]) -> str:
    cols = [c for c in next(iter(table.values())) if c != "n"]
    lines = [f"{'category':<12}{'n':>5}" + "".join(f"{c:>10}" for c in cols)]
    lines += [f"{cat:<12}{int(row['n']):>5}" + "".join(f"{row[c]:>10.3f}" for c in cols) for cat, row in table.items()]
    return "\n".join(lines)


# ----- training
def train_stream(
    task: str, *, seed: int, chunk: int = 512, pool: int = 3000, types=None, blank=(), where=0.0, list_think=False
):
    """Endless training records: fresh VQA chunks of the train split (new seed each; only question `types` if given;
    the `blank` types on a blank canvas with no objects; a `where` fraction asked as vqa_think.where_record; with
    `list_think` count, existence and arithmetic think the scene's object list, vqa_think.objects_think, its marks
    flagged for the question when it is "flags"), or a
    cycled pool of clips."""
    if task == "grounding":
        recs = records(task, "train", pool, seed=seed)
        rng = random.Random(seed)
        while True:
            rng.shuffle(recs)
            yield from recs
    k, rng = 0, np.random.default_rng(seed)
    while True:
        for r in records(task, "train", chunk, seed=1000 * (seed + 1) + k):
            if where and rng.random() < where and r["category"] not in blank:
                r = where_record(r, rng) or r
            if list_think and r["category"] in LIST_TYPES:
                r = dict(r, think=objects_think(r["objects"], r["prompt"] if list_think == "flags" else None))
            if r["category"] in (blank or ()):  # the format and the answer prior, nothing to read from the pixels
                # the think is fixed before the objects go: a blank position question keeps its scene's cell marks
                r = dict(swap_images([r], "blank")[0], objects=[], think=think_text(r))
            if not types or r["category"] in types:
                yield r
        k += 1


def args_stream(args):
    """train_stream with the flags of pretrain_vlm_args."""
    kw = {"types": args.sft_types, "blank": args.blank_types, "where": args.where, "list_think": args.list_think}
    return train_stream(args.task, seed=args.seed, pool=args.pool, **kw)


def main_key(task: str) -> str:
    return "accuracy" if task == "vqa" else "miou"


def main_metric(task: str, table: dict[str, dict[str, float]]) -> float:
    return table["all"][main_key(task)]


def validate(
    args,
    ema: nn.Module,
    processor,
    encode,
    val: list[dict[str, Any]],
    info: dict[str, Any],
    *,
    step: int,
    minutes: float,
) -> None:
    """Score the EMA model on the val sample; save it to args.out when best so far (and not above --ceiling)."""
    table = score_model(ema, processor, encode, args.task, val)
    metric = main_metric(args.task, table)
    info["evals"].append({"step": step, "minutes": round(minutes, 2), "val": table})
    cats = " ".join(f"{c} {row[main_key(args.task)]:.2f}" for c, row in table.items() if c != "all")
    print(f"step {step} ({minutes:.1f} min) val {metric:.3f} format {table['all']['format']:.3f} ({cats})", flush=True)
    ok = args.ceiling is None or metric <= args.ceiling
    if ok and (info["best"] is None or metric > info["best"]["val"]):
        info["best"] = {"step": step, "minutes": round(minutes, 2), "val": metric}
        save_pretrained_whole(ema, processor, args.out, info)


def sft_step(
    args, model: nn.Module, ema: nn.Module, opt, head, tap, encode, tok, recs: list[dict[str, Any]], step: int
) -> tuple[float, list[float] | None]:
    """One SFT update on `recs` (+ the dense loss on the same images with a head), then the EMA update. Returns the
    loss and, with a head, [dense loss, colour accuracy, shape accuracy] on the batch's object cells."""
    model.train()
    batch = [example(args.task, encode, tok, r) for r in recs]
    if args.task == "vqa" and args.key_weight != 1.0:
        for b in batch:
            b["weights"] = key_token_weights(tok.convert_ids_to_tokens(b["completion"].tolist()), args.key_weight)
    inputs, labels = collate(batch, tok.pad_token_id)
    loss = weighted_sft_loss(model, inputs, labels, batch)
    dense_log = None
    if head is not None:
        color, shape = batch_targets([r["objects"] for r in recs], tap.tokens.shape[0] // len(recs))
        dense, acc = head.loss(tap.tokens, color, shape)
        loss = loss + args.dense_weight * dense
        dense_log = [float(dense.detach()), acc["color"], acc["shape"], acc.get("position", 0.0)]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    decay = min(args.ema, (1 + step) / (10 + step))  # short warm-up so early evals are not of the init
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1 - decay)
    return float(loss.detach()), dense_log


def schedule(args, step: int, time_frac: float, since_eval: float) -> tuple[float, bool]:
    """The share of the budget spent (steps with --steps, else wall time) and whether a validation is due. --steps
    makes the run the same on any machine; the wall-clock budget does not."""
    if args.steps:
        return step / args.steps, step % args.eval_every == 0
    return time_frac, since_eval >= 60 * args.eval_minutes


def train(args) -> dict[str, Any]:
    """SFT for args.steps steps (or, with --steps 0, args.minutes of wall time); every args.eval_every steps (or
    args.eval_minutes) the EMA model is scored on a fixed val sample and saved to args.out when it is the best so far
    (and, with --ceiling, not above the band's ceiling)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, processor = build_model(
        args.task,
        hidden=args.hidden,
        layers=args.layers,
        vision_dim=args.vision_dim,
        vision_depth=args.vision_depth,
        pixels=args.pixels,
        seed=args.seed,
    )
    tok = processor.tokenizer
    encode = encoder(args.task, processor)
    start = time.time()  # --minutes counts stage 1 too
    stream = args_stream(args)
    head, tower_log = stage_one(args, model, processor, stream)  # the tower alone on the dense targets
    ema = copy.deepcopy(model).requires_grad_(False)
    tap = TowerTap(model) if head is not None else None  # after the copy: the EMA model carries no hook
    opt = optimizer(args, model, head)
    val = records(args.task, "val", args.val_n, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    info: dict[str, Any] = {"args": vars(args), "params": n_params, "losses": [], "evals": [], "best": None}
    if tower_log:
        info["tower"] = tower_log
    print(f"{args.task}: {n_params:,} parameters", flush=True)
    t0, last_eval, step, run_loss, run_dense = time.time(), time.time(), 0, [], []
    budget = 60 * args.minutes - (time.time() - start)
    while True:
        elapsed = time.time() - t0
        progress, due = schedule(args, step, elapsed / budget, time.time() - last_eval)
        done = progress >= 1.0
        if done or (step and due):
            validate(args, ema, processor, encode, val, info, step=step, minutes=elapsed / 60)
            last_eval = time.time()
            if done:
                break
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))  # cosine to 10% over the budget
        for group in opt.param_groups:
            group["lr"] = lr * group["mult"]
        loss, dense = sft_step(
            args, model, ema, opt, head, tap, encode, tok, [next(stream) for _ in range(args.batch)], step
        )
        step += 1
        run_loss.append(loss)
        run_dense += [dense] if dense else []
        if step % 25 == 0:
            log_losses(info, step, t0, lr, run_loss, run_dense)
            run_loss, run_dense = [], []
    info["train_minutes"] = round((time.time() - t0) / 60, 1)
    info["steps"] = step
    if info["best"] is not None:
        (Path(args.out) / "train_log.json").write_text(json.dumps(info, indent=1))
    return info


def score_model(model, processor, encode, task: str, recs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    texts = predict(model, encode, processor.tokenizer, recs, max_new_tokens=24 if task == "vqa" else 32)
    return score(task, texts, recs)


def parse_args(argv: list[str] | None = None):
    return pretrain_vlm_args.parse_args(argv, __doc__)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    claim(args.out, args.overwrite, "pretrain_vlm")
    info = train(args)
    print(f"trained {info['steps']} steps in {info['train_minutes']} min; best {info['best']}", flush=True)
    if args.test_n and info["best"] is not None:
        t = time.time()
        table = evaluate(args.out, args.task, "test", args.test_n)
        print(format_table(table), flush=True)
        info["test"] = table
        info["test_eval_seconds"] = round(time.time() - t, 1)
        if args.task == "vqa":
            info["test_blank"] = blank = evaluate(args.out, args.task, "test", args.test_n, images="blank")
            print(f"blank images:\n{format_table(blank)}", flush=True)
        info["test_blind_baseline"] = blind = blind_baseline(args.task, "test", args.test_n, n_train=args.pool)
        print("image-blind baseline (best answer per question template, fitted on train):", flush=True)
        print(format_table(blind), flush=True)
        (Path(args.out) / "train_log.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
