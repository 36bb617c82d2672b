"""The `vlm` pipeline builder: loads the model and processor, applies LoRA or full fine-tuning, builds the prompts.

Imports transformers and peft only inside functions, so registering the builder stays light.
"""

import warnings
from pathlib import Path
from typing import Any

import torch

from mmgrpo.errors import UserError
from mmgrpo.plugins import pipeline_settings
from mmgrpo.types import Task
from pipelines.vlm.data import (
    SHAPES_VQA,
    check_prompt_lengths,
    load_records,
    max_images,
    model_positions,
    model_special_tokens,
    prompt_tokens,
)
from pipelines.vlm.methods import CareLikelihood
from pipelines.vlm.prefix import PREFIX_ATTENTION, supports_grouped, supports_shared
from pipelines.vlm.settings import FORMAT_INSTRUCTION, ModelSettings, VLMSettings, check_attn_implementation

__all__ = ["FORMAT_INSTRUCTION", "LORA_TARGETS", "build_vlm", "check_attn_implementation", "check_vlm_kwargs"]

LORA_TARGETS = r"^(?!.*visual).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"
"""peft regex: the language model's attention and MLP projections; the vision tower is left out (as EasyR1 does)"""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _offline_hint(model: str) -> str:
    return (
        f"pipeline.kwargs.model ({model!r}) is not a local directory and is not in the local Hugging Face cache "
        f"(the Hub is unreachable or HF_HUB_OFFLINE=1); download it once (huggingface-cli download {model}) or "
        f"pass its local directory as pipeline.kwargs.model=/path/to/model; model=tiny-random-qwen2-vl runs offline"
    )


def check_vlm_kwargs(**given) -> None:
    """The checks the engine's validation (`mmgrpo config`) runs before anything loads: VLMSettings built from
    `given` and checked (the registry's `settings=` meta does the same)."""
    pipeline_settings(VLMSettings, given)


def load_model(
    model: str,
    *,
    dtype: torch.dtype,
    attn_implementation: str,
    cache_dir: str | None,
    min_pixels: int | None,
    max_pixels: int | None,
):
    """(processor, model) from a local directory, a cached hub id, or a tiny random model built on the fly."""
    # lazy: transformers (and pipelines.vlm.tiny, which imports it) only when a model loads
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from pipelines.vlm.tiny import TINY_MODELS, tiny_model_dir

    path = tiny_model_dir(model, cache_dir) if model in TINY_MODELS else model
    pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    try:
        processor = AutoProcessor.from_pretrained(path, **pixels)
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except OSError as err:
        if Path(path).exists():
            raise UserError(f"pipeline.kwargs.model ({model!r}) could not be loaded: {err}") from None
        raise UserError(_offline_hint(model)) from None
    tok = getattr(processor, "tokenizer", None)
    if (
        tok is None
        or getattr(tok, "chat_template", None) is None
        and getattr(processor, "chat_template", None) is None
    ):
        raise UserError(
            f"pipeline.kwargs.model ({model!r}) has no processor chat template; use an instruct/chat "
            f"checkpoint whose processor defines one"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return processor, hf


def _model_path(model: str, cache_dir: str | None, rollout_backend: str) -> str:
    """What vLLM loads: the tiny random models' directory, else the name or path as given."""
    # lazy: pipelines.vlm.tiny imports transformers; only vLLM on a tiny model needs it
    from pipelines.vlm.tiny import TINY_MODELS, tiny_model_dir

    return tiny_model_dir(model, cache_dir) if rollout_backend == "vllm" and model in TINY_MODELS else model


def apply_training_mode(
    hf,
    *,
    lora_rank: int,
    lora_alpha: float | None,
    lora_dropout: float,
    lora_targets: str | list[str] | None,
    freeze_vision: bool,
    gradient_checkpointing: bool,
):
    """Wrap with a LoRA adapter (lora_rank > 0) or unfreeze everything (full fine-tuning); returns the model."""
    if lora_rank < 0:
        raise UserError(f"pipeline.kwargs.lora_rank ({lora_rank}) must be >= 0 (0 = full fine-tuning)")
    if gradient_checkpointing:
        # non-reentrant: works with frozen embeddings under LoRA (no enable_input_require_grads hack)
        if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.x name
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_rank > 0:
        # lazy: peft is heavy to import (seconds); only LoRA runs need it
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(
            r=lora_rank,
            lora_alpha=lora_alpha or 2 * lora_rank,
            lora_dropout=lora_dropout,
            target_modules=lora_targets or LORA_TARGETS,
            bias="none",
        )
        with warnings.catch_warnings():  # peft reads the deprecated is_gradient_checkpointing alias
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(hf, cfg)
    hf.requires_grad_(True)
    if freeze_vision:
        visual = getattr(getattr(hf, "model", hf), "visual", None)
        if visual is None:
            raise UserError("pipeline.kwargs.freeze_vision=true but the model has no `visual` tower to freeze")
        visual.requires_grad_(False)
    return hf


def _shared_mode(prefix_sharing: str | bool, hf, prefix_attention: str = "auto") -> bool:
    """Whether the update runs one prefix-shared row per group; checks prefix_attention against this model too."""
    # lazy: pipelines.vlm.policy imports transformers; `import pipelines` (plugin load) stays light
    from pipelines.vlm.policy import unwrap

    if prefix_attention not in PREFIX_ATTENTION:
        raise UserError(
            f"pipeline.kwargs.prefix_attention ({prefix_attention!r}) must be one of "
            f"{', '.join(PREFIX_ATTENTION)} (auto: grouped attention where the model supports it)"
        )
    ok, why = supports_shared(hf)
    if prefix_sharing in ("auto", None):
        shared = ok
    elif prefix_sharing is True or prefix_sharing == "on":
        if not ok:
            raise UserError(f"pipeline.kwargs.prefix_sharing=on but {why}; set prefix_sharing=auto or off")
        shared = True
    elif prefix_sharing is False or prefix_sharing == "off":
        shared = False
    else:
        raise UserError(f"pipeline.kwargs.prefix_sharing ({prefix_sharing!r}) must be auto, on or off")
    if shared and prefix_attention == "grouped":
        ok, why = supports_grouped(unwrap(hf).model)
        if not ok:
            raise UserError(f"pipeline.kwargs.prefix_attention=grouped but {why}; set prefix_attention=auto or mask")
    return shared


def build_vlm(*, seed: int, device: torch.device, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Task:
    """GRPO on an image-text-to-text model (Qwen2-VL, Qwen2.5-VL, ...) over VQA-style records with verifiable answers.

    kwargs: the fields of `VLMSettings` (pipelines/vlm/settings.py; docs/config.md lists them), checked first.
    """
    # lazy: pipelines.vlm.policy and .rollout import transformers; `import pipelines` (plugin load) stays light
    from pipelines.vlm.policy import VLMPolicy, chat_prompt
    from pipelines.vlm.rollout import make_backend

    s = pipeline_settings(VLMSettings, kwargs)
    warn_top_p(s)
    train, evals = _records(s, seed)
    # before the model loads: a missing vllm package or GPU fails in a second, not after loading 7B weights
    check_attn_implementation(s.attn_implementation, device)
    backend = make_backend(
        s.rollout_backend,
        prompts_per_call=s.rollout_prompts_per_call,
        model_path=_model_path(s.model, s.cache_dir, s.rollout_backend),
        device=device,
        dtype=s.model_dtype,
        seed=seed,
        gpu_memory_utilization=s.vllm_gpu_memory_utilization,
        max_model_len=s.vllm_max_model_len,
        enable_sleep_mode=s.vllm_enable_sleep_mode,
        max_images=max_images(train + evals),
        min_pixels=s.min_pixels,
        max_pixels=s.max_pixels,
        engine_kwargs=s.vllm_engine_kwargs,
    )
    torch.manual_seed(seed)
    processor, hf = load_trainable(s, dtype=dtype, device=device)
    sample = sample_settings(s)
    fit = prompt_fit(s, processor, hf, positions_limit=s.vllm_max_model_len, skip=s.skip_bad_images)

    def count(rec: dict[str, Any]) -> tuple[int, int]:
        return prompt_tokens(processor, *chat_prompt(processor, sample, rec))

    train = check_prompt_lengths(train, count, field="pipeline.kwargs.data", **fit)
    evals = check_prompt_lengths(evals, count, field="pipeline.kwargs.eval_data", **fit)
    module = vlm_module(s, hf, processor)
    policy = make_policy(VLMPolicy, s, module, processor, device=device, settings=sample, backend=backend)
    rewards = [{"name": "format", "weight": 0.5, "kwargs": {}}, {"name": "accuracy", "weight": 1.0, "kwargs": {}}]
    return Task(policy=policy, module=module, train_data=train, eval_data=evals, rewards=rewards)


def warn_top_p(s: ModelSettings) -> None:
    if s.top_p < 1:
        warnings.warn(
            "pipeline.kwargs.top_p < 1 samples from a truncated distribution while log-probs use the full "
            "softmax (as TRL and verl do); the first ratio is still exactly 1",
            stacklevel=3,
        )


def load_trainable(s: ModelSettings, *, dtype: torch.dtype, device: torch.device):
    """(processor, model on `device`): the model loaded in model_dtype (else `dtype`), in its training mode."""
    processor, hf = load_model(
        s.model,
        dtype=DTYPES[s.model_dtype] if s.model_dtype else dtype,
        attn_implementation=s.attn_implementation,
        cache_dir=s.cache_dir,
        min_pixels=s.min_pixels,
        max_pixels=s.max_pixels,
    )
    hf = apply_training_mode(
        hf,
        lora_rank=s.lora_rank,
        lora_alpha=s.lora_alpha,
        lora_dropout=s.lora_dropout,
        lora_targets=s.lora_targets,
        freeze_vision=s.freeze_vision,
        gradient_checkpointing=s.gradient_checkpointing,
    )
    return processor, hf.to(device)


def sample_settings(s: ModelSettings):
    """The policy's SampleSettings (stop strings as a tuple)."""
    # lazy: pipelines.vlm.policy imports transformers; `import pipelines` (plugin load) stays light
    from pipelines.vlm.policy import SampleSettings

    stop = (s.stop,) if isinstance(s.stop, str) else tuple(s.stop or ())
    return SampleSettings(
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop=stop,
        system_prompt=s.system_prompt,
        instruction=s.instruction,
    )


def prompt_fit(s: ModelSettings, processor, hf, *, positions_limit: int | None = None, **kw: Any) -> dict[str, Any]:
    """check_prompt_lengths' keywords: the model's positions, the prompt and completion budgets, special tokens."""
    return {
        "positions": model_positions(hf, positions_limit),
        "max_prompt_length": s.max_prompt_length,
        "max_new_tokens": s.max_new_tokens,
        "special_tokens": model_special_tokens(processor),
        **kw,
    }


def vlm_module(s: ModelSettings, hf, processor):
    """The trained VLMModule: prefix sharing decided for this model, log-prob chunks, the vision cache."""
    # lazy: pipelines.vlm.policy imports transformers; `import pipelines` (plugin load) stays light
    from pipelines.vlm.policy import VLMModule

    return VLMModule(
        hf,
        pad_id=processor.tokenizer.pad_token_id,
        temperature=s.temperature,
        shared=_shared_mode(s.prefix_sharing, hf, s.prefix_attention),
        chunk_tokens=s.logp_chunk_tokens,
        prefix_attention=s.prefix_attention,
        vision_cache=s.vision_cache,
        vision_cache_items=s.vision_cache_items,
    )


def make_policy(cls: type, s: ModelSettings, module, processor, **kw: Any):
    """`cls(module, processor, reference=..., care=..., check_logp=..., **kw)`; its ValueError as one UserError."""
    care = CareLikelihood(decay=s.care_ema_decay, every=s.care_ema_every) if s.care_likelihood else None
    try:
        return cls(module, processor, reference=s.reference, care=care, check_logp=s.check_logp, **kw)
    except ValueError as err:
        raise UserError(f"pipeline.kwargs: {err}") from None


def _records(s: VLMSettings, seed: int) -> tuple[list, list]:
    """(train, eval) records: eval from `eval_data`, or from the ShapesWorld split `eval_split` when training on it."""
    common = {"seed": seed, "resolution": s.resolution, "question_types": s.question_types}
    common["skip_bad_images"] = s.skip_bad_images
    train = load_records(s.data, split="train", size=s.train_size, field="pipeline.kwargs.data", **common)
    if not (s.eval_data or s.data == SHAPES_VQA):
        return train, []
    field = "pipeline.kwargs.eval_data"
    return train, load_records(s.eval_data or SHAPES_VQA, split=s.eval_split, size=s.eval_size, field=field, **common)
