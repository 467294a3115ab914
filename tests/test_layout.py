"""Imports flow one way between the package's rooms (docs/usage.md, "Layout"): a room uses those above it."""

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
