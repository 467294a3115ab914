"""`aimet-quadapter run` and `report` end to end on a tiny planted-outlier GPT-2 saved as a model folder.

The text is sampled from that model (words ``w0 .. w511``, one per token id), so the FP model is the best
predictor of it and quantization damage shows up as a higher perplexity.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import hf_tiny

import aimet_quadapter.methods.registry as methods
from aimet_quadapter.cli import main
from aimet_quadapter.methods.records import PARKED_FP
from aimet_quadapter.models import quiet_libraries
from aimet_quadapter.quadapter.state import QuadapterState
from aimet_quadapter.quant.config import PLACEMENT_REVISION, QuantPolicy
from aimet_quadapter.reporting.figures import perplexity_bars
from aimet_quadapter.reporting.report import dev_table, matched_comparisons, ordered_rows, results_table
from aimet_quadapter.running.recipes import load_recipe
from aimet_quadapter.running.runner import RecipeRun
from aimet_quadapter.running.statistics import machine_label, prediction_range
from aimet_quadapter.versions import cpu_name

quiet_libraries()
VOCAB = 512  # the tiny GPT-2 config's vocabulary

RECIPE = """\
model: ./model
methods: [fp, ptq, cle, quadapter_bc, quadapter]
fid: [a]
calibration: {samples: 2, length: 64}
phase1: {steps: 8}
phase2: {steps: 2, batch_size: 2, seq_len: 64}
eval: {datasets: [a, b.txt], seq_len: 64, max_tokens: 320}
dev: {datasets: [a], seq_len: 64}
"""


def word_tokenizer():
    """One word per token id, so sampled ids survive the trip through text exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


@torch.no_grad()
def save_outlier_gpt2(folder: Path, factor: float = 40.0, channels: int = 3, seed: int = 0) -> Path:
    """A tiny GPT-2 folder with outlier channels planted at every LayerNorm (FP function unchanged).

    A PreparedLM cannot be saved back as GPT-2 (its Conv1D became Linear), so the scale goes straight into
    the Hugging Face weights: LayerNorm gamma/beta times alpha, the next Conv1D's input rows (its weight is
    (in, out)) and lm_head's columns divided by it. lm_head is untied so that the embedding stays as it is.
    """
    model = hf_tiny("gpt2", seed=seed, initializer_range=0.3, tie_word_embeddings=False)
    hidden = model.config.n_embd
    alpha = torch.ones(hidden)
    alpha[torch.randperm(hidden, generator=torch.Generator().manual_seed(seed))[:channels]] = factor
    for block in model.transformer.h:
        for norm, consumer in ((block.ln_1, block.attn.c_attn), (block.ln_2, block.mlp.c_fc)):
            norm.weight.mul_(alpha)
            norm.bias.mul_(alpha)
            consumer.weight.div_(alpha[:, None])
    model.transformer.ln_f.weight.mul_(alpha)
    model.transformer.ln_f.bias.mul_(alpha)
    model.lm_head.weight.div_(alpha[None, :])
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def write_sampled_text(model_dir: Path, path: Path, num: int, length: int, seed: int, temperature: float) -> None:
    from aimet_quadapter.models import load_model
    from aimet_quadapter.testing import sample_corpus

    model, _ = load_model(str(model_dir))
    ids = sample_corpus(model, num, length, seed=seed, temperature=temperature)
    path.write_text("\n".join(" ".join(f"w{i}" for i in row.tolist()) for row in ids) + "\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """recipes/r.yaml, recipes/model/, recipes/a/ (the F-ID: train, valid and test splits, each sampled with a
    seed of its own) and recipes/b.txt (hotter sampling: F-OOD)."""
    root = tmp_path_factory.mktemp("world")
    save_outlier_gpt2(root / "model")
    (root / "a").mkdir()
    for split, num, seed in (("train", 12, 1), ("valid", 2, 3), ("test", 3, 4)):
        write_sampled_text(root / "model", root / "a" / f"{split}.txt", num, 128, seed=seed, temperature=1.0)
    write_sampled_text(root / "model", root / "b.txt", 6, 128, seed=2, temperature=1.5)
    (root / "r.yaml").write_text(RECIPE)
    return root


@pytest.fixture(scope="module")
def base_run(world, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "base"
    assert main(["run", str(world / "r.yaml"), "--out", str(out), "--no-progress"]) == 0
    return out


def _results(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def _count_calls(monkeypatch) -> dict[str, int]:
    """Wrap every registered method so that a test sees which ones ran."""
    calls: dict[str, int] = {}
    for name, fn in list(methods.REGISTRY.items()):

        def counted(ctx, name=name, fn=fn):
            calls[name] = calls.get(name, 0) + 1
            return fn(ctx)

        monkeypatch.setitem(methods.REGISTRY, name, counted)
    return calls


def _markdown_rows(table: str) -> list[list[str]]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def _plain(cell: str) -> str:
    return re.sub(r"</?ins>|\*\*", "", cell)


def test_a_run_prints_as_a_results_page_section(base_run, world, capsys):
    """`report --section`: the command that made the run as the user typed it (a page's table then stands under the
    command that reproduces it), where and on what code it ran, and the report's own tables."""
    results = _results(base_run)
    command = results["recipes"]["r"]["command"]
    assert command == f"aimet-quadapter run {world / 'r.yaml'} --out {base_run} --no-progress"
    assert main(["report", str(base_run), "--section"]) == 0
    section = capsys.readouterr().out
    # where the run went is no part of what it computed: the page names the recipe's own folder
    assert f"```bash\naimet-quadapter run {world / 'r.yaml'} --no-progress\naimet-quadapter report runs/r\n" in section
    cell = results["cells"]["a/quadapter"]
    row = _markdown_rows("| graph |" + section.split("| graph |")[1].split("\n\n")[0])[0]
    assert row[0] == QuantPolicy.model_validate(results["recipes"]["r"]["settings"]["policy"]).label()  # the graph
    assert row[1] == f"{cpu_name()}, {machine_label(cell)}" and row[2] == cell["commit"].replace(
        "+changes", " + changes"
    )
    assert results_table(results) in section and dev_table(results) in section


def test_run_then_report_end_to_end(base_run, world, capsys):
    results = _results(base_run)
    cells = results["cells"]
    assert set(cells) == {"fp", "calib:a/ptq", "calib:a/cle", "calib:a/quadapter_bc", "a/quadapter"}
    for key, cell in cells.items():
        assert set(cell["ppl"]) == {"a", "b"}, key
        assert cell["wall_time_s"] > 0 and cell["method_time_s"] >= 0 and cell["eval_time_s"] > 0
        assert cell["peak_rss_kib"] > 0
    assert cells["a/quadapter"]["fid"] == "a" and cells["a/quadapter"]["finetune_sequences"] == 4
    assert [d["label"] for d in results["datasets"]] == ["a", "b"]
    # every cell is scored on the development text too: another text than the test split, so other numbers
    assert [d["label"] for d in results["dev_datasets"]] == ["a"]
    for key, cell in cells.items():
        assert set(cell["dev_ppl"]) == {"a"} and cell["dev_ppl"]["a"] != cell["ppl"]["a"], key
    # the planted outliers hurt PTQ; the calibration-only Quadapter undoes much of it
    ppl = {k: c["ppl"]["a"] for k, c in cells.items()}
    assert ppl["calib:a/ptq"] > 1.5 * ppl["fp"]
    assert ppl["calib:a/quadapter_bc"] < ppl["calib:a/ptq"]
    # one phase 1 served both Quadapter cells; per-cell files are where the report looks for them
    assert "bc_time_s" not in cells["a/quadapter"]["info"]
    bc = base_run / "calib-a" / "quadapter_bc"
    for name in ("quadapter_bc.safetensors", "phase1_curves.png", "channel_ranges.png", "phase1_losses.json"):
        assert (bc / name).is_file(), name
    assert (base_run / "a" / "quadapter" / "quadapter.safetensors").is_file()
    assert not list(base_run.rglob("checkpoints"))

    capsys.readouterr()
    assert main(["report", str(base_run)]) == 0
    printed = capsys.readouterr().out
    report = (base_run / "report.md").read_text()
    assert report in printed
    main_table = report.split("## Perplexity (Table 1 layout)")[1].split("\n## ")[0]
    rows = _markdown_rows(main_table)
    labels = {c["label"]: c for c in cells.values()}
    assert [r[1] for r in rows] == ["FP32", "PTQ", "CLE", "Quadapter BC", "Quadapter"]
    for row in rows:
        cell = labels[row[1]]
        assert [_plain(v) for v in row[2:]] == [f"{cell['ppl'][d]:.2f}" for d in ("a", "b")], row
    by_label = {r[1]: r for r in rows}
    assert by_label["Quadapter"][2].startswith("<ins>") and "<ins>" not in by_label["Quadapter"][3]
    assert "<ins>" not in "".join(by_label["PTQ"][2:])  # calibration-only rows have no F-ID
    calib = [c for c in cells.values() if c["group"] == "calib:a"]
    for col, index in (("a", 2), ("b", 3)):
        best = min(calib, key=lambda c: c["ppl"][col])
        assert by_label[best["label"]][index].startswith("**"), col
        assert sum(by_label[c["label"]][index].startswith("**") for c in calib) == 1
    assert not by_label["FP32"][2].startswith("**")
    dev_rows = _markdown_rows(report.split("## Development text")[1].split("\n## ")[0])
    dev_expected = [(c["label"], f"{c['dev_ppl']['a']:.2f}") for c in labels.values()]
    assert [(r[1], _plain(r[2])) for r in dev_rows] == dev_expected
    # Table 2 layout: F-ID = a, F-OOD = b; averages of one column each
    food = _markdown_rows(report.split("F-ID = a (Table 2 layout)")[1].split("\n## ")[0])
    quad = next(r for r in food if r[1] == "Quadapter")
    assert _plain(quad[4]) == f"{cells['a/quadapter']['ppl']['a']:.2f}"
    assert _plain(quad[5]) == f"{cells['a/quadapter']['ppl']['b']:.2f}"
    for link in re.findall(r"\]\(([^)]+\.png)\)", report):
        assert (base_run / link).is_file(), link
    assert "figures/perplexity.png" in report
    labels, bars = perplexity_bars(results, ordered_rows(results))
    assert labels == ["PTQ", "CLE", "Quadapter BC", "Quadapter\n(a)"]  # FP32 is the line the bars stand on
    for column, ratios in bars.items():
        expected = [
            cells[k]["ppl"][column] / cells["fp"]["ppl"][column]
            for k in ("calib:a/ptq", "calib:a/cle", "calib:a/quadapter_bc", "a/quadapter")
        ]
        assert ratios == pytest.approx(expected), column


def test_rerun_recomputes_only_a_missing_cell(base_run, world, tmp_path, monkeypatch):
    run = _copy(base_run, tmp_path)
    before = _results(run)
    del before["cells"]["calib:a/cle"]
    (run / "results.json").write_text(json.dumps(before))
    calls = _count_calls(monkeypatch)
    assert main(["run", str(world / "r.yaml"), "--out", str(run), "--no-progress"]) == 0
    assert calls == {"cle": 1}
    after = _results(run)["cells"]
    assert set(after) == set(_results(base_run)["cells"])
    for key, cell in before["cells"].items():
        assert after[key]["finished"] == cell["finished"], key


def test_changed_settings_recompute_only_the_cells_they_affect(base_run, world, tmp_path, monkeypatch):
    run = _copy(base_run, tmp_path)
    # a checkpoint left by an interrupted run under other settings must not be resumed
    stale = run / "a" / "quadapter" / "checkpoints"
    stale.mkdir(parents=True)
    (stale / "phase2.pt").write_text("not a checkpoint")
    (stale / "fingerprint.txt").write_text("other settings")
    # the FP weights a killed computation of the cell left parked beside it
    parked = run / "a" / "quadapter" / f"{PARKED_FP}killed"
    parked.mkdir()
    (parked / "0.pt").write_text("weights")
    calls = _count_calls(monkeypatch)
    args = ["run", str(world / "r.yaml"), "--out", str(run), "--no-progress", "--set", "phase1.steps=3"]
    assert main(args) == 0
    assert calls == {"quadapter_bc": 1, "quadapter": 1}  # ptq, cle and fp do not depend on phase 1
    assert not stale.exists() and not parked.exists()
    calls.clear()
    assert main(args) == 0
    assert calls == {}


@pytest.fixture
def toy_method(monkeypatch):
    """A method added the way every method is: one catalog entry and one function under @method."""
    from aimet_quadapter.methods.catalog import CATALOG, MethodInfo
    from aimet_quadapter.quant.policy import build_sim, calibrate

    # Recorded as absent through monkeypatch, whose undo runs last-in first-out: a test that wraps the method
    # with monkeypatch too (_count_calls) gets its wrapper undone before the name itself is removed.
    monkeypatch.setitem(CATALOG, "ptq_one_batch", None)
    monkeypatch.setitem(methods.REGISTRY, "ptq_one_batch", None)

    @methods.method("ptq_one_batch", MethodInfo("PTQ, one calibration batch", reads=("baselines",)))
    def ptq_one_batch(ctx):
        sim = build_sim(ctx.model, ctx.policy)
        calibrate(sim, ctx.calibration[:1])
        return sim

    return "ptq_one_batch"


def test_a_method_added_as_one_entry_runs_is_reported_and_fingerprinted_by_what_it_reads(
    base_run, world, tmp_path, monkeypatch, toy_method, capsys
):
    run = _copy(base_run, tmp_path)
    calls = _count_calls(monkeypatch)
    args = ["run", str(world / "r.yaml"), "--out", str(run), "--no-progress", "--set", "methods=[fp,ptq,ptq_one_batch]"]
    assert main(args) == 0
    assert calls == {"ptq_one_batch": 1}  # fp and ptq come from the base run
    cell = _results(run)["cells"]["calib:a/ptq_one_batch"]
    assert cell["label"] == "PTQ, one calibration batch"
    assert all(v > 1 for v in cell["ppl"].values())
    calls.clear()
    assert main([*args, "--set", "phase1.steps=3"]) == 0
    assert calls == {}, "phase 1's settings are not among what the method reads"
    assert main([*args, "--set", "baselines.adaround_iterations=7"]) == 0
    assert calls == {"ptq_one_batch": 1}, "a setting of the section it reads computes it again, and only it"
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    assert "PTQ, one calibration batch" in capsys.readouterr().out


def test_a_function_without_a_catalog_entry_is_refused():
    from aimet_quadapter.errors import QuadapterError

    with pytest.raises(QuadapterError, match="no entry in methods/catalog.py"):
        methods.method("not_in_the_catalog")(lambda ctx: ctx.model)


def test_phase1_is_shared_through_the_saved_state(world, tmp_path, monkeypatch):
    run = tmp_path / "run"
    common = ["run", str(world / "r.yaml"), "--out", str(run), "--no-progress"]
    assert main([*common, "--set", "methods=[quadapter]"]) == 0
    cells = _results(run)["cells"]
    assert set(cells) == {"a/quadapter"}  # quadapter_bc ran on the side, not as a cell
    assert cells["a/quadapter"]["info"]["bc_time_s"] > 0
    assert (run / "calib-a" / "quadapter_bc" / "quadapter_bc.safetensors").is_file()

    phase1_runs = []
    original = methods.apply_phase1
    monkeypatch.setattr(methods, "apply_phase1", lambda *a, **k: phase1_runs.append(1) or original(*a, **k))
    assert main([*common, "--set", "methods=[quadapter,quadapter_bc_qat]"]) == 0
    assert set(_results(run)["cells"]) == {"a/quadapter", "a/quadapter_bc_qat"}
    assert phase1_runs == [], "the saved Quadapter BC state should have been reused"


def test_a_composition_starts_from_quadapters_saved_cell_and_ends_where_its_own_phase2_would(
    base_run, world, tmp_path, monkeypatch
):
    """Quadapter + SeqMSE after a done Quadapter cell runs SeqMSE alone on that cell's saved state; on its own it
    runs phase 2 first. Both end at the same sim: the saved state rebuilds phase 2's sim."""
    phase2_runs = []
    original = methods.apply_phase2
    monkeypatch.setattr(methods, "apply_phase2", lambda *a, **k: phase2_runs.append(1) or original(*a, **k))

    def run(out: Path, names: str) -> None:
        argv = ["run", str(world / "r.yaml"), "--out", str(out), "--set", f"methods=[{names}]", "--no-progress"]
        assert main(argv) == 0

    after, alone = _copy(base_run, tmp_path), tmp_path / "alone"  # base_run holds a done Quadapter cell
    run(after, "quadapter,quadapter_seq_mse")
    assert phase2_runs == [], "the composition trained phase 2 again"
    run(alone, "quadapter_seq_mse")
    assert phase2_runs == [1]
    continued, computed = (_results(r)["cells"]["a/quadapter_seq_mse"] for r in (after, alone))
    assert continued["info"]["continued_from"] == "a/quadapter"
    assert "continued_from" not in computed["info"]
    assert continued["fingerprint"] == computed["fingerprint"]
    for text, value in computed["ppl"].items():
        assert continued["ppl"][text] == pytest.approx(value, rel=1e-5), text
    assert continued["ppl"] != _results(after)["cells"]["a/quadapter"]["ppl"]  # SeqMSE moved something
    assert main(["report", str(after)]) == 0
    assert "from a/quadapter's saved state; SeqMSE moved" in (after / "report.md").read_text()


def test_interrupted_run_keeps_finished_cells(world, tmp_path, monkeypatch):
    run = tmp_path / "run"
    common = ["run", str(world / "r.yaml"), "--out", str(run), "--no-progress", "--set", "methods=[fp,ptq,cle]"]
    spec = methods.REGISTRY["cle"]

    def interrupted(ctx):
        raise KeyboardInterrupt

    monkeypatch.setitem(methods.REGISTRY, "cle", interrupted)
    assert main(common) == 130
    assert set(_results(run)["cells"]) == {"fp", "calib:a/ptq"}
    monkeypatch.setitem(methods.REGISTRY, "cle", spec)
    calls = _count_calls(monkeypatch)
    assert main(common) == 0
    assert calls == {"cle": 1}
    assert set(_results(run)["cells"]) == {"fp", "calib:a/ptq", "calib:a/cle"}


def test_a_diverged_cell_stops_alone_and_the_matrix_goes_on(world, tmp_path, capsys):
    out = tmp_path / "run"
    overrides = ["--set", "methods=[fp,ptq,quadapter]", "--set", "phase2.lr_alpha=1e30"]  # alpha -> inf
    code = main(["run", str(world / "r.yaml"), "--out", str(out), "--no-progress", *overrides])
    err = capsys.readouterr().err
    assert code == 1
    cells = _results(out)["cells"]
    assert set(cells) == {"fp", "calib:a/ptq", "a/quadapter"}
    assert cells["fp"]["ppl"] and cells["calib:a/ptq"]["ppl"]
    stopped = cells["a/quadapter"]
    assert stopped["ppl"] == {} and "step 2 of 2" in stopped["error"]
    assert "a/quadapter" in err and "step 2 of 2" in err
    assert main(["report", str(out)]) == 0
    assert "Quadapter (stopped: training diverged)" in capsys.readouterr().out


def test_lengths_beyond_the_model_name_the_field(world, tmp_path, capsys):
    args = ["run", str(world / "r.yaml"), "--out", str(tmp_path / "run"), "--no-progress"]
    assert main([*args, "--set", "eval.seq_len=512"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "seq_len: 512 exceeds the model's 256 positions" in err


def test_a_keep_start_pattern_that_matches_no_site_stops_the_run_before_any_cell(world, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", str(world / "r.yaml"), "--out", str(out), "--no-progress"]
    assert main([*args, "--set", "phase1.keep_start=['*.mlp.up_proj->down_proj']"]) == 2  # GPT-2 has no such site
    err = capsys.readouterr().err
    assert "Traceback" not in err and "phase1.keep_start: '*.mlp.up_proj->down_proj' matches no" in err
    assert not _results(out)["cells"]


def test_plan_of_a_matrix_without_loading_anything(tmp_path, monkeypatch):
    """Calibration-only cells once per calibration set; fine-tuned cells per F-ID and per sweep size."""
    recipe_file = tmp_path / "m.yaml"
    recipe_file.write_text(
        "model: gpt2\nmethods: [fp, ptq, quadapter_bc, qat, quadapter]\n"
        "fid: [wikitext2, [ptb, lambada]]\nfinetune_sizes: [4, 16]\n"
        "eval: {datasets: [wikitext2, ptb, lambada]}\n"
    )
    per_fid = RecipeRun(load_recipe(recipe_file), tmp_path / "out", progress=False)
    keys = [c.key for c in per_fid.cells]
    assert keys[:5] == ["fp", "calib:wikitext2/ptq", "calib:ptb+lambada/ptq", "calib:wikitext2/quadapter_bc",
                        "calib:ptb+lambada/quadapter_bc"]  # fmt: skip
    assert "ptb+lambada/quadapter@16" in keys and len(keys) == 5 + 2 * 2 * 2
    shared = RecipeRun(load_recipe(recipe_file, ["calibration.dataset=wikitext2"]), tmp_path / "o", progress=False)
    assert [c.key for c in shared.cells if c.group.startswith("calib:")] == [
        "calib:wikitext2/ptq",
        "calib:wikitext2/quadapter_bc",
    ]
    assert {c.calibration for c in shared.cells if c.fid} == {"wikitext2"}
    # fingerprints: a phase-2 change leaves calibration-only cells alone, a policy change does not
    changed = RecipeRun(load_recipe(recipe_file, ["phase2.steps=5"]), tmp_path / "out", progress=False)
    same = {c.key for c in per_fid.cells if per_fid.fingerprint(c) == changed.fingerprint(c)}
    assert same == {"fp", "calib:wikitext2/ptq", "calib:ptb+lambada/ptq", "calib:wikitext2/quadapter_bc",
                    "calib:ptb+lambada/quadapter_bc"}  # fmt: skip
    # phase 2's loss is a phase-2 change too; at its default it leaves every fingerprint as it was before it existed
    kd = RecipeRun(load_recipe(recipe_file, ["phase2.loss=kd"]), tmp_path / "out", progress=False)
    assert {c.key for c in per_fid.cells if per_fid.fingerprint(c) == kd.fingerprint(c)} == same
    assert "loss" not in per_fid.prints._sections(("phase2",))["phase2"]
    assert kd.prints._sections(("phase2",))["phase2"]["loss"] == "kd"
    policy = RecipeRun(load_recipe(recipe_file, ["policy.weight_bits=4"]), tmp_path / "out", progress=False)
    assert {c.key for c in per_fid.cells if per_fid.fingerprint(c) == policy.fingerprint(c)} == {"fp"}
    # a target's placement revised in the code computes its cells again; the other target's stay
    htp = RecipeRun(load_recipe(recipe_file, ["policy.target=htp"]), tmp_path / "out", progress=False)
    before = {c.key: (per_fid.fingerprint(c), htp.fingerprint(c)) for c in per_fid.cells}
    monkeypatch.setitem(PLACEMENT_REVISION, "htp", PLACEMENT_REVISION["htp"] + 1)
    after = {c.key: (per_fid.fingerprint(c), htp.fingerprint(c)) for c in per_fid.cells}
    assert {k for k in before if before[k][0] != after[k][0]} == set()
    assert {k for k in before if before[k][1] == after[k][1]} == {"fp"}


def test_settings_a_method_does_not_read_leave_its_cells_alone(tmp_path):
    recipe_file = tmp_path / "m.yaml"
    recipe_file.write_text("model: gpt2\nmethods: [cle_phase2, qat, quadapter]\nfid: [ptb]\neval: {datasets: [ptb]}\n")

    def fingerprints(*overrides: str) -> dict[str, str]:
        run = RecipeRun(load_recipe(recipe_file, list(overrides)), tmp_path / "out", progress=False)
        return {c.method: run.fingerprint(c) for c in run.cells}

    base = fingerprints()
    for unread in ("phase2.lr_alpha=0.5", "phase2.learn_ranges=false", "phase1.steps=3"):
        changed = fingerprints(unread)
        assert changed["cle_phase2"] == base["cle_phase2"] and changed["quadapter"] != base["quadapter"], unread
        assert changed["qat"] == base["qat"], unread  # QAT trains no alpha either
    assert fingerprints("phase1.keep_start=[model.norm*]")["qat"] == base["qat"]
    ranges = fingerprints("phase2.lr_ranges=0.5")
    assert ranges["cle_phase2"] != base["cle_phase2"] and ranges["qat"] != base["qat"]


def test_a_baselines_field_computes_again_only_the_methods_that_read_it(tmp_path):
    """Each method's fingerprint holds the fields it reads (catalog ``reads``): a baselines field of one technique
    leaves Quadapter, PTQ and every other technique's cells done."""
    from aimet_quadapter.methods.catalog import CATALOG

    recipe_file = tmp_path / "m.yaml"
    recipe_file.write_text(f"model: gpt2\nmethods: [{', '.join(CATALOG)}]\nfid: [ptb]\neval: {{datasets: [ptb]}}\n")

    def fingerprints(*overrides: str) -> dict[str, str]:
        run = RecipeRun(load_recipe(recipe_file, list(overrides)), tmp_path / "out", progress=False)
        return {c.method: run.fingerprint(c) for c in run.cells}

    base = fingerprints()
    qat = {"qat", "qat_fixed_ranges", "quadapter_bc_qat", "quadapter_bc_qat_fixed_ranges", "fp_finetuned"}
    qat |= {f"{t}_{m}" for t in ("spinquant", "fptquant") for m in ("qat", "quadapter_bc_qat")}
    for override, readers in (
        ("baselines.adaround_iterations=7", {"adaround", "quadapter_adaround"}),
        ("baselines.adaround_reg_param=0.5", {"adaround", "quadapter_adaround"}),
        ("baselines.adaround_batches=1", {"adaround", "quadapter_adaround"}),
        ("baselines.seq_mse_candidates=3", {"seq_mse", "quadapter_seq_mse", "quadapter_seq_mse_learned"}),
        ("baselines.seq_mse_any_bits=false", {"seq_mse", "quadapter_seq_mse", "quadapter_seq_mse_learned"}),
        ("baselines.spinquant_r2=true", {m for m in CATALOG if m.startswith("spinquant")}),
        ("baselines.fptquant_iterations=3", {m for m in CATALOG if m.startswith("fptquant")}),
        ("baselines.adascale_iterations=3", {"adascale"}),
        ("baselines.omniquant_iterations=3", {"omniquant"}),
        ("baselines.qat_lr_weights=0.5", qat),
        ("quadapter.holdout=2", {m for m, i in CATALOG.items() if "quadapter" in i.reads}),
    ):
        changed = fingerprints(override)
        assert {m for m in base if changed[m] != base[m]} == readers, override


def test_the_report_shows_the_phase1_check_to_the_decimal_that_decides_it():
    from aimet_quadapter.reporting.report import info_text

    text = info_text({"validation_start": 4.343764, "validation_end": 4.341449, "validation_kept": "end"})
    assert "4.3438" in text and "4.3414" in text and "kept the end" in text
    points = {"0": 4.343764, "0.5": 4.338123, "1": 4.341449}
    text = info_text({"validation_start": 4.343764, "validation_end": 4.341449, "validation_kept": "0.5",
                      "validation_points": points})  # fmt: skip
    assert "kept the point 0.5 of the way (4.3381)" in text


@pytest.mark.slow
def test_generated_text_is_sampled_once_kept_and_part_of_the_fingerprint(world, tmp_path, monkeypatch):
    import aimet_quadapter.methods.generated as generated

    sampled = []
    original = generated.generate_samples
    monkeypatch.setattr(generated, "generate_samples", lambda *a, **k: sampled.append(1) or original(*a, **k))
    out = tmp_path / "run"
    sets = ["fid=[generated]", "methods=[fp,cle,quadapter]", "generated={samples: 3, length: 64}"]
    args = ["run", str(world / "r.yaml"), "--out", str(out), "--no-progress", *[x for s in sets for x in ("--set", s)]]
    assert main(args) == 0
    assert sampled == [1]  # calibration, phase 1's held-out check and phase 2 share one sampling
    (kept,) = (out / "generated").glob("*.pt")
    samples = torch.load(kept)
    assert samples.shape == (3, 64)
    assert set(_results(out)["cells"]) == {"fp", "calib:generated/cle", "generated/quadapter"}

    run = RecipeRun(load_recipe(world / "r.yaml", sets), out, progress=False)
    for batch in run.data.finetune_batches("generated", None):  # phase 2 trains on the kept samples
        for row in batch:
            assert any(torch.equal(row, s) for s in samples)

    calls = _count_calls(monkeypatch)
    assert main(args) == 0
    assert sampled == [1] and calls == {}  # read back from the run folder; every cell reused
    assert main([*args, "--set", "generated.seed=5"]) == 0
    assert sampled == [1, 1]  # other text: every cell that uses it is recomputed, the FP model's is not
    assert calls == {"cle": 1, "quadapter_bc": 1, "quadapter": 1}


def test_generated_text_is_refused_where_it_cannot_serve(world, tmp_path, capsys):
    args = ["run", str(world / "r.yaml"), "--out", str(tmp_path / "run"), "--no-progress"]
    assert main([*args, "--set", "eval.datasets=[generated]"]) == 2
    assert "field eval.datasets: 'generated' is text the model samples itself" in capsys.readouterr().err
    assert main([*args, "--set", "fid=[generated]", "--set", "generated.length=32"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "field calibration.length: 64 tokens, longer than the generated samples" in err


def test_seeds_run_every_cell_but_fp32_per_seed_and_report_mean_and_spread(world, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    argv = ["run", str(world / "r.yaml"), "--out", str(run), "--no-progress"]
    argv += ["--set", "methods=[fp,ptq,cle_phase2,quadapter]", "--set", "seeds=[0,1]", "--set", "phase1.steps=2"]
    assert main(argv) == 0
    results = _results(run)
    cells = results["cells"]
    keys = {"calib:a/ptq", "a/cle_phase2", "a/quadapter"}
    assert set(cells) == {"fp"} | {f"{k}#seed{s}" for k in keys for s in (0, 1)}
    assert results["seeds"] == [0, 1]
    # each seed draws its own calibration crops (and so its own fine-tuning order): other numbers
    ptq = [cells[f"calib:a/ptq#seed{s}"]["ppl"]["a"] for s in (0, 1)]
    assert len(set(ptq)) == 2
    assert (run / "seed-1" / "calib-a" / "quadapter_bc" / "quadapter_bc.safetensors").is_file()
    assert (run / "seed-0" / "a" / "quadapter" / "quadapter.safetensors").is_file()
    summary = results["summary"]["calib:a/ptq"]["ppl"]["a"]
    low, high = prediction_range(ptq)
    assert summary == {
        "mean": pytest.approx(sum(ptq) / 2),
        "min": min(ptq),
        "max": max(ptq),
        "predict_low": pytest.approx(low),
        "predict_high": pytest.approx(high),
    }
    assert set(results["summary"]["a/quadapter"]["dev_ppl"]) == {"a"}

    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    report = (run / "report.md").read_text()
    rows = {r[1]: r for r in _markdown_rows(report.split("## Perplexity (Table 1 layout)")[1].split("\n## ")[0])}
    assert list(rows) == ["FP32", "PTQ", "CLE + phase 2 (ranges)", "Quadapter"]
    assert _plain(rows["PTQ"][2]) == f"{sum(ptq) / 2:.2f} ({min(ptq):.2f}–{max(ptq):.2f})"
    comparisons = report.split("## Against the matched baselines")[1].split("\n## ")[0]
    assert "- a, a: Quadapter " in comparisons and "vs CLE + phase 2 (ranges)" in comparisons
    assert "the spread (2 seeds)" in comparisons

    calls = _count_calls(monkeypatch)
    assert main(argv) == 0
    assert calls == {}, "every seed's cells are kept"


def test_a_cell_computed_under_other_library_versions_is_marked(base_run, tmp_path):
    from aimet_quadapter.versions import library_versions

    run = _copy(base_run, tmp_path)
    results = _results(run)
    assert all(c["versions"] == library_versions() for c in results["cells"].values())
    results["cells"]["calib:a/cle"]["versions"]["torch"] = "0.1.0"
    (run / "results.json").write_text(json.dumps(results))
    assert main(["report", str(run)]) == 0
    report = (run / "report.md").read_text()
    rows = {r[1]: r for r in _markdown_rows(report.split("## Perplexity (Table 1 layout)")[1].split("\n## ")[0])}
    assert "CLE †" in rows and "PTQ" in rows and "PTQ †" not in rows
    assert "CLE (calib:a): torch 0.1.0" in report


def test_a_cell_computed_by_other_code_of_this_package_is_marked(base_run, tmp_path):
    """The package's version stays 0.1.0 while its code changes: the source hash tells two codes apart."""
    from aimet_quadapter.versions import SOURCE, source_commit, source_hash

    run = _copy(base_run, tmp_path)
    results = _results(run)
    assert {c["versions"][SOURCE] for c in results["cells"].values()} == {source_hash()}
    assert all(c["commit"] == source_commit() for c in results["cells"].values())
    results["cells"]["calib:a/cle"]["versions"][SOURCE] = "0123456789ab"
    (run / "results.json").write_text(json.dumps(results))
    assert main(["report", str(run)]) == 0
    report = (run / "report.md").read_text()
    assert f"CLE (calib:a): {SOURCE} 0123456789ab" in report and "PTQ (calib:a)" not in report


def test_messages_go_to_stderr_at_the_level_asked_and_always_to_the_run_log(base_run, world, tmp_path, capsys):
    run = _copy(base_run, tmp_path)
    args = ["run", str(world / "r.yaml"), "--out", str(run), "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "cells already in" in err and "run of r (" not in err  # the debug header stays in the file
    assert main([*args, "-q"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "| PTQ |" in captured.out, "quiet: no messages, the results still print"
    assert main([*args, "--verbose"]) == 0
    assert "run of r (" in capsys.readouterr().err
    lines = (run / "run.log").read_text().splitlines()
    assert sum("cells already in" in line for line in lines) >= 3  # appended by every run, quiet ones too
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO) ", lines[-1])


def test_a_matched_baseline_on_fewer_seeds_is_compared_on_the_seeds_both_ran():
    def cell(method: str, label: str, seed: int, value: float) -> dict:
        return _cell(method, "g", seed, {"t": value}, label=label)

    quadapter = {0: 10.0, 1: 18.0, 2: 35.0}  # mean 21, above QAT's 19; on seed 1 alone, below it
    cells = {f"g/quadapter#seed{s}": cell("quadapter", "Quadapter", s, v) for s, v in quadapter.items()}
    cells["g/qat#seed1"] = cell("qat", "QAT", 1, 19.0)
    cells |= {f"g/cle_phase2#seed{s}": cell("cle_phase2", "CLE + phase 2", s, v + 1) for s, v in quadapter.items()}
    lines = matched_comparisons({"cells": cells, "fids": {"g": []}})
    qat = [line for line in lines if "vs QAT" in line]
    assert qat == [
        "- g, t: Quadapter 18.00 vs QAT 19.00 (-5.3 %) (on seed 1, which both ran): one seed, no spread to judge by"
    ]
    assert any("Quadapter 21.00 vs CLE + phase 2 22.00 (-4.5 %): within the spread (3 seeds)" in line for line in lines)
    del cells["g/quadapter#seed1"]
    assert "- g: Quadapter and QAT share no seed, not compared" in matched_comparisons({"cells": cells, "fids": {}})


def test_seeds_and_cells_run_in_other_folders_merge_into_one(world, tmp_path, capsys):
    for out, seeds in (("a", "[0]"), ("b", "[1]")):
        argv = ["run", str(world / "r.yaml"), "--out", str(tmp_path / out), "--no-progress"]
        assert main([*argv, "--set", "methods=[fp,ptq]", "--set", f"seeds={seeds}"]) == 0
    other = Path(shutil.copytree(tmp_path / "b", tmp_path / "other"))
    results = _results(other)
    next(iter(results["recipes"].values()))["settings"]["calibration"]["length"] = 32
    (other / "results.json").write_text(json.dumps(results))
    capsys.readouterr()

    assert main(["merge", str(tmp_path / "a"), str(other)]) == 2
    assert "field calibration.length is 32 there and 64 in the destination" in capsys.readouterr().err
    # how the cells ran (here how often phase 2 checkpoints) does not keep runs apart
    quiet = _results(tmp_path / "b")
    next(iter(quiet["recipes"].values()))["settings"]["execution"]["checkpoint_every"] = 3
    (other / "results.json").write_text(json.dumps(quiet))
    assert main(["merge", str(shutil.copytree(tmp_path / "a", tmp_path / "a2")), str(other)]) == 0
    # nor one that no method of either run reads (catalog reads): FP32 and PTQ run no AdaRound
    next(iter(quiet["recipes"].values()))["settings"]["baselines"]["adaround_iterations"] = 7
    (other / "results.json").write_text(json.dumps(quiet))
    assert main(["merge", str(shutil.copytree(tmp_path / "a", tmp_path / "a3")), str(other)]) == 0
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert f"added to {tmp_path / 'a'}: calib:a/ptq#seed1\n" in capsys.readouterr().out
    a, b = _results(tmp_path / "a"), _results(tmp_path / "b")
    assert a["seeds"] == [0, 1] and a["cells"]["calib:a/ptq#seed1"] == b["cells"]["calib:a/ptq#seed1"]
    ptq = [a["cells"][f"calib:a/ptq#seed{s}"]["ppl"]["a"] for s in (0, 1)]
    assert a["summary"]["calib:a/ptq"]["ppl"]["a"] == {
        "mean": pytest.approx(sum(ptq) / 2),
        "min": min(ptq),
        "max": max(ptq),
        **dict(zip(("predict_low", "predict_high"), map(pytest.approx, prediction_range(ptq)))),
    }
    assert (tmp_path / "a" / "seed-1" / "calib-a" / "ptq").is_dir()
    # merging again adds nothing: seed 1 is the destination's now
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert f"added to {tmp_path / 'a'}: nothing (it has every cell of the others)\n" in capsys.readouterr().out
    # a copy that ran another method of a seed the destination has: that cell and its folder join, the rest stays
    other = Path(shutil.copytree(tmp_path / "a", tmp_path / "c"))
    argv = ["run", str(world / "r.yaml"), "--out", str(other), "--no-progress", "--set", "seeds=[0]"]
    assert main([*argv, "--set", "methods=[fp,cle]"]) == 0
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "a"), str(other)]) == 0
    assert f"added to {tmp_path / 'a'}: calib:a/cle#seed0\n" in capsys.readouterr().out
    merged = _results(tmp_path / "a")
    assert merged["cells"]["calib:a/cle#seed0"] == _results(other)["cells"]["calib:a/cle#seed0"]
    assert merged["cells"]["calib:a/ptq#seed1"] == a["cells"]["calib:a/ptq#seed1"]
    assert (tmp_path / "a" / "seed-0" / "calib-a" / "cle").is_dir()


def test_a_recipe_of_another_name_with_the_same_settings_merges(world, tmp_path, capsys):
    """Two recipe files that differ only in ``methods`` or in what they say of themselves (the paper's tables)
    compute the same cells: a run of one merges into a run of the other; a file that differs in a setting is
    refused, naming the field."""
    (world / "other-name.yaml").write_text((world / "r.yaml").read_text() + "description: another table\n")
    (world / "longer.yaml").write_text((world / "r.yaml").read_text().replace("max_tokens: 320", "max_tokens: 256"))
    argv = ["--no-progress", "--set", "methods=[fp,ptq]"]
    assert main(["run", str(world / "r.yaml"), "--out", str(tmp_path / "a"), *argv, "--set", "seeds=[0]"]) == 0
    for name in ("other-name", "longer"):
        out = str(tmp_path / name)
        assert main(["run", str(world / f"{name}.yaml"), "--out", out, *argv, "--set", "seeds=[1]"]) == 0
    capsys.readouterr()

    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "longer")]) == 2
    err = capsys.readouterr().err
    assert "a run of recipe longer, which the destination never ran" in err and "field eval.max_tokens" in err
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "other-name")]) == 0
    assert f"added to {tmp_path / 'a'}: calib:a/ptq#seed1\n" in capsys.readouterr().out
    merged = _results(tmp_path / "a")
    assert sorted(merged["recipes"]) == ["other-name", "r"] and merged["summary"]["calib:a/ptq"]["seeds"] == [0, 1]


def test_runs_of_two_checkouts_merge_their_texts_by_content(world, tmp_path, capsys):
    """A second checkout holds the same texts at another path: its cells are the same cells, and merge adds them
    (the fingerprint names a local text by its content, and data_dirs is where to look, not a setting); a text that
    differs still keeps the runs apart."""
    recipe = RECIPE.replace("model: ./model", f"model: {world / 'model'}") + "data_dirs: [.]\n"
    first, other = (
        Path(shutil.copytree(world, tmp_path / name, ignore=shutil.ignore_patterns("model")))
        for name in ("checkout", "checkout2")
    )
    for checkout in (first, other):
        (checkout / "r.yaml").write_text(recipe)
    argv = ["--no-progress", "--set", "methods=[fp,ptq]"]
    assert main(["run", str(first / "r.yaml"), "--out", str(tmp_path / "a"), *argv, "--set", "seeds=[0]"]) == 0
    assert main(["run", str(other / "r.yaml"), "--out", str(tmp_path / "b"), *argv, "--set", "seeds=[1]"]) == 0
    a, b = _results(tmp_path / "a"), _results(tmp_path / "b")
    assert a["cells"]["fp"]["fingerprint"] == b["cells"]["fp"]["fingerprint"]
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "calib:a/ptq#seed1" in capsys.readouterr().out
    with open(other / "b.txt", "a") as f:
        f.write("w1 w2 w3\n")
    assert main(["run", str(other / "r.yaml"), "--out", str(tmp_path / "c"), *argv, "--set", "seeds=[2]"]) == 0
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "c")]) == 2
    assert "other datasets than the destination's" in capsys.readouterr().err


def test_the_seeds_of_a_row_that_ran_under_other_thread_counts_or_kernels_are_marked(capsys):
    from aimet_quadapter.reporting.report import results_table

    cells = {f"calib:a/ptq#seed{s}": _cell("ptq", "calib:a", s, {"a": 10.0 + s}, label="PTQ") for s in (0, 1, 2)}
    for s, threads, kernels in ((0, 1, "AVX2"), (1, 2, "AVX512"), (2, 2, "AVX2")):
        cells[f"calib:a/ptq#seed{s}"].update(threads=threads, kernels=kernels, device="cpu")
    table = results_table({"cells": cells, "datasets": [{"label": "a"}], "seeds": [0, 1, 2]})
    assert "seeds ran under 1 thread on AVX2, 2 threads on AVX2, 2 threads on AVX512" in table
    cells["calib:a/ptq#seed2"]["kernels"] = "AVX512"
    del cells["calib:a/ptq#seed0"]
    assert "seeds ran under" not in results_table({"cells": cells, "datasets": [{"label": "a"}], "seeds": [1, 2]})


def test_a_cell_records_the_thread_count_kernels_and_device_it_ran_under(base_run):
    cell = next(iter(_results(base_run)["cells"].values()))
    assert cell["threads"] == torch.get_num_threads()
    assert cell["kernels"] == torch.backends.cpu.get_cpu_capability()
    assert cell["device"] == "cpu"


def test_the_seeds_of_a_row_computed_on_a_gpu_and_on_the_cpu_are_marked():
    from aimet_quadapter.reporting.report import results_table

    def table(devices: dict[int, str]) -> str:
        cells = {
            f"calib:a/ptq#seed{s}": _cell(
                "ptq", "calib:a", s, {"a": 10.0 + s}, threads=2, kernels="AVX2", device=device
            )
            for s, device in devices.items()
        }
        return results_table({"cells": cells, "datasets": [{"label": "a"}], "seeds": list(devices)})

    mixed = table({0: "cpu", 1: "cuda (NVIDIA H200)", 2: "cpu"})
    assert "seeds ran under 2 threads on AVX2, 2 threads on AVX2 with cuda (NVIDIA H200)" in mixed
    assert "seeds ran under" not in table({0: "cuda (NVIDIA H200)", 1: "cuda (NVIDIA H200)"})


def test_a_row_with_a_stopped_seed_is_the_mean_of_the_others_and_says_so():
    from aimet_quadapter.running.statistics import merge_seeds

    cells = {
        f"g/quadapter#seed{s}": _cell("quadapter", "g", s, {"a": v}, label="Quadapter")
        for s, v in ((0, 10.0), (1, 12.0))
    }
    cells["g/quadapter#seed2"] = _cell("quadapter", "g", 2, {}, label="Quadapter", error="the loss is nan")
    row = merge_seeds(cells)["g/quadapter"]
    assert row["ppl"]["a"] == 11.0 and row["seeds"] == [0, 1] and row["stopped_seeds"] == [2]


def test_the_prediction_range_holds_one_more_run_as_often_as_it_says_and_the_min_max_of_three_half_as_often():
    import random

    rng, trials = random.Random(0), 4000
    in_range = in_min_max = 0
    for _ in range(trials):
        *seeds, another = (rng.gauss(60.0, 1.5) for _ in range(4))
        low, high = prediction_range(seeds)
        in_range += low <= another <= high
        in_min_max += min(seeds) <= another <= max(seeds)
    assert 0.93 < in_range / trials < 0.97
    assert 0.45 < in_min_max / trials < 0.55
    with pytest.raises(ValueError, match="at least two runs"):
        prediction_range([60.0])


def test_the_report_gives_where_another_run_lands_for_rows_of_more_than_one_seed():
    from aimet_quadapter.reporting.report import prediction_table
    from aimet_quadapter.running.statistics import merge_seeds

    cells = {
        f"g/ptq#seed{s}": _cell("ptq", "g", s, {"a": v}, label="PTQ") for s, v in ((0, 10.0), (1, 11.0), (2, 12.0))
    }
    cells["g/fp"] = {"method": "fp", "label": "FP32", "group": "g", "seed": None, "ppl": {"a": 9.0}}
    low, high = merge_seeds(cells)["g/ptq"]["predict"]["ppl"]["a"]
    assert low < 10.0 and high > 12.0 and low + high == pytest.approx(22.0)
    table = prediction_table({"cells": cells, "datasets": [{"label": "a"}], "seeds": [0, 1, 2]})
    assert table is not None and f"11.00 ({low:.2f}–{high:.2f})" in table
    assert "| 9.00 |" in table  # one run: no range
    single = {k: c for k, c in cells.items() if not k.endswith(("1", "2"))}
    assert prediction_table({"cells": single, "datasets": [{"label": "a"}], "seeds": [0]}) is None


@pytest.mark.slow
def test_a_prefix_precedes_every_sequence_and_is_part_of_the_fingerprint(base_run, world, tmp_path, capsys):
    run = tmp_path / "prefixed"
    args = ["run", str(world / "r.yaml"), "--out", str(run), "--no-progress", "--set", "methods=[fp,ptq,cle]"]
    assert main([*args, "--set", "prefix=w5"]) == 0
    with_prefix, without = _results(run)["cells"], _results(base_run)["cells"]
    for key in ("fp", "calib:a/ptq", "calib:a/cle"):
        assert with_prefix[key]["fingerprint"] != without[key]["fingerprint"], key
    # the FP model reads the text after the prefix too: another perplexity than without it
    assert with_prefix["fp"]["ppl"]["a"] != pytest.approx(without["fp"]["ppl"]["a"], rel=1e-6)
    state = run / "calib-a" / "cle" / "cle.safetensors"
    assert QuadapterState.load(state).metadata["prefix"] == [5]
    capsys.readouterr()
    export = ["export", str(state), "--model", str(world / "model"), "--out", str(tmp_path / "e"), "--seq-len", "32"]
    export += ["--verify-dataset", str(world / "a"), "--verify-windows", "1", "--no-progress", "--kv-graphs"]
    # the verification windows follow the prefix: 1 + 32 tokens do not leave the KV context of 33 a token to spare
    assert main([*export, "--kv-context", "33", "--kv-prefill", "8"]) == 2
    assert "windows after the state's 1 prefix tokens must fit --kv-context 33" in capsys.readouterr().err
    assert main([*export, "--kv-context", "48", "--kv-prefill", "8"]) == 0
    assert "the prefix's 1 tokens" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert manifest["prefix"]["ids"] == manifest["kv"]["prefix"]["ids"] == [5]
    assert main([*args, "--set", "prefix=''"]) == 2  # an empty prefix: named before the model loads
    assert "field prefix" in capsys.readouterr().err


def test_a_finished_run_and_its_data_are_freed(world, tmp_path):
    """What one run (one seed's child run) computed is kept on that run: once it is gone, so are its tensors."""
    import gc
    import weakref

    from aimet_quadapter.running.recipes import load_recipe
    from aimet_quadapter.running.runner import RecipeRun

    run = RecipeRun(load_recipe(world / "r.yaml"), tmp_path / "out", progress=False)
    windows = run.data.eval_windows()
    assert run.data.eval_windows() is windows  # computed once per run
    gone = weakref.ref(run)
    del run, windows
    gc.collect()
    assert gone() is None


def _cell(method: str, group: str, seed: int | None, ppl: dict, **extra) -> dict:
    machine = {"threads": 2, "kernels": "AVX2", "device": "cpu"}  # what every record holds
    return {"method": method, "label": method.upper(), "group": group, "seed": seed, "ppl": ppl, **machine, **extra}


def _folder(path: Path, cells: dict) -> Path:
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps({"format": 1, "model": "m", "cells": cells}))
    return path


def test_merge_reads_the_destination_under_its_lock(tmp_path, monkeypatch):
    """A run that finishes a cell in the destination just before merge takes the lock keeps that cell."""
    from aimet_quadapter.running import merge
    from aimet_quadapter.running.lock import RunLock

    dest = _folder(tmp_path / "a", {"g/ptq#seed0": _cell("ptq", "g", 0, {"t": 10.0})})
    src = _folder(tmp_path / "b", {"g/ptq#seed1": _cell("ptq", "g", 1, {"t": 11.0})})
    acquire = RunLock.acquire

    def a_run_finishes_first(lock: RunLock) -> None:
        if lock.folder == dest:
            results = _results(dest)
            results["cells"]["g/ptq#seed2"] = _cell("ptq", "g", 2, {"t": 12.0})
            (dest / "results.json").write_text(json.dumps(results))
        acquire(lock)

    monkeypatch.setattr(RunLock, "acquire", a_run_finishes_first)
    merged, added = merge.merge_runs(dest, [src])
    assert added == ["g/ptq#seed1"]
    assert sorted(_results(dest)["cells"]) == ["g/ptq#seed0", "g/ptq#seed1", "g/ptq#seed2"]


def test_a_seed_of_inf_or_nan_perplexity_is_named_and_neither_averaged_nor_counted():
    from aimet_quadapter.reporting.report import results_table
    from aimet_quadapter.running.statistics import merge_seeds, summary

    values = {0: 10.0, 1: 12.0, 2: float("inf"), 3: 11.0}
    cells = {f"g/ptq#seed{s}": _cell("ptq", "g", s, {"t": v}) for s, v in values.items()}
    cells["g/ptq#seed3"]["dev_ppl"] = {"t": float("nan")}  # finite on the test text, not on the development one
    row = merge_seeds(cells)["g/ptq"]
    assert row["seeds"] == [0, 1] and row["nonfinite_seeds"] == [2, 3]
    assert row["ppl"]["t"] == 11.0 and row["spread"]["ppl"]["t"] == [10.0, 12.0]
    assert summary({"cells": cells})["g/ptq"]["seeds"] == [0, 1]
    table = results_table({"cells": cells, "datasets": [{"label": "t"}], "seeds": list(values)})
    assert "PTQ (seed 2, 3: perplexity inf or NaN, not in the mean)" in table and "11.00 (10.00–12.00)" in table
    # no finite seed at all: the row says inf, and has no statistics
    only = {k: c for k, c in cells.items() if k.endswith("2")}
    assert merge_seeds(only)["g/ptq"]["ppl"]["t"] == float("inf") and merge_seeds(only)["g/ptq"]["seeds"] == []
    assert summary({"cells": only})["g/ptq"]["ppl"] == {}


def test_rows_of_other_fine_tuning_sizes_are_neither_compared_nor_checked_against_each_other(tmp_path, capsys):
    """A sweep's 2-sequence Quadapter is compared with no 40-sequence QAT, and ``ranges`` holds a cell to the
    range of its own size; a reference row of one seed is skipped, not a crash."""
    cells = {
        f"g/{m}{f'@{n}' if n else ''}#seed{s}": _cell(m, "g", s, {"t": v + s}, size=n)
        for m, n, v in (("quadapter", 2, 50.0), ("quadapter", None, 20.0), ("qat", None, 30.0))
        for s in (0, 1)
    }
    lines = matched_comparisons({"cells": cells, "fids": {}})
    assert len(lines) == 1 and "QUADAPTER 20.50 vs QAT 30.50" in lines[0]
    cells["g/ptq#seed0"] = _cell("ptq", "g", 0, {"t": 40.0})  # one seed: no range to check against
    reference = _folder(tmp_path / "ref", cells)
    other = _folder(
        tmp_path / "other",
        {
            "g/quadapter@2#seed5": _cell("quadapter", "g", 5, {"t": 50.5}, size=2, threads=1),
            "g/ptq#seed5": _cell("ptq", "g", 5, {"t": 40.0}, threads=1),
        },
    )
    capsys.readouterr()
    assert main(["ranges", str(reference), str(other)]) == 0
    out = capsys.readouterr().out
    assert "| 50.500 |" in out and "| 50.000-51.000 | yes |" in out and "in the min-max of the seeds: 1 of 1" in out
    assert "no row of two seeds or more in the reference: 1" in out
    assert main(["ranges", str(reference), str(other), str(tmp_path / "none")]) == 2
    assert capsys.readouterr().out == ""  # refused before any row


def test_seeds_run_under_other_settings_into_one_folder_are_rows_of_their_own(world, tmp_path, capsys):
    """The issue's case: seed 0, then seed 1 with fewer calibration samples, into one folder: two PTQ rows, each
    its own seed's, not one row "seeds 0, 1"; a rerun of seed 1 under the first settings joins seed 0's row."""
    run = tmp_path / "run"
    argv = ["run", str(world / "r.yaml"), "--out", str(run), "--no-progress", "--set", "methods=[fp,ptq]"]
    assert main([*argv, "--set", "seeds=[0]"]) == 0
    assert main([*argv, "--set", "seeds=[1]", "--set", "calibration.samples=1"]) == 0
    cells = _results(run)["cells"]
    first, other = (cells[f"calib:a/ptq#seed{s}"] for s in (0, 1))
    assert first["row_fingerprint"] != other["row_fingerprint"]
    rows = [r for r in ordered_rows(_results(run)) if r["method"] == "ptq"]
    assert [(r["seeds"], r["ppl"]["a"]) for r in rows] == [([0], first["ppl"]["a"]), ([1], other["ppl"]["a"])]
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    assert f"PTQ (settings {first['row_fingerprint'][:8]})" in capsys.readouterr().out
    # seed 1 again under the first settings: the same row as seed 0 (its fingerprint aside from the seed)
    assert main([*argv, "--set", "seeds=[1]"]) == 0
    again = _results(run)["cells"]["calib:a/ptq#seed1"]
    assert again["row_fingerprint"] == first["row_fingerprint"] and again["fingerprint"] != first["fingerprint"]
    (row,) = [r for r in ordered_rows(_results(run)) if r["method"] == "ptq"]
    assert row["seeds"] == [0, 1] and "settings" not in row


def test_a_row_is_the_mean_of_the_seeds_of_one_set_of_settings():
    from aimet_quadapter.running.statistics import merge_seeds

    cells = {
        f"g/qat#seed{s}": _cell("qat", "g", s, {"t": v}, row_fingerprint=fp)
        for s, v, fp in ((0, 10.0, "aaaaaaaaaaaa"), (1, 12.0, "aaaaaaaaaaaa"), (2, 30.0, "bbbbbbbbbbbb"))
    }
    rows = merge_seeds(cells)
    assert set(rows) == {"g/qat (settings aaaaaaaa)", "g/qat (settings bbbbbbbb)"}
    assert rows["g/qat (settings aaaaaaaa)"]["ppl"]["t"] == 11.0 and rows["g/qat (settings bbbbbbbb)"]["seeds"] == [2]
    # a method matched with both is compared with each, on the seeds each ran
    cells |= {f"g/quadapter#seed{s}": _cell("quadapter", "g", s, {"t": 9.0 + s}) for s in (0, 1, 2)}
    lines = matched_comparisons({"cells": cells})
    assert [line.split(": ")[1].split(" (")[0] for line in lines] == ["QUADAPTER 9.50 vs QAT", "QUADAPTER 11.00 vs QAT"]
    assert "vs QAT (settings aaaaaaaa) 11.00 (-13.6 %) (on seeds 0, 1, which both ran)" in lines[0]
    assert "vs QAT (settings bbbbbbbb) 30.00 (-63.3 %) (on seed 2, which both ran)" in lines[1]


def test_a_row_fingerprint_leaves_out_the_seeds_and_nothing_else(tmp_path):
    recipe_file = tmp_path / "m.yaml"
    recipe_file.write_text(
        "model: gpt2\nmethods: [fp, ptq, quadapter]\nfid: [ptb]\neval: {datasets: [ptb]}\nseeds: [0, 1]\n"
    )

    def planned(*overrides: str, seed: int = 0) -> tuple[RecipeRun, list]:
        recipe = load_recipe(recipe_file, list(overrides))
        run = RecipeRun(recipe.for_seed(seed), tmp_path / "out", progress=False, seed=seed, parent=recipe)
        return run, run.cells

    base, cells = planned()
    other, other_cells = planned(seed=1)
    assert [base.prints.row_fingerprint(c) for c in cells] == [other.prints.row_fingerprint(c) for c in other_cells]
    assert [base.fingerprint(c) == other.fingerprint(c) for c in cells] == [True, False, False]  # FP32 has no seed
    samples, _ = planned("calibration.samples=3")
    assert [base.prints.row_fingerprint(c) == samples.prints.row_fingerprint(c) for c in cells] == [True, False, False]


def test_seeds_merged_from_a_folder_that_ran_them_under_other_settings_stay_a_row_of_their_own(tmp_path):
    """merge compares the recipe each folder recorded last; a seed that folder ran before under other settings
    joins the destination, but not the destination's row."""
    from aimet_quadapter.running.merge import merge_runs

    dest = _folder(tmp_path / "a", {"g/ptq#seed0": _cell("ptq", "g", 0, {"t": 10.0}, row_fingerprint="a" * 16)})
    src = _folder(tmp_path / "b", {"g/ptq#seed1": _cell("ptq", "g", 1, {"t": 20.0}, row_fingerprint="b" * 16)})
    merged, added = merge_runs(dest, [src])
    assert added == ["g/ptq#seed1"]
    assert {k: v["seeds"] for k, v in merged["summary"].items()} == {
        "g/ptq (settings aaaaaaaa)": [0],
        "g/ptq (settings bbbbbbbb)": [1],
    }


def test_a_cell_computed_again_writes_its_own_state_stamped_with_its_fingerprint(world, tmp_path, capsys):
    """The issue's case: PTQ run again under other settings. PTQ saves no state itself (run_method does): the state
    after the second run is that run's, carries the row's fingerprint, and no file of the first run stays beside
    it; the first run's state put back is refused by `eval --state`, in one line."""
    run = tmp_path / "run"
    argv = ["run", str(world / "r.yaml"), "--out", str(run), "--no-progress", "--set", "methods=[ptq]"]
    assert main(argv) == 0
    state_file = run / "calib-a" / "ptq" / "ptq.safetensors"
    first = state_file.read_bytes()
    stray = state_file.with_name("quadapter_bc.safetensors")  # a state this cell never writes
    shutil.copyfile(state_file, stray)
    assert main([*argv, "--set", "calibration.samples=1"]) == 0
    cell = _results(run)["cells"]["calib:a/ptq"]
    assert QuadapterState.load(state_file).metadata["fingerprint"] == cell["fingerprint"]
    assert state_file.read_bytes() != first and not stray.exists()
    state_file.write_bytes(first)
    capsys.readouterr()
    args = ["eval", "--model", str(world / "model"), "--state", str(state_file), "--dataset", str(world / "b.txt")]
    assert main([*args, "--seq-len", "64", "--max-tokens", "128", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert "ptq.safetensors is not the state of row calib:a/ptq" in err[-1] and "other settings" in err[-1]


def test_a_composition_continues_only_a_state_stamped_with_its_rows_fingerprint(world, tmp_path):
    """`continues` starts from Quadapter's saved state only where the state is the one its row was computed with
    (its fingerprint stamp), as phase 1's shared state is read only under its stamp."""
    recipe = load_recipe(world / "r.yaml", ["methods=[quadapter,quadapter_seq_mse]"])
    run = RecipeRun(recipe, tmp_path / "run", progress=False)
    before, after = (run.plan.finetune_cell(m, "a", None) for m in ("quadapter", "quadapter_seq_mse"))
    record = {"fingerprint": run.fingerprint(before), "ppl": {"a": 2.0, "b": 2.0}, "dev_ppl": {"a": 2.0}}
    results = {"cells": {before.key: record}}
    path = tmp_path / "run" / before.folder / "quadapter.safetensors"
    for stamp in (None, "0" * 16, record["fingerprint"]):
        QuadapterState({}, {}, metadata={} if stamp is None else {"fingerprint": stamp}).save(path)
        origin = run.executor._start_of(after, results)
        assert (origin is not None) == (stamp == record["fingerprint"]), stamp


def test_an_auto_prefix_has_the_fingerprints_of_the_text_it_names(tiny_gpt2_dir, tmp_path):
    """``prefix: auto`` is the tokenizer's own prefix (here "<eos>\\n"): cells computed under that text written out
    stay done."""
    recipe_file = tmp_path / "m.yaml"
    recipe_file.write_text(f"model: {tiny_gpt2_dir}\nmethods: [fp, ptq]\nfid: [ptb]\neval: {{datasets: [ptb]}}\n")

    def fingerprints(*overrides: str) -> dict[str, str]:
        run = RecipeRun(load_recipe(recipe_file, list(overrides)), tmp_path / "out", progress=False)
        return {c.method: run.fingerprint(c) for c in run.cells}

    auto = fingerprints("prefix=auto")
    assert auto == fingerprints('prefix="<eos>\\n"')
    assert auto["fp"] != fingerprints()["fp"] and auto["ptq"] != fingerprints()["ptq"]


def test_a_column_says_which_text_the_last_run_scored_under_its_label(tiny_gpt2_dir, corpus_dir, tmp_path):
    """A recipe that changes the text behind a column's label: results.json names the new text, not the first."""
    recipe = tmp_path / "r.yaml"
    out = tmp_path / "run"
    for start in (0, 64):
        recipe.write_text(
            f"model: {tiny_gpt2_dir}\nmethods: [fp]\neval: {{datasets: [{corpus_dir}], seq_len: 32, max_tokens: 64}}\n"
            f"dev: {{datasets: [{{name: {corpus_dir}, label: d, start: {start}}}], seq_len: 32, max_tokens: 64}}\n"
        )
        assert main(["run", str(recipe), "--out", str(out), "--no-progress"]) == 0
        columns = json.loads((out / "results.json").read_text())["dev_datasets"]
        assert [(c["label"], c["start"]) for c in columns] == [("d", start)]
