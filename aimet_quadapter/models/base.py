"""The one small interface every architecture family implements, and the model wrapper AIMET sees.

An :class:`Architecture` is data: where the transformer blocks are, which norm (or linear) feeds which
linears, which module spans a site whose producer and consumers are not directly chained, and a
``prepare`` hook that rewrites the Hugging Face model in place so that AIMET can quantize it.
Nothing outside ``aimet_quadapter.models`` should know which family it is running on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class SiteSpec:
    """A place where a per-channel scale can move between two layers without changing the FP function.

    ``producer``'s output channels are multiplied by alpha (a norm's weight and bias, or a linear's
    rows and bias); each of ``consumers`` has its input columns divided by alpha. Paths are relative
    to the block (or to the HF model for the head site).
    """

    producer: str
    consumers: tuple[str, ...]
    # A module whose forward goes from the producer to the consumers when they are not chained directly
    # (e.g. the attention between v_proj and o_proj); phase 1 reconstructs its output.
    scope: str | None = None
    # Beyond the paper's norm -> linear rule: exact only through an op that is linear per channel.
    extra: bool = False
    # Grouped-query attention: each producer channel feeds `repeat` consumer columns, one per head in its
    # group, laid out as (kv_heads, repeat, head_dim). Filled from the model config by the architecture.
    repeat_heads: bool = False


@dataclass(frozen=True)
class Site:
    """A :class:`SiteSpec` resolved to absolute module paths in a :class:`PreparedLM`."""

    name: str
    producer: str
    consumers: tuple[str, ...]
    scope: str | None = None
    extra: bool = False
    # (repeat, head_dim) when consumer columns are a per-head expansion of producer channels.
    expand: tuple[int, int] | None = None

    def consumer_scale(self, alpha: torch.Tensor) -> torch.Tensor:
        """alpha laid out along the consumers' input columns."""
        if self.expand is None:
            return alpha
        repeat, head_dim = self.expand
        return alpha.view(-1, 1, head_dim).expand(-1, repeat, head_dim).reshape(-1)


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]  # Hugging Face `config.model_type` values this family covers
    blocks: str  # path of the ModuleList of transformer blocks
    embedding: str
    lm_head: str
    block_sites: tuple[SiteSpec, ...]
    head_site: SiteSpec
    # Rewrites the HF model in place into a form AIMET can quantize, the FP function unchanged.
    prepare: Callable[[nn.Module], None]
    # (kv_heads, heads, head_dim) of the model, for sites with repeat_heads.
    head_layout: Callable[[object], tuple[int, int, int]] | None = None
    # Extra sites are on by default for this family (see SiteSpec.extra).
    extra_sites_default: bool = False
    tiny_config: Callable[..., object] | None = field(default=None, repr=False)


class PreparedLM(nn.Module):
    """``forward(input_ids) -> logits``: the shape of model ``QuantizationSimModel`` accepts.

    Holds the Hugging Face model as ``lm``; site and block paths are given relative to this wrapper, so
    they stay valid in ``sim.model`` (a deep copy of it with quantized modules swapped in).
    """

    def __init__(self, lm: nn.Module, arch: Architecture):
        super().__init__()
        self.lm = lm
        self.arch = arch

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[-1]
        # A precomputed additive causal mask keeps transformers' mask builder (and its aten::diff, which
        # ONNX cannot export) out of the graph. A finite minimum keeps fully-masked rows free of NaN.
        mask = torch.full((length, length), torch.finfo(torch.float32).min, device=input_ids.device)
        mask = torch.triu(mask, diagonal=1)[None, None]
        return self.lm(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

    def block_paths(self) -> list[str]:
        blocks = self.get_submodule(f"lm.{self.arch.blocks}")
        return [f"lm.{self.arch.blocks}.{i}" for i in range(len(blocks))]

    def sites(self, extra: bool | None = None) -> list[Site]:
        """All Quadapter sites, bottom to top; ``extra`` adds the beyond-paper sites (default per family)."""
        extra = self.arch.extra_sites_default if extra is None else extra
        expand = None
        if self.arch.head_layout is not None:
            kv_heads, heads, head_dim = self.arch.head_layout(self.config)
            expand = (heads // kv_heads, head_dim)
        out = []
        for block in self.block_paths():
            for spec in self.arch.block_sites:
                if spec.extra and not extra:
                    continue
                out.append(_resolve(spec, block, expand))
        out.append(_resolve(self.arch.head_site, "lm", None))
        return out


def _resolve(spec: SiteSpec, prefix: str, expand: tuple[int, int] | None) -> Site:
    producer = f"{prefix}.{spec.producer}"
    consumers = tuple(f"{prefix}.{c}" for c in spec.consumers)
    short = prefix.removeprefix("lm.").removeprefix("lm")
    label = f"{short + '.' if short else ''}{spec.producer}->{'+'.join(c.split('.')[-1] for c in spec.consumers)}"
    return Site(
        name=label,
        producer=producer,
        consumers=consumers,
        scope=f"{prefix}.{spec.scope}" if spec.scope else None,
        extra=spec.extra,
        expand=expand if spec.repeat_heads and expand and expand[0] > 1 else None,
    )


def untie_lm_head(model: PreparedLM) -> None:
    """Give ``lm_head`` its own copy of the embedding matrix, so a head site can scale its columns."""
    head = model.get_submodule(f"lm.{model.arch.lm_head}")
    embedding = model.get_submodule(f"lm.{model.arch.embedding}")
    if head.weight is embedding.weight:
        head.weight = nn.Parameter(embedding.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.lm, "_tied_weights_keys"):
        model.lm._tied_weights_keys = None


def is_tied(model: PreparedLM) -> bool:
    head = model.get_submodule(f"lm.{model.arch.lm_head}")
    return head.weight is model.get_submodule(f"lm.{model.arch.embedding}").weight
