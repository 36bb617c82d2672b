"""Grouped attention for prefix-shared rows (Prefix Grouper, arXiv:2506.05433), as a transformers attention function.

A shared row is [prefix (P) | c_1 (m_1) | ... | c_G (m_G) | padding]. Instead of one SDPA over the whole (P + sum m)^2
block mask, each layer runs: prefix queries over prefix keys, causally (one call on [1, H, P, D]); completion queries
[G, H, C, D] over cat(prefix K/V expanded to G, own K/V) [G, H, P + C, D] (prefix all visible, own part causal). The
expand's backward sums the prefix K/V gradient over the group, so outputs and gradients equal the block-masked row's.
Score pairs: P^2 + G C (P + C) instead of (P + G C)^2. On CPU the completion call is split instead (no expanded copy):
all G C queries over the prefix keys in one flash call, each completion causally over itself in another, the two
merged by their log-sum-exp (the split-KV identity of FlashAttention's online softmax); see `_SplitKV`.

The layout reaches the function through the model's **kwargs (`prefix_layout=`), which Qwen2/2.5/3-VL forward from
the top-level call down to every text attention; the text config names this function only inside `grouped_text`.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUPED = "mmgrpo_prefix_grouped"
"""name under which the function is registered in transformers' AttentionInterface (and a no-op mask function)"""


@dataclass(frozen=True)
class RowLayout:
    """One shared row: P prefix tokens, then G non-empty completions padded to width C in the grouped tensors."""

    prefix: int
    groups: int
    width: int
    index: Tensor  # [G * C] row position of each (completion, slot); padded slots repeat the completion's last token
    mask: Tensor  # [G, 1, C, P + C] bool, True = attend: the whole prefix, own slots causally and below its length
    ragged: bool  # completions of unequal lengths (the own part needs the mask, not just causality)
    source: Tensor  # [L] per row position, index into cat(prefix out [P], completion out [G * C], zero row [1])


@dataclass(frozen=True)
class PrefixLayout:
    """Every row of a batch of shared rows (the model's input is [R, L])."""

    rows: tuple[RowLayout, ...]
    length: int


def _row_layout(seg: list[int], device: torch.device) -> RowLayout:
    """Layout of one row from its segment ids (0 prefix, j >= 1 completion j in increasing order, -1 padding)."""
    length = len(seg)
    prefix = next((i for i, s in enumerate(seg) if s != 0), length)
    spans: list[tuple[int, int]] = []  # (start, tokens) per completion, in row order
    i = prefix
    while i < length and seg[i] > 0:
        j = i
        while j < length and seg[j] == seg[i]:
            j += 1
        if spans and seg[i] <= seg[spans[-1][0]]:
            raise ValueError(f"segment ids must increase along the row, got {seg[spans[-1][0]]} then {seg[i]} at {i}")
        spans.append((i, j - i))
        i = j
    if prefix == 0 or any(s != -1 for s in seg[i:]):
        raise ValueError(
            "a shared row must be [prefix (id 0, >= 1 token) | completions (ids 1, 2, ...) | padding (-1)]"
            f"; got ids {sorted(set(seg))} with the first non-prefix block ending at {i} of {length}"
        )
    width = max((m for _, m in spans), default=0)
    slot = torch.arange(width, device=device)  # [C]
    starts = torch.tensor([s for s, _ in spans], dtype=torch.long, device=device)  # [G]
    counts = torch.tensor([m for _, m in spans], dtype=torch.long, device=device)  # [G]
    index = (starts[:, None] + torch.minimum(slot[None], counts[:, None] - 1)).reshape(-1)  # [G * C]
    own = (slot[None, :, None] >= slot[None, None, :]) & (slot[None, None, :] < counts[:, None, None])  # [G, C, C]
    seen = torch.ones(len(spans), width, prefix, dtype=torch.bool, device=device)  # [G, C, P]
    source = torch.full((length,), prefix + len(spans) * width, dtype=torch.long, device=device)  # [L] -> zero row
    source[:prefix] = torch.arange(prefix, device=device)
    for g, (s, m) in enumerate(spans):
        source[s : s + m] = prefix + g * width + torch.arange(m, device=device)
    ragged = len({m for _, m in spans}) > 1
    return RowLayout(prefix, len(spans), width, index, torch.cat([seen, own], -1)[:, None], ragged, source)


def prefix_layout(seg: Tensor) -> PrefixLayout:
    """The grouped-attention layout of shared rows from their segment ids [R, L] (as `prefix.shared_inputs` builds)."""
    return PrefixLayout(tuple(_row_layout(row, seg.device) for row in seg.tolist()), seg.shape[1])


def _sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None, dropout: float
) -> Tensor:
    """SDPA with key/value heads shared by groups of query heads (GQA) broadcast without copying when possible."""
    rep = q.shape[-3] // k.shape[-3]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale, enable_gqa=rep > 1
    )


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def split_kv_enabled(q: Tensor, dropout: float) -> bool:
    """Whether the completion call runs as `_SplitKV`: CPU tensors, no dropout, torch's CPU flash kernel present and
    SDPA's flash backend enabled (so `sdpa_kernel(SDPBackend.MATH)`, as FLOP counting uses, selects the plain call)."""
    return (
        q.device.type == "cpu"
        and dropout == 0.0
        and _FLASH_CPU is not None
        and _FLASH_CPU_BACKWARD is not None
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16)
        and torch.backends.cuda.flash_sdp_enabled()
    )


def _flat(x: Tensor) -> Tensor:
    """[G, H, C, ...] -> [1, H, G * C, ...]: every completion's queries in one sequence."""
    return x.transpose(0, 1).reshape(1, x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


class _SplitKV(torch.autograd.Function):
    """softmax over [prefix keys | own keys] from two flash calls: out = sum_i exp(lse_i - lse) out_i with
    lse = logaddexp(lse_1, lse_2). Backward: each part's flash backward, given the merged out and lse, yields exactly
    that part's share of the gradient (its probabilities exp(s - lse) and rowsum(dout * out) are the merged ones), so
    dq is the sum of the two and the prefix K/V gradient is already summed over the group.
    """

    @staticmethod
    def forward(
        ctx, q: Tensor, kp: Tensor, vp: Tensor, ko: Tensor, vo: Tensor, own_mask: Tensor | None, scale: float | None
    ) -> Tensor:
        g, h, c, d = q.shape  # q [G, H, C, D]; kp, vp [1, Hkv, P, D]; ko, vo [G, Hkv, C, D]
        o1, l1 = _FLASH_CPU(_flat(q), kp, vp, 0.0, False, scale=scale)  # [1, H, G C, D], [1, H, G C]
        o2, l2 = _FLASH_CPU(
            q, ko, vo, 0.0, own_mask is None, attn_mask=own_mask, scale=scale
        )  # [G, H, C, D], [G, H, C]
        o1, l1 = o1.reshape(h, g, c, d).transpose(0, 1), l1.reshape(h, g, c).transpose(0, 1)  # [G, H, C, D], [G, H, C]
        lse = torch.logaddexp(l1, l2)  # [G, H, C]
        out = (l1 - lse).exp()[..., None].to(q.dtype) * o1 + (l2 - lse).exp()[..., None].to(q.dtype) * o2
        ctx.save_for_backward(q, kp, vp, ko, vo, out, lse, own_mask)
        ctx.scale = scale
        return out  # [G, H, C, D]

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, kp, vp, ko, vo, out, lse, own_mask = ctx.saved_tensors
        g, h, c, d = q.shape
        dq1, dkp, dvp = _FLASH_CPU_BACKWARD(
            _flat(dout.contiguous()), _flat(q), kp, vp, _flat(out), _flat(lse), 0.0, False, scale=ctx.scale
        )
        dq2, dko, dvo = _FLASH_CPU_BACKWARD(
            dout.contiguous(), q, ko, vo, out, lse, 0.0, own_mask is None, attn_mask=own_mask, scale=ctx.scale
        )
        return dq1.reshape(h, g, c, d).transpose(0, 1) + dq2, dkp, dvp, dko, dvo, None, None


def _completions(
    q: Tensor, kp: Tensor, vp: Tensor, ko: Tensor, vo: Tensor, lay: RowLayout, scale: float | None, dropout: float
) -> Tensor:
    """Completion queries [G, H, C, D] over cat(prefix K/V [1, Hkv, P, D] for each, own K/V [G, Hkv, C, D])."""
    if split_kv_enabled(q, dropout):
        own = lay.mask[..., lay.prefix :] if lay.ragged else None  # [G, 1, C, C]: the kernel takes an additive mask
        own = (
            None
            if own is None
            else torch.zeros(own.shape, dtype=q.dtype, device=q.device).masked_fill(~own, float("-inf"))
        )
        return _SplitKV.apply(q, kp, vp, ko, vo, own, scale)
    g = lay.groups
    kk = torch.cat([kp.expand(g, -1, -1, -1), ko], 2)  # [G, Hkv, P + C, D]
    vv = torch.cat([vp.expand(g, -1, -1, -1), vo], 2)  # [G, Hkv, P + C, D]
    return _sdpa(q, kk, vv, lay.mask, False, scale, dropout)  # [G, H, C, D]


def _own(x: Tensor, lay: RowLayout) -> Tensor:
    """[h, L, D] -> [G, h, C, D]: each completion's (padded) slots of one row."""
    return x.index_select(1, lay.index).unflatten(1, (lay.groups, lay.width)).transpose(0, 1)


def grouped_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    prefix_layout: PrefixLayout | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function: softmax(q k^T * scaling + mask) v per row, grouped as Prefix Grouper
    (arXiv:2506.05433) does it.

    Args:
        query: [R, H, L, D].  key, value: [R, Hkv, L, D] (H a multiple of Hkv).  attention_mask: ignored (the
        layout defines it).  prefix_layout: from `prefix_layout(seg)`, passed through the model's kwargs.
        sliding_window: must be None (no sliding-window layers; `prefix.supports_shared` rules them out).
    Returns:
        ([R, L, H, D] attention output, None) as transformers' sdpa_attention_forward.
    """
    if prefix_layout is None:
        raise ValueError(
            f"attention {GROUPED!r} needs prefix_layout= in the model call; run the model inside "
            "pipelines.vlm.attention.grouped_text with the layout, or use sdpa"
        )
    if sliding_window is not None:
        raise ValueError(f"grouped attention has no sliding window (got sliding_window={sliding_window}); use sdpa")
    rows, heads, length, dim = query.shape
    if rows != len(prefix_layout.rows) or length != prefix_layout.length:
        raise ValueError(
            f"prefix_layout is for {len(prefix_layout.rows)} rows of {prefix_layout.length} tokens, "
            f"the attention got {rows} of {length}"
        )
    outs = []
    for r, lay in enumerate(prefix_layout.rows):
        q, k, v, p = query[r], key[r], value[r], lay.prefix  # [H, L, D], [Hkv, L, D], [Hkv, L, D]
        pre = _sdpa(q[None, :, :p], k[None, :, :p], v[None, :, :p], None, True, scaling, dropout)  # [1, H, P, D]
        pieces = [pre[0].transpose(0, 1)]  # [P, H, D]
        if lay.groups:
            out = _completions(
                _own(q, lay), k[None, :, :p], v[None, :, :p], _own(k, lay), _own(v, lay), lay, scaling, dropout
            )  # [G, H, C, D]
            pieces.append(out.permute(0, 2, 1, 3).reshape(lay.groups * lay.width, heads, dim))  # [G * C, H, D]
        pieces.append(query.new_zeros(1, heads, dim))  # what padding positions read
        outs.append(torch.cat(pieces).index_select(0, lay.source))  # [L, H, D]
    return torch.stack(outs), None  # [R, L, H, D]


def no_mask(*args, **kwargs) -> None:
    """Mask function for GROUPED (returns None): the layout replaces the [L, L] mask, so none is built."""


def register() -> None:
    """Register GROUPED with transformers (idempotent; adds a name, changes no existing one)."""
    # lazy: transformers is heavy to import (~1 s); only registering the kernels needs it
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(GROUPED, grouped_attention)
    AttentionMaskInterface.register(GROUPED, no_mask)


def text_config(lm: nn.Module):
    """The config the text decoder's attention layers read (`language_model.config`; the vision tower has its own)."""
    inner = getattr(lm, "language_model", None)
    if inner is None:
        raise ValueError(f"{type(lm).__name__} has no language_model: grouped attention needs a Qwen-VL base model")
    return inner.config


@contextmanager
def grouped_text(lm: nn.Module) -> Iterator[None]:
    """For one forward: the text attention runs `grouped_attention` (the vision tower keeps its own); restored after.

    The layout itself travels in the call's kwargs, so nothing but the implementation name is switched, and only for
    the duration of the block (a backward that recomputes layers later, i.e. gradient checkpointing, would not see the
    switch: `prefix.supports_grouped` rules that out).
    """
    register()
    with text_attention(lm, GROUPED):
        yield


@contextmanager
def text_attention(lm: nn.Module, name: str) -> Iterator[None]:
    """For the block: the text decoder's attention layers run the registered implementation `name`; restored after."""
    cfg = text_config(lm)
    old = cfg._attn_implementation
    cfg._attn_implementation = name
    try:
        yield
    finally:
        cfg._attn_implementation = old
