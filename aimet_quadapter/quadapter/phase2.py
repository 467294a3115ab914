"""Phase 2 (Section 3.2): end-to-end training of alpha and ranges (weights for QAT), resumable from checkpoints."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from aimet_torch.quantization.affine import QuantizeDequantize
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from aimet_quadapter import distributed
from aimet_quadapter.atomic import write_atomic
from aimet_quadapter.errors import QuadapterError, TrainingDiverged
from aimet_quadapter.memory import trim_heap
from aimet_quadapter.models import device_of, own_storage
from aimet_quadapter.quadapter.adam import GroupedAdam
from aimet_quadapter.quadapter.adapter import QuadapterSet
from aimet_quadapter.quadapter.config import Phase2Parameters, RunOptions
from aimet_quadapter.quant.quantizers import (
    batched_range_encodings,
    elementwise_fake_quant,
    gathered_embedding_quantization,
    matching_quantizers,
    plain_tensors,
    quantizers_by_name,
    quantizers_in,
    range_parameter_widths,
    refresh_prefix,
)
from aimet_quadapter.settings import result_view

log = logging.getLogger(__name__)
LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``model`` (ids -> logits) on a (B, T) batch."""
    batch = batch.to(device_of(model))
    logits = model(batch)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def distillation_loss(teacher: nn.Module) -> LossFn:
    """KL divergence from ``teacher``'s next-token distribution to the model's, averaged over tokens."""

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(device_of(model))
        with torch.no_grad():
            target = F.log_softmax(teacher(batch).float(), dim=-1).flatten(0, -2)
        log_probs = F.log_softmax(model(batch).float(), dim=-1).flatten(0, -2)
        return _KlDivergenceSum.apply(log_probs, target) / log_probs.shape[0]

    return loss


class _KlDivergenceSum(torch.autograd.Function):
    """``F.kl_div(..., log_target=True, reduction="sum")`` a block of rows at a time: no logits-sized temporaries."""

    ROWS = 64

    @staticmethod
    def forward(ctx: Any, log_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(target)
        total = log_probs.new_zeros(())
        for lp, t in zip(log_probs.split(_KlDivergenceSum.ROWS), target.split(_KlDivergenceSum.ROWS)):
            total += (t.exp() * (t - lp)).sum()
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (target,) = ctx.saved_tensors
        out = torch.empty_like(target)
        for o, t in zip(out.split(_KlDivergenceSum.ROWS), target.split(_KlDivergenceSum.ROWS)):
            torch.mul(grad, t.exp(), out=o).neg_()
        return out, None


def phase2_loss(params: Phase2Parameters, fp_model: nn.Module) -> LossFn:
    """The loss ``params.loss`` names; ``fp_model`` is the teacher of ``kd``."""
    return distillation_loss(fp_model) if params.loss == "kd" else lm_loss


@torch.no_grad()
def mean_lm_loss(model: nn.Module, batches: Sequence[torch.Tensor]) -> float:
    """The mean of :func:`lm_loss` over ``batches``."""
    return sum(lm_loss(model, b).item() for b in batches) / max(len(batches), 1)


@dataclass
class Phase2Result:
    losses: list[float] = field(default_factory=list)
    resumed_from: int = 0


def run_phase2(
    sim_model: nn.Module,
    qset: QuadapterSet | None,
    batches: Sequence[torch.Tensor],
    params: Phase2Parameters | None = None,
    loss_fn: LossFn | None = None,
    progress: bool = True,
    desc: str = "phase 2 (end-to-end)",
    options: RunOptions | None = None,
) -> Phase2Result:
    """Train alpha (``qset``, attached to ``sim_model``), quantizer ranges and optionally the weights, step ``i`` on
    ``batches[i % len(batches)]`` (a resumed run sees an uninterrupted one's data); ``loss_fn``: by default the LM
    loss (:func:`phase2_loss` gives ``params.loss``'s)."""
    params = params or Phase2Parameters()
    options = for_device(options or RunOptions(), device_of(sim_model))
    loss_fn = _loss_or_lm(params, loss_fn)
    if not batches:
        raise QuadapterError("phase 2 needs at least one fine-tuning batch")
    sim_model.eval()  # dropout off: the model is frozen, only its quantization is being trained
    groups = _trained_groups(sim_model, qset, params)
    optimizer, schedule = _optimizer(groups, params)
    result = Phase2Result()
    ckpt = Path(options.checkpoint_dir) / "phase2.pt" if options.checkpoint_dir else None
    key = _checkpoint_key(params, sim_model, qset, batches) if ckpt is not None else ""
    start = _resume(ckpt, key, sim_model, qset, optimizer, schedule, result)
    trainable = [p for group in groups for p in group["params"]]
    # named before gathered_embedding_quantization takes the embedding's quantizer out of the module tree
    named = list(sim_model.named_parameters())
    fake_quantized = quantizers_in([sim_model])
    # where each small op is a kernel launch, the ranges' encodings are made once per pass for all quantizers
    batched = fake_quantized if options.fused_fake_quant else []
    shown = progress and distributed.is_main()
    bar = tqdm(range(start, params.steps), desc=desc, initial=start, total=params.steps, disable=not shown)
    with (
        _frozen_on_exit(sim_model),
        gathered_embedding_quantization(sim_model),
        elementwise_fake_quant(fake_quantized, fused=bool(options.fused_fake_quant)),
        plain_tensors(),
        _recomputed_blocks(sim_model, bool(options.recompute_blocks)),
    ):
        for step in bar:
            optimizer.zero_grad(set_to_none=True)
            part = distributed.local_part(batches[step % len(batches)])
            held = qset if qset is not None and options.fused_fake_quant else None
            loss = _accumulate(sim_model, part, loss_fn, options.micro_batch_size, batched, held)
            value = _finite_mean(loss, step, params, desc, ckpt)
            distributed.average_gradients(trainable)
            optimizer.step()
            schedule.step()
            # the prefix's cache follows the weights and alphas (no gradient reaches it through the prefix)
            refresh_prefix(sim_model)
            result.losses.append(value)
            bar.set_postfix(loss=f"{value:.4f}")
            due = (step + 1) % options.checkpoint_every == 0 or step + 1 == params.steps
            if ckpt is not None and due and distributed.is_main():
                saved = {"key": key, "step": step + 1, "losses": result.losses}
                _write_checkpoint(ckpt, saved, optimizer, schedule, _trainable_state(named, qset))
    return result


@contextmanager
def _frozen_on_exit(model: nn.Module) -> Iterator[None]:
    """Every parameter of ``model`` frozen again when training ends, by an error too."""
    try:
        yield
    finally:
        for p in model.parameters():
            p.requires_grad_(False)


def _optimizer(groups: list[dict[str, Any]], params: Phase2Parameters) -> tuple[GroupedAdam, Any]:
    """Adam over ``groups``, its rates decaying linearly to 0 over ``params.steps``."""
    optimizer = GroupedAdam(groups)
    total = max(params.steps, 1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1.0 - step / total))


def _finite_mean(loss: float, step: int, params: Phase2Parameters, desc: str, ckpt: Path | None) -> float:
    """The loss's mean over the processes; where not finite, :class:`TrainingDiverged` on every one of them, before
    the step (parameters and checkpoint stay the last good), not the others left waiting in the all-reduce."""
    value = distributed.mean_over_ranks(loss)
    if not math.isfinite(value):
        where = f"; the last checkpoint ({ckpt}) holds step {_saved_step(ckpt)}" if ckpt else ""
        raise TrainingDiverged(f"{desc}: the loss is {value} at step {step + 1} of {params.steps}{where}")
    return value


def _loss_or_lm(params: Phase2Parameters, loss_fn: LossFn | None) -> LossFn:
    """``loss_fn``, or the LM loss where none is given and ``params.loss`` asks for it."""
    if loss_fn is None and params.loss != "lm":  # not silently the LM loss: the teacher is the caller's to give
        raise QuadapterError(
            f"phase2.loss = {params.loss!r} needs its teacher: pass loss_fn=phase2_loss(params, fp_model)"
        )
    return lm_loss if loss_fn is None else loss_fn


def _resume(
    ckpt: Path | None,
    key: str,
    sim_model: nn.Module,
    qset: QuadapterSet | None,
    optimizer: GroupedAdam,
    schedule: torch.optim.lr_scheduler.LambdaLR,
    result: Phase2Result,
) -> int:
    """The step to start from: where this run's own checkpoint stopped (its state loaded), else 0."""
    state = _read_checkpoint(ckpt, key, device_of(sim_model)) if ckpt is not None else None
    if state is None:
        return 0
    _load_trainable(sim_model, qset, state)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    result.resumed_from = state["step"]
    result.losses = list(state["losses"])
    refresh_prefix(sim_model)
    return result.resumed_from


def _trained_groups(sim_model: nn.Module, qset: QuadapterSet | None, params: Phase2Parameters) -> list[dict[str, Any]]:
    """The optimizer's groups (alphas, ranges, weights); what is not trained is frozen."""
    widths = range_parameter_widths(sim_model)
    ranges = [p for p, _ in widths]
    range_ids = {id(p) for p in ranges}
    weights = [p for p in sim_model.parameters() if id(p) not in range_ids]
    if params.lr_weights > 0:
        own_storage(weights)  # the optimizer writes in place; the FP model's weights must stay
    for p in weights:
        p.requires_grad_(params.lr_weights > 0)
    for p in ranges:
        p.requires_grad_(params.learn_ranges)
    groups: list[dict[str, Any]] = []
    if qset is not None and len(qset):
        groups.append({"params": [q.theta for q in qset], "lr": params.lr_alpha})
    factors = _factor_of_each_range(sim_model, params) if params.learn_ranges else {}
    if params.learn_ranges and params.lr_ranges_relative:
        groups += [{"params": [p], "lr": params.lr_ranges * width * factors.get(id(p), 1.0)} for p, width in widths]
    elif params.learn_ranges:
        by_factor: dict[float, list[nn.Parameter]] = {}
        for p in ranges:
            by_factor.setdefault(factors.get(id(p), 1.0), []).append(p)
        groups += [{"params": ps, "lr": params.lr_ranges * factor} for factor, ps in by_factor.items()]
    if params.lr_weights > 0:
        groups.append({"params": weights, "lr": params.lr_weights})
    if not groups:
        raise QuadapterError("phase 2 has nothing to train: no Quadapter sites, ranges fixed and weights frozen")
    return groups


def _factor_of_each_range(sim_model: nn.Module, params: Phase2Parameters) -> dict[int, float]:
    """The factor ``lr_ranges_overrides`` gives each range parameter it reaches, by the parameter's id."""
    pairs = params.range_rate_factors()
    if not pairs:
        return {}
    return {
        id(p): factor
        for factor, hits in matching_quantizers(quantizers_by_name(sim_model), pairs, "phase2.lr_ranges_overrides")
        for q in hits.values()
        for name, p in q.named_parameters()
        if name in ("min", "max")
    }


def _write_checkpoint(ckpt: Path, state: dict, optimizer: GroupedAdam, schedule: Any, trained: dict) -> None:
    state = state | {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()} | trained
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(ckpt, lambda tmp: torch.save(state, tmp))


def for_device(options: RunOptions, device: torch.device) -> RunOptions:
    """``options`` with the settings left at None decided for ``device``: a GPU spends memory, a CPU saves it."""
    gpu = device.type == "cuda"
    return options.replace(
        micro_batch_size=options.micro_batch_size if options.micro_batch_size is not None else (None if gpu else 1),
        recompute_blocks=options.recompute_blocks if options.recompute_blocks is not None else not gpu,
        fused_fake_quant=options.fused_fake_quant if options.fused_fake_quant is not None else gpu,
    )


@contextmanager
def _recomputed_blocks(model: nn.Module, recompute: bool) -> Iterator[None]:
    """With ``recompute``, each decoder block of ``model`` under activation checkpointing (the same values)."""
    block_paths = getattr(model, "block_paths", None) if recompute else None
    paths: list[str] = block_paths() if callable(block_paths) else []
    blocks = [model.get_submodule(path) for path in paths]
    own = ["forward" in block.__dict__ for block in blocks]  # a forward set on the instance is put back as is
    saved = [block.forward for block in blocks]
    for block, forward in zip(blocks, saved):
        block.forward = partial(checkpoint, forward, use_reentrant=False)
    try:
        yield
    finally:
        for block, forward, kept in zip(blocks, saved, own):
            if kept:
                block.forward = forward
            else:
                del block.forward


def _saved_step(ckpt: Path) -> int:
    return int(torch.load(ckpt, weights_only=True, map_location="cpu")["step"]) if ckpt.is_file() else 0


def _checkpoint_key(
    params: Phase2Parameters, model: nn.Module, qset: QuadapterSet | None, batches: Sequence[torch.Tensor]
) -> str:
    """What a phase-2 run computes from: the settings that change a result, the start of all it trains, its data."""
    settings = result_view(Phase2Parameters, params.model_dump())
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    start = [(f"qset.{k}", v) for k, v in (qset.state_dict() if qset is not None else {}).items()]
    start += [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    for name, tensor in start:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().double().contiguous().numpy().tobytes())
    for batch in batches:
        digest.update(batch.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _read_checkpoint(ckpt: Path, key: str, device: torch.device) -> dict | None:
    """The checkpoint to resume from; None where there is none, or (warned) it is unreadable or another run's."""
    if not ckpt.is_file():
        return None
    try:  # tensors and plain data only: a checkpoint is data, not code
        state = torch.load(ckpt, weights_only=True, map_location=device)
    except Exception as error:
        log.warning("phase 2: the checkpoint %s cannot be read (%s); starting from step 0", ckpt, error)
        return None
    if state.get("key") != key:
        log.warning("phase 2: the checkpoint %s is of other settings, start or data; starting from step 0", ckpt)
        return None
    return state


def _accumulate(
    model: nn.Module,
    batch: torch.Tensor,
    loss_fn: LossFn,
    micro_batch_size: int | None,
    batched: Sequence[QuantizeDequantize] = (),
    held: QuadapterSet | None = None,
) -> float:
    """Backward of ``loss_fn`` on ``batch`` in slices of ``micro_batch_size`` sequences, each weighted by its share:
    with sequences of one length, the slices' gradients sum to that of the whole batch's mean loss."""
    size = micro_batch_size or len(batch)
    on_cpu = device_of(model).type == "cpu"
    total = 0.0
    for part in batch.split(size):
        with batched_range_encodings(batched), held.fused() if held is not None else nullcontext():
            loss = loss_fn(model, part) * (len(part) / len(batch))
            loss.backward()
        total += loss.item()
        if on_cpu:
            trim_heap()
    return total


def _trainable_state(named: list[tuple[str, nn.Parameter]], qset: QuadapterSet | None) -> dict:
    trained = {name: p.detach().clone() for name, p in named if p.requires_grad}
    return {"qset": qset.state_dict() if qset is not None else None, "params": trained}


def _load_trainable(sim_model: nn.Module, qset: QuadapterSet | None, state: dict) -> None:
    if qset is not None and state.get("qset") is not None:
        qset.load_state_dict(state["qset"])
    named = dict(sim_model.named_parameters())
    with torch.no_grad():
        for name, value in state["params"].items():
            if name not in named:
                raise QuadapterError(f"checkpoint parameter {name!r} is not in this model: wrong checkpoint_dir?")
            named[name].copy_(value)
