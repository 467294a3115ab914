"""Recipes: validation with one-line errors, --set overrides, base files and dataset paths (no model runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aimet_quadapter.cli import main
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.running.recipes import DATA_ENV, load_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
SHIPPED = sorted(p for p in RECIPES.glob("*.yaml") if not p.name.startswith("_"))

MINIMAL = """\
model: gpt2
methods: [fp, ptq, quadapter]
fid: [wikitext2]
eval:
  datasets: [wikitext2, ptb]
"""


def _write(folder: Path, text: str, name: str = "r.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def _error(capsys) -> str:
    """The CLI's error: exactly one line on stderr, no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("aimet-quadapter: error: ")
    return lines[0]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_recipe_validates(path):
    """Every shipped recipe validates, and every local text it names is in the repository, found from the recipe
    alone (a recipe that names a text only some machines hold fails here, not hours into a run)."""
    recipe = load_recipe(path)
    assert recipe.methods and recipe.eval.datasets
    names = [d.name for d in recipe.eval.datasets] + [d.name for d in (recipe.dev.datasets if recipe.dev else [])]
    names += [n for group in [*recipe.fid, recipe.calibration.dataset or []] for n in group]
    for name in names:
        if name == "generated":
            continue
        source = recipe.resolve_dataset(name)
        assert not Path(source).is_absolute() or Path(source).resolve().is_relative_to(RECIPES.parent), name


def test_the_paper_settings_reach_the_parameter_objects():
    recipe = load_recipe(RECIPES / "table1-gpt2-ptb.yaml")
    params = recipe.quadapter_parameters()
    assert (params.phase1.steps, params.phase1.lr, params.phase1.lr_decay, params.phase1.decay_every) == (
        500,
        0.1,
        0.2,
        100,
    )
    assert (params.phase2.steps, params.phase2.batch_size, params.phase2.seq_len) == (10_000, 4, 512)
    assert recipe.baseline_parameters().qat_lr_weights == 1e-5
    assert recipe.calibration.samples == 10 and recipe.calibration.length == 512
    assert recipe.fid == [["ptb"]] and recipe.model == "gpt2"
    assert [d.name for d in recipe.eval.datasets] == ["wikitext2", "ptb", "lambada", "cbt_cn", "cbt_ne"]
    table2 = load_recipe(RECIPES / "table2-gpt2.yaml")
    assert table2.fid == [["ptb", "lambada", "cbt_cn", "cbt_ne"]]


@pytest.mark.parametrize(
    "text, field",
    [
        ("phase2:\n  steps: -3\n", "field phase2.steps: must be >= 0"),
        ("phase2:\n  stepz: 3\n", "field phase2.stepz: unknown field"),
        ("phase1:\n  input_source: sideways\n", "field phase1.input_source:"),
        ("policy:\n  weight_bits: 1\n", "field policy.weight_bits: must be >= 2"),
        ("calibration:\n  samples: 0\n", "field calibration.samples: must be >= 1"),
        ("quadapter:\n  init: random\n", "field quadapter.init:"),
        ("finetune_sizes: [8, 0]\n", "field finetune_sizes[1]: must be >= 1"),
        ("phase2:\n  lr_alpha: .inf\n", "field phase2.lr_alpha: input should be a finite number"),
        ("phase1:\n  lr: .nan\n", "field phase1.lr: input should be a finite number"),
    ],
)
def test_malformed_recipe_is_one_line_naming_the_field(tmp_path, capsys, text, field):
    path = _write(tmp_path, MINIMAL + text)
    with pytest.raises(QuadapterError, match=r"^recipe .*r\.yaml: " + field.replace("[", r"\[").replace("]", r"\]")):
        load_recipe(path)
    assert main(["run", str(path)]) == 2
    line = _error(capsys)
    assert field in line and str(path) in line


def test_unknown_method_and_missing_fields(tmp_path, capsys):
    path = _write(tmp_path, MINIMAL.replace("[fp, ptq, quadapter]", "[fp, gptq]"))
    assert main(["run", str(path)]) == 2
    assert "field methods[1]: unknown method 'gptq'" in _error(capsys)
    path = _write(tmp_path, "methods: [fp]\neval:\n  datasets: [ptb]\ncalibration:\n  dataset: ptb\n")
    assert main(["run", str(path)]) == 2
    assert "field model: required field is missing" in _error(capsys)
    path = _write(tmp_path, MINIMAL.replace("fid: [wikitext2]\n", ""))
    assert main(["run", str(path)]) == 2
    assert "field fid:" in _error(capsys)


def test_bad_yaml_and_missing_file(tmp_path, capsys):
    path = _write(tmp_path, "model: [gpt2\n")
    assert main(["run", str(path)]) == 2
    assert "not valid YAML" in _error(capsys)
    path = _write(tmp_path, "- just\n- a list\n")
    assert main(["run", str(path)]) == 2
    assert "expected a mapping" in _error(capsys)
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in _error(capsys)


def test_set_overrides_values_lists_and_sections(tmp_path):
    path = _write(tmp_path, MINIMAL)
    recipe = load_recipe(
        path,
        [
            "phase2.steps=200",
            "methods=[ptq,quadapter]",
            "fid=[ptb, [lambada, cbt_cn]]",
            "policy.per_channel_weights=true",
            "eval.max_tokens=4096",
            "calibration.dataset=ptb",
            "quadapter.extra_sites=",  # empty: null
        ],
    )
    assert recipe.phase2.steps == 200
    assert recipe.methods == ["ptq", "quadapter"]
    assert recipe.fid == [["ptb"], ["lambada", "cbt_cn"]]
    assert recipe.quant_policy().per_channel_weights is True
    assert recipe.eval.max_tokens == 4096
    assert recipe.calibration.dataset == ["ptb"]
    assert recipe.quadapter.extra_sites is None
    assert recipe.phase1.steps == 500  # untouched sections keep the defaults (the paper's)


def test_float_settings_of_every_shape_validate(tmp_path):
    """Finite floats are checked on float fields; a tuple of floats (check points) validates as before."""
    path = _write(tmp_path, MINIMAL)
    recipe = load_recipe(path, ["phase1.check_points=[0.5]", "phase2.lr_alpha=0.2", "policy.percentile=99.9"])
    assert recipe.phase1.check_points == (0.5,) and recipe.phase2.lr_alpha == 0.2
    assert load_recipe(path, ["phase1.check_points=[]"]).phase1.check_points == ()


@pytest.mark.parametrize(
    "override, message",
    [
        ("phase2.stepz=3", "--set phase2.stepz: unknown field 'stepz' in phase2"),
        ("phases.steps=3", "--set phases.steps: unknown field 'phases' in the recipe"),
        ("phase2.steps.deeper=3", "--set phase2.steps.deeper: phase2.steps is a value"),
        ("phase2.steps", "expected KEY=VALUE"),
        ("phase2.steps=-1", "field phase2.steps: must be >= 0 (got -1) (from --set)"),
        ("methods=[ptq", "--set methods: value '[ptq' is not valid YAML"),
    ],
)
def test_bad_set_names_the_key(tmp_path, capsys, override, message):
    path = _write(tmp_path, MINIMAL)
    assert main(["run", str(path), "--set", override]) == 2
    assert message in _error(capsys)


def test_base_files_merge_and_paths_are_relative_to_their_file(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    (shared / "data" / "novels").mkdir(parents=True)
    (shared / "data" / "novels" / "a.txt").write_text("some text\n")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "models" / "m").mkdir(parents=True)
    _write(
        tmp_path / "recipes",
        "model: ./models/m\ndata_dirs: [../shared/data]\nphase2:\n  steps: 7\n  batch_size: 3\n"
        "eval:\n  datasets: [novels]\n  max_tokens: 100\n",
        "_base.yaml",
    )
    path = _write(
        tmp_path / "recipes", "base: _base.yaml\nmethods: [fp]\nfid: [ptb]\nphase2:\n  steps: 9\n", "leaf.yaml"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv(DATA_ENV, raising=False)
    recipe = load_recipe(path)
    assert recipe.phase2.steps == 9 and recipe.phase2.batch_size == 3  # merged field by field
    assert recipe.eval.max_tokens == 100
    assert recipe.resolve_model() == str(tmp_path / "recipes" / "models" / "m")
    assert recipe.resolve_dataset("novels") == str(shared / "data" / "novels")
    assert recipe.resolve_dataset("ptb") == "ptb"  # a corpus name is never a path


def test_dataset_search_env_then_recipe_folder(tmp_path, monkeypatch):
    (tmp_path / "env" / "austen").mkdir(parents=True)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "local.txt").write_text("x\n")
    path = _write(tmp_path / "r", MINIMAL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DATA_ENV, raising=False)
    recipe = load_recipe(path)
    with pytest.raises(QuadapterError, match=f"dataset 'austen' is neither a known corpus.*set {DATA_ENV}"):
        recipe.resolve_dataset("austen")
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "env"))
    assert recipe.resolve_dataset("austen") == str(tmp_path / "env" / "austen")
    assert recipe.resolve_dataset("local.txt") == str(tmp_path / "r" / "local.txt")


def test_base_cycle_is_an_error(tmp_path):
    _write(tmp_path, "base: b.yaml\n", "a.yaml")
    _write(tmp_path, "base: a.yaml\n", "b.yaml")
    with pytest.raises(QuadapterError, match="includes itself"):
        load_recipe(tmp_path / "a.yaml")
