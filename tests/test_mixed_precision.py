"""Mixed precision: bit-width overrides per quantizer pattern, one encoding per shared tensor, carried into
saved states and exported encodings."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from aimet_quadapter.cli import main
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.exporter import export_quantized
from aimet_quadapter.export.formats import ENCODINGS, QDQ_ONNX
from aimet_quadapter.export.onnx_eval import qdq_graph_encodings, read_encodings
from aimet_quadapter.quadapter.phase2 import lm_loss
from aimet_quadapter.quadapter.state import QuadapterState
from aimet_quadapter.quant.config import QuantPolicy
from aimet_quadapter.quant.mixed_precision import bit_sensitivity, quantizer_kinds
from aimet_quadapter.quant.policy import build_sim, calibrate, describe
from aimet_quadapter.testing import sample_corpus, toy_model

SEQ = 32
# the toy models' planted outliers sit in the norms' outputs: the inputs of q/k/v and of gate/up
NORM_READERS = ("*.q_proj.input*=16", "*.gate_proj.input*=16")


@pytest.fixture(scope="module")
def llama():
    model = toy_model("llama")
    corpus = sample_corpus(model, 8, SEQ, seed=1)
    return model, [corpus[:2], corpus[2:4]], corpus[4:]


def _sim(model, calib, overrides=()):
    sim = build_sim(model, QuantPolicy(bit_overrides=overrides))
    calibrate(sim, calib)
    return sim


def _bits(sim) -> dict[str, int]:
    return {row["tensor"]: row["bits"] for row in describe(sim.model)}


def test_an_override_reaches_every_reader_of_the_tensor_and_nothing_else(llama):
    model, calib, _ = llama
    bits = _bits(_sim(model, calib, ("*.layers.0.self_attn.q_proj.input*=16", "*.down_proj.weight=4")))
    # q, k and v read one tensor: naming q's input sets all three, as a device holds one encoding for it
    changed = {name: b for name, b in bits.items() if b != 8}
    readers = {f"lm.model.layers.0.self_attn.{p}_proj.input[0]" for p in "qkv"}
    down = {name for name in bits if name.endswith("down_proj.weight")}
    assert changed == {**dict.fromkeys(readers, 16), **dict.fromkeys(down, 4)}


def test_16_bits_where_the_outliers_are_recovers_most_of_the_error(llama):
    """The planted outlier channels stretch the norms' output ranges: 16 bits there must close most of the
    W8A8 gap, and 4-bit weights must widen it (the bit-widths are in effect, not only recorded)."""
    model, calib, held_out = llama
    with torch.no_grad():
        fp = float(lm_loss(model, held_out))
        w8a8 = float(lm_loss(_sim(model, calib).model, held_out))
        mixed = float(lm_loss(_sim(model, calib, NORM_READERS).model, held_out))
        w4 = float(lm_loss(_sim(model, calib, ("*.weight=4",)).model, held_out))
    assert w8a8 - fp > 0.05  # quantization hurts the toy model
    assert mixed - fp < 0.5 * (w8a8 - fp)
    assert w4 > w8a8


def test_a_saved_state_rebuilds_the_same_bit_widths(llama, tmp_path):
    model, calib, held_out = llama
    sim = _sim(model, calib, NORM_READERS)
    path = QuadapterState.from_sim(sim, {}, method="ptq").save(tmp_path / "mixed.safetensors")
    rebuilt = QuadapterState.load(path).build_sim(model)
    assert _bits(rebuilt) == _bits(sim)
    with torch.no_grad():
        assert torch.equal(rebuilt.model(held_out), sim.model(held_out))


@pytest.mark.slow
def test_the_export_carries_the_overrides_and_verifies(llama, tmp_path):
    model, calib, held_out = llama
    sim = _sim(model, calib, ("*.down_proj.input*=16", *NORM_READERS))
    result = export_quantized(sim, tmp_path / "e", SEQ, verify_windows=list(held_out[:2]))
    encodings = {e.name: e.bitwidth for e in read_encodings(json.loads((tmp_path / "e" / ENCODINGS).read_text()))}
    # one encoding per tensor: q/k/v's shared input and gate/up's appear once each, at 16 bits
    layers = model.config.num_hidden_layers
    assert sorted(encodings.values()).count(16) == 3 * layers
    assert set(encodings.values()) == {8, 16}
    # AIMET's QDQ graph quantizes those tensors to 16 bits too; the export's verification (onnxruntime against
    # the sim) passed, or export_quantized would have raised
    qdq_bits = [e.bitwidth for e in qdq_graph_encodings(onnx.load(str(tmp_path / "e" / QDQ_ONNX)))]
    assert qdq_bits.count(16) == 3 * layers
    assert result.verification.quantizers == len(_bits(sim))


@pytest.mark.parametrize(
    "entry, word",
    [("no-equals", "PATTERN=BITS"), ("*.x=1", "from 2 to 16"), ("*.x=sixteen", "from 2 to 16"), ("=8", "PATTERN")],
)
def test_a_malformed_override_is_refused_by_its_index(entry, word):
    with pytest.raises(QuadapterError, match=r"policy\.bit_overrides\[1\]") as info:
        QuantPolicy(bit_overrides=("*.down_proj.input*=16", entry))
    assert word in str(info.value)


def test_a_pattern_that_matches_nothing_names_a_real_quantizer(llama):
    with pytest.raises(QuadapterError, match="matches no quantizer") as info:
        build_sim(llama[0], QuantPolicy(bit_overrides=("*.mlp.down.input*=16",)))
    assert "lm.model.layers.0." in str(info.value)


def test_cli_and_recipe_take_overrides(tiny_gpt2_dir, corpus_dir, tmp_path, capsys):
    """`describe` (the CLI's own view of the sim) shows the bits that `--policy-bit-overrides` asked for."""
    argv = ["describe", "--model", str(tiny_gpt2_dir), "--policy-bit-overrides", '["*.c_fc.input*=16"]']
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ".c_fc.input" in line]
    assert lines and all(" 16 " in line for line in lines)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {tiny_gpt2_dir}\nmethods: [fp]\npolicy: {{bit_overrides: ['*.nothing*=16x']}}\n"
        f"eval: {{datasets: [{corpus_dir}], seq_len: 64, max_tokens: 256}}\n"
    )
    assert main(["run", str(recipe), "--out", str(tmp_path / "run")]) == 2
    assert "bit_overrides[0]" in capsys.readouterr().err


def test_kinds_merge_the_readers_of_one_tensor(llama):
    model, calib, _ = llama
    kinds = quantizer_kinds(_sim(model, calib).model)
    layers = model.config.num_hidden_layers
    assert len(kinds["*.self_attn.q_proj.input[0]"]) == 3 * layers  # q, k and v read one tensor
    assert "*.self_attn.k_proj.input[0]" not in kinds and "*.mlp.up_proj.input[0]" not in kinds
    assert len(kinds["*.mlp.down_proj.input[0]"]) == layers
    assert kinds["lm.model.embed_tokens.weight"] == ["lm.model.embed_tokens.weight"]
    assert sum(map(len, kinds.values())) == len(_bits(_sim(model, calib)))  # every quantizer in one kind


def test_sensitivity_finds_the_planted_outliers(llama):
    """The planted outlier channels sit in the norms' outputs: the attention norm's (read by q, k and v) must
    come first, far ahead of every kind that holds no planted outlier."""
    model, calib, held_out = llama
    with torch.no_grad():
        fp = float(lm_loss(model, held_out))
    sim = _sim(model, calib)
    base, rows = bit_sensitivity(sim.model, [held_out], lm_loss, fp)
    assert rows[0].kind == "*.self_attn.q_proj.input[0]"
    assert rows[0].recovered > 0.3 and rows[0].recovered > 3 * rows[1].recovered
    assert all(r.recovered < 1.05 for r in rows)
    assert set(_bits(sim).values()) == {8}  # every kind put back
    with torch.no_grad():
        assert float(lm_loss(sim.model, held_out)) == pytest.approx(base, rel=1e-5)


def test_cli_sensitivity_suggests_an_override(tiny_gpt2_dir, corpus_dir, capsys):
    argv = ["sensitivity", "--model", str(tiny_gpt2_dir), "--calib-dataset", str(corpus_dir)]
    assert main([*argv, "--calib-samples", "2", "--calib-len", "32", "--held-out", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "FP32" in out and "most sensitive: --policy-bit-overrides" in out
    assert main([*argv, "--held-out", "0"]) == 2


def test_cli_sensitivity_of_a_saved_state_scores_its_own_ranges(tiny_gpt2_dir, corpus_dir, tmp_path, capsys):
    """``--state``: the sim rebuilt from the state, no calibration; its ranges, not PTQ's, set the loss printed."""
    from aimet_quadapter.models import load_model
    from aimet_quadapter.text.data import batches, holdout_seed, load_text, random_crops, tokenize

    model, tokenizer = load_model(str(tiny_gpt2_dir))
    ids = tokenize(tokenizer, load_text(str(corpus_dir), "train"))
    sim = _sim(model, batches(random_crops(ids, 2, SEQ, 0), 1))
    ranges = QuadapterState.from_sim(sim, {}).ranges
    # every range a quarter as wide: a state no calibration of this text gives
    state = QuadapterState({}, {k: (lo / 4, hi / 4) for k, (lo, hi) in ranges.items()}, QuantPolicy())
    state.save(tmp_path / "narrow.safetensors")

    valid = tokenize(tokenizer, load_text(str(corpus_dir), "valid"))
    held_out = batches(random_crops(valid, 2, SEQ, holdout_seed(0), "--held-out"), 1)
    rebuilt = state.build_sim(load_model(str(tiny_gpt2_dir))[0])
    with torch.no_grad():
        expected = sum(float(lm_loss(rebuilt.model, b)) for b in held_out) / len(held_out)
        calibrated = sum(float(lm_loss(sim.model, b)) for b in held_out) / len(held_out)
    assert abs(expected - calibrated) > 1e-3  # the test tells the two apart

    argv = ["sensitivity", "--model", str(tiny_gpt2_dir), "--calib-dataset", str(corpus_dir), "--calib-len", str(SEQ)]
    args = [*argv, "--held-out", "2", "--split", "valid", "--state", str(tmp_path / "narrow.safetensors")]
    assert main([*args, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].endswith(f" {expected:.4f}"), out
    assert main([*args, "--policy-activation-bits", "16"]) == 2  # the state holds its policy
    assert "exclude each other" in capsys.readouterr().err
