"""The plan of a recipe's run, named before anything loads: F-IDs, calibration sets, scored texts and cells."""

from __future__ import annotations

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.methods.catalog import CATALOG
from aimet_quadapter.running.cells import Cell, DatasetRef, EvalSpec
from aimet_quadapter.running.recipes import Recipe
from aimet_quadapter.running.texts import Texts


class Plan:
    """The cells of ``recipe`` (of one ``seed``'s run); ``texts``: the prefix that default windows leave room for."""

    def __init__(self, recipe: Recipe, seed: int | None, texts: Texts):
        self.recipe = recipe
        self.seed = seed
        self.model_name = texts.model_name
        self.fids = {self._group_name(g): g for g in (self._refs(group) for group in recipe.fid)}
        shared = recipe.calibration.dataset
        cal = self.shared_calibration = self._refs(shared) if shared else None
        self.calibration_sets = {self._group_name(cal): cal} if cal else dict(self.fids)
        self.evals = self._eval_specs("eval", texts)
        self.devs = self._eval_specs("dev", texts)
        self.cells = self._plan()

    def _refs(self, names: list[str]) -> list[DatasetRef]:
        from aimet_quadapter.text.data import dataset_label

        sources = [(name, self.recipe.resolve_dataset(name)) for name in names]
        return [DatasetRef(name, source, dataset_label(source)) for name, source in sources]

    @staticmethod
    def _group_name(refs: list[DatasetRef]) -> str:
        return "+".join(r.label for r in refs)

    def _eval_specs(self, section: str, texts: Texts) -> list[EvalSpec]:
        """The texts the ``eval`` (test text) or ``dev`` (development text) section scores."""
        from aimet_quadapter.methods.generated import GENERATED

        if (e := getattr(self.recipe, section)) is None:
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
                    d.seq_len or e.seq_len or self._longest_window(texts),
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

    def _longest_window(self, texts: Texts) -> int:
        """The longest window after the prefix, at most EVAL_SEQ_LEN (that where the model's positions are unknown)."""
        from aimet_quadapter.models.loading import max_positions
        from aimet_quadapter.text import EVAL_SEQ_LEN

        positions = max_positions(self.model_name)
        return EVAL_SEQ_LEN if positions is None else min(EVAL_SEQ_LEN, positions - len(texts.prefix_ids()))

    def _plan(self) -> list[Cell]:
        methods = list(dict.fromkeys(self.recipe.methods))
        cells = [Cell(m, m, "-", None, None, None) for m in methods if not CATALOG[m].calibrates]
        for m in (m for m in methods if CATALOG[m].calibrates and not CATALOG[m].finetunes):
            for cal in self.calibration_sets:
                cells.append(Cell(f"calib:{cal}/{m}{self.seed_tag}", m, f"calib:{cal}", cal, None, None, self.seed))
        sizes: list[int | None] = [*self.recipe.finetune_sizes] if self.recipe.finetune_sizes else [None]
        tuned = [m for m in methods if CATALOG[m].finetunes]
        return cells + [self.finetune_cell(m, fid, size) for fid in self.fids for m in tuned for size in sizes]

    @property
    def seed_tag(self) -> str:
        return "" if self.seed is None else f"#seed{self.seed}"

    def finetune_cell(self, method: str, fid: str, size: int | None) -> Cell:
        key = f"{fid}/{method}" + (f"@{size}" if size else "") + self.seed_tag
        cal = next(iter(self.calibration_sets)) if self.shared_calibration else fid
        return Cell(key, method, fid, cal, fid, size, self.seed)

    def uses_generated(self) -> bool:
        from aimet_quadapter.methods.generated import GENERATED

        groups = [*self.fids.values(), *self.calibration_sets.values()]
        return any(r.source == GENERATED for refs in groups for r in refs)

    def finetune_pool_size(self) -> int:
        # one pool of the largest size: every smaller sweep size is a prefix of it, so the sizes are nested
        p2 = self.recipe.phase2
        return max(self.recipe.finetune_sizes or [max(p2.steps, 1) * p2.batch_size])

    def finetune_setting(self) -> str:
        return "finetune_sizes" if self.recipe.finetune_sizes else "phase2.steps x phase2.batch_size"
