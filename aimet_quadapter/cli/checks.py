"""The CLI's checks of a state, an export or runs: ``noise``, ``device-texts``, ``ptq-state`` and ``ranges``. Light to
import: what a command needs is loaded when it runs."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from aimet_quadapter.cli.export import MODEL_HELP, positive_int
from aimet_quadapter.cli.options import prefix_ids
from aimet_quadapter.errors import QuadapterError

_PTQ_PREFIX = "<|im_start|>\n"  # SmolLM2's own, as the demo's


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def add_check_commands(sub: Any) -> None:
    """``noise``, ``device-texts``, ``ptq-state`` and ``ranges``, added to the CLI's subparsers."""
    _add_noise_command(sub)
    _add_device_texts_command(sub)
    _add_ptq_state_command(sub)
    _add_ranges_command(sub)


def _add_noise_command(sub: Any) -> None:
    p = sub.add_parser(
        "noise",
        help="how far a saved state's perplexity moves when float32 rounds differently, as on another CPU",
        description="Scores the state as saved, then once per draw with every tensor an activation quantizer "
        "reads moved by one float32 ulp (what another CPU's or runtime's order of summing does), and prints the "
        "perplexities and their range; and, on the first 256 tokens, the share of activation codes (the "
        "integers the quantizers round to) that the first draw changed, layer by layer. With the windows of "
        "`export --verify-split valid` (--split valid --seq-len 128 --max-tokens 512): the band its "
        "--device-check is compared with.",
    )
    p.add_argument("state", help="a Quadapter state file, or a cell folder holding one")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--dataset", default="ptb", help="(default ptb)")
    p.add_argument("--split", default="test", help="(default test)")
    p.add_argument(
        "--seq-len", type=positive_int, default=1024, help="window length (default 1024; the export verifies on 128)"
    )
    p.add_argument("--max-tokens", type=positive_int, default=8192, help="(default 8192)")
    p.add_argument("--draws", type=_non_negative_int, default=3, help="(default 3)")
    p.add_argument(
        "--ulps",
        type=positive_int,
        default=1,
        help="the draws' move, in float32 ulps (codes: always one); 16 for a runtime whose sums round further "
        "from the sim's (default 1)",
    )
    p.add_argument(
        "--orders",
        action="store_true",
        help="draws sum every matrix product (each Linear layer's and attention's two) in a random order instead: "
        "the sums of another runtime, whose kernels order them otherwise",
    )
    p.add_argument(
        "--rounding",
        choices=("aimet-torch", "aimet-onnx"),
        default="aimet-torch",
        help="whose quantizer arithmetic every score uses (aimet-onnx: the device-graph check's; default aimet-torch)",
    )
    p.set_defaults(func=_cmd_noise)


def _cmd_noise(args: argparse.Namespace) -> int:
    import torch

    from aimet_quadapter.export.exporter import one_ulp_inputs
    from aimet_quadapter.export.noise import shuffled_sums
    from aimet_quadapter.models import load_model
    from aimet_quadapter.quadapter.state import QuadapterState, resolve_state
    from aimet_quadapter.quant.quantizers import aimet_onnx_rounding
    from aimet_quadapter.text.perplexity import eval_windows_for

    def noise(model: torch.nn.Module, seed: int) -> AbstractContextManager[None]:
        return shuffled_sums(model, seed) if args.orders else one_ulp_inputs(model, seed, args.ulps)

    model, tokenizer = load_model(args.model, quiet=True)
    sim = QuadapterState.load(resolve_state(args.state)).build_sim(model, in_place=True)
    windows = eval_windows_for(tokenizer, args.dataset, args.split, args.seq_len, max_tokens=args.max_tokens)
    with aimet_onnx_rounding(sim.model) if args.rounding == "aimet-onnx" else nullcontext():
        _noise_report(args, sim.model, windows, noise)
    return 0


def _noise_report(args: argparse.Namespace, model: Any, windows: list, noise: Callable) -> None:
    from aimet_quadapter.export.noise import activation_codes
    from aimet_quadapter.text.perplexity import perplexity

    first = windows[0].ids[None, :256]
    before, after = activation_codes(model, first), activation_codes(model, first, 1, noise)
    by_layer: dict[str, list[float]] = defaultdict(list)
    for name, codes in before.items():
        if args.orders and ".input[" in name:  # a permuted product's inputs: the same codes in another order
            continue
        match = re.search(r"layers\.(\d+)\.", name)
        by_layer[match.group(1) if match else "head"].append((codes != after[name]).float().mean().item())
    print(f"share of {'output ' if args.orders else ''}activation codes one draw changes, first 256 tokens:")
    for layer, shares in by_layer.items():
        print(f"  layer {layer}: mean {sum(shares) / len(shares):.1e}, largest {max(shares):.1e}")

    ppl = []
    for seed in (None, *range(1, args.draws + 1)):
        with noise(model, seed) if seed is not None else nullcontext():
            ppl.append(perplexity(model, windows, progress=False).ppl)
        print(f"{'as saved' if seed is None else f'draw {seed}'}: {args.dataset} {args.split} perplexity {ppl[-1]:.3f}")
    print(f"range {min(ppl):.3f}-{max(ppl):.3f}: {100 * (max(ppl) / min(ppl) - 1):.2f} % of the lowest")


def _add_device_texts_command(sub: Any) -> None:
    p = sub.add_parser(
        "device-texts",
        help="a run's cell on the device graph: every text its run scored, beside the run's number (needs aimet-onnx)",
        description="For a cell folder of a run (RUN/seed-N/GROUP/METHOD) and the export of its state "
        "(`aimet-quadapter export CELL --model M --out EXPORT --seq-len L --device-check`, L the run's evaluation "
        "length), the perplexity of the export's graph in AIMET's ONNX simulation (--device-check's graph, its "
        "encodings loaded) on each test and development text of the run's recipe, the same windows, beside the "
        "sim's number that the run recorded for the cell (its results.json).",
    )
    p.add_argument("cell", type=Path, help="a cell folder of a run (its state inside)")
    p.add_argument("export", type=Path, help="the export of that state (model.onnx and its encodings)")
    p.add_argument("--only", choices=("test", "dev"), help="only the run's test texts, or only its development texts")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_device_texts)


def _cmd_device_texts(args: argparse.Namespace) -> int:
    from aimet_quadapter.export.device_check import require_aimet_onnx
    from aimet_quadapter.export.formats import MANIFEST

    require_aimet_onnx()
    manifest = args.export / MANIFEST
    if not manifest.is_file():
        raise QuadapterError(f"{args.export}: no {MANIFEST}: give an export folder (see `export`)")
    from aimet_quadapter.running.device_texts import ROLES, cell_record, device_perplexities, texts_of

    record, recipe = cell_record(args.cell)
    texts = texts_of(record, recipe, (args.only,) if args.only else ROLES)
    seq_len = int(json.loads(manifest.read_text())["seq_len"])
    other = [f"{t.label} ({t.role})" for t in texts if any(len(w.ids) != seq_len for w in t.windows)]
    if other:  # the graph's input has a fixed length
        raise QuadapterError(
            f"{args.export}: a graph of {seq_len} tokens; {', '.join(other)}: windows of another length"
        )
    device = device_perplexities(args.export, texts, progress=not args.no_progress)
    print(f"{record['method']} ({args.cell}), seed {record.get('seed')}: text | sim (results.json) | device graph")
    for t, value in zip(texts, device):
        print(f"{t.label} ({t.role}) | {t.sim:.3f} | {value:.3f} ({100 * (value / t.sim - 1):+.1f} %)")
    return 0


def _add_ptq_state_command(sub: Any) -> None:
    from aimet_quadapter.quant.config import QuantPolicy

    bits = QuantPolicy().activation_bits
    p = sub.add_parser(
        "ptq-state",
        help="save a PTQ state of a model under target htp, e.g. for `export --device-check`",
        description="Builds the sim under target htp (--activation-bits 16: A16W8), calibrates it on --samples "
        "crops of PTB train after the prefix, and saves it as a state `export` and `eval --state` read.",
    )
    p.add_argument("--model", default="smollm2-135m", help="hub id, local folder, or smollm2-135m (the default)")
    p.add_argument("--out", required=True, help="the state file to write (.safetensors)")
    p.add_argument("--samples", type=positive_int, default=4, help="calibration crops (default 4)")
    p.add_argument("--length", type=positive_int, default=512, help="tokens per crop (default 512)")
    p.add_argument(
        "--prefix",
        default=_PTQ_PREFIX,
        help="text every sequence follows, its keys and values kept in full precision (default SmolLM2's "
        "'<|im_start|>\\n', the demo's); none or '': no prefix",
    )
    p.add_argument(
        "--bit-overrides",
        nargs="*",
        default=[],
        metavar="PATTERN=BITS",
        help="quantizers whose name matches PATTERN get BITS (as --policy-bit-overrides)",
    )
    p.add_argument("--activation-bits", type=int, default=bits, help=f"(default {bits})")
    p.set_defaults(func=_cmd_ptq_state)


def _cmd_ptq_state(args: argparse.Namespace) -> int:
    from aimet_quadapter.models.loading import check_model_source
    from aimet_quadapter.quant.config import QuantPolicy

    check_model_source(args.model)
    # refused before the model loads
    policy = QuantPolicy(target="htp", activation_bits=args.activation_bits, bit_overrides=tuple(args.bit_overrides))
    from aimet_quadapter.models import load_model
    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.quant.policy import build_sim, calibrate
    from aimet_quadapter.text.data import load_text, random_crops, tokenize

    model, tokenizer = load_model(args.model, quiet=True)
    model.set_prefix(prefix_ids(tokenizer, args.prefix or None))  # '' as none
    train = tokenize(tokenizer, load_text("ptb", "train"))
    sim = build_sim(model, policy)
    calibrate(sim, random_crops(train, args.samples, args.length).split(1))
    state = QuadapterState.from_sim(sim, {}, method="ptq", model=args.model)
    print(f"saved {state.save(args.out)}")
    return 0


def _add_ranges_command(sub: Any) -> None:
    p = sub.add_parser(
        "ranges",
        help="whether other runs of a recipe (another CPU, thread count or seed) land in a run folder's ranges",
        description="For every quantized cell of each OTHER run folder, the row of REFERENCE with its method, "
        "group, fine-tuning size and settings (over REFERENCE's seeds of them): whether each test perplexity lies "
        "in that row's 95 % prediction range (the report's \"where another run lands\") and in its min-max over "
        "the seeds. Prints a markdown table, the count of each, and how many cells had no such row of two seeds "
        "or more.",
    )
    p.add_argument("reference", help="the run folder whose ranges are checked (seeded cells)")
    p.add_argument("others", nargs="+", metavar="other", help="run folders of the same recipe")
    p.set_defaults(func=_cmd_ranges)


def _where(cell: dict) -> str:
    from aimet_quadapter.running.statistics import machine_label

    seed = "no seed" if cell.get("seed") is None else f"seed {cell['seed']}"
    return f"{seed}, {machine_label(cell)}"


def _row_of(cell: dict) -> tuple:
    # a sweep's 2-sequence point is not the 40-sequence row of its method, nor other settings' seeds the row's
    return cell["method"], cell["group"], cell.get("size"), cell.get("row_fingerprint")


def _cmd_ranges(args: argparse.Namespace) -> int:
    from aimet_quadapter.running.results_file import load_results
    from aimet_quadapter.running.statistics import merge_seeds

    rows = {_row_of(r): r for r in merge_seeds(load_results(args.reference)["cells"]).values()}
    others = [(other, load_results(other)) for other in args.others]  # a missing one refused before any row
    print("| run | cell | text | perplexity | 95 % range | in it | min-max | in it |")
    print("| --- | --- | --- | ---: | --- | --- | --- | --- |")
    counts = {"predict": [0, 0], "spread": [0, 0]}
    unmatched = 0
    for other, results in others:
        for cell in results["cells"].values():
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
    return 0
