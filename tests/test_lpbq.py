"""W4A16 with AIMET's LPBQ weights (`policy.precision: w4a16-lpbq`): its quantizers, PTQ, a trained state saved and
rebuilt, and the export with its block encodings, loaded back by the checks and by aimet-onnx."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from aimet_torch.quantization.affine import GroupedBlockQuantizeDequantize

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.exporter import export_quantized
from aimet_quadapter.export.formats import ENCODINGS
from aimet_quadapter.export.onnx_eval import read_encodings
from aimet_quadapter.models import quiet_libraries, tiny_model
from aimet_quadapter.quadapter.api import QuadapterParameters, apply_quadapter
from aimet_quadapter.quadapter.phase1 import Phase1Parameters
from aimet_quadapter.quadapter.phase2 import Phase2Parameters
from aimet_quadapter.quadapter.state import QuadapterState
from aimet_quadapter.quant.config import QuantPolicy
from aimet_quadapter.quant.policy import build_sim, calibrate
from aimet_quadapter.quant.quantizers import DynamicRanges, quantizers
from aimet_quadapter.running.recipes import load_recipe
from aimet_quadapter.settings import result_view
from aimet_quadapter.testing import sample_corpus
from aimet_quadapter.text.data import Window
from aimet_quadapter.text.perplexity import perplexity

quiet_libraries()
SEQ = 32
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "device.yaml"
# two blocks per row of the tiny Llama's 64-wide Linears (six of down_proj's 192): the preset's 64 would leave one
BLOCK = 32
POLICY = QuantPolicy(target="htp", activation_bits=16, lpbq_block_size=BLOCK)


@pytest.fixture(scope="module")
def toy():
    # no planted outliers: 4-bit weights lose a layer's down-scaled columns, which is not what is tested here
    model = tiny_model("llama", initializer_range=0.15)
    corpus = sample_corpus(model, 10, SEQ, seed=1)
    sim = build_sim(model, POLICY)
    calibrate(sim, [corpus[:2], corpus[2:4]])
    return model, corpus, sim


def _windows(rows: torch.Tensor) -> list[Window]:
    return [Window(row, 1) for row in rows]


def test_the_precision_is_one_setting_for_the_fields_it_implies():
    preset = QuantPolicy(target="htp", precision="w4a16-lpbq")
    explicit = QuantPolicy(target="htp", activation_bits=16, lpbq_block_size=64)
    assert (preset.activation_bits, preset.lpbq_block_size, preset.weight_bits) == (16, 64, 8)
    # the same cells: the preset is a name for its fields, which carry the result
    assert result_view(QuantPolicy, preset.to_dict()) == result_view(QuantPolicy, explicit.to_dict())
    assert QuantPolicy(**preset.to_dict()) == preset  # a saved state's policy reads back
    with pytest.raises(QuadapterError, match=r"policy\.precision 'w4a16-lpbq' sets activation_bits to 16"):
        QuantPolicy(target="htp", precision="w4a16-lpbq", activation_bits=8)
    with pytest.raises(QuadapterError, match=r"policy\.precision 'w4a16-lpbq' .* target 'htp' only"):
        QuantPolicy(precision="w4a16-lpbq")
    with pytest.raises(QuadapterError, match=r"policy\.lpbq_block_size applies to target 'htp' only"):
        QuantPolicy(lpbq_block_size=64)


def test_the_device_recipe_reaches_it_with_one_set():
    assert load_recipe(RECIPE).policy.lpbq_block_size is None
    policy = load_recipe(RECIPE, ["policy.precision=w4a16-lpbq"]).policy
    assert (policy.target, policy.activation_bits, policy.lpbq_block_size) == ("htp", 16, 64)
    with pytest.raises(QuadapterError, match=r"field policy: precision 'w4a16-lpbq' sets activation_bits"):
        load_recipe(RECIPE, ["policy.precision=w4a16-lpbq", "policy.activation_bits=8"])


def test_every_linear_weight_but_lm_heads_is_aimets_lpbq_and_activations_are_16_bit(toy):
    _, _, sim = toy
    weights = {path: q for path, role, q in quantizers(sim.model) if role == "weight"}
    linears = [p for p, m in sim.model.named_modules() if isinstance(m, torch.nn.Linear) and p in weights]
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down in each of two blocks, and lm_head
    for path in linears:
        q = weights[path]
        if path == "lm.lm_head":  # the target's own 8-bit per-channel grid
            assert type(q) is not GroupedBlockQuantizeDequantize and q.block_size is None
            assert q.bitwidth == 8 and q.symmetric and tuple(q.shape) == (q.shape[0], 1) and q.shape[0] > 1
            continue
        assert isinstance(q, GroupedBlockQuantizeDequantize), path
        assert (q.bitwidth, q.decompressed_bw, q.symmetric) == (4, 8, True)
        assert list(q.block_size) == [1, BLOCK] and list(q.block_grouping) == [1, -1]
        width = sim.model.get_submodule(path).in_features
        assert tuple(q.shape)[1] == width // BLOCK
    activations = [q for _, role, q in quantizers(sim.model) if role != "weight"]
    assert activations and all(q.bitwidth == 16 for q in activations)


def test_a_block_size_that_divides_no_linear_is_refused_by_name():
    with pytest.raises(QuadapterError, match=r"policy\.lpbq_block_size 48 does not divide .*input channels"):
        build_sim(tiny_model("llama"), QuantPolicy(target="htp", lpbq_block_size=48))


def test_ptq_scores_near_the_fp_model(toy):
    model, corpus, sim = toy
    windows = _windows(corpus[6:10])
    fp = perplexity(model, windows, progress=False).ppl
    ptq = perplexity(sim.model, windows, progress=False).ppl
    assert np.isfinite(ptq) and fp < ptq < 1.25 * fp


def test_dynamic_ranges_give_a_block_wise_weight_its_calibrated_grid(toy):
    """Phase 1 quantizes with each tensor's own range: on the weight it was calibrated on, the same LPBQ grid."""
    _, _, sim = toy
    module = sim.model.get_submodule("lm.model.layers.0.mlp.down_proj")
    q = module.param_quantizers["weight"]
    with torch.no_grad():
        static = q(module.weight).as_subclass(torch.Tensor)
    weight = module.weight.detach().clone().requires_grad_(True)
    with DynamicRanges([q]):
        dynamic = q(weight)
    assert torch.equal(dynamic.detach(), static)
    dynamic.square().sum().backward()
    assert weight.grad is not None and bool(weight.grad.isfinite().all()) and bool(weight.grad.abs().sum() > 0)


@pytest.fixture(scope="module")
def trained(toy, tmp_path_factory):
    """A Quadapter state of the LPBQ sim (phase 1, then phase 2 with learned ranges): the trained sim, the state
    before saving, and the state saved and loaded."""
    model, corpus, _ = toy
    sim = build_sim(model, POLICY)
    params = QuadapterParameters(phase1=Phase1Parameters(steps=2), phase2=Phase2Parameters(steps=2, lr_ranges=1e-2))
    result = apply_quadapter(sim, model, [corpus[:2], corpus[2:4]], [corpus[4:6]], params, progress=False)
    path = result.state.save(tmp_path_factory.mktemp("state") / "lpbq.safetensors")
    return sim, result.state, QuadapterState.load(path)


def test_a_calibrated_sim_saved_and_rebuilt_gives_the_same_logits(toy, tmp_path):
    model, corpus, sim = toy
    path = QuadapterState.from_sim(sim, {}, method="ptq").save(tmp_path / "ptq.safetensors")
    rebuilt = QuadapterState.load(path).build_sim(model)
    with torch.no_grad():
        assert torch.equal(sim.model(corpus[6:8]), rebuilt.model(corpus[6:8]))


def test_a_trained_state_saved_and_rebuilt_gives_the_same_logits(toy, trained):
    model, corpus, _ = toy
    sim, state, loaded = trained
    assert loaded.policy == POLICY
    # the learned LPBQ ranges are saved as they were trained
    key = "lm.model.layers.1.mlp.up_proj.weight"
    assert torch.equal(loaded.ranges[key][0], state.ranges[key][0])
    rebuilt, before = loaded.build_sim(model), state.build_sim(model)
    assert isinstance(
        rebuilt.model.get_submodule(key.rsplit(".", 1)[0]).param_quantizers["weight"], GroupedBlockQuantizeDequantize
    )
    with torch.no_grad():
        logits = rebuilt.model(corpus[6:8])
        assert torch.equal(logits, before.model(corpus[6:8]))
        # the alphas folded into the weights instead of scaling them on the way: float rounding apart
        torch.testing.assert_close(logits, sim.model(corpus[6:8]), rtol=1e-4, atol=1e-3)


def test_its_export_writes_block_encodings_that_load_back(toy, trained, tmp_path):
    aimet_onnx = pytest.importorskip("aimet_onnx", reason="aimet-onnx is the optional extra device-check")
    assert aimet_onnx
    from aimet_quadapter.export.device_check import DeviceGraphCheck, device_sim

    model, corpus, _ = toy
    rebuilt = trained[2].build_sim(model)
    with pytest.raises(QuadapterError, match="1.0.0 leaves the layout of block-wise weights"):
        export_quantized(rebuilt, tmp_path / "old", SEQ, "1.0.0", verify_windows=list(corpus[8:10]))
    out = tmp_path / "export"
    result = export_quantized(
        rebuilt, out, SEQ, verify_windows=list(corpus[8:10]), formats=[DeviceGraphCheck(list(corpus[:4]))]
    )
    assert result.manifest["encodings_version"] == "2.0.0"
    raw = {e["name"]: e for e in json.loads((out / ENCODINGS).read_text())["encodings"]}
    name = "lm.model.layers.0.self_attn.q_proj.weight_0"  # the Linear's weight as the graph holds it: (in, out)
    assert raw[name]["block_size"] == BLOCK and raw[name]["output_dtype"] == "int4"
    assert "per_block_int_scale" in raw[name] and "per_channel_float_scale" in raw[name]
    # read back, the block scales are the sim's (to its own rounding of their two factors)
    entry = next(e for e in read_encodings(json.loads((out / ENCODINGS).read_text())) if e.name == name)
    q = rebuilt.model.get_submodule("lm.model.layers.0.self_attn.q_proj").param_quantizers["weight"]
    assert np.allclose(entry.scale.T, q.get_scale().detach().numpy(), rtol=1e-6, atol=0)
    # aimet-onnx holds them as 4-bit blocks, and its device graph scores as the sim does
    with device_sim(out) as (onnx_sim, _):
        loaded = onnx_sim.qc_quantize_op_dict[name]
        assert loaded.enabled and loaded.bitwidth == 4 and loaded.quant_info.blockSize == BLOCK
    check = result.manifest["device_check"]
    assert check["ppl_rel_diff"] < 1e-3


def test_an_export_of_its_state_as_1_0_0_is_refused_before_the_model_loads(tmp_path):
    from aimet_quadapter.export.job import ExportJob

    state = QuadapterState({}, {}, POLICY)
    job = ExportJob(state=tmp_path / "s.safetensors", model="unused", out=tmp_path / "out", encodings_version="1.0.0")
    with pytest.raises(QuadapterError, match=r"1\.0\.0 leaves the layout of block-wise weights \(LPBQ blocks of 32\)"):
        job.check(state)
    assert ExportJob(state=job.state, model="unused", out=job.out).encodings_version is None  # the export chooses
