"""AIMET's LLM techniques as methods of the registry: each through AIMET's entry point, refused with AIMET's reason
where AIMET refuses, composed with Quadapter, and exported as plain weights."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest
import torch

from aimet_quadapter.cli import main
from aimet_quadapter.models import quiet_libraries
from aimet_quadapter.quant.config import BaselineParameters, FPTQuantParameters, OmniQuantParameters, QuantPolicy
from aimet_quadapter.quant.llm_techniques import AIMET_SUPPORT, refusal, spinquant_model
from aimet_quadapter.running.cell_files import CellFiles
from aimet_quadapter.testing import sample_corpus, toy_model

quiet_libraries()
ALL = "fp,ptq,spinquant,adascale,omniquant,fptquant,seq_mse,adaround,spinquant_quadapter,quadapter_seq_mse"
ALL += ",spinquant_cle_phase2,quadapter_adaround"  # spinquant_quadapter's matched baseline; Quadapter then AdaRound
ALL += ",fptquant_quadapter,fptquant_cle_phase2"  # the same composition and baseline on FPTQuant's model
ALL += ",spinquant_quadapter_bc_qat,spinquant_qat"  # the paper's BC+QAT on the rotated model and its baseline
# the compositions' starts, each row compared with its own: Quadapter's cell (they continue from it: catalog
# continues), CLE + phase 2 unrotated
ALL += ",quadapter,cle_phase2"
TINY_BUDGET = [
    "--phase1-steps", "2", "--phase2-steps", "2", "--phase2-batch-size", "1", "--phase2-seq-len", "32",
    "--baselines-adascale-iterations", "2", "--baselines-omniquant-iterations", "2",
    "--baselines-fptquant-iterations", "2", "--baselines-adaround-iterations", "2",
    "--baselines-seq-mse-candidates", "2", "--baselines-adaround-batches", "1",
]  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory, tiny_tokenizer):
    """A tiny checkpoint of the family (planted outlier channels, untied head) with the test tokenizer."""
    folder = tmp_path_factory.mktemp("models") / request.param
    model = toy_model(request.param)
    model.lm.config.tie_word_embeddings = False
    model.lm.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return request.param, folder


def test_every_aimet_technique_and_composition_runs_from_the_command_line(checkpoint, corpus_dir, tmp_path):
    family, folder = checkpoint
    out = tmp_path / "r.json"
    argv = ["eval", "--model", str(folder), "--dataset", str(corpus_dir), "--methods", ALL, "--no-progress"]
    argv += ["--seq-len", "32", "--max-tokens", "128", "--calib-samples", "2", "--calib-len", "32", *TINY_BUDGET]
    # AdaScale and OmniQuant: AIMET's symmetric weights (asymmetric ones are refused, tested below)
    argv += ["--policy-symmetric-weights", "--out", str(tmp_path / "run"), "--json", str(out)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(argv) == 0
    # AIMET's OmniQuant steps a shared scale once per quantizer holding it (docs/method.md): nothing to act on
    assert not [w for w in caught if "duplicate parameters" in str(w.message)]
    cells = {c["method"]: c for c in json.loads(out.read_text())["cells"].values()}
    assert set(cells) == set(ALL.split(","))
    ppl = {name: cell["ppl"][corpus_dir.stem] for name, cell in cells.items()}
    assert all(np.isfinite(v) for v in ppl.values()), ppl
    _each_row_moves_from_where_it_starts(ppl, {name: cell["info"] for name, cell in cells.items()})
    # every quantized row left a state that exports: its weights where the technique changed them
    states = {p.stem: p for p in (tmp_path / "run").rglob("*.safetensors")}
    assert set(ALL.split(",")) - {"fp"} <= set(states)
    from aimet_quadapter.quadapter.state import QuadapterState

    transformed = ("spinquant_quadapter", "spinquant_cle_phase2", "fptquant_quadapter", "fptquant_cle_phase2")
    transformed += ("spinquant_quadapter_bc_qat", "spinquant_qat")
    for name in ("spinquant", "fptquant", "adascale", "omniquant", *transformed):
        assert QuadapterState.load(states[name]).weights, f"{name}'s state lost its weights"
    for name, path in states.items():  # the export's manifest names the method from this
        assert QuadapterState.load(path).metadata["method"] == name
    assert not QuadapterState.load(states["ptq"]).weights


# One seed, one process, on the CPU: a technique that does nothing gives its start's perplexity to the last bit, and
# float32 rounding moves one by about 1e-6 relative; a move of 1e-4 in log perplexity is 100x that noise (a seed's
# spread is not measured here: it would take a run per seed). Not 1e-3: two phase-2 steps of ranges on FPTQuant's
# model move the llama toy's row by 5e-4.
NOISE = 1e-4


def _each_row_moves_from_where_it_starts(ppl: dict[str, float], info: dict[str, dict]) -> None:
    """Each technique's row against the row it starts from in the same run, in the direction it claims."""

    def off(a: str, b: str) -> float:
        return abs(math.log(ppl[a] / ppl[b]))

    # the outliers planted in the toy are what rotations and learned rounding or scales are for: nearer FP32 than PTQ
    for name in ("spinquant", "fptquant", "adascale", "adaround"):
        assert off(name, "fp") < off("ptq", "fp") - NOISE, (name, ppl)
    # OmniQuant's 2 steps a block overshoot past FP32's perplexity on the llama toy (a text the model does not
    # predict): it claims only a move from PTQ at this budget
    assert off("omniquant", "ptq") > NOISE, ppl
    # SeqMSE's grid (k/N of each min-max range) keeps the min-max range of every layer of this toy at 8 bits: its row
    # is PTQ's, and the compositions below are where a SeqMSE that does nothing shows
    assert info["seq_mse"]["seq_mse_layers_changed"] == 0 and ppl["seq_mse"] == ppl["ptq"]
    # the compositions, from their start: Quadapter's saved cell (weight ranges searched again on the folded
    # weights), or SpinQuant's rotation (and the same method unrotated); no direction at 2 phase-2 steps
    for name, start in (
        ("quadapter_seq_mse", "quadapter"),
        ("quadapter_adaround", "quadapter"),
        ("spinquant_quadapter", "spinquant"),
        ("spinquant_quadapter", "quadapter"),
        ("spinquant_cle_phase2", "spinquant"),
        ("spinquant_cle_phase2", "cle_phase2"),
        ("fptquant_quadapter", "fptquant"),
        ("fptquant_quadapter", "quadapter"),
        ("fptquant_cle_phase2", "fptquant"),
        ("fptquant_cle_phase2", "cle_phase2"),
        # BC+QAT against its baseline: test_a_rotated_training_state_rebuilds_the_sim_it_trained (here phase 1's
        # 2 steps beat no start, which it keeps: BC+QAT is QAT)
        ("spinquant_quadapter_bc_qat", "spinquant"),
        ("spinquant_qat", "spinquant"),
    ):
        assert off(name, start) > NOISE, (name, start, ppl)


@pytest.mark.parametrize("name", ["spinquant", "adascale", "omniquant", "fptquant"])
def test_a_technique_state_exports_and_verifies(name, tmp_path):
    """The export rebuilds the sim from the FP model and the state (the transformed weights, the ranges) and checks
    in onnxruntime that its graphs compute what that sim computes; a rotation is plain weights once merged."""
    from aimet_quadapter.export.exporter import export_quantized
    from aimet_quadapter.methods.registry import MethodContext, run_method
    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.text.perplexity import perplexity

    model = toy_model("llama")
    corpus = sample_corpus(model, 6, 32, seed=1)
    policy = QuantPolicy(symmetric_weights=True)
    ctx = MethodContext(model, policy, [corpus[:2]], out_dir=tmp_path, progress=False, records=CellFiles(tmp_path))
    ctx.baselines = BaselineParameters(adascale_iterations=2, omniquant_iterations=2, fptquant_iterations=2)
    sim = run_method(name, ctx)
    state = QuadapterState.load(tmp_path / f"{name}.safetensors")
    rebuilt = state.build_sim(model)
    from aimet_quadapter.text.data import eval_windows

    windows = [w for row in corpus[2:4] for w in eval_windows(row, 32)]
    assert perplexity(rebuilt.model, windows, progress=False).ppl == pytest.approx(
        perplexity(sim.model, windows, progress=False).ppl, rel=1e-5
    )
    exported = export_quantized(rebuilt, tmp_path / "export", 32, verify_windows=list(corpus[4:6]))
    assert exported.manifest["verification"]


def test_omniquants_learned_weight_ranges_outlive_calibration(monkeypatch):
    """OmniQuant learns each weight's range; the static calibration after it, and any later one, must keep it
    (recomputed from the quantize-dequantized weights it comes out a few ulps off), as AIMET keeps AdaScale's."""
    from aimet_torch.experimental.omniquant.let_quantizer import OmqQuantizeDequantize

    from aimet_quadapter.quant import aimet_private
    from aimet_quadapter.quant.llm_techniques import apply_omniquant
    from aimet_quadapter.quant.policy import build_sim, calibrate
    from aimet_quadapter.quant.quantizers import quantizers

    learned: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    plain = aimet_private._plain_weight_quantizers

    def keep_learned(before: dict) -> None:  # OmniQuant's quantizers, as it leaves them
        paths = {module: path for path, module in sim.model.named_modules()}
        for module in before:
            for name, q in module.param_quantizers.items():
                if isinstance(q, OmqQuantizeDequantize):
                    learned[f"{paths[module]}.{name}"] = (q.min.detach().clone(), q.max.detach().clone())
        plain(before)

    monkeypatch.setattr(aimet_private, "_plain_weight_quantizers", keep_learned)
    model = toy_model("llama")
    corpus = sample_corpus(model, 4, 32, seed=1)
    sim = build_sim(model, QuantPolicy(symmetric_weights=True))
    apply_omniquant(sim, model, [corpus[:2]], OmniQuantParameters(omniquant_iterations=2))
    calibrate(sim, [corpus[2:4]])
    found = {f"{path}.{role}": q for path, role, q in quantizers(sim.model)}
    assert len(learned) == 14  # q, k, v, o, gate, up, down of both blocks
    for key, (lo, hi) in learned.items():
        assert torch.equal(found[key].min, lo) and torch.equal(found[key].max, hi), key


@pytest.mark.parametrize(
    "name",
    [
        "spinquant_quadapter",
        "spinquant_cle_phase2",
        "fptquant_quadapter",
        "fptquant_cle_phase2",
        "spinquant_quadapter_bc_qat",
    ],
)
def test_a_rotated_training_state_rebuilds_the_sim_it_trained(name, tmp_path):
    """A state of training on the rotated model holds the rotated weights unfolded and its alphas apart (BC+QAT:
    the alphas folded into the weights it trained, none apart): folded twice or not rotated, the rebuilt sim would
    compute otherwise."""
    from aimet_quadapter.methods.registry import MethodContext, run_method
    from aimet_quadapter.quadapter.config import Phase1Parameters, Phase2Parameters, QuadapterParameters
    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.text.data import eval_windows
    from aimet_quadapter.text.perplexity import perplexity

    model = toy_model("llama")
    corpus = sample_corpus(model, 8, 32, seed=1)
    params = QuadapterParameters(  # phase 1 keeps alphas of its own at 4 steps (at 2, its start)
        phase1=Phase1Parameters(steps=4), phase2=Phase2Parameters(steps=2, batch_size=2, learn_ranges=True)
    )
    ctx = MethodContext(model, QuantPolicy(), [corpus[:2]], [corpus[2:4]], params, out_dir=tmp_path, progress=False)
    ctx.baselines = BaselineParameters(fptquant_iterations=2)
    ctx.records = CellFiles(tmp_path)
    sim = run_method(name, ctx)
    state = QuadapterState.load(tmp_path / f"{name}.safetensors")
    assert state.weights and bool(state.alphas) == ("qat" not in name)
    # the cell's one state: phase 1's alphas of the rotated model, without its weights, are no model to export
    assert [p.name for p in tmp_path.glob("*.safetensors")] == [f"{name}.safetensors"]
    windows = [w for row in corpus[4:8] for w in eval_windows(row, 32)]
    assert perplexity(state.build_sim(model).model, windows, progress=False).ppl == pytest.approx(
        perplexity(sim.model, windows, progress=False).ppl, rel=1e-5
    )
    if name == "spinquant_quadapter_bc_qat":  # phase 1's alphas are in the weights QAT started from: not QAT's
        qat_files = CellFiles(tmp_path / "qat")
        run_method("spinquant_qat", dataclasses.replace(ctx, out_dir=tmp_path / "qat", info={}, records=qat_files))
        qat = QuadapterState.load(tmp_path / "qat" / "spinquant_qat.safetensors").weights
        assert qat.keys() == state.weights.keys()
        assert any(not torch.equal(w, qat[n]) for n, w in state.weights.items() if "proj" in n)


@pytest.mark.parametrize("name", ["spinquant_quadapter", pytest.param("spinquant_cle_phase2", marks=pytest.mark.slow)])
def test_the_fp_model_waits_on_disk_while_its_rotated_copy_trains(name, tmp_path, monkeypatch):
    """A cell on the rotated model reads its copy, not the FP model: the FP model's weights are on disk while
    phase 2 trains (the third copy of the weights at the cell's peak), and back bit for bit for the next cell."""
    from aimet_quadapter.methods import registry
    from aimet_quadapter.quadapter import api
    from aimet_quadapter.quadapter.config import Phase1Parameters, Phase2Parameters, QuadapterParameters

    model = toy_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    corpus = sample_corpus(model, 4, 32, seed=1)
    params = QuadapterParameters(phase1=Phase1Parameters(steps=2), phase2=Phase2Parameters(steps=1, batch_size=2))
    ctx = registry.MethodContext(model, QuantPolicy(), [corpus[:2]], [corpus[2:4]], params, out_dir=tmp_path)
    ctx.progress = False
    held: list[int] = []

    def watched(*args, **kwargs):
        held.append(sum(p.numel() for p in model.parameters()))
        return run_phase2(*args, **kwargs)

    run_phase2 = registry.run_phase2
    monkeypatch.setattr(registry, "run_phase2", watched)
    monkeypatch.setattr(api, "run_phase2", watched)
    registry.run_method(name, ctx)
    total = sum(p.numel() for p in before.values())
    # what the rotated copy still shares with the FP model (none of the rotated weights) is all that stays
    assert held and all(h < total / 10 for h in held), (held, total)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not list(tmp_path.glob(".parked-fp-*"))


def _assert_same_prefix_and_logits(sim, rebuilt, ids: torch.Tensor) -> None:
    """The run's sim and the one its state rebuilds: the same prefix cache and logits, bit for bit."""
    for (k, v), (k2, v2) in zip(sim.model.prefix_kv, rebuilt.model.prefix_kv, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    with torch.no_grad():
        assert torch.equal(sim.model(ids), rebuilt.model(ids))


@pytest.mark.parametrize("target", ["paper", "htp"])
@pytest.mark.parametrize("name", ["cle_phase2", "spinquant_cle_phase2"])
def test_a_state_rebuilds_the_prefix_cache_its_run_scored_with(name, target, tmp_path):
    """The run scores the sim in memory, the export and `eval` the sim its state rebuilds: the prefix's cache of
    both is computed through the sim's own ops from the same weights, bit for bit (through the FP model's ops, or
    from AIMET's transposed merged weights, it is a few ulps off, which a sensitive state's perplexity magnifies)."""
    from aimet_quadapter.methods.registry import MethodContext, run_method
    from aimet_quadapter.quadapter.config import Phase1Parameters, Phase2Parameters, QuadapterParameters
    from aimet_quadapter.quadapter.state import QuadapterState

    model = toy_model("llama")
    model.set_prefix([3, 5])
    corpus = sample_corpus(model, 6, 32, seed=1)
    policy = QuantPolicy(target="htp", bit_overrides=["*.residual_adds.*=16"]) if target == "htp" else QuantPolicy()
    params = QuadapterParameters(phase1=Phase1Parameters(steps=2), phase2=Phase2Parameters(steps=2, batch_size=2))
    ctx = MethodContext(model, policy, [corpus[:2]], [corpus[2:4]], params, out_dir=tmp_path, progress=False)
    ctx.records = CellFiles(tmp_path)
    sim = run_method(name, ctx)
    rebuilt = QuadapterState.load(tmp_path / f"{name}.safetensors").build_sim(model)
    _assert_same_prefix_and_logits(sim, rebuilt, corpus[4:6])


@pytest.mark.parametrize("name", ["adaround", "adascale", "omniquant"])
def test_a_technique_that_changes_weights_calibrates_on_their_prefix_cache(name, tmp_path):
    """AdaRound's rounding and AdaScale's and OmniQuant's folds change the weights the prefix's keys and values come
    from: the cache is computed again before the activations are calibrated, as the sim rebuilt from the state
    computes it (left as it was, the cache is that of other weights, OmniQuant's keys far from it)."""
    from aimet_quadapter.methods.registry import MethodContext, run_method
    from aimet_quadapter.quadapter.config import QuadapterParameters
    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.quant.policy import calibrate
    from aimet_quadapter.quant.quantizers import quantizers

    model = toy_model("llama")
    model.set_prefix([3, 5])
    corpus = sample_corpus(model, 6, 32, seed=1)
    policy = QuantPolicy(symmetric_weights=True)
    ctx = MethodContext(
        model, policy, [corpus[:2]], [corpus[2:4]], QuadapterParameters(), out_dir=tmp_path, progress=False
    )
    ctx.records = CellFiles(tmp_path)
    ctx.baselines = BaselineParameters(adaround_iterations=2, adascale_iterations=2, omniquant_iterations=2)
    sim = run_method(name, ctx)
    state = QuadapterState.load(tmp_path / f"{name}.safetensors")
    assert state.weights  # the technique changed weights: else this would test nothing
    rebuilt = state.build_sim(model)
    _assert_same_prefix_and_logits(sim, rebuilt, corpus[4:6])
    # the activations' ranges are a calibration's on the new cache (the weights' as the technique left them)
    for _, role, q in quantizers(rebuilt.model):
        if role == "weight":
            q.allow_overwrite(False)
    calibrate(rebuilt, ctx.calibration)
    again = {f"{p}.{r}": q for p, r, q in quantizers(rebuilt.model)}
    for path, role, q in quantizers(sim.model):
        if q.is_initialized():
            other = again[f"{path}.{role}"]
            assert torch.equal(q.min, other.min) and torch.equal(q.max, other.max), f"{path}.{role}"


def test_an_order_576_hadamard_is_one_and_leaves_aimets_own_orders_alone():
    """SmolLM2's hidden size (576) has no Hadamard matrix in AIMET: the package adds H144 = H12 x H12, a true
    Hadamard matrix, through AIMET's own builder, which then gives every order it gave before unchanged."""
    from aimet_torch.common.hadamard.hadamard_utils import get_hadamard_matrix

    from aimet_quadapter.quant.aimet_private import extra_hadamard_orders

    before = {n: get_hadamard_matrix(n) for n in (64, 96, 768)}
    with pytest.raises(AssertionError, match="576 not supported"):
        get_hadamard_matrix(576)
    with extra_hadamard_orders():
        h = get_hadamard_matrix(576)
        assert all(np.array_equal(get_hadamard_matrix(n), m) for n, m in before.items())
    assert set(np.unique(h)) == {-1.0, 1.0}
    assert np.array_equal(h @ h.T, 576 * np.eye(576))
    with pytest.raises(AssertionError):  # nothing left behind
        get_hadamard_matrix(576)


def test_spinquant_rotates_a_hidden_size_aimet_lacks_and_keeps_the_function():
    """A hidden size of 144 (AIMET: unsupported) is rotated with the added order; where AIMET has the order (64),
    the rotated weights are AIMET's own, bit for bit."""
    from aimet_torch.spinquant import apply_spinquant

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    for hidden in (144, 64):
        model = toy_model("llama", hidden=hidden, heads=4)
        rotated = spinquant_model(model)
        with torch.no_grad():
            assert torch.allclose(rotated(ids), model(ids), atol=1e-3)
        assert not torch.equal(rotated.lm.lm_head.weight, model.lm.lm_head.weight)
    import copy

    unpatched = copy.deepcopy(model)
    apply_spinquant(unpatched.lm, enable_r1=True, enable_r2=False)
    for (name, a), (_, b) in zip(rotated.named_parameters(), unpatched.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fptquant_changes_the_weights_and_keeps_the_fp_function(family):
    """FPTQuant's transforms, fitted and merged, are an FP-equivalent copy: other weights, the same logits up to
    float32 rounding. Measured here: at most 47 ulps of the largest logit (sums of up to 128 products taken in
    another order through two blocks); a transform merged wrong moves them by orders of magnitude more."""
    from aimet_quadapter.quant.llm_techniques import fptquant_model

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    model = toy_model(family)
    transformed = fptquant_model(model, FPTQuantParameters(fptquant_iterations=2))
    changed = [
        n for (n, a), (_, b) in zip(transformed.named_parameters(), model.named_parameters()) if not torch.equal(a, b)
    ]
    assert len(changed) > 10, changed  # the rotated residual reaches every block's weights
    with torch.no_grad():
        ours, theirs = transformed(ids), model(ids)
    bound = 256 * torch.finfo(torch.float32).eps * theirs.abs().max()
    assert (ours - theirs).abs().max() <= bound


def test_fptquant_fits_once_per_weights_and_steps(tmp_path, monkeypatch):
    """FPTQuant's fit reads only the weights: a second call on the same weights and step count takes the kept
    weights without fitting; other steps, other weights, another way of calling AIMET or a damaged file fit
    again."""
    from aimet_torch.experimental.fptquant.fptquant_optimizer import FPTQuant

    from aimet_quadapter.cache import CACHE_ENV
    from aimet_quadapter.quant import aimet_private
    from aimet_quadapter.quant.llm_techniques import fptquant_model

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model = toy_model("qwen2")
    first = fptquant_model(model, FPTQuantParameters(fptquant_iterations=2))
    fit = FPTQuant.insert_fpt_quant_transforms

    def refuse(*args):
        raise AssertionError("fitted again")

    monkeypatch.setattr(FPTQuant, "insert_fpt_quant_transforms", staticmethod(refuse))
    again = fptquant_model(model, FPTQuantParameters(fptquant_iterations=2))
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), first.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))
    with pytest.raises(AssertionError, match="fitted again"):
        fptquant_model(model, FPTQuantParameters(fptquant_iterations=3))
    model.lm.lm_head.weight.data.mul_(2)
    with pytest.raises(AssertionError, match="fitted again"):
        fptquant_model(model, FPTQuantParameters(fptquant_iterations=2))
    model.lm.lm_head.weight.data.div_(2)
    calls = aimet_private.fptquant

    def other_call(iterations):  # as if this package enabled another of AIMET's transforms
        return calls(iterations)

    with monkeypatch.context() as patch:
        patch.setattr(aimet_private, "fptquant", other_call)
        with pytest.raises(AssertionError, match="fitted again"):
            fptquant_model(model, FPTQuantParameters(fptquant_iterations=2))

    (kept,) = (tmp_path / "transforms").glob("fptquant-2-*")
    kept.write_bytes(kept.read_bytes()[:100])
    monkeypatch.setattr(FPTQuant, "insert_fpt_quant_transforms", fit)
    refitted = fptquant_model(model, FPTQuantParameters(fptquant_iterations=2))
    assert all(torch.equal(a, b) for a, b in zip(refitted.parameters(), first.parameters()))
    assert kept.stat().st_size > 100


@pytest.mark.parametrize(
    "method, family, reason",
    [
        ("spinquant", "gpt2", "method spinquant: AIMET's spinquant supports the families llama, qwen2, qwen3, phi3"),
        ("adascale", "llama", "method adascale: AIMET's adascale quantizes weights symmetrically only"),
        ("omniquant", "llama", "method omniquant: AIMET's omniquant quantizes weights symmetrically only"),
    ],
)
def test_a_technique_aimet_refuses_is_one_line_before_the_model_loads(
    method, family, reason, tiny_gpt2_dir, tiny_tokenizer, corpus_dir, tmp_path, capsys, never_load
):
    from conftest import hf_tiny

    folder = tiny_gpt2_dir
    if family != "gpt2":
        folder = tmp_path / family
        hf_tiny(family).save_pretrained(folder)
        tiny_tokenizer.save_pretrained(folder)
    argv = ["eval", "--model", str(folder), "--dataset", str(corpus_dir), "--methods", f"fp,{method}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("aimet-quadapter: error: ") and reason in err


def test_the_support_table_is_aimets():
    """AIMET_SUPPORT names the families whose backbone class AIMET's own registries hold."""
    from aimet_torch.adascale.adascale_optimizer import adascale_model_config_dict
    from aimet_torch.experimental.fptquant.fptquant_config import fptquant_model_config_dict
    from aimet_torch.experimental.omniquant.decoder_processor import model_to_block_mapping
    from aimet_torch.spinquant.spinquant_optimizer import SpinQuant

    from aimet_quadapter.models import ARCHITECTURES

    registries = {
        "spinquant": SpinQuant.model_config_dict,
        "fptquant": fptquant_model_config_dict,
        "adascale": adascale_model_config_dict,
        "omniquant": model_to_block_mapping,
    }
    for technique, registry in registries.items():
        names = {cls.__name__.lower() for cls in registry}
        for arch in ARCHITECTURES:
            held = f"{arch.name}model" in names
            assert held == (arch.name in AIMET_SUPPORT[technique].families), (technique, arch.name)
    assert refusal("adascale", "llama", QuantPolicy())
    assert not refusal("adascale", "llama", QuantPolicy(symmetric_weights=True))
