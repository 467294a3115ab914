"""Which input should phase 1 give each site: the FP model's activations, or the partly quantized sim's?

Runs Quadapter BC both ways on the planted-outlier toy models (and optionally on a real model) and
prints the perplexity of each, on text sampled from the FP model (toy) or on a dataset (real model).

    python benchmarks/phase1_input_source.py                     # toy GPT-2 and toy Llama
    python benchmarks/phase1_input_source.py --model smollm2-135m --dataset ptb --steps 50
"""

from __future__ import annotations

import argparse
import json
import time

from aimet_quadapter.models import load_model, quiet_libraries
from aimet_quadapter.quadapter.api import QuadapterParameters, apply_phase1
from aimet_quadapter.quadapter.phase1 import Phase1Parameters
from aimet_quadapter.quadapter.phase2 import Phase2Parameters
from aimet_quadapter.quant.policy import build_sim, calibrate
from aimet_quadapter.testing import sample_corpus, toy_model
from aimet_quadapter.text.data import calibration_batches, eval_windows
from aimet_quadapter.text.perplexity import eval_windows_for, evaluate, perplexity


def compare(model, calib, windows, steps: int, tokens: int | None) -> dict:
    out = {"fp32": perplexity(model, windows, progress=False).ppl}
    sim = build_sim(model)
    calibrate(sim, calib)
    out["ptq"] = evaluate(sim, {"d": windows})["d"]
    for source in ("fp", "quantized"):
        start = time.time()
        sim = build_sim(model)
        p1 = Phase1Parameters(steps=steps, input_source=source, loss_tokens=tokens)
        apply_phase1(sim, model, calib, QuadapterParameters(phase1=p1, phase2=Phase2Parameters(steps=0)))
        out[f"bc_{source}"] = evaluate(sim, {"d": windows})["d"]
        out[f"bc_{source}_time_s"] = round(time.time() - start, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a real model (hub id, folder, smollm2-135m); default: the toy models")
    ap.add_argument("--dataset", default="ptb")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokens", type=int, help="phase-1 loss tokens for token-wise sites")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    quiet_libraries()
    results = {}
    if args.model:
        model, tok = load_model(args.model, quiet=True)
        windows = eval_windows_for(tok, args.dataset, "test", 1024, None, args.max_tokens)
        calib = calibration_batches(tok, args.dataset, 10, 512, 0)
        results[args.model] = compare(model, calib, windows, args.steps, args.tokens)
    else:
        for family in ("gpt2", "llama"):
            model = toy_model(family)
            corpus = sample_corpus(model, 24, 128, seed=1)
            windows = [w for row in corpus[4:] for w in eval_windows(row, 128)]
            calib = [corpus[i : i + 1] for i in range(4)]
            results[f"toy-{family}"] = compare(model, calib, windows, args.steps, args.tokens)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
