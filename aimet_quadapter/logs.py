"""The package's messages (logger ``aimet_quadapter``); as a library, nothing below a warning unless configured."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("aimet_quadapter")


class _ConsoleHandler(logging.Handler):
    """Messages on stderr, written around any progress bar on screen instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging's own contract: a handler never raises
            self.handleError(record)


def configure(verbosity: int = 0) -> None:
    """Show the package's messages on stderr: ``-1`` warnings and errors, ``0`` what a run is doing, ``1`` debug."""
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    for handler in [h for h in log.handlers if isinstance(h, _ConsoleHandler)]:
        log.removeHandler(handler)
    console = _ConsoleHandler(level)
    console.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(console)
    log.setLevel(logging.DEBUG)  # each handler filters for itself: the run's log file keeps everything
    log.propagate = False


@contextlib.contextmanager
def log_file(path: Path) -> Iterator[None]:
    """Append every message of the package to ``path`` while the block runs (a run folder's ``run.log``)."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        log.removeHandler(handler)
        handler.close()
        log.setLevel(level)
