"""Settings declared once: bounds and finiteness checked where a parameter class is built (in Python or as a
recipe section), what enters a fingerprint, and the recipe sections that are the classes themselves."""

from __future__ import annotations

import math

import pytest

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.quadapter.config import Phase1Parameters, Phase2Parameters, RunOptions
from aimet_quadapter.running.recipes import parameter_sections
from aimet_quadapter.settings import extra_of, result_view


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_float_setting_is_finite_unless_it_says_otherwise(value):
    with pytest.raises(QuadapterError, match=r"^phase2\.lr_alpha must be a finite number"):
        Phase2Parameters(lr_alpha=value)
    with pytest.raises(QuadapterError, match=r"^phase1\.lr must be a finite number"):
        Phase1Parameters(lr=value)


def test_the_fingerprint_view_leaves_out_what_does_not_change_a_result():
    defaults = Phase2Parameters().model_dump()
    view = result_view(Phase2Parameters, defaults)
    # settings added later only at the value that computes what runs before them computed
    assert not {"loss", "lr_ranges_relative"} & view.keys()
    assert {"steps", "lr_alpha", "lr_ranges", "learn_ranges", "batch_size", "seq_len"} <= view.keys()
    changed = result_view(Phase2Parameters, {**defaults, "loss": "kd", "lr_ranges_relative": True})
    assert changed["loss"] == "kd" and changed["lr_ranges_relative"] is True


def test_every_setting_declares_its_part_in_a_result():
    for section, source in parameter_sections():
        for name, f in source.model_fields.items():
            assert "result" in extra_of(f), f"{section}.{name} is not declared with settings.setting()"


def test_how_phase1_and_phase2_run_is_apart_from_what_they_compute():
    """The options (memory, kernels, checkpoints) change no result, and no parameter class holds one of them."""
    assert all(extra_of(f)["result"] is False for f in RunOptions.model_fields.values())
    computed = {*Phase1Parameters.model_fields, *Phase2Parameters.model_fields}
    assert not computed & RunOptions.model_fields.keys()
    assert all(extra_of(f)["result"] is not False for f in Phase2Parameters.model_fields.values())


def test_each_aimet_technique_has_its_own_parameters_and_a_method_reads_them_by_class():
    """The section `baselines` is the techniques' classes together, each field in one of them; a catalog entry that
    names a class reads exactly that class's fields, and a method of another technique none of them."""
    from aimet_quadapter.methods.catalog import CATALOG
    from aimet_quadapter.quant import config

    techniques = [config.AdaroundParameters, config.SeqMseParameters, config.QatParameters]
    techniques += [config.SpinQuantParameters, config.AdaScaleParameters, config.OmniQuantParameters]
    techniques += [config.FPTQuantParameters]
    owned = [name for t in techniques for name in t.model_fields]
    assert sorted(owned) == sorted(config.BaselineParameters.model_fields)
    assert all(issubclass(config.BaselineParameters, t) and t.section == "baselines" for t in techniques)
    assert CATALOG["adaround"].read_fields() == {"baselines": frozenset(config.AdaroundParameters.model_fields)}
    assert not CATALOG["adaround"].reads_setting("baselines", "seq_mse_candidates")
    assert CATALOG["spinquant_quadapter"].reads_setting("baselines", "spinquant_r2")


def test_a_recipe_section_is_the_parameter_class_itself():
    """One schema: the recipe's sections are the classes the package computes with, so a recipe and a Python
    caller are checked by the same fields, and a recipe hands its objects over as they are."""
    from aimet_quadapter.running.recipes import Recipe, validate_recipe

    recipe = validate_recipe({"model": "gpt2", "methods": ["ptq"], "fid": ["ptb"], "eval": {"datasets": ["ptb"]},
                              "phase1": {"steps": 7}, "policy": {"weight_bits": 4}}, "r")  # fmt: skip
    for section, source in parameter_sections():
        field = Recipe.model_fields[section].annotation
        assert isinstance(field, type) and issubclass(field, source), section
    assert recipe.quadapter_parameters().phase1 is recipe.phase1 and recipe.quant_policy() is recipe.policy
    with pytest.raises(QuadapterError, match=r"field phase1\.steps"):
        validate_recipe(
            {"model": "gpt2", "methods": ["ptq"], "eval": {"datasets": ["ptb"]}, "phase1": {"steps": -1}}, "r"
        )
