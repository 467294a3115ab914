"""The plan of a recipe's run, named before anything loads: its F-IDs and calibration sets, the texts it scores,
and its cells (the module doc of runner.py says which cells a recipe has)."""

from __future__ import annotations

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.methods.catalog import CATALOG
from aimet_quadapter.running.cells import Cell, DatasetRef, EvalSpec
from aimet_quadapter.running.recipes import Recipe
from aimet_quadapter.running.texts import Texts


class Plan:
    """The cells of ``recipe``, of its seed ``seed`` where one seed's run; ``texts``: the prefix that the evaluation
    windows leave room for where the recipe gives no length."""

    def __init__(self, recipe: Recipe, seed: int | None, texts: Texts):
        self.recipe = recipe
        self.seed = seed
        self.model_name = texts.model_name
        self.fids = {self._group_name(g): g for g in (self._refs(group) for group in recipe.fid)}
        shared = recipe.calibration.dataset
        self.shared_calibration = self._refs(shared) if shared else None
        self.calibration_sets = (
            {self._group_name(self.shared_calibration): self.shared_calibration}
            if self.shared_calibration
            else dict(self.fids)
        )
        self.evals = self._eval_specs("eval", texts)
        self.devs = self._eval_specs("dev", texts)
        self.cells = self._plan()

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

    def _eval_specs(self, section: str, texts: Texts) -> list[EvalSpec]:
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
        """The longest window the model takes after the recipe's prefix, at most the usual evaluation length;
        that length where the model's positions are not known before it loads (checked once it is)."""
        from aimet_quadapter.models.loading import max_positions
        from aimet_quadapter.text import EVAL_SEQ_LEN

        positions = max_positions(self.model_name)
        return EVAL_SEQ_LEN if positions is None else min(EVAL_SEQ_LEN, positions - len(texts.prefix_ids()))

    def _calibration_of(self, fid: str) -> str:
        return next(iter(self.calibration_sets)) if self.shared_calibration else fid

    def _plan(self) -> list[Cell]:
        methods = list(dict.fromkeys(self.recipe.methods))
        cells: list[Cell] = []
        for m in methods:
            if not CATALOG[m].calibrates:
                cells.append(Cell(m, m, "-", None, None, None))
        for m in methods:
            if not CATALOG[m].calibrates or CATALOG[m].finetunes:
                continue
            for cal in self.calibration_sets:
                cells.append(Cell(f"calib:{cal}/{m}{self.seed_tag}", m, f"calib:{cal}", cal, None, None, self.seed))
        sizes: list[int | None] = [*self.recipe.finetune_sizes] if self.recipe.finetune_sizes else [None]
        for fid in self.fids:
            for m in methods:
                if not CATALOG[m].finetunes:
                    continue
                for size in sizes:
                    cells.append(self.finetune_cell(m, fid, size))
        return cells

    @property
    def seed_tag(self) -> str:
        """How a cell's key names its seed."""
        return "" if self.seed is None else f"#seed{self.seed}"

    def finetune_cell(self, method: str, fid: str, size: int | None) -> Cell:
        key = f"{fid}/{method}" + (f"@{size}" if size else "") + self.seed_tag
        return Cell(key, method, fid, self._calibration_of(fid), fid, size, self.seed)

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
