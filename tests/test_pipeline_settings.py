"""Typed pipeline settings (issue 17 item 4): a pipeline registered with `settings=` documents and checks its
`pipeline.kwargs` through one dataclass that mirrors its builder's keywords exactly, validated before any model loads.
"""

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from mmgrpo.config import load_config
from mmgrpo.errors import UserError
from mmgrpo.plugins import PIPELINES, RESERVED_BUILD_KWARGS, load_plugins
from mmgrpo.schema import field_docs

load_plugins()
TYPED = [n for n in PIPELINES.names() if PIPELINES.meta(n).get("settings")]
TOY = str(Path(__file__).resolve().parents[1] / "configs" / "toy_count.yaml")


def test_the_toy_pipeline_is_typed():
    assert "toy_count" in TYPED


@pytest.mark.parametrize("name", TYPED)
def test_settings_mirror_the_builder_and_document_every_field(name):
    cls = PIPELINES.meta(name)["settings"]
    params = {
        k: p for k, p in inspect.signature(PIPELINES.get(name)).parameters.items() if k not in RESERVED_BUILD_KWARGS
    }
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if [p.kind for p in params.values()] == [inspect.Parameter.VAR_KEYWORD]:
        params = {}  # the builder takes **kwargs and reads them through pipeline_settings(cls, kwargs)
    else:
        assert list(fields) == list(params), f"{cls.__name__} fields != {name}'s builder keywords"
    hints = typing.get_type_hints(cls)
    for key, param in params.items():
        assert fields[key].default == param.default, f"{cls.__name__}.{key} default"
        assert hints[key] == param.annotation, f"{cls.__name__}.{key} type"
    docs = field_docs(cls)
    assert all(docs.get(k, "").strip() for k in fields), f"{cls.__name__}: every field needs a one-line docstring"
    cls().check()  # the defaults are valid


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("pipeline.kwargs.max_target=8", r"pipeline.kwargs.max_target \(8\) must be < max_len \(8\)"),  # cross-field
        ("pipeline.kwargs.max_len=1", r"pipeline.kwargs.max_len \(1\) must be >= 2"),
        ("pipeline.kwargs.hidden=0", r"pipeline.kwargs.hidden \(0\) must be >= 1"),
    ],
)
def test_settings_checks_stop_the_recipe_before_any_model_loads(override, message, monkeypatch):
    def no_build(**kwargs):
        raise AssertionError("the model must not be built during validation")

    monkeypatch.setattr(PIPELINES, "_items", {**PIPELINES._items, "toy_count": no_build})
    with pytest.raises(UserError, match=message):
        load_config(TOY, [override])


ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "vlm": "configs/vlm/shapes_vqa.yaml",
    "video": "configs/video/shapes_videoqa.yaml",
    "flow": "configs/flow/sd3_tiny_cpu.yaml",
}
# (pipeline, override, what the one line must name: the field, the value, the fix)
MISTAKES = [
    ("vlm", "pipeline.kwargs.max_new_tokens=many", ["pipeline.kwargs.max_new_tokens", "'many'", "expected int"]),
    ("vlm", "pipeline.kwargs.top_p=1.5", ["pipeline.kwargs.top_p (1.5)", "(0, 1]", "top_p=1"]),
    (
        "vlm",
        "pipeline.kwargs.reference=none",
        ["pipeline.kwargs.reference (none)", "algo.kl_coef (0.01)", "set pipeline.kwargs.reference=auto"],
    ),
    ("video", "pipeline.kwargs.num_frames=eight", ["pipeline.kwargs.num_frames", "'eight'", "expected int"]),
    ("video", "pipeline.kwargs.augment_noise=-1", ["pipeline.kwargs.augment_noise (-1.0)", ">= 0", "augment_noise="]),
    (
        "video",
        "pipeline.kwargs.min_frames=80",  # the recipe reads at most max_frames=64
        ["min_frames <= max_frames", "min_frames=80", "max_frames=64", "pipeline.kwargs.min_frames=2"],
    ),
    ("flow", "pipeline.kwargs.num_steps=ten", ["pipeline.kwargs.num_steps", "'ten'", "expected int"]),
    ("flow", "pipeline.kwargs.prompt_cache_items=-1", ["pipeline.kwargs.prompt_cache_items (-1)", ">= 0"]),
    ("flow", "pipeline.kwargs.reduce=median", ["pipeline.kwargs.reduce ('median')", "mean", "sum"]),
    (
        "flow",
        "pipeline.kwargs.step_weights=guard",  # GRPO-Guard's weights with the recipe's algo.loss clipped
        ["pipeline.kwargs.step_weights ('guard')", "algo.loss ('clipped')", "set algo.loss=guard_clipped"],
    ),
]


@pytest.mark.parametrize(("pipeline", "override", "needles"), MISTAKES, ids=[m[1] for m in MISTAKES])
def test_typed_pipelines_stop_a_bad_recipe_in_one_line_before_any_model_loads(
    pipeline, override, needles, capsys, monkeypatch, tmp_path
):
    from mmgrpo.cli import main

    def no_build(**kwargs):
        raise AssertionError("the model must not be built before the settings are checked")

    monkeypatch.setattr(PIPELINES, "_items", {**PIPELINES._items, pipeline: no_build})
    extra = ["algo.kl_coef=0.01"] if "reference" in override else []
    argv = ["train", str(ROOT / RECIPES[pipeline]), override, *extra, f"run.output_dir={tmp_path}/run"]
    code, err = main(argv), capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
