"""Setting metadata: bounds and finiteness checked where a dataclass is built, and what enters a fingerprint."""

from __future__ import annotations

import dataclasses
import math

import pytest

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.quadapter.config import Phase1Parameters, Phase2Parameters
from aimet_quadapter.running.recipes import parameter_sections
from aimet_quadapter.settings import result_view


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_float_setting_is_finite_unless_it_says_otherwise(value):
    with pytest.raises(QuadapterError, match=r"^phase2\.lr_alpha must be a finite number"):
        Phase2Parameters(lr_alpha=value)
    with pytest.raises(QuadapterError, match=r"^phase1\.lr must be a finite number"):
        Phase1Parameters(lr=value)


def test_the_fingerprint_view_leaves_out_what_does_not_change_a_result():
    defaults = dataclasses.asdict(Phase2Parameters())
    view = result_view(Phase2Parameters, defaults)
    # memory and checkpoint settings never; settings added later only at the value that computes what runs
    # before them computed
    assert not {"micro_batch_size", "recompute_blocks", "checkpoint_every", "checkpoint_dir"} & view.keys()
    assert not {"loss", "lr_ranges_relative"} & view.keys()
    assert {"steps", "lr_alpha", "lr_ranges", "learn_ranges", "batch_size", "seq_len"} <= view.keys()
    changed = result_view(Phase2Parameters, {**defaults, "loss": "kd", "lr_ranges_relative": True})
    assert changed["loss"] == "kd" and changed["lr_ranges_relative"] is True


def test_every_setting_declares_its_part_in_a_result():
    for section, source, nested in parameter_sections():
        for f in dataclasses.fields(source):
            if f.name in nested:  # a section of its own
                continue
            assert "result" in f.metadata, f"{section}.{f.name} is not declared with settings.setting()"
