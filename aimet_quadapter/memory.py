"""Giving freed memory back to the operating system between the large steps of a run."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache


@cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    library = ctypes.CDLL(name) if name else None
    return getattr(library, "malloc_trim", None)  # glibc only


def release_freed_memory() -> None:
    """Collect garbage, then ask glibc's allocator to return its free pages: after an ONNX export or an
    onnxruntime session, hundreds of MB freed by Python or C++ otherwise stay in the process's arenas and
    add to the next step's peak."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
