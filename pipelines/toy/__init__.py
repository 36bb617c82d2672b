"""Toy counting task: a tiny autoregressive policy learns to write exactly n letters "a" (tests and first demo).

Light to import: torch only. It proves the engine (loop, resume, distributed) in seconds on any CPU.
"""

from functools import partial

from mmgrpo.plugins import PIPELINES
from pipelines.toy.policy import CountLM, ToyPolicy, build_toy_count, count_reward
from rewards.api import REWARDS, FunctionReward

__all__ = ["CountLM", "ToyPolicy", "build_toy_count", "count_reward"]


def _check(max_target: int = 6, max_len: int = 8, hidden: int = 32) -> None:
    """The toy pipeline's ranges, checked by validation before the model is built."""
    for key, value, least in (("hidden", hidden, 1), ("max_len", max_len, 2), ("max_target", max_target, 1)):
        if value < least:
            raise ValueError(f"pipeline.kwargs.{key} ({value}) must be >= {least}, e.g. pipeline.kwargs.{key}=8")
    if max_target >= max_len:
        raise ValueError(
            f"pipeline.kwargs.max_target ({max_target}) must be < max_len ({max_len}): a completion "
            f"needs room for max_target letters and the end token"
        )


def _register() -> None:
    def toy_count(max_len: int = 8) -> FunctionReward:
        """Toy counting reward: 1 - |#a - target| / max_len (text, range [1 - max_len/max_len, 1])."""
        return FunctionReward(
            partial(count_reward, max_len=max_len),
            name="toy_count",
            input="text",
            preprocess="counts the letter 'a' in the completion",
            fields=("target",),
            required=("target",),
        )

    def toy_no_b() -> FunctionReward:
        """Toy rule constraint: 1 if the completion has no letter "b", else 0 (a stand-in for FGRPO's judge scores)."""
        return FunctionReward(
            lambda samples, prompts=None: [float("b" not in s) for s in samples],
            name="toy_no_b",
            input="text",
            preprocess="looks for the letter 'b' in the completion",
        )

    PIPELINES.register("toy_count", build_toy_count, check=_check)
    REWARDS.register("toy_count", toy_count)
    REWARDS.register("toy_no_b", toy_no_b)


_register()
