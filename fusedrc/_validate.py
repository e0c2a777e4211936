"""Argument checks shared by the functional layer and the modules.

Every failure names the argument and what was expected, before any kernel runs:
``TypeError`` for a wrong kind of object or dtype, ``ValueError`` for a wrong
value, shape or device.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch.autograd import forward_ad

from .reference import check_activation  # noqa: F401  (the one definition, re-exported for the layers)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_no_overlap(t, name):
    """``t`` (a 1-D buffer updated in place) must not have elements sharing memory (an expanded
    tensor: stride 0). Read from shape and strides, which dynamo and vmap trace (torch's
    ``_debug_has_internal_overlap`` graph-breaks and has no batching rule)."""
    if t is None or torch.compiler.is_compiling():
        return
    if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
        raise ValueError(f"{name} is updated in place and must not have overlapping memory (an expanded "
                         f"tensor), got strides {t.stride()} for shape {tuple(t.shape)}")


def check_tensor(t, name, *, ndim=None, min_ndim=None, floating=True):
    """``t`` must be a tensor (of ``ndim`` / at least ``min_ndim`` dimensions, floating point)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {t.dim()}-D with shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if floating and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor of dtype float16, bfloat16, float32 or float64, "
                        f"got dtype {t.dtype}")
    return t


def check_device(x, name_x, t, name):
    """``t`` (a parameter or another operand) must live on ``x``'s device."""
    if t is not None and t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but {name_x} is on {x.device}; expected the same device")


def check_same(x, name_x, t, name, *, dtype=True):
    """``t`` must live on x's device and, if ``dtype``, share its dtype."""
    if t is None:
        return
    check_device(x, name_x, t, name)
    if dtype and t.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {name_x} has dtype {x.dtype}; expected the same dtype")


def check_vector(t, name, size, x, name_x="input", *, dtype=True):
    """``t`` is None or a 1-D tensor of ``size`` elements on x's device (and of x's dtype)."""
    if t is None:
        return
    check_tensor(t, name, ndim=1)
    if t.shape[0] != size:
        raise ValueError(f"{name} must have shape ({size},), got {tuple(t.shape)}")
    check_same(x, name_x, t, name, dtype=dtype)


def check_int(v, name, *, min_value=0):
    """``v`` must be an int (not a bool) ``>= min_value``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v < min_value:
        kind = {0: "a non-negative int", 1: "a positive int"}.get(min_value, f"an int >= {min_value}")
        raise ValueError(f"{name} must be {kind}, got {v}")
    return int(v)


def check_number(v, name, *, min_value=None):
    """``v`` must be a finite real number (not a bool), ``>= min_value`` if given.

    Symbolic numbers (``torch.SymFloat`` under ``torch.compile``) pass unchecked.
    """
    if isinstance(v, (torch.SymFloat, torch.SymInt)):
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(v).__name__} {v!r}")
    if torch.compiler.is_compiling():
        return v  # may be data-dependent while dynamo traces (BatchNorm's 1/num_batches_tracked)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite float, got {v!r}")
    if min_value is not None and v < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {v}")
    return float(v)


def check_probability(v, name):
    """``v`` must be a real number in ``[0, 1]`` (symbolic numbers under ``torch.compile`` pass)."""
    v = check_number(v, name, min_value=0.0)
    if not isinstance(v, (torch.SymFloat, torch.SymInt)) and v > 1:
        raise ValueError(f"{name} must be a probability in [0, 1], got {v}")
    return v


def check_module(m, name, cls, exact=False):
    """``m`` must be an instance of ``cls`` (a ``torch.nn`` module class; with ``exact``, not a
    subclass, whose own forward a fused op would skip), its parameters materialized."""
    if not isinstance(m, cls):
        raise TypeError(f"{name} must be an nn.{cls.__name__}, got {type(m).__name__}")
    if exact and torch.nn.utils.parametrize.type_before_parametrizations(m) is not cls:
        raise TypeError(f"{name} must be an nn.{cls.__name__}, got the subclass {type(m).__name__}, whose own "
                        "forward the fused op would skip")
    if isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
        raise ValueError(f"{name} is a lazy module whose parameters are not initialized yet; run it once "
                         "on an input first")
    return m


def pair(v, name, *, min_value=None):
    """An int or a pair of ints as a list of two; each ``>= min_value`` if given."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        out = [int(v), int(v)]
    elif (isinstance(v, (tuple, list)) and len(v) == 2
          and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in v)):
        out = [int(i) for i in v]
    else:
        raise TypeError(f"{name} must be an int or a pair of ints, got {v!r}")
    if min_value is not None and min(out) < min_value:
        kind = {0: "non-negative", 1: "positive"}.get(min_value, f">= {min_value}")
        raise ValueError(f"{name} must be {kind}, got {v!r}")
    return out


def needs_unfused(*tensors) -> bool:
    """Whether forward-mode AD (``torch.autograd.forward_ad``) or a ``torch.func`` transform (grad,
    vmap, jvp, ...) tracks one of these tensors. The fused ops define a reverse-mode backward only,
    so such a call runs as the plain composition of torch ops: correct, differentiable by the
    transform, not recomputed."""
    if torch.compiler.is_compiling():
        return False
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    if forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None for t in ts):
        return True
    return any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in ts)


class CheckedCalls:
    """What the static checks of a functional op's calls returned, by the call's metadata
    (``call_key``): a layer called every step with tensors of the same shapes, dtypes, devices and
    strides and the same arguments passes them every time, and in eager mode a small layer's step
    waits on them. The checks that depend on more than that (autocast, forward-mode AD, recompute
    regions, the backend setting) still run every call."""

    MAX = 1024  # distinct call signatures; past that the cache starts over (correct, slower)

    def __init__(self):
        self._entries = {}

    def get(self, key):
        return None if key is None else self._entries.get(key)

    def put(self, key, value):
        if key is not None:
            if len(self._entries) >= self.MAX:
                self._entries.clear()
            self._entries[key] = value
        return value

    def clear(self):
        self._entries.clear()

    def __len__(self):
        return len(self._entries)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SCALARS = (int, float, bool, str, type(None), torch.dtype)


def call_key(tensors, scalars):
    """A key of everything a call's static checks read, or None (not cached: torch.compile or a
    dispatch mode is tracing, a tensor subclass or a non-strided tensor, an argument of another
    kind than None, a plain int/float/bool/str or a list/tuple of ints). Tensors stand for their
    shape, strides, dtype and device; scalars for their type and value (``True`` is not ``1``)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return None
    key = []
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) in _PLAIN and t.layout is torch.strided:
            key.append((t.shape, t.stride(), t.dtype, t.device))
        else:
            return None
    for v in scalars:
        kind = type(v)
        if kind in _SCALARS:
            key.append((kind, v))
        elif kind in (list, tuple) and all(type(i) is int for i in v):
            key.append((kind, *v))
        else:
            return None
    return tuple(key)
