"""Weights held once: a copy of a model on the original's storage, and what tells and changes whom a weight's
storage belongs to. Every sim this package builds starts on the FP model's storage; a method changes a sim's
weights by giving them new data, and the parking of weights on disk (``fast_inference``, the export) moves
only the storage a model owns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# On a parameter of a weight-sharing copy: the address of the storage it shares with the original model.
_SHARED_WITH = "_aimet_quadapter_shared_storage"


def weight_sharing_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters are new parameters on the original's storage: a second model
    for the memory of its buffers. Its weights are changed by giving a parameter new data (``p.data = ...``),
    which leaves the original as it was; a write in place would reach the original too (:func:`own_storage`
    first)."""
    import copy

    memo: dict[int, Any] = {id(p): sharing_twin(p) for p in model.parameters()}
    return copy.deepcopy(model, memo)


def sharing_twin(p: torch.Tensor) -> nn.Parameter:
    """A new Parameter on ``p``'s storage, marked as sharing it: given new data, it leaves ``p`` as it is."""
    twin = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
    setattr(twin, _SHARED_WITH, p.untyped_storage().data_ptr())
    return twin


def parameter_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters as they are held (each Parameter once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def shares_storage(p: torch.Tensor) -> bool:
    """Whether ``p``, a parameter of a :func:`weight_sharing_copy`, still holds the original's storage."""
    return getattr(p, _SHARED_WITH, None) == p.untyped_storage().data_ptr()


@torch.no_grad()
def reset_to(p: torch.Tensor, source: torch.Tensor) -> None:
    """Give ``p`` the values of ``source``, a tensor of the original model: its storage where ``p`` belongs to a
    :func:`weight_sharing_copy`, else a copy (a sim that owns its weights keeps owning them)."""
    if hasattr(p, _SHARED_WITH):
        p.data = source.detach()
        setattr(p, _SHARED_WITH, source.untyped_storage().data_ptr())
    else:
        p.data = source.detach().clone()


@torch.no_grad()
def own_storage(params: Iterable[torch.Tensor]) -> None:
    """Give each of ``params`` that shares the original model's storage a copy of its own, before a write in
    place (an optimizer's step)."""
    for p in params:
        if shares_storage(p):
            p.data = p.detach().clone()
