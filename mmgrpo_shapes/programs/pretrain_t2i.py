"""Tiny ShapesWorld text-to-image model: a pixel-space SD3Transformer2DModel with a jointly trained CLIP text
encoder, pretrained by rectified flow on ground-truth renders; plus its Euler sampler and eval. The model itself
(builders, prompt encoding, save / offline load) is in t2i_model; the scenes it trains on and the prompts it is
evaluated on are in t2i_data.
"""

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmgrpo_shapes.programs.outdir import claim, write_whole
from mmgrpo_shapes.programs.t2i_data import ScenePool, curriculum, eval_prompts
from mmgrpo_shapes.programs.t2i_model import (
    ShapesT2I,
    build_models,
    build_tokenizer,
    encode_prompts,
    load,
    save_model,
)
from mmgrpo_shapes.scenes import CATEGORIES
from mmgrpo_shapes.verifier import category_report


def sample_sigmas(n: int, *, scheme: str = "logit_normal", shift: float = 1.0, generator=None) -> torch.Tensor:
    """Training noise levels in (0, 1), SD3 (arXiv 2403.03206) style, then the scheduler's shift.

    logit_normal: sigma = sigmoid(u), u ~ N(0, 1); uniform: sigma ~ U(0, 1); shift: s' = k s / (1 + (k - 1) s).
    Returns: [n].
    """
    if scheme == "logit_normal":
        s = torch.sigmoid(torch.randn(n, generator=generator))  # [n]
    elif scheme == "uniform":
        s = torch.rand(n, generator=generator)  # [n]
    else:
        raise ValueError(f"scheme {scheme!r} is unknown; choose 'logit_normal' or 'uniform'")
    return shift * s / (1.0 + (shift - 1.0) * s)


def flow_matching_loss(transformer, x0, prompt_embeds, pooled, *, sigmas, noise) -> torch.Tensor:
    """Rectified-flow loss (Liu et al. arXiv 2209.03003; SD3 arXiv 2403.03206), diffusers' FlowMatch convention.

    x_t = (1 - sigma) x0 + sigma eps, target v = eps - x0, timestep = 1000 sigma; loss = mean ||v_theta - v||^2.
    Args: x0, noise [B, 3, H, W] in [-1, 1]; prompt_embeds [B, L, D]; pooled [B, P]; sigmas [B].
    """
    s = sigmas.view(-1, 1, 1, 1)  # [B, 1, 1, 1]
    xt = (1.0 - s) * x0 + s * noise  # [B, 3, H, W]
    pred = transformer(
        hidden_states=xt,
        encoder_hidden_states=prompt_embeds,
        pooled_projections=pooled,
        timestep=sigmas * 1000.0,
        return_dict=False,
    )[0]  # [B, 3, H, W]
    return torch.mean((pred.float() - (noise - x0)) ** 2)


@torch.no_grad()
def sample(
    model,
    prompts: list[str],
    *,
    num_steps: int = 16,
    seed: int = 0,
    guidance_scale: float | None = None,
    batch_size: int = 64,
) -> np.ndarray:
    """Euler ODE samples for `prompts` (classifier-free guidance when guidance_scale > 1).

    x_{t_{i+1}} = x_{t_i} + (sigma_{i+1} - sigma_i) v, v = v_u + w (v_c - v_u); x_1 ~ N(0, I) from `seed`.
    Args: model: a ShapesT2I or a folder path; prompts: N strings. Returns: uint8 [N, H, W, 3].
    """
    m = model if isinstance(model, ShapesT2I) else load(model)
    res = m.config["resolution"]
    w = m.config.get("guidance_scale", 1.0) if guidance_scale is None else guidance_scale
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(prompts), 3, res, res, generator=gen)  # [N, 3, H, W]
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        out.append(_euler(m, chunk, noise[start : start + len(chunk)], num_steps, w))
    x = torch.cat(out) if out else noise
    return ((x.clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def _euler(m: ShapesT2I, prompts: list[str], x: torch.Tensor, num_steps: int, w: float) -> torch.Tensor:
    cfg = w > 1.0
    texts = prompts + [""] * len(prompts) if cfg else prompts
    embeds, pooled = encode_prompts(m.tokenizer, m.text_encoder, texts)  # [B(*2), L, D], [B(*2), P]
    m.scheduler.set_timesteps(num_steps)
    for t in m.scheduler.timesteps:
        inp = torch.cat([x, x]) if cfg else x  # [B(*2), 3, H, W]
        v = m.transformer(
            hidden_states=inp,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            timestep=t.expand(inp.shape[0]),
            return_dict=False,
        )[0]
        if cfg:
            v_c, v_u = v.chunk(2)
            v = v_u + w * (v_c - v_u)
        x = m.scheduler.step(v, t, x, return_dict=False)[0]
    return x


def evaluate(
    model_dir,
    split: str = "test",
    n_per_prompt: int = 4,
    *,
    num_steps: int = 16,
    seed: int = 0,
    guidance_scale: float | None = None,
    max_prompts: int = 48,
    verbose: bool = True,
) -> dict[str, dict[str, float]]:
    """Verifier strict accuracy and partial score per category on one split's prompts; prints the table."""
    m = model_dir if isinstance(model_dir, ShapesT2I) else load(model_dir)
    prompts = eval_prompts(split, n_per_prompt, max_prompts)
    images = sample(m, prompts, num_steps=num_steps, seed=seed, guidance_scale=guidance_scale)
    table = category_report(list(images), prompts)
    if verbose:
        print(f"{'category':<14} {'strict':>7} {'partial':>8} {'n':>5}   ({split}, {num_steps} steps)")
        for cat, row in table.items():
            print(f"{cat:<14} {row['strict']:7.3f} {row['partial']:8.3f} {row['n']:5d}")
    return table


def _lr_at(step: int, progress: float, *, lr: float, warmup: int) -> float:
    # linear warm-up, then cosine to 10% over the time budget (progress = elapsed fraction in [0, 1])
    return lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def _describe(resolution: int, shift: float, guidance_scale: float, seed: int, train: dict) -> dict:
    # the shapes_t2i.json written beside the weights: how to feed the model, and how it was trained
    return {
        "space": "pixel",
        "latent": "image in [-1, 1], channels RGB, no VAE",
        "resolution": resolution,
        "prompt_format": "ShapesWorld prompt, e.g. 'a red circle left of a blue square'; '' is the CFG null prompt",
        "prompt_embeds": "text_encoder last_hidden_state [B, 16, D] (padded to 16 tokens)",
        "pooled_projections": "text_encoder text_embeds [B, P]",
        "timestep": "sigma * 1000 (FlowMatchEuler convention)",
        "prediction": "velocity = noise - x0",
        "shift": shift,
        "guidance_scale": guidance_scale,
        "seed": seed,
        "train": train,
    }


@dataclass(frozen=True)
class PretrainSettings:
    """How pretrain() trains: the architecture (build_models), the rectified-flow objective, the data and the budget
    (wall-clock `minutes`, or `max_steps` when set, whichever ends first)."""

    minutes: float = 60.0
    seed: int = 0
    resolution: int = 32
    patch_size: int = 4
    width: int = 128
    depth: int = 6
    head_dim: int = 32
    text_width: int = 128
    text_layers: int = 2
    batch_size: int = 64
    lr: float = 7e-4
    warmup: int = 200
    ema_decay: float = 0.999
    shift: float = 1.0
    sigma_scheme: str = "logit_normal"
    cond_dropout: float = 0.1
    guidance_scale: float = 2.0
    big_objects: bool = True
    single_frac: float = 0.0
    pool_per_category: int = 1500
    refresh: int = 8
    checkpoint_dir: str | None = None
    checkpoint_minutes: float = 10.0
    threads: int = 1
    max_steps: int | None = None


DESCRIBED = (
    "minutes",
    "patch_size",
    "width",
    "depth",
    "batch_size",
    "lr",
    "ema_decay",
    "sigma_scheme",
    "cond_dropout",
    "big_objects",
    "single_frac",
)
"""the settings written to shapes_t2i.json's "train" entry, in this order"""


def pretrain(out_dir, s: PretrainSettings) -> ShapesT2I:
    """Train the model by rectified flow on ground-truth renders of train prompts for `s.minutes`; save EMA weights.

    Loss: flow_matching_loss on x0 = render in [-1, 1]; prompts dropped to "" with prob cond_dropout (for CFG).
    Checkpoints (EMA) go to checkpoint_dir/step_NNNNNN every checkpoint_minutes; a loss log to out_dir/train_log.json.
    """
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    model = _new_model(s)
    params = list(model.transformer.parameters()) + list(model.text_encoder.parameters())
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.99), weight_decay=0.01)
    t0 = time.time()
    pool = ScenePool(s.pool_per_category, seed=s.seed, resolution=s.resolution, big_objects=s.big_objects)
    print(f"pool of {s.pool_per_category * len(CATEGORIES)} scenes in {time.time() - t0:.0f} s", flush=True)
    log, step, start, last_ckpt = [], 0, time.time(), time.time()
    budget = s.minutes * 60.0
    while True:
        progress = (time.time() - start) / budget
        if s.max_steps is not None:
            progress = max(progress, step / s.max_steps)
        if progress >= 1.0:
            break
        loss = _train_step(
            model,
            pool,
            opt,
            params,
            batch_size=s.batch_size,
            weights=curriculum(progress, s.single_frac),
            lr=_lr_at(step, progress, lr=s.lr, warmup=s.warmup),
            shift=s.shift,
            sigma_scheme=s.sigma_scheme,
            cond_dropout=s.cond_dropout,
            gen=gen,
        )
        decay = min(s.ema_decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - decay)
        pool.refresh(s.refresh)
        log.append(loss)
        step += 1
        if step % 100 == 0:
            print(f"step {step} loss(100) {np.mean(log[-100:]):.4f} {time.time() - start:.0f}s", flush=True)
        if s.checkpoint_dir and time.time() - last_ckpt > s.checkpoint_minutes * 60:
            _save_ema(model, params, ema, Path(s.checkpoint_dir) / f"step_{step:06d}", log, step, start)
            last_ckpt = time.time()
    _save_ema(model, params, ema, Path(out_dir), log, step, start)
    return model


def _new_model(s: PretrainSettings) -> ShapesT2I:
    """A randomly initialised model of `s`'s architecture (draws from the global torch generator)."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # lazy: diffusers is heavy to import; only training needs it

    tokenizer = build_tokenizer()
    arch = ("resolution", "patch_size", "width", "depth", "head_dim", "text_width", "text_layers")
    transformer, text_encoder = build_models(tokenizer, **{k: getattr(s, k) for k in arch})
    train = {k: getattr(s, k) for k in DESCRIBED}
    config = _describe(s.resolution, s.shift, s.guidance_scale, s.seed, train=train)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=s.shift)
    return ShapesT2I(transformer, text_encoder, tokenizer, scheduler, config)


def _train_step(model, pool, opt, params, *, batch_size, weights, lr, shift, sigma_scheme, cond_dropout, gen):
    x0, prompts = pool.batch(batch_size, weights)  # [B, 3, H, W]
    drop = torch.rand(batch_size, generator=gen) < cond_dropout  # [B]
    prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
    embeds, pooled = encode_prompts(model.tokenizer, model.text_encoder, prompts)  # [B, L, D], [B, P]
    sigmas = sample_sigmas(batch_size, scheme=sigma_scheme, shift=shift, generator=gen)  # [B]
    noise = torch.randn(x0.shape, generator=gen)  # [B, 3, H, W]
    loss = flow_matching_loss(model.transformer, x0, embeds, pooled, sigmas=sigmas, noise=noise)
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss.item()


def _save_ema(model: ShapesT2I, params, ema, out: Path, log: list[float], step: int, start: float) -> None:
    # swap the EMA weights in for saving, then restore the live ones so training can go on
    live = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
        model.config["train"].update(steps=step, wall_minutes=round((time.time() - start) / 60, 2))
        curve = [round(float(np.mean(log[i : i + 100])), 5) for i in range(0, len(log), 100)]

        def write(folder: Path) -> None:
            save_model(folder, model)
            (folder / "train_log.json").write_text(json.dumps({"steps": step, "loss_per_100_steps": curve}) + "\n")

        write_whole(out, write)  # a crash mid-save keeps the previous save whole
        for p, v in zip(params, live):
            p.copy_(v)
    print(f"saved EMA weights at step {step} to {out}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Pretrain the tiny ShapesWorld text-to-image flow model.")
    ap.add_argument("--out", default="assets/shapes-t2i")
    ap.add_argument("--overwrite", action="store_true", help="replace the model already in --out")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--patch-size", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=7e-4)
    ap.add_argument("--shift", type=float, default=1.0)
    ap.add_argument("--single-frac", type=float, default=0.0)
    ap.add_argument("--no-big-objects", action="store_true")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--eval-split", default="val", help="split evaluated after training ('' to skip)")
    args = ap.parse_args(argv)
    settings = PretrainSettings(
        minutes=args.minutes,
        seed=args.seed,
        patch_size=args.patch_size,
        width=args.width,
        depth=args.depth,
        batch_size=args.batch_size,
        lr=args.lr,
        shift=args.shift,
        single_frac=args.single_frac,
        big_objects=not args.no_big_objects,
        checkpoint_dir=args.checkpoint_dir,
    )
    claim(args.out, args.overwrite, "pretrain_t2i")
    pretrain(args.out, settings)
    if args.eval_split:
        for w in (1.0, 3.0):
            print(f"guidance_scale {w}")
            evaluate(args.out, args.eval_split, n_per_prompt=2, guidance_scale=w)


if __name__ == "__main__":
    main()
