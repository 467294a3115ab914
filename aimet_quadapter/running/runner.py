"""Running a recipe: the matrix of methods x F-ID sets, every cell evaluated on every eval dataset.

Cells and what they are computed from:

* ``fp``: once per run (group ``-``);
* methods that use only calibration data (ptq, adaround, seq_mse, cle, quadapter_bc): once per
  calibration set (group ``calib:<set>``). The calibration set is ``calibration.dataset`` when the recipe
  names one (the paper: the same calibration data for every experiment), otherwise each F-ID's train
  split, so then once per F-ID;
* fine-tuning methods: once per F-ID (group ``<F-ID>``), and per fine-tuning size in a data-size sweep.

Methods that continue from Quadapter BC share one phase 1 per calibration set: the ``quadapter_bc`` cell's
saved state, or, when that method is not in the recipe, a phase 1 run on the side and saved in the same
place (``<run>/calib-<set>/quadapter_bc/``). A method that continues from another's result (catalog
``continues``: Quadapter, then AIMET's SeqMSE) starts from that cell's saved state when the cell is done
under the same settings, and computes it otherwise.

``results.json`` is rewritten (atomically) after every cell. A re-run skips every cell already there
whose settings fingerprint is unchanged, so an interrupted matrix loses nothing finished; a cell whose
settings changed (e.g. another ``--set phase2.steps``) is computed again. Phase-2 checkpoints are
deleted once their cell is recorded: the result and the Quadapter state are what is kept.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from aimet_quadapter import distributed
from aimet_quadapter.errors import QuadapterError, TrainingDiverged
from aimet_quadapter.logs import log, log_file
from aimet_quadapter.memory import release_freed_memory
from aimet_quadapter.running.cells import Cell
from aimet_quadapter.running.checks import Checks
from aimet_quadapter.running.data import RunData
from aimet_quadapter.running.executor import Executor
from aimet_quadapter.running.fingerprints import Fingerprints
from aimet_quadapter.running.lock import RunLock
from aimet_quadapter.running.output import Output
from aimet_quadapter.running.plan import Plan
from aimet_quadapter.running.recipes import Recipe
from aimet_quadapter.running.recorder import Recorder
from aimet_quadapter.running.results_file import RESULTS
from aimet_quadapter.running.texts import Shared, Texts
from aimet_quadapter.versions import library_versions

if TYPE_CHECKING:  # imported when a run starts: the model code pulls in AIMET
    from aimet_quadapter.quadapter.state import QuadapterState


class RecipeRun:
    """One recipe run into one run folder: its plan, the data its cells read, their fingerprints, the results file
    and the computation of a cell, each an object of its own that this run holds and calls in turn.

    A recipe with ``seeds`` runs as one child run per seed (:meth:`Recipe.for_seed`) into the same folder and
    ``results.json``: keys ``<cell>#seed<N>``, files under ``seed-<N>/``; FP32's cell, the same for every seed,
    once. ``shared``: what the run whose seed this run is has loaded (model, tokenizer, tokens).
    """

    def __init__(
        self,
        recipe: Recipe,
        out_dir: Path,
        progress: bool = True,
        seed: int | None = None,
        parent: Recipe | None = None,
        command: str | None = None,
        shared: Shared | None = None,
    ):
        from aimet_quadapter.models.loading import check_model_source

        try:  # a folder that cannot load is refused before any text is read or sampled
            check_model_source(recipe.resolve_model())
        except QuadapterError as e:
            raise QuadapterError(f"{recipe.where()}: field model: {e}") from None
        if parent is None:  # a seed's run inherits its parent's methods
            from aimet_quadapter.models.loading import family_of

            recipe = recipe.for_family(family_of(recipe.resolve_model()))
        self.recipe = recipe
        self.seed = seed
        self.parent = parent or recipe  # what results.json records as the recipe
        self.command = command
        self.out_dir = Path(out_dir)
        self.model_name = recipe.resolve_model()
        self.device = self._device()
        # Under torchrun every process computes every cell (data-parallel inside); only the first writes files.
        self.main = distributed.is_main()
        self.progress = progress and self.main
        self.texts = Texts(recipe, self.model_name, shared or Shared())
        self.plan = Plan(recipe, seed, self.texts)
        plan = self.plan
        self.prints = Fingerprints(
            recipe, self.model_name, plan.evals, plan.calibration_sets, plan.fids, self.texts.prefix_text
        )
        self.output = Output(self.out_dir, self.progress, self.main)
        self.checks = Checks(recipe, plan, self.texts)
        self.data = RunData(recipe, plan, self.texts, self.checks, self.device, self.output)
        self.recorder = Recorder(self.parent, command, plan, self.prints, self.device, self.output)
        self.executor = Executor(recipe, seed, self.prints, self.data, self.recorder)

    def _device(self) -> torch.device:
        from aimet_quadapter.models.devices import resolve_device

        try:
            return resolve_device(self.recipe.device)
        except QuadapterError as e:
            raise QuadapterError(f"{self.recipe.where()}: field device: {e}") from None

    # --- what other code reads of a run ---------------------------------------------------------------------------
    @property
    def cells(self) -> list[Cell]:
        return self.plan.cells

    def fingerprint(self, cell: Cell) -> str:
        return self.prints.fingerprint(cell)

    def score(self, state: QuadapterState) -> dict[str, float]:
        """Perplexity of ``state``'s sim, rebuilt on this run's model, on the evaluation texts."""
        from aimet_quadapter.text.perplexity import evaluate

        windows = self.data.eval_windows()  # a bad text is refused before the model loads
        model = self.data.load_model()
        self.data.release_model()  # the sim takes the model's weights over (in place): no copy of them
        sim = state.build_sim(model, in_place=True)
        return evaluate(sim, windows, str(state.metadata.get("method") or "state"), self.progress)

    # --- the run --------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise QuadapterError(f"run folder {self.out_dir} cannot be created: {exc.strerror or exc}") from None
        lock = RunLock(self.out_dir) if self.main else contextlib.nullcontext()
        with lock, log_file(self.out_dir / "run.log") if self.main else contextlib.nullcontext():
            log.debug("run of %s (%s) by: %s", self.recipe.display_name, self.recipe.where(), " ".join(sys.argv))
            log.debug("versions: %s", library_versions())
            seeds = self.recipe.seeds or []
            if not seeds:
                results = self._run()
            for i, seed in enumerate(seeds):
                self.output.say(f"seed {seed} ({i + 1} of {len(seeds)})")
                results = self._run_seed(seed)
            if self.recipe.export is not None and self.main:
                self._hand_off(results)
            return results

    def _run_seed(self, seed: int) -> dict:
        """One seed's cells, by a run of its own that goes when they are done (its data with it); one model and one
        tokenization of each text for every seed."""
        child = RecipeRun(
            self.recipe.for_seed(seed),
            self.out_dir,
            self.progress,
            seed,
            self.recipe,
            self.command,
            shared=self.texts.shared,
        )
        return child._run()

    def _hand_off(self, results: dict) -> None:
        """The row chosen on development text, exported and checked (running/handoff.py), into ``results``."""
        from aimet_quadapter.running.handoff import fp_answers, hand_off

        model = self.data.load_model()
        prompts = fp_answers(self.recipe, model, self.texts.tokenizer())
        self.data.release_model()  # handed over: the export builds its sim in place on these weights
        release_freed_memory()
        results["export"] = hand_off(
            self.recipe, self.out_dir, results, prompts, self.texts.tokenizer(), self.progress, model
        )
        del model
        self.recorder.write(results)
        e = results["export"]
        check = e.get("device_check")
        if check:
            self.output.say(
                f"export: {e['chosen']} (chosen on development text) in {e['path']}; device graph {check['ppl']:.3f} "
                f"vs sim {check['sim_ppl']:.3f} on {e['verify_text']}, {check['with_encoding']} of "
                f"{check['activation_tensors']} activation tensors with this package's encoding"
            )

    def _run(self) -> dict:
        say, recorder = self.output.say, self.recorder
        results = recorder.load_or_new()
        pending = [c for c in self.cells if not recorder.is_done(results, c)]
        recorder.write(results)
        p2 = self.recipe.phase2
        seen = max(p2.steps, 1) * p2.batch_size
        if self.recipe.finetune_sizes and max(self.recipe.finetune_sizes) > seen:
            say(
                f"note: phase 2 sees at most {seen} sequences (phase2.steps x phase2.batch_size); "
                f"finetune_sizes above that use only their first {seen}"
            )
        skipped = len(self.cells) - len(pending)
        if skipped:
            say(f"{skipped} of {len(self.cells)} cells already in {self.out_dir / RESULTS}: skipped")
        self.data.check(pending)
        bar = tqdm(pending, desc="matrix", unit="cell", disable=not self.progress)
        for cell in bar:
            bar.set_postfix(cell=cell.key)
            try:
                record = self.executor.run_cell(cell, results)
            except TrainingDiverged as exc:  # this method stops; the matrix goes on (a rerun tries it again)
                record = recorder.failed_record(cell, str(exc))
            results["cells"][cell.key] = record
            results["updated"] = record["finished"]
            recorder.write(results)
            values = ", ".join(f"{k} {v:.3f}" for k, v in record["ppl"].items())
            if "error" in record:
                say(f"{cell.key}: stopped: {record['error']}", logging.WARNING)
            else:
                say(f"{cell.key} ({record['wall_time_s']:.0f} s): {values}")
        bar.close()
        return results


def score_state(recipe: Recipe, state: QuadapterState, progress: bool = True) -> dict[str, float]:
    """Perplexity of a saved state on ``recipe``'s evaluation texts (its ``eval`` section), with the sim
    rebuilt from the state: no calibration, no training, the windows a training run of ``recipe`` scores."""
    return RecipeRun(recipe, Path(".unused"), progress).score(state)


def run_recipe(
    recipe: Recipe, out_dir: Path | str | None = None, progress: bool = True, command: str | None = None
) -> tuple[Path, dict]:
    """Run every cell of ``recipe`` not yet in ``out_dir``; returns the folder and its results. ``command``: the
    command line that asked for it, recorded beside the recipe."""
    folder = Path(out_dir or recipe.out or Path("runs") / recipe.display_name)
    return folder, RecipeRun(recipe, folder, progress, command=command).run()
