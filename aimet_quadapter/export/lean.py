"""AIMET's ONNX exports, and the files they leave, with as few copies of the weights in memory at once as we can.

A protobuf message holding the weights costs far more than the weights while it is serialized (the
serializer grows its buffer by doubling, then copies it into a Python ``bytes``), and a parsed one keeps
every byte it ever held until it is freed as a whole. So nothing here parses or serializes a message
that holds the weights when the weights can travel by file instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from aimet_quadapter.memory import release_freed_memory
from aimet_quadapter.quant.aimet_adapter import wrapped_aimet_onnx_export

RAW_DATA = 9  # TensorProto.raw_data
INITIALIZER = 5  # GraphProto.initializer
GRAPH = 7  # ModelProto.graph
OPSET_IMPORT = 8  # ModelProto.opset_import
_LENGTH_DELIMITED = 2


# --- the sim's own weights, parked on disk while AIMET exports their quantize-dequantized copies ----------


class ParkedWeights:
    """Parameters of ``model`` that AIMET has swapped out for the duration of an export.

    AIMET's exports trace a quantize-dequantized copy of every quantized weight and keep the original
    Parameter aside until they return; torch then builds the graph and its protobuf beside both. The
    originals are not read again before the export returns, so they wait in ``folder`` meanwhile and
    :meth:`restore` reads them back, bit for bit, into the same Parameter objects.
    """

    def __init__(self, model: torch.nn.Module, folder: Path):
        self.model, self.folder = model, folder
        params = list({id(p): p for p in model.parameters()}.values())
        storages: dict[int, int] = {}
        for p in params:
            key = p.untyped_storage().data_ptr()
            storages[key] = storages.get(key, 0) + 1
        # a storage shared by two Parameters would come back as two: leave those where they are
        self.params = [p for p in params if p.numel() and storages[p.untyped_storage().data_ptr()] == 1]
        self.parked: list[tuple[torch.nn.Parameter, Path]] = []

    def park_displaced(self) -> None:
        """Move to disk every parameter that the model no longer holds (AIMET's copy stands in for it)."""
        present = {id(p) for p in self.model.parameters()}
        # AIMET rewraps a parameter it does not quantize in a new Parameter over the same storage: nothing to free
        in_use = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        parked = {id(p) for p, _ in self.parked}
        self.folder.mkdir(parents=True, exist_ok=True)
        for i, p in enumerate(self.params):
            if id(p) in present or id(p) in parked or p.untyped_storage().data_ptr() in in_use:
                continue
            path = self.folder / f"{i}.pt"
            torch.save(p.data, path)
            self.parked.append((p, path))
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        release_freed_memory()

    def restore(self) -> None:
        while self.parked:
            p, path = self.parked.pop()
            p.data = torch.load(path, weights_only=True)
            path.unlink()


@contextmanager
def lean_aimet_export(model: torch.nn.Module, folder: Path) -> Iterator[None]:
    """One call of AIMET's ONNX export (``sim.onnx.export`` or ``aimet_torch.onnx.export``) of ``model``, inside:

    - the Parameters AIMET swaps for their quantize-dequantized copies wait in ``folder`` until it returns
      (:class:`ParkedWeights`);
    - torch's exporter writes the graph with its weights in one external data file beside it
      (``<name>.data``) instead of inline: AIMET's passes that follow read the graph back and rewrite it
      several times, and they support external data. :func:`inline_weights` reads them back in at the end.
    """
    parked = ParkedWeights(model, folder)

    def export(original, module, args, f, **kwargs):
        parked.park_displaced()  # AIMET has swapped its copies in by now: the trace starts next
        with _torch_writes_weights_outside(str(f)) as patched:
            result = original(module, args, f, **kwargs)
        if not patched:  # another torch: the same, from the file it wrote
            import onnx

            graph = onnx.load(str(f))
            location = f"{os.path.basename(str(f))}.data"
            onnx.save(graph, str(f), save_as_external_data=True, all_tensors_to_one_file=True, location=location)
            del graph
        release_freed_memory()
        return result

    try:
        with wrapped_aimet_onnx_export(export):
            yield
    finally:
        parked.restore()
        release_freed_memory()


@contextmanager
def _torch_writes_weights_outside(path: str) -> Iterator[bool]:
    """torch's TorchScript exporter, made to hand its protobuf over with the weights moved to ``<path>.data``.

    It serializes the graph once in C++, then parses those bytes in Python to add onnxscript functions
    and serializes the result again (``_add_onnxscript_fn``), beside the bytes it parsed. Here the parsed
    message gives its weights to the data file first, exactly as ``onnx.save(...,
    save_as_external_data=True)`` would, and only the small rest is serialized and written by torch.
    Yields whether the hook was found (torch >= 2.9).
    """
    try:
        from torch.onnx._internal.torchscript_exporter import onnx_proto_utils
    except ImportError:
        yield False
        return
    original = getattr(onnx_proto_utils, "_add_onnxscript_fn", None)
    find = getattr(onnx_proto_utils, "_find_onnxscript_op", None)
    if original is None or find is None:
        yield False
        return

    def add_functions_then_move_weights(model_bytes: bytes, custom_opsets) -> bytes:
        import onnx
        from onnx.external_data_helper import convert_model_to_external_data, write_external_data_tensors

        model = onnx.load_model_from_string(model_bytes)
        functions: list = []
        find(model.graph, set(), custom_opsets, functions)
        if functions:
            model.functions.extend(functions)
        location = f"{os.path.basename(path)}.data"
        # onnx.save's defaults with save_as_external_data=True: which tensors move decides the final bytes
        convert_model_to_external_data(
            model, all_tensors_to_one_file=True, location=location, size_threshold=1024, convert_attribute=False
        )
        write_external_data_tensors(model, os.path.dirname(path) or ".")
        return model.SerializeToString()

    onnx_proto_utils._add_onnxscript_fn = add_functions_then_move_weights
    try:
        yield True
    finally:
        onnx_proto_utils._add_onnxscript_fn = original


# --- one self-contained ONNX file from a graph whose weights are in external data files -------------------


def _varint(buf, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _fields(buf, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """``(field number, start of its tag, start of its value or payload, end)`` of each field of a message."""
    pos, end = start, len(buf) if end is None else end
    while pos < end:
        tag, value = _varint(buf, pos)
        wire = tag & 7
        if wire == 0:
            _, stop = _varint(buf, value)
        elif wire == 1:
            stop = value + 8
        elif wire == _LENGTH_DELIMITED:
            length, value = _varint(buf, value)
            stop = value + length
        elif wire == 5:
            stop = value + 4
        else:
            raise ValueError(f"protobuf wire type {wire} is not used by ONNX")
        yield tag >> 3, pos, value, stop
        pos = stop


def _external_tensors_outside_initializers(graph, top: bool = True) -> int:
    from onnx.external_data_helper import uses_external_data

    count = 0 if top else sum(uses_external_data(t) for t in graph.initializer)
    for node in graph.node:
        for attr in node.attribute:
            count += sum(uses_external_data(t) for t in [attr.t, *attr.tensors] if t is not None)
            for sub in [attr.g, *attr.graphs]:
                count += _external_tensors_outside_initializers(sub, top=False)
    return count


def inline_weights(source: Path, target: Path) -> None:
    """``source`` (weights in external data files beside it) written to ``target`` as one file, the form a
    device converter or onnxruntime takes as it is; byte for byte what ``onnx.save(onnx.load(source))``
    writes. A graph over protobuf's 2 GB limit keeps one data file, ``<target>.data``.

    ``onnx.load`` + ``onnx.save`` would hold the weights three or four times over (the message, the
    serializer's buffer, the ``bytes``). Here the message is loaded without them, serialized with an empty
    ``raw_data`` where each external weight goes, and written out field by field with each weight read
    from its file into its place, one at a time.
    """
    import onnx
    from onnx import TensorProto
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(str(source), load_external_data=False)
    if _external_tensors_outside_initializers(model.graph):
        _inline_weights_in_memory(source, target)
        return
    base = source.parent
    pieces: dict[int, tuple[Path, int, int]] = {}  # initializer index -> (file, offset, length)
    for i, tensor in enumerate(model.graph.initializer):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        path = base / info.location
        offset = info.offset or 0
        length = info.length if info.length is not None else path.stat().st_size - offset
        pieces[i] = (path, offset, length)
        # what onnx.load leaves in a tensor it read from external data
        tensor.raw_data = b""
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]
    skeleton = model.SerializeToString()
    del model

    graphs = [f for f in _fields(skeleton) if f[0] == GRAPH]
    if len(graphs) != 1:
        raise ValueError(f"{source}: expected one graph in the model, found {len(graphs)}")
    _, graph_tag, graph_start, graph_end = graphs[0]
    # each external initializer: its field's tag, payload and end, its empty raw_data's span, its data
    spliced: list[tuple[int, int, int, int, int, int, tuple[Path, int, int]]] = []
    index, growth = 0, 0
    for number, tag, start, end in _fields(skeleton, graph_start, graph_end):
        if number != INITIALIZER:
            continue
        if index in pieces:
            empty = [(t, e) for n, t, _, e in _fields(skeleton, start, end) if n == RAW_DATA]
            if len(empty) != 1 or empty[0][1] - empty[0][0] != 2:  # tag and a zero length
                raise ValueError(f"{source}: initializer {index} did not serialize as expected")
            length = pieces[index][2]
            payload = (end - start) - 2 + _field_size(RAW_DATA, length)
            growth += _field_size(INITIALIZER, payload) - (end - tag)
            spliced.append((tag, start, end, empty[0][0], empty[0][1], payload, pieces[index]))
        index += 1
    graph_payload = graph_end - graph_start + growth
    total = len(skeleton) - (graph_end - graph_tag) + _field_size(GRAPH, graph_payload)
    if total >= onnx.checker.MAXIMUM_PROTOBUF:
        _inline_weights_in_memory(source, target)
        return

    with open(target, "wb") as out:
        out.write(skeleton[:graph_tag])
        out.write(_header(GRAPH, graph_payload))
        pos = graph_start
        for tag, start, end, raw_tag, raw_end, payload, (path, offset, length) in spliced:
            out.write(skeleton[pos:tag])
            out.write(_header(INITIALIZER, payload))
            out.write(skeleton[start:raw_tag])
            out.write(_header(RAW_DATA, length))
            with open(path, "rb") as data:
                data.seek(offset)
                copied = 0
                while copied < length:
                    chunk = data.read(min(1 << 24, length - copied))
                    if not chunk:
                        raise ValueError(f"{path} ends before the {length} bytes of an initializer of {source}")
                    out.write(chunk)
                    copied += len(chunk)
            out.write(skeleton[raw_end:end])
            pos = end
        out.write(skeleton[pos:])
    if target.stat().st_size != total:
        raise ValueError(f"{target}: wrote {target.stat().st_size} bytes, expected {total}")


def _header(number: int, length: int) -> bytes:
    """Tag and length of a length-delimited field."""
    return _encode_varint((number << 3) | _LENGTH_DELIMITED) + _encode_varint(length)


def _field_size(number: int, length: int) -> int:
    return len(_header(number, length)) + length


def _inline_weights_in_memory(source: Path, target: Path) -> None:
    import onnx

    graph = onnx.load(str(source))
    large = graph.ByteSize() >= onnx.checker.MAXIMUM_PROTOBUF
    onnx.save(graph, str(target), save_as_external_data=large, location=f"{target.name}.data")
    del graph
    release_freed_memory()


def opset_imports(path: Path) -> list[tuple[str, int]]:
    """``(domain, version)`` of each opset an ONNX file imports, read without reading its graph."""
    import mmap

    from onnx import OperatorSetIdProto

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        out = []
        for number, _, start, end in _fields(buf):
            if number == OPSET_IMPORT:
                opset = OperatorSetIdProto.FromString(buf[start:end])
                out.append((opset.domain, opset.version))
        return out
