"""Routed experts, gated or not (a Mixture-of-Experts layer's experts, Hugging Face's layout).

Pure-torch reference: ``fusedrc.reference.moe_experts_forward`` / ``moe_experts_backward``; the
loop over experts (slots sorted by expert, weighted sum over the k choices in fp32, no atomics)
is the reference's ``moe_forward_with`` / ``moe_backward_with``, shared: only each expert's
computation differs.

Kept for backward: x, the routing (index, weights) and the weights, what checkpointing the
experts call keeps. Per expert with rows r (its tokens) and routing weights s:

Forward (3 GEMMs): ``_gated_act_kernel`` (gate and up in one main loop, a = act(h_g) * h_u
  written once), then the down GEMM; y * s summed into the output.
Launches: experts run grouped by default (``GROUPED_EXPERTS``): each act kernel (the dual kernels; ungated, the
  dense ones) is one launch over every expert's rows (GROUPED: a table of row tiles, (expert, first row, end row),
  none across two experts; the expert's weights an expert stride past expert 0's), and each plain GEMM one
  torch._grouped_mm where it has its fast path (CUDA bf16 on sm_90+), else a launch per expert. Forward 2 launches
  and one scaling pass for the layer, backward 5 (joint gate/up rows) plus the routing's gathers; a down bias's
  sums a few more (per chunk of whole experts): a fine-grained MoE layer (128 experts of 768, Qwen3-MoE's)
  launched ~10 kernels per expert per step before. Grouped and per-expert launches may take different tiles (the
  grouped one the table's for the mean rows an expert gets), so they agree to rounding, not bit for bit; a forward
  and its recompute always take the same path and tiles.
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

import collections
import os
from typing import NamedTuple

import torch

from . import _common
from ._common import ExpertGroups, _reference, device_capability, gemm_act, gemm_act_grad, plain_gemm
from fusedrc.reference import split_gated
from .fused_mlp import fused_mlp_forward
from .gated_mlp import _joint_rows, gated_act, gated_act_grad, gated_mlp_forward, input_grads

__all__ = ["moe_experts_forward", "moe_experts_backward"]

# Experts' launches: True, every expert's rows in one launch of each act kernel (dual, or dense where ungated: their
# tile table, ``_common.ExpertGroups``) and of each plain GEMM where torch._grouped_mm takes it (``GROUPED_MM``), else a
# plain GEMM launch per expert; False, every launch per expert (the reference's loop, ``moe_forward_with``).
# Either way the same arithmetic per row (the grouped launch's tile is the table's for the mean rows an expert
# gets, a per-expert launch's for its own rows: the two may round differently, each forward and its
# recompute alike). FUSEDRC_GROUPED_EXPERTS=0 in the environment sets it off at import (benchmarks time both).
GROUPED_EXPERTS = os.environ.get("FUSEDRC_GROUPED_EXPERTS", "1").strip().lower() not in ("", "0", "false", "off", "no")
# torch._grouped_mm for the grouped plain GEMMs: "auto", where it has its fast path (CUDA bf16 on sm_90+, the
# aten GEMMs on, not deterministic: else the fallback loops as this module does); True, wherever torch has it
# and the operands are 16-byte aligned (its CPU kernel since torch 2.9: tests); False, never.
GROUPED_MM = "auto"


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


# --------------------------------------------------------------------------- grouped launches
def _torch_version():
    return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def _aligned(t):
    """torch._grouped_mm's layout rule: a 16-byte aligned base, unit stride in one of the last two dims, the other
    (the pitch) and a batch stride multiples of 16 bytes."""
    e, strides = t.element_size(), t.stride()
    if strides[-1] == 1:  # row-major: the row pitch must be aligned (a size-1 dimension's too: torch checks it)
        pitch = strides[-2]
    elif strides[-2] == 1:
        pitch = strides[-1]
    else:
        return False
    return t.data_ptr() % 16 == 0 and all(s * e % 16 == 0 for s in (*strides[:-2], pitch))


def _grouped_mm_takes(a, b):
    if GROUPED_MM is False or not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype or a.device != b.device:
        return False
    if GROUPED_MM == "auto":
        if not (a.is_cuda and a.dtype == torch.bfloat16 and _common.uses_aten_gemm(a, b)
                and device_capability(a) >= (9, 0)):
            return False
    elif not a.is_cuda and _torch_version() < (2, 9):  # no CPU kernel before 2.9
        return False
    return _aligned(a) and _aligned(b)


def _expert_rows(counts):
    """(e, rows) of each expert with rows, in order: its slice of the expert-sorted rows."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(start, start + n)
            start += n


_GROUP_INDEX = collections.OrderedDict()  # (kind, counts, device) -> a layer's index tensor, both passes


def _group_index(kind, counts, device):
    """Index tensors of the expert-sorted rows on ``device``, cached: ``"ends"``, each group's end (int32:
    torch._grouped_mm's offsets); ``"experts"``, each row's expert (int64)."""
    key = (kind, tuple(counts), device)
    t = _GROUP_INDEX.get(key)
    if t is None:
        n = torch.tensor(counts, dtype=torch.int64)
        t = n.cumsum(0).to(torch.int32) if kind == "ends" else torch.repeat_interleave(torch.arange(len(counts)), n)
        t = _GROUP_INDEX[key] = t.to(device)
        if len(_GROUP_INDEX) > 512:
            _GROUP_INDEX.popitem(last=False)
    else:
        _GROUP_INDEX.move_to_end(key)
    return t


def grouped_mm(a, b, counts, out_dtype=None, out=None):
    """(M, N): the rows of group e of a (M, K) (``counts[e]`` of them, in order) times b[e] (b (E, K, N)): one
    torch._grouped_mm where it takes them, else a ``plain_gemm`` per group; written into ``out`` where given
    (its dtype the result's)."""
    if a.shape[0] and _grouped_mm_takes(a, b):
        res = torch._grouped_mm(a, b, offs=_group_index("ends", counts, a.device))
        if out is not None:
            return out.copy_(res)
        return res if out_dtype is None or res.dtype == out_dtype else res.to(out_dtype)
    if out is None:
        out = torch.empty((a.shape[0], b.shape[2]), device=a.device, dtype=out_dtype or a.dtype)
    for e, rows in _expert_rows(counts):
        plain_gemm(a[rows], b[e], out_dtype=out.dtype, out=out[rows])
    return out


def grouped_weight_grad(a, b, counts, like, out=None):
    """(E, P, Q) laid out as ``like`` (a stacked weight, maybe stored transposed) in its dtype: [e] = the rows of
    group e of a (M, P) transposed times those of b (M, Q); zeros for a group without rows. ``out``: a view of a
    stacked gradient (laid out as ``like``) to write into."""
    transposed = not like.is_contiguous() and like.transpose(1, 2).is_contiguous()
    lhs, rhs = (b.t(), a) if transposed else (a.t(), b)
    if a.shape[0] and _grouped_mm_takes(lhs, rhs):
        res = torch._grouped_mm(lhs, rhs, offs=_group_index("ends", counts, a.device))
        empty = [e for e, n in enumerate(counts) if not n]
        if empty:  # no rows: nothing summed (zeros, whatever the kernel leaves there)
            res.index_fill_(0, torch.tensor(empty, device=res.device), 0)
        res = res.transpose(1, 2) if transposed else res
        if out is not None:
            return out.copy_(res)
        return res if res.dtype == like.dtype else res.to(like.dtype)
    if out is None:
        out = torch.zeros_like(like)
    for e, rows in _expert_rows(counts):
        plain_gemm(a[rows].t(), b[rows], out_dtype=like.dtype, out=out[e])
    return out


class _GroupedPlan(NamedTuple):
    """A grouped experts call: expert 0's weights and biases as the act kernel takes them (gated: gate, up and
    their biases, views of the stacked ones or of contiguous copies of stacked biases; ungated: up and its bias),
    the expert strides, and the stacked gate (None ungated) and up weights (E, I, K)."""
    first: tuple
    stride_w: int
    stride_b: int
    gates: torch.Tensor | None
    ups: torch.Tensor


def _grouped_plan(x, layout, gate_up, up, gate_up_bias):
    """How the experts run grouped, or None (per expert: ``GROUPED_EXPERTS`` off, a meta call, stacks the
    kernels cannot step through with one expert stride)."""
    if not GROUPED_EXPERTS or x.device.type == "meta" or gate_up.shape[0] == 0:
        return None
    if not layout.gated:  # the dense kernels with GROUPED: the up projections (E, I, K) and their biases
        gates, ups = None, gate_up
    else:
        gates, ups = (gate_up, up) if layout.apart else _reference().gate_and_up(gate_up, layout)
        if gates.stride() != ups.stride() or gates.dtype != ups.dtype:  # one set of strides for both stacks
            return None
    if max(ups.stride()[1:]) * 512 > 2 ** 31:  # in-tile offsets well within int32 (_tile_safe copies none)
        return None
    if gate_up_bias is None or layout.apart:
        biases, stride_b = (None,) * (1 + layout.gated), 0
    elif not layout.gated:
        bias = gate_up_bias.contiguous()  # (E, I), tiny
        biases, stride_b = (bias[0],), bias.stride(0)
    else:
        pair = tuple(b.contiguous() for b in _reference().gate_and_up(gate_up_bias, layout))  # (E, I) each, tiny
        biases, stride_b = (pair[0][0], pair[1][0]), pair[0].stride(0)
    weights = (ups[0],) if gates is None else (gates[0], ups[0])
    return _GroupedPlan((*weights, *biases), ups.stride(0), stride_b, gates, ups)


# rows of a chunk of the down bias's gradients: about 64 MiB of fp32 temporaries a piece at hidden size 2**10
_BIAS_CHUNK_ELEMENTS = 2 ** 24


def _grouped_down_bias_grads(gs, w, down_bias, counts, need_dw, need_ddb):
    """The down bias's share of d scale (g_out . bd per row) and its gradient (each expert's scaled rows summed),
    fp32, as ``_down_bias_grads`` per expert: over chunks of whole experts of at most ~``_BIAS_CHUNK_ELEMENTS``
    elements of g_out (a few launches a chunk, bounded temporaries, fixed order: no atomics)."""
    U, H = gs.shape
    share = torch.empty(U, device=gs.device, dtype=torch.float32) if need_dw else None
    ddb = torch.zeros_like(down_bias) if need_ddb else None
    experts = _group_index("experts", counts, gs.device)
    bias32 = down_bias.float()
    limit, e0, start = max(1, _BIAS_CHUNK_ELEMENTS // max(1, H)), 0, 0
    while e0 < len(counts):
        e1, rows = e0 + 1, counts[e0]
        while e1 < len(counts) and rows + counts[e1] <= limit:
            rows += counts[e1]
            e1 += 1
        if rows:
            g32 = gs[start:start + rows].float()
            if need_dw:
                share[start:start + rows] = (g32 * bias32.index_select(0, experts[start:start + rows])).sum(1)
            if need_ddb:
                g32.mul_(w[start:start + rows, None])
                ddb[e0:e1] = torch.segment_reduce(g32, "sum", lengths=torch.tensor(counts[e0:e1], device=gs.device),
                                                  axis=0)
        e0, start = e1, start + rows
    return share, ddb


def _token_sums(slots, order, top_k_index, dtype):
    """Each token's sum over its k slots of the expert-sorted rows ``slots`` (S, C), in ``dtype``: k gathers of
    (T, C) added in order, never a (T, k, C) copy of the slots (``unroute``'s, as large as they are)."""
    T, k = top_k_index.shape
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device)).view(T, k)
    out = slots.index_select(0, inverse[:, 0])
    for j in range(1, k):
        out += slots.index_select(0, inverse[:, j])
    return out.to(dtype)


def _grouped_forward(plan, x, top_k_index, top_k_weights, gate_up, down, activation, down_bias):
    """The experts' weighted outputs: the act kernel (both dual GEMMs where gated) in one launch, then the down
    GEMM grouped, its rows scaled into the fp32 slots (a down bias added there first, in fp32: gpt-oss's)."""
    R = _reference()
    order, tokens, counts = R.route(top_k_index, gate_up.shape[0])
    U = sum(counts)
    acc = torch.promote_types(x.dtype, torch.float32)
    slots = torch.empty((order.numel(), down.shape[1]), device=x.device, dtype=acc)
    w = top_k_weights.reshape(-1)[order].to(acc)
    groups = ExpertGroups(tuple(counts), plan.stride_w, plan.stride_b)
    if plan.gates is None:
        a = gemm_act(x[tokens[:U]], plan.first[0].t(), plan.first[1], activation, groups=groups)
    else:
        a = gated_act(x[tokens[:U]], *plan.first, activation, groups=groups)
    y = grouped_mm(a, down.transpose(1, 2), counts)
    del a
    if down_bias is None:
        torch.mul(y, w[:U, None], out=slots[:U])
    else:
        rows = slots[:U]
        rows.copy_(y)
        del y
        rows += down_bias.index_select(0, _group_index("experts", counts, x.device))
        rows *= w[:U, None]
    slots[U:].zero_()  # the skipped slots
    return _token_sums(slots, order, top_k_index, x.dtype)


def _grouped_backward(plan, x, top_k_index, top_k_weights, gate_up, down, grad_out, activation, layout, need, up,
                      gate_up_bias, down_bias):
    R = _reference()
    need_dx, need_dw, need_dgu, need_dd, need_dgub, need_ddb = need
    order, tokens, counts = R.route(top_k_index, gate_up.shape[0])
    U, S = sum(counts), order.numel()
    acc = torch.promote_types(x.dtype, torch.float32)
    w = top_k_weights.reshape(-1)[order].to(acc)
    xs, gs = x[tokens[:U]], grad_out[tokens[:U]]
    grad_y = grouped_mm(gs, down, counts, out_dtype=x.dtype)             # unscaled: the kernel scales it
    groups = ExpertGroups(tuple(counts), plan.stride_w, plan.stride_b)
    if plan.gates is None:  # ungated: one g_h, the up projections' rows
        gh, a, dbu, dscale = gemm_act_grad(xs, plan.first[0].t(), plan.first[1], grad_y, activation,
                                           store_act=need_dd, row_scale=w[:U], groups=groups)
        dbg = ghg = ghu = grads = None
    else:
        ghg, ghu, a, dbg, dbu, dscale = gated_act_grad(xs, *plan.first, grad_y, activation, store_act=need_dd,
                                                       row_scale=w[:U], groups=groups)
        # (U, 2I) in the weights' row order where the kernel laid the g_h's out so (gated_act_grad)
        grads = None if layout.apart else _joint_rows(ghg.t(), ghu.t())
        gh = grads[1].t() if grads is not None and grads[0] == ("interleaved" if layout.interleaved else "halves") \
            else None
    del grad_y
    dd = grouped_weight_grad(gs, a, counts, down) if need_dd else None  # g_out^T (s a)
    del a
    # each gathered operand freed after its last GEMM: the dX slots (fp32, every routed row) come last
    dw_slots = dgu = dup = dgub = ddb = bias_dscale = None
    if down_bias is not None and (need_dw or need_ddb):  # a bias's small sums (gpt-oss's)
        bias_dscale, ddb = _grouped_down_bias_grads(gs, w, down_bias, counts, need_dw, need_ddb)
    del gs
    if need_dgu:
        if gh is not None:
            dgu = grouped_weight_grad(gh, xs, counts, gate_up)
        elif layout.apart:
            dgu = grouped_weight_grad(ghg, xs, counts, gate_up)
            dup = grouped_weight_grad(ghu, xs, counts, up) if up is not None else None
        else:  # two buffers (gate and up rows the kernel could not read as one operand): into dgu's halves
            dgu = torch.zeros_like(gate_up)
            for g_h, stack, part in zip((ghg, ghu), (plan.gates, plan.ups), R.gate_and_up(dgu, layout)):
                grouped_weight_grad(g_h, xs, counts, stack, out=part)
    del xs
    if need_dgub and gate_up_bias is not None:
        if dbg is None:
            dgub = dbu
        else:
            dgub = torch.empty_like(gate_up_bias)
            for grad, part in zip((dbg, dbu), R.gate_and_up(dgub, layout)):
                part.copy_(grad)
    dx = None
    if need_dx:
        dx_slots = torch.empty((S, x.shape[1]), device=x.device, dtype=acc)
        if gh is not None:
            grouped_mm(gh, gate_up, counts, out=dx_slots[:U])
        else:
            grouped_mm(ghg, plan.gates, counts, out=dx_slots[:U])
            dx_slots[:U] += grouped_mm(ghu, plan.ups, counts, out_dtype=acc)
        del gh, ghg, ghu, grads  # (the joint rows' view too)
        dx_slots[U:].zero_()
        dx = _token_sums(dx_slots, order, top_k_index, x.dtype)
    if need_dw:
        dw_slots = torch.empty(S, device=x.device, dtype=acc)
        dw_slots[:U] = dscale if bias_dscale is None else dscale + bias_dscale
        dw_slots[U:].zero_()
    dw = R.unroute(dw_slots, order, top_k_index).to(top_k_weights.dtype) if need_dw else None
    return dx, dw, dgu, dd, dup, dgub, ddb


# --------------------------------------------------------------------------- entry points
def moe_experts_forward(x, top_k_index, top_k_weights, gate_up, down, activation, gated=True, up=None,
                        gate_up_bias=None, down_bias=None, interleaved=False):
    """Same contract as ``fusedrc.reference.moe_experts_forward``."""
    split_gated(activation)
    R = _reference()
    layout = R.ExpertsLayout(gated, up is not None, interleaved)
    plan = _grouped_plan(x, layout, gate_up, up, gate_up_bias)
    if plan is not None:
        return _grouped_forward(plan, x, top_k_index, top_k_weights, gate_up, down, activation, down_bias)
    return R.moe_forward_with(_expert_forward, x, top_k_index, top_k_weights, gate_up, down, activation, layout, up,
                              gate_up_bias, down_bias)


def moe_experts_backward(x, top_k_index, top_k_weights, gate_up, down, grad_out, activation, output_mask=None,
                         gated=True, up=None, gate_up_bias=None, down_bias=None, interleaved=False):
    """Same contract as ``fusedrc.reference.moe_experts_backward``."""
    split_gated(activation)
    R = _reference()
    layout = R.ExpertsLayout(gated, up is not None, interleaved)
    plan = _grouped_plan(x, layout, gate_up, up, gate_up_bias)
    if plan is not None:
        return _grouped_backward(plan, x, top_k_index, top_k_weights, gate_up, down, grad_out, activation, layout,
                                 R.wanted(output_mask, 6), up, gate_up_bias, down_bias)
    return R.moe_backward_with(_expert_backward, x, top_k_index, top_k_weights, gate_up, down, grad_out, activation,
                               layout, output_mask, up, gate_up_bias, down_bias)
