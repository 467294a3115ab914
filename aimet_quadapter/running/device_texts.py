"""``aimet-quadapter device-texts``: a cell's exported device graph (AIMET's ONNX simulation, needs aimet-onnx) on
every text its run scored, the same windows, beside the sim's number the run recorded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.device_check import device_lm
from aimet_quadapter.running.provenance import results_above
from aimet_quadapter.running.recipes import Recipe
from aimet_quadapter.running.runner import RecipeRun
from aimet_quadapter.text.data import Window
from aimet_quadapter.text.perplexity import perplexity

TEST, DEV = "test", "dev"  # a run's `eval` texts and its `dev` texts; one label may name one of each (ptb)
ROLES = (TEST, DEV)


@dataclass
class Text:
    role: str
    label: str
    windows: list[Window]
    sim: float  # the run's number for the cell


def cell_record(cell: Path) -> tuple[dict, Recipe]:
    """The run's record of ``cell`` and the recipe (one seed's) it ran under."""
    cell = cell.resolve()
    found = results_above(cell)
    if found is None or found[0] == cell:
        raise QuadapterError(f"{cell}: no results.json in a folder above it: give a cell folder of a run")
    run, results = found
    folder = cell.relative_to(run).as_posix()
    if (record := next((r for r in results["cells"].values() if r.get("folder") == folder), None)) is None:
        raise QuadapterError(f"{run / 'results.json'} has no cell in {folder}")
    if len(results["recipes"]) != 1:  # a merged folder: its cells do not say which recipe ran them
        raise QuadapterError(f"{run / 'results.json'} holds {len(results['recipes'])} recipes; give a run of one")
    (settings,) = (r["settings"] for r in results["recipes"].values())
    recipe = Recipe.model_validate(settings)
    return record, recipe.for_seed(record["seed"]) if record.get("seed") is not None else recipe


def texts_of(record: dict, recipe: Recipe, roles: tuple[str, ...] = ROLES) -> list[Text]:
    """The texts the run scored for ``record``, test texts then development texts, each with the sim's number."""
    run = RecipeRun(recipe, Path(".unused"), progress=False)
    scored = {TEST: (run.data.eval_windows(), record["ppl"]), DEV: (run.data.dev_windows(), record.get("dev_ppl", {}))}
    return [Text(role, label, w, scored[role][1][label]) for role in roles for label, w in scored[role][0].items()]


@contextlib.contextmanager
def scoring_lm(export: Path, first: Window) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """``export``'s graph in AIMET's ONNX simulation, ``ids -> logits``; unencoded tensors calibrated on ``first``."""
    with device_lm(export, [first.ids]) as (device, coverage):
        if coverage.missing:
            print(f"{len(coverage.missing)} tensors without an encoding, calibrated here on the first window")
        yield device


def device_perplexities(export: Path, texts: list[Text], progress: bool = False) -> list[float]:
    """The device graph's perplexity on each text's windows (one simulation for them all)."""
    with scoring_lm(export, texts[0].windows[0]) as device:
        return [perplexity(device, t.windows, desc=f"{t.label} ({t.role})", progress=progress).ppl for t in texts]
