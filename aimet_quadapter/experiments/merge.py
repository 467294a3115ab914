"""Seeds of one recipe computed in several run folders (one process or machine each), gathered into one.

A recipe's seeds are independent, so they can run side by side: ``run --set seeds=[0,1] --out A`` here,
``run --set seeds=[2] --out B`` elsewhere, then ``merge A B`` adds B's seeds to A's ``results.json``, with
their folders, as if A had run them. Only runs of the same recipe under the same settings (all but ``seeds``
and ``out``) merge; a seed A already has any cell of is left as A has it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.experiments.lock import RunLock
from aimet_quadapter.experiments.results_file import load_results, write_results

_PER_FOLDER = {"seeds", "out"}  # what two runs of one recipe may differ in


def _flat(settings: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in settings.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _check_same_recipe(dest: dict, src: dict, src_dir: Path) -> None:
    if dest.get("model") != src.get("model"):
        raise QuadapterError(f"{src_dir}: a run of model {src.get('model')}, not {dest.get('model')}")
    for name, recipe in src.get("recipes", {}).items():
        if name not in dest.get("recipes", {}):
            raise QuadapterError(f"{src_dir}: a run of recipe {name}, which the destination never ran")
        ours = dict(_flat(dest["recipes"][name]["settings"]))
        theirs = dict(_flat(recipe["settings"]))
        for key in sorted(ours.keys() | theirs.keys()):
            if key not in _PER_FOLDER and ours.get(key) != theirs.get(key):
                raise QuadapterError(
                    f"{src_dir}: field {key} is {theirs.get(key)!r} there and {ours.get(key)!r} in the "
                    "destination: not the same settings, so their seeds are not comparable"
                )
    for field in ("datasets", "dev_datasets"):
        if dest.get(field, []) != src.get(field, []):
            raise QuadapterError(f"{src_dir}: other {field} than the destination's")


def merge_runs(dest_dir: str | Path, sources: Sequence[str | Path]) -> tuple[dict, list[str]]:
    """Add to ``dest_dir`` the seeds that each run folder of ``sources`` has and it lacks; its results as written
    and the keys added."""
    dest_dir = Path(dest_dir)
    with ExitStack() as locks:
        folders = [dest_dir, *map(Path, sources)]
        if len({f.resolve() for f in folders}) < len(folders):
            raise QuadapterError("merge: a run folder is named twice")
        results = {f: load_results(f) for f in folders}  # every folder read before any is changed
        for folder in folders:
            locks.enter_context(RunLock(folder))  # no run may be writing one of them
        dest = results[dest_dir]
        for src_dir in folders[1:]:
            _check_same_recipe(dest, results[src_dir], src_dir)
        added: list[str] = []
        for src_dir in folders[1:]:
            have = {c["seed"] for c in dest["cells"].values() if c.get("seed") is not None}
            new_seeds: set[int] = set()
            for key, cell in results[src_dir]["cells"].items():
                seed = cell.get("seed")
                if seed is None:
                    ours = dest["cells"].get(key)
                    if ours is None:
                        dest["cells"][key] = cell
                        added.append(key)
                    elif ours.get("fingerprint") != cell.get("fingerprint"):
                        raise QuadapterError(
                            f"{src_dir}: cell {key} was computed under other settings or code than the destination's"
                        )
                elif seed not in have:
                    dest["cells"][key] = cell
                    added.append(key)
                    new_seeds.add(seed)
            for seed in sorted(new_seeds):
                if (src_dir / f"seed-{seed}").is_dir():
                    shutil.copytree(src_dir / f"seed-{seed}", dest_dir / f"seed-{seed}", dirs_exist_ok=True)
            generated = src_dir / "generated"
            for path in sorted(generated.glob("*.pt")) if generated.is_dir() else []:
                if not (dest_dir / "generated" / path.name).exists():
                    (dest_dir / "generated").mkdir(exist_ok=True)
                    shutil.copy2(path, dest_dir / "generated" / path.name)
            dest["seeds"] = sorted({*dest.get("seeds", []), *new_seeds})
        write_results(dest_dir, dest)
    return dest, added
