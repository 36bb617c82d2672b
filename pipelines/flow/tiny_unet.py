"""Tiny random epsilon-prediction UNet pipelines (StableDiffusionPipeline, StableDiffusionXLPipeline) for tests.

Same classes and scheduler configs as SD 1.5 / SDXL base (PNDM / Euler with their betas); text parts come from tiny.py.
"""

from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)

_BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1}
"""SD 1.5's and SDXL base's noise schedule (their scheduler/scheduler_config.json): "leading" spacing, offset 1"""


def _vae():
    return AutoencoderKL(
        block_out_channels=[8, 16],
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        norm_num_groups=4,
        scaling_factor=0.18215,
    )


def _unet(cross_attention_dim: int, **extra):
    return UNet2DConditionModel(
        block_out_channels=(16, 32),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=4,
        norm_num_groups=8,
        **extra,
    )


def build_sd(tokenizer, text_encoder):
    """A StableDiffusionPipeline (SD 1.5 layout: PNDM scheduler config, no safety checker) around a tiny UNet."""
    sched = PNDMScheduler(skip_prk_steps=True, set_alpha_to_one=False, **_BETAS)
    sched.register_to_config(clip_sample=False)  # as SD 1.5's scheduler_config.json (read by DDIMScheduler)
    return StableDiffusionPipeline(
        vae=_vae(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=_unet(text_encoder.config.hidden_size),
        scheduler=sched,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_sdxl(tokenizer, text_encoder, text_encoder_2):
    """A StableDiffusionXLPipeline (Euler scheduler config, text_time micro-conditioning) around a tiny UNet.

    Cross-attention width = both encoders' hidden sizes; the add-embedding input = 6 time ids x 8 + pooled width."""
    width = text_encoder.config.hidden_size + text_encoder_2.config.hidden_size
    unet = _unet(
        width,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + text_encoder_2.config.projection_dim,
    )
    return StableDiffusionXLPipeline(
        vae=_vae(),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=EulerDiscreteScheduler(timestep_spacing="leading", **_BETAS),
    )
