"""What the exported files look like, declared once: light to import, so that the command line offers the same
choices and defaults as the exporter without loading it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from aimet_quadapter.export.verification import Verification
    from aimet_quadapter.text.data import Window

ENCODING_VERSIONS = ("1.0.0", "2.0.0")  # AIMET encodings JSON formats a converter takes
ENCODING_VERSION = ENCODING_VERSIONS[0]
# The format of block-wise weights (LPBQ): 2.0.0 names each one's blocked axis, which 1.0.0 leaves implicit
BLOCKWISE_ENCODING_VERSION = "2.0.0"
SEQ_LEN = 128  # the graph's fixed input length: device graphs are static
QDQ_OPSET = 21  # QuantizeLinear/DequantizeLinear with per-axis and 4/16-bit types; what AIMET recommends
INPUT_NAME, OUTPUT_NAME = "input_ids", "logits"
MANIFEST = "manifest.json"
FP_ONNX = "model.onnx"
ENCODINGS = "model.encodings"  # AIMET names it after the ONNX file: <stem>.encodings
QDQ_ONNX = "model_qdq.onnx"


def encoding_version_for(blockwise: str | None, asked: str | None = None) -> str:
    """The encodings format of an export: ``asked``, by default :data:`BLOCKWISE_ENCODING_VERSION` where
    ``blockwise`` names a block-wise quantized tensor (for which 1.0.0 is refused), else :data:`ENCODING_VERSION`."""
    from aimet_quadapter.errors import QuadapterError

    if asked is None:
        return BLOCKWISE_ENCODING_VERSION if blockwise else ENCODING_VERSION
    if blockwise and asked == "1.0.0":
        raise QuadapterError(
            f"encodings version 1.0.0 leaves the layout of block-wise weights ({blockwise}) implicit, and the "
            f"export's checks cannot read it back: export them as {BLOCKWISE_ENCODING_VERSION} (the default for them)"
        )
    return asked


def data_file(graph: str) -> str:
    """The external data file (the weights) of an ONNX graph file."""
    return f"{Path(graph).stem}.data"


KV_FOLDER = "kv"  # the prefill and decode graphs with a KV cache, beside the full-sequence ones
HF_FOLDER = "hf"  # the folded FP model as a Hugging Face checkpoint, with AIMET's torch encodings
PREFIX_KV = "prefix.safetensors"  # a prefix's keys and values, which a host puts first in its KV cache
PREFIX_IDS = "prefix.json"  # a prefix's token ids, for a model that computes its keys and values itself


class ExtraFormat(Protocol):
    """One more form of the exported model, in the export's subfolder ``key``, written from the same sim and
    verified against it; ``key`` also names its manifest entry (what :meth:`write` and :meth:`verify` return)."""

    key: ClassVar[str]

    def check(self, windows: Sequence[Window], prefix_tokens: int) -> None:
        """Refuse, before anything is exported, settings that cannot work with these windows after the prefix."""

    def write(self, sim: Any, folder: Path, encoding_version: str) -> dict:
        """Write the files of this format from ``sim`` into ``folder``."""
        ...

    def verify(self, sim: Any, folder: Path, windows: Sequence[Window], report: Verification, export: Path) -> dict:
        """Raise where the files compute something else than ``sim``; ``report``: the full-sequence graphs'
        verification, ``export``: the export folder."""
        ...
