"""Whether the Hugging Face hub can be reached, asked once per process.

Without this, every hub call on an offline machine retries for half a minute before failing. Nothing global is
changed: where the hub cannot be reached, the loaders ask huggingface_hub and datasets for their local cache only
(``local_files_only``, their own switch), and one warning says so; ``HF_HUB_OFFLINE=1`` does the same without
the question.
"""

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
    """Whether the hub answers, asked through huggingface_hub's own HTTP session: its endpoint (HF_ENDPOINT),
    its offline switch (HF_HUB_OFFLINE, read when huggingface_hub is imported) and the proxies it is configured
    with (HTTPS_PROXY, ...)."""
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
    why = (
        "HF_HUB_OFFLINE is set"
        if constants.HF_HUB_OFFLINE or _offline_env()
        else f"no answer from {constants.ENDPOINT}"
    )
    log.warning("the Hugging Face hub cannot be reached (%s): models and datasets come from the local cache", why)
    return True
