"""Rollout backends of the VLM policy: the training model itself ("hf", any device, the default) and vLLM ("vllm", CUDA
only, `pip install mmgrpo[vllm]`; see pipelines/vlm/rollout_vllm.py).

"hf" samples all prompts of a rank's batch together (or `prompts_per_call` at a time), each prompt's G rows drawn
from that prompt's own seeded generator (GroupSampler), so any batching or rank count gives the same completions;
Qwen2/2.5/3-VL run pipelines/vlm/decode.py's loop (each prompt encoded once), other models one `generate` call.

A backend only samples token ids. Every backend's completions go through the same stop rule (first EOS, or the token
that completes a stop string, both kept), truncation at max_new_tokens and mask, and the old log-probs are always
recomputed by the training model (VLMPolicy._score), never taken from the sampler.

Group = (completions [G, T] token ids, lengths [G] real tokens >= 1, generation-time log-probs [G, T] or None); the
shared parts (stop rule, GroupSampler, padding, SamplingPolicy) are in pipelines/vlm/generation.py.
"""

from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList

from mmgrpo.errors import UserError
from pipelines.vlm.decode import prefill_once_generate, supports_own_loop
from pipelines.vlm.generation import (  # noqa: F401  GroupSampler, _StopTracker, stop_lengths: imported from here too
    Group,
    GroupSampler,
    SamplingPolicy,
    _StopTracker,
    left_pad_prompts,
    stop_lengths,
)
from pipelines.vlm.rollout_vllm import VLLMBackend
from pipelines.vlm.wrapping import needs_synced_gpus  # noqa: F401  imported from here by callers and tests

ROLLOUT_BACKENDS = ("hf", "vllm")


# ----- the transformers backend
class HFBackend:
    """Sampling with the training model's own weights, one call per `prompts_per_call` prompts (0 = all of the rank's
    prompts), G rows each, seeded per prompt (GroupSampler). prefill_once (None = when supported: Qwen2/2.5/3-VL)
    runs pipelines/vlm/decode.py's loop, whose prefill encodes each prompt once instead of G times; False,
    `generate`."""

    name = "hf"

    def __init__(self, prompts_per_call: int = 0, prefill_once: bool | None = None):
        self.prompts_per_call, self.prefill_once = prompts_per_call, prefill_once

    def generate(
        self,
        policy: SamplingPolicy,
        records: list[dict[str, Any]],
        encs: list[dict[str, Any]],
        group_size: int,
        seeds: list[int],
    ) -> list[Group]:
        step = self.prompts_per_call or max(len(encs), 1)
        return [
            g
            for i in range(0, len(encs), step)
            for g in hf_generate(
                policy,
                encs[i : i + step],
                group_size,
                [int(s) for s in seeds[i : i + step]],
                prefill_once=self.prefill_once,
            )
        ]


def hf_generate_group(
    policy: SamplingPolicy, enc: dict[str, Any], group_size: int, seed: int, *, prefill_once: bool | None = None
) -> Group:
    """G completions of one prompt (the video policy samples through this)."""
    return hf_generate(policy, [enc], group_size, [seed], prefill_once=prefill_once)[0]


def hf_generate(
    policy: SamplingPolicy,
    encs: list[dict[str, Any]],
    group_size: int,
    seeds: list[int],
    *,
    prefill_once: bool | None = None,
) -> list[Group]:
    """G completions of each prompt, sampled together (one `generate` call, or decode.py's loop), with generation-time
    log-probs when policy.check_logp; each group trimmed to its own longest completion."""
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


def _generate_call(policy: SamplingPolicy, encs: list[dict[str, Any]], group_size: int, seeds: list[int]):
    """One transformers `generate` over the left-padded prompts, G return sequences each (synced_gpus under FSDP):
    completions [N, T], raw logits [N, T, V] when policy.check_logp (else None), and the _StopTracker."""
    batch = left_pad_prompts(encs, policy.tokenizer.pad_token_id)
    lp = batch["input_ids"].shape[1]
    stops = _StopTracker(lp, policy.eos_ids, policy.s.stop, policy.tokenizer)
    sampler = GroupSampler(
        seeds,
        group_size,
        temperature=policy.s.temperature,
        top_k=policy.s.top_k,
        top_p=policy.s.top_p,
        device=policy.device,
    )
    # through Task.module's forward, so an FSDP2 root gathers its own weights (embeddings, patch embedding, lm_head)
    # as in training; sharded layers gather in their own hooks, in lockstep thanks to synced_gpus. None rather than
    # False: transformers then applies its own check (DeepSpeed ZeRO-3 shards weights too)
    with torch.random.fork_rng(devices=[policy.device] if policy.device.type == "cuda" else []):
        # generate's multinomial over GroupSampler's one-hot rows is certain but draws from the global RNG
        out = policy.module(
            generate={
                **batch,
                "generation_config": generation_config(policy, group_size),
                "logits_processor": LogitsProcessorList([sampler]),
                "stopping_criteria": [stops],
                "synced_gpus": policy.synced_gpus() or None,
            }
        )
    raw = torch.stack(out.logits, dim=1) if policy.check_logp else None  # [N, T, V]
    return out.sequences[:, lp:], raw, stops


def generation_config(policy: SamplingPolicy, group_size: int) -> GenerationConfig:
    """`generate`'s settings: the sampling (temperature, top-k, top-p, per-prompt seeds) is GroupSampler's, which
    leaves one finite score per row, so generate's own softmax + multinomial returns that token. Every other knob
    explicit and neutral: a model's own defaults (top_k=50, repetition_penalty=1.05) would change the distribution
    logp() scores."""
    return GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        max_new_tokens=policy.s.max_new_tokens,
        suppress_tokens=policy.module.suppress_ids or None,
        num_return_sequences=group_size,
        pad_token_id=policy.tokenizer.pad_token_id,
        eos_token_id=policy.eos_ids,
        return_dict_in_generate=True,
        output_logits=policy.check_logp,
    )


def make_backend(name: str, prompts_per_call: int = 0, prefill_once: bool | None = None, **vllm_kwargs: Any):
    """The rollout backend called `name` (see ROLLOUT_BACKENDS); prompts_per_call and prefill_once go to HFBackend,
    vllm_kwargs to VLLMBackend."""
    if name == "hf":
        return HFBackend(prompts_per_call, prefill_once)
    if name == "vllm":
        return VLLMBackend(**vllm_kwargs)
    raise UserError(f"pipeline.kwargs.rollout_backend ({name!r}) must be one of {list(ROLLOUT_BACKENDS)}")
