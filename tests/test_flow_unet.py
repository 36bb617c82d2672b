"""Epsilon-prediction UNets (SD 1.x / SDXL) in the flow policy: the DDIM table equals diffusers' DDIMScheduler, ratio 1
before any update (CFG on), LoRA round trip through load_lora_weights, model/step mismatches fail in one line."""

import pytest
import torch

import pipelines.flow  # noqa: F401
from mmgrpo.errors import UserError
from pipelines.flow import sde
from pipelines.flow.build import build_flow, check_flow_kwargs
from pipelines.flow.tiny import save_tiny
from pipelines.flow.unet import ddim_schedule

RECORDS = [{"prompt": "a red circle"}, {"prompt": "a blue square"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_unet")
    return {m: save_tiny(m, root / m) for m in ("sd", "sdxl")}


def _build(path, **kw):
    base = {
        "seed": 0,
        "device": torch.device("cpu"),
        "model": path,
        "prompts": ["a red circle"],
        "resolution": 32,
        "num_steps": 4,
        "sde": "ddim",
        "noise_level": 1.0,
        "lora_rank": 4,
        "guidance_scale": 1.0,
    }
    torch.manual_seed(0)
    return build_flow(**{**base, **kw})


def test_ddim_table_steps_exactly_as_diffusers_ddim_scheduler(tiny):
    from diffusers import DDIMScheduler, DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny["sd"])
    ts, table, _ = ddim_schedule(pipe.scheduler.config, 4)
    ref = DDIMScheduler.from_config(pipe.scheduler.config)
    assert not ref.config.clip_sample  # SD 1.5 ships clip_sample false in its PNDM config
    ref.set_timesteps(4)
    # SD 1.5 config: leading spacing, offset 1 -> t = 751, 501, 251, 1; the last step goes to alphas_cumprod[0]
    assert ts.tolist() == [751, 501, 251, 1] == ref.timesteps.tolist()
    assert table[-1] == ref.alphas_cumprod[0] and not ref.config.set_alpha_to_one
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    for i, t in enumerate(ts):
        eps, noise = torch.randn_like(x), torch.randn_like(x)
        want = ref.step(eps, t, x, eta=1.0, variance_noise=noise).prev_sample
        out = sde.ddim_step(x, eps, table[i], table[i + 1], eta=1.0)
        torch.testing.assert_close(out.mean + out.std[:, None, None, None] * noise, want, rtol=1e-5, atol=1e-5)
        x = want


def test_set_alpha_to_one_makes_the_last_step_deterministic(tiny):
    # ddpo-pytorch / TRL clamp prev_timestep to >= 0 before their `prev_timestep >= 0` test, so they never reach
    # final_alpha_cumprod; with set_alpha_to_one=True the last step must go to alpha_bar = 1 (std 0), as DDIMScheduler
    from diffusers import DiffusionPipeline

    cfg = dict(DiffusionPipeline.from_pretrained(tiny["sd"]).scheduler.config, set_alpha_to_one=True)
    _, table, acp = ddim_schedule(cfg, 4)
    assert table[-1] == 1.0 and table[-2] == acp[1]
    std = sde.step_std("ddim", table[:-1], table[1:], noise_level=1.0)
    assert std[-1] == 0 and bool((std[:-1] > 0).all())


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_ratio_is_one_before_any_update_with_cfg(tiny, kind):
    task = _build(tiny[kind], guidance_scale=3.0, plan="independent", plan_kwargs={"train": "all"})
    pol = task.policy
    r = pol.rollout(RECORDS, 2, [3, 4])
    assert r.old_logp.shape == (4, 4) and len(r.samples) == 4 and r.samples[0].shape == (3, 32, 32)
    steps = pol.model.timestep(r.extras["sigma"][0])  # the alpha_bar each step saw -> the DDIM timesteps
    assert steps.tolist() == [751, 501, 251, 1]
    logp, _ = pol.logp(task.module, r, torch.arange(4))
    trained = r.mask
    torch.testing.assert_close(logp[trained], r.old_logp[trained], rtol=0, atol=1e-5)
    torch.testing.assert_close(pol.ref_logp(r, torch.arange(4))[trained], r.old_logp[trained], rtol=0, atol=1e-5)
    # a second rollout with the same seeds is the same rollout (per-sample generators)
    torch.testing.assert_close(pol.rollout(RECORDS, 2, [3, 4]).extras["x_next"], r.extras["x_next"])


def test_window_plan_runs_ddim_with_eta_zero_outside_the_window(tiny):
    task = _build(tiny["sd"], plan="independent", plan_kwargs={"train": "window", "window_size": 2, "window_every": 1})
    r = task.policy.rollout(RECORDS[:1], 2, [0])
    assert r.mask.shape == (2, 2) and bool(r.mask.all())
    # the two samples share the initial noise only through the seeds: outside the window they evolve by DDIM eta 0
    assert torch.isfinite(torch.stack(r.samples)).all()


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_lora_round_trips_through_diffusers_load_lora_weights(tiny, kind, tmp_path):
    from diffusers import DiffusionPipeline

    task = _build(tiny[kind])
    pol = task.policy
    with torch.no_grad():
        for name, p in task.module.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
    pol.export(tmp_path)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    fresh = DiffusionPipeline.from_pretrained(tiny[kind])
    fresh.load_lora_weights(str(tmp_path))
    r = pol.rollout(RECORDS, 2, [5, 6])
    x, s = r.extras["x_t"][:, 0], r.extras["sigma"][:, 0]
    cond = {k[5:]: v for k, v in r.extras.items() if k.startswith("cond_")}
    with torch.no_grad():
        ours = pol.model.velocity(task.module, x, s, cond)
        theirs = pol.model.velocity(fresh.unet, x, s, cond)
        base = pol.model.velocity(DiffusionPipeline.from_pretrained(tiny[kind]).unet, x, s, cond)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base, ours, atol=1e-6)  # the adapter really changed the UNet


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"sde": "ddim", "model_type": "sd3"}, "does not fit model_type 'sd3'"),
        ({"sde": "flow_grpo", "model_type": "sd"}, "does not fit model_type 'sd'"),
        ({"sde": "ddim", "objective": "nft"}, "sde ddim trains with objective grpo"),
        ({"sde": "ddim", "step_weights": "guard"}, "step_weights 'guard'"),
        ({"sde": "ode"}, "must be a stochastic step"),
    ],
)
def test_ddim_misuse_fails_before_loading(kw, match):
    with pytest.raises(UserError, match=match) as err:
        check_flow_kwargs(**kw)
    assert "\n" not in str(err.value)


def test_flow_step_on_a_unet_fails_after_detection_in_one_line(tiny):
    with pytest.raises(UserError, match="does not fit model_type 'sd'") as err:
        _build(tiny["sd"], sde="flow_grpo")
    assert "\n" not in str(err.value)
