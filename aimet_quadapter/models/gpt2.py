"""GPT-2 family (gpt2, distilgpt2, gpt2-medium/large/xl, any GPT2LMHeadModel checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .base import Architecture, SiteSpec
from .residual import ResidualSpec

if TYPE_CHECKING:
    from transformers import GPT2Config
    from transformers.pytorch_utils import Conv1D

# Hugging Face activation names -> a torch module AIMET knows how to quantize.
_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    **dict.fromkeys(("gelu_new", "gelu_pytorch_tanh", "gelu_fast"), lambda: nn.GELU(approximate="tanh")),
    "gelu": lambda: nn.GELU(),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
}


def _conv1d_to_linear(conv: Conv1D) -> nn.Linear:
    # Conv1D stores its weight as (in, out)
    linear = nn.Linear(conv.weight.shape[0], conv.weight.shape[1], bias=conv.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        if conv.bias is not None:
            linear.bias.copy_(conv.bias)
    return linear


def prepare(hf_model: Any) -> None:  # transformers models: config and submodules are dynamic
    # imported here: the modelling code and AIMET take seconds
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.pytorch_utils import Conv1D

    from .attention import use_quantizable_attention

    for parent in list(hf_model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                setattr(parent, name, _conv1d_to_linear(child))
    activation = hf_model.config.activation_function
    if activation not in _ACTIVATIONS:
        raise ValueError(f"GPT-2 activation {activation!r} has no quantizable module here")
    for block in hf_model.transformer.h:
        block.mlp.act = _ACTIVATIONS[activation]()
    use_quantizable_attention(hf_model, GPT2Attention)


def tiny_config(
    vocab_size: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4, positions: int = 256, **kw
) -> GPT2Config:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=positions,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        **kw,
    )


def head_layout(config) -> tuple[int, int, int]:
    return config.n_head, config.n_head, config.n_embd // config.n_head


GPT2 = Architecture(
    name="gpt2",
    model_types=("gpt2",),
    blocks="transformer.h",
    embedding="transformer.wte",
    lm_head="lm_head",
    block_sites=(
        SiteSpec("ln_1", ("attn.c_attn",), role="attention_inputs"),
        SiteSpec("ln_2", ("mlp.c_fc",), role="mlp_inputs"),
    ),
    head_site=SiteSpec("transformer.ln_f", ("lm_head",), role="head"),
    prepare=prepare,
    head_layout=head_layout,
    tiny_config=tiny_config,
    residual=ResidualSpec(
        ("ln_1", "attn"), ("ln_2", "mlp"), mixer="attn", unsupported=("encoder_hidden_states", "encoder_attention_mask")
    ),
)
