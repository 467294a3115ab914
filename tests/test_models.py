"""Model preparation: same FP function as the Hugging Face model, quantizable modules, untied head."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import platform
from pathlib import Path

import pytest
import torch
from aimet_torch.nn.modules.custom import MatMul
from conftest import hf_tiny
from torch import nn
from transformers.pytorch_utils import Conv1D

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.models import is_tied, load_model, own_storage, prepare_model, shares_storage, tiny_model
from aimet_quadapter.models.attention import ATTENTION_NAME


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prepared_model_matches_hf_model(family):
    seed = 3
    reference = hf_tiny(family, seed=seed)
    prepared = tiny_model(family, seed=seed)
    ids = torch.randint(0, reference.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = prepared(ids)
    assert got.shape == expected.shape == (2, 40, reference.config.vocab_size)
    assert (got - expected).abs().max().item() <= 1e-4
    # The comparison is not vacuous: another seed gives another function.
    with torch.no_grad():
        other = tiny_model(family, seed=seed + 1)(ids)
    assert (other - expected).abs().max().item() > 1e-2


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prepare_in_place_keeps_function(family):
    hf = hf_tiny(family, seed=5)
    original = copy.deepcopy(hf)
    prepared = prepare_model(hf)
    assert prepared.lm is hf
    ids = torch.randint(0, hf.config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (prepared(ids) - original(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_gpt2_conv1d_became_linear(tiny_gpt2):
    modules = list(tiny_gpt2.modules())
    assert not any(isinstance(m, Conv1D) for m in modules)
    hidden = tiny_gpt2.config.n_embd
    for block in tiny_gpt2.lm.transformer.h:
        for name, (out_f, in_f) in {
            "attn.c_attn": (3 * hidden, hidden),
            "attn.c_proj": (hidden, hidden),
            "mlp.c_fc": (4 * hidden, hidden),
            "mlp.c_proj": (hidden, 4 * hidden),
        }.items():
            linear = block.get_submodule(name)
            assert type(linear) is nn.Linear
            assert (linear.out_features, linear.in_features) == (out_f, in_f)
        assert isinstance(block.mlp.act, nn.GELU)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_attention_runs_through_quantizable_modules(family):
    model = tiny_model(family)
    attentions = [blk.attn if family == "gpt2" else blk.self_attn for blk in _blocks(model)]
    assert len(attentions) == model.config.num_hidden_layers
    calls = {"qk": 0, "av": 0, "softmax": 0}
    hooks = []
    for attn in attentions:
        assert isinstance(attn.qk_matmul, MatMul)
        assert isinstance(attn.av_matmul, MatMul)
        assert isinstance(attn.softmax, nn.Softmax)
        for key, mod in (("qk", attn.qk_matmul), ("av", attn.av_matmul), ("softmax", attn.softmax)):
            hooks.append(mod.register_forward_hook(lambda *_, k=key: calls.__setitem__(k, calls[k] + 1)))
    assert model.config._attn_implementation == ATTENTION_NAME
    with torch.no_grad():
        model(torch.zeros((1, 8), dtype=torch.long))
    for h in hooks:
        h.remove()
    assert calls == {k: len(attentions) for k in calls}


def _blocks(model):
    return [model.get_submodule(p) for p in model.block_paths()]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prepare_unties_lm_head(family):
    hf = hf_tiny(family)
    assert hf.lm_head.weight is hf.get_input_embeddings().weight  # both tiny configs tie
    model = prepare_model(hf)
    head = model.lm.lm_head.weight
    embedding = model.lm.get_input_embeddings().weight
    assert head is not embedding
    assert torch.equal(head, embedding)
    assert not is_tied(model)
    assert model.config.tie_word_embeddings is False
    # one vocabulary matrix held (the FP model lives through every cell) by two parameters, marked as sharing
    # it: a write in place after own_storage, as an optimizer's on a sim's weights, leaves the embedding
    assert head.data_ptr() == embedding.data_ptr() and shares_storage(head)
    before = embedding.detach().clone()
    with torch.no_grad():
        own_storage([head])
        head.mul_(2.0)
    assert torch.equal(embedding, before) and torch.equal(head, before * 2.0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prepare_without_untie_stays_tied(family):
    model = prepare_model(hf_tiny(family), untie=False)
    assert is_tied(model)
    assert model.lm.lm_head.weight is model.lm.get_input_embeddings().weight


def test_sites_resolve_to_modules(tiny_gpt2, tiny_llama):
    gpt2_sites = tiny_gpt2.sites()
    assert [s.name for s in gpt2_sites] == [
        "transformer.h.0.ln_1->c_attn",
        "transformer.h.0.ln_2->c_fc",
        "transformer.h.1.ln_1->c_attn",
        "transformer.h.1.ln_2->c_fc",
        "transformer.ln_f->lm_head",
    ]
    for model in (tiny_gpt2, tiny_llama):
        for site in model.sites(extra=True):
            model.get_submodule(site.producer)
            for consumer in site.consumers:
                assert isinstance(model.get_submodule(consumer), nn.Linear)
    # Llama: two paper sites per block plus the head; the extra groups add two ("linear") and one ("qk") per block.
    layers = tiny_llama.config.num_hidden_layers
    assert len(tiny_llama.sites(extra=False)) == 2 * layers + 1
    assert len(tiny_llama.sites()) == 4 * layers + 1  # the family's default: "linear"
    assert len(tiny_llama.sites(extra=["qk"])) == 3 * layers + 1
    assert len(tiny_llama.sites(extra=True)) == 5 * layers + 1


def test_qk_site_is_exact_under_rope_and_grouped_query_attention(tiny_llama):
    """Random alphas at every Q . K^T site (one per rotated pair, shared by a KV head's query heads) keep the
    FP function; the same alphas without the pair tie do not, so the test sees RoPE."""
    from aimet_quadapter.quadapter.adapter import QuadapterSet

    model = copy.deepcopy(tiny_llama)
    config = model.config
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention is exercised
    sites = [s for s in model.sites(extra=["qk"]) if s.consumer_rows]
    assert len(sites) == config.num_hidden_layers
    head_dim = config.hidden_size // config.num_attention_heads
    assert sites[0].rotary_head_dim == head_dim
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids)
    qset = QuadapterSet(model, sites).attach(model)
    assert next(iter(qset)).theta.numel() == config.num_key_value_heads * head_dim // 2
    generator = torch.Generator().manual_seed(1)
    for q in qset:
        q.set_alpha(torch.exp(2 * torch.randn(q.theta.shape, generator=generator)))
    with torch.no_grad():
        scaled = model(ids)
    assert (scaled - plain).abs().max() < 1e-4 * plain.abs().max()
    # the same alphas on each channel separately (no pair tie) break the rotation
    untied = {q.site.name: q.site.producer_scale(q.alpha.detach()) for q in qset}
    qset.detach()
    broken = [dataclasses.replace(s, rotary_head_dim=None) for s in sites]
    loose = QuadapterSet(model, broken).attach(model)
    generator = torch.Generator().manual_seed(2)
    for q in loose:
        q.set_alpha(untied[q.site.name] * torch.exp(torch.randn(q.theta.shape, generator=generator)))
    with torch.no_grad():
        assert (model(ids) - plain).abs().max() > 1e-2 * plain.abs().max()


def test_unknown_hub_model_offline_names_model_and_local_folder(offline):
    name = "no-such-org/no-such-model-xyz"
    with pytest.raises(QuadapterError) as info:
        load_model(name)
    message = str(info.value)
    assert name in message
    assert "--model DIR" in message and "folder" in message
    assert "\n" not in message


def test_missing_local_model_folder(tmp_path):
    missing = tmp_path / "nope" / "model"
    with pytest.raises(QuadapterError, match="does not exist") as info:
        load_model(str(missing))
    assert str(missing) in str(info.value)


def test_load_local_folder(tiny_gpt2_dir, tiny_tokenizer):
    model, tokenizer = load_model(str(tiny_gpt2_dir))
    reference = hf_tiny("gpt2")
    ids = torch.tensor([tokenizer("the market fell on monday .", add_special_tokens=False)["input_ids"]])
    assert ids.tolist() == [tiny_tokenizer("the market fell on monday .", add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        assert (model(ids) - reference(input_ids=ids).logits).abs().max().item() <= 1e-4
    assert not is_tied(model)


def _offline_file(alias: str):
    from aimet_quadapter.models import loading

    entry = loading.OFFLINE_MODELS[alias]
    if importlib.util.find_spec(entry.package) is None:
        pytest.skip(f"{entry.requirement} is not installed")
    folder, name = loading._offline_source(alias)
    return Path(folder) / name


@pytest.mark.slow  # reads the real SmolLM2 file, as the other slow tests do
@pytest.mark.parametrize("alias", ["smollm2-135m"])
def test_offline_alias_declares_its_files_context_length(alias):
    """The length checks read the alias's declared positions instead of parsing the GGUF: it must be the file's."""
    from gguf import GGUFReader

    from aimet_quadapter.models.loading import OFFLINE_MODELS, max_positions

    fields = GGUFReader(str(_offline_file(alias))).fields
    arch = fields["general.architecture"]
    key = f"{bytes(arch.parts[arch.data[0]]).decode()}.context_length"
    assert int(fields[key].parts[fields[key].data[0]][0]) == OFFLINE_MODELS[alias].positions == max_positions(alias)


@pytest.mark.slow  # converts the real SmolLM2 file's tokenizer
def test_offline_tokenizer_is_cached_and_equal_to_the_converted_one(tmp_path, monkeypatch):
    """The tokenizer converted from the GGUF is kept in the cache; a second load reads it and tokenizes alike."""
    from aimet_quadapter.cache import CACHE_ENV
    from aimet_quadapter.models import loading

    _offline_file("smollm2-135m")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    converted = loading.load_tokenizer("smollm2-135m")
    saved = list((tmp_path / "tokenizers").glob("*/tokenizer.json"))
    assert len(saved) == 1
    cached = loading.load_tokenizer("smollm2-135m")
    assert Path(cached.name_or_path) == saved[0].parent
    text = "The market fell 3.5 % on Tuesday ; Mr. Darcy's <unk> said: « naïve » — 2,400x!\n"
    assert cached(text)["input_ids"] == converted(text)["input_ids"]
    assert cached.decode(cached(text)["input_ids"]) == converted.decode(converted(text)["input_ids"])
    assert len(cached) == len(converted) and cached.eos_token == converted.eos_token


def test_local_folder_positions_come_from_its_config(tiny_gpt2_dir, tmp_path):
    from aimet_quadapter.models.loading import max_positions

    config = json.loads((tiny_gpt2_dir / "config.json").read_text())
    assert max_positions(str(tiny_gpt2_dir)) == config["n_positions"]
    assert max_positions(str(tmp_path)) is None  # no config.json: known once the model loads


def test_the_hub_check_asks_huggingface_hub_at_its_endpoint(monkeypatch):
    """HF_ENDPOINT (a mirror, a proxy's address) is where the package asks, through huggingface_hub's session."""
    import http.server
    import threading

    from huggingface_hub import constants

    from aimet_quadapter.models.hub import hub_reachable

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        hub_reachable.cache_clear()
        assert hub_reachable()
        server.shutdown()
        server.server_close()
        hub_reachable.cache_clear()
        assert not hub_reachable(timeout=1.0), "nobody answers at that address now"
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        hub_reachable.cache_clear()
        assert not hub_reachable(), "HF_HUB_OFFLINE is honoured before any request"
    finally:
        hub_reachable.cache_clear()


def test_an_unreachable_hub_makes_the_loaders_local_without_touching_the_process(monkeypatch, caplog):
    """No environment variable or huggingface_hub constant is rewritten: the loaders ask for the local cache
    (huggingface_hub's and datasets' own local_files_only), and one warning says why."""
    import os

    from huggingface_hub import constants

    from aimet_quadapter.models import hub

    environment, switch = dict(os.environ), constants.HF_HUB_OFFLINE
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    hub.local_files_only.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert hub.local_files_only() and hub.local_files_only()
    finally:
        hub.local_files_only.cache_clear()
    assert dict(os.environ) == environment and switch == constants.HF_HUB_OFFLINE
    assert len([r for r in caplog.records if "cannot be reached" in r.message]) == 1


def test_a_weight_sharing_copy_holds_the_original_storage_until_it_owns_a_weight():
    from aimet_quadapter.models import own_storage, reset_to, shares_storage, weight_sharing_copy

    model = tiny_model("llama")
    name = "lm.model.layers.0.mlp.down_proj.weight"
    original = dict(model.named_parameters())[name]
    before = original.detach().clone()
    twin = weight_sharing_copy(model)
    p = dict(twin.named_parameters())[name]
    assert p is not original and shares_storage(p) and p.data_ptr() == original.data_ptr()
    p.data = p * 2  # new data: the copy's own, the original unchanged
    assert not shares_storage(p) and torch.equal(original, before)
    reset_to(p, original)  # back to the original's values, on its storage again
    assert shares_storage(p) and p.data_ptr() == original.data_ptr()
    own_storage([p])  # before a write in place
    with torch.no_grad():
        p.add_(1.0)
    assert torch.equal(original, before) and not shares_storage(p)
    # a plain deep copy owns its weights, and a reset keeps it so
    plain = dict(copy.deepcopy(model).named_parameters())[name]
    reset_to(plain, original)
    assert plain.data_ptr() != original.data_ptr() and torch.equal(plain, original)


_MAPPED_AFTER_CHURN = """
import ctypes, ctypes.util, sys
from aimet_quadapter.memory import map_large_blocks
libc = ctypes.CDLL(ctypes.util.find_library("c"))
fields = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
libc.mallinfo2.restype = type("Info", (ctypes.Structure,), {"_fields_": [(n, ctypes.c_size_t) for n in fields]})
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[1] == "asked":
    assert map_large_blocks()
libc.free(libc.malloc(8 << 20))  # a mapped block freed: glibc raises its threshold to its size unless told
mapped = libc.mallinfo2().hblks
libc.malloc(4 << 20)
print(libc.mallinfo2().hblks > mapped)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_a_large_models_blocks_stay_mapped_after_large_ones_were_freed():
    """glibc serves a 4 MiB block from its heap once an 8 MiB one came and went (its threshold moved), where its
    holes stay resident; after map_large_blocks() (what loading a model of over 1 GiB asks) it maps it."""
    import subprocess
    import sys

    def mapped(mode: str) -> str:
        run = subprocess.run([sys.executable, "-c", _MAPPED_AFTER_CHURN, mode], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert mapped("left alone") == "False"
    assert mapped("asked") == "True"


def test_loading_any_model_has_its_activations_mapped(tiny_gpt2_dir, monkeypatch):
    """A tiny model is far below a gigabyte, and still loading it asks glibc to map blocks of MAPPED_BLOCK_BYTES and
    more (what that does: the test above), where their holes in the heap would add to every later step's peak."""
    from aimet_quadapter.memory import MAPPED_BLOCK_BYTES
    from aimet_quadapter.models import load_model, loading

    asked: list[int] = []
    monkeypatch.setattr(loading, "map_large_blocks", lambda threshold=1 << 20: asked.append(threshold) or True)
    load_model(str(tiny_gpt2_dir))
    assert asked == [MAPPED_BLOCK_BYTES]
