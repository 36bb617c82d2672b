"""The `video` pipeline builder: the VLM pipeline's model loading and training modes, video records, frame settings and
the method switches (temporal, inject_ground_truth, augment, care_likelihood). Heavy imports stay inside the builder.
"""

from functools import partial
from typing import Any

import torch

from mmgrpo.errors import UserError
from mmgrpo.plugins import pipeline_settings
from mmgrpo.types import Task
from pipelines.video.data import SHAPES_VIDEO, load_records, video_prompt_tokens
from pipelines.video.methods import ground_truth_text
from pipelines.video.settings import FrameSettings, MethodSettings, VideoSettings
from pipelines.vlm import build as vlm
from pipelines.vlm.data import check_prompt_lengths
from pipelines.vlm.settings import FORMAT_INSTRUCTION

__all__ = ["FORMAT_INSTRUCTION", "build_video"]


def _check_injected_length(policy: Any, records: list[dict[str, Any]], max_new_tokens: int) -> None:
    """TempSamp's injected answer must be a completion the policy could sample: no longer than max_new_tokens."""
    longest, rec = max(((policy._ground_truth(r).shape[1], r) for r in records), key=lambda x: x[0])
    if longest > max_new_tokens:
        text = ground_truth_text(rec, span_template=policy.m.span_template, answer_template=policy.m.answer_template)
        raise UserError(
            f"pipeline.kwargs.max_new_tokens ({max_new_tokens}) is shorter than the injected ground truth "
            f"({longest} tokens for record {rec.get('id')!r}: {text!r}); sampled answers stop at "
            f"{max_new_tokens} tokens, so raise max_new_tokens to >= {longest} or shorten "
            f"pipeline.kwargs.gt_span_template / gt_answer_template"
        )


def build_video(*, seed: int, device: torch.device, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Task:
    """GRPO on a video-text-to-text model (Qwen2-VL, Qwen2.5-VL) over grounding / video-QA records.

    kwargs: the fields of `VideoSettings` (pipelines/video/settings.py; docs/config.md lists them), checked first."""
    # lazy: pipelines.video.policy imports transformers; `import pipelines` stays light
    from pipelines.video.policy import VideoPolicy

    s = pipeline_settings(VideoSettings, kwargs)
    vlm.warn_top_p(s)
    train, evals = _records(s, seed)
    vlm.check_attn_implementation(s.attn_implementation, device)
    torch.manual_seed(seed)
    processor, hf = vlm.load_trainable(s, dtype=dtype, device=device)
    module = vlm.vlm_module(s, hf, processor)
    policy = vlm.make_policy(
        VideoPolicy,
        s,
        module,
        processor,
        frames=_frames(s),
        methods=_methods(s),
        device=device,
        settings=vlm.sample_settings(s),
    )
    # a prompt (video tokens included) that leaves no room is refused naming its row, or skipped (pipelines/vlm/data)
    fit = vlm.prompt_fit(s, processor, hf, skip=s.skip_bad_videos, skip_key="skip_bad_videos", media="video")
    train = check_prompt_lengths(train, partial(video_prompt_tokens, policy), field="pipeline.kwargs.data", **fit)
    evals = check_prompt_lengths(evals, partial(video_prompt_tokens, policy), field="pipeline.kwargs.eval_data", **fit)
    if s.inject_ground_truth:
        _check_injected_length(policy, train, s.max_new_tokens)
    rewards = [
        {"name": "format", "weight": 0.1, "kwargs": {"mode": "lenient"}},
        {"name": "video_task", "weight": 1.0, "kwargs": {}},
    ]
    return Task(policy=policy, module=module, train_data=train, eval_data=evals, rewards=rewards)


def _records(s: VideoSettings, seed: int) -> tuple[list, list]:
    """(train, eval) records: eval from `eval_data`, or from the ShapesWorld split `eval_split` when training on it."""
    common = {
        "seed": seed,
        "shapes_types": s.shapes_types,
        "shapes_frames": s.shapes_frames,
        "shapes_resolution": s.shapes_resolution,
        "skip_bad_videos": s.skip_bad_videos,
        "time_prompt": s.time_prompt,
        "cache_dir": s.cache_dir,
    }
    train = load_records(s.data, split="train", size=s.train_size, field="pipeline.kwargs.data", **common)
    evals = []
    if s.eval_data or s.data == SHAPES_VIDEO:
        evals = load_records(
            s.eval_data or SHAPES_VIDEO,
            split=s.eval_split,
            size=s.eval_size,
            field="pipeline.kwargs.eval_data",
            **common,
        )
    if s.inject_ground_truth and any(r.get("spans") is None and r.get("answers") is None for r in train):
        raise UserError("pipeline.kwargs.inject_ground_truth=true needs spans or answers in every training record")
    return train, evals


def _frames(s: VideoSettings):
    return FrameSettings(
        mode=s.frame_mode,
        num_frames=s.num_frames,
        fps=s.frame_fps,
        token_budget=s.token_budget,
        pixels_per_frame=s.pixels_per_frame,
        min_frames=s.min_frames,
        max_frames=s.max_frames,
        strategy=s.frame_strategy,
        backend=s.video_backend,
        cache_dir=s.frame_cache,
    )


def _methods(s: VideoSettings):
    templates = {
        k: v
        for k, v in (("span_template", s.gt_span_template), ("answer_template", s.gt_answer_template))
        if v is not None
    }
    return MethodSettings(
        temporal=s.temporal,
        temporal_samples=s.temporal_samples,
        **templates,
        inject_ground_truth=s.inject_ground_truth,
        augment=s.augment,
        augment_reward=s.augment_reward,
        augment_easy_min=s.augment_easy_min,
        augment_hard_max=s.augment_hard_max,
        augment_noise=s.augment_noise,
    )
