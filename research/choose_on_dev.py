"""Choose one setting of a recipe on its development text: one run per candidate value, a table of the
development (and test) perplexities, and the candidate with the lowest geometric mean over the development
columns. The test columns are printed for the record only; they never enter the choice.

Each candidate runs in a copy of a finished run folder, so the cells the setting does not touch (FP32, CLE, a
shared phase 1) are reused rather than recomputed:

    python research/choose_on_dev.py recipes/demo.yaml --base runs/demo --key phase2.lr_alpha \\
        --values 0.03 0.1 0.3 --method quadapter --out runs/choose-lr_alpha
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import yaml


def _cell(results: dict, method: str, key: str, value: object) -> dict:
    cells = [c for c in results["cells"].values() if c["method"] == method and not c.get("error")]
    # A base folder may hold the method's cell for another fid or calibration set: the cell records those.
    if key in ("fid", "calibration"):
        wanted = value[0] if isinstance(value, list) and len(value) == 1 else value
        cells = [c for c in cells if c.get(key) == wanted]
    if len(cells) != 1:
        sys.exit(f"choose_on_dev: expected one finished {method} cell, found {len(cells)}")
    return cells[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("--key", required=True, help="the setting, as --set names it, e.g. phase2.lr_alpha")
    p.add_argument("--values", nargs="+", required=True, help="candidate values, each parsed as YAML")
    p.add_argument("--method", required=True, help="the cell whose numbers decide, e.g. quadapter")
    p.add_argument("--base", help="a finished run folder of the recipe to start each candidate from")
    p.add_argument("--out", required=True, help="folder of the candidates' run folders and choice.json")
    p.add_argument("--set", action="append", default=[], help="further overrides for every candidate")
    args = p.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for value in args.values:
        folder = out / f"{args.key}={value}"
        if args.base and not folder.exists():
            shutil.copytree(args.base, folder, ignore=shutil.ignore_patterns("run.lock"))
        argv = [sys.executable, "-m", "aimet_quadapter.cli", "run", args.recipe, "--out", str(folder)]
        argv += ["--no-progress", "--set", f"{args.key}={value}", "--set", f"methods=[fp,{args.method}]"]
        for item in args.set:
            argv += ["--set", item]
        print(" ".join(argv[1:]), flush=True)
        subprocess.run(argv, check=True)
        parsed = yaml.safe_load(value)
        cell = _cell(json.loads((folder / "results.json").read_text()), args.method, args.key, parsed)
        dev = cell.get("dev_ppl", {})
        if not dev:
            sys.exit("choose_on_dev: the recipe has no development text (its dev section)")
        score = math.exp(sum(math.log(v) for v in dev.values()) / len(dev))
        rows.append({"value": parsed, "dev": dev, "dev_geomean": score, "test": cell["ppl"]})

    best = min(rows, key=lambda r: r["dev_geomean"])
    dev_cols, test_cols = list(rows[0]["dev"]), list(rows[0]["test"])
    print(
        f"\n| {args.key} | "
        + " | ".join(f"{c} (dev)" for c in dev_cols)
        + " | geometric mean (dev) | "
        + " | ".join(f"{c} (test, not used)" for c in test_cols)
        + " |"
    )
    print("| --- " * (2 + len(dev_cols) + len(test_cols)) + "|")
    for r in rows:
        mark = " (kept)" if r is best else ""
        print(
            f"| {r['value']}{mark} | "
            + " | ".join(f"{r['dev'][c]:.3f}" for c in dev_cols)
            + f" | {r['dev_geomean']:.3f} | "
            + " | ".join(f"{r['test'][c]:.3f}" for c in test_cols)
            + " |"
        )
    (out / "choice.json").write_text(json.dumps({"key": args.key, "kept": best["value"], "candidates": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
