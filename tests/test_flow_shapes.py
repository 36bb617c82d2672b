"""The flow pipeline on ShapesWorld's pixel-space model format (no VAE): load, exact re-scoring, two GRPO steps."""

import json

import pytest
import torch

from mmgrpo.config import load_config
from mmgrpo.trainer import train
from mmgrpo_shapes.programs import t2i_model as pt


@pytest.fixture(scope="module")
def tiny_shapes_dir(tmp_path_factory):
    """A random pixel-space model of the shipped layout, small enough for CPU tests (built, saved, reloaded)."""
    torch.manual_seed(0)
    tok = pt.build_tokenizer()
    transformer, text_encoder = pt.build_models(
        tok, resolution=32, patch_size=8, width=32, depth=1, head_dim=16, text_width=32, text_layers=1
    )
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = pt.ShapesT2I(
        transformer=transformer,
        text_encoder=text_encoder,
        tokenizer=tok,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        config={"space": "pixel", "resolution": 32, "shift": 1.0, "guidance_scale": 2.0},
    )
    out = tmp_path_factory.mktemp("shapes") / "model"
    pt.save_model(out, model)
    return out


def _cfg(tmp_path, model_dir, *extra):
    return load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "run.steps=2",
            "run.progress=false",
            "run.report=false",
            "pipeline.name=flow",
            f"pipeline.kwargs.model={model_dir}",
            "pipeline.kwargs.data=shapes:train:single_object,colors",
            "pipeline.kwargs.resolution=32",
            "pipeline.kwargs.num_steps=4",
            "pipeline.kwargs.guidance_scale=2.0",
            "pipeline.kwargs.lora_rank=4",
            "sample.batch_size=8",
            "sample.group_size=4",
            "algo.micro_batch_size=8",
            "optim.lr=1e-2",
            "rewards=[{name: shapes_geneval, kwargs: {mode: partial}}]",
            *extra,
        ],
    )


def test_shapes_model_trains_with_exact_first_ratio(tmp_path, tiny_shapes_dir):
    from mmgrpo.setup import build_task

    cfg = _cfg(tmp_path, tiny_shapes_dir)
    before = {k: v.clone() for k, v in build_task(cfg, torch.device("cpu")).policy.state_dict().items()}
    out = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-5) and rows[0]["clip/upper_frac"] == 0.0
    assert torch.isfinite(torch.tensor(out["metrics"]["loss/policy"]))
    from safetensors.torch import load_file

    after = load_file(str(tmp_path / "checkpoints" / "step_00000002" / "weights.safetensors"))
    assert after.keys() == before.keys()
    assert any(not torch.equal(after[k], before[k]) for k in after if "lora_B" in k)


def test_shapes_model_rejects_another_resolution(tmp_path, tiny_shapes_dir, capsys):
    from mmgrpo.cli import main

    code = main(
        [
            "train",
            "configs/toy_count.yaml",
            f"run.output_dir={tmp_path}",
            "pipeline.name=flow",
            f"pipeline.kwargs={{model: {tiny_shapes_dir}, prompts: [a red circle], resolution: 64}}",
            "sample.batch_size=4",
            "sample.group_size=4",
            "rewards=[{name: shapes_geneval}]",
        ]
    )
    assert code == 2
    assert "must be 32 for this pixel-space model" in capsys.readouterr().err


def test_nft_objective_trains_on_forward_process_points_of_the_clean_samples(tmp_path, tiny_shapes_dir):
    """DiffusionNFT through the flow policy: x_t - t * target recovers each sample, v_old is the untrained model's
    CFG-free velocity there (so the first update starts at v = v_old), and two steps change the adapter."""
    from mmgrpo.setup import build_task

    cfg = _cfg(
        tmp_path,
        tiny_shapes_dir,
        "pipeline.kwargs.objective=nft",
        "pipeline.kwargs.nft_steps=2",
        "pipeline.kwargs.noise_level=0.0",
        "algo.loss=nft",
    )
    policy = build_task(cfg, torch.device("cpu")).policy
    prompts = [{"prompt": "a red circle"}, {"prompt": "a blue square"}]
    ro = policy.rollout(prompts, 4, [3, 4])
    ex = ro.extras
    assert ex["x_t"].shape == (8, 2, 3, 32, 32) and ro.mask.all() and ro.old_logp.shape == (8, 2)
    t = ex["sigma"].view(8, 2, 1, 1, 1)
    x0 = ex["x_t"] - t * ex["nft_target"]  # x_t = (1 - t) x0 + t eps, target = eps - x0
    images = torch.stack(ro.samples)  # [8, 3, 32, 32] = clamp(x0 / 2 + 0.5)
    for j in range(2):
        assert torch.allclose((x0[:, j] / 2 + 0.5).clamp(0, 1), images, atol=1e-5)
    assert set(ex["sigma"].flatten().tolist()) <= set(policy.sigmas[:-1].tolist())
    _, aux = policy.logp(policy.transformer, ro, torch.arange(8))
    assert torch.allclose(aux["loss_kwargs"]["velocity"], ex["nft_v_old"], atol=1e-5)
    out = train(cfg)
    assert torch.isfinite(torch.tensor(out["metrics"]["loss/policy"]))
    from safetensors.torch import load_file

    after = load_file(str(tmp_path / "checkpoints" / "step_00000002" / "weights.safetensors"))
    assert any(not torch.equal(after[k], v) for k, v in policy.state_dict().items() if "lora_B" in k)


def test_unknown_objective_is_a_one_line_error(tmp_path, tiny_shapes_dir):
    from mmgrpo.errors import UserError
    from mmgrpo.setup import build_task

    with pytest.raises(UserError, match="objective \\('dpo'\\) must be grpo"):
        build_task(_cfg(tmp_path, tiny_shapes_dir, "pipeline.kwargs.objective=dpo"), torch.device("cpu"))
