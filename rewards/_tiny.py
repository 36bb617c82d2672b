"""Tiny random reward models saved in the real on-disk formats, for tests and offline smoke runs (no download).

Each builder writes a directory (or file) that the matching reward loads through its normal loading code.
"""

import os
from pathlib import Path

import torch
from transformers import (
    BertTokenizer,
    BlipConfig,
    BlipForImageTextRetrieval,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
    CLIPTokenizer,
    TrOCRConfig,
    TrOCRForCausalLM,
    VisionEncoderDecoderModel,
    ViTConfig,
    ViTImageProcessor,
    ViTModel,
)

from mmgrpo.offline import write_clip_bpe
from rewards.clip_family import AestheticMLP
from rewards.imagereward import HEAD_FILE, save_pretrained

TINY_OPEN_CLIP = "mmgrpo-tiny-clip"


def write_clip_tokenizer(out_dir: str | os.PathLike, n_merges: int = 200) -> int:
    """The real CLIP BPE as vocab.json + merges.txt (see mmgrpo.offline.write_clip_bpe); returns the vocab size."""
    return write_clip_bpe(out_dir, n_merges)


def clip_tokenizer(out_dir: str | os.PathLike, n_merges: int = 200):
    write_clip_tokenizer(out_dir, n_merges)
    return CLIPTokenizer(str(Path(out_dir) / "vocab.json"), str(Path(out_dir) / "merges.txt"))


def tiny_hf_clip(out_dir: str | os.PathLike, *, image_size: int = 32, projection_dim: int = 16) -> str:
    """A random transformers CLIPModel + CLIPProcessor (real CLIP BPE, 200 merges) saved with save_pretrained."""
    tok = clip_tokenizer(out_dir)
    v = len(tok)
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=v,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=v - 2,
            eos_token_id=v - 1,
            pad_token_id=v - 1,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=image_size,
            patch_size=8,
        ),
        projection_dim=projection_dim,
    )
    torch.manual_seed(0)
    CLIPModel(cfg).eval().save_pretrained(out_dir)
    image_proc = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    CLIPProcessor(image_processor=image_proc, tokenizer=tok).save_pretrained(out_dir)
    return str(out_dir)


def tiny_aesthetic_head(path: str | os.PathLike, in_dim: int = 16) -> str:
    """A random LAION aesthetic MLP head state dict (keys layers.{0,2,4,6,7}.*) saved with torch.save."""
    torch.manual_seed(1)
    torch.save(AestheticMLP(in_dim).state_dict(), path)
    return str(path)


def register_tiny_open_clip(image_size: int = 32) -> str:
    """Register a 1.6M-parameter open_clip architecture under TINY_OPEN_CLIP (full CLIP vocab, width 32)."""
    # lazy: open_clip is heavy to import (seconds); only the open_clip builders need it
    import open_clip

    open_clip.factory._MODEL_CONFIGS[TINY_OPEN_CLIP] = dict(
        embed_dim=32,
        vision_cfg=dict(image_size=image_size, layers=2, width=32, head_width=16, patch_size=8),
        text_cfg=dict(context_length=77, vocab_size=49408, width=32, heads=2, layers=2),
    )
    return TINY_OPEN_CLIP


def tiny_open_clip_checkpoint(path: str | os.PathLike, *, wrap: bool = True) -> str:
    """Save a random tiny open_clip model; wrap=True stores {"state_dict": ...} as the HPS checkpoints do."""
    # lazy: open_clip is heavy to import (seconds); only the open_clip builders need it
    import open_clip

    register_tiny_open_clip()
    torch.manual_seed(2)
    model = open_clip.create_model(TINY_OPEN_CLIP, pretrained=None)
    sd = model.state_dict()
    torch.save({"state_dict": sd} if wrap else sd, path)
    return str(path)


def tiny_blip_imagereward(out_dir: str | os.PathLike, *, width: int = 32, text_width: int = 24) -> str:
    """A random tiny BlipForImageTextRetrieval + BERT WordPiece tokenizer + MLP head, in ImageReward's dir format."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    words = [
        "a",
        "an",
        "the",
        "cat",
        "dog",
        "red",
        "blue",
        "green",
        "photo",
        "of",
        "on",
        "in",
        "with",
        "sign",
        "says",
        "open",
    ]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789")
    (out / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words + chars) + "\n")
    tok = BertTokenizer(str(out / "vocab.txt"))
    cfg = BlipConfig(
        vision_config=dict(
            hidden_size=width,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=max(1, width // 64) if width % 64 == 0 else 2,
            image_size=32,
            patch_size=8,
            layer_norm_eps=1e-6,
        ),
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=text_width,
            encoder_hidden_size=width,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=max(1, text_width // 64) if text_width % 64 == 0 else 2,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=2,
            sep_token_id=3,
        ),
    )
    torch.manual_seed(3)
    net = BlipForImageTextRetrieval(cfg).eval()
    save_pretrained(str(out), net, tok, AestheticMLP(text_width))
    return str(out)


_VIS_TO_ORIGINAL = {
    "layer_norm1": "norm1",
    "layer_norm2": "norm2",
    "self_attn.qkv": "attn.qkv",
    "self_attn.projection": "attn.proj",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def original_imagereward_state_dict(ir_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A saved transformers-format ImageReward dir as THUDM's ImageReward.pt names it (BLIP timm-ViT + BERT + mlp)."""
    hf = BlipForImageTextRetrieval.from_pretrained(str(ir_dir)).state_dict()
    out = {f"mlp.{k}": v for k, v in torch.load(Path(ir_dir) / HEAD_FILE, weights_only=True).items()}
    emb = {"class_embedding": "cls_token", "position_embedding": "pos_embed"}
    for key, value in hf.items():
        if key.startswith("text_encoder."):
            out["blip." + key] = value
        elif key.startswith("vision_model.embeddings."):
            leaf = key.rsplit(".", 1)[-1]
            name = emb.get(leaf) or f"patch_embed.proj.{leaf}"
            out["blip.visual_encoder." + name] = value
        elif key.startswith("vision_model.post_layernorm."):
            out["blip.visual_encoder.norm." + key.rsplit(".", 1)[-1]] = value
        elif key.startswith("vision_model.encoder.layers."):
            i, rest = key[len("vision_model.encoder.layers.") :].split(".", 1)
            sub, leaf = rest.rsplit(".", 1)
            out[f"blip.visual_encoder.blocks.{i}.{_VIS_TO_ORIGINAL[sub]}.{leaf}"] = value
    return out


def tiny_trocr(out_dir: str | os.PathLike) -> str:
    """A random tiny VisionEncoderDecoder (ViT encoder + TrOCR decoder) with a CLIP-BPE tokenizer, save_pretrained."""
    tok = clip_tokenizer(out_dir)
    v = len(tok)
    enc = ViTModel(
        ViTConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=37,
            image_size=32,
            patch_size=8,
        )
    )
    dec = TrOCRForCausalLM(
        TrOCRConfig(
            vocab_size=v,
            d_model=32,
            decoder_layers=1,
            decoder_attention_heads=2,
            decoder_ffn_dim=37,
            max_position_embeddings=64,
            bos_token_id=v - 2,
            eos_token_id=v - 1,
            pad_token_id=v - 1,
            decoder_start_token_id=v - 2,
        )
    )
    torch.manual_seed(4)
    model = VisionEncoderDecoderModel(encoder=enc, decoder=dec).eval()
    model.config.decoder_start_token_id, model.config.pad_token_id, model.config.eos_token_id = v - 2, v - 1, v - 1
    model.generation_config.decoder_start_token_id = v - 2
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = v - 1, v - 1
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(out_dir)
    return str(out_dir)
