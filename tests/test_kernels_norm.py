"""The RMSNorm row kernels (fusedrc/kernels/rms_norm.py) against the reference's module roundings.

The oracle is ``fusedrc.reference.norm_with_stats`` / ``norm_backward``: each RMS kind as its module
computes it (nn.RMSNorm, Hugging Face's Llama and Gemma RMSNorms), in the input's dtype. Under Triton's
interpreter a cast of fp32 to bfloat16 truncates where a GPU rounds to nearest, so bfloat16 results
may differ by one unit in the last place there: the bfloat16 tolerance allows it.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

import fusedrc  # noqa: E402
from fusedrc import reference as R  # noqa: E402
from fusedrc.kernels import rms_norm as K  # noqa: E402

from _utils import record_launches, rel_err  # noqa: E402

KINDS = ("rms", "llama_rms", "gemma_rms")
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _weight(k, dtype, device):
    return (torch.randn(k, device=device) * 0.3 + 1.0).to(dtype)


def _compare(x, kind, w, g, tol, mask=None):
    """The kernels' (y, rstd, dx, dw) against the reference's: dtypes equal, values within ``tol``.
    dx's error is relative to its summands' size, |g w rstd|, where that is larger than dx: with one
    feature dx = g w rstd eps / (x^2 + eps) is all cancellation, and the kernels' and the reference's
    fp32 roundings of it differ by ~1e-7 of g w rstd (on an H100, 16% of dx itself)."""
    y, rstd = K.norm_with_stats(x, kind, w, None, 1e-6)
    y_ref, rstd_ref = R.norm_with_stats(x, kind, w, None, 1e-6)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape and rstd.shape == rstd_ref.shape
    assert rel_err(y, y_ref) <= tol and rel_err(rstd, rstd_ref) <= 1e-6
    got = K.norm_backward(g, x, kind, w, None, 1e-6, mask, stats=rstd)
    want = R.norm_backward(g, x, kind, w, None, 1e-6, mask, stats=rstd_ref)
    for name, a, b in zip(("dx", "dweight", "dbias"), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            err = rel_err(a, b)
            if name == "dx":
                terms = (g.double() * rstd_ref.double().reshape(*x.shape[:-1], 1)).norm() * (1 + (w.double().abs().max() if w is not None else 1))
                err = min(err, ((a.double() - b.to(a.device).double()).norm() / terms).item())
            assert err <= tol, (name, err)
    return got


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_matches_module_roundings(kind, dtype, device, monkeypatch):
    """7 rows of 37 features (no power of two; the backward's 4 programs take 2 rows each, the last 1),
    the weight in x's dtype; both kernels launched once."""
    seen = record_launches(monkeypatch, K)
    x = torch.randn(7, 37, device=device).to(dtype)
    _compare(x, kind, _weight(37, dtype, device), torch.randn(7, 37, device=device).to(dtype), TOL[dtype])
    assert [name for name, _ in seen] == ["_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"]


@pytest.mark.parametrize("kind,x_dtype,w_dtype", [
    ("llama_rms", torch.bfloat16, torch.float32),   # autocast: fp32 weight, the product (and y) in fp32
    ("llama_rms", torch.float16, torch.bfloat16),   # promoted to fp32: the product is not rounded to x's dtype
    ("gemma_rms", torch.bfloat16, torch.float32),
    ("rms", torch.float16, torch.float32),
    ("rms", torch.float32, None), ("llama_rms", torch.bfloat16, None), ("gemma_rms", torch.float16, None),
], ids=["llama-bf16-fp32w", "llama-fp16-bf16w", "gemma-bf16-fp32w", "rms-fp16-fp32w", "rms-no-w", "llama-no-w",
        "gemma-no-w"])
def test_weight_dtypes_and_no_weight(kind, x_dtype, w_dtype, device):
    x = torch.randn(5, 24, device=device).to(x_dtype)
    w = None if w_dtype is None else _weight(24, w_dtype, device)
    # the gradient comes in the norm output's dtype (the FFN ops cast it back from the FFN's): fp32
    # where llama_rms promotes
    y_dtype = R.norm_with_stats(x, kind, w, None, 1e-6)[0].dtype
    dx, dw, _ = _compare(x, kind, w, torch.randn(5, 24, device=device).to(y_dtype), TOL[x_dtype])
    assert dx is not None and (dw is None) == (w is None)


@pytest.mark.parametrize("m,k", [(1, 1), (9, 1000), (3, K.MAX_COLS)], ids=["1x1", "9x1000", "max-cols"])
def test_awkward_rows(m, k, device):
    """One feature, a row of 1000 (a 1024 block), the longest row the kernels take; rows read
    through their stride (a slice of a wider tensor)."""
    wide = torch.randn(m, k + 5, device=device)
    x = wide[:, 2:k + 2]
    assert x.stride(0) == k + 5
    _compare(x, "llama_rms", _weight(k, torch.float32, device), torch.randn(m, k, device=device), TOL[torch.float32])


def test_backward_is_repeatable_and_masked(device, monkeypatch):
    """The weight gradient sums per-program partials in a fixed order: the same bits twice. A masked
    gradient is None and its work is skipped (NEED_DX / NEED_DW)."""
    seen = record_launches(monkeypatch, K)
    x = torch.randn(11, 40, device=device, dtype=torch.float16)
    w, g = _weight(40, torch.float16, device), torch.randn(11, 40, device=device, dtype=torch.float16)
    first = K.norm_backward(g, x, "llama_rms", w, None, 1e-6)
    second = K.norm_backward(g, x, "llama_rms", w, None, 1e-6)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    seen.clear()
    dx, dw, _ = _compare(x, "llama_rms", w, g, TOL[torch.float16], mask=[True, False, False])
    assert dx is not None and dw is None
    assert [kw["NEED_DX"] and not kw["NEED_DW"] for n, kw in seen if n == "_rms_norm_bwd_kernel"] == [True]
    dx, dw, _ = _compare(x, "llama_rms", w, g, TOL[torch.float16], mask=[False, True, False])
    assert dx is None and dw is not None
    assert K.norm_backward(g, x, "llama_rms", None, None, 1e-6, [False, True, False]) == (None, None, None)


def test_weight_read_whatever_its_layout(device):
    """A weight that is a strided view (every other element of a longer vector) is read as a vector."""
    x, g = torch.randn(4, 24, device=device), torch.randn(4, 24, device=device)
    w = _weight(48, torch.float32, device)[::2]
    assert not w.is_contiguous()
    _compare(x, "llama_rms", w, g, TOL[torch.float32])


def test_other_cases_take_the_reference(device, monkeypatch):
    """LayerNorm (aten's own fused kernels), float64, rows longer than MAX_COLS, an empty input and a
    weight that is no vector of the features (the reference raises as the module would): the
    reference, no launch, its results."""
    seen = record_launches(monkeypatch, K)
    x = torch.randn(4, 37, device=device)
    w, b, g = torch.randn(37, device=device), torch.randn(37, device=device), torch.randn(4, 37, device=device)
    for args in ((x, "layer", w, b), (x.double(), "llama_rms", w.double(), None)):
        y, stats = K.norm_with_stats(*args, 1e-5)
        assert torch.equal(y, R.norm_with_stats(*args, 1e-5)[0])
        got = K.norm_backward(g.to(args[0].dtype), *args, 1e-5, stats=stats)
        want = R.norm_backward(g.to(args[0].dtype), *args, 1e-5, stats=stats)
        assert all((a is None and c is None) or torch.equal(a, c) for a, c in zip(got, want))
    with pytest.raises(RuntimeError):
        K.norm_forward(x, "rms", torch.ones(5, device=device), None, 1e-5)
    empty = torch.empty(0, 37, device=device)
    assert K.norm_with_stats(empty, "rms", w, None, 1e-5)[0].shape == (0, 37)
    monkeypatch.setattr(K, "MAX_COLS", 32)
    assert torch.equal(K.norm_forward(x, "rms", w, None, 1e-5), R.norm_forward(x, "rms", w, None, 1e-5))
    assert seen == []


def test_ffn_op_with_a_norm_runs_the_kernels(device, monkeypatch):
    """gated_mlp(norm="llama_rms") on the Triton backend: the norm's kernel in the forward, again in
    the backward (the FFN's recomputed input, the same bits), then its backward kernel; results as
    the reference backend's."""
    seen = record_launches(monkeypatch, K)
    torch.manual_seed(0)
    x = torch.randn(2, 5, 24, device=device, requires_grad=True)
    nw = _weight(24, torch.float32, device).requires_grad_(True)
    ws = [torch.randn(40, 24, device=device) * 0.2, torch.randn(40, 24, device=device) * 0.2,
          torch.randn(24, 40, device=device) * 0.2]
    ws = [w.requires_grad_(True) for w in ws]

    def run(backend):
        with fusedrc.use_backend(backend):
            y = fusedrc.functional.gated_mlp(x, ws[0], None, ws[1], None, ws[2], None, "silu", norm="llama_rms",
                                             norm_weight=nw, norm_eps=1e-6)
            return y, torch.autograd.grad(y.square().sum(), [x, nw, *ws])

    y, grads = run("triton")
    assert [n for n, _ in seen] == ["_rms_norm_fwd_kernel", "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"]
    y_ref, grads_ref = run("reference")
    assert rel_err(y, y_ref) <= 1e-5
    for a, b in zip(grads, grads_ref):
        assert rel_err(a, b) <= 1e-5
