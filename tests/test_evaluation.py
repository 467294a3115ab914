"""Perplexity against a computation by hand, on plain and strided windows."""

from __future__ import annotations

import math

import pytest
import torch

from aimet_quadapter.quant.policy import QuantPolicy, build_sim, calibrate
from aimet_quadapter.quant.quantizers import fast_inference
from aimet_quadapter.testing import sample_corpus, toy_model
from aimet_quadapter.text.data import Window, eval_windows
from aimet_quadapter.text.perplexity import perplexity, window_nll


def _by_hand(model, windows):
    """exp(mean NLL) over every scored token, one token at a time with log_softmax."""
    nlls = []
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(model(w.ids[None])[0].double(), dim=-1)
            for t in range(w.first_target, len(w.ids)):
                nlls.append(-logp[t - 1, w.ids[t]].item())
    return math.exp(sum(nlls) / len(nlls)), len(nlls)


@pytest.mark.parametrize("stride", [None, 24, 7])
def test_perplexity_matches_hand_computation(tiny_gpt2, stride):
    ids = torch.randint(0, tiny_gpt2.config.vocab_size, (150,), generator=torch.Generator().manual_seed(4))
    windows = eval_windows(ids, max_length=48, stride=stride)
    assert len(windows) >= 3
    if stride is not None:
        assert any(w.first_target > 1 for w in windows)
    expected, count = _by_hand(tiny_gpt2, windows)
    got = perplexity(tiny_gpt2, windows, progress=False)
    assert got.tokens == count == sum(w.n_targets for w in windows)
    assert got.ppl == pytest.approx(expected, rel=1e-5)
    assert got.nll == pytest.approx(math.log(expected), rel=1e-5)
    assert str(got) == f"{got.ppl:.3f}"


def test_window_nll_first_target():
    vocab = 5
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([0, 1, 2, 3, 4, 0])
    logp = torch.log_softmax(logits.double(), -1)
    for first in (1, 3, 5):
        expected = -sum(logp[t - 1, ids[t]].item() for t in range(first, 6))
        assert window_nll(logits, Window(ids, first)).item() == pytest.approx(expected, rel=1e-6)
        # batched (1, T, V) logits give the same
        assert window_nll(logits[None], Window(ids, first)).item() == pytest.approx(expected, rel=1e-6)


def test_perplexity_of_a_perfect_and_a_uniform_model():
    vocab = 11
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])

    def perfect(x):  # puts (almost) all mass on the next token
        logits = torch.full((1, x.shape[1], vocab), -1e4)
        nxt = torch.roll(x[0], -1)
        logits[0, torch.arange(x.shape[1]), nxt] = 0.0
        return logits

    def uniform(x):
        return torch.zeros((1, x.shape[1], vocab))

    windows = eval_windows(ids, max_length=4)
    assert perplexity(perfect, windows, progress=False).ppl == pytest.approx(1.0)
    assert perplexity(uniform, windows, progress=False).ppl == pytest.approx(vocab)


def test_perplexity_needs_windows(tiny_gpt2):
    with pytest.raises(ValueError, match="no evaluation windows"):
        perplexity(tiny_gpt2, [], progress=False)


def test_quantization_raises_perplexity_on_toy_model():
    """On text sampled from the FP model, W8A8 with planted outliers must cost perplexity."""
    model = toy_model("gpt2")
    text = sample_corpus(model, num=4, length=65, seed=1)
    windows = [Window(row) for row in text]
    fp = perplexity(model, windows, progress=False).ppl
    sim = build_sim(model, QuantPolicy())
    calibrate(sim, [row[None] for row in sample_corpus(model, num=2, length=64, seed=2)])
    with fast_inference(sim.model):
        q = perplexity(sim.model, windows, progress=False).ppl
    assert math.isfinite(fp) and math.isfinite(q)
    assert q > fp * 1.01
