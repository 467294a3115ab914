"""The steps the CLI and the recipe runner share: load, make data, calibrate, evaluate, tabulate."""

from __future__ import annotations

import logging

import torch
from aimet_torch.quantsim import QuantizationSimModel

from . import data
from .evaluation import perplexity
from .models import PreparedLM, load_model
from .policy import QuantPolicy, build_sim, calibrate
from .quantizers import fast_inference


def quiet_libraries() -> None:
    """AIMET and transformers log at INFO/WARNING for every sim; users want the progress bars and results."""
    for name in ("Quant", "Utils", "transformers", "aimet_torch", "aimet_common"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()


def load(name: str):
    quiet_libraries()
    return load_model(name)


def eval_windows_for(
    tokenizer,
    dataset: str,
    split: str = "test",
    seq_len: int = 1024,
    stride: int | None = None,
    max_tokens: int | None = None,
) -> list[data.Window]:
    ids = data.tokenize(tokenizer, data.load_text(dataset, split))
    return data.eval_windows(ids, seq_len, stride, max_tokens)


def calibration_batches(
    tokenizer, dataset: str, num: int = 10, length: int = 512, seed: int = 0, batch_size: int = 1
) -> list[torch.Tensor]:
    """Random crops of the train split (the paper: 10 x 512 tokens), as a list of batches."""
    ids = data.tokenize(tokenizer, data.load_text(dataset, "train"))
    return data.batches(data.random_crops(ids, num, length, seed), batch_size)


def calibrate_sim(sim: QuantizationSimModel, batches: list[torch.Tensor]) -> None:
    calibrate(sim, batches)


def ptq_sim(model: PreparedLM, policy: QuantPolicy, calib: list[torch.Tensor]) -> QuantizationSimModel:
    sim = build_sim(model, policy)
    calibrate(sim, calib)
    return sim


def evaluate(
    model: PreparedLM | QuantizationSimModel,
    windows: dict[str, list[data.Window]],
    label: str = "",
    progress: bool = True,
) -> dict[str, float]:
    """Perplexity per dataset; a sim is evaluated under :func:`~aimet_quadapter.quantizers.fast_inference`."""
    if isinstance(model, QuantizationSimModel):
        with fast_inference(model.model):
            return evaluate(model.model, windows, label, progress)
    return {name: perplexity(model, w, desc=f"{label} {name}", progress=progress).ppl for name, w in windows.items()}


def format_table(results: dict[str, dict[str, float]], datasets: list[str]) -> str:
    labels = [data.dataset_label(d) for d in datasets]
    width = max([len(m) for m in results] + [6])
    cols = [max(len(lbl), 9) for lbl in labels]
    lines = [f"{'method':<{width}}  " + "  ".join(f"{lbl:>{c}}" for lbl, c in zip(labels, cols))]
    for method, row in results.items():
        lines.append(f"{method:<{width}}  " + "  ".join(f"{row[d]:>{c}.3f}" for d, c in zip(datasets, cols)))
    return "\n".join(lines)
