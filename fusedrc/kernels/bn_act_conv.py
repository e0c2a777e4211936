"""Triton kernels of the pre-activation ``conv2d(act(bn(x)))`` (DenseNet, pre-activation ResNets).

The pure-torch twin is ``fusedrc.reference.bn_act_conv_forward/backward``. Kept for backward:
``x`` and its per-channel (mean, rstd). The activation ``a = act(bn(x))`` (what eager autograd
keeps besides ``x``) is never stored:

- forward: in training, the statistics of ``x`` (Chan partials per pixel tile,
  ``_channel_stats_kernel``, combined by conv_bn_act's finalize kernel); then the implicit-GEMM
  conv whose main loop makes ``a`` from each ``x`` tile it loads (``_conv_mainloop``'s PRE_ACT
  prologue), so ``a`` never reaches global memory;
- backward: ``dA = conv_transpose(g, W)`` and ``dW = g (x) a``. With conv_bn_act's
  ``CONV_GRAD = "aten"`` (its default: cuDNN's wgrad measured far faster than the Triton dW on an
  H100) ``a`` is rebuilt once into a transient buffer (``_bn_act_apply_kernel``) for
  ``aten.convolution_backward``; with ``"triton"``, ``conv_dx`` and ``conv_dw`` with the PRE_ACT
  prologue, no buffer. Then the act and BN backward: per-tile partials of ``sum(dpre)`` and
  ``sum(dpre * xhat)`` (``_bn_act_grad_reduce_kernel``; ``dpre = act'(pre) * dA``) and ``dx``
  (``_bn_act_grad_dx_kernel``). No convolution reruns: the conv's backward needs its input, not
  its output.

Every kernel makes ``pre = fma(x - mean, scale, shift)`` (``scale = rstd * gamma``) with the same
helper, so the backward's activation mask is the forward's, bit for bit.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import conv_bn_act as _cba
from ._common import LaunchPlans, _act_grad, _device_guard, _reference, _upcast_flag, act_meta, cdiv, \
    device_capability, dot_precision, launch, launcher, plan_key, wanted
from .conv_bn_act import (_INSPECT_ARCH, _INSPECT_GEOM, _INSPECT_PTR, _TABLE, _bn_act, _channel_vectors,
                          _conv_mainloop, _finalize_stats, _geom_constexprs, _inspect_args, _memory_format, _out_hw,
                          _pair, _pix_offsets, _supported, _tf32_key, _tile_ids, conv_dw, conv_dx, flat_k,
                          layer_config)

__all__ = ["bn_act_conv_forward", "bn_act_conv_backward"]

# the elementwise and reduction passes over x: (pixels, channels) tiles
_ELEM_BLOCK_M, _ELEM_BLOCK_C, _ELEM_WARPS = 64, 32, 4


# --------------------------------------------------------------------------- kernels
@triton.jit
def _tile(pid_m, pid_c, M, C, H, W, s_n, s_c, s_h, s_w, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """A (pixels, channels) tile of a 4-D tensor: offsets, the mask, the channels and their mask."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_m, mask_c = offs_m < M, offs_c < C
    offs = _pix_offsets(offs_m, H, W, s_n, s_h, s_w)[:, None] + (offs_c * s_c)[None, :]
    return offs, mask_m[:, None] & mask_c[None, :], offs_c, mask_c


@triton.jit
def _channel_stats_kernel(
    x_ptr, pmean_ptr, pm2_ptr, M, C, H, W, s_n, s_c, s_h, s_w,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per pixel tile and channel: the tile's mean and sum of squared deviations from it (Chan
    partials, combined in a fixed order by ``_bn_stats_finalize_kernel``)."""
    pid_m = tl.program_id(0)
    offs, mask, offs_c, mask_c = _tile(pid_m, tl.program_id(1), M, C, H, W, s_n, s_c, s_h, s_w, BLOCK_M, BLOCK_C)
    xf = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    cnt = tl.minimum(M - pid_m * BLOCK_M, BLOCK_M).to(tl.float32)
    t_mean = tl.sum(xf, axis=0) / cnt
    dev = tl.where(mask, xf - t_mean[None, :], 0.0)
    p_offs = pid_m.to(tl.int64) * C + offs_c
    tl.store(pmean_ptr + p_offs, t_mean, mask=mask_c)
    tl.store(pm2_ptr + p_offs, tl.sum(dev * dev, axis=0), mask=mask_c)


@triton.jit
def _bn_act_apply_kernel(
    x_ptr, a_ptr, mean_ptr, scale_ptr, shift_ptr, M, C, H, W, s_n, s_c, s_h, s_w, s_an, s_ac, s_ah, s_aw,
    ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """a = act(bn(x)) in x's dtype: the conv input aten's conv backward needs for dW."""
    pid_m, pid_c = tl.program_id(0), tl.program_id(1)
    offs, mask, offs_c, mask_c = _tile(pid_m, pid_c, M, C, H, W, s_n, s_c, s_h, s_w, BLOCK_M, BLOCK_C)
    a_offs = _tile(pid_m, pid_c, M, C, H, W, s_an, s_ac, s_ah, s_aw, BLOCK_M, BLOCK_C)[0]
    mean, scale, shift = _channel_vectors(mean_ptr, scale_ptr, shift_ptr, offs_c, mask_c)
    xf = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(a_ptr + a_offs, _bn_act(xf, mean, scale, shift, ACTIVATION, NEG_SLOPE).to(a_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _dpre(x_ptr, da_ptr, offs, d_offs, mask, mean, scale, shift, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr):
    """(dpre, x - mean) in fp32: dpre = act'(pre) * dA, rounded to x's dtype as eager's activation
    backward hands it to BatchNorm's."""
    xc = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) - mean
    da = tl.load(da_ptr + d_offs, mask=mask, other=0.0).to(tl.float32)
    pre = tl.fma(xc, scale, shift)  # as _bn_act makes it
    dpre = _act_grad(pre, da, ACTIVATION, NEG_SLOPE).to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(mask, dpre, 0.0), xc


@triton.jit
def _bn_act_grad_reduce_kernel(
    x_ptr, da_ptr, mean_ptr, scale_ptr, shift_ptr, rstd_ptr, pg_ptr, pgx_ptr,
    M, C, H, W, s_n, s_c, s_h, s_w, s_dn, s_dc, s_dh, s_dw,
    ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per pixel tile and channel: sum(dpre) and sum(dpre * xhat) (summed over tiles in a fixed
    order afterwards: dbeta and dgamma)."""
    pid_m, pid_c = tl.program_id(0), tl.program_id(1)
    offs, mask, offs_c, mask_c = _tile(pid_m, pid_c, M, C, H, W, s_n, s_c, s_h, s_w, BLOCK_M, BLOCK_C)
    d_offs = _tile(pid_m, pid_c, M, C, H, W, s_dn, s_dc, s_dh, s_dw, BLOCK_M, BLOCK_C)[0]
    mean, scale, shift = _channel_vectors(mean_ptr, scale_ptr, shift_ptr, offs_c, mask_c)
    dpre, xc = _dpre(x_ptr, da_ptr, offs, d_offs, mask, mean, scale, shift, ACTIVATION, NEG_SLOPE)
    rstd = tl.load(rstd_ptr + offs_c, mask=mask_c, other=0.0)[None, :]
    p_offs = pid_m.to(tl.int64) * C + offs_c
    tl.store(pg_ptr + p_offs, tl.sum(dpre, axis=0), mask=mask_c)
    tl.store(pgx_ptr + p_offs, tl.sum(dpre * (xc * rstd), axis=0), mask=mask_c)


@triton.jit
def _bn_act_grad_dx_kernel(
    x_ptr, da_ptr, dx_ptr, mean_ptr, scale_ptr, shift_ptr, rstd_ptr, sg_ptr, sgx_ptr, inv_count,
    M, C, H, W, s_n, s_c, s_h, s_w, s_dn, s_dc, s_dh, s_dw, s_xn, s_xc, s_xh, s_xw,
    TRAINING: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """dx = rstd * gamma * (dpre - mean(dpre) - xhat * mean(dpre * xhat)) (batch statistics), or
    rstd * gamma * dpre (running statistics)."""
    pid_m, pid_c = tl.program_id(0), tl.program_id(1)
    offs, mask, offs_c, mask_c = _tile(pid_m, pid_c, M, C, H, W, s_n, s_c, s_h, s_w, BLOCK_M, BLOCK_C)
    d_offs = _tile(pid_m, pid_c, M, C, H, W, s_dn, s_dc, s_dh, s_dw, BLOCK_M, BLOCK_C)[0]
    x_offs = _tile(pid_m, pid_c, M, C, H, W, s_xn, s_xc, s_xh, s_xw, BLOCK_M, BLOCK_C)[0]
    mean, scale, shift = _channel_vectors(mean_ptr, scale_ptr, shift_ptr, offs_c, mask_c)
    dpre, xc = _dpre(x_ptr, da_ptr, offs, d_offs, mask, mean, scale, shift, ACTIVATION, NEG_SLOPE)
    if TRAINING:
        rstd = tl.load(rstd_ptr + offs_c, mask=mask_c, other=0.0)[None, :]
        sg = tl.load(sg_ptr + offs_c, mask=mask_c, other=0.0)[None, :]
        sgx = tl.load(sgx_ptr + offs_c, mask=mask_c, other=0.0)[None, :]
        dpre = dpre - sg * inv_count - (xc * rstd) * (sgx * inv_count)
    tl.store(dx_ptr + x_offs, (scale * dpre).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bn_act_conv_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, mean_ptr, scale_ptr, shift_ptr,
    M, C_OUT, C_IN, H, W, OH, OW,
    s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo, s_yn, s_yc, s_yh, s_yw,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    FLAT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """y = conv2d(act(bn(x))) (+ conv bias) as an implicit GEMM; act(bn(x)) made in the main loop."""
    pid_m, pid_n = _tile_ids(M, C_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    row0, col0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc = _conv_mainloop(x_ptr, w_ptr, row0, col0, M, C_OUT, C_IN, H, W, OH, OW,
                         s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo,
                         KH, KW, SH, SW, PH, PW, DH, DW, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST, FLAT_K,
                         mean_ptr, scale_ptr, shift_ptr, True, ACTIVATION, NEG_SLOPE)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < C_OUT
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_offs = _pix_offsets(offs_m, OH, OW, s_yn, s_yh, s_yw)[:, None] + (offs_n * s_yc)[None, :]
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & mask_n[None, :])


# --------------------------------------------------------------------------- launchers
def _pre_supported(x, weight, activation, stride, padding, dilation, groups) -> bool:
    # groups=1: the prologue sits in the implicit-GEMM main loop (grouped convs run the reference)
    return groups == 1 and _supported(x, weight, activation, stride, padding, dilation, groups)


def _bn_vectors(bn_weight, bn_bias, mean, rstd):
    """(mean, rstd, scale = rstd * gamma, shift = beta), fp32 and contiguous: forward and backward build
    them from the same (mean, rstd) by the same ops, so every kernel sees the same bits."""
    mean, rstd = mean.float().contiguous(), rstd.float().contiguous()
    scale = rstd if bn_weight is None else (rstd * bn_weight.float()).contiguous()
    shift = torch.zeros_like(mean) if bn_bias is None else bn_bias.float().contiguous()
    return mean, rstd, scale, shift


def _elem_grid(M, C):
    return (cdiv(M, _ELEM_BLOCK_M), cdiv(C, _ELEM_BLOCK_C))


def _elem_meta(activation=None):
    meta = dict(BLOCK_M=_ELEM_BLOCK_M, BLOCK_C=_ELEM_BLOCK_C, num_warps=_ELEM_WARPS)
    return meta if activation is None else {**meta, **act_meta(activation)}


# Per-layer launch plans (fusedrc/kernels/_common.py, LaunchPlans): the support check and the conv launch's
# tile, grid and constexprs, worked out once per layer shape. This module's settings and
# conv_bn_act's (its tile table, CONV_GRAD) both feed them.
_PLANS = LaunchPlans().watch(__name__).watch(_cba.__name__)


class _FwdPlan(NamedTuple):
    y_shape: tuple
    fmt: torch.memory_format
    M: int
    grid: tuple
    constexprs: dict
    sites: dict  # its launch sites' bound binaries (_common.launch)


def _fwd_plan(x, weight, bias, stride, padding, dilation, activation, groups):
    if not _pre_supported(x, weight, activation, stride, padding, dilation, groups):
        return None
    N, C, H, W = x.shape
    C_out, _, KH, KW = weight.shape
    OH, OW = _out_hw(H, W, KH, KW, stride, padding, dilation)
    precision, cap = dot_precision(x), device_capability(x)
    cfg = layer_config(weight, 1, x.dtype, precision, cap)
    M = N * OH * OW
    meta = dict(_geom_constexprs(KH, KW, stride, padding, dilation), FLAT_K=flat_k(weight, 1),
                HAS_BIAS=bias is not None, **act_meta(activation),
                BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                PRECISION=precision, UPCAST=_upcast_flag(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _FwdPlan((N, C_out, OH, OW), _memory_format(x), M, (cdiv(M, cfg.BLOCK_M) * cdiv(C_out, cfg.BLOCK_N),),
                    meta, {})


def bn_act_conv_forward(
    x, bn_weight, bn_bias, running_mean, running_var, weight, bias,
    training, eps, stride, padding, dilation, activation, groups=1,
):
    """y = conv2d(act(bn(x))) -> (y, mean, rstd) of x's channels (fp32). Same contract as
    ``fusedrc.reference.bn_act_conv_forward``; the running buffers are read (eval), never written."""
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    key = plan_key("fwd", x, weight, bias is None, *stride, *padding, *dilation, activation, groups, _tf32_key(x))
    plan = _PLANS.plan(key, lambda: _fwd_plan(x, weight, bias, stride, padding, dilation, activation, groups))
    if plan is None:
        return _reference().bn_act_conv_forward(
            x, bn_weight, bn_bias, running_mean, running_var, weight, bias,
            training, eps, stride, padding, dilation, activation, groups)
    N, C, H, W = x.shape
    C_out = plan.y_shape[1]
    y = torch.empty(plan.y_shape, device=x.device, dtype=x.dtype, memory_format=plan.fmt)
    with _device_guard(x):
        if training:
            P = N * H * W
            pmean = torch.empty((cdiv(P, _ELEM_BLOCK_M), C), device=x.device, dtype=torch.float32)
            pm2 = torch.empty_like(pmean)
            launch(plan.sites, "stats", launcher(_channel_stats_kernel, x), _elem_grid(P, C),
                   (x, pmean, pm2, P, C, H, W, *x.stride()), _elem_meta())
            mean, rstd = _finalize_stats(pmean, pm2, P, C, _ELEM_BLOCK_M, eps, x.device, plan.sites)
        else:
            mean = running_mean.float().contiguous()
            rstd = torch.rsqrt(running_var.float() + eps).contiguous()
        vmean, _, scale, shift = _bn_vectors(bn_weight, bn_bias, mean, rstd)
        wt = weight.permute(2, 3, 1, 0).contiguous()  # (KH, KW, C_in, C_out), as conv_bn_act's forward
        launch(plan.sites, "conv", launcher(_bn_act_conv_fwd_kernel, x), plan.grid,
               (x, wt, bias.contiguous() if bias is not None else x, y, vmean, scale, shift, plan.M, C_out, C, H, W,
                plan.y_shape[2], plan.y_shape[3], *x.stride(), *wt.stride(), *y.stride()), plan.constexprs)
    return y, mean, rstd


def bn_act_conv_backward(
    x, bn_weight, bn_bias, weight, bias, mean, rstd, grad_out,
    training, eps, stride, padding, dilation, activation, output_mask=None, groups=1,
):
    """(dx, dbn_weight, dbn_bias, dweight, dbias); None where the input is None or ``output_mask``
    masks it off. Same contract as ``fusedrc.reference.bn_act_conv_backward``."""
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    key = plan_key("bwd", x, weight, grad_out, *stride, *padding, *dilation, activation, groups, _tf32_key(x))
    # the plan: the launch sites' dict where the kernels cover the call, else False
    sites = _PLANS.plan(key, lambda: {} if _pre_supported(x, weight, activation, stride, padding, dilation, groups)
                        and _cba._sample_extent(grad_out) <= _cba._I32_MAX else False)
    if sites is False:
        return _reference().bn_act_conv_backward(
            x, bn_weight, bn_bias, weight, bias, mean, rstd, grad_out,
            training, eps, stride, padding, dilation, activation, output_mask, groups)
    need_dx, need_dgamma, need_dbeta, need_dw, need_db = wanted(output_mask, 5)
    need_dgamma, need_dbeta = need_dgamma and bn_weight is not None, need_dbeta and bn_bias is not None
    need_da = need_dx or need_dgamma or need_dbeta
    N, C, H, W = x.shape
    P = N * H * W
    fmt = _memory_format(x)
    vmean, rstd, scale, shift = _bn_vectors(bn_weight, bn_bias, mean, rstd)
    precision, cap = dot_precision(x), device_capability(x)
    dx = dgamma = dbeta = dweight = None
    with _device_guard(x):
        if _cba.CONV_GRAD == "aten":
            a = x
            if need_dw:  # aten's wgrad reads the conv's input: act(bn(x)), transient
                a = torch.empty_like(x, memory_format=fmt)
                launch(sites, "apply", launcher(_bn_act_apply_kernel, x), _elem_grid(P, C),
                       (x, a, vmean, scale, shift, P, C, H, W, *x.stride(), *a.stride()), _elem_meta(activation))
            da, dweight, _ = torch.ops.aten.convolution_backward(
                grad_out, a, weight, None, stride, padding, dilation, False, [0, 0], 1, [need_da, need_dw, False])
            del a
            da, dweight = (da if need_da else None), (dweight if need_dw else None)  # CPU's fills them anyway
        else:
            da = conv_dx(grad_out, weight, x.shape, fmt, stride, padding, dilation, precision, cap) if need_da else None
            dweight = conv_dw(grad_out, x, weight.shape, stride, padding, dilation, precision, cap,
                              pre_act=(vmean, scale, shift, activation)) if need_dw else None
        if need_da:
            sg = sgx = x  # unused pointers in eval mode without affine gradients
            if training or need_dgamma or need_dbeta:
                T = cdiv(P, _ELEM_BLOCK_M)
                pg = torch.empty((T, C), device=x.device, dtype=torch.float32)
                pgx = torch.empty_like(pg)
                launch(sites, "reduce", launcher(_bn_act_grad_reduce_kernel, x), _elem_grid(P, C),
                       (x, da, vmean, scale, shift, rstd, pg, pgx, P, C, H, W, *x.stride(), *da.stride()),
                       _elem_meta(activation))
                sg, sgx = (pg[0], pgx[0]) if T == 1 else (pg.sum(0), pgx.sum(0))  # fixed order, no atomics
                dbeta, dgamma = sg, sgx
            if need_dx:
                dx = torch.empty_like(x, memory_format=fmt)
                launch(sites, ("dx", bool(training)), launcher(_bn_act_grad_dx_kernel, x), _elem_grid(P, C),
                       (x, da, dx, vmean, scale, shift, rstd, sg, sgx, 1.0 / P, P, C, H, W,
                        *x.stride(), *da.stride(), *dx.stride()),
                       dict(TRAINING=bool(training), **_elem_meta(activation)))
    dbias = grad_out.sum((0, 2, 3), dtype=torch.float32).to(bias.dtype) if bias is not None and need_db else None
    return (dx, dgamma.to(bn_weight.dtype) if need_dgamma else None, dbeta.to(bn_bias.dtype) if need_dbeta else None,
            dweight.to(weight.dtype) if dweight is not None else None, dbias)


# --------------------------------------------------------------------------- ahead-of-time inspection
def _inspect_fwd(dtype):
    """_bn_act_conv_fwd_kernel as bn_act_conv_forward launches it: channels_last x and y, the weight as
    (KH, KW, C_in, C_out), conv bias on, the BN vectors in fp32; conv_bn_act's 3x3 geometry."""
    p, f32 = _INSPECT_PTR[dtype], "*fp32"
    ptrs = {"x_ptr": p, "w_ptr": p, "bias_ptr": p, "y_ptr": p, "mean_ptr": f32, "scale_ptr": f32, "shift_ptr": f32}
    ints = ("M", "C_OUT", "C_IN", "H", "W", "OH", "OW", "s_xn", "s_xh", "s_xw", "s_wh", "s_ww", "s_wc",
            "s_yn", "s_yh", "s_yw")
    sig, constexprs, aligned = _inspect_args(ptrs, ints, ("s_xc", "s_wo", "s_yc"), ints[:3] + ints[7:])
    constexprs.update(_INSPECT_GEOM, FLAT_K=False, HAS_BIAS=True, **act_meta("relu"))
    return sig, constexprs, aligned


def _inspect_elem(fn, dtype):
    """The passes over x (channels_last; the gradient buffers too) as the launchers run them."""
    p, f32 = _INSPECT_PTR[dtype], "*fp32"
    pix = ("s_n", "s_h", "s_w")
    extra = {  # kernel -> (pointers after x, more pixel strides, more unit strides)
        "_channel_stats_kernel": ({"pmean_ptr": f32, "pm2_ptr": f32}, (), ()),
        "_bn_act_apply_kernel": ({"a_ptr": p, "mean_ptr": f32, "scale_ptr": f32, "shift_ptr": f32},
                                 ("s_an", "s_ah", "s_aw"), ("s_ac",)),
        "_bn_act_grad_reduce_kernel": ({"da_ptr": p, "mean_ptr": f32, "scale_ptr": f32, "shift_ptr": f32,
                                        "rstd_ptr": f32, "pg_ptr": f32, "pgx_ptr": f32},
                                       ("s_dn", "s_dh", "s_dw"), ("s_dc",)),
        "_bn_act_grad_dx_kernel": ({"da_ptr": p, "dx_ptr": p, "mean_ptr": f32, "scale_ptr": f32, "shift_ptr": f32,
                                    "rstd_ptr": f32, "sg_ptr": f32, "sgx_ptr": f32},
                                   ("s_dn", "s_dh", "s_dw", "s_xn", "s_xh", "s_xw"), ("s_dc", "s_xc")),
    }[fn.__name__]
    ptrs, more, unit = extra
    ints = ("M", "C", "H", "W", *pix, *more)
    sig, constexprs, aligned = _inspect_args({"x_ptr": p, **ptrs}, ints, ("s_c", *unit),
                                             ("M", "C", *pix, *more),
                                             floats=("inv_count",) if fn is _bn_act_grad_dx_kernel else ())
    if fn is _bn_act_grad_dx_kernel:
        constexprs["TRAINING"] = True
    if fn is not _channel_stats_kernel:
        constexprs.update(act_meta("relu"))
    constexprs.update(BLOCK_M=_ELEM_BLOCK_M, BLOCK_C=_ELEM_BLOCK_C)
    return sig, constexprs, aligned


def inspect_specs():
    """The forward conv at every sm90/sm80 entry of conv_bn_act's tile table (fp16 and bf16 for
    "16bit", fp32 with tf32/ieee otherwise), and the passes over x once per (arch, dtype).
    (The dW kernel's PRE_ACT variant is among conv_bn_act's specs.)"""
    specs, seen = [], {}
    for (family, opclass, bucket), cfg in _TABLE.items():
        arch = _INSPECT_ARCH.get(family)
        if arch is None:
            continue
        label = f"{family}/{opclass}/{bucket}"
        variants = [(torch.float16, "ieee"), (torch.bfloat16, "ieee")] if opclass == "16bit" else \
            [(torch.float32, "tf32" if opclass == "tf32" else "ieee")]
        for dtype, precision in variants:
            key = (arch, dtype, precision, cfg)
            if key in seen:
                seen[key]["source"] += "," + label
                continue
            sig, constexprs, aligned = _inspect_fwd(dtype)
            constexprs.update(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                              PRECISION=precision, UPCAST=False)
            config = {"BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N, "BLOCK_K": cfg.BLOCK_K, "GROUP_M": cfg.GROUP_M,
                      "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "precision": precision}
            seen[key] = spec = {"fn": _bn_act_conv_fwd_kernel, "kernel": "_bn_act_conv_fwd_kernel", "arch": arch,
                                "dtype": dtype, "config": config, "signature": sig, "constexprs": constexprs,
                                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "gemm": True,
                                "aligned": aligned, "source": label}
            specs.append(spec)
    for arch in _INSPECT_ARCH.values():
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for fn in (_channel_stats_kernel, _bn_act_apply_kernel, _bn_act_grad_reduce_kernel, _bn_act_grad_dx_kernel):
                sig, constexprs, aligned = _inspect_elem(fn, dtype)
                config = {"BLOCK_M": _ELEM_BLOCK_M, "BLOCK_C": _ELEM_BLOCK_C, "num_warps": _ELEM_WARPS, "num_stages": 3}
                specs.append({"fn": fn, "kernel": fn.__name__, "arch": arch, "dtype": dtype, "config": config,
                              "signature": sig, "constexprs": constexprs, "num_warps": _ELEM_WARPS, "num_stages": 3,
                              "gemm": False, "aligned": aligned, "source": f"{arch}/elem"})
    return specs
