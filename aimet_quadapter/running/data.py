"""What a run's cells compute from: the model, the tuning crops, sampled text, and the windows it scores."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from aimet_quadapter.atomic import write_atomic
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.memory import release_freed_memory
from aimet_quadapter.methods.catalog import BC, CATALOG
from aimet_quadapter.running.cells import Cell, DatasetRef, EvalSpec, named
from aimet_quadapter.running.checks import Checks
from aimet_quadapter.running.fingerprints import _fingerprint, sections
from aimet_quadapter.running.output import Output
from aimet_quadapter.running.plan import Plan
from aimet_quadapter.running.recipes import Recipe
from aimet_quadapter.running.texts import Texts

if TYPE_CHECKING:  # imported when a run starts: the model code pulls in AIMET
    from aimet_quadapter.models import PreparedLM

_Result = TypeVar("_Result")


def _per_run(method: Callable[..., _Result]) -> Callable[..., _Result]:
    """``functools.cache`` on the instance: one seed's data and windows go with its run, not with the process."""

    @functools.wraps(method)
    def cached(self: Any, *args: Any) -> _Result:
        memo = self.__dict__.setdefault("_memo", {})
        key = (method.__name__, *args)
        if key not in memo:
            memo[key] = method(self, *args)
        return memo[key]

    return cached


@dataclass(eq=False)
class RunData:
    """The data of one run (one seed's), each batch and window computed once; model and tokens shared via ``texts``."""

    recipe: Recipe
    plan: Plan
    texts: Texts
    checks: Checks
    device: torch.device
    output: Output

    def load_model(self) -> PreparedLM:
        shared = self.texts.shared
        if shared.model is not None:
            return shared.model
        from aimet_quadapter.models import load_model

        model, shared.tokenizer = load_model(self.plan.model_name, quiet=True, device=self.device)
        shared.model = model
        self.checks.check_lengths(model.max_positions)  # a hub model's limit is known only now
        self.checks.check_sites(model)  # site names are known once the model is: before any cell's work
        self.checks.check_aimet_support(self.plan.cells, model.arch.name)
        model.set_prefix(self.texts.prefix_ids())
        self._say_auto_prefix()
        return model

    def release_model(self) -> None:
        """Let the model go where a sim or export takes its weights over in place: a later cell loads it again."""
        self.texts.shared.model = None

    def _say_auto_prefix(self) -> None:
        from aimet_quadapter.models.prefix import AUTO_PREFIX

        if self.recipe.prefix != AUTO_PREFIX:
            return
        text = self.texts.prefix_text()
        if text is None:
            self.output.say(
                f"prefix auto: the tokenizer of {self.plan.model_name} has neither a BOS nor an EOS token: no prefix"
            )
        else:
            self.output.say(f"prefix auto: {text!r} (tokens {self.texts.prefix_ids()})")

    def check(self, cells: list[Cell]) -> None:
        """Read, tokenize and cut every text ``cells`` need before the model loads: a bad text stops the run now."""
        from aimet_quadapter.methods.generated import GENERATED
        from aimet_quadapter.models.loading import family_of, max_positions

        plan, checks = self.plan, self.checks
        checks.check_aimet_support(cells, family_of(plan.model_name))
        checks.check_lengths(max_positions(plan.model_name))
        checks.check_counts(cells)
        self.eval_windows()
        self.dev_windows()
        checks.check_roles()
        calibrated = [c for c in cells if c.calibration is not None and CATALOG[c.method].calibrates]
        groups = [plan.calibration_sets[c.calibration_set] for c in calibrated]
        groups += [plan.fids[c.fid] for c in cells if c.fid is not None]
        for ref in dict.fromkeys(r for refs in groups for r in refs if r.source != GENERATED):  # texts before sampling
            with self.texts.about(ref):
                self.texts.tokens(ref.source, "train")
        for cell in cells:
            if cell.calibration is not None and CATALOG[cell.method].calibrates:
                self.calibration_batches(cell.calibration)
                if CATALOG[cell.method].from_bc or cell.method == BC:
                    self.validation_batches(cell.calibration)
            if cell.fid is not None:
                self.finetune_batches(cell.fid, cell.size)
        checks.check_export()
        release_freed_memory()  # what tokenizing whole corpora freed (sampling gives its own back)

    def _crops(
        self, refs: list[DatasetRef], num: int, length: int, seed: int, setting: str, distinct: bool = False
    ) -> torch.Tensor:
        """``num`` crops of the train split(s), shared out over an expanded F-ID; ``distinct``: without overlap."""
        from aimet_quadapter.methods.generated import GENERATED, sample_crops
        from aimet_quadapter.text.data import random_crops

        parts = []
        for i, ref in enumerate(refs):
            n = num // len(refs) + (1 if i < num % len(refs) else 0)
            if n and ref.source == GENERATED:
                parts.append(sample_crops(self.generated_samples(), n, length, seed))
            elif n:
                with self.texts.about(ref):
                    ids = self.texts.tokens(ref.source, "train")
                    parts.append(random_crops(ids, n, length, seed, setting, distinct))
        crops = torch.cat(parts)
        if len(refs) > 1:  # mix the datasets within every batch
            crops = crops[torch.randperm(len(crops), generator=torch.Generator().manual_seed(seed))]
        return crops

    @_per_run
    def generated_samples(self) -> torch.Tensor:
        """The ``generated`` dataset: sampled from the FP model once, then read from the run folder."""
        from aimet_quadapter.methods.generated import generate_samples

        params = self.recipe.generated
        key = _fingerprint({"model": self.plan.model_name, **sections(self.recipe, ("generated",))})
        path = self.output.out_dir / "generated" / f"{key}.pt"
        if path.is_file():
            return torch.load(path)
        say = self.output.say
        say(f"sampling {params.samples} x {params.length} tokens of text from the FP model (dataset generated)")
        start = time.time()
        samples = generate_samples(self.load_model(), params, self.output.progress)
        say(f"  {time.time() - start:.0f} s; kept in {path}")
        if self.output.main:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda tmp: torch.save(samples, tmp))
        return samples

    @_per_run
    def calibration_batches(self, cal: str) -> list[torch.Tensor]:
        from aimet_quadapter.text.data import batches

        c = self.recipe.calibration
        crops = self._crops(self.plan.calibration_sets[cal], c.samples, c.length, c.seed, "calibration.samples", True)
        return batches(crops, 1)

    @_per_run
    def validation_batches(self, cal: str) -> list[torch.Tensor]:
        """Held-out crops of the calibration set (another seed), for phase 1's check against its start."""
        from aimet_quadapter.text.data import batches, holdout_seed

        c, n = self.recipe.calibration, self.recipe.quadapter.holdout
        if not n:
            return []
        crops = self._crops(self.plan.calibration_sets[cal], n, c.length, holdout_seed(c.seed), "quadapter.holdout")
        return batches(crops, 1)

    @_per_run
    def _finetune_pool(self, fid: str) -> torch.Tensor:
        size, seed = self.plan.finetune_pool_size(), self.recipe.calibration.seed + 1
        return self._crops(self.plan.fids[fid], size, self.recipe.phase2.seq_len, seed, self.plan.finetune_setting())

    def finetune_batches(self, fid: str, size: int | None) -> list[torch.Tensor]:
        from aimet_quadapter.text.data import batches

        pool = self._finetune_pool(fid)
        return batches(pool[:size] if size else pool, self.recipe.phase2.batch_size)

    @_per_run
    def eval_windows(self) -> dict[str, list]:
        return self._windows(self.plan.evals, "eval")

    @_per_run
    def dev_windows(self) -> dict[str, list]:
        return self._windows(self.plan.devs, "dev")

    def _windows(self, specs: list[EvalSpec], section: str) -> dict[str, list]:
        from aimet_quadapter.text.data import eval_windows

        out = {}
        for s in specs:
            tokens = self.texts.tokens(s.ref.source, s.split)
            out[s.ref.label] = eval_windows(tokens[s.start :], s.seq_len, s.stride, s.max_tokens)
            if not out[s.ref.label]:
                raise QuadapterError(
                    f"{self.recipe.where()}: {section} dataset {named(s.ref)}, split {s.split}: the text has "
                    f"{len(tokens)} token(s)"
                    + (f", {s.start} of them skipped (start)" if s.start else "")
                    + "; at least 2 are needed to score one"
                )
        return out
