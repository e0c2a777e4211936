"""The strategies compared on one model: how a training step runs the model's blocks.

* ``no_recompute``      every block plain (knob: fraction 0)
* ``torch_checkpoint``  ``torch.utils.checkpoint(..., use_reentrant=False)`` on the first k of n blocks
* ``fusedrc``           ``fusedrc.recompute`` (fused ops) on the same units of the first k blocks
* ``torch_compile``     ``torch.compile`` of the plain model, with
                        ``torch._functorch.config.activation_memory_budget`` = knob

These are the strategies of the synthetic workloads (``ffn``, ``resnet``); the real
models' (``resnet50``, ``opt``: original, torch.utils.checkpoint on units or blocks,
``fusedrc.convert`` with a policy or a ``memory_budget``) are in ``models.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .workloads import Workload

STRATEGIES = ("no_recompute", "torch_checkpoint", "fusedrc", "torch_compile")
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
COMPILE_BUDGETS = (1.0, 0.5, 0.1)


def compile_plan(workload: str, device_type: str, batch_sizes):
    """``(budgets, batch sizes)`` for torch.compile. On a CPU, compiling costs 10-40 s per configuration
    (the ResNet's the most), so to stay within the 5-minute budget it runs at the largest batch size only,
    and the ResNet at two budgets."""
    if device_type == "cuda":
        return list(COMPILE_BUDGETS), list(batch_sizes)
    budgets = [1.0, 0.1] if workload == "resnet" else list(COMPILE_BUDGETS)
    return budgets, [max(batch_sizes)]
_LR = 1e-4


@dataclass
class Config:
    workload: str
    strategy: str
    batch_size: int
    knob_name: str  # "recompute_fraction" or "activation_memory_budget"
    knob: float
    recomputed_blocks: int | None


def configs_for(wl: Workload, batch: int, compile_ok: bool, fractions=FRACTIONS, budgets=()):
    out = [Config(wl.name, "no_recompute", batch, "recompute_fraction", 0.0, 0)]
    for s in ("torch_checkpoint", "fusedrc"):
        for f in fractions:
            out.append(Config(wl.name, s, batch, "recompute_fraction", f, round(f * wl.n_blocks)))
    if compile_ok:
        for b in budgets:  # empty: no torch.compile at this batch size
            out.append(Config(wl.name, "torch_compile", batch, "activation_memory_budget", b, None))
    return out


class Runner:
    """One configuration made runnable: ``forward()`` for the saved-bytes count, ``step()`` to time."""

    def __init__(self, wl: Workload, cfg: Config, x: torch.Tensor, opt: torch.optim.Optimizer):
        self.wl, self.cfg, self.x, self.opt = wl, cfg, x, opt
        self.model = wl.model
        self.compiled = None
        if cfg.strategy == "torch_compile":
            self.mode, self.k = "none", 0
        else:
            self.mode = {"no_recompute": "none", "torch_checkpoint": "checkpoint", "fusedrc": "fusedrc"}[cfg.strategy]
            self.k = cfg.recomputed_blocks

    def compile(self):
        """Compile with the configured budget (the partitioner reads it at the first call)."""
        import torch._dynamo
        import torch._functorch.config as fc

        torch._dynamo.reset()
        model = self.wl.model
        self.compiled = torch.compile(lambda x: model(x, "none", 0))
        with fc.patch(activation_memory_budget=self.cfg.knob):
            self.step()

    def forward(self, x=None):
        x = self.x if x is None else x
        if self.compiled is not None:
            return self.compiled(x)
        return self.wl.model(x, self.mode, self.k)

    def loss(self, out):
        return self.wl.loss(out)

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(self.forward())
        loss.backward()
        self.opt.step()
        return loss


def make_optimizer(wl: Workload):
    return torch.optim.SGD(wl.model.parameters(), lr=_LR)
