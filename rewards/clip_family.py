"""CLIP-family image rewards: CLIP score (open_clip), PickScore, HPSv2.1 and the LAION aesthetic predictor v2.

Each loads from a hub id or a local path, preprocesses like its original repository, and has a differentiable mode.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rewards._hub import autocast, hub_file, loading, parse_device, parse_dtype
from rewards._images import CLIP_MEAN, CLIP_STD, resize_crop_normalize, to_pil_list, to_tensor
from rewards.api import REWARDS, Reward


class ClipReward(Reward):
    """Shared batching for CLIP-like rewards: pixels -> image embedding, prompts -> text embedding, head -> [N]."""

    input = "image"
    needs_prompts = True

    def __init__(self, *, device, dtype, batch_size: int, differentiable: bool, use_autocast: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.device, self.dtype = parse_device(device), parse_dtype(dtype)
        self.batch_size, self.differentiable, self.use_autocast = batch_size, differentiable, use_autocast
        self.image_size, self.mean, self.std = 224, CLIP_MEAN, CLIP_STD
        self.tensor_transform = False  # HPSv2 resizes the float tensor (ToTensor first), not the PIL image

    def pixels(self, samples: list[Any]) -> Tensor:
        """[N, 3, S, S] normalised pixels: the original processor on PIL, or the torch twin when differentiable."""
        size, mean, std, clamp = self.image_size, self.mean, self.std, not self.tensor_transform
        if self.differentiable:
            x = to_tensor(samples).to(self.device, self.dtype)  # [N, 3, H, W] in [0, 1]
            return resize_crop_normalize(x, size, mean=mean, std=std, clamp=clamp)
        if self.tensor_transform:  # image by image: sizes may differ; float32 like ToTensor, then cast
            one = [
                resize_crop_normalize(to_tensor([im]), size, mean=mean, std=std, clamp=False)
                for im in to_pil_list(samples)
            ]
            return torch.cat(one).to(self.device, self.dtype)  # [N, 3, S, S]
        return self.processor_pixels(to_pil_list(samples)).to(self.device, self.dtype)

    def score(self, samples, prompts):
        unique = list(dict.fromkeys(prompts))  # a group repeats its prompt G times: embed each once
        index = torch.tensor([unique.index(p) for p in prompts], device=self.device)
        out = []
        with torch.set_grad_enabled(self.differentiable), autocast(self.device, self.use_autocast):
            txt = self.embed_texts(unique)[index] if unique else None  # [N, D]
            for i in range(0, len(samples), self.batch_size):
                img = self.embed_images(self.pixels(samples[i : i + self.batch_size]))  # [n, D]
                out.append(self.head(img, None if txt is None else txt[i : i + self.batch_size]).float())
        return torch.cat(out)  # [N]

    def processor_pixels(self, images):  # pragma: no cover - abstract
        raise NotImplementedError


# ---- open_clip: CLIP score and HPSv2.1 ------------------------------------------------------------------------
class OpenClipReward(ClipReward):
    """An open_clip model scored by (optionally scaled) cosine similarity of image and prompt embeddings."""

    def __init__(
        self,
        *,
        name: str,
        model: str,
        pretrained: str | None,
        checkpoint: str | None,
        scale: float,
        device,
        dtype,
        batch_size: int,
        differentiable: bool,
        checkpoint_file: str = "",
        tensor_transform: bool = False,
        clamp_zero: bool = False,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, differentiable=differentiable)
        self.tensor_transform = tensor_transform
        # lazy: open_clip is heavy to import (seconds); only when this reward is built
        import open_clip

        # fetch the checkpoint before building the model: offline, a missing file fails before a 1B-param init
        path = None if checkpoint is None else hub_file(checkpoint, checkpoint_file, name, "checkpoint")
        with loading(model if pretrained is None else f"{model}:{pretrained}", name, "pretrained"):
            net, _, preprocess = open_clip.create_model_and_transforms(
                model, pretrained=pretrained if checkpoint is None else None, device="cpu"
            )
        if path is not None:
            state = torch.load(path, map_location="cpu", weights_only=True)
            net.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
        self.model = net.to(self.device, self.dtype).eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(model)
        self.preprocess_pil, self.scale, self.clamp_zero = preprocess, scale, clamp_zero
        size = net.visual.image_size
        self.image_size = size[0] if isinstance(size, tuple | list) else int(size)
        self.mean = tuple(getattr(net.visual, "image_mean", None) or CLIP_MEAN)
        self.std = tuple(getattr(net.visual, "image_std", None) or CLIP_STD)
        how = (
            "ToTensor then bicubic tensor resize (HPSv2 transform, no clamp)" if tensor_transform else "bicubic resize"
        )
        self.preprocess = (
            f"open_clip {model}: {how} of the shorter side to {self.image_size}, centre crop, "
            f"normalise; score = {scale:g} * {'max(cos, 0)' if clamp_zero else 'cos'}(image, prompt)"
        )

    def processor_pixels(self, images):
        return torch.stack([self.preprocess_pil(im) for im in images])

    def embed_images(self, pixels):
        return F.normalize(self.model.encode_image(pixels).float(), dim=-1)

    def embed_texts(self, prompts):
        tokens = self.tokenizer(prompts).to(self.device)
        return F.normalize(self.model.encode_text(tokens).float(), dim=-1)

    def head(self, img, txt):
        cos = (img * txt).sum(-1)  # [n]
        return self.scale * (cos.clamp(min=0) if self.clamp_zero else cos)


@REWARDS.register("clip_score", input="image", range="[-1, 1] x scale", paper="CLIPScore (arXiv:2104.08718)")
def clip_score(
    *,
    model: str = "ViT-L-14",
    pretrained: str | None = "openai",
    checkpoint: str | None = None,
    scale: float = 1.0,
    clamp_zero: bool = False,
    device: str = "cpu",
    dtype: Any = torch.float32,
    batch_size: int = 32,
    differentiable: bool = False,
) -> Reward:
    """CLIP score: cosine similarity of open_clip image and prompt embeddings (model/pretrained as in open_clip).

    scale=2.5, clamp_zero=True gives the paper's CLIP-S = 2.5 * max(cos, 0).
    """
    return OpenClipReward(
        name="clip_score",
        model=model,
        pretrained=pretrained,
        checkpoint=checkpoint,
        scale=scale,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        differentiable=differentiable,
        clamp_zero=clamp_zero,
    )


@REWARDS.register("hpsv2", input="image", range="about [0.2, 0.4]", paper="HPSv2 (arXiv:2306.09341)")
def hpsv2(
    *,
    model: str = "ViT-H-14",
    checkpoint: str = "xswu/HPSv2",
    device: str = "cpu",
    dtype: Any = torch.float32,
    batch_size: int = 16,
    differentiable: bool = False,
) -> Reward:
    """HPSv2.1: open_clip ViT-H-14 with the HPS_v2.1 checkpoint; score = cos(image, prompt) (no logit scale)."""
    return OpenClipReward(
        name="hpsv2",
        model=model,
        pretrained=None,
        checkpoint=checkpoint,
        scale=1.0,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        differentiable=differentiable,
        checkpoint_file="HPS_v2.1_compressed.pt",
        tensor_transform=True,
    )


# ---- transformers CLIP: PickScore and the aesthetic predictor ---------------------------------------------------
def _features(out: Any) -> Tensor:
    """transformers 5 returns a model output with the projected `pooler_output`; 4.x returned the tensor."""
    return out if isinstance(out, Tensor) else out.pooler_output


class HFClipReward(ClipReward):
    """A transformers CLIPModel with its CLIPProcessor (PickScore; the backbone of the aesthetic predictor)."""

    def __init__(self, *, name: str, model: str, processor: str, device, dtype, batch_size: int, differentiable: bool):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, differentiable=differentiable)
        # lazy: transformers is heavy to import (~1 s); only when this reward is built
        from transformers import AutoProcessor, CLIPModel

        with loading(processor, name, "processor"):
            self.processor = AutoProcessor.from_pretrained(processor)
        with loading(model, name, "model"):
            net = CLIPModel.from_pretrained(model)
        self.model = net.to(self.device, self.dtype).eval().requires_grad_(False)
        ip = self.processor.image_processor
        crop = ip.crop_size  # a dict in transformers 4, a SizeDict in 5, an int in old configs
        self.image_size = int(crop if isinstance(crop, int) else getattr(crop, "height", None) or crop["height"])
        self.mean, self.std = tuple(ip.image_mean), tuple(ip.image_std)

    def processor_pixels(self, images):
        return self.processor(images=images, return_tensors="pt")["pixel_values"]

    def embed_images(self, pixels):
        return F.normalize(_features(self.model.get_image_features(pixel_values=pixels)).float(), dim=-1)

    def embed_texts(self, prompts):
        tok = self.processor.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        out = self.model.get_text_features(**{k: v.to(self.device) for k, v in tok.items()})
        return F.normalize(_features(out).float(), dim=-1)


class PickScore(HFClipReward):
    def __init__(self, *, divisor: float, **kw):
        super().__init__(name="pickscore", **kw)
        self.divisor = divisor
        self.preprocess = (
            f"CLIPProcessor: resize shorter side to {self.image_size} (bicubic), centre crop, "
            f"normalise; score = logit_scale * cos / {divisor:g}"
        )

    def head(self, img, txt):
        return self.model.logit_scale.exp().float() * (img * txt).sum(-1) / self.divisor


@REWARDS.register(
    "pickscore", input="image", range="about [15, 25] (divisor 1)", paper="Pick-a-Pic (arXiv:2305.01569)"
)
def pickscore(
    *,
    model: str = "yuvalkirstain/PickScore_v1",
    processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
    divisor: float = 1.0,
    device: str = "cpu",
    dtype: Any = torch.float32,
    batch_size: int = 32,
    differentiable: bool = False,
) -> Reward:
    """PickScore: logit_scale * cos(image, prompt) of the PickScore CLIP-H (divisor=26 gives Flow-GRPO's scale)."""
    return PickScore(
        model=model,
        processor=processor,
        divisor=divisor,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        differentiable=differentiable,
    )


class AestheticMLP(nn.Module):
    """The LAION improved-aesthetic-predictor head (768 -> 1024 -> 128 -> 64 -> 16 -> 1; dropouts at train time)."""

    def __init__(self, in_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class Aesthetic(HFClipReward):
    needs_prompts = False

    def __init__(self, *, head: str, head_file: str, **kw):
        path = hub_file(head, head_file, "aesthetic", "head")  # the small file first: offline, fail before CLIP-L
        super().__init__(name="aesthetic", **kw)
        mlp = AestheticMLP(self.model.config.projection_dim)
        mlp.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self.mlp = mlp.to(self.device, torch.float32).eval().requires_grad_(False)
        self.preprocess = (
            f"CLIP ViT-L/14 processor ({self.image_size} px, CLIP mean/std); L2-normalised image "
            "embedding -> MLP; score on the 1-10 AVA scale"
        )

    def score(self, samples, prompts):
        out = []
        with torch.set_grad_enabled(self.differentiable), autocast(self.device, self.use_autocast):
            for i in range(0, len(samples), self.batch_size):
                img = self.embed_images(self.pixels(samples[i : i + self.batch_size]))  # [n, D]
                out.append(self.mlp(img.float()).squeeze(-1))  # [n]
        return torch.cat(out)


@REWARDS.register("aesthetic", input="image", range="about [1, 10]", paper="LAION aesthetic predictor v2; DDPO")
def aesthetic(
    *,
    model: str = "openai/clip-vit-large-patch14",
    processor: str | None = None,
    head: str = "trl-lib/ddpo-aesthetic-predictor",
    head_file: str = "aesthetic-model.pth",
    device: str = "cpu",
    dtype: Any = torch.float32,
    batch_size: int = 32,
    differentiable: bool = False,
) -> Reward:
    """LAION aesthetic predictor v2: CLIP ViT-L/14 image embedding (L2-normalised) -> MLP head (no prompt)."""
    return Aesthetic(
        model=model,
        processor=processor or model,
        head=head,
        head_file=head_file,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        differentiable=differentiable,
    )
