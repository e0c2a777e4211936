"""Transformer FFN: out = act(x W1^T + b1) W2^T + b2, with the recompute fused into backward.

Forward (2 GEMMs): GEMM 1 with bias + activation epilogue writes a = act(h)
(h never stored); GEMM 2 with bias epilogue writes out. Only x needs saving.

Dropout between the layers (``dropout_p > 0``): out = (act(h) * mask / (1 - p)) W2^T + b2,
the mask a counter-based function of a seed and each element's index, drawn in GEMM 1's
epilogue and regenerated in the recompute kernel's: never stored (only the 8-byte seed is).

Backward (5 GEMMs, the output GEMM is never rerun):
  g_a = grad_out W2                                    (GEMM)
  one kernel recomputes h = x W1^T + b1 tile by tile   (GEMM, same tiles as forward)
    and emits g_h = act'(h) * g_a, a = act(h), and partial column sums of g_h (db1)
    (with dropout: g_h = act'(h) * mask * g_a / (1 - p) and a = act(h) * mask / (1 - p))
  dW2 = grad_out^T a                                   (GEMM)
  dX  = g_h W1                                         (GEMM)
  dW1 = g_h^T x                                        (GEMM)
  db2 = grad_out summed over rows (fp32 accumulation).
"""
from __future__ import annotations

import torch
import triton  # noqa: F401  (this module is only imported by the triton backend)

from ._common import check_activation, gemm_act, gemm_act_grad, plain_gemm, wanted

__all__ = ["fused_mlp_forward", "fused_mlp_backward"]


def fused_mlp_forward(x, w1, b1, w2, b2, activation, dropout_p=0.0, seed=None):
    """out = dropout(act(x W1^T + b1)) W2^T + b2; x (M, K), w1 (H, K), w2 (N, H); ``seed`` a
    1-element int64 tensor when ``dropout_p > 0``."""
    assert x.dim() == 2, "fused_mlp_forward expects a 2-D x"
    check_activation(activation)
    # the pre-activation the backward recomputes: Triton, table tiles
    a = gemm_act(x, w1.t(), b1, activation, dropout=(dropout_p, seed))
    return plain_gemm(a, w2.t(), bias=b2)     # the output is never rerun: cuBLAS on CUDA


def fused_mlp_backward(x, w1, b1, w2, b2, grad_out, activation, dropout_p=0.0, seed=None, output_mask=None):
    """Returns (dx, dw1, db1, dw2, db2); db1/db2 are None when b1/b2 are None. A gradient
    ``output_mask`` masks off is None and the work only it needs is skipped: a frozen W2 drops
    dW2 and the store of a; when nothing left of the output layer needs g_h, the forward's
    kernel (same tiles, bit-identical a) rebuilds a and g_a is never formed."""
    assert x.dim() == 2, "fused_mlp_backward expects a 2-D x"
    check_activation(activation)
    need_dx, need_dw1, need_db1, need_dw2, need_db2 = wanted(output_mask, 5)
    db2 = grad_out.sum(0, dtype=torch.float32).to(b2.dtype) if b2 is not None and need_db2 else None
    if not (need_dx or need_dw1 or (need_db1 and b1 is not None)):
        a = gemm_act(x, w1.t(), b1, activation, dropout=(dropout_p, seed)) if need_dw2 else None
        dw2 = plain_gemm(grad_out.t(), a, out_dtype=w2.dtype) if need_dw2 else None
        return None, None, None, dw2, db2
    grad_a = plain_gemm(grad_out, w2, out_dtype=x.dtype)              # (M, N) @ (N, H)
    gh, a, db1 = gemm_act_grad(x, w1.t(), b1, grad_a, activation, store_act=need_dw2, dropout=(dropout_p, seed))
    del grad_a
    dw2 = plain_gemm(grad_out.t(), a, out_dtype=w2.dtype) if need_dw2 else None  # (N, M) @ (M, H)
    del a
    dx = plain_gemm(gh, w1, out_dtype=x.dtype) if need_dx else None             # (M, H) @ (H, K)
    dw1 = plain_gemm(gh.t(), x, out_dtype=w1.dtype) if need_dw1 else None       # (H, M) @ (M, K)
    return dx, dw1, db1 if need_db1 else None, dw2, db2
