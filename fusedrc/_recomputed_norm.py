"""A norm whose output no op keeps: its consumers keep the norm's input and rebuild the output.

Pre-norm and post-norm transformers hand a norm's output ``n`` to GEMMs (attention's q/k/v
projections, the LM head, the next layer) that keep ``n`` for their weight gradients, while the
norm's own autograd keeps its input ``x`` (and, for Hugging Face's RMSNorm, float32 copies of it).
``x`` is kept either way; ``n`` is one elementwise pass away from it. So:

* :class:`RecomputedNormFunction` runs the norm module's own forward without autograd and keeps
  only ``x``; its backward reruns that forward with autograd and differentiates it, under the
  autocast state of the forward (gradients bit for bit eager's: the same ops on the same values).
* While a :class:`NormScope` is the innermost saved-tensors hook (``convert`` opens one around the
  converted model's forward), every op that saves ``n``, a view of it or a cast of it (autocast's
  copy before a Linear) stores a recipe in its place; the first unpack in backward reruns the norm
  once for all of them, and the norm's own backward then reuses that rerun.

A scope chains to the saved-tensors hooks below it (a byte counter, ``save_on_cpu``): every pack
calls the outer pack once, on the tensor or on the recipe's ``x``. It opens only where no recompute
is in progress (a fusedrc region or ``torch.utils.checkpoint`` saves nothing worth replacing, and
matches its rerun's saves by count) and never under ``torch.compile``, whose partitioner recomputes
norms by itself.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ._state import top_saved_tensors_pack, under_recompute_hooks
from .errors import RecomputeError

_local = threading.local()


def _autocast_state(device_type):
    try:
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):  # a device type autocast does not know
        return None


def _autocast(state):
    if state is None:
        return torch.autocast("cpu", enabled=torch.is_autocast_enabled("cpu"))  # as it stands: a no-op
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _graph_task():
    gid = torch._C._current_graph_task_id()
    return None if gid == -1 else gid


class _Shared:
    """What a norm call's recipe and its backward share: the norm rerun with autograd, per backward pass."""

    __slots__ = ("run", "params", "autocast", "grad_x", "reruns", "__weakref__")

    def __init__(self, run, params, autocast, grad_x):
        self.run, self.params, self.autocast, self.grad_x = run, params, autocast, grad_x
        self.reruns = {}  # graph task id -> (x rerun as an autograd leaf, n rerun with its graph)

    def rerun(self, x):
        x = x.detach().requires_grad_(self.grad_x)
        with torch.enable_grad(), _autocast(self.autocast):
            return x, self.run(x)


class RecomputedNormFunction(torch.autograd.Function):
    """``run(x)`` (a norm module's forward) keeping only ``x``; ``params`` are the tensors ``run`` reads
    (the norm's weight and bias), passed so their gradients flow."""

    @staticmethod
    def forward(ctx, x, shared, *params):
        ctx.shared = shared
        ctx.save_for_backward(x)
        with _autocast(shared.autocast):  # the forward's own state (a Function's forward keeps it)
            out = shared.run(x)
        if not isinstance(out, torch.Tensor):
            raise RecomputeError(f"a recomputed norm must return one tensor, its forward returned {type(out).__name__}")
        return out

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RecomputeError(
                "double backward (create_graph=True) through a norm fusedrc.convert recomputes is not supported: "
                "convert with a policy that leaves the norms out (units of kind 'norm')")
        (x,) = ctx.saved_tensors
        shared = ctx.shared
        need = ctx.needs_input_grad
        gid = _graph_task()
        got = shared.reruns.pop(gid, None) if gid is not None else None
        xr, n = got if got is not None else shared.rerun(x)
        wanted = [t for t, w in zip((xr, *shared.params), (need[0], *need[2:])) if w]
        grads = iter(torch.autograd.grad(n, wanted, grad, allow_unused=True) if wanted else ())
        dx = next(grads) if need[0] else None
        return (dx, None, *(next(grads) if w else None for w in need[2:]))


class _Recipe:
    """An output ``n`` of RecomputedNormFunction, registered in the scope it was made in."""

    __slots__ = ("ref", "shared", "x", "x_packed", "x_version", "version", "size", "outer")

    def __init__(self, n, x, shared, outer):
        self.ref = weakref.ref(n)
        self.shared, self.x, self.x_packed, self.x_version = shared, x, None, x._version
        self.version, self.size = n._version, n.size()
        self.outer = outer  # the scope's outer (pack, unpack), or None

    def packed(self, t, cast=None):
        """A :class:`_Packed` for saved tensor ``t``, a view of this output or of ``cast`` (a copy of it in
        another dtype: autocast's before a Linear), or None where a rerun would not give what ``t`` holds."""
        n = self.ref()
        # n changed in place since it was made: what was saved is no longer its rerun
        if n is None or n._version != self.version:
            return None
        if cast is not None:
            if (cast.size() != self.size or cast.device != n.device or cast._version != 0 or not cast.is_contiguous()
                    or cast.storage_offset() != 0 or cast.untyped_storage().nbytes() != cast.numel() * cast.element_size()):
                return None
        elif t.dtype != n.dtype:
            return None
        if self.x_packed is None:  # x through the hooks below, once (what an offloading hook moves)
            self.x_packed = (self.outer[0](self.x) if self.outer else self.x.detach(),)
            self.x = None
        return _Packed(self, None if cast is None else cast.dtype, t.size(), t.stride(), t.storage_offset())

    def value(self):
        x = self.x_packed[0]
        if self.outer:
            x = self.outer[1](x)
        if x._version != self.x_version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                "operation: the input of a norm fusedrc.convert recomputes (its consumers keep that input "
                "in place of the norm's output)")
        gid = _graph_task()
        if gid is None:  # unpacked outside backward (grad_fn._saved_self)
            with torch.no_grad(), _autocast(self.shared.autocast):
                return self.shared.run(x)
        got = self.shared.reruns.get(gid)
        if got is None:
            got = self.shared.reruns[gid] = self.shared.rerun(x)
        return got[1].detach()


class _Packed:
    __slots__ = ("recipe", "dtype", "size", "stride", "offset")

    def __init__(self, recipe, dtype, size, stride, offset):
        self.recipe, self.dtype, self.size, self.stride, self.offset = recipe, dtype, size, stride, offset

    def unpack(self):
        if torch.is_grad_enabled() and _graph_task() is not None:
            raise RecomputeError(
                "double backward (create_graph=True) through the consumers of a norm fusedrc.convert recomputes "
                "is not supported: convert with a policy that leaves the norms out (units of kind 'norm')")
        n = self.recipe.value()
        if self.dtype is not None:
            n = n.to(self.dtype)
        if not n.is_contiguous():
            n = n.contiguous()
        return n.as_strided(self.size, self.stride, self.offset)


def _storage_key(t):
    return t.device, t.untyped_storage().data_ptr()


class NormScope:
    """Saved-tensors hooks under which a recomputed norm's output, its views and casts are saved as recipes."""

    def __init__(self, outer):
        self.outer = outer
        self.by_storage = {}  # (device, data_ptr) -> recipe of the output that owns that storage
        self.by_node = {}  # the output's grad_fn -> recipe (autocast's casts of it)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def register(self, n, x, shared):
        # n must own its storage, laid out as a recomputed n will be: a view of it is then one of the rerun too
        if n.numel() == 0 or n.grad_fn is None or not n.is_contiguous() or n.storage_offset() != 0 \
                or n.untyped_storage().nbytes() != n.numel() * n.element_size():
            return
        recipe = _Recipe(n, x, shared, self.outer)
        self.by_storage[_storage_key(n)] = recipe
        self.by_node[n.grad_fn] = recipe

    def _packed(self, t):
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
            and not under_recompute_hooks() and current_scope() is None)


def scope_enter(module, args):
    """Forward pre-hook of a converted model holding recomputed norms: opens a NormScope for its call."""
    if torch.compiler.is_compiling():
        return
    stack = _local.__dict__.setdefault("stack", [])
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


def recomputed_norm(run, x, params):
    """``run(x)`` (a norm's forward reading ``params``) that keeps only ``x``; inside a NormScope its
    output is registered there, so that the ops saving it keep a recipe."""
    shared = _Shared(run, tuple(params), _autocast_state(x.device.type), x.requires_grad)
    n = RecomputedNormFunction.apply(x, shared, *params)
    scope = current_scope()
    if scope is not None:
        scope.register(n, x, shared)
    return n
