"""What the simulation and Quadapter's two phases cost, measured against the FP model they simulate.

Every measurement is taken side by side in one invocation and reported as a ratio:

* evaluation throughput (tokens/s) of the W8A8 sim, as ``evaluate`` runs it, vs the FP model;
* one phase-1 step of a site vs the FP forward+backward of the same layers on the same tokens;
* one phase-2 step (alpha + learned ranges, weights frozen) vs one FP fine-tuning step of the same batch;
* peak memory (RSS on CPU, CUDA peak on a GPU) of the whole Quadapter pipeline vs the FP training step.

Each case runs in its own process, so that peak memory belongs to it alone. Prints a table and writes JSON.

    python benchmarks/perf.py                                   # GPT-2-small-shaped model from config
    python benchmarks/perf.py --models gpt2-small,smollm2-135m --json benchmarks/results/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import aimet_quadapter  # noqa: F401  (first: its allocator setting is read when torch allocates, as in the CLI)

CASES = ("eval", "phase1", "phase2", "memory_fp_train", "memory_pipeline", "memory_export")
# Not in the default set: phase 1 on every site at a given budget (the paper's: 500 steps, 10 x 512 tokens)
EXTRA_CASES = ("phase1_all",)
TARGETS = {"eval": 0.8, "phase1": 1.5, "phase2": 2.0}  # sim/FP throughput >=, step time ratio <=
MEMORY_TARGET_GB = 4.0


# --- helpers that run inside a case process -----------------------------------------------------------
def _load(name: str):
    """A PreparedLM: ``gpt2-small`` is GPT-2 small's shape built from config (random weights)."""
    import torch

    from aimet_quadapter.models import load_model, prepare_model, quiet_libraries

    quiet_libraries()
    torch.manual_seed(0)
    if name.startswith("tiny-"):  # quick checks of this script
        from aimet_quadapter.models import tiny_model

        return tiny_model(name.removeprefix("tiny-"))
    if name == "gpt2-small":
        from transformers import AutoModelForCausalLM, GPT2Config

        config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return prepare_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    if name == "smollm2-135m-shape":  # where the real weights cannot travel (a GPU machine without the package)
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        )
        return prepare_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    model, _ = load_model(name, quiet=True)
    return model


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _ids(model, batch: int, length: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=g).to(_device())


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _calibrated_sim(model, length: int):
    from aimet_quadapter.quant.policy import build_sim, calibrate

    sim = build_sim(model)
    calibrate(sim, [_ids(model, 1, length, seed=1)])
    return sim


def _peak_memory() -> dict:
    import torch

    out = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch.cuda.is_available():
        out["cuda_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


# --- the cases ------------------------------------------------------------------------------------------
def case_eval(model, args) -> dict:
    """Tokens/s of the FP model and of the sim as evaluate() runs it (weights quantized once)."""
    import torch

    from aimet_quadapter.quant import quantizers

    # named prequantized_weights before the speed-ups: "before" runs
    fast_inference = getattr(quantizers, "fast_inference", None) or quantizers.prequantized_weights

    sim = _calibrated_sim(model, args.seq_len)
    ids = _ids(model, 1, args.seq_len)
    out: dict = {"tokens": args.seq_len}
    try:  # as perplexity() runs a forward: a CUDA graph per window shape on a GPU (the eager call elsewhere)
        from aimet_quadapter.models.graphs import GraphedForward
    except ImportError:  # a version from before the graphs
        GraphedForward = None  # noqa: N806
    with torch.no_grad():
        fp = _median_time(lambda: model(ids), args.reps)
        with fast_inference(sim.model):
            q = _median_time(lambda: sim.model(ids), args.reps)
            if GraphedForward is not None:
                graphed_sim = GraphedForward(sim.model)
                out["sim_graphed_tokens_per_s"] = args.seq_len / _median_time(lambda: graphed_sim(ids), args.reps)
                out["sim_graphed"] = bool(graphed_sim._graphs)
        raw = _median_time(lambda: sim.model(ids), args.reps)
        if GraphedForward is not None:
            graphed_fp = GraphedForward(model)
            out["fp_graphed_tokens_per_s"] = args.seq_len / _median_time(lambda: graphed_fp(ids), args.reps)
    out.update(
        fp_tokens_per_s=args.seq_len / fp,
        sim_tokens_per_s=args.seq_len / q,
        sim_unprequantized_tokens_per_s=args.seq_len / raw,
        ratio=fp / q,  # sim throughput / FP throughput, both eager
    )
    if "sim_graphed_tokens_per_s" in out:  # as evaluate() runs both
        out["ratio_as_evaluated"] = out["sim_graphed_tokens_per_s"] / out["fp_graphed_tokens_per_s"]
    return out


def case_phase1(model, args) -> dict:
    """Per site kind of the first block (and the head site): a phase-1 step vs FP fwd+bwd of its layers."""
    from aimet_quadapter.quadapter import phase1
    from aimet_quadapter.quadapter.adapter import QuadapterSet
    from aimet_quadapter.quadapter.phase1 import capture_inputs

    sim = _calibrated_sim(model, args.seq_len)
    qset = QuadapterSet.for_model(sim.model).attach(sim.model)
    blocks = sim.model.block_paths()
    first_block = blocks[0]
    sites = [q.site for q in qset if q.site.producer.startswith(first_block + ".")]
    sites += [q.site for q in qset if not any(q.site.producer.startswith(b + ".") for b in blocks)]
    ids = _ids(model, 1, args.seq_len)
    out = {}
    for site in sites:
        entry = site.scope or site.producer
        if site.producer.startswith(first_block + "."):
            block = model.get_submodule(first_block)
            call = phase1.batched(capture_inputs(model, first_block, [ids]))
            calls = [phase1.run_capturing(block, call, model, [entry])[1][entry]]
        else:
            calls = [((h,), {}) for h in _final_hidden(model, ids)]
        kind = re.sub(r"^.*?\.\d+\.", "", site.name)  # the site's name within its block
        out[kind] = {"site": site.name, "tokens": args.seq_len, **_phase1_site(model, sim, qset, site, calls, args)}
    return out


def _phase1_site(model, sim, qset, site, calls, args) -> dict:
    import torch

    from aimet_quadapter.quadapter.phase1 import Phase1Parameters, SiteBlock, batched, calibrate_site

    steps = args.phase1_steps
    params = Phase1Parameters(steps=steps)
    call = batched(calls)
    block = SiteBlock(site, model, sim.model, call, call, params)  # once per site, as phase 1 does

    def quadapter_steps():
        calibrate_site(block, qset, params, progress=False)

    # the FP reference trains the same layers (norm and linears) on the same tokens
    entry = site.scope or site.producer
    fp_layers = [model.get_submodule(p) for p in ([entry] if site.scope else [site.producer, *site.consumers])]
    fp_params = [p for m in fp_layers for p in m.parameters()]

    def fp_block():
        if site.scope:
            out = fp_layers[0](*call[0], **call[1])
            return out[0] if isinstance(out, tuple) else out
        mid = fp_layers[0](*call[0], **call[1])
        return torch.cat([c(mid) for c in fp_layers[1:]], dim=-1)

    with torch.no_grad():
        reference = fp_block() * 1.01

    def fp_steps():
        for p in fp_params:
            p.requires_grad_(True)
        try:
            for _ in range(steps):
                (fp_block() - reference).pow(2).mean().backward()
        finally:
            for p in fp_params:
                p.requires_grad_(False)
                p.grad = None

    q_time = _median_time(quadapter_steps, args.reps) / steps
    fp_time = _median_time(fp_steps, args.reps) / steps
    return {"step_s": q_time, "fp_step_s": fp_time, "ratio": q_time / fp_time}


def _final_hidden(model, ids):
    from aimet_quadapter.quadapter.phase1 import capture_inputs

    final_norm = next(s for s in model.sites() if not any(s.producer.startswith(b + ".") for b in model.block_paths()))
    return [call[0][0] for call in capture_inputs(model, final_norm.producer, [ids])]


def case_phase2(model, args) -> dict:
    """A phase-2 step (alpha + ranges learned, weights frozen) vs an FP fine-tuning step, same batch."""
    import torch

    from aimet_quadapter.quadapter.adapter import QuadapterSet
    from aimet_quadapter.quadapter.config import RunOptions
    from aimet_quadapter.quadapter.phase2 import Phase2Parameters, lm_loss, run_phase2

    sim = _calibrated_sim(model, args.seq_len)
    qset = QuadapterSet.for_model(sim.model).attach(sim.model)
    batch = _ids(model, args.batch, args.seq_len)
    steps = args.phase2_steps
    # a step's own cost: the time of 2 x steps less that of steps, so the setup of each call (the optimizer,
    # the quantizer patches) is not spread over the few steps a benchmark can afford
    timed = {}
    options = RunOptions(**_phase2_memory(args))
    for n in (steps, 2 * steps):
        params = Phase2Parameters(steps=n, batch_size=args.batch, seq_len=args.seq_len)
        run = partial(run_phase2, sim.model, qset, [batch], params, progress=False, options=options)
        timed[n] = _median_time(run, args.reps)
        print(f"    phase 2, {n} steps: {timed[n]:.3f} s a call", flush=True)  # kept if a time limit cuts the case
    q_time = timed[2 * steps] - timed[steps]

    weights = list(model.parameters())
    optimizer = torch.optim.Adam(weights, lr=1e-5)

    def fp_steps():
        for p in weights:
            p.requires_grad_(True)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            lm_loss(model, batch).backward()
            optimizer.step()

    fp_time = _median_time(fp_steps, args.reps)
    out = (
        {"profile": _profile(partial(run_phase2, sim.model, qset, [batch], params, progress=False, options=options))}
        if args.profile
        else {}
    )
    return out | {
        "batch": list(batch.shape),
        **_phase2_memory(args),
        "setup_s": timed[steps] - q_time,
        "step_s": q_time / steps,
        "fp_step_s": fp_time / steps,
        "ratio": q_time / fp_time,
    }


def _phase2_memory(args) -> dict:
    """The phase-2 memory settings the command line asks for; those it leaves out keep their defaults."""
    out: dict = {}
    if args.micro_batch is not None:
        out["micro_batch_size"] = args.micro_batch or args.batch  # 0: the whole batch in one pass
    if args.no_recompute:
        out["recompute_blocks"] = False
    if args.eager:
        out["fused_fake_quant"] = False
    return out


def _profile(fn: Callable[[], object], top: int = 25) -> dict:
    """Where one call of ``fn`` spends its time: the ops of the most self time (host and, on a GPU, device), and
    the number of device kernels launched."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
        _sync()
    events = prof.key_averages()
    device = torch.autograd.DeviceType.CUDA

    def row(e) -> dict:
        return {
            "op": e.key,
            "calls": e.count,
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "self_device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3,
        }

    host = sorted((e for e in events if e.device_type != device), key=lambda e: -e.self_cpu_time_total)
    kernels = [e for e in events if e.device_type == device]
    return {
        "host_ops": [row(e) for e in host[:top]],
        "device_kernels": sum(e.count for e in kernels),
        "device_top": [row(e) for e in sorted(kernels, key=lambda e: -getattr(e, "self_device_time_total", 0.0))[:top]],
    }


def case_phase1_all(model, args) -> dict:
    """Phase 1 as apply_quadapter runs it, on every site, ``--phase1-steps`` steps each, on ``--calib-samples``
    sequences of ``--seq-len`` tokens: the wall time of the whole phase (the paper's budget: 500 x 10 x 512)."""
    from aimet_quadapter.quadapter.adapter import QuadapterSet
    from aimet_quadapter.quadapter.phase1 import Phase1Parameters, run_phase1

    sim = _calibrated_sim(model, args.seq_len)
    qset = QuadapterSet.for_model(sim.model).attach(sim.model)
    calib = [_ids(model, 1, args.seq_len, seed=i) for i in range(args.calib_samples)]
    _sync()
    start = time.perf_counter()

    def done(site, _losses) -> None:  # a run cut short by a time limit still shows its rate
        print(f"[{time.perf_counter() - start:7.1f} s] phase 1 done: {site.name}", file=sys.stderr, flush=True)

    params = Phase1Parameters(steps=args.phase1_steps)
    run_phase1(sim.model, model, qset, calib, params, progress=False, on_site_done=done)
    _sync()
    seconds = time.perf_counter() - start
    sites = len(list(qset))
    return {
        "sites": sites,
        "steps": args.phase1_steps,
        "tokens": args.calib_samples * args.seq_len,
        "seconds": seconds,
        "site_step_ms": 1e3 * seconds / (sites * args.phase1_steps),
        **_peak_memory(),
    }


def case_memory_fp_train(model, args) -> dict:
    """Peak memory of FP fine-tuning steps (the reference the pipeline is compared with)."""
    import torch

    from aimet_quadapter.quadapter.phase2 import lm_loss

    batch = _ids(model, args.batch, args.seq_len)
    for p in model.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model, batch).backward()
        optimizer.step()
    return _peak_memory()


def case_memory_pipeline(model, args) -> dict:
    """Peak memory of the whole pipeline: sim, phase 1 on every site, static calibration, phase 2, evaluation."""
    from aimet_quadapter.quadapter.api import QuadapterParameters, apply_quadapter
    from aimet_quadapter.quadapter.phase1 import Phase1Parameters
    from aimet_quadapter.quadapter.phase2 import Phase2Parameters
    from aimet_quadapter.quant.policy import build_sim
    from aimet_quadapter.text.data import eval_windows
    from aimet_quadapter.text.perplexity import evaluate

    calib = [_ids(model, 1, args.seq_len, seed=i) for i in range(2)]
    finetune = [_ids(model, args.batch, args.seq_len, seed=10)]
    params = QuadapterParameters(
        phase1=Phase1Parameters(steps=2),
        phase2=Phase2Parameters(steps=2, batch_size=args.batch, seq_len=args.seq_len),
    )
    sim = build_sim(model)
    apply_quadapter(sim, model, calib, finetune, params, progress=False)
    windows = eval_windows(_ids(model, 1, args.seq_len, seed=20)[0].cpu(), args.seq_len)
    evaluate(sim, {"random": windows}, progress=False)
    return _peak_memory()


def case_memory_export(model, args) -> dict:
    """Peak memory of an export (FP ONNX + encodings, QDQ ONNX, onnxruntime verification) of a calibrated sim:
    the CLI's steps after the model is loaded, at its default length (128) and number of windows (4)."""
    import tempfile

    from aimet_quadapter.export.exporter import export_quantized
    from aimet_quadapter.quant.policy import build_sim, calibrate
    from aimet_quadapter.text.data import eval_windows

    length = 128
    sim = build_sim(model, in_place=True)  # as the CLI builds it: the FP weights are not kept
    calibrate(sim, [_ids(model, 1, length, seed=1)])
    windows = eval_windows(_ids(model, 1, 4 * length, seed=2)[0].cpu(), length)
    with tempfile.TemporaryDirectory() as folder:
        export_quantized(sim, Path(folder) / "export", length, verify_windows=windows)
    return _peak_memory()


def run_case(case: str, model_name: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model = _load(model_name).to(_device())
    return globals()[f"case_{case}"](model, args)


# --- the driver -------------------------------------------------------------------------------------------
def _spawn(case: str, model_name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--case", case, "--models", model_name, *_shared_flags(args)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr: the case's progress, as it comes
    if done.returncode != 0:
        raise SystemExit(f"case {case} on {model_name} failed (its error above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _shared_flags(args) -> list[str]:
    flags = [
        "--seq-len",
        str(args.seq_len),
        "--batch",
        str(args.batch),
        "--reps",
        str(args.reps),
        "--phase1-steps",
        str(args.phase1_steps),
        "--phase2-steps",
        str(args.phase2_steps),
        "--calib-samples",
        str(args.calib_samples),
    ]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.profile:
        flags.append("--profile")
    if args.micro_batch is not None:
        flags += ["--micro-batch", str(args.micro_batch)]
    if args.no_recompute:
        flags.append("--no-recompute")
    if args.eager:
        flags.append("--eager")
    return flags


PAPER_PHASE1_STEPS, PAPER_PHASE2_STEPS = 500, 10_000  # per site; end to end (batch 4 x 512): the paper's Appendix


def paper_projection(model: dict, blocks: int) -> dict | None:
    """Hours of the paper's GPT-2 recipe, from one model's measured steps (``phase1`` and ``phase2`` cases): every
    site of a block as its first block's, the head site once, phase 2's step as measured. None without both."""
    if "phase1" not in model or "phase2" not in model:
        return None
    head = sum(p["step_s"] for kind, p in model["phase1"].items() if "lm_head" in kind)
    per_block = sum(p["step_s"] for kind, p in model["phase1"].items() if "lm_head" not in kind)
    phase1 = PAPER_PHASE1_STEPS * (blocks * per_block + head)
    phase2 = PAPER_PHASE2_STEPS * model["phase2"]["step_s"]
    return {"phase1_h": phase1 / 3600, "phase2_h": phase2 / 3600, "total_h": (phase1 + phase2) / 3600}


def format_table(results: dict) -> str:
    lines = ["| model | measurement | Quadapter / sim | FP | ratio | target | met |", "|---|---|---|---|---|---|---|"]
    for model_name, r in results["models"].items():
        e = r["eval"]
        # as evaluate() runs both (CUDA graphs on a GPU), where measured
        how = "_graphed" if "ratio_as_evaluated" in e else ""
        ratio = e.get("ratio_as_evaluated", e["ratio"])
        met = ratio >= TARGETS["eval"]
        lines.append(
            f"| {model_name} | eval throughput, {e['tokens']} tokens | {e[f'sim{how}_tokens_per_s']:.0f} tok/s "
            f"| {e[f'fp{how}_tokens_per_s']:.0f} tok/s | {ratio:.2f}x | >= {TARGETS['eval']}x | {_yes(met)} |"
        )
        for kind, p in r["phase1"].items():
            met = p["ratio"] <= TARGETS["phase1"]
            lines.append(
                f"| {model_name} | phase-1 step, site {kind} | {p['step_s'] * 1e3:.1f} ms "
                f"| {p['fp_step_s'] * 1e3:.1f} ms | {p['ratio']:.2f}x | <= {TARGETS['phase1']}x | {_yes(met)} |"
            )
        p = r["phase2"]
        met = p["ratio"] <= TARGETS["phase2"]
        lines.append(
            f"| {model_name} | phase-2 step, batch {p['batch'][0]}x{p['batch'][1]} | {p['step_s']:.2f} s "
            f"| {p['fp_step_s']:.2f} s | {p['ratio']:.2f}x | <= {TARGETS['phase2']}x | {_yes(met)} |"
        )
        m, f = r["memory_pipeline"], r["memory_fp_train"]
        ratio = m["peak_rss_gb"] / f["peak_rss_gb"]
        met = m["peak_rss_gb"] <= MEMORY_TARGET_GB if model_name == "gpt2-small" else None
        lines.append(
            f"| {model_name} | peak RSS, pipeline vs FP training | {m['peak_rss_gb']:.2f} GB "
            f"| {f['peak_rss_gb']:.2f} GB | {ratio:.2f}x | <= {MEMORY_TARGET_GB} GB (GPT-2-small) "
            f"| {_yes(met)} |"
        )
        if "memory_export" in r:
            x = r["memory_export"]["peak_rss_gb"]
            lines.append(
                f"| {model_name} | peak RSS, export with verification (128 tokens) | {x:.2f} GB | - | - "
                f"| <= {MEMORY_TARGET_GB} GB | {_yes(x <= MEMORY_TARGET_GB)} |"
            )
    return "\n".join(lines)


def _ratios(results: dict) -> dict[tuple[str, str], float]:
    """(model, measurement) -> the ratio that the targets speak of."""
    out = {}
    for model_name, r in results["models"].items():  # a run with --cases has only some of them
        if "eval" in r:
            out[(model_name, "eval throughput, sim / FP")] = r["eval"]["ratio"]
        for kind, p in r.get("phase1", {}).items():
            out[(model_name, f"phase-1 step / FP fwd+bwd, {kind}")] = p["ratio"]
        if "phase2" in r:
            out[(model_name, "phase-2 step / FP fine-tuning step")] = r["phase2"]["ratio"]
        if "memory_pipeline" in r:
            out[(model_name, "peak RSS of the pipeline, GB")] = r["memory_pipeline"]["peak_rss_gb"]
        if "memory_export" in r:
            out[(model_name, "peak RSS of an export, GB")] = r["memory_export"]["peak_rss_gb"]
    return out


def compare_table(before: dict, after: dict) -> str:
    """Before/after table of two JSON files written by this script."""
    old, new = _ratios(before), _ratios(after)
    lines = ["| model | measurement | before | after |", "|---|---|---|---|"]
    for key, value in new.items():
        previous = f"{old[key]:.2f}" if key in old else "-"
        lines.append(f"| {key[0]} | {key[1]} | {previous} | {value:.2f} |")
    return "\n".join(lines)


def _yes(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "no")


def machine() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import aimet_torch

        info["aimet_torch"] = aimet_torch.__version__
    except Exception:  # the version is informative only
        pass
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2-small", help="comma-separated: gpt2-small, smollm2-135m, a hub id ...")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1, help="phase-2 and FP fine-tuning batch size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--phase1-steps", type=int, default=3)
    ap.add_argument("--phase2-steps", type=int, default=2)
    ap.add_argument("--calib-samples", type=int, default=10, help="phase1_all: calibration sequences")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument(
        "--micro-batch",
        type=int,
        help="phase2: sequences per forward/backward pass (0: the whole batch; default: "
        "the device's, as Phase2Parameters chooses)",
    )
    ap.add_argument("--no-recompute", action="store_true", help="phase2: keep the blocks' activations (more memory)")
    ap.add_argument("--eager", action="store_true", help="phase2: the eager fake-quant, not the compiled kernels")
    ap.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES + EXTRA_CASES)}"
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--profile", action="store_true", help="phase2: also where one call's time goes (torch profiler)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print a before/after table of two JSONs")
    ap.add_argument("--case", choices=CASES + EXTRA_CASES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare:
        print(compare_table(*(json.loads(Path(f).read_text()) for f in args.compare)))
        return
    if args.case:  # inside a case process: one model, one JSON line on stdout
        print(json.dumps(run_case(args.case, args.models, args)))
        return
    results = {"machine": machine(), "settings": vars(args), "models": {}}
    start = time.time()
    for name in args.models.split(","):
        results["models"][name] = {}
        for case in args.cases.split(","):
            print(f"[{time.time() - start:6.0f} s] {name}: {case}", file=sys.stderr)
            results["models"][name][case] = _spawn(case, name, args)
    results["wall_s"] = time.time() - start
    complete = set(args.cases.split(",")) == set(CASES)
    table = format_table(results) if complete else json.dumps(results["models"], indent=1)
    for name, model in results["models"].items():
        blocks = {"gpt2-small": 12, "smollm2-135m": 30, "smollm2-135m-shape": 30}.get(name)
        projected = paper_projection(model, blocks) if blocks else None
        if projected:
            results.setdefault("paper_recipe_hours", {})[name] = projected
            table += f"\n{name}: the paper's recipe (phase 1 500 steps a site, phase 2 10,000 steps) takes "
            table += f"{projected['total_h']:.2f} h ({projected['phase1_h']:.2f} + {projected['phase2_h']:.2f})"
    results["table"] = table
    print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
