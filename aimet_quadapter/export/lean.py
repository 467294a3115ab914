"""AIMET's ONNX exports, and the files they leave, with as few copies of the weights in memory at once as we can.

A protobuf message holding the weights costs far more than the weights while it is serialized (the
serializer grows its buffer by doubling, then copies it into a Python ``bytes``), and a parsed one keeps
every byte it ever held until it is freed as a whole. So nothing here parses or serializes a message
that holds the weights when the weights can travel by file instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from aimet_quadapter.memory import release_freed_memory
from aimet_quadapter.models.storage import ParkedWeights
from aimet_quadapter.quant.aimet_private import (
    qdq_weights_module_by_module,
    transposed_weights_written_out,
    wrapped_aimet_onnx_export,
)


@contextmanager
def lean_aimet_export(model: torch.nn.Module, folder: Path) -> Iterator[None]:
    """One call of AIMET's ONNX export (``sim.onnx.export`` or ``aimet_torch.onnx.export``) of ``model``, inside:

    - the Parameters AIMET swaps for their quantize-dequantized copies wait in ``folder`` until it returns
      (:class:`ParkedWeights`), each module's as soon as its copies are made;
    - torch's exporter writes the graph with its weights in one external data file beside it
      (``<name>.data``) instead of inline, one weight at a time (:func:`_torch_writes_weights_outside`):
      AIMET's passes that follow read the graph back and rewrite it several times, and they support external
      data. :func:`gather_external_data` makes one data file of them;
    - once torch has written them, AIMET's copies are emptied too (:meth:`ParkedWeights.drop_stand_ins`);
    - the transposed weights AIMET's pass that follows makes go to their files as they are made, without a copy
      in memory (:func:`transposed_weights_written_out`).
    """
    parked = ParkedWeights(model, folder)

    def export(original, module, args, f, **kwargs):
        parked.park_displaced()  # AIMET has swapped its copies in by now: the trace starts next
        with _torch_writes_weights_outside(str(f), kwargs) as patched:
            result = original(module, args, f, **kwargs)
        if not patched:  # another torch: the same, from the file it wrote
            import onnx

            graph = onnx.load(str(f))
            location = f"{os.path.basename(str(f))}.data"
            onnx.save(graph, str(f), save_as_external_data=True, all_tensors_to_one_file=True, location=location)
            del graph
        parked.drop_stand_ins()
        return result

    try:
        # each module's originals leave as soon as AIMET has made its copies, not once all copies exist
        with (
            qdq_weights_module_by_module(lambda: parked.park_displaced(release=False)),
            wrapped_aimet_onnx_export(export),
            transposed_weights_written_out(),
        ):
            yield
    finally:
        parked.restore()
        release_freed_memory()


@contextmanager
def _torch_writes_weights_outside(path: str, kwargs: dict) -> Iterator[bool]:
    """torch's TorchScript exporter, made to write the graph's weights into ``<path>.data`` one at a time.

    Left alone, it encodes the graph and every weight into one C++ protobuf, serializes that and hands the
    bytes to Python: three copies of the weights at once. Asked for
    ``export_params=False`` (set in ``kwargs``), it encodes the graph alone, the weights as inputs. The weights
    it would have written, after its constant folding and deduplication, are taken from its deduplication
    pass and added back here as initializers, in its encoder's order and form, each one moved to the data
    file as soon as it is made, as ``onnx.save(..., save_as_external_data=True)`` would move it. Yields whether
    the hooks were found (torch >= 2.9); the caller then does the same from the file torch wrote.
    """
    try:
        from torch import _C
        from torch.onnx._internal.torchscript_exporter import onnx_proto_utils
    except ImportError:
        yield False
        return
    add_functions = getattr(onnx_proto_utils, "_add_onnxscript_fn", None)
    find = getattr(onnx_proto_utils, "_find_onnxscript_op", None)
    deduplicate = getattr(_C, "_jit_pass_onnx_deduplicate_initializers", None)
    # without the deduplication pass (initializers kept as inputs) torch never says which weights it writes
    asked_otherwise = kwargs.get("export_params") is False or kwargs.get("keep_initializers_as_inputs")
    if add_functions is None or find is None or deduplicate is None or asked_otherwise:
        yield False
        return
    weights: dict[str, torch.Tensor] = {}

    def deduplicate_and_keep(graph, params, *rest):
        params = deduplicate(graph, params, *rest)
        weights.clear()
        weights.update(params)
        return params

    kwargs["export_params"] = False
    onnx_proto_utils._add_onnxscript_fn = partial(_add_functions_then_weights, find=find, path=path, weights=weights)
    _C._jit_pass_onnx_deduplicate_initializers = deduplicate_and_keep
    try:
        yield True
    finally:
        onnx_proto_utils._add_onnxscript_fn = add_functions
        _C._jit_pass_onnx_deduplicate_initializers = deduplicate
        weights.clear()


def _add_functions_then_weights(
    model_bytes: bytes, custom_opsets: Any, *, find: Any, path: str, weights: dict[str, torch.Tensor]
) -> bytes:
    """torch's ``_add_onnxscript_fn`` (``find``), then ``weights`` added as initializers in torch's encoder's
    order, each one's data written into ``<path>.data`` as it is made."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import set_external_data

    model = onnx.load_model_from_string(model_bytes)
    functions: list = []
    find(model.graph, set(), custom_opsets, functions)
    if functions:
        model.functions.extend(functions)
    location = f"{os.path.basename(path)}.data"
    inputs = [i for i in model.graph.input if i.name not in weights]
    order = [i.name for i in model.graph.input if i.name in weights]  # torch's encoder's order
    if len(order) != len(weights):
        raise RuntimeError(f"torch's graph has no input for the weights {sorted(set(weights) - set(order))[:3]}")
    with open(os.path.join(os.path.dirname(path) or ".", location), "wb") as data:
        for name in order:
            tensor = numpy_helper.from_array(weights.pop(name).detach().cpu().numpy(), name)
            if len(tensor.raw_data) >= 1024:  # onnx.save's size_threshold
                set_external_data(tensor, location, data.tell(), len(tensor.raw_data))
                data.write(tensor.raw_data)
                tensor.ClearField("raw_data")
            model.graph.initializer.append(tensor)
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    return model.SerializeToString()


def export_sim_graphs(
    sim: Any, args: tuple, folder: Path, stem: str, encoding_version: str, what: str, opset: int | None = None, **common
) -> None:
    """AIMET's two exports of ``sim.model`` traced on ``args`` into ``folder``: ``<stem>.onnx`` + ``<stem>.data``
    + ``<stem>.encodings`` (``sim.onnx.export``: the FP graph and its encodings, for a converter) and
    ``<stem>_qdq.onnx`` + ``<stem>_qdq.data`` (``aimet_torch.onnx.export``: QDQ nodes, for onnxruntime), each
    with the sim's weights parked while it traces and its weights gathered into one data file. ``what`` names
    the graph in errors; ``opset``: the FP graph's (default: torch's; the QDQ graph's is ``QDQ_OPSET``);
    ``common``: torch.onnx.export's arguments for both (input and output names, dynamic axes)."""
    import aimet_torch.onnx

    from aimet_quadapter.export.formats import QDQ_OPSET
    from aimet_quadapter.export.tracing import run_aimet_export

    scratch = folder / f".scratch-{stem}"
    parked = scratch / "parked"  # the sim's weights while AIMET traces their quantize-dequantized copies
    fp, qdq = scratch / "fp" / f"{stem}.onnx", scratch / "qdq" / f"{stem}_qdq.onnx"
    fp.parent.mkdir(parents=True)
    qdq.parent.mkdir(parents=True)
    try:
        with lean_aimet_export(sim.model, parked):
            run_aimet_export(
                f"AIMET's FP ONNX + encodings export of {what} (sim.onnx.export)",
                sim.onnx.export, args, str(fp), encoding_version=encoding_version,
                **common, **({"opset_version": opset} if opset else {}),
            )  # fmt: skip
        # a second context: the parked weights must be back before this export makes its copies of them
        with lean_aimet_export(sim.model, parked):
            run_aimet_export(
                f"AIMET's QDQ ONNX export of {what} (aimet_torch.onnx.export)",
                aimet_torch.onnx.export,
                sim.model,
                args,
                str(qdq),
                opset_version=QDQ_OPSET,
                export_int32_bias=False,  # the sim leaves biases in float: so does the graph that must equal it
                **common,
            )
        encodings = fp.with_suffix(".encodings")
        if not encodings.is_file():
            from aimet_quadapter.errors import QuadapterError

            raise QuadapterError(f"AIMET's export of {what} wrote no {encodings.name} file")
        encodings.rename(folder / encodings.name)
        gather_external_data(fp, folder / fp.name)
        gather_external_data(qdq, folder / qdq.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --- the kept files: one graph and one external data file beside it ---------------------------------------

_ALIGN = 4096  # each tensor starts on a page in the data file, so that a runtime can map it in place


def gather_external_data(source: Path, target: Path) -> None:
    """``source`` (its weights in the external data files AIMET's passes left beside it, one or many) written
    as ``target`` (the graph, weights out) and ``<target stem>.data`` (every weight, one after another): ONNX
    external data, the form onnxruntime, QAIRT and AI Hub take as it is, and the only one for graphs over
    protobuf's 2 GB. Streamed one tensor at a time through onnx's own external-data helpers: only the graph
    without its weights is ever parsed or serialized."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, set_external_data, uses_external_data

    from aimet_quadapter.export.formats import data_file

    model = onnx.load(str(source), load_external_data=False)
    location = data_file(target.name)
    with open(target.parent / location, "wb") as out:
        for tensor in _all_tensors(model.graph):
            if uses_external_data(tensor):
                info = ExternalDataInfo(tensor)
                with open(source.parent / info.location, "rb") as data:
                    data.seek(info.offset or 0)
                    payload = data.read(info.length) if info.length is not None else data.read()
            elif tensor.HasField("raw_data") and len(tensor.raw_data) >= 1024:  # torch's threshold, and onnx's
                payload = tensor.raw_data
            else:
                continue
            offset = -out.tell() % _ALIGN + out.tell()
            out.seek(offset)
            out.write(payload)
            tensor.raw_data = b""  # the helper asks for the field it then moves out
            set_external_data(tensor, location, offset, len(payload))
            tensor.ClearField("raw_data")
    onnx.save(model, str(target))
    del model
    release_freed_memory()


def _all_tensors(graph) -> Iterator:
    """The initializers of ``graph`` and of the graphs its nodes hold (If, Loop, Scan)."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g, *attribute.graphs] if attribute.HasField("g") else attribute.graphs:
                yield from _all_tensors(sub)


def opset_imports(path: Path) -> list[tuple[str, int]]:
    """``(domain, version)`` of each opset an ONNX file imports (its weights left where they are)."""
    import onnx

    return [(o.domain, o.version) for o in onnx.load(str(path), load_external_data=False).opset_import]
