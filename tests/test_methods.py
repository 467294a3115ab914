"""The paper's baseline rows as methods (issue: the paper's experiments as recipes), on a tiny toy GPT-2."""

from __future__ import annotations

import copy

import pytest
import torch

from aimet_quadapter.methods.catalog import CATALOG
from aimet_quadapter.methods.registry import REGISTRY, MethodContext, run_method
from aimet_quadapter.models import quiet_libraries
from aimet_quadapter.quadapter.api import QuadapterParameters
from aimet_quadapter.quadapter.phase1 import Phase1Parameters
from aimet_quadapter.quadapter.phase2 import Phase2Parameters
from aimet_quadapter.quant.aimet_private import seq_mse_bitwidth_limit, seq_mse_weight_bitwidth_limit
from aimet_quadapter.quant.baselines import linear_weight_quantizers
from aimet_quadapter.quant.config import BaselineParameters, SeqMseParameters
from aimet_quadapter.quant.llm_techniques import refusal
from aimet_quadapter.quant.policy import QuantPolicy
from aimet_quadapter.quant.quantizers import quantizers
from aimet_quadapter.running.cell_files import CellFiles
from aimet_quadapter.testing import sample_corpus, toy_model

quiet_libraries()


@pytest.fixture(scope="module")
def toy():
    model = toy_model("gpt2")
    corpus = sample_corpus(model, 8, 32, seed=1)
    return model, [corpus[:1], corpus[1:2]], [corpus[4:6], corpus[6:8]]


def _ctx(toy, **kw) -> MethodContext:
    model, calib, train = toy
    params = QuadapterParameters(phase1=Phase1Parameters(steps=4), phase2=Phase2Parameters(steps=3, batch_size=2))
    baselines = kw.pop("baselines", BaselineParameters(adaround_iterations=4, seq_mse_candidates=5))
    return MethodContext(model, QuantPolicy(), calib, train, params, progress=False, baselines=baselines, **kw)


def _fp_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_registry_has_the_papers_rows():
    for name in ("fp", "ptq", "adaround", "cle", "quadapter_bc", "qat", "quadapter_bc_qat", "quadapter"):
        assert name in REGISTRY
    assert CATALOG["quadapter_bc_qat"].label == "Quadapter BC+QAT"
    finetunes = {m for m, info in CATALOG.items() if info.finetunes}
    assert {"qat", "qat_fixed_ranges", "quadapter", "quadapter_fixed_ranges", "fp_finetuned"} <= finetunes
    assert not {"fp", "ptq", "adaround", "seq_mse", "cle", "quadapter_bc"} & finetunes
    assert all(CATALOG[m].from_bc for m in ("quadapter", "quadapter_bc_qat", "quadapter_fixed_ranges"))
    assert REGISTRY.keys() == CATALOG.keys(), "every catalog entry has its function, and no function lacks one"


def test_every_method_leaves_the_fp_weights_and_starts_on_their_storage(toy):
    """The sims share the FP model's storage until they change a weight, which they do with new data: one copy
    of the weights serves the FP model and every sim, and no method writes into the FP model's."""
    from aimet_quadapter.models import shares_storage

    model = toy[0]
    before = _fp_weights(model)
    baselines = BaselineParameters(adaround_iterations=2, seq_mse_candidates=3, qat_lr_weights=1e-3)
    # held-out text: phase 1 scores its start, then trains from the FP weights again (their storage, shared)
    ctx = _ctx(toy, baselines=baselines, validation=[toy[2][0]])
    for name in REGISTRY:
        technique = CATALOG[name].aimet
        if technique and refusal(technique, model.arch.name, ctx.policy):  # tests/test_aimet_techniques.py
            continue
        out = run_method(name, ctx)
        assert _unchanged(model, before), f"{name} wrote into the FP model's weights"
        if name == "ptq":  # nothing changed: every weight is the FP model's own storage
            assert all(shares_storage(p) for n, p in out.model.named_parameters() if n in before)
        if name in ("cle", "quadapter"):  # the folded sites' weights are new; the embedding is the FP model's
            weights = dict(out.model.named_parameters())
            assert shares_storage(weights["lm.transformer.wte.weight"])
            assert not shares_storage(weights[f"{model.sites()[0].producer}.weight"])


def test_adaround_batches_limits_the_batches_aimet_reruns_the_model_on(toy):
    """``adaround_batches`` reaches AIMET: with one of the two calibration batches, fewer forwards of the model."""
    model = toy[0]
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    counts = {}
    try:
        for batches in (1, None):
            calls.clear()
            params = BaselineParameters(adaround_iterations=2, adaround_batches=batches)
            ctx = _ctx(toy, baselines=params)
            run_method("adaround", ctx)
            counts[batches] = (len(calls), ctx.info["adaround"]["adaround_batches"])
    finally:
        handle.remove()
    assert counts[1][1] == 1 and counts[None][1] == 2
    assert counts[1][0] < counts[None][0]


def test_adaround_freezes_its_encodings_and_rounds_differently(toy, tmp_path):
    model = toy[0]
    before = _fp_weights(model)
    ctx = _ctx(toy, out_dir=tmp_path)
    sim = run_method("adaround", ctx)
    assert _unchanged(model, before), "AdaRound must not touch the FP model"
    assert (tmp_path / "adaround.encodings").is_file()
    info = ctx.info["adaround"]
    linears = linear_weight_quantizers(sim.model)
    assert info["adaround_frozen_encodings"] == len(linears) == 9  # 2 blocks x 4 Linear + lm_head
    for path, (_, q) in linears.items():
        assert not q.is_overwrite_allowed(), f"{path}: AdaRound's encoding should be frozen"
    assert 0 < info["adaround_flipped_fraction"] < 0.5
    # activations were calibrated after loading the frozen weight encodings
    assert all(q.is_initialized() for _, _, q in quantizers(sim.model))
    with torch.no_grad():
        assert torch.isfinite(sim.model(toy[1][0])).all()


def test_seq_mse_runs_at_8_bits_only_with_the_limit_lifted(toy):
    lifted = _ctx(toy)
    sim = run_method("seq_mse", lifted)
    assert seq_mse_weight_bitwidth_limit() == 4, "the patched constant must be restored"
    frozen = [not q.is_overwrite_allowed() for _, q in linear_weight_quantizers(sim.model).values()]
    assert all(frozen), "SeqMSE should have searched and frozen every Linear weight range at 8 bits"
    info = lifted.info["seq_mse"]
    assert info["seq_mse_layers"] == 9
    # AIMET searches a range per output channel; with per-channel weights some channel gains from clipping
    per_channel = _ctx(toy)
    per_channel.policy = QuantPolicy(per_channel_weights=True)
    run_method("seq_mse", per_channel)
    assert per_channel.info["seq_mse"]["seq_mse_layers_changed"] >= 1
    assert 0 < info["seq_mse_mean_range_ratio"] <= 1.0 + 1e-6

    plain = _ctx(toy, baselines=BaselineParameters(seq_mse_candidates=5, seq_mse_any_bits=False))
    sim = run_method("seq_mse", plain)
    assert not any(not q.is_overwrite_allowed() for _, q in linear_weight_quantizers(sim.model).values())
    assert plain.info["seq_mse"]["seq_mse_layers_changed"] == 0  # AIMET skipped every 8-bit layer


def test_seq_mse_within_ranges_searches_inside_the_sims_own_weight_ranges(toy):
    """A trained sim's weight ranges (here 0.6 of min-max, set by hand, as phase 2 narrows them) bound SeqMSE's
    candidates with ``within_ranges``; without it AIMET starts again from min-max, and at 8 bits ends there."""
    from aimet_quadapter.quant.baselines import apply_seq_mse
    from aimet_quadapter.quant.policy import build_sim, calibrate

    model, calib, _ = toy
    inside = {}
    for within in (True, False):
        sim = build_sim(model, share_weights=True)
        calibrate(sim, calib)
        learned = {}
        with torch.no_grad():
            for path, (_, q) in linear_weight_quantizers(sim.model).items():
                q.set_range(q.get_min() * 0.6, q.get_max() * 0.6)
                learned[path] = (q.get_min().clone(), q.get_max().clone())
        apply_seq_mse(sim, model, calib, SeqMseParameters(seq_mse_candidates=2), False, within_ranges=within)
        inside[within] = []
        for path, (_, q) in linear_weight_quantizers(sim.model).items():
            lo, hi = learned[path]
            half_step = (hi - lo) / (2**q.bitwidth - 1) / 2  # AIMET re-derives a range through its grid
            inside[within].append(bool((q.get_min() >= lo - half_step).all() and (q.get_max() <= hi + half_step).all()))
    assert all(inside[True]), inside
    assert not any(inside[False]), inside  # the check can fail: 1/0.6 of a range is outside it


def test_seq_mse_limit_context_restores_on_error():
    with pytest.raises(RuntimeError), seq_mse_bitwidth_limit(16):
        assert seq_mse_weight_bitwidth_limit() == 16
        raise RuntimeError
    assert seq_mse_weight_bitwidth_limit() == 4


@pytest.mark.parametrize("method, learns_ranges", [("qat", True), ("qat_fixed_ranges", False)])
def test_qat_trains_weights_and_optionally_ranges(toy, method, learns_ranges):
    model = toy[0]
    before = _fp_weights(model)
    ptq = run_method("ptq", _ctx(toy))
    ctx = _ctx(toy, baselines=BaselineParameters(qat_lr_weights=1e-3))
    sim = run_method(method, ctx)
    assert _unchanged(model, before)
    changed = [n for n, p in sim.model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert any(n.endswith("c_fc.weight") for n in changed), "QAT should move the weights"
    ranges = {f"{p}.{r}": (q.min.detach().clone(), q.max.detach().clone()) for p, r, q in quantizers(ptq.model)}
    moved = [k for p, r, q in quantizers(sim.model) if not torch.equal(q.min, ranges[k := f"{p}.{r}"][0])]
    assert bool(moved) == learns_ranges


def test_fp_finetuned_trains_a_copy_of_the_fp_model(toy):
    model = toy[0]
    before = _fp_weights(model)
    ctx = _ctx(toy, baselines=BaselineParameters(qat_lr_weights=1e-3))
    tuned = run_method("fp_finetuned", ctx)
    assert tuned is not model and _unchanged(model, before)
    assert not _unchanged(tuned, before)
    assert not hasattr(tuned, "param_quantizers") and not list(quantizers(tuned))


def test_methods_from_bc_continue_from_a_saved_state_exactly(toy):
    """A state-rebuilt BC sim computes what the BC sim computed, so phase 1 can be shared between cells."""
    bc_ctx = _ctx(toy)
    bc_sim = run_method("quadapter_bc", bc_ctx)
    with torch.no_grad():
        expected = bc_sim.model(toy[1][0])

    from aimet_quadapter.methods.registry import quadapter_bc_start

    ctx = _ctx(toy, bc_state=bc_ctx.bc_state)
    sim, result = quadapter_bc_start(ctx)
    assert sim is not bc_sim
    with torch.no_grad():
        assert torch.equal(sim.model(toy[1][0]), expected)
    for q in result.qset:
        assert torch.equal(q.folded, bc_ctx.bc_state.alphas[q.site.name])

    # quadapter_bc_qat and quadapter continue from it without running phase 1 again
    import aimet_quadapter.methods.registry as methods

    def no_phase1(*a, **k):
        raise AssertionError("phase 1 ran again")

    original = methods.apply_phase1
    methods.apply_phase1 = no_phase1
    try:
        for name in ("quadapter_bc_qat", "quadapter", "quadapter_fixed_ranges"):
            out = run_method(name, _ctx(toy, bc_state=bc_ctx.bc_state))
            with torch.no_grad():
                assert torch.isfinite(out.model(toy[1][0])).all(), name
    finally:
        methods.apply_phase1 = original


@pytest.mark.parametrize("name", ["quadapter", "quadapter_bc_qat"])
def test_training_from_bc_lowers_the_loss_it_trains(toy, name):
    """Phase 2 and QAT from Quadapter BC lower the LM loss on their fine-tuning data."""
    from aimet_quadapter.quadapter.phase2 import lm_loss
    from aimet_quadapter.quant.quantizers import fast_inference

    bc_ctx = _ctx(toy)
    bc_sim = run_method("quadapter_bc", bc_ctx)
    train = toy[2]

    def loss(sim) -> float:
        with torch.no_grad(), fast_inference(sim.model):
            return sum(lm_loss(sim.model, b).item() for b in train) / len(train)

    ctx = _ctx(toy, bc_state=bc_ctx.bc_state, baselines=BaselineParameters(qat_lr_weights=1e-3))
    ctx.params = ctx.params.replace(phase2=Phase2Parameters(steps=8, batch_size=2, lr_alpha=1e-2, lr_ranges=1e-3))
    assert loss(run_method(name, ctx)) < loss(bc_sim)


def test_quadapter_fixed_ranges_trains_alpha_only(toy):
    bc_ctx = _ctx(toy)
    bc_sim = run_method("quadapter_bc", bc_ctx)
    ctx = _ctx(toy, bc_state=bc_ctx.bc_state)
    ctx.params = ctx.params.replace(phase2=Phase2Parameters(steps=3, batch_size=2, lr_alpha=1e-2))
    sim = run_method("quadapter_fixed_ranges", ctx)
    before = {f"{p}.{r}": q for p, r, q in quantizers(bc_sim.model)}
    for p, r, q in quantizers(sim.model):
        ref = before[f"{p}.{r}"]
        assert torch.equal(q.min, ref.min) and torch.equal(q.max, ref.max), f"{p}.{r}: range moved"
    site = toy[0].sites()[0]
    w, w_bc = sim.model.get_submodule(site.producer).weight, bc_sim.model.get_submodule(site.producer).weight
    assert not torch.equal(w, w_bc), "phase 2 should have moved alpha (folded into the weights)"


def test_finetuning_methods_need_finetune_data(toy):
    from aimet_quadapter.errors import QuadapterError

    ctx = _ctx(toy)
    ctx.finetune = None
    for name in sorted(m for m, info in CATALOG.items() if info.finetunes):
        with pytest.raises(QuadapterError, match="needs fine-tuning data"):
            run_method(name, copy.copy(ctx))


def test_cle_phase2_trains_the_ranges_of_cles_sim_under_the_same_phase_2(toy, tmp_path):
    """The matched baseline: CLE's folded weights and alphas stay, every range trains, its training loss falls."""
    from aimet_quadapter.quadapter.phase2 import lm_loss
    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.quant.quantizers import fast_inference

    model, _, train = toy
    before = _fp_weights(model)
    cle_ctx = _ctx(toy, records=CellFiles(tmp_path / "cle"))
    cle = run_method("cle", cle_ctx)
    ctx = _ctx(toy, records=CellFiles(tmp_path / "baseline"))
    ctx.params = ctx.params.replace(
        phase2=Phase2Parameters(steps=8, batch_size=2, lr_ranges=0.05, lr_ranges_relative=True, learn_ranges=False),
    )
    sim = run_method("cle_phase2", ctx)
    assert _unchanged(model, before)
    for (name, w), (_, w_cle) in zip(sim.model.named_parameters(), cle.model.named_parameters()):
        if name in before:
            assert torch.equal(w, w_cle), f"{name}: the baseline trains no weight and no alpha"
    ranges = {f"{p}.{r}": q for p, r, q in quantizers(cle.model)}
    moved = [k for p, r, q in quantizers(sim.model) if not torch.equal(q.max, ranges[k := f"{p}.{r}"].max)]
    assert len(moved) > len(ranges) // 2, "learn_ranges: false in the recipe does not stop the baseline's ranges"

    def loss(s) -> float:
        with torch.no_grad(), fast_inference(s.model):
            return sum(lm_loss(s.model, b).item() for b in train) / len(train)

    assert loss(sim) < loss(cle)
    state = QuadapterState.load(tmp_path / "baseline" / "cle_phase2.safetensors")
    cle_state = QuadapterState.load(tmp_path / "cle" / "cle.safetensors")
    assert state.alphas.keys() == cle_state.alphas.keys()
    assert all(torch.equal(state.alphas[k], cle_state.alphas[k]) for k in state.alphas)


class _Phase2Seen(Exception):
    pass


@pytest.mark.parametrize(
    "name",
    [m for m, info in CATALOG.items() if info.finetunes and not info.aimet and not info.continues],
)
def test_each_method_runs_the_phase2_its_catalog_entry_states(toy, name, monkeypatch):
    """The catalog's ``phase2`` of a method is what its function runs (and what its fingerprint leaves out): every
    other field of phase 2 is the recipe's. The recipe's values here are the opposite of what any method sets."""
    import aimet_quadapter.methods.registry as methods

    seen = {}

    def phase2(*args, **kwargs):
        seen["params"] = next(a for a in [*args, *kwargs.values()] if isinstance(a, Phase2Parameters))
        raise _Phase2Seen

    monkeypatch.setattr(methods, "run_phase2", phase2)
    monkeypatch.setattr(methods, "apply_phase2", phase2)
    recipe = Phase2Parameters(steps=3, batch_size=2, learn_ranges=name == "qat_fixed_ranges", lr_weights=0.5, loss="kd")
    ctx = _ctx(toy, baselines=BaselineParameters(qat_lr_weights=1e-4))
    ctx.params = ctx.params.replace(phase2=recipe)
    with pytest.raises(_Phase2Seen):
        run_method(name, ctx)
    info = CATALOG[name]
    ran = seen["params"].model_dump()
    changed = {k for k, v in recipe.model_dump().items() if ran[k] != v}
    assert changed == {k for k, v in info.phase2 if recipe.model_dump()[k] != info.phase2_changes(ctx.baselines)[k]}
    assert all(ran[k] == v for k, v in info.phase2_changes(ctx.baselines).items())
    assert {f"phase2.{k}" for k in changed} <= set(info.unused)
