"""AIMET's LLM techniques: FP-equivalent transforms of a copy (SpinQuant, FPTQuant), block-wise reconstruction on a
sim (AdaScale, OmniQuant); :data:`AIMET_SUPPORT` refuses what AIMET would, before any model loads."""

from __future__ import annotations

import copy
import hashlib
import inspect
import logging
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aimet_quadapter.atomic import write_atomic
from aimet_quadapter.cache import cache_root
from aimet_quadapter.quant.config import (
    AdaScaleParameters,
    FPTQuantParameters,
    OmniQuantParameters,
    QuantPolicy,
    SpinQuantParameters,
)

if TYPE_CHECKING:  # torch and the models are imported where a technique runs: the table below is read first
    import torch

    from aimet_quadapter.models import PreparedLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AimetSupport:
    families: tuple[str, ...]  # this package's family names whose backbone AIMET's registry holds
    symmetric_weights_only: bool = False  # AIMET asserts symmetric weight quantizers
    htp_refused: bool = False


# aimet-torch 2.42: SpinQuant.model_config_dict, fptquant_model_config_dict, adascale_model_config_dict and
# OmniQuant's model_to_block_mapping (the Qwen, Phi-3 and Gemma entries beyond these are vision-language models)
AIMET_SUPPORT: dict[str, AimetSupport] = {
    "spinquant": AimetSupport(("llama", "qwen2", "qwen3", "phi3")),
    "fptquant": AimetSupport(("llama", "qwen2", "qwen3")),
    "adascale": AimetSupport(
        ("llama", "qwen2", "qwen3", "mistral", "phi3"), symmetric_weights_only=True, htp_refused=True
    ),
    "omniquant": AimetSupport(("llama", "qwen2", "mistral"), symmetric_weights_only=True, htp_refused=True),
}


def refusal(technique: str, family: str | None, policy: QuantPolicy) -> str | None:
    """Why AIMET's ``technique`` cannot run on ``family`` (None: not known yet) under ``policy``; None if it can."""
    support = AIMET_SUPPORT[technique]
    if family is not None and family not in support.families:
        return (
            f"AIMET's {technique} supports the families {', '.join(support.families)} (its model registry), "
            f"not {family}"
        )
    if support.symmetric_weights_only and not policy.symmetric_weights:
        return (
            f"AIMET's {technique} quantizes weights symmetrically only (it asserts 'Only symmetric quantization "
            "is supported'): set policy.symmetric_weights: true"
        )
    if support.htp_refused and policy.target == "htp":
        return f"AIMET's {technique} reconstructs Linear weights under this package's placement, not target htp"
    return None


def _transformed_copy(fp_model: PreparedLM) -> PreparedLM:
    model = copy.deepcopy(fp_model)  # the FP model stays the reference of every other row
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _finish_transform(model: PreparedLM, fp_model: PreparedLM) -> None:
    # AIMET's merges leave weights transposed: row-major, so that the model computes as its saved state rebuilt does
    for p in model.parameters():
        p.data = p.data.contiguous()
    ids = fp_model.prefix_ids
    model.set_prefix(None if ids is None else ids[0].tolist())


def spinquant_model(fp_model: PreparedLM, params: SpinQuantParameters | None = None) -> PreparedLM:
    """``fp_model`` rotated by AIMET's SpinQuant (R1; R2 with ``params.spinquant_r2``), merged into the weights."""
    import torch
    from aimet_torch.spinquant import apply_spinquant

    from aimet_quadapter.quant.aimet_private import extra_hadamard_orders

    params = params or SpinQuantParameters()
    model = _transformed_copy(fp_model)
    with extra_hadamard_orders(), torch.no_grad():
        apply_spinquant(model.lm, enable_r1=True, enable_r2=params.spinquant_r2)
    _finish_transform(model, fp_model)
    return model


def fptquant_model(fp_model: PreparedLM, params: FPTQuantParameters | None = None) -> PreparedLM:
    """``fp_model`` with AIMET's FPTQuant transforms (residual rotation, pre-RoPE, value and up/down scaling)
    fitted by its local optimiser and merged into the weights. The one transform that cannot merge (a Hadamard
    computed online on down_proj's input) is left out: the deployed graph holds plain weights (docs/method.md)."""
    import torch

    from aimet_quadapter.quant.aimet_private import extra_hadamard_orders, fptquant

    params = params or FPTQuantParameters()
    model = _transformed_copy(fp_model)
    cached = _fit_file(fp_model, f"fptquant-{params.fptquant_iterations}")
    if not _load_fit(model, cached):
        with extra_hadamard_orders(), fptquant(params.fptquant_iterations) as transforms:
            transforms.insert_fpt_quant_transforms(model.lm, model.config)  # its optimiser trains the transforms
            with torch.no_grad():
                transforms.merge_fpt_quant_transforms(model.lm)
        _save_fit(model, cached)
    _finish_transform(model, fp_model)
    return model


def _fit_file(fp_model: PreparedLM, fit: str) -> Path:
    """Where ``fit``'s weights on ``fp_model`` are kept, keyed by all they depend on (the fitting calls' source too)."""
    import aimet_torch
    import torch

    from aimet_quadapter.quant import aimet_private

    calls = "".join(inspect.getsource(f) for f in (fptquant_model, aimet_private.fptquant))
    digest = hashlib.sha256(f"{fit}:aimet-torch {aimet_torch.__version__}:{calls}".encode())
    for name, p in fp_model.lm.named_parameters():
        digest.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        digest.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
    return cache_root() / "transforms" / f"{fit}-{digest.hexdigest()[:24]}.safetensors"


def _load_fit(model: PreparedLM, path: Path) -> bool:
    """Copy the kept weights into ``model``; False when there are none this model can take."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        return False
    params = dict(model.lm.named_parameters())
    try:
        weights = load_file(path)
    except (OSError, SafetensorError) as e:  # a damaged file: fit again, write it anew
        log.warning("ignoring the cached fit %s: %s", path, e)
        return False
    if weights.keys() != params.keys() or any(weights[n].shape != p.shape for n, p in params.items()):
        log.warning("ignoring the cached fit %s: not this model's parameters", path)
        return False
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    log.info("transformed weights from the cache: %s", path)
    return True


def _save_fit(model: PreparedLM, path: Path) -> None:
    from safetensors.torch import save_file

    weights = {name: p.detach().cpu().contiguous() for name, p in model.lm.named_parameters()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: save_file(weights, tmp))
    except OSError as e:  # a read-only or full cache: the fit is still this run's
        log.warning("could not cache the fit in %s: %s", path, e)


def apply_adascale(
    sim, fp_model: PreparedLM, calibration: Sequence[torch.Tensor], params: AdaScaleParameters | None = None
) -> dict:
    """AIMET's AdaScale on ``sim`` (uncalibrated, its weights its own), then static calibration; ``fp_model`` unread."""
    from aimet_torch.adascale import apply_adascale as aimet_adascale

    from aimet_quadapter.quant.baselines import aimet_forward
    from aimet_quadapter.quant.policy import calibrate
    from aimet_quadapter.quant.quantizers import refresh_prefix

    params = params or AdaScaleParameters()
    batches = list(calibration)
    with tempfile.TemporaryDirectory(prefix="aimet-quadapter-adascale-") as folder:
        aimet_adascale(sim, batches, forward_fn=aimet_forward, num_iterations=params.adascale_iterations,
                       checkpoint_dir=folder)  # fmt: skip
    refresh_prefix(sim.model)  # of the weights AdaScale folded its scales into, before the activations are calibrated
    calibrate(sim, batches)
    return {"adascale_iterations": params.adascale_iterations}


def apply_omniquant(
    sim, fp_model: PreparedLM, calibration: Sequence[torch.Tensor], params: OmniQuantParameters | None = None
) -> dict:
    """AIMET's OmniQuant on ``sim`` (uncalibrated, its weights its own), then static calibration. One sequence a
    batch: AIMET's loss reads the first sequence of each."""
    from aimet_quadapter.quant.aimet_private import omniquant_view
    from aimet_quadapter.quant.baselines import aimet_forward
    from aimet_quadapter.quant.policy import calibrate
    from aimet_quadapter.quant.quantizers import refresh_prefix

    params = params or OmniQuantParameters()
    batches = [row[None] for batch in calibration for row in batch]
    with (
        tempfile.TemporaryDirectory(prefix="aimet-quadapter-omniquant-") as folder,
        omniquant_view(sim) as omniquant,
        warnings.catch_warnings(),
    ):
        # AIMET lists a shared transform scale once per quantizer holding it
        warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate parameters")
        omniquant(
            sim, batches, forward_fn=aimet_forward, num_iterations=params.omniquant_iterations, output_path=folder
        )
    refresh_prefix(sim.model)  # the folded transforms change the keys and values: calibrate on the new ones
    calibrate(sim, list(calibration))
    return {"omniquant_iterations": params.omniquant_iterations}
