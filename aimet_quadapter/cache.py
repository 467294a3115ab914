"""This package's cache folder: what is slow to compute and a pure function of what it is keyed on (a tokenizer
converted from a GGUF vocabulary, a data-free fit of transforms to a model's weights). Deleting it loses time only."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "AIMET_QUADAPTER_CACHE"


def cache_root() -> Path:
    """``$AIMET_QUADAPTER_CACHE``, else ``$XDG_CACHE_HOME/aimet-quadapter`` (``~/.cache/aimet-quadapter``), where pip
    and the Hugging Face hub keep theirs."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aimet-quadapter"
