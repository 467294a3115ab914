"""Where the quantizers go under the default policy and its options, and the fast-eval weight path."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.quant.policy import QuantPolicy, build_sim, calibrate, describe, format_description
from aimet_quadapter.quant.quantizers import fast_inference, quantizers


def _gpt2_expected(model, norm_weights: bool = True) -> set[str]:
    """The paper's placement on GPT-2, written out tensor by tensor."""
    names = {"lm.transformer.wte.weight", "lm.transformer.wpe.weight", "lm.lm_head.weight", "lm.lm_head.input[0]"}
    if norm_weights:
        names.add("lm.transformer.ln_f.weight")
    for i in range(model.config.n_layer):
        b = f"lm.transformer.h.{i}"
        for linear in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            names |= {f"{b}.{linear}.weight", f"{b}.{linear}.input[0]"}
        for matmul in ("attn.qk_matmul", "attn.av_matmul"):
            names |= {f"{b}.{matmul}.input[0]", f"{b}.{matmul}.input[1]"}
        if norm_weights:
            names |= {f"{b}.ln_1.weight", f"{b}.ln_2.weight"}
    return names


def _rows(model, **policy):
    sim = build_sim(model, QuantPolicy(**policy))
    return sim, {r["tensor"]: r for r in describe(sim.model)}


def test_default_policy_placement_gpt2(tiny_gpt2):
    # Every Linear of the model is one of those the expected set names.
    linears = {n for n, m in tiny_gpt2.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 4 * tiny_gpt2.config.n_layer + 1
    _, rows = _rows(tiny_gpt2)
    assert set(rows) == _gpt2_expected(tiny_gpt2)
    assert all(f"{n}.input[0]" in rows and f"{n}.weight" in rows for n in linears)
    for name, row in rows.items():
        assert row["bits"] == 8, name
        assert row["symmetric"] is False, name
        assert row["granularity"] == "per-tensor", name
        assert row["kind"] == ("activation" if "input[" in name else "weight"), name
    # What must not be there: biases, outputs (norm, GELU, softmax, logits).
    assert not any(name.endswith(".bias") or "output[" in name for name in rows)
    assert not any(".softmax." in name or ".act." in name for name in rows)


def test_per_channel_weights(tiny_gpt2):
    sim, rows = _rows(tiny_gpt2, per_channel_weights=True)
    assert set(rows) == _gpt2_expected(tiny_gpt2)
    for name, module in sim.model.named_modules():
        if isinstance(module, nn.Linear):
            row = rows[f"{name}.weight"]
            assert row["granularity"] == f"per-channel({module.weight.shape[0]}, 1)", name
            assert rows[f"{name}.input[0]"]["granularity"] == "per-tensor"
    # gamma stays one range
    assert rows["lm.transformer.h.0.ln_1.weight"]["granularity"] == "per-tensor"


def test_no_norm_weights(tiny_gpt2):
    _, rows = _rows(tiny_gpt2, quantize_norm_weights=False)
    assert set(rows) == _gpt2_expected(tiny_gpt2, norm_weights=False)
    assert not any(".ln_" in name for name in rows)


def test_quantize_logits(tiny_gpt2):
    _, rows = _rows(tiny_gpt2, quantize_logits=True)
    assert set(rows) == _gpt2_expected(tiny_gpt2) | {"lm.lm_head.output[0]"}
    assert rows["lm.lm_head.output[0]"]["kind"] == "activation"


def test_weight_bits_and_symmetric(tiny_gpt2):
    _, rows = _rows(tiny_gpt2, weight_bits=4, symmetric_weights=True, activation_bits=6)
    assert set(rows) == _gpt2_expected(tiny_gpt2)
    for name, row in rows.items():
        if row["kind"] == "weight":
            assert (row["bits"], row["symmetric"]) == (4, True), name
        else:
            assert (row["bits"], row["symmetric"]) == (6, False), name


def test_llama_placement(tiny_llama):
    _, rows = _rows(tiny_llama)
    layers = tiny_llama.config.num_hidden_layers
    expected = {"lm.model.embed_tokens.weight", "lm.model.norm.weight", "lm.lm_head.weight", "lm.lm_head.input[0]"}
    for i in range(layers):
        b = f"lm.model.layers.{i}"
        for linear in ("q_proj", "k_proj", "v_proj", "o_proj"):
            expected |= {f"{b}.self_attn.{linear}.weight", f"{b}.self_attn.{linear}.input[0]"}
        for linear in ("gate_proj", "up_proj", "down_proj"):
            expected |= {f"{b}.mlp.{linear}.weight", f"{b}.mlp.{linear}.input[0]"}
        for matmul in ("qk_matmul", "av_matmul"):
            expected |= {f"{b}.self_attn.{matmul}.input[0]", f"{b}.self_attn.{matmul}.input[1]"}
        expected |= {f"{b}.input_layernorm.weight", f"{b}.post_attention_layernorm.weight"}
    assert set(rows) == expected
    assert all(r["bits"] == 8 and not r["symmetric"] and r["granularity"] == "per-tensor" for r in rows.values())


def test_build_sim_leaves_fp_model_alone(tiny_gpt2):
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = tiny_gpt2(ids)
    sim = build_sim(tiny_gpt2)
    assert sim.model is not tiny_gpt2
    assert not list(quantizers(tiny_gpt2))
    with torch.no_grad():
        assert torch.equal(tiny_gpt2(ids), before)


def _calibrated_sim(model, **policy):
    sim = build_sim(model, QuantPolicy(**policy))
    gen = torch.Generator().manual_seed(0)
    calibrate(sim, [torch.randint(0, model.config.vocab_size, (1, 32), generator=gen) for _ in range(3)])
    return sim


def test_calibration_sets_every_range(tiny_gpt2):
    sim = _calibrated_sim(tiny_gpt2)
    rows = describe(sim.model)
    assert rows and all("min" in r and r["min"] < r["max"] for r in rows)
    text = format_description(rows)
    assert "not calibrated" not in text
    n_weights = sum(r["kind"] == "weight" for r in rows)
    assert text.splitlines()[-1] == f"{len(rows)} quantizers: {n_weights} weight, {len(rows) - n_weights} activation"


@pytest.mark.parametrize(("per_channel", "spill"), [(False, False), (True, False), (False, True)])
def test_fast_inference_bit_identical(tiny_gpt2, per_channel, spill, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the float weights wait when spilled
    sim = _calibrated_sim(tiny_gpt2, per_channel_weights=per_channel)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(7))
    before = {(p, r): q for p, r, q in quantizers(sim.model)}
    weights = {n: p.detach().clone() for n, p in sim.model.named_parameters() if n.endswith("weight")}
    with torch.no_grad():
        expected = sim.model(ids)
        with fast_inference(sim.model, spill_bytes=0 if spill else 1 << 40):
            assert not any(r == "weight" for _, r, _ in quantizers(sim.model))
            assert len(list(tmp_path.glob("*/*.pt"))) == (len(weights) if spill else 0)
            fast = sim.model(ids)
        after = sim.model(ids)
    assert not list(tmp_path.iterdir())
    assert torch.equal(fast, expected)
    assert torch.equal(after, expected)
    # The same quantizer objects are back, and the float weights are untouched.
    assert {(p, r): q for p, r, q in quantizers(sim.model)} == before
    for name, param in sim.model.named_parameters():
        if name in weights:
            assert torch.equal(param, weights[name]), name
    # Quantization is on: the sim's output is not the FP output.
    with torch.no_grad():
        assert not torch.equal(expected, tiny_gpt2(ids))


def test_fast_inference_restores_on_error(tiny_gpt2):
    sim = _calibrated_sim(tiny_gpt2)
    before = list(quantizers(sim.model))
    with pytest.raises(RuntimeError, match="boom"), fast_inference(sim.model):
        raise RuntimeError("boom")
    assert [(p, r, id(q)) for p, r, q in quantizers(sim.model)] == [(p, r, id(q)) for p, r, q in before]


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("weight_bits", {"weight_bits": 1}),
        ("weight_bits", {"weight_bits": 8.0}),
        ("activation_bits", {"activation_bits": 17}),
        ("quant_scheme", {"quant_scheme": "mse"}),
        ("percentile", {"quant_scheme": "percentile", "percentile": 120}),
    ],
)
def test_policy_validation(field, kwargs):
    with pytest.raises(QuadapterError, match=rf"^policy\.{field} must"):
        QuantPolicy(**kwargs)


def test_policy_label():
    assert QuantPolicy().label().startswith("W8A8 (asymmetric per-tensor")
    assert QuantPolicy(weight_bits=4, per_channel_weights=True).label().startswith("W4A8 (asymmetric per-channel")


@pytest.mark.parametrize(
    "scheme, analyzer",
    [
        ("min_max", "MinMaxEncodingAnalyzer"),
        ("tf_enhanced", "TfEnhancedEncodingAnalyzer"),
        ("percentile", "PercentileEncodingAnalyzer"),
    ],
)
def test_quant_scheme_chooses_aimets_encoding_analyzer(tiny_gpt2, scheme, analyzer):
    """Every quantizer the policy places calibrates with the analyzer of the scheme asked for, and the
    clipping schemes really set narrower activation ranges than min-max on text with outliers."""
    sim = _calibrated_sim(tiny_gpt2, quant_scheme=scheme, percentile=99.0)
    found = {type(q.encoding_analyzer).__name__ for _, _, q in quantizers(sim.model)}
    assert found == {analyzer}
    if scheme != "min_max":
        minmax = _calibrated_sim(tiny_gpt2)
        widths = {r["tensor"]: r["max"] - r["min"] for r in describe(minmax.model)}
        rows = [r for r in describe(sim.model) if r["kind"] == "activation"]
        assert any(r["max"] - r["min"] < 0.99 * widths[r["tensor"]] for r in rows)


@pytest.mark.parametrize("target", ["paper", "htp"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_building_and_calibrating_a_sim_shows_the_user_no_warning(arch, target):
    """AIMET's trace and its bias check make torch and transformers warn (tracer deprecated, int() of a traced
    shape, torch.tensor of a tensor): noise on every command that the user can do nothing about."""
    import warnings

    from aimet_quadapter.testing import sample_corpus, toy_model

    model = toy_model(arch)
    batches = [sample_corpus(model, 2, 32, seed=1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrate(build_sim(model, QuantPolicy(target=target)), batches)
    # the categories Python shows by default (deprecations are hidden outside __main__)
    shown = [w for w in caught if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))]
    assert not shown, [f"{w.category.__name__}: {str(w.message)[:100]}" for w in shown]


@pytest.mark.slow
def test_quiet_libraries_keeps_aimets_log_lines_away_from_the_user(tiny_gpt2_dir):
    """:func:`quiet_libraries` (every command, ``load_model(quiet=True)``) silences AIMET's loggers for good:
    AIMET configures its logging, back to INFO, the first time one of its loggers is asked for, which a sim
    build does, so levels set before that let every sim build print AIMET's INFO and WARNING lines. In a
    fresh interpreter, where the import order is real."""
    import logging
    import subprocess
    import sys

    script = (
        "import logging\n"
        "import torch\n"
        "from aimet_quadapter.models import load_model, quiet_libraries\n"
        "quiet_libraries()\n"
        f"model, _ = load_model({str(tiny_gpt2_dir)!r})\n"
        "from aimet_quadapter.quant.policy import build_sim, calibrate\n"  # as a run: AIMET after the model
        "calibrate(build_sim(model), [torch.zeros((1, 16), dtype=torch.long)])\n"
        "print(logging.getLogger('Quant').getEffectiveLevel())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == logging.ERROR
    assert " - Quant - " not in done.stderr + done.stdout


def _q4_1_rows(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """A weight expanded from GGUF Q4_1 blocks: 32 inputs each, 16 levels of their own scale and minimum."""
    codes = torch.randint(0, 16, (rows, cols // 32, 32), generator=generator).float()
    scale = torch.rand(rows, cols // 32, 1, generator=generator) * 0.01 + 1e-3
    low = -torch.rand(rows, cols // 32, 1, generator=generator) * 0.08
    return (codes * scale + low).reshape(rows, cols)


def test_weight_grid_screen_refuses_what_aimets_search_refuses_and_passes_a_grid_on(monkeypatch):
    import aimet_torch.nn.base as aimet_base
    from aimet_torch.utils import _DecompositionError

    from aimet_quadapter.quant.aimet_private import weight_grid_screened

    searched = []
    aimet_search = aimet_base._decompose_prequantized_tensor

    def counted(tensor, *args, **kwargs):
        searched.append(tuple(tensor.shape))
        return aimet_search(tensor, *args, **kwargs)

    monkeypatch.setattr(aimet_base, "_decompose_prequantized_tensor", counted)
    g = torch.Generator().manual_seed(0)
    blocks = _q4_1_rows(96, 576, g)  # SmolLM2's row length: AIMET's sample of 258 elements holds <= 129 magnitudes
    on_grid = torch.randint(-128, 128, (96, 576), generator=g).float() * (torch.rand(96, 1, generator=g) + 0.1)

    def search(tensor):
        return aimet_base._decompose_prequantized_tensor(tensor, -128, 127, scale_shape=(tensor.shape[0], 1))

    with pytest.raises(_DecompositionError):
        search(blocks)  # AIMET's full search, and its answer
    assert searched == [(96, 576)]
    expected = search(on_grid)
    searched.clear()
    with weight_grid_screened():
        with pytest.raises(_DecompositionError):
            search(blocks)
        assert searched == []  # refused before AIMET's search
        codes, scale = search(on_grid)
        assert searched == [(96, 576)]
    assert torch.equal(codes, expected[0]) and torch.equal(scale, expected[1])
    assert aimet_base._decompose_prequantized_tensor is counted  # put back


def test_calibration_sets_the_ranges_aimets_own_passes_set_and_takes_the_fast_path_for_fixed_ranges(
    tiny_llama, monkeypatch
):
    import contextlib

    import aimet_quadapter.quant.policy as policy_module
    from aimet_quadapter.quant import quantizers as quantizers_module

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, tiny_llama.config.vocab_size, (1, 24), generator=g) for _ in range(3)]
    fast = []
    ste = quantizers_module.FakeQuantSTE.apply
    monkeypatch.setattr(quantizers_module.FakeQuantSTE, "apply", lambda *args: fast.append(1) or ste(*args))

    def calibrated(passes):
        monkeypatch.setattr(policy_module, "calibration_passes", passes)
        sim = build_sim(tiny_llama, QuantPolicy(target="htp"))
        fixed = [q for _, _, q in quantizers(sim.model) if q.is_initialized() and not q.is_overwrite_allowed()]
        fast.clear()
        calibrate(sim, batches)
        return {f"{p}.{r}": (q.get_min(), q.get_max()) for p, r, q in quantizers(sim.model)}, fixed, len(fast)

    ranges, fixed, fast_calls = calibrated(policy_module.calibration_passes)
    expected, _, fast_calls_without = calibrated(lambda model: contextlib.nullcontext())
    # the fixed ranges (the sigmoid's, softmax's outputs): each on the fast path once per batch, and only here
    assert fixed and fast_calls == len(fixed) * len(batches) and fast_calls_without == 0
    assert ranges.keys() == expected.keys()
    for name, (lo, hi) in ranges.items():
        assert torch.equal(lo, expected[name][0]) and torch.equal(hi, expected[name][1]), name
