"""Toy counting task: a tiny autoregressive policy learns to write exactly n letters "a" (tests and first demo).

Light to import: torch only. It proves the engine (loop, resume, distributed) in seconds on any CPU.
"""

from pipelines.toy.policy import CountLM, ToyPolicy, build_toy_count, count_reward

__all__ = ["CountLM", "ToyPolicy", "build_toy_count", "count_reward"]


def _register() -> None:
    from functools import partial

    from mmgrpo.plugins import PIPELINES
    from rewards.api import REWARDS, FunctionReward

    def toy_count(max_len: int = 8) -> FunctionReward:
        """Toy counting reward: 1 - |#a - target| / max_len (text, range [1 - max_len/max_len, 1])."""
        return FunctionReward(partial(count_reward, max_len=max_len), name="toy_count", input="text",
                              preprocess="counts the letter 'a' in the completion", fields=("target",),
                              required=("target",))

    PIPELINES.register("toy_count", build_toy_count)
    REWARDS.register("toy_count", toy_count)


_register()
