"""The versions of the libraries a number depends on, recorded next to it (results.json, export manifests)."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import platform
import subprocess
from pathlib import Path

# another version of one can move a perplexity in its last digits
DEPENDENCIES = ("aimet-quadapter", "aimet-torch", "torch", "transformers", "onnx", "onnxruntime")
SOURCE = "aimet-quadapter source"
_PACKAGE = Path(__file__).resolve().parent


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in DEPENDENCIES:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    # the package's version stays put while its code changes: this tells cells computed by different code apart
    versions[SOURCE] = source_hash()
    return versions


@functools.cache
def source_hash() -> str:
    """The first 12 hex digits of a sha256 over this package's Python files, their paths included."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(_PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@functools.cache
def cpu_name() -> str:
    """The CPU's model name, as the kernel reports it (its vector kernels alone do not say which machine ran)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def source_commit() -> str | None:
    """The git commit the package was run from, ``+changes`` where its files differ from it; None outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(_PACKAGE), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        changed = subprocess.run(
            ["git", "-C", str(_PACKAGE), "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")
