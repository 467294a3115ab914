"""Whether the Hugging Face hub can be reached, asked once per process.

Without this, every hub call on an offline machine retries for half a minute before failing. When the
hub is unreachable, HF_HUB_OFFLINE is set so that models and datasets already in the local cache
still load, and everything else fails at once with our message.
"""

from __future__ import annotations

import functools
import os


def _offline_flag() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub answers, asked through huggingface_hub's own HTTP session: its endpoint (HF_ENDPOINT),
    its offline switch (HF_HUB_OFFLINE) and the proxies it is configured with (HTTPS_PROXY, ...)."""
    if _offline_flag():
        return False
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)  # any HTTP answer: someone is there
        return True
    except Exception:  # no answer; the HTTP backend's error classes differ between huggingface_hub versions
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
