"""The HTTP wire format of a sample, shared by the reward client and server: text as JSON, images as base64 PNG,
videos as a list of PNG frames.
"""

import base64
import binascii
import io
from typing import Any

from PIL import Image, UnidentifiedImageError

from rewards._images import read_frames, to_pil


def encode_sample(sample: Any, input_kind: str) -> dict:
    """One sample as JSON: {"text": str}, {"png": base64} or {"video": [{"png": ...}, ...]} (frames)."""
    if input_kind == "text":
        if not isinstance(sample, str):
            raise ValueError(f"a text reward needs str samples, got {type(sample).__name__}")
        return {"text": sample}
    if input_kind == "video":
        return {"video": [_png(f) for f in read_frames(sample, 10**9)]}
    return _png(to_pil(sample))


def _png(image: Image.Image) -> dict:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return {"png": base64.b64encode(buf.getvalue()).decode("ascii")}


def decode_sample(obj: Any, i: int) -> Any:
    if not isinstance(obj, dict) or len(obj) != 1:
        raise ValueError(f"samples[{i}] must be an object with one key: text, png or video")
    ((key, value),) = obj.items()
    if key == "text":
        if not isinstance(value, str):
            raise ValueError(f"samples[{i}].text must be a string")
        return value
    if key == "png":
        try:
            return Image.open(io.BytesIO(base64.b64decode(value, validate=True))).convert("RGB")
        except (binascii.Error, UnidentifiedImageError, TypeError, ValueError, OSError) as err:
            raise ValueError(f"samples[{i}].png is not a base64 PNG: {err}") from None
    if key == "video":
        if not isinstance(value, list) or not value:
            raise ValueError(f"samples[{i}].video must be a non-empty list of {{'png': ...}} frames")
        return [decode_sample(f, i) for f in value]
    raise ValueError(f"samples[{i}] has unknown key {key!r}; use text, png or video")
