"""TON's cold-start stage (arXiv:2505.16854): supervised fine-tuning on thought-dropout targets, so the policy learns
that an empty <think> is allowed; GRPO then runs with the `format` reward's allow_empty_think=true and the model
decides per question whether to think. loss = -(1 / sum_i |y_i|) sum_i sum_t log p(y_i,t | image, prompt, y_i,<t).

    python -m pipelines.vlm.sft configs/vlm/qwen25vl_7b_mathvision.yaml --out runs/ton_sft --steps 200 --p 0.5
    mmgrpo train configs/vlm/qwen25vl_7b_mathvision.yaml pipeline.kwargs.model=runs/ton_sft \\
        rewards.0.kwargs.allow_empty_think=true

Records may carry a "reasoning" string (JSONL key) that the kept targets think with; the answer is "answers".
"""

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmgrpo.config import load_config
from mmgrpo.errors import UserError
from pipelines.vlm.build import build_vlm
from pipelines.vlm.methods import thought_dropout
from pipelines.vlm.prefix import completion_logp


def sft_batch(policy: Any, records: list[dict[str, Any]]) -> tuple[list, Tensor, Tensor]:
    """(prompt encodings [n], target ids + EOS [n, K] right-padded, lengths [n]) of records holding a "target"."""
    tok = policy.tokenizer
    eos = policy.eos_ids[0] if tok.eos_token_id is None else int(tok.eos_token_id)
    ids = [tok(r["target"], add_special_tokens=False)["input_ids"] + [eos] for r in records]
    k = max(len(x) for x in ids)
    completions = torch.tensor([x + [tok.pad_token_id] * (k - len(x)) for x in ids], device=policy.device)  # [n, K]
    lengths = torch.tensor([len(x) for x in ids], device=policy.device)  # [n]
    return [policy.encode(r) for r in records], completions, lengths


def sft_loss(policy: Any, records: list[dict[str, Any]]) -> Tensor:
    """Token-mean negative log-likelihood of the records' targets (temperature 1, the model's own distribution)."""
    encs, completions, lengths = sft_batch(policy, records)
    module = policy.module
    base = module.hf.get_base_model() if hasattr(module.hf, "get_base_model") else module.hf
    logp, _ = completion_logp(
        base.model,
        base.get_output_embeddings(),
        encs,
        completions,
        lengths,
        shared=module.shared,
        pad_id=module.pad_id,
        temperature=1.0,
        chunk_tokens=module.chunk_tokens,
        suppress=module.suppress if module.suppress_ids else None,
    )  # [n, K], 0 past lengths
    return -logp.sum() / lengths.sum()


def thought_dropout_sft(
    policy: Any,
    records: list[dict[str, Any]],
    *,
    steps: int,
    p: float = 0.5,
    lr: float = 1e-4,
    batch_size: int = 8,
    seed: int = 0,
) -> list[float]:
    """`steps` AdamW steps on thought-dropout targets of `records` (a fresh dropout draw per epoch); the losses."""
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise UserError(f"TON SFT needs steps >= 1, batch_size >= 1 and lr > 0, got {steps}, {batch_size}, {lr}")
    if not records:
        raise UserError("TON SFT got no training records; check pipeline.kwargs.data")
    params = list(policy.trainable_parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng, order, epoch, losses = random.Random(seed), [], 0, []
    policy.module.train()
    for _ in range(steps):
        if len(order) < batch_size:  # next epoch: reshuffle and redraw which thoughts are dropped
            data = thought_dropout(records, p=p, seed=seed + epoch)
            epoch += 1
            rng.shuffle(data)
            order += data
        batch, order = order[:batch_size], order[batch_size:]
        loss = sft_loss(policy, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def save_model(policy: Any, out: str | Path) -> None:
    """The SFT model as a plain transformers directory (LoRA merged) with its processor: GRPO's pipeline.kwargs.model."""
    hf = policy.module.hf
    model = hf.merge_and_unload() if hasattr(hf, "merge_and_unload") else hf
    model.save_pretrained(str(out))
    policy.processor.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of the GRPO recipe (model, data, ...)")
    ap.add_argument("--out", required=True, help="directory for the SFT model (then pipeline.kwargs.model=OUT)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--p", type=float, default=0.5, help="thought-dropout probability (TON uses 0.5)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if cfg.pipeline.name != "vlm":
        raise UserError(f"pipeline.name ({cfg.pipeline.name!r}) must be vlm for the TON SFT stage")
    task = build_vlm(seed=cfg.run.seed, device=torch.device(args.device), **cfg.pipeline.kwargs)
    losses = thought_dropout_sft(
        task.policy,
        task.train_data,
        steps=args.steps,
        p=args.p,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=cfg.run.seed,
    )
    save_model(task.policy, args.out)
    print(f"TON SFT: {args.steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; model in {args.out}")
    return losses


if __name__ == "__main__":
    try:
        main()
    except UserError as err:  # one line and exit code 2, as the mmgrpo CLI
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
