"""Quadapter's settings (the recipe sections ``phase1``, ``phase2``, ``quadapter``, ``execution``), torch-free."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator

from aimet_quadapter.models import EXTRA_SITE_GROUPS, SITE_ROLES
from aimet_quadapter.settings import Settings, pattern_entries, setting

# the name of phase 1's state (Quadapter BC) in a run folder; the method catalog names its row after it
BC_STATE = "quadapter_bc"
# what a site name or a glob of them holds and a role (a bare word) does not
_SITE_NAME_MARKS = ("*", "?", "[", ".", "->")


class Phase1Parameters(Settings):
    """Phase-1 settings; defaults are the paper's (Appendix, "Block-wise Calibration")."""

    section = "phase1"

    steps: int = setting(500, ge=0, help="Adam steps per site (the paper: 500)")
    lr: float = setting(0.1, gt=0, help="learning rate of log alpha (the paper's, for its 500 steps; see reach_steps)")
    # Adam moves log(alpha) by about the rate per step: a shorter run needs a larger rate to reach as far
    reach_steps: int | None = setting(
        500, ge=1, help="a run of fewer steps scales the lr by reach_steps / steps (None: the lr as given)"
    )
    lr_decay: float = setting(0.2, gt=0, help="the learning rate is multiplied by this at each stage")
    lr_stages: int = setting(5, ge=1, help="lr_stages - 1 equal intervals of decay (the paper: every 100 of 500)")
    range_gradient: bool = setting(True, help="min/max seen by autograd; False: AIMET's no-gradient ranges")
    input_source: Literal["fp", "quantized"] = setting("fp", help="where a site's input comes from")
    loss_tokens: int | None = setting(
        None, ge=1, help="token-wise sites: the loss on this many calibration tokens (None: all)"
    )
    # a block-wise optimum fitted to the calibration text can generalise worse than the start
    keep_start: tuple[str, ...] = setting(
        (),
        help=f"sites left at their start alpha, in effect but not trained: site roles ({', '.join(SITE_ROLES)}; "
        "a role the model has no site of matches none) or fnmatch patterns of site names",
    )
    # sites optimised alone under dynamic ranges can overshoot together for the static model
    check_points: tuple[float, ...] = setting(
        (0.25, 0.5, 0.75),
        help="with held-out text, these fractions of the way from the start to phase 1's alpha (in log alpha) "
        "are scored too; the best of start, these and the end is kept",
    )
    seed: int = setting(0, help="seed of the loss-token sample")

    @field_validator("check_points", mode="before")
    @classmethod
    def _fractions(cls, values):
        for i, t in enumerate(values or ()):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1:
                raise ValueError(f"[{i}] must be a number between 0 and 1 (excluded), got {t!r}")
        return values

    @field_validator("keep_start")
    @classmethod
    def _roles_or_globs(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        # a bare word can only be a role: a misspelt one would otherwise fail as a glob only once the model loads
        for i, entry in enumerate(entries):
            if entry not in SITE_ROLES and not any(mark in entry for mark in _SITE_NAME_MARKS):
                raise ValueError(
                    f"[{i}] must be a site role ({', '.join(SITE_ROLES)}) or a glob of site names, got {entry!r}"
                )
        return entries

    @property
    def first_lr(self) -> float:
        if self.reach_steps is None or self.steps == 0:
            return self.lr
        return self.lr * max(1.0, self.reach_steps / self.steps)

    @property
    def decay_every(self) -> int:
        return max(1, math.ceil(self.steps / self.lr_stages))


class Phase2Parameters(Settings):
    """Phase-2 settings; defaults are the paper's (Appendix, "End-to-end Fine-tuning")."""

    section = "phase2"

    steps: int = setting(10_000, ge=0, help="training steps (0: Quadapter BC alone)")
    batch_size: int = setting(4, ge=1, help="sequences per step")
    seq_len: int = setting(512, ge=2, help="tokens per sequence")
    # distillation pulls toward the FP model's behaviour, not the fine-tuning text's own statistics
    loss: Literal["lm", "kd"] = setting(
        "lm",
        before="lm",
        help="lm: next-token cross entropy on the fine-tuning text (the paper); kd: KL divergence to the FP "
        "model's next-token distribution on it (FP fine-tuning always uses lm)",
    )
    lr_alpha: float = setting(1e-3, ge=0, help="learning rate of log alpha, decaying linearly to 0")
    lr_ranges: float = setting(1e-3, ge=0, help="learning rate of the quantizers' min/max (LSQ+)")
    # Adam moves a parameter by about its rate per step, and one model's ranges span from 1 to over a hundred
    lr_ranges_relative: bool = setting(
        False,
        before=False,
        help="lr_ranges is a fraction of each quantizer's calibrated width (max - min) instead of a step in its "
        "own units (the paper)",
    )
    # one kind of range (a device graph's residual stream) may need another rate than the rest
    lr_ranges_overrides: tuple[str, ...] = setting(
        (),
        before=(),
        help="PATTERN=FACTOR entries: the ranges of the quantizers whose name matches PATTERN (wildcards * and ?, "
        "as policy.bit_overrides names them) learn at FACTOR x lr_ranges (e.g. '*.residual_adds.*=3'); a later "
        "entry wins",
    )
    learn_ranges: bool = setting(True, help="train the quantizer ranges; False: the paper's 'without LSQ+'")
    lr_weights: float = setting(0.0, ge=0, help="> 0 trains the model weights too (QAT)")

    @field_validator("lr_ranges_overrides", mode="before")
    @classmethod
    def _entries(cls, value):
        return (value,) if isinstance(value, str) else value  # one entry given as a string

    @field_validator("lr_ranges_overrides")
    @classmethod
    def _factors_parse(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        _range_rate_factors(entries)
        return entries

    def range_rate_factors(self) -> list[tuple[str, float]]:
        """``lr_ranges_overrides`` as (pattern, factor) pairs, in order."""
        return _range_rate_factors(self.lr_ranges_overrides)


def _factor(text: str) -> float:
    try:
        factor = float(text)
    except ValueError:
        factor = math.nan
    if not math.isfinite(factor) or factor < 0:
        raise ValueError(f"the factor must be a number >= 0, got {text!r}")
    return factor


def _range_rate_factors(entries: tuple[str, ...]) -> list[tuple[str, float]]:
    return pattern_entries(entries, "lr_ranges_overrides", "PATTERN=FACTOR (e.g. '*.residual_adds.*=3')", _factor)


class RunOptions(Settings):
    """How phase 1 and phase 2 run, not what they compute: any value gives the same result, up to the order of
    float sums where said."""

    section = "execution"

    # the slices' gradients sum to the batch's, up to float rounding; only one slice's activations are kept
    micro_batch_size: int | None = setting(
        None,
        ge=1,
        result=False,
        help="phase 2's sequences per forward/backward pass, accumulated to phase2.batch_size (None: 1 on a CPU, "
        "the whole batch on a GPU)",
    )
    # one block's activations alive at a time, for one more forward pass per step
    recompute_blocks: bool | None = setting(
        None,
        result=False,
        help="recompute each decoder block in phase 2's backward pass, for less memory (None: on a CPU, not on a GPU)",
    )
    # the same values; the ranges' gradients are summed in another order
    fused_fake_quant: bool | None = setting(
        None,
        result=False,
        help="phase 2's fake-quant of trained ranges as compiled kernels, encodings made once per pass (None: on a "
        "GPU, not on a CPU)",
    )
    checkpoint_every: int = setting(200, ge=1, result=False, help="phase-2 steps between checkpoints")
    checkpoint_dir: str | None = setting(None, result=False, help="folder of the resumable checkpoints")


class AdapterParameters(Settings):
    """The adapter's own settings: where its sites are and where phase 1 starts."""

    section = "quadapter"

    init: Literal["ones", "cle"] = setting("ones", help="phase 1's start: alpha = 1 (the paper) or CLE's")
    extra_sites: bool | list[Literal[EXTRA_SITE_GROUPS]] | None = setting(  # type: ignore[valid-type]
        None,
        help="beyond-paper site groups (linear: v->o, up->down; qk: Q.K^T), true for all; None: the family's default",
    )


class QuadapterParameters(AdapterParameters):
    """All of Quadapter's settings. Defaults are the paper's; ``phase2.steps = 0`` gives Quadapter BC."""

    phase1: Phase1Parameters = Field(default_factory=Phase1Parameters)
    phase2: Phase2Parameters = Field(default_factory=Phase2Parameters)
