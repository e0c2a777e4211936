#!/usr/bin/env bash
# One GPU call: per-kernel microbenchmarks, the default sweep (no torch.compile: its budgets
# were measured in an earlier run) and the test suite, everything written under $1.
# Usage on the GPU machine: FUSEDRC_GIT_COMMIT=<sha> bash benchmarks/gpu_session.sh "$OUT"
set -u
out=${1:?results folder}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$out/results" "$out/plots"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 60 python3 -m fusedrc.bench kernels --no-progress --results-dir "$out/results" --plots-dir "$out/plots" 2>&1 | tail -14
timeout 150 python3 -m fusedrc.bench --no-compile --no-progress --results-dir "$out/results" --plots-dir "$out/plots" 2>&1 | tail -30
timeout 80 python3 -m fusedrc.bench --workload models --batch-sizes 32 --no-progress --results-dir "$out/results" --plots-dir "$out/plots" 2>&1 | tail -24
timeout 180 python3 -m pytest -q -n 12 -p no:cacheprovider -rfs --maxfail=40 tests --ignore=tests/test_inspect.py \
    > "$out/pytest.log" 2>&1
tail -25 "$out/pytest.log" | grep -v "^  File"
