"""How far a saved state's perplexity moves when float32 rounds differently, as on another CPU.

Scores the state as saved, then once per draw with every tensor an activation quantizer reads moved by one float32
ulp (the export's noise-floor draw, ``one_ulp_inputs``: what another CPU's or runtime's order of summing does), and
prints the perplexities and their range; and, on the first 256 tokens, the share of activation codes (the integers
the quantizers round to) that the first draw changed, layer by layer.

    python scripts/rounding_noise.py runs/demo/seed-0/calib-generated/ptq --model smollm2-135m --draws 3
    python scripts/rounding_noise.py S --model smollm2-135m --split valid --seq-len 128 --max-tokens 512 --draws 5
        (the windows of `export S --verify-split valid`: the band its --device-check is compared with; --ulps 16
        for the draws of a runtime whose sums round further from the sim's)
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from contextlib import nullcontext

import torch

from aimet_quadapter.export.exporter import one_ulp_inputs
from aimet_quadapter.models import load_model
from aimet_quadapter.quadapter.state import QuadapterState, resolve_state
from aimet_quadapter.quant.quantizers import quantizers
from aimet_quadapter.text.perplexity import eval_windows_for, perplexity


def activation_codes(sim_model: torch.nn.Module, ids: torch.Tensor, seed: int | None = None) -> dict[str, torch.Tensor]:
    """Every activation quantizer's integer codes of one forward pass over ``ids``, keyed ``path.role``; ``seed``:
    with :func:`one_ulp_inputs` of that draw."""
    found: dict[str, torch.Tensor] = {}
    handles = []
    for path, role, q in quantizers(sim_model):
        if role.startswith(("input", "output")):

            def keep(module, args, out, name=f"{path}.{role}", q=q):
                scale = q.get_scale().detach()
                found[name] = torch.round(out.detach() / (scale.reshape(-1) if scale.numel() > 1 else scale))

            handles.append(q.register_forward_hook(keep))
    try:
        with torch.no_grad(), one_ulp_inputs(sim_model, seed) if seed is not None else nullcontext():
            sim_model(ids)
    finally:
        for h in handles:
            h.remove()
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("state", help="a Quadapter state file, or a cell folder holding one")
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", default="ptb")
    p.add_argument("--split", default="test")
    p.add_argument("--seq-len", type=int, default=1024, help="window length (the export's verification: 128)")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--ulps", type=int, default=1, help="the draws' move, in float32 ulps (codes: always one)")
    args = p.parse_args()
    model, tokenizer = load_model(args.model, quiet=True)
    sim = QuadapterState.load(resolve_state(args.state)).build_sim(model, in_place=True)
    windows = eval_windows_for(tokenizer, args.dataset, args.split, args.seq_len, max_tokens=args.max_tokens)

    first = windows[0].ids[None, :256]
    before, after = activation_codes(sim.model, first), activation_codes(sim.model, first, seed=1)
    by_layer: dict[str, list[float]] = defaultdict(list)
    for name, codes in before.items():
        match = re.search(r"layers\.(\d+)\.", name)
        by_layer[match.group(1) if match else "head"].append((codes != after[name]).float().mean().item())
    print("share of activation codes one draw changes, first 256 tokens:")
    for layer, shares in by_layer.items():
        print(f"  layer {layer}: mean {sum(shares) / len(shares):.1e}, largest {max(shares):.1e}")

    ppl = []
    for seed in (None, *range(1, args.draws + 1)):
        with one_ulp_inputs(sim.model, seed, args.ulps) if seed is not None else nullcontext():
            ppl.append(perplexity(sim.model, windows, progress=False).ppl)
        print(f"{'as saved' if seed is None else f'draw {seed}'}: {args.dataset} {args.split} perplexity {ppl[-1]:.3f}")
    print(f"range {min(ppl):.3f}-{max(ppl):.3f}: {100 * (max(ppl) / min(ppl) - 1):.2f} % of the lowest")


if __name__ == "__main__":
    main()
