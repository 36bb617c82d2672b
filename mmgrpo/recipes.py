"""Shipped recipes and models: find `configs/` and `assets/` in a source checkout or inside an installed wheel.

A wheel carries them as package data under `mmgrpo/_data/{configs,assets}` (setup.py copies them at build time), so
`mmgrpo train shapes_t2i` and the recipe's `model: assets/shapes-t2i` work without the repository. No model code here.
"""

import os
from pathlib import Path
from typing import Any

from mmgrpo.errors import UserError

_PACKAGED = Path(__file__).resolve().parent / "_data"
"""where a built wheel puts the recipes and shipped models (absent in a source checkout)"""
_CHECKOUT = Path(__file__).resolve().parents[1]
"""the repository root when mmgrpo runs from a source checkout (editable install or PYTHONPATH)"""


def data_root() -> Path | None:
    """The directory holding `configs/` and `assets/`: the wheel's package data first, else the source checkout."""
    for root in (_PACKAGED, _CHECKOUT):
        if (root / "configs").is_dir():
            return root
    return None


def recipe_names() -> list[str]:
    """Every shipped recipe as `subdir/name` (or `name` at the top of configs/), sorted; accelerate files excluded."""
    root = data_root()
    if root is None:
        return []
    configs = root / "configs"
    names = [p.relative_to(configs).with_suffix("").as_posix() for p in configs.rglob("*.yaml")]
    return sorted(n for n in names if not n.startswith("accelerate/"))


def resolve_recipe(path: str | os.PathLike) -> Path:
    """A recipe argument as a file: an existing path as given, else a shipped recipe by name or by its repo path.

    `shapes_t2i`, `flow/shapes_t2i`, `flow/shapes_t2i.yaml` and `configs/flow/shapes_t2i.yaml` all name
    configs/flow/shapes_t2i.yaml; a path that exists (file or directory) is returned unchanged, so the checks of
    `load_config` still see it.
    """
    given = Path(path)
    if given.exists():
        return given
    root = data_root()
    text = given.as_posix()
    if root is None or given.is_absolute():
        return given
    stem = text.removeprefix("configs/")
    stem = stem.removesuffix(".yaml")
    names = recipe_names()
    matches = [n for n in names if n == stem] or [n for n in names if n.rsplit("/", 1)[-1] == stem]
    if len(matches) == 1:
        return root / "configs" / f"{matches[0]}.yaml"
    if len(matches) > 1:
        raise UserError(
            f"recipe {text!r} is ambiguous: it names {', '.join(matches)}; pass one of these (e.g. {matches[0]})"
        )
    if "/" in text or text.endswith((".yaml", ".yml")):
        return given  # a path that does not exist: load_config says so, naming it
    raise UserError(
        f"recipe {text!r} does not exist as a file and is not a shipped recipe; pass a YAML path or one of: "
        f"{', '.join(names)}"
    )


def resolve_shipped_paths(tree: dict[str, Any]) -> None:
    """Point relative paths in pipeline/reward kwargs that are missing here but shipped (assets/...) at the shipped copy.

    In place. A value is rewritten only when it does not exist relative to the working directory and does exist
    under the data root, so a path that works today is never changed.
    """
    root = data_root()
    if root is None:
        return
    pipeline = tree.get("pipeline")
    blocks = [pipeline.get("kwargs")] if isinstance(pipeline, dict) else []
    rewards = tree.get("rewards")
    blocks += [r.get("kwargs") for r in rewards if isinstance(r, dict)] if isinstance(rewards, list) else []
    for kwargs in blocks:
        if not isinstance(kwargs, dict):
            continue
        for key, value in kwargs.items():
            if not isinstance(value, str) or not value.strip() or Path(value).is_absolute() or Path(value).exists():
                continue
            shipped = root / value
            if value.split("/", 1)[0] in ("assets", "configs") and shipped.exists():
                kwargs[key] = str(shipped)
