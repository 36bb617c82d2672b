"""The toy pipeline's typed settings (`pipeline.kwargs` of `toy_count`): one documented field per builder keyword.

Validation builds them from the recipe and runs `check()` before the model is built; docs/config.md is generated
from the field docstrings. No model code here.
"""

from dataclasses import dataclass


@dataclass
class ToySettings:
    """The toy counting task's `pipeline.kwargs` (`pipeline.name: toy_count`)."""

    max_target: int = 6
    """largest count a prompt asks for: prompts are "write n a's" for n in 1..max_target"""
    max_len: int = 8
    """longest completion in tokens, the end token included; must exceed max_target"""
    hidden: int = 32
    """width of the GRU and of its embeddings"""

    def check(self) -> None:
        """Ranges and the cross-field rule, each error naming the field, the value and the fix."""
        for key, least in (("hidden", 1), ("max_len", 2), ("max_target", 1)):
            value = getattr(self, key)
            if value < least:
                raise ValueError(f"pipeline.kwargs.{key} ({value}) must be >= {least}, e.g. pipeline.kwargs.{key}=8")
        if self.max_target >= self.max_len:
            raise ValueError(
                f"pipeline.kwargs.max_target ({self.max_target}) must be < max_len ({self.max_len}): a completion "
                f"needs room for max_target letters and the end token"
            )
