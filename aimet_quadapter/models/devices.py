"""Which device a run computes on: ``auto`` (CUDA when there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.
Under ``torchrun`` every process takes the GPU of its local rank, whatever index ``cuda`` names."""

from __future__ import annotations

import os
import re

import torch

from ..errors import QuadapterError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"


def resolve_device(spec: str = "auto") -> torch.device:
    """The ``torch.device`` that ``spec`` names on this machine; a one-line error when it is not there."""
    if not re.match(DEVICE_PATTERN, spec):
        raise QuadapterError(f"device {spec!r} is not one of {DEVICE_CHOICES}")
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise QuadapterError(
            f"device {spec!r}: no CUDA device on this machine (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'none'}); use --device cpu or auto"
        )
    if "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    index = int(spec.split(":")[1]) if ":" in spec else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise QuadapterError(f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def device_label(device: torch.device) -> str:
    """What a result records of the device that computed it: ``cpu``, or ``cuda`` and the GPU's name."""
    if device.type != "cuda":
        return device.type
    return f"cuda ({torch.cuda.get_device_name(device)})"
