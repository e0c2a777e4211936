"""Conv2d+BN+ReLU on a GPU: the recompute switches of kernels/conv_bn_act.py, measured.

DESIGN §4 leaves two choices to measurement:
  * forward: a transient z buffer (FWD_RECOMPUTE=False) or running the conv twice;
  * backward: two recompute passes (BWD_RECOMPUTE_TWICE=True) or one pass plus a
    transient z buffer;
and CONV_GRAD picks Triton or aten (cuDNN) for dX/dW. This script times forward +
backward (``triton.testing.do_bench``) and the step's peak memory above the inputs
for every combination on ResNet-50 layer shapes, next to eager and
torch.utils.checkpoint, and writes one JSON file with the raw timings.

    python benchmarks/gpu_conv_tradeoff.py --out benchmarks/results
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
from pathlib import Path

import torch

import fusedrc
from fusedrc.bench import kernels as bk
from fusedrc.bench import measure

# ResNet-50 at 224 px, batch 32: the 3x3 convs of the four stages and a 1x1.
SHAPES = [
    dict(N=32, C=64, K=64, H=56, W=56, k=3),
    dict(N=32, C=128, K=128, H=28, W=28, k=3),
    dict(N=32, C=256, K=256, H=14, W=14, k=3),
    dict(N=32, C=512, K=512, H=7, W=7, k=3),
    dict(N=32, C=256, K=64, H=56, W=56, k=1),
]


def _times(fn):
    from triton.testing import do_bench

    try:
        return [t / 1e3 for t in do_bench(fn, warmup=25, rep=100, return_mode="all")]
    except TypeError:
        return [t / 1e3 for t in do_bench(fn, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])]


def _peak(case, strategy):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    case.step(strategy)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    import importlib

    k = importlib.import_module("fusedrc.kernels.conv_bn_act")
    default = (k.FWD_RECOMPUTE, k.BWD_RECOMPUTE_TWICE, k.CONV_GRAD)
    records = []
    with fusedrc.use_backend("triton"):
        for shape in SHAPES:
            case = bk._Case("conv_bn_act", shape, dev, dtype, "triton")
            for s in ("eager", "torch_checkpoint"):
                records.append(dict(shape=shape, strategy=s, times_s=_times(lambda: case.step(s)),
                                    peak_bytes=_peak(case, s)))
            for fwd_rc, bwd_twice, grad in itertools.product((False, True), (True, False), ("triton", "aten")):
                k.FWD_RECOMPUTE, k.BWD_RECOMPUTE_TWICE, k.CONV_GRAD = fwd_rc, bwd_twice, grad
                try:
                    t = _times(lambda: case.step("fusedrc"))
                    rec = dict(times_s=t, peak_bytes=_peak(case, "fusedrc"))
                except Exception as e:  # record and go on: one failing variant must not hide the rest
                    rec = dict(error=f"{type(e).__name__}: {e}"[:500])
                records.append(dict(shape=shape, strategy="fusedrc", FWD_RECOMPUTE=fwd_rc,
                                    BWD_RECOMPUTE_TWICE=bwd_twice, CONV_GRAD=grad, **rec))
            k.FWD_RECOMPUTE, k.BWD_RECOMPUTE_TWICE, k.CONV_GRAD = default
            for r in records[-10:]:
                med = measure.quantile(r["times_s"], 0.5) * 1e3 if "times_s" in r else float("nan")
                tag = r["strategy"] + ("" if r["strategy"] != "fusedrc" else
                                       f" fwd_rc={r['FWD_RECOMPUTE']} twice={r['BWD_RECOMPUTE_TWICE']} grad={r['CONV_GRAD']}")
                print(f"{shape} {tag:55s} {med:8.3f} ms  peak {r.get('peak_bytes', 0) / 2**20:8.1f} MiB "
                      f"{r.get('error', '')}", flush=True)
    doc = dict(kind="conv_tradeoff", timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, python=platform.python_version(),
               commit=measure.git_info()[0],
               dtype=args.dtype, defaults=dict(zip(("FWD_RECOMPUTE", "BWD_RECOMPUTE_TWICE", "CONV_GRAD"), default)),
               records=records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = out / f"conv_tradeoff_cuda_{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}.json"
    name.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", name)


if __name__ == "__main__":
    main()
