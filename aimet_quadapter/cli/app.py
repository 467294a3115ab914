"""The ``aimet-quadapter`` command line: the settings' options are generated from the recipe's sections, and ``eval``
builds a recipe in memory and runs it through the same runner as ``run``."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel

from aimet_quadapter import logs
from aimet_quadapter.cli.checks import add_check_commands
from aimet_quadapter.cli.export import add_export_command
from aimet_quadapter.cli.options import NO_PREFIX, prefix_ids
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.settings import default_of
from aimet_quadapter.text import EVAL_SEQ_LEN

if TYPE_CHECKING:  # for the annotations only
    from typing import TypeAlias

    from aimet_quadapter.quadapter.state import QuadapterState
    from aimet_quadapter.running.recipes import Recipe

    # what add_subparsers returns: argparse names its class privately
    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

_PREFIX = "section:"


def _sections() -> list[tuple[str, type[BaseModel], tuple[str, ...]]]:
    """The recipe's parameter sections, less the fields that are no option."""
    from aimet_quadapter.running.recipes import parameter_sections

    not_options = {"execution": ("checkpoint_dir",)}
    return [(name, source, not_options.get(name, ())) for name, source in parameter_sections()]


def _yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise argparse.ArgumentTypeError(f"not a valid YAML value: {text!r}") from None


def _add_section_options(
    p: argparse.ArgumentParser, section: str, source: type[BaseModel], exclude: tuple[str, ...]
) -> None:
    """``--SECTION-FIELD`` for every field of the section's class; given ones override the recipe's value."""
    # the class's own summary says where its defaults come from (the paper's, AIMET's, ...)
    summary = (source.__doc__ or "").strip().splitlines()[0].replace("``", "`").replace("%", "%%")
    g = p.add_argument_group(f"{section} (recipe section `{section}`)", summary or None)
    for name, f in source.model_fields.items():
        if name in exclude:
            continue
        flag = f"--{section}-{name.replace('_', '-')}"
        dest = f"{_PREFIX}{section}.{name}"
        text = f"{f.description or ''} (default: {default_of(f)})".replace("%", "%%")  # argparse %-formats help
        if f.annotation is bool:
            g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            g.add_argument(flag, dest=dest, type=_yaml_value, default=None, metavar="VALUE", help=text)


def _section_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``{"phase1.steps": 50, ...}`` for the generated options the user gave."""
    return {k[len(_PREFIX) :]: v for k, v in vars(args).items() if k.startswith(_PREFIX) and v is not None}


def _add_model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="Hugging Face hub id (gpt2, distilgpt2, ...), a local model folder, or smollm2-135m (offline)",
    )


def add_device_option(p: argparse.ArgumentParser, recipe: bool = False) -> None:
    """``--device``: where the model, the sim and every tensor of the run live."""
    where = "overrides the recipe's `device`; " if recipe else ""
    p.add_argument(
        "--device",
        default=None if recipe else "auto",
        help=f"auto (CUDA when there is one, else the CPU), cpu, cuda or cuda:N ({where}default auto)",
    )


def _add_prefix_option(p: argparse.ArgumentParser, default: str = "none") -> None:
    p.add_argument(
        "--prefix",
        help="text every sequence follows, its keys and values kept in full precision (the recipe field `prefix`; "
        "PrefixQuant); auto: the model's own (its BOS token, else EOS, and a new line: '<|im_start|>\\n' for "
        f"SmolLM2); none: no prefix (default: {default})",
    )


def _calibration_values(args: argparse.Namespace, *extra: tuple[str, Any]) -> tuple[int, int, int]:
    """``--calib-samples``, ``--calib-len`` and ``--seed`` (their defaults where not given), each checked."""
    defaults = _calibration_defaults()
    samples = defaults["samples"] if args.calib_samples is None else args.calib_samples
    length = defaults["length"] if args.calib_len is None else args.calib_len
    seed = defaults["seed"] if args.seed is None else args.seed
    for name, value, least in (("--calib-samples", samples, 1), ("--calib-len", length, 2), ("--seed", seed, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise QuadapterError(f"{name} must be an integer >= {least}, got {value!r}")
    for name, value in extra:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise QuadapterError(f"{name} must be a positive integer, got {value!r}")
    return samples, length, seed


def _calibration_defaults() -> dict[str, Any]:
    from aimet_quadapter.running.recipes import CalibrationSection

    return {name: f.default for name, f in CalibrationSection.model_fields.items()}


def _add_calibration_options(p: argparse.ArgumentParser) -> None:
    defaults = _calibration_defaults()
    g = p.add_argument_group("calibration (recipe section `calibration`; the paper: 10 x 512 tokens of train)")
    g.add_argument("--calib-samples", type=_yaml_value, help=f"crops (default {defaults['samples']})")
    g.add_argument("--calib-len", type=_yaml_value, help=f"tokens per crop (default {defaults['length']})")
    g.add_argument("--seed", type=_yaml_value, help=f"seed of the crops (default {defaults['seed']})")


def _eval_recipe(args: argparse.Namespace) -> Recipe:
    """The recipe ``eval``'s options describe, validated like a file's (errors name the recipe field)."""
    from aimet_quadapter.running.recipes import validate_recipe

    calib = args.calib_dataset or args.dataset[0]
    raw: dict[str, Any] = {
        "name": "eval",
        "model": args.model,
        "methods": [m.strip() for m in (args.methods or "fp,ptq").split(",") if m.strip()],
        "calibration": {"dataset": calib},
        "fid": [args.finetune_dataset or calib],
        "eval": {"datasets": list(args.dataset), "split": args.split},
        "device": args.device,
    }
    prefix = _eval_prefix(args)
    if prefix is not None:
        raw["prefix"] = prefix
    given = {
        "calibration.samples": args.calib_samples,
        "calibration.length": args.calib_len,
        "calibration.seed": args.seed,
        "eval.seq_len": args.seq_len,
        "eval.stride": args.stride,
        "eval.max_tokens": args.max_tokens,
        **_section_overrides(args),
    }
    given = {k: v for k, v in given.items() if v is not None}
    for key, value in given.items():
        section, _, name = key.partition(".")
        raw.setdefault(section, {})[name] = value
    return validate_recipe(raw, "eval")


def _eval_prefix(args: argparse.Namespace) -> str | None:
    """``eval``'s recipe ``prefix``: by default the model's own under htp (lest the first token set its ranges)."""
    from aimet_quadapter.models.prefix import AUTO_PREFIX

    if args.prefix is None:
        # a saved state holds the prefix it was trained with
        htp = _section_overrides(args).get("policy.target") == "htp"
        return AUTO_PREFIX if htp and not args.state else None
    return None if args.prefix == NO_PREFIX else args.prefix


def _check_json_path(path: str | None) -> None:
    """``--json``'s file can be written: checked before the work, whose results it would otherwise lose."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise QuadapterError(f"--json {path} is a folder: name a file")
    if not target.parent.is_dir():
        raise QuadapterError(f"--json {path}: the folder {target.parent} does not exist")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise QuadapterError(f"--json {path}: the folder {target.parent} is not writable")


def _cmd_eval(args: argparse.Namespace) -> int:
    from aimet_quadapter.export import onnx_eval

    _check_json_path(args.json)
    if onnx_eval.is_export(args.model):  # an exported ONNX model: its perplexity in onnxruntime
        return _eval_export(args)
    from aimet_quadapter.models.loading import check_model_source

    check_model_source(args.model)
    if args.state:
        return _eval_state(args)
    recipe = _eval_recipe(args)  # validated before the heavy imports below
    from aimet_quadapter.reporting.report import results_table
    from aimet_quadapter.running.runner import run_recipe

    with tempfile.TemporaryDirectory(prefix="aimet-quadapter-eval-") as tmp:
        folder, results = run_recipe(recipe, args.out or tmp, progress=not args.no_progress)
        print(results_table(results))
        if args.json:
            shutil.copyfile(Path(folder) / "results.json", args.json)
    if args.out:
        print(f"results: {Path(folder) / 'results.json'}")
    return _stopped_cells(results)


def _eval_state(args: argparse.Namespace) -> int:
    """A saved state's perplexity on ``--dataset``: the sim rebuilt from it, as the training run scored it."""
    from aimet_quadapter.quadapter.state import resolve_state
    from aimet_quadapter.running.provenance import load_checked

    if args.methods:
        raise QuadapterError("--state and --methods exclude each other: a state is scored as it was saved")
    path = resolve_state(args.state)
    state = load_checked(path, args.model)
    args.methods = "fp"  # the recipe's eval section and model are all that is used
    recipe = _eval_recipe(args)
    from aimet_quadapter.running.runner import score_state

    ppl = score_state(recipe, state, progress=not args.no_progress)
    method = state.metadata.get("method") or "state"
    for name, value in ppl.items():
        print(f"{method} ({path}): {name} {value:.3f}")
    _write_results(args, {"state": str(path), "method": method, "model": args.model, "ppl": ppl})
    return 0


def _write_results(args: argparse.Namespace, results: dict) -> None:
    """``results`` to ``--json`` and to ``--out``/results.json, where given."""
    from aimet_quadapter.running.results_file import write_json_atomic

    paths = [Path(args.json)] if args.json else []
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        paths.append(Path(args.out) / "results.json")
    for path in paths:
        write_json_atomic(path, results)


def _eval_export(args: argparse.Namespace) -> int:
    from datetime import datetime, timezone

    from aimet_quadapter.export.onnx_eval import eval_exported
    from aimet_quadapter.reporting.report import results_table
    from aimet_quadapter.running.recipes import EvalSection
    from aimet_quadapter.running.results_file import FORMAT

    score = eval_exported(
        args.model,
        args.dataset,
        args.split,
        args.seq_len or EvalSection.model_fields["seq_len"].default,
        args.stride,
        args.max_tokens,
        progress=not args.no_progress,
        log=logs.log.info,
    )
    cell = {
        "method": "onnx_qdq",
        "label": score.label,
        "rank": 0,
        "group": "-",
        "ppl": score.ppl,
        "method_time_s": 0.0,
        "eval_time_s": score.seconds,
        "wall_time_s": score.seconds,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "info": {
            "onnx": str(score.qdq),
            "runtime": "onnxruntime",
            "seq_len": score.seq_len,
            "policy": score.manifest.get("policy"),
        },
    }
    columns = [{"label": label, "source": source, "split": args.split} for label, source in score.sources.items()]
    results = {"format": FORMAT, "model": score.manifest["model"], "datasets": columns, "cells": {"onnx_qdq": cell}}
    print(results_table(results))
    _write_results(args, results)
    return 0


def _cmd_describe(args: argparse.Namespace) -> int:
    from aimet_quadapter.models import load_model
    from aimet_quadapter.models.loading import check_model_source
    from aimet_quadapter.quant.config import QuantPolicy
    from aimet_quadapter.quant.policy import build_sim, calibrate, describe, format_description
    from aimet_quadapter.text.data import calibration_batches, check_crop_count, load_text

    check_model_source(args.model)
    given = {k.split(".", 1)[1]: v for k, v in _section_overrides(args).items() if k.startswith("policy.")}
    policy = QuantPolicy(**given)
    samples, length, seed = _calibration_values(args)
    if not args.calib_dataset:
        unused = [n for n, v in (("--calib-samples", args.calib_samples), ("--calib-len", args.calib_len)) if v]
        if unused or args.seed is not None:
            raise QuadapterError(f"{(unused or ['--seed'])[0]} is for calibration: give --calib-dataset too")
    else:
        check_crop_count(samples, length, "--calib-samples")
        load_text(args.calib_dataset, "train")  # a bad dataset is refused before the model loads
    model, tokenizer = load_model(args.model, quiet=True, device=args.device)
    ids = prefix_ids(tokenizer, args.prefix)
    if args.calib_dataset:
        model.check_length(length + len(ids or []), "--calib-len (after the prefix)" if ids else "--calib-len")
    if ids is not None:
        model.set_prefix(ids)
    sim = build_sim(model, policy, in_place=True)  # the FP model is not used again
    if args.calib_dataset:
        calibrate(
            sim, calibration_batches(tokenizer, args.calib_dataset, samples, length, seed, setting="--calib-samples")
        )
    print(format_description(describe(sim.model)))
    sites = model.sites(extra=not args.no_extra_sites)
    print(f"\n{len(sites)} Quadapter sites:")
    for site in sites:
        print(f"  {site.name}{'  (beyond the paper)' if site.extra else ''}")
    return 0


def _cmd_sensitivity(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from aimet_quadapter.models import load_model
    from aimet_quadapter.models.loading import check_length, check_model_source, max_positions
    from aimet_quadapter.quadapter.phase2 import lm_loss, mean_lm_loss
    from aimet_quadapter.quant.config import QuantPolicy
    from aimet_quadapter.quant.mixed_precision import bit_sensitivity, quantizer_kinds
    from aimet_quadapter.quant.policy import build_sim, calibrate
    from aimet_quadapter.text.data import batches, check_crop_count, holdout_seed, load_text, random_crops, tokenize

    check_model_source(args.model)
    given = {k.split(".", 1)[1]: v for k, v in _section_overrides(args).items() if k.startswith("policy.")}
    state = _sensitivity_state(args, given)
    policy = state.policy if state is not None else QuantPolicy(**given)
    samples, length, seed = _calibration_values(args, ("--held-out", args.held_out))
    check_length(max_positions(args.model), length, "--calib-len")
    check_crop_count(samples, length, "--calib-samples")
    check_crop_count(args.held_out, length, "--held-out")
    text = load_text(args.calib_dataset, args.split)  # a bad dataset is refused before the model loads
    model, tokenizer = load_model(args.model, quiet=True, device=args.device)
    # a state holds the prefix it was trained with
    prefix = state.metadata.get("prefix") if state is not None else prefix_ids(tokenizer, args.prefix)
    # a hub model's limit is known only now
    model.check_length(length + len(prefix or []), "--calib-len (after the prefix)" if prefix else "--calib-len")
    if prefix is not None:
        model.set_prefix(prefix)
    ids = tokenize(tokenizer, text)
    held_out = batches(random_crops(ids, args.held_out, length, holdout_seed(seed), "--held-out"), 1)
    fp_loss = mean_lm_loss(model, held_out)
    if state is not None:
        sim = state.build_sim(model, in_place=True)  # its own ranges: nothing is calibrated
    else:
        sim = build_sim(model, policy, in_place=True)  # the FP model is not used again
        calibrate(sim, batches(random_crops(ids, samples, length, seed, "--calib-samples", distinct=True), 1))
    bar = tqdm(total=len(quantizer_kinds(sim.model)), desc="kinds", disable=args.no_progress, leave=False)
    base, rows = bit_sensitivity(sim.model, held_out, lm_loss, fp_loss, args.bits, progress=lambda _: bar.update())
    bar.close()
    what = f"{args.held_out} x {length} tokens of {args.calib_dataset} {args.split}"
    print(f"held-out LM loss ({what}, not calibrated on):" if state is None else f"LM loss ({what}):")
    print(f"  FP32 {fp_loss:.4f}; {policy.label()} {base:.4f}")
    width = max(len(r.kind) for r in rows)
    print(f"{'kind at ' + str(args.bits) + ' bits':<{width}}  quantizers  loss    recovered")
    for r in rows:
        print(f"{r.kind:<{width}}  {r.quantizers:>10}  {r.loss:.4f}  {r.recovered:>8.1%}")
    if rows and rows[0].recovered > 0:
        print(f"\nmost sensitive: --policy-bit-overrides '[\"{rows[0].kind}={args.bits}\"]'")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aimet-quadapter",
        description="Quadapter quantization of GPT-2, Llama, Mistral, Qwen, Phi-3 and Gemma language models on AIMET",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_eval_command(sub)
    _add_describe_command(sub)
    _add_sensitivity_command(sub)
    _add_run_command(sub)
    _add_report_and_merge_commands(sub)
    add_export_command(sub)
    add_check_commands(sub)
    _add_talk_options(sub)
    return parser


def _add_eval_command(sub: SubParsers) -> None:
    p = sub.add_parser(
        "eval",
        help="perplexity of methods on datasets: a recipe built from the options, run like `run`",
        description="Builds a recipe from the options (model, datasets, methods, every setting) and runs it; "
        "an exported model folder (see `export`) is scored in onnxruntime instead.",
    )
    _add_model_option(p)
    p.add_argument(
        "--dataset",
        action="append",
        required=True,
        help="corpus (wikitext2, ptb, lambada, cbt_cn, cbt_ne) or a local text file/folder; repeatable",
    )
    p.add_argument("--split", default="test", choices=("train", "valid", "test"), help="(default test)")
    p.add_argument("--max-tokens", type=_yaml_value, help="evaluate only the first N tokens of each dataset")
    p.add_argument("--seq-len", type=_yaml_value, help=f"evaluation window (default {EVAL_SEQ_LEN}, the paper's)")
    p.add_argument("--stride", type=_yaml_value, help="sliding-window stride (default: non-overlapping)")
    p.add_argument(
        "--methods",
        help="comma-separated method names, e.g. fp,ptq,cle,quadapter_bc,quadapter (default fp,ptq)",
    )
    p.add_argument(
        "--state",
        help="score this saved state (.safetensors, or a run folder holding one) instead of running methods",
    )
    p.add_argument("--json", help="also write results.json to this file")
    _add_prefix_option(p, "auto under --policy-target htp, whose static ranges the first token would set; else none")
    p.add_argument("--out", help="run folder for results.json, Quadapter states and checkpoints (default: none kept)")
    p.add_argument("--calib-dataset", help="dataset whose train split calibrates (default: the first --dataset)")
    p.add_argument("--finetune-dataset", help="phase-2 data (train split; default: the calibration dataset)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_device_option(p)
    _add_calibration_options(p)
    for section, source, exclude in _sections():
        _add_section_options(p, section, source, exclude)
    p.set_defaults(func=_cmd_eval)


def _add_describe_command(sub: SubParsers) -> None:
    p = sub.add_parser("describe", help="list every quantizer of the sim and every Quadapter site")
    _add_model_option(p)
    p.add_argument("--no-extra-sites", action="store_true", help="list only the paper's norm -> linear sites")
    p.add_argument("--calib-dataset", help="calibrate on this dataset's train split first (shows the ranges)")
    _add_prefix_option(p)
    add_device_option(p)
    _add_calibration_options(p)
    _add_section_options(p, *_sections()[0])
    p.set_defaults(func=_cmd_describe)


def _sensitivity_state(args: argparse.Namespace, policy: dict[str, Any]) -> QuadapterState | None:
    """``--state``'s state, checked against ``--model``; it excludes the options that set a policy or ranges."""
    if not args.state:
        return None
    from aimet_quadapter.quadapter.state import resolve_state
    from aimet_quadapter.running.provenance import load_checked

    given = [f"--policy-{k.replace('_', '-')}" for k in policy]
    given += [n for n, v in (("--calib-samples", args.calib_samples), ("--prefix", args.prefix)) if v is not None]
    if given:
        raise QuadapterError(f"--state and {given[0]} exclude each other: a state holds its policy and its ranges")
    return load_checked(resolve_state(args.state), args.model)


def _add_sensitivity_command(sub: SubParsers) -> None:
    p = sub.add_parser(
        "sensitivity",
        help="which kind of quantizer costs most: each given more bits in turn (choosing bit_overrides)",
        description="Calibrates the sim on --calib-dataset's train split, then gives each kind of quantizer "
        "(one role across the layers, e.g. every down_proj input) --bits alone and reports the LM loss on "
        "held-out crops of the same text, most sensitive first.",
    )
    _add_model_option(p)
    p.add_argument("--calib-dataset", required=True, help="dataset whose train split calibrates and is scored")
    p.add_argument("--bits", type=int, choices=range(2, 17), default=16, metavar="2..16", help="(default 16)")
    p.add_argument("--held-out", type=_yaml_value, default=4, help="held-out crops scored (default 4)")
    p.add_argument(
        "--state",
        help="a saved state (.safetensors or its cell folder): its sim, policy and ranges instead of a calibrated "
        "PTQ sim; score it on development text (--split valid)",
    )
    p.add_argument("--split", default="train", help="the split of --calib-dataset crops are taken from (default train)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_prefix_option(p)
    add_device_option(p)
    _add_calibration_options(p)
    _add_section_options(p, *_sections()[0])
    p.set_defaults(func=_cmd_sensitivity)


def _add_run_command(sub: SubParsers) -> None:
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
    add_device_option(p, recipe=True)
    p.set_defaults(func=_cmd_run)


def _add_report_and_merge_commands(sub: SubParsers) -> None:
    p = sub.add_parser("report", help="markdown tables and figures of a run folder (writes RUN_DIR/report.md)")
    p.add_argument("run_dir", help="a folder written by `run`")
    p.add_argument(
        "--section",
        action="store_true",
        help="print the run as a section of a results page (its command, machine, commit, seeds and tables) instead",
    )
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser(
        "merge",
        help="add to a run folder the cells (seeds, methods) other run folders of the same recipe computed "
        "(e.g. in other processes or on other machines)",
    )
    p.add_argument("run_dir", help="the run folder that receives the cells")
    p.add_argument("others", nargs="+", metavar="other_run_dir", help="run folders of the same recipe and settings")
    p.set_defaults(func=_cmd_merge)


def _add_talk_options(sub: SubParsers) -> None:
    """-v / -q on every command, export's included (added last, so it sees them all)."""
    for command in sub.choices.values():
        talk = command.add_mutually_exclusive_group()
        talk.add_argument("-v", "--verbose", action="store_true", help="also the debug messages")
        talk.add_argument(
            "-q",
            "--quiet",
            action="store_true",
            help="warnings and errors only, no progress bars (results still print)",
        )


def _cmd_run(args: argparse.Namespace) -> int:
    from aimet_quadapter.running.recipes import load_recipe

    overrides = [*args.overrides, *([f"device={args.device}"] if args.device else [])]
    recipe = load_recipe(args.recipe, overrides)  # validated before the heavy imports below
    from aimet_quadapter.reporting.report import results_table
    from aimet_quadapter.running.runner import run_recipe

    folder, results = run_recipe(recipe, args.out, progress=not args.no_progress, command=args.command_line)
    print(results_table(results))
    print(f"results: {folder / 'results.json'}; `aimet-quadapter report {folder}` writes the full report")
    return _stopped_cells(results)


def _stopped_cells(results: dict) -> int:
    """1 when some cell stopped (diverged, or a perplexity not finite), after saying which; else 0."""
    stopped = {key: cell["error"] for key, cell in results["cells"].items() if cell.get("error")}
    for key, error in stopped.items():
        print(f"aimet-quadapter: {key} stopped: {error}", file=sys.stderr)
    return 1 if stopped else 0


def _cmd_report(args: argparse.Namespace) -> int:
    from aimet_quadapter.reporting.report import results_section, write_report

    if args.section:
        print(results_section(args.run_dir))
        return 0
    path, text = write_report(args.run_dir)
    print(text)
    print(f"written to {path}")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from aimet_quadapter.reporting.report import results_table
    from aimet_quadapter.running.merge import merge_runs
    from aimet_quadapter.running.statistics import merge_seeds

    results, added = merge_runs(args.run_dir, args.others)
    print(results_table(results))
    print(f"added to {args.run_dir}: {', '.join(added) or 'nothing (it has every cell of the others)'}")
    for key, row in merge_seeds(results["cells"]).items():
        if row.get("machines"):
            machines = ", ".join(row["machines"])
            print(f"note: the seeds of {key} ran under {machines}, which changes what training ends at")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"--no-progress", "--quiet", "-q"} & set(argv):
        # The libraries' own bars (transformers' GGUF loading) take no switch. tqdm reads TQDM_* once, when
        # imported, and building the parser imports torch, which imports tqdm: so this comes first.
        os.environ["TQDM_DISABLE"] = "1"
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["aimet-quadapter", *argv])  # recorded with a run's results
    if args.quiet and hasattr(args, "no_progress"):
        args.no_progress = True
    logs.configure(-1 if args.quiet else 1 if args.verbose else 0)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from aimet_quadapter import distributed

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
