"""A PTQ state of a model under target htp (calibrated on PTB train, the demo's prefix), for `export --device-check`.

python scripts/htp_ptq_state.py --model smollm2-135m --out htp-ptq.safetensors \
    [--bit-overrides ...] [--activation-bits 16]
"""

from __future__ import annotations

import argparse

from aimet_quadapter.models import load_model
from aimet_quadapter.quadapter.state import QuadapterState
from aimet_quadapter.quant.config import QuantPolicy
from aimet_quadapter.quant.policy import build_sim, calibrate
from aimet_quadapter.text.data import load_text, random_crops, tokenize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--prefix", default="<|im_start|>\n")
    ap.add_argument("--bit-overrides", nargs="*", default=[])
    ap.add_argument("--activation-bits", type=int, default=QuantPolicy().activation_bits)
    args = ap.parse_args()
    model, tokenizer = load_model(args.model, quiet=True)
    if args.prefix:
        model.set_prefix(tokenizer(args.prefix, add_special_tokens=False)["input_ids"])
    train = tokenize(tokenizer, load_text("ptb", "train"))
    sim = build_sim(
        model, QuantPolicy(target="htp", activation_bits=args.activation_bits, bit_overrides=tuple(args.bit_overrides))
    )
    calibrate(sim, random_crops(train, args.samples, args.length).split(1))
    state = QuadapterState.from_sim(sim, {}, method="ptq", model=args.model)
    print(f"saved {state.save(args.out)}")


if __name__ == "__main__":
    main()
