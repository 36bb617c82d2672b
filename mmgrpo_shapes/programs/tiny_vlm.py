"""The tiny Qwen2-VL that both ShapesWorld pretraining scripts (pretrain_vlm: VQA, pretrain_video: grounding and
video QA) train: its random build, batches of prompt + completion, the completion-only SFT loss and greedy
completions as the pipelines' rollouts produce them."""

import tempfile
from typing import Any

import torch
from torch import Tensor, nn


# ----- model
def build_model(
    task: str,
    *,
    hidden: int = 128,
    layers: int = 4,
    vision_dim: int = 96,
    vision_depth: int = 3,
    pixels: int = 112 * 112,
    seed: int = 0,
):
    """A randomly initialised Qwen2-VL + Qwen2VLProcessor with the byte-level tokenizer of pipelines/vlm/tiny.py.

    pixels fixes min_pixels = max_pixels: a 32 px image (or 64 px frame) is resized to 112 x 112, i.e. 8 x 8
    patches of 14 px merged 2 x 2 into 16 visual tokens per image (per 2 frames for video).
    """
    # lazy: transformers (and pipelines.vlm.tiny, which imports it) is heavy to import; only building a model needs it
    from transformers import AutoModelForImageTextToText

    from pipelines.vlm.tiny import SPECIALS, _processor, qwen_tokenizer

    with tempfile.TemporaryDirectory() as src:
        tok = qwen_tokenizer(src)
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIALS}
    config = qwen2vl_config(
        len(tok), ids, hidden=hidden, layers=layers, vision_dim=vision_dim, vision_depth=vision_depth
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    return model, _processor("qwen2_vl", tok, min_pixels=pixels, max_pixels=pixels)


def qwen2vl_config(
    vocab: int, ids: dict[str, int], *, hidden: int, layers: int, vision_dim: int, vision_depth: int
) -> Any:
    """The Qwen2VLConfig: text heads of width 32 with M-RoPE sections (t, h, w) = (8, 4, 4), untied embeddings,
    a vision tower of `vision_depth` blocks of width `vision_dim` (patch 14, 2 x 2 merge, 2 frames a group)."""
    # lazy: transformers is heavy to import; only building a model needs it
    from transformers import Qwen2VLConfig

    heads = hidden // 32
    quarter = 32 // 2 // 4  # M-RoPE sections (t, h, w) sum to head_dim / 2 = 16
    text = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [2 * quarter, quarter, quarter],
            "rope_theta": 1e4,
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": vision_depth,
        "embed_dim": vision_dim,
        "hidden_size": hidden,
        "num_heads": vision_dim // 32,
        "mlp_ratio": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


# ----- batches and loss
def collate(batch: list[dict[str, Tensor]], pad_id: int) -> tuple[dict[str, Tensor], Tensor]:
    """Right-padded model inputs for prompt + completion and the labels [B, L] (-100 outside completions)."""
    seqs = [torch.cat([b["input_ids"][0], b["completion"]]) for b in batch]
    length = max(len(s) for s in seqs)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)  # [B, L]
    labels = torch.full((len(batch), length), -100, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(batch), length), dtype=torch.long)  # [B, L]
    types = torch.zeros((len(batch), length), dtype=torch.long)  # [B, L] M-RoPE: which tokens are image/video
    for i, (s, b) in enumerate(zip(seqs, batch)):
        p = b["input_ids"].shape[1]
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
        labels[i, p : len(s)] = b["completion"]
        if "mm_token_type_ids" in b:
            types[i, :p] = b["mm_token_type_ids"][0]
    inputs = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if key in batch[0]:
            inputs[key] = torch.cat([b[key] for b in batch])
    return inputs, labels


def sft_loss(model: nn.Module, inputs: dict[str, Tensor], labels: Tensor, weights: Tensor | None = None) -> Tensor:
    """Token-mean cross-entropy of the completion tokens: -mean_t log p(y_t | prompt, y_<t); with `weights` [B, L]
    (aligned with labels, 0 outside completions) the weighted mean sum_t w_t CE_t / sum_t w_t."""
    logits = model(**inputs).logits[:, :-1]  # [B, L-1, V]
    target = labels[:, 1:]  # [B, L-1]
    if weights is None:
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100
        )
    ce = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100, reduction="none"
    )  # [B * (L-1)]
    w = weights[:, 1:].reshape(-1)  # [B * (L-1)]
    return (ce * w).sum() / w.sum()


def weighted_sft_loss(
    model: nn.Module, inputs: dict[str, Tensor], labels: Tensor, batch: list[dict[str, Tensor]]
) -> Tensor:
    """`sft_loss` weighted by each example's per-completion-token `weights` [T] (aligned after its `input_ids`); the
    plain token mean when an example has none or every weight is 1."""
    if all("weights" not in b or bool((b["weights"] == 1).all()) for b in batch):
        return sft_loss(model, inputs, labels)
    w = torch.zeros(labels.shape)  # [B, L] aligned with labels: the completion's weights, 0 elsewhere
    for i, b in enumerate(batch):
        done = b["weights"] if "weights" in b else torch.ones(len(b["completion"]))  # [T]
        p = b["input_ids"].shape[1]
        w[i, p : p + len(done)] = done
    return sft_loss(model, inputs, labels, w)


# ----- evaluation
@torch.no_grad()
def predict(model: nn.Module, encode, tok, recs: list[dict[str, Any]], *, max_new_tokens: int) -> list[str]:
    """Greedy completions (decoded without special tokens), one prompt at a time, as the pipelines' rollouts."""
    model.eval()
    out = []
    for rec in recs:
        enc = {k: v for k, v in encode(rec).items() if not k.startswith("_")}
        seq = model.generate(
            **enc, do_sample=False, max_new_tokens=max_new_tokens, stop_strings=None, pad_token_id=tok.pad_token_id
        )
        out.append(tok.decode(seq[0, enc["input_ids"].shape[1] :].tolist(), skip_special_tokens=True))
    return out


def add_architecture_args(p) -> None:
    """The model-size flags of both pretraining scripts (the defaults are the shipped models' sizes)."""
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vision-dim", type=int, default=96)
    p.add_argument("--vision-depth", type=int, default=3)
