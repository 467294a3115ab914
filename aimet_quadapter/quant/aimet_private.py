"""Every call into AIMET's private API, in one place (checked against aimet-torch 2.42).

This module is the one place AIMET's private calls sit: the shims over its underscored symbols (QTensor casting,
precomputed encodings, the minimum scale, Sequential MSE's bit-width limit, its ONNX export and QDQ passes, the
transposed weights of that export, its fixed-range fake-quant call), the Hadamard orders AIMET lacks, the screen
before its weight-grid search, the patches FPTQuant and OmniQuant run under, the path of AIMET's HTP quantsim
config inside its install (package data, not an API), aimet-onnx's step that adds the quantizers an encodings file
needs, and the release of the graph its supergroup fusion keeps. Nothing else in the package names an underscored
AIMET symbol: when AIMET changes one of these, this module is the one to fix, and its tests (tests/test_methods.py,
tests/test_quadapter.py, tests/test_aimet_techniques.py, tests/test_device_check.py, tests/test_export.py,
tests/test_policy.py) say which. (Named for what it wraps, not "adapter": quadapter/adapter.py is the technique's
own.)
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
    """AIMET's ONNX exports (``sim.onnx.export``, ``aimet_torch.onnx.export``) call torch's exporter through
    one private function; inside, ``wrapper(original, module, args, f, **kwargs)`` is called instead, after
    AIMET has swapped its quantize-dequantized weights in and before it reads back and rewrites the file."""
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
    """AIMET's ONNX export makes a transposed copy of each Linear weight it read from external data
    (``transpose_2d`` in ``_fold_linear_weight_transpose``), moves its bytes to a file and clears them; protobuf's
    upb runtime keeps a cleared field's bytes in the message's arena, and the pass keeps every such message until
    it returns, so a copy of all Linear weights stays in memory. Inside, each of those copies is made without
    bytes: they go to the same file AIMET would write, under the same external-data fields. Yields the names of
    the tensors that went this way; other ``from_array`` calls are AIMET's own."""
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
    """AIMET's exports swap the weights of every quantized module for quantize-dequantized copies in one pass
    (``_apply_qdq_to_model_parameters``) before tracing; inside, that pass goes one outermost quantized module
    at a time and calls ``after_each()`` after each, so that the originals can leave as their copies arrive."""
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


# Hadamard orders AIMET lacks, as factors of factor x 2^n (AIMET: 12, 20, 28): a Kronecker product of Hadamard
# matrices is one. 144 = 12 x 12 gives SmolLM2's hidden size, 576 = 144 x 4.
EXTRA_HADAMARD_FACTORS = {144: (12, 12)}


@contextmanager
def fake_quantize_replaced(fn: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """AIMET's fixed-range fake-quant call (``torch_builtins._torch_fake_quantize``: ``(tensor, scale, offset, qmin,
    qmax) -> tensor``, per tensor and per channel) replaced by ``fn``: the path every quantizer takes while no
    gradient is recorded. Yields AIMET's own, for ``fn`` to hand some calls back to."""
    from aimet_torch.quantization.affine.backends import torch_builtins

    before = torch_builtins._torch_fake_quantize
    torch_builtins._torch_fake_quantize = fn
    try:
        yield before
    finally:
        torch_builtins._torch_fake_quantize = before


# How many of a weight's per-channel blocks the grid screen below reads whole (AIMET's own sample: 64 blocks).
GRID_SCREEN_BLOCKS = 64


@contextmanager
def weight_grid_screened() -> Iterator[None]:
    """AIMET's search for the integer grid a symmetric weight already lies on (``_decompose_prequantized_tensor``,
    run before each weight's min-max calibration), refused at once where one of the weight's first
    :data:`GRID_SCREEN_BLOCKS` per-channel blocks holds more distinct magnitudes than the grid has levels.

    That is AIMET's own test, which it applies to the first ``2 x levels`` elements of those blocks only: a weight
    expanded from smaller asymmetric blocks (GGUF's Q4_1: 32 elements, 16 levels each) passes that sample, and the
    full search then runs and fails. Read whole, such a block fails the test; a weight on a grid passes it and
    meets AIMET's search as before. Other layouts (per-tensor, blockwise) go to AIMET's search unscreened."""
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
            rows = tensor.detach()[:GRID_SCREEN_BLOCKS].reshape(-1, tensor[0].numel()).float().abs()
            rows = rows.sort(dim=1).values
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
    """While inside, AIMET's Hadamard builder (SpinQuant's and FPTQuant's) also knows the orders
    :data:`EXTRA_HADAMARD_FACTORS` give, each a true Hadamard matrix (entries +-1, H H^T = n I); the orders it
    knows are built as before."""
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
    """AIMET's ``apply_omniquant``, with ``sim.model`` (a PreparedLM) showing it the attributes it reads of a
    Hugging Face model (``model``: the decoder's backbone holder, ``device``) for as long as it runs."""
    from aimet_torch.experimental.omniquant import apply_omniquant

    from aimet_quadapter.models import device_of

    model = sim.model
    before = {
        module: dict(module.param_quantizers.items())
        for module in model.modules()
        if hasattr(module, "param_quantizers")
    }
    object.__setattr__(model, "model", model.lm)  # a plain attribute: not a second registered child
    object.__setattr__(model, "device", device_of(model))
    try:
        yield apply_omniquant
    finally:
        for name in ("model", "device"):
            model.__dict__.pop(name, None)
        _plain_weight_quantizers(before)


def _plain_weight_quantizers(before: dict) -> None:
    """AIMET's OmniQuant leaves its own quantizer class on every weight it touched (one that applies its scales,
    folded by then), and one on weights that had none: each goes back to a plain ``QuantizeDequantize`` with the
    learned range, locked against ``compute_encodings``, or to none."""
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
            # locked, as AIMET locks AdaScale's and SeqMSE's: the static calibration after it would otherwise
            # recompute the range from the quantize-dequantized weights, close to the learned one but not it
            plain.allow_overwrite(False)
            module.param_quantizers[name] = plain


def add_missing_onnx_quantizers(sim: Any, params: list[str], activations: list[str]) -> None:
    """aimet-onnx's own step for an encodings file naming tensors its ``sim`` holds no quantizer for: one added
    (disabled until an encoding loads) for each. Its loader takes it for a 1.0.0 file only; a 2.0.0 file, which
    does not say which tensors are parameters, is refused instead."""
    from aimet_onnx.quantsim import _add_missing_quantizers

    _add_missing_quantizers(sim, params, activations)


def release_fused_graph() -> None:
    """Let go of the graph aimet-onnx's supergroup fusion last matched. Its rewrite rules are module globals
    (onnxscript's), and each rule's matcher keeps the last graph, node and match it saw: through them the IR of the
    model a quantsim was built from, and the ModelProto under it, with every weight, stay alive beside the sim's
    own fused copy for as long as the process runs. Safe between builds: a matcher sets all four afresh for
    each match."""
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
