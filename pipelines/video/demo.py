"""ShapesWorld grounding demo: mean temporal IoU of the held-out clips before and after training a recipe on CPU.

Run: python -m pipelines.video.demo [configs/video/shapes_grounding.yaml] [key=value overrides...]
"""

import sys
import time

import torch

import pipelines.video  # noqa: F401  registers "video" until pipelines/__init__ imports it
from mmgrpo.config import load_config
from mmgrpo.trainer import train
from rewards import load


@torch.no_grad()
def grounding_miou(policy, records: list[dict], *, samples: int = 4, seed: int = 1234) -> float:
    """Mean temporal IoU of `samples` sampled answers per record, with ground-truth injection switched off."""
    inject, policy.m.inject_ground_truth = policy.m.inject_ground_truth, False
    try:
        iou = load("temporal_iou")
        scores = []
        for i, rec in enumerate(records):
            r = policy.rollout([rec], samples, [seed + i])
            scores += iou(r.samples, spans=[rec["spans"]] * samples).tolist()
    finally:
        policy.m.inject_ground_truth = inject
    return sum(scores) / max(len(scores), 1)


def main(argv: list[str]) -> None:
    from pipelines.video.build import build_video

    path = argv[0] if argv and argv[0].endswith(".yaml") else "configs/video/shapes_grounding.yaml"
    overrides = [a for a in argv if "=" in a]
    cfg = load_config(path, overrides)
    task = build_video(seed=cfg.run.seed, device=torch.device("cpu"), **cfg.pipeline.kwargs)
    before = grounding_miou(task.policy, task.eval_data)
    t0 = time.perf_counter()
    train(cfg)
    minutes = (time.perf_counter() - t0) / 60
    task.policy.load_state_dict(_last_weights(cfg))
    after = grounding_miou(task.policy, task.eval_data)
    print(f"eval mIoU before {before:.3f}  after {after:.3f}  (+{after - before:.3f}) "
          f"in {cfg.run.steps} steps, {minutes:.1f} CPU-minutes")


def _last_weights(cfg) -> dict[str, torch.Tensor]:
    from pathlib import Path

    from safetensors.torch import load_file

    from mmgrpo import checkpoint

    last = checkpoint.list_checkpoints(Path(cfg.run.output_dir) / "checkpoints")[-1]
    return load_file(str(last / "weights.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1:])
