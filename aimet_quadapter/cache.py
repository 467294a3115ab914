"""This package's cache folder, for what is slow to compute and a pure function of its key: deleting it loses time."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "AIMET_QUADAPTER_CACHE"


def cache_root() -> Path:
    """``$AIMET_QUADAPTER_CACHE``, else ``$XDG_CACHE_HOME/aimet-quadapter`` (``~/.cache/aimet-quadapter``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aimet-quadapter"
