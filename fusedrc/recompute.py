"""``recompute``: activation recomputation, a drop-in for non-reentrant
``torch.utils.checkpoint.checkpoint`` and ``mindspore.recompute``.

A generic region keeps only its inputs. Inside it, a saved-tensors hook swaps
every tensor autograd would save for a placeholder (a ``_Holder``). The first
time backward unpacks one, the region is rerun under a second hook that fills
the placeholders with the rerun's tensors, checking each against the forward's
shape/dtype/device, and stops as soon as the last one is filled (early stop).
Every backward pass (graph task) gets its own rerun, so ``retain_graph`` and
double backward work. Recognised patterns (``Linear+act``, the FFN,
``Conv2d+BatchNorm2d+ReLU``, fusedrc modules) skip all of this and call a fused
op whose backward recomputes inside the kernel.
"""
from __future__ import annotations

import contextlib
import functools
import numbers
import uuid
import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from . import _backend, _patterns, _state
from .errors import RecomputeError

__all__ = ["recompute", "recompute_sequential", "mark", "unmark"]


class _StopRerun(Exception):
    """Raised inside the rerun once every placeholder is filled (early stop)."""


class _Holder:
    """Stands for one saved tensor; ``handles[gid]`` keys its rerun value per graph task."""

    __slots__ = ("handles", "__weakref__")

    def __init__(self):
        self.handles = {}


class _Handle:
    __slots__ = ("__weakref__",)


def _meta(t):
    return tuple(t.shape), t.dtype, t.device


def _describe(meta):
    shape, dtype, device = meta
    return f"shape={shape}, dtype={dtype}, device={device}"


# --------------------------------------------------------------------------- RNG and autocast
class _ForwardState:
    """RNG and autocast state captured at the region's forward, replayed at rerun."""

    def __init__(self, flat_inputs, preserve_rng_state):
        self.preserve = preserve_rng_state
        self.device_type = None
        self.devices, self.device_states = [], []
        for t in flat_inputs:
            if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
                self.device_type = t.device.type
                break
        if preserve_rng_state:
            self.cpu_state = torch.get_rng_state()
            if self.device_type is not None:
                mod = getattr(torch, self.device_type)
                seen = []
                for t in flat_inputs:
                    if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                        idx = t.device.index if t.device.index is not None else mod.current_device()
                        if idx not in seen:
                            seen.append(idx)
                self.devices = seen
                self.device_states = [mod.get_rng_state(i) for i in seen]
        self.autocast = {
            dev: (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
            for dev in {"cpu", self.device_type or "cpu"}
        }
        self.autocast_cache = torch.is_autocast_cache_enabled()
        # the forward's backend setting: the rerun sees it too, whatever is current when backward
        # runs (another thread, or after the forward's `with use_backend(...)`); fused ops inside a
        # region run plain (_state.inside_region), code in the block may still read the setting
        self.backend = _backend.current_backend()

    @contextlib.contextmanager
    def replay(self):
        with torch.random.fork_rng(
            devices=self.devices, enabled=self.preserve, device_type=self.device_type or "cuda"
        ):
            if self.preserve:
                torch.set_rng_state(self.cpu_state)
                if self.devices:
                    mod = getattr(torch, self.device_type)
                    for i, s in zip(self.devices, self.device_states):
                        mod.set_rng_state(s, i)
            with contextlib.ExitStack() as stack:
                stack.enter_context(_backend.use_backend(self.backend))
                for dev, (enabled, dtype) in self.autocast.items():
                    stack.enter_context(
                        torch.autocast(dev, enabled=enabled, dtype=dtype, cache_enabled=self.autocast_cache)
                    )
                yield


# --------------------------------------------------------------------------- region frame
class _Frame:
    def __init__(self, fn, spec, fwd_state, rerun_context, early_stop, check):
        self.fn = fn
        self.spec = spec
        self.fwd_state = fwd_state
        self.rerun_context = rerun_context
        self.early_stop = early_stop
        self.check = check
        self.input_saver = None
        self.weak_holders = []
        self.metas = []
        self.recomputed = defaultdict(weakref.WeakKeyDictionary)
        self.counter = defaultdict(int)
        self.is_recomputed = defaultdict(bool)
        self.forward_completed = False
        self.ignore_count_mismatch = False

    def inputs(self):
        node = self.input_saver.grad_fn
        return node.get_flat(node.saved_tensors)

    def rerun(self, flat):
        """Run the block again as in the forward (RNG, autocast, no BatchNorm update)."""
        args, kwargs = tree_unflatten(list(flat), self.spec)
        with self.fwd_state.replay(), self.rerun_context, _state.rerunning():
            return self.fn(*args, **kwargs)


class _SaveInputs(torch.autograd.Function):
    """Keeps the region's tensor inputs through autograd's saved-tensor machinery,
    so outer hooks (nested regions, offloading, byte counters) see them."""

    @staticmethod
    def forward(dummy, *flat):
        return dummy.new_empty((0,))

    @staticmethod
    def setup_context(ctx, inputs, output):
        flat = inputs[1:]
        slots, tensors = [], []
        for v in flat:
            recipe = _output_recipe(v) if isinstance(v, torch.Tensor) else None
            if recipe is not None:
                slots.append(("rerun", recipe, v.requires_grad))
            elif isinstance(v, torch.Tensor):
                slots.append(("saved", len(tensors), None))
                tensors.append(v)
            else:
                slots.append(("const", v, None))
        ctx.save_for_backward(*tensors)
        ctx.out_dtype, ctx.out_device = output.dtype, output.device

        def get_flat(saved):
            out = []
            for kind, value, requires_grad in slots:
                if kind == "saved":
                    out.append(saved[value])
                elif kind == "const":
                    out.append(value)
                else:
                    out.append(_regenerate(value, requires_grad))
            return out

        ctx.get_flat = get_flat

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("fusedrc internal error: the input saver is not part of any graph")

    @staticmethod
    def jvp(ctx, *tangents):
        # forward-mode AD (dual inputs) flows through the region's own ops; this node only saves.
        # (None here trips an internal assert in torch: a zero tangent of the empty output instead)
        return torch.empty((0,), dtype=ctx.out_dtype, device=ctx.out_device)


class _ForwardHook(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, frame):
        @_state.region_hook
        def pack(x):
            holder = _Holder()
            frame.weak_holders.append(weakref.ref(holder))
            if frame.check:
                frame.metas.append(_meta(x))
            return holder

        def unpack(holder):
            gid = torch._C._current_graph_task_id()
            if gid == -1:  # unpacked outside backward, e.g. grad_fn._saved_self
                gid = uuid.uuid4().int
            if not frame.is_recomputed[gid]:
                flat = frame.inputs()
                try:
                    with _RerunHook(weakref.ref(frame), gid), torch.enable_grad():
                        frame.rerun(flat)
                except _StopRerun:
                    pass
                frame.is_recomputed[gid] = True
                filled = frame.counter[gid]
                if filled < len(frame.weak_holders) and not frame.ignore_count_mismatch:
                    raise RecomputeError(
                        f"recompute: the rerun in backward saved {filled} tensors but the forward saved "
                        f"{len(frame.weak_holders)}; the block must do the same work when rerun "
                        "(no data-dependent branches on global state)"
                    )
            handle = holder.handles.get(gid)
            if handle is None:
                raise RecomputeError(
                    "recompute: a saved tensor was unpacked twice in one backward pass; read "
                    "ctx.saved_tensors only once per backward"
                )
            value = frame.recomputed[gid][handle]
            holder.handles[gid] = None
            return value

        super().__init__(pack, unpack)


class _RerunHook(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, frame_ref, gid):
        @_state.region_hook
        def pack(x):
            x = x.detach() if x.requires_grad else x
            frame = frame_ref()
            idx = frame.counter[gid]
            frame.counter[gid] += 1
            if idx >= len(frame.weak_holders):
                if not frame.forward_completed:
                    # backward ran inside the forward (torch.autograd.grad in the block)
                    frame.ignore_count_mismatch = True
                    return x
                raise RecomputeError(
                    f"recompute: the rerun in backward saved more tensors than the forward "
                    f"({len(frame.weak_holders)}); the block must do the same work when rerun"
                )
            if frame.check and frame.metas[idx] != _meta(x):
                raise RecomputeError(
                    f"recompute: tensor #{idx} saved by the rerun differs from the forward's: "
                    f"forward {_describe(frame.metas[idx])}, rerun {_describe(_meta(x))}. The block "
                    "must be deterministic in shapes, dtypes and devices (pass determinism_check='none' "
                    "to skip this check)"
                )
            holder = frame.weak_holders[idx]()
            if holder is not None:  # None: its node was already freed (grad inside forward)
                handle = _Handle()
                holder.handles[gid] = handle
                frame.recomputed[gid][handle] = x
            if frame.early_stop and frame.counter[gid] == len(frame.weak_holders):
                raise _StopRerun
            return x

        super().__init__(pack, lambda x: x)


# --------------------------------------------------------------------------- output_recompute
# tensor -> (frame, index in the flattened output, version at tagging time)
_OUTPUT_RECIPES = WeakTensorKeyDictionary()


def _tag_outputs(out, frame, inputs=()):
    ids = {id(v) for v in inputs if isinstance(v, torch.Tensor)}
    for i, leaf in enumerate(tree_flatten(out)[0]):
        # an input returned as is stays alive through the frame anyway (a weak key whose value holds
        # it would never die): consumers save it as usual
        if isinstance(leaf, torch.Tensor) and id(leaf) not in ids:
            _OUTPUT_RECIPES[leaf] = (frame, i, leaf._version)


def _output_recipe(t):
    if torch.compiler.is_compiling():
        return None  # no tagging under torch.compile (see _compiled)
    if _state.under_recompute_hooks():
        # the consumer is not top-level (inside another region, its rerun, a torch checkpoint):
        # its saves go to the outer hooks, which must see the same tensors in forward and rerun,
        # and the rerun's input is not tagged: keep it as usual
        return None
    entry = _OUTPUT_RECIPES.get(t)
    if entry is None or entry[2] != t._version:  # modified in place since: keep it
        return None
    return entry[:2]


def _has_tagged_input(flat):
    return any(isinstance(v, torch.Tensor) and _output_recipe(v) is not None for v in flat)


def _regenerate(recipe, requires_grad):
    """Rebuild a producing region's output (not stored) from that region's inputs."""
    frame, index = recipe
    # the region's own (no-op) hook on the stack: fused ops inside take the plain path they took in
    # the producer's forward (_state.inside_region), hence its dropout masks and its bits
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(_state.region_hook(lambda t: t), lambda t: t):
        out = frame.rerun(frame.inputs())
    value = tree_flatten(out)[0][index].detach()
    return value.requires_grad_(requires_grad)


# --------------------------------------------------------------------------- public API
_DETERMINISM_CHECKS = ("default", "none")


def _check_devices(block, flat):
    module = block if isinstance(block, nn.Module) else getattr(block, "__self__", None)
    if not isinstance(module, nn.Module):
        return
    devices = {p.device for p in module.parameters()}
    if len(devices) != 1:
        return
    (device,) = devices
    for i, v in enumerate(flat):
        # checked: floating-point inputs (activations). A 0-dim CPU tensor is a scalar torch ops take
        # on any device, and integer side tensors (lengths, indices) may live elsewhere by design
        # (pack_padded_sequence wants its lengths on the CPU)
        if isinstance(v, torch.Tensor) and v.device != device and v.is_floating_point() \
                and not (v.dim() == 0 and v.device.type == "cpu"):
            raise ValueError(
                f"recompute: input tensor #{i} of block's arguments is on {v.device}, but the block's "
                f"parameters are on {device}; expected every input on {device}"
            )


def _contexts(context_fn):
    """The (forward, rerun) context managers ``context_fn`` returns, checked."""
    if context_fn is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    pair = context_fn()
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(hasattr(c, "__enter__") and hasattr(c, "__exit__") for c in pair)):
        raise TypeError(f"context_fn must return a pair of context managers (forward, rerun), got {pair!r}")
    return tuple(pair)


def _generic(fn, args, kwargs, *, preserve_rng_state, output_recompute, context_fn, determinism_check, early_stop):
    flat, spec = tree_flatten((args, kwargs))
    fwd_context, rerun_context = _contexts(context_fn)
    frame = _Frame(
        fn, spec, _ForwardState(flat, preserve_rng_state), rerun_context, early_stop,
        check=determinism_check == "default",
    )
    dummy = torch.empty((0,), requires_grad=True)
    frame.input_saver = _SaveInputs.apply(dummy, *flat)
    # Outputs are left to regeneration only where it is safe: at top level (inside an outer region,
    # its rerun or a torch.utils.checkpoint, the inputs are the outer hooks' placeholders, which one
    # backward unpacks once; a byte counter is fine) and without a context_fn (its rerun context is
    # entered once per backward).
    merge = output_recompute and not _state.under_recompute_hooks() and context_fn is None
    with _ForwardHook(frame), fwd_context:
        out = fn(*args, **kwargs)
    frame.forward_completed = True
    if merge:
        _tag_outputs(out, frame, flat)
    return out


def _compiled(fn, args, kwargs, *, preserve_rng_state, context_fn):
    """A generic region while dynamo traces: ``torch.utils.checkpoint`` (non-reentrant).

    The saved-tensors-hook engine above cannot be traced (hooks that call back
    into Python in backward, weak dictionaries, per-graph-task state), while
    dynamo turns ``checkpoint`` into a higher-order op whose rerun the AOT
    partitioner places in the backward graph: no graph break. What changes
    under compile: ``output_recompute`` has no effect (the output is kept, as
    when its consumer is not recomputed), ``early_stop`` and
    ``determinism_check`` do not apply (the rerun is part of the compiled
    backward), and ``context_fn`` is handed to ``checkpoint`` as is (dynamo
    accepts only selective-checkpoint contexts there).
    """
    extra = {} if context_fn is None else {"context_fn": context_fn}
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **extra, **kwargs
    )


def _recompute(block, fn, args, kwargs, *, preserve_rng_state=True, output_recompute=False,
               context_fn=None, determinism_check="default", early_stop=True):
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(f"determinism_check must be one of {_DETERMINISM_CHECKS}, got {determinism_check!r}")
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"context_fn must be a callable returning two context managers, got {context_fn!r}")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # no graph: nothing to save, a plain call
    if not torch.compiler.is_compiling() and torch._C._functorch.maybe_current_level() is not None:
        # inside a torch.func transform (grad, vmap, jvp, jacrev, ...): saved-tensor hooks and the
        # rerun do not compose with its levels (torch.func.grad refuses the hooks; vmap then backward
        # would rerun on unbatched tensors): the block as it is, differentiable by the transform
        return fn(*args, **kwargs)
    flat = tree_flatten((args, kwargs))[0]
    _check_devices(block, flat)
    # the fused ops keep their own saved state: contexts, output merging and a
    # merged (not stored) input need the generic region
    if context_fn is None and not output_recompute and not _has_tagged_input(flat):
        fused = _patterns.match(block, args, kwargs)
        if fused is not None:
            return fused()
    if torch.compiler.is_compiling():
        return _compiled(fn, args, kwargs, preserve_rng_state=preserve_rng_state, context_fn=context_fn)
    return _generic(
        fn, args, kwargs, preserve_rng_state=preserve_rng_state, output_recompute=output_recompute,
        context_fn=context_fn, determinism_check=determinism_check, early_stop=early_stop,
    )


def _reject_reentrant(use_reentrant):
    if use_reentrant is None:  # torch's default spelling: the non-reentrant variant
        return
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be a bool (False), got {type(use_reentrant).__name__} {use_reentrant!r}")
    if use_reentrant:
        raise ValueError(
            "use_reentrant=True is not supported: reentrant checkpointing runs the block inside an "
            "autograd.Function, which breaks torch.autograd.grad, backward(inputs=...), nested "
            "outputs and inputs that do not require grad, and PyTorch itself deprecates it. "
            "Use use_reentrant=False (the default)."
        )


def recompute(block, *args, preserve_rng_state=True, output_recompute=False, use_reentrant=False,
              context_fn=None, determinism_check="default", early_stop=True, **kwargs):
    """Run ``block(*args, **kwargs)`` keeping only its inputs; rerun it in backward.

    A drop-in for ``torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)``
    and for ``mindspore.recompute(block, *args)``. ``block`` is any callable or
    ``nn.Module``. When it is a recognised pattern (``nn.Sequential(Linear, act)``,
    ``nn.Sequential(Linear, act, [Dropout], Linear)``, dropout fused,
    ``nn.Sequential(Conv2d, BatchNorm2d, ReLU)`` or a ``fusedrc.nn`` module) a fused
    op runs instead: its backward recomputes inside the kernel and never reruns
    the output op.

    Args:
        block: the callable to run.
        *args, **kwargs: its arguments: tensors, non-tensors, nested tuples/lists/dicts.
        preserve_rng_state: replay the forward's RNG state in the rerun, so dropout
            masks are identical; the global RNG stream is left where a plain run leaves it.
        output_recompute: do not store this block's output when the consumer is
            another (generic) recompute region: the consumer regenerates it from this
            block's inputs (MindSpore's ``output_recompute``). Without a recomputed
            consumer it changes nothing.
        use_reentrant: must be False; the reentrant variant is not supported.
        context_fn, determinism_check, early_stop: as in ``torch.utils.checkpoint``.

    Under ``torch.no_grad()`` or ``inference_mode()`` the block is simply called.
    BatchNorm running statistics change once per forward, never in the rerun.

    Under ``torch.compile`` a recognised pattern is matched at trace time and its
    fused op (a ``torch.library`` custom op) goes into the graph: no graph break. A
    generic block runs through ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``,
    which dynamo traces (no graph break either) and the compiled backward reruns; there
    ``output_recompute``, ``early_stop`` and ``determinism_check`` have no effect.

    Returns:
        What ``block(*args, **kwargs)`` returns.

    Raises:
        TypeError: ``block`` is not callable, or ``context_fn`` is not.
        ValueError: ``use_reentrant=True``, an unknown ``determinism_check``, or a
            floating-point input tensor (not a 0-dim scalar) on another device than the block's
            parameters.
        RecomputeError: in backward, when the rerun saves tensors that differ from the
            forward's (shape, dtype, device or count).

    Example::

        >>> import torch, fusedrc
        >>> ffn = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> y = fusedrc.recompute(ffn, x)      # a fused op: keeps only x; 7 GEMMs per step
        >>> torch.allclose(y, ffn(x))
        True
        >>> y.sum().backward()
        >>> x.grad.shape
        torch.Size([8, 64])
        >>> def block(x, scale=1.0):          # any callable: the generic path
        ...     return torch.tanh(x) * scale
        >>> fusedrc.recompute(block, x, scale=2.0).shape
        torch.Size([8, 64])
    """
    if not callable(block):
        raise TypeError(f"block must be a callable or nn.Module, got {type(block).__name__}")
    _reject_reentrant(use_reentrant)
    return _recompute(
        block, block, args, kwargs, preserve_rng_state=preserve_rng_state,
        output_recompute=output_recompute, context_fn=context_fn,
        determinism_check=determinism_check, early_stop=early_stop,
    )


def _segment(functions, start, end):
    chunk = functions[start : end + 1]
    if all(isinstance(f, nn.Module) for f in chunk):
        return nn.Sequential(*chunk)  # a Sequential can match a fused pattern

    def run(x):
        for f in chunk:
            x = f(x)
        return x

    return run


def recompute_sequential(functions, segments, input, *extra, preserve_rng_state=True, **kwargs):
    """Recompute a sequential model in ``segments`` chunks (``checkpoint_sequential``'s contract).

    ``functions`` is an ``nn.Sequential`` or a list of modules/callables applied in
    order to the single ``input``; every segment but the last is recomputed.

    Example::

        >>> model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
        >>> y = fusedrc.recompute_sequential(model, 4, torch.randn(4, 32, requires_grad=True))
    """
    if extra:
        raise TypeError(
            f"recompute_sequential takes one input, got {1 + len(extra)} positional inputs; "
            "pass several tensors as one tuple and let the first function unpack it"
        )
    _reject_reentrant(kwargs.pop("use_reentrant", False))  # False is what torch asks callers to pass: accepted
    if kwargs:
        raise TypeError(f"recompute_sequential got unexpected keyword arguments {sorted(kwargs)}")
    if isinstance(functions, nn.Sequential):
        functions = list(functions.children())
    elif isinstance(functions, (list, tuple)):
        functions = list(functions)
        for i, f in enumerate(functions):
            if not callable(f):
                raise TypeError(f"functions[{i}] must be callable, got {type(f).__name__}")
    else:
        raise TypeError(f"functions must be an nn.Sequential or a list of modules, got {type(functions).__name__}")
    n = len(functions)
    if n == 0:
        raise ValueError("functions must hold at least one module or callable, got an empty sequence")
    if isinstance(segments, bool) or not isinstance(segments, numbers.Integral):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    segments = int(segments)
    if not 1 <= segments <= n:
        raise ValueError(f"segments must be between 1 and {n} (the number of functions), got {segments}")
    size = n // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = recompute(_segment(functions, start, end), input, preserve_rng_state=preserve_rng_state)
    return _segment(functions, end + 1, n - 1)(input)


# --------------------------------------------------------------------------- mark / unmark
_MARK = "_fusedrc_mark"


def _is_marked(module):
    return _MARK in module.__dict__


def mark(module, output_recompute=False):
    """Recompute every call of ``module`` from now on (MindSpore's ``Cell.recompute()``).

    Returns the module. Marking a module that contains a marked module raises
    ``RecomputeError``, as does calling a marked module inside another one.
    Under ``torch.compile`` the module is recomputed as :func:`recompute` does there
    (nesting is then not checked: nested regions are nested checkpoints).

    Example::

        >>> block = fusedrc.mark(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)))
        >>> block(torch.randn(2, 16, requires_grad=True)).sum().backward()
    """
    return _mark(module, output_recompute)


def _mark(module, output_recompute=False, when=None):
    """``mark``, plus ``when(args, kwargs) -> bool``: calls it answers False for run plainly
    (fusedrc.convert: decoder layers handed a KV cache, which a rerun would update twice)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError(f"module must be an eager nn.Module, got a TorchScript {type(module).__name__}: its "
                        "forward cannot be rerun with saved-tensor hooks; mark the module before scripting, "
                        "or use torch.compile")
    if _is_marked(module):  # marking twice is marking once (MindSpore's Cell.recompute())
        module.__dict__[_MARK]["output_recompute"] = bool(output_recompute)
        module.__dict__[_MARK].pop("by_convert", None)  # marked by hand now: a later convert keeps it
        return module
    for name, sub in module.named_modules():
        if sub is not module and _is_marked(sub):
            raise RecomputeError(
                f"cannot mark {type(module).__name__}: its submodule {name!r} is already marked; nested "
                "recomputed modules are not allowed (as in MindSpore). Unmark the inner one first."
            )
    # an instance forward already there (fusedrc.convert's fx rewrite) is what gets recomputed
    options = _MarkOptions(output_recompute=bool(output_recompute), inner=module.__dict__.get("forward"), when=when)
    module.__dict__[_MARK] = options
    module.__dict__["forward"] = _MarkedForward(module)
    bind_replicas(module)
    return module


class _MarkOptions(dict):
    """A marked module's options; a replica gets its own copy, the wrapped forward rebound."""

    def _fusedrc_rebind(self, replica):
        return _MarkOptions(self, inner=_rebound(self.get("inner"), replica))


def bind_replicas(module):
    """Make ``nn.DataParallel`` replicas of ``module`` rebind its instance-level objects.

    ``replicate`` builds a replica by copying the module's ``__dict__``: an instance ``forward``
    holding the module (``mark``'s, ``convert``'s fx rewrite) would run the original, with the
    original's parameters. Objects with a ``_fusedrc_rebind(replica)`` method are rebuilt for the
    replica instead, and the replica gets this hook in turn."""
    module.__dict__["_replicate_for_data_parallel"] = _Replicate(module)


def _rebound(value, replica):
    rebind = getattr(value, "_fusedrc_rebind", None)
    return value if rebind is None else rebind(replica)


class _Replicate:
    """The instance ``_replicate_for_data_parallel`` that :func:`bind_replicas` installs."""

    def __init__(self, module):
        self.module = module

    def _fusedrc_rebind(self, replica):
        return _Replicate(replica)

    def __call__(self):
        replica = type(self.module)._replicate_for_data_parallel(self.module)
        d = replica.__dict__
        for key, value in list(d.items()):
            d[key] = _rebound(value, replica)
        return replica


class _MarkedForward:
    """The instance ``forward`` of a marked module. An object holding the module, not a
    closure, so ``copy.deepcopy`` (and ``convert``'s copy) rebinds it to the copy."""

    _fusedrc_forward = True  # runs the module's own computation (fused paths may look inside)

    def __init__(self, module):
        self.module = module

    def _fusedrc_rebind(self, replica):
        return _MarkedForward(replica)

    @property
    def __code__(self):  # read as a plain function's by torch.export (non-strict) for its shape env's name
        return type(self.module).forward.__code__

    def __call__(self, *args, **kwargs):
        module = self.module
        options = module.__dict__[_MARK]
        # a partial, not a bound method: dynamo before torch 2.13 cannot build a method object (a graph break)
        original = options.get("inner") or functools.partial(type(module).forward, module)
        output_recompute = options["output_recompute"]
        when = options.get("when")
        if when is not None and not when(args, kwargs):
            return original(*args, **kwargs)
        if torch.compiler.is_compiling():
            # dynamo cannot trace the thread-local nesting bookkeeping below; a marked module
            # inside another is then a nested torch.utils.checkpoint region, which is correct
            return _recompute(module, original, args, kwargs, output_recompute=output_recompute)
        if _state.marked_depth() > 0 and not _state.in_recompute():
            raise RecomputeError(
                f"a marked {type(module).__name__} was called inside another marked module; nested "
                "recomputed modules are not allowed (as in MindSpore)"
            )

        def run(*a, **k):
            if _state.in_recompute():  # the rerun calls forward, not __call__: no global pre-hook for module itself
                _state._bn_pre_hook(module, a)
            with _state.inside_marked():
                return original(*a, **k)

        return _recompute(module, run, args, kwargs, output_recompute=output_recompute)


def unmark(module):
    """Undo :func:`mark`: calls of ``module`` are plain again. Returns the module."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if _is_marked(module):
        inner = module.__dict__.pop(_MARK).get("inner")
        if inner is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = inner
        # the replica hook stays while something else bound to the module needs it (convert's)
        if not any(hasattr(v, "_fusedrc_rebind") for k, v in module.__dict__.items()
                   if k != "_replicate_for_data_parallel"):
            module.__dict__.pop("_replicate_for_data_parallel", None)
    return module
