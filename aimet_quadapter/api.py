"""``apply_quadapter``: the whole method on an AIMET sim, in the style of ``apply_adaround``/``apply_seq_mse``.

>>> sim = build_sim(fp_model)                          # or any QuantizationSimModel of a PreparedLM
>>> result = apply_quadapter(sim, fp_model, calib_batches, finetune_batches, QuadapterParameters())
>>> result.state.save("quadapter.safetensors")         # alphas + quantizer ranges

On return the sim holds the folded weights and the learned encodings: evaluate or export it as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from aimet_torch.quantsim import QuantizationSimModel

from .blockwise import BlockwiseParameters, BlockwiseResult, apply_blockwise_calibration
from .cle import init_with_cle
from .errors import QuadapterError
from .finetune import FinetuneParameters, FinetuneResult, apply_finetuning
from .models import PreparedLM
from .policy import calibrate
from .quadapter import QuadapterSet
from .state import QuadapterState


@dataclass
class QuadapterParameters:
    """All of Quadapter's settings. Defaults are the paper's; ``phase2.steps = 0`` gives Quadapter BC."""

    phase1: BlockwiseParameters = field(default_factory=BlockwiseParameters)
    phase2: FinetuneParameters = field(default_factory=FinetuneParameters)
    init: str = "ones"  # "ones" (the paper) or "cle": start phase 1 from the analytic CLE alpha
    extra_sites: bool | None = None  # beyond-paper sites (v->o, up->down); None: the family's default

    def __post_init__(self):
        if self.init not in ("ones", "cle"):
            raise QuadapterError(f"quadapter.init must be 'ones' or 'cle', got {self.init!r}")


@dataclass
class QuadapterResult:
    qset: QuadapterSet
    state: QuadapterState
    phase1: BlockwiseResult | None
    phase2: FinetuneResult | None


def _model_of(sim: QuantizationSimModel) -> PreparedLM:
    if not isinstance(sim.model, PreparedLM):
        raise QuadapterError("apply_quadapter needs a sim of a PreparedLM (see aimet_quadapter.models.prepare_model)")
    return sim.model


def attach_quadapters(sim: QuantizationSimModel, extra_sites: bool | None = None) -> QuadapterSet:
    """A Quadapter (alpha = 1) at every site of the sim's model, hooked into its forward."""
    return QuadapterSet.for_model(_model_of(sim), extra_sites).attach(sim.model)


def apply_cle(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    calibration_batches: Sequence[torch.Tensor],
    extra_sites: bool | None = None,
) -> QuadapterSet:
    """LayerNorm-aware CLE: analytic alphas folded into the sim, then AIMET's static calibration."""
    qset = attach_quadapters(sim, extra_sites)
    init_with_cle(qset, fp_model, calibration_batches)
    qset.fold(sim.model, reference=fp_model)
    qset.detach()
    calibrate(sim, calibration_batches)
    return qset


def apply_quadapter(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    calibration_batches: Sequence[torch.Tensor],
    finetune_batches: Sequence[torch.Tensor] | None = None,
    params: QuadapterParameters | None = None,
    progress: bool = True,
) -> QuadapterResult:
    """Quadapter on ``sim`` (built from ``fp_model``, which stays untouched), Algorithm 1 of the paper.

    1. a Quadapter per site, alpha = 1 (or CLE's alpha); phase 1 block-wise calibration under dynamic
       quantization on ``calibration_batches``;
    2. static encodings with AIMET's ``compute_encodings`` on the same calibration data, through alpha;
    3. phase 2 on ``finetune_batches``: alpha and quantizer ranges on the LM loss, weights frozen;
    4. fold alpha into the sim's weights. The sim then holds the final weights and encodings.
    """
    params = params or QuadapterParameters()
    result = apply_blockwise_phase(sim, fp_model, calibration_batches, params, progress)
    if params.phase2.steps > 0:
        if not finetune_batches:
            raise QuadapterError("phase 2 needs fine-tuning data (finetune_batches), or set phase2.steps = 0")
        result = apply_finetune_phase(sim, fp_model, result, finetune_batches, params.phase2, progress)
    return result


def apply_blockwise_phase(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    calibration_batches: Sequence[torch.Tensor],
    params: QuadapterParameters | None = None,
    progress: bool = True,
) -> QuadapterResult:
    """Steps 1-2 alone: Quadapter BC, a PTQ method. The sim is folded and statically calibrated."""
    params = params or QuadapterParameters()
    qset = attach_quadapters(sim, params.extra_sites)
    if params.init == "cle":
        init_with_cle(qset, fp_model, calibration_batches)
    phase1 = None
    if params.phase1.steps > 0:
        phase1 = apply_blockwise_calibration(
            sim.model, fp_model, qset, calibration_batches, params.phase1, progress=progress
        )
    # Fold from the FP weights now: the sim then holds exactly the weights a fresh sim of the folded
    # FP model holds, and static calibration and phase 2 start from the model that will be deployed.
    qset.fold(sim.model, reference=fp_model)
    qset.detach()
    calibrate(sim, calibration_batches)
    state = QuadapterState.from_sim(sim, qset.total_alpha(), method="quadapter_bc")
    return QuadapterResult(qset, state, phase1, None)


def apply_finetune_phase(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    previous: QuadapterResult,
    finetune_batches: Sequence[torch.Tensor],
    params: FinetuneParameters | None = None,
    progress: bool = True,
) -> QuadapterResult:
    """Steps 3-4 alone, on a sim that :func:`apply_blockwise_phase` returned."""
    qset = previous.qset.attach(sim.model)
    try:
        phase2 = apply_finetuning(sim.model, qset, finetune_batches, params, progress=progress)
        # one fold of the total alphas from the FP weights: the saved state rebuilds this sim exactly
        qset.fold(sim.model, reference=fp_model)
    finally:
        qset.detach()
    state = QuadapterState.from_sim(sim, qset.total_alpha(), method="quadapter")
    return QuadapterResult(qset, state, previous.phase1, phase2)
