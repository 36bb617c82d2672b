"""Decoding over a shared prompt cache (pipelines/vlm/shared_decode.py): the attention equals SDPA over the prompt
repeated G times, and the rollout samples the same completions with either cache."""

import pytest
import torch
import torch.nn.functional as F

from pipelines.vlm import decode
from pipelines.vlm.build import build_vlm
from pipelines.vlm.rollout import HFBackend
from pipelines.vlm.shared_decode import SharedPromptCache, shared_decode_attention

CPU = torch.device("cpu")


class _Layer:
    layer_idx = 0


class _Prefill:
    def __init__(self, keys, values):
        self.layers = [type("L", (), {"keys": keys, "values": values})()]


def test_one_step_equals_sdpa_over_the_repeated_prompt():
    """B = 2 prompts (the first left-padded by 2 of W = 5), G = 3, H = 4 query heads on Hkv = 2 key heads (GQA),
    decode step t = 2 (two own tokens cached before this one), float64. Reference: SDPA with each row's keys =
    cat(its prompt's K repeated, own K) and the padding masked, what the static cache computed."""
    g, gen = 3, torch.Generator().manual_seed(0)
    b, hkv, h, w, d, t = 2, 2, 4, 5, 8, 2
    n = b * g
    kp, vp = (torch.randn(b, hkv, w, d, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # [B, W] left padding in prompt 0
    cache = SharedPromptCache.from_prefill(_Prefill(kp, vp), mask, g, max_new_tokens=4)
    own_k, own_v = (torch.randn(n, hkv, t + 1, d, generator=gen, dtype=torch.float64) for _ in range(2))
    cache.own_keys[0][:, :, :t] = own_k[:, :, :t]  # written by the two earlier steps
    cache.own_values[0][:, :, :t] = own_v[:, :, :t]
    cache.step = t
    q = torch.randn(n, h, 1, d, generator=gen, dtype=torch.float64)
    out, _ = shared_decode_attention(
        _Layer(), q, own_k[:, :, t:], own_v[:, :, t:], None, scaling=0.3, shared_decode=cache
    )
    kk = torch.cat([kp.repeat_interleave(g, 0), own_k], 2)  # [N, Hkv, W + t + 1, D]
    vv = torch.cat([vp.repeat_interleave(g, 0), own_v], 2)
    keep = torch.cat([mask.repeat_interleave(g, 0), torch.ones(n, t + 1, dtype=torch.long)], 1).bool()  # [N, W+t+1]
    want = F.scaled_dot_product_attention(q, kk, vv, attn_mask=keep[:, None, None], scale=0.3, enable_gqa=True)
    assert out.shape == (n, 1, h, d)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=1e-12)
    assert torch.equal(cache.own_keys[0][:, :, t], own_k[:, :, t])  # this step's key is kept for the next


def test_refuses_a_call_without_its_cache():
    q = torch.zeros(2, 1, 1, 4)
    with pytest.raises(ValueError, match="needs shared_decode="):
        shared_decode_attention(_Layer(), q, q, q, None)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vlm_shared_decode_models"))


@pytest.mark.filterwarnings("ignore:pipeline.kwargs.top_p < 1")
def test_rollout_samples_the_same_with_either_cache(cache, monkeypatch):
    """3 prompts of different lengths x G = 4 at temperature 0.7: the shared cache gives the completions and the
    generation-time log-probs of the repeated one (the static cache decode.py keeps for sliding-window layers)."""
    task = build_vlm(
        seed=0,
        device=CPU,
        model="tiny-random-qwen2-vl",
        cache_dir=cache,
        train_size=4,
        eval_size=1,
        max_new_tokens=12,
        temperature=0.7,
        check_logp=True,
    )
    pol, recs = task.policy, task.train_data[:3]
    assert len({pol.encode(r)["input_ids"].shape[1] for r in recs}) > 1  # really padded
    pol.backend = HFBackend(prefill_once=True)
    used = []
    real = decode._decode_cache
    monkeypatch.setattr(decode, "_decode_cache", lambda *a: used.append(type(r := real(*a)).__name__) or r)
    shared = pol.rollout(recs, 4, [5, 6, 7])
    monkeypatch.setattr(decode, "supports_shared_decode", lambda lm: False)
    repeated = pol.rollout(recs, 4, [5, 6, 7])
    assert used == ["_SharedCache", "_RepeatedCache"]
    assert torch.equal(shared.extras["completion_ids"], repeated.extras["completion_ids"])
    assert (shared.extras["gen_logp"] - repeated.extras["gen_logp"]).abs().max() < 1e-5


def test_cache_keyword_follows_the_model_signature():
    # transformers 5.24 renamed the forward keyword past_key_values to cache (the old name warns, and goes in 5.40);
    # the decode loop must pass whichever name the installed model's forward declares
    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return input_ids

    assert decode.cache_key(Old()) == "past_key_values"
    assert decode.cache_key(New()) == "cache"
