"""The vlm pipeline's typed settings (`pipeline.kwargs` of `vlm`), and the model settings the video pipeline shares.

`ModelSettings` holds what both pipelines pass to the same code (model loading, LoRA, sampling, the update's
forward, the reference); `VLMSettings` adds the image records and the rollout backend, and pipelines/video/settings.py
adds the video records, frames and methods. Validation builds them from the recipe and runs `check()` and
`check_algo()` before any model is built; docs/config.md is generated from the field docstrings. No model code here.
"""

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from mmgrpo import losses
from mmgrpo.errors import UserError
from pipelines.vlm.data import check_eval_split, text_problem
from pipelines.vlm.prefix import PREFIX_ATTENTION
from pipelines.vlm.vision_cache import check_vision_cache

FORMAT_INSTRUCTION = "Think inside <think></think>, then give only the final answer inside <answer></answer>."
MODEL_DTYPES = ("float32", "bfloat16", "float16")
REFERENCES = ("auto", "copy", "none")
PREFIX_SHARING = ("auto", "on", "off", True, False)


def check_attn_implementation(attn_implementation: str, device: Any = None) -> None:
    """One line before any weight loads: the name must be a transformers attention kernel, and the flash kernels need
    CUDA and their package (transformers would otherwise fail mid-load with a message that names no field)."""
    # lazy: transformers is heavy to import (~1 s); validation runs before any model loads
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


def at_least(obj: Any, key: str, least: float, why: str = "", none_ok: bool = False) -> None:
    """UserError naming pipeline.kwargs.<key>, its value and an example unless obj.<key> >= least (or null)."""
    value = getattr(obj, key)
    if (value is None and none_ok) or (value is not None and value >= least):
        return
    also = " or null" if none_ok else ""
    raise UserError(
        f"pipeline.kwargs.{key} ({value!r}) must be >= {least}{also}{why}, e.g. pipeline.kwargs.{key}={max(least, 1)}"
    )


@dataclass
class ModelSettings:
    """The model, training mode, sampling and forward settings of the vlm and video pipelines."""

    model: str = "tiny-random-qwen2-vl"
    """hub id or local directory of an image/video-text-to-text model, or tiny-random-qwen2-vl (offline, random)"""
    eval_data: str | None = None
    """eval records (same forms as data); null: the ShapesWorld split eval_split when training on ShapesWorld"""
    eval_split: str = "val"
    """split of the eval records (`mmgrpo eval`): val while tuning, test for a reported held-out number"""
    lora_rank: int = 0
    """LoRA rank on the language model's projections; 0 = full fine-tuning"""
    lora_alpha: float | None = None
    """LoRA alpha; null = 2 * lora_rank"""
    lora_dropout: float = 0.0
    """dropout on the LoRA input, in [0, 1)"""
    lora_targets: str | list[str] | None = None
    """peft target modules (regex or names); null = the language model's attention and MLP projections"""
    freeze_vision: bool = False
    """full fine-tuning only: keep the vision tower frozen"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, slower)"""
    model_dtype: str | None = None
    """weights dtype: float32, bfloat16 or float16; null = the run's dtype"""
    attn_implementation: str = "sdpa"
    """transformers attention kernel: sdpa, eager, flash_attention_2 (CUDA and flash-attn), ..."""
    min_pixels: int | None = None
    """processor's smallest image area in pixels; null = the processor's default"""
    max_pixels: int | None = None
    """processor's largest image area in pixels; null = the processor's default"""
    max_new_tokens: int = 64
    """longest completion in tokens"""
    max_prompt_length: int | None = None
    """longest chat prompt in tokens (image/video tokens included): longer records are refused (or skipped); null =
    the model's positions minus max_new_tokens. Text is never silently cut"""
    temperature: float = 1.0
    """sampling temperature (> 0); log-probs are of softmax(logits / temperature)"""
    top_p: float = 1.0
    """nucleus sampling in (0, 1]; < 1 samples a truncated distribution while log-probs use the full one"""
    top_k: int = 0
    """top-k sampling; 0 = off"""
    stop: list[str] | str | None = "</answer>"
    """stop string(s) that end a completion; null = the end-of-turn token only"""
    system_prompt: str | None = None
    """system message of every chat prompt; null = none"""
    instruction: str | None = FORMAT_INSTRUCTION
    """text appended to every question (the answer format the rewards check); null = none"""
    prefix_sharing: str | bool = "auto"
    """one prompt-shared row per group in the update: auto (where the model supports it), on or off"""
    prefix_attention: str = "auto"
    """attention of the prefix-shared update: auto (grouped where supported), grouped or mask"""
    vision_cache: str = "auto"
    """auto: encode each image/video once while the vision tower is frozen; off: every pass"""
    vision_cache_items: int = 64
    """images/videos the vision cache keeps (>= the prompts one rank samples per iteration)"""
    logp_chunk_tokens: int = 1024
    """tokens per chunk of the log-prob softmax (bounds the logits' memory)"""
    reference: str = "auto"
    """KL reference: auto (LoRA: adapter off; full fine-tuning: frozen copy), copy or none"""
    care_likelihood: bool = False
    """GRPO-CARE's consistency bonus from an EMA reference's likelihood"""
    care_ema_decay: float = 0.995
    """GRPO-CARE: decay of the EMA reference, in [0, 1)"""
    care_ema_every: int = 10
    """GRPO-CARE: update the EMA reference every this many steps (>= 1)"""
    check_logp: bool = False
    """compare generate's own log-probs with the recomputed ones (a debugging check)"""
    cache_dir: str | None = None
    """directory of the tiny random models and other caches; null = ~/.cache/mmgrpo"""

    def check(self) -> None:
        """Ranges, choices and the fields' own cross-checks, each error naming the field, the value and the fix."""
        if not self.model:
            raise UserError("pipeline.kwargs.model is empty; pass a hub id, a local directory or tiny-random-qwen2-vl")
        check_eval_split(self.eval_split)
        at_least(self, "lora_rank", 0, " (0 = full fine-tuning)")
        if not 0 <= self.lora_dropout < 1:
            raise UserError(f"pipeline.kwargs.lora_dropout ({self.lora_dropout}) must be in [0, 1), e.g. 0.05")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise UserError(f"pipeline.kwargs.lora_alpha ({self.lora_alpha}) must be > 0, or null (2 * lora_rank)")
        if self.model_dtype is not None and self.model_dtype not in MODEL_DTYPES:
            raise UserError(
                f"pipeline.kwargs.model_dtype ({self.model_dtype!r}) must be one of {list(MODEL_DTYPES)} or null"
            )
        check_attn_implementation(self.attn_implementation)
        for key in ("min_pixels", "max_pixels"):
            at_least(self, key, 1, " pixels", none_ok=True)
        if None not in (self.min_pixels, self.max_pixels) and self.min_pixels > self.max_pixels:
            raise UserError(
                f"pipeline.kwargs.min_pixels ({self.min_pixels}) must be <= max_pixels "
                f"({self.max_pixels}); raise max_pixels or lower min_pixels"
            )
        self._check_sampling()
        self._check_forward()

    def _check_sampling(self) -> None:
        at_least(self, "max_new_tokens", 1)
        limit = self.max_prompt_length
        if limit is not None and limit < 1:
            raise UserError(
                f"pipeline.kwargs.max_prompt_length ({limit!r}) must be a whole number of tokens >= 1 "
                f"(image tokens included), or null for the model's positions minus max_new_tokens"
            )
        if self.temperature <= 0:
            raise UserError(
                f"pipeline.kwargs.temperature ({self.temperature}) must be > 0: GRPO samples, and the "
                f"log-probs are of softmax(logits / temperature)"
            )
        if not 0 < self.top_p <= 1:
            raise UserError(f"pipeline.kwargs.top_p ({self.top_p}) must be in (0, 1], e.g. pipeline.kwargs.top_p=1")
        at_least(self, "top_k", 0, " (0 = off)")
        for key in ("system_prompt", "instruction"):
            text = getattr(self, key)
            problem = text and text_problem(str(text), what=key)
            if problem:
                raise UserError(f"pipeline.kwargs.{key}: {problem}")

    def _check_forward(self) -> None:
        if self.prefix_sharing not in PREFIX_SHARING:
            raise UserError(f"pipeline.kwargs.prefix_sharing ({self.prefix_sharing!r}) must be auto, on or off")
        if self.prefix_attention not in PREFIX_ATTENTION:
            raise UserError(
                f"pipeline.kwargs.prefix_attention ({self.prefix_attention!r}) must be one of "
                f"{', '.join(PREFIX_ATTENTION)} (auto: grouped attention where the model supports it)"
            )
        check_vision_cache(self.vision_cache, self.vision_cache_items)
        at_least(self, "logp_chunk_tokens", 1)
        if self.reference not in REFERENCES:
            raise UserError(
                f"pipeline.kwargs.reference ({self.reference!r}) must be one of {', '.join(REFERENCES)} "
                f"(auto: LoRA adapter off, full fine-tuning a frozen copy)"
            )
        if not 0 <= self.care_ema_decay < 1:
            raise UserError(f"pipeline.kwargs.care_ema_decay ({self.care_ema_decay}) must be in [0, 1), e.g. 0.995")
        at_least(self, "care_ema_every", 1, " steps")

    def check_algo(self, algo: Any) -> None:
        """reference none leaves nothing for a KL term or a reference-based loss (DPO) to compare with."""
        if self.reference != "none":
            return
        needs = [f"algo.{k} ({getattr(algo, k)})" for k in ("kl_coef", "kl_reward_coef") if getattr(algo, k) > 0]
        if losses.POLICY_LOSSES.meta(algo.loss).get("reference"):
            needs.append(f"algo.loss ({algo.loss!r})")
        if needs:
            raise UserError(
                f"pipeline.kwargs.reference (none) switches the reference policy off, but {needs[0]} "
                f"needs one; set pipeline.kwargs.reference=auto or turn {needs[0].split(' ')[0]} off"
            )


@dataclass
class VLMSettings(ModelSettings):
    """The vlm pipeline's `pipeline.kwargs` (`pipeline.name: vlm`): image-text-to-text GRPO on VQA-style records."""

    data: str = "shapes_vqa"
    """training records: shapes_vqa (ShapesWorld), hf:<dataset>[:<config>] or a JSONL file"""
    train_size: int | None = 256
    """training records to use; null = all (shapes_vqa needs a number)"""
    eval_size: int | None = 64
    """eval records to use; null = all (shapes_vqa needs a number)"""
    resolution: int = 32
    """ShapesWorld image side in pixels"""
    question_types: list[str] | None = None
    """ShapesWorld question types to draw; null = all"""
    skip_bad_images: bool = False
    """skip (and count) records whose image is unreadable or whose prompt is too long, instead of stopping"""
    rollout_backend: str = "hf"
    """rollout engine: hf (transformers generate) or vllm (CUDA, the vllm extra)"""
    rollout_prompts_per_call: int = 0
    """prompts sampled together; 0 = all of a rank's prompts in one batch (lower it to bound the KV cache)"""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm: fraction of the GPU vLLM may take next to training, in (0, 1]"""
    vllm_max_model_len: int | None = None
    """vllm: longest prompt + completion in tokens (> max_new_tokens); null = the model's positions"""
    vllm_enable_sleep_mode: bool = False
    """vllm: free vLLM's memory during the update"""
    vllm_engine_kwargs: dict[str, Any] | None = None
    """vllm: further keyword arguments of vllm.LLM"""

    def check(self) -> None:
        """The model settings' checks, then the records' sizes and the rollout backend's settings."""
        super().check()
        at_least(self, "resolution", 1, " pixels")
        at_least(self, "train_size", 1, " records", none_ok=True)
        at_least(self, "eval_size", 0, " records", none_ok=True)
        self._check_rollout()

    def _check_rollout(self) -> None:
        # lazy: pipelines.vlm.rollout imports transformers; validation stays light
        from pipelines.vlm.rollout import ROLLOUT_BACKENDS

        if self.rollout_backend not in ROLLOUT_BACKENDS:
            raise UserError(
                f"pipeline.kwargs.rollout_backend ({self.rollout_backend!r}) must be one of {list(ROLLOUT_BACKENDS)}"
            )
        if self.rollout_prompts_per_call < 0:
            raise UserError(
                f"pipeline.kwargs.rollout_prompts_per_call ({self.rollout_prompts_per_call!r}) must be an "
                f"integer >= 0: prompts sampled together (0 = all of a rank's prompts in one batch; "
                f"lower it to bound the rollout's KV cache)"
            )
        if self.rollout_backend != "vllm":
            return
        if self.check_logp:
            raise UserError(
                "pipeline.kwargs.check_logp=true compares generate's own log-probs with the recomputed "
                "ones; with rollout_backend=vllm the old log-probs are always recomputed by the training "
                "model, so set check_logp=false (or rollout_backend=hf)"
            )
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise UserError(
                f"pipeline.kwargs.vllm_gpu_memory_utilization ({self.vllm_gpu_memory_utilization}) must "
                f"be in (0, 1]: the fraction of the GPU vLLM may take next to training (0.3 leaves 70% "
                f"for the update)"
            )
        if self.vllm_max_model_len is not None and self.vllm_max_model_len <= self.max_new_tokens:
            raise UserError(
                f"pipeline.kwargs.vllm_max_model_len ({self.vllm_max_model_len}) must exceed "
                f"max_new_tokens ({self.max_new_tokens}): it bounds prompt (image tokens included) + "
                f"completion"
            )
