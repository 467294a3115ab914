"""Phase 2's GPU path, checked on the CPU: the fused fake-quant computes what the eager one computes, and a step
issues at most twice the operations of an FP fine-tuning step (a GPU launches a kernel for each, so their number,
not the arithmetic, sets a small model's step time there)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from aimet_quadapter.models import quiet_libraries
from aimet_quadapter.quadapter.api import attach_quadapters
from aimet_quadapter.quadapter.config import RunOptions
from aimet_quadapter.quadapter.phase2 import Phase2Parameters, for_device, lm_loss, run_phase2
from aimet_quadapter.quant.policy import build_sim, calibrate
from aimet_quadapter.quant.quantizers import (
    FakeQuantLearnedRange,
    FusedFakeQuantLearnedRange,
    _compiled,
    range_parameters,
)
from aimet_quadapter.testing import sample_corpus, toy_model

quiet_libraries()


@pytest.fixture(autouse=True)
def _compiler(compiled_kernels):
    # asked when a test runs, not when the suite is collected: compiling takes seconds
    if _compiled() is None:
        pytest.skip("torch.compile cannot build kernels on this machine")


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_fake_quant_is_the_eager_one(dtype, device):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 17, 40, generator=g) * 4).to(device=device, dtype=dtype)
    x[0, 0, :5] = torch.tensor([-1e3, 1e3, 0.0, 0.015, -0.015])  # clamped at both ends, and on a grid boundary
    weights = torch.linspace(-1, 1, x.numel(), dtype=dtype, device=device).reshape(x.shape)
    runs = []
    for function in (FakeQuantLearnedRange, FusedFakeQuantLearnedRange):
        xs = x.clone().requires_grad_()
        scale = torch.tensor(0.03, device=device, requires_grad=True)
        offset = torch.tensor(-120.0, device=device, requires_grad=True)
        y = function.apply(xs.transpose(1, 2), scale, offset, 0, 255)  # a strided input, as attention gives
        (y * weights.transpose(1, 2)).sum().backward()
        runs.append((y, xs.grad, scale.grad, offset.grad))
    (y, gx, gs, go), (fy, fgx, fgs, fgo) = runs
    assert torch.equal(y, fy) and torch.equal(gx, fgx)  # the same values to the bit
    assert gs.abs() > 0 and go.abs() > 0
    assert float(fgs) == pytest.approx(float(gs), rel=1e-5)  # summed in another order
    assert float(fgo) == pytest.approx(float(go), rel=1e-5)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def toy(request):
    model = toy_model(request.param)
    corpus = sample_corpus(model, 8, 64, seed=1)
    return model, [corpus[:2]], [corpus[4:8]]


def _gpu_path(fused: bool) -> RunOptions:
    # what a GPU runs by default (for_device), forced on the CPU
    return RunOptions(micro_batch_size=4, recompute_blocks=False, fused_fake_quant=fused)


def test_phase2_fused_gives_the_eager_losses_and_gradients(toy):
    model, calib, train = toy
    runs = {}
    for fused in (False, True):
        sim = build_sim(model)
        calibrate(sim, calib)
        qset = attach_quadapters(sim)
        params = Phase2Parameters(steps=1, batch_size=4, lr_alpha=0.0, lr_ranges=0.0)
        losses = run_phase2(sim.model, qset, train, params, progress=False, options=_gpu_path(fused)).losses
        trained = [q.theta for q in qset] + range_parameters(sim.model)
        runs[fused] = losses, torch.cat([p.grad.flatten() for p in trained if p.grad is not None])
    (losses, grad), (fused_losses, fused_grad) = runs[False], runs[True]
    assert fused_losses == losses
    assert grad.abs().max() > 0
    assert torch.allclose(fused_grad, grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item())


# Views, allocations, reads of a scalar and ops that return their input (a conversion to the tensor's own dtype,
# dropout in evaluation mode; a real conversion counts by its copy) launch no kernel on a GPU.
_NO_KERNEL = {
    "aten::to", "aten::_to_copy", "aten::resize_", "aten::dropout", "aten::contiguous", "aten::clone",
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::as_strided",
    "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::slice", "aten::narrow", "aten::unbind",
    "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::flatten", "aten::unflatten", "aten::t",
    "aten::transpose", "aten::permute", "aten::expand", "aten::alias", "aten::detach", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::empty_strided", "aten::empty_like",
    "aten::set_", "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "detach",
}  # fmt: skip


def _kernels(fn) -> int:
    """The device kernels ``fn`` would launch, counted on the CPU's profile: a multi-tensor (``_foreach``) op and
    a compiled graph count once, as on a GPU; any other op that computes counts where no computing op is below it."""
    fn()  # compiled and warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def computes(event) -> bool:
        return event.name.startswith("aten::") and event.name not in _NO_KERNEL

    def inside_one(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(("aten::_foreach", "## Call CompiledFxGraph")):
                return True
            parent = parent.cpu_parent
        return False

    def below(event) -> bool:
        return any(computes(child) or below(child) for child in event.cpu_children)

    count = 0
    for event in prof.events():
        if inside_one(event):
            continue
        if event.name.startswith(("aten::_foreach", "## Call CompiledFxGraph")) or computes(event) and not below(event):
            count += 1
    return count


@pytest.mark.slow  # compiles and profiles two phase-2 runs of a six-block model: the suite's `-m slow` part
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_phase2_step_launches_at_most_twice_the_kernels_of_an_fp_step(family):
    # six blocks: the real models have 12 to 30, so a step's fixed share (embedding, loss, optimizer) weighs less
    model = toy_model(family, layers=6)
    corpus = sample_corpus(model, 6, 64, seed=1)
    calib, train = [corpus[:2]], [corpus[2:6]]
    sim = build_sim(model)
    calibrate(sim, calib)
    qset = attach_quadapters(sim)
    gpu = for_device(RunOptions(), torch.device("cuda"))
    assert (gpu.micro_batch_size, gpu.recompute_blocks, gpu.fused_fake_quant) == (None, False, True)

    def phase2(steps: int):
        params = Phase2Parameters(steps=steps, batch_size=4)
        return lambda: run_phase2(sim.model, qset, train, params, progress=False, options=_gpu_path(True))

    step = _kernels(phase2(2)) - _kernels(phase2(1))  # a step's own, without the setup of a call
    weights = [p for p in model.parameters()]
    optimizer = torch.optim.Adam(weights, lr=1e-5, foreach=True)  # as torch runs Adam on a GPU

    def fp_step():
        for p in weights:
            p.requires_grad_(True)
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model, train[0]).backward()
        optimizer.step()
        for p in weights:
            p.requires_grad_(False)

    fp = _kernels(fp_step)
    assert step <= 2 * fp, f"a phase-2 step launches {step} kernels, an FP step {fp}"


def test_the_learned_range_fake_quant_gives_the_written_out_gradients():
    # the forward builds its saved tensors in place: they must still be rounding error in range, grid value outside
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g, dtype=torch.float64) * 4
    x[0, :3] = torch.tensor([-1e3, 1e3, 0.0], dtype=torch.float64)
    weights = torch.randn(x.shape, generator=g, dtype=torch.float64)
    xs = x.clone().requires_grad_()
    scale = torch.tensor(0.03, dtype=torch.float64, requires_grad=True)
    offset = torch.tensor(-120.0, dtype=torch.float64, requires_grad=True)
    y = FakeQuantLearnedRange.apply(xs, scale, offset, 0, 255)
    (y * weights).sum().backward()
    scaled = x / 0.03
    q = scaled.round() + 120.0
    inside = (q >= 0) & (q <= 255)
    expected_y = (q.clamp(0, 255) - 120.0) * 0.03
    factor = torch.where(inside, scaled.round() - scaled, q.clamp(0, 255) - 120.0)
    assert torch.allclose(y, expected_y, rtol=0, atol=1e-12)
    assert torch.equal(xs.grad, weights * inside)
    assert float(scale.grad) == pytest.approx(float((weights * factor).sum()), rel=1e-9)
    assert float(offset.grad) == pytest.approx(float((weights * ~inside).sum() * 0.03), rel=1e-9)
    assert (~inside).sum() >= 2  # both ends clamped: the grid-value branch is exercised
