"""Pipelines turn models into the core's `Policy` (rollout / log-prob interface) and register their builders.

Importing this package must stay light: heavy libraries (diffusers, transformers) are imported inside builders.
"""

import pipelines.flow  # registers "flow"
import pipelines.flow.objectives  # registers the "guard_clipped" policy loss
import pipelines.toy  # registers "toy_count"
import pipelines.video  # registers "video", advantages "tempsamp" and "grpo_bonus"
import pipelines.vlm  # noqa: F401  registers "vlm" (F401 sees only the last of these side-effect imports)
