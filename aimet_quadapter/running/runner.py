"""Running a recipe: ``fp`` once (group ``-``); calibration-only methods once per calibration set (group
``calib:<set>``: ``calibration.dataset``, else each F-ID's train split); fine-tuning methods once per F-ID (group
``<F-ID>``) and sweep size; each cell scored on every text. A re-run skips each cell whose fingerprint is unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

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
    """One recipe run into one run folder; with ``seeds``, one child run per seed (keys ``<cell>#seed<N>``, files under
    ``seed-<N>/``, FP32's cell once), sharing the parent's loaded model, tokenizer and tokens (``shared``)."""

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
        from aimet_quadapter.models.devices import resolve_device
        from aimet_quadapter.models.loading import check_model_source, family_of

        try:  # a folder that cannot load is refused before any text is read or sampled
            check_model_source(recipe.resolve_model())
        except QuadapterError as e:
            raise QuadapterError(f"{recipe.where()}: field model: {e}") from None
        if parent is None:  # a seed's run inherits its parent's methods
            recipe = recipe.for_family(family_of(recipe.resolve_model()))
        self.recipe = recipe
        self.seed = seed
        self.parent = parent or recipe  # what results.json records as the recipe
        self.command = command
        self.out_dir = Path(out_dir)
        self.model_name = recipe.resolve_model()
        try:
            self.device = resolve_device(recipe.device)
        except QuadapterError as e:
            raise QuadapterError(f"{recipe.where()}: field device: {e}") from None
        self.main = distributed.is_main()
        self.progress = progress and self.main
        self.texts = Texts(recipe, self.model_name, shared or Shared())
        self.plan = plan = Plan(recipe, seed, self.texts)
        self.prints = Fingerprints(
            recipe, self.model_name, plan.evals, plan.calibration_sets, plan.fids, self.texts.prefix_text
        )
        self.output = Output(self.out_dir, self.progress, self.main)
        self.checks = Checks(recipe, plan, self.texts)
        self.data = RunData(recipe, plan, self.texts, self.checks, self.device, self.output)
        self.recorder = Recorder(self.parent, command, plan, self.prints, self.device, self.output)
        self.executor = Executor(recipe, seed, self.prints, self.data, self.recorder)

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
        """One seed's cells, by a run of its own that goes when they are done (its data with it)."""
        recipe, shared = self.recipe.for_seed(seed), self.texts.shared
        return RecipeRun(recipe, self.out_dir, self.progress, seed, self.recipe, self.command, shared=shared)._run()

    def _hand_off(self, results: dict) -> None:
        """The row chosen on development text, exported and checked (running/handoff.py), into ``results``."""
        from aimet_quadapter.running.handoff import fp_answers, hand_off

        model, tokenizer = self.data.load_model(), self.texts.tokenizer()
        prompts = fp_answers(self.recipe, model, tokenizer)
        self.data.release_model()  # handed over: the export builds its sim in place on these weights
        release_freed_memory()
        results["export"] = hand_off(self.recipe, self.out_dir, results, prompts, tokenizer, self.progress, model)
        del model
        self.recorder.write(results)
        e = results["export"]
        if check := e.get("device_check"):
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
        if skipped := len(self.cells) - len(pending):
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
    """Perplexity of a saved state's sim on ``recipe``'s evaluation texts, the windows a run of ``recipe`` scores."""
    return RecipeRun(recipe, Path(".unused"), progress).score(state)


def run_recipe(
    recipe: Recipe, out_dir: Path | str | None = None, progress: bool = True, command: str | None = None
) -> tuple[Path, dict]:
    """Run every cell of ``recipe`` not yet in ``out_dir``, recording ``command``; the folder and its results."""
    folder = Path(out_dir or recipe.out or Path("runs") / recipe.display_name)
    return folder, RecipeRun(recipe, folder, progress, command=command).run()
