"""Site roles: every family names what each of its sites is, so that ``phase1.keep_start`` by role picks the same
kind of site on any model, where a glob of one family's site names matches nothing on another."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.models import ARCHITECTURES, SITE_ROLES, tiny_model
from aimet_quadapter.quadapter.config import Phase1Parameters
from aimet_quadapter.quadapter.phase1 import kept_at_start
from aimet_quadapter.running.recipes import load_recipe, validate_recipe

SMOLLM2 = Path(__file__).resolve().parents[1] / "recipes" / "_smollm2.yaml"
# the list _smollm2.yaml named by SmolLM2's (Llama's) site names before roles
SMOLLM2_GLOBS = ("model.norm->lm_head", "*.post_attention_layernorm->*", "*.self_attn.v_proj->o_proj")


def _smollm2() -> dict:
    return yaml.safe_load(SMOLLM2.read_text())


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.name)
def test_every_site_of_every_family_has_the_role_its_modules_say(arch):
    """The data agree with the names: the attention's and the MLP's inputs are their norms' sites, one of each a
    block, and the head site alone is the head."""
    assert arch.head_site.role == "head"
    roles = [s.role for s in arch.block_sites]
    assert set(roles) <= set(SITE_ROLES) - {"head"} and len(roles) == len(set(roles))
    assert {"attention_inputs", "mlp_inputs"} <= set(roles)
    for spec in arch.block_sites:
        if spec.role == "attention_inputs":
            assert all(c.split(".")[0] in ("self_attn", "attn") for c in spec.consumers)
        if spec.role == "mlp_inputs":
            assert all(c.split(".")[0] == "mlp" for c in spec.consumers)
        if spec.role in ("qk", "values", "up_down"):
            assert spec.extra is not None and spec.scope is not None  # beyond the paper's norm -> linear sites


def test_the_smollm2_roles_select_the_sites_its_globs_did():
    recipe = _smollm2()
    model = tiny_model("llama")
    sites = model.sites(recipe["quadapter"]["extra_sites"])
    roles = kept_at_start(sites, recipe["phase1"]["keep_start"])
    globs = kept_at_start(sites, SMOLLM2_GLOBS)
    assert roles == globs
    layers = len(model.block_paths())
    assert len(roles) == 2 * layers + 1 and "model.norm->lm_head" in roles


def test_the_smollm2_keep_start_holds_on_gpt2_which_has_no_values_site(tiny_gpt2_dir):
    """The recipe's list resolves on GPT-2 (its head and MLP-input sites), where the globs were refused; the run
    checks it as it does once the model loads."""
    from aimet_quadapter.running.runner import RecipeRun

    model = tiny_model("gpt2")
    sites = model.sites(_smollm2()["quadapter"]["extra_sites"])
    kept = kept_at_start(sites, _smollm2()["phase1"]["keep_start"])
    assert kept == {s.name for s in sites if s.producer.endswith((".ln_2", ".ln_f"))}
    assert kept == {"transformer.ln_f->lm_head", *(f"transformer.h.{i}.ln_2->c_fc" for i in range(2))}
    with pytest.raises(QuadapterError, match="'model.norm->lm_head' matches no Quadapter site"):
        kept_at_start(sites, SMOLLM2_GLOBS)
    recipe = load_recipe(SMOLLM2.parent / "smollm2-best.yaml", [f"model={tiny_gpt2_dir}"])
    RecipeRun(recipe, Path(".unused"), progress=False).checks.check_sites(model)


def test_a_bare_word_that_is_no_role_is_refused_naming_the_field_and_the_roles():
    assert Phase1Parameters(keep_start=("head", "values", "*.ln_2->*", "model.norm->lm_head")).keep_start[0] == "head"
    with pytest.raises(QuadapterError) as error:
        Phase1Parameters(keep_start=("head", "heads"))
    message = str(error.value)
    assert "\n" not in message and message.startswith("phase1.keep_start[1] must be a site role (")
    assert all(role in message for role in SITE_ROLES) and "'heads'" in message
    raw = {"model": "gpt2", "methods": ["quadapter_bc"], "fid": ["ptb"], "eval": {"datasets": ["ptb"]}}
    with pytest.raises(QuadapterError, match=r"field phase1\.keep_start: \[0\] must be a site role \(attention"):
        validate_recipe({**raw, "phase1": {"keep_start": ["lm_head"]}})
