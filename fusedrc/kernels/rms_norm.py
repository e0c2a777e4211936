"""RMSNorm before an FFN op (Llama's, Gemma's, ``nn.RMSNorm``): a row kernel forward and backward.

The FFN ops that take a norm of their input (``fusedrc.ops``: ``norm=``) keep x, the norm's input,
and rebuild the norm's output in backward. On the reference path that is RMSNorm as its module
computes it, in aten ops: an fp32 copy of x, its square, the mean, the product with rstd and with
the weight, the cast back; and as many passes again for its backward. Here each direction is one
pass over the rows (x read once, the output or dx written once), with the module's casts and
products (``fusedrc.reference.norm_with_stats`` / ``norm_backward`` are the oracle; rstd is computed
with correctly rounded square root and division, not bit for bit torch's rsqrt):

- ``"rms"`` (``nn.RMSNorm`` / ``F.rms_norm``): ``(xf * rstd * w).to(x.dtype)``, in fp32;
- ``"llama_rms"`` (Hugging Face's Llama): ``w * (xf * rstd).to(x.dtype)``, the product in the
  promoted dtype of w and x;
- ``"gemma_rms"``: ``(xf * rstd * (1 + w)).to(x.dtype)``, in fp32.

``rstd = 1 / sqrt(mean(xf**2) + eps)`` per row, fp32. The forward and the backward's rebuild run the
same kernel, so the FFN's recomputed input equals the forward's bit for bit. The weight gradient is
a column sum: per-program fp32 partials over a fixed slice of rows, then one sum over the programs
in a fixed order (no atomics: bitwise repeatable). LayerNorm, float64, rows longer than
``MAX_COLS``, empty inputs and weights that are not a vector of x's features run the reference
(LayerNorm already has aten's fused kernels).
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ._common import _INSPECT_ARCH, _TRITON_PTR, _device_guard, _reference, cdiv, device_sms, launcher, wanted

__all__ = ["norm_forward", "norm_with_stats", "norm_backward", "MAX_COLS"]

# A row is one block of registers (8192 fp32 elements over 8 warps: 32 per thread per tensor; the
# inspect specs compile it without spills, 16384 on 16 warps spilled); longer rows take the reference
MAX_COLS = 8192
_KINDS = {"rms": 0, "llama_rms": 1, "gemma_rms": 2}


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, K, stride_xm, stride_ym, eps,
    KIND: tl.constexpr, HAS_W: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One row: rstd, then the normalized row times the weight as KIND's module rounds it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    # the sum back to fp32: inductor hands a float argument in as fp64, which sqrt_rn refuses
    rstd = tl.div_rn(1.0, tl.sqrt_rn((tl.sum(xf * xf, axis=0) / K + eps).to(tl.float32)))
    u = xf * rstd
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if KIND == 0:
            u = u * w
        elif KIND == 1:
            # the module's cast to x's dtype, then the product in the promoted dtype (y's)
            u = u.to(x.dtype).to(tl.float32) * w
        else:
            u = u * (1.0 + w)
    tl.store(y_ptr + row * stride_ym + cols, u.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, pdw_ptr, M, K, rows_per_program,
    stride_gm, stride_xm, stride_dxm,
    KIND: tl.constexpr, HAS_W: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
    ROUND_DU: tl.constexpr, ROUND_DW: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dx of each row of a fixed slice of rows, and the slice's fp32 partial column sums for dw.
    llama_rms (y = w * v, v = u in x's dtype; g in y's dtype): ROUND_DU, x in 16 bits, v's gradient
    g * w is rounded to x's dtype (autograd casts it to v's); ROUND_DW, g and x of x's 16-bit dtype,
    each product g * v is rounded to it."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_K,), dtype=tl.float32)
    row0 = pid.to(tl.int64) * rows_per_program
    for i in range(0, tl.minimum(rows_per_program, M - row0)):
        row = row0 + i
        g = tl.load(g_ptr + row * stride_gm + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0)
        rstd = tl.load(rstd_ptr + row)
        u = x.to(tl.float32) * rstd
        if KIND == 1:
            # y = w * v with v = u in x's dtype: dw = sum(g * v) (each product in x's dtype), and
            # dv = g * w (in the promoted dtype), whose fp32 copy is u's gradient
            v = u.to(x.dtype).to(tl.float32)
            if NEED_DW:
                if ROUND_DW:
                    dw += (g * v).to(x.dtype).to(tl.float32)
                else:
                    dw += g * v
            if HAS_W:
                du = g * w
                if ROUND_DU:
                    du = du.to(x.dtype).to(tl.float32)
            else:
                du = g
        else:
            if NEED_DW:
                dw += g * u
            if HAS_W:
                du = g * w if KIND == 0 else g * (1.0 + w)
            else:
                du = g
        if NEED_DX:
            c = tl.sum(du * u, axis=0) / K
            dx = rstd * (du - u * c)
            tl.store(dx_ptr + row * stride_dxm + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if NEED_DW:
        tl.store(pdw_ptr + pid * K + cols, dw, mask=mask)


def _supported(x, norm, weight) -> bool:
    return (norm in _KINDS and x.dim() == 2 and x.dtype in _TRITON_PTR and 0 < x.shape[1] <= MAX_COLS
            and x.shape[0] > 0 and (weight is None or (tuple(weight.shape) == (x.shape[1],)
                                                        and weight.dtype in _TRITON_PTR)))


def _vector(weight):
    return None if weight is None else weight.contiguous()


def _rows(t):
    """t with unit column stride (the kernels read rows through their row stride)."""
    return t if t.stride(1) == 1 else t.contiguous()


def _out_dtype(x, norm, weight):
    if norm == "llama_rms" and weight is not None:
        return torch.promote_types(weight.dtype, x.dtype)
    return x.dtype


def norm_with_stats(x, norm, weight, bias, eps):
    """``(norm output, rstd (M, 1) fp32)`` of the RMS kinds by the row kernel; the reference for the
    others (same contract as ``fusedrc.reference.norm_with_stats``)."""
    if not _supported(x, norm, weight):
        return _reference().norm_with_stats(x, norm, weight, bias, eps)
    x, weight = _rows(x), _vector(weight)
    M, K = x.shape
    y = torch.empty((M, K), device=x.device, dtype=_out_dtype(x, norm, weight))
    rstd = torch.empty((M, 1), device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(K)
    with _device_guard(x):
        launcher(_rms_norm_fwd_kernel, x)[(M,)](
            x, weight if weight is not None else x, y, rstd, K, x.stride(0), y.stride(0), float(eps),
            KIND=_KINDS[norm], HAS_W=weight is not None, BLOCK_K=block, num_warps=_warps(block),
        )
    return y, rstd


def norm_forward(x, norm, weight, bias, eps):
    return norm_with_stats(x, norm, weight, bias, eps)[0]


def norm_backward(grad, x, norm, weight, bias, eps, output_mask=None, stats=None):
    """``(dx, dweight, None)`` of the RMS kinds by the row kernel (``stats``: the forward's rstd,
    computed here when not given); the reference for the others."""
    if not _supported(x, norm, weight) or grad.dtype not in _TRITON_PTR:
        return _reference().norm_backward(grad, x, norm, weight, bias, eps, output_mask, stats)
    need_dx, need_dw, _ = wanted(output_mask, 3)
    need_dw = need_dw and weight is not None
    if not (need_dx or need_dw):
        return None, None, None
    x, grad, weight = _rows(x), _rows(grad), _vector(weight)
    M, K = x.shape
    rstd = norm_with_stats(x, norm, weight, bias, eps)[1] if stats is None else stats
    rstd = rstd.reshape(M).contiguous()
    programs = min(M, 2 * device_sms(x))
    per = cdiv(M, programs)
    programs = cdiv(M, per)
    dx = torch.empty_like(x) if need_dx else x
    pdw = torch.empty((programs, K), device=x.device, dtype=torch.float32) if need_dw else rstd
    block = triton.next_power_of_2(K)
    sixteen = x.dtype != torch.float32
    round_du = norm == "llama_rms" and weight is not None and sixteen
    dw_dtype = torch.promote_types(grad.dtype, x.dtype)  # llama_rms: g * v's
    round_dw = norm == "llama_rms" and sixteen and dw_dtype == x.dtype
    with _device_guard(x):
        launcher(_rms_norm_bwd_kernel, x)[(programs,)](
            grad, x, weight if weight is not None else x, rstd, dx, pdw, M, K, per,
            grad.stride(0), x.stride(0), dx.stride(0),
            KIND=_KINDS[norm], HAS_W=weight is not None, NEED_DX=need_dx, NEED_DW=need_dw,
            ROUND_DU=round_du, ROUND_DW=round_dw, BLOCK_K=block, num_warps=_warps(block),
        )
    dw = None
    if need_dw:
        dw = pdw.sum(0)
        # llama_rms: the module sums products in their dtype (aten accumulates them in fp32)
        dw = dw.to(dw_dtype if norm == "llama_rms" else weight.dtype)
    return (dx if need_dx else None), dw, None


# --------------------------------------------------------------------------- fusedrc.inspect
def inspect_specs():
    """Both kernels for every (arch, dtype) at Llama-7B's row (4096 columns) and at the longest row
    (MAX_COLS), llama_rms with a weight of x's dtype (the backward's most work: both outputs, the
    rounded product)."""
    specs = []
    for arch, dtype, block in itertools.product(_INSPECT_ARCH.values(), (torch.float16, torch.bfloat16, torch.float32),
                                                (4096, MAX_COLS)):
        p, f32 = _TRITON_PTR[dtype], "*fp32"
        fwd_sig = {"x_ptr": p, "w_ptr": p, "y_ptr": p, "rstd_ptr": f32, "K": "i32", "stride_xm": "i32",
                   "stride_ym": "i32", "eps": "fp32"}
        bwd_sig = {"g_ptr": p, "x_ptr": p, "w_ptr": p, "rstd_ptr": f32, "dx_ptr": p, "pdw_ptr": f32,
                   "M": "i32", "K": "i32", "rows_per_program": "i32", "stride_gm": "i32", "stride_xm": "i32",
                   "stride_dxm": "i32"}
        common = {"KIND": 1, "HAS_W": True, "BLOCK_K": block}
        for fn, sig, extra in ((_rms_norm_fwd_kernel, fwd_sig, {}),
                               (_rms_norm_bwd_kernel, bwd_sig, {"NEED_DX": True, "NEED_DW": True,
                                                                "ROUND_DU": dtype != torch.float32,
                                                                "ROUND_DW": dtype != torch.float32})):
            specs.append({"fn": fn, "kernel": fn.__name__, "arch": arch, "dtype": dtype,
                          "config": {"BLOCK_K": block, "num_warps": _warps(block), "num_stages": 1,
                                     "kind": "llama_rms"},
                          "signature": sig, "constexprs": {**common, **extra}, "num_warps": _warps(block),
                          "num_stages": 1, "gemm": False,
                          "aligned": [n for n in sig if n.endswith("_ptr")] + ["K"],
                          "source": f"{arch}/row"})
    return specs
