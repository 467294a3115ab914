"""Two CPU processes with the gloo backend compute what one process computes (phase 2 and perplexity)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aimet_quadapter.models import quiet_libraries
from aimet_quadapter.quadapter.api import attach_quadapters
from aimet_quadapter.quadapter.phase2 import Phase2Parameters, run_phase2
from aimet_quadapter.quant.policy import build_sim, calibrate
from aimet_quadapter.testing import sample_corpus, toy_model
from aimet_quadapter.text.data import eval_windows
from aimet_quadapter.text.perplexity import perplexity


def _run() -> dict:
    """Phase 2 (alpha + ranges) for 3 steps on global batches of 2 sequences, then perplexity."""
    quiet_libraries()
    torch.manual_seed(0)
    model = toy_model("gpt2")
    corpus = sample_corpus(model, 10, 48, seed=1)
    sim = build_sim(model)
    calibrate(sim, [corpus[:2]])
    qset = attach_quadapters(sim)
    train = [corpus[2:4], corpus[4:6]]
    result = run_phase2(
        sim.model, qset, train, Phase2Parameters(steps=3, lr_alpha=1e-2, lr_ranges=1e-2), progress=False
    )
    windows = [w for row in corpus[6:] for w in eval_windows(row, 48)]
    ppl = perplexity(sim.model, windows, progress=False)
    return {
        "losses": result.losses,
        "theta": torch.cat([q.theta.detach().flatten() for q in qset]),
        "ppl": ppl.ppl,
        "tokens": ppl.tokens,
    }


def _worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = _run()
        if rank == 0:
            torch.save(out, out_file)
    finally:
        dist.destroy_process_group()


def _diverging_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Phase 2 where only rank 1's loss is not finite: every rank must stop with the same line, none hang."""
    from aimet_quadapter.errors import TrainingDiverged
    from aimet_quadapter.quadapter.phase2 import lm_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = toy_model("gpt2")
        corpus = sample_corpus(model, 4, 32, seed=1)
        sim = build_sim(model)
        calibrate(sim, [corpus[:2]])

        def loss_fn(m, batch):
            loss = lm_loss(m, batch)
            return loss * float("nan") if rank == 1 else loss

        params = Phase2Parameters(steps=2, lr_alpha=1e-2, lr_ranges=1e-2)
        try:
            run_phase2(sim.model, attach_quadapters(sim), [corpus[:2]], params, loss_fn=loss_fn, progress=False)
            message = "finished"
        except TrainingDiverged as error:
            message = str(error)
        (Path(out_dir) / f"rank{rank}.txt").write_text(message)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_a_loss_not_finite_on_one_process_stops_every_process(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_diverging_worker, args=(r, 2, str(tmp_path / "init"), str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        p.kill()
    assert not hung, "a process was left waiting in the all-reduce"
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert lines[0] == lines[1] and "the loss is nan at step 1 of 2" in lines[0]


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_two_gloo_processes_match_one(tmp_path):
    single = _run()
    out_file = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(out_file)), nprocs=2, join=True)
    double = torch.load(out_file)
    assert double["tokens"] == single["tokens"]
    assert double["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert torch.allclose(double["theta"], single["theta"], atol=1e-6)
    assert (double["theta"] != 0).any(), "phase 2 should have moved alpha"
    assert double["ppl"] == pytest.approx(single["ppl"], rel=1e-6)
