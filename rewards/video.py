"""Video rewards: an image reward on evenly sampled frames (mean/min over frames), and a hook for video models.

Videos are paths (decord, else PyAV), [T,3,H,W] float / [T,H,W,3] uint8 tensors or arrays, or lists of frames.
"""

from collections.abc import Callable
from typing import Any

import torch

from rewards._images import read_frames
from rewards.api import REWARDS, Reward, load

_REDUCE = {"mean": lambda s: s.mean(1), "min": lambda s: s.min(1).values, "max": lambda s: s.max(1).values}


class FrameReward(Reward):
    """Score `num_frames` evenly spaced frames of each video with an image reward, then reduce over frames."""

    input = "video"

    def __init__(self, image_reward: Reward, *, num_frames: int, reduce: str):
        if reduce not in _REDUCE:
            raise ValueError(f"reduce={reduce!r} must be one of {sorted(_REDUCE)}")
        if num_frames < 1:
            raise ValueError(f"num_frames={num_frames} must be >= 1")
        if image_reward.input != "image" or image_reward.kind != "pointwise":
            raise ValueError(
                f"frame rewards need a pointwise image reward, got {image_reward.name!r} "
                f"({image_reward.kind}, input={image_reward.input})"
            )
        self.image_reward, self.num_frames, self.reduce = image_reward, num_frames, reduce
        self.needs_prompts = image_reward.needs_prompts
        self.preprocess = (
            f"{num_frames} frames at np.linspace indices, each: {image_reward.preprocess}; {reduce} over frames"
        )

    def score(self, samples, prompts):
        frames = [read_frames(v, self.num_frames) for v in samples]
        counts = {len(f) for f in frames}
        if len(counts) != 1:  # short videos give fewer frames: score them one by one
            return [
                self._reduce(self._frames_score(f, None if prompts is None else prompts[i]))
                for i, f in enumerate(frames)
            ]
        t = counts.pop()
        flat = [im for f in frames for im in f]  # one batched call over all N*T frames
        flat_prompts = None if prompts is None else [p for p in prompts for _ in range(t)]
        return _REDUCE[self.reduce](self.image_reward(flat, flat_prompts).view(len(samples), t))  # [N]

    def _frames_score(self, frames, prompt):
        return self.image_reward(frames, None if prompt is None else [prompt] * len(frames)).view(1, -1)

    def _reduce(self, s):
        return float(_REDUCE[self.reduce](s))


@REWARDS.register(
    "video_frames",
    input="video",
    range="the image reward's range",
    paper="DanceGRPO / Pref-GRPO frame-sampled rewards",
)
def video_frames(
    *, image_reward: str = "pickscore", image_kwargs: dict | None = None, num_frames: int = 8, reduce: str = "mean"
) -> Reward:
    """Video as frames: an image reward on num_frames evenly spaced frames, reduced by mean, min or max."""
    return FrameReward(load(image_reward, **(image_kwargs or {})), num_frames=num_frames, reduce=reduce)


class VideoModelReward(Reward):
    """Hook for a video reward model (VideoAlign-style): `fn(list of [T] PIL frame lists, prompts) -> N scores`."""

    input = "video"

    def __init__(
        self,
        fn: Callable[[list[list[Any]], list[str] | None], Any],
        *,
        num_frames: int = 16,
        name: str = "video_model",
        preprocess: str = "",
        needs_prompts: bool = True,
    ):
        self.fn, self.num_frames, self.name, self.needs_prompts = fn, num_frames, name, needs_prompts
        self.preprocess = preprocess or f"{num_frames} frames at np.linspace indices as PIL, passed to the model"

    def score(self, samples, prompts):
        return torch.as_tensor(self.fn([read_frames(v, self.num_frames) for v in samples], prompts)).float()


def register_video_model(name: str, factory: Callable[..., VideoModelReward], **meta: Any) -> None:
    """Add a video reward model to the registry so RewardSet, the server and the CLI can load it by name."""
    REWARDS.register(name, factory, input="video", **meta)
