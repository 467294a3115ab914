"""The technique: Quadapter sites and their alpha, phase 1 (block-wise), phase 2 (end to end), CLE, saved states.

Only :mod:`aimet_quadapter.models` (which sites exist) and :mod:`aimet_quadapter.quant` (the sim) are used
from here; nothing in this folder knows about recipes, reports or the command line.
"""

from aimet_quadapter.quadapter.adapter import QuadapterSet
from aimet_quadapter.quadapter.api import (
    QuadapterParameters,
    QuadapterResult,
    apply_cle,
    apply_phase1,
    apply_phase2,
    apply_quadapter,
    attach_quadapters,
)
from aimet_quadapter.quadapter.phase1 import Phase1Parameters, Phase1Result
from aimet_quadapter.quadapter.phase2 import Phase2Parameters, Phase2Result
from aimet_quadapter.quadapter.state import QuadapterState

__all__ = [
    "Phase1Parameters",
    "Phase1Result",
    "Phase2Parameters",
    "Phase2Result",
    "QuadapterParameters",
    "QuadapterResult",
    "QuadapterSet",
    "QuadapterState",
    "apply_cle",
    "apply_phase1",
    "apply_phase2",
    "apply_quadapter",
    "attach_quadapters",
]
