"""Where a fused step's time goes on a GPU: torch.profiler over a few steps of each pattern.

Prints, per pattern and strategy (and, for the conv pattern, fusedrc under two of its switches:
z from cuDNN, one recompute pass plus a z buffer), the GPU kernels (self CUDA time) and the
CPU-side wall time per step, so launch/dispatch overhead shows next to kernel time. Conv shapes
run channels_last, as benchmarks/gpu_conv_tradeoff.py and the ResNet runs do (``--nchw``: not).

    python benchmarks/gpu_profile.py [--dtype bfloat16] [--only conv] [--nchw]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import fusedrc
from fusedrc.bench import kernels as bk
from fusedrc.bench import measure

SHAPES = {
    "linear_act": dict(M=8192, K=4096, N=16384),
    "fused_mlp": dict(M=8192, d=4096, h=16384),
    "conv_bn_act": dict(N=32, C=64, K=64, H=56, W=56, k=3),
    "conv_bn_act_small": dict(N=32, C=512, K=512, H=7, W=7, k=3),
    # batch 256, where the H200 run (2026-11-26) measured 1.2-1.3x checkpoint per layer
    "conv_bn_act_b256": dict(N=256, C=64, K=64, H=56, W=56, k=3),
    "conv_bn_act_b256_small": dict(N=256, C=512, K=512, H=7, W=7, k=3),
}


# fusedrc's conv switches profiled besides the default (fusedrc/kernels/conv_bn_act.py; for 16-bit operands
# on a GPU, z from cuDNN with elementwise passes): the strictly fused passes, and one recompute pass
# plus a transient z
CONV_VARIANTS = [("CONV_Z=triton", dict(CONV_Z="triton")),
                 ("CONV_Z=triton BWD_RECOMPUTE_TWICE=False", dict(CONV_Z="triton", BWD_RECOMPUTE_TWICE=False))]


def _runs(pattern):
    """(label, strategy, conv switches) of each profiled run of a pattern."""
    runs = [(s, s, {}) for s in bk.STRATEGIES]
    if pattern == "conv_bn_act":
        runs += [(f"fusedrc {label}", "fusedrc", sw) for label, sw in CONV_VARIANTS]
    return runs


def _profile(case, strategy):
    """(enqueue s/step, wall s/step, GPU kernel ms/step, key averages) of a few steps."""
    for _ in range(3):
        case.step(strategy)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        case.step(strategy)
    cpu = (time.perf_counter() - t0) / 5
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            case.step(strategy)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    # kernel rows only: an op row (aten::mm, fusedrc::...) repeats its kernels' time
    gpu = sum(e.self_device_time_total for e in ka
              if e.device_type == DeviceType.CUDA and e.self_device_time_total) / 3 / 1e3
    return cpu, wall, gpu, ka


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--only", default="", help="profile the shapes whose name starts with this (e.g. conv)")
    ap.add_argument("--nchw", action="store_true", help="conv shapes in NCHW (default: channels_last, as "
                                                         "gpu_conv_tradeoff.py and the ResNet runs)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    from fusedrc.kernels import conv_bn_act as ck

    with fusedrc.use_backend("triton"):
        for name, shape in SHAPES.items():
            if not name.startswith(args.only):
                continue
            pattern = name.removesuffix("_small").removesuffix("_b256")
            case = bk._Case(pattern, shape, dev, dtype, "triton")
            if pattern == "conv_bn_act" and not args.nchw:
                case.block.to(memory_format=torch.channels_last)
                case.x = case.x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
                case.grad = case.grad.contiguous(memory_format=torch.channels_last)
            for label, strategy, switches in _runs(pattern):
                with measure.switches(ck, **switches):
                    cpu, wall, gpu, ka = _profile(case, strategy)
                print(f"=== {name} {shape} {label}: enqueue {cpu * 1e3:.3f} ms/step, wall {wall * 1e3:.3f} ms/step, "
                      f"GPU kernels {gpu:.3f} ms/step", flush=True)
                print(ka.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
