"""Linear + activation: y = act(x W^T + b), with the recompute fused into backward.

Forward: one GEMM whose epilogue adds the bias and applies the activation; the
pre-activation h never reaches global memory.

Backward: one kernel recomputes h tile by tile (same tile configuration and K
order as the forward, so h is bit-identical), multiplies grad_out by act'(h) in
its epilogue and stores g_h, plus per-row-tile partial column sums of g_h for
the bias gradient (reduced by a tiny sum over cdiv(M, BLOCK_M) rows). Then
dX = g_h W and dW = g_h^T x are plain GEMMs (``_common.plain_gemm``: cuBLAS on
CUDA, measured faster; the Triton kernel under the interpreter). GEMM count: 1 + 3.
"""
from __future__ import annotations

import triton  # noqa: F401  (this module is only imported by the triton backend)

from ._common import check_activation, gemm_act, gemm_act_grad, plain_gemm, wanted

__all__ = ["linear_act_forward", "linear_act_backward", "linear_act_grad_h"]


def linear_act_forward(x, weight, bias, activation):
    """y = act(x @ weight.T + bias); x (M, K), weight (N, K), bias (N,) or None; y (M, N) in x.dtype."""
    assert x.dim() == 2, "linear_act_forward expects a 2-D x"
    check_activation(activation)
    return gemm_act(x, weight.t(), bias, activation)


def linear_act_grad_h(x, weight, bias, grad_out, activation):
    """(g_h, dbias): the fused recompute + activation-backward kernel alone."""
    assert x.dim() == 2, "linear_act_grad_h expects a 2-D x"
    check_activation(activation)
    gh, _, dbias = gemm_act_grad(x, weight.t(), bias, grad_out, activation)
    return gh, dbias


def linear_act_backward(x, weight, bias, grad_out, activation, output_mask=None):
    """(dx, dweight, dbias); dbias is None when bias is None. h is recomputed in-kernel.
    A gradient ``output_mask`` masks off is None and its GEMM is skipped."""
    need_dx, need_dw, need_db = wanted(output_mask, 3)
    gh, dbias = linear_act_grad_h(x, weight, bias, grad_out, activation)
    dx = plain_gemm(gh, weight, out_dtype=x.dtype) if need_dx else None          # (M, N) @ (N, K)
    dweight = plain_gemm(gh.t(), x, out_dtype=weight.dtype) if need_dw else None  # (N, M) @ (M, K)
    return dx, dweight, dbias if need_db else None
