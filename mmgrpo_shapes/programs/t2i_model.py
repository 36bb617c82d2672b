"""The tiny ShapesWorld text-to-image model (trained by pretrain_t2i.py): a pixel-space SD3Transformer2DModel with a
CLIP text encoder over a word-level ShapesWorld tokenizer; its builders, its prompt encoding, and its diffusers-style
folder (save_model / load, offline)."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mmgrpo_shapes.scenes import COLORS, NUMBER_WORDS, SHAPES

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
    tokenizer,
    *,
    resolution: int = 32,
    patch_size: int = 4,
    width: int = 128,
    depth: int = 6,
    head_dim: int = 32,
    text_width: int = 128,
    text_layers: int = 2,
    qk_norm: str | None = "rms_norm",
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
        vocab_size=len(tokenizer),
        hidden_size=text_width,
        intermediate_size=2 * text_width,
        num_hidden_layers=text_layers,
        num_attention_heads=max(1, text_width // 32),
        projection_dim=text_width,
        max_position_embeddings=MAX_TOKENS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    transformer = SD3Transformer2DModel(
        sample_size=resolution,
        patch_size=patch_size,
        in_channels=3,
        out_channels=3,
        num_layers=depth,
        attention_head_dim=head_dim,
        num_attention_heads=width // head_dim,
        joint_attention_dim=text_width,
        caption_projection_dim=width,
        pooled_projection_dim=text_width,
        pos_embed_max_size=resolution // patch_size,
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
