"""Decode steps over a shared prompt cache: each prompt's K/V is kept once for its G samples, not repeated G times.

The prompt-sharing half of cascade attention (the decode-time twin of Prefix Grouper, arXiv:2506.05433, which
`attention.py` runs for the update). Row n = b G + j of a decode step reads prompt b's cached K/V [Hkv, W, D] (left-
padded to W, padding masked) and its own completion's K/V so far [Hkv, t + 1, D]:

    out_n = softmax([q_n K_b^T, q_n K_n,own^T] * scale + mask) [V_b; V_n,own]

one softmax over the concatenated scores, so the output is that of attention over the prompt repeated G times (the
static cache of `decode.py` before this), while the prompt's keys and values are read once per group instead of G
times and never copied: a rollout of 16 prompts x 8 samples of `assets/shapes-vlm-parts` on one CPU thread is 1.43x
as fast (bench/vlm_decode.py).
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from pipelines.vlm.attention import (
    no_mask,  # the no-op mask function grouped attention registers too
    text_attention,
    text_config,
)

SHARED_DECODE = "mmgrpo_shared_decode"
"""name under which the function is registered in transformers' AttentionInterface (and a no-op mask function)"""


@dataclass
class SharedPromptCache:
    """K/V of B prompts once, each G rows' own completion K/V, and the index `step` the next token is written at."""

    keys: list[Tensor]  # per text layer [B, Hkv, W, D], after RoPE (the prefill cache's own tensors)
    values: list[Tensor]  # per text layer [B, Hkv, W, D]
    pad: Tensor  # [B, 1, 1, 1, W] additive: 0 on prompt tokens, -inf on left padding
    own_keys: list[Tensor]  # per text layer [N, Hkv, T, D], N = B G, T = max new tokens; written step by step
    own_values: list[Tensor]  # per text layer [N, Hkv, T, D]
    step: int = 0

    @classmethod
    def from_prefill(cls, cache, attention_mask: Tensor, group_size: int, max_new_tokens: int) -> "SharedPromptCache":
        """From the prefill's DynamicCache (B prompt rows) and the prompts' left-padded attention mask [B, W]."""
        keys = [layer.keys for layer in cache.layers]  # [B, Hkv, W, D] each
        values = [layer.values for layer in cache.layers]
        b, hkv, _, d = keys[0].shape
        n = b * group_size

        def own() -> list[Tensor]:  # never read before written: empty, not zeros
            return [torch.empty(n, hkv, max_new_tokens, d, dtype=k.dtype, device=k.device) for k in keys]

        pad = torch.zeros(attention_mask.shape, dtype=torch.float32, device=attention_mask.device)  # [B, W]
        pad = pad.masked_fill(attention_mask == 0, float("-inf"))[:, None, None, None, :]  # [B, 1, 1, 1, W]
        return cls(keys, values, pad, own(), own())


def shared_decode_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    shared_decode: SharedPromptCache | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function for one decode step over a `SharedPromptCache` (module docstring).

    Args:
        query: [N, H, 1, D]. key, value: [N, Hkv, 1, D], this step's token (after RoPE), written at `step`.
        attention_mask: ignored (the cache's padding mask and causality define it). shared_decode: the cache,
        passed through the model's kwargs. sliding_window: must be None.
    Returns:
        ([N, 1, H, D] attention output, None) as transformers' sdpa_attention_forward.
    """
    if shared_decode is None:
        raise ValueError(
            f"attention {SHARED_DECODE!r} needs shared_decode= in the model call; run the decode step inside "
            "pipelines.vlm.shared_decode.shared_text with a SharedPromptCache, or use sdpa"
        )
    if sliding_window is not None or query.shape[2] != 1:
        raise ValueError(
            f"shared-prompt decoding takes one new token a row without a sliding window (got {query.shape[2]} "
            f"tokens, sliding_window={sliding_window}); decode.py uses the repeated cache for such models"
        )
    c, i, t = shared_decode, module.layer_idx, shared_decode.step
    c.own_keys[i][:, :, t : t + 1] = key
    c.own_values[i][:, :, t : t + 1] = value
    kp, vp = c.keys[i], c.values[i]  # [B, Hkv, W, D]
    (b, hkv, w, d), (n, h) = kp.shape, query.shape[:2]
    g, rep = n // b, h // hkv
    scale = d**-0.5 if scaling is None else scaling
    q = query.reshape(b, g, hkv, rep, d)  # [B, G, Hkv, rep, D]: query head k rep + r reads key head k (GQA)
    ko = c.own_keys[i][:, :, : t + 1].reshape(b, g, hkv, t + 1, d)  # [B, G, Hkv, t + 1, D]
    vo = c.own_values[i][:, :, : t + 1].reshape(b, g, hkv, t + 1, d)
    acc = torch.promote_types(query.dtype, torch.float32)  # half-precision scores softmax in float32
    s_pre = torch.einsum("bgkrd,bkwd->bgkrw", q, kp).to(acc) * scale + c.pad  # [B, G, Hkv, rep, W]
    s_own = torch.einsum("bgkrd,bgktd->bgkrt", q, ko).to(acc) * scale  # [B, G, Hkv, rep, t + 1]
    p = torch.cat([s_pre, s_own], -1).softmax(-1).to(vp.dtype)  # [B, G, Hkv, rep, W + t + 1]
    out = torch.einsum("bgkrw,bkwd->bgkrd", p[..., :w], vp) + torch.einsum(
        "bgkrt,bgktd->bgkrd", p[..., w:], vo
    )  # [B, G, Hkv, rep, D]
    return out.reshape(n, 1, h, d), None  # [N, 1, H, D]


def register() -> None:
    """Register SHARED_DECODE with transformers (idempotent; adds a name, changes no existing one)."""
    AttentionInterface.register(SHARED_DECODE, shared_decode_attention)
    AttentionMaskInterface.register(SHARED_DECODE, no_mask)  # the cache's padding mask replaces it


def supports_shared_decode(lm: nn.Module) -> bool:
    """Whether every text layer is full attention (a sliding window would need its own mask over the prompt)."""
    return "sliding_attention" not in (getattr(text_config(lm), "layer_types", None) or ())


def shared_text(lm: nn.Module):
    """For a decode step: the text attention runs `shared_decode_attention` (registered once by `register`)."""
    return text_attention(lm, SHARED_DECODE)
