"""SpinQuant then Quadapter on the device's graph against the demo's Quadapter, one cell each, one after the other.

SpinQuant then Quadapter (``spinquant_quadapter``) under the device recipe's settings (``policy.target: htp``) and
the demo's ``quadapter`` cell (the paper's placement): the same method at the same training budget (the demo's
sampled text, phase 1 and phase 2), each alone in its own run from an empty folder, so that each cell computes its
own phase 1. Prints each cell's method time (phase 1, phase 2 and what the method computes before them; the demo's
Quadapter runs its phase 1 before the method proper and records it apart), evaluation time, wall time and peak RSS,
and the ratios; the two recipes evaluate different amounts of text, so the method times are the like-for-like pair.

    python benchmarks/htp_cell.py --work runs/htp-cell --json benchmarks/results/cpu-htp-cell.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf import machine  # noqa: E402  (the benchmarks folder is not a package)

ROOT = Path(__file__).resolve().parent.parent
CELLS = {"demo": ("recipes/demo.yaml", "quadapter"), "device": ("recipes/device.yaml", "spinquant_quadapter")}
GOAL = 1.3  # the device cell's method time / the demo cell's
KEYS = ("method_time_s", "eval_time_s", "wall_time_s", "peak_rss_kib")


def run_cell(recipe: str, method: str, out: Path, reuse: bool) -> dict:
    # the cell alone: no export after it (the device recipe's last step, not a cell's)
    command = ["aimet-quadapter", "run", recipe, "--set", f"out={out}", "--set", f"methods=[{method}]"]
    command += ["--set", "export=null"]
    start = time.time()
    if not reuse:
        subprocess.run([sys.executable, "-m", "aimet_quadapter.cli", *command[1:]], check=True, cwd=ROOT)
    results = json.loads((out / "results.json").read_text())
    (record,) = [r for r in results["cells"].values() if r.get("method") == method]
    cell = {"command": " ".join(command), "run_s": None if reuse else time.time() - start}
    cell.update({k: record[k] for k in KEYS}, ppl=record["ppl"], dev_ppl=record["dev_ppl"], kernels=record["kernels"])
    cell["commit"] = record["commit"]
    cell["method_time_s"] += record["info"].get("bc_time_s", 0.0)  # phase 1, where the cell ran it first
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="an empty folder for the two runs")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--reuse", action="store_true", help="read the two runs already in --work instead")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    if not args.reuse and work.exists() and any(work.iterdir()):
        ap.error(f"--work {work} is not empty: each cell runs from an empty folder")
    cells = {name: run_cell(recipe, method, work / name, args.reuse) for name, (recipe, method) in CELLS.items()}
    ratios = {k: cells["device"][k] / cells["demo"][k] for k in KEYS}
    lines = ["| cell | method (s) | evaluation (s) | wall (s) | peak RSS (GiB) |", "|---|---:|---:|---:|---:|"]
    for name, c in cells.items():
        label = f"{name}: {CELLS[name][1]}"
        lines.append(
            f"| {label} | {c['method_time_s']:.0f} | {c['eval_time_s']:.0f} | {c['wall_time_s']:.0f} | "
            f"{c['peak_rss_kib'] / 2**20:.2f} |"
        )
    lines.append(
        f"| device / demo | **{ratios['method_time_s']:.2f}** (goal {GOAL}) | {ratios['eval_time_s']:.2f} | "
        f"{ratios['wall_time_s']:.2f} | {ratios['peak_rss_kib']:.2f} |"
    )
    table = "\n".join(lines)
    print(table)
    if args.json:
        commits = sorted({c["commit"] for c in cells.values()})
        out = {"machine": machine(), "commits": commits, "cells": cells, "ratios": ratios, "table": table}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
