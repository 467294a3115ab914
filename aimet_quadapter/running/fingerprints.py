"""What a cell is computed from, as a fingerprint: a record of another fingerprint is computed again."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.methods.catalog import BC, CATALOG
from aimet_quadapter.quant.config import PLACEMENT_REVISION
from aimet_quadapter.running.recipes import result_section

if TYPE_CHECKING:
    from aimet_quadapter.running.cells import Cell, DatasetRef, EvalSpec
    from aimet_quadapter.running.recipes import Recipe


def _fingerprint(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _seedless(value: Any) -> Any:
    """A fingerprint's payload without the seeds :meth:`Recipe.for_seed` sets: what the seeds of one row share."""
    if isinstance(value, dict):
        return {k: _seedless(v) for k, v in value.items() if k != "seed"}
    return [_seedless(v) for v in value] if isinstance(value, (list, tuple)) else value


def sections(recipe: Recipe, names: tuple[str, ...]) -> dict:
    """The recipe's sections ``names`` less what changes no result (:func:`result_section`)."""
    return {n: result_section(n, getattr(recipe, n).model_dump(mode="json")) for n in names}


@dataclass(frozen=True)
class Fingerprints:
    """The fingerprints of the cells of a run of ``recipe``, from the texts and datasets its plan names."""

    recipe: Recipe
    model_name: str
    evals: list[EvalSpec]
    calibration_sets: dict[str, list[DatasetRef]]
    fids: dict[str, list[DatasetRef]]
    # the prefix as text, asked for only once a fingerprint is: ``auto`` loads the tokenizer
    prefix_text: Callable[[], str | None]

    def _sections(self, names: tuple[str, ...]) -> dict:
        return sections(self.recipe, names)

    def _base_payload(self) -> dict:
        # a start of 0, the default, stays out of the fingerprint: only a start that skips tokens is in it
        evals = [
            (s.ref.identity, s.ref.label, s.split, s.seq_len, s.max_tokens, s.stride, *([s.start] if s.start else []))
            for s in self.evals
        ]
        payload: dict = {"model": self.model_name, "eval": evals}
        # the text, not `auto`: a recipe that names its model's own prefix either way computes the same cells
        prefix = self.prefix_text()
        if prefix is not None:  # no prefix, no key: a recipe without one adds nothing to the payload
            payload["prefix"] = prefix
        return payload

    def _sources(self, refs: list[DatasetRef]) -> list:
        """What a dataset group contributes to a fingerprint: its sources, and how generated text is sampled."""
        from aimet_quadapter.methods.generated import GENERATED

        return [self._sections(("generated",)) if r.source == GENERATED else r.identity for r in refs]

    def _calibration_payload(self, cal: str) -> dict:
        sources = self._sources(self.calibration_sets[cal])
        c = self.recipe.calibration
        settings = {"samples": c.samples, "length": c.length, "seed": c.seed}
        payload = {"policy": self._sections(("policy",))["policy"], "calibration": [sources, settings]}
        if revision := PLACEMENT_REVISION.get(self.recipe.policy.target):
            payload["placement"] = revision
        return payload

    def fingerprint(self, cell: Cell) -> str:
        """What ``cell`` is computed from: a record of it under another fingerprint is computed again."""
        return _fingerprint(self._payload(cell))

    def row_fingerprint(self, cell: Cell) -> str:
        """:meth:`fingerprint` less the seeds: a row averages only the seeds of one set of settings."""
        return _fingerprint(_seedless(self._payload(cell)))

    def _reads(self, method: str) -> dict:
        """What ``method`` reads of the recipe sections (catalog ``reads``, less ``unused``) that changes a result."""
        info = CATALOG[method]
        payload = {}
        for section, fields in info.read_fields().items():
            known = type(getattr(self.recipe, section)).model_fields
            for name in (*(fields or ()), *(u.partition(".")[2] for u in info.unused if u.startswith(section + "."))):
                if name not in known:
                    raise QuadapterError(f"method {method}: catalog reads {section}.{name}, which is no setting")
            values = self._sections((section,))[section]
            payload[section] = {
                k: v
                for k, v in values.items()
                if (k in fields if fields is not None else f"{section}.{k}" not in info.unused)
            }
        return payload

    def _payload(self, cell: Cell) -> dict:
        info = CATALOG[cell.method]
        payload = {"method": cell.method, **self._base_payload()}
        if not info.calibrates:
            return payload
        payload.update(self._calibration_payload(cell.calibration_set))
        payload.update(self._reads(cell.method))
        if info.finetunes:
            payload["fid"] = self._sources(self.fids[cell.fid_name])
            payload["size"] = cell.size
        return payload

    def bc_fingerprint(self, cal: str) -> str:
        return _fingerprint({"model": self.model_name, **self._calibration_payload(cal), **self._reads(BC)})
