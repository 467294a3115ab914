"""Architecture families as data (nothing outside ``models`` knows the family), and the model wrapper AIMET sees."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn
from transformers import DynamicCache

from .prefix import causal_mask, prefix_cache, prefix_keys_values
from .residual import ResidualSpec
from .storage import sharing_twin

# What a site is to its block, alike in every family: attention_inputs (norm -> q/k/v), qk (k_proj -> q_proj),
# values (v_proj -> o_proj), mlp_inputs (norm -> the MLP's first linears), up_down, head (final norm -> lm_head).
SiteRole = Literal["attention_inputs", "qk", "values", "mlp_inputs", "up_down", "head"]
SITE_ROLES: tuple[str, ...] = get_args(SiteRole)


@dataclass(frozen=True)
class SiteSpec:
    """A place where a per-channel scale can move between two layers without changing the FP function: the
    ``producer``'s output channels are multiplied by alpha, each of ``consumers``' input columns (or with
    ``consumer_rows`` output rows) divided by it. Paths are relative to the block (the HF model for the head)."""

    producer: str
    consumers: tuple[str, ...]
    role: SiteRole = field(kw_only=True)
    # the module between producer and consumers when not chained directly (the attention between v_proj and o_proj)
    scope: str | None = None
    # a beyond-paper group of sites, switched on together ("linear": through a per-channel linear op; "qk")
    extra: str | None = None
    # grouped-query attention: each producer channel feeds one consumer channel per head in its group
    repeat_heads: bool = False
    consumer_rows: bool = False
    # one alpha per pair of channels RoPE rotates together keeps the rotation exact
    rotary_pairs: bool = False
    # the producer's output is cached (keys or values): its alpha changes a prefix's cache
    cached: bool = False


@dataclass(frozen=True)
class Site:
    """A :class:`SiteSpec` resolved to absolute module paths in a :class:`PreparedLM`."""

    name: str
    producer: str
    consumers: tuple[str, ...]
    role: SiteRole = field(kw_only=True)
    scope: str | None = None
    extra: str | None = None
    # (repeat, head_dim) when consumer channels are a per-head expansion of producer channels
    expand: tuple[int, int] | None = None
    consumer_rows: bool = False
    rotary_head_dim: int | None = None  # head_dim when one alpha serves each rotated pair of channels
    norm_offset: float = 0.0
    cached: bool = False  # see SiteSpec.cached

    def channels(self, producer_channels: int) -> int:
        """The number of free alphas: one per producer channel, or per rotated pair."""
        return producer_channels // 2 if self.rotary_head_dim else producer_channels

    def producer_scale(self, alpha: torch.Tensor) -> torch.Tensor:
        """alpha laid out along the producer's output channels."""
        if not self.rotary_head_dim:
            return alpha
        half = self.rotary_head_dim // 2
        return alpha.view(-1, 1, half).expand(-1, 2, half).reshape(-1)

    def consumer_scale(self, alpha: torch.Tensor) -> torch.Tensor:
        """alpha laid out along the consumers' scaled channels (input columns, or output rows)."""
        alpha = self.producer_scale(alpha)
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
    # rewrites the HF model in place into a form AIMET can quantize, the FP function unchanged
    prepare: Callable[[nn.Module], None]
    # (kv_heads, heads, head_dim) of the model
    head_layout: Callable[[object], tuple[int, int, int]] | None = None
    extra_sites_default: tuple[str, ...] = ()
    tiny_config: Callable[..., object] | None = field(default=None, repr=False)
    # Gemma's norms scale by (1 + weight): a fold must scale the sum
    norm_offset: float = 0.0
    residual: ResidualSpec | None = None


def device_of(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters live."""
    return next(module.parameters()).device


def tensor_of(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """``module.<name>`` as a tensor (torch types a module's attributes as ``Tensor | Module``)."""
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} is not a tensor")
    return value


class PreparedLM(nn.Module):
    """``forward(input_ids) -> logits`` around the HF model ``lm``; paths relative to it stay valid in ``sim.model``."""

    def __init__(self, lm: nn.Module, arch: Architecture):
        super().__init__()
        self.lm = lm
        self.arch = arch
        self.prefix_ids: torch.Tensor | None = None
        self.prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def config(self):
        return self.lm.config

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model takes."""
        from .loading import position_limit

        return position_limit(self.config.to_dict())

    def check_length(self, length: int, what: str) -> None:
        """Refuse ``length`` tokens beyond :attr:`max_positions`, naming ``what`` asked for them."""
        from .loading import check_length

        check_length(self.max_positions, length, what)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # a precomputed mask keeps transformers' mask builder (aten::diff, which ONNX cannot export) out of the graph
        past = self.prefix_cache()
        if past is None:
            mask = causal_mask(input_ids.shape[-1], 0, input_ids.device)
            return self.lm(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
        start, length = past.get_seq_length(), input_ids.shape[-1]
        mask = causal_mask(length, start, input_ids.device)
        positions = torch.arange(start, start + length, device=input_ids.device)[None]
        out = self.lm(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True
        )
        return out.logits

    @torch.no_grad()
    def set_prefix(self, ids: Sequence[int] | None) -> None:
        """Make every sequence follow the tokens ``ids`` (None: none), held as full-precision keys and values
        (PrefixQuant); after a sim's weights change, ``quant.quantizers.refresh_prefix`` recomputes them."""
        self.prefix_ids = torch.tensor([list(ids)], dtype=torch.long) if ids else None
        self.refresh_prefix()

    @property
    def prefix_length(self) -> int:
        """Tokens in the prefix every sequence follows (0: none)."""
        return 0 if self.prefix_ids is None else int(self.prefix_ids.shape[-1])

    @torch.no_grad()
    def refresh_prefix(self) -> None:
        """The prefix's keys and values computed again, from the weights as they are now."""
        self.prefix_kv = None if self.prefix_ids is None else self.compute_prefix_kv()

    def compute_prefix_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The prefix's keys and values of every layer, through the model as it is now (a sim's quantizers too)."""
        if self.prefix_ids is None:
            raise ValueError("the model has no prefix")
        return prefix_keys_values(self.lm, self.config, self.prefix_ids.to(device_of(self)))

    def prefix_cache(self, growing: bool = False, batch: int = 1) -> DynamicCache | None:
        """The prefix's keys and values as a cache (None without a prefix): see :func:`.prefix.prefix_cache`."""
        if self.prefix_ids is None:
            return None
        if self.prefix_kv is None:
            raise ValueError("the model has a prefix but no keys and values for it: call set_prefix")
        return prefix_cache(self.config, self.prefix_kv, growing, batch)

    def step(self, input_ids: torch.Tensor, cache: Any = None) -> tuple[torch.Tensor, Any]:
        """Logits of ``input_ids`` after the tokens ``cache`` holds (None: the prefix, if any), and the cache with
        them added: a prefill or decode step; :meth:`forward`'s logits up to float rounding."""
        if cache is None:
            cache = self.prefix_cache(growing=True, batch=input_ids.shape[0])
        if cache is None:
            cache = DynamicCache(config=self.config)
        mask = causal_mask(input_ids.shape[-1], cache.get_seq_length(), input_ids.device)
        out = self.lm(input_ids=input_ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        return out.logits, out.past_key_values

    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim): a layer's cached keys (and values) are (batch, kv_heads, tokens, head_dim)."""
        if self.arch.head_layout is None:
            raise ValueError(f"family {self.arch.name} declares no head_layout")
        kv_heads, _, head_dim = self.arch.head_layout(self.config)
        return len(self.block_paths()), kv_heads, head_dim

    def forward_cached(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The forward of a device's KV-cache graph: ``input_ids`` (1, N) at ``position_ids`` (1, N) after the
        cached keys and values ``past`` (key then value of each layer, each (1, kv_heads, P, head_dim)), under
        the additive ``attention_mask`` (1, 1, N, P + N). Returns the logits (1, N, vocab) and the N new keys
        and values of each layer, in the order of ``past``."""
        cache = DynamicCache(config=self.config)
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        old = past[0].shape[2]
        out = self.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        new: list[torch.Tensor] = []
        for cached in cache.layers:
            kv: Any = cached  # transformers types a cache's layers loosely
            new += [kv.keys[:, :, old:], kv.values[:, :, old:]]
        return (out.logits, *new)

    def head(self) -> nn.Module:
        """The module that maps the last hidden states to the vocabulary's logits."""
        return self.get_submodule(f"lm.{self.arch.lm_head}")

    def block_paths(self) -> list[str]:
        blocks = self.get_submodule(f"lm.{self.arch.blocks}")
        return [f"lm.{self.arch.blocks}.{i}" for i in range(len(list(blocks.children())))]

    def sites(self, extra: bool | Iterable[str] | None = None) -> list[Site]:
        """All Quadapter sites, bottom to top, plus the extra groups ``extra`` names (True: all; None: the default)."""
        groups = extra_groups(self.arch, extra)
        expand = None
        if self.arch.head_layout is not None:
            kv_heads, heads, head_dim = self.arch.head_layout(self.config)
            expand = (heads // kv_heads, head_dim)
        out = []
        for block in self.block_paths():
            for spec in self.arch.block_sites:
                if spec.extra and spec.extra not in groups:
                    continue
                out.append(_resolve(spec, block, expand, self.arch.norm_offset))
        out.append(_resolve(self.arch.head_site, "lm", None, self.arch.norm_offset))
        return out


def extra_groups(arch: Architecture, extra: bool | Iterable[str] | None) -> frozenset[str]:
    """The beyond-paper site groups that ``extra`` switches on for ``arch``."""
    known = {s.extra for s in arch.block_sites if s.extra}
    if extra is None:
        return frozenset(arch.extra_sites_default)
    if isinstance(extra, bool):
        return frozenset(known) if extra else frozenset()
    return frozenset(extra) & known


def _resolve(spec: SiteSpec, prefix: str, expand: tuple[int, int] | None, norm_offset: float) -> Site:
    producer = f"{prefix}.{spec.producer}"
    consumers = tuple(f"{prefix}.{c}" for c in spec.consumers)
    short = prefix.removeprefix("lm.").removeprefix("lm")
    label = f"{short + '.' if short else ''}{spec.producer}->{'+'.join(c.split('.')[-1] for c in spec.consumers)}"
    return Site(
        name=label,
        producer=producer,
        consumers=consumers,
        role=spec.role,
        scope=f"{prefix}.{spec.scope}" if spec.scope else None,
        extra=spec.extra,
        expand=expand if spec.repeat_heads and expand and expand[0] > 1 else None,
        consumer_rows=spec.consumer_rows,
        rotary_head_dim=expand[1] if spec.rotary_pairs and expand else None,
        norm_offset=norm_offset,
        cached=spec.cached,
    )


def head_of(model: object) -> nn.Module | None:
    """``model``'s LM head where it is a PreparedLM; None for any other ``ids -> logits`` callable."""
    return model.head() if isinstance(model, PreparedLM) else None


def untie_lm_head(model: PreparedLM) -> None:
    """Give ``lm_head`` a Parameter of its own, so a head site can scale it without the embedding: on the
    embedding's storage until given new data, so a write in place must come after :func:`own_storage`."""
    head: Any = model.head()
    embedding: Any = model.get_submodule(f"lm.{model.arch.embedding}")
    if head.weight is embedding.weight:
        head.weight = sharing_twin(embedding.weight)
    model.config.tie_word_embeddings = False
    lm: Any = model.lm  # transformers' tie bookkeeping
    if hasattr(lm, "_tied_weights_keys"):
        lm._tied_weights_keys = None


def is_tied(model: PreparedLM) -> bool:
    head = model.head()
    return head.weight is model.get_submodule(f"lm.{model.arch.embedding}").weight
