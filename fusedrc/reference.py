"""Pure-PyTorch reference implementations of the fused patterns.

Each function has the same signature as its Triton launcher in ``fusedrc.kernels``;
the autograd code calls one or the other without knowing which. They use the
same aten ops as the plain modules (``F.linear``, ``F.conv2d``, ``native_batch_norm``),
so on the CPU a fused op's forward is bitwise equal to the unfused modules', and
the recompute in backward reproduces the forward's pre-activation bit for bit.

Dense patterns take ``x`` as a 2-D ``(M, K)`` tensor; the ops flatten leading dims.

Every backward takes ``output_mask``, one bool per gradient it returns (as
``aten.convolution_backward`` does): a gradient masked off is returned as None and
the work only it needs is skipped (a frozen weight's GEMM, the input gradient of a
model's first layer). None means all.
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _relu2(h):
    return torch.square(torch.relu(h))


def _quick_gelu(h):
    return h * torch.sigmoid(1.702 * h)


def _quick_gelu_backward(g, h):
    s = torch.sigmoid(1.702 * h)
    return g * s + aten.sigmoid_backward(g * h, s) * 1.702


# name -> (forward, backward(grad, h) -> grad_h). Backward uses the aten
# kernels autograd itself uses, so gradients match the unfused modules'.
ACTIVATIONS = {
    "relu": (torch.relu, lambda g, h: aten.threshold_backward(g, h, 0)),
    # as autograd of square(relu(h)): threshold_backward last, so h <= 0 gives 0 even for g = inf/NaN
    "relu2": (_relu2, lambda g, h: aten.threshold_backward(g * (2 * torch.relu(h)), h, 0)),
    "gelu": (lambda h: F.gelu(h), lambda g, h: aten.gelu_backward(g, h, approximate="none")),
    "gelu_tanh": (
        lambda h: F.gelu(h, approximate="tanh"),
        lambda g, h: aten.gelu_backward(g, h, approximate="tanh"),
    ),
    "silu": (F.silu, lambda g, h: aten.silu_backward(g, h)),
    "relu6": (F.relu6, lambda g, h: aten.hardtanh_backward(g, h, 0.0, 6.0)),
    "hardswish": (F.hardswish, lambda g, h: aten.hardswish_backward(g, h)),
    # CLIP's QuickGELU, h * sigmoid(1.702 h); backward as autograd of that composition
    "quick_gelu": (_quick_gelu, _quick_gelu_backward),
    # torch's default slope; "leaky_relu:<slope>" for another (split_activation)
    "leaky_relu": (F.leaky_relu, lambda g, h: aten.leaky_relu_backward(g, h, LEAKY_SLOPE, False)),
}

# nn.LeakyReLU's default negative slope: "leaky_relu" alone means it
LEAKY_SLOPE = 0.01


def wanted(output_mask, n: int) -> tuple:
    """``output_mask`` as ``n`` bools (None: all wanted)."""
    if output_mask is None:
        return (True,) * n
    if len(output_mask) != n:
        raise ValueError(f"output_mask must hold {n} bools, got {len(output_mask)}")
    return tuple(bool(m) for m in output_mask)


def split_activation(activation, name="activation"):
    """``(kind, slope)`` of an activation name: ``"leaky_relu:<slope>"`` is LeakyReLU with that
    negative slope (any finite float), ``"leaky_relu"`` the default 0.01; every other name has
    slope 0.0. Anything else is a ``ValueError`` naming ``name`` and the choices."""
    if isinstance(activation, str):
        if activation in ACTIVATIONS:
            return activation, (LEAKY_SLOPE if activation == "leaky_relu" else 0.0)
        kind, sep, slope = activation.partition(":")
        if kind == "leaky_relu" and sep:
            try:
                value = float(slope)
            except ValueError:
                value = float("nan")
            if math.isfinite(value):
                return kind, value
            raise ValueError(f"{name}: the slope of {activation!r} must be a finite float, as in 'leaky_relu:0.1'")
    raise ValueError(f"{name} must be one of {sorted(ACTIVATIONS)} or 'leaky_relu:<negative slope>', "
                     f"got {activation!r}")


def leaky_relu_name(slope) -> str:
    """The activation name of ``nn.LeakyReLU(slope)``."""
    return "leaky_relu" if float(slope) == LEAKY_SLOPE else f"leaky_relu:{float(slope)!r}"


def check_activation(activation, name="activation") -> str:
    """``activation`` if it names a fused activation; a ``ValueError`` naming ``name`` otherwise."""
    split_activation(activation, name)
    return activation


# A gated FFN's activation may carry options of its gated product, the gated ops only, each "|<key>=<value>":
#   limit=<L>        act(min(h_g, L)) * clamp(h_u, -L, L) (DeepSeek-V4, GLM-5-Next, HY-V4)
#   limit_after=<L>  min(act(h_g), L) * clamp(h_u, -L, L) (Step-3.7)
#   alpha=<a>        the gate's activation h * sigmoid(a h), "silu" with a slope (MiniMax-M3's, gpt-oss's glu)
#   up_offset=<c>    (h_u + c) after its clamp (MiniMax-M3's, gpt-oss's up + 1)
#   gate_softcap=<s> the gate's activation s tanh(h / s) * sigmoid(a h): silu (a = alpha, or 1) with its linear
#                    factor softcapped, the sigmoid seeing the raw h (Inkling2's)
#   up_softcap=<s>   s tanh(h_u / s) after its clamp, before its offset (Inkling2's)
#   gate_scale=<m>   m h_g before all of the above (Falcon-H1's gate multiplier)
# L, a and s finite and > 0, c finite, m finite and not 0. ``gated_name`` writes them.
_re_number = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class GatedSpec(NamedTuple):
    act: str
    limit: float | None = None
    after: bool = False
    alpha: float | None = None
    offset: float = 0.0
    gate_cap: float | None = None
    up_cap: float | None = None
    scale: float = 1.0


def split_gated(activation, name="activation") -> GatedSpec:
    """The ``GatedSpec`` of a gated FFN's activation string; a ``ValueError`` naming ``name`` otherwise."""
    act, *options = activation.split("|") if isinstance(activation, str) else (activation,)
    split_activation(act, name)
    spec, seen = GatedSpec(act), set()
    for option in options:
        key, eq, value = option.partition("=")
        # a plain decimal number, as gated_name writes it (float() would also take "1_0", " 7", "inf")
        number = float(value) if eq and _re_number.fullmatch(value) else math.nan
        positive = math.isfinite(number) and number > 0
        group = "limit" if key in ("limit", "limit_after") else key
        if group in seen:
            number, positive = math.nan, False  # each option once
        seen.add(group)
        if key in ("limit", "limit_after") and positive:
            spec = spec._replace(limit=number, after=key == "limit_after")
        elif key == "alpha" and positive and act == "silu":
            spec = spec._replace(alpha=number)
        elif key == "up_offset" and math.isfinite(number):
            spec = spec._replace(offset=number)
        elif key == "gate_softcap" and positive and act == "silu":
            spec = spec._replace(gate_cap=number)
        elif key == "up_softcap" and positive:
            spec = spec._replace(up_cap=number)
        elif key == "gate_scale" and math.isfinite(number) and number != 0:
            spec = spec._replace(scale=number)
        else:
            raise ValueError(f"{name}: a gated activation's options are '|limit=<L>' or '|limit_after=<L>', "
                             f"'|alpha=<a>' (silu), '|up_offset=<c>', '|gate_softcap=<s>' (silu) and "
                             f"'|up_softcap=<s>' and '|gate_scale=<m>', L, a and s finite > 0, c finite, m finite "
                             f"and not 0, each once; got {activation!r}")
    return spec


def gated_name(activation, limit=None, after=False, alpha=None, offset=0.0, gate_cap=None, up_cap=None,
               scale=1.0) -> str:
    """The gated ops' activation string of ``activation`` with a SwiGLU clamp at ``limit`` (None: none), after
    the activation where ``after``, the gate's activation ``h * sigmoid(alpha h)`` (None: ``activation``'s),
    ``offset`` added to the (clamped) up projection, the softcaps ``gate_cap`` of the gate's linear factor and
    ``up_cap`` of the up projection (None: none), and the gate pre-activation's multiplier ``scale``."""
    parts = [activation]
    if limit is not None:
        parts.append(f"{'limit_after' if after else 'limit'}={float(limit)!r}")
    if alpha is not None:
        parts.append(f"alpha={float(alpha)!r}")
    if offset:
        parts.append(f"up_offset={float(offset)!r}")
    if gate_cap is not None:
        parts.append(f"gate_softcap={float(gate_cap)!r}")
    if up_cap is not None:
        parts.append(f"up_softcap={float(up_cap)!r}")
    if scale != 1.0:
        parts.append(f"gate_scale={float(scale)!r}")
    return "|".join(parts)


def _softcap(h, cap):
    """(cap * tanh(h / cap), tanh(h / cap)) as the models write it."""
    t = torch.tanh(h / cap)
    return t * cap, t


def _gate_forward(h, spec):
    if spec.alpha is None and spec.gate_cap is None:
        return activation_forward(h, spec.act)
    lin = h if spec.gate_cap is None else _softcap(h, spec.gate_cap)[0]
    return lin * torch.sigmoid(h if spec.alpha is None else h * spec.alpha)


def _gate_backward(grad, h, spec):
    if spec.alpha is None and spec.gate_cap is None:
        return activation_backward(grad, h, spec.act)
    alpha = 1.0 if spec.alpha is None else spec.alpha
    s = torch.sigmoid(h * alpha)  # autograd of lin(h) * sigmoid(h * alpha), lin = h or its softcap
    if spec.gate_cap is None:
        return grad * s + aten.sigmoid_backward(grad * h, s) * alpha
    lin, t = _softcap(h, spec.gate_cap)
    return (aten.tanh_backward(grad * s * spec.gate_cap, t) / spec.gate_cap
            + aten.sigmoid_backward(grad * lin, s) * alpha)


class GatedOperands(NamedTuple):
    """What the gated product reads, as the kernels' ``_clamped_operands`` has it: ``gate`` (the gate's
    activation, clamped), ``up`` (clamped, offset), where the clamps pass a gradient (None without a clamp), the
    value the gate's derivative reads and the spec."""
    gate: torch.Tensor
    up: torch.Tensor
    keep_g: torch.Tensor | None
    keep_u: torch.Tensor | None
    hg: torch.Tensor
    spec: GatedSpec
    up_tanh: torch.Tensor | None = None  # tanh(h_u / s) of the up softcap (None without)


def gated_operands(hg, hu, activation) -> GatedOperands:
    """The operands of the gated product ``gate * up`` with the activation string's options (torch ops:
    differentiable); ``gated_product_backward`` reads them, so the activation runs once."""
    spec = split_gated(activation)
    if spec.scale != 1.0:
        hg = hg * spec.scale
    limit, keep_g, keep_u = spec.limit, None, None
    if limit is None:
        gate = _gate_forward(hg, spec)
    else:
        keep_u = (hu >= -limit) & (hu <= limit)
        hu = hu.clamp(-limit, limit)
        if spec.after:
            gate = _gate_forward(hg, spec)
            keep_g = gate <= limit
            gate = gate.clamp(max=limit)
        else:
            keep_g = hg <= limit
            hg = hg.clamp(max=limit)
            gate = _gate_forward(hg, spec)
    up_tanh = None
    if spec.up_cap is not None:
        hu, up_tanh = _softcap(hu, spec.up_cap)
    if spec.offset:
        hu = hu + spec.offset
    return GatedOperands(gate, hu, keep_g, keep_u, hg, spec, up_tanh)


def gated_product(hg, hu, activation):
    """The gated product ``act(h_g) * h_u`` with the activation string's options (torch ops: differentiable)."""
    o = gated_operands(hg, hu, activation)
    return o.gate * o.up


def gated_product_backward(grad_a, o: GatedOperands):
    """``(grad_hg, grad_hu)`` of the gated product of operands ``o``, as autograd through its ops gives them (a
    clamped element, and a NaN one, passes no gradient through its clamp; the order of the clamp's and the
    activation's backward as torch's)."""
    grad_hu = grad_a * o.gate
    grad_gate = grad_a * o.up
    if o.up_tanh is not None:
        grad_hu = aten.tanh_backward(grad_hu * o.spec.up_cap, o.up_tanh) / o.spec.up_cap
    if o.keep_u is not None:
        grad_hu = torch.where(o.keep_u, grad_hu, 0.0)
    if o.keep_g is None:
        grad_hg = _gate_backward(grad_gate, o.hg, o.spec)
    elif o.spec.after:
        grad_hg = _gate_backward(torch.where(o.keep_g, grad_gate, 0.0), o.hg, o.spec)
    else:
        grad_hg = torch.where(o.keep_g, _gate_backward(grad_gate, o.hg, o.spec), 0.0)
    return (grad_hg if o.spec.scale == 1.0 else grad_hg * o.spec.scale), grad_hu


# "none": the conv+BN op without an activation (a projection or downsample Conv-BN); not a public
# activation of the other ops (check_activation does not take it)
NO_ACTIVATION = "none"


def activation_forward(h, activation):
    if activation == NO_ACTIVATION:
        return h
    kind, slope = split_activation(activation)
    return F.leaky_relu(h, slope) if kind == "leaky_relu" else ACTIVATIONS[kind][0](h)


def activation_backward(grad, h, activation):
    if activation == NO_ACTIVATION:
        return grad
    kind, slope = split_activation(activation)
    if kind == "leaky_relu":
        return aten.leaky_relu_backward(grad, h, slope, False)
    return ACTIVATIONS[kind][1](grad, h)


# --------------------------------------------------------------------------- Linear + act
def linear_act_forward(x, weight, bias, activation):
    """y = act(x @ weight.T + bias); x is (M, K)."""
    return activation_forward(F.linear(x, weight, bias), activation)


def linear_act_backward(x, weight, bias, grad_out, activation, output_mask=None):
    """Recompute h = x W^T + b, then (dx, dweight, dbias); dbias is None without bias."""
    need_dx, need_dw, need_db = wanted(output_mask, 3)
    h = F.linear(x, weight, bias)
    grad_h = activation_backward(grad_out, h, activation)
    del h
    dx = grad_h.mm(weight) if need_dx else None
    dweight = grad_h.t().mm(x) if need_dw else None
    dbias = grad_h.sum(0) if bias is not None and need_db else None
    return dx, dweight, dbias


# --------------------------------------------------------------------------- FFN dropout
# The mask of a fused FFN's dropout is never stored: the backward regenerates it from a seed
# (a 1-element int64 tensor drawn from the device's default generator at the forward).
# This backend draws it with torch's Bernoulli sampler from a generator seeded so; the Triton
# kernels hash (seed, row, column) with Philox (``philox_keep`` is their oracle). Both keep
# an element with probability 1 - p and scale it by 1/(1 - p), as F.dropout does; the masks
# of the two backends differ (as eager's and inductor's do).
def dropout_factor(seed, shape, p, like):
    """Dropout's multiplier (0 or 1/(1-p)) for a tensor of ``shape`` like ``like``."""
    if like.device.type == "meta":  # shapes only: no generator there
        return torch.empty(shape, device=like.device, dtype=like.dtype)
    gen = torch.Generator(device=like.device)
    gen.manual_seed(int(seed.reshape(()).item()))
    keep = torch.empty(shape, device=like.device, dtype=like.dtype).bernoulli_(1 - p, generator=gen)
    return keep.mul_(1.0 / (1 - p)) if p < 1 else keep


def _dropped(a, dropout_p, seed):
    return a if dropout_p == 0 else a * dropout_factor(seed, a.shape, dropout_p, a)


_M32 = 0xFFFFFFFF


def _mul32(a, b: int):
    """(high, low) 32-bit words of a * b for int64 tensors of uint32 values, without overflowing int64."""
    hi = (a >> 16) * b
    lo = (a & 0xFFFF) * b
    return (hi + (lo >> 16)) >> 16, (((hi & 0xFFFF) << 16) + lo) & _M32


def philox4x32(seed: int, c0: torch.Tensor, c1: torch.Tensor, rounds: int = 10):
    """The 4 words of Philox 4x32 (``rounds`` rounds) of counters (c0, c1, 0, 0), int64 tensors of
    uint32 values, under the 64-bit key ``seed``, as Triton's ``tl.philox`` computes them."""
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(rounds):
        hi_b, lo_b = _mul32(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul32(c0, 0xD2511F53)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def philox_keep(seed: int, rows: int, cols: int, p: float) -> torch.Tensor:
    """The Triton FFN's dropout mask (bool, (rows, cols), True = kept), its oracle: element (m, j)
    takes word j % 4 of Philox 4x32-10 of the counter (j // 4, m, 0, 0) under the key ``seed``, and
    is kept when that word's top 24 bits are >= round(p * 2**24)."""
    quads = torch.arange(-(-cols // 4), dtype=torch.int64)
    c0 = quads.expand(rows, -1)
    c1 = torch.arange(rows, dtype=torch.int64)[:, None].expand_as(c0)
    words = torch.stack(philox4x32(seed, c0, c1), dim=-1).reshape(rows, -1)[:, :cols]
    return (words >> 8) >= round(p * 2**24)


# --------------------------------------------------------------------------- a norm before the FFN
# The FFN ops take an optional norm of their input (pre-norm transformers: ``mlp(norm(x))``) and then
# keep x, the norm's input, in place of its output. Every kind normalizes over the last dimension:
#   "layer": F.layer_norm (weight and bias optional);
#   "rms": F.rms_norm / nn.RMSNorm: x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded once;
#   "llama_rms": Hugging Face's Llama/Mistral/Qwen2/T5 RMSNorm: the same normalized in fp32 and
#       rounded to x's dtype, then times the weight (rounded twice in 16-bit dtypes);
#   "gemma_rms": Gemma's (1, 2, 3), Qwen3-Next's and Qwen3.5's RMSNorm: normalized in fp32 times
#       (1 + weight) in fp32, rounded once (the weight is stored as an offset from 1).
NORMS = ("layer", "rms", "llama_rms", "gemma_rms")


def check_norm(norm, name="norm"):
    """``norm`` if it is None or names a norm kind; a ``ValueError`` naming ``name`` otherwise."""
    if norm is not None and (not isinstance(norm, str) or norm not in NORMS):
        raise ValueError(f"{name} must be None or one of {NORMS}, got {norm!r}")
    return norm


def _rms_input(x, norm):
    # F.rms_norm computes float64 in float64; Hugging Face's RMSNorm casts every input to float32
    return x if norm == "rms" and x.dtype == torch.float64 else x.float()


def norm_forward(x, norm, weight, bias, eps):
    """The norm of ``x`` over its last dimension, as the unfused module computes it (differentiable)."""
    if norm == "layer":
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return norm_with_stats(x, norm, weight, bias, eps)[0]


def norm_with_stats(x, norm, weight, bias, eps):
    """``(norm_forward(...), stats)``, the statistics :func:`norm_backward` takes: ``(mean, rstd)``
    for "layer" (aten's own forward, F.layer_norm's kernel), ``rstd`` for the RMS kinds; one float a row."""
    if norm == "layer":
        out, mean, rstd = aten.native_layer_norm(x, x.shape[-1:], weight, bias, eps)
        return out, (mean, rstd)
    xf = _rms_input(x, norm)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    u = xf * rstd
    if norm == "rms":
        return (u if weight is None else u * weight.to(u.dtype)).to(x.dtype), rstd
    if norm == "gemma_rms":
        return (u if weight is None else u * (1.0 + weight.float())).to(x.dtype), rstd
    u = u.to(x.dtype)
    return (u if weight is None else weight * u), rstd


def norm_backward(grad, x, norm, weight, bias, eps, output_mask=None, stats=None):
    """(dx, dweight, dbias) of :func:`norm_forward` for its output's gradient ``grad``; x is (M, K).
    ``stats``: :func:`norm_with_stats`'s, when the caller has them (else computed from x)."""
    need_dx, need_dw, need_db = wanted(output_mask, 3)
    need_dw, need_db = need_dw and weight is not None, need_db and bias is not None
    if stats is None:
        stats = norm_with_stats(x, norm, weight, bias, eps)[1]
    if norm == "layer":
        # aten's kernels, as LayerNorm's autograd runs them: equal gradients
        mean, rstd = stats
        return aten.native_layer_norm_backward(grad, x, x.shape[-1:], mean, rstd, weight, bias,
                                               [need_dx, need_dw, need_db])
    rstd = stats
    u = _rms_input(x, norm) * rstd
    if norm in ("rms", "gemma_rms"):
        g = grad.to(u.dtype)
        dw = (g * u).sum(0).to(weight.dtype) if need_dw else None
        scale = None if weight is None else weight.to(u.dtype) if norm == "rms" else 1.0 + weight.float()
        du = g if scale is None else g * scale
    else:  # y = w * v, v = u in x's dtype: v's gradient in v's dtype (autograd casts it), then u's
        dw = (grad * u.to(x.dtype)).sum(0) if need_dw else None
        du = (grad if weight is None else (grad * weight).to(x.dtype)).to(u.dtype)
    dx = (rstd * (du - u * (du * u).mean(-1, keepdim=True))).to(x.dtype) if need_dx else None
    return dx, dw, None


# --------------------------------------------------------------------------- FFN
def fused_mlp_forward(x, w1, b1, w2, b2, activation, dropout_p=0.0, seed=None):
    """out = dropout(act(x W1^T + b1)) W2^T + b2; x is (M, K)."""
    return F.linear(_dropped(activation_forward(F.linear(x, w1, b1), activation), dropout_p, seed), w2, b2)


def fused_mlp_backward(x, w1, b1, w2, b2, grad_out, activation, dropout_p=0.0, seed=None, output_mask=None):
    """5 GEMMs: g_a = g W2, recompute h, dW2 = g^T a, dX = g_h W1, dW1 = g_h^T x.

    The output GEMM is not rerun; a dropout mask is regenerated from ``seed``.
    Returns (dx, dw1, db1, dw2, db2).
    """
    need_dx, need_dw1, need_db1, need_dw2, need_db2 = wanted(output_mask, 5)
    need_gh = need_dx or need_dw1 or (need_db1 and b1 is not None)
    h = F.linear(x, w1, b1)
    a = activation_forward(h, activation) if need_dw2 else None
    grad_a = grad_out.mm(w2) if need_gh else None
    if dropout_p != 0:
        factor = dropout_factor(seed, h.shape, dropout_p, h)
        for t in (a, grad_a):  # fresh here (the op runs outside autograd): no extra full-size copies
            if t is not None:
                t.mul_(factor)
        del factor
    dw2 = grad_out.t().mm(a) if need_dw2 else None
    del a
    db2 = grad_out.sum(0) if b2 is not None and need_db2 else None
    if not need_gh:
        return None, None, None, dw2, db2
    grad_h = activation_backward(grad_a, h, activation)
    del h, grad_a
    dx = grad_h.mm(w1) if need_dx else None
    dw1 = grad_h.t().mm(x) if need_dw1 else None
    db1 = grad_h.sum(0) if b1 is not None and need_db1 else None
    return dx, dw1, db1, dw2, db2


# --------------------------------------------------------------------------- Mix-FFN
# SegFormer's, GLPN's and PVT-v2's FFN: fc1 -> depthwise k x k conv over the token grid -> act ->
# [dropout] -> fc2. x is (M, K), its rows the tokens of B images of height x width in row-major
# order (M = B * height * width); the conv is "same" (padding k // 2, stride 1, one filter per
# channel), its weight (hidden, 1, k, k).
def _token_images(t, height, width):
    """(M, C) tokens as the (B, C, height, width) view the modules hand their conv (channels last)."""
    return t.view(-1, height * width, t.shape[1]).transpose(1, 2).view(-1, t.shape[1], height, width)


def _image_tokens(t):
    """The conv's (B, C, H, W) output back as (M, C) tokens, as the modules' ``flatten(2).transpose(1, 2)``."""
    return t.flatten(2).transpose(1, 2).reshape(-1, t.shape[1])


def _dwconv_tokens(h, w_dw, b_dw, height, width):
    return _image_tokens(F.conv2d(_token_images(h, height, width), w_dw, b_dw, padding=w_dw.shape[-1] // 2,
                                  groups=w_dw.shape[0]))


def _conv_input(h1, relu_first):
    return torch.relu(h1) if relu_first else h1


def mix_ffn_forward(x, w1, b1, w_dw, b_dw, w2, b2, height, width, activation, dropout_p=0.0, seed=None,
                    relu_first=False):
    """out = dropout(act(dwconv(x W1^T + b1) + b_dw)) W2^T + b2, the conv over each image's token grid;
    ``relu_first``: the conv of relu(x W1^T + b1) (PVT-v2's linear variant)."""
    h2 = _dwconv_tokens(_conv_input(F.linear(x, w1, b1), relu_first), w_dw, b_dw, height, width)
    return F.linear(_dropped(activation_forward(h2, activation), dropout_p, seed), w2, b2)


def mix_ffn_backward(x, w1, b1, w_dw, b_dw, w2, b2, grad_out, height, width, activation, dropout_p=0.0, seed=None,
                     output_mask=None, relu_first=False):
    """Recompute h1 = x W1^T + b1 and the conv's output h2 (not fc2); returns
    (dx, dw1, db1, dw_dw, db_dw, dw2, db2), None for an absent bias or a gradient masked off."""
    need_dx, need_dw1, need_db1, need_dwdw, need_dbdw, need_dw2, need_db2 = wanted(output_mask, 7)
    need_gh2 = need_dx or need_dw1 or need_dwdw or (need_db1 and b1 is not None) or (need_dbdw and b_dw is not None)
    h1 = _conv_input(F.linear(x, w1, b1), relu_first)  # the conv's input (relu'd: torch's relu backward reads it)
    h2 = _dwconv_tokens(h1, w_dw, b_dw, height, width)
    factor = dropout_factor(seed, h2.shape, dropout_p, h2) if dropout_p != 0 else None
    if need_dw2:
        a = activation_forward(h2, activation)
        dw2 = grad_out.t().mm(a if factor is None else a.mul_(factor))
        del a
    else:
        dw2 = None
    db2 = grad_out.sum(0) if b2 is not None and need_db2 else None
    if not need_gh2:
        return None, None, None, None, None, dw2, db2
    grad_a = grad_out.mm(w2)
    if factor is not None:
        grad_a.mul_(factor)
        del factor
    grad_h2 = activation_backward(grad_a, h2, activation)
    del grad_a, h2
    need_gh1 = need_dx or need_dw1 or (need_db1 and b1 is not None)
    k = w_dw.shape[-1]
    g1, dw_dw, db_dw = aten.convolution_backward(
        _token_images(grad_h2, height, width), _token_images(h1, height, width), w_dw,
        [w_dw.shape[0]] if b_dw is not None else None, [1, 1], [k // 2, k // 2], [1, 1], False, [0, 0],
        w_dw.shape[0], [need_gh1, need_dwdw, need_dbdw and b_dw is not None])
    del grad_h2
    grad_h1 = _image_tokens(g1) if need_gh1 else None
    if need_gh1 and relu_first:
        grad_h1 = aten.threshold_backward(grad_h1, h1, 0)
    del h1
    dx = grad_h1.mm(w1) if need_dx else None
    dw1 = grad_h1.t().mm(x) if need_dw1 else None
    db1 = grad_h1.sum(0) if b1 is not None and need_db1 else None
    return dx, dw1, db1, dw_dw if need_dwdw else None, db_dw if need_dbdw and b_dw is not None else None, dw2, db2


# --------------------------------------------------------------------------- xIELU FFN
# Apertus's MLP: down(xielu(up(x))), xIELU (arXiv 2411.13010) with learned alpha_p, alpha_n (their effective,
# positive values: softplus of the parameters, alpha_n with beta added, as the module computes them) and fixed
# beta, eps:  xielu(h) = alpha_p h^2 + beta h  (h > 0),  alpha_n (expm1(min(h, eps)) - h) + beta h  (else).
def xielu(h, alpha_p, alpha_n, beta, eps):
    """Hugging Face's ``XIELUActivation._xielu_python`` with the effective alphas given."""
    eps = torch.tensor(eps, dtype=h.dtype, device=h.device)
    return torch.where(h > 0, alpha_p * h * h + beta * h, (torch.expm1(torch.minimum(h, eps)) - h) * alpha_n + beta * h)


def xielu_grad(h, grad_a, alpha_p, alpha_n, beta, eps, need_gh=True, need_dap=True, need_dan=True):
    """(g_h, dalpha_p, dalpha_n) of a = xielu(h) given dL/da, each None unless needed: autograd's derivatives of the
    module's formula (torch.minimum's tie at eps splits the gradient in half), written out. Where h = -inf, autograd
    gives NaN (the h > 0 branch's zero gradient times h h) and this the limit, beta - alpha_n (a is NaN there)."""
    pos = h > 0
    eps_t = torch.tensor(eps, dtype=h.dtype, device=h.device)
    m = torch.minimum(h, eps_t)
    dap = torch.where(pos, grad_a * h * h, 0).sum().to(alpha_p.dtype).reshape(alpha_p.shape) if need_dap else None
    dan = torch.where(pos, 0, grad_a * (torch.expm1(m) - h)).sum().to(alpha_n.dtype).reshape(alpha_n.shape) \
        if need_dan else None
    grad_h = None
    if need_gh:
        dmin = torch.exp(m) * torch.where(h < eps_t, 1.0, torch.where(h == eps_t, 0.5, 0.0)).to(h.dtype)
        grad_h = grad_a * torch.where(pos, 2 * alpha_p * h + beta, alpha_n * (dmin - 1) + beta).to(h.dtype)
    return grad_h, dap, dan


def xielu_mlp_forward(x, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps):
    """out = xielu(x W1^T + b1) W2^T + b2; x is (M, K), alpha_p and alpha_n 1-element tensors."""
    return F.linear(xielu(F.linear(x, w1, b1), alpha_p, alpha_n, beta, eps), w2, b2)


def xielu_mlp_backward(x, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps, grad_out, output_mask=None):
    """Recompute h = x W1^T + b1 (not the output GEMM); returns (dx, dw1, db1, dw2, db2, dalpha_p, dalpha_n),
    None for an absent bias or a gradient masked off. The derivatives are ``xielu_grad``'s: the op's backward runs
    below autograd."""
    need_dx, need_dw1, need_db1, need_dw2, need_db2, need_dap, need_dan = wanted(output_mask, 7)
    need_gh = need_dx or need_dw1 or (need_db1 and b1 is not None)
    h = F.linear(x, w1, b1)
    dw2 = grad_out.t().mm(xielu(h, alpha_p, alpha_n, beta, eps).to(grad_out.dtype)) if need_dw2 else None
    db2 = grad_out.sum(0) if b2 is not None and need_db2 else None
    if not (need_gh or need_dap or need_dan):
        return None, None, None, dw2, db2, None, None
    grad_h, dap, dan = xielu_grad(h, grad_out.mm(w2), alpha_p, alpha_n, beta, eps, need_gh, need_dap, need_dan)
    del h
    dx = grad_h.mm(w1) if need_dx else None
    dw1 = grad_h.t().mm(x) if need_dw1 else None
    db1 = grad_h.sum(0) if b1 is not None and need_db1 else None
    return dx, dw1, db1, dw2, db2, dap, dan


# --------------------------------------------------------------------------- gated FFN
class GatedLoRA(NamedTuple):
    """Low-rank terms (LoRA adapters) of a gated FFN's projections, in the ops' form, every tensor in x's dtype:
    ``h_g += (x aᵀ) gateᵀ``, ``h_u += (x aᵀ) upᵀ`` (``a`` (R, K) stacks the gate's and the up's A matrices,
    ``gate`` and ``up`` (H, R) their scaled B matrices, zero where the other's rank sits), and
    ``out += (p down_aᵀ) down_bᵀ`` on the down projection's input p (``down_a`` (Rd, H), ``down_b`` (N, Rd) scaled).
    A pair is None where that side has no adapter. The gradients come back in the same order.

    LoRA dropout (PEFT's ``lora_dropout``, on each adapter's input): ``ranks`` the ranks of ``a``'s blocks, one an
    adapter (empty: one block), ``dropout`` the p of each block and then the down adapter's (empty: none), ``seed``
    an int64 tensor of one seed each: block i's term is ``(drop_i(x) a_iᵀ)``, its mask a function of ``seed[i]``
    (the backends' own, as their FFN dropout), regenerated in backward, never stored."""
    a: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    up: torch.Tensor | None = None
    down_a: torch.Tensor | None = None
    down_b: torch.Tensor | None = None
    ranks: tuple = ()
    dropout: tuple = ()
    seed: torch.Tensor | None = None

    def blocks(self):
        """(rows of ``a``, dropout p, seed) of each block of ``a``."""
        ranks = self.ranks or (self.a.shape[0],)
        starts = [sum(ranks[:i]) for i in range(len(ranks))]
        return [(slice(r0, r0 + r), self.p(i), self.seed_of(i)) for i, (r0, r) in enumerate(zip(starts, ranks))]

    def p(self, i):
        """Block i's dropout p (i = -1: the down adapter's)."""
        return self.dropout[i] if self.dropout else 0.0

    def seed_of(self, i):
        return None if self.seed is None else self.seed[i:i + 1] if i >= 0 else self.seed[-1:]


class LoRAAdapters(NamedTuple):
    """The gated ops' LoRA adapters as given: each projection's A ``(r, in)`` and B ``(out, r)`` (None: no adapter
    there), its scaling and its dropout's p, the dropout's seeds (int64 ``(3,)``, gate's, up's and down's; None
    without dropout), and ``shared``: one adapter on a joint gate/up projection (Phi-3's), ``a_up`` then ``a_gate``
    itself and ``b_gate``/``b_up`` its B's row halves. The ops keep these (parameters) and build ``GatedLoRA``'s
    terms from them inside the op, forward and backward: no scaled or stacked copy is kept."""
    a_gate: torch.Tensor | None = None
    b_gate: torch.Tensor | None = None
    a_up: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    a_down: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    scaling: tuple = (1.0, 1.0, 1.0)
    dropout: tuple = (0.0, 0.0, 0.0)
    seed: torch.Tensor | None = None
    shared: bool = False

    def gate_up_blocks(self):
        """(A, B, scaling, dropout p, seed index, which) of the gate's and up's adapters, in ``a``'s block order."""
        if self.shared:
            return [(self.a_gate, None, self.scaling[0], self.dropout[0], 0, "shared")]
        return [(a, b, s, p, i, w) for a, b, s, p, i, w in ((self.a_gate, self.b_gate, self.scaling[0], self.dropout[0],
                                                             0, "gate"),
                                                            (self.a_up, self.b_up, self.scaling[1], self.dropout[1],
                                                             1, "up")) if a is not None]


def lora_terms(ad, dtype):
    """``GatedLoRA`` terms of ``LoRAAdapters`` ``ad`` in ``dtype``: the gate's and up's A stacked (one A where
    shared), their scaled B's padded with zeros at the other's rank, the down's B scaled."""
    blocks = ad.gate_up_blocks()
    a = gate = up = None
    if blocks:
        a = torch.cat([blk[0] for blk in blocks]).to(dtype)
        ranks = [blk[0].shape[0] for blk in blocks]
        if ad.shared:
            gate, up = ad.b_gate.to(dtype) * ad.scaling[0], ad.b_up.to(dtype) * ad.scaling[1]
        else:
            hidden = (ad.b_gate if ad.b_gate is not None else ad.b_up).shape[0]
            gate, up = (a.new_zeros(hidden, sum(ranks)) for _ in range(2))
            r0 = 0
            for (_, b, s, _, _, which), r in zip(blocks, ranks):
                (gate if which == "gate" else up)[:, r0:r0 + r] = b.to(dtype) * s
                r0 += r
    down_a = down_b = None
    if ad.a_down is not None:
        down_a, down_b = ad.a_down.to(dtype), ad.b_down.to(dtype) * ad.scaling[2]
    if not any(ad.dropout) or ad.seed is None:
        return GatedLoRA(a, gate, up, down_a, down_b)
    index = [blk[4] for blk in blocks] + [2]
    return GatedLoRA(a, gate, up, down_a, down_b, tuple(blk[0].shape[0] for blk in blocks),
                     tuple(blk[3] for blk in blocks) + (ad.dropout[2],), ad.seed[index])


def lora_terms_mask(ad, need):
    """The terms' five gradient flags (``GatedLoRA``'s order) from the six adapters' (``LoRAAdapters``' order)."""
    need_ag, need_bg, need_au, need_bu, need_ad, need_bd = need
    return need_ag or need_au, need_bg, need_bu, need_ad, need_bd


def lora_adapter_grads(ad, grads):
    """The six adapters' gradients (each in its own dtype, None where absent or not computed) from the terms'
    (``lora_terms``): a block's rows of d a, a scaled B's columns times its scaling."""
    d_a, d_gate, d_up, d_down_a, d_down_b = grads
    out = dict.fromkeys(("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down"))
    r0 = 0
    for a, b, s, _, _, which in ad.gate_up_blocks():
        rows = slice(r0, r0 + a.shape[0])
        r0 += a.shape[0]
        if which == "shared":
            out["a_gate"] = None if d_a is None else d_a[rows]
            out["b_gate"] = None if d_gate is None else d_gate * ad.scaling[0]
            out["b_up"] = None if d_up is None else d_up * ad.scaling[1]
            continue
        # a copy: two outputs of one op may not alias (the custom op's check), and the gate's and up's rows would
        out[f"a_{which}"] = None if d_a is None else d_a[rows].clone()
        d_b = d_gate if which == "gate" else d_up
        out[f"b_{which}"] = None if d_b is None else d_b[:, rows] * s
    if ad.a_down is not None:
        out["a_down"] = d_down_a
        out["b_down"] = None if d_down_b is None else d_down_b * ad.scaling[2]
    return tuple(None if g is None else g.to(getattr(ad, k).dtype) for k, g in out.items())


def lora_rank_input(x, lora, drop=_dropped):
    """t = drop(x) aᵀ (M, R): the gate's and up's low-rank input, None without one (``drop(t, p, seed)``: the
    backend's dropout). Recomputed in backward with the same GEMMs on the same x and masks, so the pre-activations
    it enters come out as in the forward."""
    if lora is None or lora.a is None:
        return None
    blocks = lora.blocks()
    if all(p == 0 for _, p, _ in blocks):
        return x.mm(lora.a.t())
    return torch.cat([drop(x, p, seed).mm(lora.a[rows].t()) for rows, p, seed in blocks], 1)


def lora_down_output(out, p, lora, drop=_dropped):
    """The down projection's output with its low-rank term on its (dropped) input p added."""
    if lora is None or lora.down_a is None:
        return out
    return out.addmm_(drop(p, lora.p(-1), lora.seed_of(-1)).mm(lora.down_a.t()), lora.down_b.t())


def lora_down_grads(grad_out, p, lora, need_da, need_db, drop=_dropped, u=None):
    """(u, d down_a, d down_b) of the down side: u = grad_out down_b (M, Rd), or the ``u`` given (computed once);
    None without an adapter there (p may be None where neither gradient is wanted). ``lora_down_input_grad`` adds
    u's share to the gradient of p."""
    if lora is None or lora.down_a is None:
        return None, None, None
    u = grad_out.mm(lora.down_b) if u is None else u
    pd = drop(p, lora.p(-1), lora.seed_of(-1)) if need_da or need_db else None
    d_a = u.t().mm(pd) if need_da else None
    d_b = grad_out.t().mm(pd.mm(lora.down_a.t())) if need_db else None
    return u, d_a, d_b


def lora_down_input_grad(grad_p, u, lora, drop=_dropped):
    """grad_p += drop(u down_a), in place: the down adapter's share of the gradient of its input."""
    if lora.p(-1) == 0:
        return grad_p.addmm_(u, lora.down_a)
    return grad_p.add_(drop(u.mm(lora.down_a), lora.p(-1), lora.seed_of(-1)))


def lora_input_grads(x, ghg, ghu, t, lora, need_dx, need_da, need_dgate, need_dup, drop=_dropped):
    """(dx's low-rank share or None, d a, d gate, d up) from the pre-activations' gradients: dt = g_hg gate
    + g_hu up; per block of ``a``, dx += drop(dt_i a_i), d a_i = dt_iᵀ drop(x); d gate = g_hgᵀ t, d up = g_huᵀ t."""
    if t is None:
        return None, None, None, None
    dt = ghg.mm(lora.gate).addmm_(ghu, lora.up) if need_dx or need_da else None
    d_gate, d_up = ghg.t().mm(t) if need_dgate else None, ghu.t().mm(t) if need_dup else None
    blocks = lora.blocks()
    if all(p == 0 for _, p, _ in blocks):
        return dt.mm(lora.a) if need_dx else None, dt.t().mm(x) if need_da else None, d_gate, d_up
    dx = d_a = None
    if need_dx:
        dx = sum(drop(dt[:, rows].mm(lora.a[rows]), p, seed) for rows, p, seed in blocks)
    if need_da:
        d_a = torch.cat([dt[:, rows].t().mm(drop(x, p, seed)) for rows, p, seed in blocks])
    return dx, d_a, d_gate, d_up


def gated_mlp_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, dropout_p=0.0, seed=None,
                      lora=None):
    """out = dropout(act(x Wg^T + bg) * (x Wu^T + bu)) Wd^T + bd (Llama's MLP with act = silu, T5 v1.1's
    with its dropout); x is (M, K). ``lora`` (``GatedLoRA``): low-rank terms on the projections."""
    hg, hu = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
    t = lora_rank_input(x, lora)
    if t is not None:
        hg, hu = hg.addmm(t, lora.gate.t()), hu.addmm(t, lora.up.t())
    a = _dropped(gated_product(hg, hu, activation), dropout_p, seed)
    return lora_down_output(F.linear(a, w_down, b_down), a, lora)


def gated_mlp_backward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, grad_out, activation, dropout_p=0.0, seed=None,
                       output_mask=None, lora=None):
    """Recompute the gate and up projections (not the down one), a dropout mask from ``seed``;
    returns (dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down), None for an absent bias, and with ``lora``
    the gradients of its five terms after them (``output_mask`` then holds 12)."""
    need = wanted(output_mask, 7 if lora is None else 12)
    need_dx, need_dwg, need_dbg, need_dwu, need_dbu, need_dwd, need_dbd = need[:7]
    need_la, need_lg, need_lu, need_lda, need_ldb = need[7:] or (False,) * 5
    need_gh = need_dx or need_dwg or need_dwu or (need_dbg and b_gate is not None) or (need_dbu and b_up is not None) \
        or need_la or need_lg or need_lu
    hg = F.linear(x, w_gate, b_gate)
    hu = F.linear(x, w_up, b_up)
    t = lora_rank_input(x, lora)
    if t is not None:
        hg.addmm_(t, lora.gate.t())
        hu.addmm_(t, lora.up.t())
    factor = dropout_factor(seed, hg.shape, dropout_p, hg) if dropout_p != 0 else None
    operands = gated_operands(hg, hu, activation)
    del hg, hu
    if need_dwd or need_lda or need_ldb:
        a = operands.gate * operands.up
        if factor is not None:
            a.mul_(factor)
        dw_down = grad_out.t().mm(a) if need_dwd else None
        u, d_down_a, d_down_b = lora_down_grads(grad_out, a, lora, need_lda, need_ldb)
        del a
    else:
        dw_down = u = d_down_a = d_down_b = None
    db_down = grad_out.sum(0) if b_down is not None and need_dbd else None
    lora_grads = () if lora is None else (None, None, None, d_down_a, d_down_b)
    if not need_gh:
        return (None, None, None, None, None, dw_down, db_down, *lora_grads)
    grad_a = grad_out.mm(w_down)
    if lora is not None and lora.down_a is not None:
        lora_down_input_grad(grad_a, u if u is not None else grad_out.mm(lora.down_b), lora)
    if factor is not None:
        grad_a.mul_(factor)
        del factor
    grad_hg, grad_hu = gated_product_backward(grad_a, operands)
    del operands, grad_a
    dx = grad_hg.mm(w_gate).add_(grad_hu.mm(w_up)) if need_dx else None
    dx_low, d_a, d_gate, d_up = lora_input_grads(x, grad_hg, grad_hu, t, lora, need_dx, need_la, need_lg, need_lu)
    if dx_low is not None:
        dx.add_(dx_low)
    dw_gate = grad_hg.t().mm(x) if need_dwg else None
    dw_up = grad_hu.t().mm(x) if need_dwu else None
    db_gate = grad_hg.sum(0) if b_gate is not None and need_dbg else None
    db_up = grad_hu.sum(0) if b_up is not None and need_dbu else None
    if lora is not None:
        lora_grads = (d_a, d_gate, d_up, d_down_a, d_down_b)
    return (dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down, *lora_grads)


# --------------------------------------------------------------------------- routed experts (MoE)
# Hugging Face's experts layout (transformers' ``use_experts_implementation``): gate_up (E, 2I, K)
# holds each expert's gate rows then its up rows (or, interleaved, g0, u0, g1, u1, ...: gpt-oss's),
# down (E, N, I), optional per-expert biases (E, 2I) and (E, N); token t's output is
# sum_j w[t, j] * expert_{idx[t, j]}(x[t]). The loop over experts (``moe_forward_with`` /
# ``moe_backward_with``) is shared by both backends; each passes its per-expert computation.
class Expert(NamedTuple):
    """One expert's weights, or their gradients: views of the stacked tensors; None where there is none (an
    ungated expert's gate, a bias the experts lack, a gradient not wanted)."""
    w_gate: torch.Tensor | None
    w_up: torch.Tensor | None
    w_down: torch.Tensor | None
    b_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None


class ExpertsLayout(NamedTuple):
    """How stacked experts hold their projections. ``gated`` False: ``gate_up`` holds the up projections alone
    (and its bias the up biases). ``apart``: ``gate_up`` holds the gate projections alone, the up projections
    are a tensor of their own (DBRX's). ``interleaved``: gate and up rows alternate in ``gate_up`` and its bias
    (gpt-oss's); else the gate rows come first."""
    gated: bool = True
    apart: bool = False
    interleaved: bool = False


def route(top_k_index, num_experts):
    """(order, tokens, counts) of a (T, k) expert choice: the T*k slots sorted by expert (stable),
    each sorted slot's token, and the number of slots of each expert (a list: one host sync). A slot
    whose index is outside ``[0, num_experts)`` (skipped: an expert-parallel sentinel, an identity
    expert handled by the caller) sorts after every expert's and is in no count: its rows are the
    tail past ``sum(counts)``, which the callers fill with zeros."""
    flat = top_k_index.reshape(-1).long()  # int64: num_experts itself may not fit an int8/uint8 index
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1).tolist()[:num_experts]
    return order, torch.div(order, top_k_index.shape[1], rounding_mode="floor"), counts


def gate_and_up(t, layout):
    """The gate and up parts (E, I, ...) of a stacked gate_up tensor (E, 2I, ...) laid out as ``layout`` says
    (views): its alternating rows where interleaved, else its two halves."""
    if layout.interleaved:
        return t[:, 0::2], t[:, 1::2]
    return t[:, :t.shape[1] // 2], t[:, t.shape[1] // 2:]


def expert_weights(e, layout, gate_up, down, up=None, gate_up_bias=None, down_bias=None) -> Expert:
    """Expert ``e``'s ``Expert`` of the stacked weights (or of their stacked gradients) laid out as ``layout``
    says; ``up`` the up projections where ``layout.apart``. Any stacked tensor may be None."""
    def pick(t):
        return None if t is None else t[e]

    def halves(t):
        return (None, None) if t is None else tuple(u[e] for u in gate_and_up(t, layout))

    if not layout.gated:
        return Expert(None, pick(gate_up), pick(down), None, pick(gate_up_bias), pick(down_bias))
    if layout.apart:
        return Expert(pick(gate_up), pick(up), pick(down), None, None, pick(down_bias))
    (w_gate, w_up), (b_gate, b_up) = halves(gate_up), halves(gate_up_bias)
    return Expert(w_gate, w_up, pick(down), b_gate, b_up, pick(down_bias))


def unroute(slots, order, top_k_index):
    """Per-slot rows in sorted order back to (T, k, ...) token order: a gather through the inverse
    permutation (differentiable, also under torch.func: ``functional``'s plain composition uses it)."""
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return slots[inverse].view(*top_k_index.shape, *slots.shape[1:])


def moe_forward_with(expert_forward, x, top_k_index, top_k_weights, gate_up, down, activation, layout, up=None,
                     gate_up_bias=None, down_bias=None):
    if x.device.type == "meta":  # shapes only (bincount has no meta kernel)
        return x.new_empty((x.shape[0], down.shape[1]))
    order, tokens, counts = route(top_k_index, gate_up.shape[0])
    acc = torch.promote_types(x.dtype, torch.float32)
    slots = torch.empty((order.numel(), down.shape[1]), device=x.device, dtype=acc)
    w = top_k_weights.reshape(-1)[order].to(acc)
    xs = x[tokens]  # one gather: each expert's rows are then a slice (a launch per expert fewer)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            y = expert_forward(xs[rows], expert_weights(e, layout, gate_up, down, up, gate_up_bias, down_bias),
                               activation)
            torch.mul(y, w[rows, None], out=slots[rows])
            start += n
    slots[start:].zero_()  # the skipped slots
    return unroute(slots, order, top_k_index).sum(1).to(x.dtype)


def moe_backward_with(expert_backward, x, top_k_index, top_k_weights, gate_up, down, grad_out, activation, layout,
                      output_mask=None, up=None, gate_up_bias=None, down_bias=None):
    """(dx, dtop_k_weights, dgate_up, ddown, dup, dgate_up_bias, ddown_bias), None where the input is None or
    ``output_mask`` (six flags: x, top_k_weights, gate_up and up, down, gate_up_bias, down_bias) masks it off."""
    need_dx, need_dw, need_dgu, need_dd, need_dgub, need_ddb = need = wanted(output_mask, 6)
    inputs = (x, top_k_weights, gate_up, down, up, gate_up_bias, down_bias)
    needs = (need_dx, need_dw, need_dgu, need_dd, need_dgu, need_dgub, need_ddb)
    if x.device.type == "meta":
        return tuple(torch.empty_like(t) if t is not None and n else None for t, n in zip(inputs, needs))
    order, tokens, counts = route(top_k_index, gate_up.shape[0])
    acc = torch.promote_types(x.dtype, torch.float32)
    S = order.numel()
    dx_slots = torch.empty((S, x.shape[1]), device=x.device, dtype=acc) if need_dx else None
    dw_slots = torch.empty(S, device=x.device, dtype=acc) if need_dw else None
    # laid out as the weights (as autograd's accumulation wants a parameter's gradient: a weight stored transposed,
    # gpt-oss's, gets no copy of its gradient there); each expert's weight gradients are GEMMs with out= into them
    dgu, dd, dup, dgub, ddb = (torch.zeros_like(t) if t is not None and n else None
                               for t, n in zip(inputs[2:], needs[2:]))
    w = top_k_weights.reshape(-1)[order].to(acc)  # cast once (the kernels read fp32 scales), exact
    xs, gs = x[tokens], grad_out[tokens]  # one gather each, sliced per expert
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        rows = slice(start, start + n)
        # each expert's gradients go straight into their slices (GEMMs with out=): no copy of a
        # weight-sized gradient per expert; a result that could not be written there is copied
        def dst():
            return (dx_slots[rows] if need_dx else None, dw_slots[rows] if need_dw else None,
                    *expert_weights(e, layout, dgu, dd, dup, dgub, ddb))
        views = dst()
        got = expert_backward(xs[rows], expert_weights(e, layout, gate_up, down, up, gate_up_bias, down_bias),
                              gs[rows], w[rows], activation, need, views)
        # fresh views for the copies: under autograd (a direct, differentiated call) the first copy
        # makes the buffers require grad, and a view taken before that cannot be written then
        for i, (res, where) in enumerate(zip(got, views)):
            if where is not None and res is not where:
                dst()[i].copy_(res)
        start += n
    for t in (dx_slots, dw_slots):  # the skipped slots: no input gradient, a routing weight's gradient of 0
        if t is not None:
            t[start:].zero_()
    dx = unroute(dx_slots, order, top_k_index).sum(1).to(x.dtype) if need_dx else None
    dw = unroute(dw_slots, order, top_k_index).to(top_k_weights.dtype) if need_dw else None
    return dx, dw, dgu, dd, dup, dgub, ddb


def expert_forward(x, w, activation):
    """One expert's output (``w`` an ``Expert``), as torch ops (``functional``'s plain composition runs it with
    autograd)."""
    if w.w_gate is None:
        return fused_mlp_forward(x, w.w_up, w.b_up, w.w_down, w.b_down, activation)
    return gated_mlp_forward(x, w.w_gate, w.b_gate, w.w_up, w.b_up, w.w_down, w.b_down, activation)


def _mm(a, b, out=None):
    """a @ b, written into ``out`` where it has the product's dtype (a view of a stacked gradient);
    a product autograd records (a direct call differentiated through) is returned instead."""
    recorded = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if out is not None and out.dtype == a.dtype == b.dtype and not recorded:
        return torch.mm(a, b, out=out)
    return a.mm(b)


def _expert_backward(x, w, grad_out, scale, activation, need, out=(None,) * 8):
    """One expert's gradients with its output rows scaled by ``scale`` (``w`` an ``Expert``): (dx, dscale,
    dw_gate, dw_up, dw_down, db_gate, db_up, db_down), dscale = a . (grad_out Wd) + grad_out . bd per row (the
    down GEMM is not rerun for it); an ungated expert (``w.w_gate`` None) has a = act(x Wu^T + bu) and no
    dw_gate. ``need``: ``moe_backward_with``'s six flags. ``out``: where to write each result (views into the
    stacked gradients, or None); a result not written there is returned for the caller to copy."""
    need_dx, need_dw, need_dgu, need_dd, need_dgub, need_ddb = need
    hu = F.linear(x, w.w_up, w.b_up)
    if w.w_gate is None:
        a = activation_forward(hu, activation)
    else:
        operands = gated_operands(F.linear(x, w.w_gate, w.b_gate), hu, activation)
        a = operands.gate * operands.up
    grad_y = grad_out.mm(w.w_down)  # unscaled
    acc = torch.promote_types(x.dtype, torch.float32)
    dscale = None
    if need_dw:
        dscale = (a.to(acc) * grad_y.to(acc)).sum(1)
        if w.b_down is not None:
            dscale = dscale + grad_out.to(acc).mv(w.b_down.to(acc))
    grad_a = grad_y * scale[:, None].to(grad_y.dtype)
    scaled = grad_out * scale[:, None].to(grad_out.dtype)
    dw_down = _mm(scaled.t(), a, out[4]) if need_dd else None
    db_down = scaled.sum(0, dtype=acc).to(w.b_down.dtype) if need_ddb and w.b_down is not None else None
    del a, scaled
    if w.w_gate is None:
        grad_hu, grad_hg, dw_gate = activation_backward(grad_a, hu, activation), None, None
    else:
        grad_hg, grad_hu = gated_product_backward(grad_a, operands)
        dw_gate = _mm(grad_hg.t(), x, out[2]) if need_dgu else None
    if need_dx and grad_hg is not None:
        dx = _mm(grad_hg, w.w_gate, out[0]).addmm_(grad_hu, w.w_up)
    elif need_dx:
        dx = _mm(grad_hu, w.w_up, out[0])
    else:
        dx = None
    dw_up = _mm(grad_hu.t(), x, out[3]) if need_dgu else None
    db_gate = grad_hg.sum(0) if need_dgub and w.b_gate is not None else None
    db_up = grad_hu.sum(0) if need_dgub and w.b_up is not None else None
    return dx, dscale, dw_gate, dw_up, dw_down, db_gate, db_up, db_down


def moe_experts_forward(x, top_k_index, top_k_weights, gate_up, down, activation, gated=True, up=None,
                        gate_up_bias=None, down_bias=None, interleaved=False):
    """Routed experts: x (T, K), top_k_index/top_k_weights (T, k), gate_up (E, 2I, K) (ungated: the up
    projections, (E, I, K); with ``up`` (E, I, K): the gate projections, (E, I, K)), down (E, N, I), the
    optional biases gate_up_bias (gate_up's first two dimensions) and down_bias (E, N); ``interleaved``: gate
    and up rows alternate in gate_up. Returns (T, N) in x's dtype (the weighted sum over the k choices in
    fp32)."""
    layout = ExpertsLayout(gated, up is not None, interleaved)
    return moe_forward_with(expert_forward, x, top_k_index, top_k_weights, gate_up, down, activation, layout, up,
                            gate_up_bias, down_bias)


def moe_experts_backward(x, top_k_index, top_k_weights, gate_up, down, grad_out, activation, output_mask=None,
                         gated=True, up=None, gate_up_bias=None, down_bias=None, interleaved=False):
    """``moe_backward_with``'s seven gradients; each expert's gate and up projections recomputed from x, its
    down projection not (the routing weight's gradient is a . (grad Wd) + grad . bd)."""
    layout = ExpertsLayout(gated, up is not None, interleaved)
    return moe_backward_with(_expert_backward, x, top_k_index, top_k_weights, gate_up, down, grad_out, activation,
                             layout, output_mask, up, gate_up_bias, down_bias)


# --------------------------------------------------------------------------- Conv + BN + act
def conv_bn_act_forward(
    x, weight, bias, bn_weight, bn_bias, running_mean, running_var, residual,
    training, eps, stride, padding, dilation, activation, groups=1,
):
    """y = act(bn(conv(x)) [+ residual]); returns (y, mean, rstd) per channel (fp32; fp64 for float64 x).

    With ``training`` the batch statistics normalize (the running buffers are not
    touched here: the caller updates them once, outside the op); otherwise the
    running statistics do.
    """
    z = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    if training:
        pre, mean, rstd = aten.native_batch_norm(z, bn_weight, bn_bias, None, None, True, 0.0, eps)
    else:
        acc = _acc_dtype(x)
        mean = running_mean.to(acc)
        rstd = torch.rsqrt(running_var.to(acc) + eps)
        pre = _bn_eval(z, mean, rstd, bn_weight, bn_bias)
    del z
    if residual is not None:
        pre = pre + residual
    return activation_forward(pre, activation), mean, rstd


def conv_bn_act_backward(
    x, weight, bias, bn_weight, bn_bias, mean, rstd, residual, grad_out,
    training, eps, stride, padding, dilation, activation, output_mask=None, groups=1,
):
    """Recompute the conv, then the BN/act backward and the conv backward.

    Returns (dx, dweight, dbias, dbn_weight, dbn_bias, dresidual); entries are
    None where the corresponding input is None or ``output_mask`` masks them off.
    """
    need = wanted(output_mask, 6)
    z = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    C = z.shape[1]
    if training:
        # same kernel as the forward: the pre-activation, hence the mask, is bit-identical
        pre = aten.native_batch_norm(z, bn_weight, bn_bias, None, None, True, 0.0, eps)[0]
    else:
        pre = _bn_eval(z, mean, rstd, bn_weight, bn_bias)
    if residual is not None:
        pre = pre + residual
    g = activation_backward(grad_out, pre, activation)
    del pre
    dresidual = g.to(grad_out.dtype) if residual is not None and need[5] else None
    if dresidual is grad_out:  # no activation, fp32/fp64: an op may not return its input
        dresidual = dresidual.clone()
    conv_mask = [need[0], need[1], need[2] and bias is not None]
    bn_mask = [any(conv_mask), need[3] and bn_weight is not None, need[4] and bn_bias is not None]
    dz = dgamma = dbeta = None
    if any(bn_mask):
        dz, dgamma, dbeta = _bn_backward(g, z, bn_weight, mean, rstd, training, eps, bn_mask)
    del z, g
    dx, dweight, dbias = aten.convolution_backward(
        dz, x, weight, [C] if bias is not None else None,
        _pair(stride), _pair(padding), _pair(dilation), False, [0, 0], groups, conv_mask,
    ) if any(conv_mask) else (None, None, None)
    # some aten kernels (CPU's) fill a gradient the mask turned off: drop it
    dx, dweight, dbias = (g if m else None for g, m in zip((dx, dweight, dbias), conv_mask))
    dbn_weight = dgamma.to(bn_weight.dtype) if bn_mask[1] else None
    dbn_bias = dbeta.to(bn_bias.dtype) if bn_mask[2] else None
    return dx, dweight, dbias, dbn_weight, dbn_bias, dresidual


@torch.no_grad()
def update_running_stats_(running_mean, running_var, mean, rstd, eps, momentum, n):
    """In place: ``running = lerp(running, batch, momentum)`` with the batch's unbiased variance
    ``(rstd**-2 - eps) * n / (n - 1)`` (``n`` values a channel), as ``nn.BatchNorm2d`` updates its
    buffers. Their version counters stay as they were, as BatchNorm's kernel leaves them: a graph
    that saved a buffer stays valid.

    Not a twin of an op: the functional layer calls it (or the Triton launcher of the same name)
    after a fused conv-BN op, which returns the batch statistics and touches no buffer (traced
    code updates the buffers with a visible mutation instead).
    """
    bufs = [running_mean, running_var]
    versions = [b._version for b in bufs]
    lerp_running_stats_(running_mean, running_var, mean, rstd, eps, momentum, n)
    try:
        torch._C._autograd._unsafe_set_version_counter(bufs, versions)
    except (AttributeError, TypeError, RuntimeError):  # not in this torch: the bump stays
        pass


@torch.no_grad()
def lerp_running_stats_(running_mean, running_var, mean, rstd, eps, momentum, n):
    """The arithmetic of ``update_running_stats_``, the version counters bumped (traced code's
    visible buffer mutation): four small kernels in the statistics' precision (fp32; fp64 for
    float64 input)."""
    inv = rstd.reciprocal()  # sqrt(var + eps), as the Triton update squares it: rstd^2 overflows for tiny eps
    unbiased = inv.mul_(inv).sub_(eps).mul_(n / max(n - 1, 1))
    dtype = running_mean.dtype
    torch._foreach_lerp_([running_mean, running_var], [mean.to(dtype), unbiased.to(dtype)], momentum)


# --------------------------------------------------------------------------- BN + act + Conv (pre-activation)
def _bn_pre_act(x, bn_weight, bn_bias, mean, rstd, training, eps):
    """BatchNorm of ``x`` before the activation, one formula for the forward and the backward's
    recompute (so the activation's mask is the forward's, bit for bit). With ``training`` it also
    returns the batch (mean, rstd); otherwise the given ones (the running statistics)."""
    if training:
        return aten.native_batch_norm(x, bn_weight, bn_bias, None, None, True, 0.0, eps)
    return _bn_eval(x, mean, rstd, bn_weight, bn_bias), mean, rstd


def bn_act_conv_forward(
    x, bn_weight, bn_bias, running_mean, running_var, weight, bias,
    training, eps, stride, padding, dilation, activation, groups=1,
):
    """y = conv2d(act(bn(x))): the pre-activation order of DenseNet and pre-activation ResNets.
    Returns (y, mean, rstd) of ``x``'s channels (fp32; fp64 for float64 x). The activation is
    transient: backward rebuilds it from ``x`` with one elementwise pass, and no conv reruns (the
    conv's backward needs its input, not its output)."""
    if training:
        mean = rstd = None
    else:
        acc = _acc_dtype(x)
        mean, rstd = running_mean.to(acc), torch.rsqrt(running_var.to(acc) + eps)
    pre, mean, rstd = _bn_pre_act(x, bn_weight, bn_bias, mean, rstd, training, eps)
    a = activation_forward(pre, activation).to(weight.dtype)  # autocast: the conv's dtype, BN in x's
    del pre
    return F.conv2d(a, weight, bias, stride, padding, dilation, groups), mean, rstd


def bn_act_conv_backward(
    x, bn_weight, bn_bias, weight, bias, mean, rstd, grad_out,
    training, eps, stride, padding, dilation, activation, output_mask=None, groups=1,
):
    """Rebuild ``act(bn(x))``, then the conv backward and the act/BN backward.

    Returns (dx, dbn_weight, dbn_bias, dweight, dbias); None where the input is None or
    ``output_mask`` masks it off."""
    need = wanted(output_mask, 5)
    pre = _bn_pre_act(x, bn_weight, bn_bias, mean, rstd, training, eps)[0]
    a = activation_forward(pre, activation).to(weight.dtype)
    bn_mask = [need[0], need[1] and bn_weight is not None, need[2] and bn_bias is not None]
    conv_mask = [any(bn_mask), need[3], need[4] and bias is not None]
    da, dweight, dbias = aten.convolution_backward(
        grad_out, a, weight, [weight.shape[0]] if bias is not None else None,
        _pair(stride), _pair(padding), _pair(dilation), False, [0, 0], groups, conv_mask,
    ) if any(conv_mask) else (None, None, None)
    del a
    dweight, dbias = (g if m else None for g, m in zip((dweight, dbias), conv_mask[1:]))
    dx = dgamma = dbeta = None
    if any(bn_mask):
        g = activation_backward(da.to(x.dtype), pre, activation)  # through the cast to the conv's dtype
        del da, pre
        dx, dgamma, dbeta = _bn_backward(g, x, bn_weight, mean, rstd, training, eps, bn_mask)
    dx, dgamma, dbeta = (t if m else None for t, m in zip((dx, dgamma, dbeta), bn_mask))
    dbn_weight = dgamma.to(bn_weight.dtype) if dgamma is not None else None
    dbn_bias = dbeta.to(bn_bias.dtype) if dbeta is not None else None
    return dx, dbn_weight, dbn_bias, dweight, dbias


def _bn_backward(g, z, bn_weight, mean, rstd, training, eps, bn_mask):
    """(dz, dgamma, dbeta) of a BatchNorm over ``z`` (4-D) from the gradient ``g`` of its output; dz in
    z's dtype, the others in the accumulation type; None where ``bn_mask`` turns them off."""
    acc = _acc_dtype(z)  # fp32, or fp64 for float64 inputs (BN's own accumulation type)
    gamma = bn_weight.to(acc) if bn_weight is not None else None
    if training:
        # aten's fused BN backward (what autograd runs for the unfused module): one read of g and z
        # instead of about eight elementwise passes. Its mixed-dtype rule: parameters and statistics in acc.
        return aten.native_batch_norm_backward(
            g.to(z.dtype), z, gamma, None, None, mean.to(acc), rstd.to(acc), True, eps, bn_mask)
    shape, dims = (1, -1, 1, 1), (0, 2, 3)
    g = g.to(acc)
    dbeta = g.sum(dims) if bn_mask[2] else None
    dgamma = (g * ((z.to(acc) - mean.to(acc).view(shape)) * rstd.to(acc).view(shape))).sum(dims) \
        if bn_mask[1] else None
    scale = rstd.to(acc) if gamma is None else gamma * rstd.to(acc)
    return (g * scale.view(shape)).to(z.dtype) if bn_mask[0] else None, dgamma, dbeta


def _bn_eval(z, mean, rstd, bn_weight, bn_bias):
    """Eval-mode BatchNorm from the saved (mean, rstd), one formula for the forward and the backward's
    recompute: the pre-activation, hence the ReLU mask, is bit-identical (rebuilding the variance
    from rstd for F.batch_norm would not be)."""
    acc = mean.dtype
    shape = (1, -1, 1, 1)
    scale = rstd if bn_weight is None else rstd * bn_weight.to(acc)
    pre = (z.to(acc) - mean.view(shape)) * scale.view(shape)
    if bn_bias is not None:
        pre = pre + bn_bias.to(acc).view(shape)
    return pre.to(z.dtype)


def _acc_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


def _pair(v):
    return list(v) if isinstance(v, (tuple, list)) else [v, v]
