"""Export of a trained sim for on-device inference, verified against the simulation before it is kept.

Writes ``model.onnx`` + ``model.encodings`` (the FP graph, alphas folded, weights on their grid, and AIMET's
encodings JSON for a device converter), ``model_qdq.onnx`` (QDQ nodes, for onnxruntime), ``manifest.json``, and
each :class:`~aimet_quadapter.export.formats.ExtraFormat` asked for in its own subfolder. A sim with a prefix is
exported as it computes: the graphs hold the prefix's keys and values and take the tokens after it. Nothing is
kept unless every check passes (:func:`verify_export`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aimet_torch.quantsim import QuantizationSimModel
from packaging.version import Version

from aimet_quadapter.atomic import check_new_folder, write_text_atomic
from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.formats import (
    ENCODING_VERSIONS,
    ENCODINGS,
    FP_ONNX,
    INPUT_NAME,
    MANIFEST,
    OUTPUT_NAME,
    QDQ_ONNX,
    SEQ_LEN,
    ExtraFormat,
    data_file,
    encoding_version_for,
)
from aimet_quadapter.export.lean import export_sim_graphs, opset_imports
from aimet_quadapter.export.onnx_eval import (
    Encoding,
    OnnxLM,
    apply_encodings,
    graph_tensor_names,
    qdq_graph_encodings,
    read_encodings,
)
from aimet_quadapter.export.verification import Agreement, Tolerance, Verification
from aimet_quadapter.memory import release_freed_memory
from aimet_quadapter.models import device_of, parameter_bytes
from aimet_quadapter.models.storage import weights_parked
from aimet_quadapter.quant.policy import sim_policy
from aimet_quadapter.quant.quantizers import fast_inference, quantizers, quantizers_by_name, shared_activation_groups
from aimet_quadapter.text.data import Window
from aimet_quadapter.text.perplexity import window_nll
from aimet_quadapter.versions import library_versions

# The forms compared with the sim: (name, file or "fp+encodings", onnxruntime graph optimizations)
FORMS = (
    ("qdq/unoptimized", QDQ_ONNX, False),  # node by node, as written
    ("qdq", QDQ_ONNX, True),  # as `eval` and a user run it
    ("fp+encodings", "fp+encodings", False),  # model.onnx with model.encodings applied, as written
)


@dataclass
class ExportResult:
    out_dir: Path
    manifest: dict
    verification: Verification
    files: dict[str, Path] = field(default_factory=dict)


def _check_calibrated(sim: QuantizationSimModel) -> int:
    missing = [f"{path}.{role}" for path, role, q in quantizers(sim.model) if not q.is_initialized()]
    if missing:
        raise QuadapterError(
            f"{len(missing)} quantizer(s) of the sim have no encoding (e.g. {missing[0]}): calibrate the sim "
            f"(compute_encodings) or load a trained state before exporting"
        )
    return sum(1 for _ in quantizers(sim.model))


def _encoding_key(q) -> tuple:
    return (int(q.bitwidth), *(t.detach().float().cpu().numpy().tobytes() for t in (q.get_scale(), q.get_offset())))


def reconcile_shared_ranges(sim: QuantizationSimModel, merge: bool = False) -> list[dict]:
    """Check that quantizers of one tensor agree; with ``merge``, give each such group the union of its ranges.

    An integer graph holds one encoding per tensor: where its consumers' differ, AIMET's export requantizes (a QDQ
    after a QDQ), which the sim did not compute. ``merge`` changes ``sim`` in place. Returns one row per
    disagreeing group: its quantizers and their ranges before any merge. Calibration gives such quantizers equal
    ranges; phase 2's range learning separates them. The union clips nothing any of them kept.
    """
    found = quantizers_by_name(sim.model)
    conflicts: list[dict[str, Any]] = []
    for keys in shared_activation_groups(sim.model):
        group = [found[k] for k in keys]
        if len({_encoding_key(q) for q in group}) > 1:
            ranges = [[float(q.get_min().min()), float(q.get_max().max())] for q in group]
            conflicts.append({"quantizers": keys, "ranges": ranges})
    if conflicts and not merge:
        first = conflicts[0]
        detail = ", ".join(f"{k} [{lo:.4g}, {hi:.4g}]" for k, (lo, hi) in zip(first["quantizers"], first["ranges"]))
        raise QuadapterError(
            f"{len(conflicts)} tensor(s) are quantized with different ranges by their consumers (e.g. {detail}): "
            f"an integer graph holds one encoding per tensor, so the export would not compute what the sim "
            f"computes. Re-run with --merge-shared-ranges (merge_shared_ranges=True) to give each such tensor "
            f"the union of its ranges (the verification then compares with that sim, and the manifest records "
            f"the change), or train with one quantizer shared by the consumers of a tensor"
        )
    with torch.no_grad():
        for row in conflicts:
            group = [found[k] for k in row["quantizers"]]
            lo = torch.stack([q.min.detach().reshape(-1) for q in group]).min(dim=0).values
            hi = torch.stack([q.max.detach().reshape(-1) for q in group]).max(dim=0).values
            for q in group:
                q.set_range(lo.reshape(q.min.shape), hi.reshape(q.max.shape))
    return conflicts


def check_encoding_names(fp_model, entries: Sequence[Encoding]) -> None:
    """Every encodings entry must name a tensor of the FP graph, or a converter would not find it."""
    names = graph_tensor_names(fp_model)
    unknown = [e.name for e in entries if e.name not in names]
    if unknown:
        raise QuadapterError(
            f"{len(unknown)} encodings entr{'y names' if len(unknown) == 1 else 'ies name'} no tensor of the exported "
            f"ONNX graph: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
        )


# AIMET's sim and its export compute LPBQ's per-channel scale apart, an ulp or so: block scales match to this
BLOCK_SCALE_RTOL = 1e-6


def _same_blocks(got: np.ndarray, sim: np.ndarray) -> bool:
    """Block scales ``got`` from a file (a Linear's weight transposed in the graph: (blocks, out)) against the sim's."""
    return any(c.shape == sim.shape and np.allclose(c, sim, rtol=BLOCK_SCALE_RTOL, atol=0) for c in (got, got.T))


def check_quantizer_coverage(
    sim: QuantizationSimModel, entries: Sequence[Encoding], where: str = "the encodings file"
) -> int:
    """Every quantizer of the sim must appear in ``entries`` (bit-width and scales); returns how many there are.

    Matched by value, not by name: AIMET names tensors after the ONNX graph, and quantizers of one tensor share one
    entry (a Linear weight is its transposed copy ``<param>_0``). The names are checked against the graph and the
    offsets by running it with the encodings applied. Block scales (LPBQ's) match to :data:`BLOCK_SCALE_RTOL`.
    """
    available = {(e.bitwidth, e.scale.astype(np.float32).tobytes()) for e in entries if not e.block_size}
    blocks: dict[tuple[int, tuple[int, ...]], list[np.ndarray]] = {}
    for e in entries:
        if e.block_size:
            blocks.setdefault((e.bitwidth, tuple(sorted(e.scale.shape))), []).append(e.scale)
    count, missing = 0, []
    for path, role, q in quantizers(sim.model):
        count += 1
        scale = q.get_scale().detach().float().cpu().numpy()
        if q.block_size is not None:
            written = blocks.get((int(q.bitwidth), tuple(sorted(scale.shape))), [])
            found = any(_same_blocks(w, scale) for w in written)
        else:
            found = (int(q.bitwidth), scale.reshape(-1).tobytes()) in available
        if not found:
            missing.append(f"{path}.{role}")
    if missing:
        raise QuadapterError(
            f"{len(missing)} of the sim's {count} quantizers have no entry in {where}: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    return count


def _as_windows(windows: Sequence[Window | torch.Tensor]) -> list[Window]:
    out = [w if isinstance(w, Window) else Window(torch.as_tensor(w).reshape(-1), 1) for w in windows]
    if not out:
        raise QuadapterError("verification needs at least one token window")
    return out


class _Comparison:
    """Running sums over windows: the NLL of one model and its largest logit difference from another."""

    def __init__(self):
        self.nll = torch.zeros((), dtype=torch.float64)
        self.max_diff = 0.0
        self.same_top1 = 0
        self.positions = 0

    def add(self, logits: torch.Tensor, other: torch.Tensor, window: Window, scored: slice) -> None:
        """``logits`` of the whole window; ``other``: the other model's logits at the ``scored`` positions."""
        self.nll += window_nll(logits, window)
        mine = logits[0, scored]
        self.max_diff = max(self.max_diff, float((mine - other).abs().max()))
        self.same_top1 += int((mine.argmax(-1) == other.argmax(-1)).sum())
        self.positions += mine.shape[0]

    def agreement(self, graph: str, ppl: float, ref_ppl: float) -> Agreement:
        return Agreement(graph, ppl, abs(ppl - ref_ppl) / ref_ppl, self.max_diff, self.same_top1 / self.positions)


# Draws of the sim's own float32 noise (see Tolerance), the largest taken: one draw can be small by chance, and a
# floor taken too low refuses a correct export
SIM_NOISE_DRAWS = 8


def _random_bits(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """A random bool per element of ``shape``, eight from each byte of 64-bit draws (the CPU draws one at a time)."""
    n = math.prod(shape)
    words = torch.randint(-(2**63), 2**63 - 1, (-(-n // 64),), generator=generator)
    bits = (words.view(torch.uint8).reshape(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(-1)[:n].reshape(shape).bool()


@contextmanager
def one_ulp_inputs(model: torch.nn.Module, seed: int, ulps: int = 1) -> Iterator[None]:
    """Every tensor an activation quantizer of ``model`` reads moved by ``ulps`` float32 ulps, up or down (a fixed
    random draw per ``seed``): what another runtime's summation order does to each op's output."""
    generator = torch.Generator().manual_seed(seed)

    def nudge(_module, args: tuple) -> tuple:
        x = args[0]
        toward = torch.where(_random_bits(x.shape, generator).to(x.device), math.inf, -math.inf).to(x.dtype)
        # nextafter, not a factor: x * (1 + 2**-24) rounds back to x
        for _ in range(ulps):
            x = torch.nextafter(x, toward)
        return (x, *args[1:])

    handles = [q.register_forward_pre_hook(nudge) for _, role, q in quantizers(model) if role != "weight"]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _larger(a: Agreement, b: Agreement) -> Agreement:
    """The noise floor of two measurements of it: the larger difference of each kind."""
    return Agreement(
        "noise floor",
        math.nan,
        max(a.ppl_rel_diff, b.ppl_rel_diff),
        max(a.max_abs_logit_diff, b.max_abs_logit_diff),
        min(a.top1_agreement, b.top1_agreement),
    )


def verify_export(
    sim: QuantizationSimModel,
    folder: str | Path,
    windows: Sequence[Window | torch.Tensor],
    tolerance: Tolerance = Tolerance(),
    progress: bool = False,
) -> Verification:
    """Prove an export folder equal to ``sim``; raise :class:`QuadapterError` where it is not.

    Exactly: every encodings entry names a tensor of ``model.onnx`` and every quantizer has its encoding in
    ``model.encodings`` and the QDQ graph. On ``windows``: each of :data:`FORMS` in onnxruntime agrees with the sim
    within ``tolerance``.
    """
    start = time.time()
    folder = Path(folder)
    windows = _as_windows(windows)
    entries, n_quantizers = _check_encodings_exactly(sim, folder)
    sim_run, (forms, floor, vs_qdq, applied) = _run_sim_and_forms(sim, folder, entries, windows, progress)

    def ppl(nll: torch.Tensor) -> float:
        return math.exp(nll.item() / sim_run.tokens)

    sim_ppl = ppl(sim_run.nll)
    agreements = [c.agreement(name, ppl(c.nll), sim_ppl) for name, c in forms.items()]
    unoptimized = ppl(forms["qdq/unoptimized"].nll)
    floor_row = floor.agreement("qdq vs qdq/unoptimized", ppl(floor.nll), unoptimized)
    encodings_row = vs_qdq.agreement("fp+encodings vs qdq/unoptimized", ppl(vs_qdq.nll), unoptimized)
    draws = [c.agreement("sim vs sim, one-ulp inputs", ppl(c.nll), sim_ppl) for c in sim_run.noise]
    sim_floor_row = max(draws, key=lambda a: (a.ppl_rel_diff, a.max_abs_logit_diff))
    noise = _larger(floor_row, sim_floor_row)
    report = Verification(
        windows=len(windows),
        window_lengths=sorted({len(w.ids) for w in windows}),
        tokens=sim_run.tokens,
        sim_ppl=sim_ppl,
        max_abs_sim_logit=sim_run.max_abs_logit,
        agreements=agreements,
        floor=floor_row,
        sim_floor=sim_floor_row,
        encodings_vs_qdq=encodings_row,
        ppl_bound=tolerance.ppl_bound(noise),
        logit_bound=tolerance.logit_bound(noise, sim_run.max_abs_logit),
        quantizers=n_quantizers,
        encoding_entries=len(entries),
        entries_applied=applied,
        tolerance=tolerance,
        seconds=time.time() - start,
    )
    _refuse_disagreement(report)
    return report


def _run_sim_and_forms(
    sim: QuantizationSimModel, folder: Path, entries: list[Encoding], windows: list[Window], progress: bool
) -> tuple[_SimRun, tuple[dict[str, _Comparison], _Comparison, _Comparison, int]]:
    from tqdm.auto import tqdm

    # one onnxruntime session at a time: each holds a copy of the weights and its own activation arena
    scored = [slice(w.first_target - 1, len(w.ids) - 1) for w in windows]
    runs = len(windows) * (1 + SIM_NOISE_DRAWS + len(FORMS))
    with tqdm(total=runs, desc="verify export", unit="run", disable=not progress) as bar:
        sim_run = _run_sim(sim, windows, scored, bar.update)
        return sim_run, _run_forms(sim, folder, entries, windows, scored, sim_run, bar.update)


def _check_encodings_exactly(sim: QuantizationSimModel, folder: Path) -> tuple[list[Encoding], int]:
    """:func:`verify_export`'s exact checks; the entries, and how many quantizers the sim has."""
    import onnx

    fp_model = onnx.load(str(folder / FP_ONNX), load_external_data=False)
    entries = read_encodings(json.loads((folder / ENCODINGS).read_text()))
    check_encoding_names(fp_model, entries)
    n_quantizers = check_quantizer_coverage(sim, entries)
    del fp_model
    release_freed_memory()
    qdq_model = onnx.load(str(folder / QDQ_ONNX), load_external_data=False)
    check_quantizer_coverage(sim, qdq_graph_encodings(qdq_model, folder), where=f"the QDQ graph {QDQ_ONNX}")
    del qdq_model
    release_freed_memory()
    return entries, n_quantizers


@dataclass
class _SimRun:
    references: list[torch.Tensor]  # the sim's scored logits, window by window
    nll: torch.Tensor
    max_abs_logit: float
    tokens: int
    noise: list[_Comparison]  # the sim against itself with one-ulp quantizer inputs, one draw each


def _run_sim(sim: QuantizationSimModel, windows: list[Window], scored: list[slice], tick) -> _SimRun:
    references, nll, max_sim, tokens = [], torch.zeros((), dtype=torch.float64), 0.0, 0
    with torch.no_grad(), fast_inference(sim.model):
        device = device_of(sim.model)
        for window, keep in zip(windows, scored):
            logits = sim.model(window.ids.reshape(1, -1).to(device)).float().cpu()
            nll += window_nll(logits, window)
            references.append(logits[0, keep].clone())
            max_sim = max(max_sim, float(references[-1].abs().max()))
            tokens += window.n_targets
            tick()
        noise = [_Comparison() for _ in range(SIM_NOISE_DRAWS)]
        for seed, comparison in enumerate(noise):
            with one_ulp_inputs(sim.model, seed):
                for window, keep, reference in zip(windows, scored, references):
                    logits = sim.model(window.ids.reshape(1, -1).to(device)).float().cpu()
                    comparison.add(logits, reference, window, keep)
                    tick()
    return _SimRun(references, nll, max_sim, tokens, noise)


def _run_forms(
    sim: QuantizationSimModel,
    folder: Path,
    entries: list[Encoding],
    windows: list[Window],
    scored: list[slice],
    sim_run: _SimRun,
    tick,
) -> tuple[dict[str, _Comparison], _Comparison, _Comparison, int]:
    """Each of :data:`FORMS` against the sim, the floor, fp+encodings against the QDQ graph, and the entries applied."""
    import onnx

    vs_sim = {name: _Comparison() for name, _, _ in FORMS}
    floor, encodings_vs_qdq, unoptimized_logits, applied = _Comparison(), _Comparison(), [], 0
    # each session holds the weights once more: the sim's, not read again, wait on disk meanwhile
    with weights_parked(sim.model, folder / ".parked-sim"):
        for name, source, optimize in FORMS:
            if source == "fp+encodings":
                # the graph alone: the emulated graph beside it names the same data file
                graph = onnx.load(str(folder / FP_ONNX), load_external_data=False)
                emulated, applied = apply_encodings(graph, entries, copy=False)
                path = folder / f".emulated-{FP_ONNX}"
                onnx.save(emulated, str(path))
                del graph, emulated
                try:
                    lm = OnnxLM(path, optimize=optimize, low_memory=True)
                finally:
                    path.unlink()  # onnxruntime has read it
            else:
                lm = OnnxLM(folder / source, optimize=optimize, low_memory=True)
            for i, (window, keep) in enumerate(zip(windows, scored)):
                logits = lm(window.ids.reshape(1, -1))
                vs_sim[name].add(logits, sim_run.references[i], window, keep)
                if name == "qdq/unoptimized":  # kept for the floor, and to compare the encodings file with AIMET's QDQ
                    unoptimized_logits.append(logits[0, keep].clone())
                elif name == "qdq":
                    floor.add(logits, unoptimized_logits[i], window, keep)
                else:
                    encodings_vs_qdq.add(logits, unoptimized_logits[i], window, keep)
                tick()
            del lm, logits
            release_freed_memory()
    return vs_sim, floor, encodings_vs_qdq, applied


def _refuse_disagreement(report: Verification) -> None:
    floor, sim_floor, ppl_bound, logit_bound = report.floor, report.sim_floor, report.ppl_bound, report.logit_bound
    bad = [a for a in report.agreements if not (a.ppl_rel_diff <= ppl_bound and a.max_abs_logit_diff <= logit_bound)]
    if bad:
        detail = "; ".join(
            f"{a.graph}: perplexity {a.ppl:.4f} vs sim {report.sim_ppl:.4f} (rel. diff {a.ppl_rel_diff:.2e}, allowed "
            f"{ppl_bound:.2e}), max |logit diff| {a.max_abs_logit_diff:.3g} (allowed {logit_bound:.3g})"
            for a in bad
        )
        raise QuadapterError(
            f"the exported model does not compute what the sim computes: {detail}; float32 noise floor: perplexity "
            f"rel. diff {floor.ppl_rel_diff:.2e} (onnxruntime with vs without graph optimizations), "
            f"{sim_floor.ppl_rel_diff:.2e} (the sim with one-ulp quantizer inputs), max |logit diff| "
            f"{floor.max_abs_logit_diff:.3g}, {sim_floor.max_abs_logit_diff:.3g}"
        )


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks (exports can be GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _file_table(folder: Path) -> dict[str, dict]:
    """Size and sha256 of every file directly in ``folder``, by name: the manifest's record of what was written."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(folder.iterdir()) if p.is_file()
    }


def _opset(path: Path) -> int:
    return next(version for domain, version in opset_imports(path) if domain in ("", "ai.onnx"))


# an export's peak disk use, in the model's weight bytes: AIMET writes each graph several times, and the sim's
# weights may wait on disk meanwhile
DISK_FACTOR = 6


def check_free_disk(out_dir: str | Path, model: torch.nn.Module) -> None:
    """Refuse an export whose folder's disk cannot hold what the export writes at its peak, before it starts."""
    need = DISK_FACTOR * parameter_bytes(model)
    probe = Path(out_dir).expanduser().absolute()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise QuadapterError(
            f"{out_dir}: an export of this model needs about {need / 1e9:.1f} GB of free disk there, "
            f"{free / 1e9:.1f} GB are free"
        )


def int32_bias(encoding_version: str) -> bool:
    """Whether AIMET writes int32 biases for ``encoding_version``: from 2.0.0 on (compared as versions, not as text,
    which would put "10.0.0" below "2.0.0")."""
    return Version(encoding_version) >= Version("2.0.0")


def _checked_windows(
    sim: QuantizationSimModel,
    seq_len: int,
    encoding_version: str,
    verify_windows: Sequence[Window | torch.Tensor],
    dynamic_length: bool,
    formats: Sequence[ExtraFormat],
) -> tuple[list[Window], int]:
    """The verification windows and the prefix's length, every argument checked before any work."""
    if encoding_version not in ENCODING_VERSIONS:
        raise QuadapterError(
            f"encodings version must be one of {', '.join(ENCODING_VERSIONS)}, got {encoding_version!r}"
        )
    if seq_len < 2:
        raise QuadapterError(f"sequence length must be at least 2, got {seq_len}")
    windows = _as_windows(verify_windows)
    too_long = [len(w.ids) for w in windows if len(w.ids) > seq_len]
    if too_long:
        raise QuadapterError(f"verification windows of {max(too_long)} tokens exceed the export length {seq_len}")
    prefix = getattr(sim.model, "prefix_length", 0)  # a sim of something else than a PreparedLM has none
    if prefix:
        sim.model.check_length(prefix + seq_len, f"the export length {seq_len} + {prefix} prefix tokens =")
    keys = [f.key for f in formats]
    if len(set(keys)) != len(keys):
        raise QuadapterError(f"each export format once: got {', '.join(keys)}")
    for extra in formats:
        extra.check(windows, prefix)
    if dynamic_length:
        # prove the dynamic axis too: the same text at another length
        windows.append(Window(windows[0].ids[: max(2, len(windows[0].ids) // 2)], 1))
    return windows, prefix


def _export_graphs(
    sim: QuantizationSimModel, folder: Path, seq_len: int, encoding_version: str, dynamic_length: bool, opset
) -> None:
    """The FP graph with its encodings, and the QDQ graph, of ``sim`` (on the CPU) into ``folder``."""
    dummy = torch.zeros((1, seq_len), dtype=torch.long)
    common: dict[str, Any] = {"input_names": [INPUT_NAME], "output_names": [OUTPUT_NAME], "dynamo": False}
    if dynamic_length:
        common["dynamic_axes"] = {INPUT_NAME: {1: "sequence"}, OUTPUT_NAME: {1: "sequence"}}
    sim.model.eval()
    export_sim_graphs(sim, (dummy,), folder, Path(FP_ONNX).stem, encoding_version, "the model", opset, **common)


# ops whose output holds exactly its input's values (repeated, reshaped, reordered): one encoding fits both
DATA_MOVEMENT = ("Reshape", "Transpose", "Unsqueeze", "Squeeze", "Tile", "Expand", "Flatten")


def propagate_through_data_movement(folder: Path) -> list[str]:
    """Give each activation tensor that reaches an encoded tensor through :data:`DATA_MOVEMENT` ops alone that
    tensor's encoding, in ``folder``'s encodings file, where a converter would otherwise calibrate it on its own
    grid. The sim quantizes such a value once, where a module reads it (keys after the prefix joins them and their
    heads repeat); the graph holds it earlier too. Returns the names added."""
    import onnx

    graph = onnx.load(str(folder / FP_ONNX), load_external_data=False).graph
    constants = {t.name for t in graph.initializer}
    file = folder / ENCODINGS
    encodings = json.loads(file.read_text())
    key = "activation_encodings" if str(encodings.get("version", "")).startswith("1.") else "encodings"
    entries = {e["name"]: e for e in encodings[key]}
    added: list[str] = []
    # ONNX nodes are in topological order: one pass backwards carries an encoding along a whole chain
    for node in reversed(graph.node):
        source, target = (node.input[0] if node.input else ""), node.output[0]
        if node.op_type in DATA_MOVEMENT and target in entries and source and source not in entries.keys() | constants:
            entries[source] = {**entries[target], "name": source}
            added.append(source)
    if added:
        encodings[key] = list(entries.values())
        write_text_atomic(file, json.dumps(encodings, indent=1))
    return added


def _graph_description(
    sim: QuantizationSimModel, folder: Path, seq_len: int, encoding_version: str, dynamic_length: bool, prefix: int
) -> dict:
    """What the manifest says of the graphs: the policy, the encodings, the input and output, the files' roles."""
    vocab = getattr(getattr(sim.model, "config", None), "vocab_size", None)
    length = "sequence" if dynamic_length else seq_len
    return {
        "policy": sim_policy(sim).to_dict(),
        "encodings_version": encoding_version,
        "export_int32_bias": int32_bias(encoding_version),  # AIMET's default for the FP export, kept
        "seq_len": seq_len,
        "dynamic_length": dynamic_length,
        # the graphs hold the prefix's keys and values as constants: input_ids are the tokens after it
        "prefix": {"ids": sim.model.prefix_ids[0].tolist(), "tokens": prefix} if prefix else None,
        "input": {"name": INPUT_NAME, "dtype": "int64", "shape": [1, length]},
        "output": {"name": OUTPUT_NAME, "dtype": "float32", "shape": [1, length, vocab]},
        "opset": {FP_ONNX: _opset(folder / FP_ONNX), QDQ_ONNX: _opset(folder / QDQ_ONNX)},
        "files_role": {"fp_onnx": FP_ONNX, "encodings": ENCODINGS, "qdq_onnx": QDQ_ONNX},
        # a device runtime need not fuse AIMET's QDQ layout: the device route is the FP graph plus the encodings
        "files_use": {
            FP_ONNX: "device: the FP graph for a converter (with model.encodings as quantization overrides)",
            data_file(FP_ONNX): f"the weights of {FP_ONNX} (ONNX external data: keep it beside the graph)",
            ENCODINGS: "device: the encodings of every quantized tensor",
            QDQ_ONNX: "onnxruntime only: the quantized model as float QDQ, for `eval` and the verification",
            data_file(QDQ_ONNX): f"the weights of {QDQ_ONNX}",
        },
    }


def _put_in_place(tmp: Path, out_dir: Path) -> None:
    """The complete export in ``tmp`` becomes ``out_dir``; an export already there is replaced only now."""
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        out_dir.rename(old / out_dir.name)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out_dir)


def _extra_forms(
    sim: QuantizationSimModel,
    tmp: Path,
    formats: Sequence[ExtraFormat],
    encoding_version: str,
    windows: Sequence[Window],
    report: Verification,
) -> dict:
    """Each of ``formats`` written into its subfolder of ``tmp`` and verified on ``windows``: its manifest entry."""
    extras = {}
    for extra in formats:
        entry = extra.write(sim, tmp / extra.key, encoding_version)
        entry.update(extra.verify(sim, tmp / extra.key, windows, report, tmp))
        entry["files"] = _file_table(tmp / extra.key)
        extras[extra.key] = entry
        release_freed_memory()
    return extras


def export_quantized(
    sim: QuantizationSimModel,
    out_dir: str | Path,
    seq_len: int = SEQ_LEN,
    encoding_version: str | None = None,
    *,
    verify_windows: Sequence[Window | torch.Tensor],
    model_name: str | None = None,
    method: str | None = None,
    dynamic_length: bool = False,
    opset: int | None = None,
    tolerance: Tolerance = Tolerance(),
    overwrite: bool = False,
    merge_shared_ranges: bool = False,
    extra_manifest: dict | None = None,
    progress: bool = False,
    formats: Sequence[ExtraFormat] = (),
) -> ExportResult:
    """Export ``sim`` (a calibrated or trained sim of a PreparedLM) to ``out_dir``, verified; see the module doc.

    ``seq_len`` fixes the graph's input length unless ``dynamic_length``; ``opset`` is the FP graph's (the QDQ
    graph's is 21). ``verify_windows``: held-out token windows of at most ``seq_len`` tokens on which the export
    must match the sim. ``model_name``: what ``eval`` loads the tokenizer from. ``merge_shared_ranges``: see
    :func:`reconcile_shared_ranges` (changes ``sim``). ``formats``: e.g. ``KVGraphs()``, ``HFCheckpoint()``.
    """
    start = time.time()
    check_free_disk(out_dir, sim.model)
    blockwise = next((f"{path}.{role}" for path, role, q in quantizers(sim.model) if q.block_size is not None), None)
    encoding_version = encoding_version_for(blockwise, encoding_version)
    windows, prefix = _checked_windows(sim, seq_len, encoding_version, verify_windows, dynamic_length, formats)
    out_dir = Path(out_dir).expanduser().absolute()
    check_new_folder(out_dir, overwrite)
    n_quantizers = _check_calibrated(sim)
    # a state's shared ranges were merged as it was loaded (QuadapterState.build_sim); another sim's are here
    merged = [*getattr(sim, "quadapter_merged_ranges", []), *reconcile_shared_ranges(sim, merge=merge_shared_ranges)]
    with _partial_on_cpu(sim, out_dir) as tmp:
        _export_graphs(sim, tmp, seq_len, encoding_version, dynamic_length, opset)
        propagated = propagate_through_data_movement(tmp)
        report = verify_export(sim, tmp, windows, tolerance, progress=progress)
        extras = _extra_forms(sim, tmp, formats, encoding_version, windows, report)
        manifest = {
            "format": "aimet-quadapter export 1",
            "model": model_name,
            "method": method,
            **_graph_description(sim, tmp, seq_len, encoding_version, dynamic_length, prefix),
            "files": _file_table(tmp),
            "quantizers": n_quantizers,
            "shared_ranges_merged": merged,
            "encodings_propagated": propagated,
            "verification": report.to_dict(),
            **extras,
            "tools": library_versions(),
            "export_time_s": round(time.time() - start, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **(extra_manifest or {}),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _put_in_place(tmp, out_dir)
    return ExportResult(out_dir, manifest, report, {n: out_dir / n for n in (FP_ONNX, ENCODINGS, QDQ_ONNX, MANIFEST)})


@contextmanager
def _partial_on_cpu(sim: QuantizationSimModel, out_dir: Path) -> Iterator[Path]:
    """A new folder beside ``out_dir``, removed where the export fails; ``sim`` meanwhile on the CPU, where
    onnxruntime runs (and TorchScript's constant folding fails on CPU constants beside CUDA weights): on CUDA the
    verification would also measure CUDA-vs-CPU rounding on top of the export's own."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private (0700); the export folder is an ordinary one
    device = device_of(sim.model)
    sim.model.to("cpu")
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        sim.model.to(device)


__all__ = [
    "Agreement",
    "ExportResult",
    "Tolerance",
    "Verification",
    "check_encoding_names",
    "check_quantizer_coverage",
    "export_quantized",
    "reconcile_shared_ranges",
    "verify_export",
]
