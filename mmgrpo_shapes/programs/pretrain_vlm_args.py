"""The command-line flags of pretrain_vlm (kept apart so the training script stays one responsibility)."""

import argparse

from mmgrpo_shapes.programs.tiny_vlm import add_architecture_args
from mmgrpo_shapes.vqa import QUESTION_TYPES

TASKS = ("vqa", "grounding")


def add_vqa_args(p) -> None:
    """The VQA-only flags: the dense tower targets (stage 1 and the joint loss), the SFT question types, the key weight."""
    p.add_argument(
        "--dense-position",
        action="store_true",
        help="vqa with --dense-weight: the dense head also reads each token's row and column (dense.py)",
    )
    p.add_argument(
        "--dense-weight",
        type=float,
        default=0.0,
        help="vqa: weight of the per-token colour/shape loss on the tower's tokens (mmgrpo_shapes/dense.py)",
    )
    p.add_argument(
        "--tower-steps",
        type=int,
        default=0,
        help="vqa with --dense-weight: steps of stage 1, the vision tower alone on the dense targets",
    )
    p.add_argument("--tower-batch", type=int, default=64, help="images per stage-1 step")
    p.add_argument("--tower-lr", type=float, default=3e-3, help="stage-1 AdamW learning rate")
    p.add_argument(
        "--sft-types",
        nargs="+",
        choices=QUESTION_TYPES,
        default=None,
        help="vqa: train only on these question types (default all); the others are left for RL to learn from reward",
    )
    p.add_argument(
        "--blank-types",
        nargs="+",
        choices=QUESTION_TYPES,
        default=(),
        help="vqa: these question types on blank images (the base learns their format and answer prior, not to read)",
    )
    p.add_argument("--where", type=float, default=0.0, help="vqa: fraction of SFT records asked one object's cell")
    p.add_argument("--list-think", nargs="?", const="marks", choices=("marks", "flags"), default=None,
                   help="vqa: count, existence and arithmetic think the scene's object list (vqa_think.objects_think); "
                   "'flags' follows each mark with whether it counts for the question (vqa_think.mark_flag)")  # fmt: skip
    p.add_argument("--key-weight", type=float, default=1.0,
                   help="vqa: SFT loss weight of the answer tokens and the think's digits (vqa_think.key_token_weights)")  # fmt: skip


def parse_args(argv: list[str] | None = None, description: str | None = None):
    """pretrain_vlm's flags, checked; --out and --pixels get their per-task defaults."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=TASKS, required=True)
    p.add_argument(
        "--out",
        default=None,
        help="save_pretrained folder of the best EMA model (default assets/shapes-vlm or assets/shapes-video)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the model already in --out")
    p.add_argument("--minutes", type=float, default=45.0, help="training wall-clock budget")
    p.add_argument("--eval-minutes", type=float, default=5.0, help="validation (and best-checkpoint) interval")
    p.add_argument("--steps", type=int, default=0,
                   help="SFT steps budget in place of --minutes (the same run on any machine; 0: use --minutes)")  # fmt: skip
    p.add_argument("--eval-every", type=int, default=500, help="with --steps: validation interval in steps")
    p.add_argument("--val-n", type=int, default=96)
    p.add_argument("--test-n", type=int, default=300, help="test records for the final report (0: skip)")
    p.add_argument("--ceiling", type=float, default=None,
                   help="never keep a checkpoint whose val score is above this (leaves room for RL)")  # fmt: skip
    p.add_argument("--pool", type=int, default=3000, help="grounding: training clips cycled (cached once)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vision-lr-mult", type=float, default=1.0, help="the vision tower's lr / --lr")
    add_vqa_args(p)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--ema", type=float, default=0.99)
    add_architecture_args(p)
    p.add_argument(
        "--pixels",
        type=int,
        default=None,
        help="min = max pixels per image / frame (default 112*112 for vqa: 16 tokens; 56*56 for grounding)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 0 or args.eval_every < 1:
        bad = (
            ("--steps", args.steps, "0 or more") if args.steps < 0 else ("--eval-every", args.eval_every, "1 or more")
        )
        p.error(f"{bad[0]} is {bad[1]}; give {bad[2]}")
    args.out = args.out or f"assets/shapes-{'vlm' if args.task == 'vqa' else 'video'}"
    args.pixels = args.pixels or (112 * 112 if args.task == "vqa" else 56 * 56)
    return args
