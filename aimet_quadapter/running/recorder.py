"""A run's ``results.json``: begun, or read with what this run's recipe and texts are; which cells are done in it
under their settings; the record of a cell; the file rewritten (by the first process only)."""

from __future__ import annotations

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


class Recorder:
    """The results file of a run planned as ``plan``; ``parent``: the recipe it records (a seed's run records the
    recipe of all its seeds), with ``command``, the command line that asked for it."""

    def __init__(
        self,
        parent: Recipe,
        command: str | None,
        plan: Plan,
        prints: Fingerprints,
        device: torch.device,
        output: Output,
    ):
        self.parent = parent
        self.command = command
        self.plan = plan
        self.prints = prints
        self.device = device
        self.output = output

    def load_or_new(self) -> dict:
        plan = self.plan
        path = self.output.out_dir / RESULTS
        results: dict[str, Any] = (
            load_results(self.output.out_dir) if path.is_file() else {"format": FORMAT, "cells": {}}
        )
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
                entry: dict[str, Any] = {
                    "label": s.ref.label,
                    "source": s.ref.source,
                    "identity": s.ref.identity,
                    "split": s.split,
                }
                if field == "dev_datasets":
                    entry["start"] = s.start
                at = next((i for i, c in enumerate(columns) if c["label"] == s.ref.label), None)
                if at is None:
                    columns.append(entry)
                else:
                    columns[at] = entry
        fids = results.setdefault("fids", {})
        for name, refs in plan.fids.items():
            fids[name] = [r.label for r in refs]
        cals = results.setdefault("calibration_sets", {})
        for name, refs in plan.calibration_sets.items():
            cals[name] = [r.label for r in refs]
        # every local text by its content: merge reads a path of another checkout as the same text
        refs = [s.ref for s in (*plan.evals, *plan.devs)]
        refs += [r for group in (*plan.calibration_sets.values(), *plan.fids.values()) for r in group]
        texts = results.setdefault("texts", {})
        texts.update({r.source: r.identity for r in refs if r.identity != r.source})
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
            # not in the fingerprint (a version bump would recompute every run folder): the report marks a
            # cell computed under other versions than the newest cell's
            "versions": library_versions(),
            "commit": source_commit(),  # where to find the code that versions' source hash names
            # nor these (the same): the thread count, the CPU's vector kernels (AVX2, AVX512) and the device (a GPU
            # takes the whole batch in other kernels) order the sums of Adam and the matmuls, so they change what
            # training ends at; the report says where the seeds of one row ran under more than one
            "threads": torch.get_num_threads(),
            "kernels": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu_name(),
            "device": device_label(self.device),
            "fingerprint": self.prints.fingerprint(cell),
            "row_fingerprint": self.prints.row_fingerprint(cell),
            "folder": cell.folder,
        }

    def failed_record(self, cell: Cell, error: str) -> dict:
        """The record of a cell whose training diverged or whose perplexity is not finite: no perplexity, so a rerun
        computes it again."""
        return {**self.record(cell), "ppl": {}, "error": error}

    def write(self, results: dict) -> None:
        if self.output.main:
            write_results(self.output.out_dir, results)
