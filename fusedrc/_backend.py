"""Backend selection: which implementation ("triton" or "reference") runs a fused op.

The choice is thread-local. ``"auto"`` picks Triton for CUDA tensors when Triton
imports and the op has a kernel, the pure-PyTorch reference otherwise.
``"triton"`` on CPU tensors only runs under Triton's interpreter
(``TRITON_INTERPRET=1``); that is how kernels are tested without a GPU.
"""
from __future__ import annotations

import functools
import importlib
import os
import threading

import torch

BACKENDS = ("auto", "triton", "reference")

_state = threading.local()


def current_backend() -> str:
    """Return the name of the active backend in this thread: "auto", "triton" or "reference"."""
    return getattr(_state, "name", "auto")


def _validate_backend_name(name) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend name must be one of {BACKENDS}, got {name!r}")
    return name


class use_backend:
    """Select the backend that runs fusedrc's fused ops, in this thread.

    Takes effect at the call itself, and as a context manager restores the
    previous backend on exit::

        fusedrc.use_backend("reference")          # from now on, in this thread
        with fusedrc.use_backend("triton"):       # only inside the block
            loss = model(x).sum()

    ``name`` is ``"auto"`` (default: Triton for CUDA tensors, reference on CPU),
    ``"triton"`` or ``"reference"``.
    """

    def __init__(self, name: str):
        _validate_backend_name(name)
        self.name = name
        # the setting before this call: what the first `with` restores
        self._fresh = current_backend()
        self._restore = []
        _state.name = name

    def __enter__(self):
        # `with use_backend(x):` (entered while the call's own setting stands): restore what was there
        # before the call; an object entered later, after other changes or again (kept in a variable),
        # sets its backend anew and restores the then-current one
        fresh = self._fresh is not None and current_backend() == self.name
        self._restore.append(self._fresh if fresh else current_backend())
        self._fresh = None
        _state.name = self.name
        return self

    def __exit__(self, *exc):
        _state.name = self._restore.pop()
        return False

    def __repr__(self):
        return f"use_backend({self.name!r})"


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:  # ImportError, or a broken install raising something else
        return False
    return True


@functools.lru_cache(maxsize=None)
def _triton_module(op_module: str):
    """The kernels module for an op (e.g. ``fusedrc.kernels.linear_act``), or None."""
    if not triton_available():
        return None
    try:
        module = importlib.import_module(f"fusedrc.kernels.{op_module}")
    except ModuleNotFoundError as e:
        if e.name == f"fusedrc.kernels.{op_module}":
            return None
        raise
    from fusedrc import ops

    ops.register_triton_ops()  # the ops' triton_op twins need Triton: registered with the first kernels module
    return module


def has_triton_kernel(op_module: str, fn_name: str) -> bool:
    mod = _triton_module(op_module)
    return mod is not None and hasattr(mod, fn_name)


def _constant_for_dynamo(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo (and,
    through it, Triton) when fusedrc is imported: the decorator only sets this attribute."""
    fn._dynamo_marked_constant = True
    return fn


# Fixed for the life of the process, and untraceable (importlib): dynamo calls these
# at trace time and keeps the answer, so ``resolve_backend`` adds no graph break.
@_constant_for_dynamo
def _triton_importable() -> bool:
    return triton_available()


@_constant_for_dynamo
def _kernel_exists(op_module: str, fn_name: str) -> bool:
    return has_triton_kernel(op_module, fn_name)


TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def resolve_backend(x: torch.Tensor, op_module: str, fn_name: str) -> str:
    """Turn the thread's backend setting into "triton" or "reference" for one op call on ``x``."""
    name = current_backend()
    device = x.device
    if name == "reference" or device.type == "meta":  # meta: shapes only, the reference computes them
        return "reference"
    if name == "auto":
        if device.type == "cuda" and x.dtype in TRITON_DTYPES and _kernel_exists(op_module, fn_name):
            return "triton"
        return "reference"
    runnable = device.type == "cuda" or interpreter_active()
    # name == "triton": the user asked for it explicitly, so refuse rather than fall back silently
    if not runnable:
        raise RuntimeError(
            f"backend 'triton' needs CUDA tensors (got tensors on {device}); on the CPU it runs only "
            "under Triton's interpreter (set TRITON_INTERPRET=1 before importing fusedrc). "
            "Use fusedrc.use_backend('reference') or 'auto' for CPU tensors."
        )
    if not _triton_importable():
        raise RuntimeError("backend 'triton' was requested but Triton cannot be imported here")
    if x.dtype not in TRITON_DTYPES or not _kernel_exists(op_module, fn_name):
        # a valid case the kernels do not cover (float64, an op without a kernel yet):
        # the reference twin is correct
        return "reference"
    return "triton"


def get_impl(backend: str, op_module: str, fn_name: str):
    if backend == "triton":
        return getattr(_triton_module(op_module), fn_name)
    from fusedrc import reference

    return getattr(reference, fn_name)
