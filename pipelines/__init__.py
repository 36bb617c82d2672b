"""Pipelines turn models into the core's `Policy` (rollout / log-prob interface) and register their builders.

Importing this package must stay light: heavy libraries (diffusers, transformers) are imported inside builders.
"""

import pipelines.flow  # noqa: F401  registers "flow"
import pipelines.flow.objectives  # noqa: F401  registers the "guard_clipped" policy loss
import pipelines.toy  # noqa: F401  registers "toy_count"
import pipelines.vlm  # noqa: F401  registers "vlm"
import pipelines.video  # noqa: F401  registers "video", advantages "tempsamp" and "grpo_bonus"
