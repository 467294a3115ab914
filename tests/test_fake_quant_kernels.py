"""The CPU's compiled fake-quant kernels compute what the eager arithmetic computes, to the bit: the fixed-range
forward of evaluation, and a trained range's forward and backward (gradients summed as the eager path sums them),
so that every number a cell records is the same with and without them."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from aimet_torch.quantization.affine import QuantizeDequantize

from aimet_quadapter.models import quiet_libraries
from aimet_quadapter.quadapter.api import attach_quadapters
from aimet_quadapter.quadapter.phase2 import Phase2Parameters, run_phase2
from aimet_quadapter.quant import quantizers
from aimet_quadapter.quant.config import QuantPolicy
from aimet_quadapter.quant.policy import build_sim, calibrate
from aimet_quadapter.quant.quantizers import (
    FakeQuantLearnedRange,
    FakeQuantSTE,
    elementwise_fake_quant,
    plain_tensors,
    range_parameters,
)
from aimet_quadapter.testing import sample_corpus, toy_model
from aimet_quadapter.text.data import eval_windows
from aimet_quadapter.text.perplexity import evaluate

quiet_libraries()


@pytest.fixture(autouse=True)
def _compiler(compiled_kernels):
    if quantizers._compiled() is None:
        pytest.skip("torch.compile cannot build kernels on this machine")


@pytest.fixture
def eager(monkeypatch):
    """Inside ``with eager():`` the kernels are unavailable, as on a machine without a compiler."""

    class Eager:
        def __enter__(self):
            monkeypatch.setattr(quantizers, "_compiled", lambda: None)

        def __exit__(self, *exc):
            monkeypatch.undo()

    return Eager


def test_the_kernels_compared_here_are_compiled():
    """Elsewhere in the suite the kernels' functions run as written: here they are torch.compile's."""
    forward, backward = quantizers._compiled()  # type: ignore[misc]
    assert forward is not quantizers._learned_forward and backward is not quantizers._learned_backward
    assert quantizers._compiled_dynamic("forward") is not quantizers._dynamic_forward


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 17, 40, generator=g, dtype=dtype) * 4
    x[0, 0, :5] = torch.tensor([-1e3, 1e3, 0.0, 0.015, -0.015], dtype=dtype)  # clamped both ends, on a boundary
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grad_layout", ["contiguous", "strided"])
@pytest.mark.parametrize("trained", ["all", "range only", "scale only", "input and scale"])
def test_a_trained_range_gives_the_eager_values_and_gradients_to_the_bit(eager, dtype, grad_layout, trained):
    """Whichever of the input (a frozen weight's is not), scale and offset (a symmetric range's is fixed) ask for
    gradients: the compiled kernels give each the eager arithmetic's value."""
    x = _inputs(dtype)
    weights = torch.linspace(-1, 1, x.numel(), dtype=dtype).reshape(x.shape)
    runs = []
    for kernels in (False, True):
        xs = x.clone().requires_grad_(trained in ("all", "input and scale"))
        scale = torch.tensor(0.03, dtype=dtype, requires_grad=True)
        offset = torch.tensor(-120.0, dtype=dtype, requires_grad=trained in ("all", "range only"))
        with eager() if not kernels else torch.enable_grad():
            y = FakeQuantLearnedRange.apply(xs, scale, offset, 0, 255)
            # a transposed consumer hands back a strided gradient
            out = (y.transpose(1, 2) * weights.transpose(1, 2)) if grad_layout == "strided" else y * weights
            out.sum().backward()
        runs.append((y.detach(), xs.grad, scale.grad, offset.grad))
    for a, b in zip(*runs):
        assert (a is None and b is None) or torch.equal(a, b)
    assert runs[0][2].abs() > 0 and (runs[0][3] is None or runs[0][3].abs() > 0)
    assert (runs[1][1] is None) == (trained in ("range only", "scale only"))


def test_a_fixed_range_gives_the_eager_values_to_the_bit(eager):
    x = _inputs()
    scale, zero_point = torch.tensor(0.03), torch.tensor(7.0)
    with torch.no_grad():
        compiled = FakeQuantSTE.apply(x, scale, zero_point, -128, 127)
        with eager():
            plain = FakeQuantSTE.apply(x, scale, zero_point, -128, 127)
    assert torch.equal(compiled, plain)
    assert (compiled != x).any()


def test_htp_evaluation_and_phase2_record_the_same_numbers_with_and_without_kernels(eager):
    model = toy_model("llama")
    corpus = sample_corpus(model, 6, 32, seed=1)
    runs = []
    for kernels in (False, True):
        with eager() if not kernels else torch.no_grad():
            sim = build_sim(model, QuantPolicy(target="htp"))
            calibrate(sim, [corpus[:2]])
            qset = attach_quadapters(sim)
            params = Phase2Parameters(steps=2, batch_size=2, learn_ranges=True)
            with torch.enable_grad():
                losses = run_phase2(sim.model, qset, [corpus[2:4], corpus[4:6]], params, progress=False).losses
            trained = torch.cat([p.detach().flatten() for p in [q.theta for q in qset] + range_parameters(sim.model)])
            ppl = evaluate(sim, {"text": eval_windows(corpus[:2].flatten(), 32)}, progress=False)
        runs.append((losses, trained, ppl))
    (losses, trained, ppl), (k_losses, k_trained, k_ppl) = runs
    assert k_losses == losses and k_ppl == ppl
    assert torch.equal(k_trained, trained)


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_trained_per_channel_range_computes_what_its_evaluation_computes(eager, symmetric):
    """A weight's per-channel range, while it trains, rounds every value as the fixed range it leaves behind
    evaluates and exports it (AIMET's own training path divides by the scale where its evaluation multiplies by
    the reciprocal); with and without kernels to the bit, and with the gradients AIMET's path gives its range."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, 1536, generator=g) * 0.05 + (0.0 if symmetric else 0.01)
    weights = torch.randn(w.shape, generator=g)
    q = QuantizeDequantize((576, 1), 8, symmetric=symmetric)
    with q.compute_encodings():
        q(w)
    with torch.no_grad():
        evaluated = q(w).as_subclass(torch.Tensor)
    q.min.requires_grad_(True)
    q.max.requires_grad_(True)
    runs = {}
    for path in ("AIMET", "kernels", "eager"):
        ws = w.clone().requires_grad_()
        q.min.grad = q.max.grad = None
        with ExitStack() as stack:
            if path != "AIMET":
                stack.enter_context(elementwise_fake_quant([q]))
                stack.enter_context(plain_tensors())
            if path == "eager":
                stack.enter_context(eager())
            y = q(ws).as_subclass(torch.Tensor)
            (y * weights).sum().backward()
        runs[path] = y.detach(), ws.grad, q.min.grad.clone(), q.max.grad.clone()
    assert torch.equal(runs["kernels"][0], evaluated)
    for a, b in zip(runs["kernels"], runs["eager"]):
        assert torch.equal(a, b)
    assert torch.equal(runs["kernels"][1] != 0, runs["AIMET"][1] != 0)  # the same values in range
    for ours, aimets in zip(runs["kernels"][2:], runs["AIMET"][2:]):
        assert ours.shape == aimets.shape == (576, 1) and (ours != 0).all()
        # a value AIMET's division rounds to the other grid point changes its row's sum by its rounding error
        assert torch.allclose(ours, aimets, rtol=0, atol=0.05 * float(aimets.abs().max()))


@pytest.mark.parametrize(
    ("shape", "range_shape"),
    [((96, 200), (96, 1)), ((2, 64, 96), (1,)), ((2, 64, 96), ()), ((3, 40, 50), (3, 1, 1))],
)
@pytest.mark.parametrize("ties", [False, True])
def test_phase1s_observed_range_gives_autograds_values_and_gradients_to_the_bit(eager, shape, range_shape, ties):
    """Phase 1's min and max of a tensor, in one function: what autograd's amin and amax give, the input's gradient
    included where the tensor has other readers, and where several elements share the minimum or maximum."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(-3, 4, shape, generator=g).float() if ties else torch.randn(shape, generator=g)
    weights = torch.randn(shape, generator=g)

    def run(reduce) -> tuple[torch.Tensor, ...]:
        x = x0.clone().requires_grad_()
        lo, hi = reduce(x)
        scale = (hi - lo) / 255
        quantized = quantizers._round_ste(x / scale.reshape((1,) * (x.dim() - scale.dim()) + tuple(scale.shape)))
        ((quantized * weights).sum() + 0.7 * lo.sum() - 1.3 * hi.sum() + (3 * x).sum()).backward()
        return lo.detach(), hi.detach(), x.grad

    def by_autograd(x):
        return quantizers._reduce(x, range_shape, torch.amin), quantizers._reduce(x, range_shape, torch.amax)

    expected = run(by_autograd)
    for kernels in (True, False):
        with eager() if not kernels else torch.enable_grad():
            got = run(lambda x: quantizers.observed_min_max(x, range_shape))
        for a, b in zip(got, expected):
            assert a.shape == b.shape and torch.equal(a, b)
    assert (expected[2] != 3).sum() > 0


def _range_ends(x: torch.Tensor, range_shape: tuple[int, ...], fn) -> torch.Tensor:
    # each range's min or max of x, shaped to broadcast against x
    return quantizers._reduce(x, range_shape, fn).reshape((1,) * (x.dim() - len(range_shape)) + range_shape)


@pytest.mark.parametrize(("shape", "range_shape"), [((96, 200), (96, 1)), ((2, 64, 96), (1,))])
@pytest.mark.parametrize("symmetric", [True, False])
def test_phase1s_fake_quant_gives_autograds_values_and_gradients_to_the_bit(eager, shape, range_shape, symmetric):
    """Phase 1's quantizer (its range the tensor's own, the gradient reaching it) through the compiled kernels: the
    eager autograd graph's output and input gradient, values on the grid's ends included."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape, generator=g) * 3 + (0.0 if symmetric else 1.0)
    weights = torch.randn(shape, generator=g)
    # a few values just inside each range's ends, which round onto them
    bounds = [_range_ends(x0, range_shape, fn) for fn in (torch.amin, torch.amax)]
    x0[..., :2], x0[..., 2:4] = 0.999 * bounds[1], 0.999 * bounds[0]
    q = QuantizeDequantize(range_shape, 8, symmetric=symmetric)
    runs = []
    for kernels in (True, False):
        x = x0.clone().requires_grad_()
        with eager() if not kernels else torch.enable_grad(), quantizers.DynamicRanges([q]):
            y = q(x).as_subclass(torch.Tensor)
            ((y * weights).sum() + (3 * x).sum()).backward()
        runs.append((y.detach(), x.grad))
    (y, grad), (eager_y, eager_grad) = runs
    assert torch.equal(y, eager_y) and torch.equal(grad, eager_grad)
    # values on each range's grid ends beyond its two extremes (torch's clamp passes them no gradient)
    on_ends = (y == _range_ends(y, range_shape, torch.amin)) | (y == _range_ends(y, range_shape, torch.amax))
    assert on_ends.sum() > 2 * torch.Size(range_shape).numel()


def test_phase1s_fake_quant_sums_a_strided_gradient_as_autograd_does(eager):
    x0 = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    weights = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    q = QuantizeDequantize((1,), 8, symmetric=False)
    runs = []
    for kernels in (True, False):
        x = x0.clone().requires_grad_()
        with eager() if not kernels else torch.enable_grad(), quantizers.DynamicRanges([q]):
            y = q(x).as_subclass(torch.Tensor)
            (y.t() * weights).sum().backward()  # the gradient reaches y transposed
        runs.append(x.grad)
    assert torch.equal(*runs)


def test_phase1_and_phase2_stay_within_torch_compiles_graphs_per_function():
    """Every kind of input the kernels meet in both phases, on both targets (per tensor and per channel, weights that
    do and do not train, symmetric and asymmetric ranges): past 8 graphs torch.compile runs a function eagerly, and
    the eager fallback makes every product, which costs time and memory."""
    import torch._dynamo

    from aimet_quadapter.quadapter.config import Phase1Parameters
    from aimet_quadapter.quadapter.phase1 import run_phase1

    model = toy_model("llama")
    corpus = sample_corpus(model, 6, 32, seed=1)
    torch._dynamo.reset()  # a cell's process starts with none: the graphs of this process's other tests count too
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for target in ("paper", "htp"):
            sim = build_sim(model, QuantPolicy(target=target))
            calibrate(sim, [corpus[:2]])
            qset = attach_quadapters(sim)
            run_phase1(sim.model, model, qset, [corpus[:2]], Phase1Parameters(steps=2, lr_stages=1), progress=False)
            for learn_ranges in (True, False):
                params = Phase2Parameters(steps=1, batch_size=2, learn_ranges=learn_ranges)
                run_phase2(sim.model, qset, [corpus[2:4]], params, progress=False)
            qset.detach()
            run_phase2(sim.model, None, [corpus[2:4]], Phase2Parameters(steps=1, batch_size=2), progress=False)
