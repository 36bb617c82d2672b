"""The `video` pipeline builder: the VLM pipeline's model loading and training modes, video records, frame settings and
the method switches (temporal, inject_ground_truth, augment, care_likelihood). Heavy imports stay inside the builder.
"""

from typing import Any

import torch

from mmgrpo.errors import UserError
from mmgrpo.types import Task

FORMAT_INSTRUCTION = "Think inside <think></think>, then give only the final answer inside <answer></answer>."
TEMPORAL = ("none", "generate", "logp_gap")


def _check_video(**kw: Any) -> None:
    if kw["temporal"] not in TEMPORAL:
        raise UserError(f"pipeline.kwargs.temporal ({kw['temporal']!r}) must be one of {TEMPORAL}: 'generate' is "
                        f"Video-R1's T-GRPO (extra rollouts on shuffled frames), 'logp_gap' re-scores the same "
                        f"completions on shuffled frames (no generation)")
    if kw["temporal_samples"] is not None and kw["temporal_samples"] < 1:
        raise UserError(f"pipeline.kwargs.temporal_samples ({kw['temporal_samples']}) must be >= 1 or null (G // 2)")
    from pipelines.video.io import BACKENDS, MODES, STRATEGIES

    for name, value, choices in (("frame_mode", kw["frame_mode"], MODES), ("frame_strategy", kw["frame_strategy"],
                                 STRATEGIES), ("video_backend", kw["video_backend"], BACKENDS)):
        if value not in choices:
            raise UserError(f"pipeline.kwargs.{name} ({value!r}) must be one of {choices}")
    if kw["num_frames"] < 1 or kw["max_frames"] < kw["min_frames"] or kw["min_frames"] < 1:
        raise UserError(f"pipeline.kwargs: need num_frames >= 1 and 1 <= min_frames <= max_frames, got "
                        f"num_frames={kw['num_frames']}, min_frames={kw['min_frames']}, max_frames={kw['max_frames']}")
    if kw["augment_noise"] < 0:
        raise UserError(f"pipeline.kwargs.augment_noise ({kw['augment_noise']}) must be >= 0 (pixel std, 0-255)")
    from pipelines.video.methods import check_template

    for name in ("span_template", "answer_template"):
        if kw[name] is not None:
            try:
                check_template(name, kw[name])
            except ValueError as err:
                raise UserError(f"pipeline.kwargs.gt_{err}") from None


def _check_injected_length(policy: Any, records: list[dict[str, Any]], max_new_tokens: int) -> None:
    """TempSamp's injected answer must be a completion the policy could sample: no longer than max_new_tokens."""
    from pipelines.video.methods import ground_truth_text

    longest, rec = max(((policy._ground_truth(r).shape[1], r) for r in records), key=lambda x: x[0])
    if longest > max_new_tokens:
        text = ground_truth_text(rec, span_template=policy.m.span_template, answer_template=policy.m.answer_template)
        raise UserError(f"pipeline.kwargs.max_new_tokens ({max_new_tokens}) is shorter than the injected ground truth "
                        f"({longest} tokens for record {rec.get('id')!r}: {text!r}); sampled answers stop at "
                        f"{max_new_tokens} tokens, so raise max_new_tokens to >= {longest} or shorten "
                        f"pipeline.kwargs.gt_span_template / gt_answer_template")


def build_video(*, seed: int, device: torch.device, dtype: torch.dtype = torch.float32,
                model: str = "tiny-random-qwen2-vl", data: str = "shapes_video", eval_data: str | None = None,
                train_size: int | None = 64, eval_size: int | None = 16, shapes_types: list[str] | None = None,
                shapes_frames: int = 24, shapes_resolution: int = 64, skip_bad_videos: bool = False,
                time_prompt: bool = True, eval_split: str = "val",
                frame_mode: str = "count", num_frames: int = 8, frame_fps: float = 2.0, token_budget: int = 1024,
                pixels_per_frame: int = 128 * 28 * 28, min_frames: int = 2, max_frames: int = 64,
                frame_strategy: str = "uniform", video_backend: str = "auto", frame_cache: str | None = None,
                temporal: str = "none", temporal_samples: int | None = None, inject_ground_truth: bool = False,
                gt_span_template: str | None = None, gt_answer_template: str | None = None,
                augment: bool = False, augment_reward: str | dict = "video_task", augment_easy_min: float = 0.9,
                augment_hard_max: float = 0.0, augment_noise: float = 40.0,
                lora_rank: int = 0, lora_alpha: float | None = None, lora_dropout: float = 0.0,
                lora_targets: str | list[str] | None = None, freeze_vision: bool = False,
                gradient_checkpointing: bool = False, model_dtype: str | None = None, attn_implementation: str = "sdpa",
                min_pixels: int | None = None, max_pixels: int | None = None,
                max_new_tokens: int = 64, max_prompt_length: int | None = None, temperature: float = 1.0,
                top_p: float = 1.0, top_k: int = 0,
                stop: list[str] | str | None = "</answer>", system_prompt: str | None = None,
                instruction: str | None = FORMAT_INSTRUCTION, prefix_sharing: str | bool = "auto",
                prefix_attention: str = "auto", vision_cache: str = "auto", vision_cache_items: int = 64,
                logp_chunk_tokens: int = 1024, reference: str = "auto", care_likelihood: bool = False,
                care_ema_decay: float = 0.995, care_ema_every: int = 10, check_logp: bool = False,
                cache_dir: str | None = None) -> Task:
    """GRPO on a video-text-to-text model (Qwen2-VL, Qwen2.5-VL) over grounding / video-QA records."""
    from functools import partial

    from pipelines.video.data import SHAPES_VIDEO, load_records, video_prompt_tokens
    from pipelines.video.policy import FrameSettings, MethodSettings, VideoPolicy
    from pipelines.vlm.build import DTYPES, _shared_mode, apply_training_mode, check_attn_implementation, load_model
    from pipelines.vlm.data import check_prompt_lengths, model_positions, model_special_tokens
    from pipelines.vlm.methods import CareLikelihood
    from pipelines.vlm.policy import SampleSettings, VLMModule
    from pipelines.vlm.settings import ModelSettings

    ModelSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                  logp_chunk_tokens=logp_chunk_tokens, model_dtype=model_dtype, max_prompt_length=max_prompt_length,
                  eval_split=eval_split).check()
    _check_video(temporal=temporal, temporal_samples=temporal_samples, frame_mode=frame_mode,
                 frame_strategy=frame_strategy, video_backend=video_backend, num_frames=num_frames,
                 min_frames=min_frames, max_frames=max_frames, augment_noise=augment_noise,
                 span_template=gt_span_template, answer_template=gt_answer_template)
    common = {"seed": seed, "shapes_types": shapes_types, "shapes_frames": shapes_frames,
              "shapes_resolution": shapes_resolution, "skip_bad_videos": skip_bad_videos,
              "time_prompt": time_prompt, "cache_dir": cache_dir}
    train = load_records(data, split="train", size=train_size, field="pipeline.kwargs.data", **common)
    evals = load_records(eval_data or SHAPES_VIDEO, split=eval_split, size=eval_size, field="pipeline.kwargs.eval_data",
                         **common) if (eval_data or data == SHAPES_VIDEO) else []
    if inject_ground_truth and any(r.get("spans") is None and r.get("answers") is None for r in train):
        raise UserError("pipeline.kwargs.inject_ground_truth=true needs spans or answers in every training record")
    check_attn_implementation(attn_implementation, device)
    torch.manual_seed(seed)
    processor, hf = load_model(model, dtype=DTYPES[model_dtype] if model_dtype else dtype,
                               attn_implementation=attn_implementation, cache_dir=cache_dir,
                               min_pixels=min_pixels, max_pixels=max_pixels)
    hf = apply_training_mode(hf, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                             lora_targets=lora_targets, freeze_vision=freeze_vision,
                             gradient_checkpointing=gradient_checkpointing).to(device)
    module = VLMModule(hf, pad_id=processor.tokenizer.pad_token_id, temperature=temperature,
                       shared=_shared_mode(prefix_sharing, hf, prefix_attention), chunk_tokens=logp_chunk_tokens,
                       prefix_attention=prefix_attention, vision_cache=vision_cache,
                       vision_cache_items=vision_cache_items)
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    settings = SampleSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              stop=stops, system_prompt=system_prompt, instruction=instruction)
    frames = FrameSettings(mode=frame_mode, num_frames=num_frames, fps=frame_fps, token_budget=token_budget,
                           pixels_per_frame=pixels_per_frame, min_frames=min_frames, max_frames=max_frames,
                           strategy=frame_strategy, backend=video_backend, cache_dir=frame_cache)
    templates = {k: v for k, v in (("span_template", gt_span_template), ("answer_template", gt_answer_template))
                 if v is not None}
    meth = MethodSettings(temporal=temporal, temporal_samples=temporal_samples, **templates,
                          inject_ground_truth=inject_ground_truth, augment=augment, augment_reward=augment_reward,
                          augment_easy_min=augment_easy_min, augment_hard_max=augment_hard_max,
                          augment_noise=augment_noise)
    care = CareLikelihood(decay=care_ema_decay, every=care_ema_every) if care_likelihood else None
    try:
        policy = VideoPolicy(module, processor, frames=frames, methods=meth, device=device, settings=settings,
                             reference=reference, care=care, check_logp=check_logp)
    except ValueError as err:
        raise UserError(f"pipeline.kwargs: {err}") from None
    # a prompt (video tokens included) that leaves no room is refused naming its row, or skipped (pipelines/vlm/data)
    fit = {"positions": model_positions(hf), "max_prompt_length": max_prompt_length, "max_new_tokens": max_new_tokens,
           "skip": skip_bad_videos, "skip_key": "skip_bad_videos", "media": "video",
           "special_tokens": model_special_tokens(processor)}
    train = check_prompt_lengths(train, partial(video_prompt_tokens, policy), field="pipeline.kwargs.data", **fit)
    evals = check_prompt_lengths(evals, partial(video_prompt_tokens, policy), field="pipeline.kwargs.eval_data", **fit)
    if inject_ground_truth:
        _check_injected_length(policy, train, max_new_tokens)
    rewards = [{"name": "format", "weight": 0.1, "kwargs": {"mode": "lenient"}},
               {"name": "video_task", "weight": 1.0, "kwargs": {}}]
    return Task(policy=policy, module=module, train_data=train, eval_data=evals, rewards=rewards)
