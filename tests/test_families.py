"""The families beyond GPT-2 and Llama (which the rest of the suite covers): the prepared model computes the
Hugging Face one, every site folds without changing it, and the whole pipeline runs on a saved checkpoint."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import hf_tiny
from torch import nn

from aimet_quadapter.cli import main
from aimet_quadapter.models import ARCHITECTURES, prepare_model
from aimet_quadapter.quadapter.adapter import fold_alphas

FAMILIES = ["mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]
# Gemma-2's attention scores go through tanh(s / cap) * cap: a cap near the test model's scores makes it count
CONFIG = {"gemma2": {"attn_logit_softcapping": 1.0}}
SEQ = 32


def _randomized(family: str):
    """A tiny model whose biases and norm weights are not their init values (zeros, ones), so a fold that forgot
    a bias or a norm would show, and whose attention scores are not all near zero (init's small q and k), so
    attention that computed them otherwise (Gemma-2's cap) would show too."""
    hf = hf_tiny(family, seed=3, **CONFIG.get(family, {}))
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias") or param.dim() == 1:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
            if any(part in name for part in ("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                param.mul_(8)
    return hf


def test_every_family_is_accepted_by_its_model_type():
    assert {a.name for a in ARCHITECTURES} >= {"gpt2", "llama", *FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_prepared_model_computes_the_hf_model_and_every_site_folds_exactly(family):
    hf = _randomized(family)
    original = copy.deepcopy(hf)
    model = prepare_model(hf)
    ids = torch.randint(0, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original(input_ids=ids).logits
        before = model(ids)
    assert (before - expected).abs().max().item() <= 1e-4
    sites = model.sites(extra=True)
    generator = torch.Generator().manual_seed(5)
    alphas = {}
    for site in sites:
        for consumer in site.consumers:
            assert isinstance(model.get_submodule(consumer), nn.Linear)
        channels = model.get_submodule(site.producer).weight.shape[0]
        alphas[site.name] = torch.exp(torch.randn(site.channels(channels), generator=generator))
    fold_alphas(model, sites, alphas)
    with torch.no_grad():
        after = model(ids)
    assert (after - expected).abs().max().item() <= 1e-4 * expected.abs().max().item() + 1e-5
    # the fold moved the weights (not vacuous): the producers' rows are no longer the original ones
    producer = sites[0].producer.removeprefix("lm.")
    assert not torch.equal(model.lm.get_submodule(producer).weight, original.get_submodule(producer).weight)


# the whole command line per family takes a quarter of a minute: every family under -m slow (the quick suite runs
# Qwen2's checkpoint through `eval` in test_aimet_techniques, and the export on GPT-2 and Llama)
QUICK_FAMILIES: tuple[str, ...] = ()


@pytest.mark.parametrize(
    "family", [f if f in QUICK_FAMILIES else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_eval_and_export_of_a_saved_checkpoint(family, tiny_tokenizer, corpus_dir, tmp_path, capsys):
    folder = tmp_path / family
    hf = _randomized(family)
    assert len(tiny_tokenizer) <= hf.config.vocab_size
    hf.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    run = tmp_path / "run"
    argv = ["eval", "--model", str(folder), "--dataset", str(corpus_dir), "--no-progress", "--out", str(run)]
    argv += ["--seq-len", "64", "--max-tokens", "256", "--calib-samples", "2", "--calib-len", str(SEQ)]
    argv += ["--phase1-steps", "2", "--phase2-steps", "2", "--phase2-batch-size", "1", "--phase2-seq-len", str(SEQ)]
    assert main([*argv, "--methods", "fp,ptq,cle,quadapter_bc,quadapter"]) == 0, capsys.readouterr().err
    cells = {c["method"]: c for c in json.loads((run / "results.json").read_text())["cells"].values()}
    assert set(cells) == {"fp", "ptq", "cle", "quadapter_bc", "quadapter"}
    ppl = {method: cell["ppl"][corpus_dir.stem] for method, cell in cells.items()}
    assert all(math.isfinite(p) for p in ppl.values()), ppl
    assert ppl["ptq"] != ppl["fp"]  # quantizers are in the graph
    (state,) = run.glob("*/quadapter/quadapter.safetensors")
    out = tmp_path / "export"
    export = ["export", str(state), "--model", str(folder), "--out", str(out), "--seq-len", str(SEQ)]
    export += ["--verify-dataset", str(corpus_dir), "--verify-windows", "2", "--no-progress"]
    assert main(export) == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["method"] == "quadapter" and manifest["verification"]["entries_applied"] > 0


def test_a_sliding_window_is_the_longest_sequence(tiny_tokenizer, corpus_dir, tmp_path, capsys, never_load):
    """Beyond its window a sliding-window layer is not the full-attention layer the sim's mask makes of it: such
    lengths are refused before the model loads. A window Qwen2 keeps but does not use limits nothing."""
    from aimet_quadapter.models.loading import max_positions

    for family, config, limit in (
        ("mistral", {"sliding_window": 48}, 48),
        ("qwen2", {"sliding_window": 48, "use_sliding_window": False}, 256),
    ):
        folder = tmp_path / family
        hf_tiny(family, **config).save_pretrained(folder)
        tiny_tokenizer.save_pretrained(folder)
        assert max_positions(str(folder)) == limit
    argv = ["eval", "--model", str(tmp_path / "mistral"), "--dataset", str(corpus_dir), "--seq-len", "64"]
    assert main([*argv, "--methods", "fp"]) == 2
    assert "64 exceeds the model's 48 positions" in capsys.readouterr().err


@pytest.mark.parametrize("family", [a.name for a in ARCHITECTURES])
def test_residual_sums_as_modules_compute_the_blocks_function_to_the_bit(family):
    """The prepared blocks sum through AIMET's Add modules (where ``htp`` quantizes them): the full-sequence and the
    KV-cache forward equal the block's own forward bit for bit, so that the paper's placement computes what it did."""
    from aimet_quadapter.models import PreparedLM

    arch = {a.name: a for a in ARCHITECTURES}[family]
    hf = hf_tiny(family, seed=3, **CONFIG.get(family, {}))
    arch.prepare(hf)
    own = PreparedLM(copy.deepcopy(hf), arch).eval()  # the blocks' own forward, sums as `+`
    prepared = prepare_model(hf, untie=False)
    assert all(len(list(b.residual_adds)) == 2 for b in prepared.get_submodule(f"lm.{arch.blocks}").children())
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(own(ids), prepared(ids))
        (a, cache_a), (b, cache_b) = own.step(ids[:, :20]), prepared.step(ids[:, :20])
        assert torch.equal(a, b)
        assert torch.equal(own.step(ids[:, 20:], cache_a)[0], prepared.step(ids[:, 20:], cache_b)[0])
