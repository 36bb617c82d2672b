"""Vision-feature cache: a frozen vision tower's output for given pixels is a constant, so each image or video is
encoded once and reused by the rollout's prefill, the old/reference log-prob passes and every update forward.

Seam: the base model's `get_image_features` / `get_video_features` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL in transformers 5),
which the model's forward calls with the batch's pixels and grid_thw and which return the merged features already
split per image (pooler_output, plus Qwen3-VL's deepstack_features per level). Items are keyed by content (modality,
grid [t, h, w], dtype, device, autocast and inference-mode state, a 128-bit digest of the pixel bytes), so the plain
batch's G copies of one prompt, the shared batch's one copy and the next iteration's re-sampled prompt all hit the
same entry; only the misses of a call go through the tower, together. Cached outputs carry the fields the model's
forward reads (pooler_output, deepstack_features); last_hidden_state (pre-merge, unread by the forward) is None.

Why this seam: it is below every path that encodes pixels (the forward, decode.py's prefill, and `generate`, whose
encoder step calls it once before expanding the prompt G times) and above the tower's internals (Qwen2.5-VL's window
order, Qwen3-VL's deepstack mergers), so the cache needs no model code, only the per-item split it already returns.

Off (the tower runs as before) when any vision parameter requires grad (full fine-tuning, LoRA inside the tower), when
a vision dropout is live in training mode, under FSDP (ranks would skip different all-gathers on their own hits and
hang), for extra feature kwargs (attentions, hidden states), and for model types not in CACHED_MODEL_TYPES. The entries
are dropped when any vision weight is modified in place or replaced (their version counters / storages change).
"""

import contextlib
import functools
import hashlib
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from mmgrpo.errors import UserError
from pipelines.vlm.wrapping import fsdp_managed, needs_synced_gpus

CACHED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""model types whose get_image/video_features return per-item tuples (checked exact in tests/test_vision_cache.py)"""
VISION_CACHE = ("auto", "off")
"""pipeline.kwargs.vision_cache: auto = on whenever exact (frozen tower, no FSDP), off = never"""
_HARMLESS_KWARGS = frozenset({"return_dict", "prefix_layout", "use_cache"})
"""feature kwargs that leave the features unchanged (prefix_layout is the text attention's, see attention.py; the
tower ignores it and use_cache); anything else (output_attentions, hidden states...) bypasses the cache"""


def check_vision_cache(mode: str, items: int) -> None:
    """One-line errors for pipeline.kwargs.vision_cache / vision_cache_items."""
    if mode not in VISION_CACHE:
        raise UserError(
            f"pipeline.kwargs.vision_cache ({mode!r}) must be one of {', '.join(VISION_CACHE)} (auto: "
            f"encode each image/video once while the vision tower is frozen)"
        )
    if not isinstance(items, int) or isinstance(items, bool) or items < 1:
        raise UserError(
            f"pipeline.kwargs.vision_cache_items ({items!r}) must be an integer >= 1: images/videos kept "
            f"(set it >= the prompts one rank samples per iteration)"
        )


def _digest(pixels: Tensor) -> bytes:
    """128-bit digest of the tensor's bytes (copied to the host when on a device): xxh3-128 (about 25 GB/s) when the
    xxhash package is installed (datasets depends on it), else SHA-1 (about 2 GB/s)."""
    flat = pixels.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    try:
        # lazy: xxhash is optional (SHA-1 without it)
        import xxhash
    except ImportError:
        return hashlib.sha1(flat, usedforsecurity=False).digest()
    return xxhash.xxh3_128_digest(flat)


class VisionCache:
    """Bounded LRU of per-item vision features of one base model (`XForConditionalGeneration.model`).

    Use `with cache.installed():` around forwards; counters `items_encoded` / `items_reused` / `tower_calls`.
    """

    def __init__(self, lm: nn.Module, *, mode: str = "auto", max_items: int = 64):
        check_vision_cache(mode, max_items)
        self.lm, self.mode, self.max_items = lm, mode, max_items
        self.store: OrderedDict[tuple, dict[str, Any]] = OrderedDict()
        self.items_encoded = self.items_reused = self.tower_calls = 0
        self._stamp: tuple = ()
        self._sharded: bool | None = None
        self._depth = 0

    # ----- when it applies
    def why_off(self) -> str:
        """'' when the cache is exact for this model right now, else the reason it is bypassed."""
        if self.mode == "off":
            return "vision_cache=off"
        kind = getattr(self.lm.config, "model_type", "?")
        visual = getattr(self.lm, "visual", None)
        if kind not in CACHED_MODEL_TYPES or visual is None:
            return f"model type {kind!r} is not one of {CACHED_MODEL_TYPES}"
        if any(p.requires_grad for p in visual.parameters()):
            return "vision parameters require grad (the tower trains)"
        if visual.training and any(_live_dropout(m) for m in visual.modules()):
            return "a vision dropout is active in training mode"
        if self._sharded is None:  # decided at the first forward, after accelerate has prepared the model
            self._sharded = fsdp_managed(self.lm) or needs_synced_gpus(self.lm)
        if self._sharded:
            return "FSDP-sharded weights (a rank's cache hit would skip an all-gather the others wait in)"
        return ""

    def clear(self) -> None:
        self.store.clear()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Route the base model's get_image_features / get_video_features through the cache for this block."""
        if self.why_off():
            yield
            return
        self._check_stamp()
        names = ("get_image_features", "get_video_features")
        saved = {n: self.lm.__dict__.get(n) for n in names}
        originals = {n: getattr(self.lm, n) for n in names}
        for n in names:
            setattr(self.lm, n, self._wrap(n.split("_")[1], originals[n]))
        try:
            yield
        finally:
            for n in names:
                if saved[n] is None:
                    delattr(self.lm, n)
                else:
                    setattr(self.lm, n, saved[n])

    # ----- internals
    def _check_stamp(self) -> None:
        """Drop every entry when a vision weight changed in place (version counter) or was replaced (storage)."""
        stamp = tuple((p.data_ptr(), p._version) for p in self.lm.visual.parameters())
        if stamp != self._stamp:
            self.store.clear()
            self._stamp = stamp

    def _wrap(self, kind: str, original: Callable) -> Callable:
        sig = inspect.signature(original)
        pix_name, grid_name = list(sig.parameters)[:2]  # (pixel_values[_videos], image/video_grid_thw)

        # wraps: generate's encoder step reads the parameter names through inspect.signature (__wrapped__)
        @functools.wraps(original)
        def features(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs).arguments
            pixels, grid, extra = bound.get(pix_name), bound.get(grid_name), bound.get("kwargs", {})
            # nested calls (Qwen3-VL's get_video_features calls get_image_features) go straight through
            if self._depth or grid is None or set(extra) - _HARMLESS_KWARGS or extra.get("return_dict") is False:
                return original(*args, **kwargs)
            self._depth += 1
            try:
                return self._lookup(kind, original, pixels, grid)
            finally:
                self._depth -= 1

        return features

    def _key(self, kind: str, pixels: Tensor, thw: list[int]) -> tuple:
        dev = pixels.device.type
        amp = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) if dev in ("cpu", "cuda") else None
        # inference-mode tensors cannot enter autograd later, so they are kept apart from no-grad ones
        inference = torch.is_inference_mode_enabled()
        return kind, tuple(thw), pixels.dtype, str(pixels.device), amp, inference, _digest(pixels)

    def _lookup(self, kind: str, original: Callable, pixel_values: Tensor, grid_thw: Tensor) -> Any:
        thws = grid_thw.tolist()
        pieces = pixel_values.split([t * h * w for t, h, w in thws])  # one [t h w, D] block per item
        keys = [self._key(kind, p, thw) for p, thw in zip(pieces, thws)]
        todo = list(dict.fromkeys(k for k in keys if k not in self.store))  # misses, each once
        if todo:
            first = {k: i for i, k in reversed(list(enumerate(keys)))}
            idx = [first[k] for k in todo]
            out = original(torch.cat([pieces[i] for i in idx]), grid_thw[idx], return_dict=True)
            self.tower_calls += 1
            self.items_encoded += len(todo)
            deep = getattr(out, "deepstack_features", None)
            for j, k in enumerate(todo):
                # clones: an entry must not keep the whole call's output alive
                self.store[k] = {
                    "cls": type(out),
                    "pooler_output": out.pooler_output[j].detach().clone(),
                    "deepstack_features": None if deep is None else [lvl[j].detach().clone() for lvl in deep],
                }
        self.items_reused += len(keys) - len(todo)
        for k in keys:
            self.store.move_to_end(k)
        entries = [self.store[k] for k in keys]
        while len(self.store) > self.max_items:
            self.store.popitem(last=False)
        fields = {"pooler_output": tuple(e["pooler_output"] for e in entries)}
        if entries[0]["deepstack_features"] is not None:
            levels = len(entries[0]["deepstack_features"])
            fields["deepstack_features"] = [
                tuple(e["deepstack_features"][lv] for e in entries) for lv in range(levels)
            ]
        return entries[0]["cls"](**fields)


def _live_dropout(m: nn.Module) -> bool:
    return (isinstance(m, nn.Dropout) and m.p > 0) or float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0
