#!/usr/bin/env bash
# GPU session steps, each under its own time limit; results are written to a work folder and
# packed into $1/gpu.tgz after each step (and on exit), the pytest log copied to $1/pytest.log.
#   tests    the test suite (CUDA-only tests included: compiled triton_op twins, AMP, DDP+SyncBN), less
#            the files that never touch CUDA (reference, docs, examples, inspect: CI's; FUSEDRC_ALL_TESTS=1 keeps them);
#            FUSEDRC_TEST_WORKERS (default 12) overrides the worker count; FUSEDRC_TEST_FILES (node ids,
#            space-separated) runs only those
#   kernels  per-kernel microbenchmarks (fusedrc-bench kernels; with norm_gated_mlp: Llama's RMSNorm run
#            inside the gated FFN op: 1.21x checkpoint on the H100 of 2026-11-27 as aten ops, 0.98x/1.01x
#            with the row kernels of fusedrc/kernels/rms_norm.py later that day)
#   conv     issue 4's benchmark: ResNet-50 conv+BN+ReLU shapes, batch 256, bf16, channels_last,
#            eager / checkpoint / fusedrc and every recompute-switch setting (benchmarks/gpu_conv_tradeoff.py)
#   conv_graph  the same shapes as CUDA graph replays (GPU time: eager layer steps there are host-bound),
#            fusedrc's default (z from cuDNN for 16-bit operands), CONV_Z=triton (the strictly fused
#            passes) and CONV_Z=triton with BWD_RECOMPUTE_TWICE=False
#   conv_compile  the same shapes against torch.compile of the layer
#   conv_grouped  the grouped/depthwise conv shapes (EfficientNet-B0, ResNeXt-50/101, RegNetY): the default
#            (reference path / per-group GEMM) against the opt-in DIRECT kernels
#   gated    the gated FFN's dual-kernel tile candidates only (gpu_tile_sweep.py --only gated)
#   dense    the dense kernels' table entry and the first two candidates (the entries it replaced), on
#            issue 3's four GEMM shapes (gpu_tile_sweep.py --only dense --first 2)
#   tiles    issue 3's FFN steps under each dense launch switch (pointer/TMA loads, per-tile/persistent
#            programs) vs eager and checkpoint; then candidate tile-table entries, dense (issue 3's
#            GEMMs), the gated FFN's dual kernels and conv (batch 256), vs cuBLAS and eager
#            (benchmarks/gpu_tile_sweep.py)
#   sweep    the default memory-vs-speed sweep without torch.compile (images in channels_last)
#   models   issue 6's run: ResNet-50 at batch 256, bf16, channels_last, every convert strategy
#   models_graph  ResNet-50 at batch 256: each strategy's step eager and as a CUDA graph replay
#            (benchmarks/gpu_model_graph.py: how much of the step is host time)
#   opt      the OPT model (opt-125m's shape) at its default batch sizes
#   mixtral  a Mixtral (hidden 1024, 8 layers, 8 experts of 3584, top-2): the routed-experts op in a model
#   bert     BertForMaskedLM at bert-base's shape: the FFN split over BertIntermediate/BertOutput, fused
#   profile  torch.profiler over the conv pattern (batch 32 and 256): host enqueue vs GPU kernel time
#   host_profile  cProfile over eager ResNet-50 steps at batch 32 (host-bound): the functions the host time
#            goes to, for the original, checkpoint, convert(all) and convert(all) with direct launches
#            (benchmarks/gpu_host_profile.py)
#   models_mobile  EfficientNet-B0 at batch 256, bf16, channels_last (its depthwise convs on the reference path)
#   densenet DenseNet-121 at batch 64, bf16, channels_last: the pre-activation BN-ReLU-Conv units (bn_act_conv)
#   lora     LoRA fine-tuning's FFN sublayer (benchmarks/lora_mlp.py: Llama-2 7B's RMSNorm + MLP, 8192 tokens, bf16,
#            all-linear adapters r=16 in fp32, dropout 0.05): PEFT's eager computation, checkpoint, fusedrc
# Usage on the GPU machine, one 10-minute call per line (2026-11-27, H100: tests reached 1003 of
# ~1290 in 240 s on 14 workers; conv_graph ~95 s, models_graph ~50 s, tiles 4 x 45 s (each cut),
# profile 50 s, mixtral 67 s, kernels 61 s; the machine's start ~30 s). Commit first: the device tool
# ships the working tree, and FUSEDRC_GIT_DIRTY=0 claims it is that commit, unmodified.
# Every step runs under `timeout -k 30`: SIGTERM lets a script write what it measured, and a
# step hung in a CUDA call that never returns is killed 30 s later.
# A session has 15 device minutes (900 s), machine start and transfers included; a warm machine
# is given back 30 s after a call, so have the next call ready. The device tool stops a call at
# 600 s: keep one call's step limits (plus their -k grace) under it, and all calls of a session
# under ~800 s. Done 2026-11-27 15:42-16:20 (H100): models_graph models gated kernels in one call (230 s),
# then three test runs of chosen files (60, 215 with kernels, 190 s). Next:
#   session 1, call 1 (<= 330 s): FUSEDRC_DIRECT_LAUNCH=1 FUSEDRC_TEST_WORKERS=14 FUSEDRC_TIMEOUT_TESTS=280
#            FUSEDRC_TEST_FILES="tests/test_direct_launch.py tests/test_kernels_conv.py tests/test_kernels_bn_act_conv.py
#            tests/test_bn_act_conv.py tests/test_launch_plans.py tests/test_cuda_graphs.py tests/test_triton_path.py
#            tests/test_kernels_dense.py tests/test_kernels_gated.py"
#            ... "$OUT" tests: the opt-in direct launches of session 30 (never run on a GPU) under every conv
#            test, each test's second and later launches of a layer going direct (test_direct_launch
#            compares bits with them off and on); if it passes, DIRECT_LAUNCH's default can turn on. And the
#            dense kernels' new sm_90 large entry (session 31: 256x128, epilogues in eighths, never run on a
#            GPU; test_large_table_entry_runs) and the gated kernels that no longer derive from it
#   session 1, call 2 (<= 460 s): FUSEDRC_TIMEOUT_KERNELS=80 FUSEDRC_TIMEOUT_DENSE=120 FUSEDRC_TIMEOUT_MODELS_GRAPH=130
#            FUSEDRC_TIMEOUT_HOST_PROFILE=100 ... "$OUT" kernels dense models_graph host_profile: the FFN steps
#            against checkpoint (issue 3's 0.95x / 0.85x targets) and the dense GEMMs against cuBLAS (>= 80%)
#            under the 256x128 entry, with the 128x128 entry it replaced beside it (revert the table's
#            ("sm90", "16bit", "large") entry in fusedrc/kernels/_common.py if it loses); then the eager ResNet-50
#            step against its CUDA graph since the conv ops' launch plans and checked-call cache (session 29;
#            99.7 ms eager / 65.8 ms graph before) and the one-launch running-statistics update (session 30),
#            with and without direct launches (if call 1's test_direct_launch passed: the default could turn
#            on); where the eager step's host time goes, function by function; the conv pattern's host
#            enqueue time (the profile step, 120 s, and conv_grouped, 150 s, in a later call)
#   session 2: test_convert (cut at 125 of 164 on 2026-11-27; its two fixes for transformers 5.17 were
#            checked on the CPU only) with the default settings, and test_moe.py (session 34: the experts op's
#            skipped choices, up projections apart and SwiGLU limits, and the gated kernels' LIMIT epilogues
#            in test_kernels_gated.py's clamp tests, never run on a GPU; session 35: the experts' biases and
#            interleaved rows (INTERLEAVED: one operand split after the main loop), gpt-oss's, Beam's and
#            Inkling2's experts, the softcaps' GATE_CAP/UP_CAP epilogues and the kernels' tanh helper; session 36:
#            g_hg/g_hu in the weights' row order (GH_HALVES, the INTERLEAVED store through tl.interleave) with dX
#            and dW_gate_up one GEMM each, the stacked gradients laid out as the weights, and the dense grad
#            kernel's ROW_SCALE epilogue for ungated experts), then the kernels step's gpt-oss-20b experts case
#            (interleaved transposed weights, biases, its gate; compare its backward with session 35's layout:
#            git stash or checkout 35e0936 for the before figure); session 37: the grouped experts (GROUPED in
#            both dual kernels, torch._grouped_mm for the plain GEMMs: test_moe.py's grouped tests on real
#            kernels first), then "kernels kernels_per_expert": grouped against per-expert launches; session 38:
#            ungated experts grouped too (GROUPED in the dense kernels, always one program per tile; the kernels
#            step's new Nemotron-3-Nano case, 128 squared-ReLU experts of 1856, top-6) and a down bias's gradients
#            in chunks of whole experts (test_moe.py's grouped tests again); session 39: tests/test_compile.py
#            (the gated FFN and test_compile._More compiled under inductor through the triton_op twins, which
#            torch's mutation analysis rejected for the gated FFN before; never run on a GPU); session 40:
#            tests/test_mix_ffn.py and test_convert.py -k mix_ffn (the Mix-FFN's three kernels, never run on a
#            GPU), then the kernels step's mix_ffn cases (SegFormer-B2 stage 1 and 3; if the grad kernel loses to
#            eager's elementwise passes, try _GPU_TILE (32, 64, 4) / (64, 128, 8) and _GPU_GRAD_TILE (since
#            session 42 256 x 16: fewer weight partials; against 64 x 64) in fusedrc/kernels/mix_ffn.py);
#            tests/test_xielu_mlp.py and test_convert.py -k apertus, then the kernels step's xielu_mlp case
#            (Apertus-8B's MLP: xIELU in the dense kernels' epilogues since session 41, never run on a GPU;
#            the narrow tile on sm_90's large bucket, against the table's 256x128 that spilled);
#            session 41: test_convert.py -k "rwkv or glm or gemma4" (RWKV's channel mix, GLM's vision mergers,
#            Gemma 4's vision MLP on the Triton backend); session 42: test_convert.py -k "inline_ffn or
#            pixel_decoder or bart" (BART's activation_dropout as the fused op's dropout, Mask2Former's F.relu),
#            test_kernels_dense.py -k "large_table_entry or wide_tile" (the 256x128 grad kernel adding its bias
#            per epilogue slice, SLICE_BIAS: fewer registers, never run on a GPU) and test_mix_ffn.py (the grad
#            kernel's 256 x 16 tile); session 43: tests/test_lora.py (LoRA adapters' terms in the dual kernels'
#            tiles, the LORA rank loop and _lora_dropout_kernel, never compiled for a GPU but by inspect), then
#            the lora step: Llama-2 7B's norm + MLP with all-linear LoRA r=16, dropout 0.05, against PEFT's eager
#            computation and checkpoint (if fusedrc loses, time LoRA launches on the halved tile, as dropout's)
#   a later session: FUSEDRC_TIMEOUT_MODELS_MOBILE=150 ... models_mobile; then opt bert densenet sweep
#            (FUSEDRC_TIMEOUT_BERT=150, FUSEDRC_TIMEOUT_DENSENET=200)
# each as FUSEDRC_GIT_COMMIT=<sha> FUSEDRC_GIT_DIRTY=0 ... bash benchmarks/gpu_session.sh.
# (Every script here writes what it measured when its timeout's SIGTERM arrives.) A step's limit
# can be set for one call, e.g. FUSEDRC_TIMEOUT_TESTS=300 (each of the tiles step's four parts takes it).
set -u
out=${1:?results folder}
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests kernels conv sweep models opt)
# The device tool returns at most 8 files from its $OUT: work in a folder beside it and return
# the archive (packed after every step) and the pytest log.
w=${FUSEDRC_SESSION_WORK:-/tmp/fusedrc-session}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$w/results" "$w/plots"
# to a temporary name, then renamed: a call killed mid-pack keeps the previous archive
pack() { tar czf "$out/.gpu.tgz.part" -C "$w" . && mv "$out/.gpu.tgz.part" "$out/gpu.tgz"; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# a step's time limit, FUSEDRC_TIMEOUT_<STEP> (seconds) overriding its default
limit() { local v="FUSEDRC_TIMEOUT_${1^^}"; echo "${!v:-$2}"; }
opts=(--no-progress --results-dir "$w/results" --plots-dir "$w/plots")
for step in "${steps[@]}"; do
    echo "=== $step"
    case $step in
        tests)
            # SIGINT: pytest stops and still prints its summary of failures
            # the files only a GPU can check first: xdist hands tests out in collection order, so a
            # run cut by its timeout has covered the kernels (test_inspect compiles AOT: CPU work)
            # (2026-11-27, H100: the kernels files passed; compile and cuda_graphs were cut, so they go first)
            first=(compile cuda_graphs triton_path amp_cuda kernels_conv kernels_dense kernels_gated moe amp distributed
                   output_mask dropout properties nn api recompute bad_input convert)
            files=()
            for f in "${first[@]}"; do files+=("tests/test_$f.py"); done
            # files that never touch CUDA (CI runs them) are left out unless FUSEDRC_ALL_TESTS=1
            cpu_only=" tests/test_inspect.py tests/test_reference.py tests/test_docs.py tests/test_examples.py "
            [ "${FUSEDRC_ALL_TESTS:-0}" = 1 ] && cpu_only=" tests/test_inspect.py "
            for f in tests/test_*.py; do
                case " ${files[*]} $cpu_only" in *" $f "*) ;; *) files+=("$f") ;; esac
            done
            # FUSEDRC_TEST_FILES (pytest node ids, space-separated): only those, e.g. what a session changed
            [ -n "${FUSEDRC_TEST_FILES:-}" ] && read -r -a files <<< "$FUSEDRC_TEST_FILES"
            timeout -s INT -k 30 $(limit tests 500) python3 -m pytest -q -n "${FUSEDRC_TEST_WORKERS:-12}" \
                -p no:cacheprovider -rA --maxfail=200 --durations=25 "${files[@]}" > "$w/pytest.log" 2>&1
            cp "$w/pytest.log" "$out/pytest.log"
            tail -25 "$w/pytest.log" | grep -v "^  File" ;;
        kernels) timeout -k 30 $(limit kernels 150) python3 -m fusedrc.bench kernels "${opts[@]}" 2>&1 | tail -14 ;;
        # the same with the routed experts launched per expert (session 37 made grouped launches the default):
        # compare the moe_experts rows, above all Qwen3-MoE's 128 experts of 768
        kernels_per_expert) FUSEDRC_GROUPED_EXPERTS=0 timeout -k 30 $(limit kernels_per_expert 150) \
                                python3 -m fusedrc.bench kernels "${opts[@]}" 2>&1 | tail -14 ;;
        conv) timeout -k 30 $(limit conv 360) python3 benchmarks/gpu_conv_tradeoff.py --switches --no-compile --out "$w/results" 2>&1 \
                  | tail -40 ;;
        # the same layers' GPU time: each step a CUDA graph replay (no host overhead in it)
        conv_graph) timeout -k 30 $(limit conv_graph 200) python3 benchmarks/gpu_conv_tradeoff.py --cuda-graph --few-switches \
                        --no-compile --out "$w/results" 2>&1 | tail -40 ;;
        conv_compile) timeout -k 30 $(limit conv_compile 400) python3 benchmarks/gpu_conv_tradeoff.py --out "$w/results" 2>&1 | tail -40 ;;
        conv_grouped) timeout -k 30 $(limit conv_grouped 250) python3 benchmarks/gpu_conv_tradeoff.py --shapes grouped --switches --no-compile \
                          --out "$w/results" 2>&1 | tail -40 ;;
        # dense and conv apart: each writes its records even when its timeout stops it
        # the gated FFN's dual-kernel candidates alone (the sm_90 table's 128x128 split-4 entry, new 2026-11-27, untimed)
        gated) timeout -k 20 $(limit gated 100) python3 benchmarks/gpu_tile_sweep.py --only gated --out "$w/results" 2>&1 | tail -30 ;;
        # the dense kernels' table entry against the two tiles it replaced (sm_90 large: 256x128 in eighths
        # since 2026-11-28), on every dense shape of issue 3
        dense) timeout -k 20 $(limit dense 150) python3 benchmarks/gpu_tile_sweep.py --only dense --first 2 \
                   --out "$w/results" 2>&1 | tail -20 ;;
        tiles) timeout -k 20 $(limit tiles 200) python3 benchmarks/gpu_tile_sweep.py --only ffn --out "$w/results" 2>&1 | tail -20
               timeout -k 20 $(limit tiles 200) python3 benchmarks/gpu_tile_sweep.py --only dense --out "$w/results" 2>&1 | tail -70
               timeout -k 20 $(limit tiles 100) python3 benchmarks/gpu_tile_sweep.py --only gated --out "$w/results" 2>&1 | tail -24
               timeout -k 20 $(limit tiles 200) python3 benchmarks/gpu_tile_sweep.py --only conv --out "$w/results" 2>&1 | tail -50 ;;
        sweep) timeout -k 30 $(limit sweep 150) python3 -m fusedrc.bench --no-compile --channels-last "${opts[@]}" 2>&1 | tail -30 ;;
        models) timeout -k 30 $(limit models 400) python3 -m fusedrc.bench --workload resnet50 --batch-sizes 256 --channels-last \
                    --warmup 2 --repeats 5 "${opts[@]}" 2>&1 | tail -24 ;;
        # ResNet-50's strategies again, each step eager and as a CUDA graph replay (host time vs GPU time)
        models_graph) timeout -k 30 $(limit models_graph 200) python3 benchmarks/gpu_model_graph.py --out "$w/results" 2>&1 \
                          | tail -12 ;;
        opt) timeout -k 30 $(limit opt 150) python3 -m fusedrc.bench --workload opt "${opts[@]}" 2>&1 | tail -24 ;;
        mixtral) timeout -k 30 $(limit mixtral 200) python3 -m fusedrc.bench --workload mixtral "${opts[@]}" 2>&1 | tail -24 ;;
        bert) timeout -k 30 $(limit bert 150) python3 -m fusedrc.bench --workload bert "${opts[@]}" 2>&1 | tail -24 ;;
        # host vs GPU time of the conv pattern, kernel by kernel (torch.profiler tables: is a layer
        # host-bound? which of fusedrc's passes costs what next to checkpoint's kernels?)
        profile) timeout -k 30 $(limit profile 120) python3 benchmarks/gpu_profile.py --only conv \
                     > "$w/results/profile_conv.log" 2>&1; grep "^===" "$w/results/profile_conv.log" ;;
        host_profile) timeout -k 30 $(limit host_profile 120) python3 benchmarks/gpu_host_profile.py --out "$w/results" \
                          > "$w/results/host_profile.log" 2>&1; grep "^===" "$w/results/host_profile.log" ;;
        models_mobile) timeout -k 30 $(limit models_mobile 250) python3 -m fusedrc.bench --workload efficientnet_b0 --batch-sizes 256 \
                           --channels-last --warmup 2 --repeats 5 "${opts[@]}" 2>&1 | tail -24 ;;
        # DenseNet-121: the pre-activation units (bn_act_conv; never run on a GPU before this step)
        densenet) timeout -k 30 $(limit densenet 250) python3 -m fusedrc.bench --workload densenet121 --batch-sizes 64 \
                      --channels-last --warmup 2 --repeats 5 "${opts[@]}" 2>&1 | tail -24 ;;
        lora) timeout -k 30 $(limit lora 120) python3 benchmarks/lora_mlp.py --out "$w/results" 2>&1 | tail -6 ;;
        *) echo "unknown step $step" ;;
    esac
    pack
done
