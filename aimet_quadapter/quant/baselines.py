"""AIMET's own PTQ techniques (AdaRound, Sequential MSE) under this package's policy, with what each changed."""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from aimet_torch.quantization.affine import QuantizeDequantize
from aimet_torch.quantsim import QuantizationSimModel
from torch import nn

from aimet_quadapter import distributed
from aimet_quadapter.models import PreparedLM, device_of
from aimet_quadapter.models.attention import set_mask_fill
from aimet_quadapter.quant.aimet_private import htp_config_file, seq_mse_bitwidth_limit
from aimet_quadapter.quant.config import AdaroundParameters, QuantPolicy, SeqMseParameters
from aimet_quadapter.quant.policy import HTP_MASK_FILL, aimet_quant_scheme, calibrate, sim_policy
from aimet_quadapter.quant.quantizers import refresh_prefix


def aimet_forward(model: nn.Module, batch: torch.Tensor):
    """AIMET's ``forward_fn(model, inputs)`` for every technique: id tensors, moved to the model's device."""
    return model(batch.to(device_of(model)))


def aimet_config(policy: QuantPolicy) -> dict:
    """An AIMET quantsim config whose weight quantizers match ``policy`` (AdaRound builds its own sim)."""
    return {
        "defaults": {
            "ops": {"is_output_quantized": "True"},
            "params": {"is_quantized": "True", "is_symmetric": str(policy.symmetric_weights)},
            "strict_symmetric": "False",
            "per_channel_quantization": str(policy.per_channel_weights),
        },
        "params": {"bias": {"is_quantized": "False"}},
        "op_type": {},
        "supergroups": [],
        "model_input": {"is_input_quantized": "True"},
        "model_output": {},
    }


def linear_weight_quantizers(sim_model: nn.Module) -> dict[str, tuple[nn.Module, QuantizeDequantize]]:
    """module path -> (module, weight quantizer) for every quantized Linear: what AdaRound and SeqMSE touch."""
    out: dict[str, tuple[nn.Module, QuantizeDequantize]] = {}
    for path, module in sim_model.named_modules():
        if isinstance(module, nn.Linear) and hasattr(module, "param_quantizers"):
            qm: Any = module  # an AIMET quantized module: its quantizer containers are not typed
            q = dict(qm.param_quantizers.items()).get("weight")
            if q is not None:
                out[path] = (module, q)
    return out


def apply_adaround(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    calibration: Sequence[torch.Tensor],
    params: AdaroundParameters,
    out_dir: Path | None = None,
    calibrate_after: bool = True,
) -> dict:
    """AIMET AdaRound of ``fp_model``'s Linear weights into ``sim`` (a sim of ``fp_model``), their encodings frozen,
    then calibrated unless ``calibrate_after`` is False. Returns what it did."""
    policy = sim_policy(sim)
    batches = list(calibration)
    with tempfile.TemporaryDirectory() as tmp:
        # each process (torchrun) writes its own encodings file; the first one keeps a copy
        folder = Path(tmp)
        rounded, num_batches = _aimet_adaround(fp_model, batches, params, policy, folder)
        encodings = folder / "adaround.encodings"
        frozen = len(json.loads(encodings.read_text())["param_encodings"])
        if out_dir is not None and distributed.is_main():
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(encodings, Path(out_dir) / "adaround.encodings")
        with torch.no_grad():  # every weight, as a sim built from the rounded model would hold
            mine = dict(sim.model.named_parameters())
            for name, value in rounded.named_parameters():
                mine[name].data = value.detach()  # new data: the sim's weights may be the FP model's storage
        sim.set_and_freeze_param_encodings(str(encodings))
    refresh_prefix(sim.model)  # of the rounded weights, before the activations are calibrated on it
    if calibrate_after:
        calibrate(sim, batches)
    return {
        "adaround_iterations": params.adaround_iterations,
        "adaround_batches": num_batches,
        "adaround_frozen_encodings": frozen,
        "adaround_flipped_fraction": _flipped_fraction(fp_model, sim),
    }


def _aimet_adaround(
    fp_model: PreparedLM, batches: list[torch.Tensor], params: AdaroundParameters, policy: QuantPolicy, folder: Path
) -> tuple[torch.nn.Module, int]:
    """AIMET's AdaRound of ``fp_model``, encodings written into ``folder``: the rounded copy, the batches it read."""
    from aimet_torch.adaround.adaround_weight import Adaround
    from aimet_torch.adaround.adaround_weight import AdaroundParameters as AimetAdaroundParameters

    if policy.target == "htp":  # AdaRound's sim places its weight quantizers as the target's sim does
        config = Path(htp_config_file())
    else:
        config = folder / "quantsim_config.json"
        config.write_text(json.dumps(aimet_config(policy)))
    ada_params = AimetAdaroundParameters(
        data_loader=batches,
        num_batches=min(params.adaround_batches or len(batches), len(batches)),
        default_num_iterations=params.adaround_iterations,
        default_reg_param=params.adaround_reg_param,
        forward_fn=aimet_forward,
    )
    dummy = torch.zeros((1, 16), dtype=torch.long, device=device_of(fp_model))
    if policy.target == "htp":  # AIMET quantizes the softmax input of its own sim of the FP model too
        set_mask_fill(fp_model, HTP_MASK_FILL)
    try:
        with warnings.catch_warnings():
            # AIMET's trace and its losses' float(): nothing the user can act on
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar")
            rounded = Adaround.apply_adaround(
                fp_model,
                dummy,
                ada_params,
                path=str(folder),
                filename_prefix="adaround",
                default_param_bw=policy.weight_bits,
                default_quant_scheme=aimet_quant_scheme(policy),
                default_config_file=str(config),
            )
    finally:
        set_mask_fill(fp_model, None)
    return rounded, ada_params.num_batches


@torch.no_grad()
def _flipped_fraction(fp_model: nn.Module, sim: QuantizationSimModel) -> float:
    """Share of Linear weights whose quantized value differs from rounding the FP weight to nearest."""
    changed = total = 0
    for path, (module, q) in linear_weight_quantizers(sim.model).items():
        nearest = q(fp_model.get_submodule(path).weight).as_subclass(torch.Tensor)
        rounded = q(module.weight).as_subclass(torch.Tensor)
        changed += int((nearest != rounded).sum())
        total += nearest.numel()
    return changed / max(total, 1)


def apply_seq_mse(
    sim: QuantizationSimModel,
    fp_model: PreparedLM,
    calibration: Sequence[torch.Tensor],
    params: SeqMseParameters,
    calibrate_after: bool = True,
    within_ranges: bool = False,
) -> dict:
    """AIMET Sequential MSE on ``sim``, then calibrated unless ``calibrate_after`` is False; ``within_ranges``:
    candidates are fractions of the sim's own weight ranges. ``fp_model`` is not read. Returns how many ranges moved.
    """
    import logging

    from aimet_torch.seq_mse import apply_seq_mse as aimet_seq_mse

    logging.getLogger("SeqMse").setLevel(logging.ERROR)  # one INFO line per layer otherwise
    batches = list(calibration)
    limit = max(sim_policy(sim).weight_bits, 4) if params.seq_mse_any_bits else 4
    if within_ranges:  # AIMET's first min-max pass skips a locked quantizer; its candidates scale what it holds
        for _, q in linear_weight_quantizers(sim.model).values():
            q.allow_overwrite(False)
    with seq_mse_bitwidth_limit(limit):
        aimet_seq_mse(sim, batches, num_candidates=params.seq_mse_candidates, forward_fn=aimet_forward)
    if calibrate_after:
        calibrate(sim, batches)
    return {"seq_mse_candidates": params.seq_mse_candidates, **seq_mse_changes(sim)}


@torch.no_grad()
def seq_mse_changes(sim: QuantizationSimModel) -> dict:
    """How far SeqMSE moved each Linear weight range from plain min/max: changed when either end moved by more than
    half a step (SeqMSE moves even an unchanged range by a fraction of one)."""
    clipped = 0
    ratios = []
    for _, (module, q) in linear_weight_quantizers(sim.model).items():
        ref = QuantizeDequantize(q.shape, q.bitwidth, q.symmetric).to(module.weight.device)
        with ref.compute_encodings():
            ref(module.weight)
        lo0, hi0, lo1, hi1 = ref.get_min(), ref.get_max(), q.get_min(), q.get_max()
        step = (hi0 - lo0) / (2**q.bitwidth - 1)
        clipped += bool(((lo1 - lo0).abs() > step / 2).any() or ((hi1 - hi0).abs() > step / 2).any())
        ratios.append(float(((hi1 - lo1) / (hi0 - lo0)).mean()))
    return {
        "seq_mse_layers": len(ratios),
        "seq_mse_layers_changed": clipped,
        "seq_mse_mean_range_ratio": sum(ratios) / max(len(ratios), 1),
    }
