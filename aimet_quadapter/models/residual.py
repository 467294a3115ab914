"""Each block's two residual sums through AIMET ``Add`` modules a sim can quantize (``htp``), the same FP function."""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ResidualSpec:
    """A block's two residual branches, the modules from the stream to each sum in order. ``mixer`` takes the
    block's own arguments and returns a tuple, its branch's tensor first; the others map one tensor to one."""

    attention: tuple[str, ...]
    mlp: tuple[str, ...]
    mixer: str
    # block arguments its mixer does not take (GPT-2's cross-attention inputs): refused unless None
    unsupported: tuple[str, ...] = ()


def install_residual_adds(blocks: nn.Module, spec: ResidualSpec) -> None:
    """Give every block of ``blocks`` its two ``Add`` modules and a forward that sums through them (in place)."""
    from aimet_torch.nn.modules.custom import Add  # AIMET takes seconds to import

    for block in blocks.children():
        if hasattr(block, "residual_adds"):
            continue
        signature = inspect.signature(block.forward)
        block.residual_adds = nn.ModuleList([Add(), Add()])
        block.forward = types.MethodType(_residual_forward(spec, signature), block)


def _residual_forward(spec: ResidualSpec, signature: inspect.Signature):
    variadic = next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)

    def forward(block: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(hidden_states, *args, **kwargs).arguments
        bound.pop("hidden_states")
        arguments = {**bound, **(bound.pop(variadic, None) or {})} if variadic else bound
        for name in spec.unsupported:
            if arguments.pop(name, None) is not None:
                raise ValueError(f"{type(block).__name__}: {name} is not supported by the prepared model")
        adds: Any = block.residual_adds
        for i, branch in enumerate((spec.attention, spec.mlp)):
            out = hidden_states
            for name in branch:
                module = block.get_submodule(name)
                out = module(out, **arguments)[0] if name == spec.mixer else module(out)
            hidden_states = adds[i](hidden_states, out)
        return hidden_states

    return forward
