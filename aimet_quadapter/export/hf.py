"""The way back: the sim's model as a plain Hugging Face checkpoint, and its encodings in AIMET's own form.

``hf/`` holds what ``from_pretrained`` reads (alphas folded, ``lm_head`` untied), the tokenizer, the policy
(``quantization.json``), the prefix's ids (``prefix.json``) and the ranges twice: ``quantizer_state.pt`` (exact) and
``model_torch.encodings`` (for ``load_encodings_to_sim``; AIMET recomputes each scale from it, which can move it by
one ulp). :func:`load_hf_export` rebuilds the sim from them.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from aimet_torch.quantsim import QuantizationSimModel

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.formats import HF_FOLDER, PREFIX_IDS
from aimet_quadapter.memory import release_freed_memory
from aimet_quadapter.models import device_of
from aimet_quadapter.quant.quantizers import fast_inference
from aimet_quadapter.text.data import Window
from aimet_quadapter.text.perplexity import window_nll

if TYPE_CHECKING:
    from aimet_quadapter.export.verification import Verification

TORCH_ENCODINGS = "model_torch.encodings"  # AIMET's suffix for encodings keyed by module names
QUANTIZER_STATE = "quantizer_state.pt"
POLICY_FILE = "quantization.json"


def hf_state_dict(sim_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of a sim's Hugging Face model under the checkpoint's own names and layouts (GPT-2's Conv1D
    weights transposed back), taken from the model's class built on the meta device."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    lm: Any = sim_model.get_submodule("lm")
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(lm.config)
    wanted = reference.state_dict()
    state = {k: v.detach() for k, v in lm.state_dict().items() if k in wanted}
    for name, module in reference.named_modules():
        if isinstance(module, Conv1D):
            state[f"{name}.weight"] = state[f"{name}.weight"].t()
    missing = sorted(set(wanted) - set(state))
    wrong = [k for k in state if state[k].shape != wanted[k].shape]
    if missing or wrong:
        raise QuadapterError(
            f"the sim's model does not fit its own class's checkpoint: missing {missing[:3]}, other shapes {wrong[:3]}"
        )
    return {k: v.contiguous() for k, v in state.items()}


def save_hf_checkpoint(sim: QuantizationSimModel, folder: Path, tokenizer: Any = None) -> dict:
    """Write ``sim``'s model as a Hugging Face checkpoint with its encodings and policy into ``folder``."""
    from transformers import AutoModelForCausalLM

    from aimet_quadapter.quant.policy import sim_policy

    lm: Any = sim.model.get_submodule("lm")
    plain = AutoModelForCausalLM.from_config(lm.config, dtype=torch.float32)
    plain.load_state_dict(hf_state_dict(sim.model))
    folder.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():  # the weights come from a private temporary file: ordinary ones, as the rest
        path.chmod(0o666 & ~umask)
    activations, params = sim.get_activation_param_encodings()
    encodings = {"version": "0.6.1", "activation_encodings": activations, "param_encodings": params}
    (folder / TORCH_ENCODINGS).write_text(json.dumps(encodings, indent=1))
    torch.save(sim.quantizer_state_dict(), folder / QUANTIZER_STATE)
    (folder / POLICY_FILE).write_text(json.dumps(sim_policy(sim).to_dict(), indent=2))
    prefix = getattr(sim.model, "prefix_ids", None)
    if prefix is not None:
        (folder / PREFIX_IDS).write_text(json.dumps({"ids": prefix[0].tolist()}))
    return {
        "quantizer_state": QUANTIZER_STATE,
        "encodings": TORCH_ENCODINGS,
        "policy": POLICY_FILE,
        "tokenizer": tokenizer is not None,
        "prefix": None if prefix is None else PREFIX_IDS,
    }


def load_hf_export(
    folder: str | Path, device: str | torch.device = "cpu", from_json: bool = False
) -> tuple[QuantizationSimModel, Any]:
    """A fresh sim of an export's ``hf/`` folder (or of the export folder holding it) and the tokenizer (None
    where the export saved none). The ranges come from the quantizer state (exact), or with ``from_json`` from
    the JSON encodings through AIMET's ``load_encodings_to_sim``."""
    from aimet_torch.quantsim import load_encodings_to_sim

    from aimet_quadapter.models import prepare_model, resolve_device
    from aimet_quadapter.models.loading import load_hf_model, load_tokenizer
    from aimet_quadapter.quant.config import QuantPolicy
    from aimet_quadapter.quant.policy import build_sim

    folder = Path(folder)
    if (folder / HF_FOLDER / POLICY_FILE).is_file():
        folder = folder / HF_FOLDER
    for name in ("config.json", TORCH_ENCODINGS if from_json else QUANTIZER_STATE, POLICY_FILE):
        if not (folder / name).is_file():
            raise QuadapterError(f"{folder} is not an export's Hugging Face folder: it has no {name}")
    policy = QuantPolicy(**json.loads((folder / POLICY_FILE).read_text()))
    target = device if isinstance(device, torch.device) else resolve_device(device)
    model = prepare_model(load_hf_model(str(folder))).to(target)
    if (folder / PREFIX_IDS).is_file():
        model.set_prefix(json.loads((folder / PREFIX_IDS).read_text())["ids"])
    tokenizer = load_tokenizer(str(folder)) if (folder / "tokenizer_config.json").is_file() else None
    sim = build_sim(model, policy, in_place=True)
    if from_json:
        with warnings.catch_warnings():
            # AIMET steers new code to its quantizer_state_dict; the JSON is what other tools and versions read
            warnings.simplefilter("ignore", DeprecationWarning)
            load_encodings_to_sim(sim, str(folder / TORCH_ENCODINGS))
        return sim, tokenizer
    state = torch.load(folder / QUANTIZER_STATE, map_location=device, weights_only=True)
    result = sim.model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if "quantizers." in k]
    if result.unexpected_keys or missing:
        raise QuadapterError(
            f"{folder / QUANTIZER_STATE} does not fit the sim its policy builds: "
            f"{(result.unexpected_keys or missing)[0]} is {'unexpected' if result.unexpected_keys else 'missing'}"
        )
    return sim, tokenizer


@dataclass(frozen=True)
class HFRoundTrip:
    """A sim rebuilt from ``hf/`` against the exported one on the verification windows."""

    ranges_from: str  # the quantizer state, or the JSON encodings
    sim_ppl: float
    reloaded_ppl: float
    ppl_rel_diff: float
    max_abs_logit_diff: float


def _sim_logits(sim: QuantizationSimModel, windows: Sequence[Window]) -> list[torch.Tensor]:
    with torch.no_grad(), fast_inference(sim.model):
        return [sim.model(w.ids.reshape(1, -1).to(device_of(sim.model))).float().cpu() for w in windows]


def _round_trip(
    reference: Sequence[torch.Tensor], folder: Path, windows: Sequence[Window], from_json: bool, device: torch.device
) -> HFRoundTrip:
    # the exported sim's logits come in computed: two sims side by side would be the export's peak memory
    reloaded, _ = load_hf_export(folder, device, from_json=from_json)
    nll = [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)]
    tokens, diff = 0, 0.0
    with torch.no_grad(), fast_inference(reloaded.model):
        for window, ours in zip(windows, reference, strict=True):
            theirs = reloaded.model(window.ids.reshape(1, -1).to(device)).float().cpu()
            nll[0] += window_nll(ours, window)
            nll[1] += window_nll(theirs, window)
            scored = slice(window.first_target - 1, len(window.ids) - 1)
            diff = max(diff, float((ours[0, scored] - theirs[0, scored]).abs().max()))
            tokens += window.n_targets
    del reloaded
    sim_ppl, reloaded_ppl = (math.exp(x.item() / tokens) for x in nll)
    source = TORCH_ENCODINGS if from_json else QUANTIZER_STATE
    return HFRoundTrip(source, sim_ppl, reloaded_ppl, abs(reloaded_ppl - sim_ppl) / sim_ppl, diff)


@dataclass(frozen=True)
class HFCheckpoint:
    """The export's Hugging Face format (an :class:`~aimet_quadapter.export.formats.ExtraFormat`)."""

    key: ClassVar[str] = HF_FOLDER
    tokenizer: Any = field(default=None, compare=False)

    def check(self, windows: Sequence[Window], prefix_tokens: int) -> None:
        pass

    def write(self, sim: QuantizationSimModel, folder: Path, encoding_version: str) -> dict:
        return save_hf_checkpoint(sim, folder, self.tokenizer)

    def verify(
        self, sim: QuantizationSimModel, folder: Path, windows: Sequence[Window], report: Verification, export: Path
    ) -> dict:
        """The round trips a user makes against the exported sim: from the quantizer state, within the export's fixed
        tolerances; from the JSON, whose scales can move by one ulp, within the bounds the export measured."""
        tolerance = report.tolerance
        exact_logits = tolerance.logit_rtol * report.max_abs_sim_logit
        checks = (
            (False, tolerance.ppl_rtol, exact_logits),
            (True, max(tolerance.ppl_rtol, report.ppl_bound), max(exact_logits, report.logit_bound)),
        )
        rows = []
        reference = _sim_logits(sim, windows)
        release_freed_memory()
        for from_json, ppl_bound, logit_bound in checks:
            row = _round_trip(reference, folder, windows, from_json, device_of(sim.model))
            release_freed_memory()
            if row.ppl_rel_diff > ppl_bound or row.max_abs_logit_diff > logit_bound:
                raise QuadapterError(
                    f"the Hugging Face checkpoint with its {row.ranges_from}, loaded again, does not compute what the "
                    f"sim computes: perplexity {row.reloaded_ppl:.4f} vs {row.sim_ppl:.4f} (allowed rel. diff "
                    f"{ppl_bound:.2e}), max |logit diff| {row.max_abs_logit_diff:.3g} (allowed {logit_bound:.3g})"
                )
            rows.append(asdict(row))
        return {"verification": rows}
