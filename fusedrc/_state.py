"""Thread-local state of recompute regions, and BatchNorm running-stat suppression.

While a region is being rerun in backward, BatchNorm modules must not update
their running statistics a second time (torch.utils.checkpoint does:
pytorch/pytorch#96136). A global module pre-hook, installed only while some
thread is rerunning a region, snapshots the buffers of each training-mode
BatchNorm that thread calls (and fusedrc.functional.conv_bn_act snapshots the
running statistics it is handed); they are restored bit for bit when the rerun
ends, exception or not. (Switching ``track_running_stats`` off instead would
change which tensors batch_norm saves, and the rerun must save exactly what
the forward saved.)
"""
from __future__ import annotations

import contextlib
import threading

import torch

from torch.nn.modules import module as _module_mod
from torch.nn.modules.batchnorm import _NormBase

_local = threading.local()
_lock = threading.Lock()
_hook_users = 0
_hook_handle = None


def traced(t: torch.Tensor) -> bool:
    """Whether torch is tracing an op on ``t`` rather than running it eagerly: ``t`` is a fake or
    functional tensor, or a dispatch mode is active (make_fx, torch.export, a triton_op's body
    under compile)."""
    return not (type(t) in (torch.Tensor, torch.nn.Parameter) and torch._C._len_torch_dispatch_stack() == 0)


def in_recompute() -> bool:
    """True while the current thread is rerunning a recompute region in backward."""
    return getattr(_local, "depth", 0) > 0


_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def snapshot_buffers(*buffers) -> None:
    """In a region's rerun, keep ``buffers`` (running statistics a call is about to update in place)
    to be restored bit for bit when the rerun ends. The first snapshot of a tensor in a rerun wins:
    it holds the value from before the rerun touched it. Outside a rerun, nothing."""
    if not in_recompute():
        return
    for b in buffers:
        if b is not None and id(b) not in _local.snapshots:
            _local.snapshots[id(b)] = (b, b.clone())  # holding b keeps its id unique until the restore


def _bn_pre_hook(module, args):
    # _NormBase: BatchNorm*d, SyncBatchNorm and InstanceNorm*d with track_running_stats
    if isinstance(module, _NormBase) and in_recompute() and module.training and module.track_running_stats:
        snapshot_buffers(*(getattr(module, n, None) for n in _BUFFERS))


_bn_pre_hook._fusedrc_hook = True  # fusedrc's own: the fused paths do not step aside for it


def _restore_snapshots():
    with torch.no_grad():
        # newest first: of two views of one buffer (a layer handed rm[0] twice), the one taken
        # before the rerun touched it is written last
        for buf, saved in reversed(list(_local.snapshots.values())):
            # through .data: BatchNorm's own update never bumps the buffers' version counters,
            # and a graph that saved them (x * bn.running_var) must not see a modification
            buf.data.copy_(saved)
    _local.snapshots = {}


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
        _local.snapshots = {}
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            _restore_snapshots()
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


def region_hook(pack):
    """Mark ``pack`` as a generic recompute region's saved-tensors pack hook (see inside_region)."""
    pack._fusedrc_region = True
    return pack


_NO_QUERY = object()


def top_saved_tensors_pack():
    """The pack function of this thread's innermost saved-tensors hooks; None without any hooks;
    ``_NO_QUERY`` on a torch that cannot tell (no ``_top_saved_tensors_default_hooks``)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return _NO_QUERY
    hooks = top(False)
    return None if hooks is None else hooks[0]


def under_recompute_hooks() -> bool:
    """Whether the innermost saved-tensors hooks of this thread are a recompute's: a fusedrc region's
    (its forward or rerun) or torch.utils.checkpoint's (non-reentrant: forward or recomputation). Such
    hooks replace saved tensors by placeholders that are unpacked once per backward and rebuilt by a
    rerun that must save the same tensors. Byte counters, offloading hooks or none: False. Unknown (a
    torch without the query): True, the cautious answer."""
    pack = top_saved_tensors_pack()
    return pack is _NO_QUERY or getattr(pack, "_fusedrc_region", False) \
        or getattr(pack, "__module__", None) == "torch.utils.checkpoint"


def inside_region() -> bool:
    """Whether a fused op called now runs directly inside a generic recompute region (its forward,
    or its rerun in backward), eagerly. There a fused op runs as the plain composition of torch ops:
    the region already drops whatever is saved in its forward and makes its rerun's tensors
    transient, so a fused op's own recompute would only add a third pass of its GEMM or conv (a whole
    ResNet or MBConv block recomputed cost 1.4x checkpoint per block that way).

    "Directly": the innermost saved-tensors hooks are the region's. Inside another checkpoint nested
    in the region (torch.utils.checkpoint, an offloading hook) the op stays fused: that one's
    recompute runs outside the region, and forward and recompute must save the same tensors. Under
    torch.compile the region is a torch.utils.checkpoint call and the fused ops stay."""
    if torch.compiler.is_compiling():  # first: dynamo folds it and traces nothing below
        return False
    # no hooks, or a torch that cannot tell (then fused ops stay fused everywhere: always consistent)
    return getattr(top_saved_tensors_pack(), "_fusedrc_region", False)


def tf32_matmul_allowed() -> bool:
    """Whether torch's fp32 matmuls on CUDA may use tf32, by either API: torch >= 2.9 raises on
    reading ``allow_tf32`` once ``fp32_precision`` (its own or the global one) was set, and
    reports "tf32" there after ``allow_tf32 = True`` or ``set_float32_matmul_precision("high")``.
    Inside :func:`pinned_tf32`, the pinned answer."""
    pinned = getattr(_local, "tf32", None)
    if pinned is not None:
        return pinned
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    return precision == "tf32" if precision is not None else bool(matmul.allow_tf32)


def cudnn_conv_tf32() -> bool:
    """Whether cuDNN's fp32 convolutions may use tf32 (the conv of the ``CONV_Z="aten"``
    path), by either API: the newest precision set at the conv, cuDNN or global level, else the
    legacy ``allow_tf32``."""
    cudnn = torch.backends.cudnn
    for owner in (getattr(cudnn, "conv", None), cudnn, torch.backends):
        precision = getattr(owner, "fp32_precision", None)
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
    try:
        return bool(cudnn.allow_tf32)
    except RuntimeError:  # conv and RNN set apart by the new API: the conv's was read above
        return True


@contextlib.contextmanager
def pinned_cudnn_tf32(allowed: bool):
    """cuDNN's fp32 conv precision set to ``allowed`` for the block and restored after (a global
    setting, as ``torch.backends.cudnn.flags`` sets it): the conv+BN backward's cuDNN recompute
    runs as its forward did."""
    if cudnn_conv_tf32() == allowed:
        yield
        return
    cudnn = torch.backends.cudnn
    conv = getattr(cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        previous = conv.fp32_precision
        conv.fp32_precision = "tf32" if allowed else "ieee"
        try:
            yield
        finally:
            conv.fp32_precision = previous
        return
    previous = cudnn.allow_tf32
    cudnn.allow_tf32 = allowed
    try:
        yield
    finally:
        cudnn.allow_tf32 = previous


@contextlib.contextmanager
def pinned_tf32(allowed: bool):
    """Answer ``allowed`` from :func:`tf32_matmul_allowed` in this thread: a fused op's backward
    recomputes at the precision its forward ran at, whatever torch's setting is by then."""
    previous = getattr(_local, "tf32", None)
    _local.tf32 = bool(allowed)
    try:
        yield
    finally:
        _local.tf32 = previous
