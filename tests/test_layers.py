"""The program's shape: every import between exactrl modules points down the layer order or sideways, and no
modules import each other in a circle.

Every import counts: at module level, inside a function (a lazy import is still an arrow) and under
``if TYPE_CHECKING:`` (a type the checker reads is still a dependency). The imports are read with ``ast`` from
the files, so nothing is imported to check them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "exactrl"

# Bottom to top. A module may import from its own layer or below; within a layer (and within a package) only
# without forming a circle.
LAYERS: list[tuple[str, ...]] = [
    ("exactrl.config", "exactrl.progress", "exactrl.docs_gen"),
    ("exactrl.ops",),
    ("exactrl.model",),
    ("exactrl.engine",),
    ("exactrl.algorithms", "exactrl.tasks", "exactrl.envs"),
    ("exactrl.distributed",),
    ("exactrl.train",),
    ("exactrl.guard",),
    (
        "exactrl.parity",
        "exactrl.report",
        "exactrl.bench_records",
        "exactrl.bench_torch",
        "exactrl.bench",
        "exactrl.bench_rl",
    ),
    ("exactrl.commands",),
    ("exactrl.cli",),
]

# Edges allowed to break the rules: none, and nothing may be added. Each entry would be (importing module, imported
# module); an entry whose import is gone fails the test, so the list can only shrink.
KNOWN: set[tuple[str, str]] = set()


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, modules: set[str], root: Path = PACKAGE) -> set[str]:
    """The exactrl modules `path` imports anywhere in its body. `from a.b import c` names the module `a.b.c` when
    there is one, else `a.b`."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import exactrl.a.b as x`, or a name inside a package
                target = target.rpartition(".")[0]
            if target.startswith("exactrl") and target != name:
                out.add(target)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    return {module_name(f, root): imported_modules(f, modules, root) for f in files}


def layer_of(module: str) -> int | None:
    for i, group in enumerate(LAYERS):
        if any(module == top or module.startswith(top + ".") for top in group):
            return i
    return None


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for src, dsts in sorted(graph.items()):
        for dst in sorted(dsts):
            a, b = layer_of(src), layer_of(dst)
            if a is not None and b is not None and b > a:
                out.append(f"{src} (layer {a + 1}) imports {dst} (layer {b + 1})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan), as the list of modules in order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:  # walk inside the group from its first module back to it: a circle to name
        start = min(group)
        path, seen = [start], {start}
        while True:
            nxt = sorted(w for w in graph[path[-1]] if w in group)
            back = [w for w in nxt if w == start]
            if back and len(path) > 1:
                break
            fresh = [w for w in nxt if w not in seen]
            if not fresh:  # every neighbour seen: close the circle at the first one already on the path
                w = next(w for w in nxt if w in path)
                path = path[path.index(w) :]
                break
            path.append(fresh[0])
            seen.add(fresh[0])
        out.append([*path, path[0]])
    return sorted(out)


def shape_errors(graph: dict[str, set[str]], known: set[tuple[str, str]] = frozenset()) -> list[str]:
    errors = [
        f"KNOWN lists {a} -> {b}, an import that is gone: remove it from KNOWN"
        for a, b in sorted(known)
        if b not in graph.get(a, set())
    ]
    graph = {a: {b for b in bs if (a, b) not in known} for a, bs in graph.items()}
    errors += [f"upward import: {e}" for e in upward_edges(graph)]
    errors += ["import circle: " + " -> ".join(c) for c in cycles(graph)]
    return errors


def test_every_module_has_a_layer():
    assert [m for m in import_graph() if m != "exactrl" and layer_of(m) is None] == []


def test_imports_point_down_and_form_no_circle():
    errors = shape_errors(import_graph(), KNOWN)
    assert not errors, "\n".join(errors)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / "exactrl" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "exactrl"


@pytest.mark.parametrize(
    "where",
    [
        "from exactrl.engine.b import x\n",  # module level
        "def f():\n    from exactrl.engine import b\n",  # lazy
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",  # checker-only, relative
    ],
)
def test_a_planted_circle_is_named(tmp_path, where):
    root = _write(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/a.py": where,
            "engine/b.py": "import exactrl.engine.a\n",
        },
    )
    assert shape_errors(import_graph(root)) == [
        "import circle: exactrl.engine.a -> exactrl.engine.b -> exactrl.engine.a"
    ]


def test_a_planted_upward_import_is_named(tmp_path):
    root = _write(
        tmp_path,
        {"__init__.py": "", "config/__init__.py": "def f():\n    from exactrl.train.loop import RLRun\n"},
    )
    root.joinpath("train").mkdir()
    root.joinpath("train", "__init__.py").write_text("")
    root.joinpath("train", "loop.py").write_text("RLRun = 1\n")
    graph = import_graph(root)
    assert shape_errors(graph) == [
        "upward import: exactrl.config (layer 1) imports exactrl.train.loop (layer 7)"
    ]
    # A known edge is left out; one that is no longer there is called stale.
    assert shape_errors(graph, {("exactrl.config", "exactrl.train.loop")}) == []
    assert shape_errors(graph, {("exactrl.config", "exactrl.ops")})[0].startswith(
        "KNOWN lists exactrl.config"
    )
