"""Sample conversion for the model rewards: PIL / uint8 arrays / float tensors, torch preprocessing, video frames.

The torch path (resize shorter side, centre crop, normalise) is the differentiable twin of the CLIP processors.
"""

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def to_pil(x: Any) -> Image.Image:
    """One image as RGB PIL: PIL, a path, uint8 HxWx3 array, float [3,H,W] / [H,W,3] tensor in [0, 1]."""
    if isinstance(x, Image.Image):
        return x.convert("RGB")
    if isinstance(x, str | Path):
        return Image.open(x).convert("RGB")
    if isinstance(x, Tensor):
        x = x.detach().cpu()
        if x.dim() == 3 and x.shape[0] in (1, 3):  # tensors are CHW (the torchvision convention)
            x = x.permute(1, 2, 0)
        if x.dtype != torch.uint8:
            x = (x.float().clamp(0, 1) * 255).round().to(torch.uint8)
        x = x.numpy()
    arr = np.asarray(x)
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4):
        raise ValueError(f"an image must be HxWx3 (or a [3,H,W] tensor), got shape {arr.shape}")
    if arr.dtype != np.uint8:
        if arr.max(initial=0) <= 1.0:
            arr = np.round(np.clip(arr, 0, 1) * 255)
        arr = arr.astype(np.uint8)
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return Image.fromarray(arr[..., :3])


def to_pil_list(samples: list[Any]) -> list[Image.Image]:
    return [to_pil(s) for s in samples]


def to_tensor(samples: Any) -> Tensor:
    """A batch as float [N, 3, H, W] in [0, 1], keeping the autograd graph of float tensors."""
    if isinstance(samples, Tensor) and samples.dim() == 4:
        x = samples
    elif isinstance(samples, list | tuple) and samples and all(isinstance(s, Tensor) for s in samples):
        x = torch.stack(list(samples))
    else:
        arrs = [np.asarray(to_pil(s), dtype=np.float32) / 255.0 for s in samples]
        shapes = {a.shape for a in arrs}
        if len(shapes) != 1:
            raise ValueError(f"differentiable scoring needs equal-size images, got shapes {sorted(shapes)}")
        x = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2)
    if x.dim() != 4 or x.shape[1] != 3:
        raise ValueError(f"images must be [N, 3, H, W] float in [0, 1], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        x = x.float() / 255.0
    return x


def resize_crop_normalize(
    x: Tensor,
    size: int,
    *,
    mean: tuple = CLIP_MEAN,
    std: tuple = CLIP_STD,
    crop: bool = True,
    clamp: bool = True,
) -> Tensor:
    """CLIP preprocessing in torch: bicubic resize of the shorter side to `size`, centre crop, (x - mean) / std.

    The longer side becomes int(size * long / short), truncated as torchvision's Resize and CLIPImageProcessor do.
    clamp=True clips the bicubic overshoot as PIL does; torchvision's tensor Resize (HPSv2's transform) does not.

    Args:
        x: [N, 3, H, W] in [0, 1].
    Returns:
        [N, 3, size, size] normalised (differentiable w.r.t. x).
    """
    h, w = x.shape[-2:]
    if crop:
        nh, nw = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    else:
        nh, nw = size, size
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)  # [N, 3, nh, nw]
        if clamp:
            x = x.clamp(0, 1)  # bicubic overshoots; PIL clips to the uint8 range
    top, left = (nh - size) // 2, (nw - size) // 2
    x = x[:, :, top : top + size, left : left + size]  # [N, 3, size, size]
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - m) / s


def sample_indices(num_total: int, num_frames: int) -> list[int]:
    """`num_frames` indices spread evenly over [0, num_total - 1] (np.linspace, rounded), all frames if fewer."""
    if num_total <= 0:
        raise ValueError("the video has no frames")
    if num_frames >= num_total:
        return list(range(num_total))
    return [round(v) for v in np.linspace(0, num_total - 1, num_frames).tolist()]


def read_frames(video: Any, num_frames: int) -> list[Image.Image]:
    """`num_frames` evenly spaced frames of one video: a path (decord, else PyAV), [T,3,H,W] / [T,H,W,3] or a list."""
    if isinstance(video, str | Path):
        return [Image.fromarray(f) for f in _decode(str(video), num_frames)]
    if isinstance(video, list | tuple):
        frames = list(video)
    elif isinstance(video, Tensor | np.ndarray) and video.ndim == 4:
        frames = [video[i] for i in range(video.shape[0])]
    else:
        raise ValueError(
            f"a video must be a path, a [T,3,H,W]/[T,H,W,3] tensor or a list of frames, got {type(video)}"
        )
    return [to_pil(frames[i]) for i in sample_indices(len(frames), num_frames)]


def _decode(path: str, num_frames: int) -> list[np.ndarray]:
    if not Path(path).exists():
        raise ValueError(f"video file {path!r} does not exist")
    try:
        # lazy: optional video backend (decord is x86_64 only); PyAV below otherwise
        import decord

        vr = decord.VideoReader(path, ctx=decord.cpu(0))
        idx = sample_indices(len(vr), num_frames)
        return list(vr.get_batch(idx).asnumpy())
    except ImportError:
        pass
    # lazy: PyAV loads only when a video is decoded
    import av

    with av.open(path) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return [frames[i] for i in sample_indices(len(frames), num_frames)]
