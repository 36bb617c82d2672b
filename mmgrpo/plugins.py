"""The pipeline registry: name -> builder returning a `Task`; pipelines register themselves when imported.

The core imports the `pipelines` package only here, and that package must stay light (heavy imports inside builders).
"""

import importlib

from mmgrpo.registry import Registry

PIPELINES = Registry("pipeline")
"""builder(*, seed: int, device: torch.device, dtype: torch.dtype, **pipeline.kwargs) -> mmgrpo.types.Task.

Optional meta `check=fn(**pipeline.kwargs)`: the pipeline's own cheap checks, run by validation before any model
loads (raise UserError / ValueError naming the field)."""

RESERVED_BUILD_KWARGS = ("seed", "device", "dtype")


def load_plugins() -> None:
    """Import the first-party `pipelines` package so its builders register (idempotent)."""
    importlib.import_module("pipelines")
