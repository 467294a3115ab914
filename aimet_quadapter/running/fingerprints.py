"""What a run folder's cell is computed from, as a fingerprint: the recipe's fields each method reads (its catalog
``reads``), the data, the policy and the placement its code makes; the seeds aside for a row. A record whose
fingerprint is not one of :meth:`Fingerprints.fingerprints` is computed again."""

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


def _text(ref: DatasetRef, by_path: bool) -> str:
    return ref.source if by_path else ref.identity


# What each method's fingerprint read of the recipe sections before catalog ``reads`` declared fields (reads,
# unused): wider than what it reads now, so a cell recorded under it was computed
# under today's value of every field it reads, and stays done. Methods whose payload did not change are absent.
_WIDE: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    **dict.fromkeys(("adaround", "seq_mse", "spinquant", "fptquant", "adascale", "omniquant"), (("baselines",), ())),
    "cle": (("quadapter",), ()),
    **dict.fromkeys(
        ("qat", "qat_fixed_ranges"),
        (
            ("phase1", "phase2", "quadapter", "baselines"),
            ("phase1", "quadapter", "phase2.lr_alpha", "phase2.learn_ranges"),
        ),
    ),
    **dict.fromkeys(
        ("cle_phase2", "spinquant_cle_phase2"),
        (("phase1", "phase2", "quadapter", "baselines"), ("phase1", "phase2.lr_alpha", "phase2.learn_ranges")),
    ),
    **dict.fromkeys(
        (
            "fp_finetuned",
            "quadapter_bc_qat",
            "quadapter_bc_qat_fixed_ranges",
            "quadapter",
            "quadapter_fixed_ranges",
            "spinquant_quadapter",
            "quadapter_seq_mse",
            "quadapter_adaround",
        ),
        (("phase1", "phase2", "quadapter", "baselines"), ()),
    ),
}


def _fingerprint(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _seedless(value: Any) -> Any:
    """A fingerprint's payload without the seeds (calibration's, generated text's, phase 1's) that
    :meth:`Recipe.for_seed` sets: what the seeds of one row share."""
    if isinstance(value, dict):
        return {k: _seedless(v) for k, v in value.items() if k != "seed"}
    if isinstance(value, (list, tuple)):
        return [_seedless(v) for v in value]
    return value


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

    def _base_payload(self, by_path: bool = False) -> dict:
        # a start of 0 (every run folder's before the field existed) stays out of the fingerprint
        evals = [
            (
                _text(s.ref, by_path),
                s.ref.label,
                s.split,
                s.seq_len,
                s.max_tokens,
                s.stride,
                *([s.start] if s.start else []),
            )
            for s in self.evals
        ]
        payload: dict = {"model": self.model_name, "eval": evals}
        # the text, not `auto`: a recipe that names its model's own prefix either way computes the same cells
        prefix = self.prefix_text()
        if prefix is not None:  # absent otherwise: the cells of run folders before the field stay
            payload["prefix"] = prefix
        return payload

    def _sources(self, refs: list[DatasetRef], by_path: bool = False) -> list:
        """What a dataset group contributes to a fingerprint: its sources, and how generated text is sampled."""
        from aimet_quadapter.methods.generated import GENERATED

        return [self._sections(("generated",)) if r.source == GENERATED else _text(r, by_path) for r in refs]

    def _calibration_payload(self, cal: str, by_path: bool = False) -> dict:
        sources = self._sources(self.calibration_sets[cal], by_path)
        payload = {"policy": self._sections(("policy",))["policy"], "calibration": [sources, self._cal_settings()]}
        if revision := PLACEMENT_REVISION.get(self.recipe.policy.target):
            payload["placement"] = revision
        return payload

    def _cal_settings(self) -> dict:
        c = self.recipe.calibration
        return {"samples": c.samples, "length": c.length, "seed": c.seed}

    def fingerprint(self, cell: Cell, by_path: bool = False) -> str:
        """What ``cell`` is computed from; ``by_path``: as run folders before content hashes named a local text (by
        its path), under which their cells stay done."""
        return _fingerprint(self._payload(cell, by_path))

    def row_fingerprint(self, cell: Cell) -> str:
        """:meth:`fingerprint` less the seeds: the same for every seed of ``cell`` under one set of settings, so
        that a row averages only those (a folder can hold seeds run under other settings before)."""
        return _fingerprint(_seedless(self._payload(cell)))

    def _reads(self, method: str) -> dict:
        """What ``method`` reads of the recipe sections (catalog ``reads``), less what changes no result: a
        section read whole is in the payload as before fields were declared, so its cells keep their fingerprint."""
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

    def _wide_reads(self, method: str) -> dict:
        """What ``method``'s fingerprint read before its reads were declared by field (:data:`_WIDE`)."""
        if method not in _WIDE:
            return self._reads(method)
        reads, unused = _WIDE[method]
        payload = self._sections(reads)
        for name in unused:
            section, _, field = name.partition(".")
            if field:
                payload[section].pop(field, None)
            else:
                payload.pop(section, None)
        return payload

    def fingerprints(self, cell: Cell) -> tuple[str, ...]:
        """Every fingerprint under which a record of ``cell`` holds its result under these settings: the
        fingerprint, and those of run folders written before texts were hashed (``by_path``) or before reads
        were declared by field (``wide``: every field read now was the same then)."""
        return tuple(
            dict.fromkeys(
                _fingerprint(self._payload(cell, by_path, wide)) for wide in (False, True) for by_path in (False, True)
            )
        )

    def _payload(self, cell: Cell, by_path: bool = False, wide: bool = False) -> dict:
        info = CATALOG[cell.method]
        payload = {"method": cell.method, **self._base_payload(by_path)}
        if not info.calibrates:
            return payload
        payload.update(self._calibration_payload(cell.calibration_set, by_path))
        payload.update(self._wide_reads(cell.method) if wide else self._reads(cell.method))
        if info.finetunes:
            payload["fid"] = self._sources(self.fids[cell.fid_name], by_path)
            payload["size"] = cell.size
        return payload

    def bc_fingerprint(self, cal: str, by_path: bool = False) -> str:
        payload = {"model": self.model_name, **self._calibration_payload(cal, by_path)}
        payload.update(self._reads(BC))
        return _fingerprint(payload)
