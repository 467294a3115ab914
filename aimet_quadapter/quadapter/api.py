"""``apply_quadapter``, in the style of AIMET's ``apply_adaround``: on return the sim holds the folded weights and the
learned encodings; ``result.state.save(path)`` keeps the alphas and ranges."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from aimet_torch.quantsim import QuantizationSimModel

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.models import PreparedLM
from aimet_quadapter.quadapter.adapter import QuadapterSet
from aimet_quadapter.quadapter.cle import init_with_cle
from aimet_quadapter.quadapter.config import BC_STATE, Phase2Parameters, QuadapterParameters, RunOptions
from aimet_quadapter.quadapter.phase1 import Phase1Result, run_phase1
from aimet_quadapter.quadapter.phase2 import Phase2Result, mean_lm_loss, phase2_loss, run_phase2
from aimet_quadapter.quadapter.state import QuadapterState
from aimet_quadapter.quant.policy import calibrate
from aimet_quadapter.quant.quantizers import fast_inference


@dataclass
class QuadapterResult:
    qset: QuadapterSet
    state: QuadapterState
    phase1: Phase1Result | None
    phase2: Phase2Result | None


def attach_quadapters(sim: QuantizationSimModel, extra_sites: bool | Sequence[str] | None = None) -> QuadapterSet:
    """A Quadapter (alpha = 1) at every site of the sim's model, hooked into its forward."""
    if not isinstance(sim.model, PreparedLM):
        raise QuadapterError("apply_quadapter needs a sim of a PreparedLM (see aimet_quadapter.models.prepare_model)")
    return QuadapterSet.for_model(sim.model, extra_sites).attach(sim.model)


def apply_cle(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    calibration_batches: Sequence[torch.Tensor],
    extra_sites: bool | Sequence[str] | None = None,
) -> QuadapterSet:
    """LayerNorm-aware CLE: analytic alphas folded into the sim, then AIMET's static calibration."""
    qset = attach_quadapters(sim, extra_sites)
    init_with_cle(qset, fp_model, calibration_batches, sim.model)
    qset.fold(sim.model, reference=fp_model)
    qset.detach()
    calibrate(sim, calibration_batches)
    return qset


def _fold_and_calibrate(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    qset: QuadapterSet,
    alphas: dict[str, torch.Tensor],
    calibration_batches: Sequence[torch.Tensor],
) -> None:
    """The sim with exactly ``alphas`` folded into its FP weights, statically calibrated, the set's hooks off."""
    qset.set_total(alphas)
    qset.fold(sim.model, reference=fp_model)
    qset.detach()
    calibrate(sim, calibration_batches)


def _on_the_way(start: dict[str, torch.Tensor], end: dict[str, torch.Tensor], t: float) -> dict[str, torch.Tensor]:
    """The alphas ``t`` of the way from ``start`` to ``end`` in log alpha (a site missing from one is at 1)."""
    if t == 0.0:
        return start
    if t == 1.0:
        return end
    out = {}
    for name in {*start, *end}:
        like = start[name] if name in start else end[name]
        a, b = start.get(name, torch.ones_like(like)), end.get(name, torch.ones_like(like))
        out[name] = torch.exp((1 - t) * a.log() + t * b.log())
    return out


def _validation_loss(sim: QuantizationSimModel, batches: Sequence[torch.Tensor]) -> float:
    with fast_inference(sim.model):
        return mean_lm_loss(sim.model, batches)


def apply_quadapter(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    calibration_batches: Sequence[torch.Tensor],
    finetune_batches: Sequence[torch.Tensor] | None = None,
    params: QuadapterParameters | None = None,
    progress: bool = True,
    validation_batches: Sequence[torch.Tensor] | None = None,
    options: RunOptions | None = None,
) -> QuadapterResult:
    """Quadapter (Algorithm 1) on ``sim``, built from ``fp_model`` (untouched): phase 1, static calibration (with
    ``validation_batches``, the best alphas on the way from the start there), phase 2, alpha folded into the sim."""
    params = params or QuadapterParameters()
    result = apply_phase1(sim, fp_model, calibration_batches, params, progress, validation_batches, options)
    if params.phase2.steps > 0:
        if not finetune_batches:
            raise QuadapterError("phase 2 needs fine-tuning data (finetune_batches), or set phase2.steps = 0")
        result = apply_phase2(sim, fp_model, result, finetune_batches, params.phase2, progress, options)
    return result


def apply_phase1(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    calibration_batches: Sequence[torch.Tensor],
    params: QuadapterParameters | None = None,
    progress: bool = True,
    validation_batches: Sequence[torch.Tensor] | None = None,
    options: RunOptions | None = None,
) -> QuadapterResult:
    """Steps 1-2 alone: Quadapter BC, a PTQ method. The sim is folded and statically calibrated."""
    params = params or QuadapterParameters()
    qset = attach_quadapters(sim, params.extra_sites)
    if params.init == "cle":
        init_with_cle(qset, fp_model, calibration_batches, sim.model)
    start = kept = qset.total_alpha()
    phase1 = None
    if params.phase1.steps > 0:
        start_loss = None
        if validation_batches:
            _fold_and_calibrate(sim, fp_model, qset, start, calibration_batches)
            start_loss = _validation_loss(sim, validation_batches)
            qset.set_total({})
            qset.fold(sim.model, reference=fp_model)  # back to the FP weights: phase 1 scales them through hooks
            qset.set_total(start)
            qset.attach(sim.model)
        folder = options.checkpoint_dir if options is not None else None
        phase1 = run_phase1(
            sim.model, fp_model, qset, calibration_batches, params.phase1, progress, checkpoint_dir=folder
        )
        kept = qset.total_alpha()
        if start_loss is not None and validation_batches:
            # folded from the FP weights: the sim holds exactly what a fresh sim of the folded FP model holds
            losses = {0.0: start_loss}
            for t in sorted({*params.phase1.check_points, 1.0}):
                _fold_and_calibrate(sim, fp_model, qset, _on_the_way(start, kept, t), calibration_batches)
                losses[t] = _validation_loss(sim, validation_batches)
            best = min(losses, key=lambda t: losses[t])  # the start wins a tie: never worse than the start
            phase1.validation = {
                "start": start_loss,
                "end": losses[1.0],
                "points": {f"{t:g}": loss for t, loss in losses.items()},
                "kept": {0.0: "start", 1.0: "end"}.get(best, f"{best:g}"),
            }
            kept = _on_the_way(start, kept, best)
            if best != 1.0:
                _fold_and_calibrate(sim, fp_model, qset, kept, calibration_batches)
    if phase1 is None or phase1.validation is None:
        _fold_and_calibrate(sim, fp_model, qset, kept, calibration_batches)
    qset.detach()
    state = QuadapterState.from_sim(sim, qset.total_alpha(), method=BC_STATE)
    return QuadapterResult(qset, state, phase1, None)


def apply_phase2(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    previous: QuadapterResult,
    finetune_batches: Sequence[torch.Tensor],
    params: Phase2Parameters | None = None,
    progress: bool = True,
    options: RunOptions | None = None,
) -> QuadapterResult:
    """Steps 3-4 alone, on a sim that :func:`apply_phase1` returned."""
    qset = previous.qset.attach(sim.model)
    # trained on the FP weights, the folded alphas in the hooks: no second copy of the weights the sites touch
    qset.unfold(sim.model, fp_model)
    try:
        params = params or Phase2Parameters()
        loss_fn = phase2_loss(params, fp_model)
        phase2 = run_phase2(sim.model, qset, finetune_batches, params, loss_fn, progress, options=options)
        # one fold of the total alphas from the FP weights: the saved state rebuilds this sim exactly
        qset.fold(sim.model, reference=fp_model)
    finally:
        qset.detach()
    state = QuadapterState.from_sim(sim, qset.total_alpha(), method="quadapter")
    return QuadapterResult(qset, state, previous.phase1, phase2)
