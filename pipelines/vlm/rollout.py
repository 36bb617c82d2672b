"""Rollout backends of the VLM policy: transformers `generate` ("hf", any device, the default) and vLLM ("vllm", CUDA
only, `pip install mmgrpo[vllm]`; see pipelines/vlm/rollout_vllm.py).

A backend only samples token ids. Every backend's completions go through the same stop rule (first EOS, or the token
that completes a stop string, both kept), truncation at max_new_tokens and mask, and the old log-probs are always
recomputed by the training model (VLMPolicy._score), never taken from the sampler.

Group = (completions [G, T] token ids, lengths [G] real tokens >= 1, generation-time log-probs [G, T] or None).
"""

from typing import Any

import torch
from torch import Tensor, nn
from transformers import StoppingCriteria

ROLLOUT_BACKENDS = ("hf", "vllm")
Group = tuple[Tensor, Tensor, Tensor | None]


# ----- the stop rule, shared by every backend
def stop_window(stop: tuple[str, ...]) -> int:
    """Tokens to decode when looking for a stop string that ends at the newest token (each decodes to >= 1 char)."""
    return max((len(s) for s in stop), default=0) + 2


def _stops_here(ids: list[int], eos: set[int], stop: tuple[str, ...], tokenizer, window: int) -> bool:
    """Whether a completion ends at its last token of `ids`: an EOS id, or a stop string inside the decoded tail."""
    if ids[-1] in eos:
        return True
    if not stop:
        return False
    tail = tokenizer.decode(ids[-window:], skip_special_tokens=False)
    return any(s in tail for s in stop)


def stop_lengths(completions: list[list[int]], eos_ids: list[int], stop: tuple[str, ...], tokenizer) -> list[int]:
    """Per completion, the tokens kept: up to and including the first EOS or the token completing a stop string;
    all of them when neither occurs (truncated); at least 1. The same rule _StopTracker applies while `generate` runs."""
    eos, window, out = set(eos_ids), stop_window(stop), []
    for ids in completions:
        end = next((t for t in range(1, len(ids) + 1)
                    if _stops_here(ids[max(t - window, 0):t], eos, stop, tokenizer, window)), len(ids))
        out.append(max(end, 1))
    return out


class _StopTracker(StoppingCriteria):
    """Stopping criterion that records where each row ended: its first EOS token or the end of a stop string."""

    def __init__(self, prompt_len: int, eos_ids: list[int], stop: tuple[str, ...], tokenizer):
        self.prompt_len, self.stop, self.tokenizer = prompt_len, stop, tokenizer
        self.eos = {int(e) for e in eos_ids}
        self.window = stop_window(stop)
        self.done_at: Tensor | None = None

    def __call__(self, input_ids: Tensor, scores: Any = None, **kwargs: Any) -> Tensor:
        gen = input_ids[:, self.prompt_len:].cpu()  # [G, t]
        if self.done_at is None:
            self.done_at = torch.full((gen.shape[0],), -1, dtype=torch.long)
        for r in range(gen.shape[0]):
            tail = gen[r, -self.window:].tolist()
            if self.done_at[r] < 0 and _stops_here(tail, self.eos, self.stop, self.tokenizer, self.window):
                self.done_at[r] = gen.shape[1]
        return (self.done_at >= 0).to(input_ids.device)


def pad_group(ids: list[list[int]], pad_id: int, device: torch.device) -> Tensor:
    """Token-id lists of one group as [G, T] (T = the longest, at least 1), right-padded with pad_id."""
    t = max(max((len(x) for x in ids), default=0), 1)
    return torch.tensor([x + [pad_id] * (t - len(x)) for x in ids], dtype=torch.long, device=device)  # [G, T]


# ----- FSDP: generate in lockstep
def needs_synced_gpus(model: nn.Module, *, world_size: int | None = None, distributed_type: str | None = None) -> bool:
    """Whether `generate` must run with synced_gpus=True: the weights are FSDP-sharded over more than one rank.

    Under FSDP every forward all-gathers the sharded weights, so a rank whose samples all stopped must keep running
    (dummy) forwards until every rank is done, or the others hang in the all-gather. Sharded = a module of `model`
    is an FSDP2 `FSDPModule` or an FSDP1 `FullyShardedDataParallel` unit, or accelerate's state says FSDP.
    world_size / distributed_type default to torch.distributed's and accelerate's (tests pass them).
    """
    if world_size is None:
        dist = torch.distributed
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size <= 1:
        return False
    if distributed_type is None:
        distributed_type = _accelerate_distributed_type()
    return str(distributed_type).rsplit(".", 1)[-1].upper() == "FSDP" or fsdp_managed(model)


def fsdp_managed(model: nn.Module) -> bool:
    """Whether any module of `model` is FSDP-wrapped (FSDP2 fully_shard swaps in FSDPModule subclasses in place)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def _accelerate_distributed_type() -> str | None:
    """accelerate's distributed type when an Accelerator exists, else None (never creates accelerate state)."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return None
    return getattr(AcceleratorState, "_shared_state", {}).get("distributed_type")


# ----- the transformers backend
class HFBackend:
    """Sampling with the training model's own `generate`, one call per prompt (G return sequences), seeded per prompt."""

    name = "hf"

    def generate(self, policy: Any, records: list[dict[str, Any]], encs: list[dict[str, Any]], group_size: int,
                 seeds: list[int]) -> list[Group]:
        return [hf_generate_group(policy, enc, group_size, int(seed)) for enc, seed in zip(encs, seeds)]


def hf_generate_group(policy: Any, enc: dict[str, Any], group_size: int, seed: int) -> Group:
    """G completions of one prompt through `generate` (synced_gpus under FSDP), with generation-time log-probs when
    policy.check_logp."""
    lp = enc["input_ids"].shape[1]
    stops = _StopTracker(lp, policy.eos_ids, policy.s.stop, policy.tokenizer)
    gen_in = {k: v for k, v in enc.items() if not k.startswith("_")}
    devices = [policy.device] if policy.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # HF sampling draws from the global RNG: seed it per prompt
        torch.manual_seed(seed)
        # through Task.module's forward, so an FSDP2 root gathers its own weights (embeddings, patch embedding,
        # lm_head) as in training; sharded layers gather in their own hooks, in lockstep thanks to synced_gpus.
        # None rather than False: transformers then applies its own check (DeepSpeed ZeRO-3 shards weights too)
        out = policy.module(generate={**gen_in, "generation_config": policy._generation_config(group_size),
                                      "stopping_criteria": [stops], "synced_gpus": policy.synced_gpus() or None})
    comp = out.sequences[:, lp:]  # [G, T]
    t = comp.shape[1]
    done = stops.done_at if stops.done_at is not None else torch.full((group_size,), -1)
    lengths = torch.where(done > 0, done, t).clamp(min=1).to(comp.device)  # [G]
    gen_logp = None
    if policy.check_logp:
        logits = torch.stack(out.logits, dim=1).float() / policy.s.temperature  # [G, T, V] raw, unprocessed
        logits = logits.masked_fill(policy.module.suppress.to(logits.device), float("-inf"))
        gen_logp = logits.log_softmax(-1).gather(-1, comp[..., None]).squeeze(-1)  # [G, T]
    return comp, lengths, gen_logp


def make_backend(name: str, **vllm_kwargs: Any):
    """The rollout backend called `name` (see ROLLOUT_BACKENDS); vllm_kwargs go to VLLMBackend."""
    from mmgrpo.errors import UserError

    if name == "hf":
        return HFBackend()
    if name == "vllm":
        from pipelines.vlm.rollout_vllm import VLLMBackend

        return VLLMBackend(**vllm_kwargs)
    raise UserError(f"pipeline.kwargs.rollout_backend ({name!r}) must be one of {list(ROLLOUT_BACKENDS)}")
