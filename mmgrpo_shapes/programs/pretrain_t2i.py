"""Tiny ShapesWorld text-to-image model: a pixel-space SD3Transformer2DModel with a jointly trained CLIP text
encoder, pretrained by rectified flow on ground-truth renders; plus its offline loader, Euler sampler and eval.
The scenes it trains on and the prompts it is evaluated on are in t2i_data.
"""

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmgrpo_shapes.programs.t2i_data import ScenePool, curriculum, eval_prompts
from mmgrpo_shapes.scenes import CATEGORIES, COLORS, NUMBER_WORDS, SHAPES
from mmgrpo_shapes.verifier import category_report

MODEL_FILE = "shapes_t2i.json"
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
MAX_TOKENS = 16  # the longest ShapesWorld prompt is 8 words (+ bos/eos); "a photo of" prefixes still fit


def build_tokenizer():
    """A word-level tokenizer over the ShapesWorld vocabulary (bos + words + eos, lower-cased), saved beside the
    model; a 49k-entry CLIP BPE embedding table alone would be 25 MB at width 128."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors  # lazy: heavy; --help is light
    from transformers import PreTrainedTokenizerFast  # lazy: transformers is heavy to import; --help stays light

    words = ["a", "an", "and", "of", "the", "left", "right", "above", "below", "photo", "image", "picture"]
    words += list(NUMBER_WORDS.values()) + list(COLORS) + list(SHAPES) + [s + "s" for s in SHAPES]
    vocab = {w: i for i, w in enumerate(list(SPECIAL_TOKENS) + sorted(set(words)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=MAX_TOKENS,
    )


def build_models(
    tokenizer, *, resolution: int = 32, patch_size: int = 4, width: int = 128, depth: int = 6, head_dim: int = 32,
    text_width: int = 128, text_layers: int = 2, qk_norm: str | None = "rms_norm",
):
    """A fresh (SD3Transformer2DModel, CLIPTextModelWithProjection) pair in pixel space (3 channels, no VAE)."""
    from diffusers import SD3Transformer2DModel  # lazy: diffusers is heavy to import; only building a model needs it
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection  # lazy: heavy; only building a model

    if resolution % patch_size or width % head_dim:
        raise ValueError(
            f"resolution {resolution} must be divisible by patch_size {patch_size} and width {width} by head_dim "
            f"{head_dim}; pick e.g. patch_size 2 or 4 and a width that is a multiple of head_dim"
        )
    text_cfg = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width,
        num_hidden_layers=text_layers, num_attention_heads=max(1, text_width // 32), projection_dim=text_width,
        max_position_embeddings=MAX_TOKENS, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    transformer = SD3Transformer2DModel(
        sample_size=resolution, patch_size=patch_size, in_channels=3, out_channels=3, num_layers=depth,
        attention_head_dim=head_dim, num_attention_heads=width // head_dim, joint_attention_dim=text_width,
        caption_projection_dim=width, pooled_projection_dim=text_width, pos_embed_max_size=resolution // patch_size,
        qk_norm=qk_norm,
    )
    return transformer, CLIPTextModelWithProjection(text_cfg)


def encode_prompts(tokenizer, text_encoder, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds [B, L, D] = last hidden state, pooled [B, P] = projected eos state) for the transformer.

    Padding sits after eos and CLIP's mask is causal, so it never changes the real tokens' states.
    """
    ids = tokenizer(list(prompts), padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt")
    out = text_encoder(input_ids=ids.input_ids)
    return out.last_hidden_state, out.text_embeds  # [B, L, D], [B, P]


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
        hidden_states=xt, encoder_hidden_states=prompt_embeds, pooled_projections=pooled,
        timestep=sigmas * 1000.0, return_dict=False,
    )[0]  # [B, 3, H, W]
    return torch.mean((pred.float() - (noise - x0)) ** 2)


@dataclass
class ShapesT2I:
    """A loaded model: the four diffusers/transformers components and the shapes_t2i.json description."""

    transformer: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: object
    scheduler: object
    config: dict


def save_model(out_dir, model: ShapesT2I) -> None:
    """Write the model as a diffusers-style folder: one save_pretrained per component (safetensors) + json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.transformer.save_pretrained(out / "transformer")
    model.text_encoder.save_pretrained(out / "text_encoder")
    model.tokenizer.save_pretrained(out / "tokenizer")
    model.scheduler.save_pretrained(out / "scheduler")
    index = {
        "_class_name": "ShapesT2IPipeline",
        "_note": "pixel space, no VAE: load each component with from_pretrained(dir, subfolder=...), see "
        "mmgrpo_shapes/programs/pretrain_t2i.py load()",
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / MODEL_FILE).write_text(json.dumps(model.config, indent=2) + "\n")


def load(model_dir) -> ShapesT2I:
    """Load a saved model offline: each component through its own class's from_pretrained."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel  # lazy: heavy; only loading needs it
    from transformers import AutoTokenizer, CLIPTextModelWithProjection  # lazy: heavy; only loading needs it

    root = Path(model_dir)
    if not (root / MODEL_FILE).is_file():
        raise ValueError(f"model_dir {str(model_dir)!r} has no {MODEL_FILE}; pass a folder written by pretrain()")
    return ShapesT2I(
        transformer=SD3Transformer2DModel.from_pretrained(root / "transformer").eval(),
        text_encoder=CLIPTextModelWithProjection.from_pretrained(root / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
        config=json.loads((root / MODEL_FILE).read_text()),
    )


@torch.no_grad()
def sample(
    model, prompts: list[str], *, num_steps: int = 16, seed: int = 0, guidance_scale: float | None = None,
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
            hidden_states=inp, encoder_hidden_states=embeds, pooled_projections=pooled,
            timestep=t.expand(inp.shape[0]), return_dict=False,
        )[0]
        if cfg:
            v_c, v_u = v.chunk(2)
            v = v_u + w * (v_c - v_u)
        x = m.scheduler.step(v, t, x, return_dict=False)[0]
    return x


def evaluate(
    model_dir, split: str = "test", n_per_prompt: int = 4, *, num_steps: int = 16, seed: int = 0,
    guidance_scale: float | None = None, max_prompts: int = 48, verbose: bool = True,
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


def pretrain(
    out_dir, *, minutes: float, seed: int = 0, resolution: int = 32, patch_size: int = 4, width: int = 128,
    depth: int = 6, head_dim: int = 32, text_width: int = 128, text_layers: int = 2, batch_size: int = 64,
    lr: float = 7e-4, warmup: int = 200, ema_decay: float = 0.999, shift: float = 1.0,
    sigma_scheme: str = "logit_normal", cond_dropout: float = 0.1, guidance_scale: float = 2.0,
    big_objects: bool = True, single_frac: float = 0.0, pool_per_category: int = 1500, refresh: int = 8,
    checkpoint_dir=None, checkpoint_minutes: float = 10.0, threads: int = 1, max_steps: int | None = None,
) -> ShapesT2I:
    """Train the model by rectified flow on ground-truth renders of train prompts for `minutes`; save EMA weights.

    Loss: flow_matching_loss on x0 = render in [-1, 1]; prompts dropped to "" with prob cond_dropout (for CFG).
    Checkpoints (EMA) go to checkpoint_dir/step_NNNNNN every checkpoint_minutes; a loss log to out_dir/train_log.json.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler  # lazy: diffusers is heavy to import; only training needs it

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    tokenizer = build_tokenizer()
    transformer, text_encoder = build_models(
        tokenizer, resolution=resolution, patch_size=patch_size, width=width, depth=depth, head_dim=head_dim,
        text_width=text_width, text_layers=text_layers,
    )
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    config = _describe(resolution, shift, guidance_scale, seed, train={
        "minutes": minutes, "patch_size": patch_size, "width": width, "depth": depth, "batch_size": batch_size,
        "lr": lr, "ema_decay": ema_decay, "sigma_scheme": sigma_scheme, "cond_dropout": cond_dropout,
        "big_objects": big_objects, "single_frac": single_frac,
    })
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    model = ShapesT2I(transformer, text_encoder, tokenizer, scheduler, config)
    t0 = time.time()
    pool = ScenePool(pool_per_category, seed=seed, resolution=resolution, big_objects=big_objects)
    print(f"pool of {pool_per_category * len(CATEGORIES)} scenes in {time.time() - t0:.0f} s", flush=True)
    log, step, start, last_ckpt = [], 0, time.time(), time.time()
    budget = minutes * 60.0
    while True:
        progress = (time.time() - start) / budget
        if max_steps is not None:
            progress = max(progress, step / max_steps)
        if progress >= 1.0:
            break
        loss = _train_step(model, pool, opt, params, batch_size=batch_size, weights=curriculum(progress, single_frac),
                           lr=_lr_at(step, progress, lr=lr, warmup=warmup), shift=shift, sigma_scheme=sigma_scheme,
                           cond_dropout=cond_dropout, gen=gen)
        decay = min(ema_decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - decay)
        pool.refresh(refresh)
        log.append(loss)
        step += 1
        if step % 100 == 0:
            print(f"step {step} loss(100) {np.mean(log[-100:]):.4f} {time.time() - start:.0f}s", flush=True)
        if checkpoint_dir and time.time() - last_ckpt > checkpoint_minutes * 60:
            _save_ema(model, params, ema, Path(checkpoint_dir) / f"step_{step:06d}", log, step, start)
            last_ckpt = time.time()
    _save_ema(model, params, ema, Path(out_dir), log, step, start)
    return model


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
        save_model(out, model)
        for p, v in zip(params, live):
            p.copy_(v)
    curve = [round(float(np.mean(log[i : i + 100])), 5) for i in range(0, len(log), 100)]
    (out / "train_log.json").write_text(json.dumps({"steps": step, "loss_per_100_steps": curve}) + "\n")
    print(f"saved EMA weights at step {step} to {out}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Pretrain the tiny ShapesWorld text-to-image flow model.")
    ap.add_argument("--out", default="assets/shapes-t2i")
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
    pretrain(
        args.out, minutes=args.minutes, seed=args.seed, patch_size=args.patch_size, width=args.width,
        depth=args.depth, batch_size=args.batch_size, lr=args.lr, shift=args.shift, single_frac=args.single_frac,
        big_objects=not args.no_big_objects, checkpoint_dir=args.checkpoint_dir,
    )
    if args.eval_split:
        for w in (1.0, 3.0):
            print(f"guidance_scale {w}")
            evaluate(args.out, args.eval_split, n_per_prompt=2, guidance_scale=w)


if __name__ == "__main__":
    main()
