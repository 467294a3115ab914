"""The report of a run folder, from results.json and its files alone: the paper's tables (Table 1, 2) and figures."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from aimet_quadapter.atomic import write_text_atomic
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.methods.catalog import CATALOG
from aimet_quadapter.running.results_file import load_results
from aimet_quadapter.running.statistics import finite, machine_label, merge_seeds


def _fmt(value) -> str:
    if not isinstance(value, (int, float)):
        return "–"
    if not math.isfinite(value):
        return "inf" if value > 0 else "nan"
    return f"{value:.2f}"


def _group_title(group: str) -> str:
    if group == "-":
        return "–"
    return f"Calib. data ({group.removeprefix('calib:')})" if group.startswith("calib:") else group


def ordered_rows(results: dict, seeds: bool = False) -> list[dict]:
    """Rows in table order (FP, calibration groups, F-ID groups; method, size); ``seeds``: no seeds merged."""
    groups = ["-"] + [f"calib:{c}" for c in results.get("calibration_sets", {})] + list(results.get("fids", {}))
    cells = list((results["cells"] if seeds else merge_seeds(results["cells"])).values())
    order = {g: i for i, g in enumerate(dict.fromkeys([*groups, *(c["group"] for c in cells)]))}
    return sorted(cells, key=lambda c: (order[c["group"]], c.get("rank", 99), c.get("size") or 0, c.get("seed") or 0))


def _row_label(cell: dict) -> str:
    # what stopped a cell, short: the cells table gives its whole error
    reason = "perplexity not finite" if str(cell.get("error", "")).startswith("perplexity ") else "training diverged"
    stopped = f" (stopped: {reason})" if cell.get("error") else ""
    if cell.get("stopped_seeds"):
        stopped = f" (seed {', '.join(map(str, cell['stopped_seeds']))} stopped: {reason}; the mean of the others)"
    if cell.get("settings"):  # its key's seeds ran under more than one set of settings
        stopped += f" (settings {cell['settings']})"
    if cell.get("nonfinite_seeds"):
        seeds = ", ".join(map(str, cell["nonfinite_seeds"]))
        stopped += f" (seed {seeds}: perplexity inf or NaN, not in the mean)"
    if cell.get("machines"):
        stopped += f" (seeds ran under {', '.join(cell['machines'])})"
    other = " †" if cell.get("other_versions") else ""
    return cell["label"] + (f" (n={cell['size']})" if cell.get("size") else "") + stopped + other


def _versions_note(results: dict) -> str | None:
    """Marks (``other_versions``) and names the cells computed under other versions than the newest cell."""
    cells = [c for c in results["cells"].values() if c.get("versions")]
    if not cells:
        return None
    newest = max(cells, key=lambda c: c["finished"])["versions"]
    notes = []
    for c in cells:
        differ = {k: v for k, v in c["versions"].items() if newest.get(k) != v and k != "aimet-quadapter"}
        if differ:
            c["other_versions"] = True
            notes.append(f"{c['label']} ({c['group']}): " + ", ".join(f"{k} {v}" for k, v in differ.items()))
    if not notes:
        return None
    now = ", ".join(f"{k} {v}" for k, v in newest.items() if k != "aimet-quadapter")
    return f"† computed under other versions than the newest cell's ({now}): " + "; ".join(notes) + "."


def _best(rows: list[dict], columns: list[str], key: str = "ppl") -> dict[str, float]:
    candidates = [r for r in rows if r["method"] not in CATALOG or CATALOG[r["method"]].quantized]
    if len(candidates) < 2:
        return {}
    values = {col: [r[key][col] for r in candidates if finite(r.get(key, {}).get(col))] for col in columns}
    return {col: min(v) for col, v in values.items() if v}


def _mean(values: list) -> float | None:
    values = [v for v in values if finite(v)]
    return sum(values) / len(values) if values else None


def _table(
    rows: list[dict],
    columns: list[str],
    fids: dict[str, list[str]],
    extra: dict[str, list[str]] | None,
    key: str = "ppl",
    ranges: str = "spread",
) -> str:
    """A markdown table of ``rows``' ``key`` numbers; ``extra``: mean columns (title -> the columns averaged);
    ``ranges``: beside a mean over seeds, their min-max (``spread``) or where another run lands (``predict``)."""
    extra = extra or {}
    head = ["Data", "Method", *columns, *extra]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---", "---"] + ["---:"] * (len(head) - 2)) + " |"]
    by_group: dict[str, list[dict]] = {}
    for r in rows:
        by_group.setdefault(r["group"], []).append(r)
    for group, members in by_group.items():
        best = _best(members, columns, key)
        for i, r in enumerate(members):
            own = set(fids.get(r.get("fid") or "", []))
            cells = []
            for col in columns:
                value = r.get(key, {}).get(col)
                text = _fmt(value)
                low, high = r.get(ranges, {}).get(key, {}).get(col, (None, None))
                spread = f" ({_fmt(low)}–{_fmt(high)})" if low is not None and len(r.get("seeds", [])) > 1 else ""
                if col in best and value == best[col]:
                    text = f"**{text}**"
                if col in own:
                    text = f"<ins>{text}</ins>"
                cells.append(text + spread)
            cells += [_fmt(_mean([r["ppl"].get(c) for c in cols])) for cols in extra.values()]
            lines.append("| " + " | ".join([_group_title(group) if i == 0 else "", _row_label(r), *cells]) + " |")
    return "\n".join(lines)


def results_table(results: dict) -> str:
    """The Table-1 layout over every cell of the run."""
    columns = [d["label"] for d in results["datasets"]]
    return _table(ordered_rows(results), columns, results.get("fids", {}), None)


def prediction_table(results: dict) -> str | None:
    """The Table-1 layout with the 95 % range where another seed's or CPU's run lands; None without seeds."""
    rows = ordered_rows(results)
    if not any(r.get("predict", {}).get("ppl") for r in rows):
        return None
    columns = [d["label"] for d in results["datasets"]]
    return _table(rows, columns, results.get("fids", {}), None, ranges="predict")


def matched_comparisons(results: dict) -> list[str]:
    """Per trained method, matched baseline and column: lower or higher beyond the spread over seeds, within it, or
    one seed; two rows compared on the seeds both ran."""
    rows = ordered_rows(results)
    lines = []
    for r in rows:
        info = CATALOG.get(r["method"])
        for other in info.matched if info else ():
            # of the same group and fine-tuning size; each of its rows where its seeds ran under several settings
            place = (r["group"], r.get("size"))
            for base in (b for b in rows if b["method"] == other and (b["group"], b.get("size")) == place):
                lines += _comparison(results, r, base)
    return lines


def _comparison(results: dict, r: dict, base: dict) -> list[str]:
    a, b, note = r, base, ""
    name_a, name_b = _name(r), _name(base)
    seeds_a, seeds_b = set(r.get("seeds", [])), set(base.get("seeds", []))
    if seeds_a and seeds_b and seeds_a != seeds_b:
        # a mean over other seeds is another measurement: both rows from the seeds they share
        shared = sorted(seeds_a & seeds_b)
        if not shared:
            return [f"- {r['group']}: {name_a} and {name_b} share no seed, not compared"]
        a, b = _on_seeds(results, r, shared), _on_seeds(results, base, shared)
        note = f" (on seed{'s' * (len(shared) > 1)} {', '.join(map(str, shared))}, which both ran)"
    lines = []
    for field, title in (("ppl", ""), ("dev_ppl", " (development)")):
        for col, value in a.get(field, {}).items():
            ref = b.get(field, {}).get(col)
            if not isinstance(ref, (int, float)):
                continue
            lines.append(
                f"- {r['group']}, {col}{title}: {name_a} {_fmt(value)} vs {name_b} "
                f"{_fmt(ref)} ({100 * (value / ref - 1):+.1f} %){note}: {_verdict(a, b, field, col)}"
            )
    return lines


def _name(row: dict) -> str:
    return row["label"] + (f" (settings {row['settings']})" if row.get("settings") else "")


def _on_seeds(results: dict, row: dict, seeds: list[int]) -> dict:
    """``row`` (seeds merged) again, from its cells of ``seeds`` alone."""

    def place(c: dict) -> tuple:
        return c["method"], c["group"], c.get("size"), c.get("row_fingerprint")

    cells = {key: c for key, c in results["cells"].items() if place(c) == place(row) and c.get("seed") in seeds}
    return next(iter(merge_seeds(cells).values()))


def _verdict(a: dict, b: dict, field: str, col: str) -> str:
    if len(a.get("seeds", [])) < 2 or len(b.get("seeds", [])) < 2:
        return "one seed, no spread to judge by"
    (a_low, a_high), (b_low, b_high) = a["spread"][field][col], b["spread"][field][col]
    where = "lower beyond" if a_high < b_low else "higher beyond" if b_high < a_low else "within"
    return f"{where} the spread ({len(a['seeds'])} seeds)"


def dev_table(results: dict) -> str | None:
    """The Table-1 layout on the development texts; None when the run has none."""
    columns = [d["label"] for d in results.get("dev_datasets", [])]
    return _table(ordered_rows(results), columns, {}, None, "dev_ppl") if columns else None


def fid_food_tables(results: dict) -> list[tuple[str, str]]:
    """(F-ID name, table) in the Table-2 layout, for every F-ID that leaves some eval dataset out of domain."""
    columns = [d["label"] for d in results["datasets"]]
    rows = ordered_rows(results)
    out = []
    for fid, labels in results.get("fids", {}).items():
        inside = [c for c in columns if c in labels]
        outside = [c for c in columns if c not in labels]
        mine = [r for r in rows if r.get("fid") == fid]
        if not inside or not outside or not mine:
            continue
        cals = {r["calibration"] for r in mine}
        shared = [
            r for r in rows if r["group"] == "-" or (r["group"].startswith("calib:") and r["calibration"] in cals)
        ]
        out.append((fid, _table(shared + mine, columns, results.get("fids", {}), {"F-ID": inside, "F-OOD": outside})))
    return out


def info_text(info: dict) -> str:
    """What a method reported about itself (SeqMSE's changed ranges, Quadapter BC's check), for a table cell."""
    if not info:
        return ""
    if "continued_from" in info:
        rest = info_text({k: v for k, v in info.items() if k != "continued_from"})
        return f"from {info['continued_from']}'s saved state" + (f"; {rest}" if rest else "")
    if "seq_mse_layers" in info:
        return (
            f"SeqMSE moved {info['seq_mse_layers_changed']} of {info['seq_mse_layers']} Linear weight ranges "
            f"(mean range ratio {info['seq_mse_mean_range_ratio']:.3f})"
        )
    if "adaround_frozen_encodings" in info:
        return (
            f"{info['adaround_frozen_encodings']} AdaRound encodings frozen; "
            f"{100 * info['adaround_flipped_fraction']:.2f} % of Linear weights rounded away from nearest"
        )
    if "validation_kept" in info:  # the two losses differ in the third decimal or later
        return (
            f"held-out LM loss {info['validation_start']:.4f} at the start, {info['validation_end']:.4f} after "
            f"phase 1: kept {_kept(info)}"
        )
    return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())


def _kept(info: dict) -> str:
    kept = str(info["validation_kept"])
    if kept in ("start", "end"):
        return f"the {kept}"
    loss = info.get("validation_points", {}).get(kept)
    return f"the point {kept} of the way" + (f" ({loss:.4f})" if loss is not None else "")


def timing_table(results: dict) -> str:
    lines = [
        "| Cell | Method (s) | Evaluation (s) | Wall (s) | Peak RSS (GiB) | Notes |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in ordered_rows(results, seeds=True):
        key = next(k for k, v in results["cells"].items() if v is r)
        if r.get("error"):  # a stopped cell has no times: its training diverged, or its perplexity is not finite
            lines.append(f"| {key} | – | – | – | – | stopped: {r['error']} |")
            continue
        rss = f"{r['peak_rss_kib'] / 2**20:.2f}"
        lines.append(
            f"| {key} | {r['method_time_s']:.1f} | {r['eval_time_s']:.1f} | {r['wall_time_s']:.1f} | {rss} "
            f"| {info_text(r.get('info', {}))} |"
        )
    return "\n".join(lines)


def _settings_lines(results: dict) -> list[str]:
    lines = [f"Model: `{results.get('model', '?')}`.", ""]
    for name, recipe in results.get("recipes", {}).items():
        s = recipe["settings"]
        p1, p2, cal = s["phase1"], s["phase2"], s["calibration"]
        lines.append(
            f"- recipe `{name}`: methods {', '.join(s['methods'])}; {_policy_label(s['policy'])}; calibration "
            f"{cal['samples']} x {cal['length']} tokens of {', '.join(cal['dataset'] or ['each F-ID'])}; "
            f"phase 1 {p1['steps']} steps; phase 2 {p2['steps']} steps x {p2['batch_size']} x {p2['seq_len']} tokens"
            + (f"; fine-tuning sizes {s['finetune_sizes']}" if s.get("finetune_sizes") else "")
        )
    return lines


def _policy_label(values: dict) -> str:
    """Which graph a run's numbers are for: its policy's label (its target, bits and weights' grids)."""
    from pydantic import ValidationError

    from aimet_quadapter.quant.config import QuantPolicy

    try:
        return QuantPolicy.model_validate(values).label()
    except ValidationError:  # a policy of another version: what every version records
        return f"W{values['weight_bits']}A{values['activation_bits']} under target {values.get('target', 'paper')}"


def _images(run_dir: Path, pattern: str, title: str) -> list[str]:
    """A section of every figure in ``run_dir`` that ``pattern`` matches; nothing where none does."""
    images = [
        f"![{p.parent.relative_to(run_dir)}]({p.relative_to(run_dir).as_posix()})"
        for p in sorted(run_dir.rglob(pattern))
    ]
    return [title, "", *images, ""] if images else []


def build_report(run_dir: str | Path) -> str:
    run_dir = Path(run_dir)
    results = load_results(run_dir)
    if not results.get("cells"):
        return f"# Report of {run_dir}\n\nNo finished cell yet.\n"
    versions = _versions_note(results)  # before the tables: it marks their rows
    parts = [f"# Report of `{run_dir.name}`", "", *_settings_lines(results), ""]
    parts += _table1_section(results, versions)
    parts += _prediction_section(results)
    if comparisons := matched_comparisons(results):
        parts += ["## Against the matched baselines", "", *comparisons, ""]
    parts += _dev_section(results)
    parts += export_section(results)
    parts += _figure_sections(run_dir, results)
    parts += ["## Cells and wall time", "", timing_table(results), ""]
    return "\n".join(parts)


def _table1_section(results: dict, versions: str | None) -> list[str]:
    seeds = results.get("seeds")
    return [
        "## Perplexity (Table 1 layout)",
        "",
        "Lower is better. <ins>Underlined</ins>: the row's own F-ID (its fine-tuning data). **Bold**: best "
        "quantized result of the column within its group."
        + (f" Rows run with seeds {', '.join(map(str, seeds))}: their mean (min–max)." if seeds else ""),
        "",
        results_table(results),
        "",
        *([versions, ""] if versions else []),
    ]


def _prediction_section(results: dict) -> list[str]:
    if not (predicted := prediction_table(results)):
        return []
    return [
        "## Where another run lands",
        "",
        "The mean over the seeds and the range that holds one more run, on another seed or another CPU, with "
        "probability 95 % (Student's t from the seeds). Another CPU is another run even for one seed: a float32 "
        "rounding difference re-draws most of the sim's rounding a few layers on. The min-max of n seeds holds "
        "the next run with probability (n - 1) / (n + 1), half the time for three.",
        "",
        predicted,
        "",
    ]


def _dev_section(results: dict) -> list[str]:
    if not (dev := dev_table(results)):
        return []
    texts = ", ".join(
        f"{d['label']} (split {d['split']}" + (f", from token {d['start']}" if d.get("start") else "") + ")"
        for d in results["dev_datasets"]
    )
    note = f"Settings are chosen on these columns, never on the table above: {texts}."
    return ["## Development text", "", note, "", dev, ""]


def export_section(results: dict) -> list[str]:
    """The row chosen on development text, its export and the device graph beside the sim; nothing without one."""
    if not (e := results.get("export")):
        return []
    labels = {c["method"]: c["label"] for c in results["cells"].values()}
    rows = sorted(e["scores"].items(), key=lambda kv: kv[1])
    parts = [
        "## The device export",
        "",
        f"Chosen on development text ({e['rule']}): **{labels.get(e['chosen'], e['chosen'])}** (`{e['chosen']}`, "
        f"cell `{e['cell']}`), exported to `{e['path']}`.",
        "",
        "| row | development-text score |",
        "| --- | ---: |",
        *[f"| {labels.get(m, m)}{' (chosen)' if m == e['chosen'] else ''} | {_fmt(v)} |" for m, v in rows],
        "",
    ]
    if not (d := e.get("device_check")):
        return parts
    v = e["verification"]
    share = d["with_encoding"] / max(d["activation_tensors"], 1)
    rounded = d.get("sim_ppl_aimet_onnx_rounding")
    within = d["ppl_rel_diff"] <= v["ppl_bound"]  # the band the export holds its own ONNX graphs to
    verdict = f", {'within' if within else '**outside**'} the export's band {v['ppl_bound']:.1e}"
    parts += [
        f"The device graph in {d['simulator']}: {d['with_encoding']} of {d['activation_tensors']} quantized "
        f"activation tensors carry this package's encoding ({share:.1%}); the rest were calibrated on "
        f"{d['calibration_windows']} window(s) of tuning text.",
        "",
        f"| graph, on {v['windows']} window(s) of {e.get('verify_text', 'the verification text')} | perplexity "
        "| against the sim |",
        "| --- | ---: | ---: |",
        f"| the sim | {_fmt(d['sim_ppl'])} | float32 noise {d['sim_float_noise']:.1e} |",
        *(
            [f"| the sim, rounding as aimet-onnx rounds | {_fmt(rounded)} | {rounded / d['sim_ppl'] - 1:+.1e} |"]
            if rounded
            else []
        ),
        f"| **the device graph** | {_fmt(d['ppl'])} | {d['ppl'] / d['sim_ppl'] - 1:+.1e}{verdict} |",
        "",
    ]
    return parts + _prompts_table(d.get("prompts") or [])


TEXTS = ("prompt_text", "fp_text", "device_text")  # a prompt's answer's texts, in the table's order


def _prompts_table(answers: list[dict]) -> list[str]:
    if not answers:
        return []
    return [
        "Prompts answered greedily, the FP model beside the device graph; top-1: how often the device graph's "
        "most likely next token is the FP model's along the FP model's answer.",
        "",
        "| prompt | FP model | device graph | top-1 |",
        "| --- | --- | --- | ---: |",
        *[f"| {' | '.join(_cell_text(a[k]) for k in TEXTS)} | {a['top1']:.0%} |" for a in answers],
        "",
    ]


def _cell_text(text: str) -> str:
    """``text`` as one table cell: its line breaks and pipes escaped."""
    return text.replace("|", "\\|").replace("\n", "⏎ ").strip() or "–"


def _figure_sections(run_dir: Path, results: dict) -> list[str]:
    """The figures (written to ``run_dir``/figures) and the F-ID / F-OOD tables, in the paper's order."""
    from aimet_quadapter.reporting.figures import plot_data_size, plot_fp_comparison, plot_perplexities

    parts: list[str] = []
    figures = run_dir / "figures"
    if bars := plot_perplexities(results, ordered_rows(results), figures / "perplexity.png"):
        parts += [f"![perplexity / FP32's]({bars.relative_to(run_dir).as_posix()})", ""]
    for fid, table in fid_food_tables(results):
        parts += [f"## F-ID / F-OOD averages, F-ID = {fid} (Table 2 layout)", "", table, ""]
    if sweep := plot_data_size(results, figures / "data_size.png"):
        parts += ["## Data-size sweep (Fig. 3)", "", f"![data-size sweep]({sweep.relative_to(run_dir).as_posix()})", ""]
    for fid in results.get("fids", {}):
        if path := plot_fp_comparison(results, fid, figures / f"fp_finetuned_{fid.replace('+', '_')}.png"):
            image = f"![FP comparison]({path.relative_to(run_dir).as_posix()})"
            parts += [f"## FP vs FP fine-tuned, F-ID = {fid} (Fig. 6)", "", image, ""]
    parts += _images(run_dir, "channel_ranges*.png", "## Per-channel ranges of the last site, before / after (Fig. 4)")
    return parts + _images(run_dir, "phase1_curves.png", "## Phase-1 learning curves, first and last site (Fig. 5)")


def results_section(run_dir: str | Path) -> str:
    """The run as a section of docs/results.md: its command, where and on which code it ran, and its tables."""
    run_dir = Path(run_dir)
    results = load_results(run_dir)
    recipes = results.get("recipes", {})
    if len(recipes) != 1:
        raise QuadapterError(f"{run_dir}: a results section shows one recipe's run; this folder has {len(recipes)}")
    ((name, recipe),) = recipes.items()
    # a run started from Python records no command: it ran the recipe as written
    command = recipe.get("command") or f"aimet-quadapter run recipes/{Path(recipe.get('path') or name).stem}.yaml"
    command, out = _without_out(command), f"runs/{name}"  # where the run went changes no number
    cells = [c for c in results["cells"].values() if not c.get("error")]
    seeds = results.get("seeds") or sorted({c["seed"] for c in cells if c.get("seed") is not None}) or [0]
    machines = sorted({f"{c['cpu']}, {machine_label(c)}" for c in cells})
    commits = sorted({(c.get("commit") or "?").replace("+changes", " + changes") for c in cells})
    wall = sum(c["wall_time_s"] for c in cells)
    peak = max((c["peak_rss_kib"] for c in cells), default=0)
    parts = [
        f"## `{name}`",
        "",
        "```bash",
        command,
        f"aimet-quadapter report {out}",
        "```",
        "",
        "| graph | machine | commit | seeds | cells' wall time | cells' peak RSS |",
        "| --- | --- | --- | --- | ---: | ---: |",
        f"| {_policy_label(recipe['settings']['policy'])} | {'; '.join(machines)} | {', '.join(commits)} "
        f"| {', '.join(map(str, seeds))} | {wall / 60:.0f} min | {peak / 2**20:.2f} GiB |",
        "",
        "Test text (lower is better; **bold**: the best quantized row of its group):",
        "",
        results_table(results),
        "",
    ]
    if dev := dev_table(results):
        parts += ["Development text, on which the recipe chooses:", "", dev, ""]
    # the export's path as the page's command writes it, not this machine's folder
    here, there = str(run_dir.resolve()), out
    for line in export_section(results):
        parts.append(line.replace("## ", "### ", 1) if line.startswith("## ") else line.replace(here, there))
    return "\n".join(parts)


def _without_out(command: str) -> str:
    """``command`` without the run folder it named (``--out DIR``, ``--set out=DIR``)."""
    words, kept = shlex.split(command), []
    skip = False
    for word, after in zip(words, [*words[1:], ""]):
        if skip:
            skip = False
        elif word == "--out" or (word == "--set" and after.startswith("out=")):
            skip = True
        elif not word.startswith(("--out=", "--set=out=")):
            kept.append(word)
    return shlex.join(kept)


def write_report(run_dir: str | Path) -> tuple[Path, str]:
    text, path = build_report(run_dir), Path(run_dir) / "report.md"
    write_text_atomic(path, text)
    return path, text
