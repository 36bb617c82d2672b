"""DDPO's JPEG compressibility / incompressibility rewards: the size of the image saved as JPEG, in kB.

No model: PIL encodes each image at a fixed quality; the output scale is kilobytes (1 kB = 1000 bytes).
"""

import io

from rewards._images import to_pil
from rewards.api import REWARDS, FunctionReward, Reward


def jpeg_kb(image, *, quality: int = 95) -> float:
    """Size in kB of `image` encoded by PIL as JPEG at `quality` (DDPO, arXiv:2305.13301)."""
    buf = io.BytesIO()
    to_pil(image).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


def _jpeg(name: str, sign: float, quality: int) -> Reward:
    if not 1 <= quality <= 100:
        raise ValueError(f"quality={quality} must be in [1, 100]")

    def batch(samples, prompts):
        return [sign * jpeg_kb(s, quality=quality) for s in samples]

    return FunctionReward(
        batch,
        name=name,
        input="image",
        preprocess=f"RGB uint8, PIL JPEG quality {quality}; score {'-' if sign < 0 else '+'}size in kB",
    )


@REWARDS.register("jpeg_compressibility", input="image", range="(-inf, 0] kB", paper="DDPO (arXiv:2305.13301)")
def jpeg_compressibility(*, quality: int = 95) -> Reward:
    """JPEG compressibility: minus the JPEG size in kB (smaller files score higher)."""
    return _jpeg("jpeg_compressibility", -1.0, quality)


@REWARDS.register("jpeg_incompressibility", input="image", range="[0, inf) kB", paper="DDPO (arXiv:2305.13301)")
def jpeg_incompressibility(*, quality: int = 95) -> Reward:
    """JPEG incompressibility: the JPEG size in kB (larger files score higher)."""
    return _jpeg("jpeg_incompressibility", 1.0, quality)
