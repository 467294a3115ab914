"""Writing a file so that a killed process leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a sibling temporary path, then rename it over ``path`` (atomic on one filesystem)."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    """``path.write_text(text)``, atomically (see :func:`write_atomic`)."""
    write_atomic(path, lambda tmp: tmp.write_text(text))


def check_new_folder(out_dir: Path, overwrite: bool) -> None:
    """Refuse an output folder that exists and holds files, unless ``overwrite``: checked before the work."""
    from aimet_quadapter.errors import QuadapterError

    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())) and not overwrite:
        raise QuadapterError(f"{out_dir} already exists: choose another --out, or pass --force to replace it")
    existing = out_dir.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise QuadapterError(f"{out_dir} cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise QuadapterError(f"{out_dir} cannot be created: {existing} is not writable")
