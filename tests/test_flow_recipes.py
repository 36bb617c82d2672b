"""Every configs/flow recipe validates, and trains two steps on a tiny random model of the same diffusers class.

Overrides swap the hub model for `tiny:<type>` (built from configs, loaded with from_pretrained) and model rewards
for JPEG compressibility; everything else (plan, SDE kind, LoRA, CFG, k_chunk) is the recipe's own.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pipelines.flow  # noqa: F401  registers the "flow" pipeline
from mmgrpo import checkpoint
from mmgrpo.config import load_config
from mmgrpo.trainer import train
from pipelines.flow.plan import make_plan

RECIPES = sorted((Path(__file__).resolve().parents[1] / "configs" / "flow").glob("*.yaml"))


def _tiny_type(model: str) -> str:
    if model.startswith("tiny:"):
        return model[5:]
    if model.startswith("assets/shapes"):
        return "sd3"  # the ShapesWorld model is an SD3 transformer (its own format is tested in test_flow_shapes)
    if "stable-diffusion-xl" in model:
        return "sdxl"
    if "stable-diffusion-v1" in model:
        return "sd"
    return {"stabilityai": "sd3", "black-forest-labs": "flux", "Wan-AI": "wan"}[model.split("/")[0]]


def _overrides(cfg, out: Path) -> list[str]:
    kw = cfg.pipeline.kwargs
    kind = _tiny_type(kw["model"])
    video = kind == "wan"
    reward = (
        "[{name: video_frames, kwargs: {image_reward: jpeg_compressibility, num_frames: 2}}]"
        if video
        else "[{name: jpeg_compressibility}]"
    )
    if len(cfg.rewards) > 1:  # several rewards (GDPO): keep two, one of them Pref-GRPO's pairwise win rate
        reward = (
            "[{name: jpeg_compressibility, weight: 1.0}, {name: pairwise, weight: 0.5, "
            "kwargs: {base: jpeg_incompressibility}}]"
        )
    plan_kw = dict(kw.get("plan_kwargs") or {})
    if kw.get("plan") == "tree":
        plan_kw = {"split_steps": [0, 2], "fanout": 2}
    if plan_kw.get("train") == "window":
        plan_kw.update(window_size=2, window_every=1)
    if kw.get("plan") == "fast":
        plan_kw["branch_range"] = [0, 2]
    if kw.get("plan") == "singular":  # 4 tiny steps: branch inside them, keep the recipe's granularities
        plan_kw["branch_steps"] = [0, 1]
    plan_kw_yaml = "{" + ", ".join(f"{k}: {v}" for k, v in plan_kw.items()) + "}"
    return [
        f"run.output_dir={out}",
        "run.steps=2",
        "run.progress=false",
        "run.report=false",
        "run.resume=never",
        "run.mixed_precision=no",
        "run.device=cpu",
        "run.checkpoint_every=0",
        "optim.ema_decay=0.0",
        f"pipeline.kwargs.model=tiny:{kind}",
        "pipeline.kwargs.data=null",
        "pipeline.kwargs.prompts=[a red circle, a blue square]",
        "pipeline.kwargs.resolution=32",
        "pipeline.kwargs.num_frames=5",
        "pipeline.kwargs.num_steps=4",
        "pipeline.kwargs.max_sequence_length=8",
        "pipeline.kwargs.torch_dtype=null",
        "pipeline.kwargs.gradient_checkpointing=false",
        f"pipeline.kwargs.plan_kwargs={plan_kw_yaml}",
        "sample.batch_size=8",
        "sample.group_size=4",
        "algo.micro_batch_size=4",
        "algo.num_minibatches=1",
        "algo.inner_epochs=1",
        "optim.lr=1e-2",
        f"rewards={reward}",
    ]


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates(recipe):
    cfg = load_config(recipe)
    assert cfg.pipeline.name == "flow"
    assert cfg.sample.batch_size % cfg.sample.group_size == 0
    text = recipe.read_text()
    assert text.startswith("#") and "\n# Run:" in text, "recipes open with a comment: what, how to run, what to expect"
    # the recipe's own plan (the two-step test below shrinks it to 4 steps) fits its schedule and group size
    kw, g = cfg.pipeline.kwargs, cfg.sample.group_size
    t = kw.get("num_steps", 10)
    plan, trained = make_plan(
        kw.get("plan", "independent"),
        num_steps=t,
        group_size=g,
        sde=kw.get("sde", "flow_grpo"),
        iteration=0,
        same_noise=kw.get("same_noise_per_group", False),
        seeds=[0, 1],
        **(kw.get("plan_kwargs") or {}),
    )
    plan.check()
    assert plan.group_size == g and trained.shape == (2 * g, t) and bool(trained.any(1).all())


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_trains_two_steps_on_tiny_model(recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("MMGRPO_CACHE", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "mmgrpo"))
    cfg = load_config(recipe, _overrides(load_config(recipe), tmp_path))
    out = train(cfg)
    rows = [__import__("json").loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    first = rows[0]
    if cfg.algo.loss == "nft":  # likelihood-free: no ratio; the implicit policies start at the old one
        assert first["nft/old_deviation"] == pytest.approx(0.0, abs=1e-8)
    else:
        # one mini-batch, one epoch: every log-prob is taken before the only optimizer step, so the ratio is 1
        assert first["ratio/mean"] == pytest.approx(1.0, abs=1e-5)
        assert first["clip/upper_frac"] == 0.0 and first["clip/lower_frac"] == 0.0
        # the per-step monitor (issue 6 item 5): mean, std and both clip fractions for every trained step
        steps = sorted({k.split("/")[1] for k in first if k.startswith("ratio/k")})
        assert steps and all(f"ratio/{s}/{x}" in first for s in steps for x in ("std", "clip_upper", "clip_lower"))
        assert all(first[f"ratio/{s}/clip_upper"] == 0.0 for s in steps)
    assert all(torch.isfinite(torch.tensor(r["loss/policy"])) for r in rows)
    if len(cfg.rewards) > 1:  # both scored every step; P_ij + P_ji = 1, so a group's win rates average exactly 0.5
        assert all(
            r["reward/pairwise/mean"] == pytest.approx(0.5) and "reward/jpeg_compressibility/mean" in r for r in rows
        )
    weights = load_file(str(checkpoint.list_checkpoints(tmp_path / "checkpoints")[-1] / "weights.safetensors"))
    task_module_init = _initial_weights(cfg)
    # SAGE's moving anchor is saved beside the weights ("anchor." keys): not a trainable weight of the module
    changed = [k for k in weights if not k.startswith("anchor.") and not torch.equal(weights[k], task_module_init[k])]
    assert changed, "two updates changed no trainable weight"
    assert out["run_dir"] == str(tmp_path)


def _initial_weights(cfg) -> dict[str, torch.Tensor]:
    from mmgrpo.plugins import PIPELINES

    torch.manual_seed(cfg.run.seed)
    task = PIPELINES.get("flow")(seed=cfg.run.seed, device=torch.device("cpu"), **cfg.pipeline.kwargs)
    return task.policy.state_dict()


@pytest.mark.parametrize(
    "override,match",
    [
        ("pipeline.kwargs.plan_kwargs={trian: all}", "takes no keyword 'trian'"),
        ("pipeline.kwargs.sde=ode", "must be a stochastic step"),
        ("pipeline.kwargs.plan_kwargs={sde_steps: 1, branch_range: [0, 9]}", "branch_range"),
    ],
)
def test_config_command_checks_flow_kwargs_without_loading_a_model(capsys, override, match):
    from mmgrpo.cli import main as cli_main

    assert cli_main(["config", str(RECIPES[0].parent / "shapes_t2i.yaml"), override]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1 and "Traceback" not in err
