"""Advantage estimators: pure functions from group rewards [B, G] (or [B, G, R], [B, G, G]) to float32 [B, G].

All are registered in ADVANTAGES and reached through `compute(name, rewards, **kw)`; no trainer state or configs here.
The estimators live by family in submodules (group: one scalar reward; multi: several rewards or preferences;
calibrated: new group statistics; shaping: estimators over another's output); importing this package registers
them all.
"""

from mmgrpo.advantages._common import (  # noqa: F401  helpers re-exported for pipelines' own estimators
    _INPUT_NDIM,
    _INPUT_SHAPE,
    ADVANTAGES,
    _check_choice,
    _check_kwargs,
    _check_norm,
    _check_number,
    _check_rewards,
    _flat,
    _median,
    _normalise,
    _out,
    _pivot,
    _whiten,
    _work_dtype,
    compute,
    loss_mask,
)
from mmgrpo.advantages.anchored import value_anchored, vgpo
from mmgrpo.advantages.calibrated import gaussian, ngrpo
from mmgrpo.advantages.constrained import faithful
from mmgrpo.advantages.group import grpo, mc_grpo, passk, rloo
from mmgrpo.advantages.multi import gdpo, prefs_from_scores, winrate
from mmgrpo.advantages.ragged import batch_coupled, by_size, group_sizes
from mmgrpo.advantages.shaping import asymmetric

__all__ = [
    "ADVANTAGES",
    "asymmetric",
    "batch_coupled",
    "by_size",
    "compute",
    "describe",
    "faithful",
    "gaussian",
    "gdpo",
    "group_sizes",
    "grpo",
    "loss_mask",
    "mc_grpo",
    "names",
    "ngrpo",
    "passk",
    "prefs_from_scores",
    "rloo",
    "value_anchored",
    "vgpo",
    "winrate",
]


# ----------------------------------------------------------------------------- public entry points


def names() -> list[str]:
    """Registered estimator names, sorted."""
    return ADVANTAGES.names()


def describe() -> dict[str, str]:
    """name -> one-line summary (first docstring line)."""
    return ADVANTAGES.describe()
