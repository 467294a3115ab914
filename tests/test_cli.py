"""The command line, run in-process on a tiny local GPT-2 folder and a local text file."""

from __future__ import annotations

import json
import math
import re

import pytest

from aimet_quadapter.cli import main

# The tiny GPT-2 has 256 positions: windows and calibration crops must fit.
SMALL = ["--seq-len", "64", "--max-tokens", "256", "--calib-samples", "2", "--calib-len", "64"]


def _ptq_key(results) -> str:
    """The PTQ row's label ("PTQ", "W8A8 PTQ", ...)."""
    keys = [k for k in results if k.endswith("PTQ")]
    assert len(keys) == 1, list(results)
    return keys[0]


def _error_line(capsys) -> str:
    """The error message: one line, the last thing on stderr (progress bars may come before it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line.strip() for line in err.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "aimet-quadapter: error: " in line]
    assert len(errors) == 1, err
    assert lines[-1] == errors[0]
    return errors[0]


def _cells(saved: dict) -> dict[str, dict]:
    """label -> cell of a results.json."""
    return {c["label"]: c for c in saved["cells"].values()}


def test_eval_local_model_and_file(tiny_gpt2_dir, corpus_dir, tmp_path, capsys):
    """``eval`` is a recipe run: the same results.json as ``run``, and the printed table holds its numbers."""
    out_json = tmp_path / "results.json"
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), "--device", "cpu"]
    code = main([*argv, "--json", str(out_json), *SMALL])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    saved = json.loads(out_json.read_text())
    assert saved["model"] == str(tiny_gpt2_dir)
    assert saved["recipes"]["eval"]["settings"]["device"] == "cpu"
    assert saved["recipes"]["eval"]["settings"]["eval"]["seq_len"] == 64
    assert [d["label"] for d in saved["datasets"]] == [corpus_dir.stem]
    cells = _cells(saved)
    assert set(cells) == {"FP32", _ptq_key(cells)}
    fp, ptq = cells["FP32"]["ppl"][corpus_dir.stem], cells[_ptq_key(cells)]["ppl"][corpus_dir.stem]
    assert math.isfinite(fp) and math.isfinite(ptq) and fp > 1.0 and fp != ptq
    for label, value in (("FP32", fp), (_ptq_key(cells), ptq)):
        assert any(f"| {label} |" in line and f"{value:.2f}" in line for line in captured.out.splitlines())


def _never_load(monkeypatch):
    """Loading a model fails the test: the error must come before it."""
    from aimet_quadapter.models import loading

    def fail(name):
        raise AssertionError(f"model {name} was loaded before the error")

    monkeypatch.setattr(loading, "load_hf_model", fail)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["eval", "describe", "run"])
def test_device_cuda_without_cuda_is_one_line(command, tiny_gpt2_dir, corpus_dir, tmp_path, capsys, monkeypatch):
    _never_load(monkeypatch)
    if command == "run":
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"model: {tiny_gpt2_dir}\nmethods: [fp]\neval: {{datasets: [{corpus_dir}]}}\n")
        argv = ["run", str(recipe), "--out", str(tmp_path / "run")]
    else:
        argv = [command, "--model", str(tiny_gpt2_dir)] + (["--dataset", str(corpus_dir)] if command == "eval" else [])
    assert main([*argv, "--device", "cuda"]) == 2
    line = _error_line(capsys)
    assert "'cuda'" in line and "no CUDA device" in line


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CPU"])
def test_bad_device_names_the_recipe_field(device, tiny_gpt2_dir, corpus_dir, tmp_path, capsys, monkeypatch):
    _never_load(monkeypatch)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_gpt2_dir}\nmethods: [fp]\ndevice: {device}\neval: {{datasets: [{corpus_dir}]}}\n")
    assert main(["run", str(recipe), "--out", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    assert "field device" in line and repr(device) in line


def test_eval_fp_only_two_datasets(tiny_gpt2_dir, corpus_dir, tmp_path, capsys):
    other = tmp_path / "other.txt"
    other.write_text((corpus_dir / "test.txt").read_text()[::-1], encoding="utf-8")
    out_json = tmp_path / "fp.json"
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), "--dataset", str(other)]
    code = main([*argv, "--methods", "fp", "--json", str(out_json), *SMALL])
    assert code == 0
    cells = _cells(json.loads(out_json.read_text()))
    assert list(cells) == ["FP32"]
    assert set(cells["FP32"]["ppl"]) == {"corpus", "other"}
    assert cells["FP32"]["ppl"]["corpus"] != cells["FP32"]["ppl"]["other"]


def test_eval_missing_model_folder(tmp_path, corpus_dir, capsys):
    missing = tmp_path / "no" / "such-model"
    code = main(["eval", "--model", str(missing), "--dataset", str(corpus_dir)])
    assert code == 2
    assert str(missing) in _error_line(capsys)


def test_eval_unknown_dataset(tiny_gpt2_dir, capsys):
    code = main(["eval", "--model", str(tiny_gpt2_dir), "--dataset", "nosuchcorpus", *SMALL])
    assert code == 2
    line = _error_line(capsys)
    assert "'nosuchcorpus'" in line and "wikitext2" in line


def test_eval_unknown_method(tiny_gpt2_dir, corpus_dir, capsys):
    code = main(["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), "--methods", "fp,foo"])
    assert code == 2
    line = _error_line(capsys)
    assert "'foo'" in line and "field methods" in line


@pytest.mark.parametrize(
    "option, value, field",
    [
        ("--policy-weight-bits", "1", "policy.weight_bits"),
        ("--phase1-steps", "-3", "phase1.steps"),
        ("--phase1-input-source", "both", "phase1.input_source"),
        ("--quadapter-init", "random", "quadapter.init"),
        ("--seq-len", "0", "eval.seq_len"),
    ],
)
def test_eval_bad_setting_names_its_field(tiny_gpt2_dir, corpus_dir, capsys, option, value, field):
    """A generated option is checked by the recipe schema, before any model is loaded."""
    code = main(["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), option, value])
    assert code == 2
    line = _error_line(capsys)
    assert f"field {field}" in line and value in line


def test_eval_options_are_the_parameter_fields(capsys, monkeypatch):
    """Every field of the parameter classes has its option, with the class's default in its help."""
    from aimet_quadapter.quadapter import Phase1Parameters

    monkeypatch.setenv("COLUMNS", "1000")  # no help text wrapped
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--execution-checkpoint-dir" not in text  # the runner puts checkpoints in the run folder
    assert "--execution-micro-batch-size" in text
    for name, f in Phase1Parameters.model_fields.items():
        flag = f"--phase1-{name.replace('_', '-')}"
        found = re.search(rf" {flag}(?:, --no-{flag[2:]}| VALUE) (.*?)(?= --|$)", text)
        assert found, flag
        assert f"(default: {f.default})" in found.group(1), (flag, found.group(1))


def test_eval_generated_options_reach_the_run(tiny_gpt2_dir, corpus_dir, tmp_path):
    out = tmp_path / "run"
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), "--methods", "fp", *SMALL]
    code = main([*argv, "--phase1-steps", "7", "--no-policy-quantize-norm-weights", "--out", str(out)])
    assert code == 0
    settings = json.loads((out / "results.json").read_text())["recipes"]["eval"]["settings"]
    assert settings["phase1"]["steps"] == 7
    assert settings["policy"]["quantize_norm_weights"] is False
    assert settings["phase2"]["steps"] == 10_000  # not given: the dataclass default


@pytest.mark.parametrize(
    "option, value, field", [("--seq-len", "512", "eval"), ("--calib-len", "300", "calibration.length")]
)
def test_eval_window_longer_than_model(tiny_gpt2_dir, corpus_dir, capsys, option, value, field):
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), "--max-tokens", "1024"]
    code = main([*argv, "--seq-len", "64", "--calib-len", "64", option, value])
    assert code == 2
    line = _error_line(capsys)
    assert f"field {field}" in line and f"{value} exceeds" in line and "256 positions" in line


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["eval", "--model", "x", "--dataset", "y", "--split", "dev"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_describe(tiny_gpt2_dir, capsys):
    code = main(["describe", "--model", str(tiny_gpt2_dir)])
    assert code == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("lm.")]
    assert "lm.transformer.h.0.attn.c_attn.input[0]" in rows
    assert "lm.transformer.h.1.attn.av_matmul.input[1]" in rows
    assert "lm.transformer.ln_f.weight" in rows
    assert not any(r.endswith(".bias") or "output[" in r for r in rows)
    assert f"{len(rows)} quantizers: 16 weight, 17 activation" in out
    assert "5 Quadapter sites:" in out
    assert "  transformer.h.0.ln_1->c_attn" in out
    assert "  transformer.ln_f->lm_head" in out
    assert "(not calibrated)" in out


def test_describe_calibrated_with_options(tiny_gpt2_dir, corpus_dir, capsys):
    argv = ["describe", "--model", str(tiny_gpt2_dir), "--calib-dataset", str(corpus_dir)]
    options = [
        "--calib-samples",
        "2",
        "--calib-len",
        "32",
        "--no-policy-quantize-norm-weights",
        "--policy-quantize-logits",
    ]
    code = main([*argv, *options])
    assert code == 0
    out = capsys.readouterr().out
    assert "(not calibrated)" not in out
    assert "lm.lm_head.output[0]" in out
    assert ".ln_1.weight" not in out


@pytest.mark.slow
def test_eval_smollm2_ptb(tmp_path, capsys):
    """The offline demo on its first 2048 PTB test tokens: W8A8 PTQ must be worse than FP32."""
    out_json = tmp_path / "smollm2.json"
    argv = ["eval", "--model", "smollm2-135m", "--dataset", "ptb", "--max-tokens", "2048"]
    code = main([*argv, "--json", str(out_json)])
    assert code == 0, capsys.readouterr().err
    cells = _cells(json.loads(out_json.read_text()))
    fp, ptq = cells["FP32"]["ppl"]["ptb"], cells[_ptq_key(cells)]["ppl"]["ptb"]
    assert math.isfinite(fp) and math.isfinite(ptq)
    assert 1.0 < fp < ptq


def test_eval_state_scores_a_saved_state_as_its_run_did(tiny_gpt2_dir, corpus_dir, tmp_path, capsys):
    """`eval --state`: the sim rebuilt from the saved file gives the perplexity the training run reported,
    for a state whose alphas moved (Quadapter BC) and one that keeps them at CLE's."""
    run = tmp_path / "run"
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), *SMALL, "--no-progress"]
    assert main([*argv, "--methods", "cle,quadapter_bc", "--phase1-steps", "4", "--out", str(run)]) == 0
    saved = _cells(json.loads((run / "results.json").read_text()))
    for method, label in (("quadapter_bc", "Quadapter BC"), ("cle", "CLE")):
        (state,) = run.glob(f"*/{method}/{method}.safetensors")
        scored = tmp_path / f"{method}.json"
        assert main([*argv, "--state", str(state), "--json", str(scored)]) == 0, capsys.readouterr().err
        got = json.loads(scored.read_text())["ppl"][corpus_dir.stem]
        want = saved[label]["ppl"][corpus_dir.stem]
        assert got == pytest.approx(want, rel=1e-6), (method, got, want)
    assert "quadapter_bc (" in capsys.readouterr().out


def test_eval_state_refuses_methods_and_a_missing_state(tiny_gpt2_dir, corpus_dir, tmp_path, capsys):
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), *SMALL]
    assert main([*argv, "--state", str(tmp_path / "none.safetensors")]) == 2
    assert "none.safetensors" in _error_line(capsys)
    (tmp_path / "s.safetensors").write_bytes(b"")
    assert main([*argv, "--state", str(tmp_path / "s.safetensors"), "--methods", "ptq"]) == 2
    assert "--methods" in _error_line(capsys)


def test_eval_reads_the_prefix_the_recipes_read(tiny_gpt2_dir, corpus_dir, tmp_path):
    """``--prefix`` is the recipe field: every window follows it, so the FP32 perplexity changes with it."""
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), "--methods", "fp", "--no-progress"]
    argv += ["--seq-len", "64", "--max-tokens", "256"]
    ppl = {}
    for prefix in (None, "the market fell ."):
        out = tmp_path / f"{bool(prefix)}.json"
        assert main([*argv, "--json", str(out), *(["--prefix", prefix] if prefix else [])]) == 0
        ppl[prefix] = json.loads(out.read_text())["cells"]["fp"]["ppl"][corpus_dir.stem]
    assert ppl[None] != ppl["the market fell ."]


def test_eval_follows_the_models_own_prefix_by_default_under_htp_only():
    """Under htp the first token's outsized activations would set the static ranges: the model's own prefix is the
    default there; the paper's placement keeps none, and a saved state holds its own."""
    from aimet_quadapter.cli.app import _eval_recipe, build_parser

    def prefix(*options: str) -> str | None:
        args = build_parser().parse_args(["eval", "--model", "m", "--dataset", "ptb", *options])
        return _eval_recipe(args).prefix

    assert prefix() is None and prefix("--policy-target", "paper") is None
    assert prefix("--policy-target", "htp") == "auto"
    assert prefix("--policy-target", "htp", "--prefix", "none") is None
    assert prefix("--policy-target", "htp", "--prefix", "the market") == "the market"
    assert prefix("--prefix", "auto") == "auto"
    assert prefix("--policy-target", "htp", "--state", "s.safetensors") is None


def test_an_auto_prefix_of_a_tokenizer_without_bos_or_eos_is_none_and_the_log_says_so_once(
    tiny_tokenizer, corpus_dir, tmp_path
):
    import copy

    from conftest import save_tiny_gpt2

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.eos_token = None
    folder = save_tiny_gpt2(tmp_path / "model", tokenizer)
    argv = ["eval", "--model", str(folder), "--dataset", str(corpus_dir), "--methods", "fp", "--no-progress"]
    argv += ["--seq-len", "64", "--max-tokens", "256", "--policy-target", "htp"]
    ppl = {}
    for prefix in ("auto", "none"):
        assert main([*argv, "--out", str(tmp_path / prefix), "--prefix", prefix]) == 0
        ppl[prefix] = json.loads((tmp_path / prefix / "results.json").read_text())["cells"]["fp"]["ppl"]
    assert ppl["auto"] == ppl["none"]
    log = (tmp_path / "auto" / "run.log").read_text()
    assert log.count("neither a BOS nor an EOS token: no prefix") == 1


def test_ptq_state_saves_an_htp_state_that_noise_scores_as_eval_does(
    tiny_gpt2_dir, corpus_dir, tmp_path, capsys, monkeypatch
):
    """`ptq-state`: a PTQ state under target htp, calibrated on PTB train (here the local corpus's) after the prefix.
    `noise` scores it as saved, as `eval --state` does, then once per draw, each within float32 rounding of it."""
    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.text import data

    real = data.load_text
    monkeypatch.setattr(
        data, "load_text", lambda name, split="test": real(str(corpus_dir) if name == "ptb" else name, split)
    )
    state = tmp_path / "ptq.safetensors"
    argv = ["ptq-state", "--model", str(tiny_gpt2_dir), "--out", str(state), "--samples", "2", "--length", "64"]
    assert main([*argv, "--prefix", "the market", "--activation-bits", "16"]) == 0
    assert f"saved {state}" in capsys.readouterr().out
    saved = QuadapterState.load(state)
    assert saved.policy.target == "htp" and saved.policy.activation_bits == 16
    assert saved.metadata["method"] == "ptq" and saved.metadata["prefix"]

    window = ["--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), "--seq-len", "64", "--max-tokens", "128"]
    scored = tmp_path / "scored.json"
    assert main(["eval", *window, "--state", str(state), "--json", str(scored), "--no-progress"]) == 0
    want = json.loads(scored.read_text())["ppl"][corpus_dir.stem]
    capsys.readouterr()
    assert main(["noise", str(state), *window, "--draws", "2"]) == 0
    out = capsys.readouterr().out
    assert "share of activation codes one draw changes, first 256 tokens:" in out
    assert re.search(r"^  layer \S+: mean \S+, largest \S+$", out, re.M)
    name = re.escape(str(corpus_dir))
    ppl = re.findall(rf"^(as saved|draw \d): {name} test perplexity ([0-9.]+)$", out, re.M)
    assert [p[0] for p in ppl] == ["as saved", "draw 1", "draw 2"] and ppl[0][1] == f"{want:.3f}"
    values = [float(p[1]) for p in ppl]
    assert values[1:] == pytest.approx(values[:1] * 2, rel=1e-2)
    low, high = re.search(r"^range ([0-9.]+)-([0-9.]+): [0-9.]+ % of the lowest$", out, re.M).groups()
    assert (float(low), float(high)) == (min(values), max(values))
    assert main(["noise", str(state), *window, "--draws", "1", "--orders", "--rounding", "aimet-onnx"]) == 0
    out = capsys.readouterr().out
    assert "share of output activation codes one draw changes" in out and "draw 1: " in out


def test_ptq_state_refuses_a_bad_policy_before_the_model_loads(tiny_gpt2_dir, tmp_path, capsys, monkeypatch):
    _never_load(monkeypatch)
    out = tmp_path / "s.safetensors"
    assert main(["ptq-state", "--model", str(tiny_gpt2_dir), "--out", str(out), "--activation-bits", "1"]) == 2
    assert "activation_bits" in _error_line(capsys) and not out.exists()
    with pytest.raises(SystemExit) as info:
        main(["noise", "s.safetensors", "--model", "m", "--draws", "-1"])
    assert info.value.code == 2 and "expected an integer >= 0" in capsys.readouterr().err
