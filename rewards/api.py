"""The reward API: `load` a Reward by registry name or HTTP URL, `names`, `describe`, `info`; the contract re-exported.

The contract (`Reward`, the REWARDS registry, the checks, the errors) lives in rewards/base.py, the HTTP client in
rewards/client.py; `from rewards.api import REWARDS, Reward, load` stays the one import for reward modules.
"""

from typing import Any

from mmgrpo.errors import UserError
from rewards.base import (  # noqa: F401  the contract, re-exported
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
    to_scores,
)
from rewards.client import HttpReward


def load(name_or_url: str, **kwargs: Any) -> Reward:
    """A Reward by registry name (`load("pickscore", device="cuda")`) or HTTP URL (`load("http://host:8000/pickscore")`).

    Unknown names raise ValueError listing the choices; unknown keywords raise ValueError naming them.
    """
    if not isinstance(name_or_url, str):
        raise ValueError(f"reward name must be a string, got {type(name_or_url).__name__}")
    if name_or_url.startswith(("http://", "https://")):
        return HttpReward(name_or_url, **kwargs)
    REWARDS.check_kwargs(name_or_url, kwargs)
    reward = REWARDS.get(name_or_url)(**kwargs)
    reward.name = name_or_url
    return reward


def names() -> list[str]:
    """Every registered reward name, sorted."""
    return REWARDS.names()


def describe() -> dict[str, str]:
    """name -> one-line description (input, range, source)."""
    return REWARDS.describe()


def info(name: str) -> dict[str, Any]:
    """The registry metadata of a reward: input, kind, range, paper, load."""
    return dict(REWARDS.meta(name))


__all__ = ["REWARDS", "FunctionReward", "Reward", "RewardError", "UserError", "describe", "info", "load", "names"]
