"""Perplexity: the exponential of the mean negative log-likelihood over every predicted token."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from aimet_torch.quantsim import QuantizationSimModel
from torch import nn
from tqdm.auto import tqdm

from aimet_quadapter import distributed
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.memory import heap_reused
from aimet_quadapter.models import PreparedLM, head_of
from aimet_quadapter.models.graphs import GraphedForward
from aimet_quadapter.quant.quantizers import fast_inference
from aimet_quadapter.text import EVAL_SEQ_LEN, data
from aimet_quadapter.text.data import Window

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token, in nats
    tokens: int  # number of predicted tokens

    def __str__(self) -> str:
        return f"{self.ppl:.3f}"


def window_nll(logits: torch.Tensor, window: Window) -> torch.Tensor:
    """Summed NLL (float64) of the tokens a window scores, from logits of shape (T, V) or (1, T, V)."""
    logits = logits.reshape(-1, logits.shape[-1])
    # logits[t] predicts ids[t + 1]: the window scores ids[first_target:].
    pred = logits[window.first_target - 1 : len(window.ids) - 1].float()
    target = window.ids[window.first_target :].to(pred.device)
    return F.cross_entropy(pred, target, reduction="sum").double()


@torch.no_grad()
def perplexity(
    model: LogitsFn, windows: Sequence[Window], desc: str = "perplexity", progress: bool = True
) -> Perplexity:
    """Token-level perplexity of ``model`` (input ids (1, T) -> logits (1, T, V)) over ``windows``."""
    if not windows:
        raise ValueError("no evaluation windows: the text is shorter than two tokens")
    device = _device_of(model)
    total = torch.zeros((), dtype=torch.float64)
    count = 0.0
    mine = distributed.shard(windows)
    bar = tqdm(mine, desc=desc, unit="win", disable=not (progress and distributed.is_main()), leave=False)
    forward = GraphedForward(model)  # on a GPU, windows of one length replay one captured forward
    with heap_reused(head=head_of(model)):
        for window in bar:
            total += window_nll(forward(window.ids.unsqueeze(0).to(device)), window).cpu()
            count += window.n_targets
            bar.set_postfix(ppl=f"{_exp(total.item() / count):.2f}")
    summed, count = distributed.sum_over_ranks(total.item(), count)
    nll = summed / count
    return Perplexity(_exp(nll), nll, int(count))


def _exp(nll: float) -> float:
    """The perplexity of a mean NLL: inf past float64's range (where math.exp raises), NaN for NaN."""
    try:
        return math.exp(nll)
    except OverflowError:
        return math.inf


@torch.no_grad()
def cached_logits(model: PreparedLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits (1, T, vocab) of ``ids`` as a device generates them: ``prefill`` tokens at once, then one at a time."""
    if not 1 <= prefill <= ids.shape[-1]:
        raise QuadapterError(f"prefill must be between 1 and the sequence length {ids.shape[-1]}, got {prefill}")
    logits, cache = model.step(ids[:, :prefill])
    parts = [logits]
    for t in range(prefill, ids.shape[-1]):
        logits, cache = model.step(ids[:, t : t + 1], cache)
        parts.append(logits)
    return torch.cat(parts, dim=1)


def _device_of(model: LogitsFn) -> torch.device:
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def eval_windows_for(
    tokenizer,
    dataset: str,
    split: str = "test",
    seq_len: int = EVAL_SEQ_LEN,
    stride: int | None = None,
    max_tokens: int | None = None,
) -> list[Window]:
    """The evaluation windows of ``dataset``'s ``split``: :func:`~aimet_quadapter.text.data.eval_windows`."""
    ids = data.tokenize(tokenizer, data.load_text(dataset, split))
    return data.eval_windows(ids, seq_len, stride, max_tokens)


def evaluate(
    model: nn.Module | QuantizationSimModel, windows: dict[str, list[Window]], label: str = "", progress: bool = True
) -> dict[str, float]:
    """Perplexity per dataset; a sim is evaluated under :func:`~aimet_quadapter.quant.quantizers.fast_inference`."""
    if isinstance(model, QuantizationSimModel):
        with fast_inference(model.model):
            return evaluate(model.model, windows, label, progress)
    return {name: perplexity(model, w, desc=f"{label} {name}", progress=progress).ppl for name, w in windows.items()}
