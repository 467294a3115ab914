"""The quantization policy and the sim it makes: the paper's placement (weights, the inputs of every Linear and
attention matmul) or AIMET's HTP config (``htp``); docs/method.md lists both. AIMET's JSON config cannot say
"inputs of Linear and MatMul only" (its validator insists on output quantization): the paper's placement is built
with AIMET's defaults and every quantizer then set here."""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, cast

import torch
from aimet_torch.common.defs import QuantScheme
from aimet_torch.nn.modules.custom import MatMul
from aimet_torch.quantization.affine import QuantizeDequantize
from aimet_torch.quantization.encoding_analyzer import (
    EncodingAnalyzer,
    MinMaxEncodingAnalyzer,
    PercentileEncodingAnalyzer,
    TfEnhancedEncodingAnalyzer,
)
from aimet_torch.quantsim import QuantizationSimModel
from aimet_torch.quantsim.config_utils import set_grouped_blockwise_quantization_for_weights
from torch import nn

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.memory import heap_reused
from aimet_quadapter.models import PreparedLM, device_of, head_of, weight_sharing_copy
from aimet_quadapter.models.attention import set_mask_fill
from aimet_quadapter.models.device_ops import RotaryTables, install_device_ops
from aimet_quadapter.quant.aimet_private import htp_config_file, weight_grid_screened
from aimet_quadapter.quant.config import LPBQ_BITS, LPBQ_SCALE_BITS, QUANT_SCHEMES, QuantPolicy
from aimet_quadapter.quant.quantizers import (
    DynamicRanges,
    calibration_passes,
    matching_quantizers,
    quantizers,
    quantizers_by_name,
    quantizers_in,
    refresh_prefix,
    shared_activation_groups,
)

# Masked attention scores under htp: far enough below real scores to leave the softmax, near enough for 8 bits
HTP_MASK_FILL = -50.0


def aimet_quant_scheme(policy: QuantPolicy) -> QuantScheme:
    return getattr(QuantScheme, QUANT_SCHEMES[policy.quant_scheme])


def encoding_analyzer(policy: QuantPolicy, shape: tuple[int, ...]) -> EncodingAnalyzer:
    """The AIMET encoding analyzer for ``policy.quant_scheme``, as AIMET's own quantsim builder picks it."""
    if policy.quant_scheme == "tf_enhanced":
        return TfEnhancedEncodingAnalyzer(shape)
    if policy.quant_scheme == "percentile":
        return PercentileEncodingAnalyzer(shape, percentile=policy.percentile)
    return MinMaxEncodingAnalyzer(shape)


def _is_norm(module: nn.Module) -> bool:
    # by shape, not class: LayerNorm, RMSNorm and their quantized forms carry a 1-D `weight`
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and not isinstance(module, (nn.Linear, nn.Embedding))


def _quantizer(policy: QuantPolicy, shape: tuple[int, ...], bits: int, symmetric: bool) -> QuantizeDequantize:
    return QuantizeDequantize(shape, bits, symmetric, encoding_analyzer=encoding_analyzer(policy, shape))


def _weight_quantizer(module: Any, policy: QuantPolicy) -> QuantizeDequantize:
    # a norm's gamma is a vector: one range for all of it, whatever the weight granularity
    shape = (module.weight.shape[0], 1) if policy.per_channel_weights and not _is_norm(module) else ()
    return _quantizer(policy, shape, policy.weight_bits, policy.symmetric_weights)


def _activation_quantizer(policy: QuantPolicy) -> QuantizeDequantize:
    return _quantizer(policy, (), policy.activation_bits, False)


def apply_policy(sim_model: nn.Module, policy: QuantPolicy, logits_module: nn.Module | None = None) -> None:
    """Set every quantizer of ``sim_model`` as ``policy`` says (in place)."""
    for module in sim_model.modules():
        if not hasattr(module, "param_quantizers"):
            continue
        qm: Any = module  # an AIMET quantized module: its quantizer containers are not typed
        is_linear = isinstance(module, nn.Linear)
        takes_input = is_linear or isinstance(module, MatMul)
        for i in range(len(qm.input_quantizers)):
            qm.input_quantizers[i] = _activation_quantizer(policy) if takes_input else None
        for i in range(len(qm.output_quantizers)):
            keep = policy.quantize_logits and module is logits_module
            qm.output_quantizers[i] = _activation_quantizer(policy) if keep else None
        for name in list(qm.param_quantizers.keys()):
            quantize = name == "weight" and (
                is_linear or isinstance(module, nn.Embedding) or (_is_norm(module) and policy.quantize_norm_weights)
            )
            qm.param_quantizers[name] = _weight_quantizer(module, policy) if quantize else None


def quantize_stream_input(sim_model: nn.Module, model: PreparedLM, policy: QuantPolicy) -> list[str]:
    """Quantize the residual stream where it starts, made outside any module (in place): its two readers in the
    first block each get an input quantizer, which :func:`tie_shared_ranges` gives one range. Returns their names."""
    spec = model.arch.residual
    if spec is None:
        return []
    block = f"lm.{model.arch.blocks}.0"
    names = []
    for path in (f"{block}.{spec.attention[0]}", f"{block}.residual_adds.0"):
        module: Any = sim_model.get_submodule(path)  # an AIMET quantized module
        if module.input_quantizers[0] is None:
            module.input_quantizers[0] = _activation_quantizer(policy)
        names.append(f"{path}.input[0]")
    return names


def quantize_cached_inputs(sim_model: nn.Module, policy: QuantPolicy) -> list[str]:
    """Quantize the keys and values where the attention matmuls read them (in place), for a model with a prefix:
    the prefix's cached keys and values join them there, in one tensor on a device. Returns the names. (AIMET leaves
    these inputs alone when they come from a quantized module through functional ops: without a prefix, what the
    matmul reads is that module's output moved, on its grid on a device too.)"""
    names = []
    for path, module in sim_model.named_modules():
        if isinstance(module, MatMul) and path.rsplit(".", 1)[-1] in ("qk_matmul", "av_matmul"):
            qm: Any = module  # an AIMET quantized module
            if qm.input_quantizers[1] is None:
                qm.input_quantizers[1] = _activation_quantizer(policy)
                names.append(f"{path}.input[1]")
    return names


def unquantize_angles(sim_model: nn.Module) -> list[str]:
    """Take the quantizers off the rotary tables' angles (in place): constants a converter folds into the tables."""
    names = []
    for path, module in sim_model.named_modules():
        if isinstance(module, RotaryTables):
            for op in (module.cos, module.sin):
                qm: Any = op  # an AIMET quantized module
                qm.input_quantizers[0] = None
            names += [f"{path}.cos.input[0]", f"{path}.sin.input[0]"]
    return names


def drop_requantization(sim_model: nn.Module, seq_len: int = 8) -> list[str]:
    """Remove every input quantizer whose input is already a quantizer's output (in place): a device holds that
    tensor once. Found by one forward pass (tensor identity), so a tensor reshaped or rotated on its way (RoPE) keeps
    its quantizer: on a device that op's output is quantized too. Returns the names of the removed quantizers."""
    produced: set[int] = set()  # ids of quantizer outputs alive now: an id is unique while its tensor lives
    doubled: list[tuple[Any, int, str]] = []
    handles = []

    def after(_q, _args, out):
        produced.add(id(out))
        # not kept alive: every weight's quantized copy would be
        weakref.finalize(out, produced.discard, id(out))

    def before(module, index, key):
        def hook(_q, args):
            if id(args[0]) in produced:
                doubled.append((module, index, key))

        return hook

    for path, module in sim_model.named_modules():
        if not hasattr(module, "param_quantizers"):
            continue
        qm: Any = module  # an AIMET quantized module: its quantizer containers are not typed
        for q in [*qm.output_quantizers, *qm.param_quantizers.values()]:
            if q is not None:
                handles.append(q.register_forward_hook(after))
        for i, q in enumerate(qm.input_quantizers):
            if q is not None:
                handles.append(q.register_forward_pre_hook(before(qm, i, f"{path}.input[{i}]")))
    try:
        with torch.no_grad(), DynamicRanges(quantizers_in([sim_model])) as ranges, ranges.off():
            sim_model(torch.zeros((1, seq_len), dtype=torch.long, device=device_of(sim_model)))
    finally:
        for handle in handles:
            handle.remove()
    for module, index, _ in doubled:
        module.input_quantizers[index] = None
    return [key for _, _, key in doubled]


def tie_shared_ranges(sim_model: nn.Module) -> list[list[str]]:
    """Give the quantizers of one tensor (the inputs of q, k and v) one range (in place): separate modules sharing
    their ``min`` / ``max`` parameters, as a device holds the tensor once: calibration writes one range through each,
    a learned range gets every reader's gradient, a trained state exports as it is. Returns the tied groups."""
    found = quantizers_by_name(sim_model)
    groups = shared_activation_groups(sim_model)
    for keys in groups:
        first, *others = (found[k] for k in keys)
        for q in others:
            if q.bitwidth != first.bitwidth or q.min.shape != first.min.shape:
                raise QuadapterError(f"quantizers of one tensor differ in bits or shape: {', '.join(keys)}")
            for name in ("min", "max"):
                # AIMET's own registration, so that is_initialized() follows the shared parameter
                q.register_quantization_parameter(name, getattr(first, name))
    return groups


def _weight_quantized(module: Any) -> bool:
    quantizers = getattr(module, "param_quantizers", None)
    return quantizers is not None and "weight" in quantizers and quantizers["weight"] is not None


def apply_lpbq(sim: QuantizationSimModel, policy: QuantPolicy) -> list[str]:
    """AIMET's LPBQ on the weight of every quantized Linear but lm_head (in place, before calibration), blocks of
    ``policy.lpbq_block_size`` input channels; lm_head stays 8-bit, as Qualcomm's W4A16 LLMs hold it (its error
    reaches every logit unmixed, and it is one layer of many). Returns paths."""
    size = policy.lpbq_block_size
    if size is None:
        return []
    head = sim.model.head()
    chosen: list[tuple[str, Any]] = [  # AIMET quantized modules: their quantizer containers are not typed
        (path, m)
        for path, m in sim.model.named_modules()
        if isinstance(m, nn.Linear) and m is not head and _weight_quantized(m)
    ]
    for path, m in chosen:
        if m.in_features % size:
            raise QuadapterError(
                f"policy.lpbq_block_size {size} does not divide {path}'s {m.in_features} input channels: take a "
                f"divisor of every Linear's input width"
            )
    set_grouped_blockwise_quantization_for_weights(
        sim, [m for _, m in chosen], LPBQ_BITS, True, LPBQ_SCALE_BITS, block_size=size, block_grouping=-1
    )
    return [path for path, _ in chosen]


def apply_bit_overrides(sim_model: nn.Module, policy: QuantPolicy) -> dict[str, int]:
    """Give the quantizers ``policy.bit_overrides`` names their bit-width (in place, before calibration), and all
    readers of a tensor one of them reads. Returns every bit-width set; a pattern matching nothing fails."""
    pairs = policy.overrides()
    if not pairs:
        return {}
    found = quantizers_by_name(sim_model)
    bits: dict[str, int] = {}
    for width, hits in matching_quantizers(found, pairs, "policy.bit_overrides"):
        bits.update(dict.fromkeys(hits, width))
    for group in shared_activation_groups(sim_model):
        widths = {bits[k] for k in group if k in bits}
        if widths:
            bits.update(dict.fromkeys(group, max(widths)))
    for key, width in bits.items():
        found[key].bitwidth = width
    return bits


def build_sim(
    model: PreparedLM,
    policy: QuantPolicy = QuantPolicy(),
    seq_len: int = 16,
    in_place: bool = False,
    share_weights: bool = False,
) -> QuantizationSimModel:
    """A ``QuantizationSimModel`` of a deep copy of ``model`` under ``policy`` (``in_place``: of ``model``).
    ``share_weights``: of a :func:`~aimet_quadapter.models.weight_sharing_copy`, whose in-place writes (a training
    loop of one's own on ``sim.model``) would reach the FP model's weights: for callers whose every change gives the
    weights new data, as this package's methods do."""
    if share_weights:
        if in_place:
            raise ValueError("build_sim: share_weights makes a copy; in_place uses the model itself")
        model, in_place = cast(PreparedLM, weight_sharing_copy(model)), True
    if policy.target == "htp":
        if not in_place:  # the device's ops go into the sim's copy, never into the FP model
            model, in_place = copy.deepcopy(model), True
        install_device_ops(model)
    dummy = torch.zeros((1, seq_len), dtype=torch.long, device=device_of(model))
    with warnings.catch_warnings():
        # AIMET's TorchScript trace: warnings the user cannot act on
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        sim = QuantizationSimModel(
            model,
            dummy,
            in_place=in_place,
            quant_scheme=aimet_quant_scheme(policy),
            default_output_bw=policy.activation_bits,
            default_param_bw=policy.weight_bits,
            config_file=htp_config_file() if policy.target == "htp" else None,
        )
    if policy.target == "htp":
        _as_the_device_holds_it(sim, model, policy)
    else:
        apply_policy(sim.model, policy, logits_module=sim.model.head())
    apply_bit_overrides(sim.model, policy)
    tie_shared_ranges(sim.model)
    sim.model.to(dummy.device)  # the policy's quantizers are made on the CPU; AIMET placed its own already
    sim.quadapter_policy = policy  # so that a saved state can rebuild the same sim
    sim.model.eval()
    for p in sim.model.parameters():
        p.requires_grad_(False)
    # through the sim's own ops, as training refreshes it (the FP model's ops round otherwise: htp's device ops,
    # AIMET's wrappers): a sim rebuilt from a state then scores as the one it saved
    refresh_prefix(sim.model)
    return sim


def _as_the_device_holds_it(sim: QuantizationSimModel, model: PreparedLM, policy: QuantPolicy) -> None:
    set_mask_fill(sim.model, HTP_MASK_FILL)
    if policy.quant_scheme == "percentile":
        sim.set_percentile_value(policy.percentile)
    quantize_stream_input(sim.model, model, policy)
    if model.prefix_ids is not None:
        quantize_cached_inputs(sim.model, policy)
    unquantize_angles(sim.model)
    drop_requantization(sim.model)
    apply_lpbq(sim, policy)  # after the dynamic-range pass above, which takes no block-wise grid


def sim_policy(sim: QuantizationSimModel) -> QuantPolicy:
    """The policy :func:`build_sim` built a sim with (the default one for a sim built elsewhere)."""
    return getattr(sim, "quadapter_policy", QuantPolicy())


def run_batches(model: nn.Module, batches: Iterable[torch.Tensor]) -> None:
    """AIMET's ``forward_pass_callback``: forward every batch, no gradients."""
    device = device_of(model)
    with torch.no_grad():
        for batch in batches:
            model(batch.to(device))


def _calibration_batches(model: nn.Module, batches: Iterable[torch.Tensor]) -> None:
    with calibration_passes(model):
        run_batches(model, batches)


def calibrate(sim: QuantizationSimModel, batches: Iterable[torch.Tensor]) -> None:
    """Static calibration: AIMET's ``compute_encodings`` over the calibration batches."""
    with warnings.catch_warnings():
        # AIMET's bias-overflow check: torch's advice is for AIMET
        warnings.filterwarnings("ignore", message="To copy construct from a tensor", category=UserWarning)
        with heap_reused(head=head_of(sim.model)), weight_grid_screened():
            sim.compute_encodings(_calibration_batches, list(batches))


def describe(sim_model: nn.Module) -> list[dict]:
    """One row per quantizer: tensor, bits, symmetric or not, granularity and range once calibrated."""
    rows = []
    for path, role, q in quantizers(sim_model):
        row = {
            "tensor": f"{path}.{role}",
            "kind": "weight" if not role.startswith(("input", "output")) else "activation",
            "bits": q.bitwidth,
            "symmetric": bool(q.symmetric),
            "granularity": _granularity(q),
        }
        if q.is_initialized():
            row["min"] = float(q.get_min().min())
            row["max"] = float(q.get_max().max())
        rows.append(row)
    return rows


def _granularity(q: QuantizeDequantize) -> str:
    if q.block_size is not None:
        blocks = max(b for b in q.block_size if b > 0)
        lpbq = "LPBQ " if getattr(q, "decompressed_bw", None) is not None else ""
        return f"{lpbq}blocks of {blocks}{tuple(q.shape)}"
    return "per-tensor" if q.shape == () or all(s == 1 for s in q.shape) else f"per-channel{tuple(q.shape)}"


def format_description(rows: list[dict]) -> str:
    width = max((len(r["tensor"]) for r in rows), default=10)
    lines = [f"{'tensor':<{width}}  kind        bits  sym    granularity        range"]
    for r in rows:
        rng = f"[{r['min']:.4g}, {r['max']:.4g}]" if "min" in r else "(not calibrated)"
        sym, gran = str(r["symmetric"]), r["granularity"]
        lines.append(f"{r['tensor']:<{width}}  {r['kind']:<10}  {r['bits']:>4}  {sym:<5}  {gran:<17}  {rng}")
    n_w = sum(r["kind"] == "weight" for r in rows)
    lines.append(f"{len(rows)} quantizers: {n_w} weight, {len(rows) - n_w} activation")
    return "\n".join(lines)
