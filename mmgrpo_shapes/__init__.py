"""ShapesWorld: an offline world with verifiable rewards (GenEval-style T2I prompts, VQA, temporal grounding).

Scenes and prompts live in `scenes`, the detector and rewards in `verifier`, questions in `vqa`, clips in `video`,
the video model's think targets in `video_think`, the dense vision targets in `dense`. The world sits on the core
beside `rewards/` and never imports a pipeline or a program; the programs that train and probe the shipped models
on it are in `mmgrpo_shapes.programs`.
"""

from mmgrpo_shapes.scenes import (
    CATEGORIES,
    COLORS,
    SHAPES,
    SPLITS,
    ObjectSpec,
    PromptSpec,
    Scene,
    SceneObject,
    ground_truth_scenes,
    list_prompts,
    parse_prompt,
    prompts_by_category,
    random_scene,
    render,
    split_of,
)
from mmgrpo_shapes.verifier import category_report, detect, score, verify

__all__ = [
    "CATEGORIES",
    "COLORS",
    "SHAPES",
    "SPLITS",
    "ObjectSpec",
    "PromptSpec",
    "Scene",
    "SceneObject",
    "category_report",
    "detect",
    "ground_truth_scenes",
    "list_prompts",
    "parse_prompt",
    "prompts_by_category",
    "random_scene",
    "render",
    "score",
    "split_of",
    "verify",
]
