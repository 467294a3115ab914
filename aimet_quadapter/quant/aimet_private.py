"""Every call into AIMET's private API (aimet-torch 2.42): no other module names an underscored AIMET symbol.

When AIMET changes one, this module is the one to fix; tests/test_methods.py, test_quadapter.py,
test_aimet_techniques.py, test_device_check.py, test_export.py and test_policy.py say which. (Named for what it
wraps: quadapter/adapter.py is the technique's own.)
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from aimet_torch.quantization.affine import QuantizeDequantize
from aimet_torch.utils import _enable_qtensor_casting


def qtensor_casting(enabled: bool) -> AbstractContextManager:
    """Whether quantizers return AIMET's ``DequantizedTensor`` (True) or plain tensors (False)."""
    return _enable_qtensor_casting(enabled)


def precomputed_encodings(q: QuantizeDequantize) -> AbstractContextManager:
    """Build ``q``'s scale and offset once instead of at every call, while nothing trains its range."""
    return q._precompute_encodings(dtype=q.min.dtype)


def minimum_scale(num_steps: int) -> float:
    """The smallest scale AIMET lets a grid of ``num_steps`` steps take (``get_scale`` clamps to it)."""
    from aimet_torch.common.quantsim import _get_minimum_scale

    return _get_minimum_scale(num_steps)


def seq_mse_weight_bitwidth_limit() -> int:
    """The weight bit-width above which AIMET's SeqMSE leaves a layer alone (4 in aimet-torch 2.42)."""
    import aimet_torch._base.seq_mse as seq_mse_base

    return seq_mse_base.SUPPORTED_PARAM_BW


@contextmanager
def seq_mse_bitwidth_limit(limit: int) -> Iterator[None]:
    """Temporarily raise that limit (SeqMSE's search is bit-width agnostic; the limit is a policy of AIMET's)."""
    import aimet_torch._base.seq_mse as seq_mse_base

    before = seq_mse_base.SUPPORTED_PARAM_BW
    seq_mse_base.SUPPORTED_PARAM_BW = limit
    try:
        yield
    finally:
        seq_mse_base.SUPPORTED_PARAM_BW = before


@contextmanager
def wrapped_aimet_onnx_export(wrapper: Callable[..., Any]) -> Iterator[None]:
    """Inside, AIMET's ONNX exports call ``wrapper(original, module, args, f, **kwargs)`` instead of torch's
    exporter: after AIMET swaps its quantize-dequantized weights in, before it rewrites the file."""
    from aimet_torch.experimental import onnx as aimet_onnx_export

    original = aimet_onnx_export.export

    def export(module, args, f, **kwargs):
        return wrapper(original, module, args, f, **kwargs)

    aimet_onnx_export.export = export
    try:
        yield
    finally:
        aimet_onnx_export.export = original


class _ModuleWith(types.ModuleType):
    """``module`` with some of its attributes replaced, for one module that imported it to see."""

    def __init__(self, module: types.ModuleType, **replaced: Any):
        super().__init__(module.__name__)
        self.__dict__.update(replaced)
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


@contextmanager
def transposed_weights_written_out() -> Iterator[list[str]]:
    """Inside, AIMET's ONNX export writes its transposed copies of external Linear weights straight to their file,
    not into protobuf arenas that keep them until it returns. Yields the names of the tensors that went this way.

    (AIMET moves each copy's bytes to a file and clears them, but protobuf's upb runtime keeps a cleared field's
    bytes in the message's arena, and the pass keeps every message: a copy of all Linear weights.)"""
    import sys

    import aimet_torch.onnx as aimet_onnx
    import onnx
    from onnx.external_data_helper import set_external_data, uses_external_data

    real_onnx, written = aimet_onnx.onnx, []

    def from_array(array: Any, name: str | None = None) -> Any:
        made = onnx.numpy_helper.from_array(array, name)
        caller = sys._getframe(1)
        source, base_dir = caller.f_locals.get("tensor"), caller.f_locals.get("base_dir")
        if caller.f_code.co_name != "transpose_2d" or not isinstance(base_dir, str):
            return made
        if not isinstance(source, onnx.TensorProto) or not uses_external_data(source):
            return made
        location = made.name.replace("/", "_")  # AIMET's own file for it
        with open(os.path.join(base_dir, location), "wb") as f:
            f.write(made.raw_data)
        bare = onnx.TensorProto(name=made.name, data_type=made.data_type, dims=made.dims, raw_data=b"")
        set_external_data(bare, location=location, offset=0, length=len(made.raw_data))  # asks for the field
        bare.ClearField("raw_data")
        written.append(made.name)
        return bare  # ``made`` and its arena go now

    aimet_onnx.onnx = _ModuleWith(real_onnx, numpy_helper=_ModuleWith(real_onnx.numpy_helper, from_array=from_array))
    try:
        yield written
    finally:
        aimet_onnx.onnx = real_onnx


@contextmanager
def qdq_weights_module_by_module(after_each: Callable[[], None]) -> Iterator[None]:
    """Inside, AIMET's exports swap in quantize-dequantized weights one outermost quantized module at a time,
    calling ``after_each()`` after each, so that the originals can leave as their copies arrive."""
    from aimet_torch.nn import BaseQuantizationMixin
    from aimet_torch.quantsim import QuantizationSimModel

    original = QuantizationSimModel.__dict__["_apply_qdq_to_model_parameters"]

    def outermost(model: Any) -> Iterator[Any]:
        covered: set[int] = set()
        for module in model.modules():  # each module once, parents first
            if id(module) not in covered and isinstance(module, BaseQuantizationMixin):
                covered.update(id(m) for m in module.modules())  # AIMET's pass covers what it holds
                yield module

    def module_by_module(cls: type, model: Any) -> ExitStack:
        stack = ExitStack()
        try:
            for module in outermost(model):
                stack.enter_context(original.__func__(cls, module))
                after_each()
        except BaseException:
            stack.close()  # the weights already swapped go back, as AIMET's own pass does
            raise
        return stack

    QuantizationSimModel._apply_qdq_to_model_parameters = classmethod(module_by_module)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        QuantizationSimModel._apply_qdq_to_model_parameters = original  # type: ignore[method-assign]


# Hadamard orders AIMET lacks (it builds factor x 2^n for 12, 20, 28), as Kronecker factors (a Kronecker product of
# Hadamard matrices is one): 144 = 12 x 12 gives SmolLM2's hidden size, 576 = 144 x 4
EXTRA_HADAMARD_FACTORS = {144: (12, 12)}


@contextmanager
def fake_quantize_replaced(fn: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """AIMET's fixed-range fake-quant call, ``(tensor, scale, offset, qmin, qmax) -> tensor``, replaced by ``fn``:
    every quantizer's path while no gradient is recorded. Yields AIMET's own, for ``fn`` to hand calls back to."""
    from aimet_torch.quantization.affine.backends import torch_builtins

    before = torch_builtins._torch_fake_quantize
    torch_builtins._torch_fake_quantize = fn
    try:
        yield before
    finally:
        torch_builtins._torch_fake_quantize = before


# How many of a weight's per-channel blocks the grid screen below reads whole (AIMET's own sample: 64 blocks)
GRID_SCREEN_BLOCKS = 64


@contextmanager
def weight_grid_screened() -> Iterator[None]:
    """AIMET's search for the grid a symmetric weight lies on, refused at once where one of its first
    :data:`GRID_SCREEN_BLOCKS` per-channel blocks holds more distinct magnitudes than the grid has levels.

    AIMET applies that test to the first ``2 x levels`` elements of those blocks only: a weight expanded from smaller
    asymmetric blocks (GGUF's Q4_1) passes the sample, and the full search then runs and fails. Other layouts
    (per-tensor, blockwise) go to AIMET's search unscreened."""
    import aimet_torch.nn.base as aimet_base
    from aimet_torch.utils import _DecompositionError

    search = aimet_base._decompose_prequantized_tensor

    def screened(tensor, qmin, qmax, scale_shape, block_size=None, zero_point_shift=0.0):
        per_channel = (
            block_size is None
            and tensor.ndim >= 2
            and tuple(scale_shape) == (tensor.shape[0],) + (1,) * (tensor.ndim - 1)
        )
        if per_channel:
            levels = max(abs(qmin), abs(qmax)) + 1
            rows = tensor.detach()[:GRID_SCREEN_BLOCKS].reshape(-1, tensor[0].numel()).float().abs().sort(dim=1).values
            distinct = (rows[:, 1:] != rows[:, :-1]).sum(dim=1) + 1
            if bool((distinct > levels).any()):
                raise _DecompositionError(f"a per-channel block holds more than {levels} distinct magnitudes")
        return search(
            tensor, qmin, qmax, scale_shape=scale_shape, block_size=block_size, zero_point_shift=zero_point_shift
        )

    aimet_base._decompose_prequantized_tensor = screened
    try:
        yield
    finally:
        aimet_base._decompose_prequantized_tensor = search


@contextmanager
def extra_hadamard_orders() -> Iterator[None]:
    """While inside, AIMET's Hadamard builder also knows the orders :data:`EXTRA_HADAMARD_FACTORS` give."""
    import numpy as np
    from aimet_torch.common.hadamard import hadamard_utils

    known = hadamard_utils.SUPPORTED_FACTORS
    added = {}
    for order, (a, b) in EXTRA_HADAMARD_FACTORS.items():
        if order not in known:
            added[order] = lambda a=a, b=b: np.kron(np.array(known[a]()), np.array(known[b]()))
    known.update(added)
    try:
        yield
    finally:
        for order in added:
            known.pop(order, None)


@contextmanager
def fptquant(iterations: int) -> Iterator[Any]:
    """AIMET's FPTQuant class with its mergeable transforms only (the online Hadamard on down_proj's input stays
    a graph op after merging, which the export does not hold) and ``iterations`` steps of its local optimiser;
    both are class attributes of AIMET's, put back on exit."""
    from aimet_torch.experimental.fptquant.fptquant_local_transform_optimizer import LocalTransformOptimizer
    from aimet_torch.experimental.fptquant.fptquant_optimizer import FPTQuant

    saved = FPTQuant._enable_down_project_transform, LocalTransformOptimizer.num_iterations
    FPTQuant._enable_down_project_transform = False
    LocalTransformOptimizer.num_iterations = iterations
    try:
        yield FPTQuant
    finally:
        FPTQuant._enable_down_project_transform, LocalTransformOptimizer.num_iterations = saved


@contextmanager
def omniquant_view(sim: Any) -> Iterator[Callable[..., Any]]:
    """AIMET's ``apply_omniquant``, with ``sim.model`` showing it a Hugging Face model's ``model`` and ``device``."""
    from aimet_torch.experimental.omniquant import apply_omniquant

    from aimet_quadapter.models import device_of

    model = sim.model
    before = {m: dict(m.param_quantizers.items()) for m in model.modules() if hasattr(m, "param_quantizers")}
    object.__setattr__(model, "model", model.lm)  # a plain attribute: not a second registered child
    object.__setattr__(model, "device", device_of(model))
    try:
        yield apply_omniquant
    finally:
        for name in ("model", "device"):
            model.__dict__.pop(name, None)
        _plain_weight_quantizers(before)


def _plain_weight_quantizers(before: dict) -> None:
    """OmniQuant's quantizers back to plain ones with the learned range, locked, or to none where there was none."""
    from aimet_torch.experimental.omniquant.let_quantizer import OmqQuantizeDequantize

    for module, quantizers in before.items():
        for name, q in list(module.param_quantizers.items()):
            if not isinstance(q, OmqQuantizeDequantize):
                continue
            if not isinstance(q, QuantizeDequantize) or quantizers.get(name) is None:
                module.param_quantizers[name] = quantizers.get(name)
                continue
            plain = QuantizeDequantize(q.shape, q.bitwidth, q.symmetric, block_size=q.block_size).to(q.min.device)
            plain.set_range(q.min.detach(), q.max.detach())
            # as AIMET locks AdaScale's and SeqMSE's: calibration would otherwise recompute the range from the
            # quantize-dequantized weights, close to the learned one but not it
            plain.allow_overwrite(False)
            module.param_quantizers[name] = plain


def add_missing_onnx_quantizers(sim: Any, params: list[str], activations: list[str]) -> None:
    """aimet-onnx's step adding a quantizer, disabled until an encoding loads, for each tensor ``sim`` lacks one for.
    Its loader takes it for a 1.0.0 file only; a 2.0.0 file does not say which tensors are parameters."""
    from aimet_onnx.quantsim import _add_missing_quantizers

    _add_missing_quantizers(sim, params, activations)


def release_fused_graph() -> None:
    """Let go of the graph, and its weights, that aimet-onnx's global fusion rules keep; safe between builds.
    Each rule's matcher (onnxscript's, module globals) keeps the last graph, node and match it saw, and with them the
    source model's ModelProto for the life of the process; it sets all four afresh for each match."""
    from aimet_onnx.graph_passes.fusions.fusion_registry import FUSION_PASS_REGISTRY

    for rules in FUSION_PASS_REGISTRY.passes.values():
        for rule in rules:
            matcher = getattr(rule, "_matcher", None)
            for state in ("_graph", "_current_node", "_match", "_tracer"):
                if hasattr(matcher, state):
                    setattr(matcher, state, None)


# The Hexagon (HTP) generation whose quantsim config the `htp` target uses: AIMET ships one per generation.
HTP_VERSION = "v75"


def htp_config_file(version: str = HTP_VERSION, package: str = "aimet_torch") -> str:
    """The path of AIMET's own HTP quantsim config as ``package`` (aimet_torch or aimet_onnx) ships it (package
    data, not an API: it may move between releases)."""
    import importlib

    root = os.path.dirname(importlib.import_module(package).__file__ or "")
    path = os.path.join(root, "common", "quantsim_config", f"htp_quantsim_config_{version}.json")
    if not os.path.isfile(path):
        from aimet_quadapter.errors import QuadapterError

        raise QuadapterError(f"AIMET's HTP config {path} is missing: this {package} does not ship HTP {version}")
    return path
