"""One run per run folder: an OS file lock on ``run.lock`` (released by the kernel however its process dies), and
``run.lock.json`` naming the process that holds it. Under ``torchrun`` only the first process holds it."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from filelock import FileLock, Timeout

from aimet_quadapter.atomic import write_text_atomic
from aimet_quadapter.errors import QuadapterError

LOCK = "run.lock"
HOLDER = "run.lock.json"
_HOLDER_WAIT_S = 2.0  # the winner of a race writes its name just after taking the lock


class RunLock:
    """``with RunLock(folder):`` holds ``folder/run.lock``; :class:`QuadapterError`, naming the holder, if taken."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.holder_path = self.folder / HOLDER
        self._lock = FileLock(self.path, timeout=0)

    def _holder(self) -> dict | None:
        deadline = time.monotonic() + _HOLDER_WAIT_S
        while True:
            try:
                return json.loads(self.holder_path.read_text())
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)

    def acquire(self) -> None:
        try:
            self._lock.acquire()
        except Timeout:
            holder = self._holder()
            who = "another process"
            if holder:
                who = f"process {holder.get('pid')} on {holder.get('host')} (started {holder.get('started', '?')})"
            raise QuadapterError(
                f"run folder {self.folder} is in use by {who}; wait for it, or use another --out"
            ) from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        write_text_atomic(self.holder_path, json.dumps(me))

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def release(self) -> None:
        if self._lock.is_locked:
            self.holder_path.unlink(missing_ok=True)
            self._lock.release()

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
