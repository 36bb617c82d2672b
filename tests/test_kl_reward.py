"""KL in the reward on a flow model: the penalty is summed over the denoising steps of each sample (per step)."""

import json
from pathlib import Path

import torch

from mmgrpo.config import load_config
from mmgrpo.trainer import train

ROOT = Path(__file__).resolve().parents[1]
FLOW = str(ROOT / "configs" / "flow" / "sd3_tiny_cpu.yaml")


def test_kl_in_the_reward_per_denoising_step(tmp_path, monkeypatch):
    # LoRA: the reference is the adapter switched off, which is what step 0 rolls out with (LoRA B starts at 0),
    # so its per-step KL is exactly 0; after one update the steps' Gaussians move and the k3 penalty is positive
    monkeypatch.setenv("MMGRPO_CACHE", str(ROOT / ".pytest_cache" / "mmgrpo"))
    torch.set_num_threads(1)
    cfg = load_config(
        FLOW,
        [
            f"run.output_dir={tmp_path}",
            "run.steps=2",
            "run.progress=false",
            "run.report=false",
            "run.checkpoint_every=0",
            "run.device=cpu",
            "run.mixed_precision=no",
            "optim.ema_decay=0.0",
            "pipeline.kwargs.prompts=[a red circle, a blue square]",
            "pipeline.kwargs.max_sequence_length=8",
            "sample.batch_size=8",
            "sample.group_size=4",
            "optim.lr=1e-2",
            "algo.kl_reward_coef=1.0",
            "algo.kl_reward_kind=k3",
        ],
    )
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl/reward_penalty"] == 0.0
    assert rows[1]["kl/reward_penalty"] > 0 and all(r["skipped"] == 0.0 for r in rows)
