"""ImageReward (arXiv:2304.05977) on transformers' BLIP: ViT image encoder, cross-attending BERT text encoder, MLP.

Scores a whole batch in one forward (the `image-reward` package loops image by image); loads a transformers-format
directory or converts the original THUDM/ImageReward `ImageReward.pt` checkpoint on the fly.
"""

import os
from typing import Any

import torch

from mmgrpo.errors import UserError
from rewards._hub import autocast, hub_file, loading, parse_device, parse_dtype
from rewards._images import CLIP_MEAN, CLIP_STD, to_pil_list
from rewards.api import REWARDS, Reward
from rewards.clip_family import AestheticMLP

# ImageReward standardises the MLP output with these training-set statistics (ImageReward.py, THUDM)
IR_MEAN, IR_STD = 0.16717362830052426, 1.0333394966054072
HEAD_FILE = "imagereward_head.pt"


def original_config(sd: dict[str, torch.Tensor] | None = None, *, head_dim: int = 64):
    """The BLIP config of an ImageReward checkpoint: ViT-L/16 at 224 px + BERT-base cross-attending width 1024.

    With `sd` (an original ImageReward.pt state dict) every size is read from the weight shapes, so fine-tuned or
    smaller BLIP variants load too; heads = width / head_dim (64 in BLIP's ViT and BERT).
    """
    # lazy: transformers is heavy to import (~1 s); only when this reward is built
    from transformers import BlipConfig

    vision = {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "image_size": 224,
        "patch_size": 16,
    }
    text = {
        "vocab_size": 30524,
        "hidden_size": 768,
        "encoder_hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "max_position_embeddings": 512,
    }
    if sd is not None:
        v, t = "blip.visual_encoder.", "blip.text_encoder."
        patch = sd[v + "patch_embed.proj.weight"].shape[-1]
        grid = round((sd[v + "pos_embed"].shape[1] - 1) ** 0.5)  # pos_embed [1, 1 + grid^2, D]
        vision = {
            "hidden_size": sd[v + "cls_token"].shape[-1],
            "intermediate_size": sd[v + "blocks.0.mlp.fc1.weight"].shape[0],
            "num_hidden_layers": _count_blocks(sd, v + "blocks."),
            "image_size": grid * patch,
            "patch_size": patch,
        }
        words = sd[t + "embeddings.word_embeddings.weight"]  # [V, D]
        text = {
            "vocab_size": words.shape[0],
            "hidden_size": words.shape[1],
            "encoder_hidden_size": sd[t + "encoder.layer.0.crossattention.self.key.weight"].shape[1],
            "intermediate_size": sd[t + "encoder.layer.0.intermediate.dense.weight"].shape[0],
            "num_hidden_layers": _count_blocks(sd, t + "encoder.layer."),
            "max_position_embeddings": sd[t + "embeddings.position_embeddings.weight"].shape[0],
        }
    for cfg in (vision, text):
        if cfg["hidden_size"] % head_dim:
            raise ValueError(f"width {cfg['hidden_size']} is not a multiple of head_dim={head_dim}")
        cfg["num_attention_heads"] = cfg["hidden_size"] // head_dim
    return BlipConfig(vision_config={**vision, "layer_norm_eps": 1e-6}, text_config=text)


def _count_blocks(sd: dict, prefix: str) -> int:
    return len({k[len(prefix) :].split(".", 1)[0] for k in sd if k.startswith(prefix)})


def convert_original_state_dict(sd: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Rename an ImageReward.pt state dict (BLIP timm-ViT + BERT + mlp) to (BlipForImageTextRetrieval, MLP) keys."""
    vis = {
        "norm1": "layer_norm1",
        "norm2": "layer_norm2",
        "attn.qkv": "self_attn.qkv",
        "attn.proj": "self_attn.projection",
        "mlp.fc1": "mlp.fc1",
        "mlp.fc2": "mlp.fc2",
    }
    blip, head = {}, {}
    for key, value in sd.items():
        if key.startswith("mlp."):
            head[key[len("mlp.") :]] = value
        elif key.startswith("blip.text_encoder."):
            blip["text_encoder." + key[len("blip.text_encoder.") :]] = value
        elif key.startswith("blip.visual_encoder."):
            k = key[len("blip.visual_encoder.") :]
            if k == "cls_token":
                blip["vision_model.embeddings.class_embedding"] = value
            elif k == "pos_embed":
                blip["vision_model.embeddings.position_embedding"] = value
            elif k.startswith("patch_embed.proj."):
                blip["vision_model.embeddings.patch_embedding." + k.split(".")[-1]] = value
            elif k.startswith("norm."):
                blip["vision_model.post_layernorm." + k.split(".")[-1]] = value
            elif k.startswith("blocks."):
                _, i, rest = k.split(".", 2)
                sub, leaf = rest.rsplit(".", 1)
                blip[f"vision_model.encoder.layers.{i}.{vis[sub]}.{leaf}"] = value
    return blip, head


class ImageReward(Reward):
    input = "image"
    needs_prompts = True

    def __init__(
        self, *, model: str, tokenizer: str, device, dtype, batch_size: int, max_length: int, standardize: bool
    ):
        # lazy: transformers is heavy to import (~1 s); only when this reward is built
        from transformers import AutoTokenizer, BlipForImageTextRetrieval

        self.device, self.dtype, self.batch_size = parse_device(device), parse_dtype(dtype), batch_size
        self.max_length, self.standardize = max_length, standardize
        if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
            net = BlipForImageTextRetrieval.from_pretrained(model)
            head_sd = torch.load(os.path.join(model, HEAD_FILE), map_location="cpu", weights_only=True)
            tok_src = model if os.path.isfile(os.path.join(model, "tokenizer_config.json")) else tokenizer
        else:
            path = hub_file(model, "ImageReward.pt", "imagereward", "model")
            original = torch.load(path, map_location="cpu", weights_only=True)
            if "blip.visual_encoder.cls_token" not in original:
                raise UserError(f"model={model!r}: {path} is not an ImageReward checkpoint (no blip.visual_encoder.*)")
            blip_sd, head_sd = convert_original_state_dict(original)
            net = BlipForImageTextRetrieval(original_config(original))
            missing, _ = net.load_state_dict(blip_sd, strict=False)
            needed = [
                k for k in missing if k.startswith(("vision_model.", "text_encoder.")) and "position_ids" not in k
            ]
            if needed:
                raise ValueError(f"{path} is not an ImageReward checkpoint: missing {needed[:3]}...")
            tok_src = tokenizer
        with loading(tok_src, "imagereward", "tokenizer"):
            self.tokenizer = AutoTokenizer.from_pretrained(tok_src)
        self.mlp = AestheticMLP(net.config.text_config.hidden_size)
        self.mlp.load_state_dict(head_sd)
        self.mlp.to(self.device).eval().requires_grad_(False)
        self.vision = net.vision_model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.text = net.text_encoder.to(self.device, self.dtype).eval().requires_grad_(False)
        self.image_size = net.config.vision_config.image_size
        self.preprocess = (
            f"bicubic resize shorter side to {self.image_size}, centre crop, CLIP mean/std; prompt "
            f"max {max_length} tokens; score = (MLP - {IR_MEAN:.4f}) / {IR_STD:.4f}"
        )

    def pixels(self, images: list[Any]) -> torch.Tensor:
        """BLIP's eval transform (Resize bicubic, CenterCrop, ToTensor, Normalize) on PIL images."""
        # lazy: torchvision is heavy to import (~1 s); only when ImageReward scores
        from torchvision import transforms as T

        tf = T.Compose(
            [
                T.Resize(self.image_size, interpolation=T.InterpolationMode.BICUBIC),
                T.CenterCrop(self.image_size),
                T.ToTensor(),
                T.Normalize(CLIP_MEAN, CLIP_STD),
            ]
        )
        return torch.stack([tf(im) for im in to_pil_list(images)])

    @torch.no_grad()
    def score(self, samples, prompts):
        out = []
        for i in range(0, len(samples), self.batch_size):
            pix = self.pixels(samples[i : i + self.batch_size]).to(self.device, self.dtype)  # [n, 3, S, S]
            tok = self.tokenizer(
                prompts[i : i + self.batch_size],
                padding="max_length",
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            with autocast(self.device):
                img = self.vision(pixel_values=pix).last_hidden_state  # [n, P+1, Dv]
                att = torch.ones(img.shape[:-1], dtype=torch.long, device=self.device)  # [n, P+1]
                txt = self.text(
                    input_ids=tok["input_ids"],
                    attention_mask=tok["attention_mask"],
                    encoder_hidden_states=img,
                    encoder_attention_mask=att,
                ).last_hidden_state
            r = self.mlp(txt[:, 0, :].float()).squeeze(-1)  # [n]
            out.append((r - IR_MEAN) / IR_STD if self.standardize else r)
        return torch.cat(out)


def save_pretrained(reward_dir: str, net, tokenizer, mlp) -> None:
    """Write the transformers-format directory ImageReward loads: BLIP model, tokenizer and the MLP head."""
    net.save_pretrained(reward_dir)
    tokenizer.save_pretrained(reward_dir)
    torch.save(mlp.state_dict(), os.path.join(reward_dir, HEAD_FILE))


@REWARDS.register(
    "imagereward", input="image", range="about [-2.5, 2.5] (standardised)", paper="ImageReward (arXiv:2304.05977)"
)
def imagereward(
    *,
    model: str = "THUDM/ImageReward",
    tokenizer: str = "bert-base-uncased",
    device: str = "cpu",
    dtype: Any = torch.float32,
    batch_size: int = 16,
    max_length: int = 35,
    standardize: bool = True,
) -> Reward:
    """ImageReward: BLIP image-text cross-encoder + MLP, batched; a transformers dir or the original ImageReward.pt."""
    return ImageReward(
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        max_length=max_length,
        standardize=standardize,
    )
