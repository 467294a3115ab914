"""Imports flow one way between the package's rooms (CONTRIBUTING.md, "Layout"): a room uses those above it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aimet_quadapter"
# top-level modules (errors, settings, ...) come first; testing.py builds tiny models for tests and benchmarks
ROOMS = ["models", "quant", "text", "quadapter", "export", "methods", "running", "reporting", "testing", "cli"]


def _room(module: str) -> int:
    parts = module.split(".")
    if parts[0] != "aimet_quadapter" or len(parts) == 1:
        return -1
    return ROOMS.index(parts[1]) if parts[1] in ROOMS else -1


def test_each_room_imports_only_the_rooms_above_it():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        here = _room(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            wrong += [f"{module} imports {n}" for n in names if _room(n) > here]
    assert not wrong, "\n".join(sorted(wrong))


def _imports() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports, anywhere in its file."""
    modules = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found |= {n for n in names if n in modules and n != module}
        graph[module] = found
    return graph


def test_no_module_of_the_package_imports_itself_through_others():
    """Type-checking and in-function imports count too; a package's ``__init__`` re-exporting its modules does not."""
    packages = {".".join(p.relative_to(PACKAGE.parent).parts[:-1]) for p in PACKAGE.rglob("__init__.py")}
    graph = {m: deps - packages for m, deps in _imports().items() if m not in packages}
    circles = []
    for start in graph:
        stack = [(start, [start])]
        seen = set()
        while stack:
            module, path = stack.pop()
            for nxt in graph[module]:
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not circles, "\n".join(sorted(set(circles))[:20])
