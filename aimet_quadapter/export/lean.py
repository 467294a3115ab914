"""AIMET's ONNX exports, and the files they leave, with as few copies of the weights in memory at once as we can.

A protobuf message holding the weights costs several times the weights while serialized, and keeps every byte until
freed as a whole: nothing here parses or serializes one when the weights can travel by file instead.
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

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.formats import QDQ_OPSET, data_file
from aimet_quadapter.export.tracing import run_aimet_export
from aimet_quadapter.memory import release_freed_memory
from aimet_quadapter.models.storage import ParkedWeights
from aimet_quadapter.quant.aimet_private import (
    qdq_weights_module_by_module,
    transposed_weights_written_out,
    wrapped_aimet_onnx_export,
)


@contextmanager
def lean_aimet_export(model: torch.nn.Module, folder: Path) -> Iterator[None]:
    """One call of AIMET's ONNX export of ``model`` inside: the Parameters AIMET swaps for their quantize-dequantized
    copies wait in ``folder`` (:class:`ParkedWeights`); torch writes the weights into ``<name>.data`` one at a time;
    AIMET's copies are emptied once written, and the transposed weights it makes go to their files as made.
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
    """torch's TorchScript exporter, made to write the graph's weights into ``<path>.data`` one at a time: the graph
    alone (``export_params=False``), then the weights its deduplication pass keeps. Yields whether the hooks were
    found (torch >= 2.9)."""
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
    """torch's ``_add_onnxscript_fn`` (``find``), then ``weights`` added as initializers, written to ``<path>.data``."""
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
    """AIMET's two exports of ``sim.model`` traced on ``args`` into ``folder``: ``<stem>.onnx`` + ``.data`` +
    ``.encodings`` (for a converter) and ``<stem>_qdq.onnx`` + ``.data`` (for onnxruntime). ``what`` names the graph
    in errors; ``opset``: the FP graph's; ``common``: torch.onnx.export's arguments for both."""
    import aimet_torch.onnx

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
            raise QuadapterError(f"AIMET's export of {what} wrote no {encodings.name} file")
        encodings.rename(folder / encodings.name)
        gather_external_data(fp, folder / fp.name)
        gather_external_data(qdq, folder / qdq.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


_ALIGN = 4096  # each tensor starts on a page in the data file, so that a runtime can map it in place


def gather_external_data(source: Path, target: Path) -> None:
    """``source`` (its weights in the data files AIMET left beside it) written as ``target`` and one
    ``<target stem>.data``: ONNX external data, which onnxruntime, QAIRT and AI Hub take, and the only form past
    protobuf's 2 GB. Streamed one tensor at a time."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, set_external_data, uses_external_data

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
