"""Whether the Hugging Face hub can be reached, asked once per process (not with ``HF_HUB_OFFLINE=1``): offline,
every hub call would otherwise retry for half a minute before failing."""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger(__name__)


def _offline_env() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE when it is imported; a notebook may set it later
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub answers, asked through huggingface_hub's own HTTP session (its endpoint and proxies)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE or _offline_env():
        return False
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)  # any HTTP answer: someone is there
        return True
    except Exception:  # no answer; the HTTP backend's error classes differ between huggingface_hub versions
        return False


@functools.lru_cache(maxsize=1)
def local_files_only() -> bool:
    """Whether loaders should read the local cache alone (the hub cannot be reached); said once, as a warning."""
    from huggingface_hub import constants

    if hub_reachable():
        return False
    offline = constants.HF_HUB_OFFLINE or _offline_env()
    why = "HF_HUB_OFFLINE is set" if offline else f"no answer from {constants.ENDPOINT}"
    log.warning("the Hugging Face hub cannot be reached (%s): models and datasets come from the local cache", why)
    return True
