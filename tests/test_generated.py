"""The `generated` dataset: text sampled from the FP model with its key/value cache, cut into crops."""

from __future__ import annotations

import pytest
import torch

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.methods.generated import GenerationParameters, generate_samples, sample_crops
from aimet_quadapter.models.attention import ATTENTION_NAME
from aimet_quadapter.testing import toy_model


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cached_sampling_follows_the_full_forward(family):
    """Near zero temperature the sampling is greedy: each token must be the full forward's argmax at its
    position. A cache that lost its positions, or a mask that hid the past, would pick other tokens."""
    model = toy_model(family)
    start = model.config.bos_token_id
    samples = generate_samples(model, GenerationParameters(samples=3, length=20, temperature=1e-4), progress=False)
    assert samples.shape == (3, 20)
    full = torch.cat([torch.full((3, 1), start), samples], dim=1)
    with torch.no_grad():
        greedy = model(full)[:, :-1].argmax(-1)
    assert torch.equal(greedy, samples)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_sampling_runs_the_library_attention_and_draws_the_same_tokens(family, monkeypatch):
    """The FP model samples through transformers' fused attention where the family has it (grouped-query
    llama here; Gemma-2's soft-capped scores have none), draws what the quantizable attention draws, and
    keeps the quantizable attention for everything after."""
    model = toy_model(family, **({"attn_logit_softcapping": 1.0} if family == "gemma2" else {}))
    calls: list[int] = []
    for module in model.modules():
        if hasattr(module, "qk_matmul"):
            module.qk_matmul.register_forward_hook(lambda *_: calls.append(1))
    params = GenerationParameters(samples=3, length=24, seed=2, batch_size=2)
    fused = generate_samples(model, params, progress=False)
    assert bool(calls) == (family == "gemma2")
    assert model.lm.config._attn_implementation == ATTENTION_NAME
    monkeypatch.setattr(type(model.lm), "_supports_sdpa", False)
    calls.clear()
    assert torch.equal(generate_samples(model, params, progress=False), fused)
    assert calls


def test_sampling_is_seeded_and_never_ends_a_sample():
    model = toy_model("llama")
    eos = model.config.eos_token_id
    with torch.no_grad():  # make the end token the likeliest everywhere: it must still never be drawn
        model.lm.lm_head.weight[eos] = model.lm.lm_head.weight.abs().max() * 50
    params = GenerationParameters(samples=5, length=12, seed=3, batch_size=2)
    a = generate_samples(model, params, progress=False)
    assert not (a == eos).any()
    assert torch.equal(a, generate_samples(model, params, progress=False))
    other = generate_samples(model, GenerationParameters(samples=5, length=12, seed=4, batch_size=2), progress=False)
    assert not torch.equal(a, other)


def test_crops_take_every_sample_before_repeating_one():
    samples = torch.arange(4 * 10).reshape(4, 10)
    crops = sample_crops(samples, 6, 4, seed=0)
    assert crops.shape == (6, 4)
    rows = (crops[:, 0] // 10).tolist()
    assert sorted(rows[:4]) == [0, 1, 2, 3]  # one pass over the samples, then the next
    for crop, row in zip(crops, rows):  # each crop is a contiguous stretch of one sample
        offset = int(crop[0]) - 10 * row
        assert torch.equal(crop, samples[row, offset : offset + 4])
    assert not torch.equal(sample_crops(samples, 6, 4, seed=0), sample_crops(samples, 6, 4, seed=1))


def test_bad_generation_settings_name_the_field():
    with pytest.raises(QuadapterError, match="generated.temperature must be > 0"):
        GenerationParameters(temperature=0)
    with pytest.raises(QuadapterError, match="generated.length must be >= 2"):
        GenerationParameters(length=1)
