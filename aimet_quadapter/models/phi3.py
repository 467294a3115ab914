"""Phi-3: Llama-shaped, but its fused qkv_proj and gate_up_proj leave the paper's sites only."""

from __future__ import annotations

from .base import Architecture, SiteSpec
from .llama import attention_prepare, head_layout, tiny_config_of
from .residual import ResidualSpec

PHI3 = Architecture(
    name="phi3",
    model_types=("phi3",),
    blocks="model.layers",
    embedding="model.embed_tokens",
    lm_head="lm_head",
    block_sites=(
        SiteSpec("input_layernorm", ("self_attn.qkv_proj",), role="attention_inputs"),
        SiteSpec("post_attention_layernorm", ("mlp.gate_up_proj",), role="mlp_inputs"),
    ),
    head_site=SiteSpec("model.norm", ("lm_head",), role="head"),
    prepare=attention_prepare("transformers.models.phi3.modeling_phi3.Phi3Attention"),
    head_layout=head_layout,
    # each branch's output goes through a dropout (identity in eval) before its sum
    residual=ResidualSpec(
        ("input_layernorm", "self_attn", "resid_attn_dropout"),
        ("post_attention_layernorm", "mlp", "resid_mlp_dropout"),
        mixer="self_attn",
    ),
    # a tiny vocabulary needs its own token ids
    tiny_config=tiny_config_of("phi3", pad_token_id=0, bos_token_id=1, eos_token_id=2),
)
