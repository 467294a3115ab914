"""What a method hands over while it runs; a run's harness passes its own (``running/cell_files.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a run imports AIMET only once its recipe has been checked
    from aimet_quadapter.models import PreparedLM
    from aimet_quadapter.quadapter.phase1 import Phase1Result
    from aimet_quadapter.quadapter.state import QuadapterState

# the prefix of the folders where the FP model's weights wait while a method works on a copy
PARKED_FP = ".parked-fp-"


class Records:
    """What a method hands over as it makes it; here only the names of the states (a run passes its own)."""

    def __init__(self) -> None:
        self.states: set[str] = set()

    def state(self, name: str, state: QuadapterState) -> None:
        self.states.add(name)

    def phase1(self, result: Phase1Result) -> None:
        pass

    def curve(self, name: str, losses: list[float]) -> None:
        pass

    def channel_ranges(self, name: str, model: PreparedLM, state: QuadapterState) -> None:
        pass
