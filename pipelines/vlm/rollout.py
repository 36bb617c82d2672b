"""Rollout backends of the VLM policy: the training model itself ("hf", any device, the default) and vLLM ("vllm", CUDA
only, `pip install mmgrpo[vllm]`; see pipelines/vlm/rollout_vllm.py).

"hf" samples all prompts of a rank's batch together (or `prompts_per_call` at a time), each prompt's G rows drawn
from that prompt's own seeded generator (GroupSampler), so any batching or rank count gives the same completions;
Qwen2/2.5/3-VL run pipelines/vlm/decode.py's loop (each prompt encoded once), other models one `generate` call.

A backend only samples token ids. Every backend's completions go through the same stop rule (first EOS, or the token
that completes a stop string, both kept), truncation at max_new_tokens and mask, and the old log-probs are always
recomputed by the training model (VLMPolicy._score), never taken from the sampler.

Group = (completions [G, T] token ids, lengths [G] real tokens >= 1, generation-time log-probs [G, T] or None).
"""

from typing import Any

import torch
from torch import Tensor, nn
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria

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
def sampling_warpers(temperature: float, top_k: int | None, top_p: float) -> list:
    """The logits warpers transformers' `generate(do_sample=True)` applies, in its order (temperature, top-k, top-p)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        out.append(TopKLogitsWarper(top_k=int(top_k), min_tokens_to_keep=1))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=float(top_p), min_tokens_to_keep=1))
    return out


class GroupSampler(LogitsProcessor):
    """Per-prompt seeded sampling inside one `generate` over many prompts: rows [b*G, (b+1)*G) draw their next
    tokens with torch.multinomial from softmax(warped logits), using prompt b's own torch.Generator (seeded by
    seeds[b]); every other token gets -inf, so generate's own selection (argmax, or a multinomial over this one-hot
    row) returns the draw.

    The distribution is the one `generate(do_sample=True)` samples (same warpers, same softmax, same multinomial), and
    prompt b's generator is read by prompt b's rows only, so its completions do not depend on the other prompts in
    the call: one call per rank batch gives the completions one call per prompt gives (up to padding round-off in the
    logits), on any rank count. Alone, a prompt draws the stream the global RNG seeded with its seed would.
    """

    def __init__(self, seeds: list[int], group_size: int, *, temperature: float, top_k: int | None, top_p: float,
                 device: torch.device):
        self.group, self.warpers = group_size, sampling_warpers(temperature, top_k, top_p)
        self.gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if scores.shape[0] != self.group * len(self.gens):
            raise ValueError(f"GroupSampler got {scores.shape[0]} rows for {len(self.gens)} prompts x G={self.group}")
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        probs = scores.float().softmax(-1)  # [N, V]
        picks = torch.cat([torch.multinomial(probs[b * self.group: (b + 1) * self.group], 1, generator=gen)
                           for b, gen in enumerate(self.gens)])  # [N, 1]
        return torch.full_like(scores, float("-inf")).scatter_(1, picks, 0.0)  # [N, V]


def left_pad_prompts(encs: list[dict[str, Any]], pad_id: int) -> dict[str, Tensor]:
    """One generate batch from per-prompt encodings (batch of 1 each): per-token tensors left-padded to the longest
    prompt (input_ids with pad_id, masks with 0), per-image tensors (pixel_values, *_grid_thw...) concatenated."""
    from pipelines.vlm.prefix import TOKEN_KEYS

    keys = [k for k, v in encs[0].items() if isinstance(v, Tensor) and not k.startswith("_")]
    if len(encs) == 1:
        return {k: encs[0][k] for k in keys}
    width = max(e["input_ids"].shape[1] for e in encs)
    out = {}
    for k in keys:
        if k in TOKEN_KEYS:
            fill = pad_id if k == "input_ids" else 0
            out[k] = torch.cat([nn.functional.pad(e[k], (width - e[k].shape[1], 0), value=fill)
                                for e in encs])  # [B, L]
        else:
            out[k] = torch.cat([e[k] for e in encs], dim=0)
    return out


class HFBackend:
    """Sampling with the training model's own weights, one call per `prompts_per_call` prompts (0 = all of the rank's
    prompts), G rows each, seeded per prompt (GroupSampler). prefill_once (None = when supported: Qwen2/2.5/3-VL)
    runs pipelines/vlm/decode.py's loop, whose prefill encodes each prompt once instead of G times; False,
    `generate`."""

    name = "hf"

    def __init__(self, prompts_per_call: int = 0, prefill_once: bool | None = None):
        self.prompts_per_call, self.prefill_once = prompts_per_call, prefill_once

    def generate(self, policy: Any, records: list[dict[str, Any]], encs: list[dict[str, Any]], group_size: int,
                 seeds: list[int]) -> list[Group]:
        step = self.prompts_per_call or max(len(encs), 1)
        return [g for i in range(0, len(encs), step)
                for g in hf_generate(policy, encs[i: i + step], group_size, [int(s) for s in seeds[i: i + step]],
                                     prefill_once=self.prefill_once)]


def hf_generate_group(policy: Any, enc: dict[str, Any], group_size: int, seed: int) -> Group:
    """G completions of one prompt (the video policy samples through this)."""
    once = getattr(policy.backend, "prefill_once", None)
    return hf_generate(policy, [enc], group_size, [seed], prefill_once=once)[0]


def hf_generate(policy: Any, encs: list[dict[str, Any]], group_size: int, seeds: list[int], *,
                prefill_once: bool | None = None) -> list[Group]:
    """G completions of each prompt, sampled together (one `generate` call, or decode.py's loop), with generation-time
    log-probs when policy.check_logp; each group trimmed to its own longest completion."""
    from pipelines.vlm.decode import prefill_once_generate, supports_own_loop

    if prefill_once is None:
        prefill_once = supports_own_loop(policy, encs)
    run = prefill_once_generate if prefill_once else _generate_call
    comp, raw, stops = run(policy, encs, group_size, seeds)  # [N, T], [N, T, V] or None
    n, t = comp.shape
    done = stops.done_at if stops.done_at is not None else torch.full((n,), -1)
    lengths = torch.where(done > 0, done, t).clamp(min=1).to(comp.device)  # [N]
    gen_logp = None
    if raw is not None:
        logits = raw.float() / policy.s.temperature  # [N, T, V] raw, unprocessed
        logits = logits.masked_fill(policy.module.suppress.to(logits.device), float("-inf"))
        gen_logp = logits.log_softmax(-1).gather(-1, comp[..., None]).squeeze(-1)  # [N, T]
    groups = []
    for b in range(len(encs)):
        rows = slice(b * group_size, (b + 1) * group_size)
        k = int(lengths[rows].max())
        groups.append((comp[rows, :k], lengths[rows], None if gen_logp is None else gen_logp[rows, :k]))
    return groups


def _generate_call(policy: Any, encs: list[dict[str, Any]], group_size: int, seeds: list[int]):
    """One transformers `generate` over the left-padded prompts, G return sequences each (synced_gpus under FSDP):
    completions [N, T], raw logits [N, T, V] when policy.check_logp (else None), and the _StopTracker."""
    batch = left_pad_prompts(encs, policy.tokenizer.pad_token_id)
    lp = batch["input_ids"].shape[1]
    stops = _StopTracker(lp, policy.eos_ids, policy.s.stop, policy.tokenizer)
    sampler = GroupSampler(seeds, group_size, temperature=policy.s.temperature, top_k=policy.s.top_k,
                           top_p=policy.s.top_p, device=policy.device)
    # through Task.module's forward, so an FSDP2 root gathers its own weights (embeddings, patch embedding, lm_head)
    # as in training; sharded layers gather in their own hooks, in lockstep thanks to synced_gpus. None rather than
    # False: transformers then applies its own check (DeepSpeed ZeRO-3 shards weights too)
    with torch.random.fork_rng(devices=[policy.device] if policy.device.type == "cuda" else []):
        # generate's multinomial over GroupSampler's one-hot rows is certain but draws from the global RNG
        out = policy.module(generate={**batch, "generation_config": policy._generation_config(group_size),
                                      "logits_processor": LogitsProcessorList([sampler]),
                                      "stopping_criteria": [stops], "synced_gpus": policy.synced_gpus() or None})
    raw = torch.stack(out.logits, dim=1) if policy.check_logp else None  # [N, T, V]
    return out.sequences[:, lp:], raw, stops


def make_backend(name: str, prompts_per_call: int = 0, prefill_once: bool | None = None, **vllm_kwargs: Any):
    """The rollout backend called `name` (see ROLLOUT_BACKENDS); prompts_per_call and prefill_once go to HFBackend,
    vllm_kwargs to VLLMBackend."""
    from mmgrpo.errors import UserError

    if name == "hf":
        return HFBackend(prompts_per_call, prefill_once)
    if name == "vllm":
        from pipelines.vlm.rollout_vllm import VLLMBackend

        return VLLMBackend(**vllm_kwargs)
    raise UserError(f"pipeline.kwargs.rollout_backend ({name!r}) must be one of {list(ROLLOUT_BACKENDS)}")
