"""Counting the activation bytes autograd keeps: shared by ``fusedrc.convert`` and ``fusedrc-bench``."""
from __future__ import annotations

import torch
from torch import nn


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the memory autograd keeps alive through saved tensors, parameters excluded.

    What a saved tensor keeps alive is its whole storage: each distinct storage is
    counted once, at its size, however many tensors or views of it are saved (a tensor
    saved as itself and as a reshaped view is one buffer). Tensors sharing storage with
    one of ``params`` (the parameter, or a view such as the ``weight.t()`` a Linear
    saves) are not activations and are left out.
    """

    def __init__(self, params=()):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.seen = {}

        def pack(t):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if isinstance(t, nn.Parameter) or ptr in self.param_storages:
                return t
            self.seen.setdefault(ptr, storage.nbytes())
            # detached: a saved output packed as itself would hold its own grad_fn, a reference cycle
            # that leaks the graph (about the activations' size) when no backward follows
            return t.detach()

        super().__init__(pack, lambda t: t)

    @property
    def activation_bytes(self) -> int:
        return sum(self.seen.values())
