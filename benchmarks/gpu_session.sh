#!/usr/bin/env bash
# GPU session steps, each under its own time limit; everything lands in $1/gpu.tgz, re-packed
# after each step so a call cut short still returns what it finished.
#   tests    the test suite (CUDA-only tests included: compiled triton_op twins, AMP, DDP+SyncBN)
#   kernels  per-kernel microbenchmarks (fusedrc-bench kernels)
#   conv     issue 4's benchmark: ResNet-50 conv+BN+ReLU shapes, batch 256, bf16, channels_last,
#            eager / checkpoint / fusedrc and every recompute-switch setting (benchmarks/gpu_conv_tradeoff.py)
#   conv_compile  the same shapes against torch.compile of the layer
#   tiles    candidate tile-table entries, dense (issue 3's GEMMs) and conv (batch 256), vs cuBLAS
#            and eager (benchmarks/gpu_tile_sweep.py)
#   sweep    the default memory-vs-speed sweep without torch.compile (images in channels_last)
#   models   issue 6's run: ResNet-50 at batch 256, bf16, channels_last, every convert strategy
#   opt      the OPT model (opt-125m's shape) at its default batch sizes
# Usage on the GPU machine, one 10-minute call per line (session 3's partial run: 384 tests in
# 156 s on 12 workers, so the suite alone takes most of a call):
#   FUSEDRC_GIT_COMMIT=<sha> FUSEDRC_GIT_DIRTY=0 bash benchmarks/gpu_session.sh "$OUT" tests
#   FUSEDRC_GIT_COMMIT=<sha> FUSEDRC_GIT_DIRTY=0 bash benchmarks/gpu_session.sh "$OUT" kernels tiles
#   FUSEDRC_GIT_COMMIT=<sha> FUSEDRC_GIT_DIRTY=0 bash benchmarks/gpu_session.sh "$OUT" conv sweep
#   FUSEDRC_GIT_COMMIT=<sha> FUSEDRC_GIT_DIRTY=0 bash benchmarks/gpu_session.sh "$OUT" models opt
set -u
out=${1:?results folder}
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests kernels conv sweep models opt)
w=$(mktemp -d)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$w/results" "$w/plots"
pack() { tar czf "$out/gpu.tgz" -C "$w" . ; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
opts=(--no-progress --results-dir "$w/results" --plots-dir "$w/plots")
for step in "${steps[@]}"; do
    echo "=== $step"
    case $step in
        tests)
            timeout 540 python3 -m pytest -q -n 12 -p no:cacheprovider -rA --maxfail=200 tests \
                --ignore=tests/test_inspect.py > "$w/pytest.log" 2>&1
            tail -25 "$w/pytest.log" | grep -v "^  File" ;;
        kernels) timeout 90 python3 -m fusedrc.bench kernels "${opts[@]}" 2>&1 | tail -14 ;;
        conv) timeout 420 python3 benchmarks/gpu_conv_tradeoff.py --switches --no-compile --out "$w/results" 2>&1 \
                  | tail -40 ;;
        conv_compile) timeout 400 python3 benchmarks/gpu_conv_tradeoff.py --out "$w/results" 2>&1 | tail -40 ;;
        # dense and conv apart: each writes its records even when its timeout stops it
        tiles) timeout 250 python3 benchmarks/gpu_tile_sweep.py --only dense --out "$w/results" 2>&1 | tail -70
               timeout 250 python3 benchmarks/gpu_tile_sweep.py --only conv --out "$w/results" 2>&1 | tail -50 ;;
        sweep) timeout 150 python3 -m fusedrc.bench --no-compile --channels-last "${opts[@]}" 2>&1 | tail -30 ;;
        models) timeout 400 python3 -m fusedrc.bench --workload resnet50 --batch-sizes 256 --channels-last \
                    --warmup 2 --repeats 5 "${opts[@]}" 2>&1 | tail -24 ;;
        opt) timeout 150 python3 -m fusedrc.bench --workload opt "${opts[@]}" 2>&1 | tail -24 ;;
        *) echo "unknown step $step" ;;
    esac
    pack
done
