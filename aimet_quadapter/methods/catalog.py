"""The methods a recipe can name, one entry each: its table label and everything the runner derives from it.

A new method is one entry here and one function in :mod:`aimet_quadapter.methods.registry` under
``@method("name")``. The entries live apart from the functions (which import AIMET) so that a recipe's
method names and needs are checked in the first seconds of a command.
"""

from __future__ import annotations

from dataclasses import dataclass

# The recipe sections a method's settings live in, beyond model, eval, policy and calibration.
SECTIONS = ("phase1", "phase2", "quadapter", "baselines")


@dataclass(frozen=True)
class MethodInfo:
    label: str  # the paper's row name
    # False: the FP model's own function, no calibration set and no setting involved
    calibrates: bool = True
    quantized: bool = True  # False: a float reference (an upper bound), never a table's "best"
    finetunes: bool = False  # needs the F-ID training data
    from_bc: bool = False  # continues from Quadapter BC (phase 1), which runs first where not yet saved
    # recipe sections the method reads: a change there computes its cells again, a change elsewhere does not
    reads: tuple[str, ...] = SECTIONS
    # settings ("section" or "section.field") within ``reads`` that the method never reads after all
    unused: tuple[str, ...] = ()
    # what the same training buys without the method (same data, steps, rates, loss): the report sets the
    # method against each of these
    matched: tuple[str, ...] = ()
    # the AIMET technique it runs whose support AIMET limits (quant/llm_techniques.py, AIMET_SUPPORT)
    aimet: str | None = None
    # the method whose saved state this one starts from, where that cell of the same seed and F-ID ran under
    # the same settings; otherwise the method computes that state itself first
    continues: str | None = None

    def __post_init__(self) -> None:
        for name in (*self.reads, *(u.partition(".")[0] for u in self.unused)):
            if name not in SECTIONS:
                raise ValueError(f"method {self.label!r}: {name!r} is not a recipe section ({', '.join(SECTIONS)})")


# the settings of the adapter itself, which a method that trains no alpha never reads
_NO_ADAPTER = ("phase1", "quadapter", "phase2.lr_alpha", "phase2.learn_ranges")

CATALOG: dict[str, MethodInfo] = {
    "fp": MethodInfo("FP32", calibrates=False, quantized=False, reads=()),
    "fp_finetuned": MethodInfo("FP fine-tuned", quantized=False, finetunes=True),
    "ptq": MethodInfo("PTQ", reads=()),
    "adaround": MethodInfo("AdaRound", reads=("baselines",)),
    "seq_mse": MethodInfo("SeqMSE", reads=("baselines",)),
    "cle": MethodInfo("CLE", reads=("quadapter",)),
    "quadapter_bc": MethodInfo("Quadapter BC", reads=("phase1", "quadapter")),
    # QAT starts from PTQ's sim: phase 1, the sites and the alphas' rate never enter it
    "qat": MethodInfo("QAT", finetunes=True, unused=_NO_ADAPTER),
    "qat_fixed_ranges": MethodInfo("QAT w/o LSQ+", finetunes=True, unused=_NO_ADAPTER),
    "quadapter_bc_qat": MethodInfo("Quadapter BC+QAT", finetunes=True, from_bc=True, matched=("qat",)),
    "quadapter_bc_qat_fixed_ranges": MethodInfo("Quadapter BC+QAT w/o LSQ+", finetunes=True, from_bc=True),
    # Quadapter's matched baseline: the same phase 2 (loss, data, steps, rates) on CLE's sim with no alpha to
    # train, the quantizer ranges learning instead; what the training budget buys without the adapter.
    "cle_phase2": MethodInfo(
        "CLE + phase 2 (ranges)", finetunes=True, unused=("phase1", "phase2.lr_alpha", "phase2.learn_ranges")
    ),
    "quadapter": MethodInfo("Quadapter", finetunes=True, from_bc=True, matched=("cle_phase2", "qat")),
    "quadapter_fixed_ranges": MethodInfo("Quadapter w/o LSQ+", finetunes=True, from_bc=True),
    # AIMET's LLM techniques, each through its own entry point (quant/llm_techniques.py), then static calibration
    "spinquant": MethodInfo("SpinQuant", reads=("baselines",), aimet="spinquant"),
    "fptquant": MethodInfo("FPTQuant", reads=("baselines",), aimet="fptquant"),
    "adascale": MethodInfo("AdaScale", reads=("baselines",), aimet="adascale"),
    "omniquant": MethodInfo("OmniQuant", reads=("baselines",), aimet="omniquant"),
    # compositions: Quadapter (both phases) on SpinQuant's rotated model; AIMET's weight techniques on Quadapter's
    # folded model, its activation ranges kept
    "spinquant_quadapter": MethodInfo(
        "SpinQuant + Quadapter", finetunes=True, aimet="spinquant", matched=("spinquant_cle_phase2", "quadapter")
    ),
    # its matched baseline: the same rotation and phase 2, CLE's alphas fixed and the ranges learning
    "spinquant_cle_phase2": MethodInfo(
        "SpinQuant + CLE + phase 2 (ranges)",
        finetunes=True,
        aimet="spinquant",
        unused=("phase1", "phase2.lr_alpha", "phase2.learn_ranges"),
    ),
    "quadapter_seq_mse": MethodInfo("Quadapter + SeqMSE", finetunes=True, from_bc=True, continues="quadapter"),
    "quadapter_adaround": MethodInfo("Quadapter + AdaRound", finetunes=True, from_bc=True, continues="quadapter"),
}
# Phase 1's own cell: the methods that continue from it share its result (and its settings' fingerprint).
BC = "quadapter_bc"
