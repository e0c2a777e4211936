"""Gated FFN (SwiGLU / GeGLU, Llama's MLP): out = (act(x Wg^T + bg) * (x Wu^T + bu)) Wd^T + bd.

Pure-torch reference: ``fusedrc.reference.gated_mlp_forward`` / ``gated_mlp_backward``.

Forward (3 GEMMs, 2 kernels): ``_gated_act_kernel`` computes the gate and up
pre-activations of one tile in one main loop (each x tile loaded once, two
accumulators) and writes only a = act(h_g) * h_u; then the down GEMM. Only x is
kept for backward.

Backward (8 GEMMs; the down GEMM is never rerun):
  g_a = grad_out Wd                                      (GEMM)
  ``_gated_act_grad_kernel`` recomputes h_g and h_u with the forward's main loop
    and tiles (bit-identical) and emits, in its epilogue,
    g_hg = act'(h_g) * (g_a * h_u), g_hu = g_a * act(h_g), a = act(h_g) * h_u
    and per-row-tile partial column sums of g_hg and g_hu (the biases' gradients).
    h_g, h_u, act(h_g) never reach global memory.
  dWd = grad_out^T a, dX = g_hg Wg + g_hu Wu, dWg = g_hg^T x, dWu = g_hu^T x (GEMMs; dX one GEMM
  over the joint rows where Wg and Wu are rows of one tensor: ``_joint_rows``, ``input_grads``)
torch.utils.checkpoint on the same block also runs 11 GEMMs (its early stop skips the down
GEMM) but writes h_g, h_u, act(h_g) and a to memory in its recompute.

Numerics: h_g, h_u and the product act(h_g) * h_u stay in fp32 and only the product is
rounded to the input's dtype (eager rounds h_g, h_u and act(h_g) to it first: with fp16
inputs a pre-activation beyond fp16's range is inf there, finite here); the tolerance
tests compare both against float64.
Tiles: the dense table's entry for the (M, H, K) GEMM with BLOCK_N halved (two
fp32 accumulators hold what one full-width tile would), or whole where the H100 sweep
found that faster (``_WHOLE``: the grad kernel's epilogue then in column slices,
``EPILOGUE_SPLIT``); forward and recompute read the same entry.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (
    _INSPECT_ARCH, _NARROW, _TABLE, _TRITON_PTR, ExpertGroups, GemmConfig, _act_fwd, _act_grad, _add_bias,
    _arch_family, _dense_tile, _expert_tile, _mainloop, _sigmoid, _column_halves, _device_guard, _dropout_factor,
    _shape_bucket,
    _tile_safe, _upcast_flag, act_meta, cdiv, dense_grid, device_capability, dot_precision, dropout_args,
    expert_tiles, gemm_config, launcher, tile_bias_grad, operand_class, plain_gemm, release_tuning, uses_aten_gemm,
    wanted,
)
from fusedrc.reference import (
    lora_down_grads, lora_down_input_grad, lora_down_output, lora_input_grads, lora_rank_input, split_gated,
)

__all__ = ["gated_mlp_forward", "gated_mlp_backward", "gated_config"]


# Entries of the dense table the dual kernels take whole, not with BLOCK_N halved. sm_90 16-bit
# 128x128 (8 warps, 3 stages): the H100 sweep of 2026-11-27 (benchmarks/results/
# tile_sweep_cuda_20261127-084949.json) timed it at 0.81x (Llama-2 7B's MLP on 8192 tokens) and 0.87x
# (16384 x 2048 -> 5632) of the halved 128x64's forward, the recompute within +1%/+8% while it still
# spilled (496 bytes a thread); with its epilogue in quarters it spills nothing (244 registers,
# ``python -m fusedrc.inspect --kernel gated``). Timed so on an H100 (2026-11-27 15:44,
# tile_sweep_cuda_20261127-154359.json), against the halved 128x64 (split 1): forward 2.08 vs 2.69 ms,
# recompute 2.61 vs 3.16 ms (Llama-2 7B's); 1.26 vs 1.65 and 1.49 vs 1.85 ms (16384 x 2048 -> 5632).
# In halves the recompute took 2.45 and 1.47 ms, but spills on sm_90, so quarters it is.
# Not for launches with dropout on the product (an argument of the op: its forward and recompute agree):
# its mask's epilogue spills there whatever the split (8-128 bytes); they take the halved entry.
# Persistent launches (``_common.GEMM_PERSISTENT``) keep the tile, split their epilogues in eighths and
# pipeline 2 stages (the tile loop's registers: 72 bytes of spill in quarters; in eighths, 64 bytes
# under Triton 3.6 with 3 stages; see _launch_config).
_WHOLE = {
    ("sm90", "16bit", "medium"): GemmConfig(128, 128, 64, 8, 8, 3, 4),
    ("sm90", "16bit", "large"): GemmConfig(128, 128, 64, 8, 8, 3, 4),
}
# Where the dense table's entry is wide (sm_90's 16-bit large: 256x128, one accumulator of 128 registers
# a thread; two of them do not fit), the dual tiles derive from its narrow stand-in, _common._NARROW.


def gated_meta(activation: str) -> dict:
    """The dual kernels' activation constexprs: ``act_meta``'s, and the gated product's options of a gated
    activation string (``reference.split_gated``): the SwiGLU clamp's LIMIT (0.0: none; one compile per limit)
    and LIMIT_AFTER, the gate's ALPHA (0.0: none), UP_OFFSET, the softcaps GATE_CAP and UP_CAP (0.0: none) and the
    gate's multiplier GATE_SCALE (1.0: none)."""
    spec = split_gated(activation)
    return dict(act_meta(spec.act), LIMIT=0.0 if spec.limit is None else spec.limit, LIMIT_AFTER=spec.after,
                ALPHA=0.0 if spec.alpha is None else spec.alpha, UP_OFFSET=spec.offset,
                GATE_CAP=0.0 if spec.gate_cap is None else spec.gate_cap,
                UP_CAP=0.0 if spec.up_cap is None else spec.up_cap, GATE_SCALE=spec.scale)


def gated_config(cfg, key=None):
    """The dual kernels' tile for dense table entry ``cfg`` (at ``key``, (family, operand class, bucket),
    for a launch that may take it whole): ``_WHOLE[key]`` where there is one, else ``cfg`` with BLOCK_N
    halved (at least 16: two fp32 accumulators hold what one full-width tile would) and the epilogue in
    one piece."""
    if key in _WHOLE:
        return _WHOLE[key]
    return cfg._replace(BLOCK_N=max(16, cfg.BLOCK_N // 2), EPILOGUE_SPLIT=1)


def _gated_table_config(M, N, K, dtype, precision, capability, dropout=False, grouped=False):
    """The table's tile of a dual launch: a pure function of the operands, the dropout and whether it is grouped,
    so a forward and its recompute take the same one. Launches with dropout and grouped launches (routed experts)
    take the entry halved, never ``_WHOLE``'s: at 128x128 the grouped kernels' per-tile expert bookkeeping spilled
    112 bytes on sm_90 (forward and grad kernel, whatever the epilogue split; the interleaved form none)."""
    if capability is None:
        return gated_config(gemm_config(M, N, K, dtype, precision, capability))
    key = (_arch_family(capability), operand_class(dtype, precision), _shape_bucket(M, N, K))
    return gated_config(_NARROW.get(key) or _TABLE[key], None if dropout or grouped else key)


def _launch_config(cfg, persistent):
    """``cfg`` as launched: a split (whole) tile launched persistent splits its epilogue in eighths and
    pipelines at most 2 stages. Its tile loop holds two 128x128 accumulators; with 3 stages the grad
    kernel spilled 64 bytes under Triton 3.6 (none with 2, under 3.6 and 3.9). Neither changes a value:
    same tile, same K order, so a switch flipped between a forward and its backward changes no bit."""
    if not (persistent and cfg.EPILOGUE_SPLIT > 1):
        return cfg
    return cfg._replace(EPILOGUE_SPLIT=min(8, cfg.BLOCK_N // 16), num_stages=min(2, cfg.num_stages))


def _clamp_split(split, block_n, shaped, interleaved_bias=False, softcap=False):
    """The grad kernel's epilogue split with a shaped SwiGLU (``shaped``: a clamp or a softcap): a split (whole)
    tile's in eighths, for the clamp's masks (in quarters, the clamp after the activation spilled 24 bytes on
    sm_90 under Triton 3.9); in sixteenths for the softcaps' tanh (Inkling2's routed experts: 56 bytes of spill in
    quarters on 3.9, 8 in eighths on 3.6 since the product is stored row-scaled) and where the split also splits
    one interleaved operand and sums biases (gpt-oss's experts: 8 bytes of spill in eighths, none in sixteenths).
    The split changes no g_h or product value (elementwise); the routed row dots' slices are summed in another
    order (d row_scale to rounding)."""
    if not shaped or split == 1:
        return split
    fine = min(16, block_n // 8) if interleaved_bias or softcap else min(8, block_n // 16)
    if interleaved_bias:  # finer under a release that _RELEASE_TUNING names
        return release_tuning("_gated_act_grad_kernel", "interleaved_bias", block_n).get("EPILOGUE_SPLIT", fine)
    return fine


@triton.jit
def _dual_mainloop(
    a_ptr, bg_ptr, bu_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    pid_m, pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """fp32 tiles of A @ Bg and A @ Bu (Bg, Bu of the same strides), K ascending, each A tile loaded
    once. As ``_mainloop``: 64-bit tile bases, out-of-range rows/columns wrapped onto valid ones.
    INTERLEAVED: Bg's columns alternate with Bu's in one (K, 2N) matrix at ``bg_ptr`` of strides
    (stride_bk, stride_bn) (gpt-oss's layout): one tile of 2 * BLOCK_N adjacent columns a step, contiguous
    where stride_bn is 1, split into the gate's and the up's after the loop."""
    if INTERLEAVED:  # the dense main loop over the (K, 2N) operand's columns 2 col0 .. 2 (col0 + BLOCK_N)
        acc = _mainloop(a_ptr, bg_ptr, M, 2 * N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
                        BLOCK_M, 2 * BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST, False)
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        offs_m = tl.arange(0, BLOCK_M) % (M - row0)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = (a_ptr + row0.to(tl.int64) * stride_am) + (offs_m[:, None] * stride_am
                                                            + offs_k[None, :] * stride_ak)
        offs_n = tl.arange(0, BLOCK_N) % (N - col0)
        b_offs = offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        bg_ptrs = (bg_ptr + col0.to(tl.int64) * stride_bn) + b_offs
        bu_ptrs = (bu_ptr + col0.to(tl.int64) * stride_bn) + b_offs
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                bg = tl.load(bg_ptrs)
                bu = tl.load(bu_ptrs)
            else:
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                bg = tl.load(bg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                bu = tl.load(bu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                bg = bg.to(tl.float32)
                bu = bu.to(tl.float32)
            acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            bg_ptrs += BLOCK_K * stride_bk
            bu_ptrs += BLOCK_K * stride_bk
    return acc_g, acc_u


# the rank step of _lora_mainloop: the rank padded to a multiple of it (zero terms), so its loads need no masks; one
# wgmma k-step of 16-bit operands, few registers beside the accumulators
_LORA_BLOCK_R = 16
LORA_BLOCK_R = tl.constexpr(_LORA_BLOCK_R)


@triton.jit
def _lora_mainloop(acc_g, acc_u, t_ptr, lg_ptr, lu_ptr, M, N, R, pid_m, pid_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr):
    """acc_g += T Lg^T and acc_u += T Lu^T on the tile: LoRA adapters' low-rank terms, T (M, R) and Lg, Lu (N, R)
    contiguous, R their rank padded with zeros to a multiple of BLOCK_R, after the main loop and in the same order
    in the forward and its recompute. Rows and columns wrapped as the main loop's."""
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M) % (M - row0)
    offs_n = tl.arange(0, BLOCK_N) % (N - col0)
    offs_r = tl.arange(0, BLOCK_R)
    # 64-bit tile bases, 32-bit offsets within the tile
    t_base = t_ptr + row0.to(tl.int64) * R
    lg_base = lg_ptr + col0.to(tl.int64) * R
    lu_base = lu_ptr + col0.to(tl.int64) * R
    for r0 in tl.range(0, R, BLOCK_R, num_stages=1):  # a few steps: no pipeline
        t = tl.load(t_base + (offs_m[:, None] * R + (r0 + offs_r)[None, :]))
        l_offs = (r0 + offs_r)[:, None] + offs_n[None, :] * R
        lg = tl.load(lg_base + l_offs)
        lu = tl.load(lu_base + l_offs)
        if UPCAST:
            t = t.to(tl.float32)
            lg = lg.to(tl.float32)
            lu = lu.to(tl.float32)
        acc_g = tl.dot(t, lg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(t, lu, acc_u, input_precision=PRECISION)
    return acc_g, acc_u


@triton.jit
def _gated_preacts(
    a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, e, row0, loop_m, loop_pid_m, pid_n, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_be, stride_biase, R,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERLEAVED: tl.constexpr,
    GROUPED: tl.constexpr, LORA: tl.constexpr,
):
    """(h_g, h_u) of the output tile ``_expert_tile`` or ``_dense_tile`` placed: one function for the forward
    and its recompute, so both compute the pre-activations alike, bit for bit. GROUPED (routed experts, one
    launch for all): expert e's rows, weights and biases. The coordinates stay the caller's, as ``_preact``'s
    do (torch's mutation analysis would count every operand of the call that produced a store's address as
    written)."""
    if GROUPED:
        a_ptr += row0.to(tl.int64) * stride_am
        bg_ptr += e * stride_be
        bu_ptr += e * stride_be
        biasg_ptr += e * stride_biase
        biasu_ptr += e * stride_biase
    hg, hu = _dual_mainloop(a_ptr, bg_ptr, bu_ptr, loop_m, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                            loop_pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST, INTERLEAVED)
    if LORA:  # dense, not interleaved (the launcher's check)
        hg, hu = _lora_mainloop(hg, hu, t_ptr, lg_ptr, lu_ptr, loop_m, N, R, loop_pid_m, pid_n, BLOCK_M, BLOCK_N,
                                LORA_BLOCK_R, PRECISION, UPCAST)
    if HAS_BIAS:
        col0 = pid_n * BLOCK_N
        hg = _add_bias(hg, biasg_ptr, N, col0, BLOCK_N)
        hu = _add_bias(hu, biasu_ptr, N, col0, BLOCK_N)
    return hg, hu


@triton.jit
def _gated_act_tile(
    tile, a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, c_ptr, seed, tiles_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase, R,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, LIMIT: tl.constexpr,
    LIMIT_AFTER: tl.constexpr, ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr, GATE_CAP: tl.constexpr,
    UP_CAP: tl.constexpr, GATE_SCALE: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERLEAVED: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, GROUPED: tl.constexpr, LORA: tl.constexpr,
):
    if GROUPED:
        pid_m, pid_n, e, row0, row_end, loop_m, loop_pid_m = _expert_tile(tile, tiles_ptr, N, MT, BLOCK_M, BLOCK_N,
                                                                          GROUP_M)
    else:
        pid_m, pid_n, e, row0, row_end, loop_m, loop_pid_m = _dense_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    hg, hu = _gated_preacts(a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, e, row0, loop_m,
                            loop_pid_m, pid_n, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_be,
                            stride_biase, R, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST,
                            INTERLEAVED, GROUPED, LORA)
    col0 = pid_n * BLOCK_N
    _gated_fwd_epilogue(hg, hu, c_ptr, seed, row0.to(tl.int64) * N + col0, row_end, N, row0, col0, 0,
                        drop_threshold,
                        drop_scale, ACTIVATION, NEG_SLOPE, LIMIT, LIMIT_AFTER, ALPHA, UP_OFFSET, GATE_CAP, UP_CAP,
                        GATE_SCALE,
                        DROPOUT, BLOCK_M,
                        BLOCK_N, EPILOGUE_SPLIT)


@triton.jit
def _clamp_max(v, LIMIT: tl.constexpr):
    # torch.clamp(max=LIMIT): a NaN stays NaN (a comparison with NaN is false)
    return tl.where(v > LIMIT, LIMIT, v)


@triton.jit
def _tanh(x):
    """tanh in fp32 within a few ulps (no libdevice tanh in the interpreter): an odd polynomial where |x| < 0.3
    (there 1 - exp(-2|x|) would cancel), (1 - e) / (1 + e) with e = exp(-2|x|) elsewhere; NaN stays NaN."""
    x2 = x * x
    near = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397
                                                                                     + x2 * 0.021869488536155203))))
    e = tl.exp(-2.0 * tl.abs(x))
    far = (1.0 - e) / (1.0 + e)
    return tl.where(tl.abs(x) < 0.3, near, tl.where(x < 0.0, -far, far))


@triton.jit
def _gate_fwd(h, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, ALPHA: tl.constexpr, GATE_CAP: tl.constexpr):
    """The gate's activation: ``lin(h) * sigmoid(h * ALPHA)`` with ALPHA or GATE_CAP (MiniMax-M3's and gpt-oss's glu,
    lin(h) = h; Inkling2's, lin(h) = GATE_CAP tanh(h / GATE_CAP), ALPHA 1 without one), else act(h)."""
    if GATE_CAP > 0.0 or ALPHA > 0.0:
        if ALPHA > 0.0:
            s = _sigmoid(h * ALPHA)
        else:
            s = _sigmoid(h)
        if GATE_CAP > 0.0:
            y = (GATE_CAP * _tanh(h / GATE_CAP)) * s
        else:
            y = h * s
    else:
        y = _act_fwd(h, ACTIVATION, NEG_SLOPE)
    return y


@triton.jit
def _gate_grad(h, g, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, ALPHA: tl.constexpr, GATE_CAP: tl.constexpr):
    if GATE_CAP > 0.0 or ALPHA > 0.0:  # autograd of lin(h) * sigmoid(h * a): g s lin'(h) + a (g lin(h)) s (1 - s)
        if ALPHA > 0.0:
            s = _sigmoid(h * ALPHA)
        else:
            s = _sigmoid(h)
        if GATE_CAP > 0.0:  # lin = cap t, lin' = 1 - t^2, t = tanh(h / cap)
            t = _tanh(h / GATE_CAP)
            gh_lin = (g * s) * (1.0 - t * t)
            gh_sig = (g * (GATE_CAP * t)) * (s * (1.0 - s))
        else:
            gh_lin = g * s
            gh_sig = (g * h) * (s * (1.0 - s))
        if ALPHA > 0.0:
            gh_sig = gh_sig * ALPHA
        gh = gh_lin + gh_sig
    else:
        gh = _act_grad(h, g, ACTIVATION, NEG_SLOPE)
    return gh


@triton.jit
def _clamped_operands(hg, hu, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, LIMIT: tl.constexpr,
                      LIMIT_AFTER: tl.constexpr, ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr, GATE_CAP: tl.constexpr,
                      UP_CAP: tl.constexpr, GATE_SCALE: tl.constexpr):
    """(act, h_u, keep_g, keep_u, h_g, du) of the gated product act * h_u: a SwiGLU clamp at LIMIT (0.0: none)
    of the gate, before its activation or (LIMIT_AFTER) after it, and of h_u to [-LIMIT, LIMIT], then h_u's
    softcap UP_CAP tanh(h_u / UP_CAP) (0.0: none) and + UP_OFFSET; keep_g, keep_u where the clamps pass a
    gradient (torch's clamp_backward: inside the bounds, not NaN); h_g the value the activation's derivative
    reads; du the softcap's derivative (1.0 without). h_g enters multiplied by GATE_SCALE (1.0: as it is)."""
    if GATE_SCALE != 1.0:  # Falcon-H1's gate multiplier, before everything else
        hg = hg * GATE_SCALE
    if LIMIT > 0.0:
        keep_u = (hu >= -LIMIT) & (hu <= LIMIT)
        hu = tl.where(hu < -LIMIT, -LIMIT, _clamp_max(hu, LIMIT))
        if LIMIT_AFTER:
            act = _gate_fwd(hg, ACTIVATION, NEG_SLOPE, ALPHA, GATE_CAP)
            keep_g = act <= LIMIT
            act = _clamp_max(act, LIMIT)
        else:
            keep_g = hg <= LIMIT
            hg = _clamp_max(hg, LIMIT)
            act = _gate_fwd(hg, ACTIVATION, NEG_SLOPE, ALPHA, GATE_CAP)
    else:
        act = _gate_fwd(hg, ACTIVATION, NEG_SLOPE, ALPHA, GATE_CAP)
        keep_g = act == act  # unused without a clamp
        keep_u = keep_g
    du = 1.0
    if UP_CAP > 0.0:
        t = _tanh(hu / UP_CAP)
        hu = UP_CAP * t
        du = 1.0 - t * t
    if UP_OFFSET != 0.0:
        hu = hu + UP_OFFSET
    return act, hu, keep_g, keep_u, hg, du


@triton.jit
def _gated_fwd_epilogue(hg, hu, c_ptr, seed, base, M, N, row0, col0, c0, drop_threshold, drop_scale,
                        ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, LIMIT: tl.constexpr,
                        LIMIT_AFTER: tl.constexpr, ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr,
                        GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr, GATE_SCALE: tl.constexpr, DROPOUT: tl.constexpr,
                        BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, SPLIT: tl.constexpr):
    """The product act(h_g) * h_u on columns [c0, c0 + WIDTH) of the tile, dropped out and stored, in SPLIT
    column slices one after the other (as the grad kernel's epilogue)."""
    if SPLIT > 1:
        hg0, hg1 = _column_halves(hg, BLOCK_M, WIDTH)
        hu0, hu1 = _column_halves(hu, BLOCK_M, WIDTH)
        _gated_fwd_epilogue(hg0, hu0, c_ptr, seed, base, M, N, row0, col0, c0, drop_threshold, drop_scale,
                            ACTIVATION, NEG_SLOPE, LIMIT, LIMIT_AFTER, ALPHA, UP_OFFSET, GATE_CAP, UP_CAP,
                            GATE_SCALE, DROPOUT,
                            BLOCK_M,
                            WIDTH // 2, SPLIT // 2)
        _gated_fwd_epilogue(hg1, hu1, c_ptr, seed, base, M, N, row0, col0, c0 + WIDTH // 2, drop_threshold,
                            drop_scale, ACTIVATION, NEG_SLOPE, LIMIT, LIMIT_AFTER, ALPHA, UP_OFFSET, GATE_CAP,
                            UP_CAP, GATE_SCALE, DROPOUT,
                            BLOCK_M, WIDTH // 2, SPLIT // 2)
    else:
        act, hu, _, _, _, _ = _clamped_operands(hg, hu, ACTIVATION, NEG_SLOPE, LIMIT, LIMIT_AFTER, ALPHA,
                                                UP_OFFSET, GATE_CAP, UP_CAP, GATE_SCALE)
        y = act * hu
        offs_m = tl.arange(0, BLOCK_M)
        if DROPOUT:  # T5 v1.1's dropout on the product, the dense FFN's mask function of (row, column)
            y = y * _dropout_factor(seed, row0 + offs_m, col0 + c0, drop_threshold, drop_scale, BLOCK_M, WIDTH)
        offs_n = c0 + tl.arange(0, WIDTH)
        mask = (offs_m[:, None] < M - row0) & (offs_n[None, :] < N - col0)
        tl.store(c_ptr + base + (offs_m[:, None] * N + offs_n[None, :]), y.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_act_kernel(
    a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, c_ptr, seed_ptr, tiles_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase, R,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, LIMIT: tl.constexpr,
    LIMIT_AFTER: tl.constexpr, ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr, GATE_CAP: tl.constexpr,
    UP_CAP: tl.constexpr, GATE_SCALE: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERLEAVED: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    PERSISTENT: tl.constexpr, GROUPED: tl.constexpr, LORA: tl.constexpr,
):
    seed = tl.load(seed_ptr) if DROPOUT else 0
    if PERSISTENT:  # the dense kernels' launch shape (_common.GEMM_PERSISTENT)
        num_m = MT if GROUPED else tl.cdiv(M, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_m * tl.cdiv(N, BLOCK_N), tl.num_programs(0), flatten=True):
            _gated_act_tile(tile, a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, c_ptr, seed,
                            tiles_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, drop_threshold,
                            drop_scale, MT, stride_be, stride_biase, R, HAS_BIAS, ACTIVATION, NEG_SLOPE, LIMIT, LIMIT_AFTER, ALPHA, UP_OFFSET,
                            GATE_CAP, UP_CAP, GATE_SCALE, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K,
                            PRECISION, UPCAST,
                            INTERLEAVED, EPILOGUE_SPLIT, GROUPED, LORA)
    else:
        _gated_act_tile(tl.program_id(0), a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, c_ptr,
                        seed, tiles_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, drop_threshold,
                        drop_scale, MT, stride_be, stride_biase, R, HAS_BIAS, ACTIVATION, NEG_SLOPE, LIMIT, LIMIT_AFTER, ALPHA, UP_OFFSET, GATE_CAP,
                        UP_CAP, GATE_SCALE, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, PRECISION, UPCAST,
                        INTERLEAVED,
                        EPILOGUE_SPLIT, GROUPED, LORA)


@triton.jit
def _gated_grad_epilogue(
    hg, hu, g_ptr, ghg_ptr, ghu_ptr, act_ptr, partg_ptr, partu_ptr, row_scale, base, pid_m, M, N, row0, col0, c0,
    seed, drop_threshold, drop_scale,
    HAS_BIAS: tl.constexpr, STORE_ACT: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
    LIMIT: tl.constexpr, LIMIT_AFTER: tl.constexpr, ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr,
    GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr, GATE_SCALE: tl.constexpr,
    DROPOUT: tl.constexpr, ROW_SCALE: tl.constexpr, INTERLEAVED: tl.constexpr, GH_HALVES: tl.constexpr,
    BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, SPLIT: tl.constexpr,
):
    """The grad kernel's epilogue on columns [c0, c0 + WIDTH) of its tile (hg, hu hold them), in SPLIT
    column slices one after the other (halving recursively, as the dense ``_grad_epilogue``: each
    slice's temporaries are live alone). Returns the slices' share of the routed experts' row dot
    a . g (zeros without ROW_SCALE).
    Where the weights' gate and up rows are one tensor's, g_hg and g_hu go to one (M, 2N) buffer in the same
    order (dX and a stacked dW are then one GEMM each): its alternating columns (INTERLEAVED: ghg_ptr the whole
    buffer, ghu_ptr unused) or the two halves of its rows (GH_HALVES, ghu_ptr N past ghg_ptr); else two (M, N)
    buffers."""
    if SPLIT > 1:
        hg0, hg1 = _column_halves(hg, BLOCK_M, WIDTH)
        hu0, hu1 = _column_halves(hu, BLOCK_M, WIDTH)
        dot0 = _gated_grad_epilogue(
            hg0, hu0, g_ptr, ghg_ptr, ghu_ptr, act_ptr, partg_ptr, partu_ptr, row_scale, base, pid_m, M, N, row0,
            col0, c0, seed, drop_threshold, drop_scale, HAS_BIAS, STORE_ACT, ACTIVATION, NEG_SLOPE, LIMIT,
            LIMIT_AFTER, ALPHA, UP_OFFSET, GATE_CAP, UP_CAP, GATE_SCALE, DROPOUT, ROW_SCALE, INTERLEAVED, GH_HALVES,
            BLOCK_M,
            WIDTH // 2, SPLIT // 2)
        dot1 = _gated_grad_epilogue(
            hg1, hu1, g_ptr, ghg_ptr, ghu_ptr, act_ptr, partg_ptr, partu_ptr, row_scale, base, pid_m, M, N, row0,
            col0, c0 + WIDTH // 2, seed, drop_threshold, drop_scale, HAS_BIAS, STORE_ACT, ACTIVATION, NEG_SLOPE,
            LIMIT, LIMIT_AFTER, ALPHA, UP_OFFSET, GATE_CAP, UP_CAP, GATE_SCALE, DROPOUT, ROW_SCALE, INTERLEAVED,
            GH_HALVES,
            BLOCK_M, WIDTH // 2, SPLIT // 2)
        return dot0 + dot1
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = c0 + tl.arange(0, WIDTH)
    mask_n = offs_n < N - col0
    mask = (offs_m[:, None] < M - row0) & mask_n[None, :]
    offs = base + (offs_m[:, None] * N + offs_n[None, :])
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # act and hu as the product reads them (clamped, with LIMIT); hg as the activation's derivative reads it
    act, hu, keep_g, keep_u, hg, du = _clamped_operands(hg, hu, ACTIVATION, NEG_SLOPE, LIMIT, LIMIT_AFTER, ALPHA,
                                                        UP_OFFSET, GATE_CAP, UP_CAP, GATE_SCALE)
    dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if ROW_SCALE:  # a routed expert's output scaled per row by r: g is the unscaled g_out Wd
        # d r = a . (g_out Wd): this slice's share of the row dot
        dot = tl.sum(tl.where(mask, act * hu * g, 0.0), axis=1)
        g = g * row_scale[:, None]
    if DROPOUT:  # the forward's mask, regenerated: a = dropout(act * hu) for dW_down, g through the mask
        factor = _dropout_factor(seed, row0 + offs_m, col0 + c0, drop_threshold, drop_scale, BLOCK_M, WIDTH)
        g = g * factor
        if STORE_ACT:
            tl.store(act_ptr + offs, (act * hu * factor).to(act_ptr.dtype.element_ty), mask=mask)
    elif ROW_SCALE and STORE_ACT:  # r a: dW_down = (r g_out)^T a = g_out^T (r a), the g_out rows read as they are
        tl.store(act_ptr + offs, (act * hu * row_scale[:, None]).to(act_ptr.dtype.element_ty), mask=mask)
    elif STORE_ACT:
        tl.store(act_ptr + offs, (act * hu).to(act_ptr.dtype.element_ty), mask=mask)
    ghu = g * act
    if UP_CAP > 0.0:
        ghu = ghu * du
    if LIMIT > 0.0:  # the clamps pass no gradient outside their bounds (torch's order: see reference)
        ghu = tl.where(keep_u, ghu, 0.0)
        if LIMIT_AFTER:
            ghg = _gate_grad(hg, tl.where(keep_g, g * hu, 0.0), ACTIVATION, NEG_SLOPE, ALPHA, GATE_CAP)
        else:
            ghg = tl.where(keep_g, _gate_grad(hg, g * hu, ACTIVATION, NEG_SLOPE, ALPHA, GATE_CAP), 0.0)
    else:
        ghg = _gate_grad(hg, g * hu, ACTIVATION, NEG_SLOPE, ALPHA, GATE_CAP)
    if GATE_SCALE != 1.0:  # h_g entered scaled (_clamped_operands)
        ghg = ghg * GATE_SCALE
    if INTERLEAVED:  # rows 2N long, columns 2n and 2n + 1
        offs_2 = 2 * c0 + tl.arange(0, 2 * WIDTH)
        mask_2 = (offs_m[:, None] < M - row0) & (offs_2[None, :] < 2 * (N - col0))
        tl.store(ghg_ptr + 2 * base + (offs_m[:, None] * (2 * N) + offs_2[None, :]),
                 tl.interleave(ghg, ghu).to(ghg_ptr.dtype.element_ty), mask=mask_2)
    elif GH_HALVES:  # rows 2N long
        gh_offs = (2 * base - col0) + (offs_m[:, None] * (2 * N) + offs_n[None, :])
        tl.store(ghg_ptr + gh_offs, ghg.to(ghg_ptr.dtype.element_ty), mask=mask)
        tl.store(ghu_ptr + gh_offs, ghu.to(ghu_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ghg_ptr + offs, ghg.to(ghg_ptr.dtype.element_ty), mask=mask)
        tl.store(ghu_ptr + offs, ghu.to(ghu_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        part = (pid_m.to(tl.int64) * N + col0) + offs_n
        tl.store(partg_ptr + part, tl.sum(tl.where(mask, ghg, 0.0), axis=0), mask=mask_n)
        tl.store(partu_ptr + part, tl.sum(tl.where(mask, ghu, 0.0), axis=0), mask=mask_n)
    return dot


@triton.jit
def _gated_act_grad_tile(
    tile, a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, g_ptr, ghg_ptr, ghu_ptr, act_ptr,
    partg_ptr, partu_ptr, seed, scale_ptr, dscale_ptr, tiles_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase, R,
    HAS_BIAS: tl.constexpr, STORE_ACT: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
    LIMIT: tl.constexpr, LIMIT_AFTER: tl.constexpr, ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr,
    GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr, GATE_SCALE: tl.constexpr,
    DROPOUT: tl.constexpr, ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERLEAVED: tl.constexpr,
    GH_HALVES: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr, GROUPED: tl.constexpr, LORA: tl.constexpr,
):
    # the forward's pre-activations, exactly as _gated_act_tile computes them
    if GROUPED:
        pid_m, pid_n, e, row0, row_end, loop_m, loop_pid_m = _expert_tile(tile, tiles_ptr, N, MT, BLOCK_M, BLOCK_N,
                                                                          GROUP_M)
    else:
        pid_m, pid_n, e, row0, row_end, loop_m, loop_pid_m = _dense_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    hg, hu = _gated_preacts(a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, e, row0, loop_m,
                            loop_pid_m, pid_n, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_be,
                            stride_biase, R, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST,
                            INTERLEAVED, GROUPED, LORA)
    col0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    rows = offs_m < row_end - row0
    row_scale = tl.load(scale_ptr + row0 + offs_m, mask=rows, other=0.0).to(tl.float32) if ROW_SCALE else 0.0
    dot = _gated_grad_epilogue(
        hg, hu, g_ptr, ghg_ptr, ghu_ptr, act_ptr, partg_ptr, partu_ptr, row_scale, row0.to(tl.int64) * N + col0,
        pid_m, row_end, N, row0, col0, 0, seed, drop_threshold, drop_scale, HAS_BIAS, STORE_ACT, ACTIVATION, NEG_SLOPE,
        LIMIT, LIMIT_AFTER, ALPHA, UP_OFFSET, GATE_CAP, UP_CAP, GATE_SCALE, DROPOUT, ROW_SCALE, INTERLEAVED,
        GH_HALVES, BLOCK_M,
        BLOCK_N, EPILOGUE_SPLIT)
    if ROW_SCALE:  # one partial of the row dot per column tile
        tl.store(dscale_ptr + (col0 // BLOCK_N).to(tl.int64) * M + row0 + offs_m, dot, mask=rows)


@triton.jit
def _gated_act_grad_kernel(
    a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, g_ptr, ghg_ptr, ghu_ptr, act_ptr, partg_ptr,
    partu_ptr, seed_ptr, scale_ptr, dscale_ptr, tiles_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase, R,
    HAS_BIAS: tl.constexpr, STORE_ACT: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
    LIMIT: tl.constexpr, LIMIT_AFTER: tl.constexpr, ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr,
    GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr, GATE_SCALE: tl.constexpr,
    DROPOUT: tl.constexpr, ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INTERLEAVED: tl.constexpr,
    GH_HALVES: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
    PERSISTENT: tl.constexpr, GROUPED: tl.constexpr, LORA: tl.constexpr,
):
    seed = tl.load(seed_ptr) if DROPOUT else 0
    if PERSISTENT:
        num_m = MT if GROUPED else tl.cdiv(M, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_m * tl.cdiv(N, BLOCK_N), tl.num_programs(0), flatten=True):
            _gated_act_grad_tile(
                tile, a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, g_ptr, ghg_ptr, ghu_ptr,
                act_ptr, partg_ptr, partu_ptr, seed, scale_ptr, dscale_ptr, tiles_ptr, M, N, K, stride_am, stride_ak,
                stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase, R, HAS_BIAS, STORE_ACT, ACTIVATION,
                NEG_SLOPE, LIMIT, LIMIT_AFTER, ALPHA, UP_OFFSET, GATE_CAP, UP_CAP, GATE_SCALE, DROPOUT, ROW_SCALE,
                BLOCK_M,
                BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, PRECISION, UPCAST, INTERLEAVED, GH_HALVES, EPILOGUE_SPLIT, GROUPED,
                LORA)
    else:
        _gated_act_grad_tile(
            tl.program_id(0), a_ptr, bg_ptr, bu_ptr, biasg_ptr, biasu_ptr, t_ptr, lg_ptr, lu_ptr, g_ptr, ghg_ptr,
            ghu_ptr, act_ptr, partg_ptr, partu_ptr, seed, scale_ptr, dscale_ptr, tiles_ptr, M, N, K, stride_am,
            stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase, R, HAS_BIAS, STORE_ACT, ACTIVATION,
            NEG_SLOPE, LIMIT, LIMIT_AFTER, ALPHA, UP_OFFSET, GATE_CAP, UP_CAP, GATE_SCALE, DROPOUT, ROW_SCALE,
            BLOCK_M, BLOCK_N,
            BLOCK_K, GROUP_M, EVEN_K, PRECISION, UPCAST, INTERLEAVED, GH_HALVES, EPILOGUE_SPLIT, GROUPED, LORA)


@triton.jit
def _lora_dropout_kernel(x_ptr, out_ptr, seed_ptr, M, C, stride_xm, threshold, scale,
                         BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """out = x * dropout factor of each (row, column) under the seed (``_dropout_factor``: the FFN's mask
    function), x (M, C) of unit column stride, out contiguous: a LoRA adapter's dropout on its input, drawn
    again alike in backward."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_C
    cols = col0 + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < M) & (cols[None, :] < C)
    x = tl.load(x_ptr + (rows[:, None].to(tl.int64) * stride_xm + cols[None, :]), mask=mask, other=0.0)
    factor = _dropout_factor(tl.load(seed_ptr), rows, col0, threshold, scale, BLOCK_M, BLOCK_C)
    tl.store(out_ptr + (rows[:, None].to(tl.int64) * C + cols[None, :]),
             (x.to(tl.float32) * factor).to(out_ptr.dtype.element_ty), mask=mask)


_LORA_DROPOUT_TILE = (32, 128)  # (BLOCK_M, BLOCK_C): 4096 elements a program, 4 warps


def lora_dropout(x, p, seed):
    """x (M, C) times its dropout factor under ``seed`` (a 1-element int64 tensor), a new tensor; x itself for
    p = 0 (``reference.GatedLoRA``'s ``drop``: the Triton backend's, the mask of ``reference.philox_keep``)."""
    if p == 0:
        return x
    if x.stride(1) != 1:
        x = x.contiguous()
    M, C = x.shape
    out = torch.empty((M, C), device=x.device, dtype=x.dtype)
    if x.numel() == 0:
        return out
    _, seed, threshold, scale = dropout_args((p, seed), x)
    bm, bc = _LORA_DROPOUT_TILE
    with _device_guard(x):
        launcher(_lora_dropout_kernel, x)[(cdiv(M, bm), cdiv(C, bc))](
            x, out, seed, M, C, x.stride(0), threshold, scale, BLOCK_M=bm, BLOCK_C=bc, num_warps=4)
    return out


# --------------------------------------------------------------------------- launchers
def _joint_rows(first, second):
    """``(kind, view)`` where ``first`` and ``second`` (R, C) are the rows of one (2R, C) view of one tensor:
    alternating (kind "interleaved": gpt-oss's gate_up_proj ``[0::2]`` and ``[1::2]``) or one after the other
    ("halves": ``[:R]`` and ``[R:]``, Mixtral's); else None. The weights so: the dual kernels read interleaved
    rows as one operand of 2 * BLOCK_N adjacent columns (contiguous in gpt-oss's transposed storage), and the
    grad kernel lays out g_hg and g_hu the same way, so dX is one GEMM on the joint rows and so is a stacked
    weight gradient (``input_grads``). One storage: views of one base (also while torch.compile traces: fake
    tensors have no data pointer), or, in a plain call, the same data pointer (views autograd kept no base of)."""
    if first.dim() != 2 or first.shape != second.shape or first.stride() != second.stride() \
            or first.dtype != second.dtype or first.numel() == 0:
        return None
    base = first._base
    if base is None or second._base is not base:
        plain = type(first) in (torch.Tensor, torch.nn.Parameter) and type(second) in (torch.Tensor, torch.nn.Parameter)
        if not plain or torch.compiler.is_compiling() \
                or first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
            return None
    (R, C), (rows, cols) = first.shape, first.stride()
    gap = second.storage_offset() - first.storage_offset()
    # row 2r of the interleaved view is first[r], row 2r + 1 second[r] (gap half a row stride); row R + r of
    # the halves' is second[r]: each view addresses exactly the two tensors' elements
    if R >= 2 and rows % 2 == 0 and gap == rows // 2:
        return "interleaved", first.as_strided((2 * R, C), (rows // 2, cols))
    if gap == R * rows and gap > 0:
        return "halves", first.as_strided((2 * R, C), (rows, cols))
    return None


def _dual_launch(x, w_gate, w_up, b_gate, b_up, config=None, dropout=None, groups=None, lora=None):
    """Operands, table entry, constexprs, grid and tile table of a launch of either dual kernel on x (M, K)
    and the (H, K) weights: one builder, so the forward and its recompute take the same tiles.
    ``lora``: None or ``(t, lg, lu)``, low-rank terms t lg^T and t lu^T added to the pre-activations (t (M, R),
    lg and lu (H, R), x's dtype; not with ``groups``).
    ``config`` overrides the tile (tile sweeps and tests only: callers that recompute must not).
    ``groups`` (``ExpertGroups``): every routed expert's rows in one launch, the tile the table's for the mean
    rows an expert gets; the table entry None otherwise."""
    M, K = x.shape
    N = w_gate.shape[0]
    precision = dot_precision(x)
    rows = M if groups is None else max(1, M // max(1, sum(1 for n in groups.counts if n)))
    cfg = config or _gated_table_config(rows, N, K, x.dtype, precision, device_capability(x),
                                        dropout=dropout is not None and dropout[0] != 0, grouped=groups is not None)
    a = _tile_safe(x, cfg.BLOCK_M, cfg.BLOCK_K, "x")
    joint = _joint_rows(w_gate, w_up)
    pair_t = joint[1].t() if joint is not None and joint[0] == "interleaved" and lora is None else None
    if pair_t is not None and _tile_safe(pair_t, cfg.BLOCK_K, 2 * cfg.BLOCK_N, "w_gate") is pair_t:
        bg = bu = pair_t  # one (K, 2H) operand: the kernel splits its columns
    else:
        pair_t = None
        bg = _tile_safe(w_gate.t(), cfg.BLOCK_K, cfg.BLOCK_N, "w_gate")
        bu = _tile_safe(w_up.t(), cfg.BLOCK_K, cfg.BLOCK_N, "w_up")
        if bg.stride() != bu.stride():  # one set of strides serves both B operands
            bg, bu = bg.contiguous(), bu.contiguous()
    # a grouped launch reads every expert's weights and biases through expert 0's: no copy of them
    assert groups is None or (bg.data_ptr() == w_gate.data_ptr() and (pair_t is not None or bu.data_ptr() == w_up.data_ptr())
                              and (b_gate is None) == (b_up is None)
                              and (b_gate is None or b_gate.is_contiguous() and b_up.is_contiguous())), \
        "grouped experts' weights must be views of the stacked tensors (ExpertGroups)"
    has_bias = b_gate is not None or b_up is not None
    if has_bias:  # a missing one of the two adds zeros: x + 0 is x
        b_gate = b_gate.contiguous() if b_gate is not None else torch.zeros_like(b_up)
        b_up = b_up.contiguous() if b_up is not None else torch.zeros_like(b_gate)
    else:
        b_gate = b_up = a
    has_dropout, seed, threshold, scale = dropout_args(dropout, a)
    assert groups is None or not has_dropout, "grouped experts with dropout"
    assert groups is None or lora is None, "grouped experts with low-rank terms"
    if lora is not None:  # rows of R contiguous elements, R padded with zeros as _lora_mainloop reads them
        t, lg, lu = lora
        assert t.shape == (M, lg.shape[1]) and lg.shape == lu.shape == (N, t.shape[1]) \
            and t.dtype == lg.dtype == lu.dtype == x.dtype, "low-rank terms' shapes or dtypes"
        pad = -t.shape[1] % _LORA_BLOCK_R
        t, lg, lu = (torch.nn.functional.pad(v, (0, pad)) if pad else v.contiguous() for v in (t, lg, lu))
        low_rank, rank = (t, lg, lu), t.shape[1]
    else:
        low_rank, rank = (a, a, a), 0
    if groups is None:
        tiles, num_m, strides = None, cdiv(M, cfg.BLOCK_M), (0, 0, 0)
    else:
        tiles, _, num_m = expert_tiles(groups.counts, cfg.BLOCK_M, x.device)
        strides = (num_m, groups.stride_w, groups.stride_b)
    grid, persistent = dense_grid(num_m * cdiv(N, cfg.BLOCK_N), a)
    run = _launch_config(cfg, persistent)
    meta = dict(
        HAS_BIAS=has_bias, DROPOUT=has_dropout, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        GROUP_M=cfg.GROUP_M, EVEN_K=K % cfg.BLOCK_K == 0, PRECISION=precision, UPCAST=_upcast_flag(a),
        INTERLEAVED=pair_t is not None, GROUPED=groups is not None, LORA=lora is not None,
        num_warps=cfg.num_warps, num_stages=run.num_stages, PERSISTENT=persistent, EPILOGUE_SPLIT=run.EPILOGUE_SPLIT,
    )
    scalars = (M, N, K, a.stride(0), a.stride(1), bg.stride(0), bg.stride(1), threshold, scale, *strides, rank)
    # an unused pointer argument is an input, never an output (see launcher)
    return cfg, (a, bg, bu, b_gate, b_up, *low_rank), seed, scalars, meta, grid, tiles if tiles is not None else a


def gated_act(x, w_gate, w_up, b_gate, b_up, activation, config=None, dropout=None, groups=None, lora=None):
    """a = act(x Wg^T + bg) * (x Wu^T + bu), (M, H) in x.dtype; the pre-activations are not stored.
    ``dropout``: None or ``(p, seed)``: dropout on the product, as the dense FFN's (``_dropout_factor``).
    ``lora``: None or ``(t, lg, lu)``, low-rank terms of the pre-activations (``_dual_launch``).
    ``groups`` (``ExpertGroups``): x's rows are routed experts' and each expert's rows take its weights."""
    M, H = x.shape[0], w_gate.shape[0]
    out = torch.empty((M, H), device=x.device, dtype=x.dtype)
    if M == 0 or H == 0:
        return out
    _, operands, seed, scalars, meta, grid, tiles = _dual_launch(x, w_gate, w_up, b_gate, b_up, config, dropout,
                                                                 groups, lora)
    if lora is not None and meta["EPILOGUE_SPLIT"] > 1:
        # the whole sm_90 16-bit tile with the rank loop: 255 registers in quarters (no spill, Triton 3.6-3.9), 205
        # in eighths (python -m fusedrc.inspect --kernel gated)
        meta["EPILOGUE_SPLIT"] = max(meta["EPILOGUE_SPLIT"], 8)
    with _device_guard(x):
        launcher(_gated_act_kernel, x)[grid](*operands, out, seed, tiles, *scalars, **gated_meta(activation),
                                             **meta)
    return out


def _gate_up_grads(x, H, kind):
    """Empty g_hg and g_hu (M, H) for the grad kernel, and the buffer the kernel writes them through: with
    ``kind`` ("halves" or "interleaved") views of one (M, 2H) buffer whose rows are laid out as the weights' joint
    rows are (``_joint_rows``), else two buffers. ``(g_hg, g_hu, (ghg_ptr, ghu_ptr))``: interleaved, the kernel
    stores both through the whole buffer (its one output argument: a traced launch's functionalization copies
    back the elements of the arguments it writes through, so a view of half of them would lose the other half)
    and ghu_ptr is None (the caller passes an input there)."""
    if kind is None:
        ghg = torch.empty((x.shape[0], H), device=x.device, dtype=x.dtype)
        ghu = torch.empty_like(ghg)
        return ghg, ghu, (ghg, ghu)
    gh = torch.empty((x.shape[0], 2 * H), device=x.device, dtype=x.dtype)
    if kind == "interleaved":
        return gh[:, 0::2], gh[:, 1::2], (gh, None)
    ghg, ghu = gh[:, :H], gh[:, H:]
    return ghg, ghu, (ghg, ghu)


def gated_act_grad(x, w_gate, w_up, b_gate, b_up, grad_a, activation, store_act=True, config=None, dropout=None,
                   row_scale=None, groups=None, lora=None):
    """Recompute both pre-activations in tiles; return (g_hg, g_hu, a or None, dbg or None, dbu or None).
    With ``dropout`` (as given to ``gated_act``) ``grad_a`` is the gradient of dropout(act(h_g) * h_u)
    and the stored product is dropped out too.

    ``row_scale`` (M,): the product's rows scale by it downstream (a routed expert's weights, no
    dropout); ``grad_a`` is then the unscaled gradient, the g_h's and the stored product are scaled (its
    rows r_m a_m: dW_down = g_out^T (r a) needs no scaled copy of g_out), and a sixth value is returned: the
    gradient of ``row_scale``, a_m . grad_a_m per row (fp32).

    Where the weights' rows are one tensor's (``_joint_rows``) g_hg and g_hu are views of one (M, 2H) buffer laid
    out the same way, for ``input_grads``.

    ``groups`` (``ExpertGroups``, as given to ``gated_act``): one launch for every routed expert; the biases'
    gradients are then (E, H), each expert's column sums over its row tiles."""
    M, H = x.shape[0], w_gate.shape[0]
    act = torch.empty((M, H), device=x.device, dtype=x.dtype) if store_act else None
    routed = row_scale is not None
    assert not (routed and dropout is not None and dropout[0]), "row_scale with dropout"

    if M == 0 or H == 0:
        out = *_gate_up_grads(x, H, None)[:2], act, *(tile_bias_grad(None, b, H, groups) for b in (b_gate, b_up))
        return out + (torch.zeros(M, device=x.device, dtype=torch.float32),) if routed else out
    cfg, operands, seed, scalars, meta, grid, tiles = _dual_launch(x, w_gate, w_up, b_gate, b_up, config, dropout,
                                                                   groups, lora)
    num_m, tile_lengths = cdiv(M, cfg.BLOCK_M), None
    if groups is not None:
        _, tile_lengths, num_m = expert_tiles(groups.counts, cfg.BLOCK_M, x.device)
    joint = _joint_rows(w_gate, w_up)
    halves = joint is not None and joint[0] == "halves"  # lora or not: the g_h's lay out as the weights' rows
    # an interleaved pair the kernel cannot read as one operand (misaligned) gets two buffers
    ghg, ghu, (ghg_arg, ghu_arg) = _gate_up_grads(x, H, "interleaved" if meta["INTERLEAVED"] else
                                                  "halves" if halves else None)
    parts = [torch.empty((num_m, H), device=x.device, dtype=torch.float32)
             for _ in range(2)] if meta["HAS_BIAS"] else [None, None]
    dscale = torch.empty((cdiv(H, cfg.BLOCK_N), M), device=x.device, dtype=torch.float32) if routed else None
    grad_a = grad_a.contiguous()
    fill = operands[0]  # an unused pointer argument is an input, never an output (see launcher)
    act_args = gated_meta(activation)
    shaped = act_args["LIMIT"] or act_args["GATE_CAP"] or act_args["UP_CAP"]
    meta["EPILOGUE_SPLIT"] = _clamp_split(meta["EPILOGUE_SPLIT"], cfg.BLOCK_N, shaped,
                                          meta["INTERLEAVED"] and meta["HAS_BIAS"],
                                          softcap=bool(act_args["GATE_CAP"] or act_args["UP_CAP"]))
    if groups is not None and meta["INTERLEAVED"] and meta["HAS_BIAS"]:
        # grouped gpt-oss experts (the halved tile): in one piece their epilogue spilled 360 bytes on sm_90 under
        # Triton 3.6; in halves none (3.6 and 3.9)
        meta["EPILOGUE_SPLIT"] = max(meta["EPILOGUE_SPLIT"], 2)
    with _device_guard(x):
        launcher(_gated_act_grad_kernel, x)[grid](
            *operands, grad_a, ghg_arg, ghu_arg if ghu_arg is not None else fill, act if act is not None else fill,
            parts[0] if parts[0] is not None else fill, parts[1] if parts[1] is not None else fill, seed,
            row_scale.contiguous() if routed else fill, dscale if routed else fill, tiles,
            *scalars, STORE_ACT=store_act, ROW_SCALE=routed, GH_HALVES=halves, **act_args, **meta,
        )
    # tiny fixed-order reductions over cdiv(M, BLOCK_M) rows (cdiv(H, BLOCK_N) for dscale): deterministic
    out = ghg, ghu, act, *(tile_bias_grad(p, b, H, groups, tile_lengths) for p, b in zip(parts, (b_gate, b_up)))
    return out + (dscale.sum(0),) if routed else out


def _low_rank(x, lora):
    """The dual kernels' ``lora`` argument, ``(t, gate, up)`` with t = drop(x) a^T, or None (``reference.GatedLoRA``)."""
    t = lora_rank_input(x, lora, lora_dropout)
    return None if t is None else (t, lora.gate, lora.up)


def gated_mlp_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, dropout_p=0.0, seed=None,
                      lora=None):
    """out = dropout(act(x Wg^T + bg) * (x Wu^T + bu)) Wd^T + bd; x (M, K), Wg/Wu (H, K), Wd (N, H);
    ``seed`` a 1-element int64 tensor when ``dropout_p > 0``; ``lora`` (``reference.GatedLoRA``): low-rank terms
    of the projections, those of the gate and up inside the dual kernel's tiles."""
    assert x.dim() == 2, "gated_mlp_forward expects a 2-D x"
    split_gated(activation)
    a = gated_act(x, w_gate, w_up, b_gate, b_up, activation, dropout=(dropout_p, seed), lora=_low_rank(x, lora))
    return lora_down_output(plain_gemm(a, w_down.t(), bias=b_down), a, lora, lora_dropout)  # never rerun: cuBLAS


def gated_mlp_backward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, grad_out, activation, dropout_p=0.0, seed=None,
                       output_mask=None, lora=None):
    """Returns (dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down); a bias's gradient is None
    when the bias is None; with ``lora`` the gradients of its five terms after them (``output_mask`` then
    holds 12). A gradient ``output_mask`` masks off is None and the work only it
    needs is skipped: a frozen W_down drops dW_down and the store of a; when nothing left of
    the gate and up layers needs a gradient, the forward's kernel rebuilds a alone."""
    assert x.dim() == 2, "gated_mlp_backward expects a 2-D x"
    split_gated(activation)
    need = wanted(output_mask, 7 if lora is None else 12)
    need_dx, need_dwg, need_dbg, need_dwu, need_dbu, need_dwd, need_dbd = need[:7]
    need_la, need_lg, need_lu, need_lda, need_ldb = need[7:] or (False,) * 5
    need_a = need_dwd or need_lda or need_ldb
    db_down = grad_out.sum(0, dtype=torch.float32).to(b_down.dtype) if b_down is not None and need_dbd else None
    low_rank = _low_rank(x, lora)
    if not (need_dx or need_dwg or need_dwu or (need_dbg and b_gate is not None) or (need_dbu and b_up is not None)
            or need_la or need_lg or need_lu):
        a = gated_act(x, w_gate, w_up, b_gate, b_up, activation, dropout=(dropout_p, seed),
                      lora=low_rank) if need_a else None
        dw_down = plain_gemm(grad_out.t(), a, out_dtype=w_down.dtype) if need_dwd else None
        _, d_down_a, d_down_b = lora_down_grads(grad_out, a, lora, need_lda, need_ldb, lora_dropout)
        lora_grads = () if lora is None else (None, None, None, d_down_a, d_down_b)
        return (None, None, None, None, None, dw_down, db_down, *lora_grads)
    grad_a = plain_gemm(grad_out, w_down, out_dtype=x.dtype)          # (M, N) @ (N, H)
    u = lora_down_grads(grad_out, None, lora, False, False)[0]
    if u is not None:  # the down side's low-rank term: grad_a += drop((grad_out down_b) down_a)
        lora_down_input_grad(grad_a, u, lora, lora_dropout)
    ghg, ghu, a, dbg, dbu = gated_act_grad(x, w_gate, w_up, b_gate, b_up, grad_a, activation, store_act=need_a,
                                           dropout=(dropout_p, seed), lora=low_rank)
    del grad_a
    dw_down = plain_gemm(grad_out.t(), a, out_dtype=w_down.dtype) if need_dwd else None  # (N, M) @ (M, H)
    _, d_down_a, d_down_b = lora_down_grads(grad_out, a, lora, need_lda, need_ldb, lora_dropout, u)
    del a
    dx, dw_gate, dw_up = input_grads(x, w_gate, w_up, ghg, ghu, need_dx, need_dwg, need_dwu)
    dx_low, d_a, d_gate, d_up = lora_input_grads(x, ghg, ghu, low_rank and low_rank[0], lora, need_dx, need_la,
                                                 need_lg, need_lu, lora_dropout)
    if dx_low is not None:
        dx += dx_low
    dx = dx.to(x.dtype) if dx is not None else None
    grads = (dx, dw_gate, dbg if need_dbg else None, dw_up, dbu if need_dbu else None, dw_down, db_down)
    return grads if lora is None else (*grads, d_a, d_gate, d_up, d_down_a, d_down_b)


def input_grads(x, w_gate, w_up, ghg, ghu, need_dx, need_dwg, need_dwu, out=(None, None), dx_out=None):
    """(dX = g_hg Wg + g_hu Wu, dWg = g_hg^T x, dWu = g_hu^T x), None where not needed; dX in fp32 on the Triton
    GEMM, x's dtype on cuBLAS. ``out``: where to write dWg and dWu (views into stacked gradients, or None);
    ``dx_out``: where to write dX (a routed expert's rows of the fp32 slots), where its dtype is the GEMM's.
    Where the weights' rows and the g_h's columns are one tensor's, laid out alike (``gated_act_grad`` makes
    them so), dX is one GEMM over the 2H joint rows, and so are both weight gradients where ``out`` holds two
    such rows of one stacked gradient: one launch each instead of two, no sum of two partial dX."""
    joint = _joint_rows(w_gate, w_up)
    grads = _joint_rows(ghg.t(), ghu.t()) if joint is not None else None
    if grads is None or grads[0] != joint[0]:
        joint = grads = None
    gh = grads[1].t() if grads is not None else None                  # (M, 2H)
    if not need_dx:
        dx = None
    elif gh is not None:
        aten = uses_aten_gemm(gh, w_up)
        dx = plain_gemm(gh, joint[1], out_dtype=None if aten else torch.float32, out=None if aten else dx_out)
    elif uses_aten_gemm(ghu, w_up):
        dx = torch.mm(ghg, w_gate).addmm_(ghu, w_up)
    else:
        dx = plain_gemm(ghg, w_gate, out_dtype=torch.float32, out=dx_out)
        dx += plain_gemm(ghu, w_up, out_dtype=torch.float32)
    dw_out = _joint_rows(*out) if gh is not None and need_dwg and need_dwu and out[0] is not None else None
    if dw_out is not None and dw_out[0] == joint[0]:
        plain_gemm(gh.t(), x, out_dtype=w_gate.dtype, out=dw_out[1])   # (2H, M) @ (M, K)
        return dx, out[0], out[1]
    dw_gate = plain_gemm(ghg.t(), x, out_dtype=w_gate.dtype, out=out[0]) if need_dwg else None  # (H, M) @ (M, K)
    dw_up = plain_gemm(ghu.t(), x, out_dtype=w_up.dtype, out=out[1]) if need_dwu else None
    return dx, dw_gate, dw_up


# --------------------------------------------------------------------------- ahead-of-time inspection
def inspect_specs():
    """One spec per distinct compile of the two dual kernels for the sm90/sm80 dense table entries
    (``gated_config``: whole or BLOCK_N halved): fp16 and bf16 for "16bit" entries, fp32 for the others;
    activation "gelu", biases on, EVEN_K, STORE_ACT on (as ``gated_mlp_backward`` launches it); bf16
    also with dropout on the product (config ``"dropout": true``: T5 v1.1's), and sm_90 bf16 entries
    persistent (``_common.GEMM_PERSISTENT``; config ``"persistent": true``); the grad kernel of the
    widest sm_90 bf16 entry also with the routed experts' row scale (config ``"row_scale": true``), and so with the
    SwiGLU clamp variants and gpt-oss's experts (biases, strided interleaved weights)."""
    specs, seen = [], {}
    kernels = ((_gated_act_kernel, "_gated_act_kernel"), (_gated_act_grad_kernel, "_gated_act_grad_kernel"))
    for (family, opclass, bucket), entry in _TABLE.items():
        arch = _INSPECT_ARCH.get(family)
        if arch is None:
            continue
        if opclass == "16bit":
            variants = [(torch.float16, "ieee"), (torch.bfloat16, "ieee")]
        else:
            variants = [(torch.float32, "tf32" if opclass == "tf32" else "ieee")]
        persistence = (False, True) if arch == "sm_90" and opclass == "16bit" else (False,)
        for (kernel, name), (dtype, precision), dropout, persistent in itertools.product(
                kernels, variants, (False, True), persistence):
            if (dropout or persistent) and dtype != torch.bfloat16 or dropout and persistent:
                continue
            # as _gated_table_config chooses: whole where _WHOLE says, except with dropout
            entry_key = (family, opclass, bucket)
            cfg = _launch_config(gated_config(_NARROW.get(entry_key) or entry, None if dropout else entry_key),
                                 persistent)
            split = cfg.EPILOGUE_SPLIT
            key = (name, arch, dtype, precision, cfg, dropout, persistent)
            label = f"{family}/{opclass}/{bucket}"
            if key in seen:
                seen[key]["source"] += "," + label
                continue
            ptr = _TRITON_PTR[dtype]
            names = ["a_ptr", "bg_ptr", "bu_ptr", "biasg_ptr", "biasu_ptr", "t_ptr", "lg_ptr", "lu_ptr"]
            if kernel is _gated_act_kernel:
                names += ["c_ptr"]
            else:
                names += ["g_ptr", "ghg_ptr", "ghu_ptr", "act_ptr"]
            sig = {n: ptr for n in names}
            if kernel is _gated_act_grad_kernel:
                sig.update(partg_ptr="*fp32", partu_ptr="*fp32")
            sig["seed_ptr"] = "*i64"
            if kernel is _gated_act_grad_kernel:
                sig.update(scale_ptr="*fp32", dscale_ptr="*fp32")
            sig["tiles_ptr"] = ptr  # unused: a launch passes x there
            aligned = list(sig) + ["M", "N", "K", "stride_am", "stride_bn"]
            sig.update({"M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_ak": "constexpr",
                        "stride_bk": "constexpr", "stride_bn": "i32", "drop_threshold": "i32", "drop_scale": "fp32",
                        "MT": "i32", "stride_be": "i32", "stride_biase": "i32", "R": "i32"})
            constexprs = {
                "stride_ak": 1, "stride_bk": 1, "HAS_BIAS": True, "ACTIVATION": "gelu", "NEG_SLOPE": 0.0,
                "LIMIT": 0.0, "LIMIT_AFTER": False, "ALPHA": 0.0, "UP_OFFSET": 0.0, "GATE_CAP": 0.0, "UP_CAP": 0.0,
                "GATE_SCALE": 1.0,
                "DROPOUT": dropout,
                "BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N, "BLOCK_K": cfg.BLOCK_K, "GROUP_M": cfg.GROUP_M,
                "EVEN_K": True, "PRECISION": precision, "UPCAST": False, "INTERLEAVED": False,
                "PERSISTENT": persistent, "GROUPED": False, "LORA": False,
            }
            constexprs["EPILOGUE_SPLIT"] = split
            if kernel is _gated_act_grad_kernel:
                constexprs.update(STORE_ACT=True, ROW_SCALE=False, GH_HALVES=False)
            for c in constexprs:
                sig[c] = "constexpr"
            config = {"BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N, "BLOCK_K": cfg.BLOCK_K,
                      "GROUP_M": cfg.GROUP_M, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            if dtype == torch.float32:
                config["input_precision"] = precision
            config["EPILOGUE_SPLIT"] = split
            if dropout:
                config["dropout"] = True
            if persistent:
                config["persistent"] = True
            spec = {
                "fn": kernel, "kernel": name, "arch": arch, "dtype": dtype, "config": config,
                "signature": sig, "constexprs": constexprs, "num_warps": cfg.num_warps,
                "num_stages": cfg.num_stages, "gemm": True, "aligned": aligned, "source": label,
            }
            seen[key] = spec
            specs.append(spec)
    # the routed experts' variant (row scale and its gradient in the epilogue), one sm_90 bf16 entry
    # (the widest tile: the most registers)
    base = max((sp for sp in specs if sp["kernel"] == "_gated_act_grad_kernel" and sp["arch"] == "sm_90"
                and sp["dtype"] == torch.bfloat16 and not sp["constexprs"]["DROPOUT"]
                and not sp["constexprs"]["PERSISTENT"]),
                key=lambda sp: sp["config"]["BLOCK_M"] * sp["config"]["BLOCK_N"])
    # as moe_experts launches it: SwiGLU, no bias, the scales a slice at any offset, any row count
    routed = {**base, "constexprs": {**base["constexprs"], "ROW_SCALE": True, "HAS_BIAS": False, "ACTIVATION": "silu",
                                     "GH_HALVES": True},
              "config": {**base["config"], "row_scale": True},
              "aligned": [a for a in base["aligned"] if a not in ("scale_ptr", "M")]}
    specs.insert(0, routed)
    # DeepSeek-V4's SwiGLU clamp: its experts (the routed variant) and its shared MLP (the widest forward and grad
    # entries), the clamp before the activation and, for the grad, after it (Step-3.7's)
    fwd = max((sp for sp in specs if sp["kernel"] == "_gated_act_kernel" and sp["arch"] == "sm_90"
               and sp["dtype"] == torch.bfloat16 and not sp["constexprs"]["DROPOUT"]
               and not sp["constexprs"]["PERSISTENT"]),
               key=lambda sp: sp["config"]["BLOCK_M"] * sp["config"]["BLOCK_N"])
    # and MiniMax-M3's experts: the clamp, the gate's alpha and the up offset
    variants = ((routed, False, 0.0), (base, False, 0.0), (base, True, 0.0), (fwd, False, 0.0), (routed, False, 1.702),
                (fwd, False, 1.702))
    for i, (spec, after, alpha) in enumerate(variants):
        split = spec["constexprs"]["EPILOGUE_SPLIT"]
        if spec is not fwd:  # as gated_act_grad launches it
            split = _clamp_split(split, spec["constexprs"]["BLOCK_N"], 10.0)
        extra = {"ALPHA": alpha, "UP_OFFSET": 1.0} if alpha else {}
        specs.insert(1 + i, {**spec, "constexprs": {**spec["constexprs"], "LIMIT": 10.0, "LIMIT_AFTER": after,
                                                    "EPILOGUE_SPLIT": split, **extra},
                             "config": {**spec["config"], "limit": 10.0, "EPILOGUE_SPLIT": split,
                                        **({"limit_after": True} if after else {}),
                                        **({"alpha": alpha, "up_offset": 1.0} if alpha else {})}})
    # Inkling2's experts: its softcapped SwiGLU (gate cap 4, up cap 25), the routed grad kernel and the widest forward
    for spec in (routed, fwd):
        split = spec["constexprs"]["EPILOGUE_SPLIT"]
        if spec is routed:  # as gated_act_grad launches it
            split = _clamp_split(split, spec["constexprs"]["BLOCK_N"], 4.0, softcap=True)
        constexprs = {**spec["constexprs"], "GATE_CAP": 4.0, "UP_CAP": 25.0, "EPILOGUE_SPLIT": split}
        specs.insert(len(variants) + 1, {**spec, "constexprs": constexprs, "config": {
            **spec["config"], "gate_softcap": 4.0, "up_softcap": 25.0, "EPILOGUE_SPLIT": split}})
    # Falcon-H1's gate multiplier (its 0.88), the widest grad and forward entries
    for spec in (base, fwd):
        specs.insert(len(variants) + 1, {**spec, "constexprs": {**spec["constexprs"], "GATE_SCALE": 0.8838834764831843},
                                         "config": {**spec["config"], "gate_scale": 0.8838834764831843}})
    # gpt-oss's experts: biases, its gate (limit 7, alpha 1.702, up + 1) and its interleaved gate/up rows of
    # transposed weights, one operand of 2 * BLOCK_N contiguous columns (stride_bn 1, stride_bk the row length);
    # the routed grad kernel and the widest forward
    for i, spec in enumerate((routed, fwd)):
        constexprs = {k: v for k, v in spec["constexprs"].items() if k != "stride_bk"}
        split = constexprs["EPILOGUE_SPLIT"]
        if spec is routed:
            split = _clamp_split(split, constexprs["BLOCK_N"], 7.0, interleaved_bias=True)
        constexprs.update(HAS_BIAS=True, LIMIT=7.0, ALPHA=1.702, UP_OFFSET=1.0, INTERLEAVED=True, stride_bn=1,
                          EPILOGUE_SPLIT=split, **({"GH_HALVES": False} if spec is routed else {}))
        specs.insert(len(variants) + 1 + i, {
            **spec, "signature": {**spec["signature"], "stride_bk": "i32", "stride_bn": "constexpr"},
            "constexprs": constexprs, "aligned": [a for a in spec["aligned"] if a != "stride_bn"] + ["stride_bk"],
            "config": {**spec["config"], "limit": 7.0, "alpha": 1.702, "up_offset": 1.0, "bias": True,
                       "interleaved": True, "EPILOGUE_SPLIT": split}})
    # grouped launches (every routed expert's rows in one launch, GROUPED's tile table) as moe_experts makes them,
    # on the widest halved tile (_gated_table_config): the routed grad kernel with SwiGLU (and with gpt-oss's gate,
    # biases and interleaved rows) and the forward with SwiGLU, no bias
    def halved(name):  # the dropout launches' tile: the entry halved
        spec = max((sp for sp in specs if sp["kernel"] == name and sp["arch"] == "sm_90"
                    and sp["dtype"] == torch.bfloat16 and sp["constexprs"]["DROPOUT"]),
                   key=lambda sp: sp["config"]["BLOCK_M"] * sp["config"]["BLOCK_N"])
        config = {k: v for k, v in spec["config"].items() if k != "dropout"}
        return {**spec, "signature": {**spec["signature"], "tiles_ptr": "*i32"},
                "constexprs": {**spec["constexprs"], "DROPOUT": False, "ACTIVATION": "silu",
                               "HAS_BIAS": False, "GROUPED": True},
                "config": {**config, "grouped": True}}
    grad, forward = halved("_gated_act_grad_kernel"), halved("_gated_act_kernel")
    grad["constexprs"].update(ROW_SCALE=True, GH_HALVES=True)
    grad["config"]["row_scale"] = True
    grad["aligned"] = [a for a in grad["aligned"] if a not in ("scale_ptr", "M")]
    gpt_oss = {**grad, "signature": {**grad["signature"], "stride_bk": "i32", "stride_bn": "constexpr"},
               "constexprs": {**{k: v for k, v in grad["constexprs"].items() if k != "stride_bk"}, "HAS_BIAS": True,
                              "LIMIT": 7.0, "ALPHA": 1.702, "UP_OFFSET": 1.0, "INTERLEAVED": True, "GH_HALVES": False,
                              "stride_bn": 1},
               "aligned": [a for a in grad["aligned"] if a != "stride_bn"] + ["stride_bk"],
               "config": {**grad["config"], "limit": 7.0, "alpha": 1.702, "up_offset": 1.0, "bias": True,
                          "interleaved": True}}
    gpt_oss["constexprs"]["EPILOGUE_SPLIT"] = gpt_oss["config"]["EPILOGUE_SPLIT"] = 2  # as gated_act_grad splits it
    specs += [grad, gpt_oss, forward]
    # LoRA adapters' low-rank terms in the tiles (Llama's MLP under PEFT): SwiGLU, no bias, the widest sm_90 bf16
    # grad and forward entries (the terms fresh tensors: aligned; the rank any)
    for spec in (base, fwd):
        split = spec["constexprs"]["EPILOGUE_SPLIT"]
        if spec is fwd and split > 1:  # as gated_act launches it
            split = max(split, 8)
        specs.append({**spec, "constexprs": {**spec["constexprs"], "LORA": True, "HAS_BIAS": False,
                                             "ACTIVATION": "silu", "EPILOGUE_SPLIT": split},
                      "config": {**spec["config"], "lora": True, "EPILOGUE_SPLIT": split}})
    # the LoRA dropout's elementwise kernel, every arch and 16-bit dtype (its fp32 math is the same)
    bm, bc = _LORA_DROPOUT_TILE
    for arch, dtype in itertools.product(_INSPECT_ARCH.values(), (torch.float16, torch.bfloat16)):
        sig = {"x_ptr": _TRITON_PTR[dtype], "out_ptr": _TRITON_PTR[dtype], "seed_ptr": "*i64", "M": "i32",
               "C": "i32", "stride_xm": "i32", "threshold": "i32", "scale": "fp32"}
        specs.append({"fn": _lora_dropout_kernel, "kernel": "_lora_dropout_kernel", "arch": arch, "dtype": dtype,
                      "config": {"BLOCK_M": bm, "BLOCK_C": bc, "num_warps": 4, "num_stages": 1},
                      "signature": sig, "constexprs": {"BLOCK_M": bm, "BLOCK_C": bc}, "num_warps": 4,
                      "num_stages": 1, "gemm": False, "aligned": ["x_ptr", "out_ptr", "seed_ptr", "C", "stride_xm"],
                      "source": f"{arch}/lora_dropout"})
    return specs
