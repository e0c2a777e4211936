"""Train a small residual FFN stack on synthetic data with ``fusedrc.recompute``.

The model is a transformer-style stack without attention: an input projection,
pre-LayerNorm residual FFN blocks ``x + ffn(norm(x))`` whose FFN
(``Linear -> GELU -> Linear``) runs under ``fusedrc.recompute`` (a recognised
pattern: the fused op keeps only its input and recomputes the hidden activation
inside its backward), one generic block with dropout (LayerNorm, Linear, GELU,
Dropout, Linear: not a fused pattern, so the generic rerun, with the same
dropout mask, recomputes it), and a linear head. It regresses a fixed random
"teacher" function of the input.

Prints the activation bytes autograd keeps per step with and without recompute
(counted with ``torch.autograd.graph.saved_tensors_hooks``, parameters
excluded), then the loss of every step. Exits with status 1 if the loss did not
decrease.

Run::

    python examples/train_small.py                 # 20 steps, CPU or CUDA, a few seconds on CPU
    python examples/train_small.py --steps 50 --device cpu
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    # Run as a script from a source checkout: import this checkout's fusedrc
    # (sys.path[0] is examples/, and an editable install may resolve ``fusedrc``
    # to an empty namespace package from outside the repo root).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import fusedrc  # noqa: E402


class FFNBlock(nn.Module):
    """``x + ffn(norm(x))``; the FFN is the fused recompute pattern."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x, recompute=True):
        h = self.norm(x)
        return x + (fusedrc.recompute(self.ffn, h) if recompute else self.ffn(h))


class DropoutBlock(nn.Module):
    """``x + body(x)`` with dropout inside: recomputed by fusedrc's generic path."""

    def __init__(self, dim, hidden, p=0.1):
        super().__init__()
        self.body = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(p), nn.Linear(hidden, dim)
        )

    def forward(self, x, recompute=True):
        return x + (fusedrc.recompute(self.body, x) if recompute else self.body(x))


class SmallNet(nn.Module):
    def __init__(self, in_dim, dim, hidden, out_dim, blocks):
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList([FFNBlock(dim, hidden) for _ in range(blocks)] + [DropoutBlock(dim, hidden)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, out_dim)

    def forward(self, x, recompute=True):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, recompute=recompute)
        return self.head(self.norm(x))


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the distinct tensors autograd saves while active, parameters (and their views) excluded."""

    def __init__(self, params):
        storages = {p.untyped_storage().data_ptr() for p in params}
        self.seen = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if not isinstance(t, nn.Parameter) and ptr not in storages:
                self.seen.setdefault((ptr, t.storage_offset(), tuple(t.shape), t.dtype), t.numel() * t.element_size())
            return t

        super().__init__(pack, lambda t: t)

    @property
    def total(self):
        return sum(self.seen.values())


def saved_bytes(model, x, target, recompute):
    counter = SavedBytes(model.parameters())
    with counter:
        loss = nn.functional.mse_loss(model(x, recompute=recompute), target)
    del loss  # the graph is freed without a backward
    return counter.total


def pick_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return torch.device(name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto",
                   help="fusedrc backend (default auto: Triton on CUDA, reference on CPU)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=4, help="fused FFN blocks (plus one generic dropout block)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")

    device = pick_device(args.device)
    fusedrc.use_backend(args.backend)
    torch.manual_seed(args.seed)
    in_dim, out_dim = 32, 16
    model = SmallNet(in_dim, args.dim, args.hidden, out_dim, args.blocks).to(device)
    teacher_a = torch.randn(in_dim, 64, device=device) / in_dim**0.5
    teacher_b = torch.randn(64, out_dim, device=device) / 8

    def batch():
        x = torch.randn(args.batch, args.seq, in_dim, device=device)
        return x, torch.sin(2 * x @ teacher_a) @ teacher_b

    print(f"fusedrc {fusedrc.__version__}, torch {torch.__version__}, device {device}, backend {args.backend}")
    print(f"model: {args.blocks} x [x + FFN(LN(x))] ({args.dim}->{args.hidden}->{args.dim}, GELU) + 1 dropout "
          f"block, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
          f"batch {args.batch}x{args.seq} tokens")

    x, y = batch()
    plain = saved_bytes(model, x, y, recompute=False)
    rc = saved_bytes(model, x, y, recompute=True)
    print(f"activation bytes saved per step: without recompute {plain / 2**20:.2f} MiB, "
          f"with fusedrc.recompute {rc / 2**20:.2f} MiB ({rc / plain:.1%})")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = batch()
        loss = nn.functional.mse_loss(model(x, recompute=True), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"step {step:3d}  loss {losses[-1]:.5f}", flush=True)
    elapsed = time.perf_counter() - t0
    print(f"first loss {losses[0]:.5f}, last loss {losses[-1]:.5f} ({args.steps} steps in {elapsed:.2f} s)")
    if not losses[-1] < losses[0]:
        print("error: the loss did not decrease", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
