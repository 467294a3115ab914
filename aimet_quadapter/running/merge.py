"""Cells of one set of settings computed in several run folders (one process or machine each), gathered into one.

A recipe's seeds are independent, and so are its cells once what they start from is computed: they can run
side by side (``run --set seeds=[0,1] --out A`` here, ``run --set seeds=[2] --out B`` elsewhere; or B a copy
of A that runs other methods of the same seed), then ``merge A B`` adds B's cells to A's ``results.json``,
with their folders, as if A had run them. Only runs under the same settings (all but ``seeds``, ``out`` and
``methods``, and those no method of theirs reads: catalog ``reads``) merge, whatever their recipes' names; a cell
A already has is left as A has it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.methods.catalog import reads_setting
from aimet_quadapter.running.lock import RunLock
from aimet_quadapter.running.recipes import result_section
from aimet_quadapter.running.results_file import RESULTS, load_results, write_results

# what two runs of one recipe may differ in: where a run writes, which seeds and methods, the device (as in
# the fingerprints: a GPU's result and a CPU's are the same measurement up to float rounding; each cell records
# its device, and the report marks a row whose seeds ran on more than one), how its cells ran (memory, kernels,
# checkpoints), and where texts are looked for (another checkout's path: the texts found are compared by content
# below); a recipe's name and description say what it is for, not what it computes; the methods' fallbacks and the
# export change no cell
_PER_FOLDER = {
    "seeds",
    "out",
    "methods",
    "device",
    "execution",
    "data_dirs",
    "name",
    "description",
    "fallbacks",
    "export",
}


def _flat(settings: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in settings.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _difference(ours: dict, theirs: dict) -> str | None:
    """The first setting (all but the per-folder ones, and those no method of either run reads: catalog
    ``reads``) in which two recipes' results differ, said for an error."""
    methods = [*ours.get("methods", []), *theirs.get("methods", [])]
    ours, theirs = dict(_flat(ours)), dict(_flat(theirs))
    for key in sorted(ours.keys() | theirs.keys()):
        if key in _PER_FOLDER or not reads_setting(methods, key):
            continue
        if ours.get(key) != theirs.get(key):
            return f"field {key} is {theirs.get(key)!r} there and {ours.get(key)!r} in the destination"
    return None


def _check_same_recipe(dest: dict, src: dict, src_dir: Path) -> None:
    if dest.get("model") != src.get("model"):
        raise QuadapterError(f"{src_dir}: a run of model {src.get('model')}, not {dest.get('model')}")
    for name, recipe in src.get("recipes", {}).items():
        theirs = _result_settings(recipe["settings"], src)
        # a recipe of another name whose settings are the same (the paper's recipes differ only in `methods`)
        # computes the same cells: its name is not a setting
        ran = dest.get("recipes", {})
        candidates = [ran[name]] if name in ran else list(ran.values())
        differences = [_difference(_result_settings(r["settings"], dest), theirs) for r in candidates]
        if None in differences:
            continue
        if name in ran:
            raise QuadapterError(
                f"{src_dir}: {differences[0]}: not the same settings, so their seeds are not comparable"
            )
        raise QuadapterError(
            f"{src_dir}: a run of recipe {name}, which the destination never ran, and whose settings are none of "
            f"the destination's recipes' (first: {differences[0] if differences else 'it ran none'})"
        )
    for field in ("datasets", "dev_datasets"):
        if [_located(c) for c in dest.get(field, [])] != [_located(c) for c in src.get(field, [])]:
            raise QuadapterError(f"{src_dir}: other {field} than the destination's")


def _located(column: dict) -> dict:
    # a text is its content hash wherever it lies: the column without its path
    return {k: v for k, v in column.items() if k != "source"}


def _result_settings(settings: dict, results: dict) -> dict:
    # memory and checkpoint fields leave every result as it is: two runs that differ only there still merge; a
    # dataset named by a path is named by its text
    texts = results.get("texts", {})  # every local path of the run's texts, mapped to that text's content hash

    def text(value):
        if isinstance(value, list):
            return [text(v) for v in value]
        if isinstance(value, dict):
            return {k: text(v) for k, v in value.items()}
        return texts.get(value, value) if isinstance(value, str) else value

    return {k: text(result_section(k, v)) if isinstance(v, dict) else text(v) for k, v in settings.items()}


def _copy_missing(src_dir: Path, dest_dir: Path, folder: str | None) -> None:
    # a cell's folder (its state, curves, checkpoints) and the sampled texts: the files the destination lacks
    if folder and (src_dir / folder).is_dir():
        shutil.copytree(
            src_dir / folder,
            dest_dir / folder,
            dirs_exist_ok=True,
            copy_function=lambda src, dst: None if Path(dst).exists() else shutil.copy2(src, dst),
        )


def merge_runs(dest_dir: str | Path, sources: Sequence[str | Path]) -> tuple[dict, list[str]]:
    """Add to ``dest_dir`` the cells that each run folder of ``sources`` has and it lacks; its results as written
    and the keys added."""
    dest_dir = Path(dest_dir)
    with ExitStack() as locks:
        folders = [dest_dir, *map(Path, sources)]
        if len({f.resolve() for f in folders}) < len(folders):
            raise QuadapterError("merge: a run folder is named twice")
        for folder in folders:
            if not (folder / RESULTS).is_file():
                load_results(folder)  # says which folder has no run (locking it first would create it)
        for folder in folders:
            locks.enter_context(RunLock(folder))  # no run may be writing one of them
        # read under the locks: cells a run writes between a read and the lock would be lost by our write
        results = {f: load_results(f) for f in folders}  # every folder read before any is changed
        dest = results[dest_dir]
        for src_dir in folders[1:]:
            _check_same_recipe(dest, results[src_dir], src_dir)
        for src_dir in folders[1:]:
            for name, recipe in results[src_dir].get("recipes", {}).items():
                dest.setdefault("recipes", {}).setdefault(name, recipe)
        added: list[str] = []
        for src_dir in folders[1:]:
            for key, cell in results[src_dir]["cells"].items():
                ours = dest["cells"].get(key)
                if ours is None:
                    dest["cells"][key] = cell
                    added.append(key)
                    _copy_missing(src_dir, dest_dir, cell.get("folder"))
                elif cell.get("seed") is None and ours.get("fingerprint") != cell.get("fingerprint"):
                    raise QuadapterError(
                        f"{src_dir}: cell {key} was computed under other settings or code than the destination's"
                    )
            _copy_missing(src_dir, dest_dir, "generated")
            dest["seeds"] = sorted({*dest.get("seeds", []), *results[src_dir].get("seeds", [])})
        write_results(dest_dir, dest)
    return dest, added
