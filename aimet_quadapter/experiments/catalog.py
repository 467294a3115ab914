"""The methods a recipe can name, as data: their table labels and what each needs.

Apart from :mod:`aimet_quadapter.experiments.methods` (the code that runs them, which imports AIMET) so
that a recipe's method names are checked in the first seconds of a command.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodInfo:
    label: str  # the paper's row name
    finetunes: bool = False  # needs the F-ID training data
    from_bc: bool = False  # continues from Quadapter BC
    # recipe settings ("section" or "section.field") the method never reads: out of its cells' fingerprints,
    # so that changing them does not compute its cells again
    unused: tuple[str, ...] = ()
    # what the same training buys without the method (same data, steps, rates, loss): the report sets the
    # method against each of these
    matched: tuple[str, ...] = ()


CATALOG: dict[str, MethodInfo] = {
    "fp": MethodInfo("FP32"),
    "fp_finetuned": MethodInfo("FP fine-tuned", finetunes=True),
    "ptq": MethodInfo("PTQ"),
    "adaround": MethodInfo("AdaRound"),
    "seq_mse": MethodInfo("SeqMSE"),
    "cle": MethodInfo("CLE"),
    "quadapter_bc": MethodInfo("Quadapter BC"),
    "qat": MethodInfo("QAT", finetunes=True),
    "qat_fixed_ranges": MethodInfo("QAT w/o LSQ+", finetunes=True),
    "quadapter_bc_qat": MethodInfo("Quadapter BC+QAT", finetunes=True, from_bc=True, matched=("qat",)),
    "quadapter_bc_qat_fixed_ranges": MethodInfo("Quadapter BC+QAT w/o LSQ+", finetunes=True, from_bc=True),
    # Quadapter's matched baseline: the same phase 2 (loss, data, steps, rates) on CLE's sim with no alpha to
    # train, the quantizer ranges learning instead; what the training budget buys without the adapter.
    "cle_phase2": MethodInfo(
        "CLE + phase 2 (ranges)", finetunes=True, unused=("phase1", "phase2.lr_alpha", "phase2.learn_ranges")
    ),
    "quadapter": MethodInfo("Quadapter", finetunes=True, from_bc=True, matched=("cle_phase2", "qat")),
    "quadapter_fixed_ranges": MethodInfo("Quadapter w/o LSQ+", finetunes=True, from_bc=True),
}
