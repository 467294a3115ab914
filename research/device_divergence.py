"""Where the device graph parts from the sim: the residual stream's codes, sum by sum, on one window.

For every residual sum (the tensors only target ``htp`` quantizes), the share of its integer codes that differ
from the sim's: in the sim with every quantizer input moved by one float32 ulp (``one_ulp_inputs``), in the sim
with every matrix product summed in another order (``shuffled_sums``), and in the export's graph
in AIMET's ONNX simulation (``--device-check``'s graph, its encodings loaded). A defect of placement or encodings
shows in the first layers; float32 rounding starts at a handful of codes and grows with depth.

With ``--tensors``, instead, every tensor the export's encodings name, in the graph's order: the share of its values
(each a code apart, or off the grid) that differ between this package's own onnxruntime graph (``model.onnx`` with a
QuantizeLinear/DequantizeLinear pair at each named tensor, the export's verification) and AIMET's ONNX simulation of
the same graph and encodings. Both run onnxruntime's float kernels; only the quantizers differ.

With ``--windows N``, instead, each of the first N windows' loss (mean NLL per scored token) in the sim, the sim with
one summation-order draw, the sim rounding as aimet-onnx does (``aimet_onnx_rounding``) and the device graph; then,
for each of the last three against the sim and for the device graph against the sim rounding as aimet-onnx does, the
mean difference over the windows, its spread and its t: whether the device graph's perplexity is off by more than
its windows' differences make likely, and how those compare with a draw's. ``--skip K`` starts after the first K
windows (text no earlier comparison read); ``--draws D`` adds D summation-order draws of the sim rounding as
aimet-onnx does, each over all the windows as ``aimet-quadapter noise --orders --rounding aimet-onnx`` draws them, and
says where the device graph lies against their range and against the sim's float-noise band (``noise_band``):
the band and the device graph from one pass over the text.

    python research/device_divergence.py S E --model smollm2-135m
        (S: a state; E: its `aimet-quadapter export S --model smollm2-135m --out E --device-check --verify-split valid`)
    python research/device_divergence.py S E --model smollm2-135m --tensors
    python research/device_divergence.py S E --model smollm2-135m --windows 16
    python research/device_divergence.py S E --model smollm2-135m --windows 16 --skip 16 --draws 10
    python research/device_divergence.py S E --model smollm2-135m --windows 2 --dataset data/austen --start 524288
        (E exported with --seq-len 1024: the run tables' own development windows)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from aimet_onnx.utils import OrtInferenceSession
from onnx import TensorProto, helper

from aimet_quadapter.export.device_check import device_sim
from aimet_quadapter.export.formats import ENCODINGS, FP_ONNX, INPUT_NAME
from aimet_quadapter.export.noise import activation_codes, noise_band, shuffled_sums
from aimet_quadapter.export.onnx_eval import apply_encodings, ort_session, read_encodings
from aimet_quadapter.models import load_model
from aimet_quadapter.quadapter.state import QuadapterState, resolve_state
from aimet_quadapter.quant.quantizers import aimet_onnx_rounding
from aimet_quadapter.running.device_texts import scoring_lm
from aimet_quadapter.text.data import Window, eval_windows, load_text, tokenize
from aimet_quadapter.text.perplexity import window_nll


def _onnx_scope(path: str) -> str:
    """``lm.model.layers.3.residual_adds.1`` -> ``/lm/model/layers.3/residual_adds.1/`` (torch.onnx's scopes)."""
    return "/" + re.sub(r"\.(?!\d)", "/", path) + "/"


def tensor_divergence(export: Path, ids: np.ndarray, shown: int = 30) -> None:
    """Print the first ``shown`` tensors whose values differ between the export's own QDQ evaluation and the device
    graph (see the module's doc), and how many differ in all."""
    import onnx

    encodings = read_encodings(json.loads((export / ENCODINGS).read_text()))
    scales = {e.name: float(np.max(e.scale)) for e in encodings}  # per channel: the largest step, a lower bound
    fp = onnx.load(str(export / FP_ONNX))
    ours, _ = apply_encodings(fp, encodings)
    with device_sim(export) as (onnx_sim, _):
        onnx_sim.compute_encodings([{INPUT_NAME: ids}])  # every tensor carries an encoding of its own: none is changed
        graph = onnx_sim.model.model.graph
        produced = {o for node in graph.node for o in node.output}
        names = [o for node in fp.graph.node for o in node.output if o in scales and o + "_updated" in produced]
        for name in names:
            ours.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
            graph.output.append(helper.make_tensor_value_info(name + "_updated", TensorProto.FLOAT, None))
        session = ort_session(ours.SerializeToString(), optimize=False)
        mine = dict(zip([o.name for o in session.get_outputs()], session.run(None, {INPUT_NAME: ids})))
        device_session = OrtInferenceSession(onnx_sim.model.model, ["CPUExecutionProvider"])
        theirs = dict(zip([o.name for o in device_session.get_outputs()], device_session.run(None, {INPUT_NAME: ids})))
        print(f"{len(names)} quantized tensors in both graphs, in the graph's order; share of values unlike")
        differing = 0
        for name in names:
            steps = np.abs(mine[name] - theirs[name + "_updated"]) / scales[name]
            share = float((steps > 1e-3).mean())  # a code apart, or off the grid (a quantizer left out)
            if share > 0:
                differing += 1
                if differing <= shown:
                    print(f"{name} | {share:.2e} | largest {steps.max():.1f} codes")
        print(f"{differing} of {len(names)} tensors differ")


def window_divergence(sim_model: torch.nn.Module, export: Path, windows: list[Window], draws: int = 0) -> None:
    """Print each window's loss in the sim's variants and the device graph (see the module's doc); with ``draws``,
    that many summation-order draws of the sim rounding as aimet-onnx does, each over all the windows as
    ``aimet-quadapter noise --orders --rounding aimet-onnx`` draws them, and where the device graph lies against
    them."""
    columns = ["sim", "sim, a summation-order draw", "sim, aimet-onnx's rounding", "device graph"]
    columns += [f"aimet-onnx's rounding, draw {k}" for k in range(1, draws + 1)]

    def nll(model, w: Window) -> float:
        with torch.no_grad():
            return window_nll(model(w.ids[None]), w).item() / w.n_targets

    def column(draw: int | None = None, rounding: bool = False) -> list[float]:
        with (
            aimet_onnx_rounding(sim_model) if rounding else nullcontext(),
            shuffled_sums(sim_model, draw) if draw else nullcontext(),
        ):
            return [nll(sim_model, w) for w in windows]  # one draw over all the windows, as `noise`'s

    with scoring_lm(export, windows[0]) as device:
        on_device = [nll(device, w) for w in windows]
    by_column = [column(), column(1), column(rounding=True), on_device]
    by_column += [column(k, rounding=True) for k in range(1, draws + 1)]
    losses = [list(row) for row in zip(*by_column)]
    print(" | ".join(["window", *columns]))
    for i, row in enumerate(losses):
        print(" | ".join([str(i), *(f"{x:.4f}" for x in row)]))
    tokens = sum(w.n_targets for w in windows)
    ppl = [math.exp(sum(r[j] * w.n_targets for r, w in zip(losses, windows)) / tokens) for j in range(len(columns))]
    for name, value in zip(columns, ppl):
        print(f"{name}: perplexity {value:.3f}")
    sim, draw, rounded, dev = range(4)  # the columns before the draws
    pairs = [(draw, sim), (rounded, sim), (dev, sim), (dev, rounded)] if len(windows) > 1 else []  # no spread of one
    for a, b in pairs:
        d = [r[a] - r[b] for r in losses]
        mean, sd = statistics.mean(d), statistics.stdev(d)
        t = mean / (sd / math.sqrt(len(d))) if sd else float("inf")
        print(f"{columns[a]} - {columns[b]}: mean {mean:+.4f}, sd {sd:.4f} over windows, t {t:+.2f}")
    if draws:
        drawn, device_ppl = ppl[dev + 1 :], ppl[dev]
        low, high = min(drawn), max(drawn)
        print(
            f"draws under aimet-onnx's rounding: {low:.3f}-{high:.3f}; the device graph {device_ppl:.3f}, "
            f"{_where(device_ppl, low, high)}"
        )
        low, high = noise_band(ppl[sim], [ppl[rounded], *drawn])
        print(
            f"the sim's float-noise band (the sim +- the farthest of aimet-onnx's rounding and the draws): "
            f"{low:.3f}-{high:.3f}; the device graph {device_ppl:.3f}, {_where(device_ppl, low, high)}"
        )


def _where(value: float, low: float, high: float) -> str:
    if low <= value <= high:
        return "inside"
    return f"{100 * (value / (low if value < low else high) - 1):+.1f} %"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("state", help="a Quadapter state file, or a cell folder holding one")
    p.add_argument("export", type=Path, help="its export folder (model.onnx and its encodings)")
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", default="ptb")
    p.add_argument("--split", default="valid")
    p.add_argument(
        "--start",
        type=int,
        default=0,
        help="tokens of the split skipped first, as a recipe's text `start` skips them (Austen-dev: 524288)",
    )
    p.add_argument("--tensors", action="store_true", help="every encoded tensor: the export's own graph against it")
    p.add_argument("--windows", type=int, default=0, help="N windows' losses, the sim's and the device's")
    p.add_argument("--skip", type=int, default=0, help="with --windows: start after this many windows (fresh text)")
    p.add_argument("--draws", type=int, default=0, help="with --windows: summation-order draws, aimet-onnx's rounding")
    args = p.parse_args()
    seq_len = int(json.loads((args.export / "manifest.json").read_text())["seq_len"])
    model, tokenizer = load_model(args.model, quiet=True)
    tokens = tokenize(tokenizer, load_text(args.dataset, args.split))[args.start :]  # read once, for every mode
    ids = eval_windows(tokens, seq_len, max_tokens=seq_len)[0].ids[None]
    if args.tensors:
        tensor_divergence(args.export, ids.numpy().astype(np.int64))
        return
    sim = QuadapterState.load(resolve_state(args.state)).build_sim(model, in_place=True)
    if args.windows:
        windows = eval_windows(tokens, seq_len, max_tokens=seq_len * (args.skip + args.windows))[args.skip :]
        window_divergence(sim.model, args.export, windows, args.draws)
        return

    sums = {path: m for path, m in sim.model.named_modules() if re.search(r"residual_adds\.\d$", path)}
    scales = {path: m.output_quantizers[0].get_scale().detach() for path, m in sums.items()}

    def sums_codes(seed: int | None, noise=None) -> dict[str, torch.Tensor]:
        codes = activation_codes(sim.model, ids, seed, noise)
        return {path: codes[f"{path}.output[0]"] for path in sums}

    saved, moved, shuffled = sums_codes(None), sums_codes(1), sums_codes(1, shuffled_sums)

    with device_sim(args.export) as (onnx_sim, coverage):
        names = {}
        for path in sums:
            scope = _onnx_scope(path)
            found = [n for n in coverage.covered if n.startswith(scope)]
            if len(found) != 1:
                raise SystemExit(f"{path}: {len(found)} tensors of the graph under {scope}, expected one")
            names[path] = found[0]
        graph = onnx_sim.model.model.graph
        for name in names.values():  # the simulation's quantize-dequantize output of each sum
            graph.output.append(helper.make_tensor_value_info(name + "_updated", TensorProto.FLOAT, None))
        # a session of its own over the sim's graph: the quantizer nodes point at the sim's loaded encodings
        session = OrtInferenceSession(onnx_sim.model.model, ["CPUExecutionProvider"])
        outs = session.run([n + "_updated" for n in names.values()], {INPUT_NAME: ids.numpy().astype(np.int64)})
        device = {
            path: torch.round(torch.from_numpy(o).reshape(saved[path].shape) / scales[path])
            for path, o in zip(names, outs)
        }

    print(f"{args.dataset} {args.split}, first window ({seq_len} tokens); share of codes unlike the sim's")
    print("residual sum | scale | one-ulp draw | summation-order draw | device graph | device, largest code difference")
    for path in sums:
        s = saved[path]
        ulp, order, dev = ((codes[path] != s).float().mean().item() for codes in (moved, shuffled, device))
        largest = int((device[path] - s).abs().max())
        print(f"{path} | {scales[path].item():.4g} | {ulp:.2e} | {order:.2e} | {dev:.2e} | {largest}")


if __name__ == "__main__":
    main()
