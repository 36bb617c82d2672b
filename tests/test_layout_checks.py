"""The layout checks of test_layout.py can fail: a fake cycle, upward edge, oversized unit or bare local import is
caught and named, and an allow-list entry that no longer applies must be removed.
"""

import test_layout
from test_layout import (
    ALLOWED_CYCLE_EDGES,
    ALLOWED_UPWARD_EDGES,
    CORE,
    LOOP,
    PROGRAMS,
    REWARDS,
    bare_local_imports,
    cycle_edges,
    cycle_problems,
    import_graph,
    layer,
    local_import_problems,
    module_name,
    size_problems,
    unit_sizes,
    upward_problems,
)

edges, named_edges = test_layout.edges, test_layout.named_edges  # the repository's import graph, as fixtures


# ----- the checks can fail: fake edges and units
def test_a_new_cycle_fails_naming_the_edge(edges):
    fake = {**edges, ("mmgrpo.registry", "mmgrpo.losses"): "fake.py:1"}  # losses imports registry: a 2-cycle
    problems = cycle_problems(fake, ALLOWED_CYCLE_EDGES)
    assert any("mmgrpo.registry imports mmgrpo.losses (fake.py:1)" in p for p in problems), problems
    assert any("mmgrpo.registry -> mmgrpo.losses -> mmgrpo.registry" in p for p in problems), problems
    # a longer cycle through an allowed edge still fails on its new edges, and only on them
    allowed = {("a", "b"): "why", ("b", "a"): "why"}
    assert cycle_problems({("a", "b"): "a.py:1", ("b", "a"): "b.py:1"}, allowed) == []
    longer = {("a", "b"): "a.py:1", ("b", "a"): "b.py:1", ("b", "c"): "b.py:2", ("c", "a"): "c.py:1"}
    assert [p.split(" (")[0] for p in cycle_problems(longer, allowed)] == [
        "import cycle: b imports c",
        "import cycle: c imports a",
    ]


def test_an_upward_edge_fails_naming_it(named_edges):
    edges = named_edges
    fake = {**edges, ("mmgrpo.losses", "pipelines.flow.sde"): "mmgrpo/losses.py:9"}
    today = upward_problems(edges, ALLOWED_UPWARD_EDGES)
    problems = [p for p in upward_problems(fake, ALLOWED_UPWARD_EDGES) if p not in today]
    assert problems == [
        (
            "upward import: mmgrpo.losses (core) imports pipelines.flow.sde (pipelines) at "
            "mmgrpo/losses.py:9; a layer may import only itself and the layers below (core <- "
            "rewards/world <- pipelines <- programs <- bench): move the shared part down or register it "
            "through an entry point"
        )
    ]
    assert upward_problems({("bench.flow", "mmgrpo.losses"): "b.py:1"}, {}) == []  # downward is fine


def test_a_fixed_edge_must_leave_the_allow_list():
    problems = upward_problems({}, {("mmgrpo.cli", "pipelines"): "gone"})
    assert problems == [
        (
            "allow-list entry ALLOWED_UPWARD_EDGES[('mmgrpo.cli', 'pipelines')] is gone (no longer "
            "imported or no longer upward); delete it from tests/test_layout.py"
        )
    ]
    assert "no longer closes a cycle" in cycle_problems({("a", "b"): "x"}, {("a", "b"): "why"})[0]


def test_the_graph_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "mmgrpo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from ..top import x\n")
    (pkg / "top.py").write_text("import importlib\nif True:\n    importlib.import_module('mmgrpo.sub.leaf')\n")
    (pkg / "runner.py").write_text("RUN = {'leaf': 'mmgrpo.sub.leaf', 'other': 'mmgrpo.nothing'}\n")
    files = {module_name(p, tmp_path): p for p in pkg.rglob("*.py")}
    got = set(import_graph(files, tmp_path))
    assert set(import_graph(files, tmp_path, named=True)) - got == {("mmgrpo.runner", "mmgrpo.sub.leaf")}
    assert got == {
        ("mmgrpo.sub", "mmgrpo.sub.leaf"),
        ("mmgrpo.sub.leaf", "mmgrpo.top"),
        ("mmgrpo.top", "mmgrpo.sub.leaf"),
    }
    assert set(cycle_edges(dict.fromkeys(got, ""))) == {
        ("mmgrpo.sub.leaf", "mmgrpo.top"),
        ("mmgrpo.top", "mmgrpo.sub.leaf"),
    }


def test_an_oversized_function_or_file_fails(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    path = tmp_path / "m.py"
    path.write_text(f"class A:\n    @staticmethod\n    def big():\n{body}\n\n\ndef small():\n    return 1\n")
    sizes = unit_sizes(path, "m.py")
    assert sizes == {"m.py": 67, "m.py::A.big": 62, "m.py::small": 2}
    assert size_problems(sizes, {}) == [
        ("function m.py::A.big has 62 lines, over the 60-line limit; split it by responsibility")
    ]
    assert size_problems(sizes, {"m.py::A.big": (62, "why")}) == []
    assert "so it grew" in size_problems(sizes, {"m.py::A.big": (61, "why")})[0]
    assert size_problems({"big.py": 451, LOOP: 150}, {}) == [
        ("file big.py has 451 lines, over the 450-line limit; split it by responsibility")
    ]


def test_a_bare_local_import_fails_and_a_commented_one_passes(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import os\n\n\n"
        "def bare():\n    import json\n\n\n"
        "class A:\n    def commented(self):\n"
        "        # lazy: heavy\n        import torch\n        from . import sub\n\n"
        "        import numpy  # lazy: heavy too\n"
        "        if True:\n            import re\n"
    )
    found = bare_local_imports(path, "m.py")
    assert found == ["m.py:5 json", "m.py:16 re"]  # module level, grouped, inline: fine; a new block is a new run
    assert local_import_problems({"m.py": found}, {})[0].startswith(
        "function-local import without a `# lazy:` comment: m.py:5 json; move it to the module's imports"
    )
    assert local_import_problems({"m.py": found}, {"m.py": (2, "why")}) == []
    assert "so it grew" in local_import_problems({"m.py": found}, {"m.py": (1, "why")})[0]
    assert "delete it" in local_import_problems({"m.py": []}, {"m.py": (2, "why")})[0]


def test_the_world_is_layer_1_and_its_programs_layer_3():
    assert layer("mmgrpo_shapes") == layer("mmgrpo_shapes.verifier") == layer("rewards.shapes") == REWARDS
    assert layer("mmgrpo_shapes.programs") == layer("mmgrpo_shapes.programs.pretrain_vlm") == PROGRAMS
    assert layer("mmgrpo.cli") == CORE  # a prefix of the name is not the package
    fake = {("mmgrpo_shapes.vqa", "mmgrpo_shapes.programs.pretrain_vlm"): "mmgrpo_shapes/vqa.py:1"}
    assert upward_problems(fake, {})[0].startswith(
        "upward import: mmgrpo_shapes.vqa (rewards/world) imports mmgrpo_shapes.programs.pretrain_vlm (programs)"
    )
