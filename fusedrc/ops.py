"""The fused ops: ``torch.library`` custom ops with registered autograd.

Each op saves only its inputs (and, for conv+BN, the per-channel batch
statistics); its backward op recomputes the forward chain through the backend
chosen at forward time (an op argument, so forward and recompute always run the
same implementation and the same tiles). Ops never mutate their inputs: the
conv+BN op returns the batch statistics and the caller updates running buffers.

Every op exists twice, with one body:

- ``fusedrc::<name>``, a ``custom_op``: opaque to ``torch.compile`` (its fake
  implementation below gives the output layouts). It runs the reference backend,
  and the Triton backend where the kernels cannot be traced: Triton's interpreter
  on CPU tensors under ``torch.compile``/``make_fx``.
- ``fusedrc::<name>_triton``, a ``triton_op`` registered when the Triton backend
  first loads (``register_triton_ops``; it needs Triton): its launchers call the
  kernels through ``wrap_triton``, so under ``torch.compile`` inductor sees and
  schedules the Triton kernels and the cuBLAS/cuDNN calls themselves. Its fake
  implementation is its own body, traced.

``pick`` chooses between them per call. A plain eager call (no torch.compile, make_fx or
dispatch mode watching, a plain tensor) skips the dispatcher: it runs the same body through
an ``autograd.Function`` with the same autograd code (``_EAGER``), which saves the custom
op's Python dispatch overhead, hundreds of microseconds a call, twice a training step per
fused layer; that CPU time bounded small-batch steps on a GPU.
"""
from __future__ import annotations

import inspect
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._backend import get_impl
from .reference import LoRAAdapters, lora_adapter_grads, lora_terms, lora_terms_mask
from ._state import cudnn_conv_tf32, pinned_cudnn_tf32, pinned_tf32, tf32_matmul_allowed

_EMPTY = (0,)

_CUSTOM_OPS = {}   # name -> custom_op (every backend)
_IMPLS = {}        # name -> the body both twins share
_TRITON_OPS = {}   # name -> triton_op, once register_triton_ops has run
_AUTOGRAD = {}     # forward op name -> (backward, setup_context)


def _custom_op(name: str, impl):
    _IMPLS[name] = impl
    op = torch.library.custom_op(f"fusedrc::{name}", impl, mutates_args=())
    _CUSTOM_OPS[name] = op
    return op


def register_triton_ops() -> None:
    """Register the ``triton_op`` twin of every fused op (idempotent; imports Triton)."""
    triton_op = getattr(torch.library, "triton_op", None)
    if _TRITON_OPS or triton_op is None:  # torch < 2.6 has no triton_op: the custom ops serve
        return

    for name, impl in _IMPLS.items():
        if name not in _NO_TRITON_TWIN:
            _TRITON_OPS[name] = triton_op(f"fusedrc::{name}_triton", impl, mutates_args=())
    for name, (backward, setup) in _AUTOGRAD.items():
        if name in _TRITON_OPS:
            _TRITON_OPS[name].register_autograd(backward, setup_context=setup)


def _twin_traceable(x: Tensor) -> bool:
    """Whether a triton_op twin can run this call: always on CUDA; on CPU tensors (Triton's
    interpreter, which cannot be traced) only when neither torch.compile nor make_fx /
    AOTAutograd (FakeTensor, FunctionalTensor inputs) is tracing it."""
    if x.is_cuda:
        return True
    return not torch.compiler.is_compiling() and type(x) in (torch.Tensor, torch.nn.Parameter)


def _plain_eager(x: Tensor) -> bool:
    """Whether nothing would see the difference between the op and its body: no torch.compile,
    no dispatch mode (make_fx, FakeTensorMode, a FlopCounterMode or a user's), no torch.func
    transform, a plain tensor."""
    if torch.compiler.is_compiling():  # first: dynamo cannot trace the dispatch-stack query
        return False
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active())


def pick(name: str, x: Tensor, backend: str):
    """What runs ``name`` on ``x`` with ``backend``: in a plain eager call the op's body, through
    its ``autograd.Function`` for a forward op; else the triton_op twin for the Triton backend
    where it can be traced, else the custom op (which runs either backend)."""
    if _plain_eager(x):
        return _EAGER[name]
    if backend == "triton" and name in _TRITON_OPS and _twin_traceable(x):
        return _TRITON_OPS[name]
    return _CUSTOM_OPS[name]


def _no_double_backward(name):
    if torch.is_grad_enabled():
        # create_graph=True: the backward ops have no derivative of their own
        raise RuntimeError(
            f"double backward through the fused op fusedrc::{name} is not supported; wrap the block "
            "in fusedrc.recompute with a non-fused callable (the generic path supports it)"
        )


def _output_mask(ctx, positions) -> List[bool]:
    """Which of the op's inputs at ``positions`` autograd wants a gradient for: the backward
    ops skip the work of the others (a frozen weight's GEMM, a first layer's dX). A custom op's call
    drops trailing arguments left at their defaults: a position past them wants none."""
    need = ctx.needs_input_grad
    return [i < len(need) and bool(need[i]) for i in positions]


def _wanted_grads(grads, inputs, mask):
    """The backward op's outputs as autograd takes them: None for an absent input or a
    gradient masked off (which travels as an empty tensor)."""
    return tuple(None if t is None or not m else g for g, t, m in zip(grads, inputs, mask))


def _fake_grads(inputs, output_mask, x: Tensor, channels_last: bool = False, images=(0,), like=()):
    """The layouts of a backward op's outputs: each gradient like its input (dense; the inputs at
    ``images`` in x's conv memory format; those at ``like`` with the input's own strides, as
    ``torch.empty_like`` gives them); empty where the input is absent or ``output_mask`` masks it off."""
    mask = output_mask if output_mask is not None else [True] * len(inputs)
    return tuple(_empty(_EMPTY, x) if t is None or not m else torch.empty_like(t) if i in like
                 else _empty(t.shape, t, channels_last=channels_last and i in images)
                 for i, (t, m) in enumerate(zip(inputs, mask)))


def _or_empty(t: Optional[Tensor], ref: Tensor) -> Tensor:
    # custom ops return Tensors only: a missing gradient travels as an empty tensor
    return ref.new_empty(_EMPTY) if t is None else t


# --------------------------------------------------------------------------- output layouts
# Under torch.compile the fake implementations stand for the ops, and inductor checks
# the real outputs' strides against them. So every output has one documented layout,
# whatever the backend and the inputs' strides: dense row-major, except 4-D
# activations and their gradients, which follow the conv's memory format of ``x``
# (channels_last when x is channels_last and not also contiguous, like the kernels), and
# a conv weight's gradient and the routed experts' stacked weights' gradients, which have the weights'
# strides (``torch.empty_like``'s).
# Strides of size-1 dimensions are free (inductor's asserts skip them).
# A real output already laid out so (the usual case) is returned as is, never copied.
def _channels_last(x: Tensor) -> bool:
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _dense_strides(shape, channels_last: bool = False):
    if channels_last and len(shape) == 4:  # an absent gradient travels as a 1-D empty tensor
        n, c, h, w = shape
        return (h * w * c, 1, w * c, c)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _empty(shape, like: Tensor, dtype=None, channels_last: bool = False) -> Tensor:
    return torch.empty_strided(tuple(shape), _dense_strides(tuple(shape), channels_last),
                               dtype=dtype or like.dtype, device=like.device)


def _strides_match(t: Tensor, strides) -> bool:
    # a size-1 dimension's stride is free: neither inductor's stride asserts nor autograd's
    # gradient layout contract look at it (a 1x1 conv weight is both contiguous and channels_last)
    return all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), strides))


def _laid_out(t: Tensor, channels_last: bool = False, dtype=None) -> Tensor:
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    # torch's contiguity checks skip size-1 dimensions as _strides_match does: the usual case, decided
    # in C++ (an empty tensor counts as contiguous there, so it takes the check below)
    if t.is_contiguous(memory_format=torch.channels_last if channels_last and t.dim() == 4 else
                       torch.contiguous_format) and t.numel():
        return t
    if _strides_match(t, _dense_strides(tuple(t.shape), channels_last)):
        return t
    return _empty(t.shape, t, channels_last=channels_last).copy_(t)


def _laid_like(g: Tensor, param: Tensor) -> Tensor:
    """A parameter's gradient with the strides ``torch.empty_like(param)`` has: a conv weight's in its
    own memory format. cuDNN's dW already comes so; made dense row-major instead, it would be copied
    here and copied back by autograd's accumulation, whose layout contract wants the parameter's."""
    if _strides_match(g, param.stride()):  # the usual case, decided without an allocation
        return g
    like = torch.empty_like(param, dtype=g.dtype)  # a non-dense weight: empty_like picks the layout
    return g if _strides_match(g, like.stride()) else like.copy_(g)


def _stats_dtype(x: Tensor):
    # fp32 batch statistics (fp64 for a float64 input: the reference path)
    return torch.promote_types(x.dtype, torch.float32)


# --------------------------------------------------------------------------- Linear + act
def _linear_act_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str) -> Tensor:
    return _laid_out(get_impl(backend, "linear_act", "linear_act_forward")(x, weight, bias, activation))


linear_act_op = _custom_op("linear_act", _linear_act_impl)


@linear_act_op.register_fake
def _(x, weight, bias, activation, backend):
    return _empty((*x.shape[:-1], weight.shape[0]), x)  # the op takes (*, in) as F.linear does


def _linear_act_backward_impl(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], grad_out: Tensor, activation: str, backend: str,
    output_mask: Optional[List[bool]] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    grads = get_impl(backend, "linear_act", "linear_act_backward")(x, weight, bias, grad_out, activation,
                                                                   output_mask)
    return tuple(_laid_out(_or_empty(g, x)) for g in grads)


linear_act_backward_op = _custom_op("linear_act_backward", _linear_act_backward_impl)


@linear_act_backward_op.register_fake
def _(x, weight, bias, grad_out, activation, backend, output_mask=None):
    return _fake_grads((x, weight, bias), output_mask, x)


def _linear_act_setup(ctx, inputs, output):
    x, weight, bias, activation, backend = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.activation, ctx.backend = activation, backend


def _linear_act_backward(ctx, grad_out):
    _no_double_backward("linear_act")
    x, weight, bias = ctx.saved_tensors
    op = pick("linear_act_backward", x, ctx.backend)
    mask = _output_mask(ctx, range(3))
    grads = op(x, weight, bias, grad_out.contiguous(), ctx.activation, ctx.backend, mask)
    return (*_wanted_grads(grads, (x, weight, bias), mask), None, None)


_AUTOGRAD["linear_act"] = (_linear_act_backward, _linear_act_setup)


# --------------------------------------------------------------------------- a norm before the FFN
# The FFN ops take an optional norm of their input (reference.NORMS): they then keep x, the norm's
# input, and run the FFN on norm(x), computed again from x in backward, where its backward follows
# the FFN's. LayerNorm is aten's own kernels on every backend; the RMS kinds are a row kernel each
# way on the Triton backend (fusedrc/kernels/rms_norm.py), aten's elementwise ops on the reference.
def _ffn_input(x: Tensor, w: Tensor, norm: Optional[str], norm_weight: Optional[Tensor],
               norm_bias: Optional[Tensor], norm_eps: float, backend: str) -> Tensor:
    """x, or its norm in the FFN weights' dtype (autocast's cast of the norm's output)."""
    if norm is None:
        return x
    return get_impl(backend, "rms_norm", "norm_forward")(x, norm, norm_weight, norm_bias, norm_eps).to(w.dtype)


def _ffn_backward(body, x: Tensor, w: Tensor, norm, norm_weight, norm_bias, norm_eps, output_mask, n_ffn: int,
                  backend: str):
    """The FFN's gradients from ``body(input, ffn_mask)`` (the input's first), then the norm's:
    ``(dx, *the FFN parameters' gradients, dnorm_weight, dnorm_bias)``, empty where absent or masked."""
    mask = [True] * (n_ffn + 2) if output_mask is None else list(output_mask)
    if norm is None:
        grads = body(x, mask[:n_ffn])
        return tuple(_laid_out(_or_empty(g, x)) for g in (*grads, None, None))
    # the norm once: its output for the FFN, its row statistics for its own backward
    n, stats = get_impl(backend, "rms_norm", "norm_with_stats")(x, norm, norm_weight, norm_bias, norm_eps)
    ffn_mask = [mask[0] or (mask[n_ffn] and norm_weight is not None) or (mask[n_ffn + 1] and norm_bias is not None),
                *mask[1:n_ffn]]
    n_dtype, n = n.dtype, n.to(w.dtype)
    dn, *grads = body(n, ffn_mask)
    del n
    dx = dnw = dnb = None
    if dn is not None:
        # the cast to the FFN's dtype has the cast back to the norm output's as its gradient
        dx, dnw, dnb = get_impl(backend, "rms_norm", "norm_backward")(
            dn.to(n_dtype), x, norm, norm_weight, norm_bias, norm_eps, [mask[0], mask[n_ffn], mask[n_ffn + 1]],
            stats=stats)
    return tuple(_laid_out(_or_empty(g, x)) for g in (dx, *grads, dnw, dnb))


# --------------------------------------------------------------------------- FFN
# dropout_p > 0: dropout between the layers, its mask a function of ``seed`` (a 1-element int64
# tensor drawn by the caller), regenerated by the backward op and never stored.
def _fused_mlp_impl(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str, backend: str,
    dropout_p: float, seed: Optional[Tensor], norm: Optional[str] = None, norm_weight: Optional[Tensor] = None,
    norm_bias: Optional[Tensor] = None, norm_eps: float = 0.0,
) -> Tensor:
    return _laid_out(get_impl(backend, "fused_mlp", "fused_mlp_forward")(
        _ffn_input(x, w1, norm, norm_weight, norm_bias, norm_eps, backend), w1, b1, w2, b2, activation, dropout_p,
        seed))


fused_mlp_op = _custom_op("fused_mlp", _fused_mlp_impl)


@fused_mlp_op.register_fake
def _(x, w1, b1, w2, b2, activation, backend, dropout_p, seed, norm=None, norm_weight=None, norm_bias=None,
      norm_eps=0.0):
    return _empty((*x.shape[:-1], w2.shape[0]), x, dtype=w1.dtype)


def _fused_mlp_backward_impl(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], grad_out: Tensor,
    activation: str, backend: str, dropout_p: float, seed: Optional[Tensor],
    output_mask: Optional[List[bool]] = None, norm: Optional[str] = None, norm_weight: Optional[Tensor] = None,
    norm_bias: Optional[Tensor] = None, norm_eps: float = 0.0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    body = get_impl(backend, "fused_mlp", "fused_mlp_backward")
    return _ffn_backward(
        lambda inp, mask: body(inp, w1, b1, w2, b2, grad_out, activation, dropout_p, seed, mask),
        x, w1, norm, norm_weight, norm_bias, norm_eps, output_mask, 5, backend)


fused_mlp_backward_op = _custom_op("fused_mlp_backward", _fused_mlp_backward_impl)


@fused_mlp_backward_op.register_fake
def _(x, w1, b1, w2, b2, grad_out, activation, backend, dropout_p, seed, output_mask=None, norm=None,
      norm_weight=None, norm_bias=None, norm_eps=0.0):
    return _fake_grads((x, w1, b1, w2, b2, norm_weight, norm_bias), output_mask, x)


def _fused_mlp_setup(ctx, inputs, output):
    x, w1, b1, w2, b2, activation, backend, dropout_p, seed, norm, norm_weight, norm_bias, norm_eps = inputs
    ctx.save_for_backward(x, w1, b1, w2, b2, seed, norm_weight, norm_bias)
    ctx.activation, ctx.backend, ctx.dropout_p = activation, backend, dropout_p
    ctx.norm, ctx.norm_eps = norm, norm_eps


def _fused_mlp_backward(ctx, grad_out):
    _no_double_backward("fused_mlp")
    x, w1, b1, w2, b2, seed, norm_weight, norm_bias = ctx.saved_tensors
    mask = _output_mask(ctx, (0, 1, 2, 3, 4, 10, 11))
    grads = pick("fused_mlp_backward", x, ctx.backend)(
        x, w1, b1, w2, b2, grad_out.contiguous(), ctx.activation, ctx.backend, ctx.dropout_p, seed, mask,
        ctx.norm, norm_weight, norm_bias, ctx.norm_eps)
    dx, dw1, db1, dw2, db2, dnw, dnb = _wanted_grads(grads, (x, w1, b1, w2, b2, norm_weight, norm_bias), mask)
    return dx, dw1, db1, dw2, db2, None, None, None, None, None, dnw, dnb, None


_AUTOGRAD["fused_mlp"] = (_fused_mlp_backward, _fused_mlp_setup)


# --------------------------------------------------------------------------- gated FFN
# dropout_p > 0: dropout on the gated product (T5 v1.1), its mask a function of ``seed`` as the FFN's.
# lora_*: LoRA adapters on the projections as given (reference.LoRAAdapters: A and B of gate, up and down, None where
# absent; their scalings, dropout p's and seeds; shared), kept as they are (parameters); their low-rank terms
# (reference.GatedLoRA) are built inside the op, forward and backward. Their gradients follow the FFN's seven.
def _lora_adapters(a_gate, b_gate, a_up, b_up, a_down, b_down, scaling, dropout, seed, shared):
    if a_gate is None and a_up is None and a_down is None:
        return None
    return LoRAAdapters(a_gate, b_gate, a_up, b_up, a_down, b_down, tuple(scaling or (1.0, 1.0, 1.0)),
                        tuple(dropout or (0.0, 0.0, 0.0)), seed, bool(shared))


def _gated_mlp_impl(
    x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Tensor, b_up: Optional[Tensor], w_down: Tensor,
    b_down: Optional[Tensor], activation: str, backend: str, dropout_p: float, seed: Optional[Tensor],
    norm: Optional[str] = None, norm_weight: Optional[Tensor] = None, norm_bias: Optional[Tensor] = None,
    norm_eps: float = 0.0, lora_a_gate: Optional[Tensor] = None, lora_b_gate: Optional[Tensor] = None,
    lora_a_up: Optional[Tensor] = None, lora_b_up: Optional[Tensor] = None, lora_a_down: Optional[Tensor] = None,
    lora_b_down: Optional[Tensor] = None, lora_scaling: Optional[List[float]] = None,
    lora_dropout: Optional[List[float]] = None, lora_seed: Optional[Tensor] = None, lora_shared: bool = False,
) -> Tensor:
    lora = _lora_adapters(lora_a_gate, lora_b_gate, lora_a_up, lora_b_up, lora_a_down, lora_b_down, lora_scaling,
                          lora_dropout, lora_seed, lora_shared)
    return _laid_out(get_impl(backend, "gated_mlp", "gated_mlp_forward")(
        _ffn_input(x, w_gate, norm, norm_weight, norm_bias, norm_eps, backend), w_gate, b_gate, w_up, b_up, w_down,
        b_down, activation, dropout_p, seed, **({} if lora is None else {"lora": lora_terms(lora, w_gate.dtype)})))


gated_mlp_op = _custom_op("gated_mlp", _gated_mlp_impl)


@gated_mlp_op.register_fake
def _(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, backend, dropout_p, seed, norm=None,
      norm_weight=None, norm_bias=None, norm_eps=0.0, lora_a_gate=None, lora_b_gate=None, lora_a_up=None,
      lora_b_up=None, lora_a_down=None, lora_b_down=None, lora_scaling=None, lora_dropout=None, lora_seed=None,
      lora_shared=False):
    return _empty((*x.shape[:-1], w_down.shape[0]), x, dtype=w_gate.dtype)


def _gated_mlp_backward_impl(
    x: Tensor, w_gate: Tensor, b_gate: Optional[Tensor], w_up: Tensor, b_up: Optional[Tensor], w_down: Tensor,
    b_down: Optional[Tensor], grad_out: Tensor, activation: str, backend: str, dropout_p: float,
    seed: Optional[Tensor], output_mask: Optional[List[bool]] = None, norm: Optional[str] = None,
    norm_weight: Optional[Tensor] = None, norm_bias: Optional[Tensor] = None, norm_eps: float = 0.0,
    lora_a_gate: Optional[Tensor] = None, lora_b_gate: Optional[Tensor] = None, lora_a_up: Optional[Tensor] = None,
    lora_b_up: Optional[Tensor] = None, lora_a_down: Optional[Tensor] = None, lora_b_down: Optional[Tensor] = None,
    lora_scaling: Optional[List[float]] = None, lora_dropout: Optional[List[float]] = None,
    lora_seed: Optional[Tensor] = None, lora_shared: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor]:
    """``(dx, the six FFN parameters', the six adapters' (LoRAAdapters' order), dnorm_weight, dnorm_bias)``;
    ``output_mask`` in that order."""
    body = get_impl(backend, "gated_mlp", "gated_mlp_backward")
    lora = _lora_adapters(lora_a_gate, lora_b_gate, lora_a_up, lora_b_up, lora_a_down, lora_b_down, lora_scaling,
                          lora_dropout, lora_seed, lora_shared)

    def ffn(inp, mask):
        args = (inp, w_gate, b_gate, w_up, b_up, w_down, b_down, grad_out, activation, dropout_p, seed)
        if lora is None:
            return (*body(*args, mask[:7]), None, None, None, None, None, None)
        grads = body(*args, [*mask[:7], *lora_terms_mask(lora, mask[7:])], lora=lora_terms(lora, w_gate.dtype))
        return (*grads[:7], *lora_adapter_grads(lora, grads[7:]))

    return _ffn_backward(ffn, x, w_gate, norm, norm_weight, norm_bias, norm_eps, output_mask, 13, backend)


gated_mlp_backward_op = _custom_op("gated_mlp_backward", _gated_mlp_backward_impl)


@gated_mlp_backward_op.register_fake
def _(x, w_gate, b_gate, w_up, b_up, w_down, b_down, grad_out, activation, backend, dropout_p, seed, output_mask=None,
      norm=None, norm_weight=None, norm_bias=None, norm_eps=0.0, lora_a_gate=None, lora_b_gate=None, lora_a_up=None,
      lora_b_up=None, lora_a_down=None, lora_b_down=None, lora_scaling=None, lora_dropout=None, lora_seed=None,
      lora_shared=False):
    return _fake_grads((x, w_gate, b_gate, w_up, b_up, w_down, b_down, lora_a_gate, lora_b_gate,
                        None if lora_shared else lora_a_up, lora_b_up, lora_a_down, lora_b_down, norm_weight,
                        norm_bias), output_mask, x)


_GATED_LORA_INPUTS = (15, 16, 17, 18, 19, 20)  # the forward op's lora_a_gate ... lora_b_down positions


def _gated_mlp_setup(ctx, inputs, output):
    *tensors, activation, backend, dropout_p, seed, norm, norm_weight, norm_bias, norm_eps = inputs[:15]
    lora = tuple(inputs[15:]) + (None, None, None, None, None, None, None, None, None, False)[len(inputs) - 15:]
    ctx.save_for_backward(*tensors, seed, norm_weight, norm_bias, *lora[:6], lora[8])
    ctx.activation, ctx.backend, ctx.dropout_p = activation, backend, dropout_p
    ctx.norm, ctx.norm_eps, ctx.lora_scaling, ctx.lora_dropout, ctx.lora_shared = norm, norm_eps, *lora[6:8], lora[9]


def _gated_mlp_backward(ctx, grad_out):
    _no_double_backward("gated_mlp")
    saved = ctx.saved_tensors
    ffn, (seed, norm_weight, norm_bias), lora, lora_seed = saved[:7], saved[7:10], saved[10:16], saved[16]
    mask = _output_mask(ctx, (0, 1, 2, 3, 4, 5, 6, *_GATED_LORA_INPUTS, 12, 13))
    if ctx.lora_shared:
        mask[9] = False  # a_up is a_gate: its gradient goes out once, as a_gate's
    grads = pick("gated_mlp_backward", ffn[0], ctx.backend)(
        *ffn, grad_out.contiguous(), ctx.activation, ctx.backend, ctx.dropout_p, seed, mask,
        ctx.norm, norm_weight, norm_bias, ctx.norm_eps, *lora, ctx.lora_scaling, ctx.lora_dropout, lora_seed,
        ctx.lora_shared)
    *ffn_grads, dnw, dnb = _wanted_grads(grads, (*ffn, *lora, norm_weight, norm_bias), mask)
    return (*ffn_grads[:7], None, None, None, None, None, dnw, dnb, None, *ffn_grads[7:], None, None, None, None)


_AUTOGRAD["gated_mlp"] = (_gated_mlp_backward, _gated_mlp_setup)


# --------------------------------------------------------------------------- Mix-FFN
# x holds the tokens of images of height x width (rows in row-major order); the depthwise conv's
# weight is (hidden, 1, k, k), k odd, "same" padding. dropout_p and seed as the FFN's.
def _mix_ffn_impl(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w_dw: Tensor, b_dw: Optional[Tensor], w2: Tensor,
    b2: Optional[Tensor], height: int, width: int, activation: str, backend: str, dropout_p: float,
    seed: Optional[Tensor], relu_first: bool = False,
) -> Tensor:
    return _laid_out(get_impl(backend, "mix_ffn", "mix_ffn_forward")(
        x, w1, b1, w_dw, b_dw, w2, b2, height, width, activation, dropout_p, seed, relu_first))


mix_ffn_op = _custom_op("mix_ffn", _mix_ffn_impl)


@mix_ffn_op.register_fake
def _(x, w1, b1, w_dw, b_dw, w2, b2, height, width, activation, backend, dropout_p, seed, relu_first=False):
    return _empty((x.shape[0], w2.shape[0]), x, dtype=w1.dtype)


def _mix_ffn_backward_impl(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w_dw: Tensor, b_dw: Optional[Tensor], w2: Tensor,
    b2: Optional[Tensor], grad_out: Tensor, height: int, width: int, activation: str, backend: str,
    dropout_p: float, seed: Optional[Tensor], output_mask: Optional[List[bool]] = None, relu_first: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = get_impl(backend, "mix_ffn", "mix_ffn_backward")(
        x, w1, b1, w_dw, b_dw, w2, b2, grad_out, height, width, activation, dropout_p, seed, output_mask, relu_first)
    return tuple(_laid_out(_or_empty(g, x)) for g in grads)


mix_ffn_backward_op = _custom_op("mix_ffn_backward", _mix_ffn_backward_impl)


@mix_ffn_backward_op.register_fake
def _(x, w1, b1, w_dw, b_dw, w2, b2, grad_out, height, width, activation, backend, dropout_p, seed,
      output_mask=None, relu_first=False):
    return _fake_grads((x, w1, b1, w_dw, b_dw, w2, b2), output_mask, x)


def _mix_ffn_setup(ctx, inputs, output):
    x, w1, b1, w_dw, b_dw, w2, b2, height, width, activation, backend, dropout_p, seed, relu_first = inputs
    ctx.save_for_backward(x, w1, b1, w_dw, b_dw, w2, b2, seed)
    ctx.size, ctx.activation, ctx.backend, ctx.dropout_p = (height, width), activation, backend, dropout_p
    ctx.relu_first = relu_first


def _mix_ffn_backward(ctx, grad_out):
    _no_double_backward("mix_ffn")
    *saved, seed = ctx.saved_tensors
    mask = _output_mask(ctx, range(7))
    grads = pick("mix_ffn_backward", saved[0], ctx.backend)(
        *saved, grad_out.contiguous(), *ctx.size, ctx.activation, ctx.backend, ctx.dropout_p, seed, mask,
        ctx.relu_first)
    return (*_wanted_grads(grads, saved, mask), None, None, None, None, None, None, None)


_AUTOGRAD["mix_ffn"] = (_mix_ffn_backward, _mix_ffn_setup)


# --------------------------------------------------------------------------- xIELU FFN
# alpha_p, alpha_n: xIELU's effective alphas (1-element tensors, differentiable); beta, eps: its constants.
def _xielu_mlp_impl(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], alpha_p: Tensor, alpha_n: Tensor,
    beta: float, eps: float, backend: str,
) -> Tensor:
    return _laid_out(get_impl(backend, "xielu_mlp", "xielu_mlp_forward")(x, w1, b1, w2, b2, alpha_p, alpha_n, beta,
                                                                        eps))


xielu_mlp_op = _custom_op("xielu_mlp", _xielu_mlp_impl)


@xielu_mlp_op.register_fake
def _(x, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps, backend):
    return _empty((x.shape[0], w2.shape[0]), x, dtype=w1.dtype)


def _xielu_mlp_backward_impl(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], alpha_p: Tensor, alpha_n: Tensor,
    beta: float, eps: float, grad_out: Tensor, backend: str, output_mask: Optional[List[bool]] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = get_impl(backend, "xielu_mlp", "xielu_mlp_backward")(x, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps,
                                                                 grad_out, output_mask)
    return tuple(_laid_out(_or_empty(g, x)) for g in grads)


xielu_mlp_backward_op = _custom_op("xielu_mlp_backward", _xielu_mlp_backward_impl)


@xielu_mlp_backward_op.register_fake
def _(x, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps, grad_out, backend, output_mask=None):
    return _fake_grads((x, w1, b1, w2, b2, alpha_p, alpha_n), output_mask, x)


def _xielu_mlp_setup(ctx, inputs, output):
    x, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps, backend = inputs
    ctx.save_for_backward(x, w1, b1, w2, b2, alpha_p, alpha_n)
    ctx.constants, ctx.backend = (beta, eps), backend


def _xielu_mlp_backward(ctx, grad_out):
    _no_double_backward("xielu_mlp")
    saved = ctx.saved_tensors
    mask = _output_mask(ctx, range(7))
    grads = pick("xielu_mlp_backward", saved[0], ctx.backend)(
        *saved, *ctx.constants, grad_out.contiguous(), ctx.backend, mask)
    return (*_wanted_grads(grads, saved, mask), None, None, None)


_AUTOGRAD["xielu_mlp"] = (_xielu_mlp_backward, _xielu_mlp_setup)


# --------------------------------------------------------------------------- routed experts (MoE)
# The body loops over the experts a batch routes to (a host sync, data-dependent shapes): opaque
# custom ops under torch.compile, no triton_op twin (its body would be traced as the fake one).
def _moe_experts_impl(
    x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor, activation: str,
    backend: str, gated: bool = True, up: Optional[Tensor] = None, gate_up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None, interleaved: bool = False,
) -> Tensor:
    return _laid_out(get_impl(backend, "moe_experts", "moe_experts_forward")(
        x, top_k_index, top_k_weights, gate_up, down, activation, gated, up, gate_up_bias, down_bias, interleaved))


moe_experts_op = _custom_op("moe_experts", _moe_experts_impl)


@moe_experts_op.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, activation, backend, gated=True, up=None, gate_up_bias=None,
      down_bias=None, interleaved=False):
    return _empty((x.shape[0], down.shape[1]), x)


def _moe_experts_backward_impl(
    x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor, grad_out: Tensor,
    activation: str, backend: str, output_mask: Optional[List[bool]] = None, gated: bool = True,
    up: Optional[Tensor] = None, gate_up_bias: Optional[Tensor] = None, down_bias: Optional[Tensor] = None,
    interleaved: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dtop_k_weights, dgate_up, ddown, dup, dgate_up_bias, ddown_bias); ``output_mask``: six flags (up's
    gradient follows gate_up's)."""
    grads = get_impl(backend, "moe_experts", "moe_experts_backward")(
        x, top_k_index, top_k_weights, gate_up, down, grad_out, activation, output_mask, gated, up, gate_up_bias,
        down_bias, interleaved)
    # the stacked weights' gradients laid out as the weights (empty_like's strides: see moe_backward_with)
    weights = {2: gate_up, 3: down, 4: up}
    return tuple(_laid_like(g, weights[i]) if i in weights and g is not None else _laid_out(_or_empty(g, x))
                 for i, g in enumerate(grads))


moe_experts_backward_op = _custom_op("moe_experts_backward", _moe_experts_backward_impl)


@moe_experts_backward_op.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, grad_out, activation, backend, output_mask=None, gated=True,
      up=None, gate_up_bias=None, down_bias=None, interleaved=False):
    m = output_mask
    mask = None if m is None else [m[0], m[1], m[2], m[3], m[2], m[4], m[5]]
    return _fake_grads((x, top_k_weights, gate_up, down, up, gate_up_bias, down_bias), mask, x, like=(2, 3, 4))


def _moe_experts_setup(ctx, inputs, output):
    x, top_k_index, top_k_weights, gate_up, down, activation, backend, gated, up, gate_up_bias, down_bias, \
        interleaved = inputs
    ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up, down, up, gate_up_bias, down_bias)
    ctx.activation, ctx.backend, ctx.gated, ctx.interleaved = activation, backend, gated, interleaved


def _moe_experts_backward(ctx, grad_out):
    _no_double_backward("moe_experts")
    x, top_k_index, top_k_weights, gate_up, down, up, gate_up_bias, down_bias = ctx.saved_tensors
    mask = _output_mask(ctx, (0, 2, 3, 4, 8, 9, 10))
    # up's gradient comes with gate_up's (one flag: the kernels emit both)
    need = [mask[0], mask[1], mask[2] or mask[4], mask[3], mask[5], mask[6]]
    grads = pick("moe_experts_backward", x, ctx.backend)(
        x, top_k_index, top_k_weights, gate_up, down, grad_out.contiguous(), ctx.activation, ctx.backend, need,
        ctx.gated, up, gate_up_bias, down_bias, ctx.interleaved)
    dx, dw, dgu, dd, dup, dgub, ddb = _wanted_grads(
        grads, (x, top_k_weights, gate_up, down, up, gate_up_bias, down_bias), mask)
    return dx, None, dw, dgu, dd, None, None, None, dup, dgub, ddb, None


_AUTOGRAD["moe_experts"] = (_moe_experts_backward, _moe_experts_setup)
_NO_TRITON_TWIN = {"moe_experts", "moe_experts_backward"}


# --------------------------------------------------------------------------- Conv + BN + act
def conv_pads(padding):
    """A conv-BN op's ``padding``, ``[h, w]`` (symmetric) or ``[left, right, top, bottom]`` (F.pad's
    order: wider on one side, as a 'same' padding of an even kernel or TensorFlow's 'SAME' with a
    stride), as ``(extra, symmetric)``: what ``F.pad`` adds to the input first (None: nothing), then
    the symmetric ``[h, w]`` the conv applies (as aten runs an asymmetric 'same' convolution)."""
    if len(padding) == 2:
        return None, padding
    left, right, top, bottom = padding
    h, w = min(top, bottom), min(left, right)
    return [left - w, right - w, top - h, bottom - h], [h, w]


def _padded_input(x, padding):
    # a transient copy in forward and in backward's recompute: the op keeps x as it came
    extra, symmetric = conv_pads(padding)
    return (x if extra is None else torch.nn.functional.pad(x, extra)), symmetric, extra


def _conv_bn_act_impl(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], bn_weight: Optional[Tensor], bn_bias: Optional[Tensor],
    running_mean: Optional[Tensor], running_var: Optional[Tensor], residual: Optional[Tensor],
    training: bool, eps: float, stride: List[int], padding: List[int], dilation: List[int],
    activation: str, backend: str, groups: int = 1,
) -> Tuple[Tensor, Tensor, Tensor]:
    padded, padding, _ = _padded_input(x, padding)
    y, mean, rstd = get_impl(backend, "conv_bn_act", "conv_bn_act_forward")(
        padded, weight, bias, bn_weight, bn_bias, running_mean, running_var, residual,
        training, eps, stride, padding, dilation, activation, groups,
    )
    return _conv_stats_outputs(x, y, mean, rstd, training)


def _conv_stats_outputs(x, y, mean, rstd, training):
    """A conv-BN op's (y, mean, rstd) in their documented layouts (y in x's memory format)."""
    if not training:
        # the op must not return views of its inputs (the running buffers)
        mean, rstd = mean.clone(), rstd.clone()
    acc = _stats_dtype(x)
    return _laid_out(y, _channels_last(x)), _laid_out(mean, dtype=acc), _laid_out(rstd, dtype=acc)


def _fake_conv_stats_outputs(x, shape, channels, dtype):
    """The fake (y, mean, rstd) of a conv-BN op: y of ``shape`` and ``dtype``, statistics over ``channels``."""
    stats = _empty((channels,), x, dtype=_stats_dtype(x))
    return _empty(shape, x, dtype=dtype, channels_last=_channels_last(x)), stats, torch.empty_like(stats)


conv_bn_act_op = _custom_op("conv_bn_act", _conv_bn_act_impl)


def conv_padded_size(x, padding):
    """``x``'s spatial size once padded by a conv-BN op's ``padding`` (see ``conv_pads``)."""
    if len(padding) == 2:
        return x.shape[2] + 2 * padding[0], x.shape[3] + 2 * padding[1]
    return x.shape[2] + padding[2] + padding[3], x.shape[3] + padding[0] + padding[1]


def _conv_out_shape(x, weight, stride, padding, dilation):
    n, cout, kh, kw = x.shape[0], weight.shape[0], weight.shape[2], weight.shape[3]
    h, w = conv_padded_size(x, padding)
    oh = (h - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return n, cout, oh, ow


@conv_bn_act_op.register_fake
def _(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, residual,
      training, eps, stride, padding, dilation, activation, backend, groups=1):
    shape = _conv_out_shape(x, weight, stride, padding, dilation)
    return _fake_conv_stats_outputs(x, shape, shape[1], x.dtype)


def _conv_bn_act_backward_impl(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], bn_weight: Optional[Tensor], bn_bias: Optional[Tensor],
    mean: Tensor, rstd: Tensor, residual: Optional[Tensor], grad_out: Tensor,
    training: bool, eps: float, stride: List[int], padding: List[int], dilation: List[int],
    activation: str, backend: str, output_mask: Optional[List[bool]] = None, groups: int = 1,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    padded, padding, extra = _padded_input(x, padding)
    grads = get_impl(backend, "conv_bn_act", "conv_bn_act_backward")(
        padded, weight, bias, bn_weight, bn_bias, mean, rstd, residual, grad_out,
        training, eps, stride, padding, dilation, activation, output_mask, groups,
    )
    if extra is not None and grads[0] is not None:  # the padded input's gradient, cropped to x
        grads = (grads[0][:, :, extra[2]:extra[2] + x.shape[2], extra[0]:extra[0] + x.shape[3]], *grads[1:])
    cl = _channels_last(x)
    return tuple(_laid_like(g, weight) if i == 1 and g is not None else _laid_out(_or_empty(g, x), cl and i in (0, 5))
                 for i, g in enumerate(grads))


conv_bn_act_backward_op = _custom_op("conv_bn_act_backward", _conv_bn_act_backward_impl)


@conv_bn_act_backward_op.register_fake
def _(x, weight, bias, bn_weight, bn_bias, mean, rstd, residual, grad_out,
      training, eps, stride, padding, dilation, activation, backend, output_mask=None, groups=1):
    return _fake_grads((x, weight, bias, bn_weight, bn_bias, residual), output_mask, x,
                       channels_last=_channels_last(x), images=(0, 5), like=(1,))


def _conv_bn_act_setup(ctx, inputs, output):
    (x, weight, bias, bn_weight, bn_bias, _rm, _rv, residual,
     training, eps, stride, padding, dilation, activation, backend, groups) = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, bn_weight, bn_bias, mean, rstd, residual)
    ctx.args = (training, eps, stride, padding, dilation, activation, backend)
    ctx.groups = groups


def _conv_bn_act_backward(ctx, grad_out, _grad_mean, _grad_rstd):
    _no_double_backward("conv_bn_act")
    x, weight, bias, bn_weight, bn_bias, mean, rstd, residual = ctx.saved_tensors
    # in x's memory format: the kernels read strides, and a channels_last model's gradient is
    # channels_last already (a plain .contiguous() would copy it to NCHW every step)
    fmt = torch.channels_last if _channels_last(x) else torch.contiguous_format
    mask = _output_mask(ctx, (0, 1, 2, 3, 4, 7))
    grads = pick("conv_bn_act_backward", x, ctx.args[-1])(
        x, weight, bias, bn_weight, bn_bias, mean, rstd, residual, grad_out.contiguous(memory_format=fmt),
        *ctx.args, mask, ctx.groups,
    )
    inputs = (x, weight, bias, bn_weight, bn_bias, residual)
    dx, dw, db, dgamma, dbeta, dres = _wanted_grads(grads, inputs, mask)
    return dx, dw, db, dgamma, dbeta, None, None, dres, None, None, None, None, None, None, None, None


_AUTOGRAD["conv_bn_act"] = (_conv_bn_act_backward, _conv_bn_act_setup)


# --------------------------------------------------------------------------- BN + act + Conv
def _bn_act_conv_impl(
    x: Tensor, bn_weight: Optional[Tensor], bn_bias: Optional[Tensor], running_mean: Optional[Tensor],
    running_var: Optional[Tensor], weight: Tensor, bias: Optional[Tensor],
    training: bool, eps: float, stride: List[int], padding: List[int], dilation: List[int],
    activation: str, backend: str, groups: int = 1,
) -> Tuple[Tensor, Tensor, Tensor]:
    y, mean, rstd = get_impl(backend, "bn_act_conv", "bn_act_conv_forward")(
        x, bn_weight, bn_bias, running_mean, running_var, weight, bias,
        training, eps, stride, padding, dilation, activation, groups,
    )
    return _conv_stats_outputs(x, y, mean, rstd, training)


bn_act_conv_op = _custom_op("bn_act_conv", _bn_act_conv_impl)


@bn_act_conv_op.register_fake
def _(x, bn_weight, bn_bias, running_mean, running_var, weight, bias,
      training, eps, stride, padding, dilation, activation, backend, groups=1):
    # statistics over x's channels; the conv's dtype (under autocast x may be fp32 with a half conv)
    return _fake_conv_stats_outputs(x, _conv_out_shape(x, weight, stride, padding, dilation), x.shape[1],
                                    weight.dtype)


def _bn_act_conv_backward_impl(
    x: Tensor, bn_weight: Optional[Tensor], bn_bias: Optional[Tensor], weight: Tensor, bias: Optional[Tensor],
    mean: Tensor, rstd: Tensor, grad_out: Tensor,
    training: bool, eps: float, stride: List[int], padding: List[int], dilation: List[int],
    activation: str, backend: str, output_mask: Optional[List[bool]] = None, groups: int = 1,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = get_impl(backend, "bn_act_conv", "bn_act_conv_backward")(
        x, bn_weight, bn_bias, weight, bias, mean, rstd, grad_out,
        training, eps, stride, padding, dilation, activation, output_mask, groups,
    )
    cl = _channels_last(x)
    return tuple(_laid_like(g, weight) if i == 3 and g is not None else _laid_out(_or_empty(g, x), cl and i == 0)
                 for i, g in enumerate(grads))


bn_act_conv_backward_op = _custom_op("bn_act_conv_backward", _bn_act_conv_backward_impl)


@bn_act_conv_backward_op.register_fake
def _(x, bn_weight, bn_bias, weight, bias, mean, rstd, grad_out,
      training, eps, stride, padding, dilation, activation, backend, output_mask=None, groups=1):
    return _fake_grads((x, bn_weight, bn_bias, weight, bias), output_mask, x,
                       channels_last=_channels_last(x), images=(0,), like=(3,))


def _bn_act_conv_setup(ctx, inputs, output):
    (x, bn_weight, bn_bias, _rm, _rv, weight, bias,
     training, eps, stride, padding, dilation, activation, backend, groups) = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, bn_weight, bn_bias, weight, bias, mean, rstd)
    ctx.args = (training, eps, stride, padding, dilation, activation, backend)
    ctx.groups = groups


def _bn_act_conv_backward(ctx, grad_out, _grad_mean, _grad_rstd):
    _no_double_backward("bn_act_conv")
    x, bn_weight, bn_bias, weight, bias, mean, rstd = ctx.saved_tensors
    fmt = torch.channels_last if _channels_last(x) else torch.contiguous_format
    mask = _output_mask(ctx, (0, 1, 2, 5, 6))
    grads = pick("bn_act_conv_backward", x, ctx.args[-1])(
        x, bn_weight, bn_bias, weight, bias, mean, rstd, grad_out.contiguous(memory_format=fmt),
        *ctx.args, mask, ctx.groups,
    )
    dx, dgamma, dbeta, dw, db = _wanted_grads(grads, (x, bn_weight, bn_bias, weight, bias), mask)
    return dx, dgamma, dbeta, None, None, dw, db, None, None, None, None, None, None, None, None


_AUTOGRAD["bn_act_conv"] = (_bn_act_conv_backward, _bn_act_conv_setup)


def _pinning_precision(backward, setup):
    """``backward`` runs at the fp32 precision (tf32 or not) that torch allowed when the forward
    ran, for matmuls and for cuDNN's convs (the conv op's ``CONV_Z="aten"`` path, its
    default on a GPU for 16-bit operands): its
    recompute must equal the forward bit for bit (the ReLU mask, the dropout scale), even if
    ``torch.backends.cuda.matmul`` or ``torch.backends.cudnn`` changed in between."""
    def pinned_setup(ctx, inputs, output):
        setup(ctx, inputs, output)
        # tf32 applies to fp32 operands only: with 16-bit activations and weights (AMP, a bf16 model)
        # there is nothing to pin, and the backward skips the settings' reads and context managers
        ctx.pin = any(isinstance(t, Tensor) and t.dim() > 1 and t.dtype == torch.float32 for t in inputs)
        if ctx.pin:
            ctx.tf32, ctx.cudnn_tf32 = tf32_matmul_allowed(), cudnn_conv_tf32()

    def pinned_backward(ctx, *grads):
        if not ctx.pin:
            return backward(ctx, *grads)
        with pinned_tf32(ctx.tf32), pinned_cudnn_tf32(ctx.cudnn_tf32):
            return backward(ctx, *grads)

    return pinned_backward, pinned_setup


_AUTOGRAD.update({name: _pinning_precision(*pair) for name, pair in _AUTOGRAD.items()})
for _name, (_backward, _setup) in _AUTOGRAD.items():
    _CUSTOM_OPS[_name].register_autograd(_backward, setup_context=_setup)


def _eager_function(name: str, impl, backward, setup):
    """The ``autograd.Function`` a plain eager call of op ``name`` goes through: its body, and the
    backward and setup_context registered for the op (so both paths run the same code)."""
    params = inspect.signature(impl).parameters.values()
    defaults = tuple(p.default for p in params)

    def forward(ctx, *inputs):
        # setup gets every input, defaults filled, as the custom op's setup_context does (trailing
        # None gradients for inputs the call left out are dropped by autograd)
        inputs += defaults[len(inputs):]
        output = impl(*inputs)
        setup(ctx, inputs, output)
        return output

    cls = type(
        "".join(part.capitalize() for part in name.split("_")) + "Function",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward),
         "__doc__": f"fusedrc::{name} in a plain eager call (see ``pick``)."},
    )
    # the C apply: Function.apply's own Python (functorch checks, signature binding) is for
    # calls that _plain_eager already excludes, and costs as much as the op's body on small inputs;
    # a torch without the private class gets the Python apply (slower, the same results)
    base = getattr(torch.autograd.function, "_SingleLevelFunction", None)
    return super(base, cls).apply if isinstance(base, type) and issubclass(cls, base) else cls.apply


# name -> what a plain eager call runs: Function.apply for a forward op, the body for a backward op
_EAGER = {name: impl for name, impl in _IMPLS.items()}
_EAGER.update({name: _eager_function(name, _IMPLS[name], *pair) for name, pair in _AUTOGRAD.items()})
