"""Argument checks shared by the functional layer and the modules.

Every failure names the argument and what was expected, before any kernel runs.
"""
from __future__ import annotations

import torch


def check_tensor(t, name, *, ndim=None, min_ndim=None, floating=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def check_same(x, name_x, t, name, *, dtype=True):
    """``t`` (a parameter) must live on x's device and, if ``dtype``, share its dtype."""
    if t is None:
        return
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but {name_x} is on {x.device}; expected the same device")
    if dtype and t.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {name_x} has dtype {x.dtype}; expected the same dtype")


def check_vector(t, name, size, x, name_x="input", *, dtype=True):
    if t is None:
        return
    check_tensor(t, name, ndim=1)
    if t.shape[0] != size:
        raise ValueError(f"{name} must have shape ({size},), got {tuple(t.shape)}")
    check_same(x, name_x, t, name, dtype=dtype)


def pair(v, name):
    if isinstance(v, int):
        return [v, v]
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(i, int) for i in v):
        return list(v)
    raise TypeError(f"{name} must be an int or a pair of ints, got {v!r}")
