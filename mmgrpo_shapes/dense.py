"""Dense supervision of a ShapesWorld VLM's vision tower: for each merged visual token (a cell of the image grid),
the colour and the shape of the object whose centre lies in that cell, or "none".

Short VQA answers give the tower almost no gradient (assets/README.md, shapes-vlm: |grad|/|w| of the tower is a
quarter of the language model's), so `pretrain_vlm --dense-weight` adds this per-token cross-entropy through a
linear head on the tower's output tokens. The head is used in training only and never saved.
"""

import math
import time
from typing import Any

import torch
from torch import Tensor, nn

from mmgrpo_shapes.scenes import COLORS, SHAPES

COLOR_CLASSES = ("none",) + tuple(COLORS)
SHAPE_CLASSES = ("none",) + SHAPES


def cell_targets(objects: list[dict[str, Any]], side: int) -> tuple[Tensor, Tensor]:
    """Colour and shape class per cell of a side x side grid, row-major (the merged-token order of Qwen2-VL for one
    image): [side * side] each, 0 where no object's centre (cx, cy, fractions of the image side) falls in the cell.

    Objects of ShapesWorld are at least 2 * 0.14 + 0.06 = 0.34 of the side apart (centre to centre along some axis),
    more than a cell of a 4 x 4 grid (0.25), so no cell holds two centres.
    """
    color = torch.zeros(side * side, dtype=torch.long)  # [side^2]
    shape = torch.zeros(side * side, dtype=torch.long)  # [side^2]
    for obj in objects:
        k = min(int(obj["cy"] * side), side - 1) * side + min(int(obj["cx"] * side), side - 1)
        color[k], shape[k] = COLOR_CLASSES.index(obj["color"]), SHAPE_CLASSES.index(obj["shape"])
    return color, shape


class DenseHead(nn.Module):
    """A linear read-out of colour and shape classes from each visual token [N, hidden] -> [N, 7 + 4]; with `side`,
    also the token's own row and column in its image's side x side grid.

    Why the position read-out: the tower has only relative (2D rotary) positions, and a probe read a token's row or
    column from the shipped tower at 0.49 / 0.51 (chance 0.25), so "Is the red circle left of the blue square?" was
    at chance (assets/README.md); a label-free target that the tower can meet from the grid's borders.
    """

    def __init__(self, hidden: int, *, side: int = 0):
        super().__init__()
        self.side = side
        self.proj = nn.Linear(hidden, len(COLOR_CLASSES) + len(SHAPE_CLASSES) + 2 * side)

    def loss(self, tokens: Tensor, color: Tensor, shape: Tensor) -> tuple[Tensor, dict[str, float]]:
        """Colour and shape cross-entropies, averaged over object cells and over empty cells separately and then
        summed (object cells are 1-4 of 16, so a plain mean would mostly teach "empty"); with `side`, plus the mean
        row and column cross-entropy over all tokens (each image's tokens row-major). Also each head's accuracy on
        object cells (and "position": row and column both right, all tokens). tokens [N, hidden]; color, shape [N]
        class ids (0 = no object centred here).
        """
        nc, ns = len(COLOR_CLASSES), len(SHAPE_CLASSES)
        logits = self.proj(tokens.float())  # [N, 11 + 2 side]
        lc, ls = logits[:, :nc], logits[:, nc : nc + ns]  # [N, 7], [N, 4]
        ce = 0.5 * (
            nn.functional.cross_entropy(lc, color, reduction="none")
            + nn.functional.cross_entropy(ls, shape, reduction="none")
        )  # [N]
        obj = color > 0  # [N]
        loss = sum(ce[m].mean() for m in (obj, ~obj) if m.any())
        acc = {
            "color": float((lc.argmax(-1) == color)[obj].float().mean()),
            "shape": float((ls.argmax(-1) == shape)[obj].float().mean()),
        }
        if self.side:
            k = torch.arange(tokens.shape[0], device=tokens.device) % (self.side * self.side)  # [N] cell index
            lr_, lcol = logits[:, nc + ns : nc + ns + self.side], logits[:, nc + ns + self.side :]  # [N, side] each
            row, col = k // self.side, k % self.side  # [N], [N]
            loss = loss + 0.5 * (nn.functional.cross_entropy(lr_, row) + nn.functional.cross_entropy(lcol, col))
            acc["position"] = float(((lr_.argmax(-1) == row) & (lcol.argmax(-1) == col)).float().mean())
        return loss, acc


def batch_targets(batch_objects: list[list[dict[str, Any]]], tokens_per_image: int) -> tuple[Tensor, Tensor]:
    """Concatenated cell targets [B * tokens_per_image] for images whose tokens form a square grid."""
    side = math.isqrt(tokens_per_image)
    if side * side != tokens_per_image:
        raise ValueError(f"tokens_per_image {tokens_per_image} is not a square grid; use a square image size")
    pairs = [cell_targets(objs, side) for objs in batch_objects]
    return torch.cat([c for c, _ in pairs]), torch.cat([s for _, s in pairs])


class TowerTap:
    """Keeps the vision tower's merged output tokens [N, hidden] of the last forward (a forward hook)."""

    def __init__(self, model: nn.Module):
        self.tokens: Tensor | None = None
        self.handle = model.model.visual.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.tokens = output.pooler_output if hasattr(output, "pooler_output") else output


def tower_tokens(model: nn.Module, processor, images: list) -> Tensor:
    """The vision tower's merged tokens [B * tokens_per_image, hidden] for uint8 images, through the processor's own
    resize and normalisation (the same pixels `VLMPolicy.encode` gives the model)."""
    px = processor.image_processor(images=list(images), return_tensors="pt")
    out = model.model.visual(px["pixel_values"], grid_thw=px["image_grid_thw"])
    return out.pooler_output if hasattr(out, "pooler_output") else out  # [B * T, hidden]


def pretrain_tower(
    model: nn.Module, processor, head: DenseHead, stream, *, steps: int, batch: int, lr: float, log=print
) -> list[dict[str, float]]:
    """Stage 1: train the vision tower (and `head`) alone on the dense targets of `batch` records a step, AdamW at
    `lr` with 20 warm-up steps; `stream` yields records with "image" and "objects". Returns the logged means."""
    params = list(model.model.visual.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    model.train()
    logs, run = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20)
        recs = [next(stream) for _ in range(batch)]
        tokens = tower_tokens(model, processor, [r["image"] for r in recs])  # [B * T, hidden]
        color, shape = batch_targets([r["objects"] for r in recs], tokens.shape[0] // batch)
        loss, acc = head.loss(tokens, color, shape)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        run.append([float(loss.detach()), acc["color"], acc["shape"], acc.get("position", 0.0)])
        if (step + 1) % 25 == 0 or step + 1 == steps:
            m = torch.tensor(run).mean(0).tolist()
            logs.append({"step": step + 1, "dense": m[0], "color_acc": m[1], "shape_acc": m[2], "position_acc": m[3]})
            log(f"tower step {step + 1} dense {m[0]:.3f} colour {m[1]:.2f} shape {m[2]:.2f} position {m[3]:.2f}")
            run = []
    return logs


@torch.no_grad()
def dense_accuracy(model: nn.Module, processor, head: DenseHead, recs: list[dict[str, Any]]) -> dict[str, float]:
    """The head's colour and shape accuracy on the object cells of `recs` (a held-out check of stage 1)."""
    tokens = tower_tokens(model, processor, [r["image"] for r in recs])  # [B * T, hidden]
    color, shape = batch_targets([r["objects"] for r in recs], tokens.shape[0] // len(recs))
    return head.loss(tokens, color, shape)[1]


def dense_head(args, model: nn.Module):
    """The training-only dense head on the tower's tokens (None without --dense-weight, or for grounding)."""
    if args.task != "vqa" or args.dense_weight <= 0:
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed + 1)
        return DenseHead(model.config.text_config.hidden_size, side=4 if args.dense_position else 0)


def optimizer(args, model: nn.Module, head: nn.Module | None) -> torch.optim.Optimizer:
    """AdamW with the vision tower (and the dense head) at --vision-lr-mult times the language model's rate."""
    vision = list(model.model.visual.parameters()) + (list(head.parameters()) if head is not None else [])
    ids = {id(p) for p in vision}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return torch.optim.AdamW(
        [{"params": rest, "mult": 1.0}, {"params": vision, "mult": args.vision_lr_mult}],
        lr=args.lr,
        betas=(0.9, 0.99),
        weight_decay=0.01,
    )


def stage_one(args, model: nn.Module, processor, stream) -> tuple[DenseHead | None, list[dict[str, float]]]:
    """The dense head (None without --dense-weight) and, with --tower-steps, stage 1's log (`pretrain_tower`)."""
    head = dense_head(args, model)
    if head is None or args.tower_steps <= 0:
        return head, []
    return head, pretrain_tower(
        model,
        processor,
        head,
        stream,
        steps=args.tower_steps,
        batch=args.tower_batch,
        lr=args.tower_lr,
        log=lambda m: print(m, flush=True),
    )


def log_losses(info: dict[str, Any], step: int, t0: float, lr: float, run_loss: list, run_dense: list) -> None:
    """Append the mean SFT loss (and dense metrics) since the last log to info["losses"] and print them."""
    info["losses"].append(
        {"step": step, "minutes": round((time.time() - t0) / 60, 2), "loss": sum(run_loss) / len(run_loss)}
    )
    extra = ""
    if run_dense:
        d = torch.tensor(run_dense).mean(0).tolist()
        info["losses"][-1] |= {"dense": d[0], "dense_color_acc": d[1], "dense_shape_acc": d[2], "dense_position": d[3]}
        extra = f" dense {d[0]:.3f} colour {d[1]:.2f} shape {d[2]:.2f} position {d[3]:.2f}"
    print(
        f"step {step} loss {info['losses'][-1]['loss']:.4f} lr {lr:.2e} ({(time.time() - t0) / step:.2f} s/step)"
        + extra,
        flush=True,
    )
