"""Shipped recipes and models by name (mmgrpo/recipes.py): `mmgrpo train shapes_t2i` and a recipe's `assets/...`
paths resolve in a source checkout and, through the same code, inside an installed wheel (mmgrpo/_data/).

The wheel itself is built, installed into a fresh venv outside the checkout and trained by .ci/wheel_check.
"""

from pathlib import Path

import pytest

from mmgrpo import recipes
from mmgrpo.config import load_config
from mmgrpo.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
T2I = ROOT / "configs" / "flow" / "shapes_t2i.yaml"


@pytest.mark.parametrize(
    "arg", ["shapes_t2i", "flow/shapes_t2i", "flow/shapes_t2i.yaml", "configs/flow/shapes_t2i.yaml", "shapes_t2i.yaml"]
)
def test_a_recipe_resolves_by_name_or_repo_path_from_any_directory(arg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the checkout: the relative path does not exist here
    assert recipes.resolve_recipe(arg).resolve() == T2I


def test_an_existing_path_is_returned_as_given(tmp_path, monkeypatch):
    mine = tmp_path / "shapes_t2i.yaml"  # same name as a shipped recipe: the user's own file wins
    mine.write_text("run: {}\n")
    monkeypatch.chdir(tmp_path)
    assert recipes.resolve_recipe("shapes_t2i.yaml") == Path("shapes_t2i.yaml")
    assert recipes.resolve_recipe(str(mine)) == mine


def test_recipe_names_list_the_shipped_recipes_not_the_accelerate_files():
    names = recipes.recipe_names()
    assert {"toy_count", "flow/shapes_t2i", "vlm/shapes_vqa", "video/shapes_grounding"} <= set(names)
    assert not [n for n in names if n.startswith("accelerate/")]


def test_an_unknown_recipe_name_lists_the_choices(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"recipe 'shapes_t3i' does not exist .* one of: .*flow/shapes_t2i"):
        recipes.resolve_recipe("shapes_t3i")
    assert recipes.resolve_recipe("nope/missing.yaml") == Path("nope/missing.yaml")  # load_config names it


def _fake_wheel(tmp_path: Path) -> Path:
    data = tmp_path / "site" / "mmgrpo" / "_data"
    for sub in ("a", "b"):
        (data / "configs" / sub).mkdir(parents=True)
        (data / "configs" / sub / "same.yaml").write_text("run: {}\n")
    (data / "configs" / "only.yaml").write_text("run: {}\n")
    (data / "assets" / "shapes-t2i").mkdir(parents=True)
    return data


def test_packaged_data_comes_first_and_an_ambiguous_name_is_refused(tmp_path, monkeypatch):
    data = _fake_wheel(tmp_path)
    monkeypatch.setattr(recipes, "_PACKAGED", data)
    monkeypatch.chdir(tmp_path)
    assert recipes.data_root() == data
    assert recipes.recipe_names() == ["a/same", "b/same", "only"]
    assert recipes.resolve_recipe("only") == data / "configs" / "only.yaml"
    assert recipes.resolve_recipe("a/same") == data / "configs" / "a" / "same.yaml"
    with pytest.raises(UserError, match=r"recipe 'same' is ambiguous: it names a/same, b/same"):
        recipes.resolve_recipe("same")


def test_shipped_model_paths_point_at_the_shipped_copy_only_when_missing_here(tmp_path, monkeypatch):
    data = _fake_wheel(tmp_path)
    monkeypatch.setattr(recipes, "_PACKAGED", data)
    work = tmp_path / "work"
    (work / "assets" / "mine").mkdir(parents=True)
    monkeypatch.chdir(work)
    tree = {
        "pipeline": {"kwargs": {"model": "assets/shapes-t2i", "other": "assets/mine", "data": "shapes:train"}},
        "rewards": [{"name": "r", "kwargs": {"model": "assets/shapes-t2i"}}, {"name": "s"}],
    }
    recipes.resolve_shipped_paths(tree)
    assert tree["pipeline"]["kwargs"] == {
        "model": str(data / "assets" / "shapes-t2i"),  # missing here, shipped: the shipped copy
        "other": "assets/mine",  # exists here: unchanged
        "data": "shapes:train",  # not a shipped path: unchanged
    }
    assert tree["rewards"][0]["kwargs"]["model"] == str(data / "assets" / "shapes-t2i")


def test_load_config_takes_a_recipe_name_outside_the_checkout(tmp_path, monkeypatch):
    by_path = load_config(ROOT / "configs" / "toy_count.yaml", ["run.output_dir=runs/x"])
    monkeypatch.chdir(tmp_path)
    assert load_config("toy_count", ["run.output_dir=runs/x"]).to_dict() == by_path.to_dict()
