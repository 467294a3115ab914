"""The rotary embedding, its tables and SiLU as the device graph's ops, each an AIMET module, so that ``htp``
quantizes each output as the device does: the same arithmetic, but SiLU as ``x * sigmoid(x)`` (an ulp off)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_ACTIVE: list[nn.Module] = []  # the attention module running now: the rotary function finds its modules here


class Rotation(nn.Module):
    """``x * cos + rotate_half(x) * sin`` on the first ``cos.shape[-1]`` channels, every op a module."""

    def __init__(self, partial: bool = False) -> None:
        super().__init__()
        from aimet_torch.nn.modules.custom import Add, Concat, Multiply, Neg

        self.mul_cos, self.neg, self.cat, self.mul_sin, self.add = Multiply(), Neg(), Concat(-1), Multiply(), Add()
        self.join = Concat(-1) if partial else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dim = cos.shape[-1]
        rot, rest = (x, None) if dim == x.shape[-1] else (x[..., :dim], x[..., dim:])
        half = dim // 2
        rotated = self.cat(self.neg(rot[..., half:]), rot[..., :half])
        out = self.add(self.mul_cos(rot, cos), self.mul_sin(rotated, sin))
        if rest is None:
            return out
        if self.join is None:
            raise ValueError("Rotation: a partial rotary embedding, but made with partial=False")
        return self.join(out, rest)


class RotaryTables(nn.Module):
    """A rotary embedding module's tables as its own forward computes them, ``cos``, ``sin`` and scaling modules."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        from aimet_torch.nn.modules.custom import Cos, Multiply, Sin

        self.inner = inner
        self.cos, self.sin, self.scale_cos, self.scale_sin = Cos(), Sin(), Multiply(), Multiply()

    @staticmethod
    def fits(module: nn.Module) -> bool:
        params = list(inspect.signature(module.forward).parameters)
        return params[:2] == ["x", "position_ids"] and (params[2:] in ([], ["layer_type"]))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        prefix = f"{layer_type}_" if layer_type else ""
        inv_freq = getattr(self.inner, f"{prefix}inv_freq")
        scaling = getattr(self.inner, f"{prefix}attention_scaling")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = self.scale_cos(self.cos(emb), scaling), self.scale_sin(self.sin(emb), scaling)
        return (cos, sin) if x.dtype == torch.float32 else (cos.to(dtype=x.dtype), sin.to(dtype=x.dtype))


class SplitSiLU(nn.Module):
    """SiLU as the exported graph computes it: ``x * sigmoid(x)``, two ops, two quantized outputs."""

    def __init__(self) -> None:
        super().__init__()
        from aimet_torch.nn.modules.custom import Multiply

        self.sigmoid, self.mul = nn.Sigmoid(), Multiply()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mul(x, self.sigmoid(x))


def _through_modules(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args: Any, **kwargs: Any):
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        rotary: nn.ModuleList = _ACTIVE[-1].rotary  # type: ignore[assignment]
        return rotary[0](q, cos, sin), rotary[1](k, cos, sin)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _enter(module: nn.Module, _args: Any) -> None:
    """The modelling module's rotary function is ours while one of its htp attention modules runs."""
    _ACTIVE.append(module)
    modelling = sys.modules[type(module).__module__]
    if sum(type(m).__module__ == modelling.__name__ for m in _ACTIVE) == 1:
        modelling.apply_rotary_pos_emb = _through_modules(modelling.apply_rotary_pos_emb)  # type: ignore[attr-defined]


def _leave(module: nn.Module, _args: Any, _out: Any) -> None:
    _ACTIVE.pop()
    modelling = sys.modules[type(module).__module__]
    if not any(type(m).__module__ == modelling.__name__ for m in _ACTIVE):
        modelling.apply_rotary_pos_emb = modelling.apply_rotary_pos_emb.__wrapped__  # type: ignore[attr-defined]


def _rotates(attention: nn.Module) -> bool:
    return hasattr(attention, "qk_matmul") and hasattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb")


def _replaced(child: nn.Module) -> type[nn.Module] | None:
    from transformers.activations import SiLUActivation

    if type(child).__name__.endswith("RotaryEmbedding") and RotaryTables.fits(child):
        return RotaryTables
    return SplitSiLU if type(child) in (nn.SiLU, SiLUActivation) else None


def device_op_paths(model: nn.Module) -> list[str]:
    """Where :func:`install_device_ops` would put its modules in ``model`` (nothing is changed)."""
    paths = []
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if _rotates(module):
            paths.append(f"{prefix}rotary")
        paths += [f"{prefix}{name}" for name, child in module.named_children() if _replaced(child) is not None]
    return paths


def install_device_ops(model: nn.Module) -> list[str]:
    """Install (in place) :class:`Rotation`, :class:`RotaryTables` and :class:`SplitSiLU`; returns their names."""
    installed = []
    for path, module in list(model.named_modules()):
        prefix = f"{path}." if path else ""
        for name, child in list(module.named_children()):
            kind = _replaced(child)
            if kind is not None:
                setattr(module, name, RotaryTables(child) if kind is RotaryTables else SplitSiLU())
                installed.append(f"{prefix}{name}")
        if _rotates(module) and not hasattr(module, "rotary"):
            partial = float(getattr(module.config, "partial_rotary_factor", None) or 1.0) < 1.0
            module.rotary = nn.ModuleList([Rotation(partial), Rotation(partial)])  # q's, k's
            module.register_forward_pre_hook(_enter)
            module.register_forward_hook(_leave, always_call=True)
            installed.append(f"{prefix}rotary")
    return installed
