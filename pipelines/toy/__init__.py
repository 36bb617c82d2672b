"""Toy counting task: a tiny autoregressive policy learns to write exactly n letters "a" (tests and first demo).

Light to import: torch only. It proves the engine (loop, resume, distributed) in seconds on any CPU.
"""

from functools import partial

from mmgrpo.plugins import PIPELINES
from pipelines.toy.policy import CountLM, ToyPolicy, build_toy_count, count_reward
from pipelines.toy.settings import ToySettings
from rewards.api import REWARDS, FunctionReward

__all__ = ["CountLM", "ToyPolicy", "ToySettings", "build_toy_count", "count_reward"]


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

    PIPELINES.register("toy_count", build_toy_count, settings=ToySettings)
    REWARDS.register("toy_count", toy_count)
    REWARDS.register("toy_no_b", toy_no_b)


_register()
