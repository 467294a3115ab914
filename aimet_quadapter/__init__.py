"""Quadapter (Park et al., EMNLP 2022 Findings) as an AIMET quantization technique.

The entry points a user meets first: :func:`aimet_quadapter.quadapter.apply_quadapter` (next to AIMET's
``apply_adaround`` and ``apply_seq_mse``), :func:`aimet_quadapter.quant.policy.build_sim`, and
:func:`aimet_quadapter.models.load_model`. Nothing heavy is imported here: ``import aimet_torch``
alone takes seconds, and the command line validates its arguments first.
"""

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# Read by torch's CPU allocator at its first allocation: each block of 2 MiB or more is then backed by transparent
# huge pages. Phase 2 maps its large activations afresh at every pass (memory.MAPPED_BLOCK_BYTES), and each faults
# in 2 MiB at a time instead of 4 KiB. The same values; 0 keeps 4 KiB pages. Imported after torch, this is too late.
if Path("/sys/kernel/mm/transparent_hugepage/enabled").is_file():
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

try:
    __version__ = version("aimet-quadapter")
except PackageNotFoundError:  # run from a source tree that was not installed
    __version__ = "0+unknown"
