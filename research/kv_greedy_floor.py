"""Greedy generation through an export's graphs against the sim, beside onnxruntime against itself.

Generates ``--steps`` tokens greedily from the first half of each of the first ``--prompts`` PTB test windows of
128 tokens (the export's verification prompts) with the sim, with the full-sequence QDQ graph in onnxruntime
(optimized, and as written) and with the KV graphs, and prints each pair's agreement: whether the KV graphs'
disagreement with the sim is more than two onnxruntime runs of one graph disagree by.

    python research/kv_greedy_floor.py STATE --model smollm2-135m --export runs/demo-export
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from aimet_quadapter.export.formats import KV_FOLDER, MANIFEST, QDQ_ONNX
from aimet_quadapter.export.kv import KVGraphRunner, KVGraphs, sim_greedy
from aimet_quadapter.export.onnx_eval import OnnxLM
from aimet_quadapter.models import load_model
from aimet_quadapter.quadapter.state import QuadapterState
from aimet_quadapter.text.perplexity import eval_windows_for


def _graph_greedy(lm: OnnxLM, prompt: list[int], steps: int, length: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        padded = torch.tensor(ids + [0] * (length - len(ids)))[None]  # causal: the padding is never seen
        ids.append(int(lm(padded)[0, len(ids) - 1].argmax()))
    return ids[len(prompt) :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("state")
    p.add_argument("--model", required=True)
    p.add_argument("--export", required=True, help="an export folder written with --kv-graphs")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    export = Path(args.export)
    manifest = json.loads((export / MANIFEST).read_text())
    length, kv = manifest["seq_len"], manifest["kv"]
    model, tokenizer = load_model(args.model, quiet=True)
    sim = QuadapterState.load(args.state).build_sim(model, in_place=True)
    windows = eval_windows_for(tokenizer, "ptb", "test", length, None, length * (args.prompts + 1))
    prompts = [w.ids[: length // 2] for w in windows if len(w.ids) == length][: args.prompts]
    if length // 2 + args.steps > length:
        raise SystemExit(f"--steps {args.steps}: prompt and generation must fit the graph's {length} tokens")
    runs: dict[str, list[list[int]]] = {}
    with torch.no_grad():
        runs["sim"] = [sim_greedy(sim.model, x, args.steps) for x in prompts]
    for name, optimize in (("onnxruntime", True), ("onnxruntime as written", False)):
        lm = OnnxLM(export / QDQ_ONNX, optimize=optimize, low_memory=True)
        runs[name] = [_graph_greedy(lm, x.tolist(), args.steps, length) for x in prompts]
        del lm
    graphs = KVGraphs(kv["context"], tuple(int(g["tokens"]) for g in kv["graphs"].values()), kv["ids_dtype"])
    runner = KVGraphRunner(export / KV_FOLDER, graphs, sim.model.kv_shape())
    runs["KV graphs"] = [runner.generate(x.tolist(), args.steps) for x in prompts]
    names = list(runs)
    total = args.steps * len(prompts)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            same = sum(x == y for p, q in zip(runs[a], runs[b]) for x, y in zip(p, q))
            prefixes = [
                next((k for k, (x, y) in enumerate(zip(p, q)) if x != y), args.steps) for p, q in zip(runs[a], runs[b])
            ]
            print(
                f"{a} vs {b}: {same / total:.1%} of {total} tokens alike; alike before the first difference: {prefixes}"
            )


if __name__ == "__main__":
    main()
