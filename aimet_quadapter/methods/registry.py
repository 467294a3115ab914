"""Quantization methods by name, each turning the FP model into something to evaluate: the paper's rows. Every sim
starts on the FP model's storage (``share_weights``): a method gives a sim's weights new data, never in place."""

from __future__ import annotations

import copy
import dataclasses
import functools
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from aimet_torch.quantsim import QuantizationSimModel

from aimet_quadapter import distributed
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.methods.catalog import BC, CATALOG, MethodInfo
from aimet_quadapter.methods.records import PARKED_FP, Records
from aimet_quadapter.models import PreparedLM
from aimet_quadapter.models.storage import weights_parked
from aimet_quadapter.quadapter.adapter import QuadapterSet
from aimet_quadapter.quadapter.api import QuadapterResult, apply_cle, apply_phase1, apply_phase2
from aimet_quadapter.quadapter.config import Phase2Parameters, QuadapterParameters, RunOptions
from aimet_quadapter.quadapter.phase2 import phase2_loss, run_phase2
from aimet_quadapter.quadapter.state import QuadapterState
from aimet_quadapter.quant.baselines import apply_adaround, apply_seq_mse
from aimet_quadapter.quant.config import BaselineParameters, QuantPolicy
from aimet_quadapter.quant.llm_techniques import apply_adascale, apply_omniquant, fptquant_model, spinquant_model
from aimet_quadapter.quant.policy import build_sim, calibrate


@dataclass
class MethodContext:
    model: PreparedLM
    policy: QuantPolicy
    calibration: list[torch.Tensor]
    finetune: list[torch.Tensor] | None = None
    params: QuadapterParameters = field(default_factory=QuadapterParameters)
    options: RunOptions = field(default_factory=RunOptions)  # how the phases run; checkpoints under out_dir if set
    out_dir: Path | None = None
    progress: bool = True
    timings: dict[str, float] = field(default_factory=dict)
    baselines: BaselineParameters = field(default_factory=BaselineParameters)
    bc_state: QuadapterState | None = None  # Quadapter BC's result on this calibration data, once computed
    checkpoints: bool = True  # phase-2 checkpoints under out_dir
    info: dict[str, dict] = field(default_factory=dict)  # what each method measured about itself, by name
    validation: list[torch.Tensor] | None = None  # held-out text: phase 1's result is kept only if no worse there
    start: QuadapterState | None = None  # the saved state of the method this one continues from (``continues``)
    save_bc: bool = True  # False where phase 1 is a step of another method, whose own state is the cell's
    records: Records = field(default_factory=Records)  # what the methods hand over
    _bc: tuple[QuantizationSimModel, QuadapterResult] | None = None


Method = Callable[[MethodContext], "PreparedLM | QuantizationSimModel"]
# name -> the function that runs it; filled by @method below, one entry per CATALOG entry
REGISTRY: dict[str, Method] = {}


def method(name: str, info: MethodInfo | None = None) -> Callable[[Method], Method]:
    """Register the decorated function as method ``name``: its catalog entry, or ``info`` to add one."""

    def register(fn: Method) -> Method:
        if info is not None:
            CATALOG[name] = info
        if name not in CATALOG:
            raise QuadapterError(f"method {name!r} has no entry in methods/catalog.py (or pass its MethodInfo)")
        REGISTRY[name] = fn
        return fn

    return register


@method("fp")
def _fp(ctx: MethodContext) -> PreparedLM:
    return ctx.model


@method("ptq")
def _ptq(ctx: MethodContext) -> QuantizationSimModel:
    sim = build_sim(ctx.model, ctx.policy, share_weights=True)
    calibrate(sim, ctx.calibration)
    return sim


@method("adaround")
def _adaround(ctx: MethodContext) -> QuantizationSimModel:
    sim = build_sim(ctx.model, ctx.policy, share_weights=True)
    ctx.info["adaround"] = apply_adaround(sim, ctx.model, ctx.calibration, ctx.baselines, ctx.out_dir)
    return sim


@method("seq_mse")
def _seq_mse(ctx: MethodContext) -> QuantizationSimModel:
    sim = build_sim(ctx.model, ctx.policy, share_weights=True)
    ctx.info["seq_mse"] = apply_seq_mse(sim, ctx.model, ctx.calibration, ctx.baselines)
    return sim


def _transformed_ptq(ctx: MethodContext, name: str, transform) -> QuantizationSimModel:
    """PTQ of ``transform``'s FP-equivalent model; its state carries the transformed weights."""
    sim = build_sim(transform(ctx.model, ctx.baselines), ctx.policy, in_place=True)  # the copy is this sim's alone
    calibrate(sim, ctx.calibration)
    ctx.records.state(name, QuadapterState.from_sim(sim, {}).with_weights(sim.model, ctx.model))
    return sim


for _name, _transform in (("spinquant", spinquant_model), ("fptquant", fptquant_model)):
    method(_name)(functools.partial(_transformed_ptq, name=_name, transform=_transform))


def _reconstructed(ctx: MethodContext, name: str, technique) -> QuantizationSimModel:
    sim = build_sim(ctx.model, ctx.policy)  # weights of its own: AIMET writes the learned ones in place
    ctx.info[name] = technique(sim, ctx.model, ctx.calibration, ctx.baselines)
    ctx.records.state(name, QuadapterState.from_sim(sim, {}).with_weights(sim.model, ctx.model))
    return sim


for _name, _apply in (("adascale", apply_adascale), ("omniquant", apply_omniquant)):
    method(_name)(functools.partial(_reconstructed, name=_name, technique=_apply))


@method("cle")
def _cle(ctx: MethodContext) -> QuantizationSimModel:
    sim = build_sim(ctx.model, ctx.policy, share_weights=True)
    qset = apply_cle(sim, ctx.model, ctx.calibration, ctx.params.extra_sites)
    ctx.records.state("cle", QuadapterState.from_sim(sim, qset.total_alpha()))
    return sim


@method("quadapter_bc")
def _quadapter_bc(ctx: MethodContext) -> QuantizationSimModel:
    sim = build_sim(ctx.model, ctx.policy, share_weights=True)
    options = ctx.options
    checkpoints = ctx.out_dir / "checkpoints" / "phase1" if ctx.out_dir is not None else None
    if checkpoints is not None and options.checkpoint_dir is None:  # a killed phase 1 resumes by site
        options = options.replace(checkpoint_dir=str(checkpoints))
    result = apply_phase1(sim, ctx.model, ctx.calibration, ctx.params, ctx.progress, ctx.validation, options)
    ctx._bc = (sim, result)
    ctx.bc_state = result.state
    if ctx.save_bc:
        ctx.records.state(BC, result.state)
    if checkpoints is not None and distributed.is_main():  # the state handed over is what a rerun starts from now
        shutil.rmtree(checkpoints, ignore_errors=True)
    if result.phase1 is not None:
        if result.phase1.validation is not None:
            ctx.info[BC] = {f"validation_{k}": v for k, v in result.phase1.validation.items()}
        ctx.records.phase1(result.phase1)
        ctx.records.channel_ranges(BC, ctx.model, result.state)
    return sim


def quadapter_bc_start(ctx: MethodContext) -> tuple[QuantizationSimModel, QuadapterResult]:
    """A sim holding Quadapter BC's result, and its Quadapters (alpha folded), to continue from."""
    if ctx.bc_state is None:
        _quadapter_bc(ctx)
    if ctx._bc is not None:  # the live sim of a BC that ran in this context: continue on it
        bc, ctx._bc = ctx._bc, None  # the next method changes this sim: later ones rebuild from bc_state
        return bc
    state = ctx.bc_state
    assert state is not None  # set by _quadapter_bc above, or by the runner from a saved run
    sim = state.build_sim(ctx.model, share_weights=True)
    qset = QuadapterSet(sim.model, [s for s in ctx.model.sites(extra=True) if s.name in state.alphas])
    with torch.no_grad():
        for q in qset:
            q.folded.copy_(state.alphas[q.site.name])  # the sim's weights already carry these
    return sim, QuadapterResult(qset, state, None, None)


def _finetune_data(ctx: MethodContext, name: str) -> list[torch.Tensor]:
    if not ctx.finetune:
        raise QuadapterError(f"method {name!r} needs fine-tuning data (an F-ID / finetune dataset)")
    return ctx.finetune


def _phase2(ctx: MethodContext, name: str) -> Phase2Parameters:
    """The recipe's phase 2 with what method ``name`` sets of it itself (its catalog entry's ``phase2``)."""
    _finetune_data(ctx, name)
    return ctx.params.phase2.replace(**CATALOG[name].phase2_changes(ctx.baselines))


def _phase2_options(ctx: MethodContext, checkpoint_sub: str | None) -> RunOptions:
    """The context's options, phase 2's checkpoints in the run folder's ``checkpoints/<checkpoint_sub>``."""
    if ctx.out_dir is None or not ctx.checkpoints or ctx.options.checkpoint_dir is not None:
        return ctx.options
    folder = ctx.out_dir / "checkpoints"
    return ctx.options.replace(checkpoint_dir=str(folder / checkpoint_sub if checkpoint_sub else folder))


def _run_quadapter(ctx: MethodContext, name: str) -> tuple[QuantizationSimModel, QuadapterResult]:
    params = _phase2(ctx, name)
    # "quadapter" keeps the checkpoint folder the eval command has always used
    options = _phase2_options(ctx, None if name == "quadapter" else name)
    sim, bc = quadapter_bc_start(ctx)
    result = apply_phase2(sim, ctx.model, bc, _finetune_data(ctx, name), params, ctx.progress, options)
    ctx.records.state(name, result.state)
    if result.phase2 is not None:
        ctx.records.curve(name, result.phase2.losses)
        ctx.records.channel_ranges(name, ctx.model, result.state)
    return sim, result


def _quadapter(ctx: MethodContext, name: str) -> QuantizationSimModel:
    return _run_quadapter(ctx, name)[0]


for _name in ("quadapter", "quadapter_fixed_ranges"):
    method(_name)(functools.partial(_quadapter, name=_name))


def _train_sim(ctx: MethodContext, sim: QuantizationSimModel, name: str) -> QuantizationSimModel:
    """Phase 2's loop on ``sim`` with no Quadapter: what the method's phase 2 leaves trainable (the paper's QAT)."""
    params = _phase2(ctx, name)
    loss_fn, data, options = phase2_loss(params, ctx.model), _finetune_data(ctx, name), _phase2_options(ctx, name)
    result = run_phase2(sim.model, None, data, params, loss_fn, ctx.progress, name, options)
    ctx.records.curve(name, result.losses)
    return sim


def _cle_then_phase2(ctx: MethodContext, name: str) -> tuple[QuantizationSimModel, QuadapterSet]:
    _phase2(ctx, name)  # fail before calibrating when there is no fine-tuning data
    sim = build_sim(ctx.model, ctx.policy, share_weights=True)
    qset = apply_cle(sim, ctx.model, ctx.calibration, ctx.params.extra_sites)
    _train_sim(ctx, sim, name)
    return sim, qset


@method("cle_phase2")
def _cle_phase2(ctx: MethodContext) -> QuantizationSimModel:
    """Quadapter's matched baseline: CLE's sim, then the recipe's phase 2 with the ranges trained, alphas fixed."""
    sim, qset = _cle_then_phase2(ctx, "cle_phase2")
    ctx.records.state("cle_phase2", QuadapterState.from_sim(sim, qset.total_alpha()))
    return sim


def _qat(ctx: MethodContext, name: str, from_bc: bool) -> QuantizationSimModel:
    """QAT from PTQ's sim, or from Quadapter BC's (the paper's BC+QAT)."""
    _phase2(ctx, name)  # fail before calibrating when there is no fine-tuning data
    return _train_sim(ctx, quadapter_bc_start(ctx)[0] if from_bc else cast(QuantizationSimModel, _ptq(ctx)), name)


for _name, _from_bc in (
    ("qat", False),
    ("qat_fixed_ranges", False),
    ("quadapter_bc_qat", True),
    ("quadapter_bc_qat_fixed_ranges", True),
):
    method(_name)(functools.partial(_qat, name=_name, from_bc=_from_bc))


def _on_transformed(ctx: MethodContext, name: str, transform) -> tuple[PreparedLM, MethodContext]:
    """AIMET's FP-equivalent ``transform`` of the FP model, and a context whose FP model it is."""
    _phase2(ctx, name)  # fail before transforming when there is no fine-tuning data
    transformed = transform(ctx.model, ctx.baselines)
    # phase 1's alphas alone would fold into the untransformed weights on export: only the cell's state is saved
    inner = dataclasses.replace(ctx, model=transformed, bc_state=None, _bc=None, info={}, save_bc=False)
    return transformed, inner


@contextmanager
def _fp_model_parked(ctx: MethodContext, transformed: PreparedLM) -> Iterator[None]:
    """The FP model's weights wait on disk while a cell works on its transformed copy (what the copy shares stays)."""
    folder = ctx.out_dir if distributed.is_main() else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    # a folder of its own (processes under torchrun park side by side); weights_parked removes it
    with weights_parked(ctx.model, Path(tempfile.mkdtemp(prefix=PARKED_FP, dir=folder)), besides=[transformed]):
        yield


def _quadapter_on(ctx: MethodContext, name: str, transform) -> QuantizationSimModel:
    """Quadapter, both phases, on ``transform``'s model: its FP reference and the weights the alphas fold into."""
    transformed, inner = _on_transformed(ctx, name, transform)
    with _fp_model_parked(ctx, transformed):
        sim, result = _run_quadapter(inner, name)
    ctx.info[name] = inner.info.get(BC, {})
    ctx.records.state(name, result.state.with_weights(transformed, ctx.model))
    return sim


def _cle_phase2_on(ctx: MethodContext, name: str, transform) -> QuantizationSimModel:
    """The matched baseline of Quadapter on ``transform``'s model: ``cle_phase2`` on the same transformed model."""
    transformed, inner = _on_transformed(ctx, name, transform)
    with _fp_model_parked(ctx, transformed):
        sim, qset = _cle_then_phase2(inner, name)
    # the transformed weights, unfolded: the state folds its alphas into them as into any FP weights
    ctx.records.state(name, QuadapterState.from_sim(sim, qset.total_alpha()).with_weights(transformed, ctx.model))
    return sim


def _qat_on_transform(ctx: MethodContext, name: str, transform, from_bc: bool) -> QuantizationSimModel:
    """QAT on ``transform``'s model from Quadapter BC's sim of it (alphas folded into the weights) or from PTQ's."""
    _, inner = _on_transformed(ctx, name, transform)
    sim = quadapter_bc_start(inner)[0] if from_bc else cast(QuantizationSimModel, _ptq(inner))
    if from_bc:
        ctx.info[name] = inner.info.get(BC, {})
    return _train_sim(inner, sim, name)


# each AIMET transform's compositions with Quadapter and their matched baselines (catalog ``_on_transform``)
for _technique, _transform in (("spinquant", spinquant_model), ("fptquant", fptquant_model)):
    for _name, _fn in (
        ("quadapter", functools.partial(_quadapter_on, transform=_transform)),
        ("cle_phase2", functools.partial(_cle_phase2_on, transform=_transform)),
        ("quadapter_bc_qat", functools.partial(_qat_on_transform, transform=_transform, from_bc=True)),
        ("qat", functools.partial(_qat_on_transform, transform=_transform, from_bc=False)),
    ):
        method(f"{_technique}_{_name}")(functools.partial(_fn, name=f"{_technique}_{_name}"))


def _after_quadapter(ctx: MethodContext, name: str, technique) -> QuantizationSimModel:
    """Quadapter (or ``ctx.start``), then AIMET's ``technique(ctx, sim, folded_fp_model)``, activation ranges kept."""
    if ctx.start is not None:  # the state rebuilds phase 2's sim exactly (apply_phase2)
        state = ctx.start
        sim = state.build_sim(ctx.model, share_weights=True)
    else:
        sim, result = _run_quadapter(ctx, name)
        state = result.state
    ctx.info[name] = technique(ctx, sim, state.folded_model(ctx.model, share_weights=True))
    ctx.records.state(name, QuadapterState.from_sim(sim, {}).with_weights(sim.model, ctx.model))
    return sim


def _seq_mse_after(ctx: MethodContext, sim: QuantizationSimModel, folded: PreparedLM, within: bool) -> dict:
    return apply_seq_mse(sim, folded, ctx.calibration, ctx.baselines, calibrate_after=False, within_ranges=within)


def _adaround_after(ctx: MethodContext, sim: QuantizationSimModel, folded: PreparedLM) -> dict:
    return apply_adaround(sim, folded, ctx.calibration, ctx.baselines, ctx.out_dir, calibrate_after=False)


# SeqMSE's candidates as fractions of the folded weights' min-max, or of the weight ranges phase 2 learned
for _name, _then in (
    ("quadapter_seq_mse", functools.partial(_seq_mse_after, within=False)),
    ("quadapter_seq_mse_learned", functools.partial(_seq_mse_after, within=True)),
    ("quadapter_adaround", _adaround_after),
):
    method(_name)(functools.partial(_after_quadapter, name=_name, technique=_then))


@method("fp_finetuned")
def _fp_finetuned(ctx: MethodContext) -> PreparedLM:
    """The FP upper bound (the paper's Fig. 6): the FP weights fine-tuned on the same loop, no quantizer."""
    name = "fp_finetuned"
    params = _phase2(ctx, name)
    model = copy.deepcopy(ctx.model)
    data, options = _finetune_data(ctx, name), _phase2_options(ctx, name)
    result = run_phase2(model, None, data, params, progress=ctx.progress, desc="FP fine-tuning", options=options)
    ctx.records.curve(name, result.losses)
    return model


_missing = CATALOG.keys() - REGISTRY.keys()
if _missing:  # a catalog entry without its function
    raise ImportError(f"methods without a function under @method: {sorted(_missing)}")


def run_method(name: str, ctx: MethodContext):
    if name not in REGISTRY:
        raise QuadapterError(f"unknown method {name!r}; known: {', '.join(REGISTRY)}")
    start = time.time()
    out = REGISTRY[name](ctx)
    ctx.timings[name] = time.time() - start
    if isinstance(out, QuantizationSimModel) and name not in ctx.records.states:
        # every quantized row can be exported: its ranges, and the weights it changed (AdaRound's, QAT's)
        ctx.records.state(name, QuadapterState.from_sim(out, {}).with_weights(out.model, ctx.model))
    return out
