"""Flow/diffusion GRPO on diffusers models (SD3/SD3.5, FLUX.1, Wan 2.1): SDE steps, rollout plans, LoRA policy.

Light to import: registering the "flow" builder imports no diffusers; `build_flow` imports it when called.
"""

from mmgrpo.plugins import PIPELINES
from pipelines.flow import sage  # noqa: F401  registers the "sage" step kind in sde.STEPS
from pipelines.flow.build import build_flow, check_flow_kwargs
from pipelines.flow.settings import FlowSettings


def _register() -> None:
    if "flow" not in PIPELINES:
        PIPELINES.register("flow", build_flow, settings=FlowSettings)


_register()

__all__ = ["FlowSettings", "build_flow", "check_flow_kwargs"]
