"""Does a ShapesWorld video model's vision tower know which way an object moves? A softmax probe on one temporal
group's merged tokens (plus the object's colour, one-hot) predicts the direction of every moving (group, colour) cell;
fitted on train clips, scored on test clips (assets/README.md: 0.98 on the shipped model's tower, while its language
model writes the wrong arrows).

Run: python -m mmgrpo_shapes.programs.direction_probe assets/shapes-video --train-n 300 --test-n 100
"""

import argparse
import json
from typing import Any

import torch
from torch import Tensor, nn

from mmgrpo_shapes.programs.pretrain_video import NUM_FRAMES, dense_states
from mmgrpo_shapes.programs.video_probe import frame_encoder, pipeline_records, tower_features
from mmgrpo_shapes.scenes import COLORS

MOVING = 2
"""index of the first "moving <direction>" state in pretrain_video.STATES (absent, still, then the four moves)"""


def moving_cells(model: nn.Module, encode, recs: list[dict[str, Any]]) -> tuple[Tensor, Tensor]:
    """(x [N, M * D + C], y [N]): per moving (group, colour) cell of each clip, the group's tower tokens and the
    colour one-hot; y = the direction's index in video.DIRECTIONS."""
    xs, ys = [], []
    for rec in recs:
        feats = tower_features(model, encode(rec)).flatten(1)  # [G, M * D]
        states = dense_states(rec["timeline"], rec["num_frames"])  # [G, C]
        for g, c in (states >= MOVING).nonzero().tolist():
            xs.append(torch.cat([feats[g], nn.functional.one_hot(torch.tensor(c), len(COLORS)).float()]))
            ys.append(int(states[g, c]) - MOVING)
    return torch.stack(xs), torch.tensor(ys)


def probe(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, *, steps: int = 400) -> dict[str, float]:
    """Train and test accuracy of a standardised softmax probe (Adam 1e-2, weight decay 1e-3, full batch)."""
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
    head = nn.Linear(x_train.shape[1], int(y_train.max()) + 1)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(head((x_train - mu) / sd), y_train)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = {
            k: float((head((x - mu) / sd).argmax(1) == y).float().mean())
            for k, x, y in (("train", x_train, y_train), ("test", x_test, y_test))
        }
    return acc | {"n_train": len(y_train), "n_test": len(y_test)}


def main(argv: list[str] | None = None) -> None:
    # lazy: transformers is heavy to import; only loading the probed model needs it
    from transformers import AutoModelForImageTextToText, AutoProcessor

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--train-n", type=int, default=300, help="train clips (direction questions) for the fit")
    p.add_argument("--test-n", type=int, default=100, help="test clips scored")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    processor = AutoProcessor.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model).eval()
    encode = frame_encoder(processor, NUM_FRAMES)
    data = [
        moving_cells(model, encode, pipeline_records(split, n, types=("direction",), num_frames=NUM_FRAMES))
        for split, n in (("train", args.train_n), ("test", args.test_n))
    ]
    print(json.dumps(probe(*data[0], *data[1]), indent=1), flush=True)


if __name__ == "__main__":
    main()
