"""Counting the activation bytes autograd keeps: shared by ``fusedrc.convert`` and ``fusedrc-bench``."""
from __future__ import annotations

import torch
from torch import nn


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the distinct tensors autograd saves while active, parameters excluded.

    Each tensor is counted once, keyed by storage pointer, offset, shape and dtype;
    tensors sharing storage with one of ``params`` (the parameter, or a view such as
    the ``weight.t()`` a Linear saves) are not activations and are left out.
    """

    def __init__(self, params=()):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.seen = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if isinstance(t, nn.Parameter) or ptr in self.param_storages:
                return t
            self.seen.setdefault((ptr, t.storage_offset(), tuple(t.shape), t.dtype), t.numel() * t.element_size())
            # detached: a saved output packed as itself would hold its own grad_fn, a reference cycle
            # that leaks the graph (about the activations' size) when no backward follows
            return t.detach()

        super().__init__(pack, lambda t: t)

    @property
    def activation_bytes(self) -> int:
        return sum(self.seen.values())
