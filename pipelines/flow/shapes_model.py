"""ShapesWorld's pixel-space text-to-image model (assets/shapes-t2i) as a flow-pipeline model: same SD3 transformer
code path as SD3.5, a word-level CLIP text encoder, no VAE (latents are RGB in [-1, 1]).

Loaded component by component with each class's from_pretrained, so the folder stays the diffusers layout.
"""

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipelines.flow.models import SD3Model

MODEL_FILE = "shapes_t2i.json"


def is_shapes_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / MODEL_FILE).is_file()


class ShapesT2IPipeline:
    """The four components with the attribute names the flow policy reads (`transformer`, `scheduler`...)."""

    vae = None

    def __init__(self, transformer: Any, text_encoder: Any, tokenizer: Any, scheduler: Any, config: dict):
        self.transformer, self.text_encoder, self.tokenizer = transformer, text_encoder, tokenizer
        self.scheduler, self.config = scheduler, config

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "ShapesT2IPipeline":
        # lazy: diffusers and transformers are heavy to import; only when the model loads
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import AutoTokenizer, CLIPTextModelWithProjection

        root = Path(path).expanduser()
        return cls(
            transformer=SD3Transformer2DModel.from_pretrained(root / "transformer", torch_dtype=dtype),
            text_encoder=CLIPTextModelWithProjection.from_pretrained(root / "text_encoder", dtype=dtype),
            tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
            config=json.loads((root / MODEL_FILE).read_text()),
        )

    def to(self, device: torch.device) -> "ShapesT2IPipeline":
        self.transformer.to(device)
        self.text_encoder.to(device)
        return self


class ShapesModel(SD3Model):
    """SD3 transformer over RGB pixels: encode with the shipped tokenizer + text encoder, decode = rescale."""

    def _encode(self, prompts: list[str]) -> dict[str, Tensor]:
        tok, enc = self.pipe.tokenizer, self.pipe.text_encoder
        ids = tok(
            list(prompts), padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt"
        ).input_ids.to(self.device)
        out = enc(input_ids=ids)
        return {"embeds": out.last_hidden_state.to(self.dtype), "pooled": out.text_embeds.to(self.dtype)}

    def latent_shape(self) -> tuple[int, ...]:
        res = int(self.pipe.config["resolution"])
        if (self.height, self.width) != (res, res):
            raise ValueError(
                f"pipeline.kwargs.resolution ({self.height}) must be {res} for this pixel-space model "
                f"(it has no VAE to change the size)"
            )
        return (self.pipe.transformer.config.in_channels, res, res)

    @torch.no_grad()
    def decode(self, x: Tensor, batch_size: int = 8) -> list[Tensor]:
        """Pixels are the latents: [-1, 1] -> float [3, H, W] in [0, 1] on the CPU."""
        return list((x.float() / 2 + 0.5).clamp(0, 1).cpu().unbind(0))
