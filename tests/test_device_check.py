"""`export --device-check`: the exported graph in AIMET's own ONNX simulation (aimet-onnx) under its HTP config, this
package's encodings loaded and frozen, every other tensor calibrated; its coverage and perplexity."""

from __future__ import annotations

import gc
import json
import logging
import re
import shutil
import types

import numpy as np
import pytest
import torch

pytest.importorskip("aimet_onnx", reason="aimet-onnx is the optional extra device-check")

from aimet_quadapter.errors import QuadapterError  # noqa: E402
from aimet_quadapter.export.device_check import DeviceGraphCheck, device_sim  # noqa: E402
from aimet_quadapter.export.exporter import export_quantized  # noqa: E402
from aimet_quadapter.export.formats import ENCODINGS, INPUT_NAME  # noqa: E402
from aimet_quadapter.quant.config import QuantPolicy  # noqa: E402
from aimet_quadapter.quant.policy import build_sim, calibrate  # noqa: E402
from aimet_quadapter.running.device_texts import Text, cell_record, device_perplexities, texts_of  # noqa: E402
from aimet_quadapter.testing import sample_corpus, toy_model  # noqa: E402
from aimet_quadapter.text.perplexity import perplexity  # noqa: E402

SEQ = 32
QUANTIZED = 0.25  # the toy models' band between a quantized and an FP perplexity (tests/test_cuda.py says why)
DEVICE = 0.02  # the device graph against the sim (see the test)


@pytest.fixture(scope="module", params=["gpt2", "llama", "llama+prefix"])
def checked(request, tmp_path_factory):
    family, _, prefix = request.param.partition("+")
    model = toy_model(family)
    if prefix:  # full-precision cached keys and values, joined to every sequence's on the device
        model.set_prefix([3, 5])
    corpus = sample_corpus(model, 10, SEQ, seed=1)
    sim = build_sim(model, QuantPolicy(target="htp"))
    calibrate(sim, [corpus[:2], corpus[2:4]])
    out = tmp_path_factory.mktemp("export") / request.param
    result = export_quantized(
        sim, out, SEQ, verify_windows=list(corpus[8:10]), formats=[DeviceGraphCheck(list(corpus[:4]))]
    )
    return (
        model,
        corpus,
        out,
        {
            **result.manifest["device_check"],
            "propagated": result.manifest["encodings_propagated"],
            "ppl_bound": result.manifest["verification"]["ppl_bound"],
        },
    )


def test_the_device_graph_holds_the_residual_streams_encodings_and_names_the_rest(checked):
    model, _, out, report = checked
    with device_sim(out) as (_, coverage):
        pass
    ours = {e["name"] for e in json.loads((out / ENCODINGS).read_text())["activation_encodings"]}
    assert len(coverage.covered) == report["with_encoding"] > 0
    assert sorted(coverage.missing) == sorted(report["without_encoding"])
    assert not set(coverage.missing) & ours
    sums = [n for n in coverage.covered if "residual_adds" in n]
    assert len(sums) == 2 * len(model.block_paths())  # every residual sum's output carries this package's range
    assert coverage.constants == report["constants_folded"] and any("rotary_emb" in n for n in coverage.constants) == (
        model.arch.name == "llama"
    )  # the rotary angles are constants a converter folds; the tables after them carry encodings
    if model.arch.name == "llama":  # the rotation, its tables, SiLU's two ops, the masked scores: every tensor
        assert coverage.missing == []
        # the prefix's keys and values joined to the sequence's: the encoding the attention matmul reads them with
        joined = [n for n in report["propagated"] if n.endswith(("/Concat_output_0", "/Concat_1_output_0"))]
        assert len(joined) == (2 * len(model.block_paths()) if model.prefix_ids is not None else 0)
    else:  # GPT-2's Conv1D is a MatMul, then the bias Add whose output the sim quantizes
        assert coverage.missing and all(n.endswith("/MatMul_output_0") for n in coverage.missing)
    assert (out / "device_check" / "device.encodings").is_file()


def test_every_tensor_it_counts_as_covered_runs_quantized(checked):
    """aimet-onnx ties a Concat's inputs to its output (one quantizer, several names): the prefix's constant keys and
    values share the quantizer of the sequence's own, so switching them off as folded constants would leave every
    layer's keys and values in float while the report still counted them."""
    model, _, out, report = checked
    with device_sim(out) as (sim, coverage):
        assert all(sim.qc_quantize_op_dict[n].enabled for n in coverage.covered)
    joined = [n for n in coverage.covered if re.search(r"/self_attn/Concat(_1)?_output_0$", n)]
    assert len(joined) == (2 * len(model.block_paths()) if model.prefix_ids is not None else 0)
    assert not set(coverage.constants) & set(coverage.covered)


def test_the_loaded_graph_goes_once_the_simulation_holds_its_own(checked):
    """aimet-onnx's supergroup fusion copies the graph into the sim, and its rewrite rules (module globals) kept the
    graph they last matched: the loaded model, every weight in it, stayed beside the sim's copy for good."""
    import onnx_ir

    _, _, out, _ = checked
    with device_sim(out) as (sim, _):
        gc.collect()
        graphs = [o for o in gc.get_objects() if isinstance(o, (onnx_ir.Graph, onnx_ir.Model))]
        assert sim.model.model.graph.initializer and graphs == []


def test_the_graph_its_session_reads_goes_with_the_block(checked, tmp_path):
    """aimet-onnx writes the graph its onnxruntime session reads, every weight, to a temporary folder it removes
    only when the sim is collected: a process that ended first left it behind, one full copy of the model a run."""
    _, corpus, out, _ = checked
    with device_sim(out, scratch=tmp_path) as (sim, _):
        (workdir,) = tmp_path.iterdir()
        assert (workdir / "model.onnx").is_file()
        sim.compute_encodings(
            [{INPUT_NAME: corpus[0][None].numpy().astype(np.int64)}]
        )  # a rebuilt session: the same folder
        assert list(tmp_path.iterdir()) == [workdir]
    assert list(tmp_path.iterdir()) == []


def test_the_device_graph_scores_a_text_as_the_check_does(checked):
    """The device-text scoring (``device-texts``): the device graph's perplexity on the check's windows is the
    check's own."""
    _, corpus, out, report = checked
    if report["without_encoding"]:
        pytest.skip("GPT-2's tensors without an encoding: the check calibrates them on text the scoring does not read")
    (device,) = device_perplexities(out, [Text("test", "t", _windows(corpus[8:10]), report["sim_ppl"])])
    assert device == pytest.approx(report["ppl"], rel=1e-3)


def test_the_device_graph_scores_near_the_sim(checked):
    model, corpus, _, report = checked
    fp = perplexity(model, _windows(corpus[8:10]), progress=False).ppl
    # measured 0.004 (llama), 0.0 (llama with a prefix) and 0.011 (gpt2, its unfused bias adds); with the rotary
    # tables unquantized in the sim the llama toy was 0.051 apart, with the rotation's products and sums unquantized
    # 0.105, with the prefix's keys and values unquantized 0.066
    assert report["ppl"] == pytest.approx(report["sim_ppl"], rel=DEVICE)
    assert report["ppl"] == pytest.approx(report["sim_ppl_aimet_onnx_rounding"], rel=DEVICE)
    assert abs(report["ppl"] / fp - 1) > QUANTIZED  # a quantized graph, not the FP one


def test_the_verdict_is_the_exports_own_band(checked, tmp_path, caplog):
    _, corpus, out, report = checked
    assert report["within_band"] == (report["ppl_rel_diff"] <= report["ppl_bound"])
    assert report["within_band"]  # a toy htp export: the device graph computes what the sim scored
    # the same graph against a sim that scored twice its perplexity: outside the band, said in a warning
    sim = _Report(2 * report["sim_ppl"], report["ppl_bound"])
    with caplog.at_level(logging.WARNING, logger="aimet_quadapter"):
        far = DeviceGraphCheck(list(corpus[:4])).verify(None, tmp_path, _windows(corpus[8:10]), sim, out)
    assert not far["within_band"] and far["ppl_rel_diff"] == pytest.approx(0.5, abs=0.05)
    assert "outside the band" in caplog.text


def test_the_loaded_encodings_are_the_ones_it_runs_with(checked, tmp_path):
    """A residual sum's encoding made 50 times coarser in the export moves the device graph's perplexity: the
    encodings are loaded and stay frozen through the simulation's own calibration."""
    _, corpus, out, report = checked
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    encodings = json.loads((broken / ENCODINGS).read_text())
    entry = next(e for e in encodings["activation_encodings"] if "residual_adds.1" in e["name"])
    entry["scale"] = [s * 50 for s in entry["scale"]]
    (broken / ENCODINGS).write_text(json.dumps(encodings))
    check = DeviceGraphCheck(list(corpus[:4]))
    check.write(None, tmp_path / "check", "1.0.0")
    moved = check.verify(None, tmp_path / "check", _windows(corpus[8:10]), _Report(report["sim_ppl"]), broken)["ppl"]
    assert abs(moved / report["ppl"] - 1) > 0.1


class _Report:
    """The export's verification as the device check reads it."""

    def __init__(self, sim_ppl: float, ppl_bound: float = 0.0):
        self.sim_ppl = sim_ppl
        self.sim_floor = types.SimpleNamespace(ppl_rel_diff=0.0)
        self.ppl_bound = ppl_bound


def _windows(rows):
    from aimet_quadapter.text.data import eval_windows

    return [w for row in rows for w in eval_windows(row, SEQ)]


@pytest.mark.parametrize("symmetric", [False, True], ids=["asymmetric", "symmetric"])
def test_aimet_onnx_rounding_is_the_arithmetic_of_aimet_onnxs_kernel(symmetric):
    """On values at and just below a half step, the sim's quantizer under ``aimet_onnx_rounding`` gives the codes
    aimet-onnx's own quantizer gives, in AIMET's path and in :func:`elementwise_fake_quant`'s; without it they
    differ there."""
    import torch
    from aimet_onnx.common import libpymo
    from aimet_onnx.quantsim import QuantizationSimModel
    from aimet_torch.quantization.affine import QuantizeDequantize
    from onnx import TensorProto, helper

    from aimet_quadapter.quant.quantizers import aimet_onnx_rounding, elementwise_fake_quant

    step = 2.0**-4  # exact in float32: x / step is exact, only the offset's subtraction and the tie rule round
    q = QuantizeDequantize(shape=(), bitwidth=8, symmetric=symmetric)
    low, high = (-128, 127) if symmetric else (-126, 129)
    with torch.no_grad():
        q.set_range(torch.tensor(low * step), torch.tensor(high * step))
    assert float(q.get_scale().detach()) == step
    k = torch.arange(-100, 100, dtype=torch.float32)
    normal = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    x = torch.cat([(k + 0.5) * step, (k + 0.5 - 2.0**-19) * step, normal])[None]

    n = x.shape[1]
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "zero"], ["y"])],
        "one_add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])],
    )
    onnx_sim = QuantizationSimModel(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), providers=["CPUExecutionProvider"]
    )
    quantizer = onnx_sim.qc_quantize_op_dict["y"]
    quantizer.use_symmetric_encodings = symmetric
    encoding = libpymo.TfEncoding()
    encoding.bw, encoding.delta, encoding.min, encoding.max = 8, step, low * step, high * step
    encoding.offset = -128 if symmetric else low  # aimet-onnx holds a signed grid as an unsigned one
    quantizer.load_encodings([encoding])
    (device,) = onnx_sim.session.run(None, {"x": x.numpy()})
    device = torch.from_numpy(device)

    with torch.no_grad():
        assert not torch.equal(q(x).as_subclass(torch.Tensor), device)  # the data reaches where the two differ
        with aimet_onnx_rounding(q):  # a sim of one activation quantizer
            assert torch.equal(q(x).as_subclass(torch.Tensor), device)
            with elementwise_fake_quant([q]):
                assert torch.equal(q(x).as_subclass(torch.Tensor), device)


def test_aimet_onnx_rounding_leaves_the_weights_as_the_exported_graph_holds_them(tmp_path):
    """The export writes every weight already rounded onto its grid by the sim; aimet-onnx's kernel gives such a weight
    back unchanged, though on a raw weight at a half step of its grid it rounds half up where the sim rounds half to
    even (weights expanded from a 4-bit file sit there often). So under ``aimet_onnx_rounding`` a sim's weight
    quantizer keeps the sim's arithmetic, as the device graph's weights do (rounding SmolLM2's half up would move
    some of layer 0's residual-sum codes off the sim's)."""
    import torch
    from aimet_onnx.quantsim import QuantizationSimModel, load_encodings_to_sim
    from aimet_torch.quantization.affine import QuantizeDequantize
    from onnx import TensorProto, helper, numpy_helper

    from aimet_quadapter.quant.aimet_private import htp_config_file
    from aimet_quadapter.quant.quantizers import aimet_onnx_rounding

    n_in, n_out = 64, 8
    step = torch.tensor([2.0**-e for e in range(3, 3 + n_out)])  # per output channel, exact in float32
    codes = torch.randint(-120, 120, (n_out, n_in), generator=torch.Generator().manual_seed(0)).float()
    weight = (codes + 0.5) * step[:, None]  # every raw weight on a half step of its channel's grid
    q = QuantizeDequantize(shape=(n_out, 1), bitwidth=8, symmetric=True)
    with torch.no_grad():
        q.set_range(-128 * step[:, None], 127 * step[:, None])
        on_grid = q(weight).as_subclass(torch.Tensor)  # the sim's weights, as the export writes them

    def device_weights(w: torch.Tensor) -> torch.Tensor:
        """``w`` through aimet-onnx's per-channel weight quantizer under the HTP config, the sim's encoding loaded."""
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            "one_matmul",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n_in, n_in])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n_in, n_out])],
            [numpy_helper.from_array(w.T.contiguous().numpy(), "w")],
        )
        onnx_sim = QuantizationSimModel(
            helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
            config_file=htp_config_file(package="aimet_onnx"),
            providers=["CPUExecutionProvider"],
        )
        entry = {"name": "w", "dtype": "INT", "bw": 8, "is_sym": True, "enc_type": "PER_CHANNEL"}
        entry |= {"scale": step.tolist(), "offset": [-128] * n_out}
        encodings = tmp_path / "w.encodings"
        encodings.write_text(json.dumps({"version": "1.0.0", "activation_encodings": [], "param_encodings": [entry]}))
        load_encodings_to_sim(onnx_sim, str(encodings), strict=False)
        for name, quantizer in onnx_sim.qc_quantize_op_dict.items():
            quantizer.enabled = name == "w"  # the weight's alone: its product with I is the quantized weight
        (y,) = onnx_sim.session.run(None, {"x": np.eye(n_in, dtype=np.float32)})
        return torch.from_numpy(y).T

    assert not torch.equal(device_weights(weight), on_grid)  # raw weights: aimet-onnx rounds them otherwise
    exported = device_weights(on_grid)
    assert torch.equal(exported, on_grid)

    sim_model = torch.nn.Module()  # a sim whose one quantizer is a weight's
    sim_model.param_quantizers, sim_model.input_quantizers, sim_model.output_quantizers = {"weight": q}, [], []
    with aimet_onnx_rounding(sim_model):
        assert torch.equal(q(weight).as_subclass(torch.Tensor), exported)


def test_device_texts_scores_a_runs_cell_on_the_runs_own_windows(tiny_gpt2_dir, corpus_dir, tmp_path, capsys):
    """``device-texts``: the run's cell exported, its graph in AIMET's ONNX simulation on the windows the run scored,
    beside the sim's recorded number for each text, a test text and a development text of one name apart; the run
    folder itself is refused."""
    from aimet_quadapter.cli.app import main

    run, export = tmp_path / "run", tmp_path / "export"
    small = ["--seq-len", str(SEQ), "--max-tokens", str(4 * SEQ), "--calib-samples", "2", "--calib-len", str(SEQ)]
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), "--methods", "ptq", *small]
    assert main([*argv, "--policy-target", "htp", "--out", str(run), "--no-progress"]) == 0
    (cell,) = {p.parent for p in run.rglob("*.safetensors")}
    results = json.loads((run / "results.json").read_text())
    (record,) = results["cells"].values()
    record["dev_ppl"] = {"corpus": 2 * record["ppl"]["corpus"]}  # the same label on the valid split, as ptb's
    (settings,) = (r["settings"] for r in results["recipes"].values())
    settings["dev"] = {**settings["eval"], "split": "valid", "max_tokens": 2 * SEQ}
    (run / "results.json").write_text(json.dumps(results))
    verify = ["--verify-dataset", str(corpus_dir), "--verify-split", "valid", "--verify-windows", "2"]
    exported = ["export", str(cell), "--model", str(tiny_gpt2_dir), "--out", str(export), "--seq-len", str(SEQ)]
    assert main([*exported, *verify, "--device-check", "--no-progress"]) == 0

    texts = texts_of(*cell_record(cell))
    assert [(t.role, t.label, len(t.windows)) for t in texts] == [("test", "corpus", 4), ("dev", "corpus", 2)]
    assert [t.sim for t in texts] == [record["ppl"]["corpus"], record["dev_ppl"]["corpus"]]
    capsys.readouterr()
    assert main(["device-texts", str(cell), str(export), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"ptq ({cell}), seed {record.get('seed')}: text | sim (results.json) | device graph" in printed
    rows = re.findall(r"^corpus \((test|dev)\) \| ([0-9.]+) \| ([0-9.]+) \([-+][0-9.]+ %\)$", printed, re.M)
    assert [(role, sim) for role, sim, _ in rows] == [
        ("test", f"{record['ppl']['corpus']:.3f}"),
        ("dev", f"{record['dev_ppl']['corpus']:.3f}"),
    ]
    test, dev = (float(device) for _, _, device in rows)
    # the same state and windows: the device graph within the band the fixture's check holds it to
    assert test == pytest.approx(record["ppl"]["corpus"], rel=2 * DEVICE)
    assert dev != pytest.approx(test, rel=1e-3)  # the valid split's own windows
    with pytest.raises(QuadapterError, match="give a cell folder of a run"):
        cell_record(run)
    assert main(["device-texts", str(run), str(export)]) == 2
    assert "give a cell folder of a run" in capsys.readouterr().err


def test_the_prompts_answers_are_plain_greedy_decodings_with_fewer_forwards():
    from aimet_quadapter.export.device_check import Prompt, _answers, greedy

    model, length = toy_model("llama"), 24
    calls = []

    def lm(ids):  # a static graph: every call the same length
        assert ids.shape == (1, length)
        calls.append(1)
        with torch.no_grad():
            return model(ids)

    prompt = torch.tensor([5, 9, 2])
    own = greedy(lm, prompt, 8, length)
    g = torch.Generator().manual_seed(0)
    other = torch.randint(0, model.config.vocab_size, (8,), generator=g)
    for fp in (own, torch.cat([own[:4], other[4:]]), other):  # agreeing, parting at token 5, parting at once
        calls.clear()
        (answer,) = _answers(lm, [Prompt(prompt, fp)], length)
        assert answer["device"] == own.tolist()  # what decoding token by token gives
        agree = int((fp == own).long().cumprod(0).sum())
        assert len(calls) == 1 + max(0, 8 - agree - 1)  # the teacher-forced forward, then one per token after the part
