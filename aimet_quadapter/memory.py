"""Giving freed memory back to the operating system between the large steps of a run, and measuring a step's peak."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import psutil
from torch import nn

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
# above this size of weights memory, not time, decides whether a run fits: the package trades time for memory
LARGE_WEIGHTS_BYTES = 1 << 30
# the blocks glibc maps rather than cuts from its heap: from this size (a 1,024-token window's attention scores and
# MLP activations), or 1 MiB over LARGE_WEIGHTS_BYTES
MAPPED_BLOCK_BYTES = 4 << 20
# without a backward pass, blocks up to this size are reused from the heap instead of mapped afresh: mapping each
# costs page faults and zeroed pages at every allocation
REUSED_BLOCK_BYTES = 64 << 20
# ... and the heap gives back what they free only past this much, so the next layer need not fault them in again
REUSED_HEAP_BYTES = 1 << 30
_threshold: int | None = None  # what map_large_blocks last set (glibc has no getter)


@cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def release_freed_memory() -> None:
    """Collect garbage, then ask glibc's allocator to return its free pages, which would add to the next peak: after
    an ONNX export or an onnxruntime session, what Python or C++ freed otherwise stays in the process's arenas."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Ask glibc's allocator to return its free heap pages, without a garbage collection: cheap for every pass, whose
    activations, freed in its backward pass, otherwise stay resident beside the next pass's."""
    trim = getattr(_libc(), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


def map_large_blocks(threshold: int = 1 << 20) -> bool:
    """Have glibc map every block of ``threshold`` bytes or more, so the threshold stops rising; whether it took it.

    glibc's own threshold rises (up to 32 MiB) each time it frees a mapped block: a training step's large activations
    are then cut from its heap, and the holes they leave stay resident and add to every later peak. Mapping costs
    page faults at every allocation: hence MAPPED_BLOCK_BYTES for any model, this default only for large ones."""
    global _threshold
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        return False
    # the heap's free top goes back past twice the threshold, as glibc pairs the two when it moves them itself
    mallopt(M_TRIM_THRESHOLD, 2 * threshold)
    _threshold = threshold
    return True


@contextmanager
def heap_reused(threshold: int = REUSED_BLOCK_BYTES, head: nn.Module | None = None) -> Iterator[None]:
    """For passes without a backward pass, where :func:`map_large_blocks` set a lower threshold: blocks below
    ``threshold`` reused from the heap inside, the free pages given back on exit and before ``head`` at every pass.
    Such passes free what they take whole, leaving no holes a training step's peak would add to; ``head`` (an LM's
    head): so that what the layers reused does not sit beside its larger output."""
    before = _threshold
    if before is None or before >= threshold:
        yield
        return
    map_large_blocks(threshold)
    _libc().mallopt(M_TRIM_THRESHOLD, REUSED_HEAP_BYTES)
    hook = head.register_forward_pre_hook(lambda *_: trim_heap()) if head is not None else None
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()
        map_large_blocks(before)
        trim_heap()


class PeakRSS:
    """The process's peak resident memory (KiB) while a block runs, sampled every ``interval`` seconds on a thread:
    resetting the kernel's high-water mark instead would also reset what ``getrusage`` and GNU time report for the
    whole process. A spike shorter than the interval can be missed."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.kib = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:  # at least one sample before __exit__'s join returns
            self.kib = max(self.kib, self._process.memory_info().rss // 1024)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
