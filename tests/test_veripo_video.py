"""VerIPO's GRPO -> DPO schedule through the video policy (tiny random Qwen2-VL, real mp4 input): the DPO step reads
the frozen reference's sequence log-probs, so the configs/video recipe's loop runs end to end on the CPU."""

import json

import pytest

from mmgrpo.config import load_config
from mmgrpo.trainer import train
from tests.test_video_recipes import LETTERS, ROOT, TASK, _tiny

ONE_EACH = (
    "algo.phases=[{steps: 1}, {steps: 1, advantage: verifier_pairs, advantage_kwargs: {margin: 0.05}, loss: dpo, "
    "loss_kwargs: {beta: 0.1}, aggregation: seq_mean_token_mean}]"
)


def test_video_veripo_grpo_then_dpo(tmp_path_factory, tmp_path):
    cache = str(tmp_path_factory.mktemp("video_cache"))
    extra = [f"rewards=[{LETTERS}, {TASK}]", ONE_EACH]
    cfg = load_config(ROOT / "configs" / "video" / "veripo_shapes_videoqa.yaml", _tiny(cache, tmp_path) + extra)
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == [0.0, 1.0] and all(r["skipped"] == 0.0 for r in rows)
    assert rows[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert rows[1]["dpo/pair_frac"] > 0 and rows[1]["dpo/margin"] != 0.0
