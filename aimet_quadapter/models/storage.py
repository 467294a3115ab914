"""Weights held once: a model copy on the original's storage, and parking weights on disk."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aimet_quadapter.memory import release_freed_memory

# On a parameter of a weight-sharing copy: the address of the storage it shares with the original model.
_SHARED_WITH = "_aimet_quadapter_shared_storage"


def weight_sharing_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters are new parameters on the original's storage. Give a parameter new
    data (``p.data = ...``) to change it: a write in place reaches the original too (:func:`own_storage` first)."""
    import copy

    memo: dict[int, Any] = {id(p): sharing_twin(p) for p in model.parameters()}
    return copy.deepcopy(model, memo)


def sharing_twin(p: torch.Tensor) -> nn.Parameter:
    """A new Parameter on ``p``'s storage, marked as sharing it: given new data, it leaves ``p`` as it is."""
    twin = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
    setattr(twin, _SHARED_WITH, p.untyped_storage().data_ptr())
    return twin


def parameter_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters (each Parameter once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def shares_storage(p: torch.Tensor) -> bool:
    """Whether ``p``, a parameter of a :func:`weight_sharing_copy`, still holds the original's storage."""
    return getattr(p, _SHARED_WITH, None) == p.untyped_storage().data_ptr()


@torch.no_grad()
def reset_to(p: torch.Tensor, source: torch.Tensor) -> None:
    """Give ``p`` the values of ``source`` (the original model's): its storage where ``p`` shares it, else a copy."""
    if hasattr(p, _SHARED_WITH):
        p.data = source.detach()
        setattr(p, _SHARED_WITH, source.untyped_storage().data_ptr())
    else:
        p.data = source.detach().clone()


@torch.no_grad()
def own_storage(params: Iterable[torch.Tensor]) -> None:
    """Give each of ``params`` that shares the original model's storage a copy of its own, before a write in place."""
    for p in params:
        if shares_storage(p):
            p.data = p.detach().clone()


class ParkedWeights:
    """Parameters of ``model`` that wait in ``folder`` while nothing reads them: all (:meth:`park_all`), or those
    AIMET swapped out during an export (:meth:`park_displaced`). :meth:`restore` reads them back, bit for bit, into
    the same Parameters. A storage ``besides`` (other models) also holds stays."""

    def __init__(self, model: torch.nn.Module, folder: Path, besides: Iterable[nn.Module] = ()):
        self.model, self.folder = model, folder
        params = list({id(p): p for p in model.parameters()}.values())
        held_elsewhere = {p.untyped_storage().data_ptr() for other in besides for p in other.parameters()}
        self.own = {id(p) for p in params}
        self.own_storage = {p.untyped_storage().data_ptr() for p in params if p.numel()}
        storages = Counter(p.untyped_storage().data_ptr() for p in params)
        # a storage shared by two Parameters, or with the FP model, stays: it would come back as copies
        self.params = [
            p
            for p in params
            if p.numel()
            and storages[p.untyped_storage().data_ptr()] == 1
            and not shares_storage(p)
            and p.untyped_storage().data_ptr() not in held_elsewhere
        ]
        self.parked: list[tuple[torch.nn.Parameter, Path]] = []

    def _park(self, keep: set[int], release: bool = True) -> None:
        parked = {id(p) for p, _ in self.parked}
        self.folder.mkdir(parents=True, exist_ok=True)
        for i, p in enumerate(self.params):
            if id(p) in parked or p.untyped_storage().data_ptr() in keep:
                continue
            path = self.folder / f"{i}.pt"
            torch.save(p.data, path)
            self.parked.append((p, path))
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if release:
            release_freed_memory()

    def park_displaced(self, release: bool = True) -> None:
        """Move to disk every parameter that the model no longer holds; ``release``: give the memory back now."""
        # AIMET rewraps a parameter it does not quantize in a new Parameter over the same storage
        in_use = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._park(in_use, release)

    def park_all(self) -> None:
        self._park(set())

    def drop_stand_ins(self) -> None:
        """Empty the copies AIMET swapped in, once torch has written them to the file."""
        for p in self.model.parameters():
            if id(p) not in self.own and p.numel() and p.untyped_storage().data_ptr() not in self.own_storage:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        release_freed_memory()

    def restore(self) -> None:
        while self.parked:
            p, path = self.parked.pop()
            p.data = torch.load(path, weights_only=True)
            path.unlink()


@contextmanager
def weights_parked(model: nn.Module, folder: Path, besides: Iterable[nn.Module] = ()) -> Iterator[None]:
    """``model``'s weights wait in ``folder`` (removed afterwards); those ``besides`` also holds stay."""
    parked = ParkedWeights(model, folder, besides)
    try:
        parked.park_all()
        yield
    finally:
        parked.restore()
        shutil.rmtree(folder, ignore_errors=True)
