"""Tests for the dense vision targets of the ShapesWorld VLM (mmgrpo_shapes/dense.py)."""

import numpy as np
import pytest
import torch

from mmgrpo_shapes.dense import COLOR_CLASSES, SHAPE_CLASSES, DenseHead, batch_targets, cell_targets
from mmgrpo_shapes.scenes import Scene, SceneObject


def test_cell_targets_by_hand():
    # 4 x 4 grid, cells of 0.25: (cx 0.8, cy 0.1) -> row 0, col 3 -> index 3; (0.3, 0.6) -> row 2, col 1 -> 9
    objs = [
        {"shape": "triangle", "color": "blue", "cx": 0.8, "cy": 0.1},
        {"shape": "circle", "color": "red", "cx": 0.3, "cy": 0.6},
    ]
    color, shape = cell_targets(objs, 4)
    want_c, want_s = torch.zeros(16, dtype=torch.long), torch.zeros(16, dtype=torch.long)
    want_c[3], want_s[3] = COLOR_CLASSES.index("blue"), SHAPE_CLASSES.index("triangle")
    want_c[9], want_s[9] = COLOR_CLASSES.index("red"), SHAPE_CLASSES.index("circle")
    assert torch.equal(color, want_c) and torch.equal(shape, want_s)
    assert COLOR_CLASSES[0] == SHAPE_CLASSES[0] == "none"
    # a centre on the far edge (cx = 1.0) stays in the last column
    assert cell_targets([{"shape": "square", "color": "red", "cx": 1.0, "cy": 0.0}], 4)[0][3] > 0


def test_batch_targets_rejects_a_non_square_grid():
    with pytest.raises(ValueError, match="tokens_per_image 12"):
        batch_targets([[]], 12)


def test_head_loss_by_hand():
    # logits all zero -> each cross-entropy is log(classes): 0.5 * (log 7 + log 4) per cell, and that once for the
    # object cells' mean and once for the empty cells' mean
    head = DenseHead(8)
    torch.nn.init.zeros_(head.proj.weight)
    torch.nn.init.zeros_(head.proj.bias)
    loss, _ = head.loss(torch.randn(5, 8), torch.tensor([0, 1, 2, 3, 6]), torch.tensor([0, 1, 2, 3, 0]))
    assert abs(float(loss.detach()) - (np.log(7) + np.log(4))) < 1e-6


def test_head_position_loss_by_hand():
    # side 2, zero logits: colour/shape part as above, log 7 + log 4; row and column cross-entropies log 2 each,
    # averaged (0.5 * (log 2 + log 2) = log 2). Then a head that puts +10 on the right row and column (tokens 0..3
    # of an image are cells (0,0) (0,1) (1,0) (1,1)): position accuracy 1.
    head = DenseHead(8, side=2)
    torch.nn.init.zeros_(head.proj.weight)
    torch.nn.init.zeros_(head.proj.bias)
    color, shape = torch.tensor([0, 1, 0, 0, 2, 0, 0, 0]), torch.tensor([0, 1, 0, 0, 2, 0, 0, 0])
    loss, _ = head.loss(torch.randn(8, 8), color, shape)  # two images of 4 tokens
    assert abs(float(loss.detach()) - (np.log(7) + np.log(4) + np.log(2))) < 1e-6
    tokens = torch.eye(8)[[0, 1, 2, 3, 0, 1, 2, 3]]  # [8, 8] one-hot of the cell index
    with torch.no_grad():
        w = head.proj.weight  # [11 + 4, 8]: rows 11, 12 read the row, rows 13, 14 the column
        for k in range(4):
            w[11 + k // 2, k], w[13 + k % 2, k] = 10.0, 10.0
    assert head.loss(tokens, color, shape)[1]["position"] == 1.0


def test_merged_token_order_is_row_major_cells():
    # the targets assume merged token k covers cell (k // 4, k % 4): check it on the processor's real patch order
    # with one red square in cell (row 0, col 3) of a 32 px image (pixels 24-31 across, 0-7 down)
    from mmgrpo_shapes.programs.pretrain_vlm import build_model

    _, processor = build_model("vqa", hidden=32, layers=1, vision_dim=32, vision_depth=1)
    img = Scene((SceneObject("square", "red", 0.875, 0.125, 0.1),), None, 32).render()
    px = processor.image_processor(images=[img], return_tensors="pt")["pixel_values"]  # [64, 3*2*14*14]
    per_token = px.reshape(16, 4, -1).std(dim=(1, 2))  # [16] merged tokens: 4 patches each; flat = background only
    assert int(per_token.argmax()) == 3
    assert float(per_token[3]) > 10 * float(per_token[[0, 1, 2, 4, 5, 6, 8, 12]].max())
