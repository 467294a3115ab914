"""The device's graph (``policy.target: htp``) against the paper's placement, side by side in one run, on SmolLM2.

Each target runs in its own process (so that its peak RSS is its own), one after the other, on the same tokens:
the FP model's forward and forward+backward (the reference), evaluation, PTQ's calibration, phase 1 on one
decoder block's sites, phase 2 (distillation into alpha and every range), and SpinQuant then PTQ. A second,
profiled process per target says where each step's time goes, by kind of quantizer and op (the labels below);
times and peak RSS come from the unprofiled ones: ``--repeats`` per target, the targets alternating. Prints a
table of the median times' ratios with each repetition's ratio, and writes JSON.

    python benchmarks/htp.py --json benchmarks/results/cpu-htp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aimet_quadapter  # noqa: F401  (first: its allocator setting is read when torch allocates, as in the CLI)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf import machine  # noqa: E402  (the benchmarks folder is not a package)

TARGETS = ("paper", "htp")
STEPS = ("fp_forward", "fp_train", "eval", "calibration", "phase1", "phase2", "spinquant_ptq")
GOAL_TIME, GOAL_MEMORY = 1.3, 1.1  # htp / paper, per step and for the peak


# --- inside a target's process ------------------------------------------------------------------------------
def _labels() -> None:
    """Name what the profiler should see as one kind of work: each wrapped callable becomes a labelled region."""
    import aimet_torch.nn.base as aimet_base
    import torch
    from aimet_torch.quantization.affine import quantizer as aimet_quantizer

    from aimet_quadapter.quant import quantizers

    def label(owner, name: str, text: str) -> None:
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(text):
                return inner(*args, **kwargs)

        setattr(owner, name, staticmethod(wrapped) if isinstance(owner, type) and name == "apply" else wrapped)

    # AIMET 2.42 looks for an integer grid in every symmetric weight before its min-max calibration
    label(aimet_base, "_decompose_prequantized_tensor", "AIMET: weight-grid search (calibration)")
    label(aimet_quantizer.QuantizeDequantize, "forward", "AIMET: QuantizeDequantize")
    label(quantizers.FakeQuantSTE, "apply", "package: fixed-range fake-quant")
    label(quantizers.FakeQuantLearnedRange, "apply", "package: trained-range fake-quant")
    label(quantizers, "fake_quantize", "package: phase-1 fake-quant")
    label(quantizers.DynamicRanges, "observed_range", "package: phase-1 range statistics")


MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}


def _breakdown(fn: Callable[[], object]) -> dict[str, float]:
    """Seconds of ``fn`` per labelled region (inclusive) and in matrix products (their own time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        if event.key.startswith(("AIMET:", "package:")):
            out[event.key] = event.cpu_time_total / 1e6
        elif event.key in MATMUL:
            out["matrix products"] = out.get("matrix products", 0.0) + event.self_cpu_time_total / 1e6
    return out


def _timed(fn: Callable[[], object], profile: bool) -> dict:
    start = time.perf_counter()
    fn()
    out: dict = {"s": time.perf_counter() - start}
    if profile:
        out["breakdown"] = _breakdown(fn)
    return out


def run_target(target: str, args) -> dict:
    import torch

    from aimet_quadapter.models import load_model, quiet_libraries
    from aimet_quadapter.models.prefix import model_prefix
    from aimet_quadapter.quant.config import QuantPolicy
    from aimet_quadapter.quant.llm_techniques import spinquant_model
    from aimet_quadapter.quant.policy import build_sim, calibrate
    from aimet_quadapter.quant.quantizers import _compiled
    from aimet_quadapter.text.data import Window

    quiet_libraries()
    if args.threads:
        torch.set_num_threads(args.threads)
    _labels()
    if args.eager:  # as on a machine where torch.compile cannot build kernels
        from aimet_quadapter.quant import quantizers

        quantizers._compiled = lambda: None
    else:
        _compiled()  # the kernels' compilation is a process's one-off cost, not a step's
    model, tokenizer = load_model(args.model, quiet=True)
    model.set_prefix(tokenizer(model_prefix(tokenizer), add_special_tokens=False)["input_ids"])
    policy = QuantPolicy(target=target)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    calib = [torch.randint(0, vocab, (1, args.calib_len), generator=g) for _ in range(args.calib_samples)]
    windows = {"text": [Window(torch.randint(0, vocab, (args.eval_len,), generator=g)) for _ in range(2)]}
    train = [torch.cat(calib[:2])]
    out: dict = {"target": target}

    def fp_forward():
        with torch.no_grad():
            for w in windows["text"]:
                model(w.ids[None])

    def fp_train():
        params = [p for p in model.parameters()]
        for p in params:
            p.requires_grad_(True)
        model(train[0]).float().logsumexp(-1).mean().backward()
        for p in params:
            p.requires_grad_(False)
            p.grad = None

    out["fp_forward"] = _timed(fp_forward, args.profile)
    out["fp_train"] = _timed(fp_train, args.profile)

    out.update(_sim_steps(model, policy, calib, windows, train, args))

    def spinquant_ptq():
        rotated = spinquant_model(model)
        calibrate(build_sim(rotated, policy, in_place=True), calib)

    out["spinquant_ptq"] = _timed(spinquant_ptq, args.profile)
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def _sim_steps(model, policy, calib, windows, train, args) -> dict:
    """Calibration, evaluation, phase 1 on the first block's sites and phase 2, on one sim."""
    import torch

    from aimet_quadapter.quadapter import phase1 as p1
    from aimet_quadapter.quadapter.api import attach_quadapters
    from aimet_quadapter.quadapter.config import Phase1Parameters, Phase2Parameters
    from aimet_quadapter.quadapter.phase2 import phase2_loss, run_phase2
    from aimet_quadapter.quant.policy import build_sim, calibrate
    from aimet_quadapter.text.perplexity import evaluate

    out: dict = {}
    sim = build_sim(model, policy, share_weights=True)
    out["calibration"] = _timed(lambda: calibrate(sim, calib), args.profile)
    out["eval"] = _timed(lambda: evaluate(sim, windows, progress=False), args.profile)

    qset = attach_quadapters(sim, ["linear", "qk"])
    params = Phase1Parameters(steps=args.phase1_steps, lr_stages=1, loss_tokens=512, keep_start=("head",))
    kept = p1._kept_sites(sim.model, qset, params)
    blocks = sim.model.block_paths()
    fp_call, q_call = p1._first_block_inputs(model, sim.model, blocks[0], calib, True)
    by_block, _ = p1._sites_by_block(qset, kept, blocks)

    def calibrate_sites(site, fp_in, q_in):
        if site.scope:
            q_in = p1._with_hidden(q_in, p1._first_input(q_in) * p1._input_scale(qset, site.scope))
        block = p1.SiteBlock(site, model, sim.model, fp_in, q_in, params)
        p1.calibrate_site(block, qset, params, progress=False)

    state = {n: q.theta.detach().clone() for n, q in ((q.site.name, q) for q in qset)}

    def phase1_block():
        with torch.no_grad():
            for q in qset:
                q.theta.copy_(state[q.site.name])
        p1._calibrate_block(blocks[0], by_block[blocks[0]], model, sim.model, fp_call, q_call, True, calibrate_sites)

    # Each training step runs once untimed first: torch.compile builds a kernel at its first call for each kind of
    # input (rank, per tensor or per channel), once per process, and a cell's dozens of calls pay it once too.
    phase1_block()
    out["phase1"] = _timed(phase1_block, args.profile)
    out["phase1"]["sites"] = len(by_block[blocks[0]])

    def phase2(steps: int) -> None:
        p2 = Phase2Parameters(steps=steps, batch_size=1, seq_len=train[0].shape[1], loss="kd")
        run_phase2(sim.model, qset, train, p2, loss_fn=phase2_loss(p2, model), progress=False)

    phase2(1)
    out["phase2"] = _timed(lambda: phase2(args.phase2_steps), args.profile)
    qset.detach()
    return out


# --- the parent ---------------------------------------------------------------------------------------------
def _median_run(target: str, runs: list[dict]) -> dict:
    """Each step's median time over ``runs`` (with every run's time), and the largest peak RSS."""
    out: dict = {"target": target}
    for step in STEPS:
        times = [r[step]["s"] for r in runs]
        out[step] = {"s": statistics.median(times), "runs_s": times}
    out["peak_rss_gib"] = max(r["peak_rss_gib"] for r in runs)
    return out


def table(results: dict) -> str:
    paper, htp = results["paper"], results["htp"]
    lines = [
        "| step | paper (s, median) | htp (s, median) | htp / paper (each repetition's, min-max) | goal "
        "| where htp's extra time goes (s, profiled pass) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for step in STEPS:
        a, b = paper[step]["s"], htp[step]["s"]
        extra = ""
        if "breakdown" in htp[step]:
            pb, hb = paper[step].get("breakdown", {}), htp[step]["breakdown"]
            deltas = sorted(((hb[k] - pb.get(k, 0.0), k) for k in hb), reverse=True)
            extra = "; ".join(f"{k} +{d:.1f}" for d, k in deltas[:3] if d > 0.05)
        goal = "" if step.startswith("fp_") else f"{GOAL_TIME}"
        # each repetition's ratio (the runs alternate, so the i-th of each target ran side by side)
        spread = [h / p for p, h in zip(paper[step].get("runs_s", []), htp[step].get("runs_s", []))]
        ratio = f"{b / a:.2f}" + (f" ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1 else "")
        lines.append(f"| {step} | {a:.2f} | {b:.2f} | {ratio} | {goal} | {extra} |")
    pm, hm = paper["peak_rss_gib"], htp["peak_rss_gib"]
    lines.append(f"| peak RSS (GiB) | {pm:.2f} | {hm:.2f} | {hm / pm:.2f} | {GOAL_MEMORY} | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib-samples", type=int, default=4)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--eval-len", type=int, default=1024)
    ap.add_argument("--phase1-steps", type=int, default=4)
    ap.add_argument("--phase2-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="no second, profiled pass")
    ap.add_argument("--eager", action="store_true", help="without the CPU's compiled fake-quant kernels")
    ap.add_argument("--repeats", type=int, default=3, help="timed processes per target, alternating (median kept)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--target", choices=TARGETS, help=argparse.SUPPRESS)  # one target's process
    args = ap.parse_args()
    if args.target:
        print(json.dumps(run_target(args.target, args)))
        return
    flags = [f"--model={args.model}", f"--calib-samples={args.calib_samples}", f"--calib-len={args.calib_len}"]
    flags += [f"--eval-len={args.eval_len}", f"--phase1-steps={args.phase1_steps}"]
    flags += [f"--phase2-steps={args.phase2_steps}"]
    flags += [f"--threads={args.threads}"] if args.threads else []
    flags += ["--eager"] if args.eager else []

    def child(target: str, profile: bool) -> dict:
        done = subprocess.run(
            [sys.executable, __file__, "--target", target, *flags, *([] if profile else ["--no-profile"])],
            check=True,
            stdout=subprocess.PIPE,  # its stderr passes through: torch's warnings (a compile fallback) stay visible
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    results: dict = {"machine": machine(), "command": " ".join(["python", *sys.argv])}
    # times and peak memory from processes without the profiler, whose records take gigabytes; the targets
    # alternate, so that a slower stretch of a shared machine falls on both
    runs: dict[str, list[dict]] = {t: [] for t in TARGETS}
    for _ in range(args.repeats):
        for target in TARGETS:
            runs[target].append(child(target, profile=False))
    for target in TARGETS:
        results[target] = _median_run(target, runs[target])
    if args.profile:
        for target in TARGETS:
            profiled = child(target, profile=True)
            for step in STEPS:
                results[target][step]["breakdown"] = profiled[step]["breakdown"]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    results["commit"] = git.stdout.strip()
    results["python"] = platform.python_version()
    results["table"] = table(results)
    print(results["table"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
