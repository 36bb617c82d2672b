"""Completion log-probs of a VLM: the prefix-shared forward (Prefix Grouper, arXiv:2506.05433), the plain batch, and a
memory-bounded log-softmax gather. Pure tensor plumbing around a transformers model; no sampling, no optimiser.

Shared layout, one row per prompt group: [prefix | c_1 | c_2 | ... | c_G] with a block mask, so the image and prompt
are encoded once (vision tower included) and completion i attends to the prefix and causally to itself only.
Position ids of every completion continue right after the prefix (M-RoPE text positions of Qwen2/2.5/3-VL).
Attention over the row (`prefix_attention`): "grouped" (pipelines.vlm.attention: prefix once, each completion over the
prefix and itself, P^2 + G C (P + C) score pairs) or "mask" (one SDPA/eager call over the dense (P + G C)^2 block
mask: the fallback for eager attention and gradient checkpointing); "auto" picks grouped where supported.
"""

import contextlib
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mmgrpo.errors import UserError
from pipelines.vlm.attention import grouped_text, prefix_layout, text_config

TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")
"""processor outputs with one entry per prompt token; every other tensor (pixel_values, image_grid_thw...) is per image"""
SHARED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""model types whose forward takes a custom 4D mask and explicit M-RoPE positions (checked equal to the plain batch)"""
PREFIX_ATTENTION = ("auto", "grouped", "mask")
"""how a shared row's attention runs: grouped where supported (auto), grouped or refuse, dense block mask"""


def supports_shared(model: nn.Module) -> tuple[bool, str]:
    """Whether the prefix-shared forward is exact for this model, and why not when it is not."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in SHARED_MODEL_TYPES:
        return False, f"model type {kind!r} is not one of {SHARED_MODEL_TYPES} (checked for the block mask)"
    attn = getattr(cfg, "_attn_implementation", None) or "eager"
    if attn not in ("sdpa", "eager"):
        return False, f"attention {attn!r} takes no custom 4D mask (use sdpa or eager)"
    if "sliding_attention" in (getattr(getattr(cfg, "text_config", cfg), "layer_types", None) or ()):
        return False, "sliding-window attention layers (use_sliding_window) are not in the shared row's mask"
    return True, ""


def supports_grouped(lm: nn.Module) -> tuple[bool, str]:
    """Whether grouped attention can run this base model's text attention, and why not when it cannot."""
    ok, why = supports_shared(lm)
    if not ok:
        return False, why
    attn = getattr(text_config(lm), "_attn_implementation", None)
    if attn != "sdpa":
        return (
            False,
            f"text attention {attn!r} is not sdpa (grouped attention runs SDPA kernels; eager keeps the mask)",
        )
    if any(getattr(m, "gradient_checkpointing", False) for m in lm.modules()):
        return False, "gradient checkpointing recomputes layers in backward, outside the grouped-attention switch"
    return True, ""


def check_prefix_attention(requested: str) -> None:
    """One-line error for a prefix_attention value that is not one of PREFIX_ATTENTION."""
    if requested not in PREFIX_ATTENTION:
        raise UserError(f"prefix_attention ({requested!r}) must be one of {', '.join(PREFIX_ATTENTION)}")


def attention_mode(lm: nn.Module, requested: str) -> str:
    """ "grouped" or "mask" for `prefix_attention=requested` on this model (auto: grouped where supported)."""
    check_prefix_attention(requested)
    if requested == "mask":
        return "mask"
    ok, why = supports_grouped(lm)
    if requested == "grouped" and not ok:
        raise UserError(f"prefix_attention=grouped but {why}; set prefix_attention=auto or mask")
    return "grouped" if ok else "mask"


def group_indices(prompts: list[dict[str, Any]]) -> list[list[int]]:
    """Sample positions grouped by their prompt encoding (the same dict object), in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(id(p), []).append(i)
    return list(groups.values())


def _per_image(encs: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Concatenate the per-image tensors (pixel_values, image_grid_thw, ...) of `encs`, in order."""
    keys = [k for k, v in encs[0].items() if isinstance(v, Tensor) and k not in TOKEN_KEYS and not k.startswith("_")]
    return {k: torch.cat([e[k] for e in encs], dim=0) for k in keys}


def mrope_positions(lm: nn.Module, enc: dict[str, Any]) -> Tensor:
    """M-RoPE positions [3, Lp] of one prompt (memoised in the encoding under "_positions")."""
    if "_positions" not in enc:
        extra = {k: enc[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in enc}
        pos, _ = lm.get_rope_index(enc["input_ids"], mm_token_type_ids=enc["mm_token_type_ids"], **extra)
        enc["_positions"] = pos[:, 0]  # [3, Lp]
    return enc["_positions"]


def _block_mask(seg: Tensor, dtype: torch.dtype) -> Tensor:
    """Mask [R, 1, L, L] from segment ids [R, L] (0 prefix, i > 0 completion i, -1 padding): bool (True = attend)
    when dtype is torch.bool (SDPA, safe under autocast), else additive (0 or the dtype's min, for eager attention).

    allowed(q, k) = k <= q and (seg_k == 0 or seg_k == seg_q), both real; padding attends to itself only (no NaN rows).
    """
    length = seg.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=seg.device).tril()  # [L, L]
    sq, sk = seg[:, :, None], seg[:, None, :]  # [R, L, 1], [R, 1, L]
    allowed = causal & (sq >= 0) & ((sk == 0) | (sk == sq))  # [R, L, L]
    allowed = allowed | torch.eye(length, dtype=torch.bool, device=seg.device)
    if dtype == torch.bool:
        return allowed[:, None]
    zero = torch.zeros((), dtype=dtype, device=seg.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]  # [R, 1, L, L]


def shared_inputs(
    lm: nn.Module,
    prompts: list[dict[str, Any]],
    completions: Tensor,
    lengths: Tensor,
    *,
    pad_id: int,
    dtype: torch.dtype,
    grouped: bool = False,
) -> tuple[dict[str, Any], Tensor, Tensor]:
    """Model inputs for one row per group, plus the (row, position) of the hidden state predicting each token.

    grouped=False: the dense block mask as attention_mask (bool for dtype torch.bool, else additive); True: a
    `prefix_layout` for grouped attention instead (the model must then run inside `attention.grouped_text`).

    Args:
        prompts: [n] encodings (samples of one group share the dict).  completions: [n, K] token ids.
        lengths: [n] real tokens per completion (>= 1).
    Returns:
        (kwargs for the base model, rows [n], where [n, K]): hidden[rows[i], where[i, t]] predicts completions[i, t].
    """
    groups = group_indices(prompts)
    n, k = completions.shape
    dev = completions.device
    rows_len = [prompts[g[0]]["input_ids"].shape[1] + int((lengths[g] - 1).sum()) for g in groups]
    width = max(rows_len)
    ids = torch.full((len(groups), width), pad_id, dtype=torch.long, device=dev)  # [R, L]
    mm = torch.zeros_like(ids)  # [R, L]
    seg = torch.full_like(ids, -1)  # [R, L]
    pos = torch.zeros((3, len(groups), width), dtype=torch.long, device=dev)  # [3, R, L]
    rows = torch.zeros(n, dtype=torch.long, device=dev)  # [n]
    where = torch.zeros((n, k), dtype=torch.long, device=dev)  # [n, K]
    t = torch.arange(k, device=dev)
    for r, members in enumerate(groups):
        enc = prompts[members[0]]
        lp = enc["input_ids"].shape[1]
        ids[r, :lp], seg[r, :lp] = enc["input_ids"][0], 0
        mm[r, :lp] = enc["mm_token_type_ids"][0]
        pos[:, r, :lp] = mrope_positions(lm, enc)
        nxt = int(pos[:, r, :lp].max()) + 1  # completions continue after the prefix's last position
        start = lp
        for j, i in enumerate(members):
            m = int(lengths[i]) - 1  # the last token is only a target
            ids[r, start : start + m], seg[r, start : start + m] = completions[i, :m], j + 1
            pos[:, r, start : start + m] = nxt + torch.arange(m, device=dev)
            rows[i] = r
            where[i] = torch.where(t == 0, lp - 1, (start + t - 1).clamp(max=start + max(m, 1) - 1))
            start += m
    attn = {"prefix_layout": prefix_layout(seg)} if grouped else {"attention_mask": _block_mask(seg, dtype)}
    kwargs = {
        "input_ids": ids,
        **attn,
        "position_ids": pos,
        "mm_token_type_ids": mm,
        **_per_image([prompts[g[0]] for g in groups]),
    }
    return kwargs, rows, where


def plain_inputs(
    prompts: list[dict[str, Any]], completions: Tensor, lengths: Tensor, *, pad_id: int
) -> tuple[dict[str, Any], Tensor, Tensor]:
    """The reference layout: one right-padded row [prompt | completion] per sample, images repeated per sample.

    Positions and masks are left to the model (its own get_rope_index on the 2D padding mask).
    Returns the same (kwargs, rows [n], where [n, K]) as `shared_inputs`.
    """
    n, k = completions.shape
    dev = completions.device
    lps = [p["input_ids"].shape[1] for p in prompts]
    width = max(lp + int(m) - 1 for lp, m in zip(lps, lengths.tolist()))
    ids = torch.full((n, width), pad_id, dtype=torch.long, device=dev)  # [n, L]
    att = torch.zeros_like(ids)  # [n, L]
    mm = torch.zeros_like(ids)  # [n, L]
    t = torch.arange(k, device=dev)
    where = torch.zeros((n, k), dtype=torch.long, device=dev)  # [n, K]
    for i, (enc, lp) in enumerate(zip(prompts, lps)):
        m = int(lengths[i]) - 1
        ids[i, :lp], ids[i, lp : lp + m] = enc["input_ids"][0], completions[i, :m]
        att[i, : lp + m] = 1
        mm[i, :lp] = enc["mm_token_type_ids"][0] if "mm_token_type_ids" in enc else 0
        where[i] = (lp - 1 + t).clamp(max=lp + m - 1)
    kwargs = {"input_ids": ids, "attention_mask": att, **_per_image(prompts)}
    if "mm_token_type_ids" in prompts[0]:
        kwargs["mm_token_type_ids"] = mm
    return kwargs, torch.arange(n, device=dev), where


def vision_token_ids(config: Any) -> list[int]:
    """Ids of the vision placeholder tokens (image/video pad, vision start/end) named in a model config."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "image_token_index")
    return sorted({int(v) for v in (getattr(config, n, None) for n in names) if isinstance(v, int)})


def _chunk_logp(
    h: Tensor, targets: Tensor, head: nn.Module, temperature: float, suppress: Tensor | None
) -> tuple[Tensor, Tensor]:
    logits = head(h).float() / temperature  # [T, V]
    if suppress is not None:
        logits = logits.masked_fill(suppress, float("-inf"))
    logps = logits.log_softmax(-1)  # [T, V]
    logp = logps.gather(-1, targets[:, None]).squeeze(-1)  # [T]
    entropy = -torch.special.xlogy(logps.exp(), logps.exp()).sum(-1)  # [T] (0 log 0 = 0 on suppressed ids)
    return logp, entropy


def token_logp(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    suppress: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """log softmax(head(h) / T)[target] and the entropy, `chunk_tokens` rows of logits at a time.

    With grad, each chunk is checkpointed: the [T, V] logits are rebuilt in backward one chunk at a time, so peak
    memory is chunk_tokens x V instead of N x K x V. `suppress` [V] bool marks ids removed from the distribution
    (the vision placeholders, which generation suppresses too: sampled, they break the image-token count).

    Args:
        hidden: [T, H] hidden states.  targets: [T] token ids.
    Returns:
        logp [T] (float32, with grad), entropy [T] (float32, detached).
    """
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} need the same length")
    outs, ents = [], []
    for s in range(0, hidden.shape[0], chunk_tokens):
        h, tg = hidden[s : s + chunk_tokens], targets[s : s + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk_logp, h, tg, head, temperature, suppress, use_reentrant=False)
        else:
            lp, ent = _chunk_logp(h, tg, head, temperature, suppress)
        outs.append(lp)
        ents.append(ent.detach())
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(outs) if outs else empty, torch.cat(ents) if ents else empty


def completion_logp(
    lm: nn.Module,
    head: nn.Module,
    prompts: list[dict[str, Any]],
    completions: Tensor,
    lengths: Tensor,
    *,
    shared: bool,
    pad_id: int,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    suppress: Tensor | None = None,
    prefix_attention: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs and entropies [n, K] of `completions` after their prompts (0 beyond each length).

    lm is the base VLM (`XForConditionalGeneration.model`, returning last_hidden_state), head its lm_head.
    shared=True runs one row per group (vision tower and prefix once), its attention grouped or block-masked as
    `prefix_attention` (see the module docstring) picks; False the plain batch.
    """
    n, k = completions.shape
    if lengths.min() < 1 or lengths.max() > k:
        raise ValueError(f"lengths must be in [1, K={k}], got min {int(lengths.min())} max {int(lengths.max())}")
    check_prefix_attention(prefix_attention)  # on the plain batch too: a typo fails on the first call
    grouped = shared and attention_mode(lm, prefix_attention) == "grouped"
    if shared:
        sdpa = getattr(lm.config, "_attn_implementation", None) == "sdpa"
        dtype = torch.bool if sdpa else next(lm.parameters()).dtype
        kwargs, rows, where = shared_inputs(
            lm, prompts, completions, lengths, pad_id=pad_id, dtype=dtype, grouped=grouped
        )
    else:
        kwargs, rows, where = plain_inputs(prompts, completions, lengths, pad_id=pad_id)
    with grouped_text(lm) if grouped else contextlib.nullcontext():
        hidden = lm(**kwargs, use_cache=False).last_hidden_state  # [R, L, H]
    mask = torch.arange(k, device=completions.device)[None] < lengths[:, None]  # [n, K]
    h = hidden[rows[:, None].expand(n, k)[mask], where[mask]]  # [T, H] only real tokens reach the lm_head
    lp, ent = token_logp(
        h, head, completions[mask], temperature=temperature, chunk_tokens=chunk_tokens, suppress=suppress
    )
    logp = torch.zeros((n, k), dtype=torch.float32, device=completions.device).masked_scatter(mask, lp)  # [n, K]
    entropy = torch.zeros((n, k), dtype=torch.float32, device=completions.device).masked_scatter(mask, ent)
    return logp, entropy
