"""A norm whose output no op keeps: its consumers keep the norm's input and rebuild the output.

Pre-norm and post-norm transformers hand a norm's output ``n`` to GEMMs (attention's q/k/v
projections, the LM head, the next layer) that keep ``n`` for their weight gradients, while the
norm's own autograd keeps its input ``x`` (and, for Hugging Face's RMSNorm, float32 copies of it).
``x`` is kept either way; ``n`` is one elementwise pass away from it. So:

* :class:`RecomputedNormFunction` computes the norm with the functional form of its module
  (``F.layer_norm``, ``F.rms_norm``, ``F.group_norm``, Hugging Face's RMSNorm written out: the
  module's own ops) without autograd and keeps only ``x``. Its backward reruns that form with
  autograd on detached copies and differentiates it, under the autocast state of the forward:
  gradients are eager's (the same ops on the same values).
* While a :class:`NormScope` is the innermost saved-tensors hook (``convert`` opens one around the
  converted model's forward), every op that saves ``n``, a view of it or a cast of it (autocast's
  copy before a Linear) stores a recipe in its place; the first unpack in a backward reruns the norm
  once for all of them, and the norm's own backward then reuses that rerun.

The rerun reads copies of the norm's weight and bias taken in the forward (a few hundred bytes),
not the module: parameters changed in place since, swapped by ``torch.func.functional_call`` or
resharded by FSDP do not change what the consumers get back.

A scope chains to the saved-tensors hooks below it (a byte counter, ``save_on_cpu``, an offloading
hook): every pack calls the outer pack once, on the tensor or on the recipe's ``x``, and a recipe's
``x`` is unpacked once per backward. It opens only where no recompute is in progress (a fusedrc
region or ``torch.utils.checkpoint`` saves nothing worth replacing, and matches its rerun's saves by
count), and never under ``torch.compile``, ``torch.jit`` tracing or a ``torch.func`` transform.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ._state import top_saved_tensors_pack, under_recompute_hooks
from ._validate import needs_unfused
from .errors import RecomputeError

_local = threading.local()

_DOUBLE_BACKWARD = ("double backward (create_graph=True) through {what} a norm fusedrc.convert recomputes is not "
                    "supported: convert with a policy that leaves the norms out (units of kind 'norm')")


def _autocast_state(device_type):
    try:
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):  # a device type autocast does not know
        return None


class _NoAutocastChange:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _autocast(state):
    if state is None:
        return _NoAutocastChange()
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _graph_task():
    gid = torch._C._current_graph_task_id()
    return None if gid == -1 else gid


def usable(x, *params) -> bool:
    """Whether a norm call on ``x`` may run as a RecomputedNormFunction: autograd records it, and no
    forward-mode AD, ``torch.func`` transform, ``torch.jit`` trace or compile is at work."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and torch._C._functorch.maybe_current_level() is None and not needs_unfused(x, *params)
            and (x.requires_grad or any(p is not None and p.requires_grad for p in params)))


class _Shared:
    """One norm call's state, shared by its recipe and its backward: the functional form, copies of the
    parameters it read, the autocast state, and the rerun of each backward pass in progress."""

    __slots__ = ("fn", "params", "needs", "autocast", "reruns", "__weakref__")

    def __init__(self, fn, x, weight, bias):
        self.fn = fn
        # copies: what the forward read, whatever becomes of the parameters before backward
        self.params = tuple(None if p is None else p.detach().clone() for p in (weight, bias))
        self.needs = (x.requires_grad, *(p is not None and p.requires_grad for p in (weight, bias)))
        self.autocast = _autocast_state(x.device.type)
        self.reruns = {}  # graph task id -> (leaves (x, weight, bias), n rerun with its graph)

    def rerun(self, x):
        leaves = tuple(None if t is None else t.detach().requires_grad_(need)
                       for t, need in zip((x, *self.params), self.needs))
        with torch.inference_mode(False), torch.enable_grad(), _autocast(self.autocast):
            return leaves, self.fn(*leaves)

    def keep(self, gid, got):
        """Keep a rerun for the rest of backward pass ``gid`` (the norm's backward takes it; else it
        is dropped when the pass ends, as when the pass does not reach the norm)."""
        self.reruns[gid] = got
        ref = weakref.ref(self)

        def drop():
            shared = ref()
            if shared is not None:
                shared.reruns.pop(gid, None)

        torch.autograd.Variable._execution_engine.queue_callback(drop)


class RecomputedNormFunction(torch.autograd.Function):
    """``shared.fn(x, weight, bias)`` keeping only ``x`` (the parameters' copies are in ``shared``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, shared):
        ctx.shared = shared
        ctx.save_for_backward(x)
        with _autocast(shared.autocast):
            return shared.fn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RecomputeError(_DOUBLE_BACKWARD.format(what=""))
        shared = ctx.shared
        gid = _graph_task()
        got = shared.reruns.pop(gid, None) if gid is not None else None
        if got is None:
            got = shared.rerun(ctx.saved_tensors[0])
        leaves, n = got
        need = ctx.needs_input_grad[:3]
        wanted = [t for t, w in zip(leaves, need) if w]
        grads = iter(torch.autograd.grad(n, wanted, grad, allow_unused=True) if wanted else ())
        return (*(next(grads) if w else None for w in need), None)


class _Recipe:
    """An output ``n`` of RecomputedNormFunction, registered in the scope it was made in."""

    __slots__ = ("ref", "shared", "x", "x_packed", "x_version", "version", "size", "stride", "outer")

    def __init__(self, n, x, shared, outer):
        self.ref = weakref.ref(n)
        self.shared, self.x, self.x_packed, self.x_version = shared, x, None, x._version
        self.version, self.size, self.stride = n._version, n.size(), n.stride()
        self.outer = outer  # the scope's outer (pack, unpack), or None

    def packed(self, t, cast=None):
        """A :class:`_Packed` for saved tensor ``t``, a view of this output or of ``cast`` (a copy of it in
        another dtype: autocast's before a Linear), or None where a rerun would not give what ``t`` holds."""
        n = self.ref()
        # n changed in place since it was made: what was saved is no longer its rerun
        if n is None or n._version != self.version:
            return None
        if cast is not None:
            if (cast.size() != self.size or cast.stride() != self.stride or cast.device != n.device or cast._version != 0
                    or cast.storage_offset() != 0 or cast.untyped_storage().nbytes() != cast.numel() * cast.element_size()):
                return None
        elif t.dtype != n.dtype:
            return None
        if self.x_packed is None:  # x through the hooks below, once (what an offloading hook moves)
            self.x_packed = self.outer[0](self.x) if self.outer else self.x.detach()
            if self.outer:
                self.x = None
        return _Packed(self, None if cast is None else cast.dtype, t.size(), t.stride(), t.storage_offset())

    def value(self):
        gid = _graph_task()
        got = self.shared.reruns.get(gid) if gid is not None else None
        if got is None:
            x = self.outer[1](self.x_packed) if self.outer else self.x_packed
            # without hooks below, x is the forward's tensor itself: changed in place since, the rerun would
            # differ (an offloading hook's unpack gives its copy of the value the forward saw)
            if not self.outer and x._version != self.x_version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    "operation: the input of a norm fusedrc.convert recomputes (its consumers keep that input "
                    "in place of the norm's output)")
            got = self.shared.rerun(x)
            if gid is None:  # unpacked outside backward (grad_fn._saved_self)
                return got[1].detach()
            self.shared.keep(gid, got)
        return got[1].detach()


class _Packed:
    __slots__ = ("recipe", "dtype", "size", "stride", "offset")

    def __init__(self, recipe, dtype, size, stride, offset):
        self.recipe, self.dtype, self.size, self.stride, self.offset = recipe, dtype, size, stride, offset

    def unpack(self):
        if torch.is_grad_enabled() and _graph_task() is not None:
            raise RecomputeError(_DOUBLE_BACKWARD.format(what="the consumers of"))
        recipe = self.recipe
        n = recipe.value()
        if self.dtype is not None:
            n = n.to(self.dtype)
        if n.stride() != recipe.stride:  # laid out as the forward's output, which the saved view indexes
            n = torch.empty_strided(recipe.size, recipe.stride, dtype=n.dtype, device=n.device).copy_(n)
        return n.as_strided(self.size, self.stride, self.offset)


def _storage_key(t):
    return t.device, t.untyped_storage().data_ptr()


def _plain_dense(t):
    """A strided tensor of torch's own with real storage (no sparse, nested, subclass or meta tensor)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_nested
            and t.device.type != "meta")


class NormScope:
    """Saved-tensors hooks under which a recomputed norm's output, its views and casts are saved as recipes."""

    def __init__(self, outer):
        self.outer = outer
        self.by_storage = {}  # (device, data_ptr) -> recipe of the output that owns that storage
        self.by_node = {}  # the output's grad_fn -> recipe (autocast's casts of it)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def register(self, n, x, shared):
        # n must own its whole storage (dense, any memory format): a view of it indexes a rerun laid out the same
        if (not _plain_dense(n) or n.numel() == 0 or n.grad_fn is None
                or n.storage_offset() != 0 or n.untyped_storage().nbytes() != n.numel() * n.element_size()):
            return
        recipe = _Recipe(n, x, shared, self.outer)
        self.by_storage[_storage_key(n)] = recipe
        self.by_node[n.grad_fn] = recipe

    def _packed(self, t):
        if not _plain_dense(t):
            return None
        recipe = self.by_storage.get(_storage_key(t))
        if recipe is not None:
            return recipe.packed(t)
        # a view of a copy of an output (autocast's cast of it, viewed as 2-D by the Linear that keeps it)
        cast = t if t._base is None else t._base
        node = cast.grad_fn
        if node is not None and node.name() == "ToCopyBackward0":
            recipe = self.by_node.get(node.next_functions[0][0])
            if recipe is not None:
                return recipe.packed(t, cast)
        return None

    def pack(self, t):
        if self.by_storage:
            packed = self._packed(t)
            if packed is not None:
                return packed
        # as torch keeps it (detached: a saved output packed as itself would hold its own grad_fn)
        return (self.outer[0](t),) if self.outer else (t.detach(),)

    def unpack(self, p):
        if type(p) is _Packed:
            return p.unpack()
        return self.outer[1](p[0]) if self.outer else p[0]

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self.by_storage.clear()
        self.by_node.clear()


def current_scope():
    """The NormScope whose hooks are this thread's innermost saved-tensors hooks, or None."""
    pack = top_saved_tensors_pack()
    scope = getattr(pack, "__self__", None)
    return scope if isinstance(scope, NormScope) and getattr(pack, "__func__", None) is NormScope.pack else None


def _can_open():
    return (torch.is_grad_enabled() and torch._C._autograd._saved_tensors_hooks_is_enabled()
            and not torch.jit.is_tracing() and torch._C._functorch.maybe_current_level() is None
            and not under_recompute_hooks() and current_scope() is None)


def _unwind(stack, module):
    """Close what calls of ``module`` left open: a call that ended on a KeyboardInterrupt (which skips the
    forward hooks) leaves its scope on the saved-tensors hooks stack."""
    while stack:
        m, scope = stack.pop()
        if scope is not None and current_scope() is scope:
            scope.__exit__(None, None, None)
        if m is module:
            return


def scope_enter(module, args):
    """Forward pre-hook of a converted model holding recomputed norms: opens a NormScope for its call
    while one of its norm units is on."""
    if torch.compiler.is_compiling():
        return
    stack = _local.__dict__.setdefault("stack", [])
    if any(m is module for m, _ in stack):
        _unwind(stack, module)
    scope = None
    if any(site.enabled for site in module.__dict__.get("_fusedrc_norm_sites", ())) and _can_open():
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        scope = NormScope(outer).__enter__()
    stack.append((module, scope))


def scope_exit(module, args, output):
    """Forward hook (always called) closing what :func:`scope_enter` opened for this call."""
    if torch.compiler.is_compiling():
        return
    stack = getattr(_local, "stack", None)
    if not stack or stack[-1][0] is not module:  # its pre-hook did not run (an earlier pre-hook raised)
        return
    scope = stack.pop()[1]
    if scope is not None:
        scope.__exit__(None, None, None)


scope_enter._fusedrc_hook = True
scope_exit._fusedrc_hook = True


def recomputed_norm(fn, x, weight, bias):
    """``fn(x, weight, bias)`` (a norm's functional form) that keeps only ``x``; inside a NormScope its
    output is registered there, so that the ops saving it keep a recipe."""
    shared = _Shared(fn, x, weight, bias)
    n = RecomputedNormFunction.apply(x, weight, bias, shared)
    scope = current_scope()
    if scope is not None:
        scope.register(n, x, shared)
    return n
