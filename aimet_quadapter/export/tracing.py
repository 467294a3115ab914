"""AIMET's ONNX exports as steps of ours: the tracer's expected warnings silenced, a failure one line naming it."""

from __future__ import annotations

import warnings

from aimet_quadapter.errors import QuadapterError


def run_aimet_export(step: str, fn, *args, **kwargs) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript tracer warnings about shapes: expected for a fixed graph
            fn(*args, **kwargs)
    except QuadapterError:
        raise
    except Exception as exc:  # AIMET and torch.onnx raise RuntimeError, ValueError, NotImplementedError...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise QuadapterError(f"{step} failed: {type(exc).__name__}: {first}") from exc
