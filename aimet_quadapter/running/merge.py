"""``merge A B``: B's cells (run side by side, e.g. other seeds) added to A's ``results.json`` with their folders, where
both ran under the same settings (those some method reads, whatever the recipes' names); A's own cells stay."""

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

# what two runs of one recipe may differ in: none changes a cell's numbers beyond float rounding
_PER_RUN = {"seeds", "out", "methods", "device", "execution", "data_dirs", "name", "description", "fallbacks", "export"}


def _flat(settings: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in settings.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _difference(ours: dict, theirs: dict) -> str | None:
    """The first setting that counts in which two recipes' results differ, said for an error."""
    methods = [*ours.get("methods", []), *theirs.get("methods", [])]
    ours, theirs = dict(_flat(ours)), dict(_flat(theirs))
    for key in sorted(ours.keys() | theirs.keys()):
        if key in _PER_RUN or not reads_setting(methods, key):
            continue
        if ours.get(key) != theirs.get(key):
            return f"field {key} is {theirs.get(key)!r} there and {ours.get(key)!r} in the destination"
    return None


def _check_same_recipe(dest: dict, src: dict, src_dir: Path) -> None:
    if dest.get("model") != src.get("model"):
        raise QuadapterError(f"{src_dir}: a run of model {src.get('model')}, not {dest.get('model')}")
    for name, recipe in src.get("recipes", {}).items():
        theirs = _result_settings(recipe["settings"], src)
        # a recipe of another name with the same settings computes the same cells
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
    """The column without its path: a text is its content hash wherever it lies."""
    return {k: v for k, v in column.items() if k != "source"}


def _result_settings(settings: dict, results: dict) -> dict:
    """``settings`` less what changes no result, each dataset path named by its text's content hash."""
    texts = results.get("texts", {})

    def text(value):
        if isinstance(value, list):
            return [text(v) for v in value]
        if isinstance(value, dict):
            return {k: text(v) for k, v in value.items()}
        return texts.get(value, value) if isinstance(value, str) else value

    return {k: text(result_section(k, v)) if isinstance(v, dict) else text(v) for k, v in settings.items()}


def _copy_missing(src_dir: Path, dest_dir: Path, folder: str | None) -> None:
    """The files of ``folder`` (a cell's, or the sampled texts) that the destination lacks."""
    if folder and (src_dir / folder).is_dir():
        shutil.copytree(
            src_dir / folder,
            dest_dir / folder,
            dirs_exist_ok=True,
            copy_function=lambda src, dst: None if Path(dst).exists() else shutil.copy2(src, dst),
        )


def merge_runs(dest_dir: str | Path, sources: Sequence[str | Path]) -> tuple[dict, list[str]]:
    """Add to ``dest_dir`` the cells of ``sources`` it lacks; its results as written and the keys added."""
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
                if (ours := dest["cells"].get(key)) is None:
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
