"""Whether other runs of a recipe (another CPU, thread count or seed) land in a run folder's ranges.

For every quantized cell of each OTHER run folder, the row of REFERENCE with its method, group, fine-tuning size
and settings (over REFERENCE's seeds of them): whether each test perplexity lies in that row's 95 % prediction
range (the report's "where another run lands") and in its min-max over the seeds. Prints a markdown table, the
count of each, and how many cells had no such row of two seeds or more.

    python scripts/check_ranges.py runs/demo runs/demo-on-another-cpu runs/demo-two-threads
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aimet_quadapter.running.results_file import load_results
from aimet_quadapter.running.statistics import machine_label, merge_seeds


def _where(cell: dict) -> str:
    seed = "no seed" if cell.get("seed") is None else f"seed {cell['seed']}"
    return f"{seed}, {machine_label(cell)}"


def _row_of(cell: dict) -> tuple:
    # what defines a row: the 2-sequence point of a sweep is not the 40-sequence row of the same method, and
    # seeds of other settings are not the row's (cells recorded before row fingerprints: None, matched alike)
    return cell["method"], cell["group"], cell.get("size"), cell.get("row_fingerprint")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reference", help="the run folder whose ranges are checked (seeded cells)")
    p.add_argument("others", nargs="+", help="run folders of the same recipe")
    args = p.parse_args()
    rows = {_row_of(r): r for r in merge_seeds(load_results(args.reference)["cells"]).values()}
    print("| run | cell | text | perplexity | 95 % range | in it | min-max | in it |")
    print("| --- | --- | --- | ---: | --- | --- | --- | --- |")
    counts = {"predict": [0, 0], "spread": [0, 0]}
    unmatched = 0
    for other in args.others:
        for cell in load_results(other)["cells"].values():
            row = rows.get(_row_of(cell))
            if row is None or not row.get("predict", {}).get("ppl"):
                unmatched += row is None or "seeds" in row  # FP32's row has no seeds to have a range from
                continue  # a row the reference did not run, or ran on one seed
            for text, value in cell["ppl"].items():
                if text not in row["predict"]["ppl"]:
                    continue  # a text the reference did not score, or scored inf or NaN on every seed
                marks = []
                for kind in ("predict", "spread"):
                    low, high = row[kind]["ppl"][text]
                    inside = low <= value <= high
                    counts[kind][0] += inside
                    counts[kind][1] += 1
                    marks += [f"{low:.3f}-{high:.3f}", "yes" if inside else "**no**"]
                run = f"{Path(other).name} ({_where(cell)})"
                print(f"| {run} | {row['label']} | {text} | {value:.3f} | {' | '.join(marks)} |")
    for kind, title in (("predict", "95 % prediction range"), ("spread", "min-max of the seeds")):
        print(f"in the {title}: {counts[kind][0]} of {counts[kind][1]}")
    print(f"seeded cells with no row of two seeds or more in the reference: {unmatched}")


if __name__ == "__main__":
    main()
