"""Running an exported model in onnxruntime, and reading (and applying) an AIMET encodings file.

:func:`apply_encodings` does what a converter given the encodings as ``--quantization_overrides`` is meant to do,
so that onnxruntime checks the encodings file itself, not only AIMET's own QDQ graph.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.formats import MANIFEST
from aimet_quadapter.text import EVAL_SEQ_LEN

PAD_ID = 0  # fills a short last window up to a fixed-length graph's input; causal: never seen by scored tokens


def ort_session(model: str | Path | bytes, optimize: bool = True, low_memory: bool = False):
    """An onnxruntime CPU session, as many threads as torch; ``optimize``: all graph optimizations (which sum in
    another float32 order), else none. ``low_memory``: no arena, so memory freed between ops goes back to the system
    (the same results, a little slower; a QDQ graph dequantizes every weight at every run).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.log_severity_level = 3  # onnxruntime warns about every unused initializer otherwise
    # x86 without VNNI: the default uint8 x int8 kernel saturates its 16-bit pair sums; this one is exact
    options.add_session_config_entry("session.x64quantprecision", "1")
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if low_memory:
        options.enable_cpu_mem_arena = False
        options.enable_mem_pattern = False
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


class OnnxLM:
    """``ids (1, T) -> logits (1, T, V)`` through an onnxruntime session of an exported LM.

    A fixed-length graph (``seq_len`` set) gets shorter inputs padded at the end: the model is causal and
    its quantizers are static, so positions before the padding are computed exactly as without it.
    """

    def __init__(
        self, model: str | Path | bytes, seq_len: int | None = None, optimize: bool = True, low_memory: bool = False
    ):
        self.session = ort_session(model, optimize, low_memory)
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise QuadapterError(f"expected an ONNX LM with one input and one output, got {len(inputs)}/{len(outputs)}")
        self.input_name, self.output_name = inputs[0].name, outputs[0].name
        length = inputs[0].shape[-1]
        self.fixed_len = length if isinstance(length, int) else None
        self.seq_len = seq_len if seq_len is not None else self.fixed_len

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(1, -1).cpu()
        length = ids.shape[1]
        if self.fixed_len is not None:
            if length > self.fixed_len:
                raise QuadapterError(f"window of {length} tokens is longer than the exported graph's {self.fixed_len}")
            ids = torch.nn.functional.pad(ids, (0, self.fixed_len - length), value=PAD_ID)
        (logits,) = self.session.run([self.output_name], {self.input_name: ids.numpy().astype(np.int64)})
        return torch.from_numpy(logits[:, :length])


def find_manifest(path: str | Path) -> Path | None:
    """The manifest of an export: ``path`` is the export folder or one of its ONNX files."""
    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    manifest = folder / MANIFEST
    return manifest if manifest.is_file() else None


def is_export(name: str) -> bool:
    """``--model`` names an exported model (an ``.onnx`` file or an export folder) rather than a PyTorch LM."""
    return name.endswith(".onnx") or (Path(name).expanduser().is_dir() and find_manifest(name) is not None)


def load_manifest(path: str | Path) -> tuple[dict, Path]:
    manifest = find_manifest(path)
    if manifest is None:
        raise QuadapterError(
            f"{path}: no {MANIFEST} found beside it; evaluate an export folder written by `aimet-quadapter export` "
            f"(the manifest names the tokenizer and the sequence length)"
        )
    try:
        content = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise QuadapterError(f"{manifest} is not an export manifest: it cannot be read as JSON ({error})") from None
    # what the evaluation reads of it: a foreign JSON file of that name lacks these
    role = content.get("files_role") if isinstance(content, dict) else None
    if not (isinstance(role, dict) and isinstance(role.get("qdq_onnx"), str) and isinstance(content.get("model"), str)):
        raise QuadapterError(
            f"{manifest} is not a manifest of `aimet-quadapter export`: it lacks the model or files_role.qdq_onnx"
        )
    return content, manifest.parent


def qdq_model_of(path: str | Path) -> tuple[Path, dict]:
    """The QDQ ONNX file of an export (``path``: its folder or its QDQ file) and the export's manifest."""
    manifest, folder = load_manifest(path)
    path = Path(path).expanduser()
    qdq = folder / manifest["files_role"]["qdq_onnx"]
    if path.is_file() and path.resolve() != qdq.resolve():
        raise QuadapterError(
            f"{path} is not the export's QDQ model: the FP graph needs its encodings applied by a converter; "
            f"evaluate {qdq} (or the folder {folder})"
        )
    if not qdq.is_file():
        raise QuadapterError(f"{qdq} named in {folder / MANIFEST} is missing")
    return qdq, manifest


# ONNX QuantizeLinear output types by name (opset 21 for the 4- and 16-bit ones).
_ONNX_TYPES = {t: t.upper() for t in ("uint8", "int8", "uint16", "int16", "uint4", "int4", "int32")}


@dataclass(frozen=True)
class Encoding:
    """One entry of an encodings file in ONNX terms: x_q = clamp(round(x / scale) + zero_point)."""

    name: str
    bitwidth: int
    # float32, one per channel (or tensor); block-wise: shaped as the tensor, the blocked axis divided by block_size
    scale: np.ndarray
    zero_point: np.ndarray  # int64, same shape as scale
    dtype: str  # a key of _ONNX_TYPES
    axis: int | None  # channel axis (block-wise: the blocked one); None for per-tensor (1.0.0: see apply_encodings)
    is_param: bool | None  # 1.0.0 files say; 2.0.0 files do not
    block_size: int | None = None


def read_encodings(encodings: dict) -> list[Encoding]:
    """The entries of an AIMET encodings file (format 1.0.0 or 2.0.0, as ``sim.onnx.export`` writes them)."""
    version = str(encodings.get("version", ""))
    out = []
    if version.startswith("1."):
        for kind in ("activation_encodings", "param_encodings"):
            for entry in encodings.get(kind, []):
                if entry.get("dtype", "INT") != "INT":
                    raise QuadapterError(f"encoding of {entry['name']!r} is {entry['dtype']}: only INT is supported")
                if entry.get("enc_type") in ("PER_BLOCK", "LPBQ"):
                    raise QuadapterError(
                        f"encoding of {entry['name']!r} is block-wise, whose layout a 1.0.0 file leaves implicit: "
                        f"read its 2.0.0 form, which names the blocked axis"
                    )
                bw = int(entry["bw"])
                scale = np.asarray(entry["scale"], dtype=np.float32).reshape(-1)
                # AIMET's offset is the negated ONNX zero point, on an unsigned grid [0, 2^bw - 1]
                zero_point = -np.asarray(entry["offset"], dtype=np.int64).reshape(-1)
                axis = -1 if entry.get("enc_type", "PER_TENSOR") != "PER_TENSOR" or scale.size > 1 else None
                out.append(Encoding(entry["name"], bw, scale, zero_point, f"uint{bw}", axis, kind == "param_encodings"))
    elif version.startswith("2."):
        for entry in encodings.get("encodings", []):
            dtype = entry["output_dtype"]
            if dtype not in _ONNX_TYPES:
                raise QuadapterError(f"encoding of {entry['name']!r} has output_dtype {dtype!r}: not supported here")
            block_size = entry.get("block_size")
            if "per_block_int_scale" in entry:  # LPBQ: integer block scales times a float scale per channel
                scale = np.asarray(entry["per_block_int_scale"], dtype=np.float32) * np.asarray(
                    entry["per_channel_float_scale"], dtype=np.float32
                )
            else:
                scale = np.asarray(entry["y_scale"], dtype=np.float32)
            if block_size is None:
                scale = scale.reshape(-1)
            zero_point = np.broadcast_to(np.asarray(entry.get("y_zero_point", 0), dtype=np.int64), scale.shape)
            zero_point = zero_point.reshape(scale.shape).copy()
            bw = int(re.sub(r"\D", "", dtype))
            axis = entry.get("axis")
            out.append(Encoding(entry["name"], bw, scale, zero_point, dtype, axis, None, block_size))
    else:
        raise QuadapterError(f"unsupported encodings version {version!r} (supported: 1.0.0, 2.0.0)")
    return out


def graph_tensor_names(model) -> set[str]:
    """Every tensor name an ``onnx.ModelProto``'s main graph defines or uses."""
    graph = model.graph
    names = {t.name for t in graph.initializer} | {v.name for v in graph.input} | {v.name for v in graph.output}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
    names.discard("")
    return names


def qdq_graph_encodings(model, base_dir: str | Path | None = None) -> list[Encoding]:
    """The encoding of every QuantizeLinear node of a QDQ ``onnx.ModelProto``, named after its input tensor.
    ``base_dir``: the folder of a model loaded without its external data (only scales and zero points are read)."""
    from onnx import TensorProto, numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    constants = {t.name: t for t in model.graph.initializer}
    constants.update({n.output[0]: n.attribute[0].t for n in model.graph.node if n.op_type == "Constant"})
    dequantized = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}

    def value(name: str) -> np.ndarray:
        if base_dir is not None and uses_external_data(constants[name]):
            load_external_data_for_tensor(constants[name], str(base_dir))
            constants[name].data_location = TensorProto.DEFAULT
        return numpy_helper.to_array(constants[name])

    def scale_of(name: str) -> np.ndarray:
        if name in constants:
            return value(name).astype(np.float32)
        # LPBQ: the block scales are integers dequantized by a float scale per channel
        node = dequantized[name]
        ints, meta, zero = (value(i).astype(np.float32) for i in node.input[:3])
        axis = _attribute(node, "axis", 1)
        shape = [1] * ints.ndim
        shape[axis] = -1
        return (ints - zero.reshape(shape)) * meta.reshape(shape)

    out = []
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or len(node.input) < 3 or node.input[2] not in constants:
            continue
        if node.input[1] not in constants and node.input[1] not in dequantized:
            continue
        zero_point = constants[node.input[2]]
        dtype = TensorProto.DataType.Name(zero_point.data_type).lower()  # "uint8", "int4", ...
        block_size = _attribute(node, "block_size", 0) or None
        scale = scale_of(node.input[1]) if block_size else scale_of(node.input[1]).reshape(-1)
        bw = int(re.sub(r"\D", "", dtype) or 0)
        zero = value(node.input[2]).astype(np.int64).reshape(scale.shape if block_size else -1)
        out.append(Encoding(node.input[0], bw, scale, zero, dtype, _attribute(node, "axis", None), None, block_size))
    return out


def _attribute(node, name: str, default: Any) -> Any:
    return next((a.i for a in node.attribute if a.name == name), default)


def apply_encodings(model, encodings: Iterable[Encoding], copy: bool = True):
    """A copy of the FP ``onnx.ModelProto`` (``copy=False``: ``model`` itself, changed in place) with a
    QuantizeLinear/DequantizeLinear pair at every named tensor; returns ``(model, number of entries applied)``.

    int32 (bias) encodings are left out: onnx has no int32 QuantizeLinear, and the sim does not quantize biases.
    A 1.0.0 file's implicit per-channel axis is the one dimension sized as the scales, else the consuming op's
    output-channel axis (MatMul: the last, Gather: the first).
    """
    import onnx

    out = onnx.ModelProto() if copy else model
    if copy:
        out.CopyFrom(model)
    graph = out.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {name: i for i, node in enumerate(graph.node) for name in node.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, i))
    inserted: dict[int, list] = {}  # producer node index (-1: before every node) -> QDQ nodes that follow it
    applied, needs_opset21 = 0, False
    for n, enc in enumerate(encodings):
        if enc.dtype == "int32":
            continue
        raw = f"{enc.name}__float"
        if enc.name in initializers:
            tensor = initializers[enc.name]
            tensor.name = raw
            position, shape = -1, list(tensor.dims)
        elif enc.name in producers:
            position = producers[enc.name]
            node = graph.node[position]
            node.output[list(node.output).index(enc.name)] = raw
            shape = None
        else:
            raise QuadapterError(f"encoding {enc.name!r} names no initializer or node output of the graph")
        pair, wide = _qdq_pair(graph, enc, n, raw, shape, consumers.get(enc.name, []))
        needs_opset21 |= wide
        inserted.setdefault(position, []).extend(pair)
        applied += 1
    nodes = list(inserted.get(-1, []))
    for i, node in enumerate(graph.node):
        nodes.append(node)
        nodes.extend(inserted.get(i, []))
    del graph.node[:]
    graph.node.extend(nodes)
    opset = next(o for o in out.opset_import if o.domain in ("", "ai.onnx"))
    if needs_opset21 and opset.version < 21:
        from onnx import version_converter

        out = version_converter.convert_version(out, 21)
    return out, applied


def _qdq_pair(graph, enc: Encoding, n: int, raw: str, shape: list[int] | None, uses: list) -> tuple[list, bool]:
    """The QDQ nodes from ``raw`` to ``enc.name`` (constants added to ``graph``), and whether they need opset 21."""
    from onnx import TensorProto, helper, numpy_helper

    np_type = helper.tensor_dtype_to_np_dtype(getattr(TensorProto, _ONNX_TYPES[enc.dtype]))
    needs_opset21 = enc.dtype in ("uint16", "int16", "uint4", "int4")
    attrs: dict[str, Any] = {}  # node attributes: make_node takes them as keyword arguments
    if enc.block_size is not None:
        attrs.update(axis=enc.axis, block_size=enc.block_size)
        scale, zero_point = enc.scale, enc.zero_point.astype(np_type)
        needs_opset21 = True
    elif enc.scale.size > 1:
        attrs["axis"] = _channel_axis(enc, shape, uses)
        scale, zero_point = enc.scale, enc.zero_point.astype(np_type)
    else:
        scale, zero_point = enc.scale.reshape(()), enc.zero_point.reshape(()).astype(np_type)
    s_name, z_name = f"{enc.name}__scale_{n}", f"{enc.name}__zero_point_{n}"
    graph.initializer.append(numpy_helper.from_array(scale, s_name))
    graph.initializer.append(numpy_helper.from_array(zero_point, z_name))
    q_name = f"{enc.name}__quantized"
    return [
        helper.make_node("QuantizeLinear", [raw, s_name, z_name], [q_name], name=f"{q_name}_q", **attrs),
        helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [enc.name], name=f"{q_name}_dq", **attrs),
    ], needs_opset21


def _channel_axis(enc: Encoding, shape: list[int] | None, uses: list[tuple[str, int]]) -> int:
    if enc.axis is not None and enc.axis >= 0:
        return enc.axis
    if shape is None:
        raise QuadapterError(f"per-channel encoding of {enc.name!r}, which is not a constant: not supported here")
    matching = [i for i, size in enumerate(shape) if size == enc.scale.size]
    if len(matching) == 1:
        return matching[0]
    ops = {op for op, _ in uses}
    if matching and ops <= {"MatMul", "Gemm"}:
        return len(shape) - 1  # a Linear exported as MatMul holds its weight as (in, out)
    if matching and ops <= {"Gather"}:
        return 0
    raise QuadapterError(f"cannot tell the channel axis of {enc.name!r} (shape {shape}, {enc.scale.size} scales)")


@dataclass(frozen=True)
class ExportScore:
    """Perplexity of an exported QDQ model on each dataset, and what it was computed with."""

    ppl: dict[str, float]  # dataset label -> perplexity
    sources: dict[str, str]  # dataset label -> the dataset as given
    seq_len: int
    label: str
    qdq: Path
    manifest: dict
    seconds: float


def eval_exported(
    export: str | Path,
    datasets: Sequence[str],
    split: str = "test",
    seq_len: int = EVAL_SEQ_LEN,
    stride: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] = lambda _text: None,
) -> ExportScore:
    """Perplexity of an exported QDQ model in onnxruntime."""
    import time

    from aimet_quadapter.models import load_tokenizer, quiet_libraries
    from aimet_quadapter.text.data import dataset_label
    from aimet_quadapter.text.perplexity import eval_windows_for, perplexity

    start = time.time()
    qdq, manifest = qdq_model_of(str(export))
    quiet_libraries()
    tokenizer = load_tokenizer(manifest["model"])
    lm = OnnxLM(qdq)
    if lm.fixed_len is not None and seq_len != lm.fixed_len:
        # the graph's input shape is fixed: its windows are the only ones it can score
        log(f"note: the export has a fixed sequence length of {lm.fixed_len}; evaluating windows of {lm.fixed_len}")
        seq_len = lm.fixed_len
    stride = min(stride, seq_len) if stride else None
    label = f"ONNX QDQ {manifest.get('method') or 'model'}"
    ppl: dict[str, float] = {}
    sources: dict[str, str] = {}
    for dataset in datasets:
        windows = eval_windows_for(tokenizer, dataset, split, seq_len, stride, max_tokens)
        column = dataset_label(dataset)
        ppl[column] = perplexity(lm, windows, desc=f"{label} {column}", progress=progress).ppl
        sources[column] = dataset
    if not all(math.isfinite(v) for v in ppl.values()):
        raise QuadapterError(f"the exported model {qdq} gave a non-finite perplexity: {ppl}")
    return ExportScore(ppl, sources, seq_len, label, Path(qdq), manifest, time.time() - start)
