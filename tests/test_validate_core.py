"""Config combinations the core cannot run are refused by validation, before any model loads, in one line."""

from pathlib import Path

import pytest

from mmgrpo.config import load_config
from mmgrpo.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
FLOW = str(ROOT / "configs" / "flow" / "sd3_tiny_cpu.yaml")


@pytest.mark.parametrize(
    "override,value",
    [
        ("pipeline.kwargs.step_weights=noise_aware", "'noise_aware'"),  # TempFlow-GRPO's weights
        ("pipeline.kwargs.step_weights=guard", "'guard'"),
        ("pipeline.kwargs.ratio_norm=true", "True"),
    ],
)
def test_step_weights_and_ratio_norm_need_the_guard_loss(override, value):
    key = override.split("=")[0]
    with pytest.raises(UserError) as err:
        load_config(FLOW, [override, "algo.loss=clipped"])
    msg = str(err.value)
    assert "\n" not in msg and f"{key} ({value})" in msg and "algo.loss ('clipped')" in msg
    assert "algo.loss=guard_clipped" in msg and f"{key}=" in msg  # the fix: either key
    cfg = load_config(FLOW, [override, "algo.loss=guard_clipped", "algo.loss_kwargs={}"])  # the fix validates
    assert cfg.algo.loss == "guard_clipped"


def test_kl_in_reward_settings_are_checked():
    toy = str(ROOT / "configs" / "toy_count.yaml")
    with pytest.raises(UserError, match=r"algo.kl_reward_coef \(-0.1\) must be >= 0"):
        load_config(toy, ["algo.kl_reward_coef=-0.1"])
    with pytest.raises(UserError, match="algo.kl_reward_kind"):
        load_config(toy, ["algo.kl_reward_kind=k9"])
    with pytest.raises(UserError, match="does not read"):  # gdpo normalises the per-reward columns
        load_config(toy, ["algo.kl_reward_coef=0.1", "algo.advantage=gdpo", "algo.advantage_kwargs={}"])
