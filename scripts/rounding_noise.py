"""How far a saved state's perplexity moves when float32 rounds differently, as on another CPU.

Scores the state as saved, then once per draw with every tensor an activation quantizer reads moved by one float32
ulp (the export's noise-floor draw, ``one_ulp_inputs``: what another CPU's or runtime's order of summing does), and
prints the perplexities and their range; and, on the first 256 tokens, the share of activation codes (the integers
the quantizers round to) that the first draw changed, layer by layer.

With ``--orders`` a draw instead sums the terms of every matrix product (each Linear layer's and attention's two)
in a random order of its own: the sums of another runtime, whose kernels order them otherwise, not a move of a
fixed size.

With ``--rounding aimet-onnx`` every activation quantizer rounds as AIMET's ONNX simulation does
(``aimet_onnx_rounding``: the offset subtracted before rounding, half up; the weights as the sim rounds them, as the
export writes them), the as-saved score and every draw alike: the band of the device graph's own arithmetic.

    python scripts/rounding_noise.py runs/demo/seed-0/calib-generated/ptq --model smollm2-135m --draws 3
    python scripts/rounding_noise.py S --model smollm2-135m --split valid --seq-len 128 --max-tokens 512 --draws 5
        (the windows of `export S --verify-split valid`: the band its --device-check is compared with; --ulps 16
        for the draws of a runtime whose sums round further from the sim's; --orders for its summation orders;
        --rounding aimet-onnx for aimet-onnx's arithmetic)
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from aimet_quadapter.export.exporter import one_ulp_inputs
from aimet_quadapter.models import load_model
from aimet_quadapter.quadapter.state import QuadapterState, resolve_state
from aimet_quadapter.quant.quantizers import aimet_onnx_rounding, quantizers
from aimet_quadapter.text.perplexity import eval_windows_for, perplexity


@contextmanager
def shuffled_sums(model: torch.nn.Module, seed: int) -> Iterator[None]:
    """Every matrix product of ``model`` sums its terms in a random order (a fixed draw per ``seed``): the inputs'
    contracted dimension and the weights' columns permuted alike, so each sum is the same sum of the same terms, as
    exact in real numbers and rounded as another kernel's order rounds it. Per-tensor and per-output-channel
    quantizers see the same values in another order."""
    from aimet_torch.nn.modules.custom import MatMul

    generator = torch.Generator().manual_seed(seed)

    def order(n: int) -> torch.Tensor:
        return torch.randperm(n, generator=generator)

    def linear_in(module, args):
        perm = order(args[0].shape[-1]).to(args[0].device)
        module.unshuffled = module.weight.data  # the tied lm_head's table is the embedding's: swapped, not permuted
        module.weight.data = module.weight.data[:, perm]
        return (args[0][..., perm], *args[1:])

    def linear_out(module, args, out):
        module.weight.data = module.__dict__.pop("unshuffled")

    def matmul_in(module, args):
        a, b = args[:2]
        perm = order(a.shape[-1]).to(a.device)
        return (a[..., perm], b[..., perm, :], *args[2:])

    handles = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            handles += [module.register_forward_pre_hook(linear_in), module.register_forward_hook(linear_out)]
        elif isinstance(module, MatMul):
            handles.append(module.register_forward_pre_hook(matmul_in))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def activation_codes(
    sim_model: torch.nn.Module, ids: torch.Tensor, seed: int | None = None, noise: Callable | None = None
) -> dict[str, torch.Tensor]:
    """Every activation quantizer's integer codes of one forward pass over ``ids``, keyed ``path.role``; ``seed``:
    with ``noise`` of that draw (:func:`one_ulp_inputs` unless given)."""
    found: dict[str, torch.Tensor] = {}
    handles = []
    for path, role, q in quantizers(sim_model):
        if role.startswith(("input", "output")):

            def keep(module, args, out, name=f"{path}.{role}", q=q):
                scale = q.get_scale().detach()
                found[name] = torch.round(out.detach() / (scale.reshape(-1) if scale.numel() > 1 else scale))

            handles.append(q.register_forward_hook(keep))
    try:
        draw = (noise or one_ulp_inputs)(sim_model, seed) if seed is not None else nullcontext()
        with torch.no_grad(), draw:
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
    p.add_argument("--orders", action="store_true", help="draws sum every matrix product in a random order instead")
    p.add_argument(
        "--rounding",
        choices=("aimet-torch", "aimet-onnx"),
        default="aimet-torch",
        help="whose quantizer arithmetic every score uses (aimet-onnx: the device-graph check's)",
    )
    args = p.parse_args()

    def noise(model: torch.nn.Module, seed: int) -> AbstractContextManager[None]:
        return shuffled_sums(model, seed) if args.orders else one_ulp_inputs(model, seed, args.ulps)

    model, tokenizer = load_model(args.model, quiet=True)
    sim = QuadapterState.load(resolve_state(args.state)).build_sim(model, in_place=True)
    windows = eval_windows_for(tokenizer, args.dataset, args.split, args.seq_len, max_tokens=args.max_tokens)
    with aimet_onnx_rounding(sim.model) if args.rounding == "aimet-onnx" else nullcontext():
        _report(args, sim.model, windows, noise)


def _report(args: argparse.Namespace, model: torch.nn.Module, windows: list, noise: Callable) -> None:
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


if __name__ == "__main__":
    main()
