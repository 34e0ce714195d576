"""The import graph of the source packages: no cycle anywhere (lazy and type-only imports
count: a cycle hidden in a function is still two modules that need each other), and no
import against the layering of docs/architecture.md, between packages and between the
router's subpackages."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "engine", "transfer", "router", "worker", "producer", "consumer",
            "deploy")
# a package may import its own layer's modules and any lower layer's, never a higher one
LAYER = {"kernels": 1, "engine": 2, "transfer": 3, "router": 3, "worker": 4, "producer": 5,
         "consumer": 5, "deploy": 6}
# inside router/: control <- requests <- http, grpc_stream <- server; config and auth are leaves
ROUTER_LAYER = {"router.control": 1, "router.requests": 2, "router.http": 3,
                "router.grpc_stream": 3, "router.server": 4}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            parts = p.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the source modules it imports, at any depth of the file. ``from pkg import
    mod`` is an edge to ``pkg.mod``; to ``pkg`` (its __init__) only for other names."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names
                        if f"{node.module}.{a.name}" in mods]
                out.update(subs)
                if len(subs) < len(node.names):
                    out.add(node.module)
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _router_layer(mod: str) -> int:
    return next((n for k, n in ROUTER_LAYER.items() if mod == k or mod.startswith(k + ".")), 0)


def upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        top = mod.split(".")[0]
        for dep in sorted(deps):
            dtop = dep.split(".")[0]
            if LAYER[dtop] > LAYER[top] or (LAYER[dtop] == LAYER[top] and dtop != top):
                bad.append(f"{mod} imports {dep}")
            elif top == dtop == "router" and _router_layer(dep) > _router_layer(mod):
                bad.append(f"{mod} imports {dep}")
    return bad


def test_no_import_cycle() -> None:
    graph = import_graph(module_files())
    assert len(graph) > 150 and sum(map(len, graph.values())) > 300
    assert cycles(graph) == []


def test_no_upward_import() -> None:
    assert upward(import_graph(module_files())) == []


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "engine" / "a.py").write_text("def f():\n    from engine.b import g\n")
    (tmp_path / "engine" / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                              "if TYPE_CHECKING:\n    from engine import a\n")
    (tmp_path / "kernels" / "k.py").write_text("import engine.a\n")
    (tmp_path / "router" / "control").mkdir()
    (tmp_path / "router" / "requests").mkdir()
    (tmp_path / "router" / "control" / "x.py").write_text("from router.requests.y import z\n")
    (tmp_path / "router" / "requests" / "y.py").write_text("z = 1\n")
    graph = import_graph(module_files(tmp_path))
    assert cycles(graph) == [["engine.a", "engine.b"]]
    assert upward(graph) == ["kernels.k imports engine.a",
                             "router.control.x imports router.requests.y"]
