"""The ``aimet-quadapter`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from .errors import QuadapterError


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_policy_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("quantization policy (default: the paper's W8A8 asymmetric per-tensor)")
    g.add_argument("--weight-bits", type=int, default=8)
    g.add_argument("--act-bits", type=int, default=8)
    g.add_argument("--per-channel", action="store_true", help="per-output-channel weight ranges")
    g.add_argument("--symmetric-weights", action="store_true")
    g.add_argument("--no-norm-weights", action="store_true", help="leave the norms' gamma unquantized")
    g.add_argument("--quantize-logits", action="store_true", help="quantize the lm_head output too")


def _policy(args):
    from .policy import QuantPolicy

    return QuantPolicy(
        weight_bits=args.weight_bits,
        activation_bits=args.act_bits,
        per_channel_weights=args.per_channel,
        symmetric_weights=args.symmetric_weights,
        quantize_norm_weights=not args.no_norm_weights,
        quantize_logits=args.quantize_logits,
    )


def _add_model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="Hugging Face hub id (gpt2, distilgpt2, ...), a local model folder, or smollm2-135m (offline)",
    )


def _cmd_eval(args) -> int:
    from . import workflow

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - {"fp", "ptq"})
    if unknown:
        raise QuadapterError(f"--methods: unknown method(s) {', '.join(unknown)}; eval knows fp and ptq")
    policy = _policy(args)  # a bad option fails now, not after the FP evaluation
    start = time.time()
    model, tokenizer = workflow.load(args.model)
    evals = {
        d: workflow.eval_windows_for(tokenizer, d, args.split, args.seq_len, args.stride, args.max_tokens)
        for d in args.dataset
    }
    results: dict[str, dict[str, float]] = {}
    if "fp" in methods:
        results["FP32"] = workflow.evaluate(model, evals, label="FP32")
    if "ptq" in methods:
        calib_set = args.calib_dataset or args.dataset[0]
        calib = workflow.calibration_batches(tokenizer, calib_set, args.calib_samples, args.calib_len, args.seed)
        sim = workflow.ptq_sim(model, policy, calib)
        results[f"{policy.label().split()[0]} PTQ"] = workflow.evaluate(sim, evals, label="PTQ")
    elapsed = time.time() - start
    print(workflow.format_table(results, list(evals)))
    print(
        f"model {args.model}; {sum(w.n_targets for w in next(iter(evals.values())))} scored tokens per dataset "
        f"(windows of {args.seq_len}); wall time {elapsed:.1f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "results": results, "wall_time_s": elapsed}, f, indent=2)
    return 0


def _cmd_describe(args) -> int:
    from . import workflow
    from .policy import build_sim, describe, format_description

    model, tokenizer = workflow.load(args.model)
    sim = build_sim(model, _policy(args))
    if args.calib_dataset:
        workflow.calibrate_sim(
            sim,
            workflow.calibration_batches(tokenizer, args.calib_dataset, args.calib_samples, args.calib_len, args.seed),
        )
    print(format_description(describe(sim.model)))
    sites = model.sites(extra=not args.no_extra_sites)
    print(f"\n{len(sites)} Quadapter sites:")
    for site in sites:
        print(f"  {site.name}{'  (beyond the paper)' if site.extra else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aimet-quadapter",
        description="Quadapter quantization of GPT-2 and Llama-family language models on AIMET",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("eval", help="perplexity of the FP model and of its W8A8 PTQ sim")
    _add_model_option(p)
    p.add_argument(
        "--dataset",
        action="append",
        required=True,
        help="corpus (wikitext2, ptb, lambada, cbt_cn, cbt_ne) or a local text file/folder; repeatable",
    )
    p.add_argument("--split", default="test", help="train, valid or test (default test)")
    p.add_argument("--max-tokens", type=_positive_int, help="evaluate only the first N tokens of each dataset")
    p.add_argument("--seq-len", type=_positive_int, default=1024, help="evaluation window (default 1024, the paper's)")
    p.add_argument("--stride", type=_positive_int, help="sliding-window stride (default: non-overlapping)")
    p.add_argument("--methods", default="fp,ptq", help="comma-separated: fp, ptq (default both)")
    p.add_argument("--json", help="also write the results to this JSON file")
    _add_calibration_options(p)
    _add_policy_options(p)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("describe", help="list every quantizer of the sim and every Quadapter site")
    _add_model_option(p)
    p.add_argument("--no-extra-sites", action="store_true", help="list only the paper's norm -> linear sites")
    _add_calibration_options(p, default_dataset=None)
    _add_policy_options(p)
    p.set_defaults(func=_cmd_describe)
    return parser


def _add_calibration_options(p: argparse.ArgumentParser, default_dataset: str | None = None) -> None:
    g = p.add_argument_group("calibration (paper: 10 sequences x 512 tokens of the train split)")
    g.add_argument(
        "--calib-dataset",
        default=default_dataset,
        help="dataset whose train split calibrates (default: the first --dataset)",
    )
    g.add_argument("--calib-samples", type=_positive_int, default=10)
    g.add_argument("--calib-len", type=_positive_int, default=512)
    g.add_argument("--seed", type=int, default=0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return args.func(args)
    except QuadapterError as exc:
        print(f"aimet-quadapter: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aimet-quadapter: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
