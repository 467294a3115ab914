"""A prefix held as a full-precision KV cache (PrefixQuant): the text after it computes what prefix + text does in
one pass, its activations stay out of the static ranges, the cache follows every change of the weights, and the
export carries it to every form of the model."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from aimet_torch.utils import remove_all_quantizers

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.models import tiny_model
from aimet_quadapter.quadapter.api import apply_cle, apply_quadapter, attach_quadapters
from aimet_quadapter.quadapter.config import Phase1Parameters, Phase2Parameters, QuadapterParameters
from aimet_quadapter.quadapter.phase2 import run_phase2
from aimet_quadapter.quant.policy import build_sim, calibrate
from aimet_quadapter.quant.quantizers import quantizers

PREFIX = [3, 5]


def _batches(vocab: int, n: int = 2, length: int = 16, low: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(low, vocab, (1, length), generator=g) for _ in range(n)]


def _one_pass(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``ids`` computed with the prefix in the same sequence, by the model without a prefix."""
    saved = model.prefix_ids, model.prefix_kv
    model.prefix_ids = model.prefix_kv = None
    try:
        with torch.no_grad():
            full = model(torch.cat([torch.tensor([PREFIX] * ids.shape[0]), ids], dim=1))
    finally:
        model.prefix_ids, model.prefix_kv = saved
    return full[:, len(PREFIX) :]


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "phi3", "gemma2"])
def test_text_after_the_prefix_cache_gives_the_logits_of_one_pass(family):
    model = tiny_model(family)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = _one_pass(model, ids)
    model.set_prefix(PREFIX)
    with torch.no_grad():
        assert torch.allclose(model(ids), expected, atol=1e-5)
        # generation starts after the prefix too
        logits, cache = model.step(ids[:, :5])
        assert cache.get_seq_length() == len(PREFIX) + 5
        assert torch.allclose(logits, expected[:, :5], atol=1e-5)


def test_the_prefix_stays_out_of_the_static_ranges():
    model = tiny_model("llama")
    embedding = model.get_submodule(f"lm.{model.arch.embedding}")
    with torch.no_grad():  # token 7: one outsized channel, as an attention sink's
        embedding.weight[7] = 0.0
        embedding.weight[7, 0] = 50.0
    batches = _batches(model.config.vocab_size, low=8)

    def first_range(prefix: list[int], lead: list[int]) -> float:
        model.set_prefix(prefix)
        sim = build_sim(model)
        calibrate(sim, [torch.cat([torch.tensor([lead]), b], dim=1) if lead else b for b in batches])
        return next(float(q.get_max().max()) for p, r, q in quantizers(sim.model) if r == "input[0]")

    plain = first_range([], [])
    assert first_range([], [7]) > 10 * plain  # the outlier token in the text sets the range
    assert first_range([7], []) == pytest.approx(plain)  # in the prefix, it sets nothing


def test_the_prefix_cache_follows_the_fold_and_the_training():
    model = tiny_model("llama")
    model.set_prefix(PREFIX)
    batches = _batches(model.config.vocab_size, length=32)
    sim = build_sim(model)
    qset = apply_cle(sim, model, batches, extra_sites=True)  # the qk and v->o alphas change keys and values
    moved = [q.site.name for q in qset if q.site.cached and not torch.allclose(q.folded, torch.ones_like(q.folded))]
    assert moved
    ids = batches[0]
    with remove_all_quantizers(sim.model):
        assert torch.allclose(sim.model(ids), _one_pass(model, ids), atol=1e-4)

    params = QuadapterParameters(
        init="cle",
        extra_sites=True,
        phase1=Phase1Parameters(steps=2, loss_tokens=32),
        phase2=Phase2Parameters(steps=2, batch_size=1, seq_len=32, learn_ranges=True, loss="kd"),
    )
    sim = build_sim(model)
    result = apply_quadapter(sim, model, batches, batches, params, progress=False)
    assert result.phase1 is not None
    # phase 1 leaves the sites that move the cached keys and values alone; phase 2 trains them
    assert not any(name in result.phase1.losses for name in moved)
    with remove_all_quantizers(sim.model):
        assert torch.allclose(sim.model(ids), _one_pass(model, ids), atol=1e-4)
    assert result.state.metadata["prefix"] == PREFIX
    rebuilt = result.state.build_sim(tiny_model("llama"))
    with remove_all_quantizers(rebuilt.model):
        assert torch.allclose(rebuilt.model(ids), _one_pass(model, ids), atol=1e-4)


def test_phase2_recomputes_the_prefix_cache_after_every_step():
    model = tiny_model("llama")
    model.set_prefix(PREFIX)
    batches = _batches(model.config.vocab_size, length=32)
    sim = build_sim(model)
    calibrate(sim, batches)
    qset = attach_quadapters(sim, extra_sites=True)
    run_phase2(sim.model, qset, batches, Phase2Parameters(steps=2, batch_size=1, seq_len=32, lr_alpha=0.5))
    assert any(q.site.cached and q.theta.abs().max() > 0.1 for q in qset)  # keys and values moved
    with remove_all_quantizers(sim.model):  # the alphas still act through the hooks, not yet folded
        assert torch.allclose(sim.model(batches[0]), _one_pass(model, batches[0]), atol=1e-4)


@pytest.mark.slow
def test_a_prefixed_sim_exports_with_its_prefix_and_each_form_computes_what_the_sim_computes(tmp_path):
    from aimet_quadapter.export.exporter import export_quantized
    from aimet_quadapter.export.formats import PREFIX_KV
    from aimet_quadapter.export.hf import HFCheckpoint, load_hf_export
    from aimet_quadapter.export.kv import KVGraphRunner, KVGraphs

    model = tiny_model("llama")
    model.set_prefix(PREFIX)
    batches = _batches(model.config.vocab_size, length=24)
    sim = build_sim(model)
    calibrate(sim, batches)
    kv = KVGraphs(context=40, lengths=(8, 1))
    windows = _batches(model.config.vocab_size, n=2, length=24, low=1)
    # the verification reads each window after the prefix: 2 + 24 tokens must fit the context, with one to spare
    with pytest.raises(QuadapterError, match="after the 2 prefix tokens do not fit a KV context of 26"):
        export_quantized(sim, tmp_path / "no", 24, verify_windows=windows, formats=[KVGraphs(26, (8, 1))])
    # every form is verified against the sim inside: the full-sequence graphs, the KV graphs, the checkpoint
    result = export_quantized(sim, tmp_path / "e", 24, verify_windows=windows, formats=[kv, HFCheckpoint()])
    assert result.manifest["prefix"]["ids"] == PREFIX
    assert result.manifest["kv"]["prefix"]["tokens"] == len(PREFIX)

    ids = windows[0][0]
    with torch.no_grad():
        expected = sim.model(ids[None])[0]
    runner = KVGraphRunner(result.out_dir / "kv", kv, model.kv_shape())
    assert runner.filled == len(PREFIX)  # the host starts from the prefix's keys and values
    assert torch.allclose(torch.from_numpy(runner.logits(ids.tolist(), 8)), expected, atol=1e-4)
    # without the file, a host reads the text from an empty cache: another function
    (result.out_dir / "kv" / PREFIX_KV).unlink()
    bare = KVGraphRunner(result.out_dir / "kv", kv, model.kv_shape())
    assert not torch.allclose(torch.from_numpy(bare.logits(ids.tolist(), 8)), expected, atol=1e-2)

    reloaded, _ = load_hf_export(result.out_dir)
    assert reloaded.model.prefix_ids[0].tolist() == PREFIX
    with torch.no_grad():
        assert torch.allclose(reloaded.model(ids[None])[0], expected, atol=1e-4)


def _gpt2_tokenizer(folder):
    """GPT-2's tokenizer class with GPT-2's special tokens (its defaults), on a vocabulary of three tokens."""
    from transformers import GPT2TokenizerFast

    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps({"<|endoftext|>": 0, "a": 1, "\u010a": 2}))  # Ċ: byte-level "\n"
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return GPT2TokenizerFast(str(folder / "vocab.json"), str(folder / "merges.txt"))


def test_the_auto_prefix_of_a_model_without_bos_is_its_eos_and_a_new_line(tmp_path, tiny_tokenizer):
    from aimet_quadapter.models.prefix import model_prefix

    gpt2 = _gpt2_tokenizer(tmp_path / "gpt2")
    assert model_prefix(gpt2) == "<|endoftext|>\n"
    assert gpt2(model_prefix(gpt2), add_special_tokens=False)["input_ids"] == [0, 2]
    assert tiny_tokenizer.bos_token is None and model_prefix(tiny_tokenizer) == "<eos>\n"
    bare = copy.deepcopy(tiny_tokenizer)
    bare.eos_token = None
    assert model_prefix(bare) is None


@pytest.mark.slow  # converts the real SmolLM2 file's tokenizer
def test_the_auto_prefix_of_smollm2_is_the_prefix_its_recipes_chose():
    """``prefix: auto`` in _smollm2.yaml gives the tokens of the "<|im_start|>\\n" it replaced."""
    from aimet_quadapter.models.loading import OFFLINE_MODELS, load_tokenizer
    from aimet_quadapter.models.prefix import model_prefix

    if importlib.util.find_spec(OFFLINE_MODELS["smollm2-135m"].package) is None:
        pytest.skip(f"{OFFLINE_MODELS['smollm2-135m'].requirement} is not installed")
    recipe = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "_smollm2.yaml").read_text())
    assert recipe["model"] == "smollm2-135m" and recipe["prefix"] == "auto"
    tokenizer = load_tokenizer("smollm2-135m")
    assert model_prefix(tokenizer) == "<|im_start|>\n"
    assert tokenizer(model_prefix(tokenizer), add_special_tokens=False)["input_ids"] == [1, 198]
