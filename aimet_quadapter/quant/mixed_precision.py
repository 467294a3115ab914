"""Mixed precision from measured sensitivity: each kind of quantizer given more bits in turn, scored by LM loss."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from aimet_quadapter.quant.quantizers import fast_inference, quantizers, quantizers_by_name, shared_activation_groups

# the index of a repeated block in a module path: "lm.model.layers.3.mlp" / "lm.transformer.h.11.attn"
_BLOCK = re.compile(r"^.*?\.\d+\.")


def kind_of(name: str) -> str:
    """The kind pattern of quantizer ``name``: its path below the repeated block, or the name outside the blocks."""
    return _BLOCK.sub("*.", name, count=1)


def quantizer_kinds(sim_model: nn.Module) -> dict[str, list[str]]:
    """Kind pattern -> the quantizer names of that kind, in model order; kinds that read one tensor are one."""
    kinds: dict[str, list[str]] = {}
    for path, role, _ in quantizers(sim_model):
        name = f"{path}.{role}"
        kinds.setdefault(kind_of(name), []).append(name)
    merged_into: dict[str, str] = {}
    for group in shared_activation_groups(sim_model):
        first = kind_of(group[0])
        for name in group[1:]:
            other = kind_of(name)
            if other != first and other in kinds:
                merged_into[other] = first
    for other, first in merged_into.items():
        kinds[first] += kinds.pop(other)
    return kinds


@dataclass(frozen=True)
class Sensitivity:
    kind: str  # a pattern for policy.bit_overrides
    quantizers: int
    loss: float  # held-out LM loss with this kind at the higher bit-width
    recovered: float  # the share of the quantization loss (policy's sim - FP) this recovers


def bit_sensitivity(
    sim_model: nn.Module,
    held_out: Sequence[torch.Tensor],
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    fp_loss: float,
    bits: int = 16,
    progress: Callable[[str], None] | None = None,
) -> tuple[float, list[Sensitivity]]:
    """``(loss of the calibrated sim, one row per kind, most recovered first)``: each kind set to ``bits`` alone, its
    ranges kept. ``fp_loss``: the FP model's loss on ``held_out``."""
    found = quantizers_by_name(sim_model)

    def loss() -> float:
        with torch.no_grad(), fast_inference(sim_model):
            return sum(float(loss_fn(sim_model, b)) for b in held_out) / len(held_out)

    base = loss()
    gap = base - fp_loss
    rows = []
    for kind, names in quantizer_kinds(sim_model).items():
        if progress:
            progress(kind)
        saved = {name: found[name].bitwidth for name in names}
        try:
            for name in names:
                found[name].bitwidth = max(bits, saved[name])
            value = loss()
        finally:
            for name, width in saved.items():
                found[name].bitwidth = width
        rows.append(Sensitivity(kind, len(names), value, (base - value) / gap if gap > 0 else 0.0))
    return base, sorted(rows, key=lambda r: r.loss)
