"""A run's ``results.json``: begun or read, which cells are done, a cell's record, and the file rewritten."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from aimet_quadapter.methods.catalog import CATALOG
from aimet_quadapter.running.cells import Cell
from aimet_quadapter.running.fingerprints import Fingerprints
from aimet_quadapter.running.output import Output
from aimet_quadapter.running.plan import Plan
from aimet_quadapter.running.recipes import Recipe
from aimet_quadapter.running.results_file import FORMAT, RESULTS, load_results, write_results
from aimet_quadapter.versions import cpu_name, library_versions, source_commit


@dataclass(eq=False)
class Recorder:
    """The results file of a run planned as ``plan``, recording ``parent`` (all seeds' recipe) and ``command``."""

    parent: Recipe
    command: str | None
    plan: Plan
    prints: Fingerprints
    device: torch.device
    output: Output

    def load_or_new(self) -> dict:
        plan, out = self.plan, self.output.out_dir
        results: dict[str, Any] = load_results(out) if (out / RESULTS).is_file() else {"format": FORMAT, "cells": {}}
        results.setdefault("cells", {})
        results["model"] = plan.model_name
        recipes = results.setdefault("recipes", {})
        recipes[self.parent.display_name] = {
            "path": str(self.parent.path) if self.parent.path else None,
            "settings": self.parent.model_dump(mode="json"),
            **({"command": self.command} if self.command else {}),  # as the user typed it, for results pages
        }
        if self.parent.seeds:
            results["seeds"] = sorted({*results.get("seeds", []), *self.parent.seeds})
        # a column of this run's texts says what this run scores under its label (a recipe may change the text)
        for field, specs in (("datasets", plan.evals), ("dev_datasets", plan.devs)):
            columns = results.setdefault(field, [])
            for s in specs:
                r = s.ref
                entry: dict[str, Any] = {"label": r.label, "source": r.source, "identity": r.identity, "split": s.split}
                if field == "dev_datasets":
                    entry["start"] = s.start
                at = next((i for i, c in enumerate(columns) if c["label"] == s.ref.label), len(columns))
                columns[at : at + 1] = [entry]  # in place of its label's column, or appended
        for field, groups in (("fids", plan.fids), ("calibration_sets", plan.calibration_sets)):
            results.setdefault(field, {}).update({name: [r.label for r in refs] for name, refs in groups.items()})
        # every local text by its content: merge reads a path of another checkout as the same text
        refs = [s.ref for s in (*plan.evals, *plan.devs)]
        refs += [r for group in (*plan.calibration_sets.values(), *plan.fids.values()) for r in group]
        results.setdefault("texts", {}).update({r.source: r.identity for r in refs if r.identity != r.source})
        return results

    def is_done(self, results: dict, cell: Cell) -> bool:
        record = results["cells"].get(cell.key)
        if not record or record.get("fingerprint") != self.prints.fingerprint(cell):
            return False
        return all(s.ref.label in record.get("ppl", {}) for s in self.plan.evals) and all(
            s.ref.label in record.get("dev_ppl", {}) for s in self.plan.devs
        )

    def record(self, cell: Cell) -> dict:
        """What every results.json record of ``cell`` says, finished or stopped."""
        from aimet_quadapter.models.devices import device_label

        return {
            "method": cell.method,
            "label": CATALOG[cell.method].label,
            "rank": list(CATALOG).index(cell.method),
            "group": cell.group,
            "calibration": cell.calibration,
            "fid": cell.fid,
            "size": cell.size,
            "seed": cell.seed,
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            # in no fingerprint (a version bump would recompute every run folder): the report marks other versions
            "versions": library_versions(),
            "commit": source_commit(),  # where to find the code that versions' source hash names
            # nor these, which order the sums of Adam and the matmuls and so change where training ends: the report
            # says where the seeds of one row ran under more than one
            "threads": torch.get_num_threads(),
            "kernels": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu_name(),
            "device": device_label(self.device),
            "fingerprint": self.prints.fingerprint(cell),
            "row_fingerprint": self.prints.row_fingerprint(cell),
            "folder": cell.folder,
        }

    def failed_record(self, cell: Cell, error: str) -> dict:
        """The record of a diverged or non-finite cell: no perplexity, so a rerun computes it again."""
        return {**self.record(cell), "ppl": {}, "error": error}

    def write(self, results: dict) -> None:
        if self.output.main:
            write_results(self.output.out_dir, results)
