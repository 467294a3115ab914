"""What a run refuses before its heavy work, in seconds and naming the recipe's field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.methods.catalog import CATALOG
from aimet_quadapter.running.cells import Cell, EvalSpec, named
from aimet_quadapter.running.plan import Plan
from aimet_quadapter.running.recipes import Recipe
from aimet_quadapter.running.texts import Texts

if TYPE_CHECKING:  # imported when a run starts: the model code pulls in AIMET
    from aimet_quadapter.models import PreparedLM


@dataclass(eq=False)
class Checks:
    recipe: Recipe
    plan: Plan
    texts: Texts

    def check_export(self) -> None:
        """The export's texts and aimet-onnx, before the cells: a hand-off that cannot start fails now."""
        if (e := self.recipe.export) is None:
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

    def check_aimet_support(self, cells: list[Cell], family: str | None) -> None:
        """Refuse a method whose technique AIMET refuses for this family (None: not known yet) or policy."""
        from aimet_quadapter.quant.llm_techniques import refusal

        policy = self.recipe.quant_policy()
        for method in dict.fromkeys(c.method for c in cells):
            technique = CATALOG[method].aimet
            reason = refusal(technique, family, policy) if technique else None
            if reason:
                raise QuadapterError(f"{self.recipe.where()}: method {method}: {reason}")

    def check_counts(self, cells: list[Cell]) -> None:
        # the crop counts against the free memory, before any text is read (the texts can say more, later)
        from aimet_quadapter.text.data import check_crop_count

        c, p2 = self.recipe.calibration, self.recipe.phase2
        if any(cell.calibration is not None and CATALOG[cell.method].calibrates for cell in cells):
            check_crop_count(c.samples, c.length, "calibration.samples")
            check_crop_count(self.recipe.quadapter.holdout, c.length, "quadapter.holdout")
        if any(cell.fid is not None for cell in cells):
            check_crop_count(self.plan.finetune_pool_size(), p2.seq_len, self.plan.finetune_setting())
        if self.plan.uses_generated():
            check_crop_count(self.recipe.generated.samples, self.recipe.generated.length, "generated.samples")

    def check_sites(self, model: PreparedLM) -> None:
        if not self.recipe.phase1.keep_start:
            return
        from aimet_quadapter.quadapter.phase1 import kept_at_start

        sites = model.sites(self.recipe.quadapter.extra_sites)
        try:
            kept_at_start(sites, self.recipe.phase1.keep_start)
        except QuadapterError as e:
            raise QuadapterError(f"{self.recipe.where()}: {e}") from None

    def check_lengths(self, limit: int | None) -> None:
        from aimet_quadapter.models.loading import check_length

        plan = self.plan
        crops = []  # lengths cut from the calibration and fine-tuning texts
        if any(CATALOG[c.method].calibrates for c in plan.cells):  # FP32 alone calibrates nothing
            crops.append(("calibration.length", self.recipe.calibration.length))
        if any(CATALOG[c.method].finetunes for c in plan.cells):
            crops.append(("phase2.seq_len", self.recipe.phase2.seq_len))
        lengths = crops + [(f"eval.datasets ({s.ref.label}) seq_len", s.seq_len) for s in plan.evals]
        lengths += [(f"dev.datasets ({s.ref.label}) seq_len", s.seq_len) for s in plan.devs]
        prefix = len(self.texts.prefix_ids())
        if prefix:  # every sequence but the sampled text (the FP model samples it alone) follows the prefix
            lengths = [(f"{field} (after the {prefix} prefix tokens)", n + prefix) for field, n in lengths]
        generated = self.recipe.generated.length if plan.uses_generated() else None
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

    def check_roles(self) -> None:
        """Refuse tuning or development text that reads an evaluation text (methods/roles.py)."""
        from aimet_quadapter.methods.generated import GENERATED
        from aimet_quadapter.methods.roles import TextUse, check_roles

        plan, texts = self.plan, self.texts

        def use(role: str, what: str, s: EvalSpec) -> TextUse:
            span = f"tokens {s.start}.." + ("" if s.stop is None else str(s.stop))
            described = f"{what} {named(s.ref)}, split {s.split}, {span}"
            return TextUse(role, described, s.ref.source, s.split, texts.tokens(s.ref.source, s.split), s.start, s.stop)

        others: list[TextUse] = []
        tuned = [
            (f"calibration set {c.calibration}", tuple(plan.calibration_sets[c.calibration]))
            for c in plan.cells
            if c.calibration is not None and CATALOG[c.method].calibrates
        ]
        tuned += [(f"fine-tuning data of F-ID {c.fid}", tuple(plan.fids[c.fid])) for c in plan.cells if c.fid]
        for what, refs in dict.fromkeys(tuned):
            for r in refs:
                if r.source != GENERATED:  # sampled by the model: no text of any file
                    with texts.about(r):
                        tokens = texts.tokens(r.source, "train")
                    others.append(TextUse("tuning", f"{what}: train split of {named(r)}", r.source, "train", tokens))
        others += [use("development", "dev dataset", s) for s in plan.devs]
        check_roles(self.recipe.where(), [use("test", "eval dataset", s) for s in plan.evals], others)
