"""A run killed with SIGKILL anywhere (phase 1, phase 2, evaluation, the results write) resumes and ends with
the results of a run that was never interrupted, with no file left corrupt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aimet_quadapter.quadapter.state import QuadapterState

KILL_SWITCH = Path(__file__).with_name("kill_switch.py")
PHASE1_SITE = "aimet_quadapter.quadapter.phase1:calibrate_site"


def _recipe(folder: Path, model: Path, corpus: Path) -> Path:
    recipe = folder / "recipe.yaml"
    # on the CPU wherever the test runs: the killed and the uninterrupted runs must compute the same bits, which a
    # GPU's kernels (atomic adds in backward passes) do not promise from one run to the next
    recipe.write_text(
        f"""
model: {model}
device: cpu
methods: [fp, ptq, quadapter_bc, quadapter]
fid: [{corpus}]
calibration: {{samples: 2, length: 64}}
quadapter: {{holdout: 2}}
phase1: {{steps: 3}}
phase2: {{steps: 4, batch_size: 2, seq_len: 64, lr_alpha: 0.01}}
execution: {{checkpoint_every: 1}}
eval: {{datasets: [{corpus}], seq_len: 64, max_tokens: 256}}
"""
    )
    return recipe


def _run(recipe: Path, out: Path, kill_at: str | None = None, count_file: Path | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("KILL_AT", "COUNT_CALLS", "COUNT_FILE")}
    if kill_at:
        env["KILL_AT"] = kill_at
    if count_file:
        env["COUNT_CALLS"], env["COUNT_FILE"] = PHASE1_SITE, str(count_file)
    argv = [sys.executable, str(KILL_SWITCH), "run", str(recipe), "--out", str(out), "--no-progress"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if kill_at is None:
        assert done.returncode == 0, done.stderr[-3000:]
    return done.returncode


def _calls(count_file: Path) -> int:
    return len(count_file.read_text().splitlines()) if count_file.is_file() else 0


def _ppl(out: Path) -> dict:
    cells = json.loads((out / "results.json").read_text())["cells"]
    return {key: cell["ppl"] for key, cell in cells.items()}


def _no_corrupt_file(out: Path, temporary_ok: bool = False) -> None:
    if not temporary_ok:
        assert not list(out.rglob("*.tmp")), "a temporary file was left behind"
    for path in out.rglob("*.json"):
        json.loads(path.read_text())
    for path in out.rglob("*.safetensors"):
        QuadapterState.load(path)


@pytest.mark.slow
def test_killed_anywhere_resumes_to_the_uninterrupted_result(tmp_path, tiny_gpt2_dir, corpus_dir):
    recipe = _recipe(tmp_path, tiny_gpt2_dir, corpus_dir)
    whole_count = tmp_path / "whole.count"
    _run(recipe, tmp_path / "whole", count_file=whole_count)
    sites = _calls(whole_count)
    assert sites > 3
    expected = _ppl(tmp_path / "whole")

    out = tmp_path / "killed"
    kills = [
        "os:replace:3:results.json",  # the PTQ cell's results.json written to its temporary file, not yet renamed
        f"{PHASE1_SITE}:3",  # phase 1, after two sites were done
        "aimet_quadapter.quadapter.phase2:_accumulate:3",  # phase 2, after two steps were checkpointed
        "aimet_quadapter.text.perplexity:window_nll:2",  # the Quadapter cell's evaluation
    ]
    counts = []
    for i, kill in enumerate(kills):
        count = tmp_path / f"run{i}.count"
        assert _run(recipe, out, kill_at=kill, count_file=count) == -9, kill
        counts.append(_calls(count))
        _no_corrupt_file(out, temporary_ok=True)
    _run(recipe, out)
    # phase 1 was killed at its third site: the rerun calibrated only the sites not yet checkpointed; once
    # Quadapter BC was recorded it was never computed again
    assert counts == [0, 3, sites - 2, 0]
    got = _ppl(out)
    assert got.keys() == expected.keys()
    for key, ppl in expected.items():
        assert got[key] == pytest.approx(ppl, rel=1e-6), key
    _no_corrupt_file(out)
    assert not list(out.rglob("checkpoints/*")), "checkpoints of recorded cells should be gone"


def test_two_writers_of_one_file_never_meet_in_a_temporary_file(tmp_path, monkeypatch):
    """Each write goes through a temporary file of its own, flushed to disk before the rename: two writers of one
    path (two threads here) each leave a whole file, never a mix of both or a missing temporary file."""
    import os
    import threading
    import time

    from aimet_quadapter.atomic import write_atomic

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    target = tmp_path / "results.json"
    errors = []

    def writer(mark: str) -> None:
        def slow(tmp: Path) -> None:
            with open(tmp, "w") as f:
                f.write(mark * 1000)
                f.flush()
                time.sleep(0.002)  # the other writer runs meanwhile
                f.write(mark * 1000)

        try:
            for _ in range(30):
                write_atomic(target, slow)
        except Exception as error:  # noqa: BLE001 - any failure of a writer fails the test
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(m,)) for m in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert target.read_text() in ("a" * 2000, "b" * 2000)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    assert len(synced) >= 60
