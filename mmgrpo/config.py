"""Typed run configuration: `load_config` reads a YAML recipe and its overrides into `Config` and validates it.

The schema (dataclasses, YAML, overrides, coercion) lives in mmgrpo/schema.py and the checks in mmgrpo/validate.py;
both are re-exported here, so `from mmgrpo.config import Config, load_config` stays the one import for users.
Validation runs before any model loads; every message names the field, the value, the reason and the fix.
"""

import os
from typing import Any

import yaml

from mmgrpo.errors import UserError
from mmgrpo.recipes import resolve_recipe, resolve_shipped_paths
from mmgrpo.schema import (  # noqa: F401  the schema's public names, re-exported
    AlgoConfig,
    Config,
    OptimConfig,
    PipelineConfig,
    RewardSpec,
    RunConfig,
    SampleConfig,
    _build,
    _set_path,
    field_docs,
    parse_overrides,
    read_text,
    yaml_load,
)
from mmgrpo.validate import validate


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Read a YAML recipe (a path or a shipped recipe's name), apply `key.sub=value` overrides, validate the values."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = path = resolve_recipe(path)
        if p.is_dir():
            raise UserError(
                f"config file {str(path)!r} is a directory, not a YAML file; pass a recipe such as "
                f"configs/toy_count.yaml"
            )
        if not p.is_file():
            raise UserError(
                f"config file {str(path)!r} does not exist; pass a YAML recipe such as configs/toy_count.yaml"
            )
        try:
            tree = yaml_load(read_text(p, "config file")) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            why = getattr(err, "problem", None) or " ".join(str(err).split())
            raise UserError(f"config file {str(path)!r} is not valid YAML{at}: {why}; fix the syntax there") from None
        if not isinstance(tree, dict):
            raise UserError(
                f"config file {str(path)!r} must hold a mapping of sections (run, sample, algo...), "
                f"not a {type(tree).__name__}; start it with e.g. `run:` on its own line"
            )
    for key, value in parse_overrides(list(overrides)):
        _set_path(tree, key, value)
    resolve_shipped_paths(tree)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg
