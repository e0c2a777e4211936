"""Apertus's FFN: out = xielu(x W1^T + b1) W2^T + b2, xIELU's two learned alphas trained through it.

xielu(h) = alpha_p h^2 + beta h for h > 0, alpha_n (expm1(min(h, eps)) - h) + beta h otherwise (arXiv
2411.13010; alpha_p, alpha_n the effective values, positive; beta and eps fixed). Its eager form keeps about
seven hidden-sized tensors a layer for autograd (h, h^2's factors, min, expm1, the branches); this op keeps x.

The dense FFN's kernels with ACTIVATION="xielu" (``_common``: ``_xielu_fwd``, ``_xielu_grad``), the alphas read
from a 2-element tensor in the epilogues (they change every step: no constexpr, no host sync):
Forward (2 GEMMs): GEMM 1 with bias + xIELU epilogue writes a (h never stored), the output GEMM.
Backward (5 GEMMs, the output GEMM never rerun): g_a = grad_out W2; one kernel recomputes h tile by tile (the
forward's tiles: the same h bit for bit) and emits g_h, a (for dW2), db1's column partials and per tile the
partial sums of g_a h^2 over h > 0 and of g_a (expm1(min(h, eps)) - h) over the rest (the alphas' gradients,
summed here in a fixed order: no atomics); then dW2, dX, dW1.
"""

from __future__ import annotations

import torch
import triton  # noqa: F401  (this module is only imported by the triton backend)

from ._common import gemm_act, gemm_act_grad, plain_gemm, wanted

__all__ = ["xielu_mlp_forward", "xielu_mlp_backward"]


def _xielu(alpha_p, alpha_n, beta, eps):
    """The kernels' ``xielu=`` argument: the effective alphas as one (2,) fp32 tensor (a device-side cat: no sync,
    capturable), beta and eps as floats."""
    # each upcast before the cat: autocast's cat rejects two 16-bit inputs of a dtype other than its own
    return torch.cat([alpha_p.reshape(1).float(), alpha_n.reshape(1).float()]), float(beta), float(eps)


def xielu_mlp_forward(x, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps):
    """out = xielu(x W1^T + b1) W2^T + b2; x (M, K)."""
    assert x.dim() == 2, "xielu_mlp_forward expects a 2-D x"
    a = gemm_act(x, w1.t(), b1, "xielu", xielu=_xielu(alpha_p, alpha_n, beta, eps))
    return plain_gemm(a, w2.t(), bias=b2)


def xielu_mlp_backward(x, w1, b1, w2, b2, alpha_p, alpha_n, beta, eps, grad_out, output_mask=None):
    """Returns (dx, dw1, db1, dw2, db2, dalpha_p, dalpha_n); None for an absent bias or a gradient ``output_mask``
    masks off. When nothing but dW2 (and db2) is wanted, the forward's kernel rebuilds a and g_a is never formed."""
    assert x.dim() == 2, "xielu_mlp_backward expects a 2-D x"
    need_dx, need_dw1, need_db1, need_dw2, need_db2, need_dap, need_dan = wanted(output_mask, 7)
    need_db1 = need_db1 and b1 is not None
    xielu = _xielu(alpha_p, alpha_n, beta, eps)
    db2 = grad_out.sum(0, dtype=torch.float32).to(b2.dtype) if b2 is not None and need_db2 else None
    if not (need_dx or need_dw1 or need_db1 or need_dap or need_dan):
        a = gemm_act(x, w1.t(), b1, "xielu", xielu=xielu) if need_dw2 else None
        dw2 = plain_gemm(grad_out.t(), a, out_dtype=w2.dtype) if need_dw2 else None
        return None, None, None, dw2, db2, None, None
    grad_a = plain_gemm(grad_out, w2, out_dtype=x.dtype)
    gh, a, db1, dalphas = gemm_act_grad(x, w1.t(), b1, grad_a, "xielu", store_act=need_dw2, xielu=xielu)
    del grad_a
    dw2 = plain_gemm(grad_out.t(), a, out_dtype=w2.dtype) if need_dw2 else None
    del a
    dx = plain_gemm(gh, w1, out_dtype=x.dtype) if need_dx else None
    dw1 = plain_gemm(gh.t(), x, out_dtype=w1.dtype) if need_dw1 else None
    # two separate tensors: outputs of an op may not alias one another
    dap = dalphas[0].clone().reshape(alpha_p.shape).to(alpha_p.dtype) if need_dap else None
    dan = dalphas[1].clone().reshape(alpha_n.shape).to(alpha_n.dtype) if need_dan else None
    return dx, dw1, db1 if need_db1 else None, dw2, db2, dap, dan
