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
