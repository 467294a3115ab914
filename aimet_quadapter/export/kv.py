"""Prefill and decode graphs with a KV cache over a fixed context of C tokens: the language model as a device runs it.

An AR-N graph (the prefill: the prompt in chunks; AR-1: the decode) takes N tokens, the cached keys and values
``past_key_<layer>`` / ``past_value_<layer>`` (1, kv_heads, C - N, head_dim), most recent last, unused slots masked,
the additive ``attention_mask`` (1, 1, N, C) and ``position_ids`` (1, N); it returns ``logits`` and its tokens'
``new_key_<layer>`` / ``new_value_<layer>`` for the host to append. All graphs come from one sim and share one
``model.encodings``. A prefix ships as ``prefix.safetensors`` (the same names, (1, kv_heads, P, head_dim)): the
first P slots of the host's cache. :class:`KVGraphRunner` is such a host in onnxruntime.
One sim, one set of quantizers: every tensor two graphs share has one encoding (checked), as one file needs.
"""

from __future__ import annotations

import contextlib
import json
import math
import types
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from aimet_torch.quantsim import QuantizationSimModel

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.formats import ENCODING_VERSION, ENCODINGS, KV_FOLDER, PREFIX_KV, QDQ_ONNX, data_file
from aimet_quadapter.export.lean import export_sim_graphs
from aimet_quadapter.memory import release_freed_memory
from aimet_quadapter.models import PreparedLM, device_of
from aimet_quadapter.quant.quantizers import fast_inference
from aimet_quadapter.text import EVAL_SEQ_LEN
from aimet_quadapter.text.data import Window
from aimet_quadapter.text.perplexity import window_nll

if TYPE_CHECKING:
    from aimet_quadapter.export.verification import Verification

ID_DTYPES = ("int64", "int32")
MASKED = float(np.finfo(np.float32).min)  # what the sim's attention takes as a masked score


@dataclass(frozen=True)
class KVGraphs:
    """The graphs to export: a context of ``context`` tokens, one graph per AR length in ``lengths`` (1: decode).
    An :class:`~aimet_quadapter.export.formats.ExtraFormat` of the export."""

    key: ClassVar[str] = KV_FOLDER
    context: int = EVAL_SEQ_LEN
    lengths: tuple[int, ...] = (128, 1)
    ids_dtype: str = "int64"  # of input_ids and position_ids: int32 where a target wants it

    def __post_init__(self) -> None:
        if 1 not in self.lengths:
            raise QuadapterError(f"KV graphs {list(self.lengths)}: a decode graph (length 1) is needed")
        if self.ids_dtype not in ID_DTYPES:
            raise QuadapterError(f"KV graph ids dtype must be one of {', '.join(ID_DTYPES)}, got {self.ids_dtype!r}")
        bad = [n for n in self.lengths if not 1 <= n < self.context]
        if bad:
            raise QuadapterError(
                f"KV graph length {bad[0]} must be between 1 and the context {self.context} (excluded)"
            )

    def check(self, windows: Sequence[Window], prefix_tokens: int) -> None:
        check_windows_fit(self, windows, prefix_tokens)

    def write(self, sim: QuantizationSimModel, folder: Path, encoding_version: str) -> dict:
        return export_kv_graphs(sim, folder, self, encoding_version)

    def verify(
        self, sim: QuantizationSimModel, folder: Path, windows: Sequence[Window], report: Verification, export: Path
    ) -> dict:
        bounds = (report.ppl_bound, report.logit_bound)
        return {"verification": asdict(verify_kv_graphs(sim, folder, self, windows, export / QDQ_ONNX, *bounds))}


def check_windows_fit(graphs: KVGraphs, windows: Sequence[Window], prefix_tokens: int = 0) -> None:
    """Each verification window, after the prefix, must fit the context with a token to spare."""
    longest = max(len(w.ids) for w in windows)
    if prefix_tokens + longest > graphs.context - 1:
        after = f" after the {prefix_tokens} prefix tokens" if prefix_tokens else ""
        raise QuadapterError(
            f"verification windows of {longest} tokens{after} do not fit a KV context of {graphs.context}"
        )


def save_prefix_kv(model: PreparedLM, folder: Path) -> dict | None:
    """The model's prefix keys and values as ``folder/prefix.safetensors``; its manifest entry (None without one)."""
    from safetensors.torch import save_file

    if model.prefix_ids is None or model.prefix_kv is None:
        return None
    tensors = {}
    for layer, (k, v) in enumerate(model.prefix_kv):
        tensors[f"past_key_{layer}"] = k.detach().float().cpu().contiguous()
        tensors[f"past_value_{layer}"] = v.detach().float().cpu().contiguous()
    ids = model.prefix_ids[0].tolist()
    save_file(tensors, str(folder / PREFIX_KV), metadata={"ids": json.dumps(ids)})
    return {
        "file": PREFIX_KV,
        "ids": ids,
        "tokens": len(ids),
        "use": f"the first {len(ids)} tokens of the host's KV cache, at positions 0..{len(ids) - 1}, before any "
        "prompt; float32, quantized by the graphs as every cached token is",
    }


def load_prefix_kv(folder: Path) -> list[np.ndarray] | None:
    """What :func:`save_prefix_kv` wrote, in the order of the graphs' past inputs, or None."""
    from safetensors.numpy import load_file

    path = folder / PREFIX_KV
    if not path.is_file():
        return None
    tensors = load_file(str(path))
    return [tensors[f"past_{kind}_{layer}"] for layer in range(len(tensors) // 2) for kind in ("key", "value")]


def graph_file(n: int, qdq: bool = False) -> str:
    return f"ar{n}{'_qdq' if qdq else ''}.onnx"


def io_names(layers: int) -> tuple[list[str], list[str]]:
    cache = [f"{kind}_{layer}" for layer in range(layers) for kind in ("key", "value")]
    inputs = ["input_ids", "attention_mask", "position_ids", *[f"past_{c}" for c in cache]]
    return inputs, ["logits", *[f"new_{c}" for c in cache]]


def attention_mask(n: int, context: int, filled: int) -> np.ndarray:
    """(1, 1, n, context): query i sees the last ``filled`` of the ``context - n`` past slots and new tokens 0..i."""
    past = context - n
    mask = np.full((1, 1, n, context), MASKED, dtype=np.float32)
    for i in range(n):
        mask[0, 0, i, past - filled : past] = 0.0
        mask[0, 0, i, past : past + i + 1] = 0.0
    return mask


@contextlib.contextmanager
def _cached_forward(model: PreparedLM) -> Iterator[None]:
    """AIMET exports ``sim.model``'s forward: the KV-cache forward stands in for it while the graphs are traced."""
    model.forward = types.MethodType(PreparedLM.forward_cached, model)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.forward  # the class's own forward again


def export_kv_graphs(
    sim: QuantizationSimModel, folder: Path, graphs: KVGraphs, encoding_version: str = ENCODING_VERSION
) -> dict:
    """``arN.onnx`` (for a converter) and ``arN_qdq.onnx`` (for onnxruntime) per AR length N, and one
    ``model.encodings`` for all of them, into ``folder``; returns their manifest entry."""
    model = sim.model
    layers, kv_heads, head_dim = model.kv_shape()
    inputs, outputs = io_names(layers)
    folder.mkdir(parents=True, exist_ok=True)
    entries = {}
    for n in graphs.lengths:
        past = graphs.context - n
        ids = getattr(torch, graphs.ids_dtype)
        args = (
            torch.zeros((1, n), dtype=ids),
            torch.from_numpy(attention_mask(n, graphs.context, past)),
            torch.arange(past, graphs.context, dtype=ids)[None],
            *[torch.zeros((1, kv_heads, past, head_dim)) for _ in range(2 * layers)],
        )
        common: dict[str, Any] = {"input_names": inputs, "output_names": outputs, "dynamo": False}
        with torch.no_grad(), _cached_forward(model):
            export_sim_graphs(sim, args, folder, f"ar{n}", encoding_version, f"the AR-{n} graph", **common)
        entries[f"ar{n}"] = {
            "tokens": n,
            "past": past,
            "files": [graph_file(n), data_file(graph_file(n)), graph_file(n, qdq=True), data_file(graph_file(n, True))],
        }
    shared = _merge_encodings(folder, graphs)
    return {
        "prefix": save_prefix_kv(model, folder),
        "context": graphs.context,
        "ids_dtype": graphs.ids_dtype,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "inputs": inputs,
        "outputs": outputs,
        "graphs": entries,
        "encodings": ENCODINGS,
        "shared_encodings_checked": shared,
    }


def _merge_encodings(folder: Path, graphs: KVGraphs) -> int:
    """AIMET's encodings files merged into ``model.encodings``; returns how many shared tensors were checked."""
    from aimet_quadapter.export.onnx_eval import read_encodings

    files = [folder / f"ar{n}.encodings" for n in graphs.lengths]
    merged = json.loads(files[0].read_text())
    seen = {e.name: e for e in read_encodings(merged)}
    checked = 0
    for path in files[1:]:
        other = json.loads(path.read_text())
        entries = read_encodings(other)
        for entry in entries:
            mine = seen.get(entry.name)
            if mine is None:
                continue
            if not (
                mine.bitwidth == entry.bitwidth
                and np.array_equal(mine.scale, entry.scale)
                and np.array_equal(mine.zero_point, entry.zero_point)
            ):
                raise QuadapterError(f"KV graphs: tensor {entry.name} has two encodings: {mine} and {entry}")
            checked += 1
        for key, value in other.items():  # the entry lists of either format: activation/param_encodings, encodings
            if isinstance(value, list) and all(isinstance(e, dict) and "name" in e for e in value):
                merged.setdefault(key, []).extend(e for e in value if e["name"] not in seen)
        seen.update({e.name: e for e in entries})
    (folder / ENCODINGS).write_text(json.dumps(merged, indent=2))
    for path in files:
        path.unlink()
    return checked


class KVGraphRunner:
    """A host for the QDQ graphs of a folder, in onnxruntime: :meth:`prefill` feeds a prompt in chunks through the
    longest graph, :meth:`decode` one token through the AR-1 graph, each appending to the cache; :meth:`reset`
    empties the cache, or fills it with the folder's prefix."""

    def __init__(self, folder: Path, graphs: KVGraphs, kv_shape: tuple[int, int, int]):
        from aimet_quadapter.export.onnx_eval import ort_session

        self.graphs = graphs
        self.layers, self.kv_heads, self.head_dim = kv_shape
        self.sessions = {n: ort_session(str(folder / graph_file(n, qdq=True)), True, True) for n in graphs.lengths}
        self.prefill_n = max(graphs.lengths)
        self.prefix = load_prefix_kv(folder)
        self.reset()

    def reset(self) -> None:
        if self.prefix is not None:
            self.cache = list(self.prefix)  # never written in place: each step concatenates new arrays
            return
        self.cache = [np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32) for _ in range(2 * self.layers)]

    @property
    def filled(self) -> int:
        return self.cache[0].shape[2]

    def _run(self, n: int, ids: np.ndarray, keep: int) -> np.ndarray:
        filled, past = self.filled, self.graphs.context - n
        if filled > past:  # the graph has room for `past` cached tokens before its own
            raise QuadapterError(
                f"the KV cache holds {filled} tokens: the AR-{n} graph takes at most {past} before its own"
            )
        feed: dict[str, np.ndarray] = {
            "input_ids": ids.reshape(1, n).astype(self.graphs.ids_dtype),
            "attention_mask": attention_mask(n, self.graphs.context, filled),
            "position_ids": np.arange(filled, filled + n, dtype=self.graphs.ids_dtype)[None],
        }
        for i, cached in enumerate(self.cache):  # right-aligned: the most recent token in the last slot
            slots = np.zeros((1, self.kv_heads, past, self.head_dim), dtype=np.float32)
            slots[:, :, past - filled :] = cached
            feed[f"past_{'key' if i % 2 == 0 else 'value'}_{i // 2}"] = slots
        out = self.sessions[n].run(None, feed)
        self.cache = [np.concatenate([c, new[:, :, :keep]], axis=2) for c, new in zip(self.cache, out[1:])]
        return out[0][0, :keep]

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """(len(ids), vocab) logits of ``ids`` fed as a prompt after what the cache holds."""
        tokens, n, parts = np.asarray(ids, dtype=np.int64), self.prefill_n, []
        for start in range(0, len(tokens), n):
            real = min(n, len(tokens) - start)
            chunk = np.zeros(n, dtype=np.int64)
            chunk[:real] = tokens[start : start + real]
            parts.append(self._run(n, chunk, real))
        return np.concatenate(parts)

    def decode(self, token: int) -> np.ndarray:
        """(vocab,) logits of one token after what the cache holds."""
        return self._run(1, np.asarray([token], dtype=np.int64), 1)[0]

    def logits(self, ids: Sequence[int], prefill: int) -> np.ndarray:
        """(T, vocab) logits of ``ids`` from a fresh cache: the first ``prefill`` as a prompt, the rest decoded."""
        self.reset()
        parts = [self.prefill(ids[:prefill])]
        parts += [self.decode(int(t))[None] for t in ids[prefill:]]
        return np.concatenate(parts)

    def generate(self, prompt: Sequence[int], steps: int) -> list[int]:
        """``steps`` greedy tokens after ``prompt``, from a fresh cache."""
        self.reset()
        out = [int(self.prefill(prompt)[-1].argmax())]
        while len(out) < steps:
            out.append(int(self.decode(out[-1]).argmax()))
        return out[:steps]


@dataclass(frozen=True)
class KVAgreement:
    windows: int
    tokens: int
    sim_ppl: float
    graphs_ppl: float
    ppl_rel_diff: float  # the graphs (prefill, then decode) against the sim's full-sequence pass
    max_abs_logit_diff: float
    top1_agreement: float
    # against the full-sequence QDQ graph in onnxruntime: the same ops, so float rounding apart the same values
    vs_full_graph_max_abs_logit_diff: float
    greedy_tokens: int  # tokens generated greedily from each window's first half, by the sim and by the graphs
    greedy_agreement: float  # share of those the graphs generate as the sim does
    greedy_common_prefix: float  # tokens the two agree on before their first difference, mean over the prompts
    # the same for the sim against itself with one-ulp quantizer inputs: how far greedy generation can agree at all
    greedy_floor_agreement: float
    greedy_floor_common_prefix: float


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def sim_greedy(model: PreparedLM, prompt: torch.Tensor, steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt`` from ``model`` (a sim's or the FP model) with its own KV cache."""
    logits, cache = model.step(prompt[None])
    out = []
    for _ in range(steps):
        token = int(logits[0, -1].argmax())
        out.append(token)
        logits, cache = model.step(torch.tensor([[token]]), cache)
    return out


@dataclass
class _GreedyTally:
    """Greedy decodes of the graphs (``got``) and of the sim with one-ulp inputs (``noisy``) against the sim's."""

    same: int = 0
    floor_same: int = 0
    total: int = 0
    prefixes: list[int] = field(default_factory=list)
    floor_prefixes: list[int] = field(default_factory=list)

    def add(self, want: list[int], got: list[int], noisy: list[int], steps: int) -> None:
        self.same += sum(a == b for a, b in zip(want, got))
        self.floor_same += sum(a == b for a, b in zip(want, noisy))
        self.total += steps
        self.prefixes.append(_common_prefix(want, got))
        self.floor_prefixes.append(_common_prefix(want, noisy))


def verify_kv_graphs(
    sim: QuantizationSimModel,
    folder: Path,
    graphs: KVGraphs,
    windows: Sequence[Window],
    full_graph: Path,
    ppl_bound: float,
    logit_bound: float,
    greedy_steps: int = 32,
    greedy_prompts: int = 3,
) -> KVAgreement:
    """Each window through the graphs (its first half prefilled, the rest decoded) against the sim and against
    ``full_graph`` (the full-sequence QDQ graph); greedy generation from the first ``greedy_prompts`` windows.
    Raises where they differ from the sim by more than the bounds (the full-sequence export's, set by the float32 floor
    it measured), or from the full-sequence graph by more than float rounding."""
    model, prefix = sim.model, sim.model.prefix_length
    check_windows_fit(graphs, windows, prefix)
    # its session closed before the KV graphs' open: one copy of the weights fewer in memory
    full_logits = _full_graph_logits(full_graph, windows)
    runner = KVGraphRunner(folder, graphs, model.kv_shape())
    sim_nll, graphs_nll = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    tokens, max_diff, full_diff, same, greedy = 0, 0.0, 0.0, 0, _GreedyTally()
    with torch.no_grad(), fast_inference(model):
        for index, window in enumerate(windows):
            ids = window.ids
            prefill = max(1, len(ids) // 2)
            reference = model(ids[None].to(device_of(model))).float().cpu()
            ours = torch.from_numpy(runner.logits(ids.tolist(), prefill))[None]
            sim_nll += window_nll(reference, window)
            graphs_nll += window_nll(ours, window)
            scored = slice(window.first_target - 1, len(ids) - 1)
            max_diff = max(max_diff, float((reference[0, scored] - ours[0, scored]).abs().max()))
            full_diff = max(full_diff, float((full_logits[index][0, scored] - ours[0, scored]).abs().max()))
            same += int((reference[0, scored].argmax(-1) == ours[0, scored].argmax(-1)).sum())
            tokens += window.n_targets
            if index >= greedy_prompts:
                continue
            steps = min(greedy_steps, graphs.context - 1 - prefix - prefill)
            greedy.add(*_greedy_runs(model, runner, ids[:prefill], steps, index), steps)
    sim_ppl, graphs_ppl = math.exp(sim_nll.item() / tokens), math.exp(graphs_nll.item() / tokens)
    agreement = KVAgreement(
        windows=len(windows),
        tokens=tokens,
        sim_ppl=sim_ppl,
        graphs_ppl=graphs_ppl,
        ppl_rel_diff=abs(graphs_ppl - sim_ppl) / sim_ppl,
        max_abs_logit_diff=max_diff,
        top1_agreement=same / max(tokens, 1),
        vs_full_graph_max_abs_logit_diff=full_diff,
        greedy_tokens=greedy.total,
        greedy_agreement=greedy.same / max(greedy.total, 1),
        greedy_common_prefix=sum(greedy.prefixes) / max(len(greedy.prefixes), 1),
        greedy_floor_agreement=greedy.floor_same / max(greedy.total, 1),
        greedy_floor_common_prefix=sum(greedy.floor_prefixes) / max(len(greedy.floor_prefixes), 1),
    )
    _check_agreement(agreement, ppl_bound, logit_bound)
    return agreement


def _full_graph_logits(full_graph: Path, windows: Sequence[Window]) -> list[torch.Tensor]:
    from aimet_quadapter.export.onnx_eval import OnnxLM

    full = OnnxLM(full_graph, low_memory=True)
    full_logits = [full(window.ids[None]) for window in windows]
    del full
    release_freed_memory()
    return full_logits


def _greedy_runs(
    model: PreparedLM, runner: KVGraphRunner, prompt: torch.Tensor, steps: int, index: int
) -> tuple[list[int], list[int], list[int]]:
    """``steps`` greedy tokens after ``prompt`` from the sim, the graphs, and the sim with one-ulp inputs."""
    from aimet_quadapter.export.exporter import one_ulp_inputs

    want = sim_greedy(model, prompt, steps)
    got = runner.generate(prompt.tolist(), steps)
    with one_ulp_inputs(model, index):
        noisy = sim_greedy(model, prompt, steps)
    return want, got, noisy


def _check_agreement(a: KVAgreement, ppl_bound: float, logit_bound: float) -> None:
    max_diff, full_diff = a.max_abs_logit_diff, a.vs_full_graph_max_abs_logit_diff
    if a.ppl_rel_diff > ppl_bound or max_diff > logit_bound or full_diff > logit_bound:
        raise QuadapterError(
            f"the KV-cache graphs (prefill, then decode) do not compute what the sim computes: perplexity "
            f"{a.graphs_ppl:.4f} vs sim {a.sim_ppl:.4f} (rel. diff {a.ppl_rel_diff:.2e}, allowed {ppl_bound:.2e}), "
            f"max |logit diff| {max_diff:.3g} against the sim and {full_diff:.3g} against the full-sequence graph "
            f"(allowed {logit_bound:.3g})"
        )
