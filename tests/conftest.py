"""Shared fixtures: tiny models, an in-memory tokenizer, a synthetic corpus and a local model folder.

Tests never touch the network: the Hugging Face hub is declared offline before anything imports
``huggingface_hub`` or ``datasets`` (both read the variables at import time).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The package's torch.compile kernels compute what their Python functions compute, to the bit (the tests that ask for
# `compiled_kernels` compile them, as the slow ones do); elsewhere those functions run as written, for each worker
# would otherwise compile every graph again on a machine with no compile cache yet.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# Under pytest-xdist each worker is a process of its own: one thread each, not every worker on every core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import gc  # noqa: E402
import random  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

_WORDS = (
    "the a an market stock shares company profit quarter investors interest rates fell rose said "
    "traders sold bought bank bonds prices year month week analysts expect growth sales billion million "
    "new york chicago london board chairman president executive officer plan deal offer bid unit group "
    "was were is are has had will would could may might not also but and or of in on at to for with "
    "by from as than more less most about after before during since while because if when "
    "fox dog cat bird tree river house road city country people time day night water light"
)


def make_corpus(num_words: int, seed: int = 0) -> str:
    """Pseudo-English text: sentences of random words, one sentence per line."""
    rng = random.Random(seed)
    words = _WORDS.split()
    lines, count = [], 0
    while count < num_words:
        n = rng.randint(5, 15)
        lines.append(" ".join(rng.choice(words) for _ in range(n)) + " .")
        count += n + 1
    return "\n".join(lines) + "\n"


def make_tokenizer(text: str):
    """A word-level fast tokenizer trained in memory on ``text`` (no files, no hub)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=400, special_tokens=["[UNK]", "<eos>"])
    tok.train_from_iterator(text.splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>")


def hf_tiny(family: str, seed: int = 0, **config_overrides):
    """The unprepared Hugging Face model that ``tiny_model(family, seed)`` starts from."""
    from transformers import AutoModelForCausalLM

    from aimet_quadapter.models import ARCHITECTURES

    arch = {a.name: a for a in ARCHITECTURES}[family]
    torch.manual_seed(seed)
    # eager attention: the one every transformers version computes in full (some pick SDPA for Gemma-2 by default,
    # and SDPA leaves out its score cap), so that the reference is the family's definition
    config = arch.tiny_config(**config_overrides)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()


def save_tiny_gpt2(folder: Path, tokenizer, seed: int = 0) -> Path:
    """A tiny GPT-2 checkpoint (config, weights) and ``tokenizer`` saved as a local model folder."""
    model = hf_tiny("gpt2", seed=seed)
    assert len(tokenizer) <= model.config.vocab_size
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory) -> Iterator[Path]:
    """The package's cache (a fitted transform, a converted tokenizer) in the session's own folder: no test reads
    what a run outside it left there."""
    from aimet_quadapter.cache import CACHE_ENV

    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(folder))
        yield folder


@pytest.fixture(scope="session")
def corpus_text() -> str:
    return make_corpus(4000, seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(corpus_text):
    return make_tokenizer(corpus_text)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return save_tiny_gpt2(tmp_path_factory.mktemp("models") / "tiny-gpt2", tiny_tokenizer)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory, corpus_text) -> Path:
    """A local dataset with three splits of other text each: tuning reads train, the evaluation test."""
    folder = tmp_path_factory.mktemp("data") / "corpus"
    folder.mkdir()
    (folder / "train.txt").write_text(corpus_text, encoding="utf-8")
    (folder / "valid.txt").write_text(make_corpus(1000, seed=1), encoding="utf-8")
    (folder / "test.txt").write_text(make_corpus(2000, seed=2), encoding="utf-8")
    return folder


def _drop_compiled_kernels() -> None:
    # torch.compile reads TORCHDYNAMO_DISABLE when it wraps a function: the wrapped kernels are cached per process
    from aimet_quadapter.quadapter import adapter
    from aimet_quadapter.quant import quantizers

    for module in (quantizers, adapter):
        for name, value in vars(module).items():
            if name.startswith("_compiled") and hasattr(value, "cache_clear"):
                value.cache_clear()


@pytest.fixture
def compiled_kernels(monkeypatch) -> Iterator[None]:
    """The package's kernels compiled by torch.compile in this test and the processes it starts."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    _drop_compiled_kernels()
    yield
    _drop_compiled_kernels()


@pytest.fixture(autouse=True)
def _slow_tests_compile(request) -> None:
    # end to end on the real model as the product runs it
    if request.node.get_closest_marker("slow"):
        request.getfixturevalue("compiled_kernels")


@pytest.fixture
def tiny_gpt2():
    from aimet_quadapter.models import tiny_model

    return tiny_model("gpt2")


@pytest.fixture
def tiny_llama():
    from aimet_quadapter.models import tiny_model

    return tiny_model("llama")


@pytest.fixture
def never_load(monkeypatch):
    """Loading model weights fails the test: the error must come before it."""
    from aimet_quadapter.models import loading

    def fail(name):
        raise AssertionError(f"model {name} was loaded before the error")

    monkeypatch.setattr(loading, "load_hf_model", fail)


@pytest.fixture
def offline(monkeypatch):
    """The hub is unreachable: HF_HUB_OFFLINE=1, and the package's cached reachability answer forgotten."""
    from aimet_quadapter.models.hub import hub_reachable, local_files_only

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    hub_reachable.cache_clear()
    local_files_only.cache_clear()
    yield
    hub_reachable.cache_clear()
    local_files_only.cache_clear()


# Twins of cases that stay in the quick suite (the README's test command): the same code path on the other
# family or encodings version, run by `pytest -m slow` (CI runs both).
TWINS = (
    "test_export.py::test_export_after_quadapter[llama]",
    "test_export.py::test_export_after_ptq_matches_the_sim[gpt2-1.0.0]",  # test_the_gpt2_export_matches_the_sim
    "test_export.py::test_export_after_ptq_matches_the_sim[llama-1.0.0]",
    "test_export.py::test_export_after_ptq_matches_the_sim[llama-2.0.0]",
    "test_export.py::test_export_after_ptq_matches_the_sim[gpt2-2.0.0]",
    # both toys' Linear weights go through AIMET's transpose pass; the llama toy has more of them
    "test_export.py::test_aimets_transposed_weights_go_to_their_files_without_a_copy_in_memory[gpt2]",
    "test_quadapter.py::test_phase2_lowers_training_loss_and_keeps_weights[llama]",
    "test_quadapter.py::test_phase2_resume_continues_where_it_stopped[llama]",
    "test_quadapter.py::test_gathered_embedding_quantization_is_exact[llama]",
    "test_quadapter.py::test_phase2_resumes_only_its_own_checkpoint[llama]",
    "test_quadapter.py::test_save_load_gives_the_same_perplexity[llama]",
    "test_quadapter.py::test_perplexity_ordering_fp_quadapter_ptq[llama]",
    "test_quadapter.py::test_phase1_lowers_every_site_error[llama-fp]",  # each family and target once quick
    "test_quadapter.py::test_phase1_lowers_every_site_error[gpt2-quantized]",
    "test_quadapter.py::test_plain_tensors_change_no_result[llama]",
    "test_quadapter.py::test_phase2_trains_on_the_fp_storage_bit_for_bit[llama]",
    "test_quadapter.py::test_the_model_level_check_keeps_the_best_point_on_the_way[llama]",
    "test_quadapter.py::test_the_model_level_check_keeps_the_start_when_phase_1_makes_it_worse[gpt2]",
    "test_quadapter.py::test_phase1_pulls_a_planted_1000x_outlier_toward_balance[llama]",
    "test_quadapter.py::test_batched_range_encodings_give_aimets_encodings_and_the_same_gradients[gpt2]",
    "test_quadapter.py::test_phase2_micro_batches_give_the_whole_batch_gradient[gpt2]",
    "test_quadapter.py::test_phase2_recomputed_blocks_give_the_same_losses_and_gradients[gpt2]",
    "test_aimet_techniques.py::test_a_technique_state_exports_and_verifies[adascale]",  # spinquant's is quick
    "test_aimet_techniques.py::test_every_aimet_technique_and_composition_runs_from_the_command_line[qwen2]",
    # a rotated training state's rebuild: slow for both methods (the command-line test checks their states quick)
    "test_aimet_techniques.py::test_a_rotated_training_state_rebuilds_the_sim_it_trained[spinquant_quadapter]",
    "test_aimet_techniques.py::test_a_rotated_training_state_rebuilds_the_sim_it_trained[spinquant_cle_phase2]",
    "test_aimet_techniques.py::test_a_rotated_training_state_rebuilds_the_sim_it_trained[fptquant_quadapter]",
    "test_aimet_techniques.py::test_a_rotated_training_state_rebuilds_the_sim_it_trained[fptquant_cle_phase2]",
    "test_aimet_techniques.py::test_a_rotated_training_state_rebuilds_the_sim_it_trained[spinquant_quadapter_bc_qat]",
    # the device graph of the llama toy with a prefix stays quick: the same graph and more (the prefix's cache)
    "test_device_check.py::test_the_device_graph_holds_the_residual_streams_encodings_and_names_the_rest[llama]",
    "test_device_check.py::test_the_device_graph_scores_near_the_sim[llama]",
    "test_device_check.py::test_the_verdict_is_the_exports_own_band[llama]",
    "test_device_check.py::test_the_loaded_encodings_are_the_ones_it_runs_with[llama]",
    "test_device_check.py::test_every_tensor_it_counts_as_covered_runs_quantized[llama]",
    "test_device_check.py::test_the_loaded_graph_goes_once_the_simulation_holds_its_own[llama]",
    "test_device_check.py::test_the_device_graph_scores_a_text_as_the_check_does[llama]",
    "test_device_check.py::test_the_graph_its_session_reads_goes_with_the_block[llama]",
    "test_device_check.py::test_the_graph_its_session_reads_goes_with_the_block[gpt2]",
    # htp's placement, quick on GPT-2, Llama, Qwen2, Phi-3 and Gemma (the residual stream) and on GPT-2, Llama, Phi-3
    # and Gemma (the rotation and SiLU: none, rotary with SiLU, Phi-3's fused projections, GELU); each other family
    # shares one of their code paths
    *(
        f"test_targets.py::test_htp_quantizes_the_residual_stream_where_it_starts_and_at_every_sum[{family}]"
        for family in ("mistral", "qwen3", "gemma2", "gemma3")
    ),
    *(
        f"test_targets.py::test_htp_quantizes_the_rotation_its_tables_and_silus_sigmoid_as_the_graph_computes_them[{f}]"
        for f in ("mistral", "qwen2", "qwen3", "gemma2", "gemma3")
    ),
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("tests/")[-1] in TWINS:
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    """Every test module, and torch, transformers and AIMET with them, is imported by now: their objects live as
    long as the process, so they are moved out of the cyclic collector's reach. The package's
    ``release_freed_memory`` runs a full collection after each cell and export step, and walking the libraries'
    objects each time was the largest single cost of the suite (benchmarks/README.md)."""
    gc.collect()
    gc.freeze()
