"""The FFN step's floor against torch.utils.checkpoint, from committed GPU results (no GPU needed).

The fused FFN step runs checkpoint's seven GEMMs (DESIGN.md section 4) and drops its activation
passes, so however fast its epilogues are, it cannot take less than seven GEMMs' time. This script
estimates one GEMM of each ``fused_mlp`` shape from the same run's eager step (six GEMMs plus the
activation's forward and backward passes over the hidden tensor: read h, write act(h); read g_a and h,
write g_h) and prints, per result file and shape, the ratio to checkpoint that seven such GEMMs alone
would take, next to the measured ones. ``--bandwidth`` is the memory rate those passes are assumed to
run at (an H100 SXM's HBM3 peak is 3.35 TB/s).

    python benchmarks/ffn_floor.py [benchmarks/results/bench_kernels_cuda_*.json ...] [--bandwidth 3.0e12]
"""
from __future__ import annotations

import argparse
import glob
import json
import os

_ACT_PASSES = 5  # tensors of the hidden size the eager activation moves: h, act(h); g_a, h, g_h


def floor_rows(result, bandwidth):
    """One row per ``fused_mlp`` shape of a ``fusedrc-bench kernels`` result: the shape, the measured
    medians (s) of eager, checkpoint and fusedrc, the estimated GEMM time and the floor (seven GEMMs over
    checkpoint's step)."""
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[result["dtype"]]
    by_shape = {}
    for c in result["configs"]:
        if c["pattern"] == "fused_mlp" and "median_s" in c:
            by_shape.setdefault(json.dumps(c["shape"], sort_keys=True), {})[c["strategy"]] = c["median_s"]
    rows = []
    for key, t in by_shape.items():
        if not {"eager", "torch_checkpoint", "fusedrc"} <= set(t):
            continue
        shape = json.loads(key)
        passes_s = _ACT_PASSES * shape["M"] * shape["h"] * itemsize / bandwidth
        gemm_s = (t["eager"] - passes_s) / 6
        rows.append(dict(shape=shape, eager_s=t["eager"], checkpoint_s=t["torch_checkpoint"], fusedrc_s=t["fusedrc"],
                         gemm_s=gemm_s, floor=7 * gemm_s / t["torch_checkpoint"],
                         measured=t["fusedrc"] / t["torch_checkpoint"]))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="bench_kernels_cuda_*.json (default: every one committed)")
    ap.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s of the eager activation passes")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    files = args.files or sorted(glob.glob(os.path.join(here, "results", "bench_kernels_cuda_*.json")))
    rows = []
    for path in files:
        with open(path) as f:
            result = json.load(f)
        for r in floor_rows(result, args.bandwidth):
            rows.append(dict(r, file=os.path.basename(path), device=result["device"].get("name", "?")))
            s = r["shape"]
            print(f"{os.path.basename(path):40s} M={s['M']:6d} d={s['d']:5d} h={s['h']:6d}  "
                  f"eager {r['eager_s'] * 1e3:7.3f} ms  checkpoint {r['checkpoint_s'] * 1e3:7.3f} ms  "
                  f"fusedrc {r['measured']:.2f}x  one GEMM ~{r['gemm_s'] * 1e3:.3f} ms  floor {r['floor']:.2f}x")
    return rows


if __name__ == "__main__":
    main()
