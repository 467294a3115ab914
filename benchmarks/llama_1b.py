"""Peak memory and wall time of each stage on a Llama-3.2-1B-shaped model (random weights, SmolLM2's tokenizer).

Stages, each its own process under GNU time: ``eval`` of FP, PTQ and CLE; Quadapter BC and Quadapter (a step
or two per phase); the export of that Quadapter state, verified. The model is built from its config and saved
with ``save_pretrained`` (nothing from the hub); the budget is small, since memory, not accuracy, is measured:

    python benchmarks/llama_1b.py --work runs/llama-1b --json benchmarks/results/cpu-llama-1b.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path


def build(folder: Path) -> int:
    """The model folder (kept between runs); returns its number of parameters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from aimet_quadapter.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    config = LlamaConfig(  # Llama-3.2-1B's shape, but for the vocabulary: SmolLM2's tokenizer is offline
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    )
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
    with torch.device("meta"):  # counted without allocating
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


STAGES = ["eval", "quadapter", "export"]  # the keys of main's stages, in their order: each needs the one before


def timed(command: list[str], log: Path) -> dict:
    """Run ``command`` under GNU time; its peak RSS, wall time and exit status."""
    with log.open("w") as out:
        done = subprocess.run(["/usr/bin/time", "-v", *command], stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text()
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))  # type: ignore[union-attr]
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1)  # type: ignore[union-attr]
    seconds = sum(float(v) * 60**i for i, v in enumerate(reversed(wall.split(":"))))
    return {"exit_status": done.returncode, "peak_rss_kib": rss, "wall_s": round(seconds, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="folder for the model and the stages' outputs")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=STAGES, help="run only these stages (in order)")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    params = build(model)
    cli = [sys.executable, "-m", "aimet_quadapter.cli"]
    common = ["--model", str(model), "--dataset", "ptb", "--max-tokens", "1024", "--seq-len", "512"]
    common += ["--calib-samples", "2", "--calib-len", "256", "--no-progress"]
    quadapter = ["--phase1-steps", "1", "--phase1-loss-tokens", "256", "--quadapter-init", "cle"]
    quadapter += ["--phase2-steps", "2", "--phase2-batch-size", "1", "--phase2-seq-len", "256"]
    quadapter += ["--phase2-loss", "kd", "--phase2-learn-ranges"]
    for stale in args.stages:  # a later stage reads the one before: kept when it is not run again
        shutil.rmtree(work / stale, ignore_errors=True)
    state = work / "quadapter" / "ptb" / "quadapter" / "quadapter.safetensors"
    stages = {
        "eval fp,ptq,cle": [*cli, "eval", *common, "--methods", "fp,ptq,cle", "--out", str(work / "eval")],
        "eval quadapter_bc,quadapter": [
            *cli,
            "eval",
            *common,
            "--methods",
            "quadapter_bc,quadapter",
            *quadapter,
            "--out",
            str(work / "quadapter"),
        ],  # fmt: skip
        "export": [*cli, "export", str(state), "--model", str(model), "--out", str(work / "export")]
        + ["--seq-len", "128", "--verify-windows", "2", "--no-progress"],
    }
    results: dict = {}
    for i, (name, command) in enumerate(stages.items()):
        if STAGES[i] not in args.stages:
            continue
        results[name] = {"command": " ".join(command[1:]), **timed(command, work / f"stage{i}.log")}
        results[name]["peak_over_fp32_weights"] = round(results[name]["peak_rss_kib"] * 1024 / (4 * params), 2)
        print(f"{name}: {results[name]['peak_rss_kib'] / 2**20:.2f} GiB, {results[name]['wall_s']:.0f} s", flush=True)
    report = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "model": {"shape": "Llama-3.2-1B (16 x 2048, GQA 32/8, MLP 8192), SmolLM2's vocabulary", "parameters": params},
        "stages": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
