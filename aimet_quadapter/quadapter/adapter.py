"""The Quadapter (Eq. 2 and 3): a positive scale per channel, multiplying a producer's output channels and dividing
its consumers' input columns, applied by forward hooks that substitute the scaled ``weight``/``bias``: as in peft,
nothing is replaced, and AIMET's quantizers, reading ``weight``, see the scaled tensors and pass alpha its gradient."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import cast

import torch
from torch import nn

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.models import PreparedLM, Site, reset_to, tensor_of


@torch.no_grad()
def fold_site(model: nn.Module, site: Site, alpha: torch.Tensor) -> None:
    """Eq. 3: the producer's rows (or gamma) and bias times alpha, the consumers' columns (or rows) divided by it."""
    alpha = alpha.to(tensor_of(model.get_submodule(site.producer), "weight").device)  # a loaded state's: on the CPU
    for path, producer in [(site.producer, True), *((path, False) for path in site.consumers)]:
        module = model.get_submodule(path)
        # new data, not a write in place: a sim's weights can be the FP model's storage (weight_sharing_copy)
        w, b = tensor_of(module, "weight"), _bias_of(module)
        w.data, folded_bias = folded_tensors(w, b, site, alpha, producer)
        if b is not None and folded_bias is not None:
            b.data = folded_bias


def folded_tensors(
    weight: torch.Tensor, bias: torch.Tensor | None, site: Site, alpha: torch.Tensor, producer: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A module's weight and bias with one site's alpha folded in, as its producer or a consumer: new tensors."""
    if producer or site.consumer_rows:
        scale = site.producer_scale(alpha) if producer else 1 / site.consumer_scale(alpha)
        weight = rows_scaled(weight, scale, site.norm_offset if producer else 0.0)
        return weight, None if bias is None else bias * scale
    return weight / site.consumer_scale(alpha)[None, :], bias


def _bias_of(module: nn.Module) -> torch.Tensor | None:
    return tensor_of(module, "bias") if getattr(module, "bias", None) is not None else None


def rows_scaled(weight: torch.Tensor, scale: torch.Tensor, norm_offset: float) -> torch.Tensor:
    """``weight`` with its rows times ``scale``; a norm's (offset + gamma) as a whole."""
    if weight.dim() > 1:
        return weight * scale[:, None]
    return (weight + norm_offset) * scale - norm_offset if norm_offset else weight * scale


def fold_alphas(model: nn.Module, sites: Iterable[Site], alphas: dict[str, torch.Tensor]) -> None:
    """Fold ``alphas`` (site name -> alpha) into ``model`` in the order of ``sites``; an alpha of ones is skipped:
    the weights stay as they are, the FP model's storage (a weight-sharing copy's) included."""
    for site in sites:
        alpha = alphas.get(site.name)
        if alpha is not None and not bool((alpha == 1).all()):
            fold_site(model, site, alpha)


def _key(site_name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", site_name)


class Quadapter(nn.Module):
    """alpha = exp(theta), theta initialised to 0: positive, and learning rates act on relative changes of alpha, so
    an outlier channel's alpha can fall by decades without crossing zero."""

    theta: nn.Parameter
    folded: torch.Tensor

    def __init__(self, site: Site, channels: int):
        super().__init__()
        self.site = site
        self.theta = nn.Parameter(torch.zeros(channels))
        self.held: torch.Tensor | None = None  # alpha while QuadapterSet.fused holds it
        # the product of every alpha folded into the weights so far: what the FP model needs to become this sim's
        self.register_buffer("folded", torch.ones(channels))

    @property
    def alpha(self) -> torch.Tensor:
        return self.theta.exp() if self.held is None else self.held

    def set_alpha(self, alpha: torch.Tensor) -> None:
        with torch.no_grad():
            self.theta.copy_(alpha.clamp_min(1e-12).log())


def _scaled_tensors(
    weight: torch.Tensor, bias: torch.Tensor | None, row: torch.Tensor | None, col: torch.Tensor | None, offset: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """diag(row) weight diag(1 / col), and the bias times row (None where row is None or there is no bias)."""
    if row is not None:
        weight = rows_scaled(weight, row, offset)
    bias = bias * row if row is not None and bias is not None else None
    if col is not None:
        weight = weight / col[None, :]
    return weight, bias


@functools.cache
def _compiled_scaling():
    return torch.compile(_scaled_tensors, dynamic=True)


class _ModulePatch:
    """The scaled weight and bias one module sees: diag(row scale) W diag(1 / column scale)."""

    def __init__(self) -> None:
        self.rows: list[Quadapter] = []  # this module is the producer of these sites
        self.cols: list[Quadapter] = []  # ... and a consumer of these
        self.saved: dict[str, nn.Parameter | None] = {}
        # unfolded: the module holds the FP weights and each forward folds the `folded` alphas in, as fold_site does
        self.unfolded = False
        self.folds: list[tuple[Quadapter, bool]] = []  # (Quadapter, True where this module is its producer)
        self.replay: list[tuple[Quadapter, bool]] = []  # the folds whose alpha is not all ones, set by unfold
        self.fused = False  # set by QuadapterSet.fused

    def scaled(self, module: nn.Module) -> dict[str, torch.Tensor]:
        weight, bias = tensor_of(module, "weight"), _bias_of(module)
        if self.unfolded:
            for q, producer in self.replay:
                weight, bias = folded_tensors(weight, bias, q.site, q.folded, producer)
        row: torch.Tensor | None = None
        col: torch.Tensor | None = None
        offset = 0.0
        for q in self.rows:  # producer: rows times alpha
            offset = q.site.norm_offset
            scale = q.site.producer_scale(q.alpha)
            row = scale if row is None else row * scale
        for q in self.cols:  # consumer: columns (or, for a product of two projections, rows) divided by alpha
            scale = q.site.consumer_scale(q.alpha)
            if q.site.consumer_rows:
                row = 1 / scale if row is None else row / scale
            else:
                col = scale if col is None else col * scale
        # unfolded, the folded tensors stand in for the module's own even where no alpha scales them further
        out: dict[str, torch.Tensor] = {"weight": weight} if self.unfolded else {}
        if self.unfolded and bias is not None:
            out["bias"] = bias
        if row is None and col is None:
            return out
        scaling = _scaled_tensors
        if self.fused:  # a frozen parameter goes in as a plain tensor: a compiled graph fixes a parameter's shape
            weight = weight if weight.requires_grad else weight.detach()
            bias = bias if bias is None or bias.requires_grad else bias.detach()
            scaling = _compiled_scaling()
        out["weight"], scaled_bias = scaling(weight, bias, row, col, offset)
        if scaled_bias is not None:
            out["bias"] = scaled_bias
        return out

    def pre_hook(self, module: nn.Module, args):
        for name, tensor in self.scaled(module).items():
            self.saved[name] = module._parameters.pop(name)
            # a plain attribute shadows the parameter for this forward: AIMET's weight quantizers read `self.weight`
            object.__setattr__(module, name, tensor)

    def post_hook(self, module: nn.Module, args, output):
        for name, param in self.saved.items():
            module.__dict__.pop(name, None)
            module._parameters[name] = param
        self.saved.clear()
        return output


class QuadapterSet(nn.Module):
    """All Quadapters of a model, one per site, keyed by site name."""

    def __init__(self, model: nn.Module, sites: Iterable[Site]):
        super().__init__()
        self.sites = list(sites)
        self.adapters = nn.ModuleDict()
        for site in self.sites:
            producer = model.get_submodule(site.producer)
            self.adapters[_key(site.name)] = Quadapter(site, site.channels(tensor_of(producer, "weight").shape[0]))
        self.to(tensor_of(model.get_submodule(self.sites[0].producer)).device if self.sites else "cpu")
        self._handles: list = []
        self._patches: dict[int, _ModulePatch] = {}

    @classmethod
    def for_model(cls, model: PreparedLM, extra_sites: bool | Iterable[str] | None = None) -> QuadapterSet:
        return cls(model, model.sites(extra=extra_sites))

    def __getitem__(self, site_name: str) -> Quadapter:
        return cast(Quadapter, self.adapters[_key(site_name)])

    def __iter__(self) -> Iterator[Quadapter]:
        return (cast(Quadapter, q) for q in self.adapters.values())

    def __len__(self) -> int:
        return len(self.adapters)

    def attach(self, *models: nn.Module) -> QuadapterSet:
        """Make each model's forward use the scaled weights (the sim's model, the FP PreparedLM, or both)."""
        self.detach()
        for model, q in ((m, q) for m in models for q in self):
            for path, role in [(q.site.producer, "rows")] + [(c, "cols") for c in q.site.consumers]:
                module = model.get_submodule(path)
                patch = self._patches.get(id(module))
                if patch is None:
                    patch = self._patches[id(module)] = _ModulePatch()
                    self._handles.append(module.register_forward_pre_hook(patch.pre_hook))
                    self._handles.append(module.register_forward_hook(patch.post_hook, always_call=True))
                getattr(patch, role).append(q)
                patch.folds.append((q, role == "rows"))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._patches.clear()

    @contextmanager
    def fused(self) -> Iterator[None]:
        """While inside, each alpha is computed once per pass and a module's scaled tensors by compiled kernels: the
        same values, theta's gradients summed in another order."""
        self._fuse(True)
        try:
            yield
        finally:
            self._fuse(False)

    def _fuse(self, on: bool) -> None:
        for q in self:
            q.held = q.theta.exp() if on else None
        for patch in self._patches.values():
            patch.fused = on

    @torch.no_grad()
    def unfold(self, model: nn.Module, reference: nn.Module) -> None:
        """Give the attached ``model``'s touched weights ``reference``'s back, the hooks folding the ``folded`` alphas
        in at every forward as :meth:`fold` does: no folded copy kept. :meth:`fold` with ``reference`` ends it."""
        if any(id(model.get_submodule(q.site.producer)) not in self._patches for q in self):
            raise QuadapterError("unfold: the set is not attached to this model (attach it first)")
        for target in self._reset_to(model, reference):
            patch = self._patches[id(target)]
            # as fold_alphas: a site of ones is not folded (read once here, not at every forward)
            patch.replay = [(q, producer) for q, producer in patch.folds if not bool((q.folded == 1).all())]
            patch.unfolded = True

    def _reset_to(self, model: nn.Module, reference: nn.Module) -> list[nn.Module]:
        """Give every producer and consumer of ``model`` ``reference``'s weight and bias back; returns them."""
        targets = []
        for q in self:
            for path in (q.site.producer, *q.site.consumers):
                target, source = model.get_submodule(path), reference.get_submodule(path)
                reset_to(tensor_of(target, "weight"), tensor_of(source, "weight"))
                if _bias_of(target) is not None:
                    reset_to(tensor_of(target, "bias"), tensor_of(source, "bias"))
                targets.append(target)
        return targets

    @torch.no_grad()
    def fold(self, model: nn.Module, reference: nn.Module | None = None) -> None:
        """Write every alpha into ``model``'s weights (Eq. 3) and reset alpha to 1; with ``reference`` (its FP model),
        the total alphas fold into the FP weights in one go, as a saved state rebuilds them, bit for bit."""
        if reference is not None:
            self._reset_to(model, reference)
        if any(patch.unfolded for patch in self._patches.values()) and reference is None:
            raise QuadapterError("fold: the weights are unfolded (see unfold); fold them from the reference model")
        alphas = {q.site.name: (q.folded * q.alpha if reference is not None else q.alpha) for q in self}
        for patch in self._patches.values():
            patch.unfolded = False
        fold_alphas(model, self.sites, alphas)
        for q in self:
            q.folded.mul_(q.alpha)
            q.theta.zero_()
        from aimet_quadapter.quant.quantizers import refresh_prefix  # here: reading a state needs no AIMET

        refresh_prefix(model)

    @torch.no_grad()
    def set_total(self, alphas: dict[str, torch.Tensor]) -> None:
        """Make ``alphas`` the whole scale of each site (a site not named: 1), nothing counted as folded."""
        # a name of no site (another model's state, a prefixed key) would otherwise leave that site at 1
        unknown = sorted(set(alphas) - {q.site.name for q in self})
        if unknown:
            raise QuadapterError(f"alpha for {len(unknown)} unknown site(s), e.g. {unknown[0]!r}")
        for q in self:
            q.folded.fill_(1.0)
            alpha = alphas.get(q.site.name)
            if alpha is None:
                q.theta.zero_()
            else:
                q.set_alpha(alpha)

    def total_alpha(self) -> dict[str, torch.Tensor]:
        """Site name -> the whole scale relative to the original FP model (folded x current)."""
        return {q.site.name: (q.folded * q.alpha).detach().clone() for q in self}
