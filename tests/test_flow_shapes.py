"""The flow pipeline on ShapesWorld's pixel-space model format (no VAE): load, exact re-scoring, two GRPO steps."""

import json

import pytest
import torch

from mmgrpo.config import load_config
from mmgrpo.trainer import train
from pipelines.shapes import pretrain_t2i as pt


@pytest.fixture(scope="module")
def tiny_shapes_dir(tmp_path_factory):
    """A random pixel-space model of the shipped layout, small enough for CPU tests (built, saved, reloaded)."""
    torch.manual_seed(0)
    tok = pt.build_tokenizer()
    transformer, text_encoder = pt.build_models(tok, resolution=32, patch_size=8, width=32, depth=1, head_dim=16,
                                                text_width=32, text_layers=1)
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = pt.ShapesT2I(transformer=transformer, text_encoder=text_encoder, tokenizer=tok,
                         scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
                         config={"space": "pixel", "resolution": 32, "shift": 1.0, "guidance_scale": 2.0})
    out = tmp_path_factory.mktemp("shapes") / "model"
    pt.save_model(out, model)
    return out


def _cfg(tmp_path, model_dir, *extra):
    return load_config(None, [f"run.output_dir={tmp_path}", "run.steps=2", "run.progress=false", "run.report=false",
                              "pipeline.name=flow", f"pipeline.kwargs.model={model_dir}",
                              "pipeline.kwargs.data=shapes:train:single_object,colors",
                              "pipeline.kwargs.resolution=32",
                              "pipeline.kwargs.num_steps=4", "pipeline.kwargs.guidance_scale=2.0",
                              "pipeline.kwargs.lora_rank=4", "sample.batch_size=8", "sample.group_size=4",
                              "algo.micro_batch_size=8", "optim.lr=1e-2",
                              "rewards=[{name: shapes_geneval, kwargs: {mode: partial}}]", *extra])


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

    code = main(["train", "configs/toy_count.yaml", f"run.output_dir={tmp_path}", "pipeline.name=flow",
                 f"pipeline.kwargs={{model: {tiny_shapes_dir}, prompts: [a red circle], resolution: 64}}",
                 "sample.batch_size=4", "sample.group_size=4", "rewards=[{name: shapes_geneval}]"])
    assert code == 2
    assert "must be 32 for this pixel-space model" in capsys.readouterr().err
