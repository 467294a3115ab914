"""The Quadapter: one learnable positive scale per channel at each site (Eq. 2 and 3 of the paper).

At a site the producer's output channels are multiplied by alpha (a norm's gamma and beta, or a
linear's rows and bias) and the consumers' input columns are divided by alpha. Without quantizers
that is the identity for any alpha; with them, the producer's weight quantizer, the activation
quantizer between the two and the consumers' weight quantizers all see the scaled tensors.

As in peft, nothing in the model is replaced: :meth:`QuadapterSet.attach` hooks the producer and
consumer modules so that, during their forward, their ``weight``/``bias`` are the scaled tensors
(the same substitution AIMET uses for weight fake-quant), and the gradient reaches alpha through
every quantizer. :meth:`QuadapterSet.fold` writes alpha into the weights for good (Eq. 3).
"""

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
        w = tensor_of(module, "weight")
        b = _bias_of(module)
        w.data, folded_bias = folded_tensors(w, b, site, alpha, producer)
        if b is not None and folded_bias is not None:
            b.data = folded_bias


def folded_tensors(
    weight: torch.Tensor, bias: torch.Tensor | None, site: Site, alpha: torch.Tensor, producer: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A module's weight and bias with one site's alpha folded in, as its producer (rows and bias times alpha) or
    as a consumer (columns divided by alpha; rows and bias for a product of two projections): new tensors."""
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
    """Fold ``alphas`` (site name -> alpha) into ``model``, site by site in the order of ``sites``. An alpha of
    ones changes nothing and is not folded: the weights stay as they are, the FP model's storage included."""
    for site in sites:
        alpha = alphas.get(site.name)
        if alpha is not None and not bool((alpha == 1).all()):
            fold_site(model, site, alpha)


def _key(site_name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", site_name)


class Quadapter(nn.Module):
    """alpha = exp(theta), theta initialised to 0 (alpha = 1): positive by construction.

    Learning rates (the paper's 0.1 in phase 1, 1e-3 in phase 2) act on theta, i.e. on relative
    changes of alpha, which lets an outlier channel's alpha fall by decades without crossing zero.
    """

    theta: nn.Parameter
    folded: torch.Tensor

    def __init__(self, site: Site, channels: int):
        super().__init__()
        self.site = site
        self.theta = nn.Parameter(torch.zeros(channels))
        self.held: torch.Tensor | None = None  # alpha while QuadapterSet.alphas_held holds it
        # Product of every alpha folded into the weights so far: what must be applied to the FP model
        # to reproduce this sim's weights (export, fresh sims).
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
        bias = bias * row if bias is not None else None
    else:
        bias = None
    if col is not None:
        weight = weight / col[None, :]
    return weight, bias


@functools.cache
def _compiled_scaling():
    # forward and backward each fused by torch.compile; one graph per kind of module (rank, bias, row, col)
    return torch.compile(_scaled_tensors, dynamic=True)


class _ModulePatch:
    """The scaled weight and bias one module sees: diag(row scale) W diag(1 / column scale)."""

    def __init__(self) -> None:
        self.rows: list[Quadapter] = []  # this module is the producer of these sites
        self.cols: list[Quadapter] = []  # ... and a consumer of these
        self.saved: dict[str, nn.Parameter | None] = {}
        # With `unfolded`, the module holds the FP weights and each forward first folds the Quadapters' `folded`
        # alphas in, site by site as fold_site does: the same tensors, without keeping them.
        self.unfolded = False
        self.folds: list[tuple[Quadapter, bool]] = []  # (Quadapter, True where this module is its producer)
        self.replay: list[tuple[Quadapter, bool]] = []  # the folds whose alpha is not all ones, set by unfold
        self.fused = False  # set by QuadapterSet.fused

    def _folded(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        for q, producer in self.replay:
            weight, bias = folded_tensors(weight, bias, q.site, q.folded, producer)
        return weight, bias

    def scaled(self, module: nn.Module) -> dict[str, torch.Tensor]:
        weight = tensor_of(module, "weight")
        bias = _bias_of(module)
        if self.unfolded:
            weight, bias = self._folded(weight, bias)
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
            # A plain attribute shadows the parameter for this forward only; AIMET's quantized
            # modules read `self.weight`, so their weight quantizers see the scaled tensor.
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

    # --- hooks ------------------------------------------------------------------------------------
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
        """While inside, each site's alpha is computed once for every module that reads it, and a module's scaled
        weight and bias are made by one compiled kernel each way: a few kernel launches per module and pass, where
        the eager ops take a dozen. The same values; the gradients of theta are summed in another order."""
        for q in self:
            q.held = q.theta.exp()
        for patch in self._patches.values():
            patch.fused = True
        try:
            yield
        finally:
            for q in self:
                q.held = None
            for patch in self._patches.values():
                patch.fused = False

    # --- folding ----------------------------------------------------------------------------------
    @torch.no_grad()
    def unfold(self, model: nn.Module, reference: nn.Module) -> None:
        """Give the weights of the attached ``model`` that the sites touch ``reference``'s values back (its
        storage, for a weight-sharing copy) and make the hooks fold the ``folded`` alphas in at every forward,
        op for op as :meth:`fold` folds them: the same function, without a folded copy of the weights kept.
        :meth:`fold` with ``reference`` ends it."""
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
        """Write every alpha into ``model``'s weights (Eq. 3) and reset alpha to 1.

        ``model`` must be the one the set acts on; its forward is unchanged by the fold. With
        ``reference`` (the FP model ``model`` was made from), the touched weights are first reset from
        it and the *total* alphas folded in one go, exactly as :class:`~aimet_quadapter.quadapter.state.
        QuadapterState` rebuilds them, so a saved result reloads bit for bit.
        """
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

    # --- state ------------------------------------------------------------------------------------
    @torch.no_grad()
    def set_total(self, alphas: dict[str, torch.Tensor]) -> None:
        """Make ``alphas`` the whole scale of each site (a site not named: 1), nothing counted as folded.

        Followed by :meth:`fold` with ``reference``, the model then holds exactly these alphas.
        """
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
