"""ShapesWorld grounding demo: held-out mIoU, answer format and R@0.5 before and after training a recipe on CPU.

The scores are `mmgrpo eval`'s (mmgrpo.evaluate.evaluate: the eval clips, group_size samples each at the recipe's
temperature, no injected ground truth), for the base weights (ckpt=none) and the last checkpoint of the run.

Run: OMP_NUM_THREADS=1 python -m pipelines.video.demo [configs/video/shapes_grounding.yaml] [key=value overrides...]
"""

import sys
import time

import pipelines.video  # noqa: F401  registers "video" until pipelines/__init__ imports it
from mmgrpo.config import load_config
from mmgrpo.evaluate import evaluate
from mmgrpo.trainer import train

KEYS = {"temporal_iou": "mIoU", "format": "format", "r@0.5": "R@0.5"}
"""reward column -> printed name (the grounding recipe's rewards)"""


def scores(table: dict[str, dict[str, float]]) -> dict[str, float]:
    """The demo's numbers from an `evaluate` table: the "all" row's reward means, renamed."""
    row = table["all"]
    return {name: row[key] for key, name in KEYS.items() if key in row}


def line(before: dict[str, float], after: dict[str, float]) -> str:
    """'mIoU 0.174 -> 0.276 (+0.102)  format ...' for every score both sides have."""
    return "  ".join(
        f"{k} {before[k]:.3f} -> {after[k]:.3f} ({after[k] - before[k]:+.3f})" for k in before if k in after
    )


def main(argv: list[str]) -> None:
    path = argv[0] if argv and argv[0].endswith(".yaml") else "configs/video/shapes_grounding.yaml"
    cfg = load_config(path, [a for a in argv if "=" in a])
    before = scores(evaluate(cfg, "none"))
    print(f"before (ckpt=none): {before}", flush=True)
    t0 = time.perf_counter()
    train(cfg)
    minutes = (time.perf_counter() - t0) / 60
    after = scores(evaluate(cfg, "latest"))
    print(f"eval {line(before, after)}  in {cfg.run.steps} steps, {minutes:.1f} minutes of training")


if __name__ == "__main__":
    main(sys.argv[1:])
