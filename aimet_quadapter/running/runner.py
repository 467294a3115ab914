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
import functools
import json
import logging
import math
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from aimet_quadapter import distributed
from aimet_quadapter.atomic import write_atomic, write_text_atomic
from aimet_quadapter.errors import QuadapterError, TrainingDiverged
from aimet_quadapter.logs import log, log_file
from aimet_quadapter.memory import PeakRSS, release_freed_memory
from aimet_quadapter.methods.catalog import BC, CATALOG
from aimet_quadapter.running.cells import Cell, DatasetRef, EvalSpec, safe_name
from aimet_quadapter.running.fingerprints import Fingerprints, _fingerprint
from aimet_quadapter.running.lock import RunLock
from aimet_quadapter.running.recipes import Recipe
from aimet_quadapter.running.results_file import FORMAT, RESULTS, load_results, write_results
from aimet_quadapter.versions import cpu_name, library_versions, source_commit

# the file of a phase-2 loss curve a method writes into its cell's folder: ``[<method>_]phase2_losses.json``
PHASE2_CURVE = "phase2_losses.json"

if TYPE_CHECKING:  # imported when a run starts: the model code pulls in AIMET
    from aimet_quadapter.models import PreparedLM
    from aimet_quadapter.quadapter.state import QuadapterState

# recipe section -> the parameter dataclass whose fields say which settings change a result


def _named(ref: DatasetRef) -> str:
    """A dataset as an error message names it: its label, and its file or folder when it is local."""
    return ref.label if ref.source == ref.spec and not Path(ref.source).exists() else f"{ref.label} ({ref.source})"


def _per_run(method):
    """``functools.cache`` kept on the instance: what one run computed (its seed's data and windows) goes with the
    run, where a cache on the method would keep every seed's run and its tensors until the process ends."""

    @functools.wraps(method)
    def cached(self, *args):
        memo = self.__dict__.setdefault("_memo", {})
        key = (method.__name__, *args)
        if key not in memo:
            memo[key] = method(self, *args)
        return memo[key]

    return cached


class RecipeRun(Fingerprints):
    """The plan of one recipe into one run folder, and its execution.

    A recipe with ``seeds`` runs as one child run per seed (:meth:`Recipe.for_seed`) into the same folder and
    ``results.json``: keys ``<cell>#seed<N>``, files under ``seed-<N>/``; FP32's cell, the same for every seed,
    once.
    """

    def __init__(
        self,
        recipe: Recipe,
        out_dir: Path,
        progress: bool = True,
        seed: int | None = None,
        parent: Recipe | None = None,
        command: str | None = None,
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
        self.progress = progress
        self.catalog = CATALOG
        self.model_name = recipe.resolve_model()
        self._tokenizer: Any = None
        self.device = self._device()
        self.fids = {self._group_name(g): g for g in (self._refs(group) for group in recipe.fid)}
        shared = recipe.calibration.dataset
        self.shared_calibration = self._refs(shared) if shared else None
        self.calibration_sets = (
            {self._group_name(self.shared_calibration): self.shared_calibration}
            if self.shared_calibration
            else dict(self.fids)
        )
        self.evals = self._eval_specs("eval")
        self.devs = self._eval_specs("dev")
        self.cells = self._plan()
        self._model: PreparedLM | None = None
        self._token_cache: dict[tuple[str, str], torch.Tensor] = {}  # shared with the seeds' child runs
        self._bc: dict[str, QuadapterState | None] = {}
        # Under torchrun every process computes every cell (data-parallel inside); only the first writes files.
        self.main = distributed.is_main()
        if not self.main:
            self.progress = False

    def _say(self, message: str, level: int = logging.INFO) -> None:
        if self.main:  # under torchrun the first process speaks for all
            log.log(level, message)

    def _device(self) -> torch.device:
        from aimet_quadapter.models.devices import resolve_device

        try:
            return resolve_device(self.recipe.device)
        except QuadapterError as e:
            raise QuadapterError(f"{self.recipe.where()}: field device: {e}") from None

    # --- plan ---------------------------------------------------------------------------------------
    def _refs(self, names: list[str]) -> list[DatasetRef]:
        from aimet_quadapter.text.data import dataset_label

        refs = []
        for name in names:
            source = self.recipe.resolve_dataset(name)
            refs.append(DatasetRef(name, source, dataset_label(source)))
        return refs

    @staticmethod
    def _group_name(refs: list[DatasetRef]) -> str:
        return "+".join(r.label for r in refs)

    def _eval_specs(self, section: str) -> list[EvalSpec]:
        """The texts the ``eval`` (test text) or ``dev`` (development text) section scores."""
        from aimet_quadapter.methods.generated import GENERATED

        e = getattr(self.recipe, section)
        if e is None:
            return []
        specs = []
        for d in e.datasets:
            if d.name == GENERATED:
                raise QuadapterError(
                    f"{self.recipe.where()}: field {section}.datasets: {GENERATED!r} is text the model samples "
                    f"itself, for calibration and fine-tuning; score a corpus or a text file"
                )
            ref = self._refs([d.name])[0]
            if d.label:
                ref = DatasetRef(ref.spec, ref.source, d.label)
            specs.append(
                EvalSpec(
                    ref,
                    d.split or e.split,
                    d.seq_len or e.seq_len or self._longest_window(),
                    d.max_tokens if d.max_tokens is not None else e.max_tokens,
                    d.stride if d.stride is not None else e.stride,
                    d.start,
                )
            )
        labels = [s.ref.label for s in specs]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise QuadapterError(
                f"{self.recipe.where()}: field {section}.datasets: two datasets share the column {dupes[0]!r}; "
                f"give one a label"
            )
        return specs

    def _longest_window(self) -> int:
        """The longest window the model takes after the recipe's prefix, at most the usual evaluation length;
        that length where the model's positions are not known before it loads (checked once it is)."""
        from aimet_quadapter.models.loading import max_positions
        from aimet_quadapter.text import EVAL_SEQ_LEN

        positions = max_positions(self.model_name)
        return EVAL_SEQ_LEN if positions is None else min(EVAL_SEQ_LEN, positions - len(self.prefix_ids()))

    def _calibration_of(self, fid: str) -> str:
        return next(iter(self.calibration_sets)) if self.shared_calibration else fid

    def _plan(self) -> list[Cell]:
        methods = list(dict.fromkeys(self.recipe.methods))
        cells: list[Cell] = []
        for m in methods:
            if not self.catalog[m].calibrates:
                cells.append(Cell(m, m, "-", None, None, None))
        for m in methods:
            if not self.catalog[m].calibrates or self.catalog[m].finetunes:
                continue
            for cal in self.calibration_sets:
                cells.append(Cell(f"calib:{cal}/{m}{self._seed_tag}", m, f"calib:{cal}", cal, None, None, self.seed))
        sizes: list[int | None] = [*self.recipe.finetune_sizes] if self.recipe.finetune_sizes else [None]
        for fid in self.fids:
            for m in methods:
                if not self.catalog[m].finetunes:
                    continue
                for size in sizes:
                    cells.append(self._finetune_cell(m, fid, size))
        return cells

    @property
    def _seed_tag(self) -> str:
        """How a cell's key names its seed."""
        return "" if self.seed is None else f"#seed{self.seed}"

    def _finetune_cell(self, method: str, fid: str, size: int | None) -> Cell:
        key = f"{fid}/{method}" + (f"@{size}" if size else "") + self._seed_tag
        return Cell(key, method, fid, self._calibration_of(fid), fid, size, self.seed)

    # --- results file ---------------------------------------------------------------------------------
    def _load_or_new(self) -> dict:
        path = self.out_dir / RESULTS
        results: dict[str, Any] = load_results(self.out_dir) if path.is_file() else {"format": FORMAT, "cells": {}}
        results.setdefault("cells", {})
        results["model"] = self.model_name
        recipes = results.setdefault("recipes", {})
        recipes[self.parent.display_name] = {
            "path": str(self.parent.path) if self.parent.path else None,
            "settings": self.parent.model_dump(mode="json"),
            **({"command": self.command} if self.command else {}),  # as the user typed it, for results pages
        }
        if self.parent.seeds:
            results["seeds"] = sorted({*results.get("seeds", []), *self.parent.seeds})
        # a column of this run's texts says what this run scores under its label (a recipe may change the text)
        for field, specs in (("datasets", self.evals), ("dev_datasets", self.devs)):
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
        for name, refs in self.fids.items():
            fids[name] = [r.label for r in refs]
        cals = results.setdefault("calibration_sets", {})
        for name, refs in self.calibration_sets.items():
            cals[name] = [r.label for r in refs]
        # every local text by its content: merge reads a path of another checkout as the same text
        refs = [s.ref for s in (*self.evals, *self.devs)]
        refs += [r for group in (*self.calibration_sets.values(), *self.fids.values()) for r in group]
        texts = results.setdefault("texts", {})
        texts.update({r.source: r.identity for r in refs if r.identity != r.source})
        return results

    def is_done(self, results: dict, cell: Cell) -> bool:
        record = results["cells"].get(cell.key)
        if not record or record.get("fingerprint") not in self.fingerprints(cell):
            return False
        return all(s.ref.label in record.get("ppl", {}) for s in self.evals) and all(
            s.ref.label in record.get("dev_ppl", {}) for s in self.devs
        )

    # --- data ---------------------------------------------------------------------------------------
    def _load_model(self) -> PreparedLM:
        if self._model is None:
            from aimet_quadapter.models import load_model

            self._model, self._tokenizer = load_model(self.model_name, quiet=True, device=self.device)
            self._check_lengths(self._model.max_positions)  # a hub model's limit is known only now
            self._check_sites(self._model)  # site names are known once the model is: before any cell's work
            self._check_aimet_support(self.cells, self._model.arch.name)
            self._model.set_prefix(self.prefix_ids())
            self._say_auto_prefix()
        return self._model

    def prefix_text(self) -> str | None:
        """The recipe's ``prefix`` (``auto``: the model's own, from its tokenizer; None: no prefix)."""
        from aimet_quadapter.models.prefix import AUTO_PREFIX, model_prefix

        if self.recipe.prefix != AUTO_PREFIX:
            return self.recipe.prefix
        return model_prefix(self.tokenizer())

    def prefix_ids(self) -> list[int]:
        """The tokens of the recipe's ``prefix`` (none without one)."""
        text = self.prefix_text()
        if text is None:
            return []
        ids = self.tokenizer()(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise QuadapterError(f"{self.recipe.where()}: field prefix: {text!r} gives no token")
        return list(ids)

    def _say_auto_prefix(self) -> None:
        from aimet_quadapter.models.prefix import AUTO_PREFIX

        if self.recipe.prefix != AUTO_PREFIX:
            return
        text = self.prefix_text()
        if text is None:
            self._say(f"prefix auto: the tokenizer of {self.model_name} has neither a BOS nor an EOS token: no prefix")
        else:
            self._say(f"prefix auto: {text!r} (tokens {self.prefix_ids()})")

    def score(self, state: QuadapterState) -> dict[str, float]:
        """Perplexity of ``state``'s sim, rebuilt on this run's model, on the evaluation texts."""
        from aimet_quadapter.text.perplexity import evaluate

        windows = self.eval_windows()  # a bad text is refused before the model loads
        model = self._load_model()
        self._model = None  # the sim takes the model's weights over (in place): no copy of them
        sim = state.build_sim(model, in_place=True)
        return evaluate(sim, windows, str(state.metadata.get("method") or "state"), self.progress)

    def tokenizer(self):
        if self._tokenizer is None:
            from aimet_quadapter.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_name)
        return self._tokenizer

    def check_data(self, cells: list[Cell]) -> None:
        """Read, tokenize and cut every text ``cells`` need, before the model loads: a missing, binary or
        too-short text stops the run in seconds, not after minutes of loading and calibrating."""
        from aimet_quadapter.methods.generated import GENERATED
        from aimet_quadapter.models.loading import family_of, max_positions

        self._check_aimet_support(cells, family_of(self.model_name))
        self._check_lengths(max_positions(self.model_name))
        self._check_counts(cells)
        self.eval_windows()
        self.dev_windows()
        self.check_roles()
        calibrated = [c for c in cells if c.calibration is not None and self.catalog[c.method].calibrates]
        groups = [self.calibration_sets[c.calibration_set] for c in calibrated]
        groups += [self.fids[c.fid] for c in cells if c.fid is not None]
        for ref in dict.fromkeys(r for refs in groups for r in refs if r.source != GENERATED):  # texts before sampling
            with self._about(ref):
                self._tokens(ref.source, "train")
        for cell in cells:
            if cell.calibration is not None and self.catalog[cell.method].calibrates:
                self.calibration_batches(cell.calibration)
                if self.catalog[cell.method].from_bc or cell.method == BC:
                    self.validation_batches(cell.calibration)
            if cell.fid is not None:
                self.finetune_batches(cell.fid, cell.size)
        self._check_export()
        release_freed_memory()  # what tokenizing whole corpora freed (sampling gives its own back)

    def _check_export(self) -> None:
        """The export's texts and aimet-onnx, before the cells: a hand-off that cannot start fails now."""
        e = self.recipe.export
        if e is None:
            return
        from aimet_quadapter.text import data

        if e.device_check:
            from aimet_quadapter.export.device_check import require_aimet_onnx

            require_aimet_onnx()
        source = self.recipe.resolve_dataset(e.verify_dataset)
        for split in dict.fromkeys((e.verify_split, "train")):
            try:
                data.load_text(source, split)
            except QuadapterError as exc:
                raise QuadapterError(f"{self.recipe.where()}: field export.verify_dataset: {exc}") from None

    def _check_aimet_support(self, cells: list[Cell], family: str | None) -> None:
        """Refuse a method whose AIMET technique AIMET refuses for this family (None: not known before the model
        loads) or policy, with AIMET's reason."""
        from aimet_quadapter.quant.llm_techniques import refusal

        policy = self.recipe.quant_policy()
        for method in dict.fromkeys(c.method for c in cells):
            technique = self.catalog[method].aimet
            reason = refusal(technique, family, policy) if technique else None
            if reason:
                raise QuadapterError(f"{self.recipe.where()}: method {method}: {reason}")

    def _check_counts(self, cells: list[Cell]) -> None:
        # the crop counts against the free memory, before any text is read (the texts can say more, later)
        from aimet_quadapter.text.data import check_crop_count

        c, p2 = self.recipe.calibration, self.recipe.phase2
        if any(cell.calibration is not None and self.catalog[cell.method].calibrates for cell in cells):
            check_crop_count(c.samples, c.length, "calibration.samples")
            check_crop_count(self.recipe.quadapter.holdout, c.length, "quadapter.holdout")
        if any(cell.fid is not None for cell in cells):
            check_crop_count(self._finetune_pool_size(), p2.seq_len, self._finetune_setting())
        if self._uses_generated():
            check_crop_count(self.recipe.generated.samples, self.recipe.generated.length, "generated.samples")

    def _finetune_pool_size(self) -> int:
        # one pool of the largest size: every smaller sweep size is a prefix of it, so the sizes are nested
        p2 = self.recipe.phase2
        return max(self.recipe.finetune_sizes or [max(p2.steps, 1) * p2.batch_size])

    def _finetune_setting(self) -> str:
        return "finetune_sizes" if self.recipe.finetune_sizes else "phase2.steps x phase2.batch_size"

    def _check_sites(self, model: PreparedLM) -> None:
        if not self.recipe.phase1.keep_start:
            return
        from aimet_quadapter.quadapter.phase1 import kept_at_start

        sites = model.sites(self.recipe.quadapter.extra_sites)
        try:
            kept_at_start(sites, self.recipe.phase1.keep_start)
        except QuadapterError as e:
            raise QuadapterError(f"{self.recipe.where()}: {e}") from None

    def _check_lengths(self, limit: int | None) -> None:
        from aimet_quadapter.models.loading import check_length

        crops = []  # lengths cut from the calibration and fine-tuning texts
        if any(self.catalog[c.method].calibrates for c in self.cells):  # FP32 alone calibrates nothing
            crops.append(("calibration.length", self.recipe.calibration.length))
        if any(self.catalog[c.method].finetunes for c in self.cells):
            crops.append(("phase2.seq_len", self.recipe.phase2.seq_len))
        lengths = crops + [(f"eval.datasets ({s.ref.label}) seq_len", s.seq_len) for s in self.evals]
        lengths += [(f"dev.datasets ({s.ref.label}) seq_len", s.seq_len) for s in self.devs]
        prefix = len(self.prefix_ids())
        if prefix:  # every sequence but the sampled text (the FP model samples it alone) follows the prefix
            lengths = [(f"{field} (after the {prefix} prefix tokens)", n + prefix) for field, n in lengths]
        generated = self.recipe.generated.length if self._uses_generated() else None
        if generated is not None:
            lengths.append(("generated.length", generated))
        for field, length in lengths:
            check_length(limit, length, f"{self.recipe.where()}: field {field}:")
        for field, length in crops:
            if generated is not None and length > generated:
                raise QuadapterError(
                    f"{self.recipe.where()}: field {field}: {length} tokens, longer than the generated samples "
                    f"(generated.length: {generated})"
                )

    def _uses_generated(self) -> bool:
        from aimet_quadapter.methods.generated import GENERATED

        groups = [*self.fids.values(), *self.calibration_sets.values()]
        return any(r.source == GENERATED for refs in groups for r in refs)

    def _tokens(self, source: str, split: str) -> torch.Tensor:
        from aimet_quadapter.text import data

        if (source, split) not in self._token_cache:
            text = data.load_text(source, split)  # a file that is not text is refused before the tokenizer loads
            self._token_cache[source, split] = data.tokenize(self.tokenizer(), text)
        return self._token_cache[source, split]

    @contextlib.contextmanager
    def _about(self, ref: DatasetRef):
        """A problem with the train split of ``ref`` (unreadable, too short) names the recipe and the dataset."""
        try:
            yield
        except QuadapterError as exc:
            raise QuadapterError(f"{self.recipe.where()}: train split of {_named(ref)}: {exc}") from None

    def _crops(
        self, refs: list[DatasetRef], num: int, length: int, seed: int, setting: str, distinct: bool = False
    ) -> torch.Tensor:
        """``num`` crops of the train split(s), shared out evenly over the datasets of an expanded F-ID; with
        ``distinct``, no more than a text holds without overlap (refused naming ``setting``)."""
        from aimet_quadapter.methods.generated import GENERATED, sample_crops
        from aimet_quadapter.text.data import random_crops

        parts = []
        for i, ref in enumerate(refs):
            n = num // len(refs) + (1 if i < num % len(refs) else 0)
            if n and ref.source == GENERATED:
                parts.append(sample_crops(self.generated_samples(), n, length, seed))
            elif n:
                with self._about(ref):
                    ids = self._tokens(ref.source, "train")
                    parts.append(random_crops(ids, n, length, seed, setting, distinct))
        crops = torch.cat(parts)
        if len(refs) > 1:  # mix the datasets within every batch
            crops = crops[torch.randperm(len(crops), generator=torch.Generator().manual_seed(seed))]
        return crops

    @_per_run
    def generated_samples(self) -> torch.Tensor:
        """The ``generated`` dataset: sampled from the FP model once, then read from the run folder."""
        from aimet_quadapter.methods.generated import generate_samples

        params = self.recipe.generation_parameters()
        key = _fingerprint({"model": self.model_name, **self._sections(("generated",))})
        path = self.out_dir / "generated" / f"{key}.pt"
        if path.is_file():
            return torch.load(path)
        self._say(f"sampling {params.samples} x {params.length} tokens of text from the FP model (dataset generated)")
        start = time.time()
        samples = generate_samples(self._load_model(), params, self.progress)
        self._say(f"  {time.time() - start:.0f} s; kept in {path}")
        if self.main:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda tmp: torch.save(samples, tmp))
        return samples

    @_per_run
    def calibration_batches(self, cal: str) -> list[torch.Tensor]:
        from aimet_quadapter.text.data import batches

        c = self.recipe.calibration
        crops = self._crops(self.calibration_sets[cal], c.samples, c.length, c.seed, "calibration.samples", True)
        return batches(crops, 1)

    @_per_run
    def validation_batches(self, cal: str) -> list[torch.Tensor]:
        """Held-out crops of the calibration set (another seed), for phase 1's check against its start."""
        from aimet_quadapter.text.data import batches, holdout_seed

        c, n = self.recipe.calibration, self.recipe.quadapter.holdout
        if not n:
            return []
        return batches(
            self._crops(self.calibration_sets[cal], n, c.length, holdout_seed(c.seed), "quadapter.holdout"), 1
        )

    @_per_run
    def _finetune_pool(self, fid: str) -> torch.Tensor:
        size, seed = self._finetune_pool_size(), self.recipe.calibration.seed + 1
        return self._crops(self.fids[fid], size, self.recipe.phase2.seq_len, seed, self._finetune_setting())

    def finetune_batches(self, fid: str, size: int | None) -> list[torch.Tensor]:
        from aimet_quadapter.text.data import batches

        pool = self._finetune_pool(fid)
        return batches(pool[:size] if size else pool, self.recipe.phase2.batch_size)

    @_per_run
    def eval_windows(self) -> dict[str, list]:
        """The windows of the evaluation (test) texts, by column."""
        return self._windows(self.evals, "eval")

    @_per_run
    def dev_windows(self) -> dict[str, list]:
        """The windows of the development texts, by column."""
        return self._windows(self.devs, "dev")

    def _windows(self, specs: list[EvalSpec], section: str) -> dict[str, list]:
        from aimet_quadapter.text.data import eval_windows

        out = {}
        for s in specs:
            tokens = self._tokens(s.ref.source, s.split)
            out[s.ref.label] = eval_windows(tokens[s.start :], s.seq_len, s.stride, s.max_tokens)
            if not out[s.ref.label]:
                raise QuadapterError(
                    f"{self.recipe.where()}: {section} dataset {_named(s.ref)}, split {s.split}: the text has "
                    f"{len(tokens)} token(s)"
                    + (f", {s.start} of them skipped (start)" if s.start else "")
                    + "; at least 2 are needed to score one"
                )
        return out

    def check_roles(self) -> None:
        """Refuse tuning or development text that reads an evaluation text (methods/roles.py)."""
        from aimet_quadapter.methods.generated import GENERATED
        from aimet_quadapter.methods.roles import TextUse, check_roles

        def use(role: str, what: str, s: EvalSpec) -> TextUse:
            span = f"tokens {s.start}.." + ("" if s.stop is None else str(s.stop))
            named = f"{what} {_named(s.ref)}, split {s.split}, {span}"
            return TextUse(role, named, s.ref.source, s.split, self._tokens(s.ref.source, s.split), s.start, s.stop)

        others: list[TextUse] = []
        tuned = [
            (f"calibration set {c.calibration}", tuple(self.calibration_sets[c.calibration]))
            for c in self.cells
            if c.calibration is not None and self.catalog[c.method].calibrates
        ]
        tuned += [(f"fine-tuning data of F-ID {c.fid}", tuple(self.fids[c.fid])) for c in self.cells if c.fid]
        for what, refs in dict.fromkeys(tuned):
            for r in refs:
                if r.source != GENERATED:  # sampled by the model: no text of any file
                    with self._about(r):
                        tokens = self._tokens(r.source, "train")
                    others.append(TextUse("tuning", f"{what}: train split of {_named(r)}", r.source, "train", tokens))
        others += [use("development", "dev dataset", s) for s in self.devs]
        check_roles(self.recipe.where(), [use("test", "eval dataset", s) for s in self.evals], others)

    # --- execution ----------------------------------------------------------------------------------
    def _context(self, cell_dir: Path | None, cal: str | None, fid: str | None, size: int | None, fingerprint: str):
        """What a method computes from; ``fingerprint``: the stamp of every state it saves."""
        from aimet_quadapter.methods.registry import MethodContext

        p2 = self.recipe.phase2
        ctx = MethodContext(
            self._load_model(),
            self.recipe.quant_policy(),
            self.calibration_batches(cal) if cal else [],
            self.finetune_batches(fid, size) if fid else None,
            self.recipe.quadapter_parameters(),
            cell_dir,
            self.progress,
            baselines=self.recipe.baseline_parameters(),
            checkpoints=p2.checkpoint_every < p2.steps,
            validation=self.validation_batches(cal) if cal else None,
            model_name=self.model_name,
            fingerprint=fingerprint,
        )
        return ctx

    def _bc_dir(self, cal: str) -> Path:
        folder = self.out_dir if self.seed is None else self.out_dir / f"seed-{self.seed}"
        return folder / safe_name(f"calib-{cal}") / BC

    def _bc_state(self, cal: str, info: dict):
        """Quadapter BC's state for calibration set ``cal``: in memory, saved by an earlier cell, or computed now."""
        from aimet_quadapter.methods.registry import run_method
        from aimet_quadapter.quadapter.state import QuadapterState

        if cal in self._bc:
            return self._bc[cal]
        folder = self._bc_dir(cal)
        stamp = folder / "bc_fingerprint.txt"
        state_file = folder / "quadapter_bc.safetensors"
        stamps = (self.bc_fingerprint(cal), self.bc_fingerprint(cal, by_path=True))
        if state_file.is_file() and stamp.is_file() and stamp.read_text().strip() in stamps:
            self._bc[cal] = QuadapterState.load(state_file)
            return self._bc[cal]
        self._say(f"phase 1 (Quadapter BC) on calibration set {cal}, shared by the methods that continue from it")
        start = time.time()
        folder.mkdir(parents=True, exist_ok=True)
        # stamped as the folder is: where no row records this state, export compares it with bc_fingerprint.txt
        ctx = self._context(folder, cal, None, None, self.bc_fingerprint(cal))
        run_method(BC, ctx)
        if self.main:
            write_text_atomic(stamp, self.bc_fingerprint(cal))
        info["bc_time_s"] = time.time() - start
        self._bc[cal] = ctx.bc_state
        return ctx.bc_state

    def _start_of(self, cell: Cell, results: dict) -> tuple[str, QuadapterState] | None:
        """The key and saved state of the cell ``cell`` continues from (catalog ``continues``: the same seed, F-ID
        and size), where that cell is done in ``results`` under the settings it would have now; else None."""
        from aimet_quadapter.quadapter.state import QuadapterState

        origin = self.catalog[cell.method].continues
        if origin is None or cell.fid is None:
            return None
        before = self._finetune_cell(origin, cell.fid, cell.size)
        state_file = self.out_dir / before.folder / f"{origin}.safetensors"
        if not (self.is_done(results, before) and state_file.is_file()):
            return None
        state = QuadapterState.load(state_file)
        # the row's own state only: a file left by another run (other settings, or saved before states carried
        # their cell's fingerprint) would give this cell another start than its fingerprint says
        if state.metadata.get("fingerprint") != results["cells"][before.key]["fingerprint"]:
            self._say(f"{cell.key}: {state_file} is not the state of row {before.key}; computing it again")
            return None
        return before.key, state

    def run_cell(self, cell: Cell, results: dict) -> dict:
        """Compute ``cell``; ``results``: the run's results so far (what a cell may continue from)."""
        from aimet_quadapter.methods.registry import run_method

        spec = self.catalog[cell.method]
        cell_dir = self.out_dir / cell.folder
        fingerprint = self.fingerprint(cell)
        # A phase-2 checkpoint left by an interrupted run resumes the cell, but only under the same settings.
        checkpoints = cell_dir / "checkpoints"
        stamp = checkpoints / "fingerprint.txt"
        if self.main:
            if checkpoints.exists() and not (stamp.is_file() and stamp.read_text() in self.fingerprints(cell)):
                shutil.rmtree(checkpoints)
            checkpoints.mkdir(parents=True, exist_ok=True)
            write_text_atomic(stamp, fingerprint)
            # the states and loss curves of an earlier computation of this cell (other settings): none may stay
            # beside the new row
            for old in [*cell_dir.glob("*.safetensors"), *cell_dir.glob(f"*{PHASE2_CURVE}")]:
                old.unlink()
        distributed.barrier()  # under torchrun: no process resumes from a checkpoint the first one removes
        extra: dict = {}
        start = time.time()
        with PeakRSS() as peak:  # this cell's own peak, evaluation included
            origin = self._start_of(cell, results)
            if origin is not None:
                extra["continued_from"] = origin[0]
                self._say(f"{cell.key} starts from the saved state of {origin[0]}")
            bc_state = self._bc_state(cell.calibration_set, extra) if spec.from_bc and origin is None else None
            ctx = self._context(cell_dir, cell.calibration, cell.fid, cell.size, fingerprint)
            ctx.bc_state = bc_state
            ctx.start = origin[1] if origin is not None else None
            method_start = time.time()
            evaluated = run_method(cell.method, ctx)
            method_time = time.time() - method_start
            release_freed_memory()  # what training freed, before the evaluation's own peak
            if cell.method == BC:
                if self.main:
                    write_text_atomic(cell_dir / "bc_fingerprint.txt", self.bc_fingerprint(cell.calibration_set))
                self._bc[cell.calibration_set] = ctx.bc_state
            from aimet_quadapter.text.perplexity import evaluate

            eval_start = time.time()
            ppl = evaluate(evaluated, self.eval_windows(), spec.label, self.progress)
            dev_ppl = evaluate(evaluated, self.dev_windows(), f"{spec.label} (dev)", self.progress) if self.devs else {}
            eval_time = time.time() - eval_start
        if self.main:
            shutil.rmtree(cell_dir / "checkpoints", ignore_errors=True)
        record = {
            **self._record(cell),
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
        failure = self._nonfinite(ppl, dev_ppl, cell_dir)
        # no number for a perplexity that is none: the cell failed, and a rerun computes it again
        return self.failed_record(cell, failure) if failure else record

    def _nonfinite(self, ppl: dict[str, float], dev_ppl: dict[str, float], cell_dir: Path) -> str | None:
        """Why a cell whose evaluation gave a perplexity that is NaN or infinite failed, with where its training
        ended (the last step and loss of each phase-2 curve the cell wrote); None when every value is finite."""
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
        training = (
            f"the training losses stayed finite ({'; '.join(ends)})"
            if ends
            else "the method ended without a non-finite training loss"
        )
        return f"perplexity {', '.join(bad)}; {training}"

    def _record(self, cell: Cell) -> dict:
        """What every results.json record of ``cell`` says, finished or stopped."""
        from aimet_quadapter.models.devices import device_label

        return {
            "method": cell.method,
            "label": self.catalog[cell.method].label,
            "rank": list(self.catalog).index(cell.method),
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
            "fingerprint": self.fingerprint(cell),
            "row_fingerprint": self.row_fingerprint(cell),
            "folder": cell.folder,
        }

    def failed_record(self, cell: Cell, error: str) -> dict:
        """The record of a cell whose training diverged or whose perplexity is not finite: no perplexity, so a rerun
        computes it again."""
        return {**self._record(cell), "ppl": {}, "error": error}

    def _write(self, results: dict) -> None:
        if self.main:
            write_results(self.out_dir, results)

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
                self._say(f"seed {seed} ({i + 1} of {len(seeds)})")
                results = self._run_seed(seed)
            if self.recipe.export is not None and self.main:
                self._hand_off(results)
            return results

    def _run_seed(self, seed: int) -> dict:
        """One seed's cells, by a run of its own that goes when they are done (its data with it)."""
        child = RecipeRun(self.recipe.for_seed(seed), self.out_dir, self.progress, seed, self.recipe, self.command)
        # one model and one tokenization of each text for every seed
        child._model, child._tokenizer, child._token_cache = self._model, self._tokenizer, self._token_cache
        results = child._run()
        self._model, self._tokenizer = child._model, child._tokenizer
        return results

    def _hand_off(self, results: dict) -> None:
        """The row chosen on development text, exported and checked (running/handoff.py), into ``results``."""
        from aimet_quadapter.running.handoff import fp_answers, hand_off

        model = self._load_model()
        prompts = fp_answers(self.recipe, model, self.tokenizer())
        self._model = None  # handed over: the export builds its sim in place on these weights
        release_freed_memory()
        results["export"] = hand_off(
            self.recipe, self.out_dir, results, prompts, self.tokenizer(), self.progress, model
        )
        del model
        self._write(results)
        e = results["export"]
        check = e.get("device_check")
        if check:
            self._say(
                f"export: {e['chosen']} (chosen on development text) in {e['path']}; device graph {check['ppl']:.3f} "
                f"vs sim {check['sim_ppl']:.3f} on {e['verify_text']}, {check['with_encoding']} of "
                f"{check['activation_tensors']} activation tensors with this package's encoding"
            )

    def _run(self) -> dict:
        results = self._load_or_new()
        pending = [c for c in self.cells if not self.is_done(results, c)]
        for cell in self.cells:
            if cell in pending:
                continue
            record = results["cells"][cell.key]
            if record["fingerprint"] not in (self.fingerprint(cell), self.fingerprint(cell, by_path=True)):
                # done under the fingerprint of every section it was said to read: stamped with what it reads, so
                # that a later change of a field it does not read leaves it done, and its seeds one row
                record["fingerprint"] = self.fingerprint(cell)
                record["row_fingerprint"] = self.row_fingerprint(cell)
            # a cell recorded before rows kept settings apart, done under these settings: it is of their row
            record.setdefault("row_fingerprint", self.row_fingerprint(cell))
        self._write(results)
        p2 = self.recipe.phase2
        seen = max(p2.steps, 1) * p2.batch_size
        if self.recipe.finetune_sizes and max(self.recipe.finetune_sizes) > seen:
            self._say(
                f"note: phase 2 sees at most {seen} sequences (phase2.steps x phase2.batch_size); "
                f"finetune_sizes above that use only their first {seen}"
            )
        skipped = len(self.cells) - len(pending)
        if skipped:
            self._say(f"{skipped} of {len(self.cells)} cells already in {self.out_dir / RESULTS}: skipped")
        self.check_data(pending)
        bar = tqdm(pending, desc="matrix", unit="cell", disable=not self.progress)
        for cell in bar:
            bar.set_postfix(cell=cell.key)
            try:
                record = self.run_cell(cell, results)
            except TrainingDiverged as exc:  # this method stops; the matrix goes on (a rerun tries it again)
                record = self.failed_record(cell, str(exc))
            results["cells"][cell.key] = record
            results["updated"] = record["finished"]
            self._write(results)
            values = ", ".join(f"{k} {v:.3f}" for k, v in record["ppl"].items())
            if "error" in record:
                self._say(f"{cell.key}: stopped: {record['error']}", logging.WARNING)
            else:
                self._say(f"{cell.key} ({record['wall_time_s']:.0f} s): {values}")
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
