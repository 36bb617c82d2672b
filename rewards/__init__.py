"""mmgrpo rewards: one Python API for reward models and rule rewards, batched, composable and served over HTTP.

`rewards.load(name_or_url, **kw)` returns a Reward; `rewards.names()` / `describe()` list them; `RewardSet` composes.
"""

# importing each module registers its rewards; model libraries are imported only when a model reward loads
from rewards import (  # noqa: F401
    clip_family,
    compose,
    imagereward,
    jpeg,
    judge,
    ocr,
    pairwise,
    rule_rewards,
    shapes,
    video,
)
from rewards.api import REWARDS, FunctionReward, Reward, RewardError, UserError, describe, info, load, names
from rewards.compose import RewardSet, consistency_bonus, trust_weight

__all__ = [
    "REWARDS",
    "FunctionReward",
    "Reward",
    "RewardError",
    "RewardSet",
    "UserError",
    "consistency_bonus",
    "describe",
    "info",
    "load",
    "names",
    "trust_weight",
]
