"""Statistics over the seeds of one cell, as results.json's ``summary`` and the report show them."""

from __future__ import annotations

import math
import statistics
from collections import Counter


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def merge_seeds(cells: dict[str, dict]) -> dict[str, dict]:
    """``cells`` with the seeds of one ``row_fingerprint`` merged into a row under the key less ``#seed<N>`` (and
    ``settings`` where a key's seeds ran under several): mean over the finite ``seeds``, ``spread``, ``predict``,
    ``stopped_seeds``, ``nonfinite_seeds`` and ``machines`` (where several); cells without a seed as they are."""
    groups: dict[tuple[str, bool, str | None], list[dict]] = {}
    for key, c in cells.items():
        if c.get("seed") is None:
            groups[key, False, None] = [c]
        else:  # seeds of other settings (run into one folder, or merged from another) are another measurement
            groups.setdefault((key.rsplit("#seed", 1)[0], True, c.get("row_fingerprint")), []).append(c)
    rows_of_key = Counter(key for key, _, _ in groups)
    rows = {}
    for (key, seeded, settings), members in groups.items():
        if not seeded:
            rows[key] = members[0]
            continue
        # neither a stopped seed nor one with an inf or NaN perplexity has a number to average
        finished = [m for m in members if not m.get("error")]
        counted = [m for m in finished if all(finite(v) for f in ("ppl", "dev_ppl") for v in m.get(f, {}).values())]
        nonfinite = [m for m in finished if m not in counted]
        row = {**(counted or finished or members)[0], "seeds": [m["seed"] for m in counted], "spread": {}}
        stopped = [m for m in members if m.get("error")]
        if stopped:
            row["error"] = stopped[0]["error"]
            row["stopped_seeds"] = [m["seed"] for m in stopped]
        if nonfinite:
            row["nonfinite_seeds"] = [m["seed"] for m in nonfinite]
        machines = sorted({machine_label(m) for m in counted})
        if len(machines) > 1:  # sums in another order: another measurement, not another seed alone
            row["machines"] = machines
        row["predict"] = {}
        for field in ("ppl", "dev_ppl"):
            row[field], row["spread"][field], row["predict"][field] = {}, {}, {}
            for col in dict.fromkeys(col for m in finished for col in m.get(field, {})):
                values = [m[field][col] for m in counted if col in m.get(field, {})]
                if values:
                    row[field][col] = sum(values) / len(values)
                    row["spread"][field][col] = [min(values), max(values)]
                else:  # every seed's is inf or NaN: the table says so rather than nothing
                    row[field][col] = next(m[field][col] for m in nonfinite if col in m.get(field, {}))
                if len(values) > 1:
                    row["predict"][field][col] = list(prediction_range(values))
        if rows_of_key[key] > 1:
            row["settings"] = str(settings)[:8]
            key = f"{key} (settings {row['settings']})"
        rows[key] = row
    return rows


def prediction_range(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Where one more run (another seed, or another CPU) lands with probability ``level``: Student's t prediction
    interval over ``values``, which the min-max of n runs holds only with probability (n - 1) / (n + 1)."""
    from scipy.stats import t as student_t  # a second to import: only where a range is asked for

    n = len(values)
    if n < 2:
        raise ValueError("a prediction range needs at least two runs")
    mean = sum(values) / n
    half = float(student_t.ppf((1 + level) / 2, n - 1)) * statistics.stdev(values) * math.sqrt(1 + 1 / n)
    return mean - half, mean + half


def machine_label(cell: dict) -> str:
    """What a cell ran under that orders its sums: "2 threads on AVX2", "... with cuda (NVIDIA H200)" on a GPU."""
    label = f"{cell['threads']} thread{'s' if cell['threads'] != 1 else ''} on {cell['kernels']}"
    return f"{label} with {cell['device']}" if cell["device"] != "cpu" else label


def summary(results: dict) -> dict[str, dict]:
    """Mean, min-max and prediction range over the seeds of every seeded cell, keyed without ``#seed<N>``."""
    return {
        key: {
            "method": row["method"],
            "group": row["group"],
            "seeds": row["seeds"],
            **({"nonfinite_seeds": row["nonfinite_seeds"]} if row.get("nonfinite_seeds") else {}),
            **{
                field: {
                    col: {
                        "mean": value,
                        "min": row["spread"][field][col][0],
                        "max": row["spread"][field][col][1],
                        **dict(zip(("predict_low", "predict_high"), row["predict"][field].get(col, ()))),
                    }
                    for col, value in row[field].items()
                    if col in row["spread"][field]  # a column of no finite seed has no statistics
                }
                for field in ("ppl", "dev_ppl")
            },
        }
        for key, row in merge_seeds(results.get("cells", {})).items()
        if "seeds" in row
    }
