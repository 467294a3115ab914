"""The versions of the libraries a number depends on, recorded next to it (results.json, export manifests)."""

from __future__ import annotations

import importlib.metadata
import platform

# the float arithmetic, the quantizers, the model code and this package: another version of one can move a
# perplexity in its last digits (torch 2.14 and 2.15 do)
DEPENDENCIES = ("aimet-quadapter", "aimet-torch", "torch", "transformers", "onnx", "onnxruntime")


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in DEPENDENCIES:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions
