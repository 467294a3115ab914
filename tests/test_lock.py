"""One run per run folder: of two processes that reach for the lock at the same instant exactly one gets it,
the other is refused with the holder's pid; a holder killed with SIGKILL leaves the folder free."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from test_bad_input import RECIPE, _cli

from aimet_quadapter.running.lock import HOLDER, RunLock

# Waits for the file `go`, then takes the lock and holds it for a while, or reports whom it was refused for.
RACER = """
import os, sys, time
from pathlib import Path
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.running.lock import RunLock
folder, go = Path(sys.argv[1]), Path(sys.argv[2])
while not go.exists():
    time.sleep(0.001)
try:
    with RunLock(folder):
        print("ran", os.getpid(), flush=True)
        time.sleep(float(sys.argv[3]))
except QuadapterError as e:
    print("refused", e, flush=True)
"""


def _racer(folder, go, hold: float) -> subprocess.Popen:
    argv = [sys.executable, "-c", RACER, str(folder), str(go), str(hold)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_started_at_the_same_instant_exactly_one_runs(tmp_path):
    folder, go = tmp_path / "run", tmp_path / "go"
    folder.mkdir()
    for _ in range(3):  # three races, each decided by the kernel
        go.unlink(missing_ok=True)
        racers = [_racer(folder, go, 1.0) for _ in range(2)]
        time.sleep(1.5)  # both interpreters up and polling
        go.touch()
        outs = [p.communicate(timeout=60) for p in racers]
        lines = [out.strip() for out, _ in outs]
        assert all(p.returncode == 0 for p in racers), [err for _, err in outs]
        ran = [line for line in lines if line.startswith("ran")]
        refused = [line for line in lines if line.startswith("refused")]
        assert len(ran) == 1 and len(refused) == 1, lines
        winner = ran[0].split()[1]
        assert f"is in use by process {winner} on " in refused[0], lines
        assert not (folder / HOLDER).exists()


@pytest.mark.slow
def test_a_run_is_refused_while_the_folder_is_held_and_runs_once_its_holder_is_killed(
    tmp_path, tiny_gpt2_dir, corpus_dir
):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(model=tiny_gpt2_dir, corpus=corpus_dir))
    out, go = tmp_path / "run", tmp_path / "go"
    out.mkdir()
    go.touch()
    holder = _racer(out, go, 300)
    try:
        assert holder.stdout is not None and holder.stdout.readline().startswith("ran")
        refused = _cli(["run", str(recipe), "--out", str(out), "--no-progress"])
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines()[-1].startswith("aimet-quadapter: error: ")
        assert f"in use by process {holder.pid} on " in refused.stderr
    finally:
        holder.kill()  # SIGKILL: no release, no clean-up; the kernel drops the lock
        holder.communicate()
    done = _cli(["run", str(recipe), "--out", str(out), "--no-progress"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (out / HOLDER).exists()
    with RunLock(out) as lock:  # and the folder can be locked again
        assert lock.held
