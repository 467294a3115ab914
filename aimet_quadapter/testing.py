"""Small models that quantization really hurts (planted outlier channels), and text they sample, for tests."""

from __future__ import annotations

import torch

from aimet_quadapter.models import PreparedLM, tiny_model
from aimet_quadapter.quadapter.adapter import QuadapterSet


def plant_outliers(model: PreparedLM, factor: float = 40.0, channels: int = 3, seed: int = 0) -> list[int]:
    """Scale ``channels`` random channels of every norm site's output by ``factor``, keeping the FP function."""
    generator = torch.Generator().manual_seed(seed)
    qset = QuadapterSet(model, [s for s in model.sites(extra=False)])
    hidden = next(iter(qset)).theta.numel()
    picked = torch.randperm(hidden, generator=generator)[:channels].tolist()
    for q in qset:
        alpha = torch.ones_like(q.theta)
        alpha[picked] = factor
        q.set_alpha(alpha)
    qset.fold(model)
    return picked


def toy_model(family: str = "gpt2", factor: float = 40.0, seed: int = 0, **config) -> PreparedLM:
    """A tiny ``family`` model with peaked predictions (larger init) and planted outlier channels."""
    config.setdefault("initializer_range", 0.3)
    model = tiny_model(family, seed=seed, **config)
    plant_outliers(model, factor=factor, seed=seed)
    return model


@torch.no_grad()
def sample_corpus(model: PreparedLM, num: int, length: int, seed: int = 0, temperature: float = 1.0) -> torch.Tensor:
    """``num`` sequences of ``length`` tokens sampled from ``model``, shape (num, length)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (num, 1), generator=generator)
    for _ in range(length - 1):
        logits = model(ids)[:, -1, :] / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        ids = torch.cat([ids, nxt], dim=1)
    return ids
