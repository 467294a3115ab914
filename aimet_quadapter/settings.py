"""Settings declared once, as pydantic models whose fields carry default, bounds, choices, help and part in a result."""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from aimet_quadapter.errors import QuadapterError

_BOUNDS = {"ge": ">=", "gt": ">", "le": "<="}
_MISSING = object()
S = TypeVar("S", bound="Settings")
_in_schema: ContextVar[bool] = ContextVar("in_schema", default=False)


@contextmanager
def validating_a_schema() -> Iterator[None]:
    """While inside, a bad value raises pydantic's ``ValidationError`` (for a recipe to locate), not QuadapterError."""
    token = _in_schema.set(True)
    try:
        yield
    finally:
        _in_schema.reset(token)


def setting(
    default: Any = _MISSING,
    *,
    help: str = "",  # noqa: A002 - argparse's name for it
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    result: bool = True,
    before: Any = _MISSING,
    finite: bool = True,
    default_factory: Any = None,
) -> Any:
    """A field with its bounds (``None`` always allowed) and help. ``result=False``: out of run fingerprints (it changes
    how, not what); ``before``: the value older runs computed with (out at it too); ``finite=False``: inf, NaN ok."""
    extra = {"result": result, "finite": finite, **({"before": before} if before is not _MISSING else {})}
    kwargs: dict[str, Any] = {"description": help or None, "ge": ge, "gt": gt, "le": le, "json_schema_extra": extra}
    if default_factory is not None:
        return Field(default_factory=default_factory, **kwargs)
    return Field(default, **kwargs) if default is not _MISSING else Field(**kwargs)


class Settings(BaseModel):
    """A section of settings (``section`` names it in recipes, options and errors)."""

    model_config = ConfigDict(extra="forbid", validate_default=False)
    section: ClassVar[str] = "settings"

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as error:
            if _in_schema.get():  # a section of a larger schema (a recipe): pydantic reports the field's path
                raise
            raise QuadapterError(_first_error(self.section, error)) from None

    @field_validator("*", mode="before")
    @classmethod
    def _finite(cls, value: Any, info: ValidationInfo) -> Any:
        # before the bounds, which a NaN fails with a misleading message
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, float) and not math.isfinite(value) and field and extra_of(field).get("finite", True):
            raise PydanticCustomError("finite_number", "Input should be a finite number")
        return value

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes``, checked as a new instance is."""
        return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields}, **changes})


def _first_error(section: str, error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in (section, *first["loc"]))
    value = first.get("input")
    kind = first["type"]
    if kind == "finite_number":
        return f"{where} must be a finite number, got {value!r}"
    context = first.get("ctx") or {}
    for key, sign in _BOUNDS.items():
        if key in context:
            return f"{where} must be {sign} {context[key]}, got {value!r}"
    if kind == "literal_error":
        return f"{where} must be one of {context.get('expected', '').replace(' or ', ', ')}, got {value!r}"
    if kind.endswith(("_type", "_parsing", "_from_float")):
        what = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string"}
        return f"{where} must be {what.get(kind.split('_')[0], 'a ' + kind.split('_')[0])}, got {value!r}"
    message = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:  # a check of the whole section: its message starts with the field it names
        return f"{section}.{message}"
    return f"{where}{message}" if message.startswith("[") else f"{where}: {message}"


def extra_of(field: FieldInfo) -> Mapping[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, Mapping) else {}


def default_of(field: FieldInfo) -> Any:
    """The default value of ``field`` (a fresh one when it has a factory)."""
    return field.get_default(call_default_factory=True)


def bounds(field: FieldInfo) -> dict[str, float]:
    """The bounds of ``field`` that are set, by pydantic's names (``ge``, ``gt``, ``le``)."""
    return {
        key: getattr(item, key) for item in field.metadata for key in _BOUNDS if getattr(item, key, None) is not None
    }


def choices(field: FieldInfo) -> tuple[Any, ...] | None:
    """The values a ``Literal`` field allows (None for any other)."""
    annotation = field.annotation
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    return None


def result_view(source: type[BaseModel], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (of ``source``'s fields) less those declared ``result=False`` or at their ``before`` value."""
    extras = {name: extra_of(f) for name, f in source.model_fields.items()}
    out = {}
    for name, value in values.items():
        extra = extras.get(name, {})
        if extra.get("result", True) and not ("before" in extra and value == extra["before"]):
            out[name] = value
    return out


def pattern_entries(
    entries: tuple[str, ...], field: str, form: str, value: Callable[[str], Any]
) -> list[tuple[str, Any]]:
    """``PATTERN=VALUE`` entries as (pattern, value) pairs; ``value`` converts the text after the last ``=``."""
    pairs = []
    for i, entry in enumerate(entries):
        pattern, sep, text = str(entry).rpartition("=")
        where = f"{field}[{i}]"
        if not sep or not pattern.strip():
            raise ValueError(f"{where}: {entry!r} is not {form}")
        try:
            pairs.append((pattern.strip(), value(text.strip())))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return pairs
