"""Triton kernels of the pre-activation ``conv2d(act(bn(x)))`` against the float64 reference.

Without a GPU these run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1,
16x16x16 conv tiles): ragged channels and pixels over several tiles, stride, padding, dilation."""
import pytest
import torch

triton = pytest.importorskip("triton")

import fusedrc  # noqa: E402
from fusedrc import functional as F  # noqa: E402
from fusedrc.kernels import bn_act_conv as K  # noqa: E402
from fusedrc.kernels import conv_bn_act as CBA  # noqa: E402

from _utils import record_launches, rel_err  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
# (N, C_in, H, W, C_out, k, stride, padding, dilation)
SHAPES = {"3x3s2d2": (2, 19, 7, 9, 21, 3, 2, 2, 2), "1x1": (3, 20, 5, 6, 7, 1, 1, 0, 1)}


@pytest.fixture(autouse=True)
def _triton(device):
    if device.type == "cpu" and not fusedrc._backend.interpreter_active():
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1")


def _case(shape, dtype, device, *, affine=True, bias=False, channels_last=False):
    N, C, H, W, CO, k, s, p, d = shape
    torch.manual_seed(0)
    x = (torch.randn(N, C, H, W, dtype=torch.float64) * 2 + 0.3).to(dtype)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    params = dict(
        gamma=torch.rand(C, dtype=torch.float64) + 0.5 if affine else None,
        beta=torch.randn(C, dtype=torch.float64) * 0.3 if affine else None,
        rm=torch.randn(C, dtype=torch.float64) * 0.1, rv=torch.rand(C, dtype=torch.float64) + 0.5,
        w=(torch.randn(CO, C, k, k, dtype=torch.float64) * 0.2).to(dtype),
        b=torch.randn(CO, dtype=torch.float64).to(dtype) if bias else None)
    return x.to(device), {n: (t.to(device) if t is not None else None) for n, t in params.items()}, dict(
        stride=s, padding=p, dilation=d)


def _run(backend, x, prm, geom, training, activation, grad=None, f64=False):
    """One training step: {name: output, gradient or running statistic}, and the incoming gradient.
    BN parameters and statistics in fp32 (as under AMP), or everything in float64 (``f64``)."""
    conv = (lambda t: t.double()) if f64 else (lambda t: t)  # noqa: E731
    bn = (lambda t: t.double()) if f64 else (lambda t: t.float())  # noqa: E731
    leaf = lambda t, cast: None if t is None else cast(t).detach().requires_grad_()  # noqa: E731
    x = leaf(x, conv)
    gamma, beta, w, b = leaf(prm["gamma"], bn), leaf(prm["beta"], bn), leaf(prm["w"], conv), leaf(prm["b"], conv)
    rm, rv = bn(prm["rm"]).clone(), bn(prm["rv"]).clone()
    with fusedrc.use_backend(backend):
        y = F.bn_act_conv(x, gamma, beta, rm, rv, w, bias=b, training=training, activation=activation, **geom)
    g = conv(grad) if grad is not None else torch.randn_like(y)
    y.backward(g)
    out = {"y": y, "dx": x.grad, "running_mean": rm, "running_var": rv, "dweight": w.grad}
    out.update({n: t.grad for n, t in (("dgamma", gamma), ("dbeta", beta), ("dbias", b)) if t is not None})
    return out, g


def _check(shape, dtype, device, training, activation="relu", **kw):
    x, prm, geom = _case(shape, dtype, device, **kw)
    got, g = _run("triton", x, prm, geom, training, activation)
    want, _ = _run("reference", x, prm, geom, training, activation, grad=g, f64=True)
    for name, ref in want.items():
        assert rel_err(got[name], ref) < TOL[dtype], (name, rel_err(got[name], ref))


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_kernels_match_reference(shape, dtype, training, monkeypatch, device):
    """Output, dx, dgamma, dbeta, dW and the running statistics; the op's Triton kernels ran (its
    forward conv with the prologue; in backward, with aten's conv gradients (the default), the
    activation rebuilt once, then the act/BN backward passes)."""
    seen = record_launches(monkeypatch, K)
    _check(shape, dtype, device, training)
    names = [n for n, _ in seen]
    assert names.count("_bn_act_conv_fwd_kernel") == 1 and names.count("_channel_stats_kernel") == int(training)
    assert {"_bn_act_apply_kernel", "_bn_act_grad_reduce_kernel", "_bn_act_grad_dx_kernel"} <= set(names), names


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_triton_conv_gradients(training, monkeypatch, device):
    """CONV_GRAD="triton": dA by conv_dx, dW by conv_dw with the PRE_ACT prologue (no activation buffer);
    channels_last, a conv bias, SiLU."""
    monkeypatch.setattr(CBA, "CONV_GRAD", "triton")
    seen = record_launches(monkeypatch, K)
    seen_cba = record_launches(monkeypatch, CBA)
    _check(SHAPES["3x3s2d2"], torch.float32, device, training, "silu", bias=True, channels_last=True)
    assert "_bn_act_apply_kernel" not in [n for n, _ in seen]
    pre = [kw["PRE_ACT"] for n, kw in seen_cba if n == "_conv_dw_kernel"]
    assert pre == [True] and "_conv_dx_kernel" in [n for n, _ in seen_cba]


def test_no_affine_and_leaky_relu(device):
    _check(SHAPES["1x1"], torch.float32, device, True, "leaky_relu:0.2", affine=False, bias=True)


def test_mask_consistency(device):
    """Pre-activations crowded around 0: with an identity 1x1 conv, y is the forward's act(bn(x))
    exactly, and (eval, incoming gradient 1) dx is nonzero exactly where y > 0: the backward's
    recomputed ReLU mask is the forward's."""
    C = 20
    torch.manual_seed(0)
    x = torch.randn(2, C, 5, 7, device=device) * 1e-6 + 0.25
    gamma, beta = torch.rand(C, device=device) + 0.5, torch.zeros(C, device=device)
    rm, rv = torch.full((C,), 0.25, device=device), torch.rand(C, device=device) + 0.5
    w = torch.eye(C, device=device).view(C, C, 1, 1)
    xg = x.clone().requires_grad_()
    with fusedrc.use_backend("triton"):
        y = F.bn_act_conv(xg, gamma, beta, rm, rv, w, training=False)
    y.backward(torch.ones_like(y))
    assert 0.2 < (y > 0).float().mean() < 0.8
    assert torch.equal(xg.grad != 0, y > 0)


def test_nan_propagates(device):
    x, prm, geom = _case(SHAPES["1x1"], torch.float32, device)
    x[0, 3, 2, 2] = float("nan")
    got, _ = _run("triton", x, prm, geom, False, "relu")
    want, _ = _run("reference", x, prm, geom, False, "relu", grad=torch.ones_like(got["y"]))
    assert torch.equal(got["y"].isnan(), want["y"].isnan()) and got["y"].isnan().any()
