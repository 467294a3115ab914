"""Llama family (LlamaForCausalLM: Llama, SmolLM2, ...): RMSNorm -> Linear, gated FFN, grouped-query attention."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Architecture, SiteSpec

if TYPE_CHECKING:
    from transformers import LlamaConfig


def prepare(hf_model: Any) -> None:  # transformers models: config and submodules are dynamic
    # RMSNorm, Linear, SiLU and Embedding are modules AIMET knows; only attention needs rerouting.
    # Imported here: the modelling code and AIMET take seconds, and the site specs must not need them.
    from transformers.models.llama.modeling_llama import LlamaAttention

    from .attention import use_quantizable_attention

    use_quantizable_attention(hf_model, LlamaAttention)


def head_layout(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, heads, head_dim


def tiny_config(vocab_size: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4, **kw) -> LlamaConfig:
    kw.setdefault("num_key_value_heads", max(1, heads // 2))
    kw.setdefault("intermediate_size", hidden * 3)
    kw.setdefault("max_position_embeddings", 256)
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        tie_word_embeddings=True,
        **kw,
    )


LLAMA = Architecture(
    name="llama",
    model_types=("llama",),
    blocks="model.layers",
    embedding="model.embed_tokens",
    lm_head="lm_head",
    block_sites=(
        SiteSpec("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        # Q . K^T is unchanged when a K channel is scaled by alpha and the matching Q channel (of every query
        # head in the KV head's group) by 1/alpha; alpha equal on the two channels RoPE rotates together.
        SiteSpec(
            "self_attn.k_proj",
            ("self_attn.q_proj",),
            scope="self_attn",
            extra="qk",
            repeat_heads=True,
            consumer_rows=True,
            rotary_pairs=True,
        ),
        # Attention is linear in V: a V channel scaled by alpha leaves the attention output scaled the
        # same way, per head, so o_proj's matching columns can take 1/alpha.
        SiteSpec("self_attn.v_proj", ("self_attn.o_proj",), scope="self_attn", extra="linear", repeat_heads=True),
        SiteSpec("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        # silu(gate) * up is linear in up per channel.
        SiteSpec("mlp.up_proj", ("mlp.down_proj",), scope="mlp", extra="linear"),
    ),
    head_site=SiteSpec("model.norm", ("lm_head",)),
    prepare=prepare,
    head_layout=head_layout,
    extra_sites_default=("linear",),
    tiny_config=tiny_config,
)
