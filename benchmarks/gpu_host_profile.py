"""Where an eager training step's host time goes, function by function (cProfile), for a real model.

On an H100 (2026-11-27) the eager ResNet-50 step under ``convert(policy="all")`` took 99.7 ms
against 65.8 ms as a CUDA graph replay: the host, not the GPU, set its pace. torch.profiler's
tables (benchmarks/gpu_profile.py) name the aten ops but lump fusedrc's Python, Triton's JIT
dispatch and the launches into each op's "self CPU". This script runs a few eager steps of each
strategy under cProfile and prints the functions that took the most host time, by their own
time and by their cumulative time, so that the Python worth cutting can be named: Triton's
``JITFunction.run`` against ``DirectLaunch.__call__``, the launchers, argument checks, autograd
glue, aten calls.

At a small batch (32: the GPU's work per step is short) the step is host-bound, and its time is the
host's. cProfile slows Python down (about 1.5-2x); the ratios between strategies and between
functions are what to read. Every profiled row is written to
``benchmarks/results/host_profile_<workload>_<device>_<time>.json``.

    python benchmarks/gpu_host_profile.py [--batch 32] [--steps 10] [--top 30]

On a machine without a GPU it runs on the CPU (``--smoke``: ResNet-50 at 32 px, batch 2, fp32, the
backend's default there): a check of the script, not a measurement.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import time

import torch

from fusedrc.bench import measure, models


def _rows(stats: pstats.Stats, steps: int):
    """Every profiled function: (where, calls per step, own ms per step, cumulative ms per step)."""
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = f"{file.rsplit('site-packages/', 1)[-1]}:{line}({name})"
        rows.append(dict(function=where, calls_per_step=ncalls / steps, own_ms_per_step=tottime * 1e3 / steps,
                         cumulative_ms_per_step=cumtime * 1e3 / steps))
    return rows


def _print_top(label, rows, top):
    for key, title in (("own_ms_per_step", "own time"), ("cumulative_ms_per_step", "cumulative time")):
        print(f"--- {label}: top {top} by {title} (ms per step, calls per step)")
        for r in sorted(rows, key=lambda r: -r[key])[:top]:
            print(f"{r[key]:9.3f} {r['calls_per_step']:8.1f}  {r['function']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="resnet50", choices=("resnet50",))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="profiled steps per strategy (after 3 warm-up steps)")
    ap.add_argument("--top", type=int, default=30, help="functions printed per table")
    ap.add_argument("--smoke", action="store_true", help="ResNet-50 at 32 px on the CPU: checks the script runs")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    workload = args.workload
    if cuda:
        measure.match_fp32_precision(dev)
    missing = models.require(workload)
    if missing:
        raise SystemExit(missing)
    wl = models.build(workload, dev, dtype, quick=args.smoke, channels_last=cuda)
    batch = 2 if args.smoke else args.batch
    runners = {r.cfg.strategy: r for r in models.runners_for(wl, batch, dev, dtype, budgets=(), skipped=[])}
    common = importlib.import_module("fusedrc.kernels._common")
    runs = [("no_recompute", runners["no_recompute"], False), ("torch_checkpoint", runners["torch_checkpoint"], False),
            ("convert_all", runners["convert_all"], False)]
    if cuda:  # direct launches skip Triton's JIT dispatch: compiled binaries only
        runs.append(("convert_all DIRECT_LAUNCH", runners["convert_all"], True))
    records = []
    measure.interrupt_on_sigterm()
    try:
        for label, r, direct in runs:
            with measure.switches(common, DIRECT_LAUNCH=direct):
                for _ in range(3):
                    r.step()
                if cuda:
                    torch.cuda.synchronize()
                prof = cProfile.Profile()
                t0 = time.perf_counter()
                prof.enable()
                for _ in range(args.steps):
                    r.step()
                if cuda:
                    torch.cuda.synchronize()
                prof.disable()
                wall = (time.perf_counter() - t0) / args.steps
            rows = _rows(pstats.Stats(prof), args.steps)
            records.append(dict(strategy=label, direct_launch=direct, wall_ms_per_step_profiled=wall * 1e3, rows=rows))
            print(f"=== {workload} batch {batch} {label}: {wall * 1e3:.2f} ms per step under cProfile", flush=True)
            _print_top(label, rows, args.top)
    except KeyboardInterrupt:
        print(f"interrupted: writing the {len(records)} strategies profiled so far", flush=True)
    finally:
        path = measure.write_results(args.out, f"host_profile_{workload}_{dev.type}", "host_profile", dev,
                                     dtype=str(dtype).removeprefix("torch."), workload=workload, batch=batch,
                                     steps=args.steps, smoke=args.smoke, records=records)
        print("wrote", path)


if __name__ == "__main__":
    main()
