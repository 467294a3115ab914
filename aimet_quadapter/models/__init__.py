"""Model families, preparation for AIMET, and loading by hub name, local folder or offline alias."""

from __future__ import annotations

from ..errors import QuadapterError
from .base import (
    SITE_ROLES,
    Architecture,
    PreparedLM,
    Site,
    SiteSpec,
    device_of,
    head_of,
    is_tied,
    tensor_of,
    untie_lm_head,
)
from .devices import resolve_device
from .gemma import GEMMA, GEMMA2, GEMMA3
from .gpt2 import GPT2
from .llama import LLAMA, MISTRAL, QWEN2, QWEN3
from .loading import load_model, load_tokenizer, quiet_libraries
from .phi3 import PHI3
from .prefix import FixedPrefixCache
from .residual import ResidualSpec, install_residual_adds
from .storage import own_storage, parameter_bytes, reset_to, shares_storage, weight_sharing_copy

ARCHITECTURES: tuple[Architecture, ...] = (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA, GEMMA2, GEMMA3)
# every beyond-paper site group any family has: what extra_sites may name
EXTRA_SITE_GROUPS: tuple[str, ...] = tuple(sorted({s.extra for a in ARCHITECTURES for s in a.block_sites if s.extra}))

__all__ = [
    "ARCHITECTURES",
    "EXTRA_SITE_GROUPS",
    "SITE_ROLES",
    "Architecture",
    "FixedPrefixCache",
    "PreparedLM",
    "ResidualSpec",
    "Site",
    "SiteSpec",
    "architecture_of",
    "device_of",
    "head_of",
    "is_tied",
    "install_residual_adds",
    "load_model",
    "load_tokenizer",
    "quiet_libraries",
    "resolve_device",
    "prepare_model",
    "tiny_model",
    "tensor_of",
    "untie_lm_head",
    "own_storage",
    "reset_to",
    "parameter_bytes",
    "shares_storage",
    "weight_sharing_copy",
]


def architecture_of(hf_model) -> Architecture:
    model_type = getattr(hf_model.config, "model_type", None)
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    known = ", ".join(t for a in ARCHITECTURES for t in a.model_types)
    raise QuadapterError(f"model type {model_type!r} is not supported; supported families: {known}")


def prepare_model(hf_model, untie: bool = True) -> PreparedLM:
    """Rewrite a Hugging Face causal LM (in place) into a :class:`PreparedLM`; ``untie``: :func:`untie_lm_head`."""
    arch = architecture_of(hf_model)
    hf_model.eval()
    arch.prepare(hf_model)
    model = PreparedLM(hf_model, arch).eval()
    if arch.residual is not None:
        install_residual_adds(model.get_submodule(f"lm.{arch.blocks}"), arch.residual)
    if untie:
        untie_lm_head(model)
    return model


def tiny_model(family: str = "gpt2", seed: int = 0, **config_overrides) -> PreparedLM:
    """A small randomly initialised model of ``family`` built from a config (tests, benchmarks, smoke runs)."""
    from transformers import AutoModelForCausalLM

    arch = {a.name: a for a in ARCHITECTURES}.get(family)
    if arch is None or arch.tiny_config is None:
        raise ValueError(f"no tiny config for family {family!r}")
    config = arch.tiny_config(**config_overrides)
    import torch

    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return prepare_model(hf_model)
