"""Fused ops on the reference backend against float64 autograd of the unfused chain."""
import pytest
import torch
import torch.nn.functional as F

import fusedrc
import fusedrc.functional as FF
from _utils import rel_err

ACTS = ["relu", "relu2", "gelu", "gelu_tanh", "silu", "relu6", "hardswish"]
TORCH_ACT = {
    "relu": torch.relu,
    "relu2": lambda h: torch.relu(h) ** 2,
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "relu6": F.relu6,
    "hardswish": F.hardswish,
}
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], grad)


def _leaf(t, dtype):
    return None if t is None else t.detach().to(dtype).requires_grad_()


@pytest.fixture(autouse=True)
def _reference():
    with fusedrc.use_backend("reference"):
        yield


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("shape", [(7, 5, 3), (2, 3, 16, 33)])  # (*lead, K, N)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_act_matches_float64(activation, shape, bias):
    *lead, k, n = shape
    x = torch.randn(*lead, k)
    w, b = torch.randn(n, k) / k**0.5, (torch.randn(n) if bias else None)
    g = torch.randn(*lead, n)
    x32, w32, b32 = (_leaf(t, torch.float32) for t in (x, w, b))
    x64, w64, b64 = (_leaf(t, torch.float64) for t in (x, w, b))
    y = FF.linear_act(x32, w32, b32, activation)
    ref = TORCH_ACT[activation](F.linear(x64, w64, b64))
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert rel_err(y, ref) < TOL[torch.float32]
    for a, r in zip(_grads(y, (x32, w32, b32), g), _grads(ref, (x64, w64, b64), g.double())):
        assert rel_err(a, r) < TOL[torch.float32]


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("bias", [True, False])
def test_fused_mlp_matches_float64(activation, bias):
    x = torch.randn(3, 5, 12)
    w1, w2 = torch.randn(40, 12) / 12**0.5, torch.randn(9, 40) / 40**0.5
    b1, b2 = (torch.randn(40), torch.randn(9)) if bias else (None, None)
    g = torch.randn(3, 5, 9)
    p32 = [_leaf(t, torch.float32) for t in (x, w1, b1, w2, b2)]
    p64 = [_leaf(t, torch.float64) for t in (x, w1, b1, w2, b2)]
    y = FF.fused_mlp(*p32, activation)
    ref = F.linear(TORCH_ACT[activation](F.linear(p64[0], p64[1], p64[2])), p64[3], p64[4])
    assert rel_err(y, ref) < TOL[torch.float32]
    for a, r in zip(_grads(y, p32, g), _grads(ref, p64, g.double())):
        assert rel_err(a, r) < TOL[torch.float32]


def _conv_bn_ref(x, w, gamma, beta, residual, stride, padding, dilation, eps, training, rm, rv):
    z = F.conv2d(x, w, None, stride, padding, dilation)
    if training:
        mean = z.mean((0, 2, 3), keepdim=True)
        var = z.var((0, 2, 3), unbiased=False, keepdim=True)
    else:
        mean, var = rm.view(1, -1, 1, 1), rv.view(1, -1, 1, 1)
    y = (z - mean) / torch.sqrt(var + eps)
    if gamma is not None:
        y = y * gamma.view(1, -1, 1, 1) + beta.view(1, -1, 1, 1)
    if residual is not None:
        y = y + residual
    return torch.relu(y), z


@pytest.mark.parametrize(
    "stride,padding,dilation,affine,residual,training",
    [
        (1, 1, 1, True, False, True),
        (2, 0, 1, False, False, True),
        (1, 2, 2, True, True, True),
        (2, 1, 1, True, True, False),
    ],
)
def test_conv_bn_act_matches_float64(stride, padding, dilation, affine, residual, training):
    x = torch.randn(3, 4, 9, 7)
    w = torch.randn(6, 4, 3, 3) / 6
    gamma, beta = (torch.rand(6) + 0.5, torch.randn(6)) if affine else (None, None)
    rm, rv = torch.randn(6), torch.rand(6) + 0.5
    oh = (9 + 2 * padding - dilation * 2 - 1) // stride + 1
    ow = (7 + 2 * padding - dilation * 2 - 1) // stride + 1
    res = torch.randn(3, 6, oh, ow) if residual else None
    g = torch.randn(3, 6, oh, ow)
    p32 = [_leaf(t, torch.float32) for t in (x, w, gamma, beta, res)]
    p64 = [_leaf(t, torch.float64) for t in (x, w, gamma, beta, res)]
    rm32, rv32 = rm.clone(), rv.clone()
    y = FF.conv_bn_act(
        p32[0], p32[1], p32[2], p32[3], rm32, rv32, training=training, momentum=0.3, eps=1e-5,
        stride=stride, padding=padding, dilation=dilation, residual=p32[4],
    )
    ref, z = _conv_bn_ref(*p64, stride, padding, dilation, 1e-5, training, rm.double(), rv.double())
    assert rel_err(y, ref) < 1e-5
    for a, r in zip(_grads(y, p32, g), _grads(ref, p64, g.double())):
        assert rel_err(a, r) < 1e-5
    if training:
        zz = z.detach()
        exp_rm = 0.7 * rm.double() + 0.3 * zz.mean((0, 2, 3))
        exp_rv = 0.7 * rv.double() + 0.3 * zz.var((0, 2, 3), unbiased=True)
        assert rel_err(rm32, exp_rm) < 1e-6 and rel_err(rv32, exp_rv) < 1e-5
    else:
        assert torch.equal(rm32, rm) and torch.equal(rv32, rv)


def test_conv_bn_act_without_running_stats_uses_batch_stats_in_eval():
    x = torch.randn(2, 3, 5, 5)
    w = torch.randn(4, 3, 3, 3)
    y = FF.conv_bn_act(x, w, None, None, None, None, training=False)
    ref = torch.relu(F.batch_norm(F.conv2d(x, w), None, None, training=True))
    assert rel_err(y, ref) < 1e-6


def test_backward_saves_only_the_input_and_stats():
    from _utils import SavedBytes

    x = torch.randn(8, 16, requires_grad=True)
    lin = torch.nn.Linear(16, 64)
    with SavedBytes() as s:
        FF.linear_act(x, lin.weight, lin.bias)
    assert s.bytes == x.numel() * 4
    xc = torch.randn(2, 3, 8, 8, requires_grad=True)
    conv, bn = torch.nn.Conv2d(3, 5, 3, bias=False), torch.nn.BatchNorm2d(5)
    with SavedBytes() as s:
        FF.conv_bn_act(xc, conv.weight, bn.weight, bn.bias, bn.running_mean, bn.running_var)
    assert s.bytes == xc.numel() * 4 + 2 * 5 * 4  # x, mean, rstd


def test_nan_and_inf_propagate():
    x = torch.randn(4, 6)
    x[0, 0], x[1, 1] = float("nan"), float("inf")
    lin = torch.nn.Linear(6, 5)
    y = FF.linear_act(x, lin.weight, lin.bias)
    ref = torch.relu(lin(x))
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.isnan(y[0]).all()
    assert torch.allclose(y[2:], ref[2:])


def test_double_backward_through_a_fused_op_is_a_clear_error():
    x = torch.randn(3, 4, requires_grad=True)
    lin = torch.nn.Linear(4, 5)
    y = FF.linear_act(x, lin.weight, lin.bias, "gelu")
    with pytest.raises(RuntimeError, match="double backward through the fused op fusedrc::linear_act"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
