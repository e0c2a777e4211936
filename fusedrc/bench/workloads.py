"""The built-in synthetic workloads: a transformer FFN stack and a small ResNet (no downloads).

(The real models, torchvision ResNet-50 and Hugging Face OPT, are in ``models.py``.)

A workload is a model made of ``n`` blocks plus ``forward(x, mode, k)``, which runs
the first ``k`` blocks under the recompute ``mode`` (``"none"``, ``"checkpoint"``
or ``"fusedrc"``) and the rest plainly. The recomputed units are the same for
``torch.utils.checkpoint`` and ``fusedrc``:

* FFN: each block is ``x + ffn(ln(x))`` with ``ffn = Sequential(Linear, GELU, Linear)``;
  the region is ``ffn`` (the recognised FFN pattern), LayerNorm and the residual
  add stay outside it in every strategy.
* ResNet: each BasicBlock has two conv-bn-relu units, ``relu(bn1(conv1(x)))`` and
  ``relu(bn2(conv2(h)) + shortcut(x))``; both are recomputed. fusedrc runs the
  first as ``fusedrc.recompute(Sequential(Conv2d, BatchNorm2d, ReLU), x)`` and the
  second through ``fusedrc.nn.ConvBNReLU`` (sharing the same parameters) with the
  residual. The stem and the 1x1 downsampling shortcuts are never recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fusedrc
from fusedrc.nn import ConvBNReLU

MODES = ("none", "checkpoint", "fusedrc")
WORKLOADS = ("ffn", "resnet")


def _ckpt(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


# --------------------------------------------------------------------------- FFN
class FFNBlock(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.ffn = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def run(self, x, mode):
        h = self.ln(x)
        if mode == "none":
            return x + self.ffn(h)
        if mode == "checkpoint":
            return x + _ckpt(self.ffn, h)
        return x + fusedrc.recompute(self.ffn, h)


class FFNStack(nn.Module):
    def __init__(self, width, hidden, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(FFNBlock(width, hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)

    def forward(self, x, mode="none", k=0):
        for i, b in enumerate(self.blocks):
            x = b.run(x, mode if i < k else "none")
        return self.norm(x)


# --------------------------------------------------------------------------- ResNet
class ConvBNAddReLU(nn.Module):
    """``relu(bn(conv(x)) + residual)``: the BasicBlock's second unit, unfused."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x, residual):
        return torch.relu(self.bn(self.conv(x)) + residual)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.unit1 = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                   nn.ReLU())
        self.unit2 = ConvBNAddReLU(cout, cout)
        self.fused2 = ConvBNReLU.from_modules(self.unit2.conv, self.unit2.bn)  # same parameters
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def run(self, x, mode):
        sc = x if self.shortcut is None else self.shortcut(x)
        if mode == "none":
            return self.unit2(self.unit1(x), sc)
        if mode == "checkpoint":
            return _ckpt(self.unit2, _ckpt(self.unit1, x), sc)
        return self.fused2(fusedrc.recompute(self.unit1, x), sc)


class SmallResNet(nn.Module):
    def __init__(self, channels, blocks_per_stage, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels[0], 3, 1, 1, bias=False), nn.BatchNorm2d(channels[0]),
                                  nn.ReLU())
        blocks, cin = [], channels[0]
        for s, c in enumerate(channels):
            for j in range(blocks_per_stage):
                blocks.append(BasicBlock(cin, c, 2 if (s > 0 and j == 0) else 1))
                cin = c
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x, mode="none", k=0):
        x = self.stem(x)
        for i, b in enumerate(self.blocks):
            x = b.run(x, mode if i < k else "none")
        return self.head(x.mean((2, 3)))


# --------------------------------------------------------------------------- specs
@dataclass
class Workload:
    name: str
    model: nn.Module
    n_blocks: int
    input_shape: tuple  # per-sample shape; the batch dimension is prepended
    shapes: dict = field(default_factory=dict)
    description: str = ""

    def make_input(self, batch, device, dtype, seed=1):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((batch, *self.input_shape), generator=g).to(device=device, dtype=dtype)
        return x.contiguous(memory_format=torch.channels_last) if self.shapes.get("channels_last") else x

    def loss(self, out):
        return out.float().square().mean()


def default_batch_sizes(name: str, device_type: str, quick: bool):
    from .models import IMAGE_MODELS, MODEL_WORKLOADS

    if name in MODEL_WORKLOADS:  # the real models
        image = name in IMAGE_MODELS
        if quick:
            return [2]
        if device_type == "cuda":
            return [32, 128] if image else [4, 16]
        return [16] if image else [8]
    if quick:
        return [256] if name == "ffn" else [8]
    if device_type == "cuda":
        return [4096, 16384] if name == "ffn" else [64, 256]
    return [512, 2048] if name == "ffn" else [16, 64]


def build(name: str, device: torch.device, dtype: torch.dtype, quick: bool, seed: int = 0,
          channels_last: bool = False) -> Workload:
    """The workload ``name`` with width and depth scaled to the device (``quick``: tiny);
    ``channels_last``: an image workload's model and input in that memory format."""
    torch.manual_seed(seed)
    cuda = device.type == "cuda"
    if name == "ffn":
        if quick:
            width, hidden, blocks = 128, 512, 4
        elif cuda:
            width, hidden, blocks = 2048, 8192, 4
        else:
            width, hidden, blocks = 256, 1024, 4
        model = FFNStack(width, hidden, blocks)
        wl = Workload(name, model, blocks, (width,),
                      dict(width=width, hidden=hidden, blocks=blocks, activation="gelu"),
                      f"{blocks} x [x + Linear({width},{hidden}) GELU Linear({hidden},{width}) of LayerNorm(x)], "
                      f"input batch x {width} tokens")
    elif name == "resnet":
        if quick:
            channels, per_stage, res = (8, 16, 16, 32), 1, 16
        elif cuda:
            channels, per_stage, res = (64, 128, 256, 512), 2, 64
        else:
            channels, per_stage, res = (16, 32, 64, 128), 1, 32
        model = SmallResNet(channels, per_stage)
        blocks = len(channels) * per_stage
        wl = Workload(name, model, blocks, (3, res, res),
                      dict(channels=list(channels), blocks_per_stage=per_stage, resolution=res, blocks=blocks),
                      f"ResNet: stem + {len(channels)} stages x {per_stage} BasicBlock(s) of channels "
                      f"{list(channels)}, input batch x 3 x {res} x {res}")
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    wl.model.to(device=device, dtype=dtype).train()
    if channels_last and name == "resnet":
        wl.model.to(memory_format=torch.channels_last)
        wl.shapes["channels_last"] = True
    return wl
