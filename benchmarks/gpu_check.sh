#!/usr/bin/env bash
# Every check of this project that needs a GPU, as one script for a GPU machine lent for a few minutes; run from
# the repository root, with the package's dependencies importable: bash benchmarks/gpu_check.sh OUT_DIR
# What it checks and its targets: benchmarks/README.md ("On a GPU").
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/machine.txt"

# 1. the CUDA tests, the GPU path's tests and those that once failed on a GPU machine (about 2 minutes)
timeout 300 python3 -m pytest -q -n 8 -rs -p no:cacheprovider tests/test_cuda.py tests/test_phase2_speed.py \
    tests/test_quadapter.py tests/test_bad_input.py -k "cuda or speed or kernels or fused or free or importing" 2>&1 |
    tail -40 | tee "$out/cuda-tests.log"

# 2. the README's test command as a user runs it on this machine (target: well under 5 minutes)
{ time timeout 420 python3 -m pytest -q -p no:cacheprovider --durations=15; } 2>&1 | tail -50 | tee "$out/suite.log"

# 3. evaluation, a phase-1 step and a phase-2 step against the FP model at 4 x 512; the paper's recipe projected
for model in gpt2-small smollm2-135m-shape; do
    timeout 240 python3 benchmarks/perf.py --models "$model" --cases eval,phase1,phase2 --batch 4 --seq-len 512 \
        --reps 2 --phase2-steps 2 --json "$out/$model.json" 2>&1 | tail -20 | tee -a "$out/perf.log"
done
