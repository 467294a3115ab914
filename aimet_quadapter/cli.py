"""The ``aimet-quadapter`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from .cli_export import add_export_command
from .cli_export import positive_int as _positive_int
from .errors import QuadapterError


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


def _check_lengths(model, **lengths: int) -> None:
    """Windows longer than the model's positions would fail deep inside it (GPT-2's position embedding)."""
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    for option, length in lengths.items():
        if limit and length > limit:
            raise QuadapterError(f"--{option.replace('_', '-')} {length} exceeds the model's {limit} positions")


def _quadapter_params(args):
    from .api import QuadapterParameters
    from .blockwise import BlockwiseParameters
    from .finetune import FinetuneParameters

    p1 = BlockwiseParameters(
        steps=args.phase1_steps,
        lr=args.phase1_lr,
        lr_stages=args.phase1_lr_stages,
        reach_steps=args.phase1_reach_steps or None,
        range_gradient=not args.phase1_no_range_gradient,
        input_source=args.phase1_input,
        loss_tokens=args.phase1_loss_tokens,
        keep_start=tuple(args.phase1_keep_start),
    )
    p2 = FinetuneParameters(
        steps=args.phase2_steps,
        batch_size=args.phase2_batch,
        seq_len=args.phase2_len,
        learn_ranges=not args.fixed_ranges,
    )
    return QuadapterParameters(phase1=p1, phase2=p2, init=args.init, extra_sites=_extra_sites(args.extra_sites))


def _extra_sites(value: str | None) -> bool | list[str] | None:
    if value is None or value in ("on", "off"):
        return None if value is None else value == "on"
    from .models import EXTRA_SITE_GROUPS

    groups = [g.strip() for g in value.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(EXTRA_SITE_GROUPS))
    if unknown:
        known = ", ".join(EXTRA_SITE_GROUPS)
        raise QuadapterError(f"--extra-sites: unknown group(s) {', '.join(unknown)}; known: {known} (or on, off)")
    return groups


def _cmd_eval(args) -> int:
    from pathlib import Path

    from . import onnx_eval, workflow

    if onnx_eval.is_export(args.model):  # an exported ONNX model: its perplexity in onnxruntime
        return onnx_eval.eval_exported(args)
    from .methods import FINETUNE_METHODS, LABELS, METHODS, MethodContext, run_method

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise QuadapterError(f"--methods: unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    params = _quadapter_params(args)
    start = time.time()
    model, tokenizer = workflow.load(args.model)
    _check_lengths(model, seq_len=args.seq_len, calib_len=args.calib_len)
    evals = {
        d: workflow.eval_windows_for(tokenizer, d, args.split, args.seq_len, args.stride, args.max_tokens)
        for d in args.dataset
    }
    calib_set = args.calib_dataset or args.dataset[0]
    calib = workflow.calibration_batches(tokenizer, calib_set, args.calib_samples, args.calib_len, args.seed)
    finetune = None
    if any(m in FINETUNE_METHODS for m in methods):
        finetune = workflow.calibration_batches(
            tokenizer,
            args.finetune_dataset or calib_set,
            params.phase2.steps * params.phase2.batch_size,
            params.phase2.seq_len,
            args.seed + 1,
            params.phase2.batch_size,
        )
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    validation = None
    if args.holdout:
        from .data import holdout_seed

        seed = holdout_seed(args.seed)
        validation = workflow.calibration_batches(tokenizer, calib_set, args.holdout, args.calib_len, seed)
    ctx = MethodContext(model, _policy(args), calib, finetune, params, out_dir, validation=validation)
    results: dict[str, dict[str, float]] = {}
    eval_time: dict[str, float] = {}
    for name in methods:
        evaluated = run_method(name, ctx)
        t = time.time()
        results[LABELS[name]] = workflow.evaluate(evaluated, evals, label=LABELS[name])
        eval_time[name] = time.time() - t
        print(f"{LABELS[name]}: " + ", ".join(f"{d} {v:.3f}" for d, v in results[LABELS[name]].items()), flush=True)
    elapsed = time.time() - start
    print(workflow.format_table(results, list(evals)))
    tokens = sum(w.n_targets for w in next(iter(evals.values())))
    print(
        f"model {args.model}; {tokens} scored tokens per dataset (windows of {args.seq_len}); wall time {elapsed:.1f} s"
    )
    report = {
        "model": args.model,
        "policy": ctx.policy.to_dict(),
        "results": results,
        "method_time_s": ctx.timings,
        "eval_time_s": eval_time,
        "wall_time_s": elapsed,
    }
    for path in filter(None, [args.json, out_dir and out_dir / "results.json"]):
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _cmd_describe(args) -> int:
    from . import workflow
    from .policy import build_sim, describe, format_description

    model, tokenizer = workflow.load(args.model)
    if args.calib_dataset:
        _check_lengths(model, calib_len=args.calib_len)
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
    p.add_argument(
        "--methods",
        default="fp,ptq",
        help="comma-separated method names, e.g. fp,ptq,cle,quadapter_bc,quadapter (default fp,ptq)",
    )
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--out", help="folder for results.json, Quadapter states, checkpoints and figures")
    _add_calibration_options(p)
    _add_policy_options(p)
    _add_quadapter_options(p)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("describe", help="list every quantizer of the sim and every Quadapter site")
    _add_model_option(p)
    p.add_argument("--no-extra-sites", action="store_true", help="list only the paper's norm -> linear sites")
    _add_calibration_options(p, default_dataset=None)
    _add_policy_options(p)
    p.set_defaults(func=_cmd_describe)

    p = sub.add_parser("run", help="run a recipe: methods x F-ID sets, each evaluated on every eval dataset")
    p.add_argument("recipe", help="recipe YAML file (see recipes/)")
    p.add_argument("--out", help="run folder (default: the recipe's `out`, else runs/<recipe name>)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe value, VALUE parsed as YAML (e.g. --set phase2.steps=200 --set methods=[ptq,cle]); "
        "repeatable",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("report", help="markdown tables and figures of a run folder (writes RUN_DIR/report.md)")
    p.add_argument("run_dir", help="a folder written by `run`")
    p.set_defaults(func=_cmd_report)
    add_export_command(sub)
    return parser


def _cmd_run(args) -> int:
    from .recipes import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # validated before the heavy imports below
    from .report import results_table
    from .runner import run_recipe

    folder, results = run_recipe(recipe, args.out, progress=not args.no_progress)
    print(results_table(results))
    print(f"results: {folder / 'results.json'}; `aimet-quadapter report {folder}` writes the full report")
    return 0


def _cmd_report(args) -> int:
    from .report import write_report

    path, text = write_report(args.run_dir)
    print(text)
    print(f"written to {path}")
    return 0


def _add_quadapter_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Quadapter (defaults: the paper's)")
    g.add_argument("--phase1-steps", type=int, default=500)
    g.add_argument("--phase1-lr", type=float, default=0.1, help="phase-1 learning rate (of log alpha)")
    g.add_argument("--phase1-lr-stages", type=_positive_int, default=5, help="lr x0.2 at each of N-1 equal intervals")
    g.add_argument(
        "--phase1-reach-steps",
        type=_positive_int,
        default=500,
        help="a run of fewer steps scales the lr by N / steps, so that alpha can travel as far",
    )
    g.add_argument("--phase1-input", choices=("fp", "quantized"), default="fp", help="where a site's input comes from")
    g.add_argument("--phase1-loss-tokens", type=_positive_int, help="token-wise sites: the loss on this many tokens")
    g.add_argument("--phase1-no-range-gradient", action="store_true", help="ranges without gradient (ablation)")
    g.add_argument(
        "--phase1-keep-start",
        action="append",
        default=[],
        metavar="PATTERN",
        help="sites (fnmatch pattern of site names, repeatable) phase 1 leaves at their start alpha",
    )
    g.add_argument("--holdout", type=int, default=8, help="held-out calibration crops phase 1 is checked on (0: none)")
    g.add_argument("--phase2-steps", type=int, default=10_000)
    g.add_argument("--phase2-batch", type=_positive_int, default=4)
    g.add_argument("--phase2-len", type=_positive_int, default=512)
    g.add_argument("--fixed-ranges", action="store_true", help="phase 2 without LSQ+ range learning")
    g.add_argument("--finetune-dataset", help="phase-2 data (train split; default: the calibration dataset)")
    g.add_argument("--init", choices=("ones", "cle"), default="ones", help="phase-1 start: alpha = 1 or CLE's")
    g.add_argument(
        "--extra-sites",
        help="beyond-paper sites: on, off, or groups linear (v->o, up->down), qk (Q.K^T) (default: linear for Llama)",
    )


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
    from . import distributed

    if distributed.init_from_env() and not distributed.is_main():
        # torchrun: every process computes, the first one reports
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
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
