"""FlowPolicy on tiny random diffusers models: ratio 1 before any update for every plan, LoRA save/load through
diffusers, reference and exact KL, rank-independent rollouts, prompt files and one-line model errors."""

import json
import time

import pytest
import torch

import pipelines.flow  # noqa: F401
from mmgrpo.errors import UserError
from mmgrpo.plugins import PIPELINES
from pipelines.flow.build import build_flow, read_prompts
from pipelines.flow.tiny import save_tiny

PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {m: save_tiny(m, root / m) for m in ("sd3", "flux", "wan")}


def _build(path, **kw):
    base = {
        "seed": 0,
        "device": torch.device("cpu"),
        "model": path,
        "prompts": PROMPTS,
        "resolution": 32,
        "num_frames": 5,
        "num_steps": 4,
        "max_sequence_length": 8,
        "lora_rank": 4,
        "guidance_scale": 1.0,
    }
    base.update(kw)
    torch.manual_seed(0)
    return build_flow(**base)


def _records():
    return [{"prompt": p} for p in PROMPTS]


PLANS = [
    ("independent", {"train": "all"}),
    ("independent", {"train": "random", "fraction": 0.5}),
    ("independent", {"train": "window", "window_size": 2, "window_every": 1}),
    ("fast", {"sde_steps": 2}),
    ("singular", {}),
    ("singular", {"granularities": [1, 2]}),
    ("tree", {"split_steps": [0, 2]}),
]


@pytest.mark.parametrize("plan,plan_kwargs", PLANS, ids=[f"{p}-{next(iter(k.values()), '')}" for p, k in PLANS])
def test_ratio_is_one_before_any_update(tiny, plan, plan_kwargs):
    task = _build(tiny["sd3"], plan=plan, plan_kwargs=plan_kwargs, guidance_scale=3.0)
    pol = task.policy
    r = pol.rollout(_records(), 4, [3, 4])
    m = len(plan_kwargs.get("granularities", [1]))  # G2RPO: a member's M leaves share its step, leaf j = 0 trains it
    paths = r.extras.get("path_mask", r.mask)  # tree: every leaf's path; its shared edges train in one row only
    assert r.old_logp.shape[0] == 8 and paths[::m].all() and not paths.view(4 // m * 2, m, -1)[:, 1:].any()
    if plan == "tree":  # 2 prompts x (2 + 2 edges at steps 0-1, 4 + 4 at steps 2-3) = 24 of 32 path elements
        assert int(r.mask.sum()) == 24 and r.mask[:, 2:].all()
    for ks in (None, slice(0, 1)):  # whole K and one k-chunk
        lp, _ = pol.logp(task.module, r, torch.arange(8), k_slice=ks)
        old = r.old_logp[:, ks] if ks is not None else r.old_logp
        # float32 re-scoring in a different batch composition: equal up to matmul rounding
        torch.testing.assert_close(torch.exp(lp - old), torch.ones_like(old), rtol=0, atol=1e-5)


@pytest.mark.parametrize("sde_kind,reduce", [("dance", "mean"), ("cps", "mean"), ("flow_grpo", "sum")])
@pytest.mark.parametrize("plan,plan_kwargs", [("independent", {"train": "all"}), ("tree", {"split_steps": [0, 2]})])
def test_ratio_is_one_for_every_sde_kind_and_reduction(tiny, sde_kind, reduce, plan, plan_kwargs):
    # the noise scale that sampled is the one that scores: same sde kind, noise level and reduction in logp()
    task = _build(
        tiny["sd3"],
        sde=sde_kind,
        noise_level=0.8,
        reduce=reduce,
        plan=plan,
        plan_kwargs=plan_kwargs,
        guidance_scale=3.0,
    )
    r = task.policy.rollout(_records(), 4, [5, 6])
    lp, _ = task.policy.logp(task.module, r, torch.arange(8))
    assert bool(r.mask.any())
    if reduce == "sum":  # |logp| ~ 1e3 here, where float32's spacing is ~1e-4: equal to a few ulps, not to 1e-5
        torch.testing.assert_close(lp, r.old_logp, rtol=1e-6, atol=1e-5)
    else:
        torch.testing.assert_close(torch.exp(lp - r.old_logp), torch.ones_like(lp), rtol=0, atol=1e-5)
    if sde_kind == "cps":  # CPS's last step has std = sigma_next sin(.) = 0: deterministic, never trained
        assert not r.mask[:, -1].any()


def test_same_noise_window_after_step_zero_splits_there_with_ratio_one(tiny):
    # MixGRPO window on steps 1-2 with one noise per group: the ODE step 0 runs once per prompt, the group splits at
    # step 1 (its first SDE step); the stored transitions re-score to ratio 1
    task = _build(
        tiny["sd3"],
        same_noise_per_group=True,
        plan="independent",
        guidance_scale=3.0,
        plan_kwargs={"train": "window", "window_size": 2, "window_every": 1},
    )
    task.policy.set_iteration(1)
    r = task.policy.rollout(_records(), 4, [5, 6])
    assert task.policy.last_plan.branches == {1: 4} and r.extras["step"][0].tolist() == [1, 2]
    x1 = r.extras["x_t"][:, 0]  # [8, ...] latents entering step 1: one per prompt
    assert torch.equal(x1[:4], x1[:1].expand_as(x1[:4])) and not torch.equal(x1[0], x1[4])
    # steps 0 and 1 once per prompt (the split shares step 1's velocity), steps 2-3 per member: (1 + 1 + 4 * 2) / 4
    assert r.metrics["rollout/nfe_per_sample"] == 2.5
    lp, _ = task.policy.logp(task.module, r, torch.arange(8))
    torch.testing.assert_close(torch.exp(lp - r.old_logp), torch.ones_like(lp), rtol=0, atol=1e-5)


def test_same_noise_window_with_a_coarse_ode_tail(tiny):
    # MixGRPO-Flash's idea (tail_stride 2) on the window above with T = 6: the ODE after the window visits sigma
    # indices 3, 5, 6 (2 steps instead of 3); the window's transitions still re-score to ratio 1
    task = _build(
        tiny["sd3"],
        same_noise_per_group=True,
        plan="independent",
        guidance_scale=3.0,
        num_steps=6,
        plan_kwargs={"train": "window", "window_size": 2, "window_every": 1, "tail_stride": 2},
    )
    task.policy.set_iteration(1)
    r = task.policy.rollout(_records(), 4, [5, 6])
    # steps 0-1 once per prompt, then per member step 2 and the tail 3 -> 5 -> 6: (2 + 4 * 3) / 4 = 3.5, not 4.5
    assert task.policy.last_plan.granularities == (2,) and r.metrics["rollout/nfe_per_sample"] == 3.5
    assert r.mask.all() and r.extras["step"][0].tolist() == [1, 2]
    lp, _ = task.policy.logp(task.module, r, torch.arange(8))
    torch.testing.assert_close(torch.exp(lp - r.old_logp), torch.ones_like(lp), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["sd3", "flux", "wan"])
def test_rollout_is_rank_independent_and_samples_are_pixels(tiny, kind):
    pol = _build(tiny[kind], same_noise_per_group=True).policy
    both = pol.rollout(_records(), 2, [7, 8])
    alone = pol.rollout(_records()[1:], 2, [8])
    torch.testing.assert_close(both.extras["x_next"][2:], alone.extras["x_next"], rtol=0, atol=1e-5)
    s = both.samples[0]
    assert s.shape == ((5, 3, 32, 32) if kind == "wan" else (3, 32, 32))
    assert 0.0 <= float(s.min()) and float(s.max()) <= 1.0
    # same initial noise per group: both members start from one latent, so step 0 inputs agree
    torch.testing.assert_close(both.extras["x_t"][0, 0], both.extras["x_t"][1, 0], rtol=0, atol=0)


def test_reference_and_exact_kl(tiny):
    task = _build(tiny["sd3"])
    pol = task.policy
    r = pol.rollout(_records(), 2, [1, 2])
    idx = torch.arange(4)
    ref = pol.ref_logp(r, idx)
    torch.testing.assert_close(ref, r.old_logp, rtol=0, atol=1e-5)  # LoRA B starts at 0: policy == reference
    with torch.no_grad():
        for name, p in task.module.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
    lp, aux = pol.logp(task.module, r, idx)
    assert aux["kl"].shape == lp.shape and bool((aux["kl"] > 0).all())
    torch.testing.assert_close(pol.ref_logp(r, idx), ref, rtol=0, atol=1e-5)  # adapter disabled = base model


def test_full_finetune_reference_is_a_frozen_copy(tiny):
    task = _build(tiny["flux"], lora_rank=0, guidance_scale=3.5)
    pol = task.policy
    assert pol.ref is not None and not any(p.requires_grad for p in pol.ref.parameters())
    r = pol.rollout(_records(), 2, [1, 2])
    with torch.no_grad():
        next(task.module.parameters()).add_(0.1)
    torch.testing.assert_close(pol.ref_logp(r, torch.arange(4)), r.old_logp, rtol=0, atol=1e-5)
    assert len(pol.state_dict()) == len(task.module.state_dict())


@pytest.mark.parametrize("kind", ["sd3", "flux", "wan"])
def test_lora_round_trips_through_diffusers_load_lora_weights(tiny, kind, tmp_path):
    from diffusers import DiffusionPipeline

    task = _build(tiny[kind])
    pol = task.policy
    with torch.no_grad():
        for name, p in task.module.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
    state = pol.state_dict()
    pol.export(tmp_path)  # what every checkpoint's export/ gets (it calls save_lora)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    fresh = DiffusionPipeline.from_pretrained(tiny[kind])
    fresh.load_lora_weights(str(tmp_path))
    r = pol.rollout(_records(), 2, [5, 6])
    x, s = r.extras["x_t"][:, 0], r.extras["sigma"][:, 0]
    cond = {k[5:]: v for k, v in r.extras.items() if k.startswith("cond_")}
    with torch.no_grad():
        ours = pol.model.velocity(task.module, x, s, cond)
        theirs = pol.model.velocity(fresh.transformer, x, s, cond)
        base = _build(tiny[kind]).policy.model.velocity(_build(tiny[kind]).module, x, s, cond)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base, ours, atol=1e-6)  # the adapter really changed the model
    other = _build(tiny[kind]).policy
    other.load_state_dict(state)  # checkpoint path: peft state back into a fresh adapter
    assert all(torch.equal(other.state_dict()[k], state[k]) for k in state)


def test_missing_model_fails_fast_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(UserError) as err:
        _build("nobody/not-a-model")
    msg = str(err.value)
    assert "\n" not in msg and "nobody/not-a-model" in msg and "local directory" in msg
    assert time.perf_counter() - t0 < 20
    with pytest.raises(UserError, match="not a directory"):
        _build(str(tmp_path / "missing"))


def test_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n\n a dog \n")
    assert read_prompts(str(tmp_path / "p.txt")) == [{"prompt": "a cat"}, {"prompt": "a dog"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "two cats", "count": 2}) + "\n")
    assert read_prompts(str(tmp_path / "p.jsonl")) == [{"prompt": "two cats", "count": 2}]
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(UserError, match="prompt"):
        read_prompts(str(tmp_path / "bad.jsonl"))


def test_registered_and_kwargs_checked(tiny):
    assert "flow" in PIPELINES
    with pytest.raises(ValueError, match="lora_rnak"):
        PIPELINES.check_kwargs("flow", {"lora_rnak": 4})
    with pytest.raises(UserError, match="sde"):
        _build("unused", sde="ode")
    with pytest.raises(UserError, match="model_type"):
        _build(tiny["sd3"], model_type="wan")


def test_prompt_embeddings_cached_in_a_bounded_lru():
    from pipelines.flow.models import FlowModel

    class Counting(FlowModel):
        def __init__(self, **kw):
            super().__init__(None, height=8, width=8, device=torch.device("cpu"), dtype=torch.float32, **kw)
            self.calls = []

        def _encode(self, prompts):
            self.calls.append(list(prompts))
            return {"emb": torch.tensor([[float(len(p)), float(ord(p[0]))] for p in prompts])}  # [B, 2]

    m = Counting(prompt_cache_items=2)
    out = m.encode(["bb", "a", "bb"])
    assert torch.equal(out["emb"], torch.tensor([[2.0, 98.0], [1.0, 97.0], [2.0, 98.0]]))
    assert m.calls == [["a", "bb"]]  # each distinct prompt encoded once
    m.encode(["a"])  # a hit: no call, and "a" becomes the most recent
    m.encode(["ccc"])  # evicts the least recently used, "bb"
    assert m.calls == [["a", "bb"], ["ccc"]] and list(m._cache) == ["a", "ccc"]
    assert torch.equal(m.encode(["bb", "a"])["emb"], torch.tensor([[2.0, 98.0], [1.0, 97.0]]))
    assert m.calls[-1] == ["bb"] and list(m._cache) == ["bb", "a"]
    off = Counting(prompt_cache_items=0)  # no cache: every batch encoded, still correct
    off.encode(["x", "x"])
    off.encode(["x"])
    assert off.calls == [["x"], ["x"]] and not off._cache


def test_prompt_cache_items_is_checked():
    from pipelines.flow.build import check_flow_kwargs

    with pytest.raises(UserError, match=r"pipeline.kwargs.prompt_cache_items \(-1\) must be an integer >= 0"):
        check_flow_kwargs(prompt_cache_items=-1)
