"""The tiny ShapesWorld video model: one Qwen2-VL trained by supervised fine-tuning on temporal grounding ("When does
the red square move left?" -> `<answer>2.50 to 3.50</answer>`) and video QA (direction, order, count), with a dense
per-frame loss on the vision tower so that it is made to see.

Why the dense loss: trained only through short answers, the previous model's tower output moved ~1% between real
and blank frames and its answers did not change at all (assets/README.md). Here a linear head on the merged vision
tokens of each temporal group (2 frames) predicts, for every colour, whether an object of that colour is absent,
still, or moving left / right / up / down there; the head is dropped at save time (the shipped folder is a plain
Qwen2-VL). Clips are fully sampled (32 of 32 frames = 16 temporal groups of 0.5 s), and the data's events sit on
frame pairs (mmgrpo_shapes/video.py), so each group is wholly inside or outside an event.

Prompts are built by the video policy's own `encode` (the rollouts' inputs); the training pool is written once with
every question of each clip (`make_video_set(all_questions=True)`) and each clip's pixels are encoded once.

Run: OMP_NUM_THREADS=1 python -m mmgrpo_shapes.programs.pretrain_video --out assets/shapes-video --overwrite --minutes 60
"""

import argparse
import copy
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmgrpo_shapes.programs.outdir import claim, save_pretrained_whole
from mmgrpo_shapes.programs.tiny_vlm import add_architecture_args, build_model, collate, weighted_sft_loss
from mmgrpo_shapes.programs.video_eval import NUM_FRAMES, blind_baselines, evaluate, format_table
from mmgrpo_shapes.programs.video_probe import (
    blank_video,
    frame_encoder,
    lifetimes,
    pipeline_records,
    set_records,
)
from mmgrpo_shapes.scenes import BACKGROUND, COLORS
from mmgrpo_shapes.video import DIRECTIONS, SET_VERSION, VIDEO_TYPES, make_video_set
from mmgrpo_shapes.video_think import target_text
from pipelines.video.build import FORMAT_INSTRUCTION

PIXELS = 56 * 56
"""min = max pixels per frame: a 64 px frame becomes 4 x 4 patches of 14 px, merged 2 x 2 into 4 tokens a group"""
STATES = ("absent", "still") + tuple(f"moving {d}" for d in DIRECTIONS)
"""per colour and temporal group: the dense target of the vision head"""
ABSENT_WEIGHT = 0.1
"""class weight of "absent" in the dense loss: ~94% of (group, colour) cells are absent, and unweighted the head
learns the prior (pilot: held-out recall of visible cells 0.0 after 30 steps; weighted 0.1: 0.91)"""
BLANK_THINK = "Watch it."
"""the fixed think of --blank-types questions (no time line: a line written on blank frames would teach "-" marks)"""
PIXEL_STD = 0.25
"""the processor normalises pixels as (x - background) / PIXEL_STD: the grey background becomes 0, so an empty patch
embeds to 0 (the patch embedding has no bias) and a small object is the whole signal (CLIP's mean/std left the tower
output within ~1% of its blank-frame value: assets/README.md)"""


def pool_dir(split: str, n: int, *, seed: int = 0) -> Path:
    """A training pool: `n` clips of `split` with every question of every type, written once under the cache."""
    root = Path(os.environ.get("MMGRPO_CACHE") or Path.home() / ".cache" / "mmgrpo")
    out = root / f"shapes_video_pool-v{SET_VERSION}-{split}-n{n}-s{seed}-f{NUM_FRAMES}"
    if not (out / f"{split}.jsonl").is_file():
        tmp = root / f".{out.name}.tmp{os.getpid()}"
        make_video_set(split, n, tmp, seed=seed, num_frames=NUM_FRAMES, all_questions=True)
        os.replace(tmp, out)
    return out


def dense_states(timeline: list[dict[str, Any]], num_frames: int) -> Tensor:
    """[G, C] long: per temporal group g (frames 2g, 2g + 1) and colour c, the index in STATES (absent, still, moving
    <direction>). A group is "moving" when its first frame is inside the move [move_start, move_end)."""
    groups = num_frames // 2
    out = torch.zeros(groups, len(COLORS), dtype=torch.long)  # [G, C]
    moves = {e["object"]: e for e in timeline if e["event"].startswith("moves")}
    for obj, (a, d) in lifetimes(timeline, num_frames).items():
        c, mv = list(COLORS).index(obj.split()[0]), moves[obj]
        for g in range(groups):
            if not (a < 2 * g + 2 and d > 2 * g):
                continue
            moving = mv["start_frame"] <= 2 * g < mv["end_frame"]
            out[g, c] = STATES.index(f"moving {mv['event'][6:]}") if moving else 1
    return out


class Examples:
    """Training examples of a pool: each clip's pixels encoded once by the policy's `encode`, each question's ids
    made by the same chat template with the clip's video-token count (checked equal to `encode` in the tests)."""

    def __init__(self, processor, recs: list[dict[str, Any]], *, key_weight: float = 1.0, blank=(), blank_video=""):
        self.key_weight, self.blank, self.blank_video = key_weight, tuple(blank), blank_video
        self.processor, self.tok = processor, processor.tokenizer
        self.encode = frame_encoder(processor, NUM_FRAMES)
        self.recs, self.clips = recs, {}
        self.by_type = {t: [i for i, r in enumerate(recs) if r["type"] == t] for t in VIDEO_TYPES}
        self.video_id = self.tok.convert_tokens_to_ids("<|video_pad|>")

    def prompt_ids(self, rec: dict[str, Any], n_video: int) -> Tensor:
        messages = [
            {
                "role": "user",
                "content": [{"type": "video"}, {"type": "text", "text": f"{rec['prompt']}\n{FORMAT_INSTRUCTION}"}],
            }
        ]
        chat = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor(self.tok(chat, add_special_tokens=False)["input_ids"])
        at = int((ids == self.video_id).nonzero()[0])
        return torch.cat([ids[:at], torch.full((n_video,), self.video_id), ids[at + 1 :]])[None]  # [1, P]

    def __call__(self, i: int) -> dict[str, Tensor]:
        rec, blank = self.recs[i], self.recs[i]["type"] in self.blank
        if blank:  # the format and the answer prior, nothing to read from the frames
            rec = {**rec, "video": self.blank_video, "timeline": []}
        if rec["video"] not in self.clips:
            enc = self.encode(rec)
            self.clips[rec["video"]] = (
                enc["pixel_values_videos"],
                enc["video_grid_thw"],
                int((enc["input_ids"] == self.video_id).sum()),
                dense_states(rec["timeline"], rec["num_frames"]),
            )
        pixels, grid, n_video, states = self.clips[rec["video"]]
        ids = self.prompt_ids(rec, n_video)
        types = (ids == self.video_id).long() * 2  # [1, P] mm_token_type_ids: 2 marks video tokens
        target = f"<think>{BLANK_THINK}</think><answer>{rec['answers']}</answer>" if blank else target_text(rec)
        done = self.tok(target, add_special_tokens=False)["input_ids"] + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        weights = key_token_weights(self.tok.convert_ids_to_tokens(done), self.key_weight)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": types,
            "pixel_values_videos": pixels,
            "video_grid_thw": grid,
            "completion": torch.tensor(done),
            "weights": weights,
            "states": states,
        }

    def batch(self, rng: random.Random, size: int, mix: dict[str, float]) -> list[dict[str, Tensor]]:
        kinds = rng.choices(list(mix), weights=list(mix.values()), k=size)
        return [self(rng.choice(self.by_type[k])) for k in kinds]


class DenseHead(nn.Module):
    """Linear map from a temporal group's merged vision tokens [M * D] to STATES logits for each colour."""

    def __init__(self, tokens: int, width: int):
        super().__init__()
        self.proj = nn.Linear(tokens * width, len(COLORS) * len(STATES))

    def forward(self, feats: Tensor) -> Tensor:
        b, g = feats.shape[:2]  # feats [B, G, M, D]
        return self.proj(feats.flatten(2)).view(b, g, len(COLORS), len(STATES))  # [B, G, C, S]


KEY_PLAIN = frozenset("0123456789.-+")
"""think characters that the time line's layout decides (the group labels, absent "-", present "+"): weight 1"""


def key_token_weights(tokens: list[str], key_weight: float) -> Tensor:
    """[T] loss weight of each completion token: `key_weight` for the tokens that decide the answer (every token of
    <answer>...</answer>, and the think's marks other than the layout's digits, ".", "-", "+": direction's arrows, order's
    initials and "="), 1 elsewhere. Why: at 1 the arrows were 2-6 of ~90 tokens and the model wrote them at chance
    (teacher-forced, the shipped model puts 85% of the mass on arrows but at most 0.29 on any one of the four)."""
    out, inside, think = [], False, False
    for t in tokens:
        if t in ("<answer>", "</answer>", "<think>", "</think>"):
            inside, think = t == "<answer>", t == "<think>"
            out.append(1.0)
            continue
        out.append(key_weight if inside or (think and t not in KEY_PLAIN) else 1.0)
    return torch.tensor(out)


def losses(model: nn.Module, head: DenseHead, batch: list[dict[str, Tensor]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(SFT token-mean cross-entropy of the completions, dense per-group state cross-entropy) of one batch."""
    grabbed = []
    hook = model.model.visual.register_forward_hook(lambda m, i, out: grabbed.append(out.pooler_output))
    try:
        inputs, labels = collate(batch, pad_id)
        sft = weighted_sft_loss(model, inputs, labels, batch)
    finally:
        hook.remove()
    g = int(batch[0]["video_grid_thw"][0, 0])
    feats = grabbed[0].view(len(batch), g, -1, grabbed[0].shape[-1])  # [B, G, M, D]
    states = torch.stack([b["states"] for b in batch])  # [B, G, C]
    logits = head(feats)  # [B, G, C, S]
    weight = torch.tensor([ABSENT_WEIGHT] + [1.0] * (len(STATES) - 1))
    dense = nn.functional.cross_entropy(logits.reshape(-1, len(STATES)), states.reshape(-1), weight=weight)
    return sft, dense


def build(args):
    """The model and processor: pretrain_vlm's architecture, frames normalised around the background (PIXEL_STD), and
    with --init-lm every weight outside the vision tower copied from a saved Qwen2-VL of that architecture."""
    model, processor = build_model(
        "grounding",
        hidden=args.hidden,
        layers=args.layers,
        vision_dim=args.vision_dim,
        vision_depth=args.vision_depth,
        pixels=PIXELS,
        seed=args.seed,
    )
    for proc in (processor.video_processor, processor.image_processor):
        proc.image_mean, proc.image_std = [c / 255 for c in BACKGROUND], [PIXEL_STD] * 3
    if args.init_lm:
        # lazy: transformers is heavy to import; only --init-lm loads a saved model
        from transformers import AutoModelForImageTextToText

        src = AutoModelForImageTextToText.from_pretrained(args.init_lm)
        model.model.language_model.load_state_dict(src.model.language_model.state_dict())
        model.lm_head.load_state_dict(src.lm_head.state_dict())
    return model, processor


# ----- training
MIX = {"grounding": 0.4, "direction": 0.25, "order": 0.2, "count": 0.15}
"""share of each question type in a batch. Direction and order get more than count: at 1/6 each (90 min) the model
marked the right groups but wrote the arrows at chance and swapped the order letters, while count reached 0.97
(assets/README.md)"""
QA_TYPES = ("direction", "order", "count")


def val_metric(table: dict[str, dict[str, float]]) -> float:
    """Mean of grounding mIoU and the QA types' mean accuracy: the checkpoint criterion."""
    qa = [table[k]["accuracy"] for k in QA_TYPES if k in table]
    return (table["grounding"]["miou"] + sum(qa) / max(len(qa), 1)) / 2


def optimizer(model: nn.Module, head: nn.Module, args) -> torch.optim.Optimizer:
    """AdamW; the vision tower and the dense head at args.tower_lr_mult x the base rate (group "lr_mult")."""
    tower = list(model.model.visual.parameters()) + list(head.parameters())
    ids = {id(p) for p in tower}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return torch.optim.AdamW(
        [{"params": rest, "lr_mult": 1.0}, {"params": tower, "lr_mult": args.tower_lr_mult}],
        lr=args.lr,
        betas=(0.9, 0.99),
        weight_decay=0.01,
    )


def sft_step(
    args,
    model: nn.Module,
    ema: nn.Module,
    head: DenseHead,
    opt,
    batch: list[dict[str, Tensor]],
    pad_id: int,
    step: int,
) -> tuple[Tensor, Tensor]:
    """One update on SFT + dense_weight * dense (gradients clipped to 1 over model and head), then the EMA update
    (decay warmed up as (1 + step) / (10 + step) so early evals are not of the init). Returns both losses."""
    model.train()
    sft, dense = losses(model, head, batch, pad_id)
    loss = sft + args.dense_weight * dense
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(list(model.parameters()) + list(head.parameters()), 1.0)
    opt.step()
    decay = min(args.ema, (1 + step) / (10 + step))
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1 - decay)
    return sft, dense


def train(args) -> dict[str, Any]:
    """SFT + dense loss for args.minutes of wall time; the EMA model is scored on val every args.eval_minutes and
    saved to args.out when best."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, processor = build(args)
    head = DenseHead(4, model.config.text_config.hidden_size)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = optimizer(model, head, args)
    pool = args.pool_dir or pool_dir("train", args.pool, seed=args.seed)
    blank = blank_video(NUM_FRAMES, 4, 64, Path.home() / ".cache" / "mmgrpo" / "blank") if args.blank_types else ""
    data = Examples(processor, set_records(pool, "train"), key_weight=args.key_weight, blank=args.blank_types,
                    blank_video=blank)  # fmt: skip
    val = pipeline_records("val", args.val_n, types=("grounding",), num_frames=NUM_FRAMES) + pipeline_records(
        "val", args.val_n, types=QA_TYPES, num_frames=NUM_FRAMES
    )
    rng = random.Random(args.seed)
    info: dict[str, Any] = {
        "args": vars(args),
        "params": sum(p.numel() for p in model.parameters()),
        "pool_rows": len(data.recs),
        "losses": [],
        "evals": [],
        "best": None,
    }
    print(f"{info['params']:,} parameters, {len(data.recs)} training questions", flush=True)
    t0, last_eval, step, run = time.time(), time.time(), 0, []
    budget = 60 * args.minutes
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or time.time() - last_eval >= 60 * args.eval_minutes:
            table = evaluate(ema, processor, val)
            metric = val_metric(table)
            info["evals"].append({"step": step, "minutes": round(elapsed / 60, 2), "val": table, "metric": metric})
            print(f"step {step} ({elapsed / 60:.1f} min) val {metric:.3f}\n{format_table(table)}", flush=True)
            if info["best"] is None or metric > info["best"]["val"]:
                info["best"] = {"step": step, "minutes": round(elapsed / 60, 2), "val": metric}
                save_pretrained_whole(ema, processor, args.out, info)
            last_eval = time.time()
            if elapsed >= budget:
                break
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(elapsed / budget, 1.0)))  # cosine to 10% over the budget
        for group in opt.param_groups:
            group["lr"] = lr * group["lr_mult"]
        batch = data.batch(rng, args.batch, args.mix)
        sft, dense = sft_step(args, model, ema, head, opt, batch, processor.tokenizer.pad_token_id, step)
        step += 1
        run.append((float(sft.detach()), float(dense.detach())))
        if step % 25 == 0:
            s, d = (sum(x) / len(run) for x in zip(*run))
            info["losses"].append({"step": step, "minutes": round((time.time() - t0) / 60, 2), "sft": s, "dense": d})
            print(
                f"step {step} sft {s:.4f} dense {d:.4f} lr {lr:.2e} ({(time.time() - t0) / step:.2f} s/step)",
                flush=True,
            )
            run = []
    info["train_minutes"], info["steps"] = round((time.time() - t0) / 60, 1), step
    (Path(args.out) / "train_log.json").write_text(json.dumps(info, indent=1))
    return info


def test_report(
    path: str | Path | None,
    n: int,
    pool: int,
    *,
    split: str = "test",
    conditions: tuple[str, ...] = ("real", "blank", "other", "shuffled"),
) -> dict[str, Any]:
    """Scores of a saved model on `n` clips per task of `split` under each frame condition (None: only the blind
    baselines), and the blind baselines fitted on the training pool."""
    recs = pipeline_records(split, n, types=("grounding",), num_frames=NUM_FRAMES) + pipeline_records(
        split, n, types=QA_TYPES, num_frames=NUM_FRAMES
    )
    out: dict[str, Any] = {"blind": blind_baselines(set_records(pool_dir("train", pool), "train"), recs)}
    if path is not None:
        # lazy: transformers is heavy to import; only scoring a saved model needs it (not --report blind)
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path).eval()
        blank = blank_video(NUM_FRAMES, 4, 64, Path.home() / ".cache" / "mmgrpo" / "blank")
        for c in conditions:
            out[c] = evaluate(model, processor, recs, condition=c, blank=blank)
            print(f"-- {c}\n{format_table(out[c])}", flush=True)
    return out


def parse_mix(text: str) -> dict[str, float]:
    """Parse --mix: "grounding=0.5,count=0.5" -> {"grounding": 0.5, "count": 0.5}; bad text is a usage line."""
    try:
        mix = {k: float(v) for k, v in (kv.split("=") for kv in text.split(","))}
    except ValueError:
        mix = {}
    if not mix or not set(mix) <= set(VIDEO_TYPES) or min(mix.values()) < 0 or not sum(mix.values()):
        raise argparse.ArgumentTypeError(f"{text!r}: give type=share pairs of {', '.join(VIDEO_TYPES)}, shares >= 0")
    return mix


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="assets/shapes-video", help="save_pretrained folder of the best EMA model")
    p.add_argument("--overwrite", action="store_true", help="replace the model already in --out")
    p.add_argument("--minutes", type=float, default=60.0, help="training wall-clock budget")
    p.add_argument("--eval-minutes", type=float, default=6.0, help="validation (and best-checkpoint) interval")
    p.add_argument("--val-n", type=int, default=48, help="val clips per task (grounding, QA)")
    p.add_argument("--test-n", type=int, default=300, help="test clips per task for the final report (0: skip)")
    p.add_argument("--pool", type=int, default=2000, help="training clips (every question of each is used)")
    p.add_argument("--pool-dir", default=None, help="train on this written set instead of the cached pool")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tower-lr-mult", type=float, default=1.0, help="learning-rate factor of the vision tower")
    p.add_argument("--dense-weight", type=float, default=1.0, help="weight of the per-group dense vision loss")
    p.add_argument("--key-weight", type=float, default=1.0, help="SFT loss weight of the answer-deciding tokens")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--mix", type=parse_mix, default=MIX, help="batch share per type, e.g. grounding=0.5,count=0.5")
    p.add_argument("--blank-types", nargs="*", default=[], choices=VIDEO_TYPES,
                   help="these types on blank frames with a fixed think: the base learns their format and answer prior, "
                   "not to read them (room for RL)")  # fmt: skip
    p.add_argument("--ema", type=float, default=0.99)
    add_architecture_args(p)
    p.add_argument(
        "--init-lm",
        default=None,
        help="copy the weights outside the vision tower from this saved Qwen2-VL folder (same architecture)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--report",
        default=None,
        metavar="MODEL",
        help="no training: score this saved model (or 'blind': only the blind baselines) on --split",
    )
    p.add_argument("--split", default="test", choices=("val", "test"), help="--report's split")
    p.add_argument("--conditions", default="real,blank,other,shuffled", help="--report's frame conditions")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        torch.set_num_threads(args.threads)
        out = test_report(
            None if args.report == "blind" else args.report,
            args.test_n,
            args.pool,
            split=args.split,
            conditions=tuple(args.conditions.split(",")),
        )
        print(json.dumps(out, indent=1), flush=True)
        return
    claim(args.out, args.overwrite, "pretrain_video")
    info = train(args)
    print(f"trained {info['steps']} steps in {info['train_minutes']} min; best {info['best']}", flush=True)
    if args.test_n:
        info["test"] = test_report(args.out, args.test_n, args.pool)
        print(json.dumps(info["test"]["blind"], indent=1), flush=True)
        (Path(args.out) / "train_log.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    if os.environ.get("MMGRPO_POOL_ONLY"):
        print(pool_dir("train", int(os.environ["MMGRPO_POOL_ONLY"])))
    else:
        main()
