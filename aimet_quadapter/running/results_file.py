"""A run folder's results.json: reading it, and replacing it atomically so a crash never leaves half a file."""

from __future__ import annotations

import json
from pathlib import Path

from aimet_quadapter.atomic import write_text_atomic
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.running.statistics import summary

RESULTS = "results.json"
FORMAT = 1  # of results.json, written by the runner and by the ONNX evaluation


def write_json_atomic(path: Path, obj: dict) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2))


def load_results(run_dir: str | Path) -> dict:
    path = Path(run_dir) / RESULTS
    if not path.is_file():
        raise QuadapterError(f"{path} does not exist: run a recipe with --out {run_dir} first")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise QuadapterError(f"{path} is not valid JSON ({exc}); delete it to start the run afresh") from None


def write_results(run_dir: str | Path, results: dict) -> None:
    """``results`` as the run folder's results.json, atomically, its ``summary`` over the seeds brought up to date."""
    if seeded := summary(results):
        results["summary"] = seeded
    write_json_atomic(Path(run_dir) / RESULTS, results)
