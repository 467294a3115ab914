"""LayerNorm-aware cross-layer equalization (the paper's "CLE" row, and an optional start of phase 1): alpha =
sqrt(r2 / r1) equalizes each channel's share of the activation's and the consumers' weights' per-tensor ranges.
AIMET's ``equalize_model`` pairs only convolutions, so this one is the package's own."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from aimet_quadapter.models import Site, tensor_of
from aimet_quadapter.quadapter.adapter import QuadapterSet, rows_scaled
from aimet_quadapter.quant.policy import run_batches


def _reduce_rotary(values: torch.Tensor, site: Site, reduce=torch.amax) -> torch.Tensor:
    if not site.rotary_head_dim:
        return values
    half = site.rotary_head_dim // 2
    return reduce(values.view(-1, 2, half), dim=1).reshape(-1)


def _per_alpha(values: torch.Tensor, site: Site, reduce=torch.amax) -> torch.Tensor:
    """Statistics along the consumers' scaled channels, reduced (``reduce``) to one value per free alpha."""
    if site.expand is not None:
        repeat, head_dim = site.expand
        values = reduce(values.view(-1, repeat, head_dim), dim=1).reshape(-1)
    return _reduce_rotary(values, site, reduce)


@torch.no_grad()
def _absmax(model: nn.Module, points: dict[str, tuple[str, bool]], batches: Sequence[torch.Tensor]):
    """Per-channel absmax over ``batches`` of each point: name -> (module path, True for its output, else input)."""
    found: dict[str, torch.Tensor] = {}
    handles = []
    for name, (path, output) in points.items():

        def record(x: torch.Tensor, name=name) -> None:
            x = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0)
            found[name] = x if name not in found else torch.maximum(found[name], x)

        module = model.get_submodule(path)
        if output:
            handles.append(module.register_forward_hook(lambda _m, _a, out, record=record: record(out)))
        else:
            handles.append(module.register_forward_pre_hook(lambda _m, args, record=record: record(args[0])))
    _run_hooked(model, batches, handles)
    return found


def _run_hooked(model: nn.Module, batches: Sequence[torch.Tensor], handles: list) -> None:
    """Run ``model`` on ``batches``, then remove the hooks ``handles``."""
    try:
        run_batches(model, batches)
    finally:
        for h in handles:
            h.remove()


_INF = float("inf")


def _row_factor_range(w: torch.Tensor, q, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest, highest) factor of each row of ``w`` that keeps the per-tensor min-max range ``q`` takes of it."""
    n = w.shape[0]
    low, high = torch.zeros(n, device=w.device), torch.full((n,), _INF, device=w.device)
    if q is None or not all(size == 1 for size in q.shape):
        return low, high
    if q.symmetric:
        hi = w.abs().amax()
        lo = -hi
    else:
        lo, hi = w.amin().clamp(max=0), w.amax().clamp(min=0)
    top, bottom = (w, w) if w.dim() == 1 else (w.amax(dim=1), w.amin(dim=1))
    top, bottom, a, b = top + offset, bottom + offset, lo + offset, hi + offset  # (offset + w) * factor in [a, b]
    high = torch.minimum(torch.where(top > 0, b / top, _INF), torch.where((bottom < 0) & (a < 0), a / bottom, _INF))
    low = torch.maximum(
        torch.where((top < 0) & (b < 0), b / top, 0.0), torch.where((bottom > 0) & (a > 0), a / bottom, 0.0)
    )
    return low, high


class _ScaledWeights:
    """The FP weights as the alphas so far scale them, and how far a next alpha may scale rows within their range."""

    def __init__(self, model: nn.Module, sim_model: nn.Module):
        self.model, self.sim_model = model, sim_model
        self.scales: dict[tuple[str, int], torch.Tensor] = {}  # (module path, dim) -> product of the scales so far

    def _weight(self, path: str, offset: float) -> torch.Tensor:
        w = tensor_of(self.model.get_submodule(path)).detach()
        rows, cols = self.scales.get((path, 0)), self.scales.get((path, 1))
        w = w if rows is None else rows_scaled(w, rows, offset)
        return w if cols is None else w / cols[None, :]

    def _rows(self, path: str, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        quantizers = getattr(self.sim_model.get_submodule(path), "param_quantizers", None)
        q = quantizers["weight"] if quantizers is not None and "weight" in quantizers else None
        return _row_factor_range(self._weight(path, offset), q, offset)

    def bounds(self, site: Site) -> tuple[torch.Tensor, torch.Tensor]:
        """(lowest, highest) value of each free alpha of ``site`` that keeps the ranges of the rows it scales."""
        low, high = self._rows(site.producer, site.norm_offset)
        low, high = _reduce_rotary(low, site), _reduce_rotary(high, site, torch.amin)
        if site.consumer_rows:  # rows divided by alpha: a factor in [c_low, c_high] is alpha in [1/c_high, 1/c_low]
            for path in site.consumers:
                c_low, c_high = self._rows(path)
                low = torch.maximum(low, _per_alpha(1 / c_high, site))
                high = torch.minimum(high, _per_alpha(1 / c_low, site, torch.amin))
        return low, high

    def scale(self, site: Site, alpha: torch.Tensor) -> None:
        """Record ``alpha`` as folded: the producer's rows times it, the consumers' columns (or rows) divided."""
        self._times((site.producer, 0), site.producer_scale(alpha))
        for path in site.consumers:
            self._times((path, 0 if site.consumer_rows else 1), 1 / site.consumer_scale(alpha))

    def _times(self, key: tuple[str, int], scale: torch.Tensor) -> None:
        self.scales[key] = scale if key not in self.scales else self.scales[key] * scale


@torch.no_grad()
def cle_alphas(
    model: nn.Module, sites: Sequence[Site], batches: Sequence[torch.Tensor], sim_model: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The analytic alpha sqrt(r2 / r1) of every site (r1, r2: the per-channel ranges either side of the activation
    quantizer), kept with ``sim_model`` where the rows it scales stay within their weight quantizer's range: a
    channel that barely fires gets a huge alpha, and its row alone would widen every other row's grid."""
    points = {}
    for site in sites:
        if site.consumer_rows:
            points[site.name + "/producer"] = (site.producer, True)
            points[site.name + "/consumer"] = (site.consumers[0], True)
        else:
            points[site.name] = (site.consumers[0], False)
    act = _absmax(model, points, batches)
    scaled = _ScaledWeights(model, sim_model) if sim_model is not None else None
    out = {}
    for site in sites:
        if site.consumer_rows:
            r1 = _reduce_rotary(act[site.name + "/producer"], site)
            r2 = _per_alpha(act[site.name + "/consumer"], site)
        else:
            r1 = _per_alpha(act[site.name], site)
            # per-column max |w| over the consumers, reduced without an |w| copy of each weight
            weights = [tensor_of(model.get_submodule(c)).detach() for c in site.consumers]
            columns = torch.stack([torch.maximum(w.amax(dim=0), w.amin(dim=0).neg()) for w in weights]).amax(dim=0)
            r2 = _per_alpha(columns, site)
        # A channel that never fires (r1 = 0) or has all-zero columns keeps alpha = 1.
        alpha = torch.where((r1 > 0) & (r2 > 0), (r2 / r1.clamp_min(1e-12)).sqrt(), torch.ones_like(r1))
        if scaled is not None:
            low, high = scaled.bounds(site)
            alpha = torch.minimum(torch.maximum(alpha, low.to(alpha)), high.to(alpha))
            scaled.scale(site, alpha)
        out[site.name] = alpha
    return out


@torch.no_grad()
def channel_min_max(model: nn.Module, site: Site, batches: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel min and max of a site's quantized activation (its first consumer's input), for Fig. 4."""
    lo: list[torch.Tensor] = []
    hi: list[torch.Tensor] = []

    def hook(_module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1])
        lo.append(x.amin(dim=0))
        hi.append(x.amax(dim=0))

    _run_hooked(model, batches, [model.get_submodule(site.consumers[0]).register_forward_pre_hook(hook)])
    return torch.stack(lo).amin(dim=0), torch.stack(hi).amax(dim=0)


def init_with_cle(
    qset: QuadapterSet, fp_model: nn.Module, batches: Sequence[torch.Tensor], sim_model: nn.Module | None = None
) -> None:
    """Set every Quadapter of ``qset`` to its CLE alpha (bounded by ``sim_model``'s weight quantizers, if given)."""
    alphas = cle_alphas(fp_model, qset.sites, batches, sim_model)
    for q in qset:
        q.set_alpha(alphas[q.site.name])
