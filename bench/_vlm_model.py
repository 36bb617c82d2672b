"""The VLM benchmarks' model and inputs: a random Qwen2-VL (cached), a chat prompt of an exact token length, one
setting of G completions (`Case`), and the peak-tensor-memory profiler. Shared by vlm_prefix, vlm_vs_trl and scaling;
the leading "_" keeps bench/run_all.py from running it as a benchmark.
"""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.profiler import ProfilerActivity, profile

from mmgrpo.runtime import profiler_peak_bytes
from pipelines.vlm.prefix import completion_logp

GROUP, COMPLETION = 8, 128
IMAGE_SIDE = {256: 224, 512: 336, 1024: 448}  # 64, 144, 256 merged image tokens: about a quarter of each prefix
BENCH_VERSION = 1


def _configs(vocab_size: int, ids: dict[str, int], hidden: int, layers: int) -> tuple[dict, dict]:
    """The Qwen2-VL text and vision config dicts: text `hidden` wide and `layers` deep, vision 2 blocks of width 64."""
    heads = max(1, hidden // 64)  # head_dim 64; M-RoPE sections (t, h, w) sum to head_dim / 2 = 32
    text = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e4},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": 2,
        "embed_dim": 64,
        "hidden_size": hidden,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    return text, vision


def bench_vlm(hidden: int = 256, layers: int = 4) -> str:
    """A random Qwen2-VL `hidden` wide and `layers` deep with the tiny byte-level tokenizer (cached); returns its path.

    Wider and deeper than `tiny-random-qwen2-vl` (hidden 64, 2 layers) so that attention and MLP, not Python, set the
    cost; vision tower 2 blocks of width 64. Images up to 448x448 px (256 merged image tokens).
    """
    # lazy: transformers is heavy to import (~1 s); bench.scaling imports this module for its other axes
    from transformers import AutoModelForImageTextToText, Qwen2VLConfig

    from pipelines.vlm.tiny import SPECIALS, _processor, qwen_tokenizer

    root = Path(os.environ.get("MMGRPO_CACHE") or Path.home() / ".cache" / "mmgrpo")
    path = root / f"bench-qwen2-vl-h{hidden}-l{layers}-v{BENCH_VERSION}"
    if (path / "config.json").is_file() and (path / "processor_config.json").is_file():
        return str(path)
    with tempfile.TemporaryDirectory() as src:
        tok = qwen_tokenizer(src)
    ids = {n: tok.convert_tokens_to_ids(n) for n in SPECIALS}
    text, vision = _configs(len(tok), ids, hidden, layers)
    cfg = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(cfg)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    _processor("qwen2_vl", tok, min_pixels=56 * 56, max_pixels=448 * 448).save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def load(path: str, attn: str = "sdpa"):
    # lazy: transformers is heavy to import (~1 s); bench.scaling imports this module for its other axes
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    return proc, model.train()


def prefix_encoding(proc: Any, prefix: int, side: int) -> dict[str, Any]:
    """Processor inputs of one chat prompt (a random side x side image + filler text) exactly `prefix` tokens long."""
    img = Image.fromarray(np.random.default_rng(side).integers(0, 255, (side, side, 3), dtype=np.uint8))

    def enc(question: str) -> dict[str, Any]:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        chat = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return dict(proc(text=[chat], images=[img], return_tensors="pt"))

    fill = prefix - enc("")["input_ids"].shape[1]  # the tokenizer is byte-level: one token per ASCII character
    if fill < 0:
        raise ValueError(f"prefix={prefix} is shorter than the {side}x{side} image's tokens; use a smaller image")
    out = enc(("How many red circles are left of the blue square? " * 64)[:fill])
    if out["input_ids"].shape[1] != prefix:
        raise ValueError(f"prompt has {out['input_ids'].shape[1]} tokens, wanted {prefix}")
    return out


class Case:
    """One setting: G samples of one prompt (`prefix` tokens) with completions of `COMPLETION` tokens."""

    def __init__(self, model: Any, proc: Any, prefix: int, *, group: int = GROUP, completion: int = COMPLETION):
        self.model, self.prefix = model, prefix
        enc = prefix_encoding(proc, prefix, IMAGE_SIDE.get(prefix, 224))
        self.image_tokens = int((enc["input_ids"] == model.config.image_token_id).sum())
        self.prompts = [enc] * group  # one dict object per group: what the policy hands to completion_logp
        gen = torch.Generator().manual_seed(prefix)
        self.completions = torch.randint(0, 256, (group, completion), generator=gen)  # [G, K]
        self.lengths = torch.full((group,), completion)  # [G] every completion full length: the setting
        self.weights = torch.randn(group, completion, generator=gen)  # [G, K] stands in for advantages x mask
        self.pad_id = proc.tokenizer.pad_token_id

    def logp(self, shared: bool, attention: str = "auto") -> torch.Tensor:
        """Log-probs [G, K]; `attention` is completion_logp's prefix_attention (auto: grouped here)."""
        lp, _ = completion_logp(
            self.model.model,
            self.model.lm_head,
            self.prompts,
            self.completions,
            self.lengths,
            shared=shared,
            pad_id=self.pad_id,
            prefix_attention=attention,
        )
        return lp  # [G, K]

    def step(self, shared: bool, attention: str = "auto") -> float:
        """One forward+backward as the update runs it; gradients dropped after (both arms alike)."""
        lp = self.logp(shared, attention)
        (lp * self.weights).sum().backward()
        self.model.zero_grad(set_to_none=True)
        return float(lp.detach().sum())


def profile_step(fn) -> tuple[int, float]:
    """Peak bytes of CPU tensors allocated while fn() runs (over those live when it starts), and the share of the
    CPU time spent in the attention (SDPA) kernels, forward and backward.

    The CPU analogue of torch.cuda.max_memory_allocated after a reset: torch.profiler(profile_memory=True) records
    every allocator alloc (+bytes) and free (-bytes); the peak of their running sum in time order. Deterministic for
    a fixed program, so one measurement per arm is enough (tracemalloc does not see torch's CPU allocator).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    peak = profiler_peak_bytes(prof)
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    attn = sum(e.self_cpu_time_total for e in ops if "scaled_dot_product" in e.key)
    return peak, attn / total if total > 0 else 0.0
