"""The exported graph as an integer device runs it, simulated by AIMET's own ONNX quantsim (``aimet-onnx``).

As a converter does, under AIMET's HTP config: this package's encodings loaded and frozen, every other tensor
calibrated on tuning text; reports which activation tensors carry our encodings and scores the graph beside the sim.
``aimet-onnx`` is an optional extra (``pip install aimet-quadapter[device-check]``), used only through this module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import tempfile
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.formats import ENCODINGS, FP_ONNX, INPUT_NAME
from aimet_quadapter.export.onnx_eval import read_encodings
from aimet_quadapter.logs import log
from aimet_quadapter.memory import release_freed_memory, trim_heap
from aimet_quadapter.quant.aimet_private import (
    HTP_VERSION,
    add_missing_onnx_quantizers,
    htp_config_file,
    release_fused_graph,
)
from aimet_quadapter.quant.quantizers import aimet_onnx_rounding

REPORT = "device_check.json"
EXTRA = "device-check"  # the optional dependency group that brings aimet-onnx


def require_aimet_onnx() -> None:
    """Refuse in one line, before any model loads, where aimet-onnx is not installed."""
    if importlib.util.find_spec("aimet_onnx") is None:
        raise QuadapterError(
            f"--device-check needs aimet-onnx: pip install 'aimet-quadapter[{EXTRA}]' (or aimet-onnx==2.42.*)"
        )


@dataclass
class Coverage:
    """The graph's quantized activation tensors, split by whether this package's encodings name them; those
    computed from constants alone (``constants``: a converter folds them, see :func:`device_sim`) apart."""

    covered: list[str]
    missing: list[str]
    constants: list[str]


@contextlib.contextmanager
def device_sim(export: Path, scratch: Path | None = None) -> Iterator[tuple[Any, Coverage]]:
    """AIMET's ONNX quantsim of ``export``'s FP graph under the HTP config, this package's encodings loaded and
    frozen (other tensors keep their quantizers, to be calibrated), and which tensors they cover. Its files go to a
    folder in ``scratch`` (default: the system's temporary folder), removed when the block ends.
    """
    with tempfile.TemporaryDirectory(prefix="device-sim-", dir=scratch) as workdir:
        yield _device_sim(export, workdir)


def _device_sim(export: Path, workdir: str) -> tuple[Any, Coverage]:
    import onnx
    from aimet_onnx.quantsim import QuantizationSimModel, load_encodings_to_sim

    # aimet-onnx sets its loggers back to INFO, and lists every quantizer the loaded encodings change
    logging.getLogger("Quant").setLevel(logging.WARNING)

    file = export / ENCODINGS
    encodings = json.loads(file.read_text())
    model = onnx.load(str(export / FP_ONNX))  # external data is read from beside the graph
    initializers = {t.name for t in model.graph.initializer}
    folded = _constant_tensors(model)
    sim = QuantizationSimModel(
        model,
        config_file=htp_config_file(package="aimet_onnx"),
        providers=["CPUExecutionProvider"],
        path=workdir,
        # no arena: it would keep every dequantized weight beside the weights after a run
        session_options_kwargs={"enable_cpu_mem_arena": False, "enable_mem_pattern": False},
    )
    # the sim holds a fused copy of the graph: the loaded one, weights and all, goes before anything runs
    del model
    release_fused_graph()
    release_freed_memory()
    # the embedding table is a Gather input aimet-onnx quantizes as an activation; the export names it a param
    ours = {e.name for e in read_encodings(encodings)}
    if not str(encodings.get("version", "")).startswith("1."):
        # as aimet-onnx adds them for a 1.0.0 file (e.g. the embedding's output), the graph's initializers as params
        add_missing_onnx_quantizers(sim, sorted(ours & initializers), sorted(ours - initializers))
    # strict=False: a quantizer takes the loaded encoding's bits and symmetry, as a converter's override does
    load_encodings_to_sim(sim, str(file), strict=False, allow_overwrite=False, disable_missing_quantizers=False)
    trim_heap()  # the copy of the graph aimet-onnx saved for its session's rebuild, freed without a cycle
    quantizer = sim.qc_quantize_op_dict
    # aimet-onnx ties a Concat's inputs to its output (the prefix's constant keys and the sequence's): one quantizer
    tied: dict[int, list[str]] = defaultdict(list)
    for name, q in quantizer.items():
        tied[id(q)].append(name)

    def encoded(name: str) -> bool:
        return any(n in ours for n in tied[id(quantizer[name])])

    quantized = [n for n in sim.activation_names if (q := quantizer.get(n)) is not None and q.enabled]
    constants = [n for n in quantized if all(t in folded for t in tied[id(quantizer[n])]) and not encoded(n)]
    for name in constants:  # a converter folds them: the rotary angles, the causal mask, the mask's fill value
        quantizer[name].enabled = False
    quantized = [n for n in quantized if n not in constants]  # a folded quantizer holds constants' names only
    return sim, Coverage([n for n in quantized if encoded(n)], [n for n in quantized if not encoded(n)], constants)


def _constant_tensors(model: Any) -> set[str]:
    """The tensors of ``model``'s graph that do not depend on its inputs: constants of a graph of fixed length."""
    live = {i.name for i in model.graph.input} - {i.name for i in model.graph.initializer}
    produced: set[str] = set()
    for node in model.graph.node:  # ONNX graphs are topologically sorted
        produced.update(node.output)
        if any(i in live for i in node.input):
            live.update(node.output)
    return produced - live


class _SessionLM:
    """``ids (1, T) -> logits`` through the quantsim's onnxruntime session."""

    def __init__(self, sim: Any):
        self.sim = sim

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        feed = {INPUT_NAME: ids.reshape(1, -1).cpu().numpy().astype(np.int64)}
        (logits,) = self.sim.session.run(None, feed)  # the one output (the simulation renames it)
        return torch.from_numpy(logits)


@contextlib.contextmanager
def device_lm(
    export: Path, calibration: Sequence[torch.Tensor], scratch: Path | None = None
) -> Iterator[tuple[_SessionLM, Coverage]]:
    """``export``'s graph in AIMET's ONNX simulation as ``ids -> logits`` (:func:`device_sim`), every tensor without
    an encoding calibrated on ``calibration``, and its coverage."""
    with device_sim(export, scratch) as (onnx_sim, coverage):
        onnx_sim.compute_encodings([{INPUT_NAME: c.reshape(1, -1).numpy().astype(np.int64)} for c in calibration])
        yield _SessionLM(onnx_sim), coverage


def greedy(lm: Any, prompt: torch.Tensor, tokens: int, length: int | None = None) -> torch.Tensor:
    """``tokens`` tokens ``lm`` (``ids (1, T) -> logits``) appends to ``prompt`` greedily; ``length``: a static
    graph's input length, the ids padded at the end (causal: the padding changes no earlier position)."""
    ids = prompt.reshape(-1).tolist()
    for _ in range(tokens):
        feed = ids + [0] * (length - len(ids)) if length else ids
        logits = lm(torch.tensor([feed]))
        ids.append(int(logits[0, len(ids) - 1].argmax()))
    return torch.tensor(ids[prompt.numel() :])


def _greedy_after(lm: Any, prompt: Prompt, picks: torch.Tensor, length: int) -> torch.Tensor:
    """:func:`greedy`'s answer, taken from ``picks`` (the top-1 along the FP model's answer) while they agree: a
    static causal graph gives each position the same logits whatever follows, so only after the first disagreement
    does it need one forward per token."""
    fp = prompt.fp.reshape(-1)
    same = picks[: fp.numel()] == fp[: picks.numel()]
    agree = int(same.long().cumprod(0).sum())
    if agree == fp.numel():
        return fp.clone()
    head = torch.cat([fp[:agree], picks[agree : agree + 1]])  # the first pick of its own, where picks reach it
    rest = greedy(lm, torch.cat([prompt.ids.reshape(-1), head]), fp.numel() - head.numel(), length)
    return torch.cat([head, rest])


@dataclass
class Prompt:
    """A prompt's ids and the FP model's greedy continuation of it, to set the device graph's beside."""

    ids: torch.Tensor
    fp: torch.Tensor


def _answers(lm: Any, prompts: Sequence[Prompt], length: int) -> list[dict]:
    """Each prompt answered greedily by the device graph ``lm``, beside the FP model's answer and their top-1 match."""
    out = []
    for p in prompts:
        text = torch.cat([p.ids.reshape(-1), p.fp.reshape(-1)])[:length]
        logits = lm(torch.cat([text, text.new_zeros(length - text.numel())])[None])
        start = p.ids.numel()
        picks = logits[0, start - 1 : text.numel() - 1].argmax(-1)
        top1 = float((picks == text[start:]).float().mean()) if text.numel() > start else 0.0
        device = _greedy_after(lm, p, picks, length)
        out.append({"prompt": p.ids.tolist(), "fp": p.fp.tolist(), "device": device.tolist(), "top1": top1})
    return out


@dataclass
class DeviceGraphCheck:
    """The export's full-sequence graph in AIMET's ONNX simulation (see the module's doc); ``calibration``: the
    windows (of the graph's length) its tensors without an encoding are calibrated on; ``prompts``: answered
    greedily by the device graph beside the FP model's answers."""

    calibration: Sequence[torch.Tensor]
    progress: bool = False
    prompts: Sequence[Prompt] = ()
    key: ClassVar[str] = "device_check"

    def check(self, windows: Sequence[Any], prefix_tokens: int) -> None:
        require_aimet_onnx()
        lengths = {len(w.ids) for w in windows} | {int(c.numel()) for c in self.calibration}
        if len(lengths) != 1:
            raise QuadapterError(f"--device-check: calibration and verification windows differ in length {lengths}")

    def write(self, sim: Any, folder: Path, encoding_version: str) -> dict:
        folder.mkdir(parents=True, exist_ok=True)
        return {}

    def verify(self, sim: Any, folder: Path, windows: Sequence[Any], report: Any, export: Path) -> dict:
        from aimet_quadapter.models.storage import weights_parked
        from aimet_quadapter.text.perplexity import perplexity

        rounded = None
        if sim is not None:  # the sim once more, its activations rounding as this simulation's kernel rounds
            with aimet_onnx_rounding(sim.model):
                rounded = perplexity(sim.model, windows, desc="sim, aimet-onnx's rounding", progress=self.progress)
        # the torch sim's weights wait on disk while AIMET's ONNX sim holds the graph's own copies of them
        parked = weights_parked(sim.model, folder / "parked") if sim is not None else contextlib.nullcontext()
        with parked, device_lm(export, self.calibration, scratch=folder) as (device, coverage):
            ppl = perplexity(device, windows, desc="device graph (aimet-onnx)", progress=self.progress).ppl
            answers = _answers(device, self.prompts, int(self.calibration[0].numel())) if self.prompts else []
            # every tensor's encoding, the calibrated ones too; the graph is the export's own model.onnx
            device.sim.export(str(folder), "device", export_model=False)
            del device
        entry = {
            "simulator": "aimet-onnx QuantizationSimModel, HTP config " + HTP_VERSION,
            "activation_tensors": len(coverage.covered) + len(coverage.missing),
            "with_encoding": len(coverage.covered),
            "without_encoding": coverage.missing,
            "constants_folded": coverage.constants,  # computed from constants alone: a converter folds them
            "calibration_windows": len(self.calibration),
            "ppl": ppl,
            "sim_ppl": report.sim_ppl,
            "ppl_rel_diff": abs(ppl / report.sim_ppl - 1),
            "sim_float_noise": report.sim_floor.ppl_rel_diff,  # the sim against itself, one ulp apart
        }
        # the band the export holds its own ONNX graphs to: outside it, not what the sim scored
        entry["within_band"] = entry["ppl_rel_diff"] <= report.ppl_bound
        if not entry["within_band"]:
            log.warning(
                "the device graph's perplexity %.4f is %.1e from the sim's %.4f, outside the band %.1e: the device "
                "will not compute what the sim scored%s",
                ppl,
                entry["ppl_rel_diff"],
                report.sim_ppl,
                report.ppl_bound,
                f" ({len(coverage.missing)} activation tensor(s) without this package's encoding: a target whose "
                "sim quantizes them, such as htp, covers them)"
                if coverage.missing
                else "",
            )
        if self.prompts:
            entry["prompts"] = answers
        if rounded is not None:
            entry["sim_ppl_aimet_onnx_rounding"] = rounded.ppl
            entry["ppl_rel_diff_aimet_onnx_rounding"] = abs(ppl / rounded.ppl - 1)
        (folder / REPORT).write_text(json.dumps(entry, indent=1))
        return entry
