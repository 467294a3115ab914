"""Every input a user can get wrong ends in one line that names it, exit code 2, no traceback; and the errors
about options, files and datasets come before any model is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aimet_quadapter.cli import main

SMALL = ["--seq-len", "64", "--max-tokens", "256", "--calib-samples", "2", "--calib-len", "64"]


def _error_line(capsys) -> str:
    """The error: one line, the last on stderr (progress bars of the work done before it may come first)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line.strip() for line in err.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == [lines[-1]], err
    assert lines[-1].startswith("aimet-quadapter: error: ")
    return lines[-1]


def _beyond_free_memory(length: int = 64) -> int:
    """A count of ``length``-token crops whose token ids take four times the memory free now, on any machine."""
    import psutil

    return max(10**8, 4 * psutil.virtual_memory().available // (length * 8))


def _files(tmp_path: Path, corpus_dir: Path) -> dict[str, Path | str]:
    binary = tmp_path / "random.bin"
    binary.write_bytes(bytes(range(256)) * 40)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(bytes(range(128, 256)) * 40)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("the market fell .\n")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for name, manifest in (("corrupt-export", "{not json"), ("foreign-export", '{"name": "some other tool"}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(manifest)
    return {
        "binary": binary,
        "latin": latin,
        "empty": empty,
        "short": short,
        "corrupt": corrupt,
        "blocked_out": blocker / "run",
        "corpus": corpus_dir,
        "missing": tmp_path / "missing.txt",
        "json_elsewhere": tmp_path / "no-such-folder" / "r.json",
        "huge": str(_beyond_free_memory()),
        "huge_text": f"{_beyond_free_memory():,}",
    }


# (argv after `eval --model MODEL`, a word the message must hold); MODEL is the tiny GPT-2 folder
EVAL_CASES = {
    "binary dataset": (["--dataset", "{binary}"], "random.bin"),
    "undecodable dataset": (["--dataset", "{latin}"], "latin1.txt"),
    "empty dataset": (["--dataset", "{empty}"], "empty.txt"),
    "too-short dataset": (["--dataset", "{short}"], "short"),
    "missing dataset": (["--dataset", "{missing}"], "missing.txt"),
    "unknown corpus": (["--dataset", "nosuchcorpus"], "nosuchcorpus"),
    "negative phase-1 steps": (["--dataset", "{corpus}", "--phase1-steps", "-5"], "phase1.steps"),
    "zero phase-2 batch": (["--dataset", "{corpus}", "--phase2-batch-size", "0"], "phase2.batch_size"),
    "bad weight bits": (["--dataset", "{corpus}", "--policy-weight-bits", "1"], "weight_bits"),
    "unknown method": (["--dataset", "{corpus}", "--methods", "fp,foo"], "foo"),
    "negative calibration crops": (["--dataset", "{corpus}", "--calib-samples", "-1"], "calibration.samples"),
    # crops whose token ids take four times the free memory: refused by the estimate, not by the OOM killer
    "calibration crops beyond the free memory": (
        ["--dataset", "{corpus}", "--calib-samples", "{huge}"],
        "calibration.samples: {huge_text} crops of 64 tokens take",
    ),
    "more calibration crops than the text holds": (
        ["--dataset", "{corpus}", "--calib-samples", "1000"],
        "calibration.samples: 1,000 crops of 64 tokens need 64,000 tokens, the text holds",
    ),
    "bad device": (["--dataset", "{corpus}", "--device", "gpu"], "device"),
    "unwritable run folder": (["--dataset", "{corpus}", "--out", "{blocked_out}"], "a-file"),
    "window beyond the model's positions": (["--dataset", "{corpus}", "--seq-len", "100000"], "100000"),
    # refused before the run, whose results a missing folder would otherwise lose at the end
    "--json into a missing folder": (["--dataset", "{corpus}", "--json", "{json_elsewhere}"], "no-such-folder"),
    "empty prefix": (["--dataset", "{corpus}", "--prefix", ""], "prefix"),
}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_eval_bad_input_is_one_line_before_the_model_loads(
    case, tiny_gpt2_dir, corpus_dir, tmp_path, capsys, never_load
):
    files = _files(tmp_path, corpus_dir)
    extra, word = EVAL_CASES[case]
    argv = ["eval", "--model", str(tiny_gpt2_dir), *SMALL, "--methods", "fp,ptq"]
    argv += [a.format(**files) for a in extra]
    assert main(argv) == 2
    assert word.format(**files) in _error_line(capsys)


def test_offline_hub_dataset_is_one_line_before_the_model_loads(tiny_gpt2_dir, corpus_dir, capsys, never_load, offline):
    argv = ["eval", "--model", str(tiny_gpt2_dir), *SMALL, "--dataset", str(corpus_dir), "--dataset", "wikitext2"]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert "wikitext2" in line and "Offline?" in line


@pytest.fixture(scope="module")
def tmp_state(tmp_path_factory) -> Path:
    """A valid state file (PTQ ranges of a toy GPT-2), for the errors that come after it is read."""
    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.quant.policy import build_sim, calibrate
    from aimet_quadapter.testing import sample_corpus, toy_model

    model = toy_model("gpt2")
    sim = build_sim(model)
    calibrate(sim, [sample_corpus(model, 2, 32, seed=1)])
    return QuadapterState.from_sim(sim, {}, method="ptq").save(tmp_path_factory.mktemp("state") / "ptq.safetensors")


# (argv, a word the message must hold) of the commands other than eval
OTHER_CASES = {
    "export of a missing state": (["export", "{tmp}/none.safetensors", "--model", "x", "--out", "{tmp}/e"], "none"),
    "export of a corrupt state": (["export", "{corrupt}", "--model", "x", "--out", "{tmp}/e"], "corrupt.safetensors"),
    "export longer than the model's positions": (
        ["export", "{state}", "--model", "{model}", "--out", "{tmp}/e", "--seq-len", "100000"],
        "--seq-len 100000",
    ),
    "export into a folder that cannot be made": (
        ["export", "{state}", "--model", "{model}", "--out", "{blocked_out}"],
        "a-file is a file, not a folder",
    ),
    "report of an empty folder": (["report", "{tmp}"], "results.json"),
    "run into a folder that cannot be made": (["run", "{recipe}", "--out", "{blocked_out}"], "a-file"),
    "run with a --set typo": (["run", "{recipe}", "--set", "phase1.stpes=3"], "stpes"),
    "run with a negative count": (["run", "{recipe}", "--set", "phase2.steps=-1"], "phase2.steps"),
    "run with calibration crops beyond the free memory": (
        ["run", "{recipe}", "--set", "methods=[fp, ptq]", "--set", "calibration.dataset={corpus}"]
        + ["--set", "calibration.length=64", "--set", "calibration.samples={huge}"],
        "calibration.samples: {huge_text} crops of 64 tokens take",
    ),
    "run sampling more text than the memory holds": (
        ["run", "{recipe}", "--set", "methods=[fp, ptq]", "--set", "calibration.dataset=generated"]
        + ["--set", "calibration.length=64", "--set", "generated.length=64", "--set", "generated.samples=10000000000"],
        "generated.samples: 10,000,000,000 crops of 64 tokens take",
    ),
    "run of a recipe that is not YAML": (["run", "{not_yaml}"], "not valid YAML"),
    "run of a recipe with a misspelt field": (["run", "{misspelt}"], "field evall: unknown field; did you mean eval?"),
    "run setting how phase 2 runs under phase2": (
        ["run", "{recipe}", "--set", "phase2.micro_batch_size=2"],
        "unknown field 'micro_batch_size' in phase2 (did you mean execution.micro_batch_size?)",
    ),
    "eval of a missing model folder": (["eval", "--model", "{tmp}/no-model", "--dataset", "{corpus}"], "model folder"),
    "eval of an export whose manifest is not JSON": (
        ["eval", "--model", "{tmp}/corrupt-export", "--dataset", "{corpus}"],
        "corrupt-export/manifest.json is not an export manifest",
    ),
    "eval of an export whose manifest is another tool's": (
        ["eval", "--model", "{tmp}/foreign-export", "--dataset", "{corpus}"],
        "foreign-export/manifest.json is not a manifest of `aimet-quadapter export`",
    ),
    "describe with a crop count that is no number": (
        ["describe", "--model", "{model}", "--calib-dataset", "{corpus}", "--calib-samples", "abc"],
        "--calib-samples must be an integer >= 1, got 'abc'",
    ),
    "describe with a crop count and no calibration text": (
        ["describe", "--model", "{model}", "--calib-samples", "4"],
        "--calib-samples is for calibration: give --calib-dataset too",
    ),
    "describe with a missing calibration text": (
        ["describe", "--model", "{model}", "--calib-dataset", "{missing}"],
        "missing.txt",
    ),
    "eval of a missing relative model folder": (
        ["eval", "--model", "no-model/", "--dataset", "{corpus}"],
        "model folder no-model/ does not",
    ),
}


@pytest.mark.parametrize("case", list(OTHER_CASES))
def test_other_commands_bad_input_is_one_line_before_the_model_loads(
    case, tiny_gpt2_dir, corpus_dir, tmp_path, capsys, tmp_state, never_load, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the recipe names no run folder: its default, runs/r, is relative to here
    files = _files(tmp_path, corpus_dir)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(model=tiny_gpt2_dir, corpus=corpus_dir))
    not_yaml = tmp_path / "bad.yaml"
    not_yaml.write_text("methods: [fp\nmodel: {")
    argv, word = OTHER_CASES[case]
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text(RECIPE.format(model=tiny_gpt2_dir, corpus=corpus_dir).replace("eval:", "evall:"))
    names = {**files, "tmp": tmp_path, "recipe": recipe, "not_yaml": not_yaml, "model": tiny_gpt2_dir}
    names["misspelt"] = misspelt
    names["state"] = tmp_state
    assert main([a.format(**names) for a in argv]) == 2
    assert word.format(**names) in _error_line(capsys)


def test_corrupt_state_is_one_line_before_the_model_loads(tmp_path, corpus_dir, capsys, never_load):
    files = _files(tmp_path, corpus_dir)
    assert main(["export", str(files["corrupt"]), "--model", "x", "--out", str(tmp_path / "e")]) == 2
    line = _error_line(capsys)
    assert "corrupt.safetensors" in line and "not a Quadapter state file" in line


@pytest.mark.parametrize("other", ["wider gpt2", "llama"])
def test_a_state_of_another_model_is_one_line(other, tmp_path, tiny_gpt2_dir, corpus_dir, capsys, monkeypatch):
    """A state trained on another model (other widths, or another architecture): refused by the state's names
    before a sim is traced for it (another family before the model loads: see the test below)."""
    from aimet_quadapter.quadapter.api import apply_cle
    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.quant import policy
    from aimet_quadapter.quant.policy import build_sim, calibrate
    from aimet_quadapter.testing import sample_corpus, toy_model

    # the folder's model is a 64-wide GPT-2 (the tiny config's default)
    model = toy_model("gpt2", hidden=96) if other == "wider gpt2" else toy_model("llama")
    batches = [sample_corpus(model, 2, 32, seed=1)]
    sim = build_sim(model)
    qset = apply_cle(sim, model, batches)
    calibrate(sim, batches)
    path = QuadapterState.from_sim(sim, qset.total_alpha(), method="cle").save(tmp_path / "other.safetensors")

    def no_sim(*args, **kwargs):
        raise AssertionError("a sim was built for a state of another model")

    monkeypatch.setattr(policy, "QuantizationSimModel", no_sim)
    argv = ["export", str(path), "--model", str(tiny_gpt2_dir), "--out", str(tmp_path / "e"), "--seq-len", "32"]
    assert main([*argv, "--verify-dataset", str(corpus_dir)]) == 2
    line = _error_line(capsys)
    assert "other.safetensors" in line and "another model" in line


@pytest.fixture
def no_hub(monkeypatch, never_load):
    """Asking the hub (or reading a tokenizer, which may) fails the test: the error must come before it."""
    from aimet_quadapter.models import hub, loading

    def fail(*args, **kwargs):
        raise AssertionError("the hub was asked before the error")

    monkeypatch.setattr(hub, "hub_reachable", fail)
    monkeypatch.setattr(loading, "load_tokenizer", fail)


@pytest.fixture(scope="module")
def smollm2_state(tmp_path_factory) -> Path:
    """PTQ ranges of a toy Llama, saved as a run saves them for the demo's model (smollm2-135m)."""
    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.quant.policy import build_sim, calibrate
    from aimet_quadapter.testing import sample_corpus, toy_model

    model = toy_model("llama")
    sim = build_sim(model)
    calibrate(sim, [sample_corpus(model, 2, 32, seed=1)])
    state = QuadapterState.from_sim(sim, {}, method="ptq", model="smollm2-135m")
    return state.save(tmp_path_factory.mktemp("smollm2") / "ptq.safetensors")


# --model of each case: a hub id in no cache (refused by the name), a local GPT-2 (refused by the family)
OTHER_MODELS = {"hub id": "some-org/a-model-in-no-cache", "gpt2 folder": "{model}"}


@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.parametrize("other", list(OTHER_MODELS))
def test_a_state_of_another_named_model_is_one_line_before_the_hub(
    command, other, smollm2_state, tiny_gpt2_dir, corpus_dir, tmp_path, capsys, no_hub
):
    """The state names its model: `--model gpt2` with the demo's SmolLM2 state is refused at once, not after the
    hub was tried and a model loaded (16 s for eval, 38 s for export)."""
    model = OTHER_MODELS[other].format(model=tiny_gpt2_dir)
    if command == "eval":
        argv = ["eval", "--model", model, "--state", str(smollm2_state), "--dataset", str(corpus_dir)]
    else:
        argv = ["export", str(smollm2_state), "--model", model, "--out", str(tmp_path / "e")]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert "ptq.safetensors was computed for another model (smollm2-135m, a llama model)" in line
    assert f"--model {model}" in line


def test_a_run_saves_states_that_name_their_model(tmp_path, tiny_gpt2_dir):
    """What the refusals above read: each state a run saves names the model it was loaded by, and its family;
    and a state is not refused for the model it names, by that name or its folder's."""
    from aimet_quadapter.methods.registry import MethodContext, run_method
    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.quant.config import QuantPolicy
    from aimet_quadapter.running.cell_files import CellFiles
    from aimet_quadapter.running.provenance import check_model
    from aimet_quadapter.testing import sample_corpus, toy_model

    model = toy_model("gpt2")
    records = CellFiles(tmp_path, model_name=str(tiny_gpt2_dir))
    ctx = MethodContext(model, QuantPolicy(), [sample_corpus(model, 2, 32, seed=1)], progress=False, records=records)
    run_method("ptq", ctx)
    state = QuadapterState.load(tmp_path / "ptq.safetensors")
    assert state.metadata["model"] == str(tiny_gpt2_dir) and state.metadata["family"] == "gpt2"
    check_model(state, str(tiny_gpt2_dir))
    check_model(state, str(tiny_gpt2_dir / ".." / tiny_gpt2_dir.name))


# (where the state lies in the run folder, its fingerprint stamp, a word of the refusal)
NOT_THE_ROWS_STATE = {
    "other settings": ("calib-a/ptq/ptq.safetensors", "1" * 16, "under other settings"),
    "no stamp": ("calib-a/ptq/ptq.safetensors", None, "carries no fingerprint"),
    "no row": ("a/spinquant_quadapter/quadapter_bc.safetensors", "0" * 16, "no row of"),
}


@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.parametrize("case", list(NOT_THE_ROWS_STATE))
def test_a_state_that_is_not_its_rows_is_one_line_before_the_model_loads(
    command, case, smollm2_state, tmp_path, capsys, no_hub
):
    """A state in a run folder is used only where it is the one its row in results.json was computed with: a state
    of an earlier setting left beside a recomputed row, or a state no row was computed with, is refused."""
    import dataclasses

    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.running.provenance import check_row

    where, stamp, word = NOT_THE_ROWS_STATE[case]
    run = tmp_path / "run"
    cell = {"method": "ptq", "folder": "calib-a/ptq", "fingerprint": "0" * 16, "ppl": {"t": 1.0}}
    (run / "calib-a").mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"model": "smollm2-135m", "cells": {"calib:a/ptq": cell}}))
    state = QuadapterState.load(smollm2_state)
    metadata = {**state.metadata, **({"fingerprint": stamp} if stamp else {})}
    path = dataclasses.replace(state, metadata=metadata).save(run / where)
    if command == "eval":
        argv = ["eval", "--model", "smollm2-135m", "--state", str(path), "--dataset", "ptb"]
    else:
        argv = ["export", str(path), "--model", "smollm2-135m", "--out", str(tmp_path / "e")]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert path.name in line and word in line
    # the row's own state passes, and so does any state outside a run folder
    dataclasses.replace(state, metadata={**state.metadata, "fingerprint": "0" * 16}, source=None).save(
        run / "calib-a" / "ptq" / "ptq.safetensors"
    )
    check_row(QuadapterState.load(run / "calib-a" / "ptq" / "ptq.safetensors"))
    check_row(QuadapterState.load(smollm2_state))


RECIPE = "model: {model}\nmethods: [fp]\neval: {{datasets: [{corpus}], seq_len: 64, max_tokens: 256}}\n"


def test_missing_base_names_the_recipe_that_asked(tmp_path, tiny_gpt2_dir, corpus_dir, capsys):
    recipe = tmp_path / "child.yaml"
    recipe.write_text("base: parent.yaml\n" + RECIPE.format(model=tiny_gpt2_dir, corpus=corpus_dir))
    assert main(["run", str(recipe)]) == 2
    line = _error_line(capsys)
    assert "child.yaml" in line and "field base" in line and "parent.yaml" in line


def test_fp_alone_needs_no_calibration_text(tmp_path, tiny_gpt2_dir, capsys):
    """256 tokens to score and none to calibrate on: FP32 alone runs (the calibration default is 10 x 512)."""
    from conftest import make_corpus

    text = tmp_path / "small.txt"
    text.write_text(make_corpus(300, seed=3))
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(text), "--methods", "fp", "--seq-len", "64"]
    assert main([*argv, "--no-progress"]) == 0, capsys.readouterr().err


def _cli(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aimet_quadapter.cli", *argv], capture_output=True, text=True, timeout=300
    )


# AIMET, and the transformers modelling code (its tokenizers and image processors are light, and some versions
# import those with the package)
HEAVY = r"aimet_torch(\.|$)|transformers\.modeling_utils$|transformers\.models\.[^.]+\.modeling_"

BAD_INPUTS = {
    "eval option": ["eval", "--model", "{model}", "--dataset", "{corpus}", "--phase1-steps", "-5"],
    "eval dataset": ["eval", "--model", "{model}", "--dataset", "{tmp}/missing.txt"],
    "run --set": ["run", "{tmp}/r.yaml", "--set", "phase2.steps=-1"],
    "export state": ["export", "{tmp}/none.safetensors", "--model", "{model}", "--out", "{tmp}/e"],
}

# One fresh interpreter for the checks below, in this order: each import check counts what is new since the
# interpreter started, so a bad input that imports AIMET is seen at it and at every later one (the --no-progress
# command is a bad input too: a missing text).
_FRESH_INTERPRETER = """
import json, re, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    before = set(sys.modules)
    heavy = re.compile(HEAVY)
    new_heavy = lambda: sorted(m for m in set(sys.modules) - before if heavy.match(m))[:5]
    from aimet_quadapter.cli import main
    main(NO_PROGRESS)  # first: tqdm reads its settings once, when the first command imports it
    from tqdm.auto import tqdm
    found = {"library bar disabled": tqdm(range(2), desc="a library bar").disable, "bad": {}}
    for name, argv in BAD.items():
        found["bad"][name] = [main(argv), new_heavy()]
    import transformers
    transformers.GPT2LMHeadModel
    found["model code seen"] = new_heavy()
    import aimet_quadapter.cli, aimet_quadapter.methods.registry, aimet_quadapter.export.exporter
    import aimet_quadapter.quant.baselines
found["future warnings"] = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if w.category is FutureWarning]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def fresh_interpreter(tmp_path_factory, tiny_gpt2_dir, corpus_dir) -> tuple[dict, str]:
    """What a fresh interpreter saw: an interpreter costs seconds (torch's import), so the checks share one."""
    tmp = tmp_path_factory.mktemp("fresh")
    (tmp / "r.yaml").write_text(RECIPE.format(model=tiny_gpt2_dir, corpus=corpus_dir))
    bad = {k: [a.format(model=tiny_gpt2_dir, corpus=corpus_dir, tmp=tmp) for a in v] for k, v in BAD_INPUTS.items()}
    no_progress = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(tmp / "none.txt"), "--no-progress"]
    code = f"HEAVY = {HEAVY!r}\nBAD = {bad!r}\nNO_PROGRESS = {no_progress!r}\n" + _FRESH_INTERPRETER
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_refused_without_importing_aimet_or_model_code(name, fresh_interpreter):
    """AIMET's import alone takes seconds on a CPU: a bad input must be refused without it (and without the
    transformers modelling code), so that a typo costs the time of reading the recipe. Counted against what the
    interpreter held before the package was imported: an environment may preload packages of its own."""
    found, stderr = fresh_interpreter
    assert found["bad"][name] == [2, []], stderr[-2000:]


def test_the_import_check_sees_model_code(fresh_interpreter):
    """The check above can fail: loading a model's class is seen."""
    found, stderr = fresh_interpreter
    assert "transformers.models.gpt2.modeling_gpt2" in found["model code seen"], stderr[-2000:]


def test_no_progress_reaches_the_libraries_own_bars(fresh_interpreter):
    """transformers' GGUF loading bar takes no switch: --no-progress must still silence a bar like it."""
    found, stderr = fresh_interpreter
    assert found["library bar disabled"] is True
    assert "a library bar" not in stderr


def test_importing_the_package_raises_no_future_warning(fresh_interpreter):
    """aimet's `aimet_common` package warns on import; the package imports AIMET where it does not."""
    found, _ = fresh_interpreter
    assert found["future warnings"] == []


def test_an_export_without_the_disk_it_needs_is_one_line_before_the_sim(
    tmp_path, tiny_gpt2_dir, tmp_state, capsys, monkeypatch
):
    import shutil as real_shutil

    import aimet_quadapter.export.exporter as exporter

    usage = real_shutil.disk_usage(tmp_path)
    monkeypatch.setattr(exporter.shutil, "disk_usage", lambda _p: usage._replace(free=1000))
    monkeypatch.setattr(exporter, "export_quantized", lambda *a, **k: pytest.fail("the export started"))
    out = tmp_path / "e"
    assert main(["export", str(tmp_state), "--model", str(tiny_gpt2_dir), "--out", str(out)]) == 2
    line = _error_line(capsys)
    assert str(out) in line and "free disk" in line


# (what the folder holds, a phrase its refusal must hold)
BAD_MODEL_FOLDERS = {
    "missing": (None, "does not exist"),
    "empty": ({}, "has no config.json"),
    "config.json only": ({"config.json": '{"model_type": "gpt2"}'}, "has no weight files"),
    "config.json not JSON": ({"config.json": "{not json", "model.safetensors": ""}, "config.json is not JSON"),
    "unsupported model_type": (
        {"config.json": '{"model_type": "bert"}', "model.safetensors": ""},
        "model_type 'bert'; supported: gpt2, llama",
    ),
    "no tokenizer": ({"config.json": '{"model_type": "gpt2"}', "model.safetensors": ""}, "has no tokenizer files"),
}


@pytest.mark.parametrize("case", list(BAD_MODEL_FOLDERS))
def test_a_model_folder_that_cannot_load_is_one_line_before_any_work(case, tmp_path, corpus_dir):
    """`--set model=<folder>` names a folder that cannot load: refused naming the folder and what it lacks, before
    the run folder exists, so before the FP model sampled the recipe's generated text or a tokenizer was tried."""
    files, phrase = BAD_MODEL_FOLDERS[case]
    folder = tmp_path / "model"
    if files is not None:
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: gpt2\nmethods: [fp, ptq]\ncalibration: {dataset: [generated], samples: 2, length: 64}\n"
        f"generated: {{samples: 2, length: 64}}\neval: {{datasets: [{corpus_dir}], seq_len: 64, max_tokens: 256}}\n"
    )
    out = tmp_path / "out"
    done = _cli(["run", str(recipe), "--set", f"model={folder}", "--out", str(out), "--no-progress"])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("aimet-quadapter: error: "), done.stderr[-2000:]
    assert f"model folder {folder}" in lines[0] and phrase in lines[0]
    assert not out.exists()  # no run folder, no lock, no log: nothing was started


def test_every_checkpoint_save_pretrained_writes_and_every_hub_name_pass_the_folder_check(tiny_gpt2_dir, tmp_path):
    from aimet_quadapter.models.loading import check_model_source

    for name in (str(tiny_gpt2_dir), "gpt2", "some-org/a-model-in-no-cache", "smollm2-135m"):
        check_model_source(name)
    # a sharded checkpoint (its index and shards) and a slow BPE tokenizer's two files
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "vocab.json", "merges.txt"):
        (sharded / name).write_text('{"model_type": "llama"}' if name == "config.json" else "{}")
    check_model_source(str(sharded))
