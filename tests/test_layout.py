"""The repository's layout, guarded (issue 17): no import cycles, imports point one way down the layers, small units.

Layers, lowest first; a module may import its own layer and the ones below, never one above:
  0 core      mmgrpo/                                 maths, engine, contracts
  1 rewards   rewards/  and the ShapesWorld world     mmgrpo_shapes/ (scenes, verifier, VQA, video)
  2 pipelines pipelines/                              flow, vlm, video, toy
  3 programs  mmgrpo_shapes/programs/ (pretraining, probes, reports), compare, demos, SFT, tools/
  4 bench     bench/
Every import counts: module-level, function-local, under `if`, and `importlib.import_module("literal")`; the layer
check also counts a string that is exactly a dotted first-party module name (a table of modules to run). Tests are
not a layer (they may import anything) and are not scanned.

An import inside a function is only for an optional heavy dependency, and says why on its line or in the comment
directly above its run of imports: `# lazy: transformers is heavy to import; only model loading needs it`.

Today's cycles, upward edges, oversized files/functions and bare local imports sit in the allow-lists below, each
with why it is still there and what removes it. The lists can only shrink: a NEW cycle, upward edge, oversized unit or
bare local import fails naming it, and an entry that no longer applies fails too, asking for its removal (so a fix is
recorded where it happens).
"""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mmgrpo", "mmgrpo_shapes", "rewards", "pipelines", "bench", "tools")
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_LOOP_LINES = 450, 60, 150
LOOP = "mmgrpo/trainer.py::train"  # the training loop, allowed MAX_LOOP_LINES
CORE, REWARDS, PIPELINES, PROGRAMS, BENCH = range(5)
LAYER_NAMES = ("core", "rewards/world", "pipelines", "programs", "bench")
WORLD, WORLD_PROGRAMS = "mmgrpo_shapes", "mmgrpo_shapes.programs"  # ShapesWorld: layer 1, its programs layer 3
PROGRAMS_MODULES = (  # programs that still live inside pipelines/
    "pipelines.flow.compare",
    "pipelines.video.demo",
    "pipelines.vlm.sft",
)

# (importer, imported) -> why it still exists and what removes it. Only edges that close a cycle are listed.
ALLOWED_CYCLE_EDGES: dict[tuple[str, str], str] = {}

# (importer, imported) -> why the lower layer still names a higher one, and what removes it.
ALLOWED_UPWARD_EDGES: dict[tuple[str, str], str] = {}

# "path::Qualified.name" or "path" -> (lines today, why): may not grow past today's lines; split it to drop the entry.
ALLOWED_LARGE: dict[str, tuple[int, str]] = {}

# "path" -> (function-local imports without a `# lazy:` comment today, why): may not grow; fix them to drop the entry.
ALLOWED_BARE_LOCAL_IMPORTS: dict[str, tuple[int, str]] = {}
LAZY = "# lazy:"


# ----- the import graph
def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """module name -> file, for every first-party source file (tests excluded)."""
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


@functools.cache
def _parse(path: Path) -> tuple[str, ast.Module]:
    text = path.read_text(encoding="utf-8")
    return text, ast.parse(text, str(path))


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names one import statement (or importlib.import_module("literal") call) may load."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        return [f"{base}.{a.name}" for a in node.names] + [base]  # `from pkg import sub` may load the submodule
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def _resolve(name: str, modules: set[str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(files: dict[str, Path], root: Path = ROOT, *, named: bool = False) -> dict[tuple[str, str], str]:
    """(importer, imported) -> "path:line" of the first import, over first-party modules only.

    named=True also counts a string that is exactly a dotted first-party module name (`"pipelines.flow.compare"` in a
    table of modules to run): the layer check needs it, the cycle check does not (running a module is not importing
    it at import time).
    """
    modules, edges = set(files), {}
    for module, path in files.items():
        for node in ast.walk(_parse(path)[1]):
            names = _imported_names(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):  # `from a import b`: the submodule a.b if it is one, else a
                subs = [n for n in names[:-1] if n in modules]
                names = subs + (names[-1:] if len(subs) < len(names) - 1 else [])
            elif (
                named
                and isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and "." in node.value
                and node.value in modules
            ):
                names = [node.value]
            for name in names:
                target = _resolve(name, modules)
                if target and target != module:
                    edges.setdefault((module, target), f"{path.relative_to(root)}:{node.lineno}")
    return edges


def layer(module: str) -> int:
    top = module.split(".")[0]
    if top == "mmgrpo":
        return CORE
    if module == WORLD_PROGRAMS or module.startswith(WORLD_PROGRAMS + "."):
        return PROGRAMS
    if top in ("rewards", WORLD):
        return REWARDS
    if module in PROGRAMS_MODULES or top == "tools":
        return PROGRAMS
    return {"pipelines": PIPELINES, "bench": BENCH}[top]


# ----- the checks (pure functions of the graph, so a fake edge can prove they fail)
def _strongly_connected(nodes: set[str], succ: dict[str, set[str]]) -> list[set[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []
    for start in sorted(nodes):  # iterative Tarjan
        if start in index:
            continue
        work = [(start, iter(sorted(succ.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    comp.add(w)
                    if w == v:
                        break
                components.append(comp)
    return components


def _path(succ: dict[str, set[str]], src: str, dst: str, within: set[str]) -> list[str]:
    """Shortest import chain src -> ... -> dst inside one cycle (breadth first)."""
    prev: dict[str, str | None] = {src: None}
    frontier = [src]
    while frontier and dst not in prev:
        nxt = []
        for v in frontier:
            for w in sorted(succ.get(v, ())):
                if w in within and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    chain, v = [], dst
    while v is not None:
        chain.append(v)
        v = prev[v]
    return chain[::-1]


def cycle_edges(edges: dict[tuple[str, str], str]) -> dict[tuple[str, str], str]:
    """Every edge that lies on an import cycle -> the cycle it closes, written a -> b -> ... -> a."""
    succ: dict[str, set[str]] = {}
    for a, b in edges:
        succ.setdefault(a, set()).add(b)
    nodes = {m for e in edges for m in e}
    found = {}
    for comp in _strongly_connected(nodes, succ):
        for a, b in edges:
            if a in comp and b in comp:
                found[(a, b)] = " -> ".join([a, *_path(succ, b, a, comp)])
    return found


def cycle_problems(edges: dict[tuple[str, str], str], allowed: dict[tuple[str, str], str]) -> list[str]:
    cyclic = cycle_edges(edges)
    new = [
        f"import cycle: {a} imports {b} ({edges[a, b]}) closing {cyclic[a, b]}; break it (move the shared "
        f"part down, pass what is needed as an argument)"
        for a, b in sorted(cyclic)
        if (a, b) not in allowed
    ]
    stale = [
        f"allow-list entry ALLOWED_CYCLE_EDGES[{e!r}] no longer closes a cycle; delete it from tests/test_layout.py"
        for e in sorted(allowed)
        if e not in cyclic
    ]
    return new + stale


def upward_problems(edges: dict[tuple[str, str], str], allowed: dict[tuple[str, str], str]) -> list[str]:
    upward = {(a, b) for a, b in edges if layer(a) < layer(b)}
    new = [
        f"upward import: {a} ({LAYER_NAMES[layer(a)]}) imports {b} ({LAYER_NAMES[layer(b)]}) at {edges[a, b]}; "
        f"a layer may import only itself and the layers below ({' <- '.join(LAYER_NAMES)}): move the shared part "
        f"down or register it through an entry point"
        for a, b in sorted(upward - set(allowed))
    ]
    stale = [
        f"allow-list entry ALLOWED_UPWARD_EDGES[{e!r}] is gone (no longer imported or no longer upward); "
        f"delete it from tests/test_layout.py"
        for e in sorted(set(allowed) - upward)
    ]
    return new + stale


def unit_sizes(path: Path, rel: str) -> dict[str, int]:
    """rel -> file lines, and "rel::Qualified.name" -> lines of every function (decorators to last line)."""
    text, tree = _parse(path)
    sizes = {rel: len(text.splitlines())}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    sizes[f"{rel}::{name}"] = child.end_lineno - first + 1
                visit(child, f"{name}.")

    visit(tree, "")
    return sizes


def size_limit(unit: str) -> int:
    return MAX_LOOP_LINES if unit == LOOP else MAX_FUNCTION_LINES if "::" in unit else MAX_FILE_LINES


def size_problems(sizes: dict[str, int], allowed: dict[str, tuple[int, str]]) -> list[str]:
    problems = []
    for unit, n in sorted(sizes.items()):
        limit = size_limit(unit)
        ceiling = allowed[unit][0] if unit in allowed else limit
        if n > max(limit, ceiling):
            what = "function" if "::" in unit else "file"
            grown = f" (allow-listed at {ceiling}, so it grew)" if unit in allowed else ""
            problems.append(
                f"{what} {unit} has {n} lines, over the {limit}-line limit{grown}; split it by responsibility"
            )
    for unit in sorted(allowed):
        if sizes.get(unit, 0) <= size_limit(unit):
            problems.append(
                f"allow-list entry ALLOWED_LARGE[{unit!r}] is gone or within its limit now; delete it "
                f"from tests/test_layout.py"
            )
    return problems


def bare_local_imports(path: Path, rel: str) -> list[str]:
    """Every import inside a function or method, as "rel:line module", that has no `# lazy:` comment on its own
    lines or in the comment lines directly above the run of consecutive imports it belongs to (one comment may cover
    a group)."""
    text, tree = _parse(path)
    lines = text.splitlines()
    found = []

    def marked(stmt: ast.stmt, run_start: int) -> bool:
        if any(LAZY in lines[i - 1] for i in range(stmt.lineno, stmt.end_lineno + 1)):
            return True
        above = run_start - 1
        while above >= 1 and lines[above - 1].lstrip().startswith("#"):
            if LAZY in lines[above - 1]:
                return True
            above -= 1
        return False

    def visit(node: ast.AST, in_function: bool) -> None:
        for _, block in ast.iter_fields(node):
            if not (isinstance(block, list) and block and isinstance(block[0], ast.stmt)):
                continue
            run_start = None  # first line of the current run of consecutive imports
            for stmt in block:
                if not isinstance(stmt, ast.Import | ast.ImportFrom):
                    run_start = None
                    continue
                run_start = run_start or stmt.lineno
                if in_function and not marked(stmt, run_start):
                    names = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else []
                    module = ", ".join(names) or "." * stmt.level + (stmt.module or "")
                    found.append(f"{rel}:{stmt.lineno} {module}")
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    return found


def local_import_problems(found: dict[str, list[str]], allowed: dict[str, tuple[int, str]]) -> list[str]:
    problems = []
    for rel, hits in sorted(found.items()):
        ceiling = allowed[rel][0] if rel in allowed else 0
        if len(hits) > ceiling:
            grown = f" ({rel} is allow-listed at {ceiling}, so it grew)" if rel in allowed else ""
            problems += [
                f"function-local import without a `# lazy:` comment: {hit}{grown}; move it to the module's "
                f"imports, or, for an optional heavy dependency, say why on its line or the line above "
                f"(`# lazy: transformers is heavy to import; only model loading needs it`)"
                for hit in hits
            ]
    for rel in sorted(allowed):
        if not found.get(rel):
            problems.append(
                f"allow-list entry ALLOWED_BARE_LOCAL_IMPORTS[{rel!r}] has no bare local import left; delete it "
                f"from tests/test_layout.py"
            )
    return problems


def repo_sizes() -> dict[str, int]:
    sizes = {}
    for path in source_files().values():
        sizes.update(unit_sizes(path, path.relative_to(ROOT).as_posix()))
    return sizes


# ----- the repository
@pytest.fixture(scope="module")
def edges():
    return import_graph(source_files())


@pytest.fixture(scope="module")
def named_edges():
    return import_graph(source_files(), named=True)


def test_no_new_import_cycle(edges):
    problems = cycle_problems(edges, ALLOWED_CYCLE_EDGES)
    assert not problems, "\n".join(problems)


def test_imports_point_down_the_layers(named_edges):
    problems = upward_problems(named_edges, ALLOWED_UPWARD_EDGES)
    assert not problems, "\n".join(problems)


def test_files_and_functions_stay_small():
    problems = size_problems(repo_sizes(), ALLOWED_LARGE)
    assert not problems, "\n".join(problems)


def test_local_imports_say_why_they_are_lazy():
    found = {
        p.relative_to(ROOT).as_posix(): bare_local_imports(p, p.relative_to(ROOT).as_posix())
        for p in source_files().values()
    }
    problems = local_import_problems(found, ALLOWED_BARE_LOCAL_IMPORTS)
    assert not problems, "\n".join(problems)
