"""One cell of a run: computed from where it starts, evaluated on every text the run scores, and recorded."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from aimet_quadapter import distributed
from aimet_quadapter.atomic import write_text_atomic
from aimet_quadapter.memory import PeakRSS, release_freed_memory
from aimet_quadapter.methods.catalog import BC, CATALOG
from aimet_quadapter.methods.records import PARKED_FP, Records
from aimet_quadapter.running.cell_files import PHASE2_CURVE, CellFiles
from aimet_quadapter.running.cells import Cell, safe_name
from aimet_quadapter.running.data import RunData
from aimet_quadapter.running.fingerprints import Fingerprints
from aimet_quadapter.running.recipes import Recipe
from aimet_quadapter.running.recorder import Recorder

if TYPE_CHECKING:  # imported when a run starts: the model code pulls in AIMET
    from aimet_quadapter.methods.registry import MethodContext
    from aimet_quadapter.quadapter.state import QuadapterState


class Executor:
    """Computes the cells of one run (one seed's) of ``recipe``; a shared phase 1 once per calibration set."""

    def __init__(self, recipe: Recipe, seed: int | None, prints: Fingerprints, data: RunData, recorder: Recorder):
        self.recipe = recipe
        self.seed = seed
        self.prints = prints
        self.data = data
        self.recorder = recorder
        self.output = data.output
        self._bc: dict[str, QuadapterState | None] = {}

    def run_cell(self, cell: Cell, results: dict) -> dict:
        """Compute ``cell``; ``results``: the run's results so far (what a cell may continue from)."""
        from aimet_quadapter.methods.registry import run_method
        from aimet_quadapter.text.perplexity import evaluate

        spec = CATALOG[cell.method]
        cell_dir = self.output.out_dir / cell.folder
        fingerprint = self.prints.fingerprint(cell)
        self._prepare(cell, cell_dir, fingerprint)
        extra: dict = {}
        start = time.time()
        with PeakRSS() as peak:  # this cell's own peak, evaluation included
            origin = self._start_of(cell, results)
            if origin is not None:
                extra["continued_from"] = origin[0]
                self.output.say(f"{cell.key} starts from the saved state of {origin[0]}")
            bc_state = self._bc_state(cell.calibration_set, extra) if spec.from_bc and origin is None else None
            ctx = self._context(cell_dir, cell.calibration, cell.fid, cell.size, fingerprint)
            ctx.bc_state = bc_state
            ctx.start = origin[1] if origin is not None else None
            method_start = time.time()
            evaluated = run_method(cell.method, ctx)
            method_time = time.time() - method_start
            release_freed_memory()  # what training freed, before the evaluation's own peak
            if cell.method == BC:
                if self.output.main:
                    write_text_atomic(cell_dir / "bc_fingerprint.txt", self.prints.bc_fingerprint(cell.calibration_set))
                self._bc[cell.calibration_set] = ctx.bc_state
            eval_start = time.time()
            progress, devs = self.output.progress, self.data.plan.devs
            ppl = evaluate(evaluated, self.data.eval_windows(), spec.label, progress)
            dev_ppl = evaluate(evaluated, self.data.dev_windows(), f"{spec.label} (dev)", progress) if devs else {}
            eval_time = time.time() - eval_start
        if self.output.main:
            shutil.rmtree(cell_dir / "checkpoints", ignore_errors=True)
        record = {
            **self.recorder.record(cell),
            "finetune_sequences": sum(len(b) for b in ctx.finetune) if ctx.finetune else None,
            "ppl": ppl,
            "dev_ppl": dev_ppl,
            "method_time_s": method_time,
            "eval_time_s": eval_time,
            "wall_time_s": time.time() - start,
            "peak_rss_kib": peak.kib,
            "info": {**extra, **ctx.info.get(cell.method, {})},
        }
        del evaluated, ctx
        release_freed_memory()
        failure = _nonfinite(ppl, dev_ppl, cell_dir)
        return self.recorder.failed_record(cell, failure) if failure else record

    def _prepare(self, cell: Cell, cell_dir: Path, fingerprint: str) -> None:
        """A phase-2 checkpoint left by an interrupted run resumes the cell, but only under the same settings."""
        checkpoints = cell_dir / "checkpoints"
        stamp = checkpoints / "fingerprint.txt"
        if self.output.main:
            if checkpoints.exists() and not (stamp.is_file() and stamp.read_text() == fingerprint):
                shutil.rmtree(checkpoints)
            checkpoints.mkdir(parents=True, exist_ok=True)
            write_text_atomic(stamp, fingerprint)
            # an earlier computation's (other settings) states and loss curves may not stay beside the new row
            for old in [*cell_dir.glob("*.safetensors"), *cell_dir.glob(f"*{PHASE2_CURVE}")]:
                old.unlink()
            # FP weights a killed computation left parked: no process of this run has parked any yet
            for parked in cell_dir.glob(f"{PARKED_FP}*"):
                shutil.rmtree(parked, ignore_errors=True)
        distributed.barrier()  # under torchrun: no process resumes from a checkpoint the first one removes

    def _start_of(self, cell: Cell, results: dict) -> tuple[str, QuadapterState] | None:
        """The key and saved state of the cell ``cell`` continues from, where done under its settings now; else None."""
        from aimet_quadapter.quadapter.state import QuadapterState

        origin = CATALOG[cell.method].continues
        if origin is None or cell.fid is None:
            return None
        before = self.data.plan.finetune_cell(origin, cell.fid, cell.size)
        state_file = self.output.out_dir / before.folder / f"{origin}.safetensors"
        if not (self.recorder.is_done(results, before) and state_file.is_file()):
            return None
        state = QuadapterState.load(state_file)
        # the row's own state only: another run's file would give this cell another start than its fingerprint says
        if state.metadata.get("fingerprint") != results["cells"][before.key]["fingerprint"]:
            self.output.say(f"{cell.key}: {state_file} is not the state of row {before.key}; computing it again")
            return None
        return before.key, state

    def _context(
        self, cell_dir: Path, cal: str | None, fid: str | None, size: int | None, fingerprint: str
    ) -> MethodContext:
        """What a method computes from; ``fingerprint``: the stamp of every state it hands over."""
        from aimet_quadapter.methods.registry import MethodContext

        data, options, params = self.data, self.recipe.execution, self.recipe.quadapter_parameters()
        model = data.load_model()  # first: the model's own text (`generated`) is sampled by it
        calibration = data.calibration_batches(cal) if cal else []
        records = (
            CellFiles(cell_dir, data.plan.model_name, fingerprint, calibration, params.extra_sites)
            if self.output.main
            else Records()
        )
        return MethodContext(
            model,
            self.recipe.quant_policy(),
            calibration,
            data.finetune_batches(fid, size) if fid else None,
            params,
            options,
            cell_dir,
            self.output.progress,
            baselines=self.recipe.baseline_parameters(),
            checkpoints=options.checkpoint_every < self.recipe.phase2.steps,
            validation=data.validation_batches(cal) if cal else None,
            records=records,
        )

    def _bc_state(self, cal: str, info: dict) -> QuadapterState | None:
        """Quadapter BC's state for calibration set ``cal``: in memory, saved by an earlier cell, or computed now."""
        from aimet_quadapter.methods.registry import run_method
        from aimet_quadapter.quadapter.state import QuadapterState

        if cal in self._bc:
            return self._bc[cal]
        out_dir = self.output.out_dir
        folder = (out_dir if self.seed is None else out_dir / f"seed-{self.seed}") / safe_name(f"calib-{cal}") / BC
        stamp = folder / "bc_fingerprint.txt"
        state_file = folder / "quadapter_bc.safetensors"
        if state_file.is_file() and stamp.is_file() and stamp.read_text().strip() == self.prints.bc_fingerprint(cal):
            self._bc[cal] = QuadapterState.load(state_file)
            return self._bc[cal]
        self.output.say(f"phase 1 (Quadapter BC) on calibration set {cal}, shared by the methods that continue from it")
        start = time.time()
        folder.mkdir(parents=True, exist_ok=True)
        # stamped as the folder is: where no row records this state, export compares it with bc_fingerprint.txt
        ctx = self._context(folder, cal, None, None, self.prints.bc_fingerprint(cal))
        run_method(BC, ctx)
        if self.output.main:
            write_text_atomic(stamp, self.prints.bc_fingerprint(cal))
        info["bc_time_s"] = time.time() - start
        self._bc[cal] = ctx.bc_state
        return ctx.bc_state


def _nonfinite(ppl: dict[str, float], dev_ppl: dict[str, float], cell_dir: Path) -> str | None:
    """Why a cell of a NaN or infinite perplexity failed, with where its phase-2 curves ended; None if all finite."""
    bad = [
        f"{value} on {label} ({text})"
        for values, text in ((ppl, "test text"), (dev_ppl, "development text"))
        for label, value in values.items()
        if not math.isfinite(value)
    ]
    if not bad:
        return None
    ends = []
    for path in sorted(cell_dir.glob(f"*{PHASE2_CURVE}")):  # this computation's: older ones were removed
        try:
            losses = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(losses, list) and losses:
            name = path.name.removesuffix(PHASE2_CURVE).rstrip("_") or "quadapter"
            ends.append(f"{name} phase 2 ended at step {len(losses)} with loss {losses[-1]:.4g}")
    training = "the method ended without a non-finite training loss"
    if ends:
        training = f"the training losses stayed finite ({'; '.join(ends)})"
    return f"perplexity {', '.join(bad)}; {training}"
