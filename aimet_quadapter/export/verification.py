"""What an export's verification found: how far each ONNX form of the model is from the sim, against the
model's float32 noise floor, and within which tolerance."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Tolerance:
    """How far onnxruntime's output may be from the sim's, over the verification windows.

    Another runtime sums in another float32 order, and where that moves a value across a rounding boundary an
    activation moves by a whole quantization step. So the model's float32 noise floor is measured, not guessed: the
    largest difference between the QDQ graph with and without onnxruntime's optimizations, and between the sim and
    itself with one-ulp quantizer inputs (``SIM_NOISE_DRAWS`` draws). Each ONNX form must agree with the sim within

    - perplexity: ``ppl_rtol + floor_factor * floor``, relative;
    - every scored logit: ``logit_rtol * max |sim logit| + floor_factor * floor``, absolute.

    A wrong or requantized encoding is far outside both; a real W8A8 model's floor can be whole percents.
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
    # model.onnx + model.encodings against AIMET's QDQ graph, both run as written: equal whatever the floor
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
