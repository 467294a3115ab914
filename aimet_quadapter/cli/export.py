"""The ``export`` subcommand of the CLI. Light to import: the export itself is loaded when the command runs."""

from __future__ import annotations

import argparse
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from aimet_quadapter.export.formats import BLOCKWISE_ENCODING_VERSION, ENCODING_VERSION, ENCODING_VERSIONS, SEQ_LEN
from aimet_quadapter.text import EVAL_SEQ_LEN

MODEL_HELP = "the FP model the state was trained on: hub id, local folder, or smollm2-135m (offline)"


def positive_int(text: str) -> int:
    """argparse type of every count option of the CLI."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_export_command(subparsers) -> None:
    """The ``export`` subcommand, added to the CLI's subparsers."""
    p = subparsers.add_parser(
        "export",
        help="export a trained state to ONNX + AIMET encodings and a QDQ ONNX, verified in onnxruntime",
        description=(
            "Writes model.onnx + model.encodings (for a device converter's quantization overrides), "
            "model_qdq.onnx and manifest.json into --out, after checking in onnxruntime that both compute "
            "what the sim computes on held-out windows. Nothing is written if a check fails."
        ),
    )
    p.add_argument("state", help="a Quadapter state (.safetensors), or a run folder holding exactly one")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--out", required=True, help="export folder (must not exist unless --force)")
    p.add_argument(
        "--seq-len", type=positive_int, default=SEQ_LEN, help=f"the graph's fixed input length (default {SEQ_LEN})"
    )
    p.add_argument(
        "--encodings-version",
        choices=ENCODING_VERSIONS,
        default=None,
        help=f"AIMET encodings format (default {ENCODING_VERSION}; {BLOCKWISE_ENCODING_VERSION} for a state of "
        f"block-wise weights, which 1.0.0 cannot carry checked)",
    )
    p.add_argument(
        "--dynamic-length",
        action="store_true",
        help="make the sequence length a dynamic axis of both graphs (batch stays 1); on-device graphs are "
        "usually static",
    )
    p.add_argument("--opset", type=positive_int, help="opset of model.onnx (default: torch's); the QDQ graph is 21")
    _add_verification_options(p)
    _add_format_options(p)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--device", default="auto", help="where the sim runs: auto (CUDA when there is one), cpu, cuda or cuda:N"
    )
    p.set_defaults(func=_cmd_export)


def _add_verification_options(p) -> None:
    p.add_argument("--verify-dataset", default="ptb", help="held-out text for the verification (default ptb)")
    p.add_argument("--verify-split", default="test", help="its split (default test)")
    p.add_argument("--verify-windows", type=positive_int, default=4, help="windows of --seq-len tokens (default 4)")
    p.add_argument(
        "--merge-shared-ranges",
        action="store_true",
        help="a state whose readers of one tensor hold different ranges (saved before they were tied): give "
        "them the union (changes the model)",
    )


def _add_format_options(p) -> None:
    p.add_argument(
        "--kv-graphs",
        action="store_true",
        help="also the prefill and decode graphs with a KV cache (in OUT/kv/), as a device generates text",
    )
    p.add_argument(
        "--kv-context",
        type=positive_int,
        default=EVAL_SEQ_LEN,
        help=f"tokens the KV graphs attend over, past and new (default {EVAL_SEQ_LEN})",
    )
    p.add_argument(
        "--kv-prefill",
        type=positive_int,
        default=SEQ_LEN,
        help=f"tokens the prefill graph takes at once (default {SEQ_LEN}); the decode graph takes one",
    )
    p.add_argument(
        "--kv-int32-ids",
        action="store_true",
        help="int32 input_ids and position_ids in the KV graphs (default int64), for targets that want them",
    )
    p.add_argument(
        "--hf-checkpoint",
        action="store_true",
        help="also the folded FP model as a Hugging Face checkpoint with AIMET's torch encodings (in OUT/hf/), "
        "for from_pretrained and AIMET's load_encodings_to_sim",
    )
    p.add_argument(
        "--device-check",
        action="store_true",
        help="also run the graph in AIMET's ONNX simulation under its HTP config, as an integer device would: "
        "this package's encodings loaded, every other tensor calibrated on --verify-windows windows of the "
        "verification text's train split; prints which tensors have no encoding (needs aimet-onnx)",
    )


def _cmd_export(args) -> int:
    from aimet_quadapter.models.loading import check_model_source
    from aimet_quadapter.quadapter.state import resolve_state
    from aimet_quadapter.running.provenance import load_checked

    start = time.time()
    state_path = resolve_state(args.state)
    check_model_source(args.model)
    state = load_checked(state_path, args.model)
    job = export_job(args, state_path)
    kv = job.check(state)
    result = job.run(state, kv)
    _print_summary(args, result, len(state.metadata.get("prefix") or []))
    print(f"export time {result.manifest['export_time_s']:.1f} s (total {time.time() - start:.1f} s)")
    return 0


def export_job(args, state_path: Path) -> Any:
    """The :class:`~aimet_quadapter.export.job.ExportJob` the command's options describe."""
    from aimet_quadapter.export.job import ExportJob

    given = {f.name: getattr(args, f.name) for f in fields(ExportJob) if f.name not in ("state", "out", "progress")}
    return ExportJob(state=state_path, out=Path(args.out), progress=not args.no_progress, **given)


def _print_summary(args, result, prefix: int) -> None:
    m, v = result.manifest, result.verification
    print(f"exported {m['method'] or 'state'} of {args.model} to {result.out_dir}:")
    for name, info in m["files"].items():
        print(f"  {name:<20} {info['bytes'] / 1e6:10.2f} MB  sha256 {info['sha256'][:16]}")
    if m["prefix"]:
        where = "; kv/prefix.safetensors holds them for the KV graphs' host" if "kv" in m else ""
        print(f"  the prefix's {prefix} tokens: keys and values inside the graphs, which read the text after{where}")
    if m["shared_ranges_merged"]:
        print(f"  merged the ranges of {len(m['shared_ranges_merged'])} shared tensor(s) (see manifest.json)")
    _print_verification(v)
    if "kv" in m:
        _print_kv(m["kv"])
    if "device_check" in m:
        _print_device_check(m["device_check"], v.ppl_bound)
    if "hf" in m:
        print("Hugging Face checkpoint (hf/), loaded again with from_pretrained into a fresh sim, ranges from")
        for a in m["hf"]["verification"]:
            print(
                f"  {a['ranges_from']:<22} perplexity {a['reloaded_ppl']:.4f} vs sim {a['sim_ppl']:.4f} (rel. diff "
                f"{a['ppl_rel_diff']:.1e}), max |logit diff| {a['max_abs_logit_diff']:.3g}"
            )


def _print_verification(v) -> None:
    print(
        f"verified on {v.windows} window(s), {v.tokens} scored tokens: sim perplexity {v.sim_ppl:.4f}; "
        f"{v.quantizers} quantizers, {v.encoding_entries} encodings entries"
    )
    rows = [*v.agreements, v.floor, v.sim_floor, v.encodings_vs_qdq]
    width = max(len(a.graph) for a in rows)
    print(f"  {'against the sim, unless named':<{width}}  perplexity  rel. diff  max |logit diff|  same top-1")
    for a in rows:
        print(
            f"  {a.graph:<{width}}  {a.ppl:10.4f}  {a.ppl_rel_diff:9.1e}  {a.max_abs_logit_diff:16.3g}  "
            f"{a.top1_agreement:10.4f}"
        )
    print(
        f"  allowed against the sim: perplexity rel. diff {v.ppl_bound:.1e}, max |logit diff| {v.logit_bound:.3g} "
        f"(max |sim logit| {v.max_abs_sim_logit:.3g})"
    )
    noisy = max((v.floor, v.sim_floor), key=lambda a: a.ppl_rel_diff)
    if noisy.ppl_rel_diff > v.tolerance.ppl_rtol or noisy.top1_agreement < 0.99:
        # the floor rows show it; say what it means, since the bounds widen with it
        print(
            f"  note: this quantized model is sensitive to float32 rounding: {noisy.graph} differ by "
            f"{noisy.ppl_rel_diff:.1e} in perplexity and agree on the top-1 token at {noisy.top1_agreement:.1%} of "
            f"positions. No other runtime will reproduce the sim token by token; compare devices by perplexity "
            f"(see docs/export.md)"
        )


def _print_device_check(d: dict, ppl_bound: float) -> None:
    total, covered, missing = d["activation_tensors"], d["with_encoding"], d["without_encoding"]
    print(
        f"device graph ({d['simulator']}): {covered} of {total} quantized activation tensors "
        f"({covered / max(total, 1):.1%}) carry this package's encoding; the other {len(missing)} were calibrated "
        f"on {d['calibration_windows']} window(s) of tuning text, as a converter would calibrate them"
    )
    for name in missing:
        print(f"  without an encoding: {name}")
    if d.get("constants_folded"):
        print(
            f"  not counted: {len(d['constants_folded'])} tensor(s) computed from constants alone (the rotary "
            "angles, the causal mask), which a converter folds"
        )
    print(
        f"  perplexity {d['ppl']:.4f} vs sim {d['sim_ppl']:.4f} (rel. diff {d['ppl_rel_diff']:.1e}; the sim's own "
        f"float32 noise {d['sim_float_noise']:.1e}): {'within' if d['within_band'] else 'OUTSIDE'} the export's "
        f"band {ppl_bound:.1e}; all encodings it ran with: device_check/device.encodings"
    )
    if "sim_ppl_aimet_onnx_rounding" in d:
        print(
            f"  the sim rounding as aimet-onnx rounds (the offset subtracted first, half up): "
            f"{d['sim_ppl_aimet_onnx_rounding']:.4f} (rel. diff {d['ppl_rel_diff_aimet_onnx_rounding']:.1e})"
        )


def _print_kv(kv: dict) -> None:
    a = kv["verification"]
    print(
        f"KV graphs ({', '.join(kv['graphs'])} over {kv['context']} tokens): prefill then decode "
        f"against the sim: perplexity {a['graphs_ppl']:.4f} vs {a['sim_ppl']:.4f} (rel. diff "
        f"{a['ppl_rel_diff']:.1e}), max |logit diff| {a['max_abs_logit_diff']:.3g} (against the full-sequence "
        f"graph {a['vs_full_graph_max_abs_logit_diff']:.3g}), same top-1 {a['top1_agreement']:.4f}; greedy "
        f"generation: {a['greedy_agreement']:.1%} of {a['greedy_tokens']} tokens as the sim's, the first "
        f"{a['greedy_common_prefix']:.1f} of each prompt's alike on average (the sim against itself with "
        f"one-ulp inputs: {a['greedy_floor_agreement']:.1%}, the first {a['greedy_floor_common_prefix']:.1f})"
    )
