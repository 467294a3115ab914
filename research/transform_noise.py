"""Where a state's alphas (CLE's, Quadapter's) add or remove rounding noise, site kind by site kind.

For every site the state holds an alpha for, on tokens of a text run through the FP model: the rounding noise of the
tensors the alpha scales (the producer's output, and a consumer's input where an op lies between them; 8-bit per
tensor, min-max, as `htp` quantizes them) and of each consumer's weights (8-bit symmetric per output channel, `htp`'s
weights), with the alpha and without it, each as noise power over the unscaled tensor's signal power, summed over
the layers. A local measure: it says which quantizers a transform loads, not what the perplexity does.

    python research/transform_noise.py runs/t2-a16-more/seed-0/calib-ptb/cle --model smollm2-135m
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch
from aimet_torch.quantization.affine import QuantizeDequantize

from aimet_quadapter.models import load_model
from aimet_quadapter.quadapter.state import QuadapterState, resolve_state
from aimet_quadapter.quant.quantizers import fake_quantize, min_max_encoding
from aimet_quadapter.text.data import load_text, tokenize


def _round_trip(x: torch.Tensor, shape: tuple[int, ...], bits: int, symmetric: bool) -> torch.Tensor:
    """``x`` through a min-max quantizer of encoding ``shape`` on AIMET's grid (the sim's own derivation)."""
    q = QuantizeDequantize(shape, bits, symmetric)
    dims = [i for i, n in enumerate((1,) * (x.dim() - len(shape)) + shape) if n == 1]
    lo, hi = x.amin(dim=dims).reshape(shape), x.amax(dim=dims).reshape(shape)
    return fake_quantize(x, *min_max_encoding(q, lo, hi), q.qmin, q.qmax)


def _per_tensor(x: torch.Tensor, bits: int) -> torch.Tensor:
    return _round_trip(x, (), bits, symmetric=False)


def _per_row_symmetric(w: torch.Tensor, bits: int) -> torch.Tensor:
    return _round_trip(w, (w.shape[0], 1), bits, symmetric=True)


def _relative(noise: torch.Tensor, signal: torch.Tensor) -> float:
    return (noise.pow(2).mean() / signal.pow(2).mean()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("state", help="a saved state (.safetensors) or the cell folder holding it")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", default="ptb")
    parser.add_argument("--split", default="train")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--bits", type=int, default=8)
    args = parser.parse_args()

    state = QuadapterState.load(resolve_state(args.state))
    alphas = state.alphas
    model, tokenizer = load_model(args.model, quiet=True)
    if state.weights:  # a transform's weights (a rotation's): the alphas scale the transformed model
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, value in state.weights.items():
                params[name].data = value
    # the run's prefix in the KV cache, as in its sim: its first token's outsized activations set no range here either
    model.set_prefix(state.metadata.get("prefix"))
    sites = [s for s in model.sites(extra=True) if s.name in alphas and not s.consumer_rows]
    ids = tokenize(tokenizer, load_text(args.dataset, args.split))[: args.tokens][None]
    seen: dict[str, torch.Tensor] = {}  # each producer's output and each consumer's input, tokens x channels
    handles = []
    for site in sites:
        for path, take in [(site.producer, "out"), *((c, "in") for c in site.consumers)]:

            def keep(module, inputs, output, key=f"{path}:{take}", take=take):
                t = output if take == "out" else inputs[0]
                seen[key] = t.detach().reshape(-1, t.shape[-1])

            handles.append(model.get_submodule(path).register_forward_hook(keep))
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()

    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for site in sites:
        alpha = alphas[site.name].float()
        kind = re.sub(r"layers\.\d+\.", "", site.name)
        out = seen[f"{site.producer}:out"]
        rows = site.producer_scale(alpha)
        scaled = out * rows
        row = totals[f"{kind}: producer output ({args.bits}-bit per tensor)"]
        row[0] += _relative(_per_tensor(out, args.bits) - out, out)
        row[1] += _relative((_per_tensor(scaled, args.bits) - scaled) / rows, out)
        for consumer in site.consumers:
            w, x = model.get_submodule(consumer).weight.detach(), seen[f"{consumer}:in"]
            column = site.consumer_scale(alpha)
            x_scaled, w_scaled = x * column, w / column
            if x.shape != out.shape or not torch.equal(x, out):  # a tensor between them (SiLU's product)
                row = totals[f"{kind}: {consumer.rsplit('.', 1)[-1]} input ({args.bits}-bit per tensor)"]
                row[0] += _relative(_per_tensor(x, args.bits) - x, x)
                row[1] += _relative((_per_tensor(x_scaled, args.bits) - x_scaled) / column, x)
            y = x @ w.T
            row = totals[f"{kind}: {consumer.rsplit('.', 1)[-1]} weights ({args.bits}-bit per channel)"]
            row[0] += _relative(x @ (_per_row_symmetric(w, args.bits) - w).T, y)
            row[1] += _relative(x_scaled @ (_per_row_symmetric(w_scaled, args.bits) - w_scaled).T, y)
    print(f"{'noise power / signal power, summed over layers':80s} {'no alpha':>10s} {'alpha':>10s} {'ratio':>6s}")
    for name, (plain, scaled) in totals.items():
        print(f"{name:80s} {plain:10.3e} {scaled:10.3e} {scaled / plain:6.2f}")


if __name__ == "__main__":
    main()
