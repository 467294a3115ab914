"""Imports flow one way between the package's rooms (CONTRIBUTING.md, "Layout"): a room uses those above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aimet_quadapter"
TESTS = Path(__file__).resolve().parent
# folders of the repository that are no part of the product: a test that ran their files would freeze the package's
# internals those files call
OUTSIDE = ("scripts", "research")
# ways to run or import a file by its path
BY_PATH = {"runpy", "run_path", "run_module", "syspath_prepend", "spec_from_file_location", "SourceFileLoader"}
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


def _reads_by_path(source: str) -> list[str]:
    """What in a test's ``source`` runs or imports a file by path, or names a folder of :data:`OUTSIDE`."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found += [f"imports {n}" for n in names if {*n.split(".")} & {*OUTSIDE, *BY_PATH}]
        elif isinstance(node, ast.Attribute) and node.attr in BY_PATH:
            found.append(f"calls {node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            found.append("changes sys.path")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and set(re.split(r"[/\\]", node.value)) & set(OUTSIDE)
        ):
            found.append(f"names {node.value!r}")
    return found


def test_no_test_reads_the_scripts_or_research_folders_by_path():
    """Tests import what they test from the package; a research probe is run by hand, never by a test."""
    wrong = [
        f"{path.relative_to(TESTS.parent)} {what}"
        for path in sorted(TESTS.rglob("*.py"))
        if path != Path(__file__).resolve()  # this file names the folders to look for them
        for what in _reads_by_path(path.read_text(encoding="utf-8"))
    ]
    assert not wrong, "\n".join(wrong)
    assert _reads_by_path('import runpy\nrunpy.run_path(str(ROOT / "research" / "probe.py"))') == [
        "imports runpy",
        "calls run_path",
        "names 'research'",
    ]


def test_no_class_passes_300_lines_and_no_function_60():
    """A reader holds a class or a function in mind at once: its length says whether they can."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            limit = 300 if isinstance(node, ast.ClassDef) else 60
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)
