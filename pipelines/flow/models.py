"""Adapters from unpatched diffusers pipelines (SD3/SD3.5, FLUX.1, Wan 2.1) to one velocity/encode/decode interface.

Each adapter only calls public pipeline methods and the transformer's forward; diffusers is imported by the caller.
"""

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from pipelines.flow import sde

MODEL_TYPES = ("sd3", "flux", "wan", "shapes", "sd", "sdxl")
_CLASS_TO_TYPE = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "WanPipeline": "wan",
    "ShapesT2IPipeline": "shapes",
    "StableDiffusionPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl",
}
EPS_TYPES = ("sd", "sdxl")
"""epsilon-prediction UNet pipelines (pipelines/flow/unet.py): they step with sde "ddim" only"""


def model_type_of(pipe_class_name: str) -> str | None:
    """A MODEL_TYPES name for a diffusers pipeline class name (from model_index.json `_class_name`), else None."""
    return _CLASS_TO_TYPE.get(pipe_class_name)


def denoiser_of(pipe: Any) -> torch.nn.Module:
    """The trained network: `pipe.transformer` (SD3, FLUX, Wan, ShapesWorld) or `pipe.unet` (SD 1.x, SDXL)."""
    module = getattr(pipe, "transformer", None)
    return pipe.unet if module is None else module


def _rows(enc: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """{key: [B, ...]} -> B dicts {key: [...]}."""
    n = len(next(iter(enc.values())))
    return [{k: v[i] for k, v in enc.items()} for i in range(n)]


class FlowModel:
    """What the policy needs from a text-to-image/video flow model: prompt encoding, velocity, latents, decoding.

    Conditioning is a dict of per-sample tensors (leading dim = batch) so it can ride in `Rollout.extras`.
    """

    def __init__(
        self,
        pipe: Any,
        *,
        height: int,
        width: int,
        num_frames: int = 1,
        guidance_scale: float = 1.0,
        negative_prompt: str = "",
        max_sequence_length: int | None = None,
        device: torch.device,
        dtype: torch.dtype,
        prompt_cache_items: int = 256,
    ):
        self.pipe, self.height, self.width, self.num_frames = pipe, height, width, num_frames
        self.guidance_scale, self.negative_prompt = guidance_scale, negative_prompt
        self.max_sequence_length, self.device, self.dtype = max_sequence_length, device, dtype
        self.negative: dict[str, Tensor] | None = None
        # least recently used first; bounded because a T5 encoding is MBs per prompt and lives on the device
        self._cache: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        self.prompt_cache_items = prompt_cache_items

    # -- subclass hooks
    def _encode(self, prompts: list[str]) -> dict[str, Tensor]:
        raise NotImplementedError

    def latent_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def forward(self, transformer: torch.nn.Module, x: Tensor, sigma: Tensor, cond: dict[str, Tensor]) -> Tensor:
        """The transformer's velocity for latents x [M, ...] at noise levels sigma [M] under conditioning cond."""
        raise NotImplementedError

    def _decode_latents(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def sigmas(self, num_steps: int) -> Tensor:
        cfg = self.pipe.scheduler.config
        shift = float(cfg.get("shift", None) or cfg.get("flow_shift", None) or 1.0)
        return sde.sigmas(num_steps, shift, num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)))

    # -- shared
    @property
    def cfg(self) -> bool:
        """True classifier-free guidance (two transformer passes); FLUX uses its guidance embedding instead."""
        return self.guidance_scale > 1.0

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, Tensor]:
        """Conditioning for `prompts` ([B, ...] per key), cached per prompt text (the text encoders are frozen) in an
        LRU of `prompt_cache_items` prompts (0: no cache; a batch is always encoded whole)."""
        missing = sorted({p for p in prompts if p not in self._cache})
        fresh = dict(zip(missing, _rows(self._encode(missing)))) if missing else {}
        if self.cfg and self.negative is None:
            self.negative = self._encode([self.negative_prompt])
        rows = [fresh[p] if p in fresh else self._cache[p] for p in prompts]
        for p in dict.fromkeys(prompts):  # this batch's prompts become the most recent
            self._cache[p] = fresh.get(p) or self._cache[p]
            self._cache.move_to_end(p)
        while len(self._cache) > self.prompt_cache_items:
            self._cache.popitem(last=False)
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def velocity(self, transformer: torch.nn.Module, x: Tensor, sigma: Tensor, cond: dict[str, Tensor]) -> Tensor:
        """Guided velocity: v_u + w (v_c - v_u) with one batched pass when CFG is on, else the conditional v."""
        if not self.cfg:
            return self.forward(transformer, x, sigma, cond)
        neg = {k: v.expand(len(x), *v.shape[1:]) for k, v in self.negative.items()}
        both = {k: torch.cat([neg[k], cond[k]]) for k in cond}
        v_u, v_c = self.forward(transformer, torch.cat([x, x]), torch.cat([sigma, sigma]), both).chunk(2)
        return v_u + self.guidance_scale * (v_c - v_u)

    @torch.no_grad()
    def decode(self, x: Tensor, batch_size: int = 8) -> list[Tensor]:
        """Samples for rewards: float [3, H, W] images or [F, 3, H, W] videos in [0, 1], on the CPU."""
        out = []
        vae = self.pipe.vae
        for chunk in x.split(batch_size):
            pixels = self._decode_latents(chunk.to(vae.dtype))
            out.extend((pixels.float() / 2 + 0.5).clamp(0, 1).cpu().unbind(0))
        return out

    def _vae_shape(self) -> tuple[int, int]:
        f = self.pipe.vae_scale_factor if hasattr(self.pipe, "vae_scale_factor") else 8
        if self.height % (2 * f) or self.width % (2 * f):
            raise ValueError(
                f"resolution {self.height}x{self.width} must be a multiple of {2 * f} for this model "
                f"(VAE factor {f} times patch size 2)"
            )
        return self.height // f, self.width // f


class SD3Model(FlowModel):
    """StableDiffusion3Pipeline (SD3, SD3.5): CLIP-L + CLIP-G + T5 conditioning, SD3Transformer2DModel."""

    def _encode(self, prompts):
        kw = {"max_sequence_length": self.max_sequence_length} if self.max_sequence_length else {}
        emb, _, pooled, _ = self.pipe.encode_prompt(
            prompts, None, None, device=self.device, do_classifier_free_guidance=False, **kw
        )
        return {"embeds": emb.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def latent_shape(self):
        return (self.pipe.transformer.config.in_channels, *self._vae_shape())

    def forward(self, transformer, x, sigma, cond):
        return transformer(
            hidden_states=x,
            timestep=sigma * 1000,
            encoder_hidden_states=cond["embeds"],
            pooled_projections=cond["pooled"],
            return_dict=False,
        )[0]

    def _decode_latents(self, x):
        vae = self.pipe.vae
        return vae.decode(x / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]


class FluxModel(FlowModel):
    """FluxPipeline (FLUX.1): packed 2x2 latents, CLIP pooled + T5 sequence, guidance embedding (no true CFG)."""

    def __init__(self, pipe, **kw):
        super().__init__(pipe, **kw)
        self.embedded_guidance = self.guidance_scale
        self.guidance_scale = 1.0  # FLUX.1-dev is guidance-distilled: the scale goes into the embedding

    def _encode(self, prompts):
        kw = {"max_sequence_length": self.max_sequence_length} if self.max_sequence_length else {}
        emb, pooled, _ = self.pipe.encode_prompt(prompts, None, device=self.device, **kw)
        return {"embeds": emb.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def latent_shape(self):
        h, w = self._vae_shape()
        return ((h // 2) * (w // 2), self.pipe.transformer.config.in_channels)

    def sigmas(self, num_steps):
        # lazy: diffusers is heavy to import (seconds); `import pipelines` stays light
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        cfg = self.pipe.scheduler.config
        if not cfg.get("use_dynamic_shifting", False):
            return sde.sigmas(num_steps, float(cfg.get("shift", 1.0)), grid="uniform")
        mu = calculate_shift(
            self.latent_shape()[0],
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15),
        )
        return sde.sigmas(num_steps, dynamic=mu, grid="uniform")

    def forward(self, transformer, x, sigma, cond):
        h, w = self._vae_shape()
        img_ids = self.pipe._prepare_latent_image_ids(len(x), h // 2, w // 2, x.device, x.dtype)
        txt_ids = torch.zeros(cond["embeds"].shape[1], 3, device=x.device, dtype=x.dtype)
        guidance = None
        if transformer_config(transformer).get("guidance_embeds", False):
            guidance = torch.full((len(x),), self.embedded_guidance, device=x.device, dtype=torch.float32)
        return transformer(
            hidden_states=x,
            timestep=sigma,
            guidance=guidance,
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["embeds"],
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]

    def _decode_latents(self, x):
        vae = self.pipe.vae
        lat = self.pipe._unpack_latents(x, self.height, self.width, self.pipe.vae_scale_factor)
        return vae.decode(lat / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]


class WanModel(FlowModel):
    """WanPipeline (Wan 2.1 text-to-video): UMT5 conditioning, WanTransformer3DModel over [C, F, H, W] latents."""

    def _encode(self, prompts):
        kw = {"max_sequence_length": self.max_sequence_length} if self.max_sequence_length else {}
        emb, _ = self.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=self.device, **kw)
        return {"embeds": emb.to(self.dtype)}

    def latent_shape(self):
        t = self.pipe.vae_scale_factor_temporal
        if (self.num_frames - 1) % t:
            raise ValueError(
                f"num_frames={self.num_frames} must be 1 + a multiple of {t} for Wan's VAE, "
                f"e.g. {1 + t * max(1, (self.num_frames - 1) // t)}"
            )
        f = self.pipe.vae_scale_factor_spatial
        if self.height % (2 * f) or self.width % (2 * f):
            raise ValueError(f"resolution {self.height}x{self.width} must be a multiple of {2 * f} for Wan")
        c = self.pipe.transformer.config.in_channels
        return (c, (self.num_frames - 1) // t + 1, self.height // f, self.width // f)

    def forward(self, transformer, x, sigma, cond):
        return transformer(
            hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=cond["embeds"], return_dict=False
        )[0]

    def _decode_latents(self, x):
        vae = self.pipe.vae
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean, device=x.device, dtype=x.dtype).view(1, z, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, device=x.device, dtype=x.dtype).view(1, z, 1, 1, 1)
        video = vae.decode(x / inv_std + mean, return_dict=False)[0]  # [n, 3, F, H, W]
        return video.permute(0, 2, 1, 3, 4)  # [n, F, 3, H, W]


def transformer_config(module: torch.nn.Module) -> dict:
    """The diffusers config of a (possibly DDP-wrapped) transformer."""
    inner = getattr(module, "module", module)
    return dict(getattr(inner, "config", {}))


ADAPTERS = {"sd3": SD3Model, "flux": FluxModel, "wan": WanModel}


LORA_TARGETS = {
    # Flow-GRPO's SD3 targets: joint attention projections of both streams
    "sd3": [
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
    ],
    "flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
    "wan": ["to_q", "to_k", "to_v", "to_out.0"],
}
LORA_TARGETS["shapes"] = LORA_TARGETS["sd3"]  # the same SD3 transformer class
LORA_TARGETS["sd"] = LORA_TARGETS["sdxl"] = ["to_q", "to_k", "to_v", "to_out.0"]  # DDPO: every UNet attention


def num_params(module: torch.nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)
