"""Phase 2: end-to-end fine-tuning on the language-modelling loss (Section 3.2 and Appendix of the paper).

Trains the Quadapters' alpha (lr 1e-3) and the quantizers' min/max (LSQ+-style range learning, lr 1e-3)
with the model weights frozen; batch 4 x 512, learning rate decaying linearly to 0. The same loop with
the weights trainable (lr 1e-5) is the paper's QAT baseline. A checkpoint is written every
``checkpoint_every`` steps, atomically; a run given the same checkpoint directory resumes from it and
loses at most one interval.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from . import distributed
from .errors import QuadapterError
from .quadapter import QuadapterSet
from .quantizers import gathered_embedding_quantization, plain_tensors, range_parameters

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``model`` (ids -> logits) on a (B, T) batch."""
    batch = batch.to(next(model.parameters()).device)
    logits = model(batch)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


@torch.no_grad()
def mean_lm_loss(model: nn.Module, batches: Sequence[torch.Tensor]) -> float:
    """The mean of :func:`lm_loss` over ``batches``."""
    return sum(lm_loss(model, b).item() for b in batches) / max(len(batches), 1)


@dataclass
class FinetuneParameters:
    """Phase-2 settings; defaults are the paper's (Appendix, "End-to-end Fine-tuning")."""

    steps: int = 10_000
    batch_size: int = 4
    seq_len: int = 512
    lr_alpha: float = 1e-3
    lr_ranges: float = 1e-3
    learn_ranges: bool = True  # False: the paper's "without LSQ+" ablation
    lr_weights: float = 0.0  # > 0 trains the model weights too (QAT)
    checkpoint_every: int = 200
    checkpoint_dir: str | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every"):
            if getattr(self, name) < (0 if name == "steps" else 1):
                raise QuadapterError(f"phase2.{name} must be positive, got {getattr(self, name)}")


@dataclass
class FinetuneResult:
    losses: list[float] = field(default_factory=list)
    resumed_from: int = 0


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def apply_finetuning(
    sim_model: nn.Module,
    qset: QuadapterSet | None,
    batches: Sequence[torch.Tensor],
    params: FinetuneParameters | None = None,
    loss_fn: LossFn = lm_loss,
    progress: bool = True,
    desc: str = "phase 2 (end-to-end)",
) -> FinetuneResult:
    """Train alpha (``qset``, attached to ``sim_model``), quantizer ranges and optionally the weights.

    ``batches`` is indexed by step (``batches[step % len(batches)]``), so a resumed run sees the same
    data as an uninterrupted one.
    """
    params = params or FinetuneParameters()
    if not batches:
        raise QuadapterError("phase 2 needs at least one fine-tuning batch")
    sim_model.eval()  # dropout off: the model is frozen, only its quantization is being trained
    ranges = range_parameters(sim_model)
    range_ids = {id(p) for p in ranges}
    weights = [p for p in sim_model.parameters() if id(p) not in range_ids]
    for p in weights:
        p.requires_grad_(params.lr_weights > 0)
    for p in ranges:
        p.requires_grad_(params.learn_ranges)
    groups = []
    if qset is not None and len(qset):
        groups.append({"params": [q.theta for q in qset], "lr": params.lr_alpha})
    if params.learn_ranges:
        groups.append({"params": ranges, "lr": params.lr_ranges})
    if params.lr_weights > 0:
        groups.append({"params": weights, "lr": params.lr_weights})
    if not groups:
        raise QuadapterError("phase 2 has nothing to train: no Quadapter sites, ranges fixed and weights frozen")
    optimizer = torch.optim.Adam(groups)
    total = max(params.steps, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1.0 - step / total))

    result = FinetuneResult()
    start = 0
    ckpt = Path(params.checkpoint_dir) / "phase2.pt" if params.checkpoint_dir else None
    if ckpt is not None and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        _load_trainable(sim_model, qset, state)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start = result.resumed_from = state["step"]
        result.losses = list(state["losses"])

    trainable = [p for group in groups for p in group["params"]]
    # named before gathered_embedding_quantization takes the embedding's quantizer out of the module tree
    named = list(sim_model.named_parameters())
    progress = progress and distributed.is_main()
    bar = tqdm(range(start, params.steps), desc=desc, initial=start, total=params.steps, disable=not progress)
    try:
        with gathered_embedding_quantization(sim_model), plain_tensors():
            for step in bar:
                optimizer.zero_grad(set_to_none=True)
                # under torchrun each process takes its share of the global batch; gradients are averaged
                loss = loss_fn(sim_model, distributed.local_part(batches[step % len(batches)]))
                loss.backward()
                distributed.average_gradients(trainable)
                optimizer.step()
                schedule.step()
                value = distributed.mean_over_ranks(loss.item())
                result.losses.append(value)
                bar.set_postfix(loss=f"{value:.4f}")
                due = (step + 1) % params.checkpoint_every == 0 or step + 1 == params.steps
                if ckpt is not None and due and distributed.is_main():
                    ckpt.parent.mkdir(parents=True, exist_ok=True)
                    _save_atomic(
                        {
                            "step": step + 1,
                            "losses": result.losses,
                            "optimizer": optimizer.state_dict(),
                            "schedule": schedule.state_dict(),
                            **_trainable_state(named, qset),
                        },
                        ckpt,
                    )
    finally:
        for p in sim_model.parameters():
            p.requires_grad_(False)
    return result


def _trainable_state(named: list[tuple[str, nn.Parameter]], qset: QuadapterSet | None) -> dict:
    state = {"qset": qset.state_dict() if qset is not None else None}
    trained = {name: p.detach().clone() for name, p in named if p.requires_grad}
    state["params"] = trained
    return state


def _load_trainable(sim_model: nn.Module, qset: QuadapterSet | None, state: dict) -> None:
    if qset is not None and state.get("qset") is not None:
        qset.load_state_dict(state["qset"])
    named = dict(sim_model.named_parameters())
    with torch.no_grad():
        for name, value in state["params"].items():
            if name not in named:
                raise QuadapterError(f"checkpoint parameter {name!r} is not in this model: wrong checkpoint_dir?")
            named[name].copy_(value)
