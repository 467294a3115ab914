"""The command line, run in-process on a tiny local GPT-2 folder and a local text file."""

from __future__ import annotations

import json
import math

import pytest

from aimet_quadapter.cli import main

# The tiny GPT-2 has 256 positions: windows and calibration crops must fit.
SMALL = ["--seq-len", "64", "--max-tokens", "256", "--calib-samples", "2", "--calib-len", "64"]


def _ptq_key(results) -> str:
    """The PTQ row's label ("PTQ", "W8A8 PTQ", ...)."""
    keys = [k for k in results if k.endswith("PTQ")]
    assert len(keys) == 1, list(results)
    return keys[0]


def _table(out: str) -> list[str]:
    """The results table (header line first) and what follows it in the command's stdout."""
    lines = out.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.split()[:1] == ["method"]]
    assert len(starts) == 1, out
    return lines[starts[0] :]


def _error_line(capsys) -> str:
    """The error message: one line, the last thing on stderr (progress bars may come before it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line.strip() for line in err.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "aimet-quadapter: error: " in line]
    assert len(errors) == 1, err
    assert lines[-1] == errors[0]
    return errors[0]


def test_eval_local_model_and_file(tiny_gpt2_dir, corpus_file, tmp_path, capsys):
    out_json = tmp_path / "results.json"
    code = main(["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_file), "--json", str(out_json), *SMALL])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = _table(captured.out)
    assert lines[0].split() == ["method", corpus_file.stem]
    rows = {line.rsplit(None, 1)[0]: float(line.rsplit(None, 1)[1]) for line in lines[1:3]}
    assert len(rows) == 2 and "FP32" in rows and _ptq_key(rows)
    # 4 windows of 64 tokens, each window's first token is context only
    assert "252 scored tokens per dataset" in lines[3]

    saved = json.loads(out_json.read_text())
    assert saved["model"] == str(tiny_gpt2_dir)
    results = saved["results"]
    assert set(results) == set(rows)
    for method, row in results.items():
        value = row[str(corpus_file)]
        assert math.isfinite(value) and value > 1.0, method
        assert f"{value:.3f}" == f"{rows[method]:.3f}"
    assert results["FP32"][str(corpus_file)] != results[_ptq_key(results)][str(corpus_file)]
    assert saved["wall_time_s"] > 0


def test_eval_fp_only_two_datasets(tiny_gpt2_dir, corpus_file, tmp_path, capsys):
    other = tmp_path / "other.txt"
    other.write_text(corpus_file.read_text()[::-1], encoding="utf-8")
    out_json = tmp_path / "fp.json"
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_file), "--dataset", str(other)]
    code = main([*argv, "--methods", "fp", "--json", str(out_json), *SMALL])
    assert code == 0
    results = json.loads(out_json.read_text())["results"]
    assert list(results) == ["FP32"]
    assert set(results["FP32"]) == {str(corpus_file), str(other)}
    table = _table(capsys.readouterr().out)
    assert table[0].split() == ["method", "corpus", "other"]
    assert table[1].split()[0] == "FP32" and len(table[1].split()) == 3


def test_eval_missing_model_folder(tmp_path, corpus_file, capsys):
    missing = tmp_path / "no" / "such-model"
    code = main(["eval", "--model", str(missing), "--dataset", str(corpus_file)])
    assert code == 2
    assert str(missing) in _error_line(capsys)


def test_eval_unknown_dataset(tiny_gpt2_dir, capsys):
    code = main(["eval", "--model", str(tiny_gpt2_dir), "--dataset", "nosuchcorpus", *SMALL])
    assert code == 2
    line = _error_line(capsys)
    assert "'nosuchcorpus'" in line and "wikitext2" in line


def test_eval_unknown_method(tiny_gpt2_dir, corpus_file, capsys):
    code = main(["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_file), "--methods", "fp,foo"])
    assert code == 2
    line = _error_line(capsys)
    assert "foo" in line and "--methods" in line


def test_eval_bad_policy(tiny_gpt2_dir, corpus_file, capsys):
    code = main(["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_file), "--weight-bits", "1", *SMALL])
    err = capsys.readouterr().err
    assert code == 2
    assert "weight_bits" in err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert "FP32" not in err  # rejected before any evaluation runs


@pytest.mark.parametrize("option, value", [("--seq-len", "512"), ("--calib-len", "300")])
def test_eval_window_longer_than_model(tiny_gpt2_dir, corpus_file, capsys, option, value):
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_file), "--max-tokens", "1024"]
    code = main([*argv, "--seq-len", "64", "--calib-len", "64", option, value])
    assert code == 2
    line = _error_line(capsys)
    assert f"{option} {value}" in line and "256 positions" in line


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["eval", "--model", "x", "--dataset", "y", "--seq-len", "0"])
    assert info.value.code == 2
    assert "positive integer" in capsys.readouterr().err
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


def test_describe_calibrated_with_options(tiny_gpt2_dir, corpus_file, capsys):
    argv = ["describe", "--model", str(tiny_gpt2_dir), "--calib-dataset", str(corpus_file)]
    code = main([*argv, "--calib-samples", "2", "--calib-len", "32", "--no-norm-weights", "--quantize-logits"])
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
    results = json.loads(out_json.read_text())["results"]
    fp, ptq = results["FP32"]["ptb"], results[_ptq_key(results)]["ptb"]
    assert math.isfinite(fp) and math.isfinite(ptq)
    assert 1.0 < fp < ptq
