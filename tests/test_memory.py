"""Each cell of a run records its own peak resident memory, not the process's peak since it started."""

from __future__ import annotations

import time

import pytest
import torch

from aimet_quadapter.memory import PeakRSS


def test_a_blocks_peak_is_its_own_and_leaves_the_process_high_water_mark_alone():
    resource = pytest.importorskip("resource")
    with PeakRSS() as first:
        big = torch.ones(64 * 2**20)  # 256 MiB, touched
        time.sleep(0.3)
        del big
    with PeakRSS() as second:
        time.sleep(0.3)
    assert first.kib >= second.kib + 200 * 2**10, "the second block inherited the first one's peak"
    # what GNU time and getrusage report for the whole process still holds the first block's peak
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= first.kib - 2**10


def test_heap_reuse_is_lifted_on_exit_to_the_threshold_set_before():
    from aimet_quadapter import memory

    if not memory.map_large_blocks(memory.MAPPED_BLOCK_BYTES):
        pytest.skip("glibc's mallopt is not there")
    with memory.heap_reused():
        assert memory._threshold == memory.REUSED_BLOCK_BYTES
        with memory.heap_reused():  # nested: the outer one's threshold stays and comes back
            assert memory._threshold == memory.REUSED_BLOCK_BYTES
        assert memory._threshold == memory.REUSED_BLOCK_BYTES
    assert memory._threshold == memory.MAPPED_BLOCK_BYTES, "a training step after it would cut its blocks from the heap"
    with pytest.raises(RuntimeError), memory.heap_reused():
        raise RuntimeError
    assert memory._threshold == memory.MAPPED_BLOCK_BYTES, "an error inside left the heap reused"


def _faults_of(fn) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


BLOCK = 16 << 20  # below the heap's threshold inside, above glibc's trim threshold


def _churn(times: int = 4) -> None:
    """A layer's block, written, freed at its end, and made again by the next layer: glibc's malloc and free."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    for _ in range(times):
        block = libc.malloc(BLOCK)
        libc.memset(block, 1, BLOCK)
        libc.free(block)


def test_a_pass_keeps_the_pages_of_what_it_freed_and_gives_them_back_before_the_head():
    """Given back to the system when freed, a block at the heap's top is faulted in again, page by page, when the
    next op makes one; inside, the heap keeps it, until the head's forward starts, and after the block."""
    from aimet_quadapter import memory

    if not memory.map_large_blocks(memory.MAPPED_BLOCK_BYTES):
        pytest.skip("glibc's mallopt is not there")
    pages = BLOCK // 4096
    head = torch.nn.Identity()
    with memory.heap_reused(head=head):
        _churn(times=1)
        inside = _faults_of(_churn)
        after_head = _faults_of(lambda: (head(torch.zeros(1)), _churn(times=1)))
    outside = _faults_of(lambda: _churn(times=2))
    assert inside < pages / 4, f"{inside} page faults for blocks the heap held"
    assert after_head > pages / 2, "the head's forward did not give the heap's free pages back"
    assert outside > pages, "the heap kept its free pages after the block"
    assert not head._forward_pre_hooks
