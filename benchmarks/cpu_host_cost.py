"""Host cost of one Conv2d -> BatchNorm2d -> ReLU training step, on the CPU: Python and dispatch only.

On a GPU a layer step whose kernels are short is bound by the host: the time Python, the dispatcher
and the kernel launches take to enqueue it. This script measures that share without a GPU. It runs
a tiny layer (batch 1, 8 channels, 4x4) on the CPU with fusedrc's Triton kernels stubbed out
(Triton's interpreter would otherwise run them; a stubbed launch costs nothing) and its call of
cuDNN's conv backward (``aten.convolution_backward``, from Python) stubbed too. Eager and
``torch.utils.checkpoint`` run for real; at this size their CPU arithmetic is a few microseconds.
What remains for fusedrc is its own Python: argument checks, the autograd glue, the launchers,
the running statistics.

``--pattern ffn``: the same for a small FFN (Linear -> GELU -> Linear). On the CPU every fused GEMM
is a Triton kernel (the interpreter's), so all of them are stubbed there; on a GPU the plain ones
are cuBLAS calls.

``--pattern experts``: a fine-grained MoE layer's routed experts (128 experts, top-8, 256 tokens: 16 rows an
expert; hidden and expert widths tiny), ``fusedrc.functional.moe_experts`` launched per expert
(``GROUPED_EXPERTS=False``), grouped with the plain GEMMs per expert (``GROUPED_MM=False``: a GPU's path
for fp32/fp16, or before sm_90), and grouped with one ``torch._grouped_mm`` per plain GEMM (a GPU's bf16
path on sm_90+; stubbed here as the launches are), against the eager per-expert loop and checkpoint on it.

The strategies take turns, ``--batch`` steps each, so that a shared machine's drifting load falls on
all of them alike. Forward and backward are timed apart, every raw timing is written to
``benchmarks/results/host_cost_<pattern>_cpu_<time>.json``.

    python benchmarks/cpu_host_cost.py [--pattern conv|ffn] [--conv-z triton|aten] [--steps 300] [--batch 25]
        [--out benchmarks/results]
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before fusedrc: the CPU runs the "triton" backend's code

import argparse  # noqa: E402
import contextlib  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import fusedrc  # noqa: E402
from fusedrc.bench import measure  # noqa: E402


def _stub_kernels():
    """Triton launches do nothing (their outputs stay as allocated); fusedrc's Python call of the conv
    backward returns zeros. Returns the launch counter."""
    from triton.runtime.interpreter import InterpretedFunction

    from fusedrc.kernels import conv_bn_act

    launches = [0]

    def getitem(self, grid):
        def run(*args, **kwargs):
            launches[0] += 1
        return run

    InterpretedFunction.__getitem__ = getitem

    class _Aten:
        def __getattr__(self, name):
            return getattr(torch.ops.aten, name)

        @staticmethod
        def convolution_backward(dz, x, w, *args):
            return torch.zeros_like(x), torch.zeros_like(w), None

    class _Torch(types.ModuleType):  # the kernels module's `torch`, its aten conv backward stubbed
        ops = types.SimpleNamespace(aten=_Aten())

        def __getattr__(self, name):
            return getattr(torch, name)

    # only the kernels module's view of torch: eager's and checkpoint's autograd are untouched
    conv_bn_act.torch = _Torch("torch")
    return launches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="timed steps per strategy")
    ap.add_argument("--batch", type=int, default=25, help="steps a strategy runs before the next takes its turn")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--pattern", default="conv", choices=("conv", "ffn", "experts"),
                    help="the Conv-BN-ReLU layer, a small FFN (Linear-GELU-Linear: its GEMMs stubbed too), or a "
                         "MoE layer's 128 routed experts (their GEMMs stubbed too)")
    ap.add_argument("--conv-z", default=None, choices=("triton", "aten"),
                    help="the conv's CONV_Z setting (the CPU's default is the Triton conv; a GPU's, for "
                         "16-bit operands, z from cuDNN: 'aten' runs that path's Python, its aten conv for real)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_flush_denormal(True)  # stubbed outputs are uninitialised memory
    launches = _stub_kernels()
    if args.pattern == "experts":
        return _experts(args, launches)
    if args.pattern == "conv":
        fmt = torch.channels_last
        block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                              nn.ReLU()).to(memory_format=fmt)
        fused = fusedrc.nn.ConvBNReLU.from_modules(block[0], block[1])
        x = torch.randn(1, 8, 4, 4).contiguous(memory_format=fmt).requires_grad_(True)
        g = torch.randn(1, 8, 4, 4).contiguous(memory_format=fmt)
        layer = "Conv2d(8, 8, 3, padding=1) + BatchNorm2d + ReLU, input 1x8x4x4, channels_last, fp32"
    else:
        block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        fused = fusedrc.nn.FusedMLP.from_modules(block[0], "gelu", block[2])
        x = torch.randn(8, 16, requires_grad=True)
        g = torch.randn(8, 16)
        layer = "Linear(16, 64) + GELU + Linear(64, 16), input 8x16, fp32"
    module_name = "fusedrc.nn." + type(fused).__name__
    cases = {"eager": lambda: block(x), "torch_checkpoint": lambda: checkpoint(block, x, use_reentrant=False),
             "fusedrc.recompute": lambda: fusedrc.recompute(block, x), module_name: lambda: fused(x)}
    from fusedrc.kernels import conv_bn_act

    conv_z = args.conv_z or conv_bn_act.CONV_Z
    with fusedrc.use_backend("triton"), measure.switches(conv_bn_act, CONV_Z=conv_z):
        times, counts = _take_turns(cases, (x, *block.parameters()), g, args, launches)
    records = _report(times, counts, args.batch, "triton_launches_per_step", "stubbed Triton launches a step")
    path = measure.write_results(args.out, f"host_cost_{args.pattern}_cpu", "host_cost", torch.device("cpu"),
                                 pattern=args.pattern, layer=layer, conv_z=conv_z,
                                 stubbed="fusedrc's Triton launches (its GEMMs on the CPU: the interpreter's "
                                         "kernels) and its aten.convolution_backward call", records=records)
    print("wrote", path)


def _take_turns(cases, leaves, g, args, launches, switches=lambda name: contextlib.nullcontext()):
    """Forward and backward times of each case (name -> forward), and its stubbed calls a step: the cases take
    turns, ``args.batch`` steps each (a shared machine's load drifts over seconds, and every case sees the same
    drift), the first round a warm-up; ``leaves``' gradients cleared before each step, ``switches(name)`` around it."""
    times = {name: ([], []) for name in cases}
    counts = dict.fromkeys(cases, 0)
    for r in range(1 + -(-args.steps // args.batch)):
        for name, fwd in cases.items():
            launches[0] = 0
            for _ in range(args.batch):
                for t in leaves:
                    t.grad = None
                with switches(name):
                    t0 = time.perf_counter()
                    y = fwd()
                    t1 = time.perf_counter()
                    y.backward(g)
                    t2 = time.perf_counter()
                if r:
                    times[name][0].append(t1 - t0)
                    times[name][1].append(t2 - t1)
            counts[name] = launches[0] / args.batch
    return times, counts


def _report(times, counts, batch, count_key, count_label):
    """One record a case (its raw times, its calls a step as ``count_key``), each printed with its medians
    against the first case's (eager)."""
    records, eager_total = [], None
    width = max(map(len, times))
    for name, (f_times, b_times) in times.items():
        records.append({"strategy": name, "forward_times_s": f_times, "backward_times_s": b_times,
                        count_key: counts[name], "batch": batch})
        fm, bm = (measure.quantile(t, 0.5) * 1e6 for t in (f_times, b_times))
        eager_total = eager_total or fm + bm
        print(f"{name:{width}s} forward {fm:8.1f} us  backward {bm:8.1f} us  total {fm + bm:8.1f} us  "
              f"({(fm + bm) / eager_total:.2f}x eager; {count_label}: {counts[name]:.0f})", flush=True)
    return records


def _experts(args, launches):
    """The routed experts' host cost: see the module's docstring (``--pattern experts``)."""
    from fusedrc import functional as F
    from fusedrc.kernels import moe_experts

    def grouped_mm(a, b, offs=None):  # stubbed as the launches are (eager and checkpoint never call it)
        launches[0] += 1
        shape = (offs.numel(), a.shape[0], b.shape[1]) if b.dim() == 2 else (a.shape[0], b.shape[2])
        return torch.empty(shape, dtype=a.dtype)

    torch._grouped_mm = grouped_mm
    T, K, I, N, E, k = 256, 16, 16, 16, 128, 8
    x = torch.randn(T, K, requires_grad=True)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k, requires_grad=True)
    gate_up = (torch.randn(E, 2 * I, K) * K ** -0.5).requires_grad_()
    down = (torch.randn(E, N, I) * I ** -0.5).requires_grad_()
    g = torch.randn(T, N)
    params = (gate_up, down)
    layer = f"{E} experts (hidden {K}, expert width {I}), top-{k} of {T} tokens, fp32"

    def eager():
        return F._moe_plain(x, idx, w, gate_up, down, "silu")

    def fused():
        return F.moe_experts(x, idx, w, gate_up, down)

    cases = {"eager": eager, "torch_checkpoint": lambda: checkpoint(eager, use_reentrant=False),
             "fusedrc per expert": fused, "fusedrc grouped, GEMMs per expert": fused, "fusedrc grouped": fused}
    # the experts module's switches, for a case's forward and backward
    settings = {"fusedrc per expert": dict(GROUPED_EXPERTS=False),
                "fusedrc grouped, GEMMs per expert": dict(GROUPED_EXPERTS=True, GROUPED_MM=False),
                "fusedrc grouped": dict(GROUPED_EXPERTS=True, GROUPED_MM=True)}
    with fusedrc.use_backend("triton"):
        times, counts = _take_turns(cases, (x, w, *params), g, args, launches,
                                    lambda name: measure.switches(moe_experts, **settings.get(name, {})))
    records = _report(times, counts, args.batch, "stubbed_calls_per_step",
                      "stubbed launches and _grouped_mm calls a step")
    path = measure.write_results(args.out, "host_cost_experts_cpu", "host_cost", torch.device("cpu"),
                                 pattern="experts", layer=layer, stubbed="fusedrc's Triton launches (its GEMMs on "
                                 "the CPU: the interpreter's kernels) and torch._grouped_mm", records=records)
    print("wrote", path)


if __name__ == "__main__":
    main()
