"""The ``generated`` dataset: text the FP model samples itself (data-free, as LLM-QAT), its end token never drawn."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ConfigDict

from aimet_quadapter.memory import release_freed_memory
from aimet_quadapter.settings import Settings, setting

if TYPE_CHECKING:
    from aimet_quadapter.models import PreparedLM

GENERATED = "generated"


class GenerationParameters(Settings):
    """How the ``generated`` dataset is sampled from the FP model."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    section = "generated"

    samples: int = setting(16, ge=1, help="sequences sampled; crops cycle through them when more are asked for")
    length: int = setting(512, ge=2, help="tokens per sequence: the longest crop the recipe can take")
    temperature: float = setting(1.0, gt=0, help="softmax temperature of the sampling (1: the model's own)")
    seed: int = setting(0, help="seed of the sampling")
    batch_size: int = setting(16, ge=1, help="sequences sampled at once (another size draws other text)")


def _start_token(model: PreparedLM) -> int:
    config = model.config
    token = config.bos_token_id if config.bos_token_id is not None else config.eos_token_id
    return int(token if token is not None else 0)


def _end_tokens(model: PreparedLM) -> list[int]:
    eos = model.config.eos_token_id
    return [] if eos is None else [int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])]


@contextmanager
def _library_attention(model: PreparedLM) -> Iterator[None]:
    """Transformers' fused attention while the FP model samples, where the family has it (float32 rounding apart)."""
    config: Any = model.lm.config  # a transformers config
    before = config._attn_implementation
    if getattr(type(model.lm), "_supports_sdpa", False):
        config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = before


@torch.no_grad()
def generate_samples(model: PreparedLM, params: GenerationParameters, progress: bool = True) -> torch.Tensor:
    """``params.samples`` sequences of ``params.length`` tokens sampled from ``model`` (seeded), on the CPU."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(params.seed)  # on the CPU: the draws do not depend on the device
    start, ends = _start_token(model), _end_tokens(model)
    was_training = model.training
    model.eval()
    out = []
    bar = tqdm(total=params.samples * params.length, desc="sampling text from the FP model", unit="tok",
               disable=not progress, leave=False)  # fmt: skip
    try:
        with _library_attention(model):
            for first in range(0, params.samples, params.batch_size):
                n = min(params.batch_size, params.samples - first)
                ids = torch.full((n, 1), start, dtype=torch.long, device=device)
                cache, tokens = None, []
                for _ in range(params.length):
                    step = model.lm(input_ids=ids, past_key_values=cache, use_cache=True)
                    cache = step.past_key_values
                    logits = step.logits[:, -1].float().cpu() / params.temperature
                    logits[:, ends] = float("-inf")
                    ids = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
                    tokens.append(ids)
                    ids = ids.to(device)
                    bar.update(n)
                out.append(torch.cat(tokens, dim=1))
    finally:
        bar.close()
        model.train(was_training)
        # each step's cache is a new, slightly larger copy: hundreds of MB of freed blocks stay in the heap
        cache = None
        release_freed_memory()
    return torch.cat(out)


def sample_crops(samples: torch.Tensor, num: int, length: int, seed: int) -> torch.Tensor:
    """``num`` crops of ``length`` tokens at random offsets, one per sample, the samples cycled in a seeded order."""
    count, sample_length = samples.shape
    generator = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(count, generator=generator) for _ in range(-(-num // count))])[:num]
    offsets = torch.randint(0, sample_length - length + 1, (num,), generator=generator)
    return torch.stack([samples[i, o : o + length] for i, o in zip(order.tolist(), offsets.tolist())])
