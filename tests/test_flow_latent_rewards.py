"""Rewards that read latents (input "latent"): flow rollouts skip the VAE, the gallery decodes only what it shows,
FLUX's packed latents reach the reward unpacked, and GRPO trains on a latent reward without one rollout decode."""

import json
from pathlib import Path

import pytest
import torch

import pipelines.flow  # noqa: F401  registers the "flow" pipeline
from mmgrpo.config import load_config
from mmgrpo.errors import UserError
from mmgrpo.trainer import train
from pipelines.flow.build import build_flow
from pipelines.flow.models import FlowModel
from pipelines.flow.policy import FlowPolicy
from pipelines.flow.tiny import save_tiny
from rewards.api import INPUTS, REWARDS, FunctionReward

ROOT = Path(__file__).resolve().parents[1]
RECORDS = [{"prompt": "a red circle"}, {"prompt": "a blue square"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {m: save_tiny(m, root / m) for m in ("sd3", "flux")}


@pytest.fixture
def latent_mean(monkeypatch):
    """A latent reward registered for one test: the mean of each final latent (a stand-in for a latent reward model)."""
    monkeypatch.setattr(REWARDS, "_items", dict(REWARDS._items))
    monkeypatch.setattr(REWARDS, "_meta", dict(REWARDS._meta))

    def score(samples, prompts):
        assert all(tuple(s.shape) == (4, 16, 16) for s in samples), "latents [C, h, w] expected, not pixels"
        return [float(s.float().mean()) for s in samples]

    REWARDS.register(
        "test_latent_mean", lambda: FunctionReward(score, name="test_latent_mean", input="latent"), input="latent"
    )
    return "test_latent_mean"


@pytest.fixture
def rollout_decodes(monkeypatch):
    """Counts latents decoded while FlowPolicy.rollout runs (the gallery's decodes are not counted)."""
    seen = {"in_rollout": False, "decoded": 0}
    decode, rollout = FlowModel.decode, FlowPolicy.rollout

    def counting_decode(self, x, batch_size=8):
        if seen["in_rollout"]:
            seen["decoded"] += len(x)
        return decode(self, x, batch_size)

    def flagged_rollout(self, *args, **kw):
        seen["in_rollout"] = True
        try:
            return rollout(self, *args, **kw)
        finally:
            seen["in_rollout"] = False

    monkeypatch.setattr(FlowModel, "decode", counting_decode)
    monkeypatch.setattr(FlowPolicy, "rollout", flagged_rollout)
    return seen


def _build(path, **kw):
    torch.manual_seed(0)
    return build_flow(
        seed=0,
        device=torch.device("cpu"),
        model=path,
        prompts=[r["prompt"] for r in RECORDS],
        resolution=32,
        num_steps=3,
        max_sequence_length=8,
        lora_rank=4,
        guidance_scale=1.0,
        same_noise_per_group=True,
        **kw,
    )


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_latent_samples_skip_the_vae_and_the_gallery_decodes_them(tiny, kind, rollout_decodes):
    assert "latent" in INPUTS
    lat = _build(tiny[kind], reward_inputs=["latent"]).policy
    pix = _build(tiny[kind]).policy
    r_lat = lat.rollout(RECORDS, 2, [5, 6])
    assert rollout_decodes["decoded"] == 0
    r_pix = pix.rollout(RECORDS, 2, [5, 6])
    assert rollout_decodes["decoded"] == 4  # the pixel policy decodes every sample in its rollout
    assert [tuple(s.shape) for s in r_lat.samples] == [(4, 16, 16)] * 4  # FLUX: unpacked
    torch.testing.assert_close(r_lat.extras["x_next"], r_pix.extras["x_next"], rtol=0, atol=0)
    gallery = lat.gallery(r_lat, RECORDS, torch.arange(4.0))
    assert len(gallery) == 4
    for item, pixels in zip(gallery, r_pix.samples):
        assert item["image"].shape == (3, 32, 32)
        torch.testing.assert_close(item["image"], pixels, rtol=0, atol=1e-6)


def test_reward_inputs_are_checked(tiny):
    with pytest.raises(UserError, match="reward_inputs"):
        _build(tiny["sd3"], reward_inputs=["pixels"])
    with pytest.raises(UserError, match="only latent"):
        _build(tiny["sd3"], reward_inputs=["latent", "image"])
    pol = _build(tiny["sd3"], reward_inputs="latent").policy
    assert not pol.decode_samples
    pol.set_reward_inputs(["image", "text"])
    assert pol.decode_samples
    with pytest.raises(ValueError, match="cannot be mixed"):
        pol.set_reward_inputs(["latent", "image"])


def test_grpo_trains_on_a_latent_reward_without_decoding_rollouts(tmp_path, latent_mean, rollout_decodes, monkeypatch):
    monkeypatch.setenv("MMGRPO_CACHE", str(ROOT / ".pytest_cache" / "mmgrpo"))
    cfg = load_config(
        ROOT / "configs" / "flow" / "sd3_tiny_cpu.yaml",
        [
            f"run.output_dir={tmp_path}",
            "run.steps=2",
            "run.progress=false",
            "run.report=false",
            "run.device=cpu",
            "run.checkpoint_every=0",
            "pipeline.kwargs.num_steps=3",
            f"rewards=[{{name: {latent_mean}}}]",
            "optim.lr=1e-2",
        ],
    )
    train(cfg)  # no pipeline.kwargs.reward_inputs: the engine tells the policy what the rewards read
    assert rollout_decodes["decoded"] == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss/policy"])) for r in rows)
    assert rows[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    assert f"reward/{latent_mean}/mean" in rows[0]
    pngs = sorted((tmp_path / "gallery").rglob("*.png"))  # the gallery still shows decoded images
    assert pngs
