"""The Quadapter on tiny GPT-2 and Llama models with planted outlier channels (issue: Quadapter technique)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from aimet_torch.quantization.affine import QuantizeDequantize
from torch import nn

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.models import quiet_libraries
from aimet_quadapter.quadapter.adapter import QuadapterSet
from aimet_quadapter.quadapter.api import QuadapterParameters, apply_cle, apply_quadapter, attach_quadapters
from aimet_quadapter.quadapter.cle import init_with_cle
from aimet_quadapter.quadapter.config import RunOptions
from aimet_quadapter.quadapter.phase1 import Phase1Parameters, run_phase1
from aimet_quadapter.quadapter.phase2 import Phase2Parameters, distillation_loss, lm_loss, phase2_loss, run_phase2
from aimet_quadapter.quadapter.state import QuadapterState
from aimet_quadapter.quant.config import QuantPolicy
from aimet_quadapter.quant.policy import build_sim, calibrate
from aimet_quadapter.quant.quantizers import DynamicRanges, quantizers_in
from aimet_quadapter.testing import sample_corpus, toy_model
from aimet_quadapter.text.data import eval_windows
from aimet_quadapter.text.perplexity import perplexity

quiet_libraries()
FAMILIES = ["gpt2", "llama"]


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    """A planted-outlier toy model, text sampled from it, and its calibration/fine-tuning/eval splits."""
    model = toy_model(request.param)
    corpus = sample_corpus(model, 16, 96, seed=1)
    return {
        "family": request.param,
        "model": model,
        "calib": [corpus[:2], corpus[2:4]],
        "train": [corpus[8:12], corpus[12:16]],
        "windows": [w for row in corpus[4:8] for w in eval_windows(row, 96)],
    }


def _random_alphas(qset: QuadapterSet, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    for q in qset:
        q.set_alpha(torch.exp(torch.randn(q.theta.shape, generator=g)))


def _folded_sim(model, alphas: dict[str, torch.Tensor]):
    """A fresh sim of ``model`` with exactly ``alphas`` folded into its weights, no hooks left on it."""
    sim = build_sim(model)
    qset = attach_quadapters(sim)
    qset.set_total(alphas)
    qset.fold(sim.model, reference=model)
    qset.detach()
    return sim


def test_sites_match_the_paper_and_the_extra_option(setup):
    model = setup["model"]
    paper = model.sites(extra=False)
    layers = len(model.block_paths())
    assert len(paper) == 2 * layers + 1
    assert paper[-1].consumers[-1].endswith("lm_head")
    extra = model.sites(extra=True)
    assert len(extra) == (5 * layers + 1 if setup["family"] == "llama" else 2 * layers + 1)  # v->o, up->down, qk


def test_identity_at_alpha_one_in_the_sim(setup):
    model, calib = setup["model"], setup["calib"]
    sim = build_sim(model)
    calibrate(sim, calib)
    ids = calib[0]
    with torch.no_grad():
        before = sim.model(ids)
        qset = attach_quadapters(sim)
        after = sim.model(ids)
    assert len(qset) > 0
    assert torch.equal(before, after)


def test_any_alpha_keeps_the_fp_function(setup):
    fp = copy.deepcopy(setup["model"])
    qset = QuadapterSet.for_model(fp).attach(fp)
    _random_alphas(qset)
    ids = setup["calib"][0]
    with torch.no_grad():
        scaled = fp(ids)
        qset.detach()
        plain = fp(ids)
    assert (scaled - plain).abs().max() < 1e-3 * plain.abs().max()
    assert not torch.equal(scaled, plain)  # the hooks really acted


def test_fold_equals_the_hooked_forward_exactly_enough(setup):
    model, calib = setup["model"], setup["calib"]
    sim = build_sim(model)
    qset = attach_quadapters(sim)
    _random_alphas(qset)
    calibrate(sim, calib)  # encodings of the hooked (scaled) activations
    with torch.no_grad():
        hooked = sim.model(calib[0])
    # Folding must leave the function unchanged, in dynamic mode (each side its own ranges) and static.
    with torch.no_grad(), DynamicRanges(quantizers_in([sim.model])):
        hooked_dyn = sim.model(calib[0])
        qset.fold(sim.model, reference=model)
        qset.detach()
        folded_dyn = sim.model(calib[0])
    assert torch.allclose(hooked_dyn, folded_dyn, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(q.alpha, torch.ones_like(q.alpha)) for q in qset)
    site = qset.sites[0]
    assert not torch.equal(sim.model.get_submodule(site.producer).weight, model.get_submodule(site.producer).weight)
    # static encodings computed through the hooks fit the folded weights: the output is the same
    with torch.no_grad():
        assert torch.allclose(hooked, sim.model(calib[0]), atol=1e-4, rtol=1e-4)


def test_dynamic_ranges_follow_alpha_on_an_uncalibrated_sim(setup):
    """Phase 1 runs on a sim with no encodings yet. AIMET calibrates such a weight quantizer on its first call
    and, doing so, removes a patched ``forward``: the weight would then keep the range of the unscaled weight.
    Hooked and folded must still agree, and differ from the unscaled model, at every call."""
    model, calib = setup["model"], setup["calib"]
    sim = build_sim(model)
    qset = attach_quadapters(sim)
    _random_alphas(qset)
    ids = calib[0]
    with torch.no_grad(), DynamicRanges(quantizers_in([sim.model])):
        first, second = sim.model(ids), sim.model(ids)
    assert torch.equal(first, second)
    assert not any(q.is_initialized() for q in quantizers_in([sim.model]))  # the sim's state is put back
    folded = _folded_sim(model, qset.total_alpha())
    with torch.no_grad(), DynamicRanges(quantizers_in([folded.model])):
        reference = folded.model(ids)
    assert torch.allclose(first, reference, atol=1e-4, rtol=1e-4)


def test_set_total_refuses_an_alpha_for_no_site(setup):
    """A state saved with a key prefix, or another model's alphas, must not leave every site at 1 unnoticed."""
    qset = attach_quadapters(build_sim(setup["model"]))
    alphas = {f"alpha/{name}": alpha for name, alpha in qset.total_alpha().items()}
    with pytest.raises(QuadapterError, match="unknown site"):
        qset.set_total(alphas)


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_gradients_reach_alpha(setup, mode):
    model, calib = setup["model"], setup["calib"]
    sim = build_sim(model)
    calibrate(sim, calib)
    qset = attach_quadapters(sim)
    ctx = DynamicRanges(quantizers_in([sim.model])) if mode == "dynamic" else torch.enable_grad()
    with ctx:
        loss = lm_loss(sim.model, calib[0])
        loss.backward()
    for q in qset:
        assert q.theta.grad is not None, q.site.name
        assert q.theta.grad.abs().sum() > 0, q.site.name


@pytest.mark.parametrize("source", ["fp", "quantized"])
def test_phase1_lowers_every_site_error(setup, source):
    model, calib = setup["model"], setup["calib"]
    sim = build_sim(model)
    qset = attach_quadapters(sim)
    params = Phase1Parameters(steps=40, input_source=source)
    result = run_phase1(sim.model, model, qset, calib, params, progress=False)
    assert set(result.losses) == {q.site.name for q in qset}
    paper = {s.name for s in model.sites(extra=False)}
    for name in paper:
        assert len(result.losses[name]) == 41  # every step's alpha, then the last one
        assert result.error_after[name] < result.error_before[name], name
    extra = set(result.losses) - paper
    # a site with little to gain may keep its start; the extra sites as a whole must not be inert
    assert not extra or any(result.error_after[n] < result.error_before[n] for n in extra)
    # the paper's sites (norm -> linear, where the outliers were planted) improve by a wide margin with FP
    # inputs; with quantized inputs part of the error arrives from below and stays
    for site in model.sites(extra=False) if source == "fp" else []:
        assert result.error_after[site.name] < 0.5 * result.error_before[site.name], site.name


def test_phase1_ranges_come_from_every_row_when_the_loss_is_subsampled(setup):
    """With ``loss_tokens``, the loss rows' outputs are those of the run on all rows: same ranges."""
    from aimet_quadapter.quadapter.phase1 import SiteBlock, batched, capture_inputs

    model, calib = setup["model"], setup["calib"]
    sim = build_sim(model)
    qset = attach_quadapters(sim)
    _random_alphas(qset)
    site = model.sites(extra=False)[0]
    call = batched(capture_inputs(model, site.producer, calib))
    full = SiteBlock(site, model, sim.model, call, call, Phase1Parameters(steps=1))
    part = SiteBlock(site, model, sim.model, call, call, Phase1Parameters(steps=1, loss_tokens=37))
    assert part.rows is not None and len(part.rows) == 37
    with torch.no_grad(), full.quantizing():
        everything = full.output()
    with torch.no_grad(), part.quantizing():
        sampled = part.output()
    assert torch.equal(sampled, everything[part.rows])
    assert torch.equal(part.target, full.target[part.rows])


def test_a_wide_block_scored_in_row_chunks_has_the_loss_and_gradient_of_all_rows(setup, monkeypatch):
    """The head site's loss is taken in row chunks recomputed in the backward pass (to bound memory): the
    same loss and the same gradient of alpha as all rows at once, ranges included (range_gradient)."""
    from aimet_quadapter.quadapter import phase1
    from aimet_quadapter.quadapter.phase1 import SiteBlock, batched, capture_inputs

    model, calib = setup["model"], setup["calib"]
    sim = build_sim(model)
    qset = attach_quadapters(sim)
    _random_alphas(qset)
    site = model.sites()[-1]
    assert tuple(site.consumers) == (f"lm.{model.arch.lm_head}",)
    call = batched(capture_inputs(model, site.producer, calib))
    block = SiteBlock(site, model, sim.model, call, call, Phase1Parameters(steps=1))
    theta = qset[site.name].theta

    def loss_and_grad(chunk_elements: int) -> tuple[float, torch.Tensor]:
        monkeypatch.setattr(phase1, "CHUNK_ELEMENTS", chunk_elements)
        theta.grad = None
        with block.quantizing():
            loss = block.loss()
            loss.backward()
        return loss.item(), theta.grad.clone()

    whole, whole_grad = loss_and_grad(block.target.numel())
    chunked, chunked_grad = loss_and_grad(block.target.shape[-1] * 7)  # 7 rows a chunk: many chunks, one short
    assert block.target.shape[0] % 7 != 0
    assert chunked == pytest.approx(whole, rel=1e-5)
    assert whole_grad.abs().max() > 0
    assert torch.allclose(chunked_grad, whole_grad, rtol=1e-4, atol=1e-6 * whole_grad.abs().max().item())


def test_a_norm_block_sees_the_weights_the_deployed_model_has(setup):
    """The sites after a norm (v->o, Q*K^T, up->down) scale rows of the linears the norm feeds, and so their
    per-tensor weight ranges: the norm's block must run with them in effect. Its quantized output is the
    folded model's, its target the folded FP model's."""
    from aimet_quadapter.quadapter.adapter import fold_alphas
    from aimet_quadapter.quadapter.phase1 import SiteBlock, batched, capture_inputs
    from aimet_quadapter.quant.quantizers import plain_tensors

    model, calib = setup["model"], setup["calib"]
    sim = build_sim(model)
    qset = attach_quadapters(sim)
    _random_alphas(qset)
    alphas = qset.total_alpha()
    site = model.sites(extra=False)[0]
    call = batched(capture_inputs(model, site.producer, calib))
    block = SiteBlock(site, model, sim.model, call, call, Phase1Parameters(steps=1))
    with torch.no_grad(), block.quantizing():
        output = block.output()

    def run(m: torch.nn.Module) -> torch.Tensor:
        mid = m.get_submodule(site.producer)(call[0][0].reshape(-1, call[0][0].shape[-1]))
        return torch.cat([m.get_submodule(c)(mid) for c in site.consumers], dim=-1)

    folded = _folded_sim(model, alphas)
    modules = [folded.model.get_submodule(p) for p in (site.producer, *site.consumers)]
    with torch.no_grad(), DynamicRanges(quantizers_in(modules)), plain_tensors():
        assert torch.allclose(output, run(folded.model), atol=1e-4, rtol=1e-4)
    fp = copy.deepcopy(model)
    fold_alphas(fp, model.sites(), alphas)
    with torch.no_grad():
        assert torch.allclose(block.target, run(fp), atol=1e-4, rtol=1e-4)
        # where other sites scale these linears (Llama: v->o, Q.K^T), the unscaled target is another one
        if any(s.name != site.name and {s.producer, *s.consumers} & set(site.consumers) for s in model.sites()):
            assert not torch.allclose(block.target, run(model), atol=1e-3)


def test_phase1_leaves_the_sites_keep_start_names_at_their_start(setup):
    model, calib = setup["model"], setup["calib"]
    sim = build_sim(model)
    qset = attach_quadapters(sim)
    _random_alphas(qset)
    start = qset.total_alpha()
    norms = [s.name for s in model.sites(extra=False)][:2]  # a site name is its own pattern
    params = Phase1Parameters(steps=6, keep_start=tuple(norms))
    result = run_phase1(sim.model, model, qset, calib, params, progress=False)
    after = qset.total_alpha()
    assert not set(result.losses) & set(norms)
    assert all(torch.equal(after[n], start[n]) for n in norms)
    assert any(not torch.equal(after[n], start[n]) for n in result.losses)  # the others were trained
    with pytest.raises(QuadapterError, match="keep_start: 'nope\\.\\*' matches no"):
        run_phase1(sim.model, model, qset, calib, Phase1Parameters(keep_start=("nope.*",)))


def test_perplexity_ordering_fp_quadapter_ptq(setup):
    model, calib, windows = setup["model"], setup["calib"], setup["windows"]
    fp = perplexity(model, windows, progress=False).ppl
    ptq_sim = build_sim(model)
    calibrate(ptq_sim, calib)
    ptq = perplexity(ptq_sim.model, windows, progress=False).ppl
    sim = build_sim(model)
    params = QuadapterParameters(phase1=Phase1Parameters(steps=60), phase2=Phase2Parameters(steps=0))
    apply_quadapter(sim, model, calib, None, params, progress=False)
    quad = perplexity(sim.model, windows, progress=False).ppl
    assert fp < quad < ptq
    assert quad < fp * 1.25, "Quadapter BC should undo most of the planted damage"
    assert ptq > fp * 2, "the planted outliers should really hurt PTQ"


def test_cle_undoes_planted_outliers(setup):
    model, calib, windows = setup["model"], setup["calib"], setup["windows"]
    ptq_sim = build_sim(model)
    calibrate(ptq_sim, calib)
    sim = build_sim(model)
    qset = apply_cle(sim, model, calib)
    assert any((q.folded - 1).abs().max() > 0.5 for q in qset)
    assert perplexity(sim.model, windows, progress=False).ppl < perplexity(ptq_sim.model, windows, progress=False).ppl


def _up_proj_range(model, calib, per_channel: bool, bounded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """up_proj's alpha at the layer-0 up -> down site alone (CLE's), and up_proj's weight range in the sim."""
    sim = build_sim(model, QuantPolicy(per_channel_weights=per_channel))
    site = next(s for s in model.sites(extra=True) if s.name == "model.layers.0.mlp.up_proj->down_proj")
    qset = QuadapterSet(sim.model, [site]).attach(sim.model)
    init_with_cle(qset, model, calib, sim.model if bounded else None)
    qset.fold(sim.model, reference=model)
    qset.detach()
    calibrate(sim, calib)
    q = sim.model.get_submodule(site.producer).param_quantizers["weight"]
    return qset.total_alpha()[site.name], q.get_max() - q.get_min()


@pytest.mark.parametrize("per_channel", [False, True])
def test_cle_keeps_the_producer_rows_within_their_range(per_channel):
    """A channel that barely fires in the calibration text (its gate row near zero) gets a huge activation-based
    alpha; folded into its up_proj row, that row alone would set up_proj's per-tensor range. Given the sim, CLE
    keeps up_proj's range where PTQ has it; per-row weight ranges scale with their rows: no bound then."""
    model = toy_model("llama")
    with torch.no_grad():
        model.get_submodule("lm.model.layers.0.mlp.gate_proj").weight[3] *= 1e-4
    calib = [sample_corpus(model, 2, 48, seed=1)]
    free, free_width = _up_proj_range(model, calib, per_channel, bounded=False)
    kept, kept_width = _up_proj_range(model, calib, per_channel, bounded=True)
    assert free[3] > 20 * free.median(), "the planted channel should get an outsized alpha"
    if per_channel:
        assert torch.equal(kept, free)
        return
    ptq = build_sim(model)
    calibrate(ptq, calib)
    q = ptq.model.get_submodule("lm.model.layers.0.mlp.up_proj").param_quantizers["weight"]
    assert free_width > 5 * (q.get_max() - q.get_min()), "without the bound the row widens the range"
    assert kept_width <= (q.get_max() - q.get_min()) * (1 + 1e-5)
    assert 1 < kept[3] < free[3]
    held = kept != free
    assert held.sum() < len(free) // 4, "only the rows that would widen the range are held"


def test_phase2_trains_on_the_fp_storage_bit_for_bit(setup, monkeypatch):
    """Phase 2 keeps no folded copy of the weights the sites touch: they are the FP model's storage while it
    trains, Quadapter BC's alphas folded in by the hooks, and every loss, alpha and range is what training on
    the folded copy gives, bit for bit (the copy: ``unfold`` switched off)."""
    import aimet_quadapter.quadapter.api as api
    from aimet_quadapter.models import shares_storage

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    params = QuadapterParameters(
        phase1=Phase1Parameters(steps=3),
        phase2=Phase2Parameters(steps=3, lr_alpha=1e-2, learn_ranges=True, lr_ranges=1e-2, loss="kd"),
        init="cle",
        extra_sites=True,
    )
    shared: list[bool] = []
    real_run_phase2 = api.run_phase2

    def run_phase2_seeing_storage(sim_model, qset, *args, **kwargs):
        paths = {p for q in qset for p in (q.site.producer, *q.site.consumers)}
        shared.append(all(shares_storage(sim_model.get_submodule(p).weight) for p in paths))
        return real_run_phase2(sim_model, qset, *args, **kwargs)

    monkeypatch.setattr(api, "run_phase2", run_phase2_seeing_storage)
    results = []
    for unfold in (True, False):
        if not unfold:
            monkeypatch.setattr(QuadapterSet, "unfold", lambda self, model, reference: None)
        sim = build_sim(model, share_weights=True)
        result = apply_quadapter(sim, model, calib, train, params, progress=False)
        with torch.no_grad():
            results.append((result, sim.model(calib[0])))
    assert shared == [True, False]
    (unfolded, out_a), (copied, out_b) = results
    assert unfolded.phase2.losses == copied.phase2.losses
    assert all(torch.equal(unfolded.state.alphas[k], copied.state.alphas[k]) for k in copied.state.alphas)
    assert all(torch.equal(unfolded.state.ranges[k][1], v[1]) for k, v in copied.state.ranges.items())
    assert torch.equal(out_a, out_b)


def test_phase2_lowers_training_loss_and_keeps_weights(setup):
    model, calib, train = setup["model"], setup["calib"], setup["train"]
    sim = build_sim(model)
    calibrate(sim, calib)
    qset = attach_quadapters(sim)
    weights = {n: p.detach().clone() for n, p in sim.model.named_parameters() if n.endswith("weight")}
    with torch.no_grad():
        before = sum(lm_loss(sim.model, b).item() for b in train)
    run_phase2(sim.model, qset, train, Phase2Parameters(steps=10, lr_alpha=1e-2, lr_ranges=1e-2), progress=False)
    with torch.no_grad():
        after = sum(lm_loss(sim.model, b).item() for b in train)
    assert after < before
    for n, p in sim.model.named_parameters():
        if n in weights:
            assert torch.equal(p, weights[n]), f"weight {n} changed in phase 2"


@pytest.mark.slow
def test_phase2_distillation_brings_the_sim_toward_the_fp_model(setup):
    """``phase2.loss = "kd"``: zero between the FP model and itself, positive for the quantized sim, and
    lowered by phase 2 (alpha and ranges) toward the FP model's next-token distribution."""
    model, calib, train = setup["model"], setup["calib"], setup["train"]
    kd = distillation_loss(model)
    with torch.no_grad():
        assert kd(model, train[0]).item() == pytest.approx(0.0, abs=1e-6)
    sim = build_sim(model)
    calibrate(sim, calib)
    qset = attach_quadapters(sim)
    with torch.no_grad():
        before = sum(kd(sim.model, b).item() for b in train)
    assert before > 1e-3
    params = Phase2Parameters(steps=30, lr_alpha=1e-2, lr_ranges=1e-2, loss="kd")
    assert phase2_loss(Phase2Parameters(), model) is lm_loss
    with torch.no_grad():  # what apply_phase2 and QAT train under loss = "kd": the same loss, the FP model its teacher
        assert phase2_loss(params, model)(sim.model, train[0]).item() == kd(sim.model, train[0]).item()
    with pytest.raises(QuadapterError, match="phase2.loss = 'kd' needs its teacher"):
        run_phase2(sim.model, qset, train, params, progress=False)  # not the LM loss in its place
    run_phase2(sim.model, qset, train, params, loss_fn=phase2_loss(params, model), progress=False)
    with torch.no_grad():
        after = sum(kd(sim.model, b).item() for b in train)
    assert after < 0.9 * before


def test_the_distillation_loss_is_native_kl_div_with_its_gradient_to_the_bit():
    """The KD loss sums the KL divergence a block of rows at a time (for memory): its value is F.kl_div's up to
    the summation order, and the gradient reaching the student's logits is F.kl_div's, bit for bit."""
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 150, 97) * 4, torch.randn(2, 150, 97) * 4  # 300 rows: 4 blocks and a part
    target = F.log_softmax(teacher, dim=-1).flatten(0, -2)

    def native(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        log_probs = F.log_softmax(model(batch), dim=-1).flatten(0, -2)
        return F.kl_div(log_probs, target, log_target=True, reduction="batchmean")

    class Fixed(nn.Module):  # ids -> the given logits, as a trainable tensor
        def __init__(self, logits: torch.Tensor) -> None:
            super().__init__()
            self.logits = nn.Parameter(logits.clone())

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            return self.logits * 1.0

    grads, values = [], []
    for loss_fn in (native, distillation_loss(Fixed(teacher))):
        model = Fixed(student)
        value = loss_fn(model, torch.zeros(2, 150, dtype=torch.long)) * 0.5  # a slice's weight, as _accumulate's
        value.backward()
        grads.append(model.logits.grad)
        values.append(value.item())
    assert values[0] > 0.1
    assert values[1] == pytest.approx(values[0], rel=1e-6)
    assert torch.equal(grads[0], grads[1])


def test_phase2_micro_batches_give_the_whole_batch_gradient(setup):
    """Accumulating the gradient a few sequences at a time (the memory setting) gives the whole batch's loss
    and gradient. Compared on one step: Adam turns the float rounding of a near-zero gradient into a step of
    the full learning rate, so trajectories of a few steps part for reasons that have nothing to do with this."""
    from aimet_quadapter.quant.quantizers import range_parameters

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    runs = {}
    for micro in (4, 1, 3):  # 4: the whole batch in one pass; 3: uneven slices of it
        sim = build_sim(model)
        calibrate(sim, calib)
        qset = attach_quadapters(sim)
        params = Phase2Parameters(steps=1, lr_alpha=0.0, lr_ranges=0.0)
        options = RunOptions(micro_batch_size=micro)
        losses = run_phase2(sim.model, qset, train, params, progress=False, options=options).losses
        trained = [q.theta for q in qset] + range_parameters(sim.model)
        runs[micro] = losses, torch.cat([p.grad.flatten() for p in trained if p.grad is not None])
    whole_losses, whole_grad = runs[4]
    assert whole_grad.abs().max() > 0
    for micro in (1, 3):
        losses, grad = runs[micro]
        assert len(grad) == len(whole_grad)
        assert losses == pytest.approx(whole_losses, rel=1e-6)
        assert torch.allclose(grad, whole_grad, rtol=1e-4, atol=1e-6 * whole_grad.abs().max().item()), micro


def test_phase2_gives_each_passes_heap_back_on_cpu(setup, monkeypatch):
    """On a CPU, what a slice's backward pass frees goes back to the system before the next slice: glibc would
    keep it resident beside the next slice's activations (the demo's phase-2 peak)."""
    import aimet_quadapter.quadapter.phase2 as phase2

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    sim = build_sim(model)
    calibrate(sim, calib)
    qset = attach_quadapters(sim)
    events: list[str] = []
    monkeypatch.setattr(phase2, "trim_heap", lambda: events.append("trim"))
    loss = phase2.lm_loss
    monkeypatch.setattr(phase2, "lm_loss", lambda m, b: events.append("pass") or loss(m, b))
    assert all(len(b) == 4 for b in train)
    run_phase2(
        sim.model, qset, train, Phase2Parameters(steps=1), progress=False, options=RunOptions(micro_batch_size=3)
    )
    assert events == ["pass", "trim"] * 2  # two slices (3 + 1 sequences)


def test_phase2_recomputed_blocks_give_the_same_losses_and_gradients(setup):
    """Recomputing each decoder block in the backward pass (the memory setting) runs every block twice
    per step and gives the losses and gradients of keeping its activations; the blocks are left as found."""
    from aimet_quadapter.quant.quantizers import range_parameters

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    runs = {}
    for recompute in (False, True):
        sim = build_sim(model)
        calibrate(sim, calib)
        qset = attach_quadapters(sim)
        first = sim.model.get_submodule(model.block_paths()[0])
        calls = []
        inner = next(first.children())  # the block's first norm: a recomputation calls it again
        hook = inner.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        params = Phase2Parameters(steps=2, lr_alpha=1e-2, lr_ranges=1e-3)
        own = first.__dict__.get("forward")  # the prepared block's own (its residual sums through modules)
        options = RunOptions(recompute_blocks=recompute)
        losses = run_phase2(sim.model, qset, train, params, progress=False, options=options).losses
        hook.remove()
        assert first.__dict__.get("forward") is own
        trained = [q.theta for q in qset] + range_parameters(sim.model)
        grads = torch.cat([p.grad.flatten() for p in trained if p.grad is not None])
        runs[recompute] = losses, grads, len(calls)
    kept_losses, kept_grad, kept_calls = runs[False]
    losses, grad, recomputed_calls = runs[True]
    assert kept_calls == 2 * len(train[0]) and recomputed_calls == 2 * kept_calls  # micro-batches of 1
    assert kept_grad.abs().max() > 0
    assert losses == pytest.approx(kept_losses, rel=1e-6)
    assert torch.allclose(grad, kept_grad, rtol=1e-5, atol=1e-7 * kept_grad.abs().max().item())


def test_batched_range_encodings_give_aimets_encodings_and_the_same_gradients(setup, monkeypatch):
    """Phase 2 with every range's encoding made in one computation per pass (with the fused kernels: the GPU path,
    forced here) gives the same losses bit for bit and the same gradients up to summation order, without asking
    any quantizer whose range trains for its encoding."""
    from aimet_quadapter.quant.quantizers import range_parameters

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    calls = []
    original = QuantizeDequantize.get_encodings
    monkeypatch.setattr(QuantizeDequantize, "get_encodings", lambda q: calls.append(q) or original(q))
    runs = {}
    for batched in (False, True):
        sim = build_sim(model)
        calibrate(sim, calib)
        qset = attach_quadapters(sim)
        params = Phase2Parameters(steps=1, lr_alpha=0.0, lr_ranges=0.0)
        options = RunOptions(micro_batch_size=2, fused_fake_quant=batched)
        calls.clear()
        losses = run_phase2(sim.model, qset, train, params, progress=False, options=options).losses
        trained = [q.theta for q in qset] + range_parameters(sim.model)
        runs[batched] = losses, torch.cat([p.grad.flatten() for p in trained if p.grad is not None]), len(calls)
    (plain_losses, plain_grad, plain_calls), (losses, grad, batched_calls) = runs[False], runs[True]
    assert plain_calls > 0 and batched_calls == 0
    assert losses == plain_losses
    assert plain_grad.abs().max() > 0
    # The fused kernels sum a range's gradient over its tensor in another order (float32, up to 1e5 terms), so the
    # gradients differ where terms cancel: measured on the llama toy, at most 3.9e-7 of the largest gradient, and
    # 1.3e-3 relative on one near zero. Hence a bound absolute in the largest gradient (1e-5: 26x the measured);
    # a reduction that drops or doubles a term moves a gradient by far more.
    assert torch.allclose(grad, plain_grad, rtol=1e-4, atol=1e-5 * plain_grad.abs().max().item())


def test_gathered_embedding_quantization_is_exact(setup, monkeypatch):
    """Quantizing only the looked-up embedding rows (a speed-up) gives the same logits, and phase 2 with
    and without it the same losses and the same learned alphas and ranges."""
    import contextlib

    from aimet_quadapter.quadapter import phase2
    from aimet_quadapter.quant.quantizers import gathered_embedding_quantization

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    sim = build_sim(model)
    calibrate(sim, calib)
    with torch.no_grad():
        plain = sim.model(train[0])
        with gathered_embedding_quantization(sim.model):
            gathered = sim.model(train[0])
    assert torch.equal(plain, gathered)
    assert sim.model.lm.get_input_embeddings().param_quantizers["weight"] is not None  # put back

    runs = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(phase2, "gathered_embedding_quantization", lambda _m: contextlib.nullcontext())
        sim = build_sim(model)
        calibrate(sim, calib)
        qset = attach_quadapters(sim)
        params = Phase2Parameters(steps=4, lr_alpha=1e-2, lr_ranges=1e-2)
        result = run_phase2(sim.model, qset, train, params, progress=False)
        ranges = {n: p.detach().clone() for n, p in sim.model.named_parameters() if n.endswith((".min", ".max"))}
        runs.append((result.losses, qset.total_alpha(), ranges))
    (losses_a, alphas_a, ranges_a), (losses_b, alphas_b, ranges_b) = runs
    assert losses_a == pytest.approx(losses_b, rel=1e-5)
    for name in alphas_a:
        assert torch.allclose(alphas_a[name], alphas_b[name], rtol=1e-5, atol=1e-7), name
    embedding_range = [n for n in ranges_a if "wte" in n or "embed_tokens" in n]
    assert embedding_range, "the embedding's range should be learned too"
    for name in ranges_a:
        assert torch.allclose(ranges_a[name], ranges_b[name], rtol=1e-5, atol=1e-7), name


def test_evaluation_takes_the_vectorised_fake_quant(setup, monkeypatch):
    """``fast_inference`` (every evaluation) runs the vectorised fake-quant, with AIMET's output."""
    from aimet_quadapter.quant import quantizers
    from aimet_quadapter.quant.quantizers import fast_inference

    model, calib = setup["model"], setup["calib"]
    calls = []
    fake_quant = quantizers.FakeQuantSTE.apply
    monkeypatch.setattr(quantizers.FakeQuantSTE, "apply", lambda *a: calls.append(1) or fake_quant(*a))
    sim = build_sim(model)
    calibrate(sim, calib)
    with torch.no_grad():
        expected = sim.model(calib[0])
        assert not calls
        with fast_inference(sim.model):
            fast = sim.model(calib[0])
    assert calls, "the vectorised path was not taken"
    assert torch.equal(fast, expected)


def _learnable_quantizer(device: str = "cpu"):
    from aimet_torch.quantization.affine import QuantizeDequantize

    q = QuantizeDequantize((), bitwidth=8, symmetric=False).to(device)
    q.set_range(-1.3, 2.9)
    return q


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))],
)
def test_a_trained_range_rounds_as_the_evaluation_does(device):
    """Phase 2's fake-quant of a range that trains gives, bit for bit, the fixed-range output that the
    evaluation computes, also for values within an ulp of a rounding boundary, on every device. AIMET's own
    path for a trained range divides by the scale instead of multiplying by its reciprocal and rounds some
    of those the other way: phase 2 would train another function than the one evaluated and exported."""
    from aimet_quadapter.quant.quantizers import elementwise_fake_quant, plain_tensors

    q = _learnable_quantizer(device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        scale = q.get_scale().item()
    steps = torch.randint(-80, 160, (100_000,), generator=g).float()
    x = (steps + 0.5) * scale
    x = (x + torch.randn(x.shape, generator=g) * 1e-7 * x.abs()).to(device)  # an ulp or two from the boundary
    with torch.no_grad():
        evaluated = q(x).as_subclass(torch.Tensor)
    q.requires_grad_(True)
    with plain_tensors():
        aimet = q(x).detach()
        with elementwise_fake_quant([q]):
            trained = q(x)
    assert trained.requires_grad and trained.device.type == device  # the range-learning path, not the fixed one
    assert (aimet != evaluated).any()  # the inputs do sit where the two arithmetics part
    assert torch.equal(trained.detach(), evaluated)


def test_a_trained_range_has_aimets_gradients():
    """The gradients of that fake-quant to the input and to min / max are AIMET's (LSQ through the
    scale and the offset), inside the range and outside it on both sides."""
    from aimet_quadapter.quant.quantizers import elementwise_fake_quant, plain_tensors

    g = torch.Generator().manual_seed(1)
    x = torch.randn(20_000, generator=g) * 1.5  # about 7 % beyond -1.3 or 2.9
    weights = torch.randn(20_000, generator=g)
    grads = []
    for ours in (False, True):
        q = _learnable_quantizer()
        q.requires_grad_(True)
        inputs = x.clone().requires_grad_(True)
        with plain_tensors(), elementwise_fake_quant([q] if ours else []):
            (q(inputs) * weights).sum().backward()
        grads.append([inputs.grad, q.min.grad, q.max.grad])
    assert ((x < -1.3) | (x > 2.9)).sum() > 500
    for aimet, ours in zip(*grads):
        assert aimet.abs().max() > 0
        assert torch.allclose(ours, aimet, rtol=1e-4, atol=1e-5 * aimet.abs().max().item())


@pytest.mark.parametrize("relative", [False, True])
def test_range_learning_rate_relative_to_each_width(setup, relative):
    """Adam's first step moves each parameter by its learning rate: with ``lr_ranges_relative`` every min and
    max moves by that fraction of its quantizer's width, however wide; otherwise by the rate itself."""
    from aimet_quadapter.quant.quantizers import range_parameter_widths

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    sim = build_sim(model)
    calibrate(sim, calib)
    widths = range_parameter_widths(sim.model)
    before = [p.detach().clone() for p, _ in widths]
    lr = 0.01
    params = Phase2Parameters(steps=1, lr_alpha=0.0, lr_ranges=lr, lr_ranges_relative=relative)
    run_phase2(sim.model, None, train, params, progress=False)
    moved = [(float((p - b).abs().max()), width) for (p, width), b in zip(widths, before) if p.grad.abs().max() > 1e-4]
    assert len(moved) > 20
    spread = [width for _, width in moved]
    assert max(spread) > 5 * min(spread)  # one rate for all would move the narrow and the wide alike
    for step, width in moved:
        assert step == pytest.approx(lr * width if relative else lr, rel=1e-3)


@pytest.mark.parametrize("relative", [False, True])
def test_range_rate_overrides_reach_the_ranges_they_name(setup, relative):
    """``lr_ranges_overrides`` multiplies the first step of the ranges whose quantizer's name matches, and only
    theirs; a pattern that matches no quantizer is refused, naming the entry."""
    from aimet_quadapter.quant.quantizers import quantizers

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    sim = build_sim(model)
    calibrate(sim, calib)
    named = {}
    for path, role, q in quantizers(sim.model):
        if q.is_initialized() and hasattr(q, "min"):
            named[f"{path}.{role}"] = (q.min, q.max, float((q.max - q.min).mean()))
    before = {k: (lo.detach().clone(), hi.detach().clone()) for k, (lo, hi, _) in named.items()}
    lr = 0.01
    params = Phase2Parameters(
        steps=1, lr_alpha=0.0, lr_ranges=lr, lr_ranges_relative=relative, lr_ranges_overrides=("*.mlp.*=3",)
    )
    run_phase2(sim.model, None, train, params, progress=False)
    seen = set()
    for key, (lo, hi, width) in named.items():
        for p, b in ((lo, before[key][0]), (hi, before[key][1])):
            if p.grad is None or p.grad.abs().max() <= 1e-4:
                continue
            factor = 3.0 if ".mlp." in key else 1.0
            seen.add(factor)
            expected = lr * factor * (width if relative else 1.0)
            assert float((p - b).abs().max()) == pytest.approx(expected, rel=1e-3), key
    assert seen == {1.0, 3.0}

    with pytest.raises(QuadapterError, match=r"lr_ranges_overrides\[0\]: 'nowhere\.\*' matches no quantizer"):
        run_phase2(
            sim.model, None, train, Phase2Parameters(steps=1, lr_ranges_overrides=("nowhere.*=2",)), progress=False
        )


@pytest.mark.parametrize(
    ("entry", "message"), [("no-equals", "PATTERN=FACTOR"), ("*.x=-1", ">= 0"), ("*.x=fast", ">= 0")]
)
def test_range_rate_overrides_refuse_a_malformed_entry(entry, message):
    with pytest.raises(QuadapterError, match=rf"lr_ranges_overrides.*\[1\].*{message}"):
        Phase2Parameters(lr_ranges_overrides=("*.mlp.*=2", entry))


def test_plain_tensors_change_no_result(setup, monkeypatch):
    """Phases 1 and 2 with AIMET's DequantizedTensor outputs switched off (a speed-up) give the same losses."""
    import contextlib

    from aimet_quadapter.quadapter import phase1, phase2

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    runs = []
    for plain in (True, False):
        if not plain:
            for module in (phase1, phase2):
                monkeypatch.setattr(module, "plain_tensors", contextlib.nullcontext)
        sim = build_sim(model)
        calibrate(sim, calib)
        qset = attach_quadapters(sim)
        p1 = run_phase1(sim.model, model, qset, calib, Phase1Parameters(steps=3), progress=False)
        p2 = run_phase2(sim.model, qset, train, Phase2Parameters(steps=3), progress=False)
        runs.append((p1.losses, p2.losses))
    assert runs[0] == runs[1]


def test_save_load_gives_the_same_perplexity(setup, tmp_path):
    model, calib, train, windows = setup["model"], setup["calib"], setup["train"], setup["windows"]
    sim = build_sim(model)
    params = QuadapterParameters(phase1=Phase1Parameters(steps=10), phase2=Phase2Parameters(steps=4, lr_ranges=1e-2))
    result = apply_quadapter(sim, model, calib, train, params, progress=False)
    trained = perplexity(sim.model, windows, progress=False).ppl
    path = result.state.save(tmp_path / "q.safetensors")
    state = QuadapterState.load(path)
    assert set(state.alphas) == {q.site.name for q in result.qset}
    fresh = state.build_sim(model)
    assert perplexity(fresh.model, windows, progress=False).ppl == pytest.approx(trained, rel=1e-9)


def test_phase2_resume_continues_where_it_stopped(setup, tmp_path):
    model, calib, train = setup["model"], setup["calib"], setup["train"]

    def fresh():
        sim = build_sim(model)
        calibrate(sim, calib)
        return sim, attach_quadapters(sim)

    full_sim, full_q = fresh()
    full = run_phase2(full_sim.model, full_q, train, Phase2Parameters(steps=6), progress=False)

    ckpt = tmp_path / "ck"
    sim, qset = fresh()
    with pytest.raises(KeyboardInterrupt):  # the run dies during step 5: steps 1-4 are checkpointed
        run_phase2(
            sim.model,
            qset,
            train,
            Phase2Parameters(steps=6),
            progress=False,
            loss_fn=_interrupt_after(4 * len(train[0])),  # one loss per sequence (micro_batch_size 1)
            options=RunOptions(checkpoint_every=2, checkpoint_dir=str(ckpt)),
        )
    assert (ckpt / "phase2.pt").is_file()
    sim, qset = fresh()
    resumed = run_phase2(
        sim.model,
        qset,
        train,
        Phase2Parameters(steps=6),
        progress=False,
        options=RunOptions(checkpoint_every=2, checkpoint_dir=str(ckpt)),
    )
    assert resumed.resumed_from == 4
    assert resumed.losses == pytest.approx(full.losses, rel=1e-5)
    for a, b in zip(full_q, qset):
        assert torch.allclose(a.theta, b.theta, atol=1e-6)


def test_phase2_resumes_only_its_own_checkpoint(setup, tmp_path, caplog):
    """A checkpoint names the settings, start and data it came from: changed settings start over (said in a
    warning), and a file that holds more than tensors and plain data is not unpickled."""
    model, calib, train = setup["model"], setup["calib"], setup["train"]

    def run(**changes):
        sim = build_sim(model)
        calibrate(sim, calib)
        params = Phase2Parameters(steps=2).replace(**changes)
        options = RunOptions(checkpoint_every=1, checkpoint_dir=str(tmp_path), micro_batch_size=4)
        return run_phase2(sim.model, attach_quadapters(sim), train, params, progress=False, options=options)

    run()
    assert run().resumed_from == 2  # the same run: resumed at its end
    with caplog.at_level("WARNING"):
        assert run(lr_alpha=5e-3).resumed_from == 0
    assert "other settings" in caplog.text
    saved = torch.load(tmp_path / "phase2.pt", weights_only=True)
    torch.save({**saved, "extra": _NotData()}, tmp_path / "phase2.pt")  # unpickling it would run code
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert run(lr_alpha=5e-3).resumed_from == 0
    assert "cannot be read" in caplog.text


class _NotData:
    pass


def test_an_unreadable_phase1_checkpoint_is_said_and_every_site_calibrated_again(setup, tmp_path, caplog):
    model, calib = setup["model"], setup["calib"]
    (tmp_path / "phase1.pt").write_bytes(b"not a checkpoint")
    sim = build_sim(model)
    qset = attach_quadapters(sim)
    params = Phase1Parameters(steps=1)
    with caplog.at_level("WARNING"):
        result = run_phase1(sim.model, model, qset, calib, params, progress=False, checkpoint_dir=str(tmp_path))
    assert "phase1.pt cannot be read" in caplog.text
    assert len(result.losses) == len(qset)


@pytest.mark.parametrize("setup", ["gpt2"], indirect=True)
def test_phase1_resumes_only_a_checkpoint_of_its_own_quantization_policy(setup, tmp_path):
    """Phase 1 under 4-bit activations does not resume the sites a W8A8 phase 1 left in the same folder: the
    sites' errors, and so their alphas, depend on the quantizers."""
    model, calib = setup["model"], setup["calib"]
    params = Phase1Parameters(steps=1)

    def calibrated(policy: QuantPolicy) -> list[str]:
        sim = build_sim(model, policy)
        qset = attach_quadapters(sim)
        done: list[str] = []
        run_phase1(
            sim.model,
            model,
            qset,
            calib,
            params,
            progress=False,
            on_site_done=lambda s, _: done.append(s),
            checkpoint_dir=str(tmp_path),
        )
        return done

    every = calibrated(QuantPolicy())
    assert every and calibrated(QuantPolicy()) == []  # the same policy: every site resumed
    assert calibrated(QuantPolicy(activation_bits=4)) == every


def test_phase2_stops_at_a_nan_loss_and_keeps_the_last_good_checkpoint(setup, tmp_path):
    from aimet_quadapter.errors import TrainingDiverged

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    sim = build_sim(model)
    calibrate(sim, calib)
    qset = attach_quadapters(sim)
    calls = {"n": 0}

    def nan_at_step_3(m, batch):
        calls["n"] += 1
        loss = lm_loss(m, batch)
        return loss * float("nan") if calls["n"] > 2 else loss  # one call per step (the whole batch of 4)

    options = RunOptions(checkpoint_every=1, checkpoint_dir=str(tmp_path), micro_batch_size=4)
    with pytest.raises(TrainingDiverged, match="step 3 of 5.*holds step 2"):
        run_phase2(
            sim.model, qset, train, Phase2Parameters(steps=5), progress=False, loss_fn=nan_at_step_3, options=options
        )
    saved = torch.load(tmp_path / "phase2.pt", weights_only=True)
    assert saved["step"] == 2 and all(math.isfinite(v) for v in saved["losses"])
    # the parameters are those of the last good step: the NaN loss was never stepped on
    current = qset.state_dict()
    assert any((v != 0).any() for k, v in saved["qset"].items() if k.endswith("theta"))
    for key, value in saved["qset"].items():
        assert torch.equal(current[key], value), key


def _interrupt_after(n: int):
    calls = {"n": 0}

    def loss_fn(model, batch):
        if calls["n"] == n:
            raise KeyboardInterrupt
        calls["n"] += 1
        return lm_loss(model, batch)

    return loss_fn


def test_range_gradient_matches_finite_differences():
    """Shrinking an outlier narrows the dynamic range for every other element: the gradient must see it.

    The loss is the quantization error of the ordinary elements only; they depend on the outlier's size
    through the range alone. Over many elements that error is smooth in the outlier's size, so a finite
    difference measures the true derivative, which the range gradient must match and AIMET's
    no-gradient range (``range_gradient=False``) misses entirely.
    """
    from aimet_torch.quantization.affine import QuantizeDequantize

    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    q = QuantizeDequantize(shape=(), bitwidth=8, symmetric=False)

    def loss(size: torch.Tensor, range_gradient: bool = True) -> torch.Tensor:
        values = torch.cat([size.reshape(1), x])
        with DynamicRanges([q], range_gradient):
            out = q(values).as_subclass(torch.Tensor)
        return (out[1:] - x).pow(2).mean()

    size = torch.tensor(60.0, requires_grad=True)
    loss(size).backward()
    step = 0.05 * size.item()
    with torch.no_grad():
        numeric = (loss(size + step) - loss(size - step)) / (2 * step)
    assert numeric > 0
    assert size.grad == pytest.approx(numeric.item(), rel=0.1)
    blind = torch.tensor(60.0, requires_grad=True)
    loss(blind, range_gradient=False).backward()
    assert blind.grad is None or blind.grad == 0


def test_static_gradient_of_alpha_matches_finite_differences(setup):
    """With fixed (static) ranges the only non-smooth parts are rounding and clipping; at 16 bits rounding
    is negligible, so the straight-through gradient of the LM loss must match a finite difference."""
    from aimet_quadapter.quant.policy import QuantPolicy

    model, calib = setup["model"], setup["calib"]
    sim = build_sim(model, QuantPolicy(weight_bits=16, activation_bits=16))
    qset = attach_quadapters(sim)
    _random_alphas(qset, seed=5)
    calibrate(sim, calib)
    thetas = [q.theta for q in qset]
    loss = lm_loss(sim.model, calib[0])
    grads = torch.autograd.grad(loss, thetas)
    direction = [g / torch.cat([h.flatten() for h in grads]).norm() for g in grads]
    analytic = sum((g * d).sum() for g, d in zip(grads, direction)).item()
    eps = 0.05  # wide enough to average over 16-bit rounding, narrow enough for the curvature

    def moved(sign: float) -> float:
        with torch.no_grad():
            for t, d in zip(thetas, direction):
                t.add_(sign * eps * d)
            value = lm_loss(sim.model, calib[0]).item()
            for t, d in zip(thetas, direction):
                t.sub_(sign * eps * d)
        return value

    numeric = (moved(1.0) - moved(-1.0)) / (2 * eps)
    assert analytic > 0
    assert numeric == pytest.approx(analytic, rel=0.1)


@pytest.mark.parametrize("family", FAMILIES)
def test_phase1_pulls_a_planted_1000x_outlier_toward_balance(family):
    """A channel planted 1,000x too large leaves every other channel rounding to zero: the block's loss is flat
    until its alpha has fallen a long way (past 1/sqrt(1000), log -3.5). 50 steps must get it past -2 relative to
    the other channels; the paper's schedule compressed to 50 steps stops near -1.5 (``reach_steps=None``)."""
    from aimet_quadapter.models import tiny_model
    from aimet_quadapter.testing import plant_outliers

    model = tiny_model(family, seed=0, initializer_range=0.3)
    picked = plant_outliers(model, factor=1000.0)
    calib = [sample_corpus(model, 4, 64, seed=2)]
    sim = build_sim(model)
    qset = attach_quadapters(sim, extra_sites=False)
    run_phase1(sim.model, model, qset, calib, Phase1Parameters(steps=50), progress=False)
    for q in qset:  # the paper's sites: every norm, where the outliers were planted
        log_alpha = q.alpha.log()
        pulled = log_alpha[picked] - log_alpha.median()
        assert (pulled < -2).all(), (q.site.name, pulled.tolist())


def test_the_model_level_check_keeps_the_start_when_phase_1_makes_it_worse(setup, monkeypatch):
    """Phase 1 is checked on held-out text with static ranges: a phase 1 that ruins the model is undone, and
    the sim is then exactly the start's (here CLE's)."""
    from aimet_quadapter.quadapter import api

    model, calib, train = setup["model"], setup["calib"], setup["train"]

    def ruin(sim_model, fp_model, qset, *args, **kwargs):
        for q in qset:
            with torch.no_grad():
                q.theta.add_(torch.randn(q.theta.shape, generator=torch.Generator().manual_seed(1)) * 3)
        return api.Phase1Result({}, {}, {})

    monkeypatch.setattr(api, "run_phase1", ruin)
    sim = build_sim(model)
    params = QuadapterParameters(phase1=Phase1Parameters(steps=5), phase2=Phase2Parameters(steps=0), init="cle")
    result = api.apply_phase1(sim, model, calib, params, progress=False, validation_batches=train)
    check = result.phase1.validation
    assert check["kept"] == "start" and check["end"] > check["start"]
    cle = build_sim(model)
    apply_cle(cle, model, calib)
    with torch.no_grad():
        assert torch.equal(sim.model(train[0]), cle.model(train[0]))


def test_the_check_points_calibrate_without_the_hooks_and_phase_1_runs_with_them(setup, monkeypatch):
    """The start and the points phase 1's check scores are calibrated on the folded weights alone (no hook copies
    a weight at each forward), while phase 1 itself trains through the hooks."""
    from aimet_quadapter.quadapter import api

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    sets, hooks = [], {"calibrate": [], "phase1": []}
    attach_, calibrate_, run_phase1_ = api.attach_quadapters, api.calibrate, api.run_phase1
    monkeypatch.setattr(api, "attach_quadapters", lambda *a: sets.append(attach_(*a)) or sets[-1])

    def calibrate_watched(sim, batches):
        hooks["calibrate"].append(len(sets[0]._handles))
        return calibrate_(sim, batches)

    def run_phase1_watched(sim_model, fp_model, qset, *args, **kwargs):
        hooks["phase1"].append(len(qset._handles))
        return run_phase1_(sim_model, fp_model, qset, *args, **kwargs)

    monkeypatch.setattr(api, "calibrate", calibrate_watched)
    monkeypatch.setattr(api, "run_phase1", run_phase1_watched)
    params = QuadapterParameters(phase1=Phase1Parameters(steps=2), phase2=Phase2Parameters(steps=0), init="cle")
    api.apply_phase1(build_sim(model), model, calib, params, progress=False, validation_batches=train)
    assert len(hooks["calibrate"]) >= 5 and set(hooks["calibrate"]) == {0}  # the start, 3 points on the way, the end
    assert hooks["phase1"] and hooks["phase1"][0] > 0


def test_the_model_level_check_keeps_the_best_point_on_the_way(setup):
    """The start, phase 1's result and the points between them are scored on held-out text: the sim holds the
    best of them, whichever it is."""
    from aimet_quadapter.quadapter import api
    from aimet_quadapter.quadapter.phase2 import mean_lm_loss

    model, calib, train = setup["model"], setup["calib"], setup["train"]
    sim = build_sim(model)
    params = QuadapterParameters(phase1=Phase1Parameters(steps=6), phase2=Phase2Parameters(steps=0), init="cle")
    result = api.apply_phase1(sim, model, calib, params, progress=False, validation_batches=train)
    check = result.phase1.validation
    assert set(check["points"]) == {"0", "0.25", "0.5", "0.75", "1"}
    best = min(check["points"], key=check["points"].get)
    assert check["kept"] == {"0": "start", "1": "end"}.get(best, best)
    assert api._validation_loss(sim, train) == pytest.approx(check["points"][best], rel=1e-6)
    # the saved state rebuilds that same sim
    rebuilt = result.state.build_sim(model)
    with torch.no_grad():
        assert mean_lm_loss(rebuilt.model, train) == pytest.approx(check["points"][best], rel=1e-6)
