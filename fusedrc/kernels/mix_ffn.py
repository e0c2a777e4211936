"""Mix-FFN (SegFormer, GLPN, PVT-v2): out = dropout(act(dwconv(x W1^T + b1) + b_dw)) W2^T + b2
(PVT-v2's linear variant, ``relu_first``: dwconv(relu(x W1^T + b1)), the ReLU applied in each tap's load).

The depthwise k x k conv runs over each image's grid of tokens: x is (M, K), its rows the tokens of
B images of height x width in row-major order, so (M, hidden) is the channels-last layout of the
(B, hidden, height, width) images and a tap is a row shift of ``dy * width + dx``. Only x is kept.

Forward (2 GEMMs): h1 = x W1^T + b1 (cuBLAS on CUDA), then ``_dwconv_act_kernel`` computes
h2 = dwconv(h1) + b_dw tile by tile and writes a = dropout(act(h2)) (h2 never stored), then the
output GEMM. h1 is a buffer, not a tile: the conv reads each token's neighbours, which other tiles
of the GEMM own.

Backward (5 GEMMs, the output GEMM is never rerun):
  h1  = x W1^T + b1                                         (GEMM, the forward's, into a buffer)
  g_a = grad_out W2                                         (GEMM)
  ``_dwconv_act_grad_kernel`` recomputes h2 from h1 with the forward's tile function (bit for bit)
    and emits g_h2 = act'(h2) * mask * g_a, a = dropout(act(h2)) for dW2, and per row tile (of its own, taller tile) the
    partial sums of the conv's weight gradient (sum of g_h2 times each tap's shifted h1) and bias
    gradient: h2 and act(h2) live in registers only
  dW2 = grad_out^T a                                        (GEMM)
  ``_dwconv_input_grad_kernel``: g_h1 = the conv's transpose of g_h2 (the taps mirrored) with the
    partial column sums of g_h1 (db1)
  dX  = g_h1 W1, dW1 = g_h1^T x                             (GEMMs)
Transient peak of the backward: h1, g_a, a and g_h2 (each (M, hidden)) and the conv's weight partials (0.07x a
bf16 h1 at k = 3); h1 is freed before g_h1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (_act_fwd, _act_grad, _device_guard, _dropout_factor, act_meta, cdiv, check_activation,
                      dropout_args, launcher, plain_gemm, wanted)

__all__ = ["mix_ffn_forward", "mix_ffn_backward", "dwconv_act", "dwconv_act_grad", "dwconv_input_grad"]


@triton.jit
def _shifted(src_ptr, rows, cols, px, py, M, C, H, W, DY: tl.constexpr, DX: tl.constexpr, RELU_IN: tl.constexpr):
    """fp32 tile of the (M, C) tokens at ``src_ptr`` shifted by (DY, DX) on each image's grid, zero past its edge
    (and past M, C); of relu(src) with RELU_IN (NaN kept, as torch.relu)."""
    ok = (rows < M) & (py + DY >= 0) & (py + DY < H) & (px + DX >= 0) & (px + DX < W)
    src = rows.to(tl.int64) + (DY * W + DX)
    v = tl.load(src_ptr + (src[:, None] * C + cols[None, :]), mask=ok[:, None] & (cols < C)[None, :],
                other=0.0).to(tl.float32)
    if RELU_IN:
        v = tl.where(v < 0.0, 0.0, v)
    return v


@triton.jit
def _dwconv_tile(src_ptr, w_ptr, rows, cols, M, C, H, W, KSIZE: tl.constexpr, TRANSPOSED: tl.constexpr,
                 RELU_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_C) tile of the depthwise "same" conv of the (M, C) tokens at ``src_ptr``:
    sum over taps (dy, dx) of w[c, tap] * src[token shifted by (dy, dx)], zero past the image's edge.
    TRANSPOSED: the shifts mirrored (the conv's input gradient from its output's). RELU_IN: of relu(src)
    (PVT-v2's linear variant; NaN kept, as torch.relu). Taps in a fixed order: the forward and its recompute
    add them alike."""
    px = rows % W
    py = (rows // W) % H
    col_ok = cols < C
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for tap in tl.static_range(KSIZE * KSIZE):
        dy = (tap // KSIZE - KSIZE // 2) * (1 - 2 * TRANSPOSED)
        dx = (tap % KSIZE - KSIZE // 2) * (1 - 2 * TRANSPOSED)
        v = _shifted(src_ptr, rows, cols, px, py, M, C, H, W, dy, dx, RELU_IN)
        w = tl.load(w_ptr + cols * (KSIZE * KSIZE) + tap, mask=col_ok, other=0.0).to(tl.float32)
        acc += v * w[None, :]
    return acc


@triton.jit
def _conv_preact(h_ptr, w_ptr, b_ptr, rows, cols, M, C, H, W, HAS_BIAS: tl.constexpr, KSIZE: tl.constexpr,
                 RELU_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """h2 = dwconv([relu](h1)) + b_dw on one tile: the forward's and the recompute's one function."""
    h = _dwconv_tile(h_ptr, w_ptr, rows, cols, M, C, H, W, KSIZE, False, RELU_IN, BLOCK_M, BLOCK_C)
    if HAS_BIAS:
        h += tl.load(b_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    return h


@triton.jit
def _dwconv_act_kernel(
    h_ptr, w_ptr, b_ptr, a_ptr, seed_ptr, M, C, H, W, drop_threshold, drop_scale,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, DROPOUT: tl.constexpr,
    KSIZE: tl.constexpr, RELU_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c0 = tl.program_id(1) * BLOCK_C
    cols = c0 + tl.arange(0, BLOCK_C)
    h = _conv_preact(h_ptr, w_ptr, b_ptr, rows, cols, M, C, H, W, HAS_BIAS, KSIZE, RELU_IN, BLOCK_M, BLOCK_C)
    a = _act_fwd(h, ACTIVATION, NEG_SLOPE)
    if DROPOUT:
        a = a * _dropout_factor(tl.load(seed_ptr), rows, c0, drop_threshold, drop_scale, BLOCK_M, BLOCK_C)
    mask = (rows < M)[:, None] & (cols < C)[None, :]
    tl.store(a_ptr + (rows.to(tl.int64)[:, None] * C + cols[None, :]), a.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dwconv_act_grad_kernel(
    h_ptr, w_ptr, b_ptr, g_ptr, gh_ptr, act_ptr, wpart_ptr, bpart_ptr, seed_ptr, M, C, H, W,
    drop_threshold, drop_scale,
    HAS_BIAS: tl.constexpr, STORE_ACT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr,
    ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, DROPOUT: tl.constexpr, KSIZE: tl.constexpr,
    RELU_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    c0 = tl.program_id(1) * BLOCK_C
    cols = c0 + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    mask = (rows < M)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    h = _conv_preact(h_ptr, w_ptr, b_ptr, rows, cols, M, C, H, W, HAS_BIAS, KSIZE, RELU_IN, BLOCK_M, BLOCK_C)
    if DROPOUT:  # the forward's mask, regenerated
        factor = _dropout_factor(tl.load(seed_ptr), rows, c0, drop_threshold, drop_scale, BLOCK_M, BLOCK_C)
    if STORE_ACT:
        a = _act_fwd(h, ACTIVATION, NEG_SLOPE)
        if DROPOUT:
            a = a * factor
        tl.store(act_ptr + offs, a.to(act_ptr.dtype.element_ty), mask=mask)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        g = g * factor
    gh = tl.where(mask, _act_grad(h, g, ACTIVATION, NEG_SLOPE), 0.0)
    tl.store(gh_ptr + offs, gh.to(gh_ptr.dtype.element_ty), mask=mask)
    part = (pid_m.to(tl.int64) * (KSIZE * KSIZE)) * C
    if WEIGHT_GRAD:  # dW[c, tap] = sum over tokens of g_h2 * h1 at the tap's shift: this row tile's share
        px = rows % W
        py = (rows // W) % H
        for tap in tl.static_range(KSIZE * KSIZE):
            v = _shifted(h_ptr, rows, cols, px, py, M, C, H, W, tap // KSIZE - KSIZE // 2, tap % KSIZE - KSIZE // 2,
                         RELU_IN)
            tl.store(wpart_ptr + part + tap * C + cols, tl.sum(gh * v, axis=0), mask=col_ok)
    if BIAS_GRAD:
        tl.store(bpart_ptr + pid_m.to(tl.int64) * C + cols, tl.sum(gh, axis=0), mask=col_ok)


@triton.jit
def _dwconv_input_grad_kernel(
    g_ptr, w_ptr, h_ptr, out_ptr, part_ptr, M, C, H, W,
    BIAS_GRAD: tl.constexpr, KSIZE: tl.constexpr, RELU_IN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    mask = (rows < M)[:, None] & col_ok[None, :]
    g = _dwconv_tile(g_ptr, w_ptr, rows, cols, M, C, H, W, KSIZE, True, False, BLOCK_M, BLOCK_C)
    if RELU_IN:  # through the ReLU before the conv: threshold_backward, 0 where h1 <= 0 (a NaN h1 lets g through)
        h = tl.load(h_ptr + (rows.to(tl.int64)[:, None] * C + cols[None, :]), mask=mask, other=0.0).to(tl.float32)
        g = tl.where(h <= 0.0, 0.0, g)
    tl.store(out_ptr + (rows.to(tl.int64)[:, None] * C + cols[None, :]), g.to(out_ptr.dtype.element_ty), mask=mask)
    if BIAS_GRAD:  # fc1's bias gradient: this row tile's column sums, from the fp32 values
        tl.store(part_ptr + pid_m.to(tl.int64) * C + cols, tl.sum(tl.where(mask, g, 0.0), axis=0), mask=col_ok)


# --------------------------------------------------------------------------- launchers
# (BLOCK_M, BLOCK_C, num_warps): elementwise tiles with 9 shifted loads each, channels contiguous.
# Untimed on a GPU. Static check (python -m fusedrc.inspect --kernel mix_ffn): on 4 warps the compiler keeps the
# 9 taps' loads in flight at once and the grad kernel spills (sm_90 64 x 64: 8-256 bytes; 32 x 128: 200-920);
# 64 x 64 on 8 warps spills nowhere (sm_90 bf16: 128 / 176 / 97 registers for the three kernels).
# The interpreter's small tiles give the test shapes several tiles each way and ragged edges.
_GPU_TILE = (64, 64, 8)
_INTERPRETER_TILE = (16, 16, 4)
# The grad kernel's tile: as many elements, taller. Its conv weight gradient partials are (row tiles, k*k, C) fp32,
# 9 / BLOCK_M floats per element of h1 at k = 3 (64 rows: 0.28x a bf16 h1, 256: 0.07x). h2 is a function of each
# element alone (the taps added in a fixed order, the mask a function of (row, column)), so a tile of another
# shape recomputes the forward's bit for bit; the interpreter's differs from its forward tile to test that.
_GPU_GRAD_TILE = (256, 16, 8)
_INTERPRETER_GRAD_TILE = (32, 8, 4)


def _tile(t: torch.Tensor, grad=False):
    if grad:
        return _GPU_GRAD_TILE if t.is_cuda else _INTERPRETER_GRAD_TILE
    return _GPU_TILE if t.is_cuda else _INTERPRETER_TILE


def _conv_args(h, w_dw, height, width):
    M, C = h.shape
    assert M % (height * width) == 0 and w_dw.shape[0] == C and w_dw.shape[1] == 1
    return M, C, w_dw.contiguous(), w_dw.shape[-1]


def dwconv_act(h1, w_dw, b_dw, height, width, activation, dropout=None, relu_first=False):
    """a = dropout(act(dwconv([relu](h1)) + b_dw)) for the (M, C) tokens h1; (M, C) in h1's dtype."""
    M, C, w, k = _conv_args(h1, w_dw, height, width)
    a = torch.empty_like(h1)
    if M == 0 or C == 0:
        return a
    bm, bc, warps = _tile(h1)
    drop, seed, threshold, scale = dropout_args(dropout, h1)
    with _device_guard(h1):
        launcher(_dwconv_act_kernel, h1)[(cdiv(M, bm), cdiv(C, bc))](
            h1, w, b_dw if b_dw is not None else h1, a, seed, M, C, height, width, threshold, scale,
            HAS_BIAS=b_dw is not None, **act_meta(activation), DROPOUT=drop, KSIZE=k, RELU_IN=relu_first,
            BLOCK_M=bm, BLOCK_C=bc, num_warps=warps)
    return a


def dwconv_act_grad(h1, w_dw, b_dw, grad_a, height, width, activation, store_act=False, weight_grad=True,
                    bias_grad=True, dropout=None, relu_first=False):
    """(g_h2, a or None, dw_dw or None, db_dw or None) from h1 and the gradient of a, recomputing
    h2 = dwconv([relu](h1)) + b_dw in tiles (the forward's function): g_h2 = act'(h2) * mask * grad_a in h1's
    dtype, a = dropout(act(h2)); the conv's weight and bias gradients (fp32 per-row-tile partials,
    reduced here in a fixed order) in their parameters' dtypes."""
    M, C, w, k = _conv_args(h1, w_dw, height, width)
    bias_grad = bias_grad and b_dw is not None
    gh = torch.empty_like(h1)
    act = torch.empty_like(h1) if store_act else None
    bm, bc, warps = _tile(h1, grad=True)
    num_m = cdiv(M, bm)
    # every entry written by the launch (each row tile, column tile and tap): no zero-fill pass
    wpart = torch.empty((num_m, k * k, C), device=h1.device, dtype=torch.float32) if weight_grad else None
    bpart = torch.empty((num_m, C), device=h1.device, dtype=torch.float32) if bias_grad else None
    if M and C:
        drop, seed, threshold, scale = dropout_args(dropout, h1)
        with _device_guard(h1):
            launcher(_dwconv_act_grad_kernel, h1)[(num_m, cdiv(C, bc))](
                h1, w, b_dw if b_dw is not None else h1, grad_a.contiguous(), gh, act if act is not None else h1,
                wpart if wpart is not None else h1, bpart if bpart is not None else h1, seed, M, C, height, width,
                threshold, scale, HAS_BIAS=b_dw is not None, STORE_ACT=store_act, WEIGHT_GRAD=weight_grad,
                BIAS_GRAD=bias_grad, **act_meta(activation), DROPOUT=drop, KSIZE=k, RELU_IN=relu_first,
                BLOCK_M=bm, BLOCK_C=bc, num_warps=warps)
    dw = wpart.sum(0).t().reshape(C, 1, k, k).to(w_dw.dtype) if weight_grad else None
    db = bpart.sum(0).to(b_dw.dtype) if bias_grad else None
    return gh, act, dw, db


def dwconv_input_grad(g_h2, w_dw, height, width, bias=None, h1=None):
    """(g_h1, the column sums of g_h1 in ``bias``'s dtype or None): the conv's input gradient from its
    output's, the taps mirrored; with ``h1`` (a ReLU before the conv), through that ReLU."""
    M, C, w, k = _conv_args(g_h2, w_dw, height, width)
    out = torch.empty_like(g_h2)
    bm, bc, warps = _tile(g_h2)
    num_m = cdiv(M, bm)
    part = torch.empty((num_m, C), device=g_h2.device, dtype=torch.float32) if bias is not None else None
    if M and C:
        with _device_guard(g_h2):
            launcher(_dwconv_input_grad_kernel, g_h2)[(num_m, cdiv(C, bc))](
                g_h2, w, h1 if h1 is not None else g_h2, out, part if part is not None else g_h2, M, C, height,
                width, BIAS_GRAD=bias is not None, KSIZE=k, RELU_IN=h1 is not None, BLOCK_M=bm, BLOCK_C=bc,
                num_warps=warps)
    return out, (part.sum(0).to(bias.dtype) if bias is not None else None)


def mix_ffn_forward(x, w1, b1, w_dw, b_dw, w2, b2, height, width, activation, dropout_p=0.0, seed=None,
                    relu_first=False):
    """out = dropout(act(dwconv([relu](x W1^T + b1)) + b_dw)) W2^T + b2; x (M, K), w_dw (hidden, 1, k, k); ``seed`` a
    1-element int64 tensor when ``dropout_p > 0``; ``relu_first``: PVT-v2's linear variant."""
    assert x.dim() == 2, "mix_ffn_forward expects a 2-D x"
    check_activation(activation)
    h1 = plain_gemm(x, w1.t(), bias=b1)
    a = dwconv_act(h1, w_dw, b_dw, height, width, activation, dropout=(dropout_p, seed), relu_first=relu_first)
    del h1
    return plain_gemm(a, w2.t(), bias=b2)


def mix_ffn_backward(x, w1, b1, w_dw, b_dw, w2, b2, grad_out, height, width, activation, dropout_p=0.0, seed=None,
                     output_mask=None, relu_first=False):
    """Returns (dx, dw1, db1, dw_dw, db_dw, dw2, db2); None for an absent bias or a gradient ``output_mask``
    masks off (the work only it needs skipped)."""
    assert x.dim() == 2, "mix_ffn_backward expects a 2-D x"
    check_activation(activation)
    need_dx, need_dw1, need_db1, need_dwdw, need_dbdw, need_dw2, need_db2 = wanted(output_mask, 7)
    need_db1, need_dbdw = need_db1 and b1 is not None, need_dbdw and b_dw is not None
    need_gh1 = need_dx or need_dw1 or need_db1
    db2 = grad_out.sum(0, dtype=torch.float32).to(b2.dtype) if b2 is not None and need_db2 else None
    conv = dict(dropout=(dropout_p, seed), relu_first=relu_first)
    h1 = plain_gemm(x, w1.t(), bias=b1)  # the forward's GEMM: the same h1, bit for bit
    if not (need_gh1 or need_dwdw or need_dbdw):
        a = dwconv_act(h1, w_dw, b_dw, height, width, activation, **conv) if need_dw2 else None
        del h1
        dw2 = plain_gemm(grad_out.t(), a, out_dtype=w2.dtype) if need_dw2 else None
        return None, None, None, None, None, dw2, db2
    grad_a = plain_gemm(grad_out, w2, out_dtype=x.dtype)
    gh2, a, dw_dw, db_dw = dwconv_act_grad(h1, w_dw, b_dw, grad_a, height, width, activation, store_act=need_dw2,
                                           weight_grad=need_dwdw, bias_grad=need_dbdw, **conv)
    del grad_a
    if not relu_first:  # (the ReLU's backward reads h1)
        del h1
    dw2 = plain_gemm(grad_out.t(), a, out_dtype=w2.dtype) if need_dw2 else None
    del a
    dx = dw1 = db1 = None
    if need_gh1:
        gh1, db1 = dwconv_input_grad(gh2, w_dw, height, width, bias=b1 if need_db1 else None,
                                     h1=h1 if relu_first else None)
        del gh2
        dx = plain_gemm(gh1, w1, out_dtype=x.dtype) if need_dx else None
        dw1 = plain_gemm(gh1.t(), x, out_dtype=w1.dtype) if need_dw1 else None
    return dx, dw1, db1, dw_dw, db_dw, dw2, db2


# --------------------------------------------------------------------------- ahead-of-time inspection
def inspect_specs():
    """The three kernels on the GPU tile for sm_90 and sm_80, each 16-bit dtype and fp32, SegFormer's 3 x 3
    conv and GELU after PVT-v2's linear variant's ReLU (the most work): the forward with dropout, the grad kernel with every output (a, both gradients' partials,
    dropout), the transposed conv with fc1's bias sums (``python -m fusedrc.inspect --kernel mix_ffn``)."""
    from ._common import _INSPECT_ARCH, _TRITON_PTR

    tile = {"KSIZE": 3, "RELU_IN": True}
    ints = {"M": "i32", "C": "i32", "H": "i32", "W": "i32"}
    act = {**act_meta("gelu"), "DROPOUT": True}
    specs = []
    for arch, dtype in ((a, d) for a in _INSPECT_ARCH.values() for d in (torch.float16, torch.bfloat16, torch.float32)):
        p, f32 = _TRITON_PTR[dtype], "*fp32"
        drop = {"seed_ptr": "*i64", **ints, "drop_threshold": "i32", "drop_scale": "fp32"}
        kernels = (
            (_dwconv_act_kernel, {"h_ptr": p, "w_ptr": p, "b_ptr": p, "a_ptr": p, **drop},
             {"HAS_BIAS": True, **act}),
            (_dwconv_act_grad_kernel, {"h_ptr": p, "w_ptr": p, "b_ptr": p, "g_ptr": p, "gh_ptr": p, "act_ptr": p,
                                       "wpart_ptr": f32, "bpart_ptr": f32, **drop},
             {"HAS_BIAS": True, "STORE_ACT": True, "WEIGHT_GRAD": True, "BIAS_GRAD": True, **act}),
            (_dwconv_input_grad_kernel, {"g_ptr": p, "w_ptr": p, "h_ptr": p, "out_ptr": p, "part_ptr": f32,
                                         **ints}, {"BIAS_GRAD": True}),
        )
        for fn, sig, flags in kernels:
            bm, bc, warps = _GPU_GRAD_TILE if fn is _dwconv_act_grad_kernel else _GPU_TILE
            specs.append({"fn": fn, "kernel": fn.__name__, "arch": arch, "dtype": dtype,
                          "config": {"BLOCK_M": bm, "BLOCK_C": bc, "num_warps": warps, "num_stages": 1},
                          "signature": sig, "constexprs": {**tile, "BLOCK_M": bm, "BLOCK_C": bc, **flags},
                          "num_warps": warps, "num_stages": 1,
                          "gemm": False, "aligned": [n for n in sig if n.endswith("_ptr")] + ["C"],
                          "source": f"{arch}/gpu tile"})
    return specs
