"""Shared pieces of the dense kernels: tile table, activations, GEMM main loop.

Two kernels live here and serve every dense launcher:

- ``_gemm_act_kernel``: ``C = act(A @ B + bias)`` with the bias and the
  activation in the epilogue (``act`` may be ``"none"``). A is (M, K), B is
  (K, N); both are read through their strides, so ``W^T`` or ``g_h^T`` cost no
  copy.
- ``_gemm_act_grad_kernel``: recomputes ``h = A @ B + bias`` tile by tile with
  the *same* main loop and tile configuration as the forward, then in its
  epilogue emits ``g_h = act'(h) * G`` (G is the incoming gradient), optionally
  ``a = act(h)``, and per-tile partial column sums of ``g_h`` (for the bias
  gradient). ``h`` never reaches global memory. With ``ROW_SCALE`` (a routed
  ungated expert) G's rows are scaled in the epilogue and the row dots
  ``act(h) . G`` (the routing weights' gradient) come out per column tile.

Bit-identical recompute: both kernels call ``_mainloop`` with the tile
configuration from ``gemm_config`` (a pure function of M, N, K, dtype and the
device architecture), so for a given layer the forward and the backward
recompute run the same BLOCK_K, the same K order, no split-K, and add the bias
the same way: the pre-activation is equal bit for bit and no value near 0
changes sides of the ReLU.

Operand loads (``GEMM_TMA``): plain pointer tiles (the default), or Hopper's tensor
memory accelerator through host-side tensor descriptors (``TMA=True``): A and B^T
(both K-contiguous: x and a Linear weight) are copied tile by tile into shared memory
by the TMA unit, without the pointer tensors and address math of the pointer path
(sm_90, bf16, 128x256, ReLU forward: 165 registers instead of 186). What makes a 256x128 tile
fit is the epilogue, not the loads: ~1 KiB of spill unsplit in the grad kernel, 16-40 bytes in
quarters, none in eighths with the activation computed per slice (``EPILOGUE_SPLIT``).
Whether the bulk copies are faster is for the GPU sweep (benchmarks/gpu_tile_sweep.py).
The choice is a pure function of the operands (``_use_tma``), so a forward and its
recompute take the same path.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import operator
import os
import sys
import types
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fusedrc._state import tf32_matmul_allowed, traced
from fusedrc._validate import CheckedCalls
from fusedrc.reference import check_activation, split_activation  # noqa: F401  (one definition)
from fusedrc.reference import wanted  # noqa: F401  (the launchers' output_mask, one definition)

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

try:
    from torch.library import wrap_triton
except ImportError:  # torch < 2.6: no triton_op either, the fused ops stay custom ops
    def wrap_triton(kernel):
        return kernel

# kernel ACTIVATION names; "leaky_relu" takes its slope as NEG_SLOPE (act_meta)
ACTIVATIONS = ("relu", "relu2", "gelu", "gelu_tanh", "silu", "relu6", "hardswish", "quick_gelu", "leaky_relu")


# --------------------------------------------------------------------------- tile table
class GemmConfig(NamedTuple):
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int
    # The grad kernel's epilogue works on 1, 2, 4 or 8 column slices of the tile, one after the
    # other: each slice's incoming gradient, activation temporaries and stores are live alone.
    # sm_90, bf16, 128x128 on 8 warps, gelu: 255 registers unsplit, 174 in halves, 128 in
    # quarters (2 CTAs per SM instead of 1, so one CTA's epilogue overlaps another's main loop).
    # The forward's epilogue takes the split too where the tile is wide (``_wide_tile``) or
    # carries dropout. Values only, never the recomputed h: any split gives the same y, g_h and
    # act(h) bits; the bias gradient's column sums and the routed experts' row dots (ROW_SCALE)
    # agree to rounding (a GPU adds a slice's rows in another order; the row dots add the slices).
    EPILOGUE_SPLIT: int = 1


# Keyed by (architecture family, operand class, shape bucket). Operand classes:
# "16bit" (fp16/bf16, tensor cores), "tf32" (fp32 with tf32 allowed: tensor
# cores, 4-byte operands), "fp32" (fp32 "ieee": FMA units). Shared memory per
# stage is (BM + BN) * BK * bytes; every entry fits the family's budget
# (sm90/sm100: 227 KiB, sm80: 163 KiB, "small_smem" (sm75/86/89/120): ~99 KiB).
# These are starting points chosen by those budgets and the sm_90 HGMMA rules
# (BLOCK_M >= 64, num_warps a multiple of 4); retune offline on the GPU and
# commit the table. The 7th field (EPILOGUE_SPLIT, default 1) is the split that
# minimised the grad kernel's registers in `python -m fusedrc.inspect` (gelu,
# bf16 / fp32; sm_90 16-bit 128x128: 255 -> 128, tf32 128x64: 169 -> 100, sm_80 tf32
# 128x128: 255 -> 176); the small_smem family is not compiled there and stays unsplit.
# Never autotuned at run time: the forward and the backward recompute must read the
# same entry.
_TABLE = {
    # ---- Hopper / datacenter Blackwell
    ("sm90", "16bit", "small"): GemmConfig(64, 64, 64, 8, 4, 4, 4),
    ("sm90", "16bit", "medium"): GemmConfig(128, 128, 64, 8, 8, 3, 4),
    # 256x128: on an H100 (tile_sweep_cuda_20261127-084919.json, bf16, 8192x4096 -> 16384, ReLU) it
    # ran the forward in 1.71 ms and the grad kernel in 1.86 ms (98% / 90% of cuBLAS's 1.68 ms), the
    # 128x128 entry before it (128, 128, 64, 8, 8, 4, 4) 1.82 / 2.12 ms (92% / 79%). That run's
    # 256x128 was unsplit and spilled (~1 KiB in the grad kernel); in eighths, with the activation
    # computed per slice, neither kernel spills (fusedrc.inspect, every activation, dropout, TMA).
    ("sm90", "16bit", "large"): GemmConfig(256, 128, 64, 8, 8, 3, 8),
    ("sm90", "tf32", "small"): GemmConfig(64, 64, 32, 8, 4, 4, 4),
    # tf32 128x128 (8 warps): the grad kernel's epilogue spills (255 registers); 128x64 does not
    ("sm90", "tf32", "medium"): GemmConfig(128, 64, 32, 8, 8, 3, 2),
    ("sm90", "tf32", "large"): GemmConfig(128, 64, 32, 8, 8, 4, 2),
    ("sm90", "fp32", "small"): GemmConfig(32, 64, 32, 8, 4, 3),
    ("sm90", "fp32", "medium"): GemmConfig(64, 64, 32, 8, 4, 3),
    ("sm90", "fp32", "large"): GemmConfig(128, 64, 32, 8, 8, 3, 2),
    # ---- Ampere A100
    ("sm80", "16bit", "small"): GemmConfig(32, 64, 64, 8, 4, 4),
    # 128x64 on 4 warps, 128x128 on 8 warps: the grad kernel spills; 128x64 on 8 warps: ~126 registers
    ("sm80", "16bit", "medium"): GemmConfig(128, 64, 64, 8, 8, 3, 4),
    ("sm80", "16bit", "large"): GemmConfig(128, 64, 64, 8, 8, 4, 4),
    ("sm80", "tf32", "small"): GemmConfig(32, 64, 32, 8, 4, 4),
    ("sm80", "tf32", "medium"): GemmConfig(64, 128, 32, 8, 4, 3, 4),
    ("sm80", "tf32", "large"): GemmConfig(128, 128, 32, 8, 8, 3, 4),
    ("sm80", "fp32", "small"): GemmConfig(32, 64, 32, 8, 4, 3),
    ("sm80", "fp32", "medium"): GemmConfig(64, 64, 32, 8, 4, 3),
    ("sm80", "fp32", "large"): GemmConfig(128, 64, 32, 8, 8, 3, 2),
    # ---- consumer parts, ~99 KiB of shared memory
    ("small_smem", "16bit", "small"): GemmConfig(32, 64, 64, 8, 4, 3),
    ("small_smem", "16bit", "medium"): GemmConfig(64, 128, 32, 8, 4, 3),
    ("small_smem", "16bit", "large"): GemmConfig(128, 128, 32, 8, 8, 2),
    ("small_smem", "tf32", "small"): GemmConfig(32, 64, 32, 8, 4, 2),
    ("small_smem", "tf32", "medium"): GemmConfig(64, 64, 32, 8, 4, 3),
    ("small_smem", "tf32", "large"): GemmConfig(128, 64, 32, 8, 4, 2),
    ("small_smem", "fp32", "small"): GemmConfig(32, 64, 32, 8, 4, 2),
    ("small_smem", "fp32", "medium"): GemmConfig(64, 64, 32, 8, 4, 2),
    ("small_smem", "fp32", "large"): GemmConfig(64, 64, 32, 8, 4, 3),
}

# Triton's interpreter (CPU tensors, no GPU): small tiles, so that the small
# test shapes still cover several tiles in M and N, a K loop and ragged edges, and the
# grad kernel's split epilogue.
_INTERPRETER_CONFIG = GemmConfig(32, 32, 32, 2, 4, 1, 2)


def _arch_family(capability) -> str:
    major, minor = capability
    if major in (9, 10):
        return "sm90"
    if (major, minor) == (8, 0):
        return "sm80"
    return "small_smem"


def _shape_bucket(M: int, N: int, K: int) -> str:
    if M <= 64 or N <= 64:
        return "small"
    if M >= 2048 and N >= 2048 and K >= 512:
        return "large"
    return "medium"


def device_capability(t: torch.Tensor):
    """(major, minor) of the tensor's CUDA device; None on CPU (interpreter)."""
    if t.device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(t.device)


def operand_class(dtype: torch.dtype, precision: str) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        return "16bit"
    return "tf32" if precision == "tf32" else "fp32"


# Per Triton release, launch parameters that change no value (an epilogue split, num_stages) for the
# configurations whose registers spill under that release alone (`python -m fusedrc.inspect` run under
# it; the tiles were timed under 3.6, and 3.6 and 3.9 compile every one of them without a spill).
# (major, minor) -> {site: {field: value}}; a site names one launch decision, read by the function that
# makes it for the launchers and for ``inspect_specs`` alike (``release_tuning``). Never a tile, a K
# order or num_warps: a forward and its recompute still read the same entry and compute the same bits.
_RELEASE_TUNING = {
    (3, 7): {
        # the routed ungated experts' row-scale grad kernel (``_routed_split``) on sm_90's 256x128 tile:
        # 255 registers and 120 bytes of spill in eighths (bf16, relu2), 252 and none in sixteenths
        ("_gemm_act_grad_kernel", "row_scale", 256, 128): {"EPILOGUE_SPLIT": 16},
        # gpt-oss's experts (interleaved gate/up rows, biases; gated_mlp._clamp_split) on the whole 128-column
        # tile: the routed grad kernel 255 registers and 32 bytes of spill in sixteenths (sm_90 bf16), 255 and
        # none in 32nds
        ("_gated_act_grad_kernel", "interleaved_bias", 128): {"EPILOGUE_SPLIT": 32},
        # conv_bn_act: a stem's flat K loop (``conv_config(flat=True)``) at sm_80's 16-bit wide entry
        # (128x64x64): the forward's apply pass 16 bytes of spill in quarters, the backward's three 8
        # (fp16 and bf16); none in halves
        ("conv_flat_k", "sm80", "16bit", "wide"): {"EPILOGUE_SPLIT": 2},
        # conv_bn_act: the dW kernel with the PRE_ACT prologue on fp32 FMA (``_dw_config``) on sm_80:
        # 128 registers and 8 bytes of spill at 2 stages, 142 and none at 3
        ("_conv_dw_kernel", "pre_act", "sm80"): {"num_stages": 3},
        # conv_bn_act: the depthwise DIRECT tile (``direct_config``) on sm_80: the backward's eval pass
        # (fp16) 96 registers and 8 bytes of spill in halves, none in quarters
        ("conv_direct", "sm80", 64, 64): {"EPILOGUE_SPLIT": 4},
    },
}


def _triton_release():
    try:
        return tuple(int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:  # pragma: no cover - an unusual version string: no release tuning
        return None


_TRITON_RELEASE = _triton_release()


def release_tuning(*site) -> dict:
    """The fields ``_RELEASE_TUNING`` sets at ``site`` under the installed Triton ({} almost everywhere)."""
    return _RELEASE_TUNING.get(_TRITON_RELEASE, {}).get(site, {})


def release_tuned(cfg, *site):
    """``cfg`` (a config NamedTuple) with the fields ``_RELEASE_TUNING`` sets at ``site``; ``cfg`` itself almost
    everywhere."""
    return cfg._replace(**release_tuning(*site))


# Where the table's entry is a wide tile (``_wide_tile``), the tile of the launches that cannot take it:
# the dense kernels with dropout in their epilogue (the forward's mask spills 16 bytes on sm_90 under
# Triton 3.6 even in eighths) and the gated kernels (two accumulators). The entry it replaced.
_NARROW = {("sm90", "16bit", "large"): GemmConfig(128, 128, 64, 8, 8, 4, 4)}


def gemm_config(M: int, N: int, K: int, dtype: torch.dtype, precision: str, capability,
                narrow: bool = False) -> GemmConfig:
    """Tile configuration for an (M, K) @ (K, N) GEMM; a pure function of its arguments.

    ``capability`` is the CUDA (major, minor) or None for the interpreter. ``narrow``: ``_NARROW``'s
    tile where the table's is wide (a launch with dropout, grouped experts or xIELU: arguments of the op,
    so its forward and its recompute ask alike).
    """
    if capability is None:
        return _INTERPRETER_CONFIG
    key = (_arch_family(capability), operand_class(dtype, precision), _shape_bucket(M, N, K))
    return _NARROW.get(key, _TABLE[key]) if narrow else _TABLE[key]


def dot_precision(t: torch.Tensor) -> str:
    """"tf32" only when torch itself allows tf32 for fp32 matmuls on CUDA, else "ieee"."""
    if t.dtype == torch.float32 and t.device.type == "cuda" and tf32_matmul_allowed():
        return "tf32"
    return "ieee"


# Read once: @triton.jit chose interpreted or compiled kernels when this module was imported.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    return _INTERPRETING


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids: ``triton.cdiv`` is a constexpr_function in recent Triton
    and costs ~2 us a call on the host, several times per launch."""
    return -(-a // b)


def _upcast_flag(t: torch.Tensor) -> bool:
    # The interpreter computes bf16 on raw 16-bit patterns: go through fp32 there.
    return t.dtype == torch.bfloat16 and interpreting()


# --------------------------------------------------------------------------- activations
@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _gelu_tanh_t(h):
    """tanh(u) of gelu_tanh as 2 sigmoid(2u) - 1 (no libdevice tanh in the interpreter); rounds to
    -1 where torch's tanh does, so act(h) and its derivative are exactly 0 there, as in torch (an
    inf factor then gives NaN, not inf times a tiny value)."""
    return 2.0 * _sigmoid(1.5957691216057308 * (h + 0.044715 * h * h * h)) - 1.0


@triton.jit
def _act_fwd(h, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr):
    """act(h) in fp32. ReLU keeps NaN (a NaN is not < 0), as torch does."""
    if ACTIVATION == "none":
        y = h
    elif ACTIVATION == "relu":
        y = tl.where(h < 0.0, 0.0, h)
    elif ACTIVATION == "relu2":
        r = tl.where(h < 0.0, 0.0, h)
        y = r * r
    elif ACTIVATION == "gelu":
        y = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        # torch's 0.5 h (1 + tanh(u)), not the shorter h * sigmoid(2u) (see _gelu_tanh_t)
        y = 0.5 * h * (1.0 + _gelu_tanh_t(h))
    elif ACTIVATION == "relu6":
        y = tl.where(h < 0.0, 0.0, tl.where(h > 6.0, 6.0, h))  # clamp: NaN stays NaN, as torch's hardtanh
    elif ACTIVATION == "hardswish":
        # torch's x * min(max(x + 3, 0), 6) / 6 (a NaN x gives NaN through the product)
        y = h * tl.minimum(tl.maximum(h + 3.0, 0.0), 6.0) / 6.0
    elif ACTIVATION == "quick_gelu":
        y = h * _sigmoid(1.702 * h)  # CLIP's h * sigmoid(1.702 h)
    elif ACTIVATION == "leaky_relu":
        y = tl.where(h > 0.0, h, h * NEG_SLOPE)  # torch's x > 0 ? x : x * slope (NaN: NaN * slope)
    else:  # silu
        y = h * _sigmoid(h)
    return y


@triton.jit
def _act_grad(h, g, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr):
    """act'(h) * g in fp32, with the formulas of torch's backward kernels."""
    if ACTIVATION == "none":
        gh = g
    elif ACTIVATION == "relu":
        gh = tl.where(h <= 0.0, 0.0, g)  # threshold_backward: a NaN h lets g through, as in torch
    elif ACTIVATION == "relu2":
        # autograd of square(relu(h)) ends in threshold_backward: 0 where h <= 0 even for g = inf/NaN
        r = tl.where(h < 0.0, 0.0, h)
        gh = tl.where(h <= 0.0, 0.0, g * (2.0 * r))
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
        pdf = tl.exp(-0.5 * h * h) * 0.3989422804014327
        gh = g * (cdf + h * pdf)
    elif ACTIVATION == "gelu_tanh":
        # aten's gelu_backward(approximate="tanh")
        t = _gelu_tanh_t(h)
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
        gh = g * (0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * du)
    # relu6, hardswish: a NaN h lets g through, as torch's CUDA kernels and its CPU kernels' scalar
    # path do (their vectorized CPU path gives 0 and NaN there)
    elif ACTIVATION == "relu6":
        gh = tl.where((h <= 0.0) | (h >= 6.0), 0.0, g)  # hardtanh_backward: 0 at the kinks
    elif ACTIVATION == "hardswish":
        # hardswish_backward with torch's CPU kinks: 0 up to -3 included, g from 3 on (CUDA's: -g/2, 3g/2)
        gh = tl.where(h <= -3.0, 0.0, tl.where(h < 3.0, g * (h / 3.0 + 0.5), g))
    elif ACTIVATION == "quick_gelu":
        # autograd of h * sigmoid(1.702 h): g s + 1.702 (g h) s (1 - s)
        s = _sigmoid(1.702 * h)
        gh = g * s + 1.702 * ((g * h) * (s * (1.0 - s)))
    elif ACTIVATION == "leaky_relu":
        gh = tl.where(h > 0.0, g, g * NEG_SLOPE)  # leaky_relu_backward: a NaN h takes the slope side
    else:  # silu
        s = _sigmoid(h)
        gh = g * (s * (1.0 + h * (1.0 - s)))
    return gh


# xIELU (Apertus; arXiv 2411.13010): xielu(h) = alpha_p h^2 + beta h for h > 0, alpha_n (expm1(min(h, eps)) - h)
# + beta h otherwise. The alphas are learned (read from xielu_alpha_ptr: they change every step, and a scalar
# argument would need a host sync), beta and eps are fixed floats passed by value. ACTIVATION="xielu" in the dense
# kernels only: their epilogues take it apart from _act_fwd/_act_grad, which know no parameters.
@triton.jit
def _xielu_parts(h, eps):
    """(h > 0, the alpha_p factor h^2, the alpha_n factor expm1(min(h, eps)) - h) in fp32. With m = min(h, eps),
    expm1(m) - h = (expm1(m) - m) - (h - m): the first term by its series where |m| < 1 (exp(m) - 1 - m cancels
    to nothing near 0, where most h lie), the second exact. m keeps a NaN h (torch.minimum's), as tl.minimum
    would not."""
    pos = h > 0.0
    m = tl.where(h > eps, eps, h)
    series = 0.5 * m * m * (1.0 + m / 3.0 * (1.0 + m / 4.0 * (1.0 + m / 5.0 * (1.0 + m / 6.0 * (
        1.0 + m / 7.0 * (1.0 + m / 8.0 * (1.0 + m / 9.0 * (1.0 + m / 10.0))))))))
    em1_m = tl.where(m > -1.0, series, tl.exp(m) - 1.0 - m)
    # h - m, 0 where h <= eps (h - h is NaN at h = -inf; torch's expm1(-inf) + inf is inf)
    return pos, h * h, em1_m - tl.where(h > eps, h - eps, 0.0)


@triton.jit
def _xielu_fwd(h, alpha_ptr, beta, eps):
    pos, p, n = _xielu_parts(h, eps)
    return tl.where(pos, tl.load(alpha_ptr) * p, tl.load(alpha_ptr + 1) * n) + beta * h


@triton.jit
def _xielu_grad(h, g, mask, alpha_ptr, beta, eps):
    """(xielu'(h) g, the sums over the tile's elements in ``mask`` of g h^2 where h > 0 and of
    g (expm1(min(h, eps)) - h) elsewhere: the alphas' gradients' shares). Masked, not by g = 0: the main loop's
    clamped loads fill the columns past N with real ones, whose h may be infinite."""
    pos, p, n = _xielu_parts(h, eps)
    # d expm1(min(h, eps)) / dh: exp(h) below eps, half of it at the tie (torch.minimum's), 0 above; NaN for a
    # NaN h, as autograd's (0 times exp(NaN))
    dmin = tl.where(h < eps, 1.0, tl.where(h == eps, 0.5, 0.0)) * tl.exp(tl.where(h > eps, eps, h))
    gh = g * (tl.where(pos, 2.0 * tl.load(alpha_ptr) * h, tl.load(alpha_ptr + 1) * (dmin - 1.0)) + beta)
    return gh, tl.sum(tl.sum(tl.where(mask & pos, g * p, 0.0), axis=1), axis=0), \
        tl.sum(tl.sum(tl.where(mask & ~pos, g * n, 0.0), axis=1), axis=0)


# --------------------------------------------------------------------------- main loop
@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile ``pid`` in grouped order (GROUP_M row tiles share B in L2)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _expert_tile(tile, tiles_ptr, N, MT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n, e, row0, row_end, loop_m, loop_pid_m) of output tile ``tile`` of a grouped launch (routed
    experts, one launch for all): row tile pid_m of MT is ``tiles[pid_m]`` = (expert e, row0, row_end) of the
    expert-sorted rows (no tile spans two experts); the main loop runs the expert's rows from row0 (its row tile
    0 of loop_m rows: a tensor, the loop takes .to); the caller moves the operands to row0 and to expert e's
    weights."""
    pid_m, pid_n = _tile_ids(tile, MT * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    e = tl.load(tiles_ptr + 3 * pid_m).to(tl.int64)
    row0 = tl.load(tiles_ptr + 3 * pid_m + 1)
    row_end = tl.load(tiles_ptr + 3 * pid_m + 2)
    return pid_m, pid_n, e, row0, row_end, row_end - row0, row0 * 0


@triton.jit
def _dense_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``_expert_tile``'s tuple for one (M, N) output: rows [row0, M) of row tile pid_m. Apart from
    ``_expert_tile`` so that an ungrouped launch never passes the tile table to a call: torch's mutation
    analysis (torch.compile of the triton_op twins) counts every argument of a call that yields a store's
    address as written, and would clone the input the launcher hands in as the unused table."""
    pid_m, pid_n = _tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    return pid_m, pid_n, 0, pid_m * BLOCK_M, M, M, pid_m


@triton.jit
def _mainloop(
    a_ptr, b_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    pid_m, pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):
    """fp32 accumulator of one (BLOCK_M, BLOCK_N) tile of A @ B, K in ascending order.

    The tile's base offset is 64-bit (no overflow on huge operands); offsets
    inside the tile are 32-bit. Rows/columns past M/N wrap around (modulo)
    onto valid ones so that only K needs a mask; those rows are never stored.
    TMA: ``a_ptr`` and ``b_ptr`` are tensor descriptors of A (M, K) and B^T (N, K);
    the unit zero-fills whatever lies past M, N or K.
    """
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    if TMA:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = a_ptr.load([row0, k * BLOCK_K])
            b = b_ptr.load([col0, k * BLOCK_K])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    else:
        offs_m = tl.arange(0, BLOCK_M) % (M - row0)
        offs_n = tl.arange(0, BLOCK_N) % (N - col0)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = (a_ptr + row0.to(tl.int64) * stride_am) + (offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak)
        b_ptrs = (b_ptr + col0.to(tl.int64) * stride_bn) + (offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _add_bias(acc, bias_ptr, N, col0, BLOCK_N: tl.constexpr):
    """acc + bias[col0:col0+BLOCK_N] in fp32 (identical in forward and recompute)."""
    offs_n = col0 + tl.arange(0, BLOCK_N)
    bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    return acc + bias[None, :]


@triton.jit
def _dropout_factor(seed, rows, col_start, threshold, scale, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Dropout's factor (``scale`` = 1/(1-p), or 0) for columns [col_start, col_start + WIDTH) of
    ``rows``: a pure function of the seed and each element's (row, column), whatever the tile, so
    the backward regenerates the forward's mask and nothing is stored. Philox 4x32-10 of the
    counter (column // 4, row, 0, 0) gives the words of 4 adjacent columns at once (its oracle:
    ``fusedrc.reference.philox_keep``); a word's top 24 bits against ``threshold`` =
    round(p * 2**24). A factor, not a select: a dropped NaN stays NaN, as ``x * mask`` in torch."""
    quad = (col_start // 4 + tl.arange(0, WIDTH // 4)).to(tl.uint32)
    c0 = tl.broadcast_to(quad[None, :], (ROWS, WIDTH // 4))
    c1 = tl.broadcast_to(rows.to(tl.uint32)[:, None], (ROWS, WIDTH // 4))
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero, zero)
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (ROWS, WIDTH))  # column 4q + i <- r_i
    return tl.where((r >> 8).to(tl.int32) >= threshold, scale, 0.0)


@triton.jit
def _fwd_epilogue(h, c_ptr, seed, base, M, N, row0, col0, c0, drop_threshold, drop_scale, xielu_alpha_ptr,
                  xielu_beta, xielu_eps, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, DROPOUT: tl.constexpr,
                  BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, SPLIT: tl.constexpr):
    """Activate and store columns [c0, c0 + WIDTH) of the forward's tile (h holds them), through
    dropout, in SPLIT column slices one after the other (the activation's and the mask's
    temporaries live per slice)."""
    if SPLIT > 1:
        h0, h1 = _column_halves(h, BLOCK_M, WIDTH)
        _fwd_epilogue(h0, c_ptr, seed, base, M, N, row0, col0, c0, drop_threshold, drop_scale, xielu_alpha_ptr,
                      xielu_beta, xielu_eps, ACTIVATION, NEG_SLOPE, DROPOUT, BLOCK_M, WIDTH // 2, SPLIT // 2)
        _fwd_epilogue(h1, c_ptr, seed, base, M, N, row0, col0, c0 + WIDTH // 2, drop_threshold, drop_scale,
                      xielu_alpha_ptr, xielu_beta, xielu_eps, ACTIVATION, NEG_SLOPE, DROPOUT, BLOCK_M, WIDTH // 2,
                      SPLIT // 2)
    else:
        if ACTIVATION == "xielu":
            y = _xielu_fwd(h, xielu_alpha_ptr, xielu_beta, xielu_eps)
        else:
            y = _act_fwd(h, ACTIVATION, NEG_SLOPE)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = c0 + tl.arange(0, WIDTH)
        if DROPOUT:
            y = y * _dropout_factor(seed, row0 + offs_m, col0 + c0, drop_threshold, drop_scale, BLOCK_M, WIDTH)
        mask = (offs_m[:, None] < M - row0) & (offs_n[None, :] < N - col0)
        tl.store(c_ptr + base + (offs_m[:, None] * N + offs_n[None, :]), y.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _column_halves(x, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """(x[:, :WIDTH // 2], x[:, WIDTH // 2:]) of a (ROWS, WIDTH) tile."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, WIDTH // 2)), (0, 2, 1)))


# --------------------------------------------------------------------------- kernels
# Outputs (and the incoming gradient of the grad kernel) are contiguous (M, N):
# one 32-bit in-tile offset tensor serves all of them, from a 64-bit tile base.
@triton.jit
def _preact(
    a_ptr, b_ptr, bias_ptr, e, row0, loop_m, loop_pid_m, pid_n, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    stride_be, stride_biase, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """The pre-activation of the output tile ``_expert_tile`` or ``_dense_tile`` placed: one function for the
    forward and its recompute, so both compute it alike, bit for bit. GROUPED: expert e's rows, weights and bias
    (pointer loads: the launcher sets no TMA). The tile's coordinates come from the caller, never from here:
    torch's mutation analysis (torch.compile of the triton_op twins) follows a store's address through every
    argument of the call that produced it, and would count the operands as written."""
    if GROUPED:
        a_ptr += row0.to(tl.int64) * stride_am
        b_ptr += e * stride_be
        bias_ptr += e * stride_biase
    acc = _mainloop(a_ptr, b_ptr, loop_m, N, K, stride_am, stride_ak, stride_bk, stride_bn, loop_pid_m, pid_n,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST, TMA)
    if HAS_BIAS:
        acc = _add_bias(acc, bias_ptr, N, pid_n * BLOCK_N, BLOCK_N)
    return acc


@triton.jit
def _gemm_act_tile(
    tile, a_ptr, b_ptr, bias_ptr, c_ptr, seed, tiles_ptr, xielu_alpha_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase,
    xielu_beta, xielu_eps,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, GROUPED: tl.constexpr,
):
    if GROUPED:
        pid_m, pid_n, e, row0, row_end, loop_m, loop_pid_m = _expert_tile(tile, tiles_ptr, N, MT, BLOCK_M, BLOCK_N,
                                                                          GROUP_M)
    else:
        pid_m, pid_n, e, row0, row_end, loop_m, loop_pid_m = _dense_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _preact(a_ptr, b_ptr, bias_ptr, e, row0, loop_m, loop_pid_m, pid_n, N, K, stride_am, stride_ak, stride_bk,
                  stride_bn, stride_be, stride_biase, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST,
                  TMA, GROUPED)
    col0 = pid_n * BLOCK_N
    _fwd_epilogue(acc, c_ptr, seed, row0.to(tl.int64) * N + col0, row_end, N, row0, col0, 0,
                  drop_threshold, drop_scale, xielu_alpha_ptr, xielu_beta, xielu_eps, ACTIVATION, NEG_SLOPE, DROPOUT,
                  BLOCK_M, BLOCK_N, EPILOGUE_SPLIT)


@triton.jit
def _gemm_act_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, seed_ptr, tiles_ptr, xielu_alpha_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase,
    xielu_beta, xielu_eps,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, PERSISTENT: tl.constexpr, GROUPED: tl.constexpr,
):
    seed = tl.load(seed_ptr) if DROPOUT else 0
    if PERSISTENT:  # a few programs per SM walk the tiles; flattened, the next tile's loads overlap this epilogue
        num_m = MT if GROUPED else tl.cdiv(M, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_m * tl.cdiv(N, BLOCK_N), tl.num_programs(0), flatten=True):
            _gemm_act_tile(tile, a_ptr, b_ptr, bias_ptr, c_ptr, seed, tiles_ptr, xielu_alpha_ptr, M, N, K,
                           stride_am, stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be,
                           stride_biase, xielu_beta, xielu_eps, HAS_BIAS, ACTIVATION, NEG_SLOPE, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                           EVEN_K, PRECISION, UPCAST, TMA, EPILOGUE_SPLIT, GROUPED)
    else:
        _gemm_act_tile(tl.program_id(0), a_ptr, b_ptr, bias_ptr, c_ptr, seed, tiles_ptr, xielu_alpha_ptr, M, N, K,
                       stride_am, stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be,
                       stride_biase, xielu_beta, xielu_eps, HAS_BIAS, ACTIVATION, NEG_SLOPE, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                       EVEN_K, PRECISION, UPCAST, TMA, EPILOGUE_SPLIT, GROUPED)


@triton.jit
def _grad_epilogue(h, bias_ptr, g_ptr, gh_ptr, act_ptr, part_ptr, row_scale, base, pid_m, M, N, row0, col0, c0,
                   seed, drop_threshold, drop_scale, xielu_alpha_ptr, xielu_beta, xielu_eps,
                   HAS_BIAS: tl.constexpr, SLICE_BIAS: tl.constexpr, STORE_ACT: tl.constexpr, ACTIVATION: tl.constexpr,
                   NEG_SLOPE: tl.constexpr, DROPOUT: tl.constexpr, ROW_SCALE: tl.constexpr,
                   BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, SPLIT: tl.constexpr):
    """The grad kernel's epilogue on columns [c0, c0 + WIDTH) of its tile (h holds them; with SLICE_BIAS before
    the bias, which each slice adds to its columns), in
    SPLIT column slices one after the other (halving recursively: each slice's temporaries are
    live alone). Returns the slices' share of the row dot act(h) . g (ROW_SCALE; zeros without) and, for
    xIELU, their sums of the alphas' gradients (0.0 for other activations)."""
    if SPLIT > 1:
        h0, h1 = _column_halves(h, BLOCK_M, WIDTH)
        dot0, ap0, an0 = _grad_epilogue(
            h0, bias_ptr, g_ptr, gh_ptr, act_ptr, part_ptr, row_scale, base, pid_m, M, N, row0, col0, c0, seed, drop_threshold,
            drop_scale, xielu_alpha_ptr, xielu_beta, xielu_eps, HAS_BIAS, SLICE_BIAS, STORE_ACT, ACTIVATION, NEG_SLOPE,
            DROPOUT, ROW_SCALE, BLOCK_M, WIDTH // 2, SPLIT // 2)
        dot1, ap1, an1 = _grad_epilogue(
            h1, bias_ptr, g_ptr, gh_ptr, act_ptr, part_ptr, row_scale, base, pid_m, M, N, row0, col0, c0 + WIDTH // 2, seed,
            drop_threshold, drop_scale, xielu_alpha_ptr, xielu_beta, xielu_eps, HAS_BIAS, SLICE_BIAS, STORE_ACT,
            ACTIVATION, NEG_SLOPE, DROPOUT, ROW_SCALE, BLOCK_M, WIDTH // 2, SPLIT // 2)
        return dot0 + dot1, ap0 + ap1, an0 + an1
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = c0 + tl.arange(0, WIDTH)
    mask_n = offs_n < N - col0
    mask = (offs_m[:, None] < M - row0) & mask_n[None, :]
    offs = offs_m[:, None] * N + offs_n[None, :]
    if SLICE_BIAS:  # h = A @ B + bias: _add_bias's add, on this slice's columns
        h = h + tl.load(bias_ptr + col0 + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if DROPOUT:
        # the mask the forward drew, regenerated: a = dropout(act(h)) for dW2, g through the mask
        factor = _dropout_factor(seed, row0 + offs_m, col0 + c0, drop_threshold, drop_scale, BLOCK_M, WIDTH)
    if STORE_ACT or ROW_SCALE:
        if ACTIVATION == "xielu":
            a = _xielu_fwd(h, xielu_alpha_ptr, xielu_beta, xielu_eps)
        else:
            a = _act_fwd(h, ACTIVATION, NEG_SLOPE)
    if STORE_ACT and ROW_SCALE:  # r act(h): dW2 = (r g_out)^T act(h) = g_out^T (r act(h)), g_out read as it is
        tl.store(act_ptr + base + offs, (a * row_scale[:, None]).to(act_ptr.dtype.element_ty), mask=mask)
    elif STORE_ACT:
        if DROPOUT:
            a = a * factor
        tl.store(act_ptr + base + offs, a.to(act_ptr.dtype.element_ty), mask=mask)
    g = tl.load(g_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if ROW_SCALE:  # a routed expert's output scaled per row by r (no dropout): g is the unscaled g_out W2
        # d r = act(h) . (g_out W2): this slice's share of the row dot
        dot = tl.sum(tl.where(mask, a * g, 0.0), axis=1)
        g = g * row_scale[:, None]
    if DROPOUT:
        g = g * factor
    if ACTIVATION == "xielu":
        gh, dalpha_p, dalpha_n = _xielu_grad(h, g, mask, xielu_alpha_ptr, xielu_beta, xielu_eps)
    else:
        gh = _act_grad(h, g, ACTIVATION, NEG_SLOPE)
        dalpha_p, dalpha_n = 0.0, 0.0
    tl.store(gh_ptr + base + offs, gh.to(gh_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        # partial bias gradient of this row tile: part[pid_m, n] = sum over its rows of g_h
        col_sum = tl.sum(tl.where(mask, gh, 0.0), axis=0)
        tl.store(part_ptr + (pid_m.to(tl.int64) * N + col0) + offs_n, col_sum, mask=mask_n)
    return dot, dalpha_p, dalpha_n


@triton.jit
def _gemm_act_grad_tile(
    tile, a_ptr, b_ptr, bias_ptr, g_ptr, gh_ptr, act_ptr, part_ptr, seed, scale_ptr, dscale_ptr, tiles_ptr,
    xielu_alpha_ptr, xielu_part_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase,
    xielu_beta, xielu_eps,
    HAS_BIAS: tl.constexpr, STORE_ACT: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
    DROPOUT: tl.constexpr, ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, GROUPED: tl.constexpr,
):
    # recompute the pre-activation exactly as _gemm_act_tile does: the same main loop, then the same fp32 add of
    # the bias. On a wide tile (256x128: 32768 accumulator elements, 128 fp32 registers a thread on 8 warps) that
    # add is made per epilogue slice (SLICE_BIAS; an elementwise add: the same bits wherever it happens): added to
    # the whole tile up front, every slice's h was live through the epilogue (sm_90 256x128 gelu: 228 / 233
    # registers under Triton 3.6 / 3.9, 255 and 16-32 bytes of spill under 3.8; per slice 203 / 200 and 205).
    # Smaller tiles add it up front, as before: per slice moved some of them a few registers either way.
    SLICE_BIAS: tl.constexpr = HAS_BIAS and BLOCK_M * BLOCK_N >= 32768
    if GROUPED:
        pid_m, pid_n, e, row0, row_end, loop_m, loop_pid_m = _expert_tile(tile, tiles_ptr, N, MT, BLOCK_M, BLOCK_N,
                                                                          GROUP_M)
    else:
        pid_m, pid_n, e, row0, row_end, loop_m, loop_pid_m = _dense_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _preact(a_ptr, b_ptr, bias_ptr, e, row0, loop_m, loop_pid_m, pid_n, N, K, stride_am, stride_ak, stride_bk,
                  stride_bn, stride_be, stride_biase, HAS_BIAS and not SLICE_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION, UPCAST,
                  TMA, GROUPED)
    if GROUPED and SLICE_BIAS:
        bias_ptr += e * stride_biase
    col0 = pid_n * BLOCK_N
    base = row0.to(tl.int64) * N + col0
    offs_m = tl.arange(0, BLOCK_M)
    rows = offs_m < row_end - row0
    row_scale = tl.load(scale_ptr + row0 + offs_m, mask=rows, other=0.0).to(tl.float32) if ROW_SCALE else 0.0
    dot, dalpha_p, dalpha_n = _grad_epilogue(
        acc, bias_ptr, g_ptr, gh_ptr, act_ptr, part_ptr, row_scale, base, pid_m, row_end, N, row0, col0, 0, seed,
        drop_threshold, drop_scale, xielu_alpha_ptr, xielu_beta, xielu_eps, HAS_BIAS, SLICE_BIAS, STORE_ACT,
        ACTIVATION, NEG_SLOPE, DROPOUT, ROW_SCALE, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT)
    if ROW_SCALE:  # one partial of the row dot per column tile
        tl.store(dscale_ptr + pid_n.to(tl.int64) * M + row0 + offs_m, dot, mask=rows)
    if ACTIVATION == "xielu":  # the alphas' gradients, one pair per tile (summed in a fixed order: no atomics)
        tl.store(xielu_part_ptr + 2 * tile, dalpha_p)
        tl.store(xielu_part_ptr + 2 * tile + 1, dalpha_n)


@triton.jit
def _gemm_act_grad_kernel(
    a_ptr, b_ptr, bias_ptr, g_ptr, gh_ptr, act_ptr, part_ptr, seed_ptr, scale_ptr, dscale_ptr, tiles_ptr,
    xielu_alpha_ptr, xielu_part_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase,
    xielu_beta, xielu_eps,
    HAS_BIAS: tl.constexpr, STORE_ACT: tl.constexpr, ACTIVATION: tl.constexpr, NEG_SLOPE: tl.constexpr,
    DROPOUT: tl.constexpr, ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, PERSISTENT: tl.constexpr, GROUPED: tl.constexpr,
):
    seed = tl.load(seed_ptr) if DROPOUT else 0
    if PERSISTENT:  # as _gemm_act_kernel's: each tile's K loop is the forward's, whichever program runs it
        num_m = MT if GROUPED else tl.cdiv(M, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_m * tl.cdiv(N, BLOCK_N), tl.num_programs(0), flatten=True):
            _gemm_act_grad_tile(tile, a_ptr, b_ptr, bias_ptr, g_ptr, gh_ptr, act_ptr, part_ptr, seed, scale_ptr,
                                dscale_ptr, tiles_ptr, xielu_alpha_ptr, xielu_part_ptr, M, N, K, stride_am,
                                stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be,
                                stride_biase, xielu_beta, xielu_eps, HAS_BIAS, STORE_ACT,
                                ACTIVATION, NEG_SLOPE, DROPOUT, ROW_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K,
                                PRECISION, UPCAST, TMA, EPILOGUE_SPLIT, GROUPED)
    else:
        _gemm_act_grad_tile(tl.program_id(0), a_ptr, b_ptr, bias_ptr, g_ptr, gh_ptr, act_ptr, part_ptr, seed,
                            scale_ptr, dscale_ptr, tiles_ptr, xielu_alpha_ptr, xielu_part_ptr, M, N, K, stride_am,
                            stride_ak, stride_bk, stride_bn, drop_threshold, drop_scale, MT, stride_be, stride_biase,
                            xielu_beta, xielu_eps, HAS_BIAS, STORE_ACT, ACTIVATION,
                            NEG_SLOPE, DROPOUT, ROW_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, PRECISION,
                            UPCAST, TMA, EPILOGUE_SPLIT, GROUPED)


# --------------------------------------------------------------------------- launchers
# While a triton_op's body is traced (torch.compile, make_fx) every launch goes through
# ``wrap_triton``, which records it as a graph node. A pointer a launch does not use (its
# constexpr flag off) is an *input* of the launch, never one of its outputs: the traced graph
# clones each argument a kernel may write separately, and an output passed twice would come
# back as two tensors.
def launcher(kernel, probe: torch.Tensor):
    """``kernel``, or ``wrap_triton(kernel)`` when torch is tracing this launch (``traced``: a
    fake or functional operand, or an active dispatch mode).
    In a plain eager call the kernel itself: wrap_triton's eager path is a higher-order-op
    dispatch per launch."""
    if not traced(probe):
        return kernel
    try:
        return wrap_triton(kernel)
    except RuntimeError:
        # torch before 2.13 wraps no interpreted kernel: on real tensors under a dispatch mode
        # (an op counter) the kernel runs as it is; fake tensors cannot run one, so that case raises
        if type(probe) in (torch.Tensor, torch.nn.Parameter):
            return kernel
        raise


class LaunchPlans(CheckedCalls):
    """Per-layer launch plans of a kernels module, keyed by a call's metadata (shapes, strides,
    dtypes, device, flags).

    A layer's launches (which kernels, tiles, grids, every integer and constexpr argument) follow
    from its operands' metadata and the module's switches alone, yet working them out is most of a
    small layer's host time: in eager mode a GPU step of short kernels waits on it. So the first call
    of a layer builds its plan and later calls with the same key reuse it. Any attribute set on the
    module (a switch such as ``CONV_Z``, a table, a monkeypatched helper) clears every plan
    (``watch``); a table mutated in place needs ``clear()``. Traced calls (fake tensors, symbolic
    shapes) never use the cache: ``key`` is None there."""

    def plan(self, key, build):
        """The plan of ``key``, built by ``build()`` on a miss; ``build()`` every call when key is None."""
        if key is None:
            return build()
        plan = self.get(key)
        return plan if plan is not None else self.put(key, build())

    def watch(self, module_name: str):
        """Clear the plans whenever an attribute of module ``module_name`` is set or deleted (a
        module may be watched by several caches, a cache may watch several modules)."""
        module = sys.modules[module_name]
        _WATCHERS.setdefault(module_name, []).append(self)
        if not isinstance(module, _WatchedModule):
            module.__class__ = _WatchedModule
        return self


_WATCHERS = {}  # module name -> the LaunchPlans its attributes feed


class _WatchedModule(types.ModuleType):
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        for plans in _WATCHERS.get(self.__name__, ()):
            plans.clear()

    def __delattr__(self, name):
        super().__delattr__(name)
        for plans in _WATCHERS.get(self.__name__, ()):
            plans.clear()


def plan_key(*parts):
    """``parts`` as a plan key, or None where a tensor among them is traced or symbolic (no cache).
    A tensor stands for its shape, strides, dtype and device."""
    key = []
    for p in parts:
        if isinstance(p, torch.Tensor):
            if traced(p):
                return None
            key.append((p.shape, p.stride(), p.dtype, p.device))
        else:
            key.append(p)
    return tuple(key)


def _reference():
    """``fusedrc.reference``, imported at the call: the launchers hand it the cases the kernels do not
    cover (fusedrc imports the kernels lazily, and the reference imports nothing of them)."""
    from fusedrc import reference

    return reference


def _device_guard(t: torch.Tensor):
    """Launch on the tensor's GPU, not the current one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# --------------------------------------------------------------------------- direct launches
# Opt-in (FUSEDRC_DIRECT_LAUNCH=1 or ``kernels._common.DIRECT_LAUNCH = True``) until a GPU run has
# checked it on the Triton versions fusedrc supports: a plan's launch sites call the compiled
# kernel's launcher themselves after their first launch.
DIRECT_LAUNCH = os.environ.get("FUSEDRC_DIRECT_LAUNCH", "0") not in ("", "0")


def _driver_calls():
    """(current device, stream of a device) as Triton's JIT asks for them."""
    from triton.runtime import driver

    return driver.active.get_current_device, driver.active.get_current_stream


def _runtime_knobs():
    """Where Triton's JIT reads its launch hooks (a profiler may set them at any time)."""
    from triton import knobs

    return knobs.runtime


class DirectLaunch:
    """One launch site of a launch plan, bound to the binary Triton compiled for it.

    ``JITFunction.run`` (Triton 3.3 to 3.9) specializes every argument, hashes a cache key, looks
    the binary up and ends with ``binary.run(grid, stream, function, metadata, launch metadata,
    hooks, *bound arguments)``. At a site of a plan the key cannot change except through what
    the guard checks here, so this skips to that last call. The guard: each tensor argument's
    dtype and 16-byte alignment (the pointers' specialization) and every other non-float argument
    (ints: their value-1 and divisibility specialization, None) as recorded; a miss launches
    through the JIT, as does a launch while the module's DIRECT_LAUNCH switch is off."""

    __slots__ = ("run", "function", "metadata", "launch_metadata", "tensors", "dtypes", "fixed", "fixed_values",
                 "consts", "device", "stream", "knobs")

    @classmethod
    def record(cls, kernel, binary, args, meta):
        """The site's DirectLaunch, or None where the launch does not have the expected shape
        (then the site keeps launching through the JIT)."""
        params = getattr(kernel, "params", None)
        if params is None or not all(hasattr(binary, a) for a in ("run", "function", "packed_metadata",
                                                                   "launch_metadata")):
            return None
        consts = _constexpr_tail(params, args, meta)
        if consts is None:
            return None
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        fixed = [i for i, a in enumerate(args) if not isinstance(a, (torch.Tensor, float))]
        if not tensors or any(args[i].data_ptr() % 16 for i in tensors):
            return None  # an unaligned pointer: rare, left to the JIT
        site = cls()
        site.run, site.function, site.metadata = binary.run, binary.function, binary.packed_metadata
        site.launch_metadata = binary.launch_metadata
        site.tensors = _getter(tensors)
        site.dtypes = tuple(args[i].dtype for i in tensors)
        site.fixed = _getter(fixed)
        site.fixed_values = site.fixed(args)
        site.consts = consts
        site.device, site.stream = _driver_calls()
        site.knobs = _runtime_knobs()
        return site

    def __call__(self, grid, args) -> bool:
        """Launch ``args`` on ``grid`` if the guard holds; whether it launched."""
        for a, dtype in zip(self.tensors(args), self.dtypes):
            if a.dtype is not dtype or a.data_ptr() % 16:
                return False
        if self.fixed(args) != self.fixed_values:
            return False
        stream = self.stream(self.device())
        tail = (*args, *self.consts)
        knobs = self.knobs
        self.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, self.function,
                 self.metadata, self.launch_metadata(grid, stream, *tail), knobs.launch_enter_hook,
                 knobs.launch_exit_hook, *tail)
        return True


def _constexpr_tail(params, args, meta):
    """What Triton's binder appends to ``args`` (positional, in signature order): the values of the
    remaining parameters, all constexprs, from ``meta`` or their defaults; None where the call has
    another shape (a runtime argument by name, a constexpr with neither)."""
    if len(args) > len(params) or any(p.name in meta for p in params[:len(args)]):
        return None
    consts = []
    for p in params[len(args):]:
        if not p.is_constexpr:
            return None
        if p.name in meta:
            consts.append(meta[p.name])
        elif p.has_default:
            consts.append(p.default)
        else:
            return None
    return tuple(consts)


def _getter(indices):
    """args -> the tuple of args[i] for i in ``indices``, in C."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*indices)


def launch(sites: dict, name, kernel, grid, args, meta):
    """``kernel[grid](*args, **meta)`` for launch site ``name`` of a plan (``sites``: the plan's
    dict); with DIRECT_LAUNCH on, directly through the site's binary after its first launch.
    ``kernel``: the JIT function itself (``launcher``'s answer when nothing is traced)."""
    if DIRECT_LAUNCH:
        site = sites.get(name)
        if site is not None and site(grid, args):
            return
        binary = kernel[grid](*args, **meta)
        if name not in sites and not interpreting() and not traced(args[0]):
            sites[name] = DirectLaunch.record(kernel, binary, args, meta)
        return
    kernel[grid](*args, **meta)


_I32_MAX = 2**31 - 1


def _tile_safe(t: torch.Tensor, block_rows: int, block_cols: int, name: str) -> torch.Tensor:
    """An operand whose in-tile offsets (block * stride) would overflow int32.

    The kernels make tile bases 64-bit and keep offsets inside a tile 32-bit (cheaper
    address math); a view with a huge stride is copied to a contiguous layout first,
    which only fails for rows of more than ~2**31 / block elements.
    """
    def fits(u):
        return u.stride(0) * block_rows <= _I32_MAX and u.stride(1) * block_cols <= _I32_MAX
    if fits(t):
        return t
    t = t.contiguous()
    if not fits(t):
        raise ValueError(f"{name} of shape {tuple(t.shape)} has rows too long for the Triton kernels' "
                         f"32-bit in-tile offsets; use the reference backend")
    return t


# Operand loads of the two dense kernels: False (pointer tiles, the default), True (TMA wherever
# the operands allow it: sm_90+ GPUs, and Triton's interpreter, for the tests), "auto" (TMA on
# sm_90+ GPUs only). Opt-in until timed on a GPU: benchmarks/gpu_tile_sweep.py times both.
GEMM_TMA = False


# Launch shape of the dense kernels: 0, one program per output tile (the default); n > 0, n
# programs per SM (at most one per tile), each walking the tiles pid, pid + programs, ... with its
# tile loop flattened into the K loop, so that one tile's epilogue overlaps the next tile's first
# loads. The arithmetic of a tile does not change (same main loop, same K order): the recomputed
# pre-activation equals the forward's either way. Opt-in until timed: benchmarks/gpu_tile_sweep.py.
GEMM_PERSISTENT = 0
_INTERPRETER_SMS = 2  # the interpreter's pretend SM count: test shapes of a few tiles still loop


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    """The SM count of ``t``'s GPU; the interpreter's pretend count on the CPU."""
    if not t.is_cuda:
        return _INTERPRETER_SMS
    return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())


def dense_grid(num_tiles: int, t: torch.Tensor, cfg: GemmConfig | None = None, grouped: bool = False):
    """(grid, PERSISTENT) of a dense launch of ``num_tiles`` output tiles of ``cfg`` on ``t``'s
    device. A wide tile (``_wide_tile``) and a grouped launch (routed experts' tile table) take one program
    per tile whatever the switch: the tile and its arithmetic stay the switch's, so a forward and its recompute
    agree bit for bit. (Persistent, the grouped dense kernels spilled 360-776 bytes on sm_90, every table tile.)"""
    if not GEMM_PERSISTENT or grouped or (cfg is not None and _wide_tile(cfg)):
        return (num_tiles,), False
    return (max(1, min(num_tiles, GEMM_PERSISTENT * device_sms(t))),), True


def _use_tma(a: torch.Tensor, b: torch.Tensor, precision: str | None = None) -> bool:
    """Whether the dense kernels load a (M, K) and b (K, N) through TMA descriptors: the switch,
    Triton's host descriptors, the hardware (sm_90+; the interpreter only when forced), an eager
    launch (descriptors are not handed to torch's tracing of user kernels), tensor-core operands
    (fp16/bf16, or fp32 as tf32: fp32 FMA tiles read from shared memory spill on sm_90), and the
    layout TMA needs: A and B^T K-contiguous, 16-byte aligned bases and row pitches. A pure
    function of the operands: a forward and its recompute decide alike."""
    if GEMM_TMA is False or TensorDescriptor is None or traced(a):
        return False
    if operand_class(a.dtype, precision or dot_precision(a)) == "fp32":
        return False
    if a.is_cuda:
        if device_capability(a)[0] < 9:
            return False
    elif GEMM_TMA == "auto" or not interpreting():
        return False
    e = a.element_size()
    return (a.shape[1] > 0 and a.stride(1) == 1 and b.stride(0) == 1
            and (a.stride(0) * e) % 16 == 0 and (b.stride(1) * e) % 16 == 0
            and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0)


def _operands(a: torch.Tensor, b: torch.Tensor, cfg: GemmConfig, tma: bool):
    """The A and B arguments of a dense launch: the tensors, or TMA descriptors of A and B^T."""
    if not tma:
        return a, b
    return (TensorDescriptor.from_tensor(a, [cfg.BLOCK_M, cfg.BLOCK_K]),
            TensorDescriptor.from_tensor(b.t(), [cfg.BLOCK_N, cfg.BLOCK_K]))


def _launch_params(a: torch.Tensor, M: int, N: int, K: int, narrow: bool = False):
    precision = dot_precision(a)
    cfg = gemm_config(M, N, K, a.dtype, precision, device_capability(a), narrow)
    return precision, cfg


def _wide_tile(cfg: GemmConfig) -> bool:
    """Whether the tile's fp32 accumulator alone takes 128 or more registers a thread (256x128 on 8
    warps): its forward epilogue is split too, and it is never launched persistent (the tile loop's
    registers spill there: 32-96 bytes on sm_90 in eighths)."""
    return cfg.BLOCK_M * cfg.BLOCK_N >= 128 * 32 * cfg.num_warps


def _epilogue_split(cfg: GemmConfig, grad_kernel: bool, dropout: bool) -> int:
    # the forward's plain epilogue on a tile that leaves registers free is light: in one piece; the
    # grad kernel's, the dropout mask's and a wide tile's, in the table's slices
    return cfg.EPILOGUE_SPLIT if grad_kernel or dropout or _wide_tile(cfg) else 1


def _routed_split(split: int, persistent: bool, block_m: int, block_n: int) -> int:
    # the row-scale epilogue's row dot on a persistent sm_90 128x128 tile spills 8 bytes in quarters, none in
    # eighths (python -m fusedrc.inspect --kernel _gemm_act_grad); the per-tile launches' splits do not spill
    # (but under a release that _RELEASE_TUNING names)
    if persistent:
        return 2 * split
    return release_tuning("_gemm_act_grad_kernel", "row_scale", block_m, block_n).get("EPILOGUE_SPLIT", split)


def dropout_args(dropout, fill):
    """(DROPOUT, seed pointer, threshold, scale) of a launch from ``dropout`` (None or (p, seed));
    without dropout the seed pointer is ``fill`` (an input: never read)."""
    if dropout is None or dropout[0] == 0:
        return False, fill, 0, 1.0
    p, seed = dropout
    return True, seed, min(round(p * 2**24), 2**24), (1.0 / (1.0 - p) if p < 1 else 0.0)


# --------------------------------------------------------------------------- routed experts, one launch
class ExpertGroups(NamedTuple):
    """Routed experts in one launch of a dense or dual kernel (GROUPED): x's rows sorted by expert, ``counts[e]`` of
    them expert e's (host ints); the (H, K) weights and (H,) biases passed are expert 0's, of stacked
    tensors whose expert e lies ``e * stride_w`` (``e * stride_b``) elements further; both biases or neither."""
    counts: tuple
    stride_w: int
    stride_b: int = 0


# (counts, BLOCK_M, device) -> (tile table, tiles per expert, count): a layer's forward and its backward (the
# forwards of every MoE layer of a model run before the first backward: room for a few hundred)
_TILES_CACHE = collections.OrderedDict()


def expert_tiles(counts, block_m, device):
    """(table, lengths, MT): the grouped launch's row tiles, (expert, first row, end row) as int32 triples of
    the expert-sorted rows, no tile across two experts; ``lengths`` (E,) the tiles of each expert (int64)."""
    key = (tuple(counts), block_m, device)
    hit = _TILES_CACHE.get(key)
    if hit is not None:
        _TILES_CACHE.move_to_end(key)
    else:  # on the host (the counts are there), a few vector ops whatever the expert count
        n = torch.tensor(counts, dtype=torch.int64)
        lengths = (n + block_m - 1) // block_m
        expert = torch.repeat_interleave(torch.arange(len(counts)), lengths)
        ends = torch.cumsum(n, 0)
        tile_in_expert = torch.arange(expert.numel()) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths,
                                                                               lengths)
        table = torch.stack((expert, (ends - n)[expert] + tile_in_expert * block_m, ends[expert]), dim=1)
        hit = table.to(torch.int32).reshape(-1).to(device), lengths.to(device), expert.numel()
        _TILES_CACHE[key] = hit
        if len(_TILES_CACHE) > 256:
            _TILES_CACHE.popitem(last=False)
    return hit


def _dense_launch(a: torch.Tensor, b: torch.Tensor, bias, config, dropout, grad_kernel: bool, groups=None,
                  xielu=None):
    """What a launch of either dense kernel on a (M, K) @ b (K, N) needs besides its own outputs:
    ``(cfg, pointers, seed, tiles, scalars, meta, num_m)``: the table entry, the A, B and bias arguments (the
    operands made tile-safe, or TMA descriptors), the dropout seed pointer, the tile table (GROUPED; else an
    unused input) and xIELU's alphas (else an unused input), the integer and float arguments, the constexprs and
    launch options, and the row tiles. One builder for the forward and its recompute: both take the same tiles,
    precision and loads. ``dropout`` is None or (p, seed), seed a 1-element int64 tensor on the operands' device.
    ``xielu``: None or (alphas, beta, eps), alphas the (2,) fp32 effective (alpha_p, alpha_n) on that device.

    ``groups`` (``ExpertGroups``): a's rows are routed experts', b and bias expert 0's: every expert in one launch,
    the tile the table's for the mean rows an expert gets (never a wide one), pointer loads."""
    M, K = a.shape
    N = b.shape[1]
    rows = M if groups is None else max(1, M // max(1, sum(1 for n in groups.counts if n)))
    # dropout's mask, experts' tables and xIELU's epilogue take the narrow tile where the table's is wide (a wide
    # grad kernel spills with them: 40 bytes on sm_90 for xIELU in eighths)
    precision, cfg = _launch_params(a, rows, N, K, narrow=dropout is not None and dropout[0] != 0
                                    or groups is not None or xielu is not None)
    cfg = config or cfg
    a = _tile_safe(a, cfg.BLOCK_M, cfg.BLOCK_K, "a")
    b_safe = _tile_safe(b, cfg.BLOCK_K, cfg.BLOCK_N, "b")
    # a grouped launch reads every expert's weights and biases through expert 0's: no copy of them
    assert groups is None or (b_safe is b and (bias is None or bias.is_contiguous())), \
        "grouped experts' weights must be views of the stacked tensors (ExpertGroups)"
    b = b_safe
    if bias is not None:
        bias = bias.contiguous()  # (N,): the kernels read it with unit stride
    tma = groups is None and _use_tma(a, b, precision)
    a_arg, b_arg = _operands(a, b, cfg, tma)
    has_dropout, seed, threshold, scale = dropout_args(dropout, a)
    assert groups is None or not has_dropout, "grouped experts with dropout"
    if groups is None:
        tiles, num_m, grouping = a, cdiv(M, cfg.BLOCK_M), (0, 0, 0)
    else:
        tiles, _, num_m = expert_tiles(groups.counts, cfg.BLOCK_M, a.device)
        grouping = (num_m, groups.stride_w, groups.stride_b)
    meta = dict(
        HAS_BIAS=bias is not None, DROPOUT=has_dropout,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        EVEN_K=K % cfg.BLOCK_K == 0, PRECISION=precision, UPCAST=_upcast_flag(a), TMA=tma,
        EPILOGUE_SPLIT=_epilogue_split(cfg, grad_kernel, has_dropout), GROUPED=groups is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    pointers = (a_arg, b_arg, bias if bias is not None else a)
    alphas, beta, eps = xielu if xielu is not None else (a, 0.0, 0.0)
    scalars = (M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), threshold, scale, *grouping,
               float(beta), float(eps))
    return cfg, pointers, seed, (tiles, alphas), scalars, meta, num_m


def _xielu_args(activation, xielu, dropout, groups, row_scale=None):
    """``xielu`` checked against ``activation``: the parameters come with "xielu" and only with it; no dropout,
    experts or row scale with it (nothing uses them)."""
    assert (activation == "xielu") == (xielu is not None), "activation 'xielu' takes its xielu=(alphas, beta, eps)"
    assert xielu is None or ((dropout is None or not dropout[0]) and groups is None and row_scale is None), \
        "xielu with dropout, experts or a row scale"
    assert xielu is None or (xielu[0].dtype == torch.float32 and xielu[0].shape == (2,)), "xielu alphas: (2,) fp32"


def gemm_act(a: torch.Tensor, b: torch.Tensor, bias, activation: str = "none", out_dtype=None,
             config: GemmConfig | None = None, dropout=None, out=None, groups=None, xielu=None) -> torch.Tensor:
    """act(a @ b + bias) for a (M, K), b (K, N) of any strides; output (M, N) contiguous.

    ``dropout``: None or ``(p, seed)``: dropout on act(...), its mask a function of the seed
    and the element's index (``_dropout_factor``). ``config`` overrides the table (tests only:
    callers that recompute must not). ``out``: a contiguous (M, N) tensor of the output's dtype
    to write into (a slice of a larger buffer: no copy afterwards). ``groups`` (``ExpertGroups``):
    a's rows are routed experts' (sorted by expert), b and bias expert 0's of stacked tensors, one launch.
    ``xielu``: with ``activation="xielu"``, its (alphas, beta, eps) (``_dense_launch``).
    """
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
    _xielu_args(activation, xielu, dropout, groups)
    M, K = a.shape
    N = b.shape[1]
    dtype = out_dtype or a.dtype
    if out is None:
        out = torch.empty((M, N), device=a.device, dtype=dtype)
    else:
        assert out.shape == (M, N) and out.dtype == dtype and out.is_contiguous(), "gemm_act: out"
    if M == 0 or N == 0:
        return out
    cfg, pointers, seed, (tiles, alphas), scalars, meta, num_m = _dense_launch(
        a, b, bias, config, dropout, grad_kernel=False, groups=groups, xielu=xielu)
    grid, persistent = dense_grid(num_m * cdiv(N, cfg.BLOCK_N), a, cfg, groups is not None)
    with _device_guard(a):
        launcher(_gemm_act_kernel, a)[grid](*pointers, out, seed, tiles, alphas, *scalars, **act_meta(activation),
                                            **meta, PERSISTENT=persistent)
    return out


# The plain GEMMs (the backward's dX, dW, the FFN's g_a and dW2, and the FFN's forward output
# GEMM: no activation epilogue, nothing recomputed): "aten" runs them as torch.mm / addmm
# (cuBLAS) on CUDA, "triton" as _gemm_act_kernel.
# Measured on an H100, bf16, 8192x4096x16384: cuBLAS 1.32 ms, _gemm_act_kernel 1.66 ms
# (benchmarks/results/gpu_logs/profile_h100_*.log). Under deterministic algorithms the Triton
# kernel is used (cuBLAS would need CUBLAS_WORKSPACE_CONFIG).
PLAIN_GEMM = "aten"


def uses_aten_gemm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``plain_gemm(a, b)`` runs torch.mm rather than the Triton kernel."""
    return (PLAIN_GEMM == "aten" and a.is_cuda and a.dtype == b.dtype
            and not torch.are_deterministic_algorithms_enabled())


def plain_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype=None, bias=None, out=None) -> torch.Tensor:
    """a @ b (+ bias) with fp32 accumulation, output (M, N) in ``out_dtype`` (default a.dtype).
    ``out``: an (M, N) tensor to write into and return (a slice of a larger buffer, such as one
    expert's rows of a stacked weight gradient); written directly where its dtype is the GEMM's
    and it is contiguous or transposed contiguous (a stacked weight stored transposed: out^T = b^T a^T
    is written instead), else the result is copied into it.

    For GEMMs nothing recomputes (bit-identical reruns are only needed for a pre-activation)."""
    if out is not None and bias is None and out.dim() == 2 and out.shape[0] > 1 and out.shape[1] > 1 \
            and not out.is_contiguous() and out.t().is_contiguous():
        plain_gemm(b.t(), a.t(), out_dtype=out_dtype or a.dtype, out=out.t())
        return out
    direct = out is not None and out.is_contiguous() and out.dtype == (out_dtype or a.dtype)
    if uses_aten_gemm(a, b) and (bias is None or bias.dtype == a.dtype):
        if direct and out.dtype == a.dtype:
            return torch.mm(a, b, out=out) if bias is None else torch.addmm(bias, a, b, out=out)
        res = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
        res = res if out_dtype is None or res.dtype == out_dtype else res.to(out_dtype)
    else:
        res = gemm_act(a, b, bias, out_dtype=out_dtype, out=out if direct else None)
    return res if out is None or res is out else out.copy_(res)


def tile_bias_grad(part, bias, width, groups=None, lengths=None):
    """A bias's gradient from a grad kernel's column sums per row tile ``part`` (None: no rows), in the bias's
    dtype: their sum; grouped (``ExpertGroups``), (E, width), each expert's over its ``lengths`` row tiles. Tiny
    fixed-order reductions, no atomics. None without a bias."""
    if bias is None:
        return None
    if groups is not None:
        if part is None:
            return torch.zeros((len(groups.counts), width), device=bias.device, dtype=bias.dtype)
        return torch.segment_reduce(part, "sum", lengths=lengths, axis=0).to(bias.dtype)
    return part.sum(0).to(bias.dtype) if part is not None else torch.zeros_like(bias)


def gemm_act_grad(a: torch.Tensor, b: torch.Tensor, bias, grad: torch.Tensor, activation: str,
                  store_act: bool = False, config: GemmConfig | None = None, dropout=None, row_scale=None,
                  groups=None, xielu=None):
    """Recompute h = a @ b + bias in tiles and return (g_h, act(h) or None, dbias or None).

    g_h = act'(h) * grad, in a's dtype; dbias = sum over rows of g_h (fp32 partial
    sums per row tile, reduced here), in bias's dtype. Uses the same tile table
    entry as ``gemm_act`` for the same (a, b), hence the same h bit for bit.
    With ``dropout`` (as given to ``gemm_act``) ``grad`` is the gradient of dropout(act(h)):
    g_h = act'(h) * mask * grad, and the stored activation is dropout(act(h)).

    ``row_scale`` (M,): act(h)'s rows scale by it downstream (a routed ungated expert's weights, no
    dropout); ``grad`` is then the unscaled gradient, g_h and the stored activation are scaled (r_m
    act(h)_m: dW2 = g_out^T (r act(h)) needs no scaled copy of g_out), and a fourth value is returned:
    the gradient of ``row_scale``, act(h)_m . grad_m per row (fp32, from per-column-tile partials).

    ``groups`` (``ExpertGroups``, as given to ``gemm_act``): one launch for every routed expert; dbias is then
    (E, N), each expert's column sums over its row tiles.

    ``xielu`` (as given to ``gemm_act``, ``activation="xielu"``): a fourth value is returned, the alphas'
    gradients (2,) fp32, from per-tile partials.
    """
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
    _xielu_args(activation, xielu, dropout, groups, row_scale)
    routed = row_scale is not None
    assert not (routed and dropout is not None and dropout[0]), "row_scale with dropout"
    M, K = a.shape
    N = b.shape[1]
    assert grad.shape == (M, N)
    gh = torch.empty((M, N), device=a.device, dtype=a.dtype)
    act = torch.empty((M, N), device=a.device, dtype=a.dtype) if store_act else None

    if M == 0 or N == 0:
        dbias = tile_bias_grad(None, bias, N, groups)
        if routed:
            return gh, act, dbias, torch.zeros(M, device=a.device, dtype=torch.float32)
        return (gh, act, dbias) if xielu is None else (gh, act, dbias, torch.zeros(2, device=a.device))
    cfg, pointers, seed, (tiles, alphas), scalars, meta, num_m = _dense_launch(
        a, b, bias, config, dropout, grad_kernel=True, groups=groups, xielu=xielu)
    dscale = torch.empty((cdiv(N, cfg.BLOCK_N), M), device=a.device, dtype=torch.float32) if routed else None
    part = torch.empty((num_m, N), device=a.device, dtype=torch.float32) if bias is not None else None
    num_tiles = num_m * cdiv(N, cfg.BLOCK_N)
    xielu_part = torch.empty((num_tiles, 2), device=a.device, dtype=torch.float32) if xielu is not None else None
    grid, persistent = dense_grid(num_tiles, a, cfg, groups is not None)
    if routed:
        meta["EPILOGUE_SPLIT"] = _routed_split(meta["EPILOGUE_SPLIT"], persistent, cfg.BLOCK_M, cfg.BLOCK_N)
    grad = grad.contiguous()  # no copy in the usual case
    with _device_guard(a):
        launcher(_gemm_act_grad_kernel, a)[grid](
            *pointers, grad, gh, act if act is not None else a, part if part is not None else a, seed,
            row_scale.contiguous() if routed else a, dscale if routed else a, tiles, alphas,
            xielu_part if xielu_part is not None else a, *scalars, STORE_ACT=store_act, ROW_SCALE=routed, **act_meta(activation), **meta, PERSISTENT=persistent,
        )
    # tiny reductions over the row tiles (the column tiles for dscale); no atomics, deterministic
    lengths = expert_tiles(groups.counts, cfg.BLOCK_M, a.device)[1] if groups is not None else None
    dbias = tile_bias_grad(part, bias, N, groups, lengths)
    if routed:
        return gh, act, dbias, dscale.sum(0)
    return (gh, act, dbias) if xielu is None else (gh, act, dbias, xielu_part.sum(0))


def act_meta(activation: str) -> dict:
    """The kernels' activation constexprs of an activation name: ``"leaky_relu:0.1"`` is
    ACTIVATION="leaky_relu", NEG_SLOPE=0.1 (one compile per slope); NEG_SLOPE is 0.0 for the
    others, so each of them compiles once."""
    if activation in ("none", "xielu"):  # xielu: the dense kernels only, its parameters their arguments
        return dict(ACTIVATION=activation, NEG_SLOPE=0.0)
    kind, slope = split_activation(activation)
    return dict(ACTIVATION=kind, NEG_SLOPE=slope)


# --------------------------------------------------------------------------- ahead-of-time inspection
# ``python -m fusedrc.inspect`` compiles every spec returned by a kernels
# module's ``inspect_specs()`` for its GPU target on the CPU and reports
# registers, shared memory, spills and the matrix instructions. A spec is a
# plain dict (no import of fusedrc.inspect needed here):
#   fn, kernel, arch ("sm_90"/"sm_80"), dtype, config, signature (name -> Triton
#   type or "constexpr"), constexprs, num_warps, num_stages, gemm (bool), and
#   optionally aligned (argument names given the 16-byte divisibility hint a
#   real launch gets), source (label shown in the table).
_INSPECT_ARCH = {"sm90": "sm_90", "sm80": "sm_80"}
_TRITON_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def _inspect_signature(kernel, dtype: torch.dtype):
    """Argument types of a launch from ``linear_act``'s forward: x (M, K) row-major
    and weight.t(), so stride_ak == stride_bk == 1 (the JIT specialises an int
    argument equal to 1 into a constexpr) and the other ints are multiples of 16."""
    ptr = _TRITON_PTR[dtype]
    if kernel is _gemm_act_kernel:
        sig = {"a_ptr": ptr, "b_ptr": ptr, "bias_ptr": ptr, "c_ptr": ptr}
    else:
        sig = {"a_ptr": ptr, "b_ptr": ptr, "bias_ptr": ptr, "g_ptr": ptr, "gh_ptr": ptr, "act_ptr": ptr,
               "part_ptr": "*fp32"}
    sig["seed_ptr"] = "*i64"
    if kernel is _gemm_act_grad_kernel:
        sig.update(scale_ptr="*fp32", dscale_ptr="*fp32")
    sig["tiles_ptr"] = ptr  # unused: a launch passes a there
    sig["xielu_alpha_ptr"] = "*fp32"  # read with ACTIVATION="xielu" only (else a launch passes a)
    if kernel is _gemm_act_grad_kernel:
        sig["xielu_part_ptr"] = "*fp32"
    aligned = list(sig)
    sig.update({"M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_ak": "constexpr",
                "stride_bk": "constexpr", "stride_bn": "i32", "drop_threshold": "i32", "drop_scale": "fp32",
                "MT": "i32", "stride_be": "i32", "stride_biase": "i32", "xielu_beta": "fp32", "xielu_eps": "fp32"})
    aligned += ["M", "N", "K", "stride_am", "stride_bn"]
    return sig, aligned


def inspect_specs():
    """One spec per distinct compile of the two dense kernels for the sm90 and
    sm80 table entries: fp16 and bf16 for "16bit" entries, fp32 with the
    matching input precision for "tf32"/"fp32" entries; activation "gelu" (the
    heaviest epilogue), bias on, EVEN_K, and STORE_ACT on for the grad kernel
    (as ``fused_mlp`` launches it). sm_90 entries also with TMA loads (``GEMM_TMA``;
    config ``"loads": "tma"``); bf16 entries also with the FFN's dropout in the epilogue
    (config ``"dropout": true``: Philox per element, the heaviest epilogue); sm_90 bf16 entries
    but wide ones (``_wide_tile``) also persistent (``GEMM_PERSISTENT``; config ``"persistent": true``),
    with either load. The grad
    kernel of one sm_90 bf16 entry also with each other activation (config ``"activation"``)."""
    specs = []
    by_key = {}
    for (family, opclass, bucket), cfg in _TABLE.items():
        arch = _INSPECT_ARCH.get(family)
        if arch is None:
            continue
        if opclass == "16bit":
            variants = [(torch.float16, "ieee"), (torch.bfloat16, "ieee")]
        else:
            variants = [(torch.float32, "tf32" if opclass == "tf32" else "ieee")]
        tma_ok = arch == "sm_90" and opclass != "fp32" and TensorDescriptor is not None
        loads = (False, True) if tma_ok else (False,)
        persistence = (False, True) if arch == "sm_90" and opclass == "16bit" and not _wide_tile(cfg) else (False,)
        for (kernel, name), dtype_precision, tma, dropout, persistent in itertools.product(
                ((_gemm_act_kernel, "_gemm_act_kernel"), (_gemm_act_grad_kernel, "_gemm_act_grad_kernel")),
                variants, loads, (False, True), persistence):
            dtype, precision = dtype_precision
            if dropout and (tma or dtype != torch.bfloat16):
                continue  # the epilogue's cost: one dtype, pointer loads
            if persistent and (dropout or dtype != torch.bfloat16):
                continue  # the launch shape's cost: bf16, both loads
            entry = _NARROW.get((family, opclass, bucket), cfg) if dropout else cfg  # as gemm_config(narrow=...)
            key = (name, arch, dtype, precision, entry, tma, dropout, persistent)
            label = f"{family}/{opclass}/{bucket}"
            if key in by_key:  # identical compile: one spec, both table entries named
                by_key[key]["source"] += "," + label
                continue
            sig, aligned = _inspect_signature(kernel, dtype)
            constexprs = {"stride_ak": 1, "stride_bk": 1, "HAS_BIAS": True, "DROPOUT": dropout, "GROUPED": False}
            if tma:  # descriptors of A (M, K) and B^T (N, K) with the entry's boxes
                elt = _TRITON_PTR[dtype][1:]
                sig["a_ptr"] = f"tensordesc<{elt}[{entry.BLOCK_M}, {entry.BLOCK_K}]>"
                sig["b_ptr"] = f"tensordesc<{elt}[{entry.BLOCK_N}, {entry.BLOCK_K}]>"
                aligned = [n for n in aligned if n not in ("a_ptr", "b_ptr")]
            if kernel is _gemm_act_grad_kernel:
                constexprs.update(STORE_ACT=True, ROW_SCALE=False)
            split = _epilogue_split(entry, kernel is _gemm_act_grad_kernel, dropout)
            constexprs["EPILOGUE_SPLIT"] = split
            constexprs.update({
                "ACTIVATION": "gelu", "NEG_SLOPE": 0.0,
                "BLOCK_M": entry.BLOCK_M, "BLOCK_N": entry.BLOCK_N, "BLOCK_K": entry.BLOCK_K,
                "GROUP_M": entry.GROUP_M, "EVEN_K": True, "PRECISION": precision, "UPCAST": False,
                "TMA": tma, "PERSISTENT": persistent,
            })
            for c in constexprs:
                sig[c] = "constexpr"
            config = {"BLOCK_M": entry.BLOCK_M, "BLOCK_N": entry.BLOCK_N, "BLOCK_K": entry.BLOCK_K,
                      "GROUP_M": entry.GROUP_M, "num_warps": entry.num_warps, "num_stages": entry.num_stages}
            if split > 1 or kernel is _gemm_act_grad_kernel or dropout:
                config["EPILOGUE_SPLIT"] = split
            if dtype == torch.float32:
                config["input_precision"] = precision
            if tma:
                config["loads"] = "tma"
            if dropout:
                config["dropout"] = True
            if persistent:
                config["persistent"] = True
            spec = {
                "fn": kernel, "kernel": name, "arch": arch, "dtype": dtype, "config": config,
                "signature": sig, "constexprs": constexprs,
                "num_warps": entry.num_warps, "num_stages": entry.num_stages,
                "gemm": True, "aligned": aligned, "source": label,
            }
            by_key[key] = spec
            specs.append(spec)
    # every other activation's epilogue (values and derivative), on one sm_90 bf16 grad kernel
    # (gelu's, the heaviest, stands for them in the table above)
    base = next(s for s in specs if s["kernel"] == "_gemm_act_grad_kernel" and s["arch"] == "sm_90"
                and s["dtype"] == torch.bfloat16 and not {"loads", "dropout", "persistent"} & set(s["config"]))
    for act in ACTIVATIONS:
        if act != "gelu":
            meta = act_meta("leaky_relu:0.1" if act == "leaky_relu" else act)
            specs.append(dict(base, constexprs=dict(base["constexprs"], **meta),
                              config=dict(base["config"], activation=act), source=base["source"] + "/activation"))
    # xIELU (Apertus: the alphas' loads, two exps and the alphas' partial sums) on both kernels of every
    # sm_90/sm_80 16-bit entry as xielu_mlp launches them: the dropout specs' narrow tiles (_dense_launch), bf16,
    # pointer loads, no dropout
    for spec in [s for s in specs if s["config"].get("dropout")]:
        c = spec["constexprs"]
        entry = GemmConfig(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["GROUP_M"], spec["num_warps"],
                           spec["num_stages"], c["EPILOGUE_SPLIT"])
        grad = spec["kernel"] == "_gemm_act_grad_kernel"
        split = _epilogue_split(entry, grad, False)
        config = {k: v for k, v in spec["config"].items() if k not in ("dropout", "EPILOGUE_SPLIT")}
        if split > 1 or grad:
            config["EPILOGUE_SPLIT"] = split
        specs.append(dict(spec, constexprs=dict(c, DROPOUT=False, EPILOGUE_SPLIT=split, **act_meta("xielu")),
                          config=dict(config, activation="xielu"), source=spec["source"] + "/xielu"))
    # the routed ungated experts' variant (row scale and its gradient in the epilogue) on every sm_90 bf16 grad
    # entry with pointer loads: Nemotron-H's relu2, no bias, the scales a slice at any offset, any row count
    for spec in [s for s in specs if s["kernel"] == "_gemm_act_grad_kernel" and s["arch"] == "sm_90"
                 and s["dtype"] == torch.bfloat16 and not {"loads", "dropout", "activation"} & set(s["config"])]:
        c = spec["constexprs"]
        split = _routed_split(c["EPILOGUE_SPLIT"], c["PERSISTENT"], c["BLOCK_M"], c["BLOCK_N"])
        specs.append(dict(spec, constexprs=dict(spec["constexprs"], ROW_SCALE=True, HAS_BIAS=False, EPILOGUE_SPLIT=split,
                                                **act_meta("relu2")),
                          config=dict(spec["config"], activation="relu2", row_scale=True, EPILOGUE_SPLIT=split),
                          aligned=[n for n in spec["aligned"] if n not in ("scale_ptr", "M")],
                          source=spec["source"] + "/row_scale"))
    # grouped launches (every routed ungated expert's rows in one launch, GROUPED's tile table) as moe_experts makes
    # them: every sm_90 16-bit tile a grouped launch may take (the table's, narrow: _dense_launch), pointer loads,
    # one program per tile (dense_grid); the forward and the row-scale grad kernel, bf16, Nemotron-H's relu2, with
    # the up biases (their expert stride)
    tiles = {}
    for (family, opclass, bucket), cfg in _TABLE.items():
        if family == "sm90" and opclass == "16bit":
            tiles.setdefault(_NARROW.get((family, opclass, bucket), cfg), []).append(f"{family}/{opclass}/{bucket}")
    for (entry, labels), (kernel, name), persistent in itertools.product(
            tiles.items(), ((_gemm_act_kernel, "_gemm_act_kernel"), (_gemm_act_grad_kernel, "_gemm_act_grad_kernel")),
            (False,)):
        grad = kernel is _gemm_act_grad_kernel
        split = _epilogue_split(entry, grad, False)
        split = _routed_split(split, persistent, entry.BLOCK_M, entry.BLOCK_N) if grad else split
        sig, aligned = _inspect_signature(kernel, torch.bfloat16)
        constexprs = {"stride_ak": 1, "stride_bk": 1, "HAS_BIAS": True, "DROPOUT": False, "GROUPED": True,
                      **act_meta("relu2"), "BLOCK_M": entry.BLOCK_M, "BLOCK_N": entry.BLOCK_N,
                      "BLOCK_K": entry.BLOCK_K, "GROUP_M": entry.GROUP_M, "EVEN_K": True, "PRECISION": "ieee",
                      "UPCAST": False, "TMA": False, "PERSISTENT": persistent, "EPILOGUE_SPLIT": split,
                      **({"STORE_ACT": True, "ROW_SCALE": True} if grad else {})}
        sig.update({c: "constexpr" for c in constexprs}, tiles_ptr="*i32")
        config = {"BLOCK_M": entry.BLOCK_M, "BLOCK_N": entry.BLOCK_N, "BLOCK_K": entry.BLOCK_K,
                  "GROUP_M": entry.GROUP_M, "num_warps": entry.num_warps, "num_stages": entry.num_stages,
                  "EPILOGUE_SPLIT": split, "activation": "relu2", "grouped": True,
                  **({"persistent": True} if persistent else {}), **({"row_scale": True} if grad else {})}
        specs.append({"fn": kernel, "kernel": name, "arch": "sm_90", "dtype": torch.bfloat16, "config": config,
                      "signature": sig, "constexprs": constexprs, "num_warps": entry.num_warps,
                      "num_stages": entry.num_stages, "gemm": True,
                      "aligned": [n for n in aligned if n not in ("scale_ptr", "M")],
                      "source": ",".join(labels) + "/grouped"})
    return specs
