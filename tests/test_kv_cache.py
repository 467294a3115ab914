"""Generation with a KV cache: a prefill, then one token at a time, computes what the full sequence computes,
in the FP model and in its sim under both targets (static ranges: a token's logits do not depend on how the
tokens before it were fed)."""

from __future__ import annotations

import pytest
import torch

from aimet_quadapter.quant.config import QuantPolicy
from aimet_quadapter.quant.policy import build_sim, calibrate
from aimet_quadapter.quant.quantizers import fast_inference
from aimet_quadapter.testing import sample_corpus, toy_model
from aimet_quadapter.text.perplexity import cached_logits

LENGTH, PREFILL = 24, 8


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model_and_text(request):
    model = toy_model(request.param).eval()
    with torch.no_grad():
        text = sample_corpus(model, 3, LENGTH, seed=1)
    return model, text


def _agree(model, ids: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        full = model(ids)
        cached = cached_logits(model, ids, PREFILL)
    return float((full - cached).abs().max()), float(full.abs().max())


def test_prefill_then_decode_equals_the_full_sequence_in_the_fp_model(model_and_text):
    model, text = model_and_text
    diff, scale = _agree(model, text[2:3])
    assert diff <= 1e-5 * scale


@pytest.mark.parametrize("target", ["paper", "htp"])
def test_prefill_then_decode_equals_the_full_sequence_in_the_sim(model_and_text, target):
    model, text = model_and_text
    sim = build_sim(model, QuantPolicy(target=target))
    calibrate(sim, [text[:1], text[1:2]])
    ids = text[2:3]
    diff, scale = _agree(sim.model, ids)
    with fast_inference(sim.model):  # the evaluation's fast path gives the same
        fast_diff, _ = _agree(sim.model, ids)
    # one quantization step of the logits' range would be ~1 % of it: a stale or misplaced mask, or a range
    # that depends on the tokens fed at once, moves logits by far more than float rounding does
    assert diff <= 1e-4 * scale and fast_diff <= 1e-4 * scale, (diff, fast_diff, scale)


def test_prefill_must_fit_the_sequence(model_and_text):
    from aimet_quadapter.errors import QuadapterError

    model, text = model_and_text
    with pytest.raises(QuadapterError, match="prefill must be between 1 and the sequence length"):
        cached_logits(model, text[:1], LENGTH + 1)
