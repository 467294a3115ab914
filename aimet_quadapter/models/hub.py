"""Whether the Hugging Face hub can be reached, asked once per process.

Without this, every hub call on an offline machine retries for half a minute before failing. When the
hub is unreachable, HF_HUB_OFFLINE is set so that models and datasets already in the local cache
still load, and everything else fails at once with our message.
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse


def _offline_flag() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    if _offline_flag():
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def go_offline_if_unreachable() -> bool:
    """Set HF_HUB_OFFLINE=1 when the hub cannot be reached; returns whether the hub is reachable."""
    reachable = hub_reachable()
    if not reachable:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        try:  # huggingface_hub reads the variable at import time
            import huggingface_hub.constants as constants

            constants.HF_HUB_OFFLINE = True
        except ImportError:
            pass
    return reachable
