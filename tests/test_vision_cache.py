"""Vision-feature cache (pipelines/vlm/vision_cache.py): with a frozen tower, log-probs, entropies and LoRA gradients
equal the uncached ones on tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL (images and videos, shared and plain batches); the
tower runs once per distinct image where it ran once per forward before; it is off when vision parameters train; the
store is bounded (LRU) and dropped when a vision weight changes."""

import re

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.errors import UserError
from pipelines.vlm.build import LORA_TARGETS, check_vlm_kwargs
from pipelines.vlm.policy import VLMModule
from pipelines.vlm.tiny import tiny_model_dir
from pipelines.vlm.vision_cache import VisionCache, check_vision_cache

MODELS = ["tiny-random-qwen2-vl", "tiny-random-qwen2.5-vl", "tiny-random-qwen3-vl"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vision_cache_models"))


def _module(cache, name, *, lora=True, targets=LORA_TARGETS, checkpointing=False, **kw):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_model_dir(name, cache)
    proc, hf = AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(path)
    torch.manual_seed(0)
    if checkpointing:
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        hf = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    return proc, VLMModule(hf, pad_id=0, temperature=0.7, shared=True, chunk_tokens=5, **kw).train()


def _image(proc, question, hw):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    img = Image.fromarray(np.random.default_rng(hw[0]).integers(0, 255, (*hw, 3), dtype=np.uint8))
    return dict(proc(text=[text], images=[img], return_tensors="pt"))


def _video(proc, question, seed, frames=8):
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    pix = np.random.default_rng(seed).integers(0, 255, (frames, 56, 56, 3), dtype=np.uint8)
    meta = [{"fps": 2.0, "total_num_frames": frames, "frames_indices": list(range(frames))}]
    return dict(proc(text=[text], videos=[pix], return_tensors="pt", do_sample_frames=False, video_metadata=meta))


def _counted(mod):
    calls = []
    visual = mod.vision_cache.lm.visual
    return calls, visual.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[0]))


def _run(mod, prompts, comps, lengths, shared):
    mod.zero_grad()
    logp, ent = mod(prompts, comps, lengths, shared=shared)
    (logp * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    return logp.detach(), ent, {n: p.grad.clone() for n, p in mod.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-6)
    assert a[2].keys() == b[2].keys() and a[2] and all("lora_" in k for k in a[2])
    for k, g in a[2].items():
        assert (b[2][k] - g).norm() <= 1e-6 * g.norm().clamp(min=1e-30), k


@pytest.mark.parametrize("name,kind", [(m, "image") for m in MODELS] + [(m, "video") for m in MODELS])
def test_cached_equals_uncached_and_tower_runs_once_per_prompt(cache, name, kind):
    proc, mod = _module(cache, name)
    if kind == "image":
        a, b = _image(proc, "How many circles?", (32, 48)), _image(proc, "What color?", (60, 40))
    else:
        a, b = _video(proc, "When?", 0), _video(proc, "What moves?", 1)
    prompts = [a, a, a, b, b]  # groups of G = 3 and G = 2
    comps = torch.randint(0, 256, (5, 7), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([7, 3, 1, 5, 6])
    vc = mod.vision_cache
    assert vc.why_off() == ""
    for shared in (True, False):
        vc.mode = "off"
        calls, handle = _counted(mod)
        ref = _run(mod, prompts, comps, lengths, shared)
        ref2 = _run(mod, prompts, comps, lengths, shared)
        # uncached: every forward runs the tower on its batch (2 prompts shared, 5 copies plain)
        assert len(calls) == 2 and calls[0] == calls[1]
        vc.mode, calls[:] = "auto", []
        vc.clear()
        got = _run(mod, prompts, comps, lengths, shared)
        got2 = _run(mod, prompts, comps, lengths, shared)
        handle.remove()
        # cached: one tower call on the two distinct prompts, none for the second forward
        per_item = [int(e[k].shape[0]) for e in (a, b) for k in e if k.startswith("pixel_values")]
        assert calls == [sum(per_item)] and len(vc.store) == 2
        _assert_same(ref, got)
        _assert_same(ref2, got2)


def test_qwen3_deepstack_features_are_cached_once(cache):
    """Qwen3-VL's get_video_features calls get_image_features: the nested call goes through, one entry per video."""
    proc, mod = _module(cache, "tiny-random-qwen3-vl")
    v = _video(proc, "When?", 3)
    vc = mod.vision_cache
    with torch.no_grad():
        mod([v, v], torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 2]), shared=False)
    (entry,) = vc.store.values()
    assert entry["deepstack_features"] and vc.items_encoded == 1 and vc.items_reused == 1  # the plain-batch copy


def test_off_when_vision_parameters_train(cache):
    proc, full = _module(cache, MODELS[0], lora=False)  # full fine-tuning: the tower trains
    assert "require grad" in full.vision_cache.why_off()
    proc, lora_vis = _module(cache, MODELS[0], targets=r".*visual.*\.(qkv|proj)$")  # LoRA inside the tower
    assert "require grad" in lora_vis.vision_cache.why_off()
    a = _image(proc, "Any?", (28, 28))
    comps, lengths = torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 2])
    calls, handle = _counted(lora_vis)
    for _ in range(2):
        _run(lora_vis, [a, a], comps, lengths, True)
    handle.remove()
    assert len(calls) == 2 and not lora_vis.vision_cache.store  # ran as before, nothing stored
    full.hf.model.visual.requires_grad_(False)  # freeze_vision
    assert full.vision_cache.why_off() == ""


def test_equal_under_gradient_checkpointing(cache):
    proc, mod = _module(cache, MODELS[1], checkpointing=True)
    a = _video(proc, "When?", 4)
    comps, lengths = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(2)), torch.tensor([5, 2, 4])
    mod.vision_cache.mode = "off"
    ref = _run(mod, [a] * 3, comps, lengths, True)
    mod.vision_cache.mode = "auto"
    _assert_same(ref, _run(mod, [a] * 3, comps, lengths, True))
    _assert_same(ref, _run(mod, [a] * 3, comps, lengths, True))  # second one from the cache
    assert mod.vision_cache.items_reused >= 1


def test_bounded_lru_and_dropped_on_weight_change(cache):
    proc, mod = _module(cache, MODELS[0], vision_cache_items=2)
    vc = mod.vision_cache
    encs = [_image(proc, "Any?", (28 + 4 * i, 28)) for i in range(3)]
    comps, lengths = torch.ones(1, 2, dtype=torch.long), torch.tensor([2])
    with torch.no_grad():
        for e in encs + [encs[2]]:
            mod([e], comps, lengths)
        assert len(vc.store) == 2 and vc.items_encoded == 3 and vc.items_reused == 1  # the first was evicted
        before = mod([encs[2]], comps, lengths)[0]
        vc.lm.visual.merger.mlp[0].weight.mul_(2.0)  # an in-place change: the old features are stale
        after = mod([encs[2]], comps, lengths)[0]
        vc.mode = "off"
        fresh = mod([encs[2]], comps, lengths)[0]
    assert vc.items_encoded == 4 and not torch.equal(before, after)
    torch.testing.assert_close(after, fresh, rtol=0, atol=1e-6)


def test_inference_mode_entries_stay_out_of_autograd(cache):
    """Features cached under torch.inference_mode (an evaluation loop) sit under their own key: an inference tensor is
    refused by any autograd op that would save it for backward, so a training forward encodes its own copy."""
    proc, mod = _module(cache, MODELS[0])
    a = _image(proc, "Any?", (28, 28))
    comps, lengths = torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 2])
    with torch.inference_mode():
        mod([a, a], comps, lengths)
    got = _run(mod, [a, a], comps, lengths, True)
    assert len(mod.vision_cache.store) == 2 and got[2]


def test_switch_values_are_checked():
    check_vision_cache("off", 1)
    for mode, items, word in (("on", 64, "vision_cache ('on')"), ("auto", 0, "vision_cache_items (0)")):
        with pytest.raises(UserError, match=re.escape(word)):
            check_vision_cache(mode, items)
    with pytest.raises(UserError, match="vision_cache"):
        check_vlm_kwargs(vision_cache="yes")
    with pytest.raises(UserError, match="vision_cache_items"):
        VisionCache(torch.nn.Linear(1, 1), max_items=True)


@pytest.mark.parametrize("prefill_once", [True, False])
def test_video_iteration_encodes_each_prompt_once(cache, prefill_once):
    """One GRPO iteration of the video pipeline (LoRA, tower frozen): rollout (decode.py's prefill or HF generate,
    whose encoder step goes through the wrapped get_video_features), old log-probs, update forward and the adapter-off
    reference: the same completions and log-probs as uncached; the tower runs once per prompt instead of per pass."""
    from pipelines.video.build import build_video

    task = build_video(
        seed=0,
        device=torch.device("cpu"),
        model=MODELS[0],
        cache_dir=cache,
        train_size=2,
        eval_size=1,
        num_frames=8,
        max_new_tokens=5,
        lora_rank=4,
    )
    pol, mod = task.policy, task.module
    pol.backend.prefill_once = prefill_once
    vc = mod.vision_cache
    assert vc.why_off() == ""
    idx = torch.arange(6)
    runs = []
    for mode in ("off", "auto"):
        vc.mode = mode
        vc.clear()
        calls, handle = _counted(mod)
        r = pol.rollout(task.train_data[:2], 3, [5, 6])
        logp, _ = pol.logp(mod, r, idx)
        ref = pol.ref_logp(r, idx)
        handle.remove()
        runs.append((r, logp.detach(), ref, len(calls)))
    (r0, lp0, ref0, n0), (r1, lp1, ref1, n1) = runs
    assert torch.equal(r0.extras["completion_ids"], r1.extras["completion_ids"]) and r0.samples == r1.samples
    for a, b in ((r0.old_logp, r1.old_logp), (lp0, lp1), (ref0, ref1)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert n1 == 2 and n0 == 2 + 3  # cached: the two rollout prefills; uncached: + old log-probs, update, reference
