"""A run's plan as values: the datasets a recipe names, the texts it scores, and its cells."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aimet_quadapter.errors import QuadapterError


@dataclass(frozen=True)
class DatasetRef:
    spec: str  # as the recipe wrote it
    source: str  # corpus name or absolute path
    label: str  # table column / group name

    @property
    def identity(self) -> str:
        """What fingerprints and merge compare: the corpus name, or a local text's content hash (not its path)."""
        from aimet_quadapter.text.data import text_identity

        return text_identity(self.source)


def named(ref: DatasetRef) -> str:
    """A dataset as an error message names it: its label, and its file or folder when it is local."""
    return ref.label if ref.source == ref.spec and not Path(ref.source).exists() else f"{ref.label} ({ref.source})"


@dataclass(frozen=True)
class EvalSpec:
    ref: DatasetRef
    split: str
    seq_len: int
    max_tokens: int | None
    stride: int | None
    start: int = 0  # tokens of the split skipped before the first window

    @property
    def stop(self) -> int | None:
        """Where the tokens the windows read end (None: the end of the split)."""
        return None if self.max_tokens is None else self.start + self.max_tokens


@dataclass(frozen=True)
class Cell:
    key: str  # key in results.json
    method: str
    group: str  # "-", "calib:<set>" or the F-ID's name
    calibration: str | None  # calibration set name
    fid: str | None  # F-ID name (fine-tuning cells)
    size: int | None  # fine-tuning sequences in a data-size sweep
    seed: int | None = None  # one seed of a recipe's ``seeds``

    @property
    def calibration_set(self) -> str:
        if self.calibration is None:
            raise QuadapterError(f"cell {self.key} has no calibration set")
        return self.calibration

    @property
    def fid_name(self) -> str:
        if self.fid is None:
            raise QuadapterError(f"cell {self.key} is not a fine-tuning cell")
        return self.fid

    @property
    def folder(self) -> str:
        """Where the cell's states and figures go (``MethodContext.out_dir``), relative to the run folder."""
        leaf = safe_name(self.method + (f"@{self.size}" if self.size else ""))
        folder = leaf if self.group == "-" else safe_name(self.group.replace("calib:", "calib-")) + "/" + leaf
        return folder if self.seed is None else f"seed-{self.seed}/{folder}"


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._+-@" else "_" for c in name) or "_"
