"""Writing a file so that a killed process leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, flush it, then rename it over ``path``."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:  # the bytes on disk before the name points at them
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    _remove_orphans(path)


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform whose folders cannot be opened: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_orphans(path: Path) -> None:
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            tmp.unlink(missing_ok=True)


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
