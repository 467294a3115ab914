"""Export for on-device inference (ONNX + AIMET encodings, QDQ ONNX), proven equal to the sim in onnxruntime."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from aimet_quadapter.cli import main
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export import exporter as export_module
from aimet_quadapter.export import lean
from aimet_quadapter.export.exporter import (
    Tolerance,
    check_quantizer_coverage,
    export_quantized,
    verify_export,
)
from aimet_quadapter.export.formats import ENCODING_VERSION, ENCODINGS, QDQ_ONNX
from aimet_quadapter.export.hf import HFCheckpoint, load_hf_export
from aimet_quadapter.export.lean import gather_external_data, opset_imports
from aimet_quadapter.export.noise import noise_band, shuffled_sums
from aimet_quadapter.export.onnx_eval import (
    OnnxLM,
    graph_tensor_names,
    ort_session,
    qdq_graph_encodings,
    read_encodings,
)
from aimet_quadapter.models import prepare_model, quiet_libraries
from aimet_quadapter.models.storage import ParkedWeights
from aimet_quadapter.quadapter.api import QuadapterParameters, apply_quadapter
from aimet_quadapter.quadapter.phase1 import Phase1Parameters
from aimet_quadapter.quadapter.phase2 import Phase2Parameters
from aimet_quadapter.quadapter.state import QuadapterState, resolve_state
from aimet_quadapter.quant.aimet_private import qdq_weights_module_by_module, wrapped_aimet_onnx_export
from aimet_quadapter.quant.config import QuantPolicy
from aimet_quadapter.quant.policy import build_sim, calibrate
from aimet_quadapter.quant.quantizers import quantizers, shared_activation_groups
from aimet_quadapter.testing import sample_corpus, toy_model
from aimet_quadapter.text.data import Window
from aimet_quadapter.text.perplexity import perplexity

quiet_libraries()
SEQ = 32


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def toy(request):
    """A planted-outlier toy model, text sampled from it, and its PTQ state rebuilt into a fresh sim."""
    model = toy_model(request.param)
    corpus = sample_corpus(model, 10, SEQ, seed=1)
    sim = build_sim(model)
    calibrate(sim, [corpus[:2], corpus[2:4]])
    state = QuadapterState.from_sim(sim, {}, method="ptq")
    return {
        "family": request.param,
        "model": model,
        "state": state,
        "calib": [corpus[:2], corpus[2:4]],
        "train": [corpus[4:6]],
        "verify": list(corpus[6:9]),
        "held_out": corpus[9:10],
    }


def _exported_equals_sim(sim, out: Path, ids: torch.Tensor) -> float:
    """Max |onnxruntime - sim| / max |sim| of the QDQ graph on ``ids``, computed here, not by the export.

    Run as written (no graph optimizations), the tiny graphs reproduce the sim to float32 rounding; the
    optimized run may flip one rounding somewhere, which the export's own check measures as its floor.
    """
    with torch.no_grad():
        reference = sim.model(ids)
    return float((OnnxLM(out / QDQ_ONNX, optimize=False)(ids) - reference).abs().max() / reference.abs().max())


# How near a grid midpoint float32 rounding can leave a value another summation order puts on its other side: 2^-16
# of its size, 256 ulps (a dot product's rounding grows with its length and with the cancellation in it).
NEAR_MIDPOINT = 2.0**-16


def _sim_logits(sim, ids: torch.Tensor, flips: list[tuple[int, int]], near: list | None = None) -> torch.Tensor:
    """The sim's logits on ``ids`` with each (activation quantizer, element) of ``flips`` rounded to the other
    side of its grid midpoint; ``near``: filled with the (quantizer, element) pairs within NEAR_MIDPOINT of one."""
    handles = []
    active = [q for _, role, q in quantizers(sim.model) if role != "weight"]
    for i, q in enumerate(active):

        def pre(module, args, i=i, q=q):
            x = args[0]
            scale = torch.broadcast_to(q.get_scale().detach().reshape(-1), x.shape).reshape(-1)
            steps = x.reshape(-1) / scale
            if near is not None:
                gap = (steps - torch.floor(steps) - 0.5).abs()
                near.extend((i, int(e)) for e in torch.nonzero(gap <= NEAR_MIDPOINT * steps.abs()).reshape(-1))
            mine = [e for j, e in flips if j == i]
            if not mine:
                return None  # the input untouched, to the bit
            x = x.clone().reshape(-1)
            for at in mine:
                midpoint = torch.floor(steps[at]) + 0.5
                x[at] = (midpoint + (0.25 if steps[at] < midpoint else -0.25)) * scale[at]
            return (x.reshape(args[0].shape), *args[1:])

        handles.append(q.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            return sim.model(ids.reshape(1, -1))
    finally:
        for handle in handles:
            handle.remove()


def _check_exported_equals_sim(sim, out: Path, ids: torch.Tensor, most_flips: int = 2) -> list[tuple[int, int]]:
    """The QDQ graph, run as written, computes the sim's logits to float32 rounding, but for at most ``most_flips``
    activation codes that float32 rounding decides: the flips found, none where the logits agree at once.

    Its float32 summation order is not torch's (nor is torch's the same under its AVX2 and AVX-512 kernels):
    where a value lies within that rounding of a grid midpoint, its code moves by one step, and every layer
    after it moves with it (3.3e-3 of the largest logit on an AMD EPYC under torch's AVX-512 kernels, below
    1e-5 under its AVX2 ones). So where the logits differ, the codes within NEAR_MIDPOINT of a midpoint are
    flipped in the sim, one at a time, and the one that brings it to the graph's logits kept. A wrong weight or
    encoding moves codes far from any midpoint: no flip explains it.
    """
    graph = OnnxLM(out / QDQ_ONNX, optimize=False)(ids)
    flips: list[tuple[int, int]] = []
    while True:
        near: list[tuple[int, int]] = []
        reference = _sim_logits(sim, ids, flips, near)
        scale = float(reference.abs().max())
        if float((graph - reference).abs().max()) < 1e-5 * scale:
            return flips
        assert len(flips) < most_flips, f"the QDQ graph differs from the sim beyond {most_flips} flipped roundings"
        tried = {c: float((graph - _sim_logits(sim, ids, [*flips, c])).abs().max()) for c in near if c not in flips}
        assert tried, f"the QDQ graph differs by {float((graph - reference).abs().max()) / scale:.2e}, no code is near"
        flips.append(min(tried, key=lambda c: tried[c]))


def _patched_internals() -> dict:
    """What of torch and AIMET the export replaces while it runs (aimet_private, export/lean.py), by identity."""
    import aimet_torch.onnx as aimet_onnx
    from aimet_torch.experimental import onnx as aimet_onnx_export
    from aimet_torch.quantsim import QuantizationSimModel
    from torch import _C
    from torch.onnx._internal.torchscript_exporter import onnx_proto_utils

    return {
        "torch's _add_onnxscript_fn": onnx_proto_utils._add_onnxscript_fn,
        "torch's deduplication pass": _C._jit_pass_onnx_deduplicate_initializers,
        "AIMET's export": aimet_onnx_export.export,
        "AIMET's onnx module": aimet_onnx.onnx,
        "AIMET's weight QDQ": QuantizationSimModel.__dict__["_apply_qdq_to_model_parameters"],
    }


@pytest.mark.parametrize("version", ["1.0.0", "2.0.0"])
def test_export_after_ptq_matches_the_sim(toy, version, tmp_path):
    sim = toy["state"].build_sim(toy["model"])
    before = {name: p.detach().clone() for name, p in sim.model.named_parameters()}
    internals = _patched_internals()
    out = tmp_path / "export"
    result = export_quantized(
        sim, out, SEQ, version, verify_windows=toy["verify"], model_name="toy", method=toy["state"].metadata["method"]
    )
    assert _patched_internals() == internals  # every patch undone: the process is as it was
    _check_ptq_export(sim, before, out, result, version, toy["verify"], toy["held_out"])
    assert not list(tmp_path.glob(".export.*"))


def test_the_gpt2_export_matches_the_sim(gpt2_export_run):
    """The quick suite's case of the test above: the export the verification tests below break copies of."""
    run = gpt2_export_run
    _check_ptq_export(run.sim, run.before, run.out, run.result, ENCODING_VERSION, run.windows, run.held_out)
    assert not list(run.out.parent.glob(".export.*"))
    assert run.internals[0] == run.internals[1]  # every patch of torch's and AIMET's undone


def _check_ptq_export(
    sim, before: dict, out: Path, result, version: str, windows: list[torch.Tensor], held_out: torch.Tensor
) -> None:
    # the weights parked on disk during AIMET's exports are back, bit for bit
    after = dict(sim.model.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], value) for name, value in before.items())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == json.loads(json.dumps(result.manifest))
    assert manifest["method"] == "ptq" and manifest["encodings_version"] == version and manifest["seq_len"] == SEQ
    assert manifest["opset"]["model_qdq.onnx"] == 21
    kept = {"model.onnx", "model.data", "model.encodings", "model_qdq.onnx", "model_qdq.data"}
    assert set(manifest["files"]) == kept
    # AIMET's passes left a weight file per tensor: each graph now has its weights in one data file, nothing is left
    assert sorted(p.name for p in out.iterdir()) == sorted([*kept, "manifest.json"])
    for name in ("model", "model_qdq"):
        graph = onnx.load(str(out / f"{name}.onnx"), load_external_data=False)
        moved = [t for t in graph.graph.initializer if uses_external_data(t)]
        assert moved and {ExternalDataInfo(t).location for t in moved} == {f"{name}.data"}
        assert all(int(ExternalDataInfo(t).offset) % 4096 == 0 for t in moved)  # page-aligned, for mapping
    for name, info in manifest["files"].items():
        data = (out / name).read_bytes()
        assert info["bytes"] == len(data) and info["sha256"] == hashlib.sha256(data).hexdigest()
    assert json.loads((out / ENCODINGS).read_text())["version"] == version
    qdq = onnx.load(str(out / QDQ_ONNX))
    ops = {n.op_type for n in qdq.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert qdq.graph.input[0].type.tensor_type.shape.dim[1].dim_value == SEQ  # static by default
    report = result.verification
    assert report.quantizers == sum(1 for _ in quantizers(sim.model))
    # the encodings file applied to the FP graph computes what AIMET's QDQ graph computes, to the bit
    assert report.encodings_vs_qdq.max_abs_logit_diff == 0.0
    _check_exported_equals_sim(sim, out, held_out)
    if any(_check_exported_equals_sim(sim, out, ids) for ids in windows):
        return  # a rounding flipped on the verification windows: the export's own bounds held, or it would refuse
    for agreement in [*report.agreements, report.floor, report.encodings_vs_qdq]:
        # float32 reassociation only, and no rounding flipped: far inside the tolerance
        assert agreement.ppl_rel_diff < 1e-5 and agreement.max_abs_logit_diff < 1e-4 * report.max_abs_sim_logit
        assert agreement.top1_agreement == 1.0
    # the sim's one-ulp draws flip a rounding where a value sits that close to a midpoint, which the machine's
    # kernels decide: a flip or two, not a step's move of every input
    assert report.sim_floor.ppl_rel_diff < 1e-3


def test_export_after_quadapter(toy, tmp_path):
    """Phase 2 learns ranges; the readers of one tensor (q/k/v, gate/up) share theirs, so the trained state
    exports as it is, with no merge, and the export computes what the trained sim computed."""
    model = toy["model"]
    sim = build_sim(model)
    params = QuadapterParameters(phase1=Phase1Parameters(steps=4), phase2=Phase2Parameters(steps=2, lr_ranges=1e-2))
    result = apply_quadapter(sim, model, toy["calib"], toy["train"], params, progress=False)
    path = result.state.save(tmp_path / "quadapter.safetensors")
    rebuilt = QuadapterState.load(path).build_sim(model)  # what the CLI exports
    shared = shared_activation_groups(rebuilt.model)
    found = {f"{p}.{r}": q for p, r, q in quantizers(rebuilt.model)}
    if toy["family"] == "llama":
        assert shared
        for keys in shared:  # one range per tensor: trained together, saved and rebuilt equal
            assert len({id(found[k].min) for k in keys}) == 1 and len({id(found[k].max) for k in keys}) == 1
            assert len({tuple(result.state.ranges[k][1].reshape(-1).tolist()) for k in keys}) == 1
    else:
        assert not shared  # GPT-2's fused c_attn: every activation quantizer has a tensor of its own
    out = tmp_path / "export"
    exported = export_quantized(
        rebuilt, out, SEQ, verify_windows=toy["verify"], method="quadapter", formats=[HFCheckpoint()]
    )
    assert exported.manifest["method"] == "quadapter"
    assert exported.manifest["shared_ranges_merged"] == []
    _check_exported_equals_sim(rebuilt, out, toy["held_out"])
    _check_exported_equals_sim(sim, out, toy["held_out"])  # the trained sim itself
    # the exported weights are the folded ones: an FP graph of the unfolded model would differ
    assert result.state.alphas and any((a - 1).abs().max() > 1e-3 for a in result.state.alphas.values())

    # the way back, as a user takes it with nothing of this package: transformers' loader, a fresh AIMET sim
    # under the saved policy, AIMET's own encodings loader; it reproduces the state's perplexity
    from aimet_torch.quantsim import load_encodings_to_sim
    from transformers import AutoModelForCausalLM

    hf = out / "hf"
    plain = AutoModelForCausalLM.from_pretrained(str(hf))
    head, embedding = plain.get_output_embeddings().weight, plain.get_input_embeddings().weight
    assert not torch.equal(head, embedding)  # lm_head untied: the head site's alpha is folded into it alone
    fresh = build_sim(prepare_model(plain), QuantPolicy(**json.loads((hf / "quantization.json").read_text())))
    with pytest.warns(DeprecationWarning):  # AIMET's JSON loader, deprecated for its state dicts, works
        load_encodings_to_sim(fresh, str(hf / "model_torch.encodings"))
    windows = [Window(ids.reshape(-1), 1) for ids in toy["verify"]]
    state_ppl = perplexity(rebuilt.model, windows, progress=False).ppl
    assert perplexity(fresh.model, windows, progress=False).ppl == pytest.approx(state_ppl, rel=1e-6)
    exact, from_json = exported.manifest["hf"]["verification"]
    assert exact["ranges_from"] == "quantizer_state.pt" and exact["max_abs_logit_diff"] == 0.0
    assert from_json["ranges_from"] == "model_torch.encodings" and from_json["ppl_rel_diff"] < 1e-6


def _straightforward_aimet_export(model, folder):
    """What the export did before it parked weights and had torch write them outside the graph: torch writes
    the graph with its weights inline, then it is loaded and saved again with them in an external file."""

    def export(original, module, args, f, **kwargs):
        result = original(module, args, f, **kwargs)
        onnx.save(onnx.load(str(f)), str(f), save_as_external_data=True, location=f"{Path(f).name}.data")
        return result

    return wrapped_aimet_onnx_export(export)


def _save_in_memory(source: Path, target: Path) -> None:
    onnx.save(onnx.load(str(source)), str(target), save_as_external_data=True, location=f"{target.stem}.data")


def _loaded(path: Path) -> bytes:
    """The model with every weight read back in: what a runtime sees, whichever way its files are laid out."""
    model = onnx.load(str(path))
    for tensor in model.graph.initializer:
        tensor.ClearField("data_location")  # set (to DEFAULT) on the tensors that were read from a data file
    return model.SerializeToString()


@pytest.mark.slow
def test_lean_export_writes_what_the_straightforward_one_writes(toy, tmp_path, monkeypatch):
    """Parking the sim's weights, torch's weights going straight to a data file and the streamed gathering
    change how much memory an export holds, not what the files hold."""
    sim = toy["state"].build_sim(toy["model"])
    export_quantized(sim, tmp_path / "lean", SEQ, verify_windows=toy["verify"][:1])
    monkeypatch.setattr(lean, "lean_aimet_export", _straightforward_aimet_export)
    monkeypatch.setattr(lean, "gather_external_data", _save_in_memory)
    export_quantized(sim, tmp_path / "plain", SEQ, verify_windows=toy["verify"][:1])
    for name in ("model.onnx", "model_qdq.onnx"):
        assert _loaded(tmp_path / "lean" / name) == _loaded(tmp_path / "plain" / name), name
    assert (tmp_path / "lean" / ENCODINGS).read_bytes() == (tmp_path / "plain" / ENCODINGS).read_bytes()


def test_aimets_transposed_weights_go_to_their_files_without_a_copy_in_memory(toy, tmp_path, monkeypatch):
    """AIMET's pass that transposes the Linear weights writes the same graph and files when its copies are made
    without bytes; and the hook finds that pass, or the memory it saves is silently spent again."""
    import contextlib

    import aimet_torch.onnx

    sim = toy["state"].build_sim(toy["model"])
    args = (toy["verify"][0][None],)

    def export(folder: Path) -> dict[str, bytes]:
        folder.mkdir()
        lean.export_sim_graphs(sim, args, folder, "m", ENCODING_VERSION, "the toy", dynamo=False)
        return {p.name: _loaded(p) if p.suffix == ".onnx" else p.read_bytes() for p in folder.iterdir()}

    written: list[list[str]] = []
    hook = lean.transposed_weights_written_out

    @contextlib.contextmanager
    def watched():
        with hook() as names:
            yield names
        written.append(list(names))

    monkeypatch.setattr(lean, "transposed_weights_written_out", watched)
    files = export(tmp_path / "hooked")
    assert len(written) == 2 and all(written)  # both of AIMET's exports transpose the toy's Linear weights
    monkeypatch.setattr(lean, "transposed_weights_written_out", contextlib.nullcontext)
    assert export(tmp_path / "plain") == files
    assert aimet_torch.onnx.onnx is onnx  # AIMET's module sees onnx itself again


def test_aimet_swaps_in_its_weight_copies_one_module_at_a_time(toy, tmp_path):
    """AIMET's pass that swaps every quantized weight for its quantize-dequantized copy, run module by module
    with the originals parked after each: never all originals and all copies at once; everything back after."""
    from aimet_torch.nn import BaseQuantizationMixin
    from aimet_torch.quantsim import QuantizationSimModel

    sim = toy["state"].build_sim(toy["model"])
    before = {name: p.detach().clone() for name, p in sim.model.named_parameters()}
    parked = ParkedWeights(sim.model, tmp_path / "parked")
    modules = [m for m in sim.model.modules() if isinstance(m, BaseQuantizationMixin)]
    weights = {
        id(p) for m in modules for n, p in m.named_parameters(recurse=False) if m.param_quantizers[n] is not None
    }
    counts: list[int] = []

    def park() -> None:
        parked.park_displaced(release=False)
        counts.append(len(parked.parked))

    with qdq_weights_module_by_module(park), QuantizationSimModel._apply_qdq_to_model_parameters(sim.model):
        assert not weights & {id(p) for p in sim.model.parameters()}  # every quantized weight is AIMET's copy now
        assert len(counts) == len(modules) > 1
        # each module's originals left right after its copies were made, one module's worth at a time
        assert counts == sorted(counts) and counts[0] < counts[-1] == len(weights)
    parked.restore()
    after = dict(sim.model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items())


@pytest.mark.slow
def test_the_sims_weights_wait_on_disk_while_onnxruntime_runs(toy, tmp_path, monkeypatch):
    """The verification's onnxruntime sessions each hold the weights: the sim's, read no more, are on disk
    meanwhile, and back bit for bit after."""
    sim = toy["state"].build_sim(toy["model"])
    before = {name: p.detach().clone() for name, p in sim.model.named_parameters()}
    held: list[int] = []

    class Watched(OnnxLM):
        def __init__(self, *args, **kwargs):
            held.append(sum(p.numel() for p in sim.model.parameters()))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(export_module, "OnnxLM", Watched)
    export_quantized(sim, tmp_path / "export", SEQ, verify_windows=toy["verify"][:1])
    assert len(held) == len(export_module.FORMS) and set(held) == {0}
    after = dict(sim.model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items())


def test_gather_external_data_keeps_every_tensor(tmp_path):
    """From a weight file per tensor (as AIMET's passes leave them) to one data file: the same model once
    loaded, small tensors kept inline, a Constant node's value left where it is, opsets readable."""
    rng = np.random.default_rng(0)
    sizes = [10, 300, 5000, 17, 200_000, 3]
    weights = [numpy_helper.from_array(rng.random(n).astype(np.float32), f"w{i}") for i, n in enumerate(sizes)]
    constant = numpy_helper.from_array(np.ones(1000, np.float32))
    nodes = [helper.make_node("Add", ["x", "w0"], ["y"]), helper.make_node("Constant", [], ["c"], value=constant)]
    io = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [10]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "g", io[:1], io[1:], initializer=weights, doc_string="doc")
    model = helper.make_model(graph, producer_name="test")
    model.metadata_props.add(key="k", value="v")
    source = tmp_path / "many" / "model.onnx"
    source.parent.mkdir()
    onnx.save(model, str(source), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=5000)
    assert len(list(source.parent.iterdir())) > 2
    target = tmp_path / "one" / "model.onnx"
    target.parent.mkdir()
    gather_external_data(source, target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.data", "model.onnx"]
    assert _loaded(target) == _loaded(source)
    loaded = onnx.load(str(target)).graph.initializer
    assert all(np.array_equal(numpy_helper.to_array(t), numpy_helper.to_array(w)) for t, w in zip(loaded, weights))
    kept = onnx.load(str(target), load_external_data=False).graph.initializer
    # w1 (1.2 kB) was inline in the source: a weight of 1 kB or more moves too
    assert [uses_external_data(t) for t in kept] == [False, True, True, False, True, False]
    assert opset_imports(target) == [(o.domain, o.version) for o in model.opset_import]


def test_qdq_encodings_read_without_the_weights(tmp_path):
    """The QDQ graph's encodings, read with only the scales and zero points taken from its data file (the weights
    stay on disk): the same as from the graph loaded whole; per-channel scales of over 1 kB are external."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.random((600, 4)).astype(np.float32), "w")
    scale = numpy_helper.from_array(rng.random(600).astype(np.float32) + 0.1, "scale")
    zero = numpy_helper.from_array(np.zeros(600, np.int8), "zero")
    nodes = [
        helper.make_node("QuantizeLinear", ["w", "scale", "zero"], ["wq"], axis=0),
        helper.make_node("DequantizeLinear", ["wq", "scale", "zero"], ["y"], axis=0),
    ]
    out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [600, 4])
    graph = helper.make_graph(nodes, "g", [], [out], initializer=[w, scale, zero])
    path = tmp_path / QDQ_ONNX
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="model_qdq.data")
    bare = onnx.load(str(path), load_external_data=False)
    assert uses_external_data(next(t for t in bare.graph.initializer if t.name == "scale"))
    (read,), (whole,) = qdq_graph_encodings(bare, tmp_path), qdq_graph_encodings(onnx.load(str(path)))
    assert (read.name, read.bitwidth, read.axis) == (whole.name, whole.bitwidth, 0)
    assert np.array_equal(read.scale, whole.scale) and np.array_equal(read.zero_point, whole.zero_point)
    assert len(read.scale) == 600
    assert uses_external_data(next(t for t in bare.graph.initializer if t.name == "w")), "the weight stays on disk"


@pytest.mark.slow
def test_a_state_of_separate_shared_ranges_is_refused_or_merged(tmp_path):
    """A state saved while q/k/v each had a range of its own (before they shared one) cannot be rebuilt as
    it was trained: refused by name, or merged to the union with ``merge_shared_ranges`` and recorded."""
    model = toy_model("llama")
    corpus = sample_corpus(model, 4, SEQ, seed=5)
    sim = build_sim(model)
    calibrate(sim, [corpus[:2]])
    state = QuadapterState.from_sim(sim, {}, method="ptq")
    keys = shared_activation_groups(sim.model)[0]
    lo, hi = state.ranges[keys[1]]
    state.ranges[keys[1]] = (lo.clone(), hi * 2)  # as phase 2 left them when each reader learned its own
    path = state.save(tmp_path / "separate.safetensors")
    with pytest.raises(QuadapterError, match="separate.safetensors holds different ranges.*merge-shared-ranges"):
        QuadapterState.load(path).build_sim(model)
    rebuilt = QuadapterState.load(path).build_sim(model, merge_shared_ranges=True)
    found = {f"{p}.{r}": q for p, r, q in quantizers(rebuilt.model)}
    assert all(torch.equal(found[k].max, hi * 2) for k in keys)  # the union: nothing any reader kept is clipped
    out = tmp_path / "export"
    exported = export_quantized(rebuilt, out, SEQ, verify_windows=[corpus[2, :SEQ]], method="ptq")
    assert [sorted(row["quantizers"]) for row in exported.manifest["shared_ranges_merged"]] == [sorted(keys)]


class _ExportRun(NamedTuple):
    sim: Any
    out: Path
    windows: list[torch.Tensor]
    before: dict[str, torch.Tensor]  # the sim's weights before the export
    result: Any
    held_out: torch.Tensor
    internals: tuple[dict, dict]  # _patched_internals() before and after the export


@pytest.fixture(scope="module")
def gpt2_export_run(tmp_path_factory) -> _ExportRun:
    """A PTQ export of the GPT-2 toy, and what a check of it needs."""
    model = toy_model("gpt2")
    corpus = sample_corpus(model, 7, SEQ, seed=2)
    sim = build_sim(model)
    calibrate(sim, [corpus[:2]])
    before = {name: p.detach().clone() for name, p in sim.model.named_parameters()}
    out = tmp_path_factory.mktemp("exports") / "gpt2"
    internals = _patched_internals()
    result = export_quantized(sim, out, SEQ, verify_windows=list(corpus[2:4]), model_name="toy", method="ptq")
    return _ExportRun(sim, out, list(corpus[2:4]), before, result, corpus[6:7], (internals, _patched_internals()))


@pytest.fixture(scope="module")
def gpt2_export(gpt2_export_run):
    """The export, the sim it came from, and its verification windows."""
    return gpt2_export_run[:3]


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    encodings = json.loads((dst / ENCODINGS).read_text())
    edit(encodings)
    (dst / ENCODINGS).write_text(json.dumps(encodings))
    return dst


def test_name_check_catches_a_renamed_entry(gpt2_export, tmp_path):
    sim, out, windows = gpt2_export
    verify_export(sim, out, windows)  # the export as written passes

    def rename(enc):
        enc["activation_encodings"][3]["name"] += "_renamed"

    broken = _broken_copy(out, tmp_path / "renamed", rename)
    with pytest.raises(QuadapterError, match=r"names no tensor of the exported ONNX graph: .*_renamed"):
        verify_export(sim, broken, windows)


def test_coverage_check_catches_a_missing_entry(gpt2_export, tmp_path):
    sim, out, windows = gpt2_export

    def drop(enc):
        enc["param_encodings"] = [e for e in enc["param_encodings"] if "c_fc" not in e["name"]]

    broken = _broken_copy(out, tmp_path / "dropped", drop)
    with pytest.raises(QuadapterError, match=r"have no entry in the encodings file: .*c_fc\.weight"):
        verify_export(sim, broken, windows)


def test_value_checks_catch_a_wrong_scale_or_offset(gpt2_export, tmp_path):
    """A wrong scale is caught by value; a wrong offset by running the FP graph with the encodings applied."""
    sim, out, windows = gpt2_export

    def entry(enc):
        return next(e for e in enc["activation_encodings"] if "ln_2" in e["name"])

    def scale(enc):
        entry(enc)["scale"] = [s * 1.5 for s in entry(enc)["scale"]]

    def offset(enc):
        entry(enc)["offset"] = [o + 40 for o in entry(enc)["offset"]]

    with pytest.raises(QuadapterError, match=r"have no entry in the encodings file: .*c_fc\.input"):
        verify_export(sim, _broken_copy(out, tmp_path / "scaled", scale), windows)
    with pytest.raises(QuadapterError, match=r"does not compute what the sim computes: fp\+encodings: perplexity"):
        verify_export(sim, _broken_copy(out, tmp_path / "shifted", offset), windows)


def _corrupt_qdq_then_verify(monkeypatch):
    """Make the QDQ graph wrong between AIMET's export and the verification."""
    real = export_module.verify_export

    def corrupting(sim, folder, *args, **kwargs):
        model = onnx.load(str(Path(folder) / QDQ_ONNX))
        # shift the zero point of a norm output's quantizer: its scale (checked by value) stays right
        node = next(
            n
            for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.input[0].endswith("ln_1/LayerNormalization_output_0")
        )
        zero_point = next(t for t in model.graph.initializer if t.name == node.input[2])
        array = onnx.numpy_helper.to_array(zero_point) + 40
        zero_point.CopyFrom(onnx.numpy_helper.from_array(array, zero_point.name))
        onnx.save(model, str(Path(folder) / QDQ_ONNX))
        return real(sim, folder, *args, **kwargs)

    monkeypatch.setattr(export_module, "verify_export", corrupting)


def test_failed_verification_leaves_no_output(gpt2_export, tmp_path, monkeypatch):
    sim, _, windows = gpt2_export
    _corrupt_qdq_then_verify(monkeypatch)
    with pytest.raises(QuadapterError, match="does not compute what the sim computes: qdq"):
        export_quantized(sim, tmp_path / "out", SEQ, verify_windows=windows)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_failed_verification_keeps_the_previous_export(gpt2_export, tmp_path):
    sim, out, windows = gpt2_export
    previous = shutil.copytree(out, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in previous.iterdir()}
    impossible = Tolerance(ppl_rtol=-1.0)
    with pytest.raises(QuadapterError, match="does not compute what the sim computes"):
        export_quantized(sim, previous, SEQ, verify_windows=windows, tolerance=impossible, overwrite=True)
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(QuadapterError, match="already exists"):
        export_quantized(sim, previous, SEQ, verify_windows=windows)


@pytest.mark.slow
def test_dynamic_length(gpt2_export, tmp_path):
    sim, _, windows = gpt2_export
    out = tmp_path / "dyn"
    result = export_quantized(sim, out, SEQ, verify_windows=windows, dynamic_length=True)
    assert result.manifest["input"]["shape"] == [1, "sequence"]
    assert result.verification.window_lengths == [SEQ // 2, SEQ]  # a shorter window proves the dynamic axis
    lm = OnnxLM(out / QDQ_ONNX)
    assert lm.fixed_len is None
    for length in (5, 17):
        ids = windows[0][:length].unsqueeze(0)
        with torch.no_grad():
            assert torch.allclose(lm(ids), sim.model(ids), atol=1e-4)


def test_fixed_length_graph_pads_short_windows_exactly(gpt2_export):
    sim, out, windows = gpt2_export
    lm = OnnxLM(out / QDQ_ONNX)
    assert lm.fixed_len == SEQ
    ids = windows[1][:11].unsqueeze(0)
    with torch.no_grad():
        assert torch.allclose(lm(ids), sim.model(ids), atol=1e-4)
    with pytest.raises(QuadapterError, match="longer than"):
        lm(torch.zeros((1, SEQ + 1), dtype=torch.long))


def test_resolve_state(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(QuadapterError, match="holds no Quadapter state"):
        resolve_state(run)
    (run / "ptq.safetensors").write_bytes(b"x")
    assert resolve_state(run) == run / "ptq.safetensors"
    (run / "quadapter.safetensors").write_bytes(b"x")
    with pytest.raises(QuadapterError, match=r"2 Quadapter states \(ptq.safetensors, quadapter.safetensors\)"):
        resolve_state(run)
    (run / "results.json").write_text(json.dumps({"states": {"quadapter": "quadapter.safetensors"}}))
    assert resolve_state(run) == run / "quadapter.safetensors"
    assert resolve_state(run / "ptq.safetensors") == run / "ptq.safetensors"
    with pytest.raises(QuadapterError, match="does not exist"):
        resolve_state(tmp_path / "nothing")


@pytest.mark.slow
def test_cli_export_then_eval(tiny_gpt2_dir, corpus_dir, tmp_path, capsys):
    from aimet_quadapter.models import load_model
    from aimet_quadapter.quant.policy import calibrate
    from aimet_quadapter.text.data import calibration_batches
    from aimet_quadapter.text.perplexity import eval_windows_for

    folder = tiny_gpt2_dir
    model, tokenizer = load_model(str(folder))
    sim = build_sim(model)
    calibrate(sim, calibration_batches(tokenizer, str(corpus_dir), num=2, length=SEQ))
    state_file = QuadapterState.from_sim(sim, {}, method="ptq").save(tmp_path / "run" / "ptq.safetensors")

    out = tmp_path / "export"
    argv = ["export", str(state_file.parent), "--model", str(folder), "--out", str(out), "--seq-len", str(SEQ)]
    # KV graphs that cannot hold the verification windows are refused before anything loads
    assert main([*argv, "--kv-graphs", "--kv-context", "16", "--verify-dataset", str(corpus_dir)]) == 2
    assert "--kv-prefill 128 must be below --kv-context 16" in capsys.readouterr().err
    assert main([*argv, "--kv-graphs", "--kv-context", "16", "--kv-prefill", "8"]) == 2
    assert "must fit --kv-context 16" in capsys.readouterr().err
    kv = ["--kv-graphs", "--kv-context", "64", "--kv-prefill", "8", "--hf-checkpoint"]
    code = main([*argv, *kv, "--verify-dataset", str(corpus_dir), "--verify-windows", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "model_qdq.onnx" in captured.out and "fp+encodings" in captured.out
    assert "KV graphs (ar8, ar1 over 64 tokens)" in captured.out and (out / "kv" / "ar1_qdq.onnx").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"] == str(folder.resolve()) and manifest["method"] == "ptq"
    assert manifest["state"]["path"] == str(state_file.resolve())
    assert "Hugging Face checkpoint (hf/)" in captured.out and manifest["hf"]["tokenizer"]
    with pytest.raises(QuadapterError, match="not an export.s Hugging Face folder: it has no config.json"):
        load_hf_export(out / "kv")
    reloaded, hf_tokenizer = load_hf_export(out)  # the export folder, or its hf/ itself
    assert hf_tokenizer.encode("the cat") == tokenizer.encode("the cat")
    some = eval_windows_for(tokenizer, str(corpus_dir), "test", SEQ, None, 96)
    assert perplexity(reloaded.model, some, progress=False).ppl == pytest.approx(
        perplexity(sim.model, some, progress=False).ppl, rel=1e-6
    )

    # a second export to the same folder is refused, with a one-line error
    assert main([*argv, "--verify-dataset", str(corpus_dir)]) == 2
    assert "already exists" in capsys.readouterr().err

    # eval on the export: onnxruntime's perplexity over windows of the export's length; the last window
    # (250 = 7 x 32 + 26 tokens) is padded, and must score exactly as the sim does
    report = tmp_path / "onnx.json"
    code = main(
        ["eval", "--model", str(out), "--dataset", str(corpus_dir), "--max-tokens", "250", "--json", str(report)]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "fixed sequence length of 32" in captured.err
    saved = json.loads(report.read_text())
    (cell,) = saved["cells"].values()  # the runner's results.json shape, one cell
    assert cell["label"].startswith("ONNX QDQ") and cell["info"]["seq_len"] == SEQ
    onnx_ppl = cell["ppl"][corpus_dir.stem]
    windows = eval_windows_for(tokenizer, str(corpus_dir), "test", SEQ, None, 250)
    assert len(windows[-1].ids) == 26
    sim_ppl = perplexity(sim.model, windows, progress=False).ppl
    assert onnx_ppl == pytest.approx(sim_ppl, rel=1e-5)

    # the QDQ file itself works as --model too; the FP graph alone does not (it needs its encodings)
    assert (
        main(["eval", "--model", str(out / "model_qdq.onnx"), "--dataset", str(corpus_dir), "--max-tokens", "64"]) == 0
    )
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "model.onnx"), "--dataset", str(corpus_dir)]) == 2
    assert "not the export's QDQ model" in capsys.readouterr().err


@pytest.mark.slow
def test_kv_graphs_prefill_then_decode_compute_what_the_sim_computes(toy, tmp_path):
    from aimet_quadapter.export.kv import KVGraphs

    sim = toy["state"].build_sim(toy["model"])
    ids = "int32" if toy["family"] == "llama" else "int64"  # both id types, one per family
    kv = KVGraphs(context=48, lengths=(8, 1), ids_dtype=ids)
    result = export_quantized(sim, tmp_path / "e", SEQ, verify_windows=toy["verify"], model_name="toy", formats=[kv])
    entry = result.manifest["kv"]
    folder = result.out_dir / "kv"
    suffixes = (".onnx", ".data", "_qdq.onnx", "_qdq.data")
    assert set(entry["files"]) == {f"ar{n}{suffix}" for n in (8, 1) for suffix in suffixes} | {ENCODINGS}
    # one encodings file for both graphs: each entry names a tensor of one of them, and every tensor of
    # either graph that AIMET encoded is in it
    names = set().union(*(graph_tensor_names(onnx.load(str(folder / f"ar{n}.onnx"))) for n in (8, 1)))
    entries = read_encodings(json.loads((folder / ENCODINGS).read_text()))
    assert entries and {e.name for e in entries} <= names
    check_quantizer_coverage(sim, entries)
    layers, kv_heads, head_dim = toy["model"].kv_shape()
    if toy["family"] == "llama":
        assert kv_heads < toy["model"].config.num_attention_heads  # grouped-query attention kept, not repeated
    for n in (8, 1):
        graph = onnx.load(str(folder / f"ar{n}_qdq.onnx"))
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
        types = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in graph.graph.input}
        assert types["input_ids"] == types["position_ids"] == np.dtype(ids)
        assert shapes["input_ids"] == [1, n] and shapes["attention_mask"] == [1, 1, n, 48]
        assert shapes[f"past_key_{layers - 1}"] == [1, kv_heads, 48 - n, head_dim]  # static shapes throughout
    agreement = entry["verification"]
    # PTQ under the paper's placement: the graphs reproduce the sim to float32 rounding, token for token
    assert agreement["ppl_rel_diff"] < 1e-5 and agreement["vs_full_graph_max_abs_logit_diff"] < 1e-4
    assert agreement["top1_agreement"] == 1.0 and agreement["greedy_agreement"] == 1.0
    steps = min(32, 48 - 1 - SEQ // 2)  # from each window's first half, as far as the context goes
    assert agreement["greedy_tokens"] == steps * min(3, len(toy["verify"]))
    assert agreement["greedy_common_prefix"] == steps
    assert agreement["greedy_floor_agreement"] == 1.0  # one-ulp noise flips no argmax of a tiny model either
    assert entry["shared_encodings_checked"] > 0  # the two graphs' common tensors, one encoding each


@pytest.mark.slow
def test_kv_graphs_with_a_wrong_mask_fail_and_leave_nothing(tmp_path, monkeypatch):
    """A host that lets a token see one slot too many (the next token) computes something else: caught."""
    from aimet_quadapter.export import kv as kv_module

    model = toy_model("gpt2")
    corpus = sample_corpus(model, 5, SEQ, seed=1)
    sim = build_sim(model)
    calibrate(sim, [corpus[:2]])
    right = kv_module.attention_mask

    def one_too_many(n, context, filled):
        mask = right(n, context, filled)
        past = context - n
        for i in range(n - 1):
            mask[0, 0, i, past + i + 1] = 0.0
        return mask

    monkeypatch.setattr(kv_module, "attention_mask", one_too_many)
    with pytest.raises(QuadapterError, match="KV-cache graphs"):
        export_quantized(
            sim,
            tmp_path / "e",
            SEQ,
            verify_windows=list(corpus[2:4]),
            formats=[kv_module.KVGraphs(context=48, lengths=(8, 1))],
        )
    assert not (tmp_path / "e").exists()


def test_the_int32_bias_follows_the_encodings_version_as_a_version():
    from aimet_quadapter.export.exporter import int32_bias

    assert not int32_bias("1.0.0") and int32_bias("2.0.0") and int32_bias("10.0.0")  # "10.0.0" < "2.0.0" as text


def test_an_optimized_session_does_not_saturate_integer_products():
    """A QDQ matrix product whose uint8 activations and int8 weights span their ranges: optimized, onnxruntime
    fuses it into an integer kernel, which on x86 CPUs without VNNI saturates its 16-bit pair sums unless told
    otherwise (on other CPUs both sessions agree either way)."""
    k, n = 64, 8
    weights = np.random.default_rng(0).choice([-127, 127], size=(k, n)).astype(np.int8)
    scalar = numpy_helper.from_array
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]),
        helper.make_node("MatMul", ["xd", "wd"], ["y"]),
        helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["out"]),
    ]
    constants = [
        scalar(np.array(1.0, np.float32), "xs"),
        scalar(np.array(0, np.uint8), "xz"),
        scalar(weights, "w"),
        scalar(np.array(1.0, np.float32), "ws"),
        scalar(np.array(0, np.int8), "wz"),
        scalar(np.array(255 * 127 * k * 2 / 255, np.float32), "ys"),  # the output's grid holds every sum
        scalar(np.array(128, np.uint8), "yz"),
    ]
    float_io = onnx.TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "qdq_matmul",
        [helper.make_tensor_value_info("x", float_io, [1, k])],
        [helper.make_tensor_value_info("out", float_io, [1, n])],
        constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()
    x = np.full((1, k), 255.0, np.float32)
    (fused,) = ort_session(model).run(None, {"x": x})
    (as_written,) = ort_session(model, optimize=False).run(None, {"x": x})
    assert np.abs(as_written).max() > 2 * 32767  # the exact sums are beyond a 16-bit accumulator
    np.testing.assert_array_equal(fused, as_written)


def test_a_summation_order_draw_sums_the_same_terms():
    """``noise --orders``: each matrix product of a draw sums its terms in another order, so the FP model's logits
    move by float32 rounding only, a tied embedding table stays as it is, and the model after the draw is the model
    before it. A product whose input were permuted without its weights would move them by the logits' own size."""
    from aimet_quadapter.testing import toy_model

    model = toy_model("llama")
    model.lm.lm_head.weight = model.lm.model.embed_tokens.weight  # tied, as SmolLM2's
    table = model.lm.model.embed_tokens.weight.detach().clone()
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    sim = build_sim(model, QuantPolicy(target="htp"))
    calibrate(sim, [ids])
    with torch.no_grad():
        before, sim_before = model(ids), sim.model(ids)
        with shuffled_sums(model, 1):
            drawn = model(ids)
        with shuffled_sums(sim.model, 1):
            sim.model(ids)
        after, sim_after = model(ids), sim.model(ids)
    assert not torch.equal(drawn, before)
    assert (drawn - before).abs().max() <= 256 * torch.finfo(torch.float32).eps * before.abs().max()
    assert torch.equal(after, before) and torch.equal(sim_after, sim_before)
    assert torch.equal(model.lm.model.embed_tokens.weight, table)


def test_the_noise_band_is_centred_on_the_sim_and_reaches_its_farthest_variant():
    """A device graph as far from the sim as a draw is inside, though outside the draws' own range when the sim
    lies beside them; one farther than every variant is not."""
    low, high = noise_band(77.4, [75.9, 76.9, 77.0])
    assert (low, high) == pytest.approx((75.9, 78.9))
    assert low <= 77.45 <= high and not low <= 79.0 <= high


def test_the_noise_floor_moves_every_quantizer_input_by_whole_ulps_up_and_down():
    """The sim's float-noise band runs it with each activation quantizer's input one float32 ulp away, up or
    down at random: each element moves by exactly that many ulps, in both directions, the same for a seed."""
    from aimet_quadapter.export.exporter import one_ulp_inputs

    class Holder(torch.nn.Module):  # where quantizers() finds quantizers: AIMET's three slots
        def __init__(self):
            super().__init__()
            self.param_quantizers = {}
            self.input_quantizers = torch.nn.ModuleList([torch.nn.Identity()])
            self.output_quantizers = torch.nn.ModuleList()

    holder = Holder()
    x = torch.randn(3, 1000) * torch.logspace(-3, 3, 1000)
    up, down = torch.nextafter(x, torch.tensor(math.inf)), torch.nextafter(x, torch.tensor(-math.inf))
    with one_ulp_inputs(holder, seed=0):
        moved = holder.input_quantizers[0](x)
    assert bool(((moved == up) | (moved == down)).all()), "an input moved by other than one ulp"
    assert 0.4 < (moved == up).float().mean().item() < 0.6, "both directions, about equally often"
    with one_ulp_inputs(holder, seed=0):
        assert torch.equal(holder.input_quantizers[0](x), moved), "a seed draws the same moves"
    with one_ulp_inputs(holder, seed=0, ulps=2):
        twice = holder.input_quantizers[0](x)
    assert bool(
        (
            (twice == torch.nextafter(up, torch.tensor(math.inf)))
            | (twice == torch.nextafter(down, torch.tensor(-math.inf)))
        ).all()
    )
    assert torch.equal(holder.input_quantizers[0](x), x), "the hooks are gone afterwards"
