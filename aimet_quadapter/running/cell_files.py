"""A cell's folder, written as its method hands things over (``methods.records.Records``): states, curves, Fig. 4."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from aimet_quadapter.atomic import write_text_atomic
from aimet_quadapter.methods.catalog import BC
from aimet_quadapter.methods.records import Records

if TYPE_CHECKING:  # the executor imports this file before a recipe is checked: AIMET comes with the first cell
    import torch

    from aimet_quadapter.models import PreparedLM
    from aimet_quadapter.quadapter.phase1 import Phase1Result
    from aimet_quadapter.quadapter.state import QuadapterState

PHASE2_CURVE = "phase2_losses.json"


def curve_file(name: str) -> str:
    """The file of method ``name``'s phase-2 curve; Quadapter's has no method prefix."""
    return PHASE2_CURVE if name == "quadapter" else f"{name}_{PHASE2_CURVE}"


class CellFiles(Records):
    """Writes into ``folder``, every state stamped with ``model_name`` and ``fingerprint`` (checked by export, eval)."""

    def __init__(
        self,
        folder: Path,
        model_name: str | None = None,
        fingerprint: str | None = None,
        calibration: list[torch.Tensor] | None = None,
        extra_sites: bool | Iterable[str] | None = None,
    ):
        super().__init__()
        self.folder = folder
        self.stamp = {"model": model_name} if model_name else {}
        if fingerprint:
            self.stamp["fingerprint"] = fingerprint
        self.calibration = calibration or []
        self.extra_sites = extra_sites

    def state(self, name: str, state: QuadapterState) -> None:
        super().state(name, state)
        # the method that made it (a composition continues a state that says "quadapter"), for the export and `eval`
        state = dataclasses.replace(state, metadata={**state.metadata, "method": name, **self.stamp})
        state.save(self.folder / f"{name}.safetensors")

    def phase1(self, result: Phase1Result) -> None:
        from aimet_quadapter.running.plots import plot_phase1_curves

        record = {
            "losses": result.losses,
            "error_before": result.error_before,
            "error_after": result.error_after,
            "validation": result.validation,
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.folder / "phase1_losses.json", json.dumps(record))
        plot_phase1_curves(result.losses, self.folder / "phase1_curves.png")

    def curve(self, name: str, losses: list[float]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.folder / curve_file(name), json.dumps(losses))

    def channel_ranges(self, name: str, model: PreparedLM, state: QuadapterState) -> None:
        """Fig. 4: the last site's activation per channel, before and after folding its alpha."""
        from aimet_quadapter.models import PreparedLM, weight_sharing_copy
        from aimet_quadapter.quadapter.adapter import fold_alphas
        from aimet_quadapter.quadapter.cle import channel_min_max
        from aimet_quadapter.running.plots import plot_channel_ranges

        if not self.calibration:
            return
        site = model.sites(extra=self.extra_sites)[-1]
        batches = self.calibration[:2]
        before = channel_min_max(model, site, batches)
        folded = cast(PreparedLM, weight_sharing_copy(model))
        fold_alphas(folded, [site], state.alphas)
        after = channel_min_max(folded, site, batches)
        png = "channel_ranges.png" if name == BC else f"channel_ranges_{name}.png"
        plot_channel_ranges(before, after, self.folder / png, site.name)
