"""The recipe sections ``policy`` and ``baselines``, apart from AIMET: a bad value is refused before AIMET loads."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Strict, field_validator, model_validator

from aimet_quadapter.settings import Settings, pattern_entries, setting

# quant_scheme's names -> the member of AIMET's QuantScheme each stands for (resolved in quant.policy)
QUANT_SCHEMES: dict[str, str] = {
    "min_max": "min_max",
    "tf": "min_max",
    "tf_enhanced": "post_training_tf_enhanced",
    "percentile": "post_training_percentile",
}


# target -> what it places; `paper` is the placement of the paper's tables, `htp` what a Qualcomm HTP graph quantizes
TARGETS: dict[str, str] = {
    "paper": "inputs of every Linear and attention matmul, asymmetric per-tensor weights",
    "htp": "AIMET's HTP quantsim config: every op output, symmetric per-channel Linear weights",
}


# A target's placement revision, in a cell's fingerprint so that a new placement recomputes it (absent: the first).
# htp 2: the rotation, its tables and SiLU as the exported graph's ops.
PLACEMENT_REVISION: dict[str, int] = {"htp": 2}


# LPBQ, AIMET's low-power blockwise weights: 4-bit blocks whose scales are 8-bit integers times a per-channel float
LPBQ_BITS = 4
LPBQ_SCALE_BITS = 8


PRECISIONS: dict[str, dict[str, Any]] = {"w4a16-lpbq": {"activation_bits": 16, "lpbq_block_size": 64}}


def _bits(text: str) -> int:
    if not text.isdigit() or not 2 <= int(text) <= 16:
        raise ValueError(f"bits must be an integer from 2 to 16, got {text!r}")
    return int(text)


_PAPER_ONLY = ("per_channel_weights", "symmetric_weights", "quantize_norm_weights", "quantize_logits")


class QuantPolicy(Settings):
    """Which tensors are quantized, to how many bits, and how their ranges are set. Defaults: the paper's W8A8."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # hashable, a default argument
    section = "policy"

    target: Literal[tuple(TARGETS)] = setting(  # type: ignore[valid-type]
        "paper",
        help="where quantizers sit: paper (the inputs of every Linear and attention matmul) or htp "
        "(AIMET's own HTP config: every op output, as the device quantizes)",
    )
    weight_bits: Annotated[int, Strict()] = setting(8, ge=2, le=16, help="weight bit-width")  # 8.0 is no width
    activation_bits: Annotated[int, Strict()] = setting(8, ge=2, le=16, help="activation bit-width")
    per_channel_weights: bool = setting(False, help="per-output-channel weight ranges")
    symmetric_weights: bool = setting(False, help="symmetric weight ranges")
    quantize_norm_weights: bool = setting(True, help="quantize the norms' gamma")
    quantize_logits: bool = setting(False, help="quantize the lm_head output too (a choice the paper leaves open)")
    quant_scheme: Literal[tuple(QUANT_SCHEMES)] = setting(  # type: ignore[valid-type]
        "min_max", help="how compute_encodings sets ranges: min_max (alias tf), tf_enhanced (SQNR) or percentile"
    )
    percentile: float = setting(99.99, ge=50, le=100, help="the kept share of values under 'percentile', in %")
    precision: Literal[tuple(PRECISIONS)] | None = setting(  # type: ignore[valid-type]
        None,
        result=False,
        help="a named device configuration (target htp), setting the fields it implies: w4a16-lpbq "
        "(activation_bits 16, lpbq_block_size 64); such a field given too must hold that value",
    )
    lpbq_block_size: int | None = setting(
        None,
        ge=1,
        before=None,
        help=f"the Linear weights but lm_head's as AIMET's LPBQ: {LPBQ_BITS}-bit blocks of this many input "
        f"channels, their scales {LPBQ_SCALE_BITS}-bit per output channel (target htp; None: off)",
    )
    # patterns match quantizer names as `describe` prints them
    bit_overrides: tuple[str, ...] = setting(
        (),
        help="PATTERN=BITS entries: the quantizers whose name matches PATTERN (wildcards * and ?) get BITS "
        "(e.g. '*.mlp.down_proj.input*=16'); a later entry wins; a tensor read by several layers takes "
        "the bits of any of its readers",
    )

    @field_validator("bit_overrides", mode="before")
    @classmethod
    def _entries(cls, value):
        return (value,) if isinstance(value, str) else value  # one entry given as a string

    @model_validator(mode="before")
    @classmethod
    def _precision(cls, values: Any) -> Any:
        name = values.get("precision") if isinstance(values, dict) else None
        if name not in PRECISIONS:
            return values  # none, or a bad name the field's own check refuses
        implied = PRECISIONS[name]
        for field, value in implied.items():
            if field in values and values[field] != value:
                raise ValueError(
                    f"precision {name!r} sets {field} to {value!r}, and {field} is given as {values[field]!r}: "
                    f"leave {field} out, or precision"
                )
        return {**implied, **values}

    @model_validator(mode="after")
    def _consistent(self) -> QuantPolicy:
        self.overrides()
        if self.precision is not None and self.target != "htp":
            raise ValueError(f"precision {self.precision!r} is a device configuration: it applies to target 'htp' only")
        if self.lpbq_block_size is not None and self.target != "htp":
            raise ValueError(
                "lpbq_block_size applies to target 'htp' only: LPBQ is a device (HTP) weight format, which "
                "the paper's placement does not hold"
            )
        if self.target != "paper":
            fields = type(self).model_fields
            changed = [n for n in _PAPER_ONLY if getattr(self, n) != fields[n].default]
            if changed:
                raise ValueError(
                    f"{changed[0]} applies to target 'paper' only: under target {self.target!r} AIMET's "
                    f"config places the quantizers (use bit_overrides for bit-widths)"
                )
        return self

    def overrides(self) -> list[tuple[str, int]]:
        """``bit_overrides`` as (pattern, bits) pairs, in order; a malformed entry is refused by its index."""
        return pattern_entries(
            self.bit_overrides, "bit_overrides", "PATTERN=BITS (e.g. '*.mlp.down_proj.input*=16')", _bits
        )

    def to_dict(self) -> dict:
        return self.model_dump()

    def label(self) -> str:
        overrides = "".join(f", {bits} bits at {pattern}" for pattern, bits in self.overrides())
        bits = f"W{self.weight_bits}A{self.activation_bits}"
        if self.target == "paper":
            gran = "per-channel" if self.per_channel_weights else "per-tensor"
            sym = "symmetric" if self.symmetric_weights else "asymmetric"
            return f"{bits} ({sym} {gran} weights, asymmetric activations){overrides}"
        under = f"under target {self.target} ({TARGETS[self.target]})"
        if self.lpbq_block_size is None:
            return f"{bits} {under}{overrides}"
        return (
            f"W{LPBQ_BITS}A{self.activation_bits} {under}, "
            f"the Linear weights but lm_head's LPBQ ({LPBQ_BITS}-bit blocks of {self.lpbq_block_size}, "
            f"{LPBQ_SCALE_BITS}-bit per-channel scales), the other weights {self.weight_bits}-bit{overrides}"
        )


class _Baselines(Settings):
    """The one flat recipe section ``baselines``: each AIMET technique's fields, prefixed with its name."""

    section = "baselines"


class AdaroundParameters(_Baselines):
    """AIMET's AdaRound (its own default: 10,000 iterations per layer)."""

    adaround_iterations: int = setting(10_000, ge=1, help="AdaRound optimisation steps per layer")
    adaround_reg_param: float = setting(0.01, ge=0, help="AdaRound's rounding regulariser weight")
    # AIMET reruns the model on each of these batches for every layer it rounds
    adaround_batches: int | None = setting(None, ge=1, help="calibration batches AdaRound uses (None: all)")


class SeqMseParameters(_Baselines):
    """AIMET's SeqMSE."""

    seq_mse_candidates: int = setting(20, ge=1, help="SeqMSE's candidate ranges per layer")
    seq_mse_any_bits: bool = setting(True, help="lift AIMET's 4-bit limit so that SeqMSE searches 8-bit ranges")


class QatParameters(_Baselines):
    """The paper's QAT: phase 2's loop with the weights trained too."""

    qat_lr_weights: float = setting(1e-5, gt=0, help="learning rate of the model weights in every QAT-style row")


class SpinQuantParameters(_Baselines):
    """AIMET's SpinQuant rotation."""

    spinquant_r2: bool = setting(
        False, before=False, help="SpinQuant: also rotate each attention head's values and outputs (R2)"
    )


# AIMET's defaults: 1500 and 800 steps per block, 200 for FPTQuant's local (data-free) optimiser
class AdaScaleParameters(_Baselines):
    """AIMET's AdaScale."""

    adascale_iterations: int = setting(1500, ge=1, before=1500, help="AdaScale optimisation steps per block")


class OmniQuantParameters(_Baselines):
    """AIMET's OmniQuant."""

    omniquant_iterations: int = setting(800, ge=1, before=800, help="OmniQuant optimisation steps per block")


class FPTQuantParameters(_Baselines):
    """AIMET's FPTQuant transforms."""

    fptquant_iterations: int = setting(200, ge=1, before=200, help="FPTQuant's local transform optimisation steps")


class BaselineParameters(
    FPTQuantParameters,
    OmniQuantParameters,
    AdaScaleParameters,
    SpinQuantParameters,
    QatParameters,
    SeqMseParameters,
    AdaroundParameters,
):
    """Settings of the non-Quadapter rows: every AIMET technique's class above, together."""
