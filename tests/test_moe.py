"""Routed gated experts (``fusedrc.functional.moe_experts``): both backends against a float64
per-token oracle, the routing weights' gradient from the recompute, what is kept for backward,
the GEMM count, torch.compile; and ``fusedrc.convert`` on Hugging Face MoE models (Mixtral,
Qwen2-MoE with its shared expert, OLMoE, Aria's transposed weights).

Triton kernels run under Triton's interpreter on the CPU (tests/conftest.py).
"""
import copy
import math
import sys

import pytest
import torch
import torch.nn.functional as TF
from torch import nn

import fusedrc
from fusedrc import functional as F
from fusedrc import reference as R
from fusedrc.convert import _import_torchvision, _set_impl, saved_bytes

from _utils import (FusedOpLog, GemmCounter, SavedBytes, backend_device, fused_without_norms, record_launches,
                    rel_err)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}
BACKENDS = ["reference", "triton"]


def _routing(T, k, E, *, skip=None, repeat=False, device="cpu"):
    """(T, k) distinct experts per token (``repeat``: any, a token may pick one expert twice);
    expert ``skip`` gets no token."""
    pool = torch.tensor([e for e in range(E) if e != skip])
    if repeat:
        idx = pool[torch.randint(len(pool), (T, k))]
        idx[0] = pool[0]  # at least one token routed twice to the same expert
    else:
        idx = torch.stack([pool[torch.randperm(len(pool))[:k]] for _ in range(T)])
    return idx.to(device), torch.rand(T, k, dtype=torch.float64).to(device)


def _weights(E, K, I, N, gated=True):
    rows = 2 * I if gated else I
    return torch.randn(E, rows, K, dtype=torch.float64) * K ** -0.5, torch.randn(E, N, I, dtype=torch.float64) * I ** -0.5


def _oracle(x, idx, w, gate_up, down, act, gated=True, limit=None, after=False):
    """Token by token, in float64, through autograd: out[t] = sum_j w[t, j] expert_idx[t, j](x[t]) (with
    ``limit``, the SwiGLU clamp as the models write it)."""
    I = down.shape[2]
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(down.shape[1])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if not 0 <= e < gate_up.shape[0]:  # a skipped choice
                continue
            if limit is not None:
                g, u = x[t] @ gate_up[e, :I].T, (x[t] @ gate_up[e, I:].T).clamp(-limit, limit)
                g = (R.activation_forward(g, act).clamp(max=limit) if after
                     else R.activation_forward(g.clamp(max=limit), act))
                h = g * u
            elif gated:
                h = R.activation_forward(x[t] @ gate_up[e, :I].T, act) * (x[t] @ gate_up[e, I:].T)
            else:
                h = R.activation_forward(x[t] @ gate_up[e].T, act)
            y = y + w[t, j] * (h @ down[e].T)
        rows.append(y)
    return torch.stack(rows)


def _check(backend, dtype, T, K, I, N, E, k, act, skip=None, repeat=False, gated=True, sentinels=(), limit=None,
           after=False):
    """``sentinels``: out-of-range indices put in place of some choices, run with ``skip_out_of_range``."""
    device = backend_device(backend)
    x = torch.randn(T, K, dtype=torch.float64)
    idx, w = _routing(T, k, E, skip=skip, repeat=repeat)
    for i, s in enumerate(sentinels):  # token 0's every choice first (a token no expert runs), then one a token
        idx[(0, i) if i < k else (i - k + 1, 0)] = s
    gate_up, down = _weights(E, K, I, N, gated)
    g = torch.randn(T, N, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    ref = _oracle(leaves[0], idx, *leaves[1:], act, gated, limit, after)
    ref_grads = torch.autograd.grad(ref, leaves, g)
    # the routing weights stay fp32 beside half activations (as a router's softmax gives them)
    ours = [t.to(device, torch.float64 if dtype == torch.float64 else torch.float32 if t is w else dtype)
            .requires_grad_() for t in (x, w, gate_up, down)]
    with fusedrc.use_backend(backend):
        y = F.moe_experts(ours[0], idx.to(device), *ours[1:], activation=act, gated=gated,
                          skip_out_of_range=bool(sentinels), swiglu_limit=limit, limit_after_act=after)
        grads = torch.autograd.grad(y, ours, g.to(device, dtype))
    assert y.dtype == dtype and y.shape == (T, N)
    assert rel_err(y, ref) < TOL[dtype], "out"
    for name, got, want, t in zip(["dx", "dweights", "dgate_up", "ddown"], grads, ref_grads, ours):
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert rel_err(got, want) < TOL[dtype], name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_experts_matches_float64_oracle(backend, dtype):
    """Awkward sizes (no block multiple), top-2 of 5 experts with one expert left without tokens."""
    _check(backend, dtype, T=13, K=24, I=20, N=17, E=5, k=2, act="silu", skip=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ungated_experts(backend, dtype):
    """Ungated experts act(x Wu^T) Wd^T (Nemotron-H's, squared ReLU), the dense kernels'."""
    _check(backend, dtype, T=11, K=24, I=20, N=17, E=4, k=2, act="relu2", skip=1, gated=False)


@pytest.mark.parametrize("act", ["gelu_tanh", "relu", "leaky_relu:0.2"])
def test_moe_experts_activations_top1_and_repeats(act):
    """Other activations (Triton's epilogues), top-1 routing, a single token, float64 (reference);
    top-3 where a token may pick the same expert more than once."""
    _check("triton", torch.float32, T=9, K=16, I=12, N=16, E=3, k=1, act=act)
    _check("reference", torch.float64, T=1, K=8, I=4, N=8, E=4, k=2, act=act)
    for backend in BACKENDS:
        _check(backend, torch.float32, T=7, K=8, I=12, N=8, E=3, k=3, act=act, repeat=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_up_projections_stored_apart(backend):
    """``up_proj`` (DBRX's layout: gate and up projections in two stacks): the same results and gradients
    as the halves of one ``gate_up_proj``, each stack's gradient its own; a frozen gate or up stack gets
    no gradient; a shape or an ungated call that does not fit raises."""
    device = backend_device(backend)
    T, K, I, N, E = 11, 16, 12, 8, 4
    x = torch.randn(T, K, device=device)
    idx, w = _routing(T, 2, E, skip=2, device=device)
    w = w.float()
    gate_up, down = (t.float().to(device) for t in _weights(E, K, I, N))
    g = torch.randn(T, N, device=device)
    one = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    two = [t.clone().requires_grad_() for t in (x, w, gate_up[:, :I], down, gate_up[:, I:])]
    with fusedrc.use_backend(backend):
        y1 = F.moe_experts(one[0], idx, *one[1:])
        y2 = F.moe_experts(*two[:1], idx, *two[1:4], up_proj=two[4])
        g1 = torch.autograd.grad(y1, one, g)
        g2 = torch.autograd.grad(y2, two, g)
    assert rel_err(y2, y1) < 1e-6
    for a, b, name in ((g2[0], g1[0], "dx"), (g2[1], g1[1], "dweights"), (g2[2], g1[2][:, :I], "dgate"),
                       (g2[4], g1[2][:, I:], "dup"), (g2[3], g1[3], "ddown")):
        assert b.shape == a.shape and rel_err(a, b) < 1e-5, name
    for frozen in (2, 4):  # the gate stack, the up stack
        leaves = [t.detach().requires_grad_(i != frozen) for i, t in enumerate(two)]
        with fusedrc.use_backend(backend):
            y = F.moe_experts(leaves[0], idx, *leaves[1:4], up_proj=leaves[4])
            y.backward(g)
        assert leaves[frozen].grad is None and rel_err(leaves[6 - frozen].grad, g2[6 - frozen]) < 1e-6
    if backend == "reference":  # the op's optional tensor under torch.compile, and the plain composition (jvp)
        def fn(x, w, gate, down, up):
            return F.moe_experts(x, idx, w, gate, down, up_proj=up).square().sum()

        torch._dynamo.reset()
        got = torch.autograd.grad(torch.compile(fn, backend="aot_eager", fullgraph=True)(*two), two)
        assert all(rel_err(a, b) < 1e-6 for a, b in zip(got, torch.autograd.grad(fn(*two), two)))
        _, tangent = torch.func.jvp(lambda up: F.moe_experts(x, idx, w, two[2].detach(), down, up_proj=up),
                                    (two[4].detach(),), (torch.ones_like(two[4]),))
        _, want = torch.func.jvp(lambda gu: F.moe_experts(x, idx, w, gu, down),
                                 (gate_up,), (torch.cat([torch.zeros_like(two[2]), torch.ones_like(two[4])], 1),))
        assert rel_err(tangent, want) < 1e-5
    with pytest.raises(ValueError, match="up_proj must have gate_up_proj's shape"):
        F.moe_experts(x, idx, w, gate_up[:, :I], down, up_proj=gate_up[:, :I - 1])
    with pytest.raises(ValueError, match="up_proj is for gated experts"):
        F.moe_experts(x, idx, w, gate_up[:, :I], down, gated=False, up_proj=gate_up[:, I:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_clamped_experts(backend):
    """A SwiGLU clamp that bites (DeepSeek-V4's before the activation, Step-3.7's after it) on every expert:
    output, input, routing-weight and weight gradients against the float64 oracle; ungated experts refuse it."""
    for after in (False, True):
        _check(backend, torch.float32, T=13, K=24, I=20, N=17, E=4, k=2, act="silu", skip=1, limit=0.3, after=after)
    x, (up, down) = torch.randn(5, 8), (t.float() for t in _weights(4, 8, 6, 8, gated=False))
    idx, w = _routing(5, 2, 4)
    with pytest.raises(ValueError, match="ungated experts"):
        F.moe_experts(x, idx, w.float(), up, down, gated=False, swiglu_limit=1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_gate_scale(backend):
    """A gate multiplier m on every expert, ``act(m h_g) * h_u``, equals the experts with m times their gate rows:
    output, input and routing-weight gradients alike, and the gate rows' gradients m times those of the scaled
    rows; ungated experts refuse it."""
    device = backend_device(backend)
    E, K, I, N, m = 4, 24, 20, 17, -0.6
    x = torch.randn(13, K, device=device)
    idx, w = _routing(13, 2, E, device=device)
    gate_up, down = (t.float().to(device) for t in _weights(E, K, I, N))
    scaled = gate_up.clone()
    scaled[:, :I] *= m
    outs = []
    for weights, kwargs in ((gate_up, dict(gate_scale=m)), (scaled, {})):
        leaves = [t.clone().requires_grad_() for t in (x, w.float(), weights, down)]
        with fusedrc.use_backend(backend):
            y = F.moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], "silu", **kwargs)
            y.square().sum().backward()
        outs.append((y, *(t.grad for t in leaves)))
    (y, dx, dw, dgu, dd), (y2, dx2, dw2, dgu2, dd2) = outs
    for a, b in ((y, y2), (dx, dx2), (dw, dw2), (dd, dd2), (dgu[:, I:], dgu2[:, I:]), (dgu[:, :I], m * dgu2[:, :I])):
        assert rel_err(a, b) < 1e-5
    up, down_u = (t.float() for t in _weights(E, 8, 6, 8, gated=False))
    with pytest.raises(ValueError, match="ungated experts"):
        F.moe_experts(torch.randn(5, 8), idx[:5], w[:5].float(), up, down_u, gated=False, gate_scale=2.0)


def _gpt_oss_oracle(x, idx, w, gate_up, down, gate_up_bias, down_bias, gated, interleaved, limit, alpha, offset):
    """Token by token, in float64, through autograd, as gpt-oss writes its experts: the gate and up rows
    alternating (or halves), biases on both projections (the down bias scaled with the expert's output), the
    gate (up.clamp(-L, L) + offset) * g * sigmoid(alpha g) of g = gate.clamp(max=L); ungated: relu."""
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(down.shape[1])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = gate_up[e] @ x[t] + gate_up_bias[e]
            if not gated:
                a = torch.relu(h)
            else:
                g, u = (h[::2], h[1::2]) if interleaved else h.chunk(2)
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                a = (u + offset) * (g * torch.sigmoid(g * alpha))
            y = y + w[t, j] * (down[e] @ a + down_bias[e])
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["interleaved", "halves", "ungated"])
def test_experts_with_biases(backend, form):
    """Per-expert biases on both projections (gpt-oss's, the OpenAI privacy filter's, ungated experts' up
    biases), the gate and up rows interleaved or in halves, gpt-oss's gate with a limit that bites: output and
    every gradient (the biases' and the routing weights', whose share of the down bias is grad . bd) against
    the float64 oracle, in fp32."""
    device, gated, interleaved = backend_device(backend), form != "ungated", form == "interleaved"
    T, K, I, N, E, k = 13, 24, 20, 17, 4, 2
    x = torch.randn(T, K, dtype=torch.float64)
    idx, w = _routing(T, k, E, skip=2)
    gate_up, down = _weights(E, K, I, N, gated)
    biases = torch.randn(E, gate_up.shape[1], dtype=torch.float64), torch.randn(E, N, dtype=torch.float64)
    g = torch.randn(T, N, dtype=torch.float64)
    gate = dict(limit=0.4, alpha=1.702, offset=1.0) if gated else dict(limit=None, alpha=None, offset=0.0)
    leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down, *biases)]
    ref = _gpt_oss_oracle(*leaves[:1], idx, *leaves[1:], gated, interleaved, **gate)
    ref_grads = torch.autograd.grad(ref, leaves, g)
    ours = [t.to(device, torch.float32).requires_grad_() for t in (x, w, gate_up, down, *biases)]
    with fusedrc.use_backend(backend), FusedOpLog(calls := []):
        y = F.moe_experts(ours[0], idx.to(device), *ours[1:4], activation="silu" if gated else "relu", gated=gated,
                          gate_up_proj_bias=ours[4], down_proj_bias=ours[5], interleaved=interleaved,
                          swiglu_limit=gate["limit"], swiglu_alpha=gate["alpha"], up_offset=gate["offset"])
        grads = torch.autograd.grad(y, ours, g.to(device, torch.float32))
    assert calls and all(c.startswith("moe_experts") for c in calls)
    assert rel_err(y, ref) < TOL[torch.float32], "out"
    names = ["dx", "dweights", "dgate_up", "ddown", "dgate_up_bias", "ddown_bias"]
    for name, got, want, t in zip(names, grads, ref_grads, ours):
        assert got.shape == t.shape and rel_err(got, want) < TOL[torch.float32], name
    # a frozen down bias and weights: only the other gradients, the same values
    ours[5].requires_grad_(False)
    with fusedrc.use_backend(backend):
        y = F.moe_experts(ours[0], idx.to(device), *ours[1:4], activation="silu" if gated else "relu", gated=gated,
                          gate_up_proj_bias=ours[4], down_proj_bias=ours[5], interleaved=interleaved,
                          swiglu_limit=gate["limit"], swiglu_alpha=gate["alpha"], up_offset=gate["offset"])
        again = torch.autograd.grad(y, ours[:5], g.to(device, torch.float32))
    for name, got, want in zip(names, again, grads):
        assert torch.equal(got, want), name


def test_experts_bias_and_layout_arguments_checked():
    """Bad biases and layouts name the argument and what was expected."""
    x, (gate_up, down) = torch.randn(5, 8), (t.float() for t in _weights(4, 8, 6, 3))
    idx, w = _routing(5, 2, 4)
    w = w.float()
    with pytest.raises(ValueError, match=r"gate_up_proj_bias must have shape \(4, 12\)"):
        F.moe_experts(x, idx, w, gate_up, down, gate_up_proj_bias=torch.randn(4, 6))
    with pytest.raises(ValueError, match=r"down_proj_bias must have shape \(4, 3\)"):
        F.moe_experts(x, idx, w, gate_up, down, down_proj_bias=torch.randn(3, 4))
    with pytest.raises(ValueError, match="down_proj_bias must be 2-D"):
        F.moe_experts(x, idx, w, gate_up, down, down_proj_bias=torch.randn(3))
    with pytest.raises(TypeError, match="down_proj_bias must be a floating"):
        F.moe_experts(x, idx, w, gate_up, down, down_proj_bias=torch.ones(4, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        F.moe_experts(x, idx, w, gate_up, down, interleaved=1)
    with pytest.raises(ValueError, match="interleaved .* needs gated experts without up_proj"):
        F.moe_experts(x, idx, w, gate_up[:, :6], down, gated=False, interleaved=True)
    with pytest.raises(ValueError, match="gate_up_proj_bias with up_proj"):
        F.moe_experts(x, idx, w, gate_up[:, :6], down, up_proj=gate_up[:, 6:], gate_up_proj_bias=torch.randn(4, 6))
    with pytest.raises(TypeError, match="gate_up_proj_bias .*dtype"):
        F.moe_experts(x, idx, w, gate_up, down, gate_up_proj_bias=torch.randn(4, 12, dtype=torch.float64))


def test_narrow_index_dtypes():
    """int8 / uint8 expert indices with as many experts as the dtype holds values (the sentinel num_experts
    itself does not fit it)."""
    x = torch.randn(6, 4)
    for dtype, E in ((torch.int8, 128), (torch.uint8, 256)):
        gate_up, down = (t.float() for t in _weights(E, 4, 2, 4))
        idx = torch.tensor([[0, E - 1], [5, 7], [E - 1, 3], [1, 2], [E - 2, 0], [4, 6]])
        w = torch.rand(6, 2)
        want = F._moe_plain(x, idx, w, gate_up, down, "silu")
        for skip in (False, True):
            assert rel_err(F.moe_experts(x, idx.to(dtype), w, gate_up, down, skip_out_of_range=skip), want) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_choices(backend):
    """``skip_out_of_range=True``: choices outside [0, E) (an expert-parallel sentinel E, indices past it,
    -1) add nothing and their weights' gradients are 0; a token whose every choice is skipped gets zeros;
    gated and ungated; the plain composition (torch.func) skips them too; without the flag they raise."""
    E = 4
    _check(backend, torch.float32, T=9, K=16, I=12, N=8, E=E, k=2, act="silu", sentinels=(E, E + 3, -1, E, E))
    _check(backend, torch.float32, T=6, K=16, I=12, N=8, E=E, k=3, act="relu2", gated=False, sentinels=(E,) * 4)
    x, (gate_up, down) = torch.randn(5, 8), (t.float() for t in _weights(E, 8, 6, 8))
    idx, w = _routing(5, 2, E)
    idx[1, 0], idx[3] = E, -1
    y = F.moe_experts(x, idx, w.float(), gate_up, down, skip_out_of_range=True)
    assert torch.equal(y[3], torch.zeros(8))
    jvp = torch.func.jvp(lambda x: F.moe_experts(x, idx, w.float(), gate_up, down, skip_out_of_range=True),
                         (x,), (torch.ones_like(x),))
    assert torch.allclose(jvp[0], y, rtol=1e-6, atol=1e-6) and torch.equal(jvp[1][3], torch.zeros(8))
    with pytest.raises(ValueError, match="skip_out_of_range=True"):
        F.moe_experts(x, idx, w.float(), gate_up, down)
    with pytest.raises(TypeError, match="skip_out_of_range must be a bool"):
        F.moe_experts(x, idx, w.float(), gate_up, down, skip_out_of_range=1)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_routing_scale_kernel_matches_reference(bias, gated):
    """The grad kernels' ROW_SCALE epilogues (the dual kernel's, and for ungated experts the dense one's): the
    gradients of the scaled rows and the row dots a . (g Wd) summed over several column tiles, against the
    reference expert; with biases (gpt-oss's) their gradients from the kernel's column partials and the down
    bias's share of the row dots."""
    from fusedrc.kernels import _common, gated_mlp, moe_experts

    dev = backend_device("triton")

    M, K, I, N = 37, 33, 50, 20
    x = torch.randn(M, K, dtype=torch.float64)
    wg, wu = torch.randn(I, K, dtype=torch.float64) * K ** -0.5, torch.randn(I, K, dtype=torch.float64) * K ** -0.5
    wd, g = torch.randn(N, I, dtype=torch.float64) * I ** -0.5, torch.randn(M, N, dtype=torch.float64)
    biases = [torch.randn(n, dtype=torch.float64) if bias else None for n in (I, I, N)]
    if not gated:
        wg, biases[0] = None, None
    act = "silu" if gated else "relu2"
    scale = torch.rand(M, dtype=torch.float64) - 0.25  # negative and near-zero scales too
    ours = [t.to(dev, torch.float32) if t is not None else None for t in (x, wg, wu, wd, g, scale, *biases)]
    cfg = gated_mlp._dual_launch(*ours[:3], None, None)[0] if gated else \
        _common._dense_launch(ours[0], ours[2].t(), None, None, None, grad_kernel=True)[0]
    assert I > cfg.BLOCK_N  # the row dot spans several column tiles
    need = (True,) * 6
    want = R._expert_backward(x, R.Expert(wg, wu, wd, *biases), g, scale, act, need)
    got = moe_experts._expert_backward(ours[0], R.Expert(*ours[1:4], *ours[6:]), *ours[4:6], act, need)
    names = ["dx", "dscale", "dw_gate", "dw_up", "dw_down", "db_gate", "db_up", "db_down"]
    for name, a, b in zip(names, got, want):
        absent = (name.startswith("db") and not bias) or (not gated and name in ("dw_gate", "db_gate"))
        assert (a is None) == (b is None) == absent, name
        if a is not None:
            assert rel_err(a, b) < 1e-5, name


def test_keeps_only_the_inputs_and_runs_11_gemms_an_expert():
    """Kept for backward: the call's inputs (what checkpointing it keeps), no intermediate; 3 GEMMs an
    expert forward, 8 backward (the down projection is not rerun for the routing weights)."""
    T, K, I, N, E, k = 16, 8, 32, 8, 4, 2
    x = torch.randn(T, K, requires_grad=True)
    idx, w = _routing(T, k, E)
    w = w.float().requires_grad_()
    gate_up, down = (torch.nn.Parameter(t.float()) for t in _weights(E, K, I, N))
    gate, up = torch.nn.Parameter(gate_up[:, :I].detach().clone()), torch.nn.Parameter(gate_up[:, I:].detach().clone())
    hit = idx.unique().numel()
    for weights in ({"gate_up_proj": gate_up}, {"gate_up_proj": gate, "up_proj": up}):  # up projections apart too
        with fusedrc.use_backend("reference"):
            with SavedBytes() as saved:
                y = F.moe_experts(x, idx, w, down_proj=down, **weights)
            assert saved.bytes == sum(t.numel() * t.element_size() for t in (x, idx, w))
            with GemmCounter() as fwd:
                y = F.moe_experts(x, idx, w, down_proj=down, **weights)
            with GemmCounter() as bwd:
                y.sum().backward()
        assert (fwd.gemms, bwd.gemms) == (3 * hit, 8 * hit)
        assert all(p.grad is not None for p in weights.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_gradients_written_in_place(backend):
    """Each expert's weight gradients are written straight into their slices of the stacked
    gradients (GEMMs with out=), laid out as the weights: no weight-sized copy per expert, and none in
    autograd's accumulation for weights stored transposed (gpt-oss's, with interleaved gate and up rows;
    Llama 4's, halves), whose parameters' gradients come with their strides."""
    class Copies(GemmCounter):  # looks inside fusedrc's ops as GemmCounter does
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # floating destinations only: Triton's interpreter copies each kernel argument's
            # storage to and from the host as bytes (uint8), which a GPU launch does not
            if not isinstance(func, torch._ops.HigherOrderOperator) \
                    and func.overloadpacket.__name__ in ("copy_", "index_put_", "slice_scatter", "select_scatter") \
                    and args[0].is_floating_point():
                self.sizes.append(args[0].numel())
            return super().__torch_dispatch__(func, types, args, kwargs)

    device = backend_device(backend)
    T, K, I, N, E, k = 12, 16, 24, 16, 3, 2
    x = torch.randn(T, K, device=device, requires_grad=True)
    idx, w = _routing(T, k, E, device=device)
    w = w.float().requires_grad_()
    for gated, stored in ((True, "rows"), (False, "rows"), (True, "interleaved"), (True, "halves")):
        gate_up, down = (torch.nn.Parameter(t.float().to(device)) for t in _weights(E, K, I, N, gated))
        if stored != "rows":  # (E, K, 2I) and (E, I, N) parameters, the op given their transposes
            gate_up, down = (torch.nn.Parameter(t.detach().transpose(1, 2).contiguous()) for t in (gate_up, down))
        ops = (gate_up, down) if stored == "rows" else (gate_up.transpose(1, 2), down.transpose(1, 2))
        ref = F._moe_plain(x, idx, w, *ops, "silu", R.ExpertsLayout(gated, False, stored == "interleaved"))
        want = torch.autograd.grad(ref.square().sum(), (x, gate_up, down))
        with fusedrc.use_backend(backend):
            y = F.moe_experts(x, idx, w, *ops, gated=gated, interleaved=stored == "interleaved")
            with Copies() as c:
                y.square().sum().backward()
        for p, g in zip((x, gate_up, down), want):
            assert p.grad.stride() == p.stride() and rel_err(p.grad, g) < 1e-5, stored
        x.grad = None
        assert any("bincount" in op for op in c.ops)  # the mode saw inside the op (its routing)
        assert not [n for n in c.sizes if n >= min(I * K, N * I)], (stored, c.sizes)


@pytest.mark.parametrize("mode", ["per_expert", "grouped", "grouped_mm"])
def test_experts_backward_launches(monkeypatch, mode):
    """The Triton backend's launches in the experts' backward. ``per_expert`` (GROUPED_EXPERTS off): an expert's
    backward is 5 launches where its gate and up rows are one tensor's (halves, or gpt-oss's interleaved
    transposed rows): the grad kernel (the two recomputed GEMMs), g_out Wd, dWd, and dX and dW_gate_up one GEMM
    each over the joint rows; 7 with the up projections apart. ``grouped`` (the default): one grad kernel launch
    for all experts, the plain GEMMs still per expert where torch._grouped_mm does not take them (here: its
    "auto" takes CUDA bf16 only); ``grouped_mm``: those GEMMs one torch._grouped_mm each, no launch per expert.
    Ungated experts: the dense grad kernel the same way (one launch grouped), dX and dW_up one GEMM each.
    No elementwise pass scales the experts' rows for the routing weights (the grad kernel stores s a for dWd)."""
    from fusedrc.kernels import _common, gated_mlp, moe_experts

    monkeypatch.setattr(moe_experts, "GROUPED_EXPERTS", mode != "per_expert")
    monkeypatch.setattr(moe_experts, "GROUPED_MM", True if mode == "grouped_mm" else "auto")
    T, K, I, N, E, k = 12, 16, 24, 16, 3, 2  # 16-byte aligned rows in fp32: _grouped_mm takes them
    x = torch.randn(T, K, requires_grad=True)
    idx, w = _routing(T, k, E)
    w = w.float()
    gate_up, down = (t.float() for t in _weights(E, K, I, N))
    down.requires_grad_()
    hit = idx.unique().numel()
    layouts = {"halves": (dict(gate_up_proj=gate_up), 2),
               "interleaved": (dict(gate_up_proj=gate_up.transpose(1, 2).contiguous().transpose(1, 2),
                                    interleaved=True), 2),
               "apart": (dict(gate_up_proj=gate_up[:, :I].contiguous(), up_proj=gate_up[:, I:].contiguous()), 4),
               "ungated": (dict(gate_up_proj=gate_up[:, :I].contiguous(), gated=False, activation="relu2"), 2)}
    for name, (weights, per_input) in layouts.items():
        weights = {key: v.requires_grad_() if torch.is_tensor(v) else v for key, v in weights.items()}
        with fusedrc.use_backend("triton"):
            y = F.moe_experts(x, idx, w, down_proj=down, **weights)
            with monkeypatch.context() as m:
                seen = record_launches(m, _common)
                seen_gated = record_launches(m, gated_mlp)
                with GemmCounter() as ops:
                    y.backward(torch.randn_like(y))
        assert not [op for op in ops.ops if op.startswith("aten.mul")], name
        plain = 2 + per_input  # g_out Wd and dWd; dX and dW_gate_up (each two with the up rows apart)
        grouped = [op for op in ops.ops if "_grouped_mm" in op]
        act_kernel = "_gated_act_grad_kernel" if name != "ungated" else "_gemm_act_grad_kernel"
        act_launches = [n for n, _ in seen_gated + seen if n == act_kernel]
        seen = [(n, kw) for n, kw in seen if n != act_kernel]  # the plain GEMMs
        if mode == "per_expert":
            assert act_launches == [act_kernel] * hit, name
            assert len(seen) == plain * hit and not grouped, (name, seen)
        else:
            assert act_launches == [act_kernel], name
            if mode == "grouped":
                assert len(seen) == plain * hit and not grouped, (name, seen)
            else:
                assert not seen and len(grouped) == plain, (name, seen, grouped)


def test_expert_tiles_table():
    """The grouped launch's row tiles: every expert-sorted row in exactly one tile, the tile's expert's own,
    at most BLOCK_M rows a tile, tiles in row order; an expert without rows has none."""
    from fusedrc.kernels import _common

    counts, block = (5, 0, 17, 16, 1), 8
    table, lengths, num = _common.expert_tiles(counts, block, torch.device("cpu"))
    tiles = table.view(-1, 3).tolist()
    assert num == len(tiles) == 7 and lengths.tolist() == [1, 0, 3, 2, 1]
    owner = [e for e, n in enumerate(counts) for _ in range(n)]
    covered = []
    for e, first, end in tiles:
        rows = list(range(first, min(first + block, end)))
        assert rows and all(owner[r] == e for r in rows) and end == sum(counts[:e + 1])
        covered += rows
    assert covered == list(range(sum(counts)))


@pytest.mark.parametrize("layout", ["halves", "interleaved", "apart", "gpt_oss", "ungated"])
def test_grouped_experts_match_per_expert(monkeypatch, layout):
    """Every expert's rows in one launch of each act kernel (GROUPED: several row and column tiles an expert,
    an expert without tokens, skipped choices; one-program-per-tile and persistent launches) give the
    per-expert launches' output and gradients, and so with torch._grouped_mm for the plain GEMMs; layouts:
    gate/up halves, gpt-oss's interleaved transposed rows, up projections apart, gpt-oss's experts (biases, its
    clamped gate), ungated experts (the dense kernels; relu2, up and down biases). Down biases' gradients in
    chunks of whole experts too. Two grouped runs are bitwise equal (no atomics)."""
    from fusedrc.kernels import _common, moe_experts

    T, K, I, N, E, k = 64, 16, 40, 16, 4, 2  # ~42 rows an expert; 16-byte aligned fp32 rows for _grouped_mm
    x = torch.randn(T, K)
    idx, w = _routing(T, k, E, skip=2)
    idx[3, 0] = E  # a skipped choice (an expert-parallel sentinel)
    w = w.float()
    gate_up, down = (t.float() for t in _weights(E, K, I, N, layout != "ungated"))
    kwargs = dict(skip_out_of_range=True)
    if layout == "ungated":
        kwargs.update(gated=False, activation="relu2", gate_up_proj_bias=torch.randn(E, I),
                      down_proj_bias=torch.randn(E, N))
    if layout in ("interleaved", "gpt_oss"):
        gate_up = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
        kwargs.update(interleaved=True)
    if layout == "gpt_oss":
        kwargs.update(gate_up_proj_bias=torch.randn(E, 2 * I), down_proj_bias=torch.randn(E, N), swiglu_limit=0.5,
                      swiglu_alpha=1.702, up_offset=1.0)
    tensors = dict(gate_up_proj=gate_up, down_proj=down)
    if layout == "apart":
        tensors.update(gate_up_proj=gate_up[:, :I].contiguous(), up_proj=gate_up[:, I:].contiguous())
    g = torch.randn(T, N)

    def run(grouped, grouped_mm="auto", persistent=0):
        monkeypatch.setattr(moe_experts, "GROUPED_EXPERTS", grouped)
        monkeypatch.setattr(moe_experts, "GROUPED_MM", grouped_mm)
        monkeypatch.setattr(_common, "GEMM_PERSISTENT", persistent)
        leaves = {n: t.clone().requires_grad_() for n, t in
                  dict(x=x, w=w, **tensors, **{n: v for n, v in kwargs.items() if torch.is_tensor(v)}).items()}
        with fusedrc.use_backend("triton"):
            y = F.moe_experts(leaves["x"], idx, leaves["w"], **{**kwargs, **{n: t for n, t in leaves.items()
                                                                              if n not in ("x", "w")}})
            grads = torch.autograd.grad(y, list(leaves.values()), g)
        return [y, *grads]

    per_expert = run(False)
    grouped = run(True)
    runs = [grouped, run(True, True), run(True, persistent=1)]
    if "down_proj_bias" in kwargs:  # the down bias's gradients a chunk of whole experts at a time (one expert
        monkeypatch.setattr(moe_experts, "_BIAS_CHUNK_ELEMENTS", 40 * N)  # past the limit: a chunk of its own)
        runs.append(run(True))
    for got in runs:
        for i, (a, b) in enumerate(zip(got, per_expert)):
            assert a.shape == b.shape and rel_err(a, b) < 1e-5, (layout, i)
    assert all(torch.equal(a, b) for a, b in zip(run(True), runs[-1]))
    assert not grouped[3][2].any()  # expert 2 got no token: no gradient of its gate and up rows


@pytest.mark.parametrize("grouped_mm", [True, "auto"])
def test_grouped_experts_without_tokens(monkeypatch, grouped_mm):
    """A grouped call with no token (an empty batch) or every choice skipped: zero outputs, zero gradients."""
    from fusedrc.kernels import moe_experts

    monkeypatch.setattr(moe_experts, "GROUPED_MM", grouped_mm)
    K, I, N, E = 16, 8, 16, 3
    gate_up, down = (t.float().requires_grad_() for t in _weights(E, K, I, N))
    for T in (0, 3):
        x = torch.randn(T, K, requires_grad=True)
        idx, w = torch.full((T, 2), E), torch.rand(T, 2, requires_grad=True)  # every choice skipped
        with fusedrc.use_backend("triton"):
            y = F.moe_experts(x, idx, w, gate_up, down, skip_out_of_range=True)
            y.backward(torch.randn_like(y))
        assert y.shape == (T, N) and not y.any()
        assert not x.grad.any() and not w.grad.any() and not gate_up.grad.any() and not down.grad.any()


def test_grouped_mm_falls_back_on_unaligned_operands(monkeypatch):
    """torch._grouped_mm wants 16-byte aligned strides, a size-1 dimension's too: operands it would refuse (one
    routed row of 3 features, an expert width of 1) take the per-expert GEMMs instead, with the same results."""
    from fusedrc.kernels import moe_experts

    for T, K, I in ((5, 8, 1), (1, 3, 8)):
        x = torch.randn(T, K)
        idx, w = torch.zeros(T, 1, dtype=torch.long), torch.rand(T, 1)
        gate_up, down = torch.randn(2, 2 * I, K), torch.randn(2, 8, I)
        results = []
        for grouped_mm in (True, False):
            monkeypatch.setattr(moe_experts, "GROUPED_MM", grouped_mm)
            leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
            with fusedrc.use_backend("triton"):
                y = F.moe_experts(leaves[0], idx, *leaves[1:])
                results.append([y, *torch.autograd.grad(y.square().sum(), leaves)])
        for a, b in zip(*results):
            assert rel_err(a, b) < 1e-6, (T, K, I)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_parts_and_determinism(backend):
    """Gradients only where asked (frozen experts, fixed routing weights); two runs bitwise equal."""
    T, K, I, N, E, k = 10, 8, 12, 8, 3, 2
    device = backend_device(backend)
    x = torch.randn(T, K, device=device, requires_grad=True)
    idx, w = _routing(T, k, E, device=device)
    w = w.float()
    gate_up, down = (t.float().to(device) for t in _weights(E, K, I, N))
    down.requires_grad_()
    with fusedrc.use_backend(backend):
        runs = []
        for _ in range(2):
            y = F.moe_experts(x, idx, w, gate_up, down, "gelu")
            runs.append((y, *torch.autograd.grad(y.square().sum(), (x, down))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ref = F._moe_plain(x, idx, w, gate_up, down, "gelu")
    assert rel_err(runs[0][2], torch.autograd.grad(ref.square().sum(), down)[0]) < 1e-5


def test_autocast_and_compile():
    """bf16 autocast casts the input and the experts' weights, as F.linear does; torch.compile
    runs the op opaque (it loops over the routed experts): no graph break, same results."""
    T, K, I, N, E, k = 12, 16, 8, 16, 4, 2
    x = torch.randn(T, K, requires_grad=True)
    idx, w = _routing(T, k, E)
    w = w.float().requires_grad_()
    gate_up, down = (t.float().requires_grad_() for t in _weights(E, K, I, N))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.moe_experts(x, idx, w, gate_up, down)
        plain = F._moe_plain(x, idx, w, gate_up.bfloat16(), down.bfloat16(), "silu")
    assert y.dtype == torch.bfloat16 and rel_err(y, plain) < 1e-2  # as F.linear under autocast
    meta = [t.to("meta") for t in (x, idx, w, gate_up, down)]
    assert F.moe_experts(*meta).shape == (T, N)  # shapes only

    def fn(x, idx, w, gate_up, down):
        return F.moe_experts(x, idx, w, gate_up, down).square().sum()

    explain = torch._dynamo.explain(fn)(x, idx, w, gate_up, down)
    assert explain.graph_break_count == 0
    eager = torch.autograd.grad(fn(x, idx, w, gate_up, down), (x, w, gate_up, down))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, idx, w, gate_up, down), (x, w, gate_up, down))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, eager))
    # the weights' gradients have the weights' strides (transposed too), the fake implementation's as well
    from torch._subclasses.fake_tensor import FakeTensorMode

    stored = [t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (gate_up, down)]
    args = (x.detach(), idx, w.detach(), *stored, torch.randn(T, N), "silu")
    for backend in ("reference", "triton"):
        real = torch.ops.fusedrc.moe_experts_backward(*args, backend)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = torch.ops.fusedrc.moe_experts_backward(
                *(mode.from_tensor(a) if torch.is_tensor(a) else a for a in args), backend)
        assert [g.stride() for g in real[2:4]] == [t.stride() for t in stored]
        assert [g.stride() for g in real if g.numel()] == [g.stride() for g in fake if g.numel()]


@pytest.mark.parametrize("gated", [True, False])
def test_moe_experts_module(gated):
    """fusedrc.nn.MoEExperts: transformers' experts' parameter names and shapes (their state_dict loads
    as is), N-D inputs, the functional op's results; state_dict keys as Mixtral's / Nemotron-H's."""
    experts = fusedrc.nn.MoEExperts(4, 16, 24, out_features=12, activation="relu2" if not gated else "silu",
                                    gated=gated)
    assert list(experts.state_dict()) == (["gate_up_proj", "down_proj"] if gated else ["up_proj", "down_proj"])
    first = experts.gate_up_proj if gated else experts.up_proj
    assert first.shape == (4, 48 if gated else 24, 16) and experts.down_proj.shape == (4, 12, 24)
    bound = 1 / 16 ** 0.5  # nn.Linear's init bound for 16 inputs
    assert 0.5 * bound < first.abs().max() <= bound
    x = torch.randn(2, 5, 16, requires_grad=True)
    weights, index = torch.randn(2, 5, 4).softmax(-1).topk(2)
    y = experts(x, index, weights)
    want = F.moe_experts(x.reshape(10, 16), index.reshape(10, 2), weights.reshape(10, 2), first,
                         experts.down_proj, experts.activation, gated=gated)
    assert y.shape == (2, 5, 12) and torch.equal(y.reshape(10, 12), want)
    y.sum().backward()
    assert x.grad.shape == x.shape and first.grad is not None
    if gated:
        _transformers()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4)
        cfg._experts_implementation = "eager"
        hf = MixtralExperts(cfg)
        for p in hf.parameters():
            torch.nn.init.normal_(p, std=0.2)
        ours = fusedrc.nn.MoEExperts(4, 16, 24)
        ours.load_state_dict(hf.state_dict())
        x2 = torch.randn(6, 16)
        w6, i6 = torch.randn(6, 4).softmax(-1).topk(2)
        assert rel_err(ours(x2, i6, w6), hf(x2, i6, w6)) < 1e-5


# --------------------------------------------------------------------------- fusedrc.convert on HF MoE models
def _transformers():
    try:
        _import_torchvision()
    except ImportError:
        pass
    return pytest.importorskip("transformers", reason="transformers is not installed (test extra)")


def _moe_model(family):
    tr = _transformers()
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, use_cache=False)
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    if family == "mixtral":
        cfg = tr.MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common)
        return tr.MixtralForCausalLM(cfg), experts
    if family == "qwen2_moe":  # plus a shared expert: a Llama-form gated MLP (gated_ffn)
        cfg = tr.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                num_experts=4, num_experts_per_tok=2, **common)
        shared = [f"model.layers.{i}.mlp.shared_expert" for i in range(2)]
        return tr.Qwen2MoeForCausalLM(cfg), [u for pair in zip(experts, shared) for u in pair]
    if family == "olmoe":
        cfg = tr.OlmoeConfig(intermediate_size=24, num_experts=4, num_experts_per_tok=2, **common)
        return tr.OlmoeForCausalLM(cfg), experts
    if family == "jetmoe":  # its own MoE layer (JetMoeMoE: a rule of its own); its attention's experts are left
        cfg = tr.JetMoeConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                              num_key_value_heads=2, kv_channels=8, num_local_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=64, use_cache=False)
        model = tr.JetMoeForCausalLM(cfg)
        for m in model.modules():  # its output bias starts at zero (empty, then initialised): make it count
            if type(m).__name__ == "JetMoeMoE":
                torch.nn.init.normal_(m.bias, std=0.1)
        return model, [f"model.layers.{i}.mlp" for i in range(2)]
    if family == "llama4":  # every expert on every token (bmm; the router's scores scale the rows) and a shared MLP
        cfg = tr.Llama4TextConfig(head_dim=8, intermediate_size=24, intermediate_size_mlp=40, num_local_experts=4,
                                  num_experts_per_tok=1, interleave_moe_layer_step=1, **common)
        model = tr.Llama4ForCausalLM(cfg)
        for m in model.modules():  # its gate_up_proj starts at zero: make the experts count
            if type(m).__name__ == "Llama4TextExperts":
                nn.init.normal_(m.gate_up_proj, std=0.2)
                nn.init.normal_(m.down_proj, std=0.2)
        return model, [f"model.layers.{i}.feed_forward.experts" for i in range(2)] + \
            [f"model.layers.{i}.feed_forward.shared_expert.gate_proj" for i in range(2)]
    if family == "longcat":  # identity ("zero") experts numbered after the 4 routed ones; two dense MLPs a layer
        cfg = tr.LongcatFlashConfig(num_layers=2, ffn_hidden_size=40, expert_ffn_hidden_size=24, n_routed_experts=4,
                                    zero_expert_num=2, moe_topk=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                    qk_nope_head_dim=8, v_head_dim=8, head_dim=8,
                                    **{k: v for k, v in common.items()
                                       if k not in ("num_hidden_layers", "num_key_value_heads")})
        return tr.LongcatFlashForCausalLM(cfg), [u for i in range(2) for u in (
            experts[i], f"model.layers.{i}.mlps.0", f"model.layers.{i}.mlps.1")]
    if family == "dbrx":  # gate w1, up v1 and down w2 as (E * F, hidden) stacks (up_proj apart, w2 transposed)
        cfg = tr.DbrxConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=64, use_cache=False,
                            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                            ffn_config=dict(ffn_hidden_size=24, moe_num_experts=4, moe_top_k=2))
        return tr.DbrxForCausalLM(cfg), [f"transformer.blocks.{i}.ffn.experts" for i in range(2)]
    if family == "deepseek_v4":  # its experts' and shared experts' SwiGLU clamped before the activation, biting
        cfg = tr.DeepseekV4Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                  max_position_embeddings=64, swiglu_limit=0.05, mlp_layer_types=["moe", "moe"],
                                  use_cache=False)
        return tr.DeepseekV4ForCausalLM(cfg), [u for i in range(2) for u in (
            experts[i], f"model.layers.{i}.mlp.shared_experts")]
    # Aria's experts keep their weights transposed (is_transposed): fused on the transposed views
    cfg = tr.AriaTextConfig(intermediate_size=24, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, **common)
    shared = [f"model.layers.{i}.mlp.shared_experts" for i in range(2)]
    model = tr.AriaTextForCausalLM(cfg)
    if "is_transposed" not in model.model.layers[0].mlp.experts.__dict__:
        pytest.skip(f"transformers {tr.__version__}'s Aria experts predate its experts interface (a forward "
                    "of router logits of their own): nothing of the kind to fuse")
    return model, [u for pair in zip(experts, shared) for u in pair]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe", "aria", "jetmoe", "llama4", "longcat", "dbrx"])
def test_convert_moe_models(family):
    """Every experts module becomes one fused unit (found by what transformers' experts decorator
    sets, not by class name); the state_dict keys stay; loss and every gradient match the original;
    the bytes kept equal checkpointing the same units'; blocks and budgets plan as for dense models."""
    model, units = _moe_model(family)
    model.train()
    ids = torch.randint(0, 64, (2, 12))
    conv = fusedrc.convert(model, example_inputs=(ids,))
    plan = conv.fusedrc_plan
    assert fused_without_norms(plan) == units and not plan.skipped
    assert all(u.kind == "moe_experts" for u in plan.units if u.name.endswith(".experts"))
    assert list(conv.state_dict()) == list(model.state_dict())
    assert plan.final_bytes < 0.7 * plan.baseline_bytes
    assert plan.final_bytes <= saved_bytes(_set_impl(copy.deepcopy(conv), "checkpoint"), (ids,))
    la, lb = model(ids, labels=ids).loss, conv(ids, labels=ids).loss
    assert abs(la.item() - lb.item()) < 1e-5
    la.backward()
    lb.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), conv.named_parameters()):
        if p.grad is not None:
            assert (q.grad - p.grad).norm() <= 1e-4 * p.grad.norm() + 1e-7, name
    budget = fusedrc.convert(model, memory_budget=0.3, example_inputs=(ids,)).fusedrc_plan
    assert budget.final_bytes <= budget.target_bytes
    # the experts' recompute FLOPs too; the norms rerun no GEMM
    assert all((u.cost > 0) == (u.kind != "norm") for u in budget.units)
    if family in ("mixtral", "jetmoe"):  # its backward reruns the gate and up projections: 2 of the experts' 3 GEMMs
        S = 2 * ids.numel()  # routed tokens: top-2
        layer = model.model.layers[0].mlp
        _, two_i, K = layer.experts.gate_up_proj.shape if family == "mixtral" else layer.input_linear.weight.shape
        assert [u.cost for u in budget.units if u.kind != "norm"] == [2 * S * two_i * K] * 2
        # a layer's block reruns the experts' 3 GEMMs (and the attention's)
        assert all(b.cost > 2 * S * two_i * K + 2 * S * K * two_i // 2 for b in budget.blocks)
    if family == "llama4":  # every expert sees every token: the gate and up bmm of E * tokens rows
        E, K, two_i = model.model.layers[0].feed_forward.experts.gate_up_proj.shape
        assert [u.cost for u in budget.units if u.kind == "moe_experts"] == [2 * E * ids.numel() * K * two_i] * 2


def test_convert_ungated_experts_module():
    """Nemotron-H's experts (``has_gate=False``: up_proj then squared ReLU then down_proj) become one
    fused unit; outputs and gradients (routing weights' included) as the original's."""
    tr = _transformers()
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    cfg = tr.NemotronHConfig(hidden_size=32, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = NemotronHExperts(cfg)
            for p in self.experts.parameters():
                torch.nn.init.normal_(p, std=0.2)

        def forward(self, h, idx, w):
            return self.experts(h, idx, w)

    model = Holder()
    conv = fusedrc.convert(model)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("experts", "moe_experts")]
    idx, w = _routing(9, 2, 4, repeat=True)
    h = torch.randn(9, 32)
    args = [(h.clone().requires_grad_(), idx, w.float().requires_grad_()) for _ in range(2)]
    ya, yb = model(*args[0]), conv(*args[1])
    assert rel_err(yb, ya) < 1e-5
    ya.square().sum().backward()
    yb.square().sum().backward()
    for a, b in zip(args[0], args[1]):
        if a.is_floating_point():
            assert rel_err(b.grad, a.grad) < 1e-5
    for p, q in zip(model.parameters(), conv.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-5


def test_convert_moe_follows_the_modules_and_reports_what_it_leaves():
    """The experts interface chosen in the config does not matter (the fused call computes the same
    function); hooks or an activation swapped in later run the module as it is; experts with their
    own gating are reported, not fused."""
    tr = _transformers()
    model, _ = _moe_model("mixtral")
    model.train()
    ids = torch.randint(0, 64, (2, 10))
    eager = copy.deepcopy(model)
    eager.config._experts_implementation = "eager"
    conv = fusedrc.convert(eager)
    assert rel_err(conv(ids).logits, model(ids).logits) < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):  # hidden_states' dtype out, as transformers' experts
        assert conv(ids).logits.dtype == model(ids).logits.dtype
        hs = torch.randn(5, 32)
        route = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]]), torch.rand(5, 2)
        assert conv.model.layers[1].mlp.experts(hs, *route).dtype == torch.float32
    experts = conv.model.layers[0].mlp.experts
    calls = []
    handle = experts.register_forward_hook(lambda *a: calls.append(1))
    with fusedrc.use_backend("reference"), _OpCount() as ops:
        conv(ids)
    assert calls and ops.count == 1  # layer 0 ran plainly (hooked), layer 1 fused
    handle.remove()
    experts.act_fn = torch.nn.Tanh()  # no fused form: the module as it now is
    with _OpCount() as ops:
        y = conv(ids).logits
    assert ops.count == 1
    assert torch.isfinite(y).all()

    gated = copy.deepcopy(model)
    cls = type(gated.model.layers[0].mlp.experts)
    sub = type("CustomGateExperts", (cls,), {"_apply_gate": lambda self, gu: TF.silu(gu[..., ::2]) * gu[..., 1::2]})
    gated.model.layers[0].mlp.experts.__class__ = sub
    with pytest.warns(UserWarning, match="gates its experts its own way"):
        plan = fusedrc.convert(gated).fusedrc_plan
    assert fused_without_norms(plan) == ["model.layers.1.mlp.experts"]
    assert plan.skipped == [("model.layers.0.mlp.experts",
                             "CustomGateExperts gates its experts its own way (not act(gate) * up on the halves "
                             "of gate_up_proj)")]


def _grads_match(a, b, tol=1e-5):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert rel_err(q.grad, p.grad) < tol, name


def _converted_experts(experts, backend, T=10, k=2):
    """``experts`` (hidden 32, 4 experts) with every parameter drawn anew, converted into one fused experts unit, both
    on the backend's device; and a call for them: (hidden_states, top-k choices, fp32 routing weights)."""
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    conv = fusedrc.convert(experts)
    assert [u.kind for u in conv.fusedrc_plan.units] == ["moe_experts"]
    device = backend_device(backend)
    experts.to(device), conv.to(device)
    idx, w = _routing(T, k, 4)
    return conv, (torch.randn(T, 32, device=device), idx.to(device), w.float().to(device))


def _compare_experts(experts, conv, call, backend):
    """One step of the original and the converted experts on the same call: their output, input gradient and every
    parameter's gradient the same; returns how many fused experts calls ran."""
    x, idx, w = call
    for m in (experts, conv):
        m.zero_grad()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with fusedrc.use_backend(backend), _OpCount() as ops:
        ya, yb = experts(xa, idx, w), conv(xb, idx, w)
        ya.square().sum().backward()
        yb.square().sum().backward()
    assert rel_err(yb, ya) < 1e-5 and rel_err(xb.grad, xa.grad) < 1e-5
    _grads_match(experts, conv)
    return ops.count


@pytest.mark.parametrize("backend", BACKENDS)
def test_convert_gpt_oss_experts(backend):
    """gpt-oss's experts (weights stored transposed, gate and up rows interleaved, biases on both projections,
    its clamped gate with alpha and an up offset of 1, its own argument names): one fused experts call per
    layer, the model's output and every gradient the original's; a keyword call by its own names fuses too, one
    by the experts interface's names runs the module's forward."""
    tr = _transformers()
    if not hasattr(tr, "GptOssConfig"):
        pytest.skip(f"transformers {tr.__version__} has no gpt-oss")
    cfg = tr.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64, use_cache=False, swiglu_limit=1.0,
                          layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    torch.manual_seed(0)
    model = tr.GptOssForCausalLM(cfg).train()
    for n, p in model.named_parameters():
        if "experts" in n or "router" in n:  # gpt-oss initializes biases to 0: nonzero ones are checked
            nn.init.normal_(p, std=0.3)
    device = backend_device(backend)
    model.to(device)
    conv = fusedrc.convert(model)
    units = {u.name: u.kind for u in conv.fusedrc_plan.units}
    assert units["model.layers.0.mlp.experts"] == units["model.layers.1.mlp.experts"] == "moe_experts"
    ids = torch.randint(0, 64, (2, 10), device=device)
    with fusedrc.use_backend(backend), _OpCount() as ops:
        ya, yb = model(ids).logits, conv(ids).logits
        ya.square().mean().backward()
        yb.square().mean().backward()
    assert ops.count == 2 and rel_err(yb, ya) < 1e-5
    _grads_match(model, conv)
    experts, plain = conv.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts
    hs, idx, w = torch.randn(6, 32, device=device), *(t.to(device) for t in _routing(6, 2, 4))
    with fusedrc.use_backend(backend), _OpCount() as ops:
        got = experts(hs, router_indices=idx, routing_weights=w.float())
    assert ops.count == 1 and rel_err(got, plain(hs, idx, w.float())) < 1e-5
    with fusedrc.use_backend(backend), _OpCount() as ops:  # transformers' implementations take these names
        got = experts(hs, top_k_index=idx, top_k_weights=w.float())
    assert ops.count == 0 and rel_err(got, plain(hs, idx, w.float())) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_convert_expert_parallel_sentinels(backend):
    """Experts flagged expert-parallel (transformers' ``MoEParamShard``: ``num_experts`` this rank's count, other
    ranks' experts as ids at or past it): one fused call skipping those choices, output and every gradient as
    transformers' batched_mm implementation's, which masks them (no output, no routing weight gradient)."""
    model, _ = _moe_model("mixtral")
    experts = model.model.layers[0].mlp.experts
    if "_is_expert_parallel" not in experts.__dict__:
        pytest.skip("this transformers has no expert parallelism flag")
    model.config._experts_implementation = "batched_mm"
    conv = fusedrc.convert(experts)
    device = backend_device(backend)
    experts.to(device), conv.to(device)
    experts._is_expert_parallel = conv._is_expert_parallel = True
    x = torch.randn(8, 32, device=device)
    idx, w = _routing(8, 2, 4)
    idx[0, 0], idx[3, 1], idx[5] = 4, 6, torch.tensor([4, 5])  # other ranks' experts; token 5 runs none here
    idx, w = idx.to(device), w.float().to(device)
    xa, xb, wa, wb = x.clone().requires_grad_(), x.clone().requires_grad_(), w.clone().requires_grad_(), \
        w.clone().requires_grad_()
    with fusedrc.use_backend(backend), _OpCount() as ops:
        ya, yb = experts(xa, idx, wa), conv(xb, idx, wb)
        ya.square().sum().backward()
        yb.square().sum().backward()
    assert ops.count == 1 and rel_err(yb, ya) < 1e-5 and float(yb[5].detach().abs().max()) == 0
    assert rel_err(xb.grad, xa.grad) < 1e-5 and rel_err(wb.grad, wa.grad) < 1e-5
    assert float(wb.grad[idx >= 4].abs().max()) == 0
    _grads_match(experts, conv)


def test_convert_beam_fp32_gates():
    """Beam's experts and dense MLP evaluate the SwiGLU product in fp32 and round it once, as the kernels do: its
    experts one fused call, its dense MLP one fused gated FFN; output and every gradient the original's."""
    tr = _transformers()
    if not hasattr(tr, "BeamConfig"):
        pytest.skip(f"transformers {tr.__version__} has no Beam")
    cfg = tr.BeamConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, moe_intermediate_size=24, num_experts=4,
                        num_experts_per_tok=2, n_group=2, topk_group=1, max_position_embeddings=64, use_cache=False,
                        mlp_layer_types=["dense", "sparse"])
    torch.manual_seed(0)
    model = tr.BeamForCausalLM(cfg).train()
    for n, p in model.named_parameters():
        if "experts" in n:
            nn.init.normal_(p, std=0.3)
    conv = fusedrc.convert(model)
    units = {u.name: u.kind for u in conv.fusedrc_plan.units}
    assert units["model.layers.0.mlp"] == "norm_gated_ffn"  # with the RMSNorm before it
    assert units["model.layers.1.mlp.experts"] == "moe_experts"
    ids = torch.randint(0, 64, (2, 10))
    with _OpCount() as ops, FusedOpLog(calls := []):
        ya, yb = model(ids).logits, conv(ids).logits
        ya.square().mean().backward()
        yb.square().mean().backward()
    assert ops.count == 1 and any(c.startswith("gated_mlp") for c in calls) and rel_err(yb, ya) < 1e-5
    _grads_match(model, conv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_convert_inkling2_softcapped_experts(backend):
    """Inkling2's experts (``act_fn(gate, up)``: ``s_g tanh(g / s_g) * sigmoid(g) * s_u tanh(u / s_u)`` in fp32): one
    fused call with the softcaps, output and every gradient the original's; a cap changed after convert is read
    at each call; one that is no number > 0, or another gate module put in, runs the module's forward."""
    _transformers()
    try:
        from transformers.models.inkling2 import configuration_inkling2 as C
        from transformers.models.inkling2 import modeling_inkling2 as M
    except ImportError:
        pytest.skip("this transformers has no Inkling2")
    cfg = C.Inkling2TextConfig(hidden_size=32, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                               mlp_gate_softcap=0.5, mlp_up_softcap=0.4)
    torch.manual_seed(0)
    experts = M.Inkling2Experts(cfg)
    conv, call = _converted_experts(experts, backend)
    for cap in (0.5, 3.0):
        experts.act_fn.gate_softcap.softcap = conv.act_fn.gate_softcap.softcap = cap
        assert _compare_experts(experts, conv, call, backend) == 1
    conv.act_fn.gate_softcap.softcap = 0.0  # tanh(g / 0): the module's own forward (NaNs), not the op
    with _OpCount() as ops:
        conv(*call)
    assert ops.count == 0
    conv.act_fn.gate_softcap.softcap = 0.5
    conv.act_fn.up_softcap = M.Inkling2Softcap(0.4).to(call[0].device)  # another module: the original forward
    with _OpCount() as ops:
        conv(*call)
    assert ops.count == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_convert_inkling_shared_experts(backend):
    """Inkling's shared experts (every token through each of the stacked gated FFNs, weighted by the router's
    gammas, bmm's in the original): one fused experts call choosing every expert for every token; output, input,
    gammas and weight gradients the original's; a call by keyword fuses too, hooks or other arguments run the
    module's forward; the whole MoE layer has two units, its routed and its shared experts."""
    _transformers()
    try:
        from transformers.models.inkling import configuration_inkling as C
        from transformers.models.inkling import modeling_inkling as M
    except ImportError:
        pytest.skip("this transformers has no Inkling")
    cfg = C.InklingTextConfig(hidden_size=32, moe_intermediate_size=24, n_shared_experts=3)
    torch.manual_seed(0)
    experts = M.InklingSharedExperts(cfg)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    conv = fusedrc.convert(experts)
    assert [u.kind for u in conv.fusedrc_plan.units] == ["moe_experts"], conv.fusedrc_plan
    device = backend_device(backend)
    experts.to(device), conv.to(device)
    x, g = torch.randn(2, 5, 32, device=device), torch.rand(2, 5, 3, device=device)
    for call in (lambda m, x, g: m(x, g), lambda m, x, g: m(hidden_states=x, gammas=g)):
        for m in (experts, conv):
            m.zero_grad()
        leaves = [[t.clone().requires_grad_() for t in (x, g)] for _ in range(2)]
        with fusedrc.use_backend(backend), _OpCount() as ops:
            ya, yb = call(experts, *leaves[0]), call(conv, *leaves[1])
            ya.square().sum().backward()
            yb.square().sum().backward()
        assert ops.count == 1 and yb.shape == ya.shape == x.shape
        assert rel_err(yb, ya) < 1e-5
        for a, b in zip(leaves[0], leaves[1]):
            assert rel_err(b.grad, a.grad) < 1e-5
        _grads_match(experts, conv)
    handle = conv.act_fn.register_forward_hook(lambda *a: None)
    with _OpCount() as ops:
        conv(x, g)
    assert ops.count == 0
    handle.remove()
    with pytest.raises(TypeError):
        conv(x, g, 1)  # no such call: the module's own forward says so
    moe = M.InklingMoE(C.InklingTextConfig(hidden_size=32, moe_intermediate_size=24, n_shared_experts=2,
                                          n_routed_experts=4, num_experts_per_tok=2))
    assert sorted(fusedrc.convert(moe).fusedrc_plan.fused) == ["experts", "shared_experts"]


def test_convert_reports_experts_with_a_forward_of_their_own():
    """An experts class overriding the interface's forward (Ergo's: every route its own row, a norm after each
    expert) is reported and left, not fused as its parent's layout says."""
    _transformers()
    try:
        from transformers.models.ergo import configuration_ergo as C
        from transformers.models.ergo import modeling_ergo as M
    except ImportError:
        pytest.skip("this transformers has no Ergo")
    experts = M.ErgoExperts(C.ErgoConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4))
    plan = fusedrc.convert(experts).fusedrc_plan
    assert not plan.units
    assert [r for _, r in plan.skipped] == ["ErgoExperts.forward is its own, not transformers' experts interface "
                                            "(the experts computed some other way): no fused form"]


def test_convert_openai_privacy_filter_experts():
    """The OpenAI privacy filter's experts (gpt-oss's with the gate and up projections in halves, its eager
    forward in fp32): one fused call, output and every gradient the original's in fp32; the biases' dtype
    differing from the states' (no autocast) runs the module's forward."""
    _transformers()
    try:
        from transformers.models.openai_privacy_filter import configuration_openai_privacy_filter as C
        from transformers.models.openai_privacy_filter import modeling_openai_privacy_filter as M
    except ImportError:
        pytest.skip("this transformers has no OpenAI privacy filter")
    cfg = C.OpenAIPrivacyFilterConfig(hidden_size=32, intermediate_size=24, num_local_experts=4,
                                      num_experts_per_tok=2, swiglu_limit=0.8)
    torch.manual_seed(0)
    experts = M.OpenAIPrivacyFilterExperts(cfg)
    conv, call = _converted_experts(experts, "reference")
    assert _compare_experts(experts, conv, call, "reference") == 1
    conv.down_proj_bias.data = conv.down_proj_bias.data.double()
    with _OpCount() as ops:
        conv(*call)
    assert ops.count == 0


class _OpCount:
    """Counts fused experts calls (the op's plain-eager Function or the custom op)."""

    def __enter__(self):
        from fusedrc import functional

        self.count, self._orig = 0, functional.ops.pick

        def pick(name, x, backend):
            if name == "moe_experts":
                self.count += 1
            return self._orig(name, x, backend)

        functional.ops.pick = pick
        return self

    def __exit__(self, *exc):
        from fusedrc import functional

        functional.ops.pick = self._orig


def _triton_step(model):
    """``model`` converted, one training step of both on the Triton backend (the interpreter on the CPU):
    two fused experts calls, loss and every gradient as the original's. Returns (converted, device)."""
    model.train()
    device = backend_device("triton")
    model.to(device)
    ids = torch.randint(0, 64, (2, 8), device=device)
    conv = fusedrc.convert(model)
    la = model(ids, labels=ids).loss
    with fusedrc.use_backend("triton"), _OpCount() as ops:
        lb = conv(ids, labels=ids).loss
    assert ops.count == 2
    la.backward()
    with fusedrc.use_backend("triton"):
        lb.backward()
    assert abs(la.item() - lb.item()) < 1e-5
    for (name, p), (_, q) in zip(model.named_parameters(), conv.named_parameters()):
        if p.grad is not None:
            assert (q.grad - p.grad).norm() <= 1e-4 * p.grad.norm() + 1e-7, name
    return conv, device


def test_convert_mixtral_on_the_triton_backend():
    """A converted Mixtral's experts through the Triton kernels (the interpreter on the CPU): loss and
    every gradient as the original's."""
    _triton_step(_moe_model("mixtral")[0])


def test_convert_jetmoe_moe_layer():
    """JetMoE's MoE layer on the Triton backend (the interpreter on the CPU): one experts call a layer on the
    router's choices laid back out per token, loss and every gradient (the router's and the output bias's
    too) as the original's; a layer with a hook, or with 2-D input, runs its own forward; a router of
    another kind and an activation with no fused form are reported."""
    model, _ = _moe_model("jetmoe")
    conv, device = _triton_step(model)
    layer, fused = model.model.layers[0].mlp, conv.model.layers[0].mlp
    x = torch.randn(2, 5, 32, device=device)
    handle = fused.register_forward_hook(lambda *a: None)
    with _OpCount() as ops:
        assert rel_err(fused(x), layer(x)) < 1e-6
    handle.remove()
    assert ops.count == 0
    with pytest.raises(ValueError):  # as the original: it unpacks three sizes
        fused(x[0])

    other = copy.deepcopy(layer)
    other.router.__class__ = type("TopKRouter", (type(layer.router),), {})
    with pytest.warns(UserWarning, match="no pattern found"):
        plan = fusedrc.convert(other).fusedrc_plan
    assert "is not JetMoE's top-k gating" in dict(plan.skipped)[""]
    other = copy.deepcopy(layer)
    other.activation = nn.Tanh()
    with pytest.warns(UserWarning, match="no pattern found"):
        plan = fusedrc.convert(other).fusedrc_plan
    assert "activation Tanh has no fused form" in dict(plan.skipped)[""]


def test_convert_llama4_experts():
    """Llama 4's bmm experts on the Triton backend (the interpreter on the CPU): one experts call a layer,
    loss and every gradient as the original's; under bf16 autocast the output's dtype is the original's
    (bmm's) and agrees to bf16's rounding; a hook, or rows that do not split evenly over the experts,
    run the original forward; another forward or an activation with no fused form is reported."""
    model, _ = _moe_model("llama4")
    conv, device = _triton_step(model)
    experts, fused = model.model.layers[0].feed_forward.experts, conv.model.layers[0].feed_forward.experts
    assert type(fused).__name__ == "FusedLlama4TextExperts"
    x = torch.randn(4 * 5, 32, device=device)
    for cast, tol in ((False, 1e-5), (True, 2e-2)):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cast), _OpCount() as ops:
            ya, yb = experts(x), fused(x)
        assert ops.count == 1 and yb.dtype == ya.dtype and rel_err(yb, ya) < tol
    handle = fused.register_forward_hook(lambda *a: None)
    with _OpCount() as ops:
        assert rel_err(fused(x), experts(x)) < 1e-6
    handle.remove()
    assert ops.count == 0
    with pytest.raises(RuntimeError):  # as the original: 21 rows do not view as (4, -1, 32)
        fused(torch.randn(21, 32, device=device))

    other = copy.deepcopy(experts)
    other.act_fn = nn.Tanh()
    with pytest.warns(UserWarning, match="no pattern found"):
        plan = fusedrc.convert(other).fusedrc_plan
    assert "activation Tanh has no fused form" in dict(plan.skipped)[""]
    other = copy.deepcopy(experts)
    other.__class__ = type("Llama4TextExperts", (nn.Module,), {"forward": lambda self, h: h})
    with pytest.warns(UserWarning, match="no pattern found"):
        plan = fusedrc.convert(other).fusedrc_plan
    assert "forward is not Llama 4's bmm experts" in dict(plan.skipped)[""]


def _assert_reported(module, change, reason):
    """A copy of ``module`` that ``change`` alters converts to nothing, with ``reason`` in the plan."""
    other = copy.deepcopy(module)
    change(other)
    with pytest.warns(UserWarning, match="no pattern found"):
        plan = fusedrc.convert(other).fusedrc_plan
    assert reason in dict(plan.skipped)[""]


def test_convert_longcat_flash_experts():
    """LongCat-Flash's experts with identity ("zero") experts on the Triton backend (the interpreter on the
    CPU): one experts call a layer, the zero experts' choices skipped by the op and added as weight * x (a
    token routed to zero experts alone too); output and every gradient the original's; FLOPs of the routed
    choices alone; bf16 autocast as the original; a hook on its identity expert runs the original forward;
    another forward, an activation with no fused form or no routed experts are reported."""
    from fusedrc.convert import _looks_experts

    model, _ = _moe_model("longcat")
    conv, device = _triton_step(model)
    experts, fused = model.model.layers[0].mlp.experts, conv.model.layers[0].mlp.experts
    if _looks_experts(experts):
        _check_longcat_interface_experts(model, conv, device)
        return
    assert type(fused).__name__ == "FusedLongcatFlashExperts"
    x = torch.randn(6, 32, device=device)
    idx = torch.tensor([[0, 4], [5, 4], [3, 1], [5, 2], [1, 0], [4, 3]], device=device)  # token 1: zero experts only
    w = torch.rand(6, 2, device=device)
    inputs = [(x.clone().requires_grad_(), w.clone().requires_grad_()) for _ in range(2)]
    with fusedrc.use_backend("triton"), _OpCount() as ops:
        ya, yb = experts(inputs[0][0], idx, inputs[0][1]), fused(inputs[1][0], idx, inputs[1][1])
    assert ops.count == 1 and rel_err(yb, ya) < 1e-6
    assert torch.allclose(yb[1], x[1] * w[1].sum())
    for m in (experts, fused):
        m.zero_grad()
    g = torch.randn_like(ya)
    ya.backward(g)
    with fusedrc.use_backend("triton"):
        yb.backward(g)
    for a, b, name in ((*(t.grad for t, _ in inputs), "x"), (*(t.grad for _, t in inputs), "weights"),
                       (experts.gate_up_proj.grad, fused.gate_up_proj.grad, "gate_up_proj"),
                       (experts.down_proj.grad, fused.down_proj.grad, "down_proj")):
        assert rel_err(b, a) < 1e-5, name
    assert not fused.gate_up_proj.grad[4:].any()  # the zero experts' unused entries
    # the unit's cost: the gate and up projections of the 7 routed choices
    two_i, K = fused.gate_up_proj.shape[1:]
    assert fused._fusedrc_flops((x, idx, w), {})[1] == 2 * 7 * two_i * K
    with torch.autocast(device.type, dtype=torch.bfloat16), _OpCount() as ops:
        ya, yb = experts(x, idx, w), fused(x, idx, w)
    assert ops.count == 1 and yb.dtype == ya.dtype and rel_err(yb, ya) < 2e-2
    assert fused(x[:0], idx[:0], w[:0]).shape == (0, 32)
    for bad in (6, -1):  # past the zero experts, negative: the original's one_hot raises, so does the module's
        with pytest.raises(RuntimeError):
            experts(x, torch.where(idx == 2, bad, idx), w)
        with pytest.raises(RuntimeError):
            fused(x, torch.where(idx == 2, bad, idx), w)
    handle = fused.identity_expert.register_forward_hook(lambda *a: None)
    with _OpCount() as ops:
        assert rel_err(fused(x, idx, w), experts(x, idx, w)) < 1e-6
    handle.remove()
    assert ops.count == 0

    for change, reason in ((lambda m: setattr(m, "act_fn", nn.Tanh()), "activation Tanh has no fused form"),
                           (lambda m: setattr(m, "num_routed_experts", 0), "no routed experts"),
                           (lambda m: setattr(m, "__class__", type("LongcatFlashExperts", (nn.Module,), {
                               "forward": lambda self, h, i, w: h})), "is not LongCat-Flash's experts loop")):
        _assert_reported(experts, change, reason)


def _check_longcat_interface_experts(model, conv, device):
    """transformers 5.25's LongCat-Flash: its experts under transformers' experts interface, the identity
    ("zero") experts routed around them by its MoE layer (their choices in-range indices of weight 0): the
    generic rule's fused experts, the layer's output and every gradient the original's, a token routed to zero
    experts alone too."""
    layer, fused_layer = model.model.layers[0].mlp, conv.model.layers[0].mlp
    assert type(fused_layer.experts).__name__ == "FusedExperts"
    x = torch.randn(6, 32, device=device)
    idx = torch.tensor([[0, 4], [5, 4], [3, 1], [5, 2], [1, 0], [4, 3]], device=device)  # token 1: zero experts only
    w = torch.rand(6, 2, device=device)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    route = lambda h: (None, w, idx)  # noqa: E731 (the router's (scores, weights, indices))
    for m in (layer, fused_layer):
        m.router.forward = route
        m.zero_grad()
    try:
        ya = layer(xs[0])
        with fusedrc.use_backend("triton"), _OpCount() as ops:
            yb = fused_layer(xs[1])
        assert ops.count == 1 and rel_err(yb, ya) < 1e-6
        g = torch.randn_like(ya)
        ya.backward(g)
        with fusedrc.use_backend("triton"):
            yb.backward(g)
    finally:
        for m in (layer, fused_layer):
            del m.router.forward
    assert rel_err(xs[1].grad, xs[0].grad) < 1e-5
    for name in ("gate_up_proj", "down_proj"):
        a, b = getattr(layer.experts, name).grad, getattr(fused_layer.experts, name).grad
        assert rel_err(b, a) < 1e-5, name


def test_convert_dbrx_experts():
    """DBRX's experts on the Triton backend (the interpreter on the CPU): one experts call a layer on views of
    its w1/v1/w2 stacks, loss and every gradient as the original's; an index past the experts raises, as in the
    original; FLOPs of the gate and up GEMMs; bf16 autocast as the original;
    a hook on its mlp runs the original forward; another expert forward or activation is reported."""
    model, _ = _moe_model("dbrx")
    conv, device = _triton_step(model)
    experts, fused = model.transformer.blocks[0].ffn.experts, conv.transformer.blocks[0].ffn.experts
    assert type(fused).__name__ == "FusedDbrxExperts"
    x = torch.randn(2, 3, 32, device=device)
    idx = torch.tensor([[0, 1], [2, 1], [3, 0], [1, 2], [0, 3], [2, 3]], device=device)
    w = torch.rand(6, 2, device=device)
    with fusedrc.use_backend("triton"), _OpCount() as ops:
        ya, yb = experts(x, idx, w), fused(x, idx, w)
    assert ops.count == 1 and yb.shape == ya.shape == (2, 3, 32) and rel_err(yb, ya) < 1e-6
    for m, error in ((experts, IndexError), (fused, ValueError)):
        with pytest.raises(error):
            m(x, torch.where(idx == 3, 4, idx), w)
    assert fused._fusedrc_flops((x, idx, w), {})[1] == 2 * 12 * 2 * 24 * 32
    with torch.autocast(device.type, dtype=torch.bfloat16), _OpCount() as ops:
        ya, yb = experts(x, idx, w), fused(x, idx, w)
    assert ops.count == 1 and yb.dtype == ya.dtype and rel_err(yb, ya) < 2e-2
    handle = fused.mlp.register_forward_hook(lambda *a: None)
    with _OpCount() as ops:
        assert rel_err(fused(x, idx, w), experts(x, idx, w)) < 1e-6
    handle.remove()
    assert ops.count == 0
    for change, reason in ((lambda m: setattr(m.mlp, "activation_fn", nn.Tanh()), "activation Tanh has no fused form"),
                           (lambda m: setattr(m.mlp, "__class__", type("DbrxExpertGLU", (nn.Module,), {
                               "forward": lambda self, x, w1, v1, w2: x})), "is not DBRX's gated expert")):
        _assert_reported(experts, change, reason)


def test_convert_step3p7_clamped_swiglu():
    """Step-3.7 (its text model: a dense layer, then MoE layers with a shared expert): its SwiGLU clamp after the
    activation, off (limit +inf, its config's 0) or on (a limit that bites), runs in the fused ops
    (``limit_after_act``): loss and every gradient as the original's; a limit changed after convert is read at each
    call; a limit that is no number > 0 runs the module's own forward."""
    tr = _transformers()
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

    torch.manual_seed(0)
    cfg = tr.Step3p7TextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=48, moe_intermediate_size=24,
                               n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
                               mlp_layer_types=["dense", "sparse", "sparse"], share_expert_dim=40,
                               swiglu_limits=[0, 0, 0.05], swiglu_limits_shared=[0, 0, 0.05], use_cache=False)
    model = Step3p7TextModel(cfg).train()
    conv = fusedrc.convert(model)
    plan = conv.fusedrc_plan
    assert [(u.name, u.kind) for u in plan.units if u.kind != "norm"] == [
        ("layers.0.mlp", "norm_gated_ffn"), ("layers.1.mlp.experts", "moe_experts"),
        ("layers.1.mlp.shared_experts", "gated_ffn"), ("layers.2.mlp.experts", "moe_experts"),
        ("layers.2.mlp.shared_experts", "gated_ffn")] and not plan.skipped
    ids = torch.randint(0, 64, (2, 12))
    for step in range(2):  # the second with the limits of layer 1 changed after convert (one that bites)
        with _OpCount() as ops:
            yb = conv(ids).last_hidden_state
        ya = model(ids).last_hidden_state
        assert ops.count == 2 and rel_err(yb, ya) < 1e-5
        model.zero_grad(), conv.zero_grad()
        ya.square().sum().backward()
        yb.square().sum().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), conv.named_parameters()):
            if p.grad is not None:
                assert (q.grad - p.grad).norm() <= 1e-4 * p.grad.norm() + 1e-7, name
        for layer in (model, conv):
            layer.layers[1].mlp.experts.limit = layer.layers[1].mlp.shared_experts.limit = 0.02
    for layer in (model, conv):  # no number > 0: the modules as they are
        layer.layers[1].mlp.experts.limit = 0
    with _OpCount() as ops, torch.no_grad():
        yb, ya = conv(ids).last_hidden_state, model(ids).last_hidden_state
    assert ops.count == 1 and rel_err(yb, ya) < 1e-5
    h, w = torch.randn(5, 32), torch.rand(5, 2)
    original, converted = model.layers[2].mlp.experts, conv.layers[2].mlp.experts
    for index in (-1, 5):  # where the original raises (5.24's one_hot(num_classes=E + 1)) so does the converted
        idx = torch.tensor([[0, 1], [2, index], [3, 0], [1, 4], [2, 3]])  # module; where it does not (5.25's
        try:                                          # experts interface, grouped_mm: its output there undefined)
            original(h, idx, w)                       # the converted module runs the original's forward
        except RuntimeError:
            with pytest.raises(RuntimeError):
                converted(h, idx, w)
        else:
            with _OpCount() as ops:
                converted(h, idx, w)
            assert ops.count == 0, index
    other = copy.deepcopy(model.layers[1].mlp.experts)
    other.act_fn = nn.Tanh()
    with pytest.warns(UserWarning, match="no pattern found"):
        assert "activation Tanh has no fused form" in dict(fusedrc.convert(other).fusedrc_plan.skipped)[""]


@pytest.mark.parametrize("family", ["deepseek_v4", "hy_v4"])
def test_convert_swiglu_clamped_before_the_activation(family):
    """DeepSeek-V4's and HY-V4's SwiGLU clamps before the activation (experts under transformers' experts interface
    with their own ``_apply_gate``: ``self.act_fn`` or ``F.silu``; DeepSeek-V4's shared MLP; a limit that bites)
    run in the fused ops: loss and every gradient as the original's, bytes no more than checkpoint's on the same
    units; a limit changed after convert is read at each call."""
    tr = _transformers()
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
                  num_experts_per_tok=2, max_position_embeddings=64, swiglu_limit=0.05, use_cache=False)
    if family == "deepseek_v4":
        model = tr.DeepseekV4ForCausalLM(tr.DeepseekV4Config(num_local_experts=4, mlp_layer_types=["moe", "moe"],
                                                             **common))
        units = [u for i in range(2) for u in (f"model.layers.{i}.mlp.experts", f"model.layers.{i}.mlp.shared_experts")]
    else:  # a dense first layer (its MLP unclamped), then experts gating with F.silu and a shared MLP
        model = tr.HYV4ForCausalLM(tr.HYV4Config(moe_intermediate_size=16, n_routed_experts=4, pad_token_id=0,
                                                 **common))
        units = ["model.layers.0.mlp", "model.layers.1.mlp.experts", "model.layers.1.mlp.shared_experts"]
    model.train()
    ids = torch.randint(0, 64, (2, 12))
    conv = fusedrc.convert(model, example_inputs=(ids,))
    plan = conv.fusedrc_plan
    assert fused_without_norms(plan) == units and not plan.skipped
    assert plan.final_bytes <= saved_bytes(_set_impl(copy.deepcopy(conv), "checkpoint"), (ids,))
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    for step in range(2):  # the second with the experts' limits changed after convert
        model.zero_grad(), conv.zero_grad()
        with _OpCount() as ops:
            lb = conv(ids, labels=ids).loss
        la = model(ids, labels=ids).loss
        assert ops.count == len(experts) and abs(la.item() - lb.item()) < 1e-5
        la.backward()
        lb.backward()
        for (name, p), (_, q) in zip(model.named_parameters(), conv.named_parameters()):
            if p.grad is not None:
                assert (q.grad - p.grad).norm() <= 1e-4 * p.grad.norm() + 1e-7, name
        for m in [*experts, *(m for m in conv.modules() if type(m).__name__ == "FusedExperts")]:
            setattr(m, "limit" if family == "deepseek_v4" else "swiglu_limit", 0.02)


def test_convert_glm5_next_clamped_mlp_and_experts():
    """GLM-5-Next's MLP (``gate.clamp(min=None, max=L)`` through local variables) and experts (``F.silu``), each
    converted alone: one fused op each, output and every gradient as the original's with a limit that bites."""
    _transformers()
    from transformers.models.glm5_next import modeling_glm5_next as M

    torch.manual_seed(0)
    cfg = M.Glm5NextTextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                               n_routed_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4,
                               swiglu_limit=0.3, pad_token_id=0)
    mlp, experts = M.Glm5NextTextMLP(cfg), M.Glm5NextTextExperts(cfg)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
    x = torch.randn(10, 32)
    idx, w = _routing(10, 2, 4)
    for module, args, kind in ((mlp, (x,), "gated_ffn"), (experts, (x, idx, w.float()), "moe_experts")):
        conv = fusedrc.convert(module)
        assert [u.kind for u in conv.fusedrc_plan.units] == [kind]
        leaves = [[a.clone().requires_grad_() if a.is_floating_point() else a for a in args] for _ in range(2)]
        ya, yb = module(*leaves[0]), conv(*leaves[1])
        assert rel_err(yb, ya) < 1e-5
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert rel_err(leaves[1][0].grad, leaves[0][0].grad) < 1e-5
        for (name, p), q in zip(module.named_parameters(), conv.parameters()):
            assert rel_err(q.grad, p.grad) < 1e-5, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_convert_minimax_m3_experts(backend):
    """MiniMax-M3's experts (``_apply_gate``: the halves clamped, ``(up + 1.0) * (gate * sigmoid(gate * alpha))``;
    on the reference backend a subclass adding 2.5) as one fused experts call with the limit, alpha and offset:
    output and every gradient as the original's; an alpha changed after convert is read at each call; one that is
    no number > 0 runs the module's forward. Its dense MLP (a bias on gate_up_proj) likewise."""
    _transformers()
    from transformers.models.minimax_m3_vl import configuration_minimax_m3_vl as C
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as M

    torch.manual_seed(0)
    cfg = C.MiniMaxM3VLTextConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                  swiglu_limit=0.5)
    class OffsetExperts(M.MiniMaxM3VLExperts):  # another up offset in the same code: read from the source
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            glu = gate * torch.sigmoid(gate * self.swiglu_alpha)
            return (up + 2.5) * glu

    experts = (M.MiniMaxM3VLExperts if backend == "triton" else OffsetExperts)(cfg)
    conv, call = _converted_experts(experts, backend)
    for alpha, fused in ((1.702, 1), (1.0, 1), (0.0, 0)):
        experts.swiglu_alpha = conv.swiglu_alpha = alpha
        assert _compare_experts(experts, conv, call, backend) == fused
    device = backend_device(backend)
    # its dense MLP: one gated FFN on the halves of gate_up_proj, the same gate; a hook runs its forward
    mlp = M.MiniMaxM3VLDenseMLP(cfg, intermediate_size=40)
    mlp.gate_up_proj = nn.Linear(32, 80)  # with a bias: its halves go to the gate and the up projection
    mlp.to(device)
    conv = fusedrc.convert(mlp)
    assert [u.kind for u in conv.fusedrc_plan.units] == ["gated_ffn"]
    x = torch.randn(2, 5, 32, device=device)
    for hooked in (False, True):
        if hooked:
            conv.down_proj.register_forward_hook(lambda *a: None)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        calls = []
        with fusedrc.use_backend(backend), FusedOpLog(calls):
            ya, yb = mlp(xa), conv(xb)
            ya.square().sum().backward()
            yb.square().sum().backward()
        assert bool(calls) != hooked and all(c.startswith("gated_mlp") for c in calls) and rel_err(yb, ya) < 1e-5
        assert rel_err(xb.grad, xa.grad) < 1e-5
        for (name, p), q in zip(mlp.named_parameters(), conv.parameters()):
            assert rel_err(q.grad, p.grad) < 1e-5, name
            p.grad = q.grad = None


def test_jetmoe_top1_and_under_autocast():
    """A top-1 JetMoE layer (one expert a token) converted: output and every gradient the original's in
    fp32; under bf16 autocast the output's dtype is the original's and agrees to bf16's rounding."""
    tr = _transformers()
    torch.manual_seed(0)
    cfg = tr.JetMoeConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                          num_key_value_heads=2, kv_channels=8, num_local_experts=4, num_experts_per_tok=1,
                          max_position_embeddings=64, use_cache=False)
    layer = tr.JetMoeForCausalLM(cfg).model.layers[0].mlp
    nn.init.normal_(layer.bias, std=0.1)
    conv = fusedrc.convert(layer)
    assert [u.kind for u in conv.fusedrc_plan.units] == ["moe_experts"]
    x = torch.randn(2, 7, 32)
    for cast, tol in ((False, 1e-5), (True, 2e-2)):
        for m in (layer, conv):
            m.zero_grad()
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast), _OpCount() as ops:
            ya, yb = layer(xa), conv(xb)
        assert ops.count == 1 and yb.dtype == ya.dtype and rel_err(yb, ya) < tol
        ya.float().square().sum().backward()
        yb.float().square().sum().backward()
        assert rel_err(xb.grad, xa.grad) < 2 * tol
        for (n, p), q in zip(layer.named_parameters(), conv.parameters()):
            assert rel_err(q.grad, p.grad) < 2 * tol, n


def test_converted_mixtral_compiles_without_graph_breaks():
    """torch.compile over a converted Mixtral: no graph break (the experts op opaque, its fake
    implementation giving the layout), the same loss and gradients as the converted model in eager."""
    model, _ = _moe_model("mixtral")
    conv = fusedrc.convert(model.train())
    ids = torch.randint(0, 64, (2, 8))
    torch._dynamo.reset()
    assert torch._dynamo.explain(conv)(ids).graph_break_count == 0
    eager = conv(ids, labels=ids).loss
    grads = torch.autograd.grad(eager, list(conv.parameters()), allow_unused=True)
    torch._dynamo.reset()
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    loss = compiled(ids, labels=ids).loss
    assert torch.allclose(loss, eager, rtol=1e-5, atol=1e-6)
    for g, h in zip(grads, torch.autograd.grad(loss, list(conv.parameters()), allow_unused=True)):
        assert (g is None) == (h is None) and (g is None or torch.allclose(g, h, rtol=1e-4, atol=1e-6))
