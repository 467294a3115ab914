"""A prefix every sequence follows (PrefixQuant): its keys and values, computed once in full precision and held
as a cache that every call attends to, and the causal masks of a sequence after cached tokens.

:class:`~aimet_quadapter.models.base.PreparedLM` holds a model's prefix (``set_prefix``) and reads it through
these; ``aimet_quadapter.quant.quantizers.refresh_prefix`` recomputes it with a sim's quantizers out of the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

# The value of a prefix setting (the recipe's `prefix`, the command line's --prefix) that means model_prefix's.
AUTO_PREFIX = "auto"


def prefix_keys_values(lm: nn.Module, config: Any, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The keys and values of every layer of the Hugging Face model ``lm`` for the tokens ``ids`` (1, P)."""
    cache = DynamicCache(config=config)
    mask = causal_mask(ids.shape[-1], 0, ids.device)
    lm(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return [(layer.keys.detach(), layer.values.detach()) for layer in _layers(cache)]


def prefix_cache(
    config: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], growing: bool = False, batch: int = 1
) -> DynamicCache:
    """The prefix ``kv`` as a cache: one that every call attends to and none extends, or with ``growing`` an
    ordinary cache of ``batch`` sequences to generate after."""
    if not growing:
        return FixedPrefixCache(config, kv)
    cache = DynamicCache(config=config)
    for layer, (k, v) in enumerate(kv):
        cache.update(k.expand(batch, -1, -1, -1).clone(), v.expand(batch, -1, -1, -1).clone(), layer)
    return cache


class FixedPrefixCache(DynamicCache):
    """A prefix's keys and values that every call attends to and no call extends: a call's own keys and
    values come back after the prefix's and are not kept, so that one cache serves any number of calls
    (phase 1 reruns a block on the arguments it captured, this cache among them)."""

    def __init__(self, config: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(config=config)
        for layer, (k, v) in enumerate(kv):
            super().update(k, v, layer)

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer: Any = self.layers[layer_idx]
        batch = key_states.shape[0]
        keys = layer.keys.to(key_states).expand(batch, -1, -1, -1)
        values = layer.values.to(value_states).expand(batch, -1, -1, -1)
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)


def _layers(cache: DynamicCache) -> list[Any]:
    return list(cache.layers)  # a DynamicCache's layers hold keys and values (transformers types them loosely)


def causal_mask(length: int, past: int, device: torch.device) -> torch.Tensor:
    """The additive mask (1, 1, length, past + length) under which new token i sees the ``past`` cached tokens
    and new tokens 0..i; a finite minimum keeps fully-masked rows free of NaN."""
    mask = torch.full((length, past + length), torch.finfo(torch.float32).min, device=device)
    return torch.triu(mask, diagonal=past + 1)[None, None]


def model_prefix(tokenizer: Any) -> str | None:
    """The prefix of ``tokenizer``'s model: the token its texts follow (BOS; EOS where it has none, as GPT-2
    separates texts with it), on which attention sinks form, and a new line. None for a tokenizer with neither."""
    token = tokenizer.bos_token or tokenizer.eos_token
    return f"{token}\n" if token else None
