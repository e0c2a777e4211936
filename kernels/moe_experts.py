"""Routed gated experts (a Mixture-of-Experts layer's experts, Hugging Face's layout).

Pure-torch reference: ``fusedrc.reference.moe_experts_forward`` / ``moe_experts_backward``; the
loop over experts (slots sorted by expert, weighted sum over the k choices in fp32, no atomics)
is the reference's ``moe_forward_with`` / ``moe_backward_with``, shared: only each expert's
computation differs.

Kept for backward: x, the routing (index, weights) and the weights, what checkpointing the
experts call keeps. Per expert with rows r (its tokens) and routing weights s:

Forward (3 GEMMs): ``_gated_act_kernel`` (gate and up in one main loop, a = act(h_g) * h_u
  written once), then the down GEMM; y * s summed into the output.
Backward (8 GEMMs; the down GEMM is not rerun, not even for ds):
  G = g_out[r] Wd                                       (GEMM, unscaled)
  ``_gated_act_grad_kernel`` with ROW_SCALE recomputes h_g, h_u bit for bit and emits
    g_hg, g_hu for g_a = s * G, a, and per column tile the partial row dots a . G, whose
    sum is ds (d(s * a Wd^T) / ds = a . (g_out Wd)).
  dWd = (s * g_out[r])^T a, dX[r] = g_hg Wg + g_hu Wu, dWg = g_hg^T x[r], dWu = g_hu^T x[r]
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


def _expert_forward(x, w_gate, w_up, w_down, activation):
    if w_gate is None:  # ungated: the dense FFN's kernel, act(x Wu^T) never stored
        return fused_mlp_forward(x, w_up, None, w_down, None, activation)
    return gated_mlp_forward(x, w_gate, None, w_up, None, w_down, None, activation)


def _ungated_expert_backward(x, w_up, w_down, grad_out, scale, activation, need, out):
    """The dense grad kernel has no row-scale epilogue: the scale is applied to g_a before it and
    d scale = a . (g Wd) taken from the a it stores (two passes over the (rows, I) buffers more)."""
    need_dx, need_dw, need_dgu, need_dd = need
    grad_y = plain_gemm(grad_out, w_down, out_dtype=torch.float32)     # unscaled, fp32 for the row dots
    gh, a, _ = gemm_act_grad(x, w_up.t(), None, (grad_y * scale[:, None].float()).to(x.dtype), activation,
                             store_act=True)
    dscale = (a.float() * grad_y).sum(1) if need_dw else None
    del grad_y
    dw_down = plain_gemm((grad_out * scale[:, None].to(grad_out.dtype)).t(), a, out_dtype=w_down.dtype,
                         out=out[3]) if need_dd else None
    del a
    dx = plain_gemm(gh, w_up, out_dtype=torch.float32, out=out[0]) if need_dx else None
    dw_up = plain_gemm(gh.t(), x, out_dtype=w_up.dtype, out=out[2]) if need_dgu else None
    return dx, None, dw_up, dw_down, dscale


def _expert_backward(x, w_gate, w_up, w_down, grad_out, scale, activation, need, out=(None,) * 5):
    """One expert's gradients (the reference's ``_expert_backward`` contract): the weights' gradients
    written into ``out``'s views of the stacked gradients where given (no per-expert copy)."""
    if w_gate is None:
        return _ungated_expert_backward(x, w_up, w_down, grad_out, scale, activation, need, out)
    need_dx, need_dw, need_dgu, need_dd = need
    grad_y = plain_gemm(grad_out, w_down, out_dtype=x.dtype)           # unscaled: the kernel scales it
    ghg, ghu, a, _, _, dscale = gated_act_grad(x, w_gate, w_up, None, None, grad_y, activation,
                                               store_act=need_dd, row_scale=scale.float())
    del grad_y
    dw_down = plain_gemm((grad_out * scale[:, None].to(grad_out.dtype)).t(), a, out_dtype=w_down.dtype,
                         out=out[3]) if need_dd else None
    del a
    return (*input_grads(x, w_gate, w_up, ghg, ghu, need_dx, need_dgu, need_dgu, out[1:3]), dw_down, dscale)


def moe_experts_forward(x, top_k_index, top_k_weights, gate_up, down, activation, gated=True, up=None):
    """Same contract as ``fusedrc.reference.moe_experts_forward``."""
    split_gated(activation)
    return _reference().moe_forward_with(_expert_forward, x, top_k_index, top_k_weights, gate_up, down, activation,
                                         gated, up)


def moe_experts_backward(x, top_k_index, top_k_weights, gate_up, down, grad_out, activation, output_mask=None,
                         gated=True, up=None):
    """Same contract as ``fusedrc.reference.moe_experts_backward``."""
    split_gated(activation)
    return _reference().moe_backward_with(_expert_backward, x, top_k_index, top_k_weights, gate_up, down, grad_out,
                                          activation, output_mask, gated, up)
