"""How far training moved a state's quantizer ranges from another state's: which ranges moved, and by how much.

For each quantizer whose name matches ``--pattern`` (wildcards), in both states: the reference's min and max, the
state's, and the shift of each end as a share of the reference's width (for a per-channel range, the largest over
the channels). A range phase 2 trained is read against the calibrated start it began from, e.g. SpinQuant then
Quadapter's state against SpinQuant then PTQ's of the same run (the same rotation, the same calibration text).

    python research/range_shift.py RUN/generated/spinquant_quadapter RUN/generated/spinquant --pattern '*residual_adds*'
"""

from __future__ import annotations

import argparse
import fnmatch
import re

import torch

from aimet_quadapter.quadapter.state import QuadapterState, resolve_state


def _largest(moved: torch.Tensor) -> float:
    """The entry of largest magnitude, its sign kept (a per-tensor range has one)."""
    flat = moved.flatten()
    return float(flat[flat.abs().argmax()])


def shifts(state: QuadapterState, reference: QuadapterState, pattern: str) -> list[tuple[str, float, float, float]]:
    """``(name, reference width, min shift, max shift)`` per quantizer both states hold; shifts in widths."""
    rows = []
    for name, (lo, hi) in reference.ranges.items():
        if not fnmatch.fnmatch(name, pattern) or name not in state.ranges:
            continue
        new_lo, new_hi = state.ranges[name]
        width = (hi - lo).float().clamp_min(torch.finfo(torch.float32).tiny)
        rows.append(
            (name, float(width.max()), _largest((new_lo - lo).float() / width), _largest((new_hi - hi).float() / width))
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("state", help="a saved state (.safetensors) or the cell folder holding it")
    parser.add_argument("reference", help="the state its ranges started from")
    parser.add_argument("--pattern", default="*", help="quantizer names to show (wildcards; default all)")
    args = parser.parse_args()
    state = QuadapterState.load(resolve_state(args.state))
    reference = QuadapterState.load(resolve_state(args.reference))
    rows = shifts(state, reference, args.pattern)
    if not rows:
        raise SystemExit(f"no quantizer of both states matches {args.pattern!r}")
    print("| quantizer | reference width | min moved | max moved |")
    print("| --- | ---: | ---: | ---: |")
    for name, width, lo, hi in rows:
        print(f"| {name} | {width:.4g} | {lo:+.1%} | {hi:+.1%} |")
    kinds: dict[str, list[float]] = {}
    for name, _, lo, hi in rows:
        kinds.setdefault(re.sub(r"\.\d+\.", ".N.", name), []).append(max(abs(lo), abs(hi)))
    print("\n| kind | quantizers | largest end's shift: median | max |")
    print("| --- | ---: | ---: | ---: |")
    for kind, values in kinds.items():
        values.sort()
        print(f"| {kind} | {len(values)} | {values[len(values) // 2]:.1%} | {values[-1]:.1%} |")


if __name__ == "__main__":
    main()
