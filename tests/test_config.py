"""Config loading: defaults, recipes, YAML-typed overrides, documentation coverage, save round trip, docs drift.

Every recipe under configs/ is validated here, so a new recipe with a stale key fails CI without a dedicated test.
"""

import dataclasses
import importlib.util
import typing
from pathlib import Path

import pytest

import mmgrpo.validate as validate_mod
from mmgrpo.config import Config, OptimConfig, RewardSpec, field_docs, load_config, parse_overrides
from mmgrpo.errors import UserError
from mmgrpo.validate import validate

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "configs" / "toy_count.yaml"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    # relative output_dir values ("runs/...") must resolve somewhere harmless and writable
    monkeypatch.chdir(tmp_path)


def _sections() -> list[type]:
    """Every dataclass reachable from Config (sections and list item types such as RewardSpec)."""
    out = []
    for tp in typing.get_type_hints(Config).values():
        if typing.get_origin(tp) is list:
            (tp,) = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            out.append(tp)
    return out


def _recipes() -> list[Path]:
    return sorted(
        p for p in (ROOT / "configs").rglob("*.y*ml") if "accelerate" not in p.relative_to(ROOT / "configs").parts[:1]
    )


def test_defaults_validate():
    cfg = Config()
    validate(cfg)
    assert load_config(None) == cfg


def test_toy_recipe_loads():
    cfg = load_config(TOY)
    # values straight from configs/toy_count.yaml
    assert cfg.pipeline.name == "toy_count"
    assert cfg.pipeline.kwargs == {"max_target": 6, "max_len": 8, "hidden": 32}
    assert (cfg.sample.batch_size, cfg.sample.group_size) == (64, 8)
    assert cfg.algo.advantage_kwargs == {"std": "group", "eps": 1e-6}
    assert cfg.optim.lr == pytest.approx(3e-3)
    assert cfg.rewards == [RewardSpec(name="toy_count", weight=1.0, kwargs={"max_len": 8})]
    # untouched fields keep their dataclass defaults
    assert cfg.optim.betas == OptimConfig().betas
    assert cfg.run.keep_last == Config().run.keep_last


def test_nested_and_list_item_overrides():
    cfg = load_config(
        TOY,
        [
            "algo.kl_coef=0.01",
            "pipeline.kwargs.hidden=16",
            "rewards.0.weight=2",
            "rewards.0.kwargs.max_len=8",
            "run.output_dir=out/a",
        ],
    )
    assert cfg.algo.kl_coef == 0.01
    assert cfg.pipeline.kwargs == {"max_target": 6, "max_len": 8, "hidden": 16}
    assert cfg.rewards[0].weight == 2.0 and cfg.rewards[0].name == "toy_count"
    assert cfg.run.output_dir == "out/a"


def test_overrides_are_yaml_typed(monkeypatch):
    monkeypatch.setattr(validate_mod, "_importable", lambda module: True)  # tensorboard need not be installed here
    cfg = load_config(
        TOY,
        [
            "optim.betas=[0.9, 0.95]",
            "algo.norm_len=null",
            "run.progress=false",
            "sample.filter_zero_std=true",
            "run.trackers=[tensorboard]",
            "run.seed=7",
            "algo.loss_kwargs={clip_low: 0.2, clip_high: 0.28, dual_clip: 3.0}",
        ],
    )
    assert cfg.optim.betas == [0.9, 0.95]
    assert cfg.algo.norm_len is None
    assert cfg.run.progress is False and cfg.sample.filter_zero_std is True
    assert cfg.run.trackers == ["tensorboard"]
    assert cfg.run.seed == 7 and isinstance(cfg.run.seed, int)
    assert cfg.algo.loss_kwargs == {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    # the later override of the same key wins, as on any command line
    assert load_config(TOY, ["run.seed=1", "run.seed=2"]).run.seed == 2


def test_parse_overrides_keeps_text_after_first_equals():
    assert parse_overrides(["pipeline.kwargs.prompt=a=b", "x.y=", "z=[1, 2]"]) == [
        ("pipeline.kwargs.prompt", "a=b"),
        ("x.y", ""),
        ("z", [1, 2]),
    ]


def test_ints_widen_to_float():
    cfg = load_config(TOY, ["optim.lr=1", "algo.kl_coef=0", "optim.betas=[0, 0.5]", "rewards.0.weight=3"])
    for value, want in [
        (cfg.optim.lr, 1.0),
        (cfg.algo.kl_coef, 0.0),
        (cfg.rewards[0].weight, 3.0),
        (cfg.optim.betas[0], 0.0),
        (cfg.optim.betas[1], 0.5),
    ]:
        assert type(value) is float and value == want


def test_yaml_scalars_follow_yaml_1_2(tmp_path):
    # PyYAML's YAML 1.1 defaults read `1e-4` as the text "1e-4" and `no` as False; recipes mean a float and "no",
    # also inside kwargs dicts, where no field type could repair them later
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "run: {mixed_precision: no, resume: never}\noptim: {lr: 1e-4}\n"
        "algo: {kl_coef: 4e-2, advantage_kwargs: {eps: 1e-6}}\n"
    )
    cfg = load_config(recipe, ["optim.ema_decay=9e-1", "pipeline.kwargs.hidden=16", "run.progress=false"])
    assert (cfg.optim.lr, cfg.algo.kl_coef, cfg.optim.ema_decay) == (1e-4, 4e-2, 0.9)
    assert type(cfg.algo.advantage_kwargs["eps"]) is float and cfg.algo.advantage_kwargs["eps"] == 1e-6
    assert cfg.run.mixed_precision == "no" and cfg.run.progress is False
    assert load_config(TOY, ["run.mixed_precision=no"]).run.mixed_precision == "no"
    assert load_config(TOY, ["run.output_dir=2024-01-01"]).run.output_dir == "2024-01-01"
    # 1.1-only booleans are text now, so a bool field says so instead of silently taking them
    with pytest.raises(UserError, match="run.progress: expected bool, got 'yes'"):
        load_config(TOY, ["run.progress=yes"])
    assert parse_overrides(["a=.5", "b=-1E+3", "c=1_000", "d=.inf", "e=1.2.3", "f=."]) == [
        ("a", 0.5),
        ("b", -1000.0),
        ("c", 1000),
        ("d", float("inf")),
        ("e", "1.2.3"),
        ("f", "."),
    ]


def test_bool_is_not_an_int_and_int_is_not_a_bool():
    with pytest.raises(UserError, match="run.steps: expected int, got True"):
        load_config(TOY, ["run.steps=true"])
    with pytest.raises(UserError, match="run.progress: expected bool, got 1"):
        load_config(TOY, ["run.progress=1"])


def test_empty_and_null_sections_use_defaults(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run:\nalgo: {}\n")
    assert load_config(recipe) == Config()
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    assert load_config(empty) == Config()


def test_override_creates_missing_section_keys():
    cfg = load_config(None, ["pipeline.kwargs.hidden=8", "sample.sampler_kwargs.prior_alpha=2", "sample.sampler=vade"])
    assert cfg.pipeline.kwargs == {"hidden": 8}
    assert cfg.sample.sampler_kwargs == {"prior_alpha": 2}


@pytest.mark.parametrize("cls", _sections(), ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    names = [f.name for f in dataclasses.fields(cls)]
    docs = field_docs(cls)
    missing = [n for n in names if not docs.get(n, "").strip()]
    assert not missing, f"{cls.__name__} fields without an attribute docstring: {missing}"
    assert list(docs) == names  # no stale entry and source order preserved (the docs table follows it)


def test_sections_cover_config():
    assert {c.__name__ for c in _sections()} == {
        "RunConfig",
        "PipelineConfig",
        "SampleConfig",
        "AlgoConfig",
        "OptimConfig",
        "RewardSpec",
    }


def test_save_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(validate_mod, "_importable", lambda module: True)
    cfg = load_config(
        TOY,
        [
            f"run.output_dir={tmp_path / 'out'}",
            "run.trackers=[tensorboard]",
            "algo.norm_len=12",
            "algo.kl_coef=0.05",
            "optim.betas=[0.8, 0.9]",
            ("rewards=[{name: toy_count, weight: 0.5, kwargs: {max_len: 8}}, {name: format, weight: 2}]"),
            "pipeline.kwargs.hidden=16",
        ],
    )
    path = tmp_path / "saved.yaml"
    cfg.save(path)
    again = load_config(path)
    assert again == cfg
    assert again.rewards[1] == RewardSpec(name="format", weight=2.0)
    # a default Config survives too (null norm_len, empty lists and dicts)
    Config().save(path)
    assert load_config(path) == Config()


@pytest.mark.parametrize("recipe", _recipes(), ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_recipe_validates(recipe):
    cfg = load_config(recipe)
    assert isinstance(cfg, Config)


def test_every_recipe_validates_in_a_fresh_process():
    """As `mmgrpo train` sees them: a new interpreter that has imported no pipeline, so the names pipelines register
    (video's "tempsamp" advantage, flow's losses) must be registered by validation itself. One process per configs/
    folder (run side by side): within a process the first validation would register the names for the rest."""
    import subprocess
    import sys

    code = (
        "import sys; from mmgrpo.config import load_config\n"
        "for p in sys.argv[1:]:\n    load_config(p)\nprint('ok', len(sys.argv) - 1)"
    )
    folders: dict[Path, list[str]] = {}
    for p in _recipes():
        folders.setdefault(p.parent, []).append(str(p))
    procs = {
        d: subprocess.Popen(
            [sys.executable, "-c", code, *paths], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        for d, paths in folders.items()
    }
    for d, proc in procs.items():
        out, err = proc.communicate()
        assert proc.returncode == 0 and out.strip() == f"ok {len(folders[d])}", f"{d}: {err[-2000:]}"


def test_recipes_found():
    assert TOY in _recipes()


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "tools" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_docs_up_to_date():
    docs = (ROOT / "docs" / "config.md").read_text()
    assert docs == _generator().render(), (
        "docs/config.md is stale: run `python tools/gen_config_docs.py > docs/config.md`"
    )


def test_config_docs_list_every_field():
    text = _generator().render()
    for cls in _sections():
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} missing from docs/config.md"
    assert "| `norm_len` | `int \\| None` | `null` |" in text
    assert "| `betas` | `list[float]` | `[0.9, 0.999]` |" in text


def test_union_fields_take_the_first_type_that_fits():
    # micro_batch_size: int | str, compile: bool | str, memory_budget_gb: float | None (ints widen to float)
    cfg = load_config(TOY, ["algo.micro_batch_size=auto", "algo.memory_budget_gb=4", "run.compile=force"])
    assert cfg.algo.micro_batch_size == "auto" and cfg.algo.memory_budget_gb == 4.0
    assert isinstance(cfg.algo.memory_budget_gb, float) and cfg.run.compile == "force"
    cfg = load_config(TOY, ["algo.micro_batch_size=12", "run.compile=true"])
    assert cfg.algo.micro_batch_size == 12 and cfg.run.compile is True
    assert load_config(TOY).algo.memory_budget_gb is None and load_config(TOY).run.compile is False
    with pytest.raises(UserError, match=r"algo.micro_batch_size: expected int or str, got \[4\] \(list\)"):
        load_config(TOY, ["algo.micro_batch_size=[4]"])
