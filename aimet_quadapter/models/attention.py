"""Attention whose matmuls and softmax are modules AIMET can quantize, computing as transformers' eager attention."""

from __future__ import annotations

from typing import Any

import torch
from aimet_torch.nn.modules.custom import MatMul
from torch import nn
from transformers.modeling_utils import AttentionInterface

ATTENTION_NAME = "aimet_quadapter"


def quantizable_attention(
    module: Any,  # a transformers attention module, given its qk_matmul / softmax / av_matmul above
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    # from the config, not the shapes: under a TorchScript trace shapes are CPU tensors
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:  # grouped-query attention: every KV head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = module.qk_matmul(query, key.transpose(-1, -2)) * scaling
    if softcap is not None:  # Gemma-2: scores squashed into (-softcap, softcap) before the mask
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        fill = getattr(module, "mask_fill", None)
        masked = mask <= torch.finfo(mask.dtype).min / 2
        if fill is None:
            scores = scores + mask
        elif torch.jit.is_tracing():  # a traced graph (AIMET's, the ONNX export's) keeps the out-of-place op
            scores = scores.masked_fill(masked, fill)
        else:  # in place: scores is this function's own product, which no backward reads
            scores = scores.masked_fill_(masked, fill)
    # no cast where float32 already: traced, it would be an op between the masked scores and the softmax input
    probs = module.softmax(scores if scores.dtype == torch.float32 else scores.float())
    probs = probs if probs.dtype == value.dtype else probs.to(value.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = module.av_matmul(probs, value)
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register(ATTENTION_NAME, quantizable_attention)


def set_mask_fill(model: nn.Module, value: float | None) -> None:
    """Give the masked attention scores the finite ``value`` (far enough below the real scores to leave the softmax)
    instead of the dtype's minimum, which would stretch a quantized softmax input's range; ``None``: transformers'."""
    for module in model.modules():
        if hasattr(module, "qk_matmul") and hasattr(module, "softmax"):
            module.mask_fill = value  # type: ignore[assignment]  # a plain attribute, not a submodule or buffer


def use_quantizable_attention(hf_model: Any, attention_cls: type[nn.Module]) -> None:
    """Give every ``attention_cls`` module its matmul/softmax modules and route attention through them."""
    for module in hf_model.modules():
        if isinstance(module, attention_cls):
            module.qk_matmul = MatMul()
            module.av_matmul = MatMul()
            module.softmax = nn.Softmax(dim=-1)
    hf_model.config._attn_implementation = ATTENTION_NAME
