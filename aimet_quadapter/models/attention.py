"""Attention whose matrix products and softmax are module instances, so AIMET can quantize them.

Hugging Face calls a registered attention function with the attention module as first argument; the
function below looks up the modules :func:`attach_attention_modules` hung on it. Its arithmetic is
that of transformers' eager attention (every family here), so the FP output is unchanged.
"""

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
    # From the module's config, not from the shapes: under a TorchScript trace shapes are CPU tensors (a CPU
    # repeat count cannot index CUDA tensors), and int() of them makes the tracer warn. GPT-2 has no groups.
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:  # grouped-query attention: every KV head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = module.qk_matmul(query, key.transpose(-1, -2)) * scaling
    if softcap is not None:  # Gemma-2: scores squashed into (-softcap, softcap) before the mask
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        fill = getattr(module, "mask_fill", None)  # a finite value for masked scores: see set_mask_fill
        masked = mask <= torch.finfo(mask.dtype).min / 2
        if fill is None:
            scores = scores + mask
        elif torch.jit.is_tracing():  # a traced graph (AIMET's, the ONNX export's) keeps the out-of-place op
            scores = scores.masked_fill(masked, fill)
        else:  # in place: scores is this function's own product, which no backward reads
            scores = scores.masked_fill_(masked, fill)
    # no cast where the dtype is float32 already: traced, it is an op of the graph between the tensor a device
    # quantizes (the masked scores) and the one the sim's quantizer names (the softmax input)
    probs = module.softmax(scores if scores.dtype == torch.float32 else scores.float())
    probs = probs if probs.dtype == value.dtype else probs.to(value.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = module.av_matmul(probs, value)
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register(ATTENTION_NAME, quantizable_attention)


def attach_attention_modules(attention: nn.Module) -> None:
    attention.qk_matmul = MatMul()
    attention.av_matmul = MatMul()
    attention.softmax = nn.Softmax(dim=-1)


def set_mask_fill(model: nn.Module, value: float | None) -> None:
    """Give the masked attention scores the finite ``value`` instead of adding the dtype's minimum.

    Where the softmax input is quantized (every op output, as on a device), its range would reach
    -3.4e38 and every real score would round to one value. A device graph takes the mask as a finite
    value for this reason. With ``value`` far enough below the real scores, the softmax is unchanged
    (a masked entry weighs exp(value - row max)); ``None`` adds the mask as transformers does.
    """
    for module in model.modules():
        if hasattr(module, "qk_matmul") and hasattr(module, "softmax"):
            module.mask_fill = value  # type: ignore[assignment]  # a plain attribute, not a submodule or buffer


def use_quantizable_attention(hf_model: Any, attention_cls: type[nn.Module]) -> None:
    """Give every ``attention_cls`` module its matmul/softmax modules and route attention through them."""
    for module in hf_model.modules():
        if isinstance(module, attention_cls):
            attach_attention_modules(module)
    hf_model.config._attn_implementation = ATTENTION_NAME
