"""Video-LLM pipeline: GRPO for Qwen2-VL / Qwen2.5-VL on videos (decord / PyAV reading, temporal grounding, video QA)
with T-GRPO, Reg-GRPO + difficulty-aware augmentation, TempSamp-R1 ground-truth injection and GRPO-CARE as switches.

Light to import: transformers, decord and PyAV load only when a task is built or a video is read.
"""

from mmgrpo.plugins import PIPELINES
from pipelines.video import advantages, rewards  # noqa: F401  registers "tempsamp", "grpo_bonus", video rewards
from pipelines.video.build import build_video
from pipelines.video.settings import VideoSettings


def _register() -> None:
    if "video" not in PIPELINES:
        PIPELINES.register("video", build_video, settings=VideoSettings)


_register()

__all__ = ["VideoSettings", "build_video"]
