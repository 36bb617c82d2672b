"""Video-LLM pipeline: GRPO for Qwen2-VL / Qwen2.5-VL on videos (decord / PyAV reading, temporal grounding, video QA)
with T-GRPO, Reg-GRPO + difficulty-aware augmentation, TempSamp-R1 ground-truth injection and GRPO-CARE as switches.

Light to import: transformers, decord and PyAV load only when a task is built or a video is read.
"""

from pipelines.video.build import build_video


def _register() -> None:
    import dataclasses

    from mmgrpo.plugins import PIPELINES, pipeline_settings
    from pipelines.video import advantages, rewards  # noqa: F401  registers "tempsamp", "grpo_bonus", video rewards
    from pipelines.vlm.settings import ModelSettings

    def check_video_kwargs(**given) -> None:
        shared = {f.name for f in dataclasses.fields(ModelSettings)}
        pipeline_settings(ModelSettings, {k: v for k, v in given.items() if k in shared})

    if "video" not in PIPELINES:
        PIPELINES.register("video", build_video, check=check_video_kwargs)


_register()

__all__ = ["build_video"]
