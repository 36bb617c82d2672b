"""Tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoints with an offline byte-level Qwen-style tokenizer and the real processor.

For tests and the CPU recipe only: weights are random; the directory loads through AutoProcessor/AutoModel as usual.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AddedToken,
    AutoModelForImageTextToText,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLConfig,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

TINY_MODELS = {
    "tiny-random-qwen2-vl": "qwen2_vl",
    "tiny-random-qwen2.5-vl": "qwen2_5_vl",
    "tiny-random-qwen3-vl": "qwen3_vl",
}
"""model names the `vlm` builder creates on the fly (in a cache dir) instead of loading from the Hub"""

TINY_VERSION = 1
"""bumped whenever the tiny configs change, so a stale cached copy is never reused"""
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
"""added (non-special) tokens: one id per reasoning tag, so a random tiny model can learn the format in few steps"""

# Qwen-style chat template: <|im_start|>role\ncontent<|im_end|>\n, images as <|vision_start|><|image_pad|><|vision_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins of byte-level BPE (GPT-2 table), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def qwen_tokenizer(out_dir: str | os.PathLike):
    """A Qwen2Tokenizer over the 256 bytes (no merges) + Qwen's specials + the reasoning tags; saved to out_dir.

    Ids: bytes 0..255, then the 7 specials (pad <|endoftext|>, eos <|im_end|>), then the 4 tags: vocabulary 267.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "merges.txt").write_text("#version: 0.2\n")
    tok = Qwen2Tokenizer(
        vocab=str(out / "vocab.json"),
        merges=str(out / "merges.txt"),
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True) for s in SPECIALS]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _config(kind: str, tok):
    """Qwen2-VL, Qwen2.5-VL or Qwen3-VL config with hidden 64, 2 text layers, 2 vision blocks (about 0.2M parameters)."""
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIALS}
    text = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        # M-RoPE sections (temporal, height, width) must sum to head_dim / 2 = 64 / 4 / 2 = 8
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    tokens = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    common = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
    if kind == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, **common}
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
    if kind == "qwen3_vl":  # 16-pixel patches, interleaved M-RoPE, DeepStack features injected after vision block 0
        text = {**text, "head_dim": 16, "rope_parameters": {**text["rope_parameters"], "mrope_interleaved": True}}
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
            **common,
            "patch_size": 16,
        }
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
        **common,
    }
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)


def _processor(kind: str, tok, *, min_pixels: int, max_pixels: int):
    if kind == "qwen3_vl":
        image = Qwen2VLImageProcessor(patch_size=16, min_pixels=min_pixels, max_pixels=max_pixels)
        video = Qwen3VLVideoProcessor(patch_size=16, size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
        return Qwen3VLProcessor(
            image_processor=image, tokenizer=tok, video_processor=video, chat_template=CHAT_TEMPLATE
        )
    image = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    video = Qwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    cls = Qwen2VLProcessor if kind == "qwen2_vl" else Qwen2_5_VLProcessor
    return cls(image_processor=image, tokenizer=tok, video_processor=video, chat_template=CHAT_TEMPLATE)


def save_tiny_vlm(
    out_dir: str | os.PathLike,
    kind: str = "qwen2_vl",
    *,
    seed: int = 0,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> str:
    """Build a random tiny `kind` ("qwen2_vl" | "qwen2_5_vl" | "qwen3_vl") model + processor; save_pretrained both.

    Images are resized to between min_pixels and max_pixels (default 2x2 to 4x4 merged patches of 28 pixels, or 32
    for Qwen3-VL: 4 to 16 image tokens), which keeps CPU steps fast.
    Returns out_dir as a string, loadable with AutoProcessor / AutoModelForImageTextToText.from_pretrained.
    """
    if kind not in TINY_MODELS.values():
        raise ValueError(f"kind={kind!r} must be one of {sorted(TINY_MODELS.values())}")

    merged = 32 if kind == "qwen3_vl" else 28  # patch 16 or 14, spatial merge 2
    min_pixels, max_pixels = min_pixels or (2 * merged) ** 2, max_pixels or (4 * merged) ** 2
    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as src:
        tok = qwen_tokenizer(src)
    config = _config(kind, tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    _processor(kind, tok, min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(out)
    return str(out)


def tiny_model_dir(name: str, cache_dir: str | os.PathLike | None = None) -> str:
    """The directory of tiny model `name` (a key of TINY_MODELS), built once under cache_dir and reused after.

    cache_dir defaults to $MMGRPO_CACHE or ~/.cache/mmgrpo. Building takes about a second.
    """
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; choose from {sorted(TINY_MODELS)}")
    root = Path(cache_dir or os.environ.get("MMGRPO_CACHE") or Path.home() / ".cache" / "mmgrpo")
    out = root / f"{name}-v{TINY_VERSION}"
    if not ((out / "config.json").is_file() and (out / "processor_config.json").is_file()):
        tmp = root / f".{name}.tmp{os.getpid()}"
        save_tiny_vlm(tmp, TINY_MODELS[name])
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, out)  # atomic, so a concurrent builder never sees half a directory
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; its copy is complete
    return str(out)
