"""Train a torchvision ResNet on synthetic images, original vs ``fusedrc.convert``.

Builds ``torchvision.models.resnet18`` (or ``--model resnet50``, or ``--model
efficientnet_b0``: Conv-BN-SiLU chains, or ``--model densenet121``: pre-activation BN-ReLU-Conv
chains) from code (no download), converts a copy with
``fusedrc.convert`` (every Conv-BN-act chain and residual tail becomes a fused recompute op; ``--budget 0.35`` instead lets convert
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
    python examples/train_resnet.py --model efficientnet_b0    # dropout and stochastic depth off (see below)
    python examples/train_resnet.py --model densenet121 --budget 0.3
    python examples/train_resnet.py --device cuda --size 224 --batch 64 --steps 20
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _compare import compare  # noqa: E402
from fusedrc.convert import import_torchvision  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18",
                   choices=["resnet18", "resnet34", "resnet50", "resnet101", "efficientnet_b0", "densenet121"])
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

    tv = import_torchvision()

    torch.manual_seed(args.seed)
    # EfficientNet's dropout and stochastic depth off: the two models would draw different masks
    extra = dict(dropout=0.0, stochastic_depth_prob=0.0) if args.model.startswith("efficientnet") else {}
    original = getattr(tv.models, args.model)(num_classes=10, **extra).to(device).train()
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [
        (torch.randn(args.batch, 3, args.size, args.size, generator=gen).to(device),
         torch.randint(0, 10, (args.batch,), generator=gen).to(device))
        for _ in range(args.steps)
    ]
    return compare(
        original, args, batches, (batches[0][0],), device,
        lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
        lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
        f"{args.model}, {args.size}x{args.size}, batch {args.batch}, {args.steps} steps", checked_steps=2)


if __name__ == "__main__":
    sys.exit(main())
