"""The technique: Quadapter sites and their alpha, phase 1, phase 2, CLE, saved states. The names below are imported
on first use, so that the settings in :mod:`aimet_quadapter.quadapter.config` are usable without AIMET."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aimet_quadapter.quadapter.config import Phase1Parameters, Phase2Parameters, QuadapterParameters, RunOptions

if TYPE_CHECKING:
    from aimet_quadapter.quadapter.adapter import QuadapterSet
    from aimet_quadapter.quadapter.api import (
        QuadapterResult,
        apply_cle,
        apply_phase1,
        apply_phase2,
        apply_quadapter,
        attach_quadapters,
    )
    from aimet_quadapter.quadapter.phase1 import Phase1Result
    from aimet_quadapter.quadapter.phase2 import Phase2Result
    from aimet_quadapter.quadapter.state import QuadapterState

_MODULES = {
    "adapter": ["QuadapterSet"],
    "api": ["QuadapterResult", "apply_cle", "apply_phase1", "apply_phase2", "apply_quadapter", "attach_quadapters"],
    "phase1": ["Phase1Result"],
    "phase2": ["Phase2Result"],
    "state": ["QuadapterState"],
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = [
    "Phase1Parameters",
    "Phase1Result",
    "Phase2Parameters",
    "Phase2Result",
    "QuadapterParameters",
    "QuadapterResult",
    "QuadapterSet",
    "QuadapterState",
    "RunOptions",
    "apply_cle",
    "apply_phase1",
    "apply_phase2",
    "apply_quadapter",
    "attach_quadapters",
]
