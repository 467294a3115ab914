"""The README's demo table holds: its FP32 and PTQ rows, computed again by the demo recipe (slow: SmolLM2-135M)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from aimet_quadapter.cli import main

ROOT = Path(__file__).resolve().parent.parent
# FP32 is evaluated in float32 only: another CPU's BLAS moves it in the fourth digit at most. PTQ rounds every
# activation, so that float32 noise flips roundings: two 2-core CPUs gave it 0.3 % and 0.8 % apart (README).
FP32_REL, PTQ_REL = 1e-3, 0.01


def _readme_row(label: str) -> tuple[float, float]:
    """(PTB test, Austen) of the README table's row that starts with ``label``."""
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith(label):
            return float(re.sub(r"\s.*", "", cells[1])), float(re.sub(r"\s.*", "", cells[2]))
    raise AssertionError(f"the README has no table row {label!r}")


@pytest.mark.slow
def test_the_demo_recomputes_the_readmes_fp32_and_ptq_rows(tmp_path):
    out = tmp_path / "demo"
    argv = ["run", str(ROOT / "recipes" / "demo.yaml"), "--out", str(out), "--no-progress"]
    assert main([*argv, "--set", "methods=[fp, ptq]"]) == 0
    cells = {
        c["label"].split(" (")[0]: c["ppl"] for c in json.loads((out / "results.json").read_text())["cells"].values()
    }
    for label, rel in (("FP32", FP32_REL), ("PTQ", PTQ_REL)):
        ptb, austen = _readme_row(label)
        assert cells[label]["ptb"] == pytest.approx(ptb, rel=rel), label
        assert cells[label]["austen"] == pytest.approx(austen, rel=rel), label
