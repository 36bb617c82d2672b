"""The reward contract in the core (mmgrpo/reward.py): the engine finds the concrete rewards only through the plugins
it imports, and `rewards` re-exports the same objects, so there is one registry."""

import subprocess
import sys
from pathlib import Path

import pytest

import rewards
from mmgrpo import reward
from rewards import api, client, compose

ROOT = Path(__file__).resolve().parents[1]


def test_rewards_re_exports_the_core_contract():
    assert rewards.REWARDS is api.REWARDS is reward.REWARDS  # one registry, not a copy
    assert api.Reward is reward.Reward and api.FunctionReward is reward.FunctionReward
    assert rewards.RewardSet is compose.RewardSet is reward.RewardSet
    assert rewards.RewardError is reward.RewardError and rewards.load is reward.load


def test_the_core_loads_the_plugins_before_naming_an_unknown_reward():
    # a fresh process that never imports `rewards`: the core must find pickscore through the entry point
    code = (
        "import sys\n"
        "from mmgrpo.reward import load\n"
        "assert 'rewards' not in sys.modules\n"
        "try:\n"
        "    load('pickscor')\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "unknown reward 'pickscor' (did you mean 'pickscore'?); choose from: accuracy," in out


def test_only_one_url_client():
    reward.set_url_client(client.HttpReward)  # the same client again is fine
    with pytest.raises(ValueError, match="reward URL client is already set"):
        reward.set_url_client(lambda url, **kw: None)
