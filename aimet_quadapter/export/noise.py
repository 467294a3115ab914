"""The sim's float-noise band: how far float32 rounding alone moves a quantized model's codes and perplexity.

A draw (:func:`shuffled_sums` or :func:`~aimet_quadapter.export.exporter.one_ulp_inputs`) is a run as valid as the
sim's own; a device graph within :func:`noise_band` of the sim's perplexity lies within its float noise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from aimet_quadapter.export.exporter import one_ulp_inputs
from aimet_quadapter.quant.quantizers import quantizers


@contextmanager
def shuffled_sums(model: torch.nn.Module, seed: int) -> Iterator[None]:
    """Every matrix product of ``model`` sums its terms in a random order (a fixed draw per ``seed``): the same sum
    of the same terms, rounded as another kernel's order rounds it."""
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


def noise_band(sim: float, variants: list[float]) -> tuple[float, float]:
    """The sim's perplexity +- the farthest any of its float variants lies from it. Centred on the sim: a draw
    exchangeable with ten others still falls outside their range two times in eleven."""
    radius = max(abs(v - sim) for v in variants)
    return sim - radius, sim + radius
