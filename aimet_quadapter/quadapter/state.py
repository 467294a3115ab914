"""The Quadapter state: every site's alpha and quantizer range (safetensors), all a result needs besides the FP
model. Reading one needs no AIMET, so a bad file is refused in a command's first seconds."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors.torch import load as tensors_from_bytes
from safetensors.torch import save_file

from aimet_quadapter.atomic import write_atomic
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.models import PreparedLM, tensor_of, weight_sharing_copy
from aimet_quadapter.models.device_ops import device_op_paths
from aimet_quadapter.quadapter.adapter import fold_alphas
from aimet_quadapter.quant.config import QuantPolicy

if TYPE_CHECKING:
    from aimet_torch.quantsim import QuantizationSimModel


@dataclass
class QuadapterState:
    alphas: dict[str, torch.Tensor]  # site name -> total alpha relative to the FP model
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "module.role" -> (min, max)
    policy: QuantPolicy = field(default_factory=QuantPolicy)
    metadata: dict = field(default_factory=dict)
    source: Path | None = field(default=None, compare=False)  # the file it was read from, for messages
    # the weights a method changed beyond the alphas, by name: they replace the FP model's before the alphas fold in
    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    def with_weights(self, model: torch.nn.Module, fp_model: PreparedLM) -> QuadapterState:
        """This state with every parameter of ``model`` (unfolded) that differs from ``fp_model``'s."""
        reference = dict(fp_model.named_parameters())
        changed = {
            name: p.detach().clone()
            for name, p in model.named_parameters()
            if name in reference and not torch.equal(p.detach().to(reference[name].device), reference[name].detach())
        }
        return dataclasses.replace(self, weights=changed)

    @classmethod
    def from_sim(cls, sim: QuantizationSimModel, alphas: dict[str, torch.Tensor], **metadata) -> QuadapterState:
        from aimet_quadapter.quant.policy import sim_policy
        from aimet_quadapter.quant.quantizers import quantizers

        ranges = {}
        for path, role, q in quantizers(sim.model):
            if q.is_initialized():
                # the raw parameters: get_min()/get_max() return values rounded onto the grid
                ranges[f"{path}.{role}"] = (q.min.detach().clone(), q.max.detach().clone())
        arch = getattr(sim.model, "arch", None)
        if arch is not None:  # `export` and `eval --state` refuse a state of another family before loading a model
            metadata.setdefault("family", arch.name)
        prefix = getattr(sim.model, "prefix_ids", None)
        if prefix is not None:  # the deployable model reads its text after this prefix
            metadata["prefix"] = prefix[0].tolist()
        return cls({k: v.detach().clone() for k, v in alphas.items()}, ranges, sim_policy(sim), dict(metadata))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"alpha/{k}": v.contiguous() for k, v in self.alphas.items()}
        tensors.update({f"weight/{k}": v.contiguous() for k, v in self.weights.items()})
        for k, (lo, hi) in self.ranges.items():
            tensors[f"min/{k}"] = lo.contiguous()
            tensors[f"max/{k}"] = hi.contiguous()
        meta = {"policy": json.dumps(self.policy.to_dict()), "metadata": json.dumps(self.metadata)}
        write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
        return path

    @classmethod
    def load(cls, path: str | Path) -> QuadapterState:
        path = Path(path)
        if not path.is_file():
            raise QuadapterError(f"Quadapter state file {path} does not exist")
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            # read, not mapped: a mapped file stays resident while any one of its tensors lives
            tensors = tensors_from_bytes(path.read_bytes())
            policy = QuantPolicy(**json.loads(meta.get("policy", "{}")))
            metadata = json.loads(meta.get("metadata", "{}"))
            alphas = {k.removeprefix("alpha/"): v for k, v in tensors.items() if k.startswith("alpha/")}
            weights = {k.removeprefix("weight/"): v for k, v in tensors.items() if k.startswith("weight/")}
            ranges = {
                k.removeprefix("min/"): (v, tensors["max/" + k.removeprefix("min/")])
                for k, v in tensors.items()
                if k.startswith("min/")
            }
        except QuadapterError as exc:
            raise QuadapterError(f"Quadapter state file {path}: {exc}") from None
        except Exception as exc:  # safetensors, json and the dataclass raise their own types
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise QuadapterError(f"{path} is not a Quadapter state file (corrupt or truncated?): {reason}") from None
        return cls(alphas, ranges, policy, metadata, source=path, weights=weights)

    def folded_model(self, fp_model: PreparedLM, in_place: bool = False, share_weights: bool = False) -> PreparedLM:
        """A copy of ``fp_model`` (``in_place``: itself; ``share_weights``: on its storage), every alpha folded in."""
        self.check_fits(fp_model)
        if in_place and share_weights:
            raise ValueError("folded_model: share_weights makes a copy; in_place uses the model itself")
        if in_place:
            model = fp_model
        else:
            model = cast(PreparedLM, weight_sharing_copy(fp_model) if share_weights else copy.deepcopy(fp_model))
        if self.weights:
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, value in self.weights.items():
                    if params[name].shape != value.shape:
                        raise QuadapterError(
                            f"{self.described}'s weight {name} has shape {tuple(value.shape)}, this model's "
                            f"{tuple(params[name].shape)}: the state was trained on another model"
                        )
                    params[name].data = value.to(params[name].device)  # new data: the copy may share the FP storage
        sites = model.sites(extra=True)
        for site in sites:
            alpha = self.alphas.get(site.name)
            width = site.channels(tensor_of(model.get_submodule(site.producer)).shape[0])
            if alpha is not None and alpha.shape != (width,):
                raise QuadapterError(
                    f"{self.described}'s alpha for {site.name} has {alpha.numel()} channels, this model's site "
                    f"{width}: the state was trained on another model"
                )
        fold_alphas(model, sites, self.alphas)
        model.set_prefix(self.metadata.get("prefix"))  # the prefix's keys and values of the folded weights
        return model

    def check_fits(self, fp_model: PreparedLM) -> None:
        """Refuse a state made for another model by the names it holds, before any copy or sim is built."""
        missing = sorted(set(self.alphas) - {s.name for s in fp_model.sites(extra=True)})
        modules = {name for name, _ in fp_model.named_modules()}
        # a htp sim's modules for the graph's own ops (models/device_ops.py), which the FP model does not hold
        device = tuple(f"{p}." for p in device_op_paths(fp_model))
        missing += sorted(
            {m for key in self.ranges if (m := key.rsplit(".", 1)[0]) not in modules and not m.startswith(device)}
        )
        missing += sorted(set(self.weights) - {name for name, _ in fp_model.named_parameters()})
        if missing:
            raise QuadapterError(
                f"{self.described} was trained on another model: this one has no {', '.join(missing[:3])}"
                + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
            )

    @property
    def described(self) -> str:
        """The state as errors name it: its file, where it was loaded from one."""
        return f"state {self.source}" if self.source else "the state"

    def build_sim(
        self,
        fp_model: PreparedLM,
        in_place: bool = False,
        merge_shared_ranges: bool = False,
        share_weights: bool = False,
    ) -> QuantizationSimModel:
        """A fresh sim of the folded FP model with this state's ranges: the deployable result. ``in_place``: fold into
        ``fp_model`` itself; ``merge_shared_ranges``: see :func:`load_ranges` (``sim.quadapter_merged_ranges``)."""
        from aimet_quadapter.quant.policy import build_sim

        model = self.folded_model(fp_model, in_place, share_weights)
        sim = build_sim(model, self.policy, in_place=True)
        sim.quadapter_merged_ranges = load_ranges(sim, self.ranges, merge_shared_ranges, source=self.described)
        return sim


def load_ranges(
    sim: QuantizationSimModel,
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]],
    merge_shared_ranges: bool = False,
    source: str = "the state",
) -> list[dict]:
    """Set the sim's quantizer ranges from ``ranges``; one tensor's readers share one range, so different ranges for
    them are refused, or with ``merge_shared_ranges`` merged (their union): one row per merged tensor is returned."""
    from aimet_quadapter.quant.quantizers import quantizers_by_name

    found = quantizers_by_name(sim.model)
    unknown = sorted(set(ranges) - set(found))
    if unknown:
        raise QuadapterError(f"{source} has ranges for quantizers this sim does not have: {', '.join(unknown[:3])}")
    tied: dict[int, list[str]] = {}
    for key, (lo, hi) in ranges.items():
        q = found[key]
        if lo.shape != q.min.shape or hi.shape != q.max.shape:
            raise QuadapterError(
                f"{source}'s range for {key} has shape {tuple(lo.shape)}, this sim's quantizer "
                f"{tuple(q.min.shape)}: the state was made under another quantization policy"
            )
        tied.setdefault(id(q.min), []).append(key)
    merged = []
    with torch.no_grad():
        for keys in tied.values():
            los = torch.stack([ranges[k][0].reshape(-1) for k in keys])
            his = torch.stack([ranges[k][1].reshape(-1) for k in keys])
            if len(keys) > 1 and not (bool((los == los[0]).all()) and bool((his == his[0]).all())):
                if not merge_shared_ranges:
                    raise QuadapterError(
                        f"{source} holds different ranges for quantizers of one tensor ({', '.join(keys)}); the "
                        f"sim, like the device, gives such a tensor one range. Export it with "
                        f"--merge-shared-ranges (merge_shared_ranges=True) to take the union of them"
                    )
                merged.append(
                    {"quantizers": keys, "ranges": [[float(lo.min()), float(hi.max())] for lo, hi in zip(los, his)]}
                )
            q = found[keys[0]]
            q.set_range(los.min(dim=0).values.reshape(q.min.shape), his.max(dim=0).values.reshape(q.max.shape))
    return merged


def resolve_state(path: str | Path) -> Path:
    """A Quadapter state file from ``path``: the file, or the one state of a run folder (or its ``results.json``)."""
    path = Path(path).expanduser()
    if path.is_file():
        if path.suffix != ".safetensors":
            raise QuadapterError(f"{path} is not a Quadapter state (.safetensors) file")
        return path
    if not path.is_dir():
        raise QuadapterError(f"Quadapter state {path} does not exist")
    candidates = sorted(path.glob("*.safetensors"))
    results = path / "results.json"
    if results.is_file():
        try:
            states = json.loads(results.read_text()).get("states")
        except (json.JSONDecodeError, AttributeError):
            states = None
        if isinstance(states, dict):
            states = list(states.values())
        if isinstance(states, list) and states:
            candidates = sorted(path / s for s in states)
    if len(candidates) == 1:
        if not candidates[0].is_file():
            raise QuadapterError(f"{results} names the state {candidates[0]}, which does not exist")
        return candidates[0]
    if not candidates:
        raise QuadapterError(f"{path} holds no Quadapter state (*.safetensors): pass the state file")
    names = ", ".join(c.name for c in candidates)
    raise QuadapterError(
        f"{path} holds {len(candidates)} Quadapter states ({names}): pass the one to export, "
        f"e.g. {path / candidates[-1].name}"
    )
