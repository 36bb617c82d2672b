"""Prefix-shared forward (Prefix Grouper, arXiv:2506.05433) == the plain batch, in outputs and gradients, on tiny
random Qwen2-VL, Qwen2.5-VL and Qwen3-VL with unequal completion lengths, grouped attention and the dense block mask;
the grouped attention function against dense-mask SDPA; the block mask, positions and chunked log-softmax."""

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.errors import UserError
from pipelines.vlm.attention import (
    GROUPED,
    grouped_attention,
    grouped_text,
    prefix_layout,
    split_kv_enabled,
    text_config,
)
from pipelines.vlm.prefix import (
    _block_mask,
    attention_mode,
    completion_logp,
    group_indices,
    mrope_positions,
    shared_inputs,
    supports_shared,
    token_logp,
)
from pipelines.vlm.tiny import tiny_model_dir

MODELS = ["tiny-random-qwen2-vl", "tiny-random-qwen2.5-vl", "tiny-random-qwen3-vl"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vlm_models"))


def _load(cache, name):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_model_dir(name, cache)
    return AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(path)


def _enc(proc, question, hw):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    rng = np.random.default_rng(hw[0])
    img = Image.fromarray(rng.integers(0, 255, (*hw, 3), dtype=np.uint8))
    return dict(proc(text=[text], images=[img], return_tensors="pt"))


def _grads(model, fn):
    model.zero_grad()
    logp, ent = fn()
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    (logp * weights).sum().backward()
    return logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_shared_equals_plain_outputs_and_grads(cache, name):
    """float64 model: grouped attention and the dense block mask both give the plain batch's log-probs, entropies and
    parameter gradients (log-probs go through float32 logits in token_logp, hence rtol 1e-6 rather than 1e-12)."""
    proc, model = _load(cache, name)
    model.double()
    a, b = _enc(proc, "How many circles?", (32, 48)), _enc(proc, "What color is the big square?", (60, 40))
    c = _enc(proc, "Any?", (28, 28))
    prompts = [a, a, a, b, b, b, b, c]  # groups of G=3, G=4 and G=1
    comps = torch.randint(0, 256, (8, 9), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([9, 4, 1, 6, 9, 2, 5, 7])  # unequal, including a single-token completion

    def run(shared, attention="auto"):
        return completion_logp(
            model.model,
            model.lm_head,
            prompts,
            comps,
            lengths,
            shared=shared,
            pad_id=0,
            temperature=0.7,
            chunk_tokens=5,
            prefix_attention=attention,
        )

    assert attention_mode(model.model, "auto") == "grouped"
    lp_p, ent_p, g_p = _grads(model, lambda: run(False))
    mask = torch.arange(9)[None] < lengths[:, None]
    assert (lp_p[~mask] == 0).all() and g_p.keys() and any("visual" in k for k in g_p)  # grads reach the vision tower
    for attention in ("grouped", "mask"):
        lp_s, ent_s, g_s = _grads(model, lambda a=attention: run(True, a))
        assert (lp_s[~mask] == 0).all()
        torch.testing.assert_close(lp_s, lp_p, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ent_s, ent_p, rtol=1e-6, atol=1e-6)
        assert g_p.keys() == g_s.keys()
        for k in g_p:
            rel = (g_s[k] - g_p[k]).norm() / g_p[k].norm().clamp(min=1e-30)
            assert rel <= 1e-6, (attention, k, float(rel))
    assert text_config(model.model)._attn_implementation == "sdpa"  # the switch is undone after the forward


@pytest.mark.parametrize("setup", ["lora", "checkpointing"])
def test_shared_equals_plain_with_lora_and_checkpointing(cache, setup):
    """LoRA (peft on the text projections, as build_vlm wraps it): grouped attention, adapter gradients equal the
    plain batch's. Gradient checkpointing: auto falls back to the block mask (the recompute runs outside the
    grouped switch), still equal to the plain batch."""
    from peft import LoraConfig, get_peft_model

    from pipelines.vlm.build import LORA_TARGETS

    proc, model = _load(cache, MODELS[0])
    model.double().train()
    if setup == "lora":
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
        )
    else:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    base = model.get_base_model() if setup == "lora" else model
    assert attention_mode(base.model, "auto") == ("grouped" if setup == "lora" else "mask")
    enc = _enc(proc, "Is there a red circle?", (40, 40))
    comps, lengths = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(2)), torch.tensor([6, 2, 4])
    runs = [
        _grads(
            model, lambda s=s: completion_logp(base.model, base.lm_head, [enc] * 3, comps, lengths, shared=s, pad_id=0)
        )
        for s in (False, True)
    ]
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-6, atol=1e-6)
    assert runs[0][2].keys() == runs[1][2].keys() and (setup != "lora" or all("lora_" in k for k in runs[0][2]))
    for k, g in runs[0][2].items():
        assert (runs[1][2][k] - g).norm() <= 1e-6 * g.norm().clamp(min=1e-30), k


def _dense_reference(q, k, v, seg, scale):
    """softmax(q k^T * scale + block mask) v over each whole row, K/V heads repeated for GQA: [R, L, H, D]."""
    rep = q.shape[1] // k.shape[1]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q,
        k.repeat_interleave(rep, 1),
        v.repeat_interleave(rep, 1),
        attn_mask=_block_mask(seg, torch.bool),
        scale=scale,
    )
    return ref.transpose(1, 2)


@pytest.mark.parametrize("split", [True, False])
def test_grouped_attention_equals_dense_mask_sdpa(split):
    """Random float64 tensors, 4 query heads over 2 K/V heads: three rows of different prefix lengths, unequal
    completions (one of 1 token) or equal ones, trailing padding; outputs and q/k/v gradients equal the dense
    block-mask SDPA, both with the CPU split-KV completion call and with the expanded-K/V call (SDPA math backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seg = torch.tensor(
        [
            [0] * 5 + [1] * 3 + [2] + [4] * 4 + [-1] * 2,  # completion 3 had no tokens in the row
            [0] * 9 + [1] * 2 + [2] * 4,
            [0] * 7 + [1] * 4 + [2] * 4,
        ]
    )  # equal lengths: the own part is plain causal
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 15, 8, dtype=torch.float64, generator=gen).requires_grad_()
    k = torch.randn(3, 2, 15, 8, dtype=torch.float64, generator=gen).requires_grad_()
    v = torch.randn(3, 2, 15, 8, dtype=torch.float64, generator=gen).requires_grad_()
    lay = prefix_layout(seg)
    assert [r.ragged for r in lay.rows] == [True, True, False]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if split else [SDPBackend.MATH]):
        assert split_kv_enabled(q, 0.0) is split and not split_kv_enabled(q, 0.1)
        out, weights = grouped_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, prefix_layout=lay)
        w = torch.randn(out.shape, dtype=torch.float64, generator=gen)
        real = (seg >= 0)[:, :, None, None]  # [R, L, 1, 1] padding outputs are never read
        grads = torch.autograd.grad((out * w * real).sum(), (q, k, v))
    ref = _dense_reference(q, k, v, seg, 0.3)
    assert weights is None and out.shape == (3, 15, 4, 8) and (out[~real.expand_as(out)] == 0).all()
    torch.testing.assert_close(out * real, ref * real, rtol=1e-12, atol=1e-12)
    refs = torch.autograd.grad((ref * w * real).sum(), (q, k, v))
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_prefix_layout_golden():
    # prefix of 2, completion 1 of 2 tokens, completion 2 of 1 token, one pad: G = 2, C = 2
    lay = prefix_layout(torch.tensor([[0, 0, 1, 1, 2, -1]]))
    row = lay.rows[0]
    assert (row.prefix, row.groups, row.width, lay.length) == (2, 2, 2, 6)
    assert row.index.tolist() == [2, 3, 4, 4]  # completion 2's padded slot repeats its last token
    # keys: [prefix 0, prefix 1, own slot 0, own slot 1]; slot 1 of completion 2 is padding, never a key
    assert row.mask[:, 0].int().tolist() == [[[1, 1, 1, 0], [1, 1, 1, 1]], [[1, 1, 1, 0], [1, 1, 1, 0]]]
    # row position -> cat(prefix out [2], completion out [2 x 2], zero [1]); the pad reads the zero row (index 6)
    assert row.source.tolist() == [0, 1, 2, 3, 4, 6]
    with pytest.raises(ValueError, match="prefix"):
        prefix_layout(torch.tensor([[1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="increase"):
        prefix_layout(torch.tensor([[0, 2, 1]]))


def test_grouped_flops_formula():
    """FlopCounterMode over the grouped function (SDPA decomposed into matmuls by the math backend, which also selects
    the expanded-K/V completion call: the split-KV one computes the same rectangles in two parts) counts
    4 H D (P^2 + G C (P + C)) per row: q k^T and p v are 2 H D flops per (query, key) pair each. Here H = 4, D = 8;
    row 1: P = 5, G = 2, C = 3 -> 25 + 2 * 3 * 8 = 73 pairs; row 2: P = 4, G = 1, C = 2 -> 16 + 12 = 28 pairs;
    4 * 4 * 8 * 101 = 12928."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    seg = torch.tensor([[0] * 5 + [1] * 3 + [2] * 2, [0] * 4 + [1] * 2 + [-1] * 4])
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        grouped_attention(torch.nn.Module(), q, k, k, None, prefix_layout=prefix_layout(seg))
    assert fc.get_total_flops() == 12928


def test_attention_mode_choices(cache):
    _, model = _load(cache, MODELS[0])
    lm = model.model
    assert attention_mode(lm, "auto") == "grouped" and attention_mode(lm, "mask") == "mask"
    with pytest.raises(UserError, match="prefix_attention \\('dense'\\) must be one of auto, grouped, mask"):
        attention_mode(lm, "dense")
    model.set_attn_implementation("eager")
    assert attention_mode(lm, "auto") == "mask"
    with pytest.raises(UserError, match="prefix_attention=grouped but text attention 'eager'.*auto or mask"):
        attention_mode(lm, "grouped")
    model.set_attn_implementation("sdpa")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert attention_mode(lm, "auto") == "mask"
    model.activation_checkpointing_disable()
    assert attention_mode(lm, "auto") == "grouped"


def test_grouped_switch_is_scoped(cache):
    """The text config names the grouped function only inside the block (also when the forward raises); the vision
    tower keeps sdpa; a model call under the switch without a layout fails loudly instead of running unmasked."""
    _, model = _load(cache, MODELS[0])
    lm = model.model
    with grouped_text(lm):
        assert text_config(lm)._attn_implementation == GROUPED
        assert model.config.vision_config._attn_implementation == "sdpa"
        with pytest.raises(ValueError, match="needs prefix_layout"):
            lm(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    assert text_config(lm)._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", MODELS)
def test_completion_positions_continue_after_the_prefix(cache, name):
    """Shared-row M-RoPE positions equal the model's own get_rope_index over [prompt | completion]."""
    proc, model = _load(cache, name)
    enc = _enc(proc, "Q?", (56, 84))
    comps = torch.randint(0, 256, (2, 5))
    lengths = torch.tensor([5, 3])
    kwargs, rows, where = shared_inputs(model.model, [enc, enc], comps, lengths, pad_id=0, dtype=torch.float32)
    lp = enc["input_ids"].shape[1]
    for i, start in ((0, lp), (1, lp + 4)):
        full = torch.cat([enc["input_ids"], comps[i : i + 1, :4]], 1)  # the 4 completion tokens fed as inputs
        mm = torch.cat([enc["mm_token_type_ids"], torch.zeros(1, 4, dtype=torch.long)], 1)
        ref, _ = model.model.get_rope_index(full, mm_token_type_ids=mm, image_grid_thw=enc["image_grid_thw"])
        m = int(lengths[i]) - 1
        assert torch.equal(kwargs["position_ids"][:, 0, start : start + m], ref[:, 0, lp : lp + m])
    assert torch.equal(kwargs["position_ids"][:, 0, :lp], mrope_positions(model.model, enc))
    # hidden state predicting token t: the last prompt token for t = 0, else completion token t - 1
    assert where[0].tolist()[:5] == [lp - 1, lp, lp + 1, lp + 2, lp + 3]
    assert where[1].tolist()[:3] == [lp - 1, lp + 4, lp + 5] and rows.tolist() == [0, 0]


def test_block_mask_golden():
    # row: prefix of 2 (seg 0), completion 1 of 2 tokens, completion 2 of 1 token, one pad
    seg = torch.tensor([[0, 0, 1, 1, 2, -1]])
    allowed = _block_mask(seg, torch.float32)[0, 0] == 0
    expect = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],  # completion 2 sees the prefix and itself, not completion 1
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )  # padding sees only itself (no NaN row)
    assert torch.equal(allowed, expect)
    assert torch.equal(_block_mask(seg, torch.bool)[0, 0], expect)  # the SDPA form
    assert _block_mask(seg, torch.float32)[0, 0, 0, 1] == torch.finfo(torch.float32).min


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_shared_equals_plain_for_each_attention(cache, attn):
    proc, model = _load(cache, MODELS[0])
    model.set_attn_implementation(attn)
    enc = _enc(proc, "Is there a red circle?", (40, 40))
    comps, lengths = torch.randint(0, 256, (3, 6)), torch.tensor([6, 2, 4])
    run = [
        completion_logp(model.model, model.lm_head, [enc] * 3, comps, lengths, shared=s, pad_id=0)[0]
        for s in (False, True)
    ]
    torch.testing.assert_close(run[1], run[0], rtol=1e-5, atol=1e-5)
    model.set_attn_implementation("sdpa")


def test_shared_equals_plain_for_a_qwen3_vl_video(cache):
    """Qwen3-VL video prompts carry per-frame timestamps and split video_grid_thw in get_rope_index; the video
    pipeline turns prefix sharing on through the same switch, so the shared rows must match there too."""
    proc, model = _load(cache, "tiny-random-qwen3-vl")
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "When?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    frames = np.random.default_rng(0).integers(0, 255, (8, 64, 64, 3), dtype=np.uint8)
    meta = [{"fps": 2.0, "total_num_frames": 8, "frames_indices": list(range(8))}]
    enc = dict(proc(text=[text], videos=[frames], return_tensors="pt", do_sample_frames=False, video_metadata=meta))
    assert "video_grid_thw" in enc and int(enc["video_grid_thw"][0, 0]) == 4  # 8 frames, temporal patch 2
    comps, lengths = torch.randint(0, 256, (3, 6)), torch.tensor([6, 2, 4])
    run = [
        completion_logp(model.model, model.lm_head, [enc] * 3, comps, lengths, shared=s, pad_id=0)[0].detach()
        for s in (False, True)
    ]
    torch.testing.assert_close(run[1], run[0], rtol=1e-5, atol=1e-5)


def test_group_indices_by_shared_encoding():
    a, b = {"x": 1}, {"x": 1}  # equal content, different prompts
    assert group_indices([a, b, a, b, b]) == [[0, 2], [1, 3, 4]]


def test_token_logp_chunked_matches_dense_and_suppresses():
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=False)
    h = torch.randn(7, 6, requires_grad=True)
    tg = torch.tensor([0, 3, 10, 5, 5, 1, 2])
    suppress = torch.zeros(11, dtype=torch.bool)
    suppress[[4, 9]] = True
    lp, ent = token_logp(h, head, tg, temperature=0.5, chunk_tokens=3, suppress=suppress)
    lp.sum().backward()
    g_chunk = h.grad.clone()
    h.grad = None
    logits = (head(h) / 0.5).double()
    logits[:, [4, 9]] = float("-inf")
    ref = logits.log_softmax(-1).gather(-1, tg[:, None]).squeeze(-1)
    ref.sum().backward()
    torch.testing.assert_close(lp.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_chunk.double(), h.grad.double(), rtol=1e-5, atol=1e-6)
    p = logits.softmax(-1)
    ref_ent = -(p * torch.where(p > 0, p.log(), 0.0)).sum(-1)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=1e-5, atol=1e-6)
    assert not ent.requires_grad and torch.isfinite(ent).all()
    # a uniform head over 9 allowed ids: entropy log 9, every log-prob -log 9
    flat, e = token_logp(
        torch.zeros(2, 6), torch.nn.Linear(6, 11, bias=False), torch.tensor([0, 1]), suppress=suppress
    )
    assert torch.allclose(flat, torch.full((2,), -np.log(9.0)).float()) and torch.allclose(
        e, torch.full((2,), np.log(9.0)).float()
    )


def test_supports_shared_falls_back_cleanly(cache):
    _, model = _load(cache, MODELS[0])
    assert supports_shared(model) == (True, "")
    model.config._attn_implementation = "flash_attention_2"
    ok, why = supports_shared(model)
    assert not ok and "flash_attention_2" in why
    model.config._attn_implementation = "sdpa"

    class Other:
        config = type("C", (), {"model_type": "llava", "_attn_implementation": "sdpa"})()

    ok, why = supports_shared(Other())
    assert not ok and "llava" in why
    Other.config.model_type = "qwen2_vl"
    Other.config.text_config = type("T", (), {"layer_types": ["full_attention", "sliding_attention"]})()
    ok, why = supports_shared(Other())
    assert not ok and "sliding-window" in why


def test_builder_falls_back_to_the_plain_batch(cache, monkeypatch):
    """prefix_sharing=auto on a model without the block-mask support trains on the plain batch (first ratio exactly
    1); prefix_sharing=on refuses it in one line naming the fix."""
    from mmgrpo.errors import UserError
    from pipelines.vlm import prefix
    from pipelines.vlm.build import build_vlm

    kw = {
        "seed": 0,
        "device": torch.device("cpu"),
        "cache_dir": cache,
        "train_size": 2,
        "eval_size": 1,
        "max_new_tokens": 6,
    }
    assert build_vlm(**kw).module.shared  # supported: on by default
    monkeypatch.setattr(prefix, "SHARED_MODEL_TYPES", ("llava",))  # as if qwen2_vl had no block-mask support
    task = build_vlm(**kw)
    assert task.module.shared is False
    calls = []
    plain = prefix.plain_inputs
    monkeypatch.setattr(prefix, "plain_inputs", lambda *a, **k: calls.append(1) or plain(*a, **k))
    ro = task.policy.rollout(task.train_data[:1], 3, [0])
    logp, _ = task.policy.logp(task.module, ro, torch.arange(3))
    assert calls and torch.equal(logp[ro.mask], ro.old_logp[ro.mask])
    with pytest.raises(UserError, match="prefix_sharing=on but model type 'qwen2_vl'.*set prefix_sharing=auto or off"):
        build_vlm(**kw, prefix_sharing="on")


def test_lengths_out_of_range_raise(cache):
    proc, model = _load(cache, MODELS[0])
    enc = _enc(proc, "Q", (32, 32))
    with pytest.raises(ValueError, match="lengths"):
        completion_logp(
            model.model,
            model.lm_head,
            [enc],
            torch.zeros(1, 3, dtype=torch.long),
            torch.tensor([0]),
            shared=True,
            pad_id=0,
        )
    with pytest.raises(UserError, match="prefix_attention \\('grouped_'\\)"):
        completion_logp(
            model.model,
            model.lm_head,
            [enc],
            torch.zeros(1, 3, dtype=torch.long),
            torch.tensor([3]),
            shared=False,
            pad_id=0,
            prefix_attention="grouped_",
        )
