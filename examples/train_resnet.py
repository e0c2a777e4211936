"""Train a torchvision ResNet on synthetic images, original vs ``fusedrc.convert``.

Builds ``torchvision.models.resnet18`` (or ``--model resnet50``) from code (no
download), converts a copy with ``fusedrc.convert`` (every Conv-BN-ReLU chain and
residual tail becomes a fused recompute op; ``--budget 0.35`` instead lets convert
choose units and whole blocks to fit 35% of the original's activation bytes), and
trains both from the same initial weights on the same synthetic batches. Prints
each step's loss for both, the median step time, the activation bytes autograd
keeps per step (saved-tensor hooks, parameters excluded) and, on CUDA, the peak
memory allocated. Exits with status 1 if the losses of the first two steps (before
and after one update) differ by more than 1e-3 (relative). Later steps may drift
apart: at these tiny sizes a ResNet-50 is ill-conditioned (its BatchNorms see 2x2
pixels), so a 1e-6 relative change of the weights moves its gradients by ~4%,
between two copies of the plain torchvision model too; rounding differences of
the fused ops grow the same way.

Run::

    python examples/train_resnet.py                       # resnet18, 64 px, batch 8, 5 steps: CPU, < 1 min
    python examples/train_resnet.py --model resnet50 --budget 0.35
    python examples/train_resnet.py --device cuda --size 224 --batch 64 --steps 20
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import fusedrc  # noqa: E402
from fusedrc.convert import _import_torchvision, saved_bytes  # noqa: E402


def train(model, batches, device, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for x, y in batches:
        t = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return losses, times, peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18", choices=["resnet18", "resnet34", "resnet50", "resnet101"])
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--budget", type=float, default=None, help="memory_budget for convert (fraction, e.g. 0.35)")
    p.add_argument("--policy", default="all", choices=["all", "blocks"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)

    _import_torchvision()
    from torchvision.models import resnet

    torch.manual_seed(args.seed)
    original = getattr(resnet, args.model)(num_classes=10).to(device).train()
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [
        (torch.randn(args.batch, 3, args.size, args.size, generator=gen).to(device),
         torch.randint(0, 10, (args.batch,), generator=gen).to(device))
        for _ in range(args.steps)
    ]
    example = (batches[0][0],)
    converted = fusedrc.convert(original, policy=args.policy, memory_budget=args.budget,
                                example_inputs=example, verbose=True)
    base_bytes = saved_bytes(original, example)
    conv_bytes = saved_bytes(converted, example)

    runs = {}
    for name, model in (("original", copy.deepcopy(original)), ("fusedrc.convert", converted)):
        runs[name] = train(model, batches, device, args.lr)

    print(f"\n{args.model}, {args.size}x{args.size}, batch {args.batch}, {args.steps} steps on {device}, "
          f"torch {torch.__version__}, backend {fusedrc.current_backend()}")
    print("step  loss (original)  loss (converted)")
    for i, (a, b) in enumerate(zip(runs["original"][0], runs["fusedrc.convert"][0])):
        print(f"{i:4d}  {a:15.6f}  {b:16.6f}")
    print(f"\n{'model':18s} {'median step (s)':>16s} {'activation bytes kept':>24s} {'peak CUDA memory':>18s}")
    for name, kept in (("original", base_bytes), ("fusedrc.convert", conv_bytes)):
        _, times, peak = runs[name]
        med = statistics.median(times[1:] if len(times) > 1 else times)
        peak_s = f"{peak / 2**20:.1f} MiB" if peak is not None else "n/a (CPU)"
        print(f"{name:18s} {med:16.3f} {kept / 2**20:18.2f} MiB {peak_s:>18s}")
    print(f"saved-bytes ratio converted/original: {conv_bytes / base_bytes:.3f}")
    la, lb = runs["original"][0], runs["fusedrc.convert"][0]
    if any(abs(a - b) > 1e-3 * max(abs(a), 1e-6) for a, b in list(zip(la, lb))[:2]):
        print("losses of the first two steps differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
