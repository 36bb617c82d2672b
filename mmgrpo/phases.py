"""The phase schedule (algo.phases): which estimator, loss and aggregation a training step uses, and its checks.

A phase only overrides names and keyword arguments, so a step's algorithm is a pure function of the step: a resumed
run picks up mid-phase exactly. The loop applies it in mmgrpo/trainer.py; nothing here touches a model.
"""

import dataclasses
import re
from collections.abc import Callable

from mmgrpo import losses
from mmgrpo.errors import UserError
from mmgrpo.schema import AlgoConfig, Config, PhaseConfig


def phase_index(phases: list[PhaseConfig], step: int) -> int | None:
    """Index of the phase that step `step` (0-based) falls in, cycling the schedule; None without phases."""
    if not phases:
        return None
    pos = step % sum(p.steps for p in phases)
    for i, p in enumerate(phases):
        if pos < p.steps:
            return i
        pos -= p.steps
    raise AssertionError("unreachable: pos < total steps")


def _apply(algo: AlgoConfig, p: PhaseConfig) -> AlgoConfig:
    return dataclasses.replace(
        algo,
        advantage=p.advantage or algo.advantage,
        advantage_kwargs=dict(algo.advantage_kwargs if p.advantage_kwargs is None else p.advantage_kwargs),
        loss=p.loss or algo.loss,
        loss_kwargs=dict(algo.loss_kwargs if p.loss_kwargs is None else p.loss_kwargs),
        aggregation=p.aggregation or algo.aggregation,
        phases=[],
    )


def config_at(cfg: Config, step: int) -> Config:
    """`cfg` with algo as phase `phase_index(step)` sets it (cfg itself when there are no phases)."""
    i = phase_index(cfg.algo.phases, step)
    return cfg if i is None else dataclasses.replace(cfg, algo=_apply(cfg.algo, cfg.algo.phases[i]))


def check(cfg: Config, validate_algo: Callable[[Config], None]) -> None:
    """algo's loss has the aggregation it needs; every phase has steps >= 1 and validates as algo (names, kwargs,
    dry run) with its overrides applied. Raises UserError naming the phase's field."""
    a = cfg.algo
    need = losses.POLICY_LOSSES.meta(a.loss).get("aggregation")
    if need and a.aggregation != need:
        raise UserError(
            f"algo.aggregation ({a.aggregation!r}) with algo.loss={a.loss!r}: this loss writes one value per "
            f"sequence on its elements, so only {need!r} averages it as the paper does; set algo.aggregation={need}"
        )
    for i, p in enumerate(a.phases):
        if p.steps < 1:
            raise UserError(f"algo.phases.{i}.steps ({p.steps}) must be >= 1 (steps spent in this phase per cycle)")
        try:
            validate_algo(dataclasses.replace(cfg, algo=_apply(a, p)))
        except UserError as err:
            msg = re.sub(r"\balgo\.(?=(advantage|loss|aggregation))", f"algo.phases.{i}.", str(err))
            raise UserError(f"{msg} (the phase inherits algo's value for what it leaves unset)") from None
