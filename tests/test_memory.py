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
