"""A cell whose perplexity is NaN or infinite after training that stayed finite is recorded as failed, with where
its training ended, never as a number: the matrix goes on, `eval` says a cell stopped, the report shows it, and a
rerun computes it again."""

from __future__ import annotations

import json
import math

import torch

import aimet_quadapter.methods.registry as methods
from aimet_quadapter.cli import main

SMALL = ["--seq-len", "64", "--max-tokens", "256", "--calib-samples", "2", "--calib-len", "64"]
PHASE2 = ["--phase2-steps", "2", "--phase2-batch-size", "2", "--phase2-seq-len", "64"]
# the logits the evaluation sees, by method: QAT's NaN, PTQ's so large that exp(mean NLL) leaves float64
POISON = {"qat": math.nan, "ptq": 1e9}


def _poisoned(monkeypatch, calls: dict[str, int]) -> None:
    """Every method counted; PTQ's and QAT's sims (trained as usual) give the logits of ``POISON`` when scored."""
    for name, fn in list(methods.REGISTRY.items()):

        def wrapped(ctx, name=name, fn=fn):
            calls[name] = calls.get(name, 0) + 1
            out = fn(ctx)
            if name in POISON:  # a hook on the sim's own module: the FP model the next cells use stays as it is
                out.model.register_forward_hook(lambda _m, _a, logits: logits * POISON[name])
            return out

        monkeypatch.setitem(methods.REGISTRY, name, wrapped)


def test_a_cell_of_nonfinite_perplexity_is_recorded_failed_and_computed_again(
    tiny_gpt2_dir, corpus_dir, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    argv = ["eval", "--model", str(tiny_gpt2_dir), "--dataset", str(corpus_dir), *SMALL, *PHASE2]
    argv += ["--methods", "fp,ptq,cle,qat", "--out", str(out), "--no-progress"]
    calls: dict[str, int] = {}
    originals = dict(methods.REGISTRY)
    _poisoned(monkeypatch, calls)
    assert main(argv) == 1  # `eval` says a cell stopped
    err = capsys.readouterr().err
    cells = {c["method"]: c for c in json.loads((out / "results.json").read_text())["cells"].values()}
    for method in ("fp", "cle"):  # before and after the failed cell: numbers
        assert cells[method]["ppl"] and all(math.isfinite(v) for v in cells[method]["ppl"].values())
        assert "error" not in cells[method]
    ptq, qat = cells["ptq"], cells["qat"]
    assert ptq["ppl"] == {} and qat["ppl"] == {}
    assert ptq["error"] == "perplexity inf on corpus (test text); the method ended without a non-finite training loss"
    assert qat["error"].startswith("perplexity nan on corpus (test text); the training losses stayed finite (qat ")
    assert "phase 2 ended at step 2 with loss" in qat["error"]
    assert "ptq stopped: perplexity inf" in err and "qat stopped: perplexity nan" in err

    assert main(["report", str(out)]) == 0
    report = capsys.readouterr().out
    assert "PTQ (stopped: perplexity not finite)" in report and "QAT (stopped: perplexity not finite)" in report
    assert f"stopped: {qat['error']}" in report  # the cells table gives the whole error

    # its state stays in the run folder, for a look; `export` refuses it as a failed row's
    assert (
        main(["export", str(out / "calib-corpus" / "ptq"), "--model", str(tiny_gpt2_dir), "--out", str(tmp_path / "e")])
        == 2
    )
    assert "ptq, which failed: perplexity inf" in capsys.readouterr().err

    calls.clear()
    assert main(argv) == 1
    assert calls == {"ptq": 1, "qat": 1}  # the failed cells again, the others kept
    for method in POISON:  # scored as they are: a rerun computes them and records numbers
        monkeypatch.setitem(methods.REGISTRY, method, originals[method])
    assert main(argv) == 0
    cells = {c["method"]: c for c in json.loads((out / "results.json").read_text())["cells"].values()}
    assert all(math.isfinite(v) for m in POISON for v in cells[m]["ppl"].values()) and cells["qat"]["ppl"]


def test_a_nan_window_or_an_nll_beyond_float64_gives_a_perplexity_that_is_not_finite():
    """One window's NaN makes the whole perplexity NaN (never averaged away), and a mean NLL whose exponential
    leaves float64 is inf, not an OverflowError that would end the whole run."""
    from aimet_quadapter.text.data import eval_windows
    from aimet_quadapter.text.perplexity import perplexity

    windows = eval_windows(torch.arange(200) % 10, 16, None, None)
    assert len(windows) > 2

    def logits(nan_at: int | None, scale: float = 1.0):
        seen: list[int] = []

        def model(ids: torch.Tensor) -> torch.Tensor:
            out = torch.nn.functional.one_hot(ids, 10).float() * scale
            seen.append(len(seen))
            return out * math.nan if seen[-1] == nan_at else out

        return model

    assert math.isfinite(perplexity(logits(None), windows, progress=False).ppl)
    assert math.isnan(perplexity(logits(1), windows, progress=False).ppl)
    assert perplexity(logits(None, scale=1e6), windows, progress=False).ppl == math.inf
