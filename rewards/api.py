"""The reward API: `load` a Reward by registry name or HTTP URL, `names`, `describe`, `info`; the contract re-exported.

The contract (`Reward`, the REWARDS registry, `load`, the checks, the errors) lives in the core, mmgrpo/reward.py;
importing this module also plugs in the HTTP client (rewards/client.py), so `load("http://...")` works.
`from rewards.api import REWARDS, Reward, load` stays the one import for reward modules.
"""

from mmgrpo.errors import UserError
from mmgrpo.reward import (  # noqa: F401  the contract, re-exported
    INPUTS,
    KINDS,
    REWARDS,
    FunctionReward,
    Reward,
    RewardError,
    as_sample_list,
    check_fields,
    check_group_size,
    check_prompts,
    describe,
    info,
    load,
    names,
    to_scores,
)
from rewards.client import HttpReward  # noqa: F401  importing it plugs the URL client into load

__all__ = ["REWARDS", "FunctionReward", "Reward", "RewardError", "UserError", "describe", "info", "load", "names"]
