"""Routed gated experts (a Mixture-of-Experts layer's experts, Hugging Face's layout).

Pure-torch reference: ``fusedrc.reference.moe_experts_forward`` / ``moe_experts_backward``; the
loop over experts (slots sorted by expert, weighted sum over the k choices in fp32, no atomics)
is the reference's ``moe_forward_with`` / ``moe_backward_with``, shared: only each expert's
computation differs.

Kept for backward: x, the routing (index, weights) and the weights, what checkpointing the
experts call keeps. Per expert with rows r (its tokens) and routing weights s:

Forward (3 GEMMs): ``_gated_act_kernel`` (gate and up in one main loop, a = act(h_g) * h_u
  written once), then the down GEMM; y * s summed into the output.
Backward (8 GEMMs; the down GEMM is not rerun, not even for ds; ungated experts: 5 GEMMs, the dense grad
kernel with the same row-scale epilogue):
  G = g_out[r] Wd                                       (GEMM, unscaled)
  ``_gated_act_grad_kernel`` with ROW_SCALE recomputes h_g, h_u bit for bit and emits
    g_hg, g_hu for g_a = s * G, a, and per column tile the partial row dots a . G, whose
    sum is ds (d(s * a Wd^T) / ds = a . (g_out Wd)).
  dWd = (s * g_out[r])^T a = g_out[r]^T (s a) (the kernel stores s a), dX[r] = g_hg Wg + g_hu Wu, dWg = g_hg^T x[r],
  dWu = g_hu^T x[r]
  (gate and up rows of one stacked tensor, halves or interleaved: g_hg and g_hu come in one buffer in the
  weights' row order, and dX[r] = [g_hg g_hu] W_gate_up and dW_gate_up are one GEMM each: 5 GEMM launches, not 7)
Stacked weight gradients are laid out as the weights (a transposed one gets no copy in autograd's accumulation).
With biases (gpt-oss's): bg, bu enter both kernels' pre-activations (their gradients the grad kernel's
column partial sums), bd the down GEMM's epilogue; ds gains g_out[r] . bd and dbd = sum_r s g_out[r].
Interleaved gate/up rows (gpt-oss's): the dual kernels read them in place as one operand (INTERLEAVED).
torch.utils.checkpoint on the experts call runs 12 GEMMs (its recompute must rerun the down
GEMM: the weights' gradient reads the expert outputs) and writes every expert's h_g, h_u,
act(h_g) and a at once.
"""
from __future__ import annotations

import torch

from ._common import _reference, gemm_act_grad, plain_gemm
from fusedrc.reference import split_gated
from .fused_mlp import fused_mlp_forward
from .gated_mlp import gated_act_grad, gated_mlp_forward, input_grads

__all__ = ["moe_experts_forward", "moe_experts_backward"]


def _expert_forward(x, w, activation):
    if w.w_gate is None:  # ungated: the dense FFN's kernel, act(x Wu^T + bu) never stored
        return fused_mlp_forward(x, w.w_up, w.b_up, w.w_down, w.b_down, activation)
    return gated_mlp_forward(x, w.w_gate, w.b_gate, w.w_up, w.b_up, w.w_down, w.b_down, activation)


def _down_bias_grads(grad_out, scale, b_down, need_dw, need_ddb):
    """The down bias's share of d scale (grad_out . bd per row) and its gradient (sum of the scaled rows), fp32:
    one pass over the expert's grad_out rows each, none without a down bias."""
    if b_down is None or not (need_dw or need_ddb):
        return None, None
    g32 = grad_out.float()
    return (g32.mv(b_down.float()) if need_dw else None,
            g32.t().mv(scale.float()).to(b_down.dtype) if need_ddb else None)


def _down_weight_grad(grad_out, scaled_a, w_down, out):
    """dWd = (s g_out)^T a = g_out^T (s a) (the grad kernels store the product's rows scaled: no scaled copy of
    g_out, no elementwise launch), written into ``out`` (a view of the stacked gradient) where it can be."""
    return plain_gemm(grad_out.t(), scaled_a, out_dtype=w_down.dtype, out=out)


def _ungated_expert_backward(x, w, grad_out, scale, activation, need, out):
    """The dense grad kernel with its row-scale epilogue (ROW_SCALE): g_h of the scaled gradient, act(h) for
    dWd where needed, and d scale = act(h) . (g_out Wd) from the recomputed h (the gated experts' scheme)."""
    need_dx, need_dw, need_dgu, need_dd, need_dgub, need_ddb = need
    grad_y = plain_gemm(grad_out, w.w_down, out_dtype=x.dtype)           # unscaled: the kernel scales it
    gh, a, db_up, dscale = gemm_act_grad(x, w.w_up.t(), w.b_up, grad_y, activation, store_act=need_dd,
                                         row_scale=scale.float())
    del grad_y
    dw_down = _down_weight_grad(grad_out, a, w.w_down, out[4]) if need_dd else None
    del a
    dx = plain_gemm(gh, w.w_up, out_dtype=torch.float32, out=out[0]) if need_dx else None
    dw_up = plain_gemm(gh.t(), x, out_dtype=w.w_up.dtype, out=out[3]) if need_dgu else None
    return dx, dscale if need_dw else None, None, dw_up, dw_down, None, db_up


def _expert_backward(x, w, grad_out, scale, activation, need, out=(None,) * 8):
    """One expert's gradients (the reference's ``_expert_backward`` contract): the weights' gradients
    written into ``out``'s views of the stacked gradients where given (no per-expert copy)."""
    need_dx, need_dw, need_dgu, need_dd, need_dgub, need_ddb = need
    if w.w_gate is None:
        dx, dscale, dw_gate, dw_up, dw_down, db_gate, db_up = _ungated_expert_backward(
            x, w, grad_out, scale, activation, need, out)
    else:
        grad_y = plain_gemm(grad_out, w.w_down, out_dtype=x.dtype)       # unscaled: the kernel scales it
        ghg, ghu, a, db_gate, db_up, dscale = gated_act_grad(x, w.w_gate, w.w_up, w.b_gate, w.b_up, grad_y,
                                                             activation, store_act=need_dd, row_scale=scale.float())
        del grad_y
        dw_down = _down_weight_grad(grad_out, a, w.w_down, out[4]) if need_dd else None
        del a
        dx, dw_gate, dw_up = input_grads(x, w.w_gate, w.w_up, ghg, ghu, need_dx, need_dgu, need_dgu, out[2:4],
                                         dx_out=out[0])
    bias_dscale, db_down = _down_bias_grads(grad_out, scale, w.b_down, need_dw, need_ddb)
    if need_dw and bias_dscale is not None:
        dscale = dscale + bias_dscale
    return (dx, dscale if need_dw else None, dw_gate, dw_up, dw_down, *((db_gate, db_up) if need_dgub else (None,) * 2),
            db_down)


def moe_experts_forward(x, top_k_index, top_k_weights, gate_up, down, activation, gated=True, up=None,
                        gate_up_bias=None, down_bias=None, interleaved=False):
    """Same contract as ``fusedrc.reference.moe_experts_forward``."""
    split_gated(activation)
    R = _reference()
    return R.moe_forward_with(_expert_forward, x, top_k_index, top_k_weights, gate_up, down, activation,
                              R.ExpertsLayout(gated, up is not None, interleaved), up, gate_up_bias, down_bias)


def moe_experts_backward(x, top_k_index, top_k_weights, gate_up, down, grad_out, activation, output_mask=None,
                         gated=True, up=None, gate_up_bias=None, down_bias=None, interleaved=False):
    """Same contract as ``fusedrc.reference.moe_experts_backward``."""
    split_gated(activation)
    R = _reference()
    return R.moe_backward_with(_expert_backward, x, top_k_index, top_k_weights, gate_up, down, grad_out, activation,
                               R.ExpertsLayout(gated, up is not None, interleaved), output_mask, up, gate_up_bias,
                               down_bias)
