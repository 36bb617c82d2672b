"""The pipeline registry and plugin loading: pipelines, rewards, estimators and losses register when imported.

What gets imported, in order:
  1. every entry point in the `mmgrpo.plugins` group of the installed packages (pyproject.toml's
     `[project.entry-points."mmgrpo.plugins"]`; this repository declares its own `pipelines` and `rewards` there);
  2. when mmgrpo runs from a source checkout whose installed metadata predates a declared entry point (an editable
     install made before it was added), that checkout's pyproject.toml entries too;
  3. the modules a recipe lists in `run.plugins` (e.g. `run.plugins: [my_estimators]`), importable from sys.path.
CLI sub-commands come the same way, from the `mmgrpo.commands` group: each entry is `add(subparsers)`.
The core never names a package above it: it only follows these declarations.
"""

import functools
import importlib
import importlib.metadata
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmgrpo.errors import UserError
from mmgrpo.registry import Registry
from mmgrpo.schema import _build

PIPELINES = Registry("pipeline")
"""builder(*, seed: int, device: torch.device, dtype: torch.dtype, **pipeline.kwargs) -> mmgrpo.types.Task.

Optional meta `check=fn(**pipeline.kwargs)`: the pipeline's own cheap checks, run by validation before any model
loads (raise UserError / ValueError naming the field). Optional meta `settings=SomeSettings`: a dataclass with one
field per pipeline keyword and a one-line docstring under each, plus `check()` (types, ranges, the fields' own
cross-checks) and optionally `check_algo(algo)` (the fields against algo.loss, algo.kl_coef...); validation builds it
from pipeline.kwargs (typed), calls both, and docs/config.md documents it. The builder either mirrors the fields as
keywords (same name, type and default) or takes `**kwargs` and reads them with `pipeline_settings(SomeSettings,
kwargs)`."""

RESERVED_BUILD_KWARGS = ("seed", "device", "dtype")
_REINSTALL = "fix or reinstall the package that declares it (`pip install -e .` in a checkout), or uninstall it"
GROUP = "mmgrpo.plugins"
COMMANDS = "mmgrpo.commands"
SOURCE_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pipeline_settings(cls: type, kwargs: dict[str, Any]) -> Any:
    """`cls` (a pipeline's `settings=` dataclass) built from `kwargs` as validation builds it: unknown keys and wrong
    types are one UserError line each, then `check()`; a ValueError from check() becomes a UserError too."""
    settings = _build(cls, dict(kwargs), "pipeline.kwargs")
    try:
        settings.check()
    except UserError:
        raise
    except ValueError as err:
        msg = " ".join(str(err).split())
        raise UserError(msg if msg.startswith("pipeline.kwargs") else f"pipeline.kwargs: {msg}") from None
    return settings


def declared_plugins(pyproject: Path = SOURCE_PYPROJECT, group: str = GROUP) -> dict[str, str]:
    """name -> "module[:attr]" of every entry point in `group`: the installed packages' metadata, plus the entries
    of mmgrpo's own source checkout (`pyproject`) that the installed metadata lacks."""
    return dict(_declared(pyproject, group, tuple(sys.path)))


@functools.lru_cache(maxsize=8)
def _declared(pyproject: Path, group: str, search_path: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Scanning every installed distribution takes tens of ms: once per search path (a changed sys.path rescans)."""
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}
    for name, value in _source_entry_points(pyproject, group).items():
        found.setdefault(name, value)
    return tuple(found.items())


def _source_entry_points(pyproject: Path, group: str = GROUP) -> dict[str, str]:
    """The `group` entry points of mmgrpo's own pyproject.toml, when mmgrpo runs from a source checkout."""
    if not pyproject.is_file():
        return {}  # an installed wheel: its metadata is complete
    try:
        # lazy: tomllib is Python >= 3.11; on 3.10 the installed metadata alone is used
        import tomllib
    except ModuleNotFoundError:
        return {}
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    if data.get("project", {}).get("name") != "mmgrpo":
        return {}
    return dict(data["project"].get("entry-points", {}).get(group, {}))


def _import(target: str, what: str, fix: str) -> Any:
    """Import `module[:attr]` and return it; any failure is one UserError line naming the plugin, the error and the
    fix."""
    module, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in filter(None, attr.split(".")):
            obj = getattr(obj, part)
    except Exception as err:  # a plugin's own bug or a missing module: one line, --debug shows more
        why = " ".join(f"{type(err).__name__}: {err}".split())
        raise UserError(f"{what} {target!r} failed to import ({why}); {fix}") from err
    return obj


def load_plugins(modules: list[str] | tuple[str, ...] = ()) -> None:
    """Import every declared plugin, then `modules` (a recipe's run.plugins), so their components register.

    Idempotent: Python imports each module once, so a second call only re-reads the declarations.
    """
    for name, target in declared_plugins().items():
        _import(target, f"plugin {name!r} (entry point {GROUP})", _REINSTALL)
    for i, module in enumerate(modules):
        _import(
            module,
            f"run.plugins.{i}",
            "put the module's directory on PYTHONPATH or `pip install` the package that provides it, or remove "
            "it from run.plugins",
        )


def command_adders(warn: Callable[[str], None]) -> list[Callable]:
    """The `add(subparsers)` function of every `mmgrpo.commands` entry point, by name. One that fails to import is
    skipped with one `warn` line naming it and the fix, so a broken plugin never takes `mmgrpo train` down with it."""
    adders = []
    for name, target in sorted(declared_plugins(group=COMMANDS).items()):
        try:
            adders.append(_import(target, f"command plugin {name!r} (entry point {COMMANDS})", _REINSTALL))
        except UserError as err:
            warn(f"mmgrpo: {err}")
    return adders
