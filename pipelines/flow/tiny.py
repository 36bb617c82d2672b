"""Tiny random diffusers pipelines (SD3, FLUX.1, Wan 2.1) saved with `save_pretrained`, for tests and CPU recipes.

Same classes as the real checkpoints, a few thousand parameters each; tokenizers are built offline (no hub).
"""

import os
import shutil
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from mmgrpo.offline import write_clip_bpe
from pipelines.flow.tiny_unet import build_sd, build_sdxl

MODEL_TYPES = ("sd3", "flux", "wan", "sd", "sdxl")
_T5_CHARS = " abcdefghijklmnopqrstuvwxyz0123456789.,'\"!?-:;()"


def clip_tokenizer(path: Path, n_merges: int = 0):
    """The real CLIP BPE (open_clip's bundled merges, first `n_merges`) as a transformers CLIPTokenizer.

    With n_merges=0 it is byte-level: 512 symbols + bos (V-2) + eos (V-1).
    """
    write_clip_bpe(path, n_merges)
    return CLIPTokenizer(str(Path(path) / "vocab.json"), str(Path(path) / "merges.txt"), model_max_length=77)


def t5_tokenizer():
    """A character-level Unigram tokenizer with T5's specials (pad=0, eos=1, unk=2), as PreTrainedTokenizerFast."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(c, -1.0) for c in _T5_CHARS]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )


def _clip_text(v: int, projection: bool):
    cfg = CLIPTextConfig(
        vocab_size=v,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=32,
        bos_token_id=v - 2,
        eos_token_id=v - 1,
        pad_token_id=v - 1,
        hidden_act="gelu",
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg)


def _t5(umt5: bool = False):
    kw = {
        "vocab_size": 64,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 37,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
    }
    return UMT5EncoderModel(UMT5Config(**kw)) if umt5 else T5EncoderModel(T5Config(**kw))


def _vae():
    return AutoencoderKL(
        block_out_channels=[8, 16],
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )


def _sd3(tmp: Path):
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
        pos_embed_max_size=64,
    )
    tok = clip_tokenizer(tmp / "clip")
    v = len(tok)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(),
        text_encoder=_clip_text(v, True),
        tokenizer=tok,
        text_encoder_2=_clip_text(v, True),
        tokenizer_2=tok,
        text_encoder_3=_t5(),
        tokenizer_3=t5_tokenizer(),
    )


def _flux(tmp: Path):
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
        guidance_embeds=True,
    )
    vae = AutoencoderKL(
        block_out_channels=[8, 16],
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    )
    sched = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    tok = clip_tokenizer(tmp / "clip")
    return FluxPipeline(
        transformer=transformer,
        scheduler=sched,
        vae=vae,
        text_encoder=_clip_text(len(tok), False),
        tokenizer=tok,
        text_encoder_2=_t5(),
        tokenizer_2=t5_tokenizer(),
    )


def _wan(tmp: Path):
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    return WanPipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=_t5(umt5=True),
        tokenizer=t5_tokenizer(),
    )


def _sd(tmp: Path):
    tok = clip_tokenizer(tmp / "clip")
    return build_sd(tok, _clip_text(len(tok), False))


def _sdxl(tmp: Path):
    tok = clip_tokenizer(tmp / "clip")
    return build_sdxl(tok, _clip_text(len(tok), False), _clip_text(len(tok), True))


def save_tiny(model_type: str, path: str | os.PathLike, *, seed: int = 0) -> str:
    """Build a tiny random diffusers pipeline of `model_type` (one of MODEL_TYPES) and save it to `path`.

    The directory loads with `DiffusionPipeline.from_pretrained(path)` like a hub checkpoint. Returns the path.
    """
    builders = {"sd3": _sd3, "flux": _flux, "wan": _wan, "sd": _sd, "sdxl": _sdxl}
    if model_type not in builders:
        raise ValueError(f"model_type={model_type!r} is not a tiny model we can build; choose from {MODEL_TYPES}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    pipe = builders[model_type](out / "_tok_tmp")
    pipe.save_pretrained(str(out))
    shutil.rmtree(out / "_tok_tmp", ignore_errors=True)
    return str(out)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        raise SystemExit(f"usage: python -m pipelines.flow.tiny {{{'|'.join(MODEL_TYPES)}}} OUT_DIR")
    print(save_tiny(sys.argv[1], sys.argv[2]))
