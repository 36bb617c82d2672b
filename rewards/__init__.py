"""mmgrpo rewards: one Python API for reward models and rule rewards, batched, composable and served over HTTP.

`rewards.load(name_or_url, **kw)` returns a Reward; `rewards.names()` / `describe()` list them; `RewardSet` composes.
"""

from rewards.api import REWARDS, FunctionReward, Reward, RewardError, UserError, describe, info, load, names
from rewards import rule_rewards, jpeg  # noqa: E402,F401  (registration side effects)
from rewards import compose  # noqa: E402,F401
from rewards.compose import RewardSet, consistency_bonus, trust_weight  # noqa: E402

for _mod in ("clip_family", "imagereward", "ocr", "video", "pairwise", "shapes"):
    try:
        __import__(f"rewards.{_mod}")
    except ModuleNotFoundError as _err:  # a slice not written yet must not break the rest
        if _err.name != f"rewards.{_mod}":
            raise

__all__ = ["REWARDS", "Reward", "FunctionReward", "RewardError", "RewardSet", "UserError", "consistency_bonus",
           "describe", "info", "load", "names", "trust_weight"]
