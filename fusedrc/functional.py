"""Functional forms of the fused patterns.

Each keeps only its input (and the parameters; conv+BN also the per-channel
batch statistics) for backward and recomputes the rest inside the backward op.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from . import ops, reference
from ._backend import get_impl, resolve_backend
from ._state import inside_region, snapshot_buffers, traced
from ._validate import (CheckedCalls, call_key, check_activation, check_device, check_int, check_no_overlap,
                        check_number, check_probability, check_same, check_tensor, check_vector, needs_unfused, pair)

__all__ = ["linear_act", "fused_mlp", "gated_mlp", "mix_ffn", "xielu_mlp", "moe_experts", "conv_bn_act", "bn_act_conv"]


def _autocast_on(device_type: str) -> bool:
    if torch.compiler.is_compiling():
        # dynamo (torch 2.11) cannot trace is_autocast_available; fake tensors carry real device types
        return torch.is_autocast_enabled(device_type)
    # 'meta' and other device types without autocast: is_autocast_enabled would raise
    available = getattr(torch.amp, "is_autocast_available", None)
    if available is not None and not available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


def _autocast(*tensors):
    """Cast floating tensors as ``F.linear``/``F.conv2d`` do under autocast (None passes through)."""
    x = tensors[0]
    if not isinstance(x, Tensor) or not _autocast_on(x.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(x.device.type)
    # autocast never casts float64 (at::autocast::is_eligible): a float64 model stays float64
    return tuple(
        t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


def _unview(y: Tensor, lead, n: int) -> Tensor:
    """The op's ``(M, n)`` result as ``(*lead, n)`` and not a view, as ``F.linear`` returns it: FSDP2
    warns about a module output that is a view, and an in-place op on one skips its pre-backward
    hook (the parameters are then not all-gathered for backward)."""
    return y if len(lead) == 1 else torch.ops.aten._unsafe_view(y, (*lead, n))


def _plain_rows(fn, x: Tensor, n: int) -> Tensor:
    """The plain composition ``fn`` on x's rows, shaped back as the fused op's output (not a view)."""
    return _unview(fn(_rows(x)), x.shape[:-1], n)


def _check_params(x, *named, name_x="input"):
    """Before autocast: each ``(tensor, name, ndim, optional)`` is a floating tensor of
    ``ndim`` dimensions on x's device (or None, where ``optional``)."""
    for t, name, ndim, optional in named:
        if t is None and optional:
            continue
        check_tensor(t, name, ndim=ndim)
        check_device(x, name_x, t, name)


def _check_linear(x, weight, bias, name_w="weight", name_b="bias", name_x="input", in_features=None, what=None):
    k = x.shape[-1] if in_features is None else in_features
    if weight.shape[1] != k:
        what = what or f"{name_x}'s last dimension {k}"
        raise ValueError(f"{name_w} must have shape (out_features, {k}) to match {what}, got {tuple(weight.shape)}")
    check_same(x, name_x, weight, name_w)
    check_vector(bias, name_b, weight.shape[0], x, name_x)


def _check_two_linears(x, w1, b1, w2, b2):
    """An FFN's two layers: w1 (hidden, in_features) with b1, w2 (out_features, hidden) with b2."""
    _check_linear(x, w1, b1, "w1", "b1")
    _check_linear(x, w2, b2, "w2", "b2", in_features=w1.shape[0],
                  what=f"w1's out_features (the hidden size {w1.shape[0]})")


def _check_norm(x, norm, norm_weight, norm_bias, norm_eps):
    """The FFN ops' norm arguments (before autocast): ``norm_eps`` as a float."""
    reference.check_norm(norm)
    if norm is None:
        for t, name in ((norm_weight, "norm_weight"), (norm_bias, "norm_bias")):
            if t is not None:
                raise ValueError(f"{name} was given without a norm: pass norm='layer', 'rms', 'llama_rms' or 'gemma_rms'")
        return norm_eps
    check_vector(norm_weight, "norm_weight", x.shape[-1], x)
    check_vector(norm_bias, "norm_bias", x.shape[-1], x)
    if norm_bias is not None and norm != "layer":
        raise ValueError(f"norm_bias: a {norm!r} norm has no bias, expected None")
    return float(check_number(norm_eps, "norm_eps", min_value=0.0))


def _ffn_autocast(x, norm, *params):
    """``(x, *params)`` cast as under autocast, and the FFN's input dtype. With a norm, x stays in
    its dtype (the norm runs there, as LayerNorm runs in float32 under autocast) and the norm's
    output is cast to the weights' dtype, as ``nn.Linear`` casts its input."""
    if norm is None:
        cast = _autocast(x, *params)
        return cast, cast[0]
    cast = (x, *_autocast(x, *params)[1:])
    w = cast[1]
    # the FFN's input as the checks see it: the norm's output, in the weights' dtype under autocast
    # (autocast never casts float64: a float64 norm output meets the weights as is, as nn.Linear's input would)
    cast_input = w.dtype != x.dtype and x.dtype != torch.float64 and _autocast_on(x.device.type)
    probe = x.new_empty(x.shape[-1:], dtype=w.dtype) if cast_input else x
    return cast, probe


_NORM_DOC = """norm: None, or a norm of ``x`` over its last dimension run first (a pre-norm
            transformer's ``mlp(norm(x))``): ``"layer"`` (``F.layer_norm``), ``"rms"``
            (``F.rms_norm``, ``nn.RMSNorm``), ``"llama_rms"`` (Hugging Face's Llama, Mistral,
            Qwen2 and T5 RMSNorm: normalized in float32, cast to x's dtype, then times the
            weight) or ``"gemma_rms"`` (Gemma's and Qwen3-Next's: normalized in float32 times
            ``1 + weight``, then cast). The op then keeps ``x``, the norm's input, in place of its output, and
            backward computes the norm again from it, once (aten's ops).
        norm_weight, norm_bias: the norm's ``(in_features,)`` weight and (``"layer"`` only)
            bias, in x's dtype, or None.
        norm_eps: the norm's epsilon."""


def linear_act(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "relu") -> Tensor:
    """``act(x @ weight.T + bias)``, recomputing the pre-activation in backward.

    Only ``x`` and the parameters are kept for backward; the pre-activation never
    reaches memory (the backward kernel recomputes it tile by tile).

    Args:
        x: input of shape ``(*, in_features)``, floating point.
        weight: ``(out_features, in_features)``, as in ``nn.Linear``; same dtype and device as ``x``.
        bias: ``(out_features,)`` or None.
        activation: ``"relu"``, ``"relu2"`` (squared ReLU), ``"gelu"`` (erf),
            ``"gelu_tanh"``, ``"silu"``, ``"relu6"``, ``"hardswish"``, ``"quick_gelu"`` (CLIP's
            ``h * sigmoid(1.702 h)``) or ``"leaky_relu"`` (negative slope 0.01, as ``nn.LeakyReLU()``;
            ``"leaky_relu:0.1"`` for another slope).

    Returns:
        ``(*, out_features)``, in ``x``'s dtype.

    Raises:
        TypeError: a non-tensor, non-floating or dtype-mismatched operand.
        ValueError: a wrong shape, an operand on another device, an unknown activation.

    Example::

        >>> x, lin = torch.randn(4, 16), torch.nn.Linear(16, 32)
        >>> y = fusedrc.functional.linear_act(x, lin.weight, lin.bias, "gelu")
        >>> torch.allclose(y, torch.nn.functional.gelu(lin(x)))
        True
    """
    check_tensor(x, "input", min_ndim=1)
    _check_params(x, (weight, "weight", 2, False), (bias, "bias", 1, True))
    check_activation(activation)
    x, weight, bias = _autocast(x, weight, bias)
    _check_linear(x, weight, bias)
    if needs_unfused(x, weight, bias):
        return reference.linear_act_forward(x, weight, bias, activation)
    if inside_region():  # the plain composition (_state.inside_region)
        return _plain_rows(lambda r: reference.linear_act_forward(r, weight, bias, activation), x, weight.shape[0])
    backend = resolve_backend(x, "linear_act", "linear_act_forward")
    lead = x.shape[:-1]
    y = ops.pick("linear_act", x, backend)(_rows(x), weight, bias, activation, backend)
    return _unview(y, lead, weight.shape[0])


def _rows(x: Tensor) -> Tensor:
    """x as (rows, features): -1 keeps a dynamic batch dynamic under torch.export; 0 features need
    the row count spelled out (-1 is ambiguous for an empty tensor)."""
    return x.reshape(-1, x.shape[-1]) if x.shape[-1] != 0 else x.reshape(x.shape[:-1].numel(), 0)


def fused_mlp(
    x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, activation: str = "relu",
    dropout_p: float = 0.0, *, norm: str | None = None, norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None, norm_eps: float = 1e-5,
) -> Tensor:
    """The transformer FFN ``act(x W1ᵀ + b1) W2ᵀ + b2``, keeping only ``x`` for backward.

    Backward runs 5 GEMMs (the output GEMM is not rerun) and never stores the
    hidden activation: 7 GEMMs a step, like ``torch.utils.checkpoint``.

    With ``dropout_p > 0`` the hidden activation goes through dropout
    (``F.dropout(act(h), dropout_p)``, training semantics: pass 0 in eval). Its mask is
    never stored: it is a function of a seed drawn from the default generator of
    ``x``'s device (so ``torch.manual_seed`` and the RNG replay of a recompute region
    reproduce it) and the backward regenerates it. The mask follows its own stream:
    equal in distribution to ``F.dropout``'s, not element for element.

    Args:
        x: ``(*, in_features)``, floating point.
        w1, b1: first layer, ``(hidden, in_features)`` and ``(hidden,)`` or None.
        w2, b2: second layer, ``(out_features, hidden)`` and ``(out_features,)`` or None.
        activation: as in :func:`linear_act`.
        dropout_p: probability of zeroing a hidden element, in ``[0, 1]``.
        {norm}

    Returns:
        ``(*, out_features)``, in the weights' dtype (x's, outside autocast).

    Example::

        >>> fc1, fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        >>> x = torch.randn(2, 3, 16, requires_grad=True)
        >>> y = fusedrc.functional.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, "relu")
        >>> y.shape
        torch.Size([2, 3, 16])
        >>> y.sum().backward()
    """
    check_tensor(x, "input", min_ndim=1)
    _check_params(x, (w1, "w1", 2, False), (b1, "b1", 1, True), (w2, "w2", 2, False), (b2, "b2", 1, True),
                  (norm_weight, "norm_weight", 1, True), (norm_bias, "norm_bias", 1, True))
    check_activation(activation)
    dropout_p = check_probability(dropout_p, "dropout_p")
    norm_eps = _check_norm(x, norm, norm_weight, norm_bias, norm_eps)
    (x, w1, b1, w2, b2), x_ffn = _ffn_autocast(x, norm, w1, b1, w2, b2)
    _check_two_linears(x_ffn, w1, b1, w2, b2)
    def plain(x):
        x = ops._ffn_input(x, w1, norm, norm_weight, norm_bias, norm_eps, "reference")  # differentiable
        a = torch.nn.functional.dropout(reference.linear_act_forward(x, w1, b1, activation), dropout_p)
        return torch.nn.functional.linear(a, w2, b2)

    if needs_unfused(x, w1, b1, w2, b2, norm_weight, norm_bias):
        return plain(x)
    if inside_region():  # the plain composition (_state.inside_region)
        return _plain_rows(plain, x, w2.shape[0])
    backend = resolve_backend(w1, "fused_mlp", "fused_mlp_forward")  # w1: the FFN's dtype
    lead = x.shape[:-1]
    # the mask's seed, from x's device's default generator: a device-side draw, no host sync
    seed = torch.randint(0, 2**62, (1,), device=x.device) if dropout_p else None
    y = ops.pick("fused_mlp", x, backend)(_rows(x), w1, b1, w2, b2, activation, backend, float(dropout_p), seed,
                                          norm, norm_weight, norm_bias, norm_eps)
    return _unview(y, lead, w2.shape[0])


def gated_mlp(
    x: Tensor, w_gate: Tensor, b_gate: Tensor | None, w_up: Tensor, b_up: Tensor | None, w_down: Tensor,
    b_down: Tensor | None, activation: str = "silu", dropout_p: float = 0.0, *, norm: str | None = None,
    norm_weight: Tensor | None = None, norm_bias: Tensor | None = None, norm_eps: float = 1e-5,
    swiglu_limit: float | None = None, limit_after_act: bool = False, swiglu_alpha: float | None = None,
    up_offset: float = 0.0, gate_softcap: float | None = None, up_softcap: float | None = None,
    gate_scale: float = 1.0, lora_gate: tuple | None = None, lora_up: tuple | None = None,
    lora_down: tuple | None = None,
) -> Tensor:
    """The gated FFN ``(act(x Wgᵀ + bg) * (x Wuᵀ + bu)) Wdᵀ + bd``, keeping only ``x`` for backward.

    Llama's, Mistral's and Qwen2's MLP (``act = "silu"``: SwiGLU), Gemma's
    (``"gelu_tanh"``: GeGLU). Backward recomputes the gate and up projections
    (one kernel, both in one main loop, emitting their gradients) and never reruns
    the down projection: 11 GEMMs a step, as ``torch.utils.checkpoint`` with its early
    stop, and none of the three hidden-sized intermediates is stored.

    Args:
        x: ``(*, in_features)``, floating point.
        w_gate, b_gate: gate projection, ``(hidden, in_features)`` and ``(hidden,)`` or None.
        w_up, b_up: up projection, same shapes as the gate's.
        w_down, b_down: down projection, ``(out_features, hidden)`` and ``(out_features,)`` or None.
        activation: as in :func:`linear_act`; ``"silu"`` by default.
        dropout_p: dropout on the gated product before the down projection (T5 v1.1's), in
            ``[0, 1]``; its mask is never stored, as :func:`fused_mlp`'s.
        {norm}
        {limit}
        lora_gate, lora_up, lora_down: a LoRA adapter on that projection, ``(A, B, scaling)`` or
            ``(A, B, scaling, dropout_p)``: it adds ``scaling * (dropout(z) Aᵀ) Bᵀ`` to the projection of its
            input z, A ``(r, in)``, B ``(out, r)`` (PEFT's ``lora_A``/``lora_B`` weights and ``lora_dropout``), or
            None. The adapters' dropout masks are functions of seeds drawn per call (as ``dropout_p``'s),
            regenerated in backward, never stored; each adapter draws its own. The gate's and up's terms run inside the gated kernel's
            tiles (their rank-r input ``x Aᵀ`` is all they add to memory, and it is not kept), the down
            projection's on the product as the kernel emits it; the adapters' weights get their gradients,
            cast back to their own dtype (a float32 adapter on bfloat16 weights, PEFT's default, computes in
            bfloat16 with float32 accumulation). The gate's and the up's A may be one tensor (one adapter on a
            joint gate/up projection, Phi-3's).

    Returns:
        ``(*, out_features)``, in the weights' dtype (x's, outside autocast).

    Example::

        >>> g, u, d = torch.nn.Linear(16, 64), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        >>> x = torch.randn(2, 3, 16, requires_grad=True)
        >>> y = fusedrc.functional.gated_mlp(x, g.weight, g.bias, u.weight, u.bias, d.weight, d.bias)
        >>> torch.allclose(y, d(torch.nn.functional.silu(g(x)) * u(x)), atol=1e-6)
        True
        >>> y.sum().backward()
    """
    check_tensor(x, "input", min_ndim=1)
    _check_params(x, (w_gate, "w_gate", 2, False), (b_gate, "b_gate", 1, True), (w_up, "w_up", 2, False),
                  (b_up, "b_up", 1, True), (w_down, "w_down", 2, False), (b_down, "b_down", 1, True),
                  (norm_weight, "norm_weight", 1, True), (norm_bias, "norm_bias", 1, True))
    activation = _gated_activation(activation, swiglu_limit, limit_after_act, swiglu_alpha, up_offset, gate_softcap,
                                   up_softcap, gate_scale)
    dropout_p = check_probability(dropout_p, "dropout_p")
    norm_eps = _check_norm(x, norm, norm_weight, norm_bias, norm_eps)
    (x, w_gate, b_gate, w_up, b_up, w_down, b_down), x_ffn = _ffn_autocast(
        x, norm, w_gate, b_gate, w_up, b_up, w_down, b_down)
    _check_linear(x_ffn, w_gate, b_gate, "w_gate", "b_gate")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up must have w_gate's shape {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    _check_linear(x_ffn, w_up, b_up, "w_up", "b_up")
    _check_linear(x_ffn, w_down, b_down, "w_down", "b_down", in_features=w_gate.shape[0],
                  what=f"w_gate's out_features (the hidden size {w_gate.shape[0]})")
    lora = _lora_adapters(w_gate, w_down, lora_gate, lora_up, lora_down)

    def plain(x):
        x = ops._ffn_input(x, w_gate, norm, norm_weight, norm_bias, norm_eps, "reference")  # differentiable
        hg, hu = torch.nn.functional.linear(x, w_gate, b_gate), torch.nn.functional.linear(x, w_up, b_up)
        if lora is not None and lora.shared:  # one dropout of x for both halves
            t = torch.nn.functional.linear(torch.nn.functional.dropout(x, lora.dropout[0]), lora.a_gate.to(x.dtype))
            hg = hg + torch.nn.functional.linear(t, lora.b_gate.to(x.dtype)) * lora.scaling[0]
            hu = hu + torch.nn.functional.linear(t, lora.b_up.to(x.dtype)) * lora.scaling[1]
        elif lora is not None:
            if lora.a_gate is not None:
                hg = hg + _lora_term(x, lora.a_gate, lora.b_gate, lora.scaling[0], lora.dropout[0])
            if lora.a_up is not None:
                hu = hu + _lora_term(x, lora.a_up, lora.b_up, lora.scaling[1], lora.dropout[1])
        a = torch.nn.functional.dropout(reference.gated_product(hg, hu, activation), dropout_p)
        out = torch.nn.functional.linear(a, w_down, b_down)
        if lora is not None and lora.a_down is not None:
            out = out + _lora_term(a, lora.a_down, lora.b_down, lora.scaling[2], lora.dropout[2])
        return out

    if needs_unfused(x, w_gate, b_gate, w_up, b_up, w_down, b_down, norm_weight, norm_bias, *(lora or ())[:6]):
        return plain(x)
    if inside_region():  # the plain composition (_state.inside_region)
        return _plain_rows(plain, x, w_down.shape[0])
    backend = resolve_backend(w_gate, "gated_mlp", "gated_mlp_forward")  # w_gate: the FFN's dtype
    lead = x.shape[:-1]
    seed = torch.randint(0, 2**62, (1,), device=x.device) if dropout_p else None  # as fused_mlp's
    y = ops.pick("gated_mlp", x, backend)(_rows(x), w_gate, b_gate, w_up, b_up, w_down, b_down, activation, backend,
                                          float(dropout_p), seed, norm, norm_weight, norm_bias, norm_eps,
                                          *_lora_op_args(lora, x))
    return _unview(y, lead, w_down.shape[0])


def _lora_adapter(adapter, name, in_features, out_features, like):
    """``(A, B, scaling, dropout_p)`` of an ``(A, B, scaling[, dropout_p])`` adapter, checked; None for None."""
    if adapter is None:
        return None
    if not isinstance(adapter, (tuple, list)) or len(adapter) not in (3, 4):
        raise TypeError(f"{name} must be None or a tuple (A, B, scaling[, dropout_p]), got {type(adapter).__name__}")
    a, b, scaling, p = (*adapter, 0.0) if len(adapter) == 3 else adapter
    p = check_probability(p, f"{name}'s dropout_p")
    for t, what in ((a, "A"), (b, "B")):
        if not isinstance(t, Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise TypeError(f"{name}'s {what} must be a 2-D floating-point tensor")
        if t.device != like.device:
            raise ValueError(f"{name}'s {what} must be on {like.device}, got {t.device}")
    rank = a.shape[0]
    if a.shape[1] != in_features or tuple(b.shape) != (out_features, rank) or rank == 0:
        raise ValueError(f"{name} must hold A of shape (r, {in_features}) and B of shape ({out_features}, r), r > 0; "
                         f"got A {tuple(a.shape)} and B {tuple(b.shape)}")
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real) or not math.isfinite(scaling):
        raise TypeError(f"{name}'s scaling must be a finite number, got {scaling!r}")
    return a, b, float(scaling), p


def _lora_adapters(w_gate, w_down, lora_gate, lora_up, lora_down):
    """The adapters as the op takes them (``reference.LoRAAdapters``, no seed yet), or None without any."""
    hidden, k = w_gate.shape
    gate = _lora_adapter(lora_gate, "lora_gate", k, hidden, w_gate)
    up = _lora_adapter(lora_up, "lora_up", k, hidden, w_gate)
    down = _lora_adapter(lora_down, "lora_down", hidden, w_down.shape[0], w_gate)
    if gate is None and up is None and down is None:
        return None
    shared = gate is not None and up is not None and gate[0] is up[0]
    if shared and gate[3] != up[3]:
        raise ValueError("lora_gate and lora_up share A (one adapter): their dropout_p must be one, got "
                         f"{gate[3]} and {up[3]}")
    parts = [p or (None, None, 1.0, 0.0) for p in (gate, up, down)]
    return reference.LoRAAdapters(*(t for p in parts for t in p[:2]), tuple(p[2] for p in parts),
                                  tuple(p[3] for p in parts), None, shared)


def _lora_op_args(lora, x):
    """The gated op's trailing lora_* arguments (none without adapters), the dropout's seeds drawn now."""
    if lora is None:
        return ()
    seed = None
    if any(lora.dropout):  # one seed an adapter's dropout, as fused_mlp's: from the default generator of x's device
        seed = torch.randint(0, 2**62, (3,), device=x.device)
    return (*lora[:6], list(lora.scaling), list(lora.dropout) if seed is not None else None, seed, lora.shared)


def _lora_term(z, a, b, scaling, p):
    """A LoRA adapter's term ``scaling * (dropout(z) Aᵀ) Bᵀ`` as torch's ops (the plain composition), in z's dtype."""
    return torch.nn.functional.linear(torch.nn.functional.linear(torch.nn.functional.dropout(z, p), a.to(z.dtype)),
                                      b.to(z.dtype)) * scaling



_LIMIT_DOC = """swiglu_limit: a clamp of the gated product's operands at this finite limit > 0, or None (no
            clamp): ``act(min(h_g, L)) * clamp(h_u, -L, L)`` (DeepSeek-V4's, GLM-5-Next's, HY-V4's
            SwiGLU limit), in the kernels' epilogues, recomputed in backward like the rest; a clamped
            element passes no gradient, as through ``torch.clamp``.
        limit_after_act: clamp ``act(h_g)`` rather than ``h_g``: ``min(act(h_g), L) * clamp(h_u, -L, L)``
            (Step-3.7's).
        swiglu_alpha: with ``activation="silu"``, the gate's activation ``h * sigmoid(alpha h)`` (a finite
            alpha > 0; MiniMax-M3's and gpt-oss's glu, alpha 1.702); None: ``activation`` itself.
        up_offset: a number added to the (clamped) up projection, ``(clamp(h_u, -L, L) + c)`` (MiniMax-M3's
            and gpt-oss's ``up + 1``).
        gate_softcap: with ``activation="silu"``, a finite cap s > 0 of the gate's linear factor:
            ``s tanh(h_g / s) * sigmoid(h_g)`` (the sigmoid sees the raw h_g; with ``swiglu_alpha``,
            ``sigmoid(alpha h_g)``; Inkling2's); None: none.
        up_softcap: a finite cap s > 0 of the up projection, ``s tanh(h_u / s)`` after its clamp and before its
            offset (Inkling2's); None: none.
        gate_scale: a finite multiplier m != 0 of the gate's pre-activation, ``act(m h_g)``, applied before
            everything above (Falcon-H1's ``gate_multiplier``), in the kernels' epilogues: no scaled copy of
            the weights or of h_g; 1.0: none."""


def _gated_activation(activation, swiglu_limit, limit_after_act, swiglu_alpha=None, up_offset=0.0, gate_softcap=None,
                      up_softcap=None, gate_scale=1.0):
    """The gated ops' activation string (``reference.gated_name``) of a public call's arguments, checked."""
    check_activation(activation)
    if not isinstance(limit_after_act, bool):
        raise TypeError(f"limit_after_act must be a bool, got {type(limit_after_act).__name__} {limit_after_act!r}")

    def real(v, name, positive):  # None passes where the number is optional (a positive one)
        if v is None and positive:
            return None
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or positive and v <= 0:
            raise ValueError(f"{name} must be {'a finite number > 0 or None' if positive else 'a finite number'}, "
                             f"got {v!r}")
        return float(v)

    limit, alpha = real(swiglu_limit, "swiglu_limit", True), real(swiglu_alpha, "swiglu_alpha", True)
    if alpha is not None and activation != "silu":
        raise ValueError(f"swiglu_alpha sets the slope of silu's sigmoid (h * sigmoid(alpha h)): it needs "
                         f"activation='silu', got {activation!r}")
    gate_cap, up_cap = real(gate_softcap, "gate_softcap", True), real(up_softcap, "up_softcap", True)
    if gate_cap is not None and activation != "silu":
        raise ValueError(f"gate_softcap caps the linear factor of silu's h * sigmoid(h): it needs activation='silu', "
                         f"got {activation!r}")
    scale = real(gate_scale, "gate_scale", False)
    if scale == 0.0:
        raise ValueError("gate_scale must be a finite number other than 0, got 0.0")
    return reference.gated_name(activation, limit, limit_after_act, alpha, real(up_offset, "up_offset", False),
                                gate_cap, up_cap, scale)


for _fn in (fused_mlp, gated_mlp):
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ = _fn.__doc__.replace("{norm}", _NORM_DOC).replace("{limit}", _LIMIT_DOC)

def _check_dwconv(w_dw, b_dw, hidden, x):
    if w_dw.dim() != 4 or w_dw.shape[0] != hidden or w_dw.shape[1] != 1 or w_dw.shape[2] != w_dw.shape[3] \
            or w_dw.shape[2] % 2 == 0:
        raise ValueError(f"w_dw must be a depthwise conv weight of shape ({hidden}, 1, k, k) with k odd (one k x k "
                         f"filter per hidden channel of w1), got {tuple(w_dw.shape)}")
    check_same(x, "input", w_dw, "w_dw")
    check_vector(b_dw, "b_dw", hidden, x)


def mix_ffn(
    x: Tensor, height: int, width: int, w1: Tensor, b1: Tensor | None, w_dw: Tensor, b_dw: Tensor | None,
    w2: Tensor, b2: Tensor | None, activation: str = "gelu", dropout_p: float = 0.0, *, relu_first: bool = False,
) -> Tensor:
    """SegFormer's Mix-FFN, ``fc2(dropout(act(dwconv(fc1(x)))))``, keeping only ``x`` for backward.

    ``dwconv`` is a depthwise k x k convolution with "same" padding (``nn.Conv2d(hidden, hidden, k,
    padding=k // 2, groups=hidden)``) over each image's ``height x width`` grid of tokens, as SegFormer's,
    GLPN's and PVT-v2's FFNs apply it. Neither the conv's output nor the activation is kept: backward
    recomputes ``fc1`` (a GEMM), and one kernel recomputes the conv and the activation tile by tile
    inside the activation's backward. Dropout as in :func:`fused_mlp` (its mask regenerated, never
    stored).

    Args:
        x: ``(*, height * width, in_features)``: the tokens of each image in row-major order.
        height, width: the token grid.
        w1, b1: first layer, ``(hidden, in_features)`` and ``(hidden,)`` or None.
        w_dw, b_dw: the depthwise conv, ``(hidden, 1, k, k)`` with k odd, and ``(hidden,)`` or None.
        w2, b2: second layer, ``(out_features, hidden)`` and ``(out_features,)`` or None.
        activation: as in :func:`linear_act`.
        dropout_p: probability of zeroing an activated element, in ``[0, 1]``.
        relu_first: a ReLU between fc1 and the conv, ``dwconv(relu(fc1(x)))`` (PVT-v2's linear variant).

    Returns:
        ``(*, height * width, out_features)``, in the weights' dtype (x's, outside autocast).

    Example::

        >>> fc1, fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        >>> dw = torch.nn.Conv2d(64, 64, 3, padding=1, groups=64)
        >>> x = torch.randn(2, 6 * 8, 16, requires_grad=True)
        >>> y = fusedrc.functional.mix_ffn(x, 6, 8, fc1.weight, fc1.bias, dw.weight, dw.bias, fc2.weight, fc2.bias)
        >>> y.shape
        torch.Size([2, 48, 16])
    """
    check_tensor(x, "input", min_ndim=2)
    _check_params(x, (w1, "w1", 2, False), (b1, "b1", 1, True), (w_dw, "w_dw", 4, False), (b_dw, "b_dw", 1, True),
                  (w2, "w2", 2, False), (b2, "b2", 1, True))
    height, width = check_int(height, "height", min_value=1), check_int(width, "width", min_value=1)
    if x.shape[-2] != height * width:
        raise ValueError(f"input must have shape (*, height * width, in_features) = (*, {height * width}, "
                         f"{x.shape[-1]}) for height {height} and width {width}, got {tuple(x.shape)}")
    check_activation(activation)
    dropout_p = check_probability(dropout_p, "dropout_p")
    if not isinstance(relu_first, bool):
        raise TypeError(f"relu_first must be a bool, got {type(relu_first).__name__}")
    x, w1, b1, w_dw, b_dw, w2, b2 = _autocast(x, w1, b1, w_dw, b_dw, w2, b2)
    _check_two_linears(x, w1, b1, w2, b2)
    _check_dwconv(w_dw, b_dw, w1.shape[0], x)

    def plain(x):
        h = reference._dwconv_tokens(reference._conv_input(torch.nn.functional.linear(x, w1, b1), relu_first), w_dw,
                                     b_dw, height, width)
        a = torch.nn.functional.dropout(reference.activation_forward(h, activation), dropout_p)
        return torch.nn.functional.linear(a, w2, b2)

    if needs_unfused(x, w1, b1, w_dw, b_dw, w2, b2) or inside_region():
        return _plain_rows(plain, x, w2.shape[0])
    backend = resolve_backend(w1, "mix_ffn", "mix_ffn_forward")
    seed = torch.randint(0, 2**62, (1,), device=x.device) if dropout_p else None
    y = ops.pick("mix_ffn", x, backend)(_rows(x), w1, b1, w_dw, b_dw, w2, b2, height, width, activation, backend,
                                        float(dropout_p), seed, relu_first)
    return _unview(y, x.shape[:-1], w2.shape[0])


def xielu_mlp(
    x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, alpha_p: Tensor, alpha_n: Tensor,
    beta: float = 0.5, eps: float = -1e-6,
) -> Tensor:
    """Apertus's FFN ``F.linear(xielu(F.linear(x, w1, b1)), w2, b2)``, keeping only ``x`` for backward.

    xIELU (arXiv 2411.13010) is ``alpha_p h² + beta h`` for ``h > 0`` and ``alpha_n (expm1(min(h, eps)) - h) +
    beta h`` otherwise. Its learned alphas are trained through the op: pass their effective values as Hugging
    Face's ``XIELUActivation`` computes them, ``softplus(act.alpha_p)`` and ``act.beta + softplus(act.alpha_n)``.
    The module's eager form keeps about seven hidden-sized tensors a layer. On the Triton backend xIELU is the
    first GEMM's epilogue, as :func:`fused_mlp`'s activations: backward's recompute kernel rebuilds the activation
    tile by tile while it emits the gradients (the alphas' as per-tile partial sums).

    Args:
        x: ``(*, in_features)``, floating point.
        w1, b1, w2, b2: the two Linears, as in :func:`fused_mlp`.
        alpha_p, alpha_n: 1-element floating tensors on x's device (any dtype: the activation runs in fp32 on the
            Triton backend, in the promoted dtype on the reference one, as the module does).
        beta, eps: xIELU's constants (0.5 and -1e-6 in Apertus; pass ``float(act.eps)``, the buffer's rounded value,
            to match a bf16 module).

    Returns:
        ``(*, out_features)``, in the weights' dtype (x's, outside autocast).

    Example::

        >>> up, down = torch.nn.Linear(16, 64, bias=False), torch.nn.Linear(64, 16, bias=False)
        >>> a_p, a_n = torch.full((1,), 0.8, requires_grad=True), torch.full((1,), 0.8, requires_grad=True)
        >>> y = fusedrc.functional.xielu_mlp(torch.randn(2, 5, 16), up.weight, None, down.weight, None, a_p, a_n)
        >>> y.sum().backward()
        >>> a_p.grad.shape
        torch.Size([1])
    """
    check_tensor(x, "input", min_ndim=1)
    _check_params(x, (w1, "w1", 2, False), (b1, "b1", 1, True), (w2, "w2", 2, False), (b2, "b2", 1, True))
    for t, name in ((alpha_p, "alpha_p"), (alpha_n, "alpha_n")):
        check_tensor(t, name)
        check_device(x, "input", t, name)
        if t.numel() != 1:
            raise ValueError(f"{name} must hold one element (xIELU's effective alpha), got shape {tuple(t.shape)}")
    beta, eps = float(check_number(beta, "beta")), float(check_number(eps, "eps"))
    x, w1, b1, w2, b2 = _autocast(x, w1, b1, w2, b2)
    _check_two_linears(x, w1, b1, w2, b2)
    if needs_unfused(x, w1, b1, w2, b2, alpha_p, alpha_n) or inside_region():
        return _plain_rows(lambda r: reference.xielu_mlp_forward(r, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps), x,
                           w2.shape[0])
    backend = resolve_backend(w1, "xielu_mlp", "xielu_mlp_forward")
    y = ops.pick("xielu_mlp", x, backend)(_rows(x), w1, b1, w2, b2, alpha_p, alpha_n, beta, eps, backend)
    return _unview(y, x.shape[:-1], w2.shape[0])


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _check_routing(x, top_k_index, top_k_weights, num_experts, skip_out_of_range=False):
    if not isinstance(top_k_index, Tensor):
        raise TypeError(f"top_k_index must be a torch.Tensor, got {type(top_k_index).__name__}")
    if top_k_index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"top_k_index must be an integer tensor (the chosen experts), got dtype {top_k_index.dtype}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"top_k_index must have shape (tokens, k) = ({x.shape[0]}, k) to match hidden_states, "
                         f"got {tuple(top_k_index.shape)}")
    check_device(x, "hidden_states", top_k_index, "top_k_index")
    check_tensor(top_k_weights, "top_k_weights", ndim=2)
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, "
                         f"got {tuple(top_k_weights.shape)}")
    check_device(x, "hidden_states", top_k_weights, "top_k_weights")
    if not isinstance(skip_out_of_range, bool):
        raise TypeError(f"skip_out_of_range must be a bool, got {type(skip_out_of_range).__name__} "
                        f"{skip_out_of_range!r}")
    if (top_k_index.numel() and not skip_out_of_range and not torch.compiler.is_compiling()
            and top_k_index.device.type != "meta"):
        lo, hi = torch.stack(torch.aminmax(top_k_index)).tolist()  # one host sync (routing syncs anyway)
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"top_k_index must hold expert numbers in [0, {num_experts}), got values in [{lo}, {hi}]"
                             " (pass skip_out_of_range=True to skip the choices outside it: expert-parallel sentinels,"
                             " identity experts)")


def _moe_plain(x, top_k_index, top_k_weights, gate_up, down, activation, layout=reference.ExpertsLayout(), up=None,
               gate_up_bias=None, down_bias=None):
    """The experts as plain torch ops (autograd, forward AD and torch.func see through them)."""
    order, tokens, counts = reference.route(top_k_index, gate_up.shape[0])
    acc = torch.promote_types(x.dtype, torch.float32)
    w = top_k_weights.reshape(-1)[order].to(acc)
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            weights = reference.expert_weights(e, layout, gate_up, down, up, gate_up_bias, down_bias)
            y = reference.expert_forward(x[tokens[start:start + n]], weights, activation)
            outs.append(y.to(acc) * w[start:start + n, None])
            start += n
    outs.append(x.new_zeros((order.numel() - start, down.shape[1]), dtype=acc))  # the skipped slots
    slots = torch.cat(outs)
    return reference.unroute(slots, order, top_k_index).sum(1).to(x.dtype)


def moe_experts(
    hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
    activation: str = "silu", *, gated: bool = True, skip_out_of_range: bool = False, up_proj: Tensor | None = None,
    swiglu_limit: float | None = None, limit_after_act: bool = False, swiglu_alpha: float | None = None,
    up_offset: float = 0.0, gate_up_proj_bias: Tensor | None = None, down_proj_bias: Tensor | None = None,
    interleaved: bool = False, gate_softcap: float | None = None, up_softcap: float | None = None,
    gate_scale: float = 1.0,
) -> Tensor:
    """A Mixture-of-Experts layer's routed gated experts, keeping only the inputs for backward.

    Token ``t``'s output is ``sum_j top_k_weights[t, j] * expert_e(hidden_states[t])`` with
    ``e = top_k_index[t, j]`` and ``expert_e(x) = (act(x Wg_eᵀ + bg_e) * (x Wu_eᵀ + bu_e)) Wd_eᵀ + bd_e`` (the
    biases optional), in Hugging Face's
    layout (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...: ``gate_up_proj[e]`` holds ``Wg_e`` then
    ``Wu_e``). Each expert runs the gated FFN's kernels on the tokens routed to it; backward
    recomputes each expert's gate and up projections (never its down projection, not even for the
    routing weights' gradient) and keeps no intermediate: the bytes ``torch.utils.checkpoint``
    keeps on the same call, in 11 GEMMs an expert to its 12.

    Args:
        hidden_states: ``(tokens, hidden)``, floating point.
        top_k_index: ``(tokens, k)`` integer, the chosen experts, each in ``[0, num_experts)``.
        top_k_weights: ``(tokens, k)`` floating, the routing weights (differentiable).
        gate_up_proj: ``(num_experts, 2 * intermediate, hidden)``.
        down_proj: ``(num_experts, out_features, intermediate)``.
        activation: as in :func:`linear_act`; ``"silu"`` by default.
        gated: False for ungated experts ``act(x Wu_eᵀ) Wd_eᵀ`` (Nemotron-H's): ``gate_up_proj`` then
            holds the up projections alone, ``(num_experts, intermediate, hidden)``.
        skip_out_of_range: True: a choice whose index is outside ``[0, num_experts)`` adds nothing
            and its weight's gradient is 0, at no expert's cost (an expert-parallel sentinel for another
            rank's expert; LongCat-Flash's identity "zero" experts, whose ``weight * x`` the caller adds).
            False (the default): such an index raises (one host sync checks the range; under
            ``torch.compile`` the check is not made and such choices are skipped).
        up_proj: the up projections ``(num_experts, intermediate, hidden)`` where they are stored apart from
            the gate projections (DBRX's ``v1`` beside ``w1``): ``gate_up_proj`` then holds the gate
            projections alone, ``(num_experts, intermediate, hidden)``; no copy of either is made.
        gate_up_proj_bias: optional per-expert biases of the gate and up projections, laid out as
            ``gate_up_proj``'s rows: ``(num_experts, 2 * intermediate)`` (ungated: ``(num_experts,
            intermediate)``); not with ``up_proj``.
        down_proj_bias: optional ``(num_experts, out_features)``, each expert's down projection's bias
            (scaled by the routing weight with the rest of the expert's output, as gpt-oss's).
        interleaved: True where gate and up rows alternate in ``gate_up_proj`` and its bias (gate row
            ``i`` at ``2i``, up row ``i`` at ``2i + 1``: gpt-oss's layout) rather than all gate rows
            first; the kernels read them in place as one operand.
        {limit}

    Returns:
        ``(tokens, out_features)`` in ``hidden_states``' dtype (the sum over the ``k`` choices in fp32).

    Example::

        >>> x = torch.randn(6, 16, requires_grad=True)
        >>> idx, w = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [3, 2], [1, 3]]), torch.rand(6, 2)
        >>> gate_up, down = torch.randn(4, 2 * 32, 16), torch.randn(4, 16, 32)
        >>> y = fusedrc.functional.moe_experts(x, idx, w, gate_up, down)
        >>> y.shape
        torch.Size([6, 16])
        >>> y.sum().backward()
    """
    check_tensor(hidden_states, "hidden_states", ndim=2)
    _check_params(hidden_states, (gate_up_proj, "gate_up_proj", 3, False), (down_proj, "down_proj", 3, False),
                  name_x="hidden_states")
    activation = _gated_activation(activation, swiglu_limit, limit_after_act, swiglu_alpha, up_offset, gate_softcap,
                                   up_softcap, gate_scale)
    if not isinstance(gated, bool):
        raise TypeError(f"gated must be a bool, got {type(gated).__name__} {gated!r}")
    if (swiglu_limit is not None or swiglu_alpha is not None or up_offset or gate_softcap is not None
            or up_softcap is not None or gate_scale != 1.0) and not gated:
        raise ValueError("swiglu_limit, swiglu_alpha, up_offset, the softcaps and gate_scale shape a gated product; "
                         "ungated experts have none")
    apart = up_proj is not None
    if apart:
        _check_params(hidden_states, (up_proj, "up_proj", 3, False), name_x="hidden_states")
        if not gated:
            raise ValueError("up_proj is for gated experts (gate and up projections stored apart); ungated experts "
                             "hold their up projections in gate_up_proj")
        if up_proj.shape != gate_up_proj.shape:
            raise ValueError(f"up_proj must have gate_up_proj's shape {tuple(gate_up_proj.shape)} (the gate "
                             f"projections, with up_proj apart), got {tuple(up_proj.shape)}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__} {interleaved!r}")
    if interleaved and (apart or not gated):
        raise ValueError("interleaved says how gate_up_proj holds both the gate and the up projections: it needs "
                         "gated experts without up_proj")
    E, rows, k_in = gate_up_proj.shape
    if (gated and not apart and rows % 2) or k_in != hidden_states.shape[1]:
        what = "2 * intermediate" if gated and not apart else "intermediate"
        raise ValueError(f"gate_up_proj must have shape (num_experts, {what}, {hidden_states.shape[1]}) "
                         f"to match hidden_states' last dimension, got {tuple(gate_up_proj.shape)}")
    inter = rows // 2 if gated and not apart else rows
    if down_proj.shape[0] != E or down_proj.shape[2] != inter:
        raise ValueError(f"down_proj must have shape ({E}, out_features, {inter}) to match gate_up_proj's "
                         f"experts and intermediate size, got {tuple(down_proj.shape)}")
    _check_params(hidden_states, (gate_up_proj_bias, "gate_up_proj_bias", 2, True),
                  (down_proj_bias, "down_proj_bias", 2, True), name_x="hidden_states")
    if gate_up_proj_bias is not None and apart:
        raise ValueError("gate_up_proj_bias with up_proj apart has no up biases: experts with both are not supported")
    for bias, name, shape in ((gate_up_proj_bias, "gate_up_proj_bias", (E, rows)),
                              (down_proj_bias, "down_proj_bias", (E, down_proj.shape[1]))):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (num_experts, the projection's output rows), "
                             f"got {tuple(bias.shape)}")
    _check_routing(hidden_states, top_k_index, top_k_weights, E, skip_out_of_range)
    x, gate_up_proj, down_proj, up_proj, gate_up_proj_bias, down_proj_bias = _autocast(
        hidden_states, gate_up_proj, down_proj, up_proj, gate_up_proj_bias, down_proj_bias)
    for t, name in ((gate_up_proj, "gate_up_proj"), (down_proj, "down_proj"), (up_proj, "up_proj"),
                    (gate_up_proj_bias, "gate_up_proj_bias"), (down_proj_bias, "down_proj_bias")):
        if t is not None:
            check_same(x, "hidden_states", t, name)
    args = (x, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    biases = (gate_up_proj_bias, down_proj_bias)
    if needs_unfused(x, top_k_weights, gate_up_proj, down_proj, up_proj, *biases) or inside_region():
        return _moe_plain(*args, reference.ExpertsLayout(gated, apart, interleaved), up_proj, *biases)
    backend = resolve_backend(x, "moe_experts", "moe_experts_forward")
    return ops.pick("moe_experts", x, backend)(*args, backend, gated, up_proj, *biases, interleaved)


def _check_training(training):
    if not isinstance(training, bool):
        kind = type(training).__name__ if type(training).__module__ == "builtins" else \
            f"{type(training).__module__}.{type(training).__name__}"  # numpy.bool, not "bool"
        raise TypeError(f"training must be a bool, got {kind} {training!r}")


def _check_batch_norm(x, bn_weight, bn_bias, running_mean, running_var, c, training, eps) -> bool:
    """Check a fused BatchNorm's parameters and statistics over ``c`` channels against ``x``
    (``F.batch_norm``'s rules); returns whether batch statistics normalize."""
    mixed = x.dtype in (torch.float16, torch.bfloat16)  # fp32 BN parameters with a half input are fine
    check_vector(bn_weight, "bn_weight", c, x, dtype=not mixed)
    check_vector(bn_bias, "bn_bias", c, x, dtype=not mixed)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must both be tensors or both be None")
    if mixed:  # F.batch_norm's rule for a half input: its parameters in its dtype or in fp32, both alike
        given = [(t, n) for t, n in ((bn_weight, "bn_weight"), (bn_bias, "bn_bias")) if t is not None]
        for t, n in given:
            if t.dtype not in (x.dtype, torch.float32):
                raise TypeError(f"{n} has dtype {t.dtype} but input has dtype {x.dtype}; expected {x.dtype} "
                                "or torch.float32")
        if len(given) == 2 and bn_weight.dtype != bn_bias.dtype:
            raise TypeError(f"bn_weight has dtype {bn_weight.dtype} but bn_bias has dtype {bn_bias.dtype}; "
                            "expected the same dtype")
    check_vector(running_mean, "running_mean", c, x, dtype=False)
    check_vector(running_var, "running_var", c, x, dtype=False)
    if training:
        check_no_overlap(running_mean, "running_mean")
        check_no_overlap(running_var, "running_var")
    use_batch_stats = training or running_mean is None
    if use_batch_stats and eps == 0:
        raise ValueError("eps must be positive when batch statistics normalize (training, or no running "
                         "statistics), got 0.0")
    return use_batch_stats


def _check_conv_weight(x, weight, bias, stride, padding, dilation, groups, same_dtype=True):
    """Check a conv's weight and bias against its input ``x`` (and its dtype, with ``same_dtype``);
    returns the output's shape."""
    if x.shape[1] % groups:
        raise ValueError(f"input's {x.shape[1]} channels must be divisible by groups={groups}")
    if weight.shape[1] * groups != x.shape[1] or weight.shape[0] % groups:
        per = x.shape[1] // groups
        raise ValueError(
            f"weight must have shape (out_channels, {per}, kh, kw) with out_channels divisible by groups={groups}, "
            f"to match input's {x.shape[1]} channels, got {tuple(weight.shape)}"
        )
    check_same(x, "input", weight, "weight", dtype=same_dtype)
    check_vector(bias, "bias", weight.shape[0], x, dtype=same_dtype)
    expected = ops._conv_out_shape(x, weight, stride, padding, dilation)
    if expected[2] < 1 or expected[3] < 1:
        kh, kw = weight.shape[2:]
        raise ValueError(
            f"weight's kernel ({kh}, {kw}) (dilation {tuple(dilation)}) is larger than input's padded spatial "
            f"size {tuple(ops.conv_padded_size(x, padding))}; expected kernel extent <= padded input size"
        )
    return expected


def _check_conv_geometry(stride, padding, dilation, groups, weight=None):
    """The conv arguments as lists. With ``weight`` (conv_bn_act's), ``padding`` may also be ``"same"``
    / ``"valid"`` or 4 ints ``(left, right, top, bottom)``: a padding wider on one side comes back as
    those 4 (``ops.conv_pads``), any other as ``[h, w]``."""
    stride, dilation = pair(stride, "stride", min_value=1), pair(dilation, "dilation", min_value=1)
    groups = check_int(groups, "groups", min_value=1)
    four = isinstance(padding, (tuple, list)) and len(padding) == 4
    if weight is None or not (isinstance(padding, str) or four):
        if weight is not None and not (isinstance(padding, numbers.Integral) or isinstance(padding, (tuple, list))
                                       and len(padding) == 2):
            raise TypeError("padding must be an int, a pair of ints, 4 ints (left, right, top, bottom), 'same' or "
                            f"'valid', got {padding!r}")
        return stride, pair(padding, "padding", min_value=0), dilation, groups
    if padding == "valid":
        return stride, [0, 0], dilation, groups
    if padding == "same":
        if stride != [1, 1]:
            raise ValueError(f"padding='same' is not supported for strided convolutions, got stride={tuple(stride)}")
        (th, tw) = (d * (k - 1) for d, k in zip(dilation, weight.shape[2:]))
        sides = [tw // 2, tw - tw // 2, th // 2, th - th // 2]  # the odd one at the far side, as aten pads
    elif isinstance(padding, str):
        raise ValueError(f"padding must be 'same' or 'valid' as a string, got {padding!r}")
    else:
        if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in padding):
            raise TypeError(
                f"padding must be an int, a pair of ints or 4 ints (left, right, top, bottom), got {padding!r}")
        sides = [int(i) for i in padding]
        if min(sides) < 0:
            raise ValueError(f"padding must be non-negative, got {padding!r}")
    left, right, top, bottom = sides
    return stride, ([top, left] if (left, top) == (right, bottom) else sides), dilation, groups


def _check_one_value(use_batch_stats, n, c, h, w):
    if use_batch_stats and n * h * w == 1:  # F.batch_norm's own check, same message
        raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                         f"{torch.Size((n, c, h, w))}")


# The conv ops' static checks, by call (_validate.CheckedCalls): the autocast setting joins the key,
# since the weight checks read the cast operands.
_CONV_CHECKED = CheckedCalls()
_BN_CONV_CHECKED = CheckedCalls()


def _conv_call_key(x, tensors, scalars):
    if not isinstance(x, Tensor):
        return None
    amp = torch.get_autocast_dtype(x.device.type) if _autocast_on(x.device.type) else None
    return call_key((x, *tensors), (*scalars, amp))


def conv_bn_act(
    x: Tensor, weight: Tensor, bn_weight: Tensor | None, bn_bias: Tensor | None,
    running_mean: Tensor | None, running_var: Tensor | None, *, training: bool = True,
    momentum: float = 0.1, eps: float = 1e-5, stride=1, padding=0, dilation=1,
    bias: Tensor | None = None, residual: Tensor | None = None, activation: str | None = "relu", groups: int = 1,
) -> Tensor:
    """``act(batch_norm(conv2d(x, weight)) [+ residual])`` with ``F.batch_norm``'s conventions.

    ``bn_weight``/``bn_bias`` may be None (no affine); ``running_mean``/``running_var``
    may be None (no tracking: batch statistics are used, also in eval). When
    ``training``, the running statistics are updated in place once with the
    averaging factor ``momentum`` (unbiased variance). Kept for backward: ``x``,
    the parameters, the per-channel mean and rstd, and ``residual`` if given.
    The batch variance that update uses is ``rstd**-2 - eps`` from the op's fp32 rstd: exact
    to about ``1e-7 * (var + eps)``, so a channel whose variance is far below ``eps`` (a
    nearly constant one) gets a running variance off by much more than that relatively
    (1e-4 relative at var = 1e-8, eps = 1e-5; torch accumulates it in fp64 on the CPU), while
    the ``running_var + eps`` that eval normalizes with stays exact to about 1e-7.

    Args:
        x: ``(N, C_in, H, W)``, floating point.
        weight: conv weight ``(C_out, C_in / groups, kh, kw)``; ``bias`` ``(C_out,)`` or None.
        bn_weight, bn_bias, running_mean, running_var: ``(C_out,)`` or None.
        training: normalize with the batch statistics (and update the running ones).
        momentum, eps: as in ``F.batch_norm`` (``eps`` must be positive with batch statistics).
        stride, padding, dilation: ints or pairs of ints, as in ``F.conv2d`` (zero padding);
            ``padding`` may also be ``"same"`` (stride 1; an even kernel extent pads the far side one
            more, as ``F.conv2d``), ``"valid"``, or 4 ints ``(left, right, top, bottom)`` in ``F.pad``'s
            order (TensorFlow's 'SAME' with a stride, timm's ``Conv2dSame``). The side padded wider
            is padded on a transient copy of ``x`` (in forward and in backward's recompute); only ``x``
            is kept.
        residual: added after BatchNorm, before the activation; the conv output's shape. Under
            autocast it is cast with the conv's operands and the output is in their dtype, as
            torchvision's blocks get it (``out += identity`` in place keeps the half dtype).
        activation: as in :func:`linear_act`; ``"relu"`` by default; None: no activation
            (``batch_norm(conv2d(x)) [+ residual]``, a projection or downsample Conv-BN).
        groups: as in ``F.conv2d`` (ResNeXt, RegNet, depthwise convolutions). On the Triton
            backend a grouped conv with a multiple of 16 output channels per group runs the fused
            kernels with an implicit GEMM per group; any other grouping (depthwise convs among
            them) runs the fused op's reference implementation (aten's conv in forward and in the
            backward's recompute: the memory of a recompute, not the fused kernels' traffic
            savings). Opt-in, ``kernels.conv_bn_act.DIRECT_MAX_GROUP_CHANNELS`` sends groups of up
            to that many input channels to fused kernels with a direct (FMA) convolution.

    Example::

        >>> conv, bn = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
        >>> x = torch.randn(2, 3, 8, 8)
        >>> y = fusedrc.functional.conv_bn_act(x, conv.weight, bn.weight, bn.bias, bn.running_mean,
        ...                                    bn.running_var, training=True, padding=1)
        >>> y.shape
        torch.Size([2, 8, 8, 8])
    """
    key = _conv_call_key(x, (weight, bias, bn_weight, bn_bias, running_mean, running_var, residual),
                         (activation, stride, padding, dilation, groups, eps, training))
    checked = _CONV_CHECKED.get(key)
    if checked is None:
        check_tensor(x, "input", ndim=4)
        _check_params(x, (weight, "weight", 4, False), (bias, "bias", 1, True), (residual, "residual", 4, True))
        activation = reference.NO_ACTIVATION if activation is None else check_activation(activation)
        stride, padding, dilation, groups = _check_conv_geometry(stride, padding, dilation, groups, weight)
        eps = check_number(eps, "eps", min_value=0)
        momentum = check_number(momentum, "momentum")
        _check_training(training)
        # autocast casts the conv's operands; BatchNorm keeps its (fp32) parameters, as in eager
        x, weight, bias, residual = _autocast(x, weight, bias, residual)
        expected = _check_conv_weight(x, weight, bias, stride, padding, dilation, groups)
        use_batch_stats = _check_batch_norm(x, bn_weight, bn_bias, running_mean, running_var, weight.shape[0],
                                            training, eps)
        if residual is not None:
            check_same(x, "input", residual, "residual")
            if tuple(residual.shape) != expected:
                raise ValueError(f"residual must have the conv output's shape {expected}, got {tuple(residual.shape)}")
        _CONV_CHECKED.put(key, (activation, stride, padding, dilation, groups, eps, expected, use_batch_stats))
    else:
        activation, stride, padding, dilation, groups, eps, expected, use_batch_stats = checked
        momentum = check_number(momentum, "momentum")  # it may change every call (a cumulative average)
        x, weight, bias, residual = _autocast(x, weight, bias, residual)
    c = weight.shape[0]
    if training and running_mean is not None:
        snapshot_buffers(running_mean, running_var)  # a region's rerun updates them once more: undone after it
    if x.shape[0] == 0 or needs_unfused(x, weight, bias, bn_weight, bn_bias, residual) or inside_region():
        # an empty batch (eager BatchNorm returns an empty output and leaves the statistics alone),
        # a transform the op has no rule for, or inside a recompute region (_state.inside_region):
        # the plain composition, running statistics included
        extra, symmetric = ops.conv_pads(padding)
        padded = x if extra is None else torch.nn.functional.pad(x, extra)
        y = torch.nn.functional.batch_norm(
            torch.nn.functional.conv2d(padded, weight, bias, stride, symmetric, dilation, groups), running_mean,
            running_var, bn_weight, bn_bias, use_batch_stats, momentum, eps)
        return reference.activation_forward(y if residual is None else y + residual, activation)
    _check_one_value(use_batch_stats, x.shape[0], c, *expected[2:])
    backend = resolve_backend(x, "conv_bn_act", "conv_bn_act_forward")
    y, mean, rstd = ops.pick("conv_bn_act", x, backend)(
        x, weight, bias, bn_weight, bn_bias, running_mean, running_var, residual,
        use_batch_stats, float(eps), stride, padding, dilation, activation, backend, groups,
    )
    if training and running_mean is not None:
        _update_running_stats(running_mean, running_var, mean, rstd, eps, momentum, y.numel() // c, backend)
    return y


def bn_act_conv(
    x: Tensor, bn_weight: Tensor | None, bn_bias: Tensor | None, running_mean: Tensor | None,
    running_var: Tensor | None, weight: Tensor, *, training: bool = True, momentum: float = 0.1, eps: float = 1e-5,
    stride=1, padding=0, dilation=1, bias: Tensor | None = None, activation: str | None = "relu", groups: int = 1,
) -> Tensor:
    """``conv2d(act(batch_norm(x)), weight)``: the pre-activation order (DenseNet's layers and
    transitions, pre-activation ResNets), with ``F.batch_norm``'s conventions for the BatchNorm
    over ``x``'s channels.

    Kept for backward: ``x``, the parameters and the per-channel mean and rstd of ``x``. The
    normalized and activated tensor (the conv's input, which eager autograd keeps besides ``x``)
    is rebuilt in backward by one elementwise pass; no convolution reruns, since the conv's
    backward needs its input, not its output (``torch.utils.checkpoint``'s early stop ends its rerun
    there too, after BatchNorm and the activation as separate ops).
    The running statistics are updated in place once when ``training``, as in
    :func:`conv_bn_act`. Under autocast, as in eager, BatchNorm and the activation run in ``x``'s
    dtype and the activation is cast to the conv's (an fp32 ``x`` with a bf16 conv takes the
    reference implementation on the Triton backend).

    Args:
        x: ``(N, C_in, H, W)``, floating point.
        bn_weight, bn_bias, running_mean, running_var: ``(C_in,)`` or None.
        weight: conv weight ``(C_out, C_in / groups, kh, kw)``; ``bias`` ``(C_out,)`` or None.
        training, momentum, eps: as in ``F.batch_norm``.
        stride, padding, dilation, groups: as in ``F.conv2d`` (zero padding).
        activation: as in :func:`conv_bn_act`; ``"relu"`` by default; None: none.

    Example::

        >>> bn, conv = torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 4, 1, bias=False)
        >>> x = torch.randn(2, 8, 5, 5)
        >>> y = fusedrc.functional.bn_act_conv(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
        ...                                    conv.weight, training=True)
        >>> y.shape
        torch.Size([2, 4, 5, 5])
    """
    key = _conv_call_key(x, (weight, bias, bn_weight, bn_bias, running_mean, running_var),
                         (activation, stride, padding, dilation, groups, eps, training))
    checked = _BN_CONV_CHECKED.get(key)
    if checked is None:
        check_tensor(x, "input", ndim=4)
        _check_params(x, (weight, "weight", 4, False), (bias, "bias", 1, True))
        activation = reference.NO_ACTIVATION if activation is None else check_activation(activation)
        stride, padding, dilation, groups = _check_conv_geometry(stride, padding, dilation, groups)
        eps = check_number(eps, "eps", min_value=0)
        momentum = check_number(momentum, "momentum")
        _check_training(training)
        _, weight, bias = _autocast(x, weight, bias)  # the conv's operands; BatchNorm keeps x's dtype
        _check_conv_weight(x, weight, bias, stride, padding, dilation, groups,
                           same_dtype=not _autocast_on(x.device.type))
        use_batch_stats = _check_batch_norm(x, bn_weight, bn_bias, running_mean, running_var, x.shape[1], training,
                                            eps)
        _BN_CONV_CHECKED.put(key, (activation, stride, padding, dilation, groups, eps, use_batch_stats))
    else:
        activation, stride, padding, dilation, groups, eps, use_batch_stats = checked
        momentum = check_number(momentum, "momentum")  # it may change every call (a cumulative average)
        _, weight, bias = _autocast(x, weight, bias)
    c = x.shape[1]
    if training and running_mean is not None:
        snapshot_buffers(running_mean, running_var)
    if x.shape[0] == 0 or needs_unfused(x, weight, bias, bn_weight, bn_bias) or inside_region():
        a = torch.nn.functional.batch_norm(x, running_mean, running_var, bn_weight, bn_bias, use_batch_stats,
                                           momentum, eps)
        return torch.nn.functional.conv2d(reference.activation_forward(a, activation).to(weight.dtype), weight, bias,
                                          stride, padding, dilation, groups)
    _check_one_value(use_batch_stats, *x.shape)
    backend = resolve_backend(x, "bn_act_conv", "bn_act_conv_forward")
    y, mean, rstd = ops.pick("bn_act_conv", x, backend)(
        x, bn_weight, bn_bias, running_mean, running_var, weight, bias,
        use_batch_stats, float(eps), stride, padding, dilation, activation, backend, groups,
    )
    if training and running_mean is not None:
        _update_running_stats(running_mean, running_var, mean, rstd, eps, momentum, x.numel() // c, backend)
    return y


def _update_running_stats(running_mean, running_var, mean, rstd, eps, momentum, n, backend):
    if torch.compiler.is_compiling() or traced(running_mean):
        # traced (compile, export): a visible buffer mutation
        reference.lerp_running_stats_(running_mean, running_var, mean, rstd, eps, momentum, n)
        return
    # eager: as BatchNorm's kernel, without bumping the buffers' version counters (a graph that
    # saved them stays valid); the Triton backend does it in one launch
    get_impl(backend, "conv_bn_act", "update_running_stats_")(running_mean, running_var, mean, rstd, eps, momentum, n)


if moe_experts.__doc__:
    moe_experts.__doc__ = moe_experts.__doc__.replace("{limit}", _LIMIT_DOC)
