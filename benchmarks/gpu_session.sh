#!/usr/bin/env bash
# One GPU call: per-kernel microbenchmarks, the default sweep (no torch.compile: its budgets
# were measured in an earlier run), the real models and the test suite. Everything lands in
# $1/gpu.tgz, re-packed after each step so a call cut short still returns what it finished.
# Usage on the GPU machine: FUSEDRC_GIT_COMMIT=<sha> bash benchmarks/gpu_session.sh "$OUT"
set -u
out=${1:?results folder}
w=$(mktemp -d)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$w/results" "$w/plots"
pack() { tar czf "$out/gpu.tgz" -C "$w" . ; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
opts=(--no-progress --results-dir "$w/results" --plots-dir "$w/plots")
timeout 60 python3 -m fusedrc.bench kernels "${opts[@]}" 2>&1 | tail -14; pack
timeout 150 python3 -m fusedrc.bench --no-compile "${opts[@]}" 2>&1 | tail -30; pack
timeout 80 python3 -m fusedrc.bench --workload models --batch-sizes 32 "${opts[@]}" 2>&1 | tail -24; pack
timeout 180 python3 -m pytest -q -n 12 -p no:cacheprovider -rA --maxfail=200 tests --ignore=tests/test_inspect.py \
    > "$w/pytest.log" 2>&1
pack
tail -25 "$w/pytest.log" | grep -v "^  File"
