"""What the exported files look like, declared once: light to import, so that the command line offers the same
choices and defaults as the exporter without loading it."""

from __future__ import annotations

ENCODING_VERSIONS = ("1.0.0", "2.0.0")  # AIMET encodings JSON formats a converter takes
ENCODING_VERSION = ENCODING_VERSIONS[0]
SEQ_LEN = 128  # the graph's fixed input length: device graphs are static
QDQ_OPSET = 21  # QuantizeLinear/DequantizeLinear with per-axis and 4/16-bit types; what AIMET recommends
INPUT_NAME, OUTPUT_NAME = "input_ids", "logits"
KV_FOLDER = "kv"  # the prefill and decode graphs with a KV cache, beside the full-sequence ones
