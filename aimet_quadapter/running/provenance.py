"""Where a saved state comes from: ``export``, ``eval --state`` and ``sensitivity --state`` refuse, before any model
loads, a state of another model than ``--model`` or not the one its run folder's row was computed with."""

from __future__ import annotations

import json
from pathlib import Path

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.quadapter.config import BC_STATE
from aimet_quadapter.quadapter.state import QuadapterState


def check_model(state: QuadapterState, model: str) -> None:
    """Refuse, before the hub is asked, a state computed for another model than ``model`` (as ``--model`` takes it):
    by the families where both are known locally, else by the names (widths: :meth:`QuadapterState.check_fits`)."""
    from aimet_quadapter.models.loading import family_of

    recorded = state.metadata.get("model")
    if recorded is not None and _same_model(recorded, model):
        return
    family = state.metadata.get("family") or (family_of(recorded) if recorded else None)
    given = family_of(model)
    what = ", ".join(x for x in (recorded, f"a {family} model" if family else None) if x)
    if family and given and family != given:
        raise QuadapterError(
            f"{state.described} was computed for another model ({what}), not --model {model} (a {given} model)"
        )
    if recorded and given is None:
        raise QuadapterError(
            f"{state.described} was computed for another model ({what}) than --model {model}, whose config is not "
            f"on this machine to compare: pass --model {recorded}, or that model's folder"
        )


def check_row(state: QuadapterState) -> None:
    """Refuse a state in a run folder that is not the one its row was computed with (by the fingerprint the row, or a
    shared phase 1's ``bc_fingerprint.txt``, records). A state outside any run folder is the user's to vouch for."""
    if state.source is None or (found := results_above(state.source.resolve().parent)) is None:
        return
    run, results = found
    folder = state.source.resolve().parent.relative_to(run).as_posix()
    name = state.source.stem
    rows = [
        (key, cell)
        for key, cell in results["cells"].items()
        if isinstance(cell, dict) and cell.get("folder") == folder and cell.get("method") == name
    ]
    stamp = state.metadata.get("fingerprint")
    results_file = run / "results.json"
    expected: str | None = None
    side = state.source.parent / "bc_fingerprint.txt"  # phase 1 run on the side, shared by its methods
    if rows:
        key, cell = rows[0]
        expected, what = cell.get("fingerprint"), f"row {key} of {results_file}"
    elif name == BC_STATE and side.is_file():
        expected, what = side.read_text().strip(), f"the phase 1 its run shared ({side})"
    if rows and rows[0][1].get("error"):  # its training diverged or its perplexity is not finite
        raise QuadapterError(f"{state.described} is the state of row {rows[0][0]}, which failed: {rows[0][1]['error']}")
    if expected is not None and stamp == expected:
        return
    if expected is None:
        why = f": no row of {results_file} was computed with it (an earlier run's, or a step of another method)"
    elif stamp is None:
        why = f" carries no fingerprint: nothing says it is the state of {what}"
    else:
        why = (
            f" is not the state of {what}: it was computed under other settings (fingerprint {stamp}, "
            f"the row's {expected})"
        )
    raise QuadapterError(
        f"{state.described}{why}; run the cell again, or copy the file out of the run folder to use it as it is"
    )


def results_above(folder: Path) -> tuple[Path, dict] | None:
    """The run folder holding ``folder`` (a cell's: itself or up to three above it) and its results; None if none."""
    for candidate in [folder, *folder.parents][:4]:
        try:
            results = json.loads((candidate / "results.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(results, dict) and isinstance(results.get("cells"), dict):
            return candidate, results
    return None


def _same_model(a: str, b: str) -> bool:
    """Whether two names a ``--model`` takes name one model: equal, or one folder."""
    if a == b:
        return True
    first, second = Path(a).expanduser(), Path(b).expanduser()
    return first.exists() and second.exists() and first.resolve() == second.resolve()


def load_checked(path: Path, model: str) -> QuadapterState:
    """The state at ``path``, refused as :func:`check_model` and :func:`check_row` refuse."""
    state = QuadapterState.load(path)
    check_model(state, model)
    check_row(state)
    return state
