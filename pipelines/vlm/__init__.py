"""VLM reasoning pipeline: GRPO for image-text-to-text models (Qwen2-VL, Qwen2.5-VL) with a prefix-shared forward.

Light to import: the builder pulls in transformers and peft only when a task is built.
"""

from mmgrpo.plugins import PIPELINES
from pipelines.vlm.build import build_vlm
from pipelines.vlm.settings import VLMSettings

if "vlm" not in PIPELINES:
    PIPELINES.register("vlm", build_vlm, settings=VLMSettings)

__all__ = ["VLMSettings", "build_vlm"]
