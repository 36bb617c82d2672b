"""The hf backend's own sampling loop for M-RoPE VLMs (Qwen2/2.5/3-VL): each prompt's image and text are prefilled
once, then the B x G rows decode together over that prompt cache, each prompt's K/V kept once for its G rows
(shared_decode.py; a static cache holding it G times where text layers use a sliding window).

transformers' `generate` (num_return_sequences=G) repeats every prompt G times before its prefill, so the language
model encodes each prompt G times (B x G rows); here B rows (the decode steps are the same work). Sampling is
GroupSampler's (the same warpers, softmax and per-prompt seeded multinomial), the stop rule `_StopTracker`'s, and
positions continue after each prompt's last M-RoPE position, as in `generate` and in the prefix-shared update
(pipelines/vlm/prefix.py), so the completions are those of `hf_generate` up to float round-off in the logits
(checked in tests/test_vlm_rollout.py).
"""

import contextlib
import inspect
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache, StaticCache

from pipelines.vlm.generation import GroupSampler, SamplingPolicy, _StopTracker, left_pad_prompts
from pipelines.vlm.prefix import SHARED_MODEL_TYPES, mrope_positions
from pipelines.vlm.shared_decode import SharedPromptCache, register, shared_text, supports_shared_decode
from pipelines.vlm.wrapping import unwrap


def supports_own_loop(policy: SamplingPolicy, encs: list[dict[str, Any]]) -> bool:
    """Whether `prefill_once_generate` applies: an M-RoPE model type whose positions prefix.py computes from the
    processor's mm_token_type_ids (transformers >= 5 processors return them)."""
    kind = getattr(unwrap(policy.module.hf).config, "model_type", None)
    return kind in SHARED_MODEL_TYPES and all("mm_token_type_ids" in e for e in encs)


def prompt_batch(lm: Any, encs: list[dict[str, Any]], pad_id: int) -> tuple[dict[str, Tensor], Tensor]:
    """Model inputs for B prompts, left-padded as `generate` gets them (left_pad_prompts) plus explicit M-RoPE
    positions [3, B, L]; and each prompt's next position [B] (its largest position + 1)."""
    batch = left_pad_prompts(encs, pad_id)
    width, dev = batch["input_ids"].shape[1], batch["input_ids"].device
    pos = torch.ones((3, len(encs), width), dtype=torch.long, device=dev)  # [3, B, L] padding: any position
    nxt = torch.zeros(len(encs), dtype=torch.long, device=dev)  # [B]
    for b, enc in enumerate(encs):
        p = mrope_positions(lm, enc)  # [3, Lp]
        pos[:, b, width - p.shape[1] :] = p
        nxt[b] = int(p.max()) + 1
    return {**batch, "position_ids": pos}, nxt


def cache_key(model: Any) -> str:
    """The forward keyword (and output field) of the KV cache: `cache` from transformers 5.24 (which deprecates
    `past_key_values`, to be removed in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _all_done(done: bool, synced: bool, device: torch.device) -> bool:
    """This rank's done flag, or under synced_gpus whether every rank is done (FSDP ranks forward in lockstep)."""
    if not synced:
        return done
    flag = torch.tensor(0.0 if done else 1.0, device=device)
    torch.distributed.all_reduce(flag)
    return float(flag) == 0.0


class _SharedCache:
    """Decode inputs over a SharedPromptCache: each prompt's K/V once (shared_decode.py), the step's own K/V kept."""

    def __init__(self, cache: SharedPromptCache):
        register()
        self.cache = cache

    def attention(self, lm):
        return shared_text(lm)

    def step_inputs(self, width: int, steps: int) -> dict[str, Any]:
        self.cache.step = steps
        return {"shared_decode": self.cache, "use_cache": False}


class _RepeatedCache:
    """Decode inputs over a static cache holding each prompt's K/V G times: for sliding-window text layers."""

    def __init__(self, base, prefill, attention_mask: Tensor, group_size: int, max_new_tokens: int):
        # preallocated, written in place: growing a cache by concatenation copies every row's prefix at every step
        width = attention_mask.shape[1]
        self.key, self.cache = cache_key(base), StaticCache(config=base.config, max_cache_len=width + max_new_tokens)
        for i, layer in enumerate(prefill.layers):
            self.cache.update(
                layer.keys.repeat_interleave(group_size, dim=0), layer.values.repeat_interleave(group_size, dim=0), i
            )
        rows = attention_mask.shape[0] * group_size
        self.att = torch.zeros((rows, width + max_new_tokens), dtype=torch.long, device=attention_mask.device)
        self.att[:, :width] = attention_mask.repeat_interleave(group_size, dim=0)  # [N, L + max_new]

    def attention(self, lm):
        return contextlib.nullcontext()

    def step_inputs(self, width: int, steps: int) -> dict[str, Any]:
        self.att[:, width + steps] = 1
        return {"attention_mask": self.att, self.key: self.cache, "use_cache": True}


def _decode_cache(base, prefill, attention_mask: Tensor, group_size: int, max_new_tokens: int):
    """The decode steps' cache: shared prompts where every text layer is full attention, else repeated."""
    if supports_shared_decode(base.model):
        return _SharedCache(SharedPromptCache.from_prefill(prefill, attention_mask, group_size, max_new_tokens))
    return _RepeatedCache(base, prefill, attention_mask, group_size, max_new_tokens)


@torch.no_grad()
def prefill_once_generate(policy: SamplingPolicy, encs: list[dict[str, Any]], group_size: int, seeds: list[int]):
    """Completions [N, T] (N = B x G, prompt-major), generation-time raw logits [N, T, V] when policy.check_logp (else
    None), and the _StopTracker that saw them. Forwards go through policy.module (FSDP2 root hooks gather as in
    training); under synced_gpus a finished rank keeps stepping until every rank is done."""

    base, s, pad = unwrap(policy.module.hf), policy.s, policy.tokenizer.pad_token_id
    synced = bool(policy.synced_gpus())
    batch, nxt = prompt_batch(base.model, encs, pad)
    g = group_size
    key = cache_key(base)
    out = policy.module(step={**batch, key: DynamicCache(config=base.config), "use_cache": True, "logits_to_keep": 1})
    width = batch["input_ids"].shape[1]
    kv = _decode_cache(base, getattr(out, key), batch["attention_mask"], g, s.max_new_tokens)
    nxt = nxt.repeat_interleave(g)  # [N]
    logits = out.logits[:, -1].float().repeat_interleave(g, dim=0)  # [N, V]
    sampler = GroupSampler(seeds, g, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, device=policy.device)
    stops = _StopTracker(0, policy.eos_ids, s.stop, policy.tokenizer)
    suppress = policy.module.suppress.to(logits.device)
    n = logits.shape[0]
    tokens = torch.empty((n, 0), dtype=torch.long, device=logits.device)  # [N, t]
    raw, finished = [], torch.zeros(n, dtype=torch.bool, device=logits.device)  # [N]
    done, steps = False, 0
    while True:  # one sampled token (until this rank is done), one collective when synced, one forward per round
        if not done:
            if policy.check_logp:
                raw.append(logits)
            scores = logits.masked_fill(suppress, float("-inf"))  # generate's suppress_tokens
            nxt_tok = torch.where(finished, pad, sampler(tokens, scores).argmax(-1))  # [N] finished rows pad
            tokens = torch.cat([tokens, nxt_tok[:, None]], dim=1)  # [N, t + 1]
            finished = finished | stops(tokens).to(finished.device)
            done = bool(finished.all()) or tokens.shape[1] == s.max_new_tokens
        if _all_done(done, synced, logits.device):
            break
        pos = (nxt + steps).view(1, n, 1).expand(3, n, 1)  # [3, N, 1] text positions continue after the prompt
        if done:  # synced_gpus: this rank only keeps the others' weight gathers company (no cache: it is full)
            policy.module(step={"input_ids": tokens[:, -1:], "position_ids": pos, "use_cache": False})
            continue
        with kv.attention(base.model):
            out = policy.module(
                step={"input_ids": tokens[:, -1:], "position_ids": pos, **kv.step_inputs(width, steps)}
            )
        steps += 1
        logits = out.logits[:, -1].float()  # [N, V]
    return tokens, (torch.stack(raw, dim=1) if raw else None), stops
