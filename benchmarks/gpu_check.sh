#!/usr/bin/env bash
# Every check of this project that needs a GPU, for a GPU machine lent for a few minutes; run from the repository
# root, with the package's dependencies importable: bash benchmarks/gpu_check.sh OUT_DIR [suite|perf|all]
# What it checks and its targets: benchmarks/README.md ("On a GPU"). Each part stays under 5 minutes (all: under
# 10, one call of a lease), and every log is written whole under OUT_DIR even when a limit cuts a step.
set -uo pipefail
out=${1:-gpu-check}
part=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/machine.txt"
python3 -c "import torch, transformers, aimet_torch; print(torch.__version__, transformers.__version__, aimet_torch.__version__)" |
    tee -a "$out/machine.txt"

if [[ $part == suite || $part == all ]]; then
    # the README's test command (the CUDA tests are part of it), with more workers and a per-test limit, so that a
    # hang costs one test, not the lease (about 200 s on an H200 with 12 workers)
    { time timeout 250 python3 -m pytest -q -p no:cacheprovider -n 12 --timeout 200 -rs --durations=15; } 2>&1 |
        tee "$out/suite.log" | tail -60
fi

if [[ $part == perf || $part == all ]]; then
    # evaluation, a phase-1 step and a phase-2 step against the FP model at 4 x 512 on GPT-2 small's shape, and the
    # paper's recipe projected from them (about 160 s on an H200); SmolLM2's shape: the phase-2 step
    timeout 190 python3 benchmarks/perf.py --models gpt2-small --cases eval,phase1,phase2 --batch 4 --seq-len 512 \
        --reps 2 --phase2-steps 2 --json "$out/gpt2-small.json" 2>&1 | tee "$out/perf.log" | tail -25
    timeout 100 python3 benchmarks/perf.py --models smollm2-135m-shape --cases phase2 --batch 4 --seq-len 512 \
        --reps 1 --phase2-steps 2 --json "$out/smollm2-135m-shape.json" 2>&1 | tee -a "$out/perf.log" | tail -25
fi
