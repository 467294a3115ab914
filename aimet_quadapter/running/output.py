"""Where a run writes and who speaks for it: under torchrun only the first process writes files and logs."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from aimet_quadapter.logs import log


@dataclass(frozen=True)
class Output:
    out_dir: Path
    progress: bool
    main: bool  # the first process (or the only one)

    def say(self, message: str, level: int = logging.INFO) -> None:
        if self.main:  # under torchrun the first process speaks for all
            log.log(level, message)
