"""Conv2d + BatchNorm2d + activation (+ residual): implicit-GEMM Triton kernels and launchers.

The activation is any of the dense kernels' (``ACTIVATION``: relu, relu2, gelu, gelu_tanh, silu, relu6,
hardswish, quick_gelu, leaky_relu with its ``NEG_SLOPE``; the epilogue functions of fusedrc/kernels/_common.py);
ReLU below stands for it.

Shapes: x (N, C_in, H, W) in any strides (NCHW, channels_last, ...), weight
(C_out, C_in / groups, KH, KW). With groups=1 the convolution is an implicit GEMM:
M = N*OH*OW output pixels, N = C_out, K = KH*KW*C_in, iterated in one flat loop
over (tap, C_in block) with tap = (kh, kw) outer and the channel block inner,
fp32 accumulator, ``tl.dot``. Every tensor is read through its strides. A layer with at most
``FLAT_K_MAX_CHANNELS`` input channels (a stem's 3) walks K = (kh, kw, c) as one flat index
instead (``FLAT_K``): one tap's 3 channels would fill 3 of tl.dot's 16 K-rows per step.
Grouped convolutions with a multiple of 16 output channels per group run the implicit
GEMM per group: BLOCK_N divides the group's output channels, so a tile's columns read one
group's input channels (``group_strategy``). Opt-in (``DIRECT_MAX_GROUP_CHANNELS``, 0 by
default: slower than the reference path on an H200), groups up to that many input channels
take the same passes with a direct conv in place of the implicit GEMM (``DIRECT``: fp32 FMA
over taps x the group's channels, same tile shape, so every epilogue below is shared).
dX/dW of any grouped conv are aten's grouped conv backward.

Forward (training), DESIGN §4:
  1. ``_conv_bn_fwd_kernel`` (STATS, STORE_Z): conv tile, + conv bias, rounded to
     x.dtype (z = what torch's conv2d would hand to BatchNorm), stored to a
     transient z; its epilogue writes per-tile, per-channel partials (tile mean,
     tile M2 = sum of squared deviations from the tile mean).
  2. ``_bn_stats_finalize_kernel``: Chan's parallel combination of the partials,
     M2 = sum_t [M2_t + n_t (mean_t - mean)^2], deterministic (no atomics);
     mean and rstd = 1/sqrt(var + eps) (biased variance).
  3. ``_conv_bn_fwd_kernel`` (FROM_Z, APPLY): reads z, normalizes + affine
     (+ residual) + ReLU, writes y. z is freed on return.
  ``FWD_RECOMPUTE = True`` instead recomputes the conv in step 3 (no z buffer:
  two convs, no z traffic); eval mode is always a single conv kernel with the
  BN/ReLU epilogue (running statistics known up front).

Backward, DESIGN §4 (the conv is recomputed tile by tile with the forward's tile
configuration and K order, so z, hence the pre-activation and the ReLU mask,
are bit-identical; the normalization is one explicit ``fma`` in every kernel):
  ``BWD_RECOMPUTE_TWICE = True`` (default, strictly fused):
    pass 1 ``_conv_bn_bwd_kernel`` (REDUCE): recompute z, g = relu'(pre) * grad_out,
      per-tile partial sums of g and g*xhat (-> dbeta, dgamma), dresidual = g;
    pass 2 ``_conv_bn_bwd_kernel`` (EMIT_DZ): recompute z again, emit
      dz = gamma*rstd*(g - sum(g)/n - xhat*sum(g*xhat)/n) in x.dtype and per-tile
      partial sums of dz (-> conv bias gradient).
    z and xhat never reach memory; dz (an operand of the two conv-backward GEMMs) does.
  ``BWD_RECOMPUTE_TWICE = False``: pass 1 also stores z (one transient buffer),
    pass 2 reads z instead of recomputing the conv (elementwise).
  ``"auto"`` (either switch): per layer, whichever a roofline estimate calls cheaper
    (``_rerun_beats_buffer``); opt-in until measured.
  Eval mode: one pass (dz = gamma*rstd*g does not need the reductions first).
  ``CONV_Z`` (below) replaces the Triton conv of these passes, in both directions, by cuDNN's
  into a transient z buffer (the passes then read z): the default on a GPU with 16-bit operands,
  where it measured faster; the strictly fused passes above are ``CONV_Z = "triton"``, and the CPU's.
  Then dX = ``_conv_dx_kernel`` (transposed conv as an implicit GEMM over the input
  pixels, K = KH*KW*C_out; for stride > 1 the taps that do not land on an output
  pixel are masked, so (stride_h*stride_w - 1)/(stride_h*stride_w) of its MMA
  work is on zeros) and dW = ``_conv_dw_kernel`` (implicit GEMM over K = N*OH*OW
  pixels, split-K into fp32 partials reduced in a fixed order: deterministic).
  ``CONV_GRAD = "aten"`` (the default, measured faster on an H100) runs dX/dW as
  ``aten.convolution_backward`` (cuDNN): a backward convolution of dz, not a rerun
  of the forward; ``"triton"`` runs the two kernels above.

All partial reductions go through per-tile buffers reduced in a fixed order: no
atomics anywhere, results are bitwise repeatable. Tile configurations come from
the fixed table below (no autotuning). Groups wider than ``DIRECT_MAX_GROUP_CHANNELS``
channels (by default: every grouping) with a number of output channels per group that is no
multiple of 16 (depthwise convs among them), float64,
empty tensors and samples past 32-bit offsets run the reference implementation
(fusedrc.reference), which is correct.
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (
    _I32_MAX, _act_fwd, _act_grad, _arch_family, _column_halves, _device_guard, _reference, _sm_count, _upcast_flag,
    LaunchPlans, act_meta, cdiv, check_activation, device_capability, dot_precision, interpreting, launch, launcher,
    operand_class, plan_key, release_tuned, release_tuning, tf32_matmul_allowed, wanted,
)

__all__ = ["conv_bn_act_forward", "conv_bn_act_backward", "conv_config", "update_running_stats_"]

# Strategy switches (module level: the launchers' signatures are fixed). Every setting gives
# the same results; they exist to be measured on a GPU per shape. "auto" decides per layer
# with the cost model of ``_rerun_beats_buffer`` (DESIGN §4: "measure both ... pick per shape").
FWD_RECOMPUTE = False        # training forward: False = transient z buffer, True = run the conv twice
BWD_RECOMPUTE_TWICE = True   # training backward: True = two recomputes, False = one recompute + transient z
# Flops per byte at which the implicit-GEMM conv turns compute-bound, per operand class: sm_90
# estimates (~400 TFLOP/s of 16-bit MMA, ~150 of tf32, ~40 of fp32 FMA in a Triton kernel,
# ~3 TB/s of HBM3). Only "auto" reads them.
_RIDGE = {"16bit": 130.0, "tf32": 50.0, "fp32": 13.0}
# Where z (the conv output) comes from when a pass needs it: "triton" (the implicit-GEMM kernels
# above, with the BN/ReLU work in their epilogues: z never reaches memory in the backward) or "aten"
# (aten.convolution, cuDNN on a GPU, into a transient buffer in the forward and the backward; the
# kernels then run as elementwise + reduction passes over it, FROM_Z). "aten" trades two extra passes
# over z per direction for cuDNN's GEMM speed. "auto" (the default) decides per layer, as measured
# (groups = 1; a grouped conv keeps the Triton conv, its setting before the measurement):
# on a GPU with 16-bit operands, "aten" (H100, bf16, ResNet-50's 16 layer shapes at batch 256,
# channels_last, GPU time of CUDA-graph replays: 0.81x checkpoint's step as a geometric mean against
# the Triton conv's 1.15x; slower only on two 1x1 layers, by under 2%; conv_tradeoff_graph_cuda_20261127-*.json);
# on a GPU with fp32 operands (not measured), "aten" where the roofline calls the conv compute-bound
# (``_aten_conv_pays``); on the CPU (Triton's interpreter, no cuDNN to win with), "triton".
# Forward and backward must see the same setting: each computes z its own way, and the ReLU mask of
# the backward must match the forward's bit for bit.
CONV_Z = "auto"
# dX / dW: "aten" (aten.convolution_backward: cuDNN on a GPU) or "triton" (_conv_dx/_conv_dw
# kernels). Measured on an H100 (bf16, ResNet-50 shapes, benchmarks/results/conv_tradeoff_*.json):
# cuDNN's wgrad took 21 us where _conv_dw_kernel took 650 us at 32x64x56x56, so aten is the default.
CONV_GRAD = "aten"


# --------------------------------------------------------------------------- tile table
class ConvConfig(NamedTuple):
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int
    # The forward's normalize/ReLU epilogue and the backward kernel's epilogue on 1, 2 or 4 column
    # slices of the tile, one after the other (as the dense grad kernel's, fusedrc/kernels/_common.py):
    # fewer registers live at once.
    EPILOGUE_SPLIT: int = 1


# (arch family, operand class, width bucket) -> config. Operand classes: "16bit"
# (fp16/bf16), "tf32" (fp32, tf32 allowed), "fp32" (fp32 "ieee", FMA units).
# Width bucket: the GEMM's N (C_out for the conv) <= 64 -> "narrow". Shared memory
# per stage (BM + BN) * BK * bytes fits each family (sm90: 227 KiB, sm80: 163 KiB,
# others ~99 KiB); sm_90 HGMMA wants BLOCK_M >= 64 and num_warps % 4 == 0.
# Starting points: retune offline on the GPU and commit. Never autotuned at run
# time: the forward and the backward recompute must read the same entry.
_TABLE = {
    # Epilogue register pressure bounds the tile: the backward's epilogue (BN, ReLU mask,
    # residual, several 64-bit offset tensors) spills beyond ~32 accumulator elements per
    # thread, so 128x128 on 8 warps (and 128x64 on 4 warps) spills on sm_90 unsplit. Hence
    # 128x64 on 8 warps (two warpgroups, HGMMA) for both widths. The 7th field splits the
    # backward's epilogue (EPILOGUE_SPLIT; fusedrc.inspect, bf16, sm_90 128x64: reduce /
    # emit_dz / eval 168 / 185 / 176 registers unsplit, 100 / 128 / 124 in quarters, the forward's
    # apply pass 158 -> 80, so two CTAs fit an SM; 128x128 stops spilling from halves on, in
    # both directions). small_smem: not compiled there.
    ("sm90", "16bit", "narrow"): ConvConfig(128, 64, 64, 8, 8, 4, 4),
    ("sm90", "16bit", "wide"): ConvConfig(128, 64, 64, 8, 8, 4, 4),
    ("sm90", "tf32", "narrow"): ConvConfig(128, 64, 32, 8, 8, 3, 4),
    ("sm90", "tf32", "wide"): ConvConfig(128, 64, 32, 8, 8, 3, 4),
    # fp32 on FMA units: BLOCK_K 16 (operands live in registers; 32 spills)
    ("sm90", "fp32", "narrow"): ConvConfig(64, 64, 16, 8, 4, 2, 2),
    ("sm90", "fp32", "wide"): ConvConfig(64, 64, 16, 8, 4, 2, 2),
    # sm_80: Triton 3.6 (the GPU image's) spills the backward kernel at 128x64 on 4 warps and
    # 128x128 on 8 (56-232 bytes), and the tf32 dX kernel at BLOCK_K 32 (8 bytes); 3.9 does not.
    # 128x64 on 8 warps and tf32 BLOCK_K 16 compile without spills under both.
    ("sm80", "16bit", "narrow"): ConvConfig(128, 64, 32, 8, 8, 4, 4),
    ("sm80", "16bit", "wide"): ConvConfig(128, 64, 64, 8, 8, 3, 4),
    ("sm80", "tf32", "narrow"): ConvConfig(64, 64, 16, 8, 4, 3, 4),
    ("sm80", "tf32", "wide"): ConvConfig(128, 64, 16, 8, 8, 3, 4),
    ("sm80", "fp32", "narrow"): ConvConfig(64, 64, 16, 8, 4, 2, 2),
    ("sm80", "fp32", "wide"): ConvConfig(64, 64, 16, 8, 4, 2, 2),
    ("small_smem", "16bit", "narrow"): ConvConfig(64, 64, 32, 8, 4, 3),
    ("small_smem", "16bit", "wide"): ConvConfig(128, 64, 32, 8, 4, 3),
    ("small_smem", "tf32", "narrow"): ConvConfig(64, 64, 32, 8, 4, 2),
    ("small_smem", "tf32", "wide"): ConvConfig(64, 64, 32, 8, 4, 2),
    ("small_smem", "fp32", "narrow"): ConvConfig(64, 64, 16, 8, 4, 2),
    ("small_smem", "fp32", "wide"): ConvConfig(64, 64, 16, 8, 4, 2),
}
# Elementwise passes over z (normalize in the forward, dz in the buffered backward).
_ELEM_CONFIG = ConvConfig(64, 64, 16, 1, 4, 1, 2)  # halves: unsplit, from_z spills 8 bytes (sm_90 fp16)
# Interpreter (CPU): tiny tiles so the tiny test shapes cover several tiles,
# ragged edges and K loops.
_INTERPRETER_CONFIG = ConvConfig(16, 16, 16, 2, 4, 1, 2)  # the split epilogue; the elementwise one is not split
_INTERPRETER_ELEM_CONFIG = ConvConfig(16, 16, 16, 1, 4, 1)
# Grouped convolutions (DIRECT: FMA, no tensor cores; BLOCK_K unused) on every architecture: plain
# depthwise (one channel per group in and out, which the JIT folds to constants) at 64 channels of
# 2 bytes, a 128-byte row of a channels_last tensor; any other grouping (several channels per group,
# or a depthwise channel multiplier: runtime group widths) at a half-wide tile (fusedrc.inspect, bf16:
# 120-128 registers in the passes with an epilogue, 218-255 at 64x64). No software pipelining
# (num_stages 1): the loads are gathers, not dot operands. Starting points, unmeasured.
_DIRECT_CONFIG = ConvConfig(64, 64, 16, 8, 4, 1, 2)
_DIRECT_GROUPED_CONFIG = ConvConfig(64, 32, 16, 8, 4, 1, 2)
# Channels per group up to which a grouped conv runs the DIRECT kernels (opt-in). Wider groups whose
# output channels per group are a multiple of GROUPED_GEMM_MIN_N run the implicit GEMM per group (a
# tile's columns inside one group, the group's input channels its K: tensor cores); the rest the
# reference implementation (aten's grouped conv, cuDNN on CUDA). Off (0) since it was measured
# (H200, bf16, batch 256, channels_last, conv_tradeoff_grouped_cuda_20261126-040216.json): at 32 the
# DIRECT kernels took 1.08-1.53x checkpoint's step on EfficientNet-B0's depthwise layers, where the
# reference path took 0.86-1.04x, and 14-21x on ResNeXt-50's grouped 3x3 (4-16 channels a group),
# where the reference path / per-group GEMM took 0.93-1.35x. Their one gain is a lower peak (the conv
# output never held in backward: 590 against 784 MiB on the 112x112 depthwise layer).
DIRECT_MAX_GROUP_CHANNELS = 0
GROUPED_GEMM_MIN_N = 16  # tl.dot's smallest N


def group_strategy(weight, groups: int):
    """How a conv layer's tiles compute z: "gemm" (the implicit GEMM; groups=1, or one group's
    slice per tile), "direct" (FMA over the group's channels), or None (the reference path)."""
    if groups == 1:
        return "gemm"
    in_per_group, out_per_group = weight.shape[1], weight.shape[0] // groups
    if in_per_group <= DIRECT_MAX_GROUP_CHANNELS:
        return "direct"
    if out_per_group % GROUPED_GEMM_MIN_N == 0:
        return "gemm"
    return None


def _group_tile(cfg: ConvConfig, out_per_group: int) -> ConvConfig:
    """cfg with BLOCK_N the largest power of 2 up to its own that divides the group's output
    channels (a tile never straddles two groups), and an epilogue split no finer than 16 columns."""
    block_n = cfg.BLOCK_N
    while out_per_group % block_n:
        block_n //= 2
    return cfg._replace(BLOCK_N=block_n, EPILOGUE_SPLIT=max(1, min(cfg.EPILOGUE_SPLIT, block_n // 16)))


def direct_config(in_per_group: int, out_per_group: int, capability) -> ConvConfig:
    """Tile of the grouped (DIRECT) kernels for a conv with these channels per group; the forward and
    the backward recompute read the same."""
    if capability is None:
        return _INTERPRETER_CONFIG
    return _direct_tuned(_DIRECT_CONFIG if in_per_group == out_per_group == 1 else _DIRECT_GROUPED_CONFIG,
                         _arch_family(capability))


def _direct_tuned(cfg: ConvConfig, family: str) -> ConvConfig:
    """A DIRECT tile with the epilogue split ``_RELEASE_TUNING`` (fusedrc/kernels/_common.py) sets for it under
    the installed Triton (a value-free choice)."""
    return release_tuned(cfg, "conv_direct", family, cfg.BLOCK_M, cfg.BLOCK_N)


def _clamp_k(block_k: int, k_per_tap: int) -> int:
    # K per filter tap is a channel count: do not pad 3 channels to a 64-wide step.
    # tl.dot needs K >= 16.
    pow2 = 1 << (max(k_per_tap, 1) - 1).bit_length()  # next power of 2 (triton's costs ~2 us a call)
    return max(16, min(block_k, pow2))


def conv_config(gemm_n: int, k_per_tap: int, dtype, precision: str, capability, flat: bool = False) -> ConvConfig:
    """Tile configuration of an implicit-GEMM conv; a pure function of its arguments.

    The forward and the backward recompute call it with the same arguments, hence
    run the same BLOCK_M/N/K, K order and warps: the recomputed z is bit-identical.
    ``flat``: for the flat K loop (FLAT_K), which may take another epilogue split under
    the installed Triton (``_RELEASE_TUNING``'s "conv_flat_k" sites).
    """
    if capability is None:
        cfg = _INTERPRETER_CONFIG
    else:
        bucket = "narrow" if gemm_n <= 64 else "wide"
        key = (_arch_family(capability), operand_class(dtype, precision), bucket)
        cfg = release_tuned(_TABLE[key], "conv_flat_k", *key) if flat else _TABLE[key]
    return cfg._replace(BLOCK_K=_clamp_k(cfg.BLOCK_K, k_per_tap))


# Layers of groups=1 with at most this many input channels (a stem's 3 colour channels) walk the
# implicit GEMM's K as one flat (kh, kw, c) index (FLAT_K), BLOCK_K of it per step, rather than tap
# by tap with each tap's few channels padded to tl.dot's 16: a 7x7 stem on 3 channels takes 3
# steps of 64 instead of 49 of 16. 8 channels or fewer: at least half of each padded step is zeros.
# 0 turns it off.
FLAT_K_MAX_CHANNELS = 8


def flat_k(weight, groups: int) -> bool:
    """Whether the layer's implicit GEMM takes the flat K loop (``FLAT_K_MAX_CHANNELS``)."""
    return groups == 1 and weight.shape[1] <= FLAT_K_MAX_CHANNELS


def layer_config(weight, groups: int, dtype, precision: str, capability) -> ConvConfig:
    """The tile of a conv layer's passes: the DIRECT one for a DIRECT grouped conv, the table's
    otherwise (for a grouped GEMM narrowed to one group's columns; with the flat K loop, BLOCK_K
    clamped to the whole K). The forward and the backward recompute both take it here, hence the
    same tile and K order."""
    C_out, C_in = weight.shape[:2]  # C_in per group
    if group_strategy(weight, groups) == "direct":
        return direct_config(C_in, C_out // groups, capability)
    if flat_k(weight, groups):
        return conv_config(C_out, C_in * weight.shape[2] * weight.shape[3], dtype, precision, capability, flat=True)
    cfg = conv_config(C_out // groups, C_in, dtype, precision, capability)
    return cfg if groups == 1 else _group_tile(cfg, C_out // groups)


def _roofline(x, weight, M: int, precision: str):
    """(the conv's flops in byte-time units (flops / ridge), bytes of x + weights, bytes of z)
    for M output pixels: the terms of the two cost models below."""
    C_out, C_in, KH, KW = weight.shape  # C_in per group
    elt = x.element_size()
    direct = group_strategy(weight, x.shape[1] // C_in) == "direct"
    opclass = "fp32" if direct else operand_class(x.dtype, precision)  # DIRECT: FMA
    compute = 2.0 * M * C_out * C_in * KH * KW / _RIDGE[opclass]
    return compute, (x.numel() + weight.numel()) * elt, M * C_out * elt


def _rerun_beats_buffer(x, weight, M: int, precision: str) -> bool:
    """Whether running the conv once more costs less than a transient z buffer (one write and
    one read of the conv output): the rerun costs its flops or, when memory-bound, reading x and
    the weights, whichever bounds it. M = output pixels. A roofline estimate, not a measurement."""
    compute, operands, z = _roofline(x, weight, M, precision)
    return max(compute, operands) < 2.0 * z


def _strategy(flag, x, weight, M: int, precision: str) -> bool:
    return _rerun_beats_buffer(x, weight, M, precision) if flag == "auto" else bool(flag)


def _aten_conv_pays(x, weight, M: int, precision: str) -> bool:
    """Whether z is better computed by aten.convolution (cuDNN) into a buffer: where the conv is
    compute-bound, the GEMM engine's speed dominates the extra z traffic. A roofline guess (an
    H100 profile at 32x64x56x56, 3x3: cuDNN's conv took 51 us where the Triton pass took 90 us)."""
    compute, operands, z = _roofline(x, weight, M, precision)
    return compute > operands + z


def _auto_z_from_aten(device_type: str, opclass: str, compute_bound) -> bool:
    """CONV_Z="auto": z from cuDNN on a GPU, for 16-bit operands always (measured), for fp32 where
    ``compute_bound()`` (a roofline guess); never on the CPU (the interpreter's runs)."""
    return device_type != "cpu" and (opclass == "16bit" or compute_bound())


def _z_from_aten(x, weight, M: int, precision: str) -> bool:
    if CONV_Z not in ("triton", "aten", "auto"):
        raise ValueError(f"fusedrc.kernels.conv_bn_act.CONV_Z: expected 'triton', 'aten' or 'auto', got {CONV_Z!r}")
    if CONV_Z == "auto":
        # groups = 1 only: grouped and depthwise layers were not measured (their previous default stays)
        return x.shape[1] == weight.shape[1] and _auto_z_from_aten(
            x.device.type, operand_class(x.dtype, precision), lambda: _aten_conv_pays(x, weight, M, precision))
    return CONV_Z == "aten"


def _aten_z(x, weight, bias, stride, padding, dilation, like):
    """z = conv2d(x, weight, bias) by aten, laid out like ``like`` (the kernels read z with its strides)."""
    groups = x.shape[1] // weight.shape[1]
    z = torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, False, [0, 0], groups)
    return z if z.stride() == like.stride() else z.contiguous(memory_format=_memory_format(like))


def conv_plan(x, weight, M: int, precision: str) -> tuple:
    """(z from aten, forward reruns the conv, backward reruns it twice) for this layer: the switches
    above resolved. With z from aten, both directions buffer z (no Triton conv runs)."""
    if _z_from_aten(x, weight, M, precision):
        return True, False, False
    return (False, _strategy(FWD_RECOMPUTE, x, weight, M, precision),
            _strategy(BWD_RECOMPUTE_TWICE, x, weight, M, precision))


def _elem_config(capability) -> ConvConfig:
    return _INTERPRETER_ELEM_CONFIG if capability is None else _ELEM_CONFIG


# --------------------------------------------------------------------------- jit helpers
@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row tiles in a row share their B tiles in L2."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % size_m)
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _split_pixels(p, H, W):
    """Flat pixel indices p = (n, h, w) of an (N, ., H, W) tensor -> n, h, w."""
    hw = H * W
    n = p // hw
    r = p - n * hw
    h = r // W
    return n, h, r - h * W


@triton.jit
def _pix_offsets(offs_m, OH, OW, s_n, s_h, s_w):
    """64-bit offsets of output pixels m = (n, oh, ow) in a tensor with strides (s_n, ., s_h, s_w)."""
    n, oh, ow = _split_pixels(offs_m, OH, OW)
    return n.to(tl.int64) * s_n + (oh * s_h + ow * s_w)


@triton.jit
def _tile_coords(x_ptr, row0, col0, M, C_OUT, OH, OW, s_xn, SH: tl.constexpr, SW: tl.constexpr,
                 PH: tl.constexpr, PW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A conv tile's output pixels and channels: (row mask, first input row and column of each
    pixel's window, each pixel's sample base in x, the channels, their mask)."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    n, oh, ow = _split_pixels(offs_m, OH, OW)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    return offs_m < M, oh * SH - PH, ow * SW - PW, x_ptr + n.to(tl.int64) * s_xn, offs_n, offs_n < C_OUT


@triton.jit
def _dot_step(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b, the operands through fp32 under the interpreter's bf16 (UPCAST)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _conv_mainloop(
    x_ptr, w_ptr, row0, col0, M, C_OUT, C_IN, H, W, OH, OW,
    s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, FLAT_K: tl.constexpr,
    pre_mean_ptr, pre_scale_ptr, pre_shift_ptr,
    PRE_ACT: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
):
    """fp32 tile z[row0:row0+BM, col0:col0+BN] of the conv as an implicit GEMM.

    Rows are output pixels, columns output channels. K runs in one flat loop in a
    fixed order: taps (kh, kw) row-major, inside each tap C_in in BLOCK_K steps.
    Padding, ragged rows/channels: masked loads of zeros.
    FLAT_K (few input channels: a stem's 3): K = (kh, kw, c) as one index, BLOCK_K of it per
    step, each element's tap and channel computed, instead of one tap per step padded to
    tl.dot's 16 channels (7x7x3: 3 steps of 64 instead of 49 of 16).
    PRE_ACT: the conv's input is act(bn(x)), made from each loaded x tile (``_pre_act``) with the
    per-input-channel (mean, scale, shift); the padding stays 0 (it pads the activation).
    """
    mask_m, ih0, iw0, x_rows, offs_n, mask_n = _tile_coords(x_ptr, row0, col0, M, C_OUT, OH, OW, s_xn,
                                                            SH, SW, PH, PW, BLOCK_M, BLOCK_N)
    w_cols = w_ptr + offs_n * s_wo
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FLAT_K:
        k_total = KH * KW * C_IN
        for k0 in range(0, k_total, BLOCK_K):
            k = k0 + offs_k
            tap = k // C_IN
            c = k - tap * C_IN
            kh = tap // KW
            kw = tap - kh * KW
            ok_k = k < k_total
            ih = ih0[:, None] + (kh * DH)[None, :]
            iw = iw0[:, None] + (kw * DW)[None, :]
            ok = (mask_m[:, None] & ok_k[None, :]) & ((ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))
            a = tl.load(x_rows[:, None] + (ih * s_xh + iw * s_xw + (c * s_xc)[None, :]), mask=ok, other=0.0)
            if PRE_ACT:
                pm, ps, pt = _channel_vectors(pre_mean_ptr, pre_scale_ptr, pre_shift_ptr, c, ok_k)
                a = _pre_act(a, ok, pm, ps, pt, ACTIVATION, NEG_SLOPE)
            b = tl.load(w_cols[None, :] + (kh * s_wh + kw * s_ww + c * s_wc)[:, None],
                        mask=ok_k[:, None] & mask_n[None, :], other=0.0)
            acc = _dot_step(a, b, acc, PRECISION, UPCAST)
        return acc
    n_cblk = tl.cdiv(C_IN, BLOCK_K)
    for it in range(0, KH * KW * n_cblk):
        tap = it // n_cblk
        c0 = (it - tap * n_cblk) * BLOCK_K
        kh = tap // KW
        kw = tap - kh * KW
        ih = ih0 + kh * DH
        iw = iw0 + kw * DW
        ok_m = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        c = c0 + offs_k
        ok_c = c < C_IN
        ok = ok_m[:, None] & ok_c[None, :]
        a = tl.load(x_rows[:, None] + (ih * s_xh + iw * s_xw)[:, None] + c[None, :] * s_xc, mask=ok, other=0.0)
        if PRE_ACT:
            pm, ps, pt = _channel_vectors(pre_mean_ptr, pre_scale_ptr, pre_shift_ptr, c, ok_c)
            a = _pre_act(a, ok, pm, ps, pt, ACTIVATION, NEG_SLOPE)
        b = tl.load(w_cols[None, :] + (kh * s_wh + kw * s_ww) + c[:, None] * s_wc,
                    mask=ok_c[:, None] & mask_n[None, :], other=0.0)
        acc = _dot_step(a, b, acc, PRECISION, UPCAST)
    return acc


@triton.jit
def _bn_act(xf, mean, scale, shift, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr):
    """act(bn(x)) in fp32 from per-channel (mean, scale = rstd * gamma, shift = beta) broadcast to
    xf's shape: one explicit fma, the same in every kernel (the backward's activation mask is the
    forward's, bit for bit)."""
    return _act_fwd(tl.fma(xf - mean, scale, shift), ACTIVATION, NEG_SLOPE)


@triton.jit
def _channel_vectors(mean_ptr, scale_ptr, shift_ptr, c, ok_c):
    """Channels ``c``'s (mean, scale, shift) as (1, len(c)) rows, broadcast over a tile's pixels."""
    mean = tl.load(mean_ptr + c, mask=ok_c, other=0.0)[None, :]
    scale = tl.load(scale_ptr + c, mask=ok_c, other=0.0)[None, :]
    shift = tl.load(shift_ptr + c, mask=ok_c, other=0.0)[None, :]
    return mean, scale, shift


@triton.jit
def _pre_act(a, ok, mean, scale, shift, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr):
    """A loaded x tile (rows: pixels, columns: channels) as the conv's input act(bn(x)), rounded to
    x's dtype as eager hands it to the conv; 0 where ``ok`` is off (padding, ragged edges)."""
    return tl.where(ok, _bn_act(a.to(tl.float32), mean, scale, shift, ACTIVATION, NEG_SLOPE), 0.0).to(a.dtype)


@triton.jit
def _direct_conv_mainloop(
    x_ptr, w_ptr, row0, col0, M, C_OUT, C_IN, C_OUT_G, H, W, OH, OW,
    s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """fp32 tile z[row0:row0+BM, col0:col0+BN] of a grouped conv by direct fp32 FMA.

    C_IN input channels per group (the weight's dim 1), C_OUT_G output channels per group:
    column co reads input channels (co // C_OUT_G) * C_IN + [0, C_IN). A few channels per
    group leave a tensor core nothing to do (depthwise: K = KH*KW), so each tap is a gather of
    x and one fma per element. One flat loop in a fixed order (taps row-major, the group's
    channels inside; nested loops kept a (BM, BN) address tensor live: 255 registers) and an
    explicit fma: every kernel that recomputes z gets the forward's bits.
    """
    mask_m, ih0, iw0, x_rows, offs_n, mask_n = _tile_coords(x_ptr, row0, col0, M, C_OUT, OH, OW, s_xn,
                                                            SH, SW, PH, PW, BLOCK_M, BLOCK_N)
    x_cols = (offs_n // C_OUT_G) * C_IN * s_xc
    w_cols = w_ptr + offs_n * s_wo
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(0, KH * KW * C_IN):
        tap = it // C_IN
        c = it - tap * C_IN
        kh = tap // KW
        kw = tap - kh * KW
        ih = ih0 + kh * DH
        iw = iw0 + kw * DW
        ok = (mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))[:, None] & mask_n[None, :]
        a = tl.load((x_rows + (ih * s_xh + iw * s_xw))[:, None] + (x_cols + c * s_xc)[None, :], mask=ok, other=0.0)
        b = tl.load(w_cols + (kh * s_wh + kw * s_ww + c * s_wc), mask=mask_n, other=0.0)
        acc = tl.fma(a.to(tl.float32), b.to(tl.float32)[None, :], acc)
    return acc


@triton.jit
def _conv_z(
    x_ptr, w_ptr, bias_ptr, z_ptr, o_offs, mask, row0, col0, offs_n, mask_n,
    M, C_OUT, C_IN, C_OUT_G, H, W, OH, OW, s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, DIRECT: tl.constexpr,
    FLAT_K: tl.constexpr, FROM_Z: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_Z: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """The tile's conv output z in fp32: read from the z buffer (FROM_Z), or computed (+ conv bias)
    and rounded to x's dtype, as torch's conv2d hands it to BatchNorm (stored too with STORE_Z).
    The forward and every backward pass compute z here: the recompute is the forward's, bit for bit."""
    if FROM_Z:
        zf = tl.load(z_ptr + o_offs, mask=mask, other=0.0).to(tl.float32)
    else:
        if DIRECT:
            acc = _direct_conv_mainloop(x_ptr, w_ptr, row0, col0, M, C_OUT, C_IN, C_OUT_G, H, W, OH, OW,
                                        s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo,
                                        KH, KW, SH, SW, PH, PW, DH, DW, BLOCK_M, BLOCK_N)
        else:
            # a grouped GEMM's tile lies inside one group (C_OUT_G % BLOCK_N == 0): that group's
            # input channels; groups=1 passes C_OUT_G = C_OUT, offset 0
            acc = _conv_mainloop(x_ptr + (col0 // C_OUT_G) * C_IN * s_xc, w_ptr, row0, col0, M, C_OUT, C_IN,
                                 H, W, OH, OW,
                                 s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo,
                                 KH, KW, SH, SW, PH, PW, DH, DW, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST,
                                 FLAT_K, x_ptr, x_ptr, x_ptr, False, "relu", 0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        zq = acc.to(x_ptr.dtype.element_ty)
        if STORE_Z:
            tl.store(z_ptr + o_offs, zq, mask=mask)
        zf = zq.to(tl.float32)
    return zf


@triton.jit
def _channel_params(mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, offs_n, mask_n,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per-channel fp32 mean, rstd, gamma (1 without affine), beta (0 without affine)."""
    mean = tl.load(mean_ptr + offs_n, mask=mask_n, other=0.0)
    rstd = tl.load(rstd_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_W:
        gamma = tl.load(gamma_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    else:
        gamma = tl.full((BLOCK_N,), 1.0, tl.float32)
    if HAS_B:
        beta = tl.load(beta_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    else:
        beta = tl.full((BLOCK_N,), 0.0, tl.float32)
    return mean, rstd, gamma, beta


@triton.jit
def _bn_pre(zf, mean, rstd, gamma, beta):
    """BN output (before residual/act): one explicit fma, identical in every kernel.

    (x*1 and fma(a, b, 0) are exact, so the no-affine case needs no other branch.)
    """
    return tl.fma(zf - mean[None, :], (rstd * gamma)[None, :], beta[None, :])


# --------------------------------------------------------------------------- forward kernels
@triton.jit
def _conv_bn_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, z_ptr, y_ptr, res_ptr,
    mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, pmean_ptr, pm2_ptr,
    M, C_OUT, C_IN, C_OUT_G, H, W, OH, OW,
    s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo,
    s_on, s_oc, s_oh, s_ow,       # z and y (same layout)
    s_rn, s_rc, s_rh, s_rw,       # residual
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, DIRECT: tl.constexpr,
    FLAT_K: tl.constexpr, FROM_Z: tl.constexpr, HAS_BIAS: tl.constexpr, STATS: tl.constexpr, STORE_Z: tl.constexpr,
    APPLY: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, C_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < C_OUT
    mask = mask_m[:, None] & mask_n[None, :]
    o_offs = _pix_offsets(offs_m, OH, OW, s_on, s_oh, s_ow)[:, None] + (offs_n * s_oc)[None, :]
    zf = _conv_z(x_ptr, w_ptr, bias_ptr, z_ptr, o_offs, mask, row0, col0, offs_n, mask_n,
                 M, C_OUT, C_IN, C_OUT_G, H, W, OH, OW, s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo,
                 KH, KW, SH, SW, PH, PW, DH, DW, DIRECT, FLAT_K, FROM_Z, HAS_BIAS, STORE_Z,
                 BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)
    if STATS:
        # per-tile mean and sum of squared deviations from it (Chan partials)
        cnt = tl.minimum(M - row0, BLOCK_M).to(tl.float32)
        t_mean = tl.sum(tl.where(mask_m[:, None], zf, 0.0), axis=0) / cnt
        dev = tl.where(mask_m[:, None], zf - t_mean[None, :], 0.0)
        t_m2 = tl.sum(dev * dev, axis=0)
        p_offs = pid_m.to(tl.int64) * C_OUT + offs_n
        tl.store(pmean_ptr + p_offs, t_mean, mask=mask_n)
        tl.store(pm2_ptr + p_offs, t_m2, mask=mask_n)
    if APPLY:
        # pixel offsets again rather than held across the main loop (registers)
        o_pix = _pix_offsets(offs_m, OH, OW, s_on, s_oh, s_ow)
        r_pix = _pix_offsets(offs_m, OH, OW, s_rn, s_rh, s_rw)
        _apply_epilogue(zf, col0, o_pix, r_pix, mask_m, C_OUT, s_oc, s_rc, y_ptr, res_ptr,
                        mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, HAS_RES, HAS_W, HAS_B, ACTIVATION, NEG_SLOPE, BLOCK_M,
                        BLOCK_N, EPILOGUE_SPLIT)


@triton.jit
def _apply_epilogue(zf, c0, o_pix, r_pix, mask_m, C_OUT, s_oc, s_rc, y_ptr, res_ptr,
                    mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
                    HAS_B: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, BLOCK_M: tl.constexpr,
                    WIDTH: tl.constexpr, SPLIT: tl.constexpr):
    """The forward's normalize + affine (+ residual) + activation on channels [c0, c0 + WIDTH) of its
    tile, in SPLIT column slices one after the other (as the dense grad kernel's epilogue)."""
    if SPLIT > 1:
        z0, z1 = _column_halves(zf, BLOCK_M, WIDTH)
        _apply_epilogue(z0, c0, o_pix, r_pix, mask_m, C_OUT, s_oc, s_rc, y_ptr, res_ptr, mean_ptr, rstd_ptr,
                        gamma_ptr, beta_ptr, HAS_RES, HAS_W, HAS_B, ACTIVATION, NEG_SLOPE, BLOCK_M, WIDTH // 2,
                        SPLIT // 2)
        _apply_epilogue(z1, c0 + WIDTH // 2, o_pix, r_pix, mask_m, C_OUT, s_oc, s_rc, y_ptr, res_ptr, mean_ptr,
                        rstd_ptr, gamma_ptr, beta_ptr, HAS_RES, HAS_W, HAS_B, ACTIVATION, NEG_SLOPE, BLOCK_M,
                        WIDTH // 2, SPLIT // 2)
    else:
        offs_n = c0 + tl.arange(0, WIDTH)
        mask_n = offs_n < C_OUT
        mask = mask_m[:, None] & mask_n[None, :]
        mean, rstd, gamma, beta = _channel_params(mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, offs_n, mask_n,
                                                  HAS_W, HAS_B, WIDTH)
        pre = _bn_pre(zf, mean, rstd, gamma, beta)
        if HAS_RES:
            pre = pre + tl.load(res_ptr + r_pix[:, None] + (offs_n * s_rc)[None, :], mask=mask,
                                other=0.0).to(tl.float32)
        y = _act_fwd(pre, ACTIVATION, NEG_SLOPE)  # ReLU: NaN stays NaN like torch.relu
        tl.store(y_ptr + o_pix[:, None] + (offs_n * s_oc)[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bn_stats_finalize_kernel(
    pmean_ptr, pm2_ptr, mean_ptr, rstd_ptr, T, C, M, eps,
    TILE_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Combine per-tile (mean_t, M2_t) of T row tiles (TILE_M rows each, last ragged).

    mean = sum_t n_t mean_t / M; M2 = sum_t [M2_t + n_t (mean_t - mean)^2]; var = M2 / M.
    Fixed order, no atomics.
    """
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    s = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        mask_t = t < T
        n_t = tl.minimum(M - t * TILE_M, TILE_M).to(tl.float32)
        pm = tl.load(pmean_ptr + t.to(tl.int64)[:, None] * C + offs_c[None, :],
                     mask=mask_t[:, None] & mask_c[None, :], other=0.0)
        s += tl.sum(tl.where(mask_t[:, None], n_t[:, None] * pm, 0.0), axis=0)
    mean = s / M
    m2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        mask_t = t < T
        n_t = tl.minimum(M - t * TILE_M, TILE_M).to(tl.float32)
        p_offs = t.to(tl.int64)[:, None] * C + offs_c[None, :]
        pmask = mask_t[:, None] & mask_c[None, :]
        pm = tl.load(pmean_ptr + p_offs, mask=pmask, other=0.0)
        pq = tl.load(pm2_ptr + p_offs, mask=pmask, other=0.0)
        d = pm - mean[None, :]
        m2 += tl.sum(tl.where(mask_t[:, None], pq + n_t[:, None] * d * d, 0.0), axis=0)
    var = m2 / M
    # inductor hands a float argument in as fp64, which sqrt_rn refuses: the sum back to fp32
    rstd = 1.0 / tl.sqrt_rn((var + eps).to(tl.float32))
    tl.store(mean_ptr + offs_c, mean, mask=mask_c)
    tl.store(rstd_ptr + offs_c, rstd, mask=mask_c)


@triton.jit
def _bn_running_update_kernel(
    mean_ptr, rstd_ptr, rm_ptr, rv_ptr, C, s_rm, s_rv, eps, momentum, bessel, BLOCK_C: tl.constexpr,
):
    """running = running + momentum * (batch - running), the batch variance unbiased
    (``(1/rstd^2 - eps) * bessel``), in fp32, stored in the buffers' dtype."""
    offs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < C
    mean = tl.load(mean_ptr + offs, mask=mask, other=0.0)
    rstd = tl.load(rstd_ptr + offs, mask=mask, other=1.0)
    inv = 1.0 / rstd  # sqrt(var + eps): squaring rstd itself overflows for tiny eps
    var = (inv * inv - eps) * bessel
    rm = tl.load(rm_ptr + offs * s_rm, mask=mask, other=0.0).to(tl.float32)
    rv = tl.load(rv_ptr + offs * s_rv, mask=mask, other=0.0).to(tl.float32)
    tl.store(rm_ptr + offs * s_rm, (rm + momentum * (mean - rm)).to(rm_ptr.dtype.element_ty), mask=mask)
    tl.store(rv_ptr + offs * s_rv, (rv + momentum * (var - rv)).to(rv_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- backward kernels
@triton.jit
def _conv_bn_bwd_kernel(
    x_ptr, w_ptr, bias_ptr, z_ptr, g_ptr, res_ptr, dz_ptr, dres_ptr,
    mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, sg_ptr, sgx_ptr,
    pg_ptr, pgx_ptr, pdb_ptr,
    M, C_OUT, C_IN, C_OUT_G, H, W, OH, OW, inv_count,
    s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo,
    s_on, s_oc, s_oh, s_ow,       # z, dz, dresidual (same layout)
    s_gn, s_gc, s_gh, s_gw,       # grad_out
    s_rn, s_rc, s_rh, s_rw,       # residual
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, DIRECT: tl.constexpr,
    FLAT_K: tl.constexpr, FROM_Z: tl.constexpr, STORE_Z: tl.constexpr, REDUCE: tl.constexpr, EMIT_DZ: tl.constexpr,
    TRAINING: tl.constexpr, STORE_DRES: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
):
    """Recompute z (or read it: FROM_Z) and the pre-activation; g = act'(pre) * grad_out, then

    REDUCE:  per-tile partials of g and g*xhat per channel (pg, pgx: (tiles_m, C_OUT));
    EMIT_DZ: dz in x.dtype, and per-tile partials of dz (pdb) for the conv bias;
    STORE_DRES: dresidual = g; STORE_Z: the rounded z (buffered variant).
    EPILOGUE_SPLIT (1, 2 or 4) runs all that on column slices of the tile one after the other
    (fewer registers live at once; per-channel results, so the same bits).
    """
    pid_m, pid_n = _tile_ids(M, C_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < C_OUT
    mask = mask_m[:, None] & mask_n[None, :]
    o_offs = _pix_offsets(offs_m, OH, OW, s_on, s_oh, s_ow)[:, None] + (offs_n * s_oc)[None, :]
    zf = _conv_z(x_ptr, w_ptr, bias_ptr, z_ptr, o_offs, mask, row0, col0, offs_n, mask_n,
                 M, C_OUT, C_IN, C_OUT_G, H, W, OH, OW, s_xn, s_xc, s_xh, s_xw, s_wh, s_ww, s_wc, s_wo,
                 KH, KW, SH, SW, PH, PW, DH, DW, DIRECT, FLAT_K, FROM_Z, HAS_BIAS, STORE_Z,
                 BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)
    # pixel offsets again rather than held across the main loop (registers)
    o_pix = _pix_offsets(offs_m, OH, OW, s_on, s_oh, s_ow)
    r_pix = _pix_offsets(offs_m, OH, OW, s_rn, s_rh, s_rw)
    g_pix = _pix_offsets(offs_m, OH, OW, s_gn, s_gh, s_gw)
    _bwd_epilogue(zf, col0, o_pix, r_pix, g_pix, mask_m, pid_m, C_OUT, inv_count, s_oc, s_rc, s_gc,
                  g_ptr, res_ptr, dz_ptr, dres_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, sg_ptr, sgx_ptr,
                  pg_ptr, pgx_ptr, pdb_ptr, REDUCE, EMIT_DZ, TRAINING, STORE_DRES, HAS_BIAS, HAS_RES,
                  HAS_W, HAS_B, ACTIVATION, NEG_SLOPE, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT)


@triton.jit
def _bwd_epilogue(
    zf, c0, o_pix, r_pix, g_pix, mask_m, pid_m, C_OUT, inv_count, s_oc, s_rc, s_gc,
    g_ptr, res_ptr, dz_ptr, dres_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, sg_ptr, sgx_ptr,
    pg_ptr, pgx_ptr, pdb_ptr,
    REDUCE: tl.constexpr, EMIT_DZ: tl.constexpr, TRAINING: tl.constexpr, STORE_DRES: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, SPLIT: tl.constexpr,
):
    """The backward kernel's epilogue on channels [c0, c0 + WIDTH) of its tile (zf holds them),
    in SPLIT column slices one after the other (as the dense grad kernel's epilogue)."""
    if SPLIT > 1:
        z0, z1 = _column_halves(zf, BLOCK_M, WIDTH)
        _bwd_epilogue(z0, c0, o_pix, r_pix, g_pix, mask_m, pid_m, C_OUT, inv_count, s_oc, s_rc, s_gc,
                      g_ptr, res_ptr, dz_ptr, dres_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, sg_ptr, sgx_ptr,
                      pg_ptr, pgx_ptr, pdb_ptr, REDUCE, EMIT_DZ, TRAINING, STORE_DRES, HAS_BIAS, HAS_RES,
                      HAS_W, HAS_B, ACTIVATION, NEG_SLOPE, BLOCK_M, WIDTH // 2, SPLIT // 2)
        _bwd_epilogue(z1, c0 + WIDTH // 2, o_pix, r_pix, g_pix, mask_m, pid_m, C_OUT, inv_count, s_oc, s_rc,
                      s_gc, g_ptr, res_ptr, dz_ptr, dres_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, sg_ptr,
                      sgx_ptr, pg_ptr, pgx_ptr, pdb_ptr, REDUCE, EMIT_DZ, TRAINING, STORE_DRES, HAS_BIAS,
                      HAS_RES, HAS_W, HAS_B, ACTIVATION, NEG_SLOPE, BLOCK_M, WIDTH // 2, SPLIT // 2)
    else:
        offs_n = c0 + tl.arange(0, WIDTH)
        mask_n = offs_n < C_OUT
        mask = mask_m[:, None] & mask_n[None, :]
        o_offs = o_pix[:, None] + (offs_n * s_oc)[None, :]
        mean, rstd, gamma, beta = _channel_params(mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, offs_n, mask_n,
                                                  HAS_W, HAS_B, WIDTH)
        pre = _bn_pre(zf, mean, rstd, gamma, beta)
        if HAS_RES:
            pre = pre + tl.load(res_ptr + r_pix[:, None] + (offs_n * s_rc)[None, :], mask=mask,
                                other=0.0).to(tl.float32)
        gout = tl.load(g_ptr + g_pix[:, None] + (offs_n * s_gc)[None, :], mask=mask, other=0.0).to(tl.float32)
        # torch's activation backward formulas (ReLU: threshold_backward, a NaN pre lets grad through).
        # gout is 0 outside the mask and pre finite there, so g is 0 there too (the sums rely on it)
        g = _act_grad(pre, gout, ACTIVATION, NEG_SLOPE)
        xhat = (zf - mean[None, :]) * rstd[None, :]
        if STORE_DRES:
            tl.store(dres_ptr + o_offs, g.to(dres_ptr.dtype.element_ty), mask=mask)
        p_offs = pid_m.to(tl.int64) * C_OUT + offs_n
        if REDUCE:
            tl.store(pg_ptr + p_offs, tl.sum(g, axis=0), mask=mask_n)
            tl.store(pgx_ptr + p_offs, tl.sum(tl.where(mask, g * xhat, 0.0), axis=0), mask=mask_n)
        if EMIT_DZ:
            scale = (rstd * gamma)[None, :]
            if TRAINING:
                sg = tl.load(sg_ptr + offs_n, mask=mask_n, other=0.0)
                sgx = tl.load(sgx_ptr + offs_n, mask=mask_n, other=0.0)
                dz = scale * (g - (sg * inv_count)[None, :] - xhat * (sgx * inv_count)[None, :])
            else:
                dz = scale * g
            dzq = dz.to(dz_ptr.dtype.element_ty)
            tl.store(dz_ptr + o_offs, dzq, mask=mask)
            if HAS_BIAS:
                tl.store(pdb_ptr + p_offs, tl.sum(tl.where(mask, dzq.to(tl.float32), 0.0), axis=0), mask=mask_n)


@triton.jit
def _conv_dx_kernel(
    dz_ptr, w_ptr, dx_ptr,
    M, C_IN, C_OUT, H, W, OH, OW,
    s_dn, s_dc, s_dh, s_dw,       # dz
    s_wh, s_ww, s_wo, s_wc,       # weight, read as (kh, kw, c_out, c_in)
    s_xn, s_xc, s_xh, s_xw,       # dx
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """dx = conv_transpose(dz, W) as an implicit GEMM: rows = input pixels (n, ih, iw),
    columns = C_in, K = taps x C_out. Tap (kh, kw) reads dz at oh = (ih + PH - kh*DH) / SH
    where that division is exact and in range (masked otherwise)."""
    pid_m, pid_n = _tile_ids(M, C_IN, BLOCK_M, BLOCK_N, GROUP_M)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    offs_m = row0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    n, ih, iw = _split_pixels(offs_m, H, W)
    d_rows = dz_ptr + n.to(tl.int64) * s_dn
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < C_IN
    w_cols = w_ptr + offs_n * s_wc
    offs_k = tl.arange(0, BLOCK_K)
    n_cblk = tl.cdiv(C_OUT, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(0, KH * KW * n_cblk):
        tap = it // n_cblk
        c0 = (it - tap * n_cblk) * BLOCK_K
        kh = tap // KW
        kw = tap - kh * KW
        th = ih + (PH - kh * DH)
        tw = iw + (PW - kw * DW)
        oh = th // SH
        ow = tw // SW
        ok_m = mask_m & (th >= 0) & (tw >= 0) & (oh < OH) & (ow < OW)
        if SH > 1:
            ok_m = ok_m & (oh * SH == th)
        if SW > 1:
            ok_m = ok_m & (ow * SW == tw)
        c = c0 + offs_k
        ok_c = c < C_OUT
        a = tl.load(d_rows[:, None] + (oh * s_dh + ow * s_dw)[:, None] + c[None, :] * s_dc,
                    mask=ok_m[:, None] & ok_c[None, :], other=0.0)
        b = tl.load(w_cols[None, :] + (kh * s_wh + kw * s_ww) + c[:, None] * s_wo,
                    mask=ok_c[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    x_offs = (n.to(tl.int64) * s_xn + (ih * s_xh + iw * s_xw))[:, None] + (offs_n * s_xc)[None, :]
    tl.store(dx_ptr + x_offs, acc.to(dx_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _conv_dw_kernel(
    dz_ptr, x_ptr, part_ptr,
    P, C_OUT, C_IN, H, W, OH, OW, iters_per_split,
    s_dn, s_dc, s_dh, s_dw,       # dz
    s_xn, s_xc, s_xh, s_xw,       # x
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    pre_mean_ptr, pre_scale_ptr, pre_shift_ptr,
    PRE_ACT: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
):
    """dW[co, (ci, kh, kw)] = sum over output pixels p of dz[p, co] * x[p shifted by the tap, ci].
    PRE_ACT: the conv's input is act(bn(x)), made from each x tile as the forward made it.

    Rows = C_out, columns = C_in*KH*KW in weight order, K = P = N*OH*OW pixels,
    split into program_id(1) chunks of iters_per_split*BLOCK_K pixels; each chunk
    writes fp32 partials part[split, co, col] (summed afterwards in a fixed order).
    """
    NCOL = C_IN * KH * KW
    pid_m, pid_n = _tile_ids(C_OUT, NCOL, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < C_OUT
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NCOL
    ci = offs_n // (KH * KW)
    tap = offs_n - ci * (KH * KW)
    kh = tap // KW
    kw = tap - kh * KW
    x_cols = ci * s_xc
    if PRE_ACT:  # a column's input channel is fixed: its BN vectors loaded once
        pm, ps, pt = _channel_vectors(pre_mean_ptr, pre_scale_ptr, pre_shift_ptr, ci, mask_n)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p_start = pid_k * iters_per_split * BLOCK_K
    for it in range(0, iters_per_split):
        p = p_start + it * BLOCK_K + tl.arange(0, BLOCK_K)
        ok_p = p < P
        n, oh, ow = _split_pixels(p, OH, OW)
        n64 = n.to(tl.int64)
        a = tl.load(dz_ptr + (n64 * s_dn + (oh * s_dh + ow * s_dw))[None, :] + (offs_m * s_dc)[:, None],
                    mask=mask_m[:, None] & ok_p[None, :], other=0.0)
        ih = (oh * SH - PH)[:, None] + (kh * DH)[None, :]
        iw = (ow * SW - PW)[:, None] + (kw * DW)[None, :]
        ok = ok_p[:, None] & mask_n[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        b = tl.load(x_ptr + (n64 * s_xn)[:, None] + (x_cols[None, :] + ih * s_xh + iw * s_xw),
                    mask=ok, other=0.0)
        if PRE_ACT:
            b = _pre_act(b, ok, pm, ps, pt, ACTIVATION, NEG_SLOPE)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    offs = (pid_k.to(tl.int64) * C_OUT + offs_m)[:, None] * NCOL + offs_n[None, :]
    tl.store(part_ptr + offs, acc, mask=mask_m[:, None] & mask_n[None, :])


# --------------------------------------------------------------------------- launcher helpers
def _pair(v):
    return [int(e) for e in v] if isinstance(v, (tuple, list)) else [int(v), int(v)]


def _out_hw(H, W, KH, KW, stride, padding, dilation):
    oh = (H + 2 * padding[0] - dilation[0] * (KH - 1) - 1) // stride[0] + 1
    ow = (W + 2 * padding[1] - dilation[1] * (KW - 1) - 1) // stride[1] + 1
    return oh, ow


def _memory_format(x: torch.Tensor):
    if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _known_activation(activation) -> bool:
    """The dense kernels' epilogue activations, and "none" (Conv-BN without an activation)."""
    try:
        return activation == "none" or bool(check_activation(activation))
    except ValueError:
        return False


def _supported(x, weight, activation, stride, padding, dilation, groups=1, residual=None) -> bool:
    if not _known_activation(activation) or groups < 1 or x.dim() != 4 or weight.dim() != 4:
        return False
    if weight.shape[1] * groups != x.shape[1] or weight.shape[0] % groups:
        return False
    if group_strategy(weight, groups) is None:
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return False
    if not (x.is_cuda or interpreting()):
        return False
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        return False
    if x.numel() == 0 or weight.numel() == 0:
        return False
    oh, ow = _out_hw(x.shape[2], x.shape[3], weight.shape[2], weight.shape[3], stride, padding, dilation)
    # offsets inside one sample (channel, row, column) are 32-bit in the kernels; only the sample's
    # base is 64-bit: a sample of 2**31 elements or more (x's, the output's, or the residual's
    # through its strides) runs the reference
    return (oh > 0 and ow > 0 and _sample_extent(x) <= _I32_MAX and weight.shape[0] * oh * ow <= _I32_MAX
            and (residual is None or _sample_extent(residual) <= _I32_MAX))


def _sample_extent(t) -> int:
    """One past the largest element offset inside one sample of a 4-D tensor."""
    return 1 + sum((size - 1) * abs(st) for size, st in zip(t.shape[1:], t.stride()[1:]))


def _geom_constexprs(KH, KW, stride, padding, dilation):
    return dict(KH=KH, KW=KW, SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1],
                DH=dilation[0], DW=dilation[1])


def _vec(t):
    return None if t is None else t.contiguous()


def _pre_act_args(x, pre_act):
    """The PRE_ACT launch arguments of a conv kernel: off (x stands for the unused pointers), or
    on with ``pre_act`` = (mean, scale, shift, activation)."""
    if pre_act is None:
        return dict(pre_mean_ptr=x, pre_scale_ptr=x, pre_shift_ptr=x, PRE_ACT=False, ACTIVATION="relu",
                    NEG_SLOPE=0.0)
    mean, scale, shift, activation = pre_act
    return dict(pre_mean_ptr=mean, pre_scale_ptr=scale, pre_shift_ptr=shift, PRE_ACT=True, **act_meta(activation))


def _finalize_stats(pmean, pm2, M, C, tile_m, eps, device, sites):
    """(mean, rstd) from the per-tile partials; ``sites``: the caller's plan's launch sites (a plan
    fixes M and C)."""
    mean = torch.empty(C, device=device, dtype=torch.float32)
    rstd = torch.empty(C, device=device, dtype=torch.float32)
    T = pmean.shape[0]
    BLOCK_C = 16 if interpreting() else 32
    BLOCK_T = 16 if interpreting() else 64
    launch(sites, "finalize", launcher(_bn_stats_finalize_kernel, pmean), (cdiv(C, BLOCK_C),),
           (pmean, pm2, mean, rstd, T, C, M, float(eps)),
           dict(TILE_M=tile_m, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=4))
    return mean, rstd


# --------------------------------------------------------------------------- launch plans
# Everything a layer's launches need besides its tensors' addresses, worked out once per layer
# (fusedrc/kernels/_common.py, LaunchPlans): a small layer's eager step is otherwise bound by this Python.
_PLANS = LaunchPlans().watch(__name__)


def clear_launch_plans():
    """Forget every layer's plan (after mutating a tile table in place)."""
    _PLANS.clear()


def update_running_stats_(running_mean, running_var, mean, rstd, eps, momentum, n):
    """``reference.update_running_stats_`` in one launch (eager only: traced code mutates the
    buffers visibly). At ResNet channel counts the reference's four aten kernels cost host time,
    not flops; the kernel writes no version counter either."""
    # the plan: the launch's sites where the kernel covers the call, else False
    sites = _PLANS.plan(plan_key("running", running_mean, running_var, mean, rstd),
                        lambda: {} if _running_supported(running_mean, running_var, mean, rstd) else False)
    if sites is False:
        return _reference().update_running_stats_(running_mean, running_var, mean, rstd, eps, momentum, n)
    C = mean.numel()
    block_c = min(1024, triton.next_power_of_2(max(C, 16)))
    with _device_guard(mean):
        launch(sites, "update", launcher(_bn_running_update_kernel, mean), (cdiv(C, block_c),),
               (mean, rstd, running_mean, running_var, C, running_mean.stride(0), running_var.stride(0), float(eps),
                float(momentum), n / max(n - 1, 1)), dict(BLOCK_C=block_c, num_warps=4))


def _running_supported(running_mean, running_var, mean, rstd) -> bool:
    return (
        mean.dtype == torch.float32 and rstd.dtype == torch.float32 and mean.is_contiguous() and rstd.is_contiguous()
        and running_mean.device == mean.device and running_var.device == mean.device
        and running_mean.dtype in _RUNNING_DTYPES and running_var.dtype in _RUNNING_DTYPES
        # bf16 arithmetic is broken in Triton's interpreter
        and not (interpreting() and torch.bfloat16 in (running_mean.dtype, running_var.dtype))
    )


_RUNNING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tf32_key(x) -> bool:
    # what dot_precision(x) reads besides x's metadata (asked only where it can matter)
    return x.dtype == torch.float32 and x.is_cuda and tf32_matmul_allowed()


def _meta_strides(shape, fmt):
    return torch.empty(shape, device="meta", memory_format=fmt).stride()


def _launch_spec(M, C_out, cfg, **constexprs):
    """(grid, constexprs) of one launch of a conv kernel over M output pixels with tile ``cfg``."""
    grid = (cdiv(M, cfg.BLOCK_M) * cdiv(C_out, cfg.BLOCK_N),)
    return grid, dict(constexprs, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                      GROUP_M=cfg.GROUP_M, EPILOGUE_SPLIT=cfg.EPILOGUE_SPLIT, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)


class _Layer(NamedTuple):
    """A conv layer's geometry and strategy, shared by its forward and backward plans."""
    N: int
    C_out: int
    OH: int
    OW: int
    M: int
    fmt: torch.memory_format
    precision: str
    cap: tuple
    cfg: ConvConfig
    aten_z: bool
    fwd_recompute: bool
    twice: bool
    ints: tuple      # M, C_OUT, C_IN, C_OUT_G, H, W, OH, OW and x's and the weight tile's strides
    constexprs: dict  # the geometry and the flags both directions share


def _layer(x, weight, bias, stride, padding, dilation, groups) -> _Layer:
    N, _, H, W = x.shape
    C_out, C_in, KH, KW = weight.shape  # C_in per group
    OH, OW = _out_hw(H, W, KH, KW, stride, padding, dilation)
    M = N * OH * OW
    precision = dot_precision(x)
    cap = device_capability(x)
    aten_z, fwd_recompute, twice = conv_plan(x, weight, M, precision)
    # the weight as the Triton conv reads it, (KH, KW, C_in, C_out) contiguous: coalesced B tiles
    # (weight rows, DIRECT); x stands in for it when every pass reads z
    w_strides = x.stride() if aten_z else (KW * C_in * C_out, C_in * C_out, C_out, 1)
    return _Layer(
        N, C_out, OH, OW, M, _memory_format(x), precision, cap, layer_config(weight, groups, x.dtype, precision, cap),
        aten_z, fwd_recompute, twice, (M, C_out, C_in, C_out // groups, H, W, OH, OW, *x.stride(), *w_strides),
        dict(_geom_constexprs(KH, KW, stride, padding, dilation), DIRECT=group_strategy(weight, groups) == "direct",
             FLAT_K=flat_k(weight, groups), HAS_BIAS=bias is not None, PRECISION=precision, UPCAST=_upcast_flag(x)),
    )


def _weight_tile(x, weight, layer: _Layer):
    return x if layer.aten_z else weight.permute(2, 3, 1, 0).contiguous()


class _FwdPlan(NamedTuple):
    layer: _Layer
    ints: tuple           # the layer's, then y's (and z's) strides and the residual's
    stats: tuple | None   # (grid, constexprs) of the training forward's statistics pass
    stats_rows: int       # its row tiles (the partials' rows)
    store_z: bool         # that pass stores z (the Triton conv, z buffered) for the apply pass
    finalize: tuple       # (grid, constexprs) of _bn_stats_finalize_kernel
    apply: tuple          # (grid, constexprs) of the normalize + activation pass
    apply_from_z: bool
    sites: dict           # its launch sites' bound binaries (_common.launch)


def _fwd_plan(x, weight, bias, bn_weight, bn_bias, residual, training, stride, padding, dilation, activation,
              groups):
    """The forward's plan, or None where the kernels do not cover the call (the reference runs)."""
    if not _supported(x, weight, activation, stride, padding, dilation, groups, residual):
        return None
    layer = _layer(x, weight, bias, stride, padding, dilation, groups)
    M, C_out, cfg, cap = layer.M, layer.C_out, layer.cfg, layer.cap
    y_strides = _meta_strides((layer.N, C_out, layer.OH, layer.OW), layer.fmt)
    rr = residual if residual is not None else x  # x stands for an unused pointer (fusedrc/kernels/_common.py)
    flags = dict(layer.constexprs, HAS_RES=residual is not None, HAS_W=bn_weight is not None,
                 HAS_B=bn_bias is not None)
    stats = None
    stats_cfg = _elem_config(cap) if layer.aten_z else cfg  # with z from aten the stats pass is elementwise
    store_z = training and not layer.aten_z and not layer.fwd_recompute
    if training:
        pass_cfg = cfg if store_z or not layer.aten_z else stats_cfg
        # ACTIVATION is unused without APPLY: one compile for every activation
        stats = _launch_spec(M, C_out, pass_cfg, **flags, FROM_Z=layer.aten_z and not store_z, STATS=True,
                             STORE_Z=store_z, APPLY=False, **act_meta("relu"))
    apply_from_z = layer.aten_z or store_z
    apply = _launch_spec(M, C_out, _elem_config(cap) if apply_from_z else cfg, **flags, FROM_Z=apply_from_z,
                         STATS=False, STORE_Z=False, APPLY=True, **act_meta(activation))
    block_c = 16 if interpreting() else 32
    finalize = ((cdiv(C_out, block_c),), dict(TILE_M=stats_cfg.BLOCK_M, BLOCK_T=16 if interpreting() else 64,
                                               BLOCK_C=block_c, num_warps=4))
    return _FwdPlan(layer, (*layer.ints, *y_strides, *rr.stride()), stats, cdiv(M, stats_cfg.BLOCK_M), store_z,
                    finalize, apply, apply_from_z, {})


# --------------------------------------------------------------------------- forward
def conv_bn_act_forward(
    x, weight, bias, bn_weight, bn_bias, running_mean, running_var, residual,
    training, eps, stride, padding, dilation, activation, groups=1,
):
    """y = act(bn(conv2d(x, weight, bias)) [+ residual]) -> (y, mean, rstd) (fp32, per channel).

    Same contract as ``fusedrc.reference.conv_bn_act_forward``; running buffers are
    read (eval) but never written.
    """
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    training = bool(training)
    key = plan_key("fwd", x, weight, bias is None, bn_weight is None, bn_bias is None, residual, training,
                   *stride, *padding, *dilation, activation, groups, _tf32_key(x))
    plan = _PLANS.plan(key, lambda: _fwd_plan(x, weight, bias, bn_weight, bn_bias, residual, training, stride,
                                              padding, dilation, activation, groups))
    if plan is None:
        return _reference().conv_bn_act_forward(
            x, weight, bias, bn_weight, bn_bias, running_mean, running_var, residual,
            training, eps, stride, padding, dilation, activation, groups)
    layer = plan.layer
    C_out = layer.C_out
    y = torch.empty((layer.N, C_out, layer.OH, layer.OW), device=x.device, dtype=x.dtype, memory_format=layer.fmt)
    dummy = x  # unused pointers: an input, never an output (see fusedrc/kernels/_common.py)
    wt = _weight_tile(x, weight, layer)
    bias_, gamma, beta = _vec(bias), _vec(bn_weight), _vec(bn_bias)
    head = (x, wt, bias_ if bias_ is not None else dummy)
    tail = (residual if residual is not None else dummy,)
    bn = (gamma if gamma is not None else dummy, beta if beta is not None else dummy)
    kernel = launcher(_conv_bn_fwd_kernel, x)

    with _device_guard(x):
        z = _aten_z(x, weight, bias, stride, padding, dilation, y) if layer.aten_z else None
        if training:
            pmean = torch.empty((plan.stats_rows, C_out), device=x.device, dtype=torch.float32)
            pm2 = torch.empty_like(pmean)
            if plan.store_z:
                z = torch.empty_like(y)
            grid, meta = plan.stats
            launch(plan.sites, "stats", kernel, grid, (*head, z if z is not None else dummy, y, *tail, dummy, dummy,
                                                        *bn, pmean, pm2, *plan.ints), meta)
            mean = torch.empty(C_out, device=x.device, dtype=torch.float32)
            rstd = torch.empty(C_out, device=x.device, dtype=torch.float32)
            grid, meta = plan.finalize
            launch(plan.sites, "finalize", launcher(_bn_stats_finalize_kernel, pmean), grid,
                   (pmean, pm2, mean, rstd, plan.stats_rows, C_out, layer.M, float(eps)), meta)
            del pmean, pm2
        else:
            mean = running_mean.float().contiguous()
            rstd = torch.rsqrt(running_var.float() + eps).contiguous()
        # eval, or the training forward that reruns the conv: no z
        grid, meta = plan.apply
        launch(plan.sites, "apply", kernel, grid, (*head, z if z is not None else dummy, y, *tail, mean, rstd, *bn,
                                                    dummy, dummy, *plan.ints), meta)
        del z  # transient
    return y, mean, rstd


# --------------------------------------------------------------------------- backward
def _dw_split(tiles, iters, cap, device):
    """Split-K factor of the dW GEMM (K = N*OH*OW is huge, the output small)."""
    if cap is None:
        target = 4
    else:
        target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    split = max(1, min(target // max(tiles, 1), iters // 8 if cap is not None else iters, 64))
    return max(split, 1)


def conv_dx(dz, weight, x_shape, x_fmt, stride, padding, dilation, precision, cap):
    """dX = conv_transpose(dz, weight) by the Triton implicit GEMM; dz (N, C_out, OH, OW)."""
    N, C_in, H, W = x_shape
    C_out, _, KH, KW = weight.shape
    OH, OW = dz.shape[2], dz.shape[3]
    dx = torch.empty(x_shape, device=dz.device, dtype=dz.dtype, memory_format=x_fmt)
    wt = weight.permute(2, 3, 0, 1).contiguous()  # (KH, KW, C_out, C_in)
    M = N * H * W
    cfg = conv_config(C_in, C_out, dz.dtype, precision, cap)
    grid = (cdiv(M, cfg.BLOCK_M) * cdiv(C_in, cfg.BLOCK_N),)
    launcher(_conv_dx_kernel, dz)[grid](
        dz, wt, dx, M, C_in, C_out, H, W, OH, OW,
        *dz.stride(), *wt.stride(), *dx.stride(),
        **_geom_constexprs(KH, KW, stride, padding, dilation),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        PRECISION=precision, UPCAST=_upcast_flag(dz), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dx


def _dw_config(cfg: ConvConfig, dtype, precision: str, pre_act: bool, family: str | None) -> ConvConfig:
    """The dW kernel's tile: the table's (K = pixels: no per-tap clamp); with the PRE_ACT prologue on
    fp32 FMA (no tensor cores) 8 warps, as 4 spill (255 registers on sm_90), and the stages
    ``_RELEASE_TUNING`` (fusedrc/kernels/_common.py) sets for ``family`` under the installed Triton.
    (dW is its own split-K GEMM: no recompute reads its tile.)"""
    if pre_act and dtype == torch.float32 and precision == "ieee":
        return cfg._replace(num_warps=8, **release_tuning("_conv_dw_kernel", "pre_act", family))
    return cfg


def conv_dw(dz, x, weight_shape, stride, padding, dilation, precision, cap, pre_act=None):
    """dW by the Triton implicit GEMM over the output pixels, split-K with fp32 partials.
    ``pre_act``: (mean, scale, shift, activation): the conv's input is act(bn(x)) (``_pre_act``)."""
    N, C_in, H, W = x.shape
    C_out, _, KH, KW = weight_shape
    OH, OW = dz.shape[2], dz.shape[3]
    P = N * OH * OW
    NCOL = C_in * KH * KW
    cfg = _dw_config(conv_config(NCOL, 1 << 30, dz.dtype, precision, cap), dz.dtype, precision, pre_act is not None,
                     None if cap is None else _arch_family(cap))
    tiles = cdiv(C_out, cfg.BLOCK_M) * cdiv(NCOL, cfg.BLOCK_N)
    iters = cdiv(P, cfg.BLOCK_K)
    split = _dw_split(tiles, iters, cap, dz.device)
    per_split = cdiv(iters, split)
    split = cdiv(iters, per_split)
    part = torch.empty((split, C_out, NCOL), device=dz.device, dtype=torch.float32)
    launcher(_conv_dw_kernel, dz)[(tiles, split)](
        dz, x, part, P, C_out, C_in, H, W, OH, OW, per_split,
        *dz.stride(), *x.stride(),
        **_geom_constexprs(KH, KW, stride, padding, dilation),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        PRECISION=precision, UPCAST=_upcast_flag(dz),
        **_pre_act_args(x, pre_act), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    dw = part[0] if split == 1 else part.sum(0)
    return dw.view(C_out, C_in, KH, KW)


class _BwdPass(NamedTuple):
    grid: tuple
    constexprs: dict
    rows: int      # row tiles: the rows of the per-tile partials
    reduce: bool   # it reduces sum(g) and sum(g * xhat) per channel (into sg, sgx)
    dbias: bool    # it reduces the conv bias's gradient


class _BwdPlan(NamedTuple):
    layer: _Layer
    ints: tuple
    wanted: tuple           # need_dx, need_dw, need_db, need_dgamma, need_dbeta, need_dres
    store_z: bool           # the first pass stores z for the second (the Triton conv, z buffered)
    passes: tuple           # _BwdPass, run in order; the second reads the first's sums
    sites: dict             # its launch sites' bound binaries (_common.launch)


def _bwd_plan(x, weight, bias, bn_weight, bn_bias, residual, grad_out, training, stride, padding, dilation,
              activation, output_mask, groups):
    """The backward's plan, or None where the kernels do not cover the call (the reference runs)."""
    if not _supported(x, weight, activation, stride, padding, dilation, groups, residual) \
            or _sample_extent(grad_out) > _I32_MAX:  # read through its strides too
        return None
    need = wanted(output_mask, 6)
    need_dx, need_dw, need_db, _, _, need_dres = need
    layer = _layer(x, weight, bias, stride, padding, dilation, groups)
    M, C_out, cfg, cap = layer.M, layer.C_out, layer.cfg, layer.cap
    dz_strides = _meta_strides((layer.N, C_out, layer.OH, layer.OW), layer.fmt)  # z's and dres's too
    rr = residual if residual is not None else x
    flags = dict(layer.constexprs, TRAINING=training, HAS_RES=residual is not None, HAS_W=bn_weight is not None,
                 HAS_B=bn_bias is not None, **act_meta(activation))
    store_dres = residual is not None and need_dres

    def spec(cfg, *, from_z, store_z, reduce, emit, store_dres):
        grid, meta = _launch_spec(M, C_out, cfg, **flags, FROM_Z=from_z, STORE_Z=store_z, REDUCE=reduce,
                                  EMIT_DZ=emit, STORE_DRES=store_dres)
        return _BwdPass(grid, meta, cdiv(M, cfg.BLOCK_M), reduce, emit and bias is not None)

    aten_z = layer.aten_z
    z_cfg = _elem_config(cap) if aten_z else cfg  # passes that read z are elementwise
    # dz feeds dX, dW and the conv bias's gradient only (BN-only training has no use for it)
    emit = need_dx or need_dw or (need_db and bias is not None)
    store_z = training and not aten_z and not layer.twice and emit
    if not training:
        passes = (spec(z_cfg, from_z=aten_z, store_z=False, reduce=bn_weight is not None or bn_bias is not None,
                       emit=True, store_dres=store_dres),)
    else:
        first = spec(cfg if store_z else z_cfg, from_z=aten_z, store_z=store_z, reduce=True, emit=False,
                     store_dres=store_dres)
        z_read = aten_z or store_z
        second = spec(_elem_config(cap) if z_read else cfg, from_z=z_read, store_z=False, reduce=False, emit=True,
                      store_dres=False)
        passes = (first, second) if emit else (first,)
    ints = (*layer.ints[:8], 1.0 / M, *layer.ints[8:], *dz_strides, *grad_out.stride(), *rr.stride())
    return _BwdPlan(layer, ints, need, store_z, passes, {})


def _tile_sums(p):
    # per-tile partials -> per-channel sums: fixed order, no atomics
    return p.sum(0) if p.shape[0] > 1 else p[0]


def conv_bn_act_backward(
    x, weight, bias, bn_weight, bn_bias, mean, rstd, residual, grad_out,
    training, eps, stride, padding, dilation, activation, output_mask=None, groups=1,
):
    """(dx, dweight, dbias, dbn_weight, dbn_bias, dresidual); None where the input is None
    or ``output_mask`` masks the gradient off (a frozen weight's dW pass and a first layer's
    dX pass are skipped then).

    Same contract as ``fusedrc.reference.conv_bn_act_backward``; the conv output is
    recomputed inside the kernels (see the module docstring for the passes).
    """
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    training = bool(training)
    mask = None if output_mask is None else tuple(bool(m) for m in output_mask)
    key = plan_key("bwd", x, weight, bias is None, bn_weight is None, bn_bias is None, residual, grad_out, training,
                   *stride, *padding, *dilation, activation, groups, mask, _tf32_key(x))
    plan = _PLANS.plan(key, lambda: _bwd_plan(x, weight, bias, bn_weight, bn_bias, residual, grad_out, training,
                                              stride, padding, dilation, activation, mask, groups))
    if plan is None:
        return _reference().conv_bn_act_backward(
            x, weight, bias, bn_weight, bn_bias, mean, rstd, residual, grad_out,
            training, eps, stride, padding, dilation, activation, output_mask, groups)
    need_dx, need_dw, need_db, need_dgamma, need_dbeta, need_dres = plan.wanted
    layer = plan.layer
    C_out = layer.C_out
    dev = x.device
    wt = _weight_tile(x, weight, layer)  # as in the forward
    bias_, gamma, beta = _vec(bias), _vec(bn_weight), _vec(bn_bias)
    mean, rstd = mean.float().contiguous(), rstd.float().contiguous()
    dz = torch.empty((layer.N, C_out, layer.OH, layer.OW), device=dev, dtype=x.dtype, memory_format=layer.fmt)
    dres = torch.empty_like(dz, dtype=grad_out.dtype) if residual is not None and need_dres else None
    dummy = x
    head = (x, wt, bias_ if bias_ is not None else dummy)
    mid = (grad_out, residual if residual is not None else dummy, dz, dres if dres is not None else dummy, mean, rstd,
           gamma if gamma is not None else dummy, beta if beta is not None else dummy)
    kernel = launcher(_conv_bn_bwd_kernel, x)
    f32 = dict(device=dev, dtype=torch.float32)

    with _device_guard(x):
        z = _aten_z(x, weight, bias, stride, padding, dilation, dz) if layer.aten_z else None
        if plan.store_z:
            z = torch.empty_like(dz)
        sg = sgx = db = None
        for i, p in enumerate(plan.passes):
            # separate buffers: sums of one would alias, and a custom op's outputs may not
            pg = torch.empty((p.rows, C_out), **f32) if p.reduce else dummy
            pgx = torch.empty((p.rows, C_out), **f32) if p.reduce else dummy
            pdb = torch.empty((p.rows, C_out), **f32) if p.dbias else dummy
            launch(plan.sites, i, kernel, p.grid, (*head, z if z is not None else dummy, *mid,
                                                    sg if sg is not None else dummy, sgx if sgx is not None else dummy,
                                                    pg, pgx, pdb, *plan.ints), p.constexprs)
            if p.reduce:
                sg, sgx = _tile_sums(pg), _tile_sums(pgx)
            if p.dbias:
                db = _tile_sums(pdb)
        del z  # transient
        if not (need_dx or need_dw):
            dx = dweight = None
        elif CONV_GRAD == "aten" or groups > 1:  # the Triton dX/dW kernels are implicit GEMMs of groups=1
            dx, dweight, _ = torch.ops.aten.convolution_backward(
                dz, x, weight, None, stride, padding, dilation, False, [0, 0], groups, [need_dx, need_dw, False])
            dx, dweight = dx if need_dx else None, dweight if need_dw else None  # CPU's fills them anyway
        else:
            dx = conv_dx(dz, weight, x.shape, layer.fmt, stride, padding, dilation, layer.precision,
                         layer.cap) if need_dx else None
            dweight = conv_dw(dz, x, weight.shape, stride, padding, dilation, layer.precision,
                              layer.cap) if need_dw else None
    dweight = dweight.to(weight.dtype) if dweight is not None else None
    dbias = db.to(bias.dtype) if bias is not None and need_db else None
    dbn_weight = sgx.to(bn_weight.dtype) if bn_weight is not None and need_dgamma else None
    dbn_bias = sg.to(bn_bias.dtype) if bn_bias is not None and need_dbeta else None
    return dx, dweight, dbias, dbn_weight, dbn_bias, dres


# --------------------------------------------------------------------------- ahead-of-time inspection
# ``python -m fusedrc.inspect`` compiles every spec of ``inspect_specs()`` for its
# GPU target on the CPU (no GPU needed) and reports registers, shared memory,
# spills and the matrix instructions; see fusedrc/inspect.py for the spec format.
_INSPECT_ARCH = {"sm90": "sm_90", "sm80": "sm_80"}
_INSPECT_FAMILY = {arch: family for family, arch in _INSPECT_ARCH.items()}
_INSPECT_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
# The launch the specs stand for: a 3x3 conv, stride 1, padding 1, channels_last
# activations (the tensor-core layout: the channel stride is 1 and specialised to a
# constexpr by the JIT, like the weights' unit strides), channel counts and pixel
# strides multiples of 16 (divisibility hint), spatial sizes not (7x7, 14x14, ...);
# conv bias, residual and BN affine all on (the heaviest epilogues); BN weight and
# bias in fp32 (autocast); C_in >= the table's BLOCK_K (no per-tap clamp).
_INSPECT_GEOM = dict(KH=3, KW=3, SH=1, SW=1, PH=1, PW=1, DH=1, DW=1)


def _inspect_args(ptrs: dict, ints: tuple, unit: tuple, aligned_ints: tuple, floats: tuple = ()):
    """(signature, constexprs, aligned) of one launch: pointer types by name, i32
    arguments, arguments equal to 1 (constexpr 1), and the ints given the 16-hint."""
    sig = dict(ptrs)
    sig.update({n: "i32" for n in ints})
    sig.update({n: "fp32" for n in floats})
    constexprs = {n: 1 for n in unit}
    return sig, constexprs, list(ptrs) + [n for n in aligned_ints if n in ints]


def _inspect_config(cfg: ConvConfig, mode: str, dtype, precision: str) -> dict:
    config = {"mode": mode, "BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N, "BLOCK_K": cfg.BLOCK_K,
              "GROUP_M": cfg.GROUP_M, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if dtype == torch.float32:
        config["input_precision"] = precision
    return config


def _direct_flavor(mode: str):
    """("depthwise" | "multiplier" | "grouped" | "flat" | None, the mode without its prefix): a "dw_",
    "mult_" or "grouped_" mode prefix is the DIRECT (grouped) conv; depthwise has one channel per group
    in and out, which the JIT specialises to constexpr 1 as it does any int argument equal to 1; a
    channel multiplier has one in and several out. "flat_": the implicit GEMM's flat K loop of a
    layer with few input channels (FLAT_K: a stem's 3, no 16-hint)."""
    for prefix, flavor in (("dw_", "depthwise"), ("mult_", "multiplier"), ("grouped_", "grouped"),
                           ("flat_", "flat")):
        if mode.startswith(prefix):
            return flavor, mode.removeprefix(prefix)
    return None, mode


def _direct_args(flavor, sig, constexprs, aligned):
    """C_IN and C_OUT_G (channels per group in and out), DIRECT and FLAT_K as ``flavor``'s launch has them."""
    constexprs["DIRECT"] = flavor in ("depthwise", "multiplier", "grouped")
    constexprs["FLAT_K"] = flavor == "flat"
    if flavor == "depthwise":
        del sig["C_IN"]
        constexprs["C_IN"] = constexprs["C_OUT_G"] = 1
    elif flavor == "multiplier":
        del sig["C_IN"]
        constexprs["C_IN"] = 1
        sig["C_OUT_G"] = "i32"
    else:  # C_OUT_G: C_OUT (GEMM: the group offset is 0) or a group's width, no alignment either way
        sig["C_OUT_G"] = "i32"
        if flavor in ("grouped", "flat"):  # 3, 4, 8, ... channels (per group): no 16-hint
            aligned.remove("C_IN")
    aligned[:] = [n for n in aligned if n not in constexprs]


def _inspect_fwd(dtype, mode: str):
    """_conv_bn_fwd_kernel as conv_bn_act_forward launches it: "stats" (training pass 1,
    conv + z store + Chan partials), "apply" (eval, or FWD_RECOMPUTE's second pass:
    conv + BN + residual + ReLU), "from_z" (training pass 2: elementwise over z),
    "z_stats" (CONV_Z="aten": the Chan partials of a given z, elementwise). A "dw_"/"mult_"/"grouped_"
    prefix: the same pass of a depthwise/channel-multiplier/grouped conv (DIRECT)."""
    p, f32 = _INSPECT_PTR[dtype], "*fp32"
    flavor, mode = _direct_flavor(mode)
    stats, apply_ = mode in ("stats", "z_stats"), mode in ("apply", "from_z")
    ptrs = {"x_ptr": p, "w_ptr": p, "bias_ptr": p, "z_ptr": p, "y_ptr": p, "res_ptr": p,
            "mean_ptr": f32 if apply_ else p, "rstd_ptr": f32 if apply_ else p,
            "gamma_ptr": f32, "beta_ptr": f32,
            "pmean_ptr": f32 if stats else p, "pm2_ptr": f32 if stats else p}
    ints = ("M", "C_OUT", "C_IN", "H", "W", "OH", "OW", "s_xn", "s_xh", "s_xw", "s_wh", "s_ww", "s_wc",
            "s_on", "s_oh", "s_ow", "s_rn", "s_rh", "s_rw")
    unit = ("s_xc", "s_wo", "s_oc", "s_rc")
    sig, constexprs, aligned = _inspect_args(ptrs, ints, unit, ints[:3] + ints[7:13] + ("s_on", "s_rn"))
    # pixel strides of channels_last (N, C, 7, 7): s_n = 49 C, s_h = 7 C, s_w = C, all multiples of 16
    aligned += ["s_oh", "s_ow", "s_rh", "s_rw"]
    constexprs.update(_INSPECT_GEOM)
    constexprs.update(FROM_Z=mode in ("from_z", "z_stats"), HAS_BIAS=True, STATS=stats,
                      STORE_Z=mode == "stats" and FWD_RECOMPUTE is not True,
                      APPLY=apply_, HAS_RES=True, HAS_W=True, HAS_B=True)
    _direct_args(flavor, sig, constexprs, aligned)
    return sig, constexprs, aligned


def _inspect_bwd(dtype, mode: str):
    """_conv_bn_bwd_kernel as conv_bn_act_backward launches it: in training
    (BWD_RECOMPUTE_TWICE) "reduce" (pass 1: recompute, partial sums, dresidual) and
    "emit_dz" (pass 2: recompute, dz and its per-tile sums for the conv bias); in eval
    mode "eval" (one pass: recompute, partial sums, dresidual and dz). A "z_" prefix: the
    same pass reading z instead of recomputing it (the buffered backward, CONV_Z="aten"); a
    "dw_"/"mult_"/"grouped_" prefix: a depthwise/channel-multiplier/grouped conv (DIRECT)."""
    p, f32 = _INSPECT_PTR[dtype], "*fp32"
    flavor, mode = _direct_flavor(mode)
    from_z, mode = mode.startswith("z_"), mode.removeprefix("z_")
    reduce_, emit, training = mode in ("reduce", "eval"), mode in ("emit_dz", "eval"), mode != "eval"
    ptrs = {"x_ptr": p, "w_ptr": p, "bias_ptr": p, "z_ptr": p, "g_ptr": p, "res_ptr": p, "dz_ptr": p,
            "dres_ptr": p, "mean_ptr": f32, "rstd_ptr": f32, "gamma_ptr": f32, "beta_ptr": f32,
            "sg_ptr": f32 if mode == "emit_dz" else p, "sgx_ptr": f32 if mode == "emit_dz" else p,
            "pg_ptr": f32 if reduce_ else p, "pgx_ptr": f32 if reduce_ else p, "pdb_ptr": f32 if emit else p}
    ints = ("M", "C_OUT", "C_IN", "H", "W", "OH", "OW", "s_xn", "s_xh", "s_xw", "s_wh", "s_ww", "s_wc",
            "s_on", "s_oh", "s_ow", "s_gn", "s_gh", "s_gw", "s_rn", "s_rh", "s_rw")
    unit = ("s_xc", "s_wo", "s_oc", "s_gc", "s_rc")
    sig, constexprs, aligned = _inspect_args(ptrs, ints, unit, ints[:3] + ints[7:], floats=("inv_count",))
    constexprs.update(_INSPECT_GEOM)
    constexprs.update(FROM_Z=from_z, STORE_Z=False, REDUCE=reduce_, EMIT_DZ=emit, TRAINING=training,
                      STORE_DRES=mode != "emit_dz", HAS_BIAS=True, HAS_RES=True, HAS_W=True, HAS_B=True)
    _direct_args(flavor, sig, constexprs, aligned)
    return sig, constexprs, aligned


def _inspect_dx(dtype, mode: str):
    """_conv_dx_kernel as conv_dx launches it: dz and dx channels_last, weight (KH, KW, C_out, C_in)."""
    p = _INSPECT_PTR[dtype]
    ints = ("M", "C_IN", "C_OUT", "H", "W", "OH", "OW", "s_dn", "s_dh", "s_dw", "s_wh", "s_ww", "s_wo",
            "s_xn", "s_xh", "s_xw")
    sig, constexprs, aligned = _inspect_args({"dz_ptr": p, "w_ptr": p, "dx_ptr": p}, ints,
                                             ("s_dc", "s_wc", "s_xc"), ints[:3] + ints[7:])
    constexprs.update(_INSPECT_GEOM)
    return sig, constexprs, aligned


def _inspect_dw(dtype, mode: str):
    """_conv_dw_kernel as conv_dw launches it: dz and x channels_last, fp32 split-K partials."""
    p = _INSPECT_PTR[dtype]
    ints = ("P", "C_OUT", "C_IN", "H", "W", "OH", "OW", "iters_per_split", "s_dn", "s_dh", "s_dw",
            "s_xn", "s_xh", "s_xw")
    pre = "*fp32" if mode == "pre_act" else p  # off: x stands for the prologue's pointers
    sig, constexprs, aligned = _inspect_args({"dz_ptr": p, "x_ptr": p, "part_ptr": "*fp32", "pre_mean_ptr": pre,
                                              "pre_scale_ptr": pre, "pre_shift_ptr": pre}, ints,
                                             ("s_dc", "s_xc"), ("P", "C_OUT", "C_IN", "s_dn", "s_dh", "s_dw",
                                                                "s_xn", "s_xh", "s_xw"))
    constexprs.update(_INSPECT_GEOM)
    constexprs.update(PRE_ACT=mode == "pre_act", ACTIVATION="relu", NEG_SLOPE=0.0)
    return sig, constexprs, aligned


# the launch modes whose epilogue applies the activation (or its derivative)
_ACTIVATION_MODES = ("apply", "reduce", "emit_dz", "eval")


def inspect_specs():
    """One spec per distinct compile of every kernel of this module, for the sm90 and
    sm80 table entries (fp16 and bf16 for "16bit", fp32 with tf32/ieee for "tf32"/"fp32"):
    the GEMM-shaped kernels (forward "stats" and "apply", backward "reduce",
    "emit_dz" and "eval", dX, dW) at each entry (ReLU; bf16 also with GELU, config
    ``"activation": "gelu"``), the elementwise forward pass at ``_ELEM_CONFIG``
    and the statistics finalize kernel as ``_finalize_stats`` launches it. Entries
    that compile to the same code share one spec (their labels joined)."""
    # (kernel, spec builder, launch modes): the implicit-GEMM passes at each table entry, and the
    # passes over a z buffer (the buffered forward and backward, CONV_Z="aten") at _ELEM_CONFIG
    gemm_kernels = ((_conv_bn_fwd_kernel, _inspect_fwd, ("stats", "apply")),
                    (_conv_bn_bwd_kernel, _inspect_bwd, ("reduce", "emit_dz", "eval")),
                    (_conv_dx_kernel, _inspect_dx, ("",)), (_conv_dw_kernel, _inspect_dw, ("", "pre_act")))
    elem_kernels = ((_conv_bn_fwd_kernel, _inspect_fwd, ("from_z", "z_stats")),
                    (_conv_bn_bwd_kernel, _inspect_bwd, ("z_reduce", "z_emit_dz", "z_eval")))
    specs, by_key = [], {}

    def add(key, label, make):
        if key in by_key:  # identical compile: one spec, every table entry named
            if label not in by_key[key]["source"].split(","):
                by_key[key]["source"] += "," + label
            return
        by_key[key] = spec = make()
        spec["source"] = label
        specs.append(spec)

    def make(fn, build, mode, dtype, precision, cfg, arch, gemm, activation="relu"):
        if fn is _conv_dw_kernel:
            cfg = _dw_config(cfg, dtype, precision, mode == "pre_act", _INSPECT_FAMILY[arch])
        sig, constexprs, aligned = build(dtype, mode)
        constexprs.update(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                          GROUP_M=cfg.GROUP_M, PRECISION=precision, UPCAST=False)
        if gemm:
            config = _inspect_config(cfg, mode, dtype, precision)
            if not mode:
                del config["mode"]
        else:  # no dot: BLOCK_K and the precision do not matter
            config = {"mode": mode, "BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N,
                      "GROUP_M": cfg.GROUP_M, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        if fn in (_conv_bn_fwd_kernel, _conv_bn_bwd_kernel):
            constexprs["EPILOGUE_SPLIT"] = config["EPILOGUE_SPLIT"] = cfg.EPILOGUE_SPLIT
            constexprs.update(act_meta(activation))
            if activation != "relu":
                config["activation"] = activation
        return {"fn": fn, "kernel": fn.__name__, "arch": arch, "dtype": dtype, "config": config,
                "signature": sig, "constexprs": constexprs, "num_warps": cfg.num_warps,
                "num_stages": cfg.num_stages, "gemm": gemm, "aligned": aligned}

    for (family, opclass, bucket), cfg in _TABLE.items():
        arch = _INSPECT_ARCH.get(family)
        if arch is None:
            continue
        label = f"{family}/{opclass}/{bucket}"
        if opclass == "16bit":
            variants = [(torch.float16, "ieee"), (torch.bfloat16, "ieee")]
        else:
            variants = [(torch.float32, "tf32" if opclass == "tf32" else "ieee")]
        for dtype, precision in variants:
            for fn, build, modes in gemm_kernels:
                for mode in modes:
                    add((fn.__name__, mode, arch, dtype, precision, cfg), label,
                        functools.partial(make, fn, build, mode, dtype, precision, cfg, arch, True))
                    # bf16 also with GELU (erf, and exp in its derivative): the heaviest activation epilogue
                    if dtype == torch.bfloat16 and mode in _ACTIVATION_MODES:
                        add((fn.__name__, mode, arch, dtype, precision, cfg, "gelu"), label,
                            functools.partial(make, fn, build, mode, dtype, precision, cfg, arch, True, "gelu"))
            # one compile per (arch, dtype, mode): the first entry's precision stands for all
            for fn, build, modes in elem_kernels:
                for mode in modes:
                    add((fn.__name__, mode, arch, dtype), f"{family}/elem",
                        functools.partial(make, fn, build, mode, dtype, precision, _ELEM_CONFIG, arch, False))
        # statistics finalize (fp32 partials whatever the dtype): TILE_M is the BLOCK_M of the
        # pass that wrote the partials (the entry's, the elementwise or the DIRECT one's)
        for tile_m in sorted({cfg.BLOCK_M, _ELEM_CONFIG.BLOCK_M, _DIRECT_CONFIG.BLOCK_M,
                              _DIRECT_GROUPED_CONFIG.BLOCK_M}):
            def make_fin(tile_m=tile_m):
                sig, constexprs, aligned = _inspect_args(
                    {"pmean_ptr": "*fp32", "pm2_ptr": "*fp32", "mean_ptr": "*fp32", "rstd_ptr": "*fp32"},
                    ("T", "C", "M"), (), ("C", "M"), floats=("eps",))
                constexprs.update(TILE_M=tile_m, BLOCK_T=64, BLOCK_C=32)
                return {"fn": _bn_stats_finalize_kernel, "kernel": "_bn_stats_finalize_kernel", "arch": arch,
                        "dtype": torch.float32,
                        "config": {"TILE_M": tile_m, "BLOCK_T": 64, "BLOCK_C": 32, "num_warps": 4, "num_stages": 3},
                        "signature": sig, "constexprs": constexprs, "num_warps": 4, "num_stages": 3,
                        "gemm": False, "aligned": aligned}
            add(("_bn_stats_finalize_kernel", arch, tile_m), f"{family}/finalize", make_fin)
        # the running-statistics update, buffers in fp32 (AMP) or in the model's 16-bit dtype, at the
        # block of 64 channels and of 1024 (update_running_stats_: up to 1024 channels a program)
        for buf_dtype, block_c in itertools.product((torch.float32, torch.bfloat16, torch.float16), (64, 1024)):
            def make_upd(buf_dtype=buf_dtype, block_c=block_c):
                buf = _INSPECT_PTR[buf_dtype]
                sig, constexprs, aligned = _inspect_args(
                    {"mean_ptr": "*fp32", "rstd_ptr": "*fp32", "rm_ptr": buf, "rv_ptr": buf}, ("C",),
                    ("s_rm", "s_rv"), ("C",), floats=("eps", "momentum", "bessel"))
                constexprs.update(BLOCK_C=block_c)
                return {"fn": _bn_running_update_kernel, "kernel": "_bn_running_update_kernel", "arch": arch,
                        "dtype": buf_dtype, "config": {"BLOCK_C": block_c, "num_warps": 4, "num_stages": 3},
                        "signature": sig, "constexprs": constexprs, "num_warps": 4, "num_stages": 3,
                        "gemm": False, "aligned": aligned}
            add(("_bn_running_update_kernel", arch, buf_dtype, block_c), f"{family}/running_update", make_upd)
    # the flat K loop of a stem (FLAT_K; BLOCK_K as layer_config gives a 7x7 conv on 3 channels:
    # K = 147, clamped to the entry's 64; the geometry constexprs are the other specs' 3x3): the
    # GEMM passes at each sm90/sm80 16-bit table entry, fp16 and bf16
    for (family, opclass, bucket), cfg in _TABLE.items():
        arch = _INSPECT_ARCH.get(family)
        if arch is None or opclass != "16bit":
            continue
        stem = release_tuned(cfg, "conv_flat_k", family, opclass, bucket)
        stem = stem._replace(BLOCK_K=_clamp_k(cfg.BLOCK_K, 7 * 7 * 3))
        for dtype in (torch.float16, torch.bfloat16):
            for fn, build, modes in gemm_kernels[:2]:
                for mode in modes:
                    add((fn.__name__, "flat_" + mode, arch, dtype, "ieee", stem), f"{family}/{opclass}/{bucket}/flat_k",
                        functools.partial(make, fn, build, "flat_" + mode, dtype, "ieee", stem, arch, True))
    # wide groups (the implicit GEMM per group): the bf16 table entries narrowed to 16 and 32 columns
    # (_group_tile: 112 or 48 channels per group; 64 is the table's own tile)
    for (family, opclass, bucket), cfg in _TABLE.items():
        arch = _INSPECT_ARCH.get(family)
        if arch is None or opclass != "16bit":
            continue
        for out_per_group in (16, 32):
            narrow = _group_tile(cfg, out_per_group)
            for fn, build, modes in gemm_kernels[:2]:
                for mode in modes:
                    add((fn.__name__, mode, arch, torch.bfloat16, "ieee", narrow), f"{family}/{bucket}/grouped_gemm",
                        functools.partial(make, fn, build, mode, torch.bfloat16, "ieee", narrow, arch, True))
    # grouped convs (DIRECT: FMA, one tile for every architecture): the passes that run a conv, for
    # depthwise convs in every dtype (bf16 also with GELU), depthwise with a channel multiplier and
    # wider groups in bf16
    for family, arch in _INSPECT_ARCH.items():
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for fn, build, modes in gemm_kernels[:2]:
                for mode in modes:
                    flavors = (("dw_", _direct_tuned(_DIRECT_CONFIG, family)),
                               ("mult_", _direct_tuned(_DIRECT_GROUPED_CONFIG, family)),
                               ("grouped_", _direct_tuned(_DIRECT_GROUPED_CONFIG, family)))
                    for flavor, direct_cfg in flavors[:3 if dtype == torch.bfloat16 else 1]:
                        add((fn.__name__, flavor + mode, arch, dtype), f"{family}/direct",
                            functools.partial(make, fn, build, flavor + mode, dtype, "ieee", direct_cfg, arch,
                                              False))
                    if dtype == torch.bfloat16 and mode in _ACTIVATION_MODES:
                        add((fn.__name__, "dw_" + mode, arch, dtype, "gelu"), f"{family}/direct",
                            functools.partial(make, fn, build, "dw_" + mode, dtype, "ieee",
                                              _direct_tuned(_DIRECT_CONFIG, family), arch,
                                              False, "gelu"))
    return specs
