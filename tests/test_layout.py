"""The package import rules (docs/architecture.md): checked over the source with `ast`, so
an import hidden inside a function breaks the rule as surely as one at the top."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# what the engine must never depend on: services, gRPC and transports
ENGINE_FORBIDDEN = {"grpc", "zmq", "ucxx", "transfer", "worker", "producer", "consumer",
                    "router"}
WORKER_FORBIDDEN = {"producer", "consumer"}


def top_level_imports(path: Path) -> set[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the file, at any depth."""
    found: set[tuple[int, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update((node.lineno, a.name.split(".")[0]) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.lineno, node.module.split(".")[0]))
    return found


def violations(package: str, forbidden: set[str]) -> list[str]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no modules: the check would pass vacuously"
    return [f"{f.relative_to(ROOT)}:{line} imports {mod}"
            for f in files for line, mod in sorted(top_level_imports(f)) if mod in forbidden]


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from producer.handler import X\n"
                   "    import consumer.colocated as c\n")
    assert top_level_imports(src) == {(1, "os"), (4, "producer"), (5, "consumer")}


def test_worker_imports_no_role_package() -> None:
    assert violations("worker", WORKER_FORBIDDEN) == []


def test_engine_imports_no_service_grpc_or_transport() -> None:
    assert violations("engine", ENGINE_FORBIDDEN) == []


@pytest.mark.parametrize("package", ["producer", "consumer"])
def test_roles_do_not_import_each_other_or_the_router(package: str) -> None:
    other = {"producer": "consumer", "consumer": "producer"}[package]
    assert violations(package, {other, "router"}) == []


def test_router_runs_without_torch() -> None:
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                     for p in (ROOT / "router").rglob("*.py") if p.stem != "__init__")
    assert len(modules) > 10
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print('ok', len(sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok")


# The rule is "a file holds one idea" (docs/architecture.md, "One idea per file"): a reviewer
# judges it, a line count cannot. This bound only catches a file that has plainly grown a
# second idea unnoticed: twice the size of the largest modules that hold one (the engine,
# its config, the transfer receiver: each under 400 lines).
SANITY_LINES = 800
SOURCE_DIRS = ("engine", "kernels", "transfer", "worker", "producer", "consumer", "router",
               "deploy", "bench", "tests")


def test_no_source_file_has_plainly_outgrown_one_idea() -> None:
    """Generated gRPC code aside."""
    long = {str(p.relative_to(ROOT)): n for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")
            if "_pb2" not in p.name and (n := len(p.read_text().splitlines())) > SANITY_LINES}
    assert long == {}
