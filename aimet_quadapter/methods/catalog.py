"""The methods a recipe can name, one entry each (its function is in :mod:`aimet_quadapter.methods.registry`): kept
apart from the functions, which import AIMET, so that a recipe's methods are checked in a command's first seconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aimet_quadapter.quadapter.config import BC_STATE
from aimet_quadapter.quant.config import (
    AdaroundParameters,
    AdaScaleParameters,
    FPTQuantParameters,
    OmniQuantParameters,
    QatParameters,
    SeqMseParameters,
    SpinQuantParameters,
)
from aimet_quadapter.settings import Settings

# the recipe sections a method's settings live in, beyond model, eval, policy and calibration
SECTIONS = ("phase1", "phase2", "quadapter", "baselines")


@dataclass(frozen=True)
class FromSetting:
    """A phase-2 field a method sets to another section's setting (``"baselines.qat_lr_weights"``)."""

    key: str


# Phase 2's fields a QAT-style row sets itself: the weights learn at baselines.qat_lr_weights
_QAT_WEIGHTS = ("lr_weights", FromSetting("baselines.qat_lr_weights"))
_RANGES_LEARN = (("learn_ranges", True),)
_RANGES_FIXED = (("learn_ranges", False),)


@dataclass(frozen=True)
class MethodInfo:
    label: str  # the paper's row name
    calibrates: bool = True  # False: the FP model's own function, no calibration set and no setting involved
    quantized: bool = True  # False: a float reference (an upper bound), never a table's "best"
    finetunes: bool = False  # needs the F-ID training data
    from_bc: bool = False  # continues from Quadapter BC (phase 1), which runs first where not yet saved
    # what of SECTIONS its fingerprint holds: a section ("phase2"), a field ("quadapter.extra_sites") or a parameter
    # class (its fields); the default, every section, is never stale
    reads: tuple[str | type[Settings], ...] = SECTIONS
    # the fields of phase 2 the method sets itself, whatever the recipe says: (field, value or FromSetting)
    phase2: tuple[tuple[str, Any], ...] = ()
    trains_alpha: bool = True  # False: phase 2 trains no alpha (no adapter, or alphas folded before it)
    unused: tuple[str, ...] = field(default=(), init=False)  # derived: see _unused
    matched: tuple[str, ...] = ()  # what the same training buys without the method, for the report
    aimet: str | None = None  # the AIMET technique it runs whose support AIMET limits (AIMET_SUPPORT)
    continues: str | None = None  # the method whose saved state (same seed, F-ID, settings) this one starts from

    def __post_init__(self) -> None:
        # a parameter class stands for its fields: from here on every entry is a "section[.field]" name
        names = tuple(n for r in self.reads for n in ((r,) if isinstance(r, str) else _field_names(r)))
        object.__setattr__(self, "reads", names)
        object.__setattr__(self, "unused", self._unused())
        for name in (*names, *self.unused):
            if name.partition(".")[0] not in SECTIONS:
                raise ValueError(f"method {self.label!r}: {name!r} is not in a recipe section ({', '.join(SECTIONS)})")
        for name in self.unused:
            if name.partition(".")[0] not in self.reads or not name.partition(".")[2]:
                raise ValueError(f"method {self.label!r}: unused {name!r} is no field of a section it reads whole")

    def _unused(self) -> tuple[str, ...]:
        """The fields of phase 2, read whole, that cannot change the result."""
        if "phase2" not in self.reads:
            return ()
        sets = dict(self.phase2)
        unused = [*sets, *([] if self.trains_alpha else ["lr_alpha"])]
        if sets.get("learn_ranges") is False:
            unused += ["lr_ranges", "lr_ranges_relative", "lr_ranges_overrides"]
        return tuple(f"phase2.{name}" for name in unused)

    def phase2_changes(self, settings: Any) -> dict[str, Any]:
        """:attr:`phase2` with each :class:`FromSetting` taken from ``settings`` (the section it names)."""
        return {
            k: getattr(settings, v.key.partition(".")[2]) if isinstance(v, FromSetting) else v for k, v in self.phase2
        }

    def read_fields(self) -> dict[str, frozenset[str] | None]:
        """Each section the method reads: the fields it reads of it, or None for all (less its ``unused``)."""
        out: dict[str, frozenset[str] | None] = {}
        for name in self.reads:
            assert isinstance(name, str)  # classes became their fields' names in __post_init__
            section, _, field = name.partition(".")
            if not field:
                out[section] = None
            elif section not in out or out[section] is not None:
                out[section] = (out.get(section) or frozenset()) | {field}
        return out

    def reads_setting(self, section: str, field: str) -> bool:
        """Whether the setting ``section.field`` (a section of SECTIONS) can change this method's result."""
        fields = self.read_fields()
        if section not in fields:
            return False
        wanted = fields[section]
        return f"{section}.{field}" not in self.unused if wanted is None else field in wanted


def _field_names(source: type[Settings]) -> tuple[str, ...]:
    return tuple(f"{source.section}.{name}" for name in source.model_fields)


def reads_setting(methods: list[str], key: str) -> bool:
    """Whether the recipe setting ``key`` ("section.field") can change a result of one of ``methods``."""
    section, _, field = key.partition(".")
    if section not in SECTIONS:
        return True
    field = field.partition(".")[0]
    return any(m not in CATALOG or CATALOG[m].reads_setting(section, field) for m in methods)


# Phase 1 reads the adapter's section whole: its start (init), its sites and its held-out check (holdout).
_PHASE1 = ("phase1", "quadapter")


def _qat(label: str, learn_ranges: bool, **fields: Any) -> MethodInfo:
    """A QAT-style row: phase 2 trains every weight at baselines.qat_lr_weights and no alpha."""
    ranges = _RANGES_LEARN if learn_ranges else _RANGES_FIXED
    return MethodInfo(label, finetunes=True, phase2=(_QAT_WEIGHTS, *ranges), trains_alpha=False, **fields)


def _after_quadapter(label: str, reads: type[Settings]) -> MethodInfo:
    """AIMET's weight technique (``reads``: its parameters) on Quadapter's folded model, its activation ranges kept."""
    return MethodInfo(label, finetunes=True, from_bc=True, continues="quadapter", reads=(*_PHASE1, "phase2", reads))


def _on_transform(technique: str, label: str, reads: type[Settings]) -> dict[str, MethodInfo]:
    """Quadapter and BC+QAT on AIMET's ``technique``'s FP-equivalent model, and their matched baselines."""
    return {
        f"{technique}_quadapter": MethodInfo(
            f"{label} + Quadapter",
            finetunes=True,
            aimet=technique,
            matched=(f"{technique}_cle_phase2", "quadapter"),
            reads=(*_PHASE1, "phase2", reads),
        ),
        f"{technique}_cle_phase2": MethodInfo(
            f"{label} + CLE + phase 2 (ranges)",
            finetunes=True,
            aimet=technique,
            reads=("quadapter.extra_sites", "phase2", reads),
            phase2=_RANGES_LEARN,
            trains_alpha=False,
        ),
        # the paper's BC+QAT on the transformed model, and its matched baseline: the same QAT from PTQ's sim
        f"{technique}_quadapter_bc_qat": _qat(
            f"{label} + Quadapter BC+QAT",
            True,
            aimet=technique,
            matched=(f"{technique}_qat", "quadapter_bc_qat"),
            reads=(*_PHASE1, "phase2", QatParameters, reads),
        ),
        f"{technique}_qat": _qat(f"{label} + QAT", True, aimet=technique, reads=("phase2", QatParameters, reads)),
    }


CATALOG: dict[str, MethodInfo] = {
    "fp": MethodInfo("FP32", calibrates=False, quantized=False, reads=()),
    # the LM loss on the FP weights, whatever phase 2's loss, rates and ranges say
    "fp_finetuned": MethodInfo(
        "FP fine-tuned",
        quantized=False,
        finetunes=True,
        reads=("phase2", QatParameters),
        # distilling the FP model into itself would not move it
        phase2=(_QAT_WEIGHTS, *_RANGES_FIXED, ("loss", "lm")),
        trains_alpha=False,
    ),
    "ptq": MethodInfo("PTQ", reads=()),
    "adaround": MethodInfo("AdaRound", reads=(AdaroundParameters,)),
    "seq_mse": MethodInfo("SeqMSE", reads=(SeqMseParameters,)),
    "cle": MethodInfo("CLE", reads=("quadapter.extra_sites",)),
    "quadapter_bc": MethodInfo("Quadapter BC", reads=_PHASE1),
    # QAT starts from PTQ's sim: phase 1, the sites and the alphas' rate never enter it
    "qat": _qat("QAT", True, reads=("phase2", QatParameters)),
    "qat_fixed_ranges": _qat("QAT w/o LSQ+", False, reads=("phase2", QatParameters)),
    "quadapter_bc_qat": _qat(
        "Quadapter BC+QAT", True, from_bc=True, matched=("qat",), reads=(*_PHASE1, "phase2", QatParameters)
    ),
    "quadapter_bc_qat_fixed_ranges": _qat(
        "Quadapter BC+QAT w/o LSQ+", False, from_bc=True, reads=(*_PHASE1, "phase2", QatParameters)
    ),
    # Quadapter's matched baseline: the same phase 2 on CLE's sim, the ranges learning instead of alpha
    "cle_phase2": MethodInfo(
        "CLE + phase 2 (ranges)",
        finetunes=True,
        reads=("quadapter.extra_sites", "phase2"),
        phase2=_RANGES_LEARN,
        trains_alpha=False,
    ),
    "quadapter": MethodInfo(
        "Quadapter", finetunes=True, from_bc=True, matched=("cle_phase2", "qat"), reads=(*_PHASE1, "phase2")
    ),
    "quadapter_fixed_ranges": MethodInfo(
        "Quadapter w/o LSQ+", finetunes=True, from_bc=True, reads=(*_PHASE1, "phase2"), phase2=_RANGES_FIXED
    ),
    # AIMET's LLM techniques, each through its own entry point (quant/llm_techniques.py), then static calibration
    "spinquant": MethodInfo("SpinQuant", reads=(SpinQuantParameters,), aimet="spinquant"),
    "fptquant": MethodInfo("FPTQuant", reads=(FPTQuantParameters,), aimet="fptquant"),
    "adascale": MethodInfo("AdaScale", reads=(AdaScaleParameters,), aimet="adascale"),
    "omniquant": MethodInfo("OmniQuant", reads=(OmniQuantParameters,), aimet="omniquant"),
    # compositions with AIMET's transforms (before Quadapter) and weight techniques (after it)
    **_on_transform("spinquant", "SpinQuant", SpinQuantParameters),
    # FPTQuant's online Hadamard left out: the export holds plain weights
    **_on_transform("fptquant", "FPTQuant", FPTQuantParameters),
    "quadapter_seq_mse": _after_quadapter("Quadapter + SeqMSE", SeqMseParameters),
    # SeqMSE's search confined to the weight ranges phase 2 learned
    "quadapter_seq_mse_learned": _after_quadapter("Quadapter + SeqMSE in learned ranges", SeqMseParameters),
    "quadapter_adaround": _after_quadapter("Quadapter + AdaRound", AdaroundParameters),
}
# Phase 1's own cell: the methods that continue from it share its result (and its settings' fingerprint).
BC = BC_STATE
