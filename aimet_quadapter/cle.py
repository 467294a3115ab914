"""LayerNorm-aware cross-layer equalization: alpha set analytically (the paper's "CLE" row).

AIMET's ``equalize_model`` pairs only convolutions. Here, as Nagel et al. (2019) do for two consecutive
layers, each channel's share of the per-tensor range is made equal on both sides of the activation
quantizer: with r1 the per-channel range of the quantized activation (the consumers' input) and r2 the
per-column range of the consumers' weights, alpha = sqrt(r2 / r1), after which both are sqrt(r1 * r2).
It is a baseline, and an optional initialisation of phase 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .models import Site
from .quadapter import QuadapterSet


def _per_producer_channel(values: torch.Tensor, site: Site) -> torch.Tensor:
    """Consumer-column statistics reduced to one value per producer channel (max over a head group)."""
    if site.expand is None:
        return values
    repeat, head_dim = site.expand
    return values.view(-1, repeat, head_dim).amax(dim=1).reshape(-1)


@torch.no_grad()
def activation_ranges(
    model: nn.Module, sites: Sequence[Site], batches: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Per-channel absmax of each site's quantized activation (its first consumer's input) over ``batches``."""
    ranges: dict[str, torch.Tensor] = {}
    handles = []
    for site in sites:

        def hook(_module, args, site=site):
            x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)
            ranges[site.name] = x if site.name not in ranges else torch.maximum(ranges[site.name], x)

        handles.append(model.get_submodule(site.consumers[0]).register_forward_pre_hook(hook))
    try:
        device = next(model.parameters()).device
        for batch in batches:
            model(batch.to(device))
    finally:
        for h in handles:
            h.remove()
    return {s.name: _per_producer_channel(ranges[s.name], s) for s in sites}


@torch.no_grad()
def channel_min_max(model: nn.Module, site: Site, batches: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel min and max of a site's quantized activation (its first consumer's input), for Fig. 4."""
    lo: list[torch.Tensor] = []
    hi: list[torch.Tensor] = []

    def hook(_module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1])
        lo.append(x.amin(dim=0))
        hi.append(x.amax(dim=0))

    handle = model.get_submodule(site.consumers[0]).register_forward_pre_hook(hook)
    try:
        device = next(model.parameters()).device
        for batch in batches:
            model(batch.to(device))
    finally:
        handle.remove()
    return torch.stack(lo).amin(dim=0), torch.stack(hi).amax(dim=0)


@torch.no_grad()
def cle_alphas(model: nn.Module, sites: Sequence[Site], batches: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The analytic alpha of every site, from FP ``model`` and calibration ``batches``."""
    act = activation_ranges(model, sites, batches)
    out = {}
    for site in sites:
        weights = torch.cat([model.get_submodule(c).weight.detach().abs() for c in site.consumers], dim=0)
        r2 = _per_producer_channel(weights.amax(dim=0), site)
        r1 = act[site.name]
        # A channel that never fires (r1 = 0) or has all-zero columns keeps alpha = 1.
        alpha = torch.where((r1 > 0) & (r2 > 0), (r2 / r1.clamp_min(1e-12)).sqrt(), torch.ones_like(r1))
        out[site.name] = alpha
    return out


def init_with_cle(qset: QuadapterSet, fp_model: nn.Module, batches: Sequence[torch.Tensor]) -> None:
    """Set every Quadapter of ``qset`` to its CLE alpha."""
    alphas = cle_alphas(fp_model, qset.sites, batches)
    for q in qset:
        q.set_alpha(alphas[q.site.name])
