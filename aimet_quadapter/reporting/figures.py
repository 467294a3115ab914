"""Figures of a whole run from its results.json: perplexity against FP32, the paper's Fig. 3 and Fig. 6."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from aimet_quadapter.running.plots import save_figure  # noqa: E402

# in the order of the paper's Fig. 6
COMPARISON = ("fp", "fp_finetuned", "qat", "quadapter_bc_qat", "quadapter")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _bar_rows(rows: list[dict]) -> list[dict]:
    """The rows that get a bar: every quantized one, sweeps left out."""
    return [r for r in rows if r["method"] != "fp" and not r.get("size")]


def perplexity_bars(results: dict, rows: list[dict]) -> tuple[list[str], dict[str, list[float]]]:
    """The bars of :func:`plot_perplexities`: labels and, per column, perplexity / FP32's (NaN where missing)."""
    columns = [d["label"] for d in results["datasets"]]
    fp = next((r for r in rows if r["method"] == "fp"), None)
    quantized = _bar_rows(rows)
    if fp is None:
        return [], {}
    labels = [r["label"] + ("" if r["group"].startswith("calib:") else f"\n({r['group']})") for r in quantized]
    series = {}
    for column in columns:
        base = fp["ppl"].get(column)
        series[column] = [
            r["ppl"][column] / base if _finite(base) and _finite(r["ppl"].get(column)) else math.nan for r in quantized
        ]
    return labels, series


def plot_perplexities(results: dict, rows: list[dict], path: Path) -> Path | None:
    """One bar per cell and column, perplexity / FP32's so that texts share one axis, labelled with the perplexity."""
    labels, series = perplexity_bars(results, rows)
    if not labels or not any(math.isfinite(v) for values in series.values() for v in values):
        return None
    fp = next(r for r in rows if r["method"] == "fp")
    quantized = _bar_rows(rows)
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * len(labels) * max(len(series), 2) + 2), 3.8))
    for j, (column, ratios) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(labels))]
        spreads = [r.get("spread", {}).get("ppl", {}).get(column) for r in quantized]
        low = [v - s[0] / fp["ppl"][column] if s and math.isfinite(v) else 0.0 for v, s in zip(ratios, spreads)]
        high = [s[1] / fp["ppl"][column] - v if s and math.isfinite(v) else 0.0 for v, s in zip(ratios, spreads)]
        errors = [low, high] if any(low) or any(high) else None
        bars = ax.bar(xs, [0.0 if math.isnan(v) else v for v in ratios], width, label=column, yerr=errors, capsize=2)
        for bar, ratio in zip(bars, ratios):
            if math.isfinite(ratio):
                x = bar.get_x() + bar.get_width() / 2
                ax.annotate(f"{ratio * fp['ppl'][column]:.1f}", (x, ratio), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, ls="--", color="gray", lw=1, label="FP32")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("perplexity / FP32's")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return save_figure(fig, Path(path))


def plot_data_size(results: dict, path: Path) -> Path | None:
    """Perplexity against the number of fine-tuning sequences, one panel per eval dataset, log-log."""
    cells = [c for c in results["cells"].values() if c.get("size")]
    if not cells:
        return None
    columns = [d["label"] for d in results["datasets"]]
    fids = sorted({c["fid"] for c in cells})
    in_fid = {lbl for f in fids for lbl in results.get("fids", {}).get(f, [])}
    series: dict[tuple[str, str], list[tuple[int, dict]]] = {}
    for c in cells:
        series.setdefault((c["fid"], c["method"]), []).append((c["size"], c))
    ncols = min(len(columns), 3)
    nrows = math.ceil(len(columns) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    references = [c for c in results["cells"].values() if c["method"] in ("fp", "quadapter_bc") and not c.get("size")]
    for ax, column in zip(axes.flat, columns):
        for (fid, _), points in sorted(series.items(), key=lambda kv: (kv[0][0], kv[1][0][1]["rank"])):
            points.sort(key=lambda p: p[0])
            xs = [s for s, c in points if _finite(c["ppl"].get(column))]
            ys = [c["ppl"][column] for s, c in points if _finite(c["ppl"].get(column))]
            if xs:
                label = points[0][1]["label"] + (f" [{fid}]" if len(fids) > 1 else "")
                ax.plot(xs, ys, marker="o", label=label)
        for ref in references:
            value = ref["ppl"].get(column)
            if _finite(value):
                style = "--" if ref["method"] == "fp" else ":"
                ax.axhline(value, ls=style, color="gray", lw=1, label=ref["label"])
        ax.set(xscale="log", yscale="log", xlabel="fine-tuning sequences", ylabel="perplexity")
        sizes = sorted({c["size"] for c in cells})
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(column + (" (F-ID)" if column in in_fid else " (F-OOD)"), fontsize=10)
        ax.grid(alpha=0.3, which="both")
    for ax in list(axes.flat)[len(columns) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    return save_figure(fig, Path(path))


def comparison_rows(results: dict, fid: str) -> list[dict]:
    """The cells of the FP / FP-fine-tuned comparison for one F-ID (full-size fine-tuning, or the largest)."""
    rows = []
    for method in COMPARISON:
        found = [
            c
            for c in results["cells"].values()
            if c["method"] == method and (c["group"] == "-" if method == "fp" else c.get("fid") == fid)
        ]
        if found:
            rows.append(max(found, key=lambda c: (c.get("size") is None, c.get("size") or 0)))
    return rows


def plot_fp_comparison(results: dict, fid: str, path: Path) -> Path | None:
    """Bars per eval dataset: FP, FP fine-tuned, QAT, Quadapter BC+QAT, Quadapter (those that ran)."""
    rows = comparison_rows(results, fid)
    if not any(r["method"] == "fp_finetuned" for r in rows):
        return None
    columns = [d["label"] for d in results["datasets"]]
    fid_labels = set(results.get("fids", {}).get(fid, []))
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(columns) + 2), 3.8))
    for i, row in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(columns))]
        ys = [row["ppl"].get(c, float("nan")) for c in columns]
        ax.bar(xs, ys, width, label=row["label"])
    ax.set_xticks(range(len(columns)), [c + ("\n(F-ID)" if c in fid_labels else "") for c in columns])
    ax.set(yscale="log", ylabel="perplexity")
    ax.set_title(f"fine-tuned on {fid}", fontsize=10)
    ax.grid(alpha=0.3, axis="y", which="both")
    ax.legend(fontsize=7)
    return save_figure(fig, Path(path))
