"""The technique: Quadapter sites and their alpha, phase 1 (block-wise), phase 2 (end to end), CLE, saved states.

Only :mod:`aimet_quadapter.models` (which sites exist) and :mod:`aimet_quadapter.quant` (the sim) are used
from here; nothing in this folder knows about recipes, reports or the command line.

The names below are imported on first use: importing AIMET takes seconds, and the settings in
:mod:`aimet_quadapter.quadapter.config` must be usable (to check a recipe) without it.
"""

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

_LAZY = {
    "QuadapterSet": "adapter",
    "QuadapterResult": "api",
    "apply_cle": "api",
    "apply_phase1": "api",
    "apply_phase2": "api",
    "apply_quadapter": "api",
    "attach_quadapters": "api",
    "Phase1Result": "phase1",
    "Phase2Result": "phase2",
    "QuadapterState": "state",
}


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
