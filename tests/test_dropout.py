"""Dropout between the FFN's layers, fused: the mask is regenerated in backward, never stored.

The Triton kernels draw it with Philox from (seed, row, column); ``reference.philox_keep`` is
their oracle. The reference backend draws it with torch's Bernoulli sampler from a generator
seeded with the same seed. Both are checked against float64 autograd through an explicit mask.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedrc
from fusedrc import reference as R
from tests._utils import SavedBytes, backend_device, rel_err

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def _seed_after(s, device=torch.device("cpu")):
    """The seed fused_mlp draws right after ``torch.manual_seed(s)`` (``device``'s generator)."""
    torch.manual_seed(s)
    return torch.randint(0, 2**62, (1,), device=device)


def _mask(backend, seed, rows, cols, p):
    if backend == "triton":
        return R.philox_keep(int(seed), rows, cols, p).double().to(seed.device)
    return (R.dropout_factor(seed, (rows, cols), p, torch.empty(0, device=seed.device)) != 0).double()


def _inputs(M, K, H, N, dtype, bias=True, device=torch.device("cpu")):
    g = torch.Generator().manual_seed(M * 1000 + H)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_()
    return (r(M, K), r(H, K, scale=K ** -0.5), r(H, scale=0.5) if bias else None,
            r(N, H, scale=H ** -0.5), r(N, scale=0.5) if bias else None)


def _run(backend, tensors, act, p, s=1):
    with fusedrc.use_backend(backend):
        torch.manual_seed(s)
        y = fusedrc.functional.fused_mlp(*tensors, activation=act, dropout_p=p)
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, [t for t in tensors if t is not None], g)
    return y, g, grads


_CASES = [
    (torch.float32, "gelu", True, (37, 20, 45, 11), 0.3),   # no size a multiple of a tile or of 4
    (torch.float32, "silu", True, (5, 8, 3, 4), 0.9),
]


@pytest.mark.parametrize("backend,dtype,act,bias,shape,p", [
    *[("reference", *c) for c in _CASES],
    *[("triton", *c) for c in _CASES],
    ("triton", torch.float16, "relu", False, (64, 33, 70, 9), 0.5),  # fp16 GEMMs: the interpreter only on CPU
])
def test_forward_and_gradients_match_an_explicit_mask(backend, dtype, act, bias, shape, p):
    M, K, H, N = shape
    dev = backend_device(backend)
    tensors = _inputs(*shape, dtype, bias, device=dev)
    y, g, grads = _run(backend, tensors, act, p)
    keep = _mask(backend, _seed_after(1, dev), M, H, p)
    d = [t.detach().double().requires_grad_() if t is not None else None for t in tensors]
    a = R.activation_forward(F.linear(d[0], d[1], d[2]), act)
    y_ref = F.linear(a * keep / (1 - p), d[3], d[4])
    refs = torch.autograd.grad(y_ref, [t for t in d if t is not None], g.double())
    assert y.dtype == dtype
    assert rel_err(y, y_ref) < TOL[dtype]
    for name, got, ref in zip(["dx", "dw1", "db1", "dw2", "db2"] if bias else ["dx", "dw1", "dw2"], grads, refs):
        assert rel_err(got, ref) < TOL[dtype], name


@pytest.mark.parametrize("backend,dtype,act,shape,p", [
    ("reference", torch.float32, "gelu_tanh", (37, 20, 45, 11), 0.3),
    ("triton", torch.float32, "gelu_tanh", (37, 20, 45, 11), 0.3),   # no size a multiple of a tile or of 4
    ("triton", torch.float16, "silu", (64, 33, 70, 9), 0.5),
])
def test_gated_ffn_dropout_matches_an_explicit_mask(backend, dtype, act, shape, p):
    """The gated FFN's dropout on its product (T5 v1.1): the same mask function as the FFN's, forward
    and every gradient against float64 autograd through that mask; only x and the seed are kept."""
    M, K, H, N = shape
    dev = backend_device(backend)
    x, wg, bg, wd, bd = _inputs(*shape, dtype, device=dev)
    wu, bu = (t.detach().flip(0).clone().requires_grad_() for t in (wg, bg))
    tensors = (x, wg, bg, wu, bu, wd, bd)
    with fusedrc.use_backend(backend):
        torch.manual_seed(1)
        with SavedBytes() as s:
            y = fusedrc.functional.gated_mlp(*tensors, activation=act, dropout_p=p)
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, tensors, g)
    # x and the parameters (plain tensors here, so counted) and the 8-byte seed: no mask, no hidden tensor
    assert s.bytes == sum(t.numel() * t.element_size() for t in tensors) + 8
    keep = _mask(backend, _seed_after(1, dev), M, H, p)
    d = [t.detach().double().requires_grad_() for t in tensors]
    a = R.activation_forward(F.linear(d[0], d[1], d[2]), act) * F.linear(d[0], d[3], d[4])
    y_ref = F.linear(a * keep / (1 - p), d[5], d[6])
    refs = torch.autograd.grad(y_ref, d, g.double())
    assert y.dtype == dtype and rel_err(y, y_ref) < TOL[dtype]
    for name, got, ref in zip(["dx", "dwg", "dbg", "dwu", "dbu", "dwd", "dbd"], grads, refs):
        assert rel_err(got, ref) < TOL[dtype], name


def test_gated_module_dropout_modes():
    """nn.GatedMLP(dropout=p): the mask in training (seeded, reproducible), none in eval; its
    state_dict is the three Linears'."""
    torch.manual_seed(0)
    mlp = fusedrc.nn.GatedMLP(8, 24, dropout=0.5)
    x = torch.randn(6, 8)
    torch.manual_seed(5)
    a = mlp(x)
    torch.manual_seed(5)
    assert torch.equal(a, mlp(x))
    mlp.eval()
    g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    assert torch.allclose(mlp(x), d(F.silu(g(x)) * u(x)), atol=1e-6)
    assert not torch.allclose(a, mlp(x))
    assert set(mlp.state_dict()) == {f"{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    assert "dropout=0.5" in repr(mlp)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mask_statistics_seeds_and_extremes(backend):
    M, K, H, N = 64, 8, 96, 8
    dev = backend_device(backend)
    tensors = _inputs(M, K, H, N, torch.float32, device=dev)
    with fusedrc.use_backend(backend):
        for p in (0.1, 0.5):
            kept = _mask(backend, _seed_after(3, dev), M, H, p).mean().item()
            sigma = (p * (1 - p) / (M * H)) ** 0.5
            assert abs(kept - (1 - p)) < 5 * sigma, (p, kept)
        ya, _, _ = _run(backend, tensors, "relu", 0.5, s=7)
        yb, _, _ = _run(backend, tensors, "relu", 0.5, s=7)
        yc, _, _ = _run(backend, tensors, "relu", 0.5, s=8)
        assert torch.equal(ya, yb), "torch.manual_seed must reproduce the mask"
        assert not torch.equal(ya, yc), "another seed, another mask"
        # p = 0 is the plain FFN, bit for bit; p = 1 drops everything (F.dropout's zeros)
        y0, _, _ = _run(backend, tensors, "relu", 0.0)
        plain = fusedrc.functional.fused_mlp(*tensors, activation="relu")
        assert torch.equal(y0, plain)
        y1, _, grads = _run(backend, tensors, "relu", 1.0)
        assert torch.equal(y1, tensors[4].detach().expand_as(y1))
        assert not grads[1].any() and not grads[3].any()  # dw1 and dw2 vanish with every unit dropped


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mask_is_regenerated_not_saved(backend):
    dev = backend_device(backend)
    x = torch.randn(24, 16, device=dev, requires_grad=True)
    ffn = fusedrc.nn.FusedMLP(16, 64, dropout=0.25, device=dev)
    with fusedrc.use_backend(backend), SavedBytes() as s:
        y = ffn(x)
    # x (24 x 16 fp32) and the 8-byte seed: no mask, no hidden activation
    assert s.bytes == 24 * 16 * 4 + 8
    y.sum().backward()
    assert x.grad is not None and ffn.fc1.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_nan_propagates_through_dropped_units(backend):
    # torch's dropout multiplies by its mask: a dropped NaN stays NaN. So do the fused paths.
    dev = backend_device(backend)
    x = torch.randn(6, 8, device=dev)
    x[2, 3] = float("nan")
    fc1, fc2 = nn.Linear(8, 32, device=dev), nn.Linear(32, 4, device=dev)
    with fusedrc.use_backend(backend):
        y = fusedrc.functional.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, "relu", dropout_p=0.5)
    eager = fc2(F.dropout(F.relu(fc1(x)), 0.5))
    assert torch.equal(torch.isnan(y), torch.isnan(eager))
    assert torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 3, 4, 5]]).any()


def test_module_recompute_and_modes():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Dropout(0.2), nn.Linear(48, 16))
    ffn = fusedrc.nn.FusedMLP.from_modules(seq[0], seq[1], seq[3], dropout=seq[2])
    assert ffn.dropout == 0.2 and "dropout=0.2" in repr(ffn)
    x = torch.randn(4, 5, 16)
    # recompute of the Sequential and the module run the same fused op with the same p
    torch.manual_seed(5)
    with SavedBytes() as s:
        a = fusedrc.recompute(seq, x.clone().requires_grad_())
    torch.manual_seed(5)
    b = ffn(x)
    assert torch.equal(a, b)
    assert s.bytes == x.numel() * 4 + 8
    # eval: no dropout, the plain modules' output
    seq.eval(), ffn.eval()
    assert torch.equal(ffn(x), seq(x)) and torch.equal(fusedrc.recompute(seq, x), seq(x))
    # (a dropout the fused op cannot stand for: test_api's test_fallback_for_unfusable_blocks_is_correct)


def test_compile_matches_eager_without_graph_breaks():
    ffn = fusedrc.nn.FusedMLP(16, 32, activation="gelu_tanh", dropout=0.3)
    twin = copy.deepcopy(ffn)
    x = torch.randn(6, 16)
    explain = torch._dynamo.explain(twin)(x)
    assert explain.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    torch.manual_seed(11)
    ye = ffn(x.clone().requires_grad_())
    ye.square().sum().backward()
    torch.manual_seed(11)
    yc = compiled(x.clone().requires_grad_())
    yc.square().sum().backward()
    # aot_eager draws the seed from the eager generator: the same mask
    assert torch.equal(ye, yc)
    for p, q in zip(ffn.parameters(), twin.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-6
