"""Functional forms of the fused patterns.

Each keeps only its input (and the parameters; conv+BN also the per-channel
batch statistics) for backward and recomputes the rest inside the backward op.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from ._backend import resolve_backend
from ._validate import check_same, check_tensor, check_vector, pair
from .reference import check_activation

__all__ = ["linear_act", "fused_mlp", "conv_bn_act"]


def _autocast(*tensors):
    """Cast floating tensors as ``F.linear``/``F.conv2d`` do under autocast (None passes through)."""
    x = tensors[0]
    if not isinstance(x, Tensor) or not torch.is_autocast_enabled(x.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(x.device.type)
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in tensors)


def _check_linear(x, weight, bias, name_w="weight", name_b="bias", name_x="input", in_features=None):
    check_tensor(weight, name_w, ndim=2)
    k = x.shape[-1] if in_features is None else in_features
    if weight.shape[1] != k:
        raise ValueError(
            f"{name_w} must have shape (out_features, {k}) to match {name_x}'s last dimension {k}, "
            f"got {tuple(weight.shape)}"
        )
    check_same(x, name_x, weight, name_w)
    check_vector(bias, name_b, weight.shape[0], x, name_x)


def linear_act(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str = "relu") -> Tensor:
    """``act(x @ weight.T + bias)``, recomputing the pre-activation in backward.

    ``x`` is ``(*, in_features)``; ``weight`` ``(out_features, in_features)`` as in
    ``nn.Linear``; ``activation`` one of ``relu``, ``relu2``, ``gelu``, ``gelu_tanh``, ``silu``.
    Only ``x`` and the parameters are kept for backward.
    """
    check_tensor(x, "input", min_ndim=1)
    x, weight, bias = _autocast(x, weight, bias)
    _check_linear(x, weight, bias)
    check_activation(activation)
    backend = resolve_backend(x, "linear_act", "linear_act_forward")
    lead = x.shape[:-1]
    y = ops.linear_act_op(x.reshape(-1, x.shape[-1]), weight, bias, activation, backend)
    return y.view(*lead, weight.shape[0])


def fused_mlp(
    x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, activation: str = "relu"
) -> Tensor:
    """The transformer FFN ``act(x W1ᵀ + b1) W2ᵀ + b2``, keeping only ``x`` for backward.

    Backward runs 5 GEMMs (the output GEMM is not rerun) and never stores the
    hidden activation: 7 GEMMs a step, like ``torch.utils.checkpoint``.
    """
    check_tensor(x, "input", min_ndim=1)
    x, w1, b1, w2, b2 = _autocast(x, w1, b1, w2, b2)
    _check_linear(x, w1, b1, "w1", "b1")
    check_tensor(w2, "w2", ndim=2)
    _check_linear(x, w2, b2, "w2", "b2", in_features=w1.shape[0])
    check_activation(activation)
    backend = resolve_backend(x, "fused_mlp", "fused_mlp_forward")
    lead = x.shape[:-1]
    y = ops.fused_mlp_op(x.reshape(-1, x.shape[-1]), w1, b1, w2, b2, activation, backend)
    return y.view(*lead, w2.shape[0])


def conv_bn_act(
    x: Tensor, weight: Tensor, bn_weight: Tensor | None, bn_bias: Tensor | None,
    running_mean: Tensor | None, running_var: Tensor | None, *, training: bool = True,
    momentum: float = 0.1, eps: float = 1e-5, stride=1, padding=0, dilation=1,
    bias: Tensor | None = None, residual: Tensor | None = None, activation: str = "relu",
) -> Tensor:
    """``act(batch_norm(conv2d(x, weight)) [+ residual])`` with ``F.batch_norm``'s conventions.

    ``bn_weight``/``bn_bias`` may be None (no affine); ``running_mean``/``running_var``
    may be None (no tracking: batch statistics are used, also in eval). When
    ``training``, the running statistics are updated in place once with the
    averaging factor ``momentum`` (unbiased variance). Kept for backward: ``x``,
    the parameters, the per-channel mean and rstd, and ``residual`` if given.
    """
    check_tensor(x, "input", ndim=4)
    check_tensor(weight, "weight", ndim=4)
    # autocast casts the conv's operands; BatchNorm keeps its (fp32) parameters, as in eager
    x, weight, bias, residual = _autocast(x, weight, bias, residual)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight must have shape (out_channels, {x.shape[1]}, kh, kw) to match input's {x.shape[1]} "
            f"channels (groups=1), got {tuple(weight.shape)}"
        )
    check_same(x, "input", weight, "weight")
    c = weight.shape[0]
    check_vector(bias, "bias", c, x)
    mixed = x.dtype in (torch.float16, torch.bfloat16)  # fp32 BN parameters with a half input are fine
    check_vector(bn_weight, "bn_weight", c, x, dtype=not mixed)
    check_vector(bn_bias, "bn_bias", c, x, dtype=not mixed)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must both be tensors or both be None")
    check_vector(running_mean, "running_mean", c, x, dtype=False)
    check_vector(running_var, "running_var", c, x, dtype=False)
    check_activation(activation)
    stride, padding, dilation = pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")
    use_batch_stats = training or running_mean is None
    if residual is not None:
        check_tensor(residual, "residual", ndim=4)
        check_same(x, "input", residual, "residual")
        expected = ops._conv_out_shape(x, weight, stride, padding, dilation)
        if tuple(residual.shape) != expected:
            raise ValueError(f"residual must have the conv output's shape {expected}, got {tuple(residual.shape)}")
    if use_batch_stats:
        oh, ow = ops._conv_out_shape(x, weight, stride, padding, dilation)[2:]
        if x.shape[0] * oh * ow == 1:  # F.batch_norm's own check, same message
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size "
                f"{torch.Size((x.shape[0], c, oh, ow))}"
            )
    backend = resolve_backend(x, "conv_bn_act", "conv_bn_act_forward")
    y, mean, rstd = ops.conv_bn_act_op(
        x, weight, bias, bn_weight, bn_bias, running_mean, running_var, residual,
        use_batch_stats, float(eps), stride, padding, dilation, activation, backend,
    )
    if training and running_mean is not None:
        _update_running_stats(running_mean, running_var, mean, rstd, eps, momentum, y.numel() // c)
    return y


@torch.no_grad()
def _update_running_stats(running_mean, running_var, mean, rstd, eps, momentum, n):
    var = rstd.double().pow(-2) - eps
    unbiased = var * (n / max(n - 1, 1))
    running_mean.copy_(momentum * mean.double() + (1 - momentum) * running_mean.double())
    running_var.copy_(momentum * unbiased + (1 - momentum) * running_var.double())
