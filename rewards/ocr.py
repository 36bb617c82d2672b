"""OCR reward: 1 - normalised edit distance between the prompt's quoted text and a transformers OCR model's reading.

The model is any VisionEncoderDecoder OCR checkpoint (TrOCR by default); Flow-GRPO used PaddleOCR with the same score.
"""

from typing import Any

import torch

from rewards import rules
from rewards._hub import autocast, loading, parse_device, parse_dtype
from rewards._images import to_pil_list
from rewards.api import REWARDS, Reward


class OcrReward(Reward):
    input = "image"
    needs_prompts = True
    fields = ("texts",)

    def __init__(self, *, model: str, device, dtype, batch_size: int, max_new_tokens: int, substring: bool = False):
        # lazy: transformers is heavy to import (~1 s); only when this reward is built
        from transformers import AutoImageProcessor, AutoTokenizer, VisionEncoderDecoderModel

        self.device, self.dtype, self.batch_size, self.max_new_tokens = (
            parse_device(device),
            parse_dtype(dtype),
            batch_size,
            max_new_tokens,
        )
        self.substring = substring
        with loading(model, "ocr", "model"):
            self.image_processor = AutoImageProcessor.from_pretrained(model)
            self.tokenizer = AutoTokenizer.from_pretrained(model)
            net = VisionEncoderDecoderModel.from_pretrained(model)
        self.model = net.to(self.device, self.dtype).eval().requires_grad_(False)
        ip = self.image_processor
        size = dict(getattr(ip, "size", None) or {})  # TrOCR: {"height": 384, "width": 384}, resized without crop
        res = f"{size.get('height', '?')}x{size.get('width', '?')}" if "height" in size else str(size or "model's")
        mean, std = getattr(ip, "image_mean", None), getattr(ip, "image_std", None)
        self.preprocess = (
            f"{type(ip).__name__}: resize to {res}, normalise mean {mean} std {std}; greedy decode; "
            "target = prompt's quoted text (or field texts); "
            "score = 1 - min(ED, len)/len on lower-cased text without spaces"
            + ("; target inside the reading = 1" if substring else "")
        )

    @torch.no_grad()
    def read(self, samples: list[Any]) -> list[str]:
        """The model's transcription of each image (greedy decoding, batched)."""
        out = []
        images = to_pil_list(samples)
        for i in range(0, len(images), self.batch_size):
            pix = self.image_processor(images=images[i : i + self.batch_size], return_tensors="pt")["pixel_values"]
            with autocast(self.device):
                ids = self.model.generate(
                    pixel_values=pix.to(self.device, self.dtype),
                    num_beams=1,
                    do_sample=False,
                    max_new_tokens=self.max_new_tokens,
                )
            out += self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return out

    def score(self, samples, prompts, texts=None):
        targets = list(texts) if texts is not None else [rules.quoted_text(p) for p in prompts]
        for i, t in enumerate(targets):
            if t is None:
                raise ValueError(
                    f"prompt {i} ({prompts[i]!r}) has no quoted text to read; quote the text to render "
                    'like: a sign that says "OPEN", or pass field texts=[...]'
                )
        return [rules.ocr_similarity(r, t, substring=self.substring) for r, t in zip(self.read(samples), targets)]


@REWARDS.register("ocr", input="image", range="[0, 1]", paper="Flow-GRPO OCR reward (arXiv:2505.05470)")
def ocr(
    *,
    model: str = "microsoft/trocr-base-printed",
    device: str = "cpu",
    dtype: Any = torch.float32,
    batch_size: int = 16,
    max_new_tokens: int = 32,
    substring: bool = False,
) -> Reward:
    """OCR: 1 - normalised edit distance between the prompt's quoted text and a TrOCR-style model's reading."""
    return OcrReward(
        model=model,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        substring=substring,
    )
