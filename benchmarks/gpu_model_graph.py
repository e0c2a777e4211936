"""A real model's training step, eager and as a CUDA graph replay: how much of each strategy's
step is host time (Python, dispatch, kernel launches) rather than GPU time.

The ``models`` step of benchmarks/gpu_session.sh times ResNet-50 at batch 256 in eager mode. On
the H200 (2026-11-26) torch.utils.checkpoint on the 53 conv units took 88 ms and convert(all)
98 ms against the original's 54.5 ms, while a single layer step took checkpoint 1.5-2.4 ms where
eager took 0.3-1.7 ms: the recomputing strategies looked host-bound. Here each strategy's step
(``zero_grad`` + forward + loss + backward + ``SGD.step``, as ``fusedrc-bench``'s model runs) is
timed both ways: eager, and captured once in a CUDA graph (after warm-up steps on a side stream)
and replayed, which leaves only the GPU's time. A strategy whose capture fails (a host sync) is
recorded with its error. RNG-free models only (``no_rng_state_save``). convert(all) runs three
times: with the default conv path, with its strictly fused passes (``CONV_Z="triton"``) and with
direct launches (``kernels._common.DIRECT_LAUNCH``: its eager step against the default's is what
skipping Triton's JIT dispatch saves).

    python benchmarks/gpu_model_graph.py                       # resnet50, batch 256, bf16, channels_last
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib

import torch
import torch.utils.checkpoint as tuc

from fusedrc.bench import measure, models

# a model step takes tens of ms: do_bench's default 100 ms would time it once or twice
REP_MS = 1500


@contextlib.contextmanager
def no_rng_state_save():
    """Checkpointed regions save the CUDA RNG state in their forward (torch.utils.checkpoint's, as the
    ``torch_checkpoint*`` strategies and convert's checkpoint units call it, and fusedrc's generic
    regions, as ``convert(policy="blocks")`` runs them), which a graph capture refuses. ResNet-50
    draws no random numbers, so the save changes nothing there: it is turned off while a step is
    warmed up and captured (``preserve_rng_state=False``)."""
    rc = importlib.import_module("fusedrc.recompute")  # the module: fusedrc.recompute is the function
    saved = tuc.checkpoint, models.checkpoint, rc._ForwardState.__init__
    tuc.checkpoint = models.checkpoint = functools.partial(saved[0], preserve_rng_state=False)
    rc._ForwardState.__init__ = lambda self, flat, preserve: saved[2](self, flat, False)
    try:
        yield
    finally:
        tuc.checkpoint, models.checkpoint, rc._ForwardState.__init__ = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # RNG-free models only: the capture turns the checkpointed regions' RNG-state save off
    ap.add_argument("--workload", default="resnet50", choices=("resnet50",))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--nchw", action="store_true", help="image models in NCHW (default channels_last)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_model_graph.py needs a CUDA GPU")
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    measure.match_fp32_precision(dev)
    missing = models.require(args.workload)
    if missing:
        raise SystemExit(missing)
    wl = models.build(args.workload, dev, dtype, quick=False, channels_last=not args.nchw)
    skipped = []
    runners = models.runners_for(wl, args.batch, dev, dtype, budgets=(), skipped=skipped)
    records = []
    measure.interrupt_on_sigterm()  # the session's `timeout`: keep what was measured
    complete = False
    conv_kernels = importlib.import_module("fusedrc.kernels.conv_bn_act")
    common = importlib.import_module("fusedrc.kernels._common")
    # convert's model once more with the conv's strictly fused passes (the default takes z from
    # cuDNN for 16-bit operands on a GPU), and once with direct launches (fusedrc/kernels/_common.py,
    # opt-in: the plans' sites call the compiled binaries themselves): the switches are read at
    # each call, the model is the same
    runs = [(r, r.cfg.strategy, {}) for r in runners]
    runs += [(r, r.cfg.strategy + " " + name, sw) for r in runners if r.cfg.strategy == "convert_all"
             for name, sw in (("CONV_Z=triton", dict(CONV_Z="triton")), ("DIRECT_LAUNCH", dict(DIRECT_LAUNCH=True)))]
    try:
        for r, label, sw in runs:
            rec = dict(strategy=label, units=r.cfg.recomputed_units, blocks=r.cfg.recomputed_blocks, **sw)
            conv_sw = {k: v for k, v in sw.items() if k != "DIRECT_LAUNCH"}
            direct = sw.get("DIRECT_LAUNCH", common.DIRECT_LAUNCH)
            with measure.switches(conv_kernels, **conv_sw), measure.switches(common, DIRECT_LAUNCH=direct):
                try:
                    rec["eager_times_s"] = measure.do_bench_times(r.step, rep=REP_MS)
                except Exception as e:  # record and go on
                    rec["eager_error"] = f"{type(e).__name__}: {e}"[:400]
                try:
                    with no_rng_state_save():
                        graph = measure.capture_graph(r.step)
                    graph.replay()
                    rec["graph_times_s"] = measure.do_bench_times(graph.replay, rep=REP_MS)
                    del graph
                except Exception as e:
                    rec["graph_error"] = f"{type(e).__name__}: {e}"[:400]
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            records.append(rec)
            med = {k: measure.quantile(rec[f"{k}_times_s"], 0.5) * 1e3 for k in ("eager", "graph")
                   if f"{k}_times_s" in rec}
            base = next((x for x in records if x["strategy"] == "no_recompute"), None)
            rel = {k: med[k] / (measure.quantile(base[f"{k}_times_s"], 0.5) * 1e3) for k in med
                   if base is not None and f"{k}_times_s" in base}
            print(f"{args.workload} batch {args.batch} {label:24s} "
                  + "  ".join(f"{k} {med[k]:8.2f} ms (x{rel.get(k, float('nan')):4.2f} original)" for k in med)
                  + f"  {rec.get('eager_error', '')}{rec.get('graph_error', '')}", flush=True)
        complete = True
    except KeyboardInterrupt:
        print(f"interrupted: writing the {len(records)} records measured so far", flush=True)
    finally:
        name = measure.write_results(
            args.out, f"model_graph_{args.workload}_cuda", "model_graph", dev, dtype=args.dtype,
            workload=args.workload, batch=args.batch, memory_format="NCHW" if args.nchw else "channels_last",
            step="zero_grad + forward + " + wl.loss_desc + " + backward + SGD.step", rep_ms=REP_MS,
            complete=complete,
            skipped=skipped, records=records)
        print("wrote", name)


if __name__ == "__main__":
    main()
