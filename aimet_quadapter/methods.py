"""Quantization methods by name, each turning the FP model into something to evaluate.

Every method gets the same calibration data (the paper: 10 x 512 tokens). ``quadapter`` continues
from ``quadapter_bc`` when that ran first in the same context, as the paper's two phases do.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aimet_torch.quantsim import QuantizationSimModel

from .api import QuadapterParameters, QuadapterResult, apply_blockwise_phase, apply_cle, apply_finetune_phase
from .cle import channel_min_max
from .errors import QuadapterError
from .models import PreparedLM
from .plots import plot_channel_ranges, plot_phase1_curves
from .policy import QuantPolicy, build_sim, calibrate
from .state import QuadapterState


@dataclass
class MethodContext:
    model: PreparedLM
    policy: QuantPolicy
    calibration: list[torch.Tensor]
    finetune: list[torch.Tensor] | None = None
    params: QuadapterParameters = field(default_factory=QuadapterParameters)
    out_dir: Path | None = None
    progress: bool = True
    timings: dict[str, float] = field(default_factory=dict)
    _bc: tuple[QuantizationSimModel, QuadapterResult] | None = None


Method = Callable[[MethodContext], "PreparedLM | QuantizationSimModel"]


def _fp(ctx: MethodContext) -> PreparedLM:
    return ctx.model


def _ptq(ctx: MethodContext) -> QuantizationSimModel:
    sim = build_sim(ctx.model, ctx.policy)
    calibrate(sim, ctx.calibration)
    return sim


def _cle(ctx: MethodContext) -> QuantizationSimModel:
    sim = build_sim(ctx.model, ctx.policy)
    qset = apply_cle(sim, ctx.model, ctx.calibration, ctx.params.extra_sites)
    _save(ctx, "cle", QuadapterState.from_sim(sim, qset.total_alpha(), method="cle"))
    return sim


def _quadapter_bc(ctx: MethodContext) -> QuantizationSimModel:
    sim = build_sim(ctx.model, ctx.policy)
    result = apply_blockwise_phase(sim, ctx.model, ctx.calibration, ctx.params, ctx.progress)
    ctx._bc = (sim, result)
    _save(ctx, "quadapter_bc", result.state)
    if ctx.out_dir is not None and result.phase1 is not None:
        (ctx.out_dir / "phase1_losses.json").write_text(
            json.dumps(
                {
                    "losses": result.phase1.losses,
                    "error_before": result.phase1.error_before,
                    "error_after": result.phase1.error_after,
                }
            )
        )
        plot_phase1_curves(result.phase1.losses, ctx.out_dir / "phase1_curves.png")
        _plot_head_site(ctx, result.state)
    return sim


def _quadapter(ctx: MethodContext) -> QuantizationSimModel:
    if ctx._bc is None:
        _quadapter_bc(ctx)
    sim, bc = ctx._bc
    ctx._bc = None  # phase 2 changes this sim: quadapter_bc's result is gone from here on
    if not ctx.finetune:
        raise QuadapterError("method 'quadapter' needs fine-tuning data (finetune dataset)")
    params = ctx.params.phase2
    if ctx.out_dir is not None and params.checkpoint_dir is None:
        params = type(params)(**{**params.__dict__, "checkpoint_dir": str(ctx.out_dir / "checkpoints")})
    result = apply_finetune_phase(sim, ctx.model, bc, ctx.finetune, params, ctx.progress)
    _save(ctx, "quadapter", result.state)
    if ctx.out_dir is not None:
        (ctx.out_dir / "phase2_losses.json").write_text(json.dumps(result.phase2.losses))
    return sim


METHODS: dict[str, Method] = {
    "fp": _fp,
    "ptq": _ptq,
    "cle": _cle,
    "quadapter_bc": _quadapter_bc,
    "quadapter": _quadapter,
}
LABELS = {"fp": "FP32", "ptq": "PTQ", "cle": "CLE", "quadapter_bc": "Quadapter BC", "quadapter": "Quadapter"}


def run_method(name: str, ctx: MethodContext):
    if name not in METHODS:
        raise QuadapterError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    start = time.time()
    out = METHODS[name](ctx)
    ctx.timings[name] = time.time() - start
    return out


def _save(ctx: MethodContext, name: str, state: QuadapterState) -> None:
    if ctx.out_dir is not None:
        state.save(ctx.out_dir / f"{name}.safetensors")


def _plot_head_site(ctx: MethodContext, state: QuadapterState) -> None:
    """Fig. 4: the last site's activation per channel, FP model before and after folding the alphas."""
    site = ctx.model.sites(extra=ctx.params.extra_sites)[-1]
    batches = ctx.calibration[:2]
    before = channel_min_max(ctx.model, site, batches)
    after = channel_min_max(state.folded_model(ctx.model), site, batches)
    plot_channel_ranges(before, after, ctx.out_dir / "channel_ranges.png", site.name)
