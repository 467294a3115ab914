"""One run per run folder: a lock file that names its process, and is taken over once that process is gone.

Two runs writing one ``results.json`` would each overwrite the other's cells. A lock left by a killed run
(SIGKILL, a machine that went down) names a process that no longer exists, so the next run takes it over
instead of waiting forever. Under ``torchrun`` only the first process holds it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from aimet_quadapter.errors import QuadapterError

LOCK = "run.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class RunLock:
    """``with RunLock(folder):`` holds ``folder/run.lock`` for the duration; :class:`QuadapterError` if a live
    process on this machine holds it."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK
        self.held = False

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # gone meanwhile, or a torn write of a killed run: not a live holder

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):  # a stale lock removed, then raced for
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder and holder.get("host") == me["host"] and _alive(int(holder.get("pid", -1))):
                    raise QuadapterError(
                        f"run folder {self.path.parent} is in use by process {holder['pid']} (started "
                        f"{holder.get('started', '?')}); wait for it, or use another --out"
                    ) from None
                if holder and holder.get("host") != me["host"]:
                    raise QuadapterError(
                        f"run folder {self.path.parent} is locked by process {holder.get('pid')} on "
                        f"{holder.get('host')}; if that run is over, delete {self.path}"
                    ) from None
                self.path.unlink(missing_ok=True)  # its process is gone: a killed run's lock
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise QuadapterError(f"could not take the lock {self.path}: another run keeps taking it")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
