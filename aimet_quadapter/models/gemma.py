"""Gemma families (Gemma, Gemma-2, Gemma-3 text): Llama-shaped, with norms that scale by (1 + weight); Gemma-3
normalises every query and key head (no Q . K^T site)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from .base import Architecture, SiteSpec
from .llama import ATTENTION_INPUTS, MLP_INPUTS, QK, RESIDUAL, UP_DOWN, VO, attention_prepare, llama_shaped
from .residual import ResidualSpec


def register_quantized_norm(norm_cls: type[torch.nn.Module]) -> None:
    """Give AIMET a quantized form of the RMSNorm ``norm_cls``, typed as ONNX RMSNormalization for the quantsim
    config's rules, as AIMET does for the norms it knows. Registered once per class."""
    from aimet_torch.nn import QuantizationMixin
    from aimet_torch.onnx_utils import map_torch_types_to_onnx

    if norm_cls in QuantizationMixin.cls_to_qcls:
        return
    map_torch_types_to_onnx[norm_cls] = ["RMSNormalization"]

    class QuantizedNorm(QuantizationMixin, norm_cls):  # type: ignore[valid-type, misc]  # a class made at run time
        def __quant_init__(self):
            super().__quant_init__()
            self.input_quantizers = torch.nn.ModuleList([None])
            self.output_quantizers = torch.nn.ModuleList([None])
            self.param_quantizers = torch.nn.ModuleDict({"weight": None})

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            if self.input_quantizers[0]:
                hidden_states = self.input_quantizers[0](hidden_states)
            with self._patch_quantized_parameters():
                out = super().forward(hidden_states)
            if self.output_quantizers[0]:
                out = self.output_quantizers[0](out)
            return out

    QuantizedNorm.__name__ = QuantizedNorm.__qualname__ = f"Quantized{norm_cls.__name__}"
    QuantizationMixin.implements(norm_cls)(QuantizedNorm)


def leave_unquantized(module_cls: type[torch.nn.Module]) -> None:
    """Have AIMET keep ``module_cls`` as it is (rotary tables; Gemma's scaled embedding, as AIMET keeps Gemma-3's)."""
    from aimet_torch.nn import QuantizationMixin

    QuantizationMixin.ignore(module_cls)


PRE_FEEDFORWARD = SiteSpec("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), role="mlp_inputs")
# Gemma-2 and -3 norm each branch's output before its sum
SANDWICH = ResidualSpec(
    ("input_layernorm", "self_attn", "post_attention_layernorm"),
    ("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"),
    mixer="self_attn",
)


def _prepare(module: str, prefix: str) -> Callable[[Any], None]:
    route = attention_prepare(f"{module}.{prefix}Attention")

    def prepare(hf_model: Any) -> None:
        modelling = importlib.import_module(module)
        register_quantized_norm(getattr(modelling, f"{prefix}RMSNorm"))
        leave_unquantized(getattr(modelling, f"{prefix}RotaryEmbedding"))
        leave_unquantized(getattr(modelling, f"{prefix}TextScaledWordEmbedding"))
        route(hf_model)

    return prepare


def _gemma(
    name: str,
    model_type: str,
    block_sites: tuple[SiteSpec, ...],
    aimet_knows: bool = False,
    residual: ResidualSpec = RESIDUAL,
) -> Architecture:
    module, prefix = f"transformers.models.{name}.modeling_{name}", name.capitalize()
    # aimet_knows: AIMET has the family's norm and ignores its rotary table and embedding already
    prepare = None if aimet_knows else _prepare(module, prefix)
    attention = f"{module}.{prefix}Attention"
    return llama_shaped(
        name, model_type, attention, block_sites, prepare=prepare, norm_offset=1.0, residual=residual, head_dim=16
    )


GEMMA = _gemma("gemma", "gemma", (ATTENTION_INPUTS, QK, VO, MLP_INPUTS, UP_DOWN))
GEMMA2 = _gemma("gemma2", "gemma2", (ATTENTION_INPUTS, QK, VO, PRE_FEEDFORWARD, UP_DOWN), residual=SANDWICH)
GEMMA3 = _gemma(
    "gemma3", "gemma3_text", (ATTENTION_INPUTS, VO, PRE_FEEDFORWARD, UP_DOWN), aimet_knows=True, residual=SANDWICH
)
