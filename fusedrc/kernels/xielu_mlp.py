"""Apertus's FFN: out = xielu(x W1^T + b1) W2^T + b2, xIELU's two learned alphas trained through it.

xielu(h) = alpha_p h^2 + beta h for h > 0, alpha_n (expm1(min(h, eps)) - h) + beta h otherwise (arXiv
2411.13010; alpha_p, alpha_n the effective values, positive; beta and eps fixed). Its eager form keeps about
seven hidden-sized tensors a layer for autograd (h, h^2's factors, min, expm1, the branches); this op keeps x.

Forward (2 GEMMs): h = x W1^T + b1 (cuBLAS on CUDA), ``_xielu_kernel`` writes a = xielu(h), the output GEMM.
Backward (5 GEMMs, the output GEMM never rerun): h again (the forward's GEMM: the same bits), g_a = grad_out W2,
``_xielu_grad_kernel`` rebuilds xielu(h) in registers and emits g_h, a (for dW2) and per program the partial
sums of g_a h^2 over h > 0 and g_a (expm1(min(h, eps)) - h) over the rest (the alphas' gradients, summed here in
a fixed order: no atomics), then dW2, dX, dW1. The activation is an elementwise pass over h, not a GEMM epilogue
(h goes through memory once each way): what it saves is autograd's intermediates and their passes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _device_guard, cdiv, launcher, plain_gemm, wanted

__all__ = ["xielu_mlp_forward", "xielu_mlp_backward", "xielu_act", "xielu_act_grad"]


@triton.jit
def _xielu_parts(h, BETA: tl.constexpr, EPS: tl.constexpr):
    """(h > 0, the alpha_p factor h^2, the alpha_n factor expm1(min(h, eps)) - h) in fp32. With m = min(h, eps),
    expm1(m) - h = (expm1(m) - m) - (h - m): the first term by its series where |m| < 1 (exp(m) - 1 - m cancels
    to nothing near 0, which is where h lies mostly), the second exact."""
    pos = h > 0.0
    m = tl.minimum(h, EPS)
    series = 0.5 * m * m * (1.0 + m / 3.0 * (1.0 + m / 4.0 * (1.0 + m / 5.0 * (1.0 + m / 6.0 * (
        1.0 + m / 7.0 * (1.0 + m / 8.0 * (1.0 + m / 9.0 * (1.0 + m / 10.0))))))))
    em1_m = tl.where(m > -1.0, series, tl.exp(m) - 1.0 - m)
    return pos, h * h, em1_m - (h - m)


@triton.jit
def _xielu_kernel(h_ptr, a_ptr, alpha_ptr, N, BETA: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    h = tl.load(h_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    ap = tl.load(alpha_ptr)
    an = tl.load(alpha_ptr + 1)
    pos, p, n = _xielu_parts(h, BETA, EPS)
    tl.store(a_ptr + offs, (tl.where(pos, ap * p, an * n) + BETA * h).to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _xielu_grad_kernel(h_ptr, g_ptr, gh_ptr, a_ptr, alpha_ptr, part_ptr, N, BETA: tl.constexpr, EPS: tl.constexpr,
                       STORE_ACT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    h = tl.load(h_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    ap = tl.load(alpha_ptr)
    an = tl.load(alpha_ptr + 1)
    pos, p, n = _xielu_parts(h, BETA, EPS)
    if STORE_ACT:
        tl.store(a_ptr + offs, (tl.where(pos, ap * p, an * n) + BETA * h).to(a_ptr.dtype.element_ty), mask=ok)
    # d expm1(min(h, eps)) / dh: exp(h) below eps, half of it at the tie (torch.minimum's), 0 above
    dmin = tl.where(h < EPS, 1.0, tl.where(h == EPS, 0.5, 0.0)) * tl.exp(tl.minimum(h, EPS))
    gh = g * (tl.where(pos, 2.0 * ap * h, an * (dmin - 1.0)) + BETA)
    tl.store(gh_ptr + offs, gh.to(gh_ptr.dtype.element_ty), mask=ok)
    # (past N: g = 0, nothing added)
    tl.store(part_ptr + 2 * pid, tl.sum(tl.where(pos, g * p, 0.0), axis=0))
    tl.store(part_ptr + 2 * pid + 1, tl.sum(tl.where(pos, 0.0, g * n), axis=0))


# --------------------------------------------------------------------------- launchers
# Elementwise blocks: 1024 elements on 4 warps (8 a thread); the interpreter's 64 give the test shapes several.
_GPU_BLOCK, _INTERPRETER_BLOCK = 1024, 64


def _block(t):
    return _GPU_BLOCK if t.is_cuda else _INTERPRETER_BLOCK


def _alphas(alpha_p, alpha_n):
    return torch.cat([alpha_p.reshape(1), alpha_n.reshape(1)]).float()


def xielu_act(h, alpha_p, alpha_n, beta, eps):
    """xielu(h) for a contiguous h, in h's dtype (computed in fp32, rounded once)."""
    a = torch.empty_like(h)
    if h.numel():
        block = _block(h)
        with _device_guard(h):
            launcher(_xielu_kernel, h)[(cdiv(h.numel(), block),)](
                h, a, _alphas(alpha_p, alpha_n), h.numel(), BETA=float(beta), EPS=float(eps), BLOCK=block, num_warps=4)
    return a


def xielu_act_grad(h, grad_a, alpha_p, alpha_n, beta, eps, store_act=False):
    """(g_h, a or None, dalpha_p, dalpha_n): xielu(h) rebuilt in registers; the alphas' gradients in their dtypes."""
    gh = torch.empty_like(h)
    act = torch.empty_like(h) if store_act else None
    block = _block(h)
    programs = cdiv(h.numel(), block)
    # each program writes its row; zeros only where nothing runs (no elements)
    part = torch.empty((programs, 2), device=h.device, dtype=torch.float32) if programs else \
        torch.zeros((1, 2), device=h.device, dtype=torch.float32)
    if h.numel():
        with _device_guard(h):
            launcher(_xielu_grad_kernel, h)[(programs,)](
                h, grad_a.contiguous(), gh, act if act is not None else h, _alphas(alpha_p, alpha_n), part, h.numel(),
                BETA=float(beta), EPS=float(eps), STORE_ACT=store_act, BLOCK=block, num_warps=4)
    # two separate sums: outputs of an op may not alias one another
    return gh, act, part[:, 0].sum().reshape(alpha_p.shape).to(alpha_p.dtype), \
        part[:, 1].sum().reshape(alpha_n.shape).to(alpha_n.dtype)


def xielu_mlp_forward(x, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps):
    """out = xielu(x W1^T + b1) W2^T + b2; x (M, K)."""
    assert x.dim() == 2, "xielu_mlp_forward expects a 2-D x"
    a = xielu_act(plain_gemm(x, w1.t(), bias=b1), alpha_p, alpha_n, beta, eps)
    return plain_gemm(a, w2.t(), bias=b2)


def xielu_mlp_backward(x, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps, grad_out, output_mask=None):
    """Returns (dx, dw1, db1, dw2, db2, dalpha_p, dalpha_n); None for an absent bias or a gradient ``output_mask``
    masks off."""
    assert x.dim() == 2, "xielu_mlp_backward expects a 2-D x"
    need_dx, need_dw1, need_db1, need_dw2, need_db2, need_dap, need_dan = wanted(output_mask, 7)
    need_db1 = need_db1 and b1 is not None
    db2 = grad_out.sum(0, dtype=torch.float32).to(b2.dtype) if b2 is not None and need_db2 else None
    h = plain_gemm(x, w1.t(), bias=b1)  # the forward's GEMM: the same h, bit for bit
    if not (need_dx or need_dw1 or need_db1 or need_dap or need_dan):
        a = xielu_act(h, alpha_p, alpha_n, beta, eps) if need_dw2 else None
        del h
        dw2 = plain_gemm(grad_out.t(), a, out_dtype=w2.dtype) if need_dw2 else None
        return None, None, None, dw2, db2, None, None
    grad_a = plain_gemm(grad_out, w2, out_dtype=x.dtype)
    gh, a, dap, dan = xielu_act_grad(h, grad_a, alpha_p, alpha_n, beta, eps, store_act=need_dw2)
    del h, grad_a
    dw2 = plain_gemm(grad_out.t(), a, out_dtype=w2.dtype) if need_dw2 else None
    del a
    dx = plain_gemm(gh, w1, out_dtype=x.dtype) if need_dx else None
    dw1 = plain_gemm(gh.t(), x, out_dtype=w1.dtype) if need_dw1 else None
    db1 = gh.sum(0, dtype=torch.float32).to(b1.dtype) if need_db1 else None
    return dx, dw1, db1, dw2, db2, dap if need_dap else None, dan if need_dan else None


# --------------------------------------------------------------------------- ahead-of-time inspection
def inspect_specs():
    """Both kernels for sm_90 and sm_80, each dtype, Apertus's constants, the grad kernel storing the activation
    too (``python -m fusedrc.inspect --kernel xielu``)."""
    from ._common import _INSPECT_ARCH, _TRITON_PTR

    specs = []
    for arch, dtype in ((a, d) for a in _INSPECT_ARCH.values() for d in (torch.float16, torch.bfloat16, torch.float32)):
        p, f32 = _TRITON_PTR[dtype], "*fp32"
        consts = {"BETA": 0.5, "EPS": -1e-6, "BLOCK": _GPU_BLOCK}
        for fn, sig, flags in (
                (_xielu_kernel, {"h_ptr": p, "a_ptr": p, "alpha_ptr": f32, "N": "i64"}, {}),
                (_xielu_grad_kernel, {"h_ptr": p, "g_ptr": p, "gh_ptr": p, "a_ptr": p, "alpha_ptr": f32,
                                      "part_ptr": f32, "N": "i64"}, {"STORE_ACT": True})):
            specs.append({"fn": fn, "kernel": fn.__name__, "arch": arch, "dtype": dtype,
                          "config": {"BLOCK": _GPU_BLOCK, "num_warps": 4, "num_stages": 1},
                          "signature": sig, "constexprs": {**consts, **flags}, "num_warps": 4, "num_stages": 1,
                          "gemm": False, "aligned": [n for n in sig if n.endswith("_ptr")], "source": f"{arch}/block"})
    return specs
