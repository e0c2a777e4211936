"""Conv2d+BN+ReLU on a GPU: ResNet-50's layer shapes, every strategy, one JSON file.

Issue 4's benchmark: each distinct Conv2d -> BatchNorm2d -> ReLU shape of ResNet-50
(the stem, then the 1x1 / 3x3 / strided convs of the four stages), one training step
of the layer (forward + backward with a given output gradient), against eager
PyTorch (cuDNN), ``torch.utils.checkpoint`` and ``torch.compile`` of the same layer;
and, with ``--switches``, every setting of fusedrc/kernels/conv_bn_act.py's recompute
switches (FWD_RECOMPUTE x BWD_RECOMPUTE_TWICE with cuDNN's dX/dW, the Triton dX/dW once, z from
cuDNN (CONV_Z="aten"), and the "auto" settings). Times come from
``triton.testing.do_bench`` (every raw timing is written), memory is the step's peak
allocated bytes above what was allocated before it. ``--cuda-graph`` times each step as the
replay of a CUDA graph it was captured in: the GPU's time with no host overhead (a layer step at
these sizes looks host-bound in eager mode: H200, 2026-11-26, the 15 layers after the stem:
checkpoint 1.48-2.44 ms where eager took 0.33-1.65 ms, fusedrc with cuDNN's dX/dW 1.59-2.96 ms
whatever its other switches).

``--shapes grouped``: the grouped convs instead: EfficientNet-B0's depthwise Conv-BN-SiLU
layers and ResNeXt-50 32x4d's grouped 3x3 Conv-BN-ReLU, ResNeXt-101 32x8d's last stage and
RegNetY-16GF's 112-wide groups (the implicit GEMM per group); each with the library's
``DIRECT_MAX_GROUP_CHANNELS`` (0: every grouping with a multiple of 16 output channels per
group on the per-group GEMM, the rest on the reference path) and with the other setting (32:
the opt-in DIRECT kernels up to 32 channels per group).

    python benchmarks/gpu_conv_tradeoff.py                    # batch 256, bf16, channels_last
    python benchmarks/gpu_conv_tradeoff.py --batch 32 --nchw --switches --no-compile
    python benchmarks/gpu_conv_tradeoff.py --shapes grouped --no-compile
    python benchmarks/gpu_conv_tradeoff.py --cuda-graph --few-switches --no-compile  # GPU time only
    python benchmarks/gpu_conv_tradeoff.py --summarize benchmarks/results/conv_tradeoff_cuda_<time>.json
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fusedrc
from fusedrc.bench import measure

# (C_in, C_out, kernel, stride, H=W of the input) of ResNet-50 at 224 px
SHAPES = [
    (3, 64, 7, 2, 224),      # stem
    (64, 64, 1, 1, 56), (64, 64, 3, 1, 56), (256, 64, 1, 1, 56),
    (256, 128, 1, 1, 56), (128, 128, 3, 2, 56), (128, 128, 3, 1, 28), (512, 128, 1, 1, 28),
    (512, 256, 1, 1, 28), (256, 256, 3, 2, 28), (256, 256, 3, 1, 14), (1024, 256, 1, 1, 14),
    (1024, 512, 1, 1, 14), (512, 512, 3, 2, 14), (512, 512, 3, 1, 7), (2048, 512, 1, 1, 7),
]
# (C_in, C_out, kernel, stride, H=W, groups, activation) at 224 px: EfficientNet-B0's depthwise
# layers (one per distinct shape), then ResNeXt-50 32x4d's grouped 3x3 convs (4 to 32 channels per group)
GROUPED_SHAPES = [
    (32, 32, 3, 1, 112, 32, "silu"), (96, 96, 3, 2, 112, 96, "silu"), (144, 144, 3, 1, 56, 144, "silu"),
    (144, 144, 5, 2, 56, 144, "silu"), (240, 240, 5, 1, 28, 240, "silu"), (240, 240, 3, 2, 28, 240, "silu"),
    (480, 480, 3, 1, 14, 480, "silu"), (672, 672, 5, 2, 14, 672, "silu"), (1152, 1152, 5, 1, 7, 1152, "silu"),
    (128, 128, 3, 1, 56, 32, "relu"), (256, 256, 3, 1, 28, 32, "relu"), (512, 512, 3, 1, 14, 32, "relu"),
    (1024, 1024, 3, 1, 7, 32, "relu"),
    (2048, 2048, 3, 1, 7, 32, "relu"), (448, 448, 3, 1, 28, 4, "relu"), (1232, 1232, 3, 1, 14, 11, "relu"),
]
_ACT = {"relu": nn.ReLU, "silu": nn.SiLU}


# fusedrc/kernels/conv_bn_act.py's module-level strategy switches
SWITCHES = ("FWD_RECOMPUTE", "BWD_RECOMPUTE_TWICE", "CONV_GRAD", "CONV_Z")


def _measure(step, fwd, cuda_graph=False, ref_dx=None):
    """Timings and the step's peak above what was allocated before it (the gradients the timing
    runs left are freed first: counted as resident they would lower the peak), or the error.
    ``cuda_graph``: the step captured in a CUDA graph and timed by its replays, so that no host
    time (Python, dispatch, kernel launches) is in the timings: the GPU time of the step. Its
    input gradient after a replay is checked against ``ref_dx`` (``err_dx``); no peak."""
    try:
        if cuda_graph:
            # the gradients are allocated in the graph's pool and rewritten by every replay
            graph = measure.capture_graph(lambda: step(fwd))
            graph.replay()
            rec = dict(times_s=measure.do_bench_times(graph.replay), cuda_graph=True,
                       err_dx=((step.x.grad.float() - ref_dx.float()).norm() / ref_dx.float().norm()).item())
            del graph
            step.clear()
            torch.cuda.empty_cache()
            return rec
        times = measure.do_bench_times(lambda: step(fwd))
        step.clear()
        peak, before = measure.peak_allocated(torch.device("cuda"), lambda: step(fwd))
        return dict(times_s=times, peak_bytes=peak - before)
    except Exception as e:  # record and go on: one failing strategy must not hide the rest
        return dict(error=f"{type(e).__name__}: {e}"[:500], **(dict(cuda_graph=True) if cuda_graph else {}))


def conv_layer(shape, batch, dtype, channels_last):
    """A Conv2d -> BatchNorm2d -> activation layer of ``shape`` (ReLU, groups=1 unless the shape
    names them) on the GPU, its input and output gradient, and ``step(fwd)``: one training step
    (grads cleared, ``fwd()``, backward); ``step.clear()`` frees the gradients."""
    cin, cout, k, s, hw, groups, act = (*shape, 1, "relu")[:7]
    block = nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False, groups=groups), nn.BatchNorm2d(cout),
                          _ACT[act]())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    block = block.to(device="cuda", dtype=dtype, memory_format=fmt).train()
    x = torch.randn(batch, cin, hw, hw, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    x.requires_grad_(True)
    with torch.no_grad():
        g = torch.randn_like(block(x))
    params = list(block.parameters())

    def clear():
        x.grad = None
        for p in params:
            p.grad = None

    def step(fwd):
        clear()
        fwd().backward(g)

    step.clear = clear
    step.x = x
    return block, x, g, step


def setting(r) -> str:
    """A record's strategy, with the switch values for fusedrc's."""
    if r["strategy"] != "fusedrc":
        return r["strategy"]
    return (f"fusedrc fwd_rc={r['FWD_RECOMPUTE']} twice={r['BWD_RECOMPUTE_TWICE']} grad={r['CONV_GRAD']} "
            f"z={r['CONV_Z']}" + (f" direct<={r['DIRECT_MAX_GROUP_CHANNELS']}" if "DIRECT_MAX_GROUP_CHANNELS" in r
                                  else "") + (f" flat<={r['FLAT_K_MAX_CHANNELS']}" if "FLAT_K_MAX_CHANNELS" in r else ""))


def summarize(records) -> dict:
    """Per setting, over the shapes where it and checkpoint both have timings: the geometric mean
    of its median step time / checkpoint's, the range, and the number of shapes; per shape, the
    fastest fusedrc setting. The README's conv tables are this function's output."""
    med = {}
    for r in records:
        if "times_s" in r:
            med[(tuple(r["shape"]), setting(r))] = measure.quantile(r["times_s"], 0.5)
    shapes = list(dict.fromkeys(s for s, _ in med))
    ratios = {}
    best = {}
    for shape in shapes:
        ck = med.get((shape, "torch_checkpoint"))
        if ck is None:
            continue
        for (s, name), t in med.items():
            if s == shape:
                ratios.setdefault(name, []).append(t / ck)
        mine = {name: t / ck for (s, name), t in med.items() if s == shape and name.startswith("fusedrc")}
        if mine:
            best[shape] = min(mine.items(), key=lambda kv: kv[1])
    settings = {name: dict(geomean=math.exp(sum(map(math.log, rs)) / len(rs)), min=min(rs), max=max(rs),
                           shapes=len(rs)) for name, rs in ratios.items()}
    return dict(settings=settings, best=best)


def _print_summary(path):
    doc = json.loads(open(path).read())
    summary = summarize(doc["records"])
    print(f"{path}: {doc['device']['name']}, batch {doc['batch']}, {doc['dtype']}, {doc['memory_format']}, "
          f"commit {doc['commit']}")
    for name, st in summary["settings"].items():
        print(f"{name:66s} x{st['geomean']:5.3f} ckpt (geometric mean; {st['min']:.2f}-{st['max']:.2f}, "
              f"{st['shapes']} shapes)")
    for shape, (name, ratio) in summary["best"].items():
        print(f"best at {str(shape):36s} x{ratio:5.2f} {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--summarize", metavar="JSON", help="print a results file's summary (no GPU) and exit")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--nchw", action="store_true", help="NCHW instead of channels_last")
    ap.add_argument("--switches", action="store_true", help="also every recompute-switch setting")
    ap.add_argument("--few-switches", action="store_true",
                    help="also the strictly fused passes (CONV_Z=triton; the default takes z from cuDNN "
                         "for 16-bit operands), one recompute pass + z over them (BWD_RECOMPUTE_TWICE=False) "
                         "and, on the stem, the per-tap K loop (FLAT_K_MAX_CHANNELS=0)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="time each step as a CUDA graph replay: GPU time, no host overhead")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--shapes", default="resnet50", choices=("resnet50", "grouped"),
                    help="ResNet-50's layers, or grouped/depthwise ones (EfficientNet-B0, ResNeXt-50)")
    args = ap.parse_args()
    if args.summarize:
        return _print_summary(args.summarize)
    shapes = SHAPES if args.shapes == "resnet50" else GROUPED_SHAPES
    dtype = getattr(torch, args.dtype)
    measure.match_fp32_precision(torch.device("cuda"))
    k = importlib.import_module("fusedrc.kernels.conv_bn_act")
    switches = SWITCHES + ("FLAT_K_MAX_CHANNELS",) + (("DIRECT_MAX_GROUP_CHANNELS",) if args.shapes == "grouped" else ())
    default = {n: getattr(k, n) for n in switches}
    variants = [default]
    if args.switches:
        # both recompute switches with cuDNN's dX/dW; the Triton dX/dW once (measured 30x slower in
        # session 3: kept as a control); z from cuDNN; and the per-layer roofline choices ("auto")
        variants = [{**default, **dict(zip(SWITCHES, (f, t, "aten", "triton")))}
                    for f, t in itertools.product((False, True), (True, False))]
        variants += [{**default, **dict(zip(SWITCHES, v))}
                     for v in ((False, True, "triton", "triton"), (False, True, "aten", "aten"),
                               ("auto", "auto", "aten", "triton"), ("auto", "auto", "aten", "auto"))]
    elif args.few_switches:
        # the default ("auto": z from cuDNN for 16-bit operands), the strictly fused passes, the
        # buffered backward over the Triton conv, and the stem's per-tap loop (other layers: skipped)
        fused = {**default, "CONV_Z": "triton"}
        variants += [fused, {**fused, "BWD_RECOMPUTE_TWICE": False}, {**fused, "FLAT_K_MAX_CHANNELS": 0}]
    if args.shapes == "grouped":  # grouped convs take aten's dX/dW whatever CONV_GRAD says: one run of each
        variants = [v for i, v in enumerate(variants)
                    if {**v, "CONV_GRAD": "aten"} not in [{**u, "CONV_GRAD": "aten"} for u in variants[:i]]]
        other = 32 if default["DIRECT_MAX_GROUP_CHANNELS"] == 0 else 0
        variants += [{**v, "DIRECT_MAX_GROUP_CHANNELS": other} for v in variants]
    records = []

    measure.interrupt_on_sigterm()  # the session's `timeout`: keep what was measured
    complete = False
    try:
        for shape in shapes:
            block, x, _, step = conv_layer(shape, args.batch, dtype, not args.nchw)
            # no RNG in the block: checkpoint's RNG-state save (which a graph capture refuses) changes nothing
            strategies = {"eager": lambda: block(x),
                          "torch_checkpoint": lambda: checkpoint(block, x, use_reentrant=False,
                                                                 preserve_rng_state=not args.cuda_graph)}
            if not args.no_compile:
                # a fresh dynamo per layer: past recompile_limit (8) dynamo would silently run eager
                torch._dynamo.reset()
                compiled = torch.compile(block)
                strategies["torch_compile"] = lambda: compiled(x)
            ref_dx = None
            if args.cuda_graph:
                step(strategies["eager"])
                ref_dx = x.grad.clone()
            for name, fwd in strategies.items():
                records.append(dict(shape=shape, strategy=name, **_measure(step, fwd, args.cuda_graph, ref_dx)))
            with fusedrc.use_backend("triton"):
                for variant in variants:
                    if variant["FLAT_K_MAX_CHANNELS"] != default["FLAT_K_MAX_CHANNELS"] and \
                            shape[0] > max(variant["FLAT_K_MAX_CHANNELS"], default["FLAT_K_MAX_CHANNELS"]):
                        continue  # the flat K loop's switch changes nothing on this layer
                    fwd = lambda: fusedrc.recompute(block, x)  # noqa: E731  (a recognised pattern: the fused op)
                    with measure.switches(k, **variant):
                        records.append(dict(shape=shape, strategy="fusedrc", **variant,
                                            **_measure(step, fwd, args.cuda_graph, ref_dx)))
            mine = [r for r in records if r["shape"] == shape]
            ref = {r["strategy"]: measure.quantile(r["times_s"], 0.5) for r in mine if "times_s" in r}
            for r in mine:
                med = measure.quantile(r["times_s"], 0.5) if "times_s" in r else float("nan")
                tag = setting(r)
                ratio = med / ref["torch_checkpoint"] if "torch_checkpoint" in ref else float("nan")
                extra = f"err_dx {r['err_dx']:.1e}" if "err_dx" in r else \
                    f"peak {(r.get('peak_bytes') or 0) / 2**20:8.1f} MiB"
                print(f"{str(shape):36s} {tag:60s} {med * 1e3:8.3f} ms  x{ratio:5.2f} ckpt  "
                      f"{extra} {r.get('error', '')}", flush=True)
        complete = True
    except KeyboardInterrupt:
        print(f"interrupted: writing the {len(records)} records measured so far", flush=True)
    finally:  # any other error too: the shapes measured before it are kept
        name = measure.write_results(
            args.out, ("conv_tradeoff" if args.shapes == "resnet50" else "conv_tradeoff_grouped")
            + ("_graph" if args.cuda_graph else "") + "_cuda",
            "conv_tradeoff", torch.device("cuda"), dtype=args.dtype, cuda_graph=args.cuda_graph,
            batch=args.batch, memory_format="NCHW" if args.nchw else "channels_last",
            shape_fields=["C_in", "C_out", "kernel", "stride", "H=W"] + (["groups", "activation"] if
                                                                       args.shapes == "grouped" else []),
            defaults=default, complete=complete,
            records=records)
        print("wrote", name)


if __name__ == "__main__":
    main()
