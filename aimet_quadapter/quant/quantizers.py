"""The AIMET quantizers of a sim: enumeration, dynamic mode, learnable ranges, fast evaluation, shared tensors."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
from aimet_torch.quantization.affine import QuantizeDequantize
from aimet_torch.utils import remove_all_quantizers, remove_param_quantizers, ste_round
from torch import nn

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.memory import LARGE_WEIGHTS_BYTES, heap_reused
from aimet_quadapter.models import PreparedLM, device_of, head_of, shares_storage
from aimet_quadapter.quant.aimet_private import (
    fake_quantize_replaced,
    minimum_scale,
    precomputed_encodings,
    qtensor_casting,
)

log = logging.getLogger(__name__)


def quantizers(model: nn.Module) -> Iterator[tuple[str, str, QuantizeDequantize]]:
    """(module path, role, quantizer) for every quantizer, each once; role: weight, input[i] or output[i]. Once,
    at its first place: AIMET's HTP placement gives ops that only move or negate values (RoPE's ``Neg``, ``Concat``)
    their input's quantizer."""
    seen: set[int] = set()
    for path, module in model.named_modules():
        if not hasattr(module, "param_quantizers"):
            continue
        slots = [
            *module.param_quantizers.items(),
            *((f"input[{i}]", q) for i, q in enumerate(module.input_quantizers)),
            *((f"output[{i}]", q) for i, q in enumerate(module.output_quantizers)),
        ]
        for role, q in slots:
            if q is not None and id(q) not in seen:
                seen.add(id(q))
                yield path, role, q


def quantizers_by_name(model: nn.Module) -> dict[str, QuantizeDequantize]:
    """Every quantizer of ``model`` by the name its settings and saved states use: ``<module path>.<role>``."""
    return {f"{path}.{role}": q for path, role, q in quantizers(model)}


def name_matches(name: str, pattern: str) -> bool:
    """``*`` and ``?`` wildcards, everything else literal (fnmatch would read ``input[0]``'s brackets)."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", ".*").replace(r"\?", "."), name) is not None


def matching_quantizers(
    found: dict[str, QuantizeDequantize], pairs: list[tuple[str, Any]], field: str
) -> Iterator[tuple[Any, dict[str, QuantizeDequantize]]]:
    """For each (pattern, value) of a ``PATTERN=VALUE`` setting, in order: the value and the quantizers of ``found``
    whose name matches. A pattern that matches nothing is refused, naming ``field`` and the entry."""
    for i, (pattern, value) in enumerate(pairs):
        hits = {key: q for key, q in found.items() if name_matches(key, pattern)}
        if not hits:
            example = next((k for k in found if ".input" in k), next(iter(found), ""))
            raise QuadapterError(
                f"{field}[{i}]: {pattern!r} matches no quantizer of this model (names look like {example!r}; "
                "`aimet-quadapter describe` lists them)"
            )
        yield value, hits


def quantizers_in(modules: Iterable[nn.Module]) -> list[QuantizeDequantize]:
    seen: dict[int, QuantizeDequantize] = {}
    for module in modules:
        for _, _, q in quantizers(module):
            seen.setdefault(id(q), q)
    return list(seen.values())


# AIMET's smallest quantization scale for 8 bits (float32 eps)
_MIN_SCALE = float(torch.finfo(torch.float32).eps)


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (x.round() - x).detach()


def _reduce(x: torch.Tensor, shape: tuple[int, ...], fn) -> torch.Tensor:
    """``fn`` (amin / amax) of ``x`` over every dimension where the quantizer's encoding ``shape`` is 1."""
    if all(s == 1 for s in shape):
        return fn(x).reshape(shape)
    full = (1,) * (x.dim() - len(shape)) + tuple(shape)
    return fn(x, dim=[i for i, s in enumerate(full) if s == 1], keepdim=True).reshape(shape)


def min_max_encoding(q: QuantizeDequantize, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset) that AIMET's min-max analyzer and ``q`` derive from an observed range, differentiably:
    widened to hold zero, an asymmetric offset rounded (straight-through), a symmetric grid centred on zero."""
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if q.symmetric:
        scale = torch.maximum(hi / q.qmax, lo / q.qmin).clamp_min(_MIN_SCALE)
        return scale, torch.full_like(scale, float(-round((q.qmin + q.qmax) / 2)))
    scale = ((hi - lo) / (q.qmax - q.qmin)).clamp_min(_MIN_SCALE)
    return scale, (_round_ste(lo / scale) - q.qmin).clamp(-q.qmax, -q.qmin)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Quantize-dequantize with straight-through rounding; the gradient reaches ``x`` and the encoding (LSQ)."""
    scale, offset = _broadcastable(scale, x), _broadcastable(offset, x)
    rows = _rows(x, scale) if x.device.type == "cpu" and x.is_contiguous() else None
    if rows is not None and _compiled() is not None:
        return _DynamicFakeQuant.apply(x, scale, offset, qmin, qmax, rows)
    return _dynamic_forward(x, scale, offset, qmin, qmax)


def _rows(x: torch.Tensor, range_: torch.Tensor) -> tuple[int, int] | None:
    """``x`` as (rows, elements per row) with one range value per row, or None: the shapes the kernels take."""
    if range_.numel() == 1:
        return 1, x.numel()
    if range_.dim() == x.dim() and range_.shape[0] == x.shape[0] and all(n == 1 for n in range_.shape[1:]):
        return x.shape[0], x.numel() // x.shape[0]
    return None


def _dynamic_forward(x: torch.Tensor, s: torch.Tensor, o: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    return (_round_ste(x / s) - o).clamp(qmin, qmax).add(o).mul(s)


def _dynamic_terms(
    grad: torch.Tensor, x: torch.Tensor, s: torch.Tensor, o: torch.Tensor, qmin: int, qmax: int
) -> tuple[torch.Tensor, ...]:
    # autograd's backward of _dynamic_forward, op by op: the input's gradient, the scale's two terms, the offset's two
    u = x / s
    v = u + (u.round() - u) - o
    grad_z = grad * s
    grad_v = torch.where((v > qmin) & (v < qmax), grad_z, 0.0)  # torch's clamp passes none on the bounds
    return grad_v / s, grad * (v.clamp(qmin, qmax) + o), -grad_v * ((x / s) / s), grad_z, -grad_v


def _dynamic_terms_fixed_offset(*args) -> tuple[torch.Tensor, ...]:
    return _dynamic_terms(*args)[:3]


# phase 1's fake-quant forward, and its backward's terms with (offset) or without (scale) the offset's
_DYNAMIC: dict[str, Any] = {"forward": _dynamic_forward, "offset": _dynamic_terms, "scale": _dynamic_terms_fixed_offset}


@functools.cache
def _compiled_dynamic(part: str) -> Any:
    return torch.compile(_DYNAMIC[part], dynamic=True)


class _DynamicFakeQuant(torch.autograd.Function):
    """:func:`_dynamic_forward` with autograd's gradients to the bit, one kernel each way; ``rows``: :func:`_rows`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, s: torch.Tensor, o: torch.Tensor, qmin: int, qmax: int, rows: tuple[int, int]):
        # as (rows, row) and (rows, 1): one graph whatever the rank and what needs a gradient
        flat = (x.detach().reshape(rows), s.detach().reshape(rows[0], 1), o.detach().reshape(rows[0], 1))
        ctx.save_for_backward(*flat)
        ctx.limits, ctx.shapes = (qmin, qmax), (x.shape, s.shape, o.shape)
        return _compiled_dynamic("forward")(*flat, qmin, qmax).view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, s, o = ctx.saved_tensors
        need_x, need_s, need_o = ctx.needs_input_grad[:3]
        x_shape, s_shape, o_shape = ctx.shapes
        if grad.is_contiguous():
            terms = _compiled_dynamic("offset" if need_o else "scale")(grad.reshape(x.shape), x, s, o, *ctx.limits)
            grad_x = terms[0].view(x_shape)
        else:  # the eager products take grad's layout, so that their sums add in autograd's order
            terms = _dynamic_terms(grad, x.view(x_shape), s.view(s_shape), o.view(o_shape), *ctx.limits)
            grad_x = terms[0]

        def summed(a: torch.Tensor, b: torch.Tensor, shape: torch.Size) -> torch.Tensor:
            return a.view(x_shape).sum_to_size(shape) + b.view(x_shape).sum_to_size(shape)

        grad_s = summed(terms[1], terms[2], s_shape) if need_s else None
        grad_o = summed(terms[3], terms[4], o_shape) if need_o else None
        return grad_x if need_x else None, grad_s, grad_o, None, None, None


def observed_min_max(x: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``_reduce`` of ``x`` by amin and by amax in one autograd function: autograd's gradients to the bit, faster.
    A per-channel weight's range is taken at every phase-1 step; autograd's own backward makes many passes over ``x``.
    Bitwise equal because the two ends' terms meet in one sum where one of them is zero wherever the ends differ."""
    full = (1,) * (x.dim() - len(shape)) + tuple(shape)
    dims = tuple(i for i, n in enumerate(full) if n == 1)
    return _MinMax.apply(x, dims, tuple(shape))


class _MinMax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dims: tuple[int, ...], shape: tuple[int, ...]):
        lo, hi = torch.amin(x, dim=dims, keepdim=True), torch.amax(x, dim=dims, keepdim=True)
        ctx.save_for_backward(x, lo, hi)
        ctx.dims = dims
        return lo.reshape(shape), hi.reshape(shape)

    @staticmethod
    def backward(ctx, grad_lo: torch.Tensor, grad_hi: torch.Tensor):
        x, lo, hi = ctx.saved_tensors
        grad_lo, grad_hi = grad_lo.reshape(lo.shape), grad_hi.reshape(hi.shape)
        rows = _rows(x, lo) if x.is_contiguous() else None
        if x.device.type != "cpu" or rows is None or _compiled() is None:
            return _min_max_gradient(x, lo, hi, grad_lo, grad_hi, ctx.dims), None, None
        ends = (t.reshape(rows[0], 1) for t in (lo, hi, grad_lo, grad_hi))
        return _compiled_min_max_gradient()(x.detach().reshape(rows), *ends, (1,)).view(x.shape), None, None


def _min_max_gradient(x, lo, hi, grad_lo, grad_hi, dims: tuple[int, ...]) -> torch.Tensor:
    # autograd's amin/amax backward (scale_grad_by_count), one term per end
    at_lo, at_hi = x == lo, x == hi
    return (grad_lo / at_lo.sum(dims, True)) * at_lo + (grad_hi / at_hi.sum(dims, True)) * at_hi


@functools.cache
def _compiled_min_max_gradient() -> Any:
    return torch.compile(_min_max_gradient, dynamic=True)


class DynamicRanges:
    """The paper's dynamic quantization (phase 1): while entered, each quantizer of ``qs`` takes the min-max range of
    the tensor it quantizes, part of the graph with ``range_gradient`` (False: AIMET's dynamic mode, under no_grad).
    :meth:`pin` fixes the range of a larger tensor while part of it is quantized. The quantizers' state is kept.
    AIMET's mode lets a gradient see only the rounding; with the range in the graph, shrinking an outlier channel is
    seen to narrow the range of every other channel, which is how a Quadapter helps. ``pin``: so that subsampling the
    loss rows does not change the ranges."""

    def __init__(self, qs: Iterable[QuantizeDequantize], range_gradient: bool = True):
        self.quantizers = list(dict.fromkeys(qs))
        self.range_gradient = range_gradient
        self.quantizing = True
        self._pinned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @contextmanager
    def off(self) -> Iterator[None]:
        """Inside the entered context, the quantizers pass their input through."""
        self.quantizing = False
        try:
            yield
        finally:
            self.quantizing = True

    def observed_range(self, q: QuantizeDequantize, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.as_subclass(torch.Tensor)
        if q.block_size is not None:  # one range per block: the tensor's dimensions split into (blocks, size)
            split = x.reshape([n for blocks, width in zip(q.shape, x.shape) for n in (blocks, width // blocks)])
            inner = tuple(range(1, split.dim(), 2))
            lo, hi = split.amin(dim=inner), split.amax(dim=inner)
        elif self.range_gradient:
            return observed_min_max(x, tuple(q.shape))
        else:
            lo, hi = _reduce(x, tuple(q.shape), torch.amin), _reduce(x, tuple(q.shape), torch.amax)
        return (lo, hi) if self.range_gradient else (lo.detach(), hi.detach())

    def pin(self, qs: Iterable[QuantizeDequantize], x: torch.Tensor) -> None:
        """Until :meth:`unpin`, each of ``qs`` uses the range of ``x`` whatever it is given."""
        for q in qs:
            self._pinned[id(q)] = self.observed_range(q, x)

    def unpin(self) -> None:
        self._pinned.clear()

    def _forward(self, q: QuantizeDequantize, x: torch.Tensor) -> torch.Tensor:
        if not self.quantizing:
            return x.as_subclass(torch.Tensor)
        lo, hi = self._pinned.get(id(q)) or self.observed_range(q, x)
        scale, offset = min_max_encoding(q, lo, hi)
        if q.block_size is not None:
            return self._aimet_forward(q, x, scale, offset)
        return fake_quantize(x.as_subclass(torch.Tensor), scale, offset, q.qmin, q.qmax)

    @staticmethod
    def _aimet_forward(q: QuantizeDequantize, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor):
        """``q``'s own forward (a block-wise grid, LPBQ's among them) on the range of ``scale`` and ``offset``."""
        patched = q.__dict__.pop("forward")
        try:
            bounds = {"min": (offset + q.qmin) * scale, "max": (offset + q.qmax) * scale}
            return torch.func.functional_call(q, bounds, (x,)).as_subclass(torch.Tensor)
        finally:
            q.forward = patched

    def __enter__(self) -> DynamicRanges:
        # AIMET calibrates a quantizer with no range at its first call, and that context deletes the ``forward``
        # patched below on exit: a placeholder range, put back on exit, keeps AIMET from doing that.
        if any(q.zero_point_shift != 0 for q in self.quantizers):
            raise NotImplementedError("dynamic ranges: shifted grids are not supported")
        self._uninitialized = [(q, _clone_state(q.state_dict())) for q in self.quantizers if not q.is_initialized()]
        for q, _ in self._uninitialized:
            q.set_range(-1.0, 1.0)
        for q in self.quantizers:
            q.forward = lambda x, q=q: self._forward(q, x)
        return self

    def __exit__(self, *exc) -> None:
        self.unpin()
        for q in self.quantizers:
            q.__dict__.pop("forward", None)
        for q, state in self._uninitialized:
            q.load_state_dict(state)
        # readers of one tensor share min/max: a later reader's load marks the earlier ones initialized again
        for q, state in self._uninitialized:
            q.set_extra_state(state["_extra_state"])


def _clone_state(state):
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return type(state)((k, _clone_state(v)) for k, v in state.items())
    return state


def range_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The learnable min/max of every quantizer (LSQ+-style range learning), each once."""
    return [p for p, _ in range_parameter_widths(model)]


def range_parameter_widths(model: nn.Module) -> list[tuple[nn.Parameter, float]]:
    """:func:`range_parameters`, each with its range's width (max - min), averaged over channels (0 uncalibrated)."""
    params: dict[int, tuple[nn.Parameter, float]] = {}
    for _, _, q in quantizers(model):
        named = dict(q.named_parameters())
        if "min" not in named or "max" not in named:
            continue
        width = float((named["max"] - named["min"]).mean()) if q.is_initialized() else 0.0
        for name in ("min", "max"):
            params.setdefault(id(named[name]), (named[name], width))
    return list(params.values())


def plain_tensors() -> AbstractContextManager:
    """Quantizers return plain tensors, not AIMET's ``DequantizedTensor``: the same values and gradients, faster
    (the subclass only carries the encoding; its ``__torch_function__`` runs on every op; AIMET's inference mode
    switches it off too)."""
    return qtensor_casting(False)


# Above this many bytes of weights, fast_inference keeps the float weights on disk while their quantized copies serve
SPILL_BYTES = LARGE_WEIGHTS_BYTES


@contextmanager
def fast_inference(sim_model: nn.Module, spill_bytes: int = SPILL_BYTES) -> Iterator[None]:
    """Evaluate the sim at lower cost with the same output: weights quantized once, encodings precomputed,
    :func:`elementwise_fake_quant` and :func:`plain_tensors`. Weights of more than ``spill_bytes`` wait on disk.
    Weight fake-quant dominates a sim forward and gives one result on every call while nothing trains."""
    with quantized_weights(sim_model, spill_bytes), ExitStack() as inner:
        active = [q for _, _, q in quantizers(sim_model) if q.is_initialized()]
        for q in active:
            inner.enter_context(precomputed_encodings(q))
        inner.enter_context(elementwise_fake_quant(active))
        inner.enter_context(plain_tensors())
        inner.enter_context(heap_reused(head=head_of(sim_model)))
        yield


@contextmanager
def calibration_passes(sim_model: nn.Module) -> Iterator[None]:
    """Inside AIMET's ``compute_encodings``, the same statistics at lower cost: its fixed ranges (a softmax's
    output under ``htp``) through :func:`elementwise_fake_quant`, quantizer outputs as plain tensors. Weights are still
    quantized at every batch: once for all would hold a quantized copy beside the float one."""
    fixed = [q for _, _, q in quantizers(sim_model) if q.is_initialized() and not q.is_overwrite_allowed()]
    with elementwise_fake_quant(fixed), plain_tensors():
        yield


@contextmanager
def quantized_weights(sim_model: nn.Module, spill_bytes: int = SPILL_BYTES) -> Iterator[None]:
    """While inside, every calibrated weight holds its quantized value and its quantizer is off; weights of more
    than ``spill_bytes`` in all wait on disk; all put back on exit."""
    quantized = []
    for module in sim_model.modules():
        if hasattr(module, "param_quantizers"):
            qm: Any = module  # an AIMET quantized module: its quantizer containers are not typed
            quantized += [(qm, n, q) for n, q in qm.param_quantizers.items() if q is not None and q.is_initialized()]
    size = sum(getattr(m, n).numel() * getattr(m, n).element_size() for m, n, _ in quantized)
    saved: list[tuple[Any, str, QuantizeDequantize, torch.Tensor | Path]] = []
    with ExitStack() as stack:
        folder = None
        if size > spill_bytes:
            folder = Path(stack.enter_context(TemporaryDirectory(prefix="aimet-quadapter-weights-")))
        try:
            with torch.no_grad():
                for module, name, q in quantized:
                    param = getattr(module, name)
                    original: torch.Tensor | Path = param.data
                    # the FP model's own storage is kept by the FP model: spilling it would free nothing
                    shared = shares_storage(param)
                    param.data = q(param).as_subclass(torch.Tensor).detach()
                    if folder is not None and not shared:
                        path = folder / f"{len(saved)}.pt"
                        torch.save(original, path)
                        original = path
                    saved.append((module, name, q, original))
                    module.param_quantizers[name] = None
            yield
        finally:
            for module, name, q, data in saved:
                param = getattr(module, name)
                if isinstance(data, Path):
                    data = torch.load(data, map_location=param.device, weights_only=True)
                param.data = data
                module.param_quantizers[name] = q


def _zero_point(offset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # as AIMET hands it to torch.fake_quantize_per_tensor_affine: -offset as int32
    return (-offset.to(torch.int32)).to(dtype)


# True inside aimet_onnx_rounding()
_onnx_rounding = False


def aimet_onnx_fake_quant(
    x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, qmin: int, qmax: int
) -> torch.Tensor:
    """Fake-quant as aimet-onnx's CPU kernel computes it: the code ``x / scale - offset - qmin`` in float32, rounded
    half up, on the unsigned grid ``[0, qmax - qmin]``. Per tensor or per channel (``scale``'s shape)."""
    shape = (1,) * (x.dim() - scale.dim()) + tuple(scale.shape)
    s = scale.detach().to(torch.float32).reshape(shape)
    o = offset.detach().to(torch.float32).reshape(shape)
    t = x.to(torch.float32) / s - o - qmin
    floor = torch.floor(t)
    code = floor.add_((t - floor >= 0.5).to(t.dtype)).clamp_(0, qmax - qmin)
    return code.add_(o + qmin).mul_(s).to(x.dtype)


@contextmanager
def aimet_onnx_rounding(sim_model: nn.Module) -> Iterator[None]:
    """Evaluate ``sim_model`` with every activation quantizer rounding as AIMET's ONNX simulation does (half up,
    offset first, where the sim rounds half to even), gradients off. Weight quantizers keep the sim's arithmetic:
    the export writes weights already on their grid. Tells that bias from a defect of the exported graph.

    A value within a float32 rounding of a half step gets the code above, never the one below: a bias one code wide,
    which an 8-bit residual stream carries from layer to layer. Weights must not round half up here: aimet-onnx gives
    an on-grid value back unchanged, and weights expanded from a 4-bit file sit on half steps of their 8-bit grid."""
    global _onnx_rounding
    weights = [q for _, role, q in quantizers(sim_model) if not role.startswith(("input", "output"))]
    inside = [0]  # > 0 while a weight quantizer runs: AIMET's own arithmetic

    def enter(module, args) -> None:
        inside[0] += 1

    def leave(module, args, out) -> None:
        inside[0] -= 1

    def fake_quant(x, scale, offset, qmin, qmax):
        return (aimet if inside[0] else aimet_onnx_fake_quant)(x, scale, offset, qmin, qmax)

    handles = [h for q in weights for h in (q.register_forward_pre_hook(enter), q.register_forward_hook(leave))]
    before, _onnx_rounding = _onnx_rounding, True
    try:
        with torch.no_grad(), fake_quantize_replaced(fake_quant) as aimet:
            yield
    finally:
        _onnx_rounding = before
        for handle in handles:
            handle.remove()


class FakeQuantSTE(torch.autograd.Function):
    """Per-tensor fake-quant with the straight-through gradient of ATen's kernel (grad where in range)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int):
        if _onnx_rounding:
            return aimet_onnx_fake_quant(x, scale, -zero_point, qmin, qmax)
        if not x.requires_grad and x.device.type == "cpu" and x.is_contiguous():
            kernels = _compiled()
            if kernels is not None:
                return kernels[0](x.reshape(-1), scale, zero_point, qmin, qmax).view(x.shape)
        q = x.mul(1.0 / scale).round_().add_(zero_point)
        if x.requires_grad:
            ctx.save_for_backward((q >= qmin) & (q <= qmax))
        return q.clamp_(qmin, qmax).sub_(zero_point).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return grad * mask, None, None, None, None


class FakeQuantLearnedRange(torch.autograd.Function):
    """:class:`FakeQuantSTE`'s arithmetic with the gradients of AIMET's ``QuantDequantFunc`` (whose own forward
    divides by the scale and rounds otherwise): training computes, bit for bit, what evaluation computes. The two
    round a value on a grid boundary differently, and a model as sensitive to single roundings as SmolLM2 would then
    train another function than the one evaluated and exported."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, qmin: int, qmax: int):
        s, offset_ = scale.detach(), offset.detach()
        ctx.per_channel = s.numel() != 1
        if ctx.per_channel:  # one scale per row of a weight: broadcast over the rest of it
            s, offset_ = _broadcastable(s, x), _broadcastable(offset_, x)
        zero_point = _zero_point(offset_, s.dtype)
        ctx.shapes, ctx.limits = (scale.shape, offset.shape), (qmin, qmax)
        kernels = _compiled() if x.device.type == "cpu" and x.is_contiguous() else None
        ctx.compiled = kernels is not None
        if kernels is not None:
            # flat where the range is one scale, so that one graph serves every shape
            ctx.save_for_backward(x.detach(), s, zero_point)
            flat = x.detach() if ctx.per_channel else x.detach().reshape(-1)
            return kernels[0](flat, s, zero_point, qmin, qmax).view(x.shape)
        mask, scale_factor, q = _eager_terms(x, s, zero_point, qmin, qmax, scale.requires_grad)
        ctx.save_for_backward(mask, scale_factor, s)
        return q.mul_(s)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scale_shape, offset_shape = ctx.shapes
        if ctx.compiled:
            x, s, zero_point = ctx.saved_tensors
            qmin, qmax = ctx.limits
            scale_factor: Any
            if not grad.is_contiguous():  # summed in grad's layout, as the eager products are
                mask, scale_factor, _ = _eager_terms(x, s, zero_point, qmin, qmax, ctx.needs_input_grad[1])
            else:
                grad_, x_ = (grad, x) if ctx.per_channel else (grad.reshape(-1), x.reshape(-1))
                flat = (grad_, x_, s, zero_point, qmin, qmax)
                return (*_compiled_gradients(ctx.needs_input_grad, ctx.shapes, x.shape, flat), None, None)
        else:
            mask, scale_factor, s = ctx.saved_tensors
        grad_x = grad * mask if ctx.needs_input_grad[0] else None
        grad_scale = _sum_to(grad * scale_factor, scale_shape) if ctx.needs_input_grad[1] else None
        grad_offset = None
        if ctx.needs_input_grad[2]:
            grad_offset = _sum_to(grad * ~mask, offset_shape).mul(s.reshape(offset_shape))
        return grad_x, grad_scale, grad_offset, None, None


def _broadcastable(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.reshape((1,) * (x.dim() - t.dim()) + tuple(t.shape))


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return _reduce(t, tuple(shape), torch.sum)


def _eager_terms(
    x: torch.Tensor, s: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, scale_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The in-range mask, the scale's gradient factor (where ``scale_grad``) and the grid value less the zero point."""
    scaled = x.mul(1.0 / s)
    rounded = scaled.round()
    q = rounded.add(zero_point)
    mask = (q >= qmin) & (q <= qmax)
    q.clamp_(qmin, qmax).sub_(zero_point)
    # torch.where(mask, rounded - scaled, q) in place: on lm_head's weights each copy is over 100 MB
    scale_factor = None
    if scale_grad:
        scale_factor = rounded.sub_(scaled)
        del scaled
        outside = ~mask
        scale_factor.masked_scatter_(outside, q[outside])
    return mask, scale_factor, q


def _learned_terms(
    grad: torch.Tensor, x: torch.Tensor, s: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scaled = x * (1.0 / s)
    rounded = scaled.round()
    q = rounded + zero_point
    inside = (q >= qmin) & (q <= qmax)
    factor = torch.where(inside, rounded - scaled, q.clamp(qmin, qmax) - zero_point)
    return grad * inside, grad * factor, grad * ~inside


def _terms_input_and_scale(*args) -> tuple[torch.Tensor, torch.Tensor]:
    return _learned_terms(*args)[:2]


def _terms_input(*args) -> tuple[torch.Tensor]:
    return (_learned_terms(*args)[0],)


def _terms_scale(*args) -> tuple[torch.Tensor]:
    return (_learned_terms(*args)[1],)


# one code object per selection: torch.compile keeps at most 8 graphs per code object, then runs it eagerly (every
# product made); per tensor and per channel each selection needs two
_TERMS = {(0, 1): _terms_input_and_scale, (0,): _terms_input, (1,): _terms_scale}


@functools.cache
def _compiled_terms(which: tuple[int, ...]) -> Any:
    return torch.compile(_TERMS[which], dynamic=True)


def _compiled_gradients(needs: tuple[bool, ...], shapes: tuple, shape: torch.Size, flat: tuple) -> tuple:
    """The gradients ``needs`` asks for from flat ``(grad, x, s, zero_point, qmin, qmax)``, two big tensors at once:
    the scale's products are summed before the offset's are made, as the gradient less the input's (``grad *
    ~inside`` but for the sign of a zero, which no sum keeps)."""
    scale_shape, offset_shape = shapes
    grad_x = grad_scale = grad_offset = None
    if needs[0] or needs[2]:
        if needs[1]:
            grad_x, by_scale = _compiled_terms((0, 1))(*flat)
            grad_scale = _sum_to(by_scale, scale_shape)
            del by_scale
        else:
            (grad_x,) = _compiled_terms((0,))(*flat)
    elif needs[1]:
        grad_scale = _sum_to(_compiled_terms((1,))(*flat)[0], scale_shape)
    if needs[2]:
        grad_offset = _sum_to(flat[0].sub(grad_x), offset_shape).mul(flat[2].reshape(offset_shape))
    return (grad_x.view(shape) if needs[0] and grad_x is not None else None), grad_scale, grad_offset


def _learned_forward(x: torch.Tensor, s: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    # FakeQuantLearnedRange.forward's arithmetic, op for op
    return (x * (1.0 / s)).round().add(zero_point).clamp(qmin, qmax).sub(zero_point).mul(s)


def _learned_backward(
    grad: torch.Tensor, x: torch.Tensor, s: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_x, by_scale, by_offset = _learned_terms(grad, x, s, zero_point, qmin, qmax)
    return grad_x, by_scale.sum(), by_offset.sum() * s


@functools.cache
def _compiled() -> tuple[Any, Any] | None:
    """The learned-range forward and backward kernels, for flat inputs; None where torch.compile cannot build them."""
    try:
        forward = torch.compile(_learned_forward, dynamic=True)
        backward = torch.compile(_learned_backward, dynamic=True)
        x = torch.linspace(-2.0, 2.0, 64)
        s, zero_point = torch.tensor(0.02), torch.tensor(3.0)
        with torch.no_grad():
            forward(x, s, zero_point, 0, 255), backward(torch.ones_like(x), x, s, zero_point, 0, 255)
    except Exception as error:  # a missing C++ compiler or Triton: the eager arithmetic computes the same
        log.warning("fused fake-quant unavailable (%s): phase 2 runs the eager arithmetic", error)
        return None
    return forward, backward


class FusedFakeQuantLearnedRange(torch.autograd.Function):
    """:class:`FakeQuantLearnedRange` in two compiled kernels: range gradients summed in another order."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        qmin: int,
        qmax: int,
        zero_point: torch.Tensor | None = None,
    ):
        kernels = _compiled()
        if kernels is None:
            return FakeQuantLearnedRange.forward(ctx, x, scale, offset, qmin, qmax)
        s = scale.detach()
        zero_point = _zero_point(offset.detach(), s.dtype) if zero_point is None else zero_point.detach()
        ctx.shapes, ctx.limits, ctx.eager = (scale.shape, offset.shape, x.shape), (qmin, qmax), False
        # flat and not a view (guards would tell inputs apart by rank, strides, base and requires_grad): one compiled
        # graph for every tensor of a dtype
        x = x.reshape(-1).detach()
        ctx.save_for_backward(x, s, zero_point)
        return kernels[0](x, s, zero_point, qmin, qmax).view(ctx.shapes[2])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if getattr(ctx, "eager", True):
            return *FakeQuantLearnedRange.backward(ctx, grad), None
        x, s, zero_point = ctx.saved_tensors
        backward = _compiled()[1]  # type: ignore[index]
        grad_x, grad_scale, grad_offset = backward(grad.reshape(-1).detach(), x, s, zero_point, *ctx.limits)
        scale_shape, offset_shape, shape = ctx.shapes
        return (
            grad_x.view(shape) if ctx.needs_input_grad[0] else None,
            grad_scale.reshape(scale_shape) if ctx.needs_input_grad[1] else None,
            grad_offset.reshape(offset_shape) if ctx.needs_input_grad[2] else None,
            None,
            None,
            None,
        )


@contextmanager
def elementwise_fake_quant(qs: Iterable[QuantizeDequantize], fused: bool = False) -> Iterator[None]:
    """While inside, fixed per-tensor fake-quant on a CPU runs as vectorised tensor ops (ATen's values, bit for bit),
    and a range that trains takes :class:`FakeQuantLearnedRange` on every device (``fused``: per tensor, the fused
    one). Fixed per-channel ranges and fixed ranges on CUDA keep AIMET's path. On a CPU,
    ``torch.fake_quantize_per_tensor_affine`` is not vectorised and writes a gradient mask; CUDA's kernels are."""
    learned = FusedFakeQuantLearnedRange if fused else FakeQuantLearnedRange
    patched = []
    try:
        for q in qs:
            original = q.forward

            def forward(x: torch.Tensor, q=q, original=original) -> torch.Tensor:
                batched = _batched.get(id(q))
                if batched is not None and torch.is_grad_enabled():
                    scale, offset, zero_point = batched
                    plain = x.as_subclass(torch.Tensor)
                    if fused:
                        return FusedFakeQuantLearnedRange.apply(plain, scale, offset, q.qmin, q.qmax, zero_point)
                    return FakeQuantLearnedRange.apply(plain, scale, offset, q.qmin, q.qmax)
                enc = q.get_encodings()
                if enc is None or enc.block_size is not None or enc.zero_point_shift != 0:
                    return original(x)
                per_tensor = enc.scale.numel() == 1
                if torch.is_grad_enabled() and (enc.scale.requires_grad or enc.offset.requires_grad):
                    plain = x.as_subclass(torch.Tensor)
                    function = learned if per_tensor else FakeQuantLearnedRange
                    return function.apply(plain, enc.scale, enc.offset, enc.qmin, enc.qmax)
                # CUDA's kernels are vectorised already, and ATen's per-channel one also multiplies by 1 / scale
                if x.device.type != "cpu" or not per_tensor:
                    return original(x)
                scale = enc.scale.detach().reshape(())
                zero_point = _zero_point(enc.offset.detach().reshape(()), scale.dtype)
                return FakeQuantSTE.apply(x.as_subclass(torch.Tensor), scale, zero_point, enc.qmin, enc.qmax)

            q.forward = forward
            patched.append(q)
        yield
    finally:
        for q in patched:
            q.__dict__.pop("forward", None)  # AIMET's own patch of `forward` may have removed it already


# (scale, offset, zero point) of a quantizer while :func:`batched_range_encodings` holds them, by id of the quantizer
_batched: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@contextmanager
def batched_range_encodings(qs: Iterable[QuantizeDequantize]) -> Iterator[None]:
    """While inside (and under :func:`elementwise_fake_quant`), the per-tensor quantizers of ``qs`` whose range
    trains take their encodings from one computation made on entry (``get_encodings``' values, gradients summed in
    another order). Enter it anew for each pass: the encodings are part of its autograd graph. Otherwise each
    quantizer derives its encoding at every call, a dozen tiny ops each way: on a GPU, each a kernel launch."""
    groups: dict[tuple[int, int, bool], dict[tuple[int, int], list[QuantizeDequantize]]] = {}
    for q in dict.fromkeys(qs):
        named = dict(q.named_parameters(recurse=False))
        if "min" not in named or "max" not in named or not q.is_initialized() or not _per_tensor(q):
            continue
        if q.block_size is not None or q.zero_point_shift != 0:
            continue
        if not (named["min"].requires_grad or named["max"].requires_grad):
            continue
        readers = groups.setdefault((q.qmin, q.qmax, q.symmetric), {})
        readers.setdefault((id(named["min"]), id(named["max"])), []).append(q)
    held = []
    try:
        for (qmin, qmax, symmetric), by_range in groups.items():
            first = [qs_[0] for qs_ in by_range.values()]
            lo = torch.stack([q.min.reshape(()) for q in first])
            hi = torch.stack([q.max.reshape(()) for q in first])
            # AIMET's get_scale and _get_offset, over every range at once
            scale = ((hi - lo) / (qmax - qmin)).abs().clamp_min_(minimum_scale(qmax - qmin))
            if symmetric:
                offset = torch.full_like(scale, float(-round((qmin + qmax) / 2))).detach()
            else:
                offset = torch.clamp(ste_round(lo / scale) - qmin, -qmax, -qmin)
            zero_point = _zero_point(offset.detach(), scale.dtype)
            for readers_, s, o, z in zip(by_range.values(), scale.unbind(), offset.unbind(), zero_point.unbind()):
                for q in readers_:
                    _batched[id(q)] = s.reshape(q.shape), o.reshape(q.shape), z.reshape(q.shape)
                    held.append(id(q))
        yield
    finally:
        for key in held:
            _batched.pop(key, None)


# Set while a prefix's keys and values are recomputed: quantization hooks of this module stand aside.
_full_precision: list[bool] = [False]


@torch.no_grad()
def refresh_prefix(sim_model: nn.Module) -> None:
    """Recompute the full-precision keys and values of the prefix of ``sim_model`` from its weights as they are now,
    every quantizer out of the way: after the weights or alphas change. A model without a prefix is left alone."""
    if not isinstance(sim_model, PreparedLM) or sim_model.prefix_ids is None:
        return
    _full_precision[0] = True
    try:
        with remove_all_quantizers(sim_model):
            sim_model.refresh_prefix()
    finally:
        _full_precision[0] = False


def _quantized_rows(q: QuantizeDequantize, out: torch.Tensor) -> torch.Tensor:
    return out if _full_precision[0] else q(out).as_subclass(torch.Tensor)


def _per_tensor(q: QuantizeDequantize) -> bool:
    return all(s == 1 for s in q.shape)


@contextmanager
def gathered_embedding_quantization(sim_model: nn.Module) -> Iterator[None]:
    """Fake-quantize only the embedding rows a batch looks up (training), under a static per-tensor range: then equal
    to looking up the quantized table; a dynamic range taken from the looked-up rows would differ from the table's."""
    saved = []
    try:
        for module in sim_model.modules():
            if not isinstance(module, nn.Embedding) or not hasattr(module, "param_quantizers"):
                continue
            qm: Any = module  # an AIMET quantized module: its quantizer containers are not typed
            q = qm.param_quantizers["weight"]
            if q is None or not q.is_initialized() or not _per_tensor(q):
                continue
            qm.param_quantizers["weight"] = None
            handle = module.register_forward_hook(lambda _m, _args, out, q=q: _quantized_rows(q, out))
            saved.append((qm, q, handle))
        yield
    finally:
        for module, q, handle in saved:
            handle.remove()
            module.param_quantizers["weight"] = q


def shared_activation_groups(sim_model: nn.Module, seq_len: int = 8) -> list[list[str]]:
    """Activation quantizers that quantize one and the same tensor, e.g. the inputs of q, k and v, found by one
    forward pass (tensor identity). Works on an uncalibrated sim too."""
    calls: dict[int, tuple[torch.Tensor, list[str]]] = {}
    handles = []

    def recorder(key: str):
        def pre_hook(module, args):
            # kept alive in `calls`, so that its id cannot be reused
            calls.setdefault(id(args[0]), (args[0], []))[1].append(key)

        return pre_hook

    activations = []
    for path, role, q in quantizers(sim_model):
        if role.startswith(("input", "output")):
            handles.append(q.register_forward_pre_hook(recorder(f"{path}.{role}")))
            activations.append(q)
    device = device_of(sim_model)
    try:
        # dynamic mode runs an uncalibrated sim too; float weights: quantized copies would only add to the peak
        with torch.no_grad(), remove_param_quantizers(sim_model), DynamicRanges(activations):
            sim_model(torch.zeros((1, seq_len), dtype=torch.long, device=device))
    finally:
        for handle in handles:
            handle.remove()
    return [keys for _, keys in calls.values() if len(keys) > 1]
