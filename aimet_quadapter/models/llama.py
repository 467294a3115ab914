"""Llama-shaped families (Llama, Mistral, Qwen2/2.5, Qwen3): what differs between them is data below."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .base import Architecture, SiteSpec
from .residual import ResidualSpec


def attention_prepare(attention: str) -> Callable[[Any], None]:
    """A ``prepare`` hook routing every attention module of class ``attention`` (a dotted path) through ours."""

    def prepare(hf_model: Any) -> None:  # transformers models: config and submodules are dynamic
        from .attention import use_quantizable_attention

        module, name = attention.rsplit(".", 1)
        use_quantizable_attention(hf_model, getattr(importlib.import_module(module), name))

    return prepare


def head_layout(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, heads, head_dim


def tiny_config_of(model_type: str, **fixed: Any) -> Callable[..., object]:
    """A small config of ``model_type`` (tests, benchmarks, smoke runs); ``fixed``: what the family needs."""

    def tiny_config(vocab_size: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4, **kw) -> object:
        from transformers import AutoConfig

        kw.setdefault("num_key_value_heads", max(1, heads // 2))
        kw.setdefault("intermediate_size", hidden * 3)
        kw.setdefault("max_position_embeddings", 256)
        kw.setdefault("tie_word_embeddings", True)
        return AutoConfig.for_model(
            model_type,
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            **{**fixed, **kw},
        )

    return tiny_config


ATTENTION_INPUTS = SiteSpec(
    "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), role="attention_inputs"
)
# Q . K^T is unchanged when a K channel is scaled by alpha and the matching Q channels by 1/alpha
QK = SiteSpec(
    "self_attn.k_proj",
    ("self_attn.q_proj",),
    role="qk",
    scope="self_attn",
    extra="qk",
    repeat_heads=True,
    consumer_rows=True,
    rotary_pairs=True,
    cached=True,
)
# attention is linear in V: o_proj's matching columns can take 1/alpha
VO = SiteSpec(
    "self_attn.v_proj",
    ("self_attn.o_proj",),
    role="values",
    scope="self_attn",
    extra="linear",
    repeat_heads=True,
    cached=True,
)
MLP_INPUTS = SiteSpec("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), role="mlp_inputs")
RESIDUAL = ResidualSpec(("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"), mixer="self_attn")
# silu(gate) * up is linear in up per channel.
UP_DOWN = SiteSpec("mlp.up_proj", ("mlp.down_proj",), role="up_down", scope="mlp", extra="linear")


def llama_shaped(
    name: str,
    model_type: str,
    attention: str,
    block_sites: tuple[SiteSpec, ...] = (),
    prepare: Callable[[Any], None] | None = None,
    norm_offset: float = 0.0,
    residual: ResidualSpec = RESIDUAL,
    **tiny: Any,
) -> Architecture:
    """A family whose modules are named as Llama's; ``tiny``: what the family's tiny config needs."""
    return Architecture(
        name=name,
        model_types=(model_type,),
        blocks="model.layers",
        embedding="model.embed_tokens",
        lm_head="lm_head",
        block_sites=block_sites or (ATTENTION_INPUTS, QK, VO, MLP_INPUTS, UP_DOWN),
        head_site=SiteSpec("model.norm", ("lm_head",), role="head"),
        prepare=prepare or attention_prepare(attention),
        head_layout=head_layout,
        extra_sites_default=("linear",),
        tiny_config=tiny_config_of(model_type, **tiny),
        norm_offset=norm_offset,
        residual=residual,
    )


LLAMA = llama_shaped("llama", "llama", "transformers.models.llama.modeling_llama.LlamaAttention")
MISTRAL = llama_shaped("mistral", "mistral", "transformers.models.mistral.modeling_mistral.MistralAttention")
QWEN2 = llama_shaped("qwen2", "qwen2", "transformers.models.qwen2.modeling_qwen2.Qwen2Attention")
# Qwen3 normalises every query and key head after its projection: no Q . K^T site
QWEN3 = llama_shaped(
    "qwen3",
    "qwen3",
    "transformers.models.qwen3.modeling_qwen3.Qwen3Attention",
    (ATTENTION_INPUTS, VO, MLP_INPUTS, UP_DOWN),
    head_dim=16,
)
