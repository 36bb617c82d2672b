"""The vLLM rollout backend (CUDA only, `pip install mmgrpo[vllm]`), colocated with training the way TRL's GRPOTrainer
runs vllm_mode="colocate": one in-process engine per rank on that rank's GPU (external launcher, tensor parallel 1),
sampling that rank's own prompts.

Before every rollout the current policy weights are loaded into the engine (LoRA merged as W + (alpha / r) B A,
Hu et al. 2021, without touching the training model) and vLLM's prefix cache is dropped, so sampling is on-policy.
Only token ids are taken from vLLM: the stop rule, truncation and mask are the HF path's (rollout.stop_lengths), and
the old log-probs are always recomputed by the training model (VLMPolicy._score), as TRL does, because vLLM's own
log-probs differ numerically (other kernels and precision) and would move the first importance ratio away from 1.
"""

import os
import socket
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from mmgrpo.errors import UserError
from pipelines.vlm.generation import Group, SamplingPolicy, chat_prompt, pad_group, stop_lengths

INSTALL = "pip install mmgrpo[vllm]"
SUPPRESS_BIAS = -100.0
"""logit bias of the vision placeholder ids (as verl does): vLLM then samples them with probability < e^-100"""


def import_vllm():
    """The vllm module, or a one-line UserError saying how to install it."""
    try:
        # lazy: optional extra [vllm] (CUDA only)
        import vllm
    except ImportError as err:
        raise UserError(
            f"pipeline.kwargs.rollout_backend=vllm needs the vllm package ({err}); install it with "
            f"`{INSTALL}` (CUDA only) or set pipeline.kwargs.rollout_backend=hf"
        ) from None
    return vllm


def check_cuda(device: torch.device) -> None:
    """vLLM samples on NVIDIA GPUs only: refuse any other device in one line."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UserError(
            f"pipeline.kwargs.rollout_backend=vllm needs a CUDA device, but the policy runs on "
            f"{device.type} (CUDA available: {torch.cuda.is_available()}); set "
            f"pipeline.kwargs.rollout_backend=hf, which samples with transformers' generate on any device"
        )


# ----- weights
def _full(t: Tensor) -> Tensor:
    """A plain tensor from a possibly FSDP2-sharded one (a collective: every rank iterates the weights in order)."""
    # lazy: torch.distributed.tensor takes ~1 s to import; only FSDP runs need it
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _merged_lora(name: str, layer: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """weight (and bias) of one peft LoRA linear with its active adapters merged: W + scaling_a * B_a @ A_a."""
    base = layer.get_base_layer()
    if not isinstance(base, nn.Linear):
        raise UserError(
            f"rollout_backend=vllm merges LoRA into linear layers only, but {name!r} is a "
            f"{type(base).__name__}; restrict pipeline.kwargs.lora_targets to linear projections"
        )
    weight = _full(base.weight.detach())  # [out, in]
    if not layer.merged and not layer.disable_adapters:
        merged = weight.float()
        for a in layer.active_adapters:
            if a not in layer.lora_A:
                continue
            if layer.use_dora.get(a, False):
                raise UserError(f"rollout_backend=vllm cannot merge the DoRA adapter of {name!r}; use plain LoRA")
            lora_a = _full(layer.lora_A[a].weight.detach()).float()  # [r, in]
            lora_b = _full(layer.lora_B[a].weight.detach()).float()  # [out, r]
            delta = (lora_b @ lora_a) * layer.scaling[a]  # [out, in]
            merged = merged + (delta.T if getattr(layer, "fan_in_fan_out", False) else delta)
        weight = merged.to(weight.dtype)
    yield f"{name}.weight", weight
    if base.bias is not None:
        yield f"{name}.bias", _full(base.bias.detach())


def merged_weights(hf: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of every parameter of the transformers model under `hf`, named as that model's own
    state_dict (no peft prefixes, which is what vLLM's load_weights maps from), LoRA adapters merged in, one at a time
    so a 7B model is never copied whole."""
    # lazy: peft is heavy to import (seconds); only LoRA runs need it
    from peft.tuners.lora import LoraLayer

    base = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    inside: str | None = None  # the LoRA layer whose submodules (base_layer, lora_A, ...) it already yielded
    for mod_name, module in base.named_modules():
        if inside is not None and mod_name.startswith(inside + "."):
            continue
        inside = None
        if isinstance(module, LoraLayer):
            inside = mod_name
            yield from _merged_lora(mod_name, module)
            continue
        for p_name, p in module.named_parameters(recurse=False):
            yield (f"{mod_name}.{p_name}" if mod_name else p_name), _full(p.detach())


def _load_into(model: nn.Module, weights: list[tuple[str, Tensor]]) -> None:
    model.load_weights(weights)


def _inprocess_model(llm: Any) -> nn.Module | None:
    """The engine's model when the worker lives in this process (external launcher), else None."""
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    runner = getattr(getattr(executor, "driver_worker", None), "model_runner", None)
    return getattr(runner, "model", None)


def _launcher_env(device: torch.device) -> None:
    """The torch.distributed variables vLLM's external launcher reads; a launcher (accelerate, torchrun) sets them."""
    dist = torch.distributed
    up = dist.is_available() and dist.is_initialized()
    os.environ.setdefault("RANK", str(dist.get_rank() if up else 0))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size() if up else 1))
    os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
    os.environ.setdefault("MASTER_ADDR", "localhost")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("localhost", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


class VLLMBackend:
    """Sampling with a colocated vLLM engine; see the module docstring. The engine starts at the first rollout
    (after accelerate has set up the ranks)."""

    name = "vllm"

    def __init__(
        self,
        *,
        model_path: str,
        device: torch.device,
        dtype: str | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
        max_images: int = 1,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        check_cuda(device)
        self.vllm = import_vllm()
        self.device, self.sleep = device, enable_sleep_mode
        pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        # the engine must see the same model, resolution and image count as the processor that scores the samples
        self.engine_args: dict[str, Any] = {
            "model": model_path,
            "dtype": dtype or "auto",
            "seed": seed,
            "tensor_parallel_size": 1,
            "distributed_executor_backend": "external_launcher",
            "gpu_memory_utilization": gpu_memory_utilization,
            "enable_sleep_mode": enable_sleep_mode,
            "limit_mm_per_prompt": {"image": max(max_images, 1)},
        }
        if max_model_len is not None:
            self.engine_args["max_model_len"] = max_model_len
        if pixels:
            self.engine_args["mm_processor_kwargs"] = pixels
        self.engine_args.update(engine_kwargs or {})
        self.llm = None

    def engine(self) -> Any:
        if self.llm is None:
            _launcher_env(self.device)
            self.llm = self.vllm.LLM(**self.engine_args)
        return self.llm

    def push_weights(self, hf: nn.Module) -> None:
        """Load the policy's current (merged) weights into the engine and drop the KV prefix cache built with the
        previous ones."""
        llm = self.engine()
        model = _inprocess_model(llm)
        if model is not None:  # TRL's colocate path: streamed, one merged tensor at a time
            model.load_weights(merged_weights(hf))
        else:  # a worker in another process: the weights travel as one list
            llm.apply_model(partial(_load_into, weights=list(merged_weights(hf))))
        if hasattr(llm, "reset_prefix_cache"):
            llm.reset_prefix_cache()

    def sampling_params(self, policy: SamplingPolicy, group_size: int, seed: int) -> Any:
        """The HF path's sampling settings in vLLM's terms; seeded per prompt like the HF path."""
        s = policy.s
        bias = {int(i): SUPPRESS_BIAS for i in policy.module.suppress_ids}
        return self.vllm.SamplingParams(
            n=group_size,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=s.max_new_tokens,
            repetition_penalty=1.0,
            stop=list(s.stop) or None,
            include_stop_str_in_output=True,
            stop_token_ids=list(policy.eos_ids),
            seed=seed,
            logit_bias=bias or None,
        )

    def generate(
        self,
        policy: SamplingPolicy,
        records: list[dict[str, Any]],
        encs: list[dict[str, Any]],
        group_size: int,
        seeds: list[int],
    ) -> list[Group]:
        llm = self.engine()
        if self.sleep:
            llm.wake_up()
        self.push_weights(policy.module.hf)
        inputs = []
        for record in records:
            chat, images = chat_prompt(policy.processor, policy.s, record)
            inputs.append({"prompt": chat, "multi_modal_data": {"image": images}} if images else {"prompt": chat})
        params = [self.sampling_params(policy, group_size, int(seed)) for seed in seeds]
        outputs = llm.generate(inputs, sampling_params=params, use_tqdm=False)
        if self.sleep:  # frees the KV cache and the weights for the update
            llm.sleep(level=1)
        groups = []
        for record, out in zip(records, outputs):
            ids = [list(c.token_ids)[: policy.s.max_new_tokens] for c in sorted(out.outputs, key=lambda c: c.index)]
            if len(ids) != group_size:
                raise RuntimeError(
                    f"vLLM returned {len(ids)} completions for {record.get('id')!r}, asked {group_size}"
                )
            lengths = stop_lengths(ids, policy.eos_ids, policy.s.stop, policy.tokenizer)
            comp = pad_group(
                [x[:n] for x, n in zip(ids, lengths)], policy.tokenizer.pad_token_id, policy.device
            )  # [G, T]
            groups.append((comp, torch.tensor(lengths, device=policy.device), None))
        return groups
