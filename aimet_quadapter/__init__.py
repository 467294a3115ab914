"""Quadapter (Park et al., EMNLP 2022 Findings) as an AIMET quantization technique; nothing heavy is imported here."""

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# read at torch's first CPU allocation (so only before torch is imported): large blocks on transparent huge pages,
# so phase 2's freshly mapped activations fault in 2 MiB at a time; 0 keeps 4 KiB pages
if Path("/sys/kernel/mm/transparent_hugepage/enabled").is_file():
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

try:
    __version__ = version("aimet-quadapter")
except PackageNotFoundError:  # run from a source tree that was not installed
    __version__ = "0+unknown"
