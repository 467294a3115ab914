"""A prefix every sequence follows (PrefixQuant) as a full-precision KV cache, and causal masks after cached tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

# The prefix setting's value that means model_prefix's
AUTO_PREFIX = "auto"


def prefix_keys_values(lm: nn.Module, config: Any, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The keys and values of every layer of the Hugging Face model ``lm`` for the tokens ``ids`` (1, P)."""
    cache = DynamicCache(config=config)
    mask = causal_mask(ids.shape[-1], 0, ids.device)
    lm(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    layers: Any = cache.layers  # transformers types a cache's layers loosely
    return [(layer.keys.detach(), layer.values.detach()) for layer in layers]


def prefix_cache(
    config: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], growing: bool = False, batch: int = 1
) -> DynamicCache:
    """The prefix ``kv`` as a cache every call attends to and none extends, or with ``growing`` an ordinary cache
    of ``batch`` sequences."""
    if not growing:
        return FixedPrefixCache(config, kv)
    cache = DynamicCache(config=config)
    for layer, (k, v) in enumerate(kv):
        cache.update(k.expand(batch, -1, -1, -1).clone(), v.expand(batch, -1, -1, -1).clone(), layer)
    return cache


class FixedPrefixCache(DynamicCache):
    """A prefix's keys and values that every call attends to and no call extends."""

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


def causal_mask(length: int, past: int, device: torch.device) -> torch.Tensor:
    """The additive mask (1, 1, length, past + length): new token i sees the ``past`` cached tokens and new tokens
    0..i; a finite minimum keeps fully-masked rows free of NaN."""
    mask = torch.full((length, past + length), torch.finfo(torch.float32).min, device=device)
    return torch.triu(mask, diagonal=past + 1)[None, None]


def model_prefix(tokenizer: Any) -> str | None:
    """The prefix of ``tokenizer``'s model: its BOS (else EOS) token, where attention sinks form, and a new line.
    None for a tokenizer with neither."""
    token = tokenizer.bos_token or tokenizer.eos_token
    return f"{token}\n" if token else None
