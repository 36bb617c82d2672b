"""The `vlm` pipeline builder: loads the model and processor, applies LoRA or full fine-tuning, builds the prompts.

Imports transformers and peft only inside functions, so registering the builder stays light.
"""

import warnings
from pathlib import Path
from typing import Any

import torch

from mmgrpo.errors import UserError
from mmgrpo.types import Task

FORMAT_INSTRUCTION = "Think inside <think></think>, then give only the final answer inside <answer></answer>."
LORA_TARGETS = r"^(?!.*visual).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"
"""peft regex: the language model's attention and MLP projections; the vision tower is left out (as EasyR1 does)"""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _offline_hint(model: str) -> str:
    return (
        f"pipeline.kwargs.model ({model!r}) is not a local directory and is not in the local Hugging Face cache "
        f"(the Hub is unreachable or HF_HUB_OFFLINE=1); download it once (huggingface-cli download {model}) or "
        f"pass its local directory as pipeline.kwargs.model=/path/to/model; model=tiny-random-qwen2-vl runs offline"
    )


def check_attn_implementation(attn_implementation: str, device: torch.device | str | None = None) -> None:
    """One line before any weight loads: the name must be a transformers attention kernel, and the flash kernels need
    CUDA and their package (transformers would otherwise fail mid-load with a message that names no field)."""
    import importlib.util

    from transformers import AttentionInterface

    known = ["eager", *(k for k in AttentionInterface._global_mapping if "|" not in k)]
    if attn_implementation not in known:
        raise UserError(
            f"pipeline.kwargs.attn_implementation ({attn_implementation!r}) is not an attention kernel "
            f"transformers knows; choose one of {', '.join(known)} (sdpa is the default and runs anywhere)"
        )
    package = {
        "flash_attention_2": "flash_attn",
        "flash_attention_3": "flash_attn_interface",
        "flash_attention_4": "flash_attn",
    }.get(attn_implementation)
    if package is None or device is None:  # validation before the device is known checks the name only
        return
    on_cuda = torch.device(device).type == "cuda"
    if not on_cuda or importlib.util.find_spec(package) is None:
        why = "no CUDA device" if not on_cuda else f"the {package} package is not installed"
        raise UserError(
            f"pipeline.kwargs.attn_implementation={attn_implementation} needs CUDA and {package} ({why}); "
            f"install flash-attn on a CUDA machine, or use attn_implementation=sdpa"
        )


def check_vlm_kwargs(**given) -> None:
    """The cheap checks the engine's validation (`mmgrpo config`) runs before anything loads."""
    from pipelines.vlm.prefix import PREFIX_ATTENTION
    from pipelines.vlm.vision_cache import check_vision_cache

    check_attn_implementation(given.get("attn_implementation", "sdpa"))
    check_vision_cache(given.get("vision_cache", "auto"), given.get("vision_cache_items", 64))
    if given.get("prefix_attention", "auto") not in PREFIX_ATTENTION:
        raise UserError(
            f"pipeline.kwargs.prefix_attention ({given['prefix_attention']!r}) must be one of "
            f"{', '.join(PREFIX_ATTENTION)} (auto: grouped attention where the model supports it)"
        )


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
    from pipelines.vlm.policy import unwrap
    from pipelines.vlm.prefix import PREFIX_ATTENTION, supports_grouped, supports_shared

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


def build_vlm(
    *,
    seed: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    model: str = "tiny-random-qwen2-vl",
    data: str = "shapes_vqa",
    eval_data: str | None = None,
    eval_split: str = "val",
    train_size: int | None = 256,
    eval_size: int | None = 64,
    resolution: int = 32,
    question_types: list[str] | None = None,
    skip_bad_images: bool = False,
    lora_rank: int = 0,
    lora_alpha: float | None = None,
    lora_dropout: float = 0.0,
    lora_targets: str | list[str] | None = None,
    freeze_vision: bool = False,
    gradient_checkpointing: bool = False,
    model_dtype: str | None = None,
    attn_implementation: str = "sdpa",
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    max_new_tokens: int = 64,
    max_prompt_length: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop: list[str] | str | None = "</answer>",
    system_prompt: str | None = None,
    instruction: str | None = FORMAT_INSTRUCTION,
    prefix_sharing: str | bool = "auto",
    prefix_attention: str = "auto",
    vision_cache: str = "auto",
    vision_cache_items: int = 64,
    logp_chunk_tokens: int = 1024,
    reference: str = "auto",
    care_likelihood: bool = False,
    care_ema_decay: float = 0.995,
    care_ema_every: int = 10,
    check_logp: bool = False,
    rollout_backend: str = "hf",
    rollout_prompts_per_call: int = 0,
    vllm_gpu_memory_utilization: float = 0.3,
    vllm_max_model_len: int | None = None,
    vllm_enable_sleep_mode: bool = False,
    vllm_engine_kwargs: dict[str, Any] | None = None,
    cache_dir: str | None = None,
) -> Task:
    """GRPO on an image-text-to-text model (Qwen2-VL, Qwen2.5-VL, ...) over VQA-style records with verifiable answers.

    max_prompt_length: refuse (or, with skip_bad_images, skip) records whose chat prompt, image tokens included, is
    longer; every prompt must also leave max_new_tokens within the model's positions. Text is never silently cut.
    eval_split: the split of the eval records (`mmgrpo eval`): val while tuning, test for a reported held-out number.
    """
    from pipelines.vlm.data import (
        check_prompt_lengths,
        max_images,
        model_positions,
        model_special_tokens,
        prompt_tokens,
    )
    from pipelines.vlm.methods import CareLikelihood
    from pipelines.vlm.policy import SampleSettings, VLMModule, VLMPolicy, chat_prompt
    from pipelines.vlm.rollout import make_backend

    _check(
        eval_split=eval_split,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        logp_chunk_tokens=logp_chunk_tokens,
        model_dtype=model_dtype,
        max_prompt_length=max_prompt_length,
        system_prompt=system_prompt,
        instruction=instruction,
    )
    _check_rollout(
        rollout_backend,
        check_logp=check_logp,
        gpu_memory_utilization=vllm_gpu_memory_utilization,
        max_model_len=vllm_max_model_len,
        max_new_tokens=max_new_tokens,
        prompts_per_call=rollout_prompts_per_call,
    )
    common = {"seed": seed, "resolution": resolution, "question_types": question_types}
    train, evals = _records(data, eval_data, eval_split, train_size, eval_size, skip_bad_images, **common)
    # before the model loads: a missing vllm package or GPU fails in a second, not after loading 7B weights
    check_attn_implementation(attn_implementation, device)
    backend = make_backend(
        rollout_backend,
        prompts_per_call=rollout_prompts_per_call,
        model_path=_model_path(model, cache_dir, rollout_backend),
        device=device,
        dtype=model_dtype,
        seed=seed,
        gpu_memory_utilization=vllm_gpu_memory_utilization,
        max_model_len=vllm_max_model_len,
        enable_sleep_mode=vllm_enable_sleep_mode,
        max_images=max_images(train + evals),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        engine_kwargs=vllm_engine_kwargs,
    )
    torch.manual_seed(seed)
    processor, hf = load_model(
        model,
        dtype=DTYPES[model_dtype] if model_dtype else dtype,
        attn_implementation=attn_implementation,
        cache_dir=cache_dir,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
    hf = apply_training_mode(
        hf,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        lora_targets=lora_targets,
        freeze_vision=freeze_vision,
        gradient_checkpointing=gradient_checkpointing,
    ).to(device)
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    settings = SampleSettings(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=stops,
        system_prompt=system_prompt,
        instruction=instruction,
    )
    fit = {
        "positions": model_positions(hf, vllm_max_model_len),
        "max_prompt_length": max_prompt_length,
        "max_new_tokens": max_new_tokens,
        "skip": skip_bad_images,
        "special_tokens": model_special_tokens(processor),
    }

    def count(rec: dict[str, Any]) -> tuple[int, int]:
        return prompt_tokens(processor, *chat_prompt(processor, settings, rec))

    train = check_prompt_lengths(train, count, field="pipeline.kwargs.data", **fit)
    evals = check_prompt_lengths(evals, count, field="pipeline.kwargs.eval_data", **fit)
    module = VLMModule(
        hf,
        pad_id=processor.tokenizer.pad_token_id,
        temperature=temperature,
        shared=_shared_mode(prefix_sharing, hf, prefix_attention),
        chunk_tokens=logp_chunk_tokens,
        prefix_attention=prefix_attention,
        vision_cache=vision_cache,
        vision_cache_items=vision_cache_items,
    )
    care = CareLikelihood(decay=care_ema_decay, every=care_ema_every) if care_likelihood else None
    try:
        policy = VLMPolicy(
            module,
            processor,
            device=device,
            settings=settings,
            reference=reference,
            care=care,
            check_logp=check_logp,
            backend=backend,
        )
    except ValueError as err:
        raise UserError(f"pipeline.kwargs: {err}") from None
    rewards = [{"name": "format", "weight": 0.5, "kwargs": {}}, {"name": "accuracy", "weight": 1.0, "kwargs": {}}]
    return Task(policy=policy, module=module, train_data=train, eval_data=evals, rewards=rewards)


def _records(data, eval_data, eval_split, train_size, eval_size, skip_bad_images, **common) -> tuple[list, list]:
    """(train, eval) records: eval from `eval_data`, or from the ShapesWorld split `eval_split` when training on it."""
    from pipelines.vlm.data import SHAPES_VQA, load_records

    common["skip_bad_images"] = skip_bad_images
    train = load_records(data, split="train", size=train_size, field="pipeline.kwargs.data", **common)
    if not (eval_data or data == SHAPES_VQA):
        return train, []
    field = "pipeline.kwargs.eval_data"
    return train, load_records(eval_data or SHAPES_VQA, split=eval_split, size=eval_size, field=field, **common)


def _check(**kw: Any) -> None:
    from pipelines.vlm.data import check_eval_split

    check_eval_split(kw.get("eval_split", "val"))
    if kw["max_new_tokens"] < 1:
        raise UserError(f"pipeline.kwargs.max_new_tokens ({kw['max_new_tokens']}) must be >= 1")
    from pipelines.vlm.data import text_problem

    for key in ("system_prompt", "instruction"):
        problem = kw.get(key) and text_problem(str(kw[key]), what=key)
        if problem:
            raise UserError(f"pipeline.kwargs.{key}: {problem}")
    limit = kw.get("max_prompt_length")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise UserError(
            f"pipeline.kwargs.max_prompt_length ({limit!r}) must be a whole number of tokens >= 1 (image "
            f"tokens included), or null for the model's positions minus max_new_tokens"
        )
    if kw["temperature"] <= 0:
        raise UserError(
            f"pipeline.kwargs.temperature ({kw['temperature']}) must be > 0: GRPO samples, and the "
            f"log-probs are of softmax(logits / temperature)"
        )
    if not 0 < kw["top_p"] <= 1:
        raise UserError(f"pipeline.kwargs.top_p ({kw['top_p']}) must be in (0, 1]")
    if kw["top_p"] < 1:
        warnings.warn(
            "pipeline.kwargs.top_p < 1 samples from a truncated distribution while log-probs use the full "
            "softmax (as TRL and verl do); the first ratio is still exactly 1",
            stacklevel=3,
        )
    if kw["logp_chunk_tokens"] < 1:
        raise UserError(f"pipeline.kwargs.logp_chunk_tokens ({kw['logp_chunk_tokens']}) must be >= 1")
    if kw["model_dtype"] is not None and kw["model_dtype"] not in DTYPES:
        raise UserError(f"pipeline.kwargs.model_dtype ({kw['model_dtype']!r}) must be one of {sorted(DTYPES)} or null")


def _check_rollout(
    backend: str,
    *,
    check_logp: bool,
    gpu_memory_utilization: float,
    max_model_len: int | None,
    max_new_tokens: int,
    prompts_per_call: int = 0,
) -> None:
    from pipelines.vlm.rollout import ROLLOUT_BACKENDS

    if backend not in ROLLOUT_BACKENDS:
        raise UserError(f"pipeline.kwargs.rollout_backend ({backend!r}) must be one of {list(ROLLOUT_BACKENDS)}")
    if not isinstance(prompts_per_call, int) or prompts_per_call < 0:
        raise UserError(
            f"pipeline.kwargs.rollout_prompts_per_call ({prompts_per_call!r}) must be an integer >= 0: "
            f"prompts sampled together (0 = all of a rank's prompts in one batch; lower it to bound "
            f"the rollout's KV cache)"
        )
    if backend != "vllm":
        return
    if check_logp:
        raise UserError(
            "pipeline.kwargs.check_logp=true compares generate's own log-probs with the recomputed ones; "
            "with rollout_backend=vllm the old log-probs are always recomputed by the training model, so "
            "set check_logp=false (or rollout_backend=hf)"
        )
    if not 0 < gpu_memory_utilization <= 1:
        raise UserError(
            f"pipeline.kwargs.vllm_gpu_memory_utilization ({gpu_memory_utilization}) must be in (0, 1]: "
            f"the fraction of the GPU vLLM may take next to training (0.3 leaves 70% for the update)"
        )
    if max_model_len is not None and max_model_len <= max_new_tokens:
        raise UserError(
            f"pipeline.kwargs.vllm_max_model_len ({max_model_len}) must exceed max_new_tokens "
            f"({max_new_tokens}): it bounds prompt (image tokens included) + completion"
        )
