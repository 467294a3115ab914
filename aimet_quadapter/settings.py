"""Settings declared once: a parameter dataclass's fields carry their default, bounds, choices and help.

The dataclass checks itself with :func:`check_fields`; the recipe schema (``experiments/recipes.py``)
and the command line are derived from the same fields, so a bound or a help text is written in one place.
"""

from __future__ import annotations

import dataclasses
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
) -> Any:
    """A dataclass field with its bounds (``None`` always allowed), allowed values and help text."""
    metadata = {"help": help, "choices": choices, **{k: v for k, v in (("ge", ge), ("gt", gt), ("le", le))}}
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
        limits = bounds(f)
        if limits and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise QuadapterError(f"{section}.{f.name} must be a number, got {value!r}")
        for key, limit in limits.items():
            ok = {"ge": value >= limit, "gt": value > limit, "le": value <= limit}[key]
            if not ok:
                raise QuadapterError(f"{section}.{f.name} must be {_BOUNDS[key]} {limit}, got {value!r}")
