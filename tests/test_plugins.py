"""Plugins (mmgrpo/plugins.py): a package outside this repository adds an advantage estimator and a reward, through an
entry point in the `mmgrpo.plugins` group or through a recipe's `run.plugins`, and the toy recipe trains with them.

The throw-away package is a module in a tmp directory on sys.path; its entry point is a `*.dist-info` next to it
(what `pip install` writes), so importlib.metadata finds it as it finds an installed package.
"""

import json
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from mmgrpo import train
from mmgrpo.advantages import ADVANTAGES
from mmgrpo.cli import main as cli_main
from mmgrpo.config import load_config
from mmgrpo.errors import UserError
from mmgrpo.plugins import (
    PIPELINES,
    SOURCE_PYPROJECT,
    _declared,
    _source_entry_points,
    declared_plugins,
    load_plugins,
)
from rewards.api import REWARDS

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "configs" / "toy_count.yaml")
FAST = [
    "run.progress=false",
    "run.report=false",
    "run.steps=2",
    "run.checkpoint_every=0",
    "sample.batch_size=16",
    "sample.group_size=4",
    "algo.micro_batch_size=8",
]

PLUGIN = '''
"""A throw-away mmgrpo plugin: one advantage estimator and one reward, registered on import."""
from mmgrpo.advantages import ADVANTAGES
from mmgrpo.cli import main as cli_main
from rewards.api import REWARDS, FunctionReward

CALLS = []


@ADVANTAGES.register("{name}_centered", input="scalar")
def centered(rewards):
    """Reward minus its group mean, no std (a test estimator)."""
    CALLS.append(tuple(rewards.shape))
    r = rewards.float()
    return r - r.mean(dim=1, keepdim=True)  # [B, G]


def _exact(samples, prompts, target):
    CALLS.append(len(samples))
    return [float(s.count("a") == t) for s, t in zip(samples, target)]


@REWARDS.register("{name}_exact", input="text", range="{{0, 1}}")
def exact():
    """1 when the completion has exactly `target` letters a (a test reward)."""
    return FunctionReward(_exact, name="{name}_exact", fields=("target",), required=("target",))
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A fresh plugin module on sys.path; the registries and sys.modules are restored afterwards."""
    load_plugins()  # first-party components registered before the copy, so the restored registries hold them
    for reg in (ADVANTAGES, REWARDS, PIPELINES):
        monkeypatch.setattr(reg, "_items", dict(reg._items))
        monkeypatch.setattr(reg, "_meta", dict(reg._meta))
    name = f"mmgrpo_test_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / f"{name}.py").write_text(PLUGIN.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield name
    sys.modules.pop(name, None)


def _entry_point(site: Path, name: str, target: str, group: str = "mmgrpo.plugins") -> None:
    """What `pip install` of a package declaring `[project.entry-points."<group>"] name = target` leaves."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {target}\n")


def _train_with(name: str, out: Path, extra: list[str]) -> list[dict]:
    cfg = load_config(
        RECIPE,
        [
            f"run.output_dir={out}",
            *FAST,
            f"algo.advantage={name}_centered",
            "algo.advantage_kwargs={}",
            f"rewards=[{{name: {name}_exact}}]",
            *extra,
        ],
    )
    train(cfg)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_an_entry_point_plugin_trains_the_toy_recipe(plugin, tmp_path):
    _entry_point(tmp_path / "site", plugin, plugin)
    assert declared_plugins()[plugin] == plugin
    rows = _train_with(plugin, tmp_path / "run", [])
    calls = sys.modules[plugin].CALLS
    assert len(rows) == 2 and all(f"reward/{plugin}_exact/mean" in r for r in rows)
    assert (4, 4) in calls and 16 in calls  # the estimator saw [B, G] = [16 / 4, 4]; the reward 16 samples


def test_run_plugins_imports_a_users_module(plugin, tmp_path):
    assert plugin not in declared_plugins()
    with pytest.raises(UserError, match=f"advantage.*{plugin}_centered"):  # not imported: the name is unknown
        load_config(RECIPE, [f"algo.advantage={plugin}_centered", "algo.advantage_kwargs={}"])
    rows = _train_with(plugin, tmp_path / "run", [f"run.plugins=[{plugin}]"])
    assert len(rows) == 2 and rows[-1]["step"] == 1


def test_a_missing_or_broken_plugin_is_one_line_naming_it_and_the_fix(plugin, tmp_path):
    with pytest.raises(UserError) as err:
        load_config(RECIPE, ["run.plugins=[no_such_module_xyz]"])
    assert str(err.value) == (
        "run.plugins.0 'no_such_module_xyz' failed to import (ModuleNotFoundError: No module "
        "named 'no_such_module_xyz'); put the module's directory on PYTHONPATH or `pip install` "
        "the package that provides it, or remove it from run.plugins"
    )
    broken = f"{plugin}_broken"
    (tmp_path / "site" / f"{broken}.py").write_text("raise RuntimeError('half-written plugin')\n")
    _entry_point(tmp_path / "site", broken, broken)
    _declared.cache_clear()  # the declarations are read once per sys.path; a package installed meanwhile needs this
    with pytest.raises(
        UserError,
        match=rf"plugin '{broken}' \(entry point mmgrpo.plugins\) '{broken}' failed to "
        r"import \(RuntimeError: half-written plugin\); fix or reinstall",
    ):
        load_plugins()
    sys.modules.pop(broken, None)


def test_first_party_plugins_are_declared_and_survive_stale_metadata(tmp_path):
    # what a fresh `pip install -e .` or wheel puts in the metadata
    assert _source_entry_points(SOURCE_PYPROJECT) == {"pipelines": "pipelines", "rewards": "rewards"}
    # an editable install made before the entry points existed: the checkout's pyproject.toml still declares them
    stale = tmp_path / "pyproject.toml"
    stale.write_text(
        textwrap.dedent("""
        [project]
        name = "mmgrpo"
        [project.entry-points."mmgrpo.plugins"]
        only_in_the_checkout = "json"
    """)
    )
    assert declared_plugins(stale)["only_in_the_checkout"] == "json"
    other = tmp_path / "other" / "pyproject.toml"
    other.parent.mkdir()
    other.write_text(stale.read_text().replace('name = "mmgrpo"', 'name = "someone-else"'))
    assert "only_in_the_checkout" not in declared_plugins(other)  # another project's pyproject is not ours
    load_plugins()
    assert {"flow", "toy_count", "vlm", "video"} <= set(PIPELINES.names())


def test_cli_sub_commands_come_from_entry_points(plugin, tmp_path, capsys):
    site = tmp_path / "site"
    (site / f"{plugin}_cmd.py").write_text(
        textwrap.dedent("""
        def add(subparsers):
            p = subparsers.add_parser("hello", help="say hello")
            p.set_defaults(func=lambda args: print("hello from a plugin") or 0)
    """)
    )
    _entry_point(site, f"{plugin}_cmd", f"{plugin}_cmd:add", group="mmgrpo.commands")
    _entry_point(site, f"{plugin}_bad", f"{plugin}_cmd:missing", group="mmgrpo.commands")
    assert cli_main(["hello"]) == 0
    out, err = capsys.readouterr()
    assert out == "hello from a plugin\n"
    assert err == (
        f"mmgrpo: command plugin '{plugin}_bad' (entry point mmgrpo.commands) '{plugin}_cmd:missing' "
        f"failed to import (AttributeError: module '{plugin}_cmd' has no attribute 'missing'); fix or "
        f"reinstall the package that declares it (`pip install -e .` in a checkout), or uninstall it\n"
    )
    assert declared_plugins(group="mmgrpo.commands")["rewards"] == "rewards.cli:add_subcommands"
    assert declared_plugins(group="mmgrpo.commands")["shapes"] == "mmgrpo_shapes.programs.cli:add_subcommands"
    sys.modules.pop(f"{plugin}_cmd", None)
