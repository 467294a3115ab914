"""The `htp` target: AIMET's own HTP quantsim config, one quantizer per tensor, a finite attention mask, and every
method (and the export) running under it."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch

from aimet_quadapter.cli import main
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.exporter import export_quantized
from aimet_quadapter.export.formats import ENCODINGS
from aimet_quadapter.export.onnx_eval import read_encodings
from aimet_quadapter.models import ARCHITECTURES
from aimet_quadapter.models.attention import set_mask_fill
from aimet_quadapter.quadapter.api import QuadapterParameters, apply_cle, apply_quadapter
from aimet_quadapter.quadapter.phase1 import Phase1Parameters
from aimet_quadapter.quadapter.phase2 import Phase2Parameters, lm_loss
from aimet_quadapter.quadapter.state import QuadapterState
from aimet_quadapter.quant.config import QuantPolicy
from aimet_quadapter.quant.policy import HTP_MASK_FILL, build_sim, calibrate, describe, drop_requantization
from aimet_quadapter.quant.quantizers import shared_activation_groups
from aimet_quadapter.testing import sample_corpus, toy_model

SEQ = 32
HTP = QuantPolicy(target="htp")
# every family, as the checkpoints users bring (SmolLM2 is Llama-shaped)
FAMILIES = [a.name for a in ARCHITECTURES]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def toy(request):
    model = toy_model(request.param)
    corpus = sample_corpus(model, 10, SEQ, seed=1)
    return request.param, model, [corpus[:2], corpus[2:4]], [corpus[4:6]], corpus[8:]


def _loss(model, batch) -> float:
    with torch.no_grad():
        return float(lm_loss(model, batch))


def test_htp_places_quantizers_as_the_config_says_with_one_per_tensor(toy):
    _, model, _, _, _ = toy
    sim = build_sim(model, HTP)
    rows = {r["tensor"]: r for r in describe(sim.model)}
    linears = [name[: -len(".weight")] for name, r in rows.items() if name.endswith("proj.weight") or "c_" in name]
    linears = [n for n in linears if n + ".weight" in rows and rows[n + ".weight"]["granularity"] != "per-tensor"]
    assert linears  # the config's Gemm entry: symmetric per-channel weights for every Linear
    for name in linears:
        assert rows[name + ".weight"]["symmetric"] and f"{name}.output[0]" in rows
    # outputs of norms and softmax are quantized, as every op output is on the device
    assert any(n.endswith("layernorm.output[0]") or n.endswith("ln_1.output[0]") for n in rows)
    assert any(n.endswith("softmax.output[0]") for n in rows)
    # no tensor is quantized twice: the readers of a quantized output keep no input quantizer of their own; the one
    # tensor with two readers' quantizers is the residual stream's start, and they share one range
    assert drop_requantization(sim.model) == []
    (group,) = shared_activation_groups(sim.model)
    first, second = (sim.model.get_submodule(k.rsplit(".", 1)[0]).input_quantizers[0] for k in group)
    assert first.min is second.min and first.max is second.max


@pytest.mark.parametrize("family", FAMILIES)
def test_htp_quantizes_the_residual_stream_where_it_starts_and_at_every_sum(family):
    model = toy_model(family)
    sim = build_sim(model, HTP)
    rows = {r["tensor"] for r in describe(sim.model) if r["kind"] == "activation"}
    blocks = model.block_paths()
    spec = model.arch.residual
    assert spec is not None, f"{family} declares no residual branches"
    for block in blocks:
        for i in (0, 1):
            assert f"{block}.residual_adds.{i}.output[0]" in rows, f"{block}: residual sum {i} has no quantizer"
    assert {f"{blocks[0]}.{spec.attention[0]}.input[0]", f"{blocks[0]}.residual_adds.0.input[0]"} <= rows
    # the quantizers act: what every block after the first reads, a residual sum's output, is on an 8-bit grid under
    # htp; the paper's placement quantizes no addition (its Section 4), and there the same tensors are not
    paper = build_sim(model)
    assert not any("residual_adds" in r["tensor"] for r in describe(paper.model))
    for placed, on_grid in ((sim, True), (paper, False)):
        calibrate(placed, [sample_corpus(model, 2, SEQ, seed=1)])
        seen: list[torch.Tensor] = []
        hooks = [
            placed.model.get_submodule(b).register_forward_pre_hook(lambda _, a, seen=seen: seen.append(a[0]))
            for b in blocks
        ]
        with torch.no_grad():
            placed.model(sample_corpus(model, 1, SEQ, seed=2))
        for hook in hooks:
            hook.remove()
        assert [x.unique().numel() <= 256 for x in seen[1:]] == [on_grid] * (len(blocks) - 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_htp_quantizes_the_rotation_its_tables_and_silus_sigmoid_as_the_graph_computes_them(family):
    """Under htp the sim holds the ops the exported graph holds: q and k rotated by modules (each product and sum
    quantized), the rotary tables quantized, SiLU as sigmoid then product; the FP function of the copy they are
    installed in is the model's (to the bit without SiLU, whose split moves it by an ulp as the graph does)."""
    from aimet_torch.v2.utils import remove_all_quantizers

    model = toy_model(family)
    sim = build_sim(model, HTP)
    rows = {r["tensor"] for r in describe(sim.model) if r["kind"] == "activation"}
    rotary = family != "gpt2"
    silu = family in ("llama", "mistral", "qwen2", "qwen3", "phi3")
    for block in model.block_paths():
        for i in (0, 1):
            expected = {f"{block}.self_attn.rotary.{i}.{op}.output[0]" for op in ("mul_cos", "mul_sin", "add")}
            assert (expected <= rows) == rotary, (block, i)
        sigmoid = {f"{block}.mlp.{act}.sigmoid.output[0]" for act in ("act_fn", "activation_fn")}  # Phi-3's name
        assert bool(sigmoid & rows) == silu, block
    tables = {r for r in rows if ".rotary_emb." in r}
    assert bool(tables) == rotary and not any(".input[" in r for r in tables)  # the angles: folded constants
    # the paper's placement: the model as transformers writes it
    assert not any(s in str(describe(build_sim(model).model)) for s in (".rotary.", ".sigmoid.", ".rotary_emb."))
    ids = sample_corpus(model, 1, SEQ, seed=2)
    # transformers' rotary function is replaced only while a htp attention module runs
    modelling = sys.modules[type(model.lm).__module__]
    own, seen = getattr(modelling, "apply_rotary_pos_emb", None), []
    for m in sim.model.modules():
        if type(m).__name__ == "Rotation":
            m.register_forward_hook(lambda *_: seen.append(modelling.apply_rotary_pos_emb is not own))
    with torch.no_grad(), remove_all_quantizers(sim.model):
        copy, reference = sim.model(ids), model(ids)
    assert getattr(modelling, "apply_rotary_pos_emb", None) is own
    assert seen and all(seen) if rotary else not seen
    if silu:
        assert torch.allclose(copy, reference, rtol=0, atol=1e-4)
    else:
        assert torch.equal(copy, reference)


def test_the_finite_mask_keeps_the_fp_function(toy):
    _, model, _, _, held_out = toy
    with torch.no_grad():
        reference = model(held_out)
        set_mask_fill(model, HTP_MASK_FILL)
        try:
            filled = model(held_out)
        finally:
            set_mask_fill(model, None)
    assert torch.allclose(filled, reference, atol=1e-4, rtol=1e-4)


def test_the_softmax_input_range_stays_finite(toy):
    """With the dtype's minimum as the mask, the softmax input's range reaches -3.4e38 and attention is lost."""
    _, model, calib, _, _ = toy
    sim = build_sim(model, HTP)
    calibrate(sim, calib)
    lows = [r["min"] for r in describe(sim.model) if r["tensor"].endswith("softmax.input[0]")]
    assert lows and all(HTP_MASK_FILL - 1 <= low < 0 for low in lows)


@pytest.mark.slow
def test_every_method_runs_under_htp_and_quadapter_recovers_the_planted_outliers(toy, tmp_path):
    family, model, calib, train, held_out = toy
    fp = _loss(model, held_out)
    ptq = build_sim(model, HTP)
    calibrate(ptq, calib)
    ptq_loss = _loss(ptq.model, held_out)
    assert ptq_loss - fp > 0.5  # the planted outliers hurt under this target too
    cle = build_sim(model, HTP)
    apply_cle(cle, model, calib)
    calibrate(cle, calib)
    sim = build_sim(model, HTP)
    params = QuadapterParameters(phase1=Phase1Parameters(steps=8), phase2=Phase2Parameters(steps=2))
    result = apply_quadapter(sim, model, calib, train, params, progress=False)
    for tuned in (cle.model, sim.model):
        assert _loss(tuned, held_out) - fp < 0.5 * (ptq_loss - fp)
    # the trained state rebuilds under the same target, exports as it is and passes the verification
    path = result.state.save(tmp_path / "htp.safetensors")
    rebuilt = QuadapterState.load(path).build_sim(model)
    assert rebuilt.quadapter_policy.target == "htp"
    assert _loss(rebuilt.model, held_out) == pytest.approx(_loss(sim.model, held_out), rel=1e-6)
    out = tmp_path / "e"
    export = export_quantized(rebuilt, out, SEQ, verify_windows=list(held_out))
    entries = read_encodings(json.loads((out / ENCODINGS).read_text()))
    assert export.verification.quantizers == len(describe(rebuilt.model)) <= len(entries)


def test_paper_only_fields_are_refused_under_htp(tiny_gpt2_dir, capsys):
    with pytest.raises(QuadapterError, match="per_channel_weights applies to target 'paper' only"):
        QuantPolicy(target="htp", per_channel_weights=True)
    argv = ["describe", "--model", str(tiny_gpt2_dir), "--policy-target", "htp", "--no-policy-quantize-norm-weights"]
    assert main(argv) == 2
    assert "quantize_norm_weights" in capsys.readouterr().err
    assert main(["describe", "--model", str(tiny_gpt2_dir), "--policy-target", "htp"]) == 0
    out = capsys.readouterr().out
    assert "ln_1.output[0]" in out and "per-channel" in out


@pytest.mark.slow  # every method end to end: PTQ, CLE and Quadapter under htp, exported, stay quick (above)
def test_every_registered_method_runs_under_htp(tmp_path):
    """AIMET's own techniques too: AdaRound rounds into the target's per-channel symmetric weight grids."""
    from aimet_quadapter.methods.registry import REGISTRY, MethodContext, run_method
    from aimet_quadapter.quant.baselines import linear_weight_quantizers
    from aimet_quadapter.quant.config import BaselineParameters

    model = toy_model("gpt2")
    corpus = sample_corpus(model, 6, SEQ, seed=1)
    held_out = corpus[4:]
    params = QuadapterParameters(phase1=Phase1Parameters(steps=2), phase2=Phase2Parameters(steps=2, batch_size=2))
    baselines = BaselineParameters(adaround_iterations=4, seq_mse_candidates=3)
    from aimet_quadapter.methods.catalog import CATALOG
    from aimet_quadapter.quant.llm_techniques import refusal

    for name in REGISTRY:
        technique = CATALOG[name].aimet
        if technique and refusal(technique, model.arch.name, HTP):  # AIMET refuses GPT-2 (test_aimet_techniques)
            continue
        ctx = MethodContext(
            model, HTP, [corpus[:1], corpus[1:2]], [corpus[2:4]], params, progress=False, baselines=baselines
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sim = run_method(name, ctx)
        with torch.no_grad():
            logits = (sim.model if sim is not None and hasattr(sim, "model") else model)(held_out)
        assert torch.isfinite(logits).all(), name
        if name == "adaround":
            for path, (_, q) in linear_weight_quantizers(sim.model).items():
                assert q.symmetric and q.shape[0] > 1 and not q.is_overwrite_allowed(), path
            # AIMET traces the FP model again and reads its losses with float() of a tensor with grad: silenced
            shown = [w for w in caught if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))]
            assert not shown, [f"{w.category.__name__}: {str(w.message)[:100]}" for w in shown]
