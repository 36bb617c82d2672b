"""The "flow" pipeline builder: load a diffusers text-to-image/video pipeline, add LoRA, read prompts, make the Task.

Light to import: diffusers and peft are imported inside `build_flow`, so `mmgrpo list pipelines` stays fast.
"""

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from mmgrpo.errors import UserError
from mmgrpo.plugins import pipeline_settings
from mmgrpo.types import Task
from mmgrpo_shapes.scenes import CATEGORIES, SPLITS, list_prompts
from pipelines.flow.models import (
    ADAPTERS,
    EPS_TYPES,
    LORA_TARGETS,
    MODEL_TYPES,
    denoiser_of,
    model_type_of,
    num_params,
)
from pipelines.flow.policy import FlowPolicy
from pipelines.flow.settings import ATTENTION, FlowSettings, _check_ddim
from pipelines.flow.shapes_model import ShapesModel, ShapesT2IPipeline, is_shapes_dir
from pipelines.flow.unet import ADAPTERS as UNET_ADAPTERS
from rewards.api import INPUTS

__all__ = ["ATTENTION", "build_flow", "check_flow_kwargs", "read_prompts", "shapes_prompts", "tiny_task"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def shapes_prompts(spec: str) -> list[dict[str, Any]]:
    """ShapesWorld prompts "shapes:<split>[:<category>,...]" as records with their GenEval-style category."""
    parts = spec.split(":")
    split = parts[1] if len(parts) > 1 else "train"
    cats = parts[2].split(",") if len(parts) > 2 and parts[2] else list(CATEGORIES)
    bad = [c for c in cats if c not in CATEGORIES]
    if split not in SPLITS or bad:
        raise UserError(
            f"pipeline.kwargs.data ({spec!r}): use shapes:<split>[:<category>,...] with split in "
            f"{', '.join(SPLITS)} and categories from {', '.join(CATEGORIES)}"
        )
    return [{"prompt": p, "category": c} for c in cats for p in list_prompts(split, c)]


def read_prompts(path: str) -> list[dict[str, Any]]:
    """Prompt records from a .txt file (one prompt per line), .jsonl ({"prompt": ..., ground-truth fields}) or
    ShapesWorld ("shapes:train", "shapes:test:position,counting")."""
    if path.startswith("shapes:"):
        return shapes_prompts(path)
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"pipeline.kwargs.data ({path!r}) is not a file; pass a .txt (one prompt per line) or a "
            f'.jsonl file with a "prompt" field per line'
        )
    lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    if p.suffix != ".jsonl":
        return [{"prompt": ln.strip()} for ln in lines]
    out = []
    for i, ln in enumerate(lines):
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{i + 1} is not valid JSON ({err.msg}); write one JSON object per line") from None
        if not isinstance(rec, dict) or "prompt" not in rec:
            raise UserError(f'{path}:{i + 1} has no "prompt" field; each line must be {{"prompt": ..., ...}}')
        out.append(rec)
    return out


def _records(data: str | None, prompts: list | None, what: str) -> list[dict[str, Any]]:
    if data is not None and prompts is not None:
        raise UserError(f"pipeline.kwargs: give {what} either as a file (data) or a list (prompts), not both")
    if data is not None:
        return read_prompts(data)
    return [p if isinstance(p, dict) else {"prompt": str(p)} for p in (prompts or [])]


def load_pipeline(model: str, torch_dtype: torch.dtype):
    """`DiffusionPipeline.from_pretrained(model)` with a one-line UserError when it is not there."""
    # lazy: diffusers is heavy to import (seconds); only when a model loads
    from diffusers import DiffusionPipeline

    if not model:
        raise UserError(
            "pipeline.kwargs.model is empty; pass a hub id (e.g. stabilityai/stable-diffusion-3.5-medium), "
            "a local directory saved with save_pretrained, or tiny:sd3 / tiny:flux / tiny:wan"
        )
    if model.startswith("tiny:"):  # a tiny random pipeline built on the spot, for CPU recipes and tests
        # lazy: pipelines.flow.tiny imports diffusers and transformers
        from pipelines.flow.tiny import save_tiny

        cache = Path(os.environ.get("MMGRPO_CACHE", Path.home() / ".cache" / "mmgrpo")) / f"tiny-{model[5:]}"
        if not (cache / "model_index.json").is_file():
            tmp = save_tiny(model[5:], cache.with_name(f"{cache.name}.tmp{os.getpid()}"))
            try:
                os.rename(tmp, cache)  # atomic: concurrent builders never see a half-written directory
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        model = str(cache)

    if is_shapes_dir(model):  # ShapesWorld's pixel-space model: no VAE, components loaded one by one
        return ShapesT2IPipeline.from_pretrained(model, dtype=torch_dtype)
    looks_local = model.startswith((".", "/", "~")) or os.sep in model.strip("/").split("/", 1)[-1]
    if looks_local and not Path(model).expanduser().is_dir():
        raise UserError(
            f"pipeline.kwargs.model ({model!r}) is not a directory; pass an existing local pipeline "
            f"directory or a hub id such as stabilityai/stable-diffusion-3.5-medium"
        )
    try:
        return DiffusionPipeline.from_pretrained(
            str(Path(model).expanduser()) if looks_local else model, dtype=torch_dtype
        )
    except (OSError, ValueError) as err:
        offline = " (HF_HUB_OFFLINE=1 is set)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise UserError(
            f"pipeline.kwargs.model ({model!r}) could not be loaded{offline}: {first}; download it "
            f"first (huggingface-cli download {model}) or pass a local directory, "
            f"e.g. pipeline.kwargs.model=/path/to/model"
        ) from None


def _add_lora(transformer, model_type: str, rank: int, alpha: float | None, targets: list[str] | None) -> None:
    # lazy: peft is heavy to import (seconds); only LoRA runs need it
    from peft import LoraConfig

    cfg = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        init_lora_weights="gaussian",
        target_modules=list(targets or LORA_TARGETS[model_type]),
    )
    try:
        transformer.add_adapter(cfg)
    except ValueError as err:
        raise UserError(
            f"pipeline.kwargs.lora_targets ({cfg.target_modules}) match no layer of this transformer "
            f"({err}); name modules such as to_q, to_k, to_v, to_out.0"
        ) from None
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # trainable adapter weights stay fp32 under bf16 base weights


def _model_type(pipe, model_type: str | None, sde: str) -> str:
    """The checked model type of a loaded pipeline: model_type if given (it must match the class), else detected."""
    detected = model_type_of(type(pipe).__name__)
    model_type = model_type or detected
    if model_type not in MODEL_TYPES or (detected and detected != model_type):
        raise UserError(
            f"pipeline.kwargs.model_type ({model_type!r}) must be one of {MODEL_TYPES} and match the "
            f"loaded {type(pipe).__name__} ({detected!r}); leave model_type unset to detect it"
        )
    _check_ddim(sde, model_type, "grpo", "none")
    return model_type


def adapter_for(model_type: str):
    """The FlowModel class of a model type: models.py (SD3, FLUX, Wan), shapes_model.py (the pixel-space ShapesWorld
    model) or unet.py (epsilon-prediction SD 1.x / SDXL)."""
    if model_type == "shapes":
        return ShapesModel
    if model_type in EPS_TYPES:
        return UNET_ADAPTERS[model_type]
    return ADAPTERS[model_type]


def _reward_inputs(reward_inputs: list[str] | str | None) -> list[str] | None:
    """The reward input kinds as a checked list (a single kind may be given as a string)."""
    if reward_inputs is None:
        return None
    kinds = [reward_inputs] if isinstance(reward_inputs, str) else list(reward_inputs)
    if not kinds or any(k not in INPUTS for k in kinds) or ("latent" in kinds and len(set(kinds)) > 1):
        raise UserError(
            f"pipeline.kwargs.reward_inputs ({reward_inputs!r}) must list kinds from {', '.join(INPUTS)}, "
            f"either only latent (rollouts skip the VAE) or only pixel kinds; e.g. [latent] or [image]"
        )
    return kinds


def check_attention(attention: str, device: torch.device) -> None:
    """xformers needs CUDA and the package (the `cuda` extra); say so in one line before any weight loads."""
    if attention != "xformers":
        return

    if torch.device(device).type != "cuda" or importlib.util.find_spec("xformers") is None:
        why = "no CUDA device" if torch.device(device).type != "cuda" else "the xformers package is not installed"
        raise UserError(
            f"pipeline.kwargs.attention=xformers needs CUDA and xformers ({why}); install the cuda extra "
            f'(pip install -e ".[cuda]") on a CUDA machine, or use attention=sdpa'
        )


def check_flow_kwargs(**given) -> None:
    """The checks `build_flow` makes before loading anything: FlowSettings built from `given` and checked (the
    registry's `settings=` meta makes validation, `mmgrpo config` and `train`, do the same)."""
    pipeline_settings(FlowSettings, given)


def _adapter(pipe: Any, s: FlowSettings, model_type: str, device: torch.device, dtype: torch.dtype) -> Any:
    """The model adapter at the settings' resolution, frames and guidance, its latent shape checked."""
    h, w = (s.resolution, s.resolution) if isinstance(s.resolution, int) else tuple(s.resolution)
    adapter = adapter_for(model_type)(
        pipe,
        height=h,
        width=w,
        num_frames=s.num_frames,
        guidance_scale=s.guidance_scale,
        negative_prompt=s.negative_prompt,
        max_sequence_length=s.max_sequence_length,
        device=device,
        dtype=dtype,
        prompt_cache_items=s.prompt_cache_items,
    )
    adapter.latent_shape()  # resolution / frame-count errors before any rollout
    return adapter


def build_flow(*, seed: int, device: torch.device, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Task:
    """GRPO on a diffusers flow model (SD3/SD3.5, FLUX.1, Wan 2.1) or epsilon UNet (SD 1.x, SDXL; sde ddim).

    kwargs: the fields of `FlowSettings` (pipelines/flow/settings.py; docs/config.md lists them), checked first.
    reward_inputs: ["latent"] skips the VAE in rollouts (samples are the final latents); None decodes to pixels
    unless the engine reports the rewards' inputs through policy.set_reward_inputs."""
    s = pipeline_settings(FlowSettings, kwargs)
    check_attention(s.attention, device)
    reward_inputs = _reward_inputs(s.reward_inputs)
    train = _records(s.data, s.prompts, "training prompts")
    if not train:
        raise UserError('pipeline.kwargs needs prompts: data: prompts.txt|.jsonl or prompts: ["a cat", ...]')
    weights_dtype = _DTYPES[s.torch_dtype] if s.torch_dtype else dtype
    pipe = load_pipeline(s.model, weights_dtype)
    model_type = _model_type(pipe, s.model_type, s.sde)
    transformer = _trainable(pipe, s, model_type, device)
    adapter = _adapter(pipe, s, model_type, device, weights_dtype)
    policy = FlowPolicy(
        pipe,
        adapter,
        num_steps=s.num_steps,
        sde_kind=s.sde,
        noise_level=s.noise_level,
        reduce=s.reduce,
        plan=s.plan,
        plan_kwargs=s.plan_kwargs or {},
        same_noise=s.same_noise_per_group,
        lora=s.lora_rank > 0,
        reference=s.reference,
        k_chunk=s.k_chunk,
        seed=seed,
        decode_batch_size=s.decode_batch_size,
        objective=s.objective,
        nft_steps=s.nft_steps,
        ratio_norm=s.ratio_norm,
        step_weights=s.step_weights,
        reward_inputs=reward_inputs,
        value_anchor=s.value_anchor,
        anchor_every=s.anchor_every,
        trust_step=s.trust_step,
    )
    policy.num_params = {"transformer": num_params(transformer), "trainable": num_params(transformer, True)}
    return Task(
        policy=policy,
        module=transformer,
        train_data=train,
        eval_data=_records(s.eval_data, s.eval_prompts, "evaluation prompts"),
    )


def _trainable(pipe, s: FlowSettings, model_type: str, device: torch.device):
    """The pipeline on `device` with its VAE and text encoders frozen; the denoiser with LoRA (lora_rank > 0) or
    trainable, checkpointed and with xformers attention as asked."""
    pipe.to(device)
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        part = getattr(pipe, name, None)
        if part is not None:
            part.requires_grad_(False).eval()
    transformer = denoiser_of(pipe).requires_grad_(False)
    if s.lora_rank > 0:
        _add_lora(transformer, model_type, s.lora_rank, s.lora_alpha, s.lora_targets)
    else:
        transformer.requires_grad_(True)
    if s.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if s.attention == "xformers":
        pipe.enable_xformers_memory_efficient_attention()  # transformer (LoRA included) and VAE
    return transformer


def tiny_task(path: str, **overrides) -> Task:
    """`build_flow` on a model saved by `pipelines.flow.tiny.save_tiny` with small CPU settings (32 px, 4 steps,
    LoRA r4, CFG off), torch seeded first so LoRA initialisation repeats; keyword overrides win. For tests and quick
    checks. It lives here, not in tiny.py, so the tiny model builders never import the pipeline builder."""
    kw = {
        "seed": 0,
        "device": torch.device("cpu"),
        "model": path,
        "prompts": ["a"],
        "resolution": 32,
        "num_steps": 4,
        "max_sequence_length": 8,
        "lora_rank": 4,
        "guidance_scale": 1.0,
        **overrides,
    }
    torch.manual_seed(0)
    return build_flow(**kw)
