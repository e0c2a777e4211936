"""Thread-local state of recompute regions, and BatchNorm running-stat suppression.

While a region is being rerun in backward, BatchNorm modules must not update
their running statistics a second time (torch.utils.checkpoint does:
pytorch/pytorch#96136). A global module pre-hook, installed only while some
thread is rerunning a region, switches ``track_running_stats`` off for
training-mode BatchNorm modules called by that thread; with it off, a training
BatchNorm normalizes with the batch statistics exactly as before and touches no
buffer. The flags are restored when the rerun ends, exception or not.
"""
from __future__ import annotations

import contextlib
import threading

from torch.nn.modules import module as _module_mod
from torch.nn.modules.batchnorm import _BatchNorm

_local = threading.local()
_lock = threading.Lock()
_hook_users = 0
_hook_handle = None


def in_recompute() -> bool:
    """True while the current thread is rerunning a recompute region in backward."""
    return getattr(_local, "depth", 0) > 0


def _bn_pre_hook(module, args):
    if isinstance(module, _BatchNorm) and in_recompute() and module.training and module.track_running_stats:
        module.track_running_stats = False
        _local.flipped.append(module)


@contextlib.contextmanager
def rerunning():
    """Mark the current thread as rerunning a region (nestable)."""
    global _hook_users, _hook_handle
    with _lock:
        if _hook_users == 0:
            _hook_handle = _module_mod.register_module_forward_pre_hook(_bn_pre_hook)
        _hook_users += 1
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        _local.flipped = []
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            for m in _local.flipped:
                m.track_running_stats = True
            _local.flipped = []
        with _lock:
            _hook_users -= 1
            if _hook_users == 0:
                _hook_handle.remove()
                _hook_handle = None


def marked_depth() -> int:
    return getattr(_local, "marked", 0)


@contextlib.contextmanager
def inside_marked():
    _local.marked = marked_depth() + 1
    try:
        yield
    finally:
        _local.marked -= 1
