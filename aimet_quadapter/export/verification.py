"""What an export's verification found: how far each ONNX form of the model is from the sim, against the
float32 noise floor of the model, and within which tolerance. The exporter computes it, and each extra format
(``formats.py``) checks itself against it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Tolerance:
    """How far onnxruntime's output may be from the sim's, over the verification windows.

    A quantized model cannot be reproduced bit for bit by another runtime: onnxruntime sums in float32
    in another order than torch (about 1e-6 relative), and wherever that moves a value across a rounding
    boundary one activation moves by a whole quantization step; over many layers these flips add up.
    How much they add up to depends on the model, so it is measured, not guessed: the QDQ graph is run by
    onnxruntime as written (no graph optimizations) and as a user runs it (all optimizations), and the sim
    is run again (``SIM_NOISE_DRAWS`` times) with every tensor its activation quantizers read moved by one
    float32 ulp, up or down at random, as another runtime's summation order moves it. Each pair is two
    correct executions of one model that differ only in float32 rounding; the largest difference is this
    model's float32 noise floor. The onnxruntime pair alone can underestimate it: its two runs share most
    of their kernels, and which values sit on a rounding boundary is a matter of chance. Each ONNX form
    must then agree with the sim within

    - perplexity: ``ppl_rtol + floor_factor * floor``, relative;
    - every scored logit: ``logit_rtol * max |sim logit| + floor_factor * floor``, absolute.

    Where the floor is tiny the fixed terms decide (perplexity within ``ppl_rtol``, logits within
    ``logit_rtol`` of the largest one). A wrong, missing or requantized encoding is far outside both (a
    tensor quantized twice moves logits by more than their range); and the encodings themselves are
    checked exactly, by value, before any of this. A real W8A8 model can have a floor of whole percents
    in perplexity (docs/export.md): the bounds widen with it, and the CLI says so.
    """

    ppl_rtol: float = 1e-3
    logit_rtol: float = 1e-2
    floor_factor: float = 3.0  # two independent roundings of one graph differ by about the floor each

    def ppl_bound(self, floor: Agreement) -> float:
        return self.ppl_rtol + self.floor_factor * floor.ppl_rel_diff

    def logit_bound(self, floor: Agreement, max_abs_logit: float) -> float:
        return self.logit_rtol * max_abs_logit + self.floor_factor * floor.max_abs_logit_diff


@dataclass(frozen=True)
class Agreement:
    """One ONNX form of the model against the sim (or, for the floor, against the other onnxruntime run)."""

    graph: str
    ppl: float
    ppl_rel_diff: float
    max_abs_logit_diff: float
    top1_agreement: float  # fraction of scored positions whose most likely next token is the same


@dataclass(frozen=True)
class Verification:
    windows: int
    window_lengths: list[int]
    tokens: int
    sim_ppl: float
    max_abs_sim_logit: float
    agreements: list[Agreement]  # each form of FORMS against the sim
    floor: Agreement  # "qdq" against "qdq/unoptimized": float32 reordering alone
    sim_floor: Agreement  # the sim against itself with one-ulp quantizer inputs (the largest draw): rounding alone
    # model.onnx + model.encodings against AIMET's QDQ graph, both run as written: equal where the encodings file
    # says exactly what AIMET's QDQ graph does (so far always to the bit), whatever the floor
    encodings_vs_qdq: Agreement
    ppl_bound: float  # the relative perplexity difference allowed (Tolerance.ppl_bound)
    logit_bound: float  # the absolute logit difference allowed (Tolerance.logit_bound)
    quantizers: int  # quantizers in the sim, each matched by an entry of the encodings file and of the QDQ graph
    encoding_entries: int  # entries in the encodings file, every one naming a tensor of model.onnx
    entries_applied: int  # entries applied to model.onnx for the fp+encodings check (int32 biases are not)
    tolerance: Tolerance
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)
