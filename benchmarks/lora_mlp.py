"""LoRA fine-tuning's FFN sublayer: a Llama decoder layer's post-attention RMSNorm and gated MLP whose three
projections carry LoRA adapters (PEFT's ``target_modules="all-linear"``), base weights frozen, the adapters trained.

Three ways to run a training step of it, on the same tensors:

* ``eager``: as PEFT's LoRA layers compute it (``base(z) + scaling * B(A(dropout(z)))`` per projection, the
  adapters' input cast to their dtype);
* ``torch_checkpoint``: the same under ``torch.utils.checkpoint`` (what ``gradient_checkpointing_enable`` does
  to a whole layer, here to the sublayer);
* ``fusedrc``: ``fusedrc.functional.gated_mlp`` with the norm and the adapters (what ``convert`` runs for such
  a PEFT model): the gate's and up's low-rank terms inside the dual kernel's tiles, the LoRA dropout's masks
  regenerated in backward.

Per strategy: the activation bytes autograd keeps (parameters excluded), the step's peak memory on a GPU and its
raw step times (``triton.testing.do_bench`` on a GPU, ``time.perf_counter`` rounds on a CPU, where fusedrc runs its
reference backend: that time says nothing of the kernels). Written to
``benchmarks/results/lora_mlp_<device>_<time>.json`` with the device, versions and commit.

    python benchmarks/lora_mlp.py [--tokens 8192 --d 4096 --h 11008 --rank 16 --dropout 0.05] [--dtype bfloat16]
        [--repeats 20] [--out benchmarks/results]

Defaults: on a GPU Llama-2 7B's MLP on 8192 tokens in bfloat16, adapters in float32 (PEFT's default); on a CPU a
small one in float32.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fusedrc  # noqa: E402
from fusedrc.bench import measure  # noqa: E402

STRATEGIES = ("eager", "torch_checkpoint", "fusedrc")


class LoraSublayer(nn.Module):
    """RMSNorm, then the SwiGLU MLP, each projection a frozen Linear plus a trained LoRA adapter."""

    def __init__(self, d, h, rank, dropout, dtype, adapter_dtype, device):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm = nn.RMSNorm(d, eps=1e-6, **kw)
        self.proj = nn.ModuleDict({n: nn.Linear(i, o, bias=False, **kw)
                                   for n, (i, o) in dict(gate=(d, h), up=(d, h), down=(h, d)).items()})
        self.a = nn.ParameterDict({n: nn.Parameter(torch.randn(rank, p.in_features, device=device, dtype=adapter_dtype)
                                                   * p.in_features ** -0.5) for n, p in self.proj.items()})
        self.b = nn.ParameterDict({n: nn.Parameter(torch.randn(p.out_features, rank, device=device,
                                                               dtype=adapter_dtype) * 0.02) for n, p in self.proj.items()})
        self.requires_grad_(False)
        for p in (*self.a.values(), *self.b.values()):
            p.requires_grad_(True)
        self.scaling, self.dropout = 2.0, dropout

    def _project(self, name, z):
        a, b = self.a[name], self.b[name]
        out = self.proj[name](z)
        lora = nn.functional.linear(nn.functional.linear(nn.functional.dropout(z.to(a.dtype), self.dropout), a), b)
        return (out + lora * self.scaling).to(out.dtype)

    def forward(self, x):
        z = self.norm(x)
        return self._project("down", nn.functional.silu(self._project("gate", z)) * self._project("up", z))

    def fused(self, x):
        adapters = {f"lora_{n}": (self.a[n], self.b[n], self.scaling, self.dropout) for n in self.proj}
        p = self.proj
        return fusedrc.functional.gated_mlp(x, p["gate"].weight, None, p["up"].weight, None, p["down"].weight, None,
                                            "silu", norm="rms", norm_weight=self.norm.weight, norm_eps=1e-6,
                                            **adapters)


def run(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    tokens, d, h = args.tokens or (8192 if cuda else 512), args.d or (4096 if cuda else 256), \
        args.h or (11008 if cuda else 688)
    torch.manual_seed(0)
    layer = LoraSublayer(d, h, args.rank, args.dropout, dtype, torch.float32, device)
    x = torch.randn(tokens, d, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, d, device=device, dtype=dtype)
    trained = [x, *layer.a.values(), *layer.b.values()]
    calls = {"eager": lambda: layer(x), "torch_checkpoint": lambda: checkpoint(layer, x, use_reentrant=False),
             "fusedrc": lambda: layer.fused(x)}

    def step(name):
        for t in trained:
            t.grad = None
        calls[name]().backward(grad)

    records, timer = [], measure.Timer(device)
    for name in STRATEGIES:
        counter = measure.SavedBytes(list(layer.parameters()))
        with counter:
            out = calls[name]()
        out.backward(grad)
        del out
        peak, before = measure.peak_allocated(device, lambda: step(name))
        if cuda:
            times = measure.do_bench_times(lambda: step(name), rep=max(100, 25 * args.repeats))
        else:
            step(name)  # warm-up
            times = [timer(lambda: step(name)) for _ in range(args.repeats)]
        rec = dict(strategy=name, saved_activation_bytes=counter.activation_bytes, times_s=times,
                   **measure.summarize(times), step_peak_bytes=None if peak is None else peak - before)
        records.append(rec)
        print(f"{name:17s} kept {rec['saved_activation_bytes'] / 2**20:9.2f} MiB  median "
              f"{rec['median_s'] * 1e3:9.3f} ms" + ("" if peak is None else f"  step peak {(peak - before) / 2**20:9.1f} MiB"),
              flush=True)
    shape = dict(tokens=tokens, d=d, h=h, rank=args.rank, dropout=args.dropout, adapter_dtype="float32")
    path = measure.write_results(args.out, f"lora_mlp_{device.type}", "lora_mlp", device, dtype=str(dtype)[6:],
                                 shape=shape, backend=fusedrc.current_backend(), timer=timer.name,
                                 note=None if cuda else "CPU: fusedrc runs its reference backend; the kernels are "
                                                        "timed on a GPU only", records=records)
    print("wrote", path)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--d", type=int)
    ap.add_argument("--h", type=int)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.05)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
