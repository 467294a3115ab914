"""Settings declared once: a parameter dataclass's fields carry their default, bounds, choices and help, and
whether they change a result.

The dataclass checks itself with :func:`check_fields`; the recipe schema (``running/recipes.py``), the
command line and the run fingerprints (:func:`result_view`) are derived from the same fields, so a bound, a
help text or a field's part in a result is written in one place.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from aimet_quadapter.errors import QuadapterError

_BOUNDS = {"ge": ">=", "gt": ">", "le": "<="}


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str = "",  # noqa: A002 - argparse's name for it
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    choices: tuple[Any, ...] | None = None,
    result: bool = True,
    before: Any = dataclasses.MISSING,
    finite: bool = True,
) -> Any:
    """A dataclass field with its bounds (``None`` always allowed), allowed values and help text.

    ``result=False``: the field changes how a result is computed (memory, checkpoints), not the result, so
    it stays out of run fingerprints. ``before``: for a field added after run folders existed, the value
    that computes what those runs computed; at that value the field stays out of fingerprints too, so the
    old folders' cells are not computed again. ``finite=False`` admits an infinite or NaN float.
    """
    metadata = {
        "help": help,
        "choices": choices,
        "result": result,
        "before": before,
        "finite": finite,
        **{k: v for k, v in (("ge", ge), ("gt", gt), ("le", le))},
    }
    return dataclasses.field(default=default, metadata=metadata)


def default_of(f: dataclasses.Field) -> Any:
    """The default value of field ``f`` (a fresh one when it has a factory)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def bounds(f: dataclasses.Field) -> dict[str, float]:
    """The bounds of field ``f`` that are set, as pydantic ``Field`` keyword arguments."""
    return {k: f.metadata[k] for k in _BOUNDS if f.metadata.get(k) is not None}


def check_fields(obj: Any, section: str) -> None:
    """Raise :class:`QuadapterError` naming ``section.field`` for the first value outside its bounds or choices."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            raise QuadapterError(f"{section}.{f.name} must be one of {allowed}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value) and f.metadata.get("finite", True):
            raise QuadapterError(f"{section}.{f.name} must be a finite number, got {value!r}")
        limits = bounds(f)
        if limits and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise QuadapterError(f"{section}.{f.name} must be a number, got {value!r}")
        for key, limit in limits.items():
            ok = {"ge": value >= limit, "gt": value > limit, "le": value <= limit}[key]
            if not ok:
                raise QuadapterError(f"{section}.{f.name} must be {_BOUNDS[key]} {limit}, got {value!r}")


def result_view(source: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (a section of dataclass ``source``'s fields) less what leaves a result unchanged: the fields
    declared ``result=False``, and those added later that hold their ``before`` value."""
    meta: dict[str, Mapping[str, Any]] = {f.name: f.metadata for f in dataclasses.fields(source)}
    out = {}
    for name, value in values.items():
        m = meta.get(name, {})
        if not m.get("result", True):
            continue
        if m.get("before", dataclasses.MISSING) is not dataclasses.MISSING and value == m["before"]:
            continue
        out[name] = value
    return out
