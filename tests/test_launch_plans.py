"""Host-side caches of the conv ops: the kernels' per-layer launch plans and the functional layer's
checked calls. Each must give the results of the uncached path and never let a change through
that the cache does not see (a switch, a layout, a dtype, a bad argument)."""
import pytest
import torch

triton = pytest.importorskip("triton")

import fusedrc  # noqa: E402
from fusedrc import functional as F  # noqa: E402
from fusedrc import reference as R  # noqa: E402
from fusedrc.kernels import conv_bn_act as K  # noqa: E402

pytestmark = pytest.mark.usefixtures("strictly_fused_conv")

EPS = 1e-5


def _layer(channels_last=False, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 6, 7, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(9, 5, 3, 3, generator=g, dtype=torch.float64) / 6).to(device=device, dtype=dtype)
    gamma = (1 + 0.2 * torch.randn(9, generator=g)).to(device)
    beta = (0.1 * torch.randn(9, generator=g)).to(device)
    grad = torch.randn(2, 9, 6, 7, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    if channels_last:
        grad = grad.contiguous(memory_format=torch.channels_last)
    return x, w, gamma, beta, grad


def _fwd_bwd(mod, x, w, gamma, beta, grad, training=True):
    # eval normalizes with running statistics
    rm, rv = (None, None) if training else (0.1 * torch.ones_like(gamma), 2 * torch.ones_like(gamma))
    y, mean, rstd = mod.conv_bn_act_forward(x, w, None, gamma, beta, rm, rv, None, training, EPS,
                                            [1, 1], [1, 1], [1, 1], "relu", 1)
    grads = mod.conv_bn_act_backward(x, w, None, gamma, beta, mean, rstd, None, grad, training, EPS,
                                     [1, 1], [1, 1], [1, 1], "relu", None, 1)
    return (y, mean, rstd), grads


def _assert_close_to_reference(out, grads, x, w, gamma, beta, grad, tol=1e-5, training=True):
    d = [t.double() for t in (x, w, gamma, beta, grad)]
    out_r, grads_r = _fwd_bwd(R, *d, training=training)
    for o, r in zip((*out, *grads), (*out_r, *grads_r)):
        if r is None:
            assert o is None
            continue
        err = (o.double() - r).norm() / r.norm()
        assert err < tol, err


def test_plan_built_once_per_layer(monkeypatch, device):
    monkeypatch.setattr(K, "CONV_Z", "triton")
    builds = {"fwd": 0, "bwd": 0}
    fwd_plan, bwd_plan = K._fwd_plan, K._bwd_plan

    def count(kind, build):
        def wrapped(*args):
            builds[kind] += 1
            return build(*args)
        return wrapped

    monkeypatch.setattr(K, "_fwd_plan", count("fwd", fwd_plan))
    monkeypatch.setattr(K, "_bwd_plan", count("bwd", bwd_plan))
    x, w, gamma, beta, grad = _layer(device=device)
    first = _fwd_bwd(K, x, w, gamma, beta, grad)
    second = _fwd_bwd(K, x.clone(), w.clone(), gamma, beta, grad.clone())  # other tensors, same metadata
    assert builds == {"fwd": 1, "bwd": 1}
    for a, b in zip((*first[0], *first[1]), (*second[0], *second[1])):
        assert (a is None and b is None) or torch.equal(a, b)
    _assert_close_to_reference(*second, x, w, gamma, beta, grad)


def test_setting_a_switch_clears_the_plans(monkeypatch, device):
    x, w, gamma, beta, grad = _layer(device=device)
    monkeypatch.setattr(K, "CONV_Z", "triton")
    _fwd_bwd(K, x, w, gamma, beta, grad)
    assert len(K._PLANS) == 2
    assert not any(p.layer.aten_z for p in K._PLANS._entries.values())
    monkeypatch.setattr(K, "CONV_Z", "aten")
    assert len(K._PLANS) == 0
    out, grads = _fwd_bwd(K, x, w, gamma, beta, grad)
    # the new setting's plans: z from aten.convolution
    assert len(K._PLANS) == 2 and all(p.layer.aten_z for p in K._PLANS._entries.values())
    _assert_close_to_reference(out, grads, x, w, gamma, beta, grad)


def test_plans_key_on_layout_dtype_and_mode(monkeypatch, device):
    monkeypatch.setattr(K, "CONV_Z", "triton")
    K.clear_launch_plans()
    for channels_last in (False, True):
        x, w, gamma, beta, grad = _layer(channels_last=channels_last, device=device)
        out, grads = _fwd_bwd(K, x, w, gamma, beta, grad)
        assert out[0].is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        _assert_close_to_reference(out, grads, x, w, gamma, beta, grad)
    x, w, gamma, beta, grad = _layer(device=device)
    out, grads = _fwd_bwd(K, x, w, gamma, beta, grad, training=False)  # eval: other plans
    _assert_close_to_reference(out, grads, x, w, gamma, beta, grad, training=False)
    xh, wh, _, _, gh = (t.half() for t in (x, w, gamma, beta, grad))
    out, grads = _fwd_bwd(K, xh, wh, gamma, beta, gh)
    assert out[0].dtype == torch.float16 and grads[0].dtype == torch.float16
    _assert_close_to_reference(out, grads, xh, wh, gamma, beta, gh, tol=1e-2)
    # two layouts, eval and fp16 in training: 4 forward and 4 backward plans
    assert len(K._PLANS) == 8


def test_plans_skip_traced_calls():
    from fusedrc.kernels._common import plan_key
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert plan_key(torch.ones(2), 3) is not None
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(2))
        assert plan_key(fake, 3) is None


# --------------------------------------------------------------------------- checked calls
def _call(x, conv, bn, **kw):
    args = dict(training=True, momentum=0.1, eps=1e-5, stride=1, padding=1)
    args.update(kw)
    return F.conv_bn_act(x, conv.weight, bn.weight, bn.bias, bn.running_mean, bn.running_var, **args)


def test_checked_call_still_rejects_bad_arguments(device):
    conv = torch.nn.Conv2d(4, 6, 3, padding=1, bias=False).to(device)
    bn = torch.nn.BatchNorm2d(6).to(device)
    x = torch.randn(2, 4, 5, 5, device=device)
    with fusedrc.use_backend("triton"):
        _call(x, conv, bn)
        _call(x, conv, bn)  # the cached path
        with pytest.raises(TypeError, match="stride"):
            _call(x, conv, bn, stride=True)  # hashes as 1, must not hit the cache
        with pytest.raises(ValueError, match="eps"):
            _call(x, conv, bn, eps=0.0)
        with pytest.raises(TypeError, match="momentum"):
            _call(x, conv, bn, momentum="0.1")  # momentum is checked on every call
        with pytest.raises(ValueError, match="momentum"):
            _call(x, conv, bn, momentum=float("nan"))
        with pytest.raises(ValueError, match="weight"):
            _call(torch.randn(2, 3, 5, 5, device=device), conv, bn)
        with pytest.raises(ValueError, match="running_mean"):  # an expanded buffer: same shape, stride 0
            F.conv_bn_act(x, conv.weight, bn.weight, bn.bias, torch.zeros(1, device=device).expand(6),
                          bn.running_var, training=True, padding=1)


def test_checked_call_matches_the_modules(device):
    """Repeated calls through the cache: outputs, gradients and running statistics as eager's, and the
    momentum of each call (a cumulative average changes it every step) applied."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 6, 3, padding=1, bias=False).to(device)
    bn = torch.nn.BatchNorm2d(6, momentum=None).to(device)  # cumulative: 1/n every call
    ref_conv, ref_bn = torch.nn.Conv2d(4, 6, 3, padding=1, bias=False).to(device), torch.nn.BatchNorm2d(
        6, momentum=None).to(device)
    ref_conv.load_state_dict(conv.state_dict())
    fused = fusedrc.nn.ConvBNReLU.from_modules(conv, bn)
    with fusedrc.use_backend("triton"):
        for step in range(3):
            x = torch.randn(2, 4, 5, 5, device=device, requires_grad=True)
            xr = x.detach().clone().requires_grad_(True)
            y = fused(x)
            yr = torch.relu(ref_bn(ref_conv(xr)))
            torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
            y.sum().backward()
            yr.sum().backward()
            torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv.weight.grad, ref_conv.weight.grad, rtol=1e-5, atol=1e-5)


def test_checked_call_keys_on_autocast(device):
    conv = torch.nn.Conv2d(4, 6, 3, padding=1, bias=False).to(device)
    bn = torch.nn.BatchNorm2d(6).to(device)
    x = torch.randn(2, 4, 5, 5, device=device)
    with fusedrc.use_backend("triton"):
        assert _call(x, conv, bn).dtype == torch.float32
        with torch.autocast(x.device.type, dtype=torch.float16 if x.is_cuda else torch.bfloat16):
            y = _call(x, conv, bn)
        assert y.dtype == (torch.float16 if x.is_cuda else torch.bfloat16)
        assert _call(x, conv, bn).dtype == torch.float32


def test_bn_act_conv_plans_follow_both_modules(monkeypatch, device):
    """The pre-activation conv's plans read conv_bn_act's tile table and switches too: setting one
    there clears them; the cached launch gives the reference's result."""
    from fusedrc.kernels import bn_act_conv as B

    x, w, gamma, beta, grad = _layer(device=device)
    w = w[:5]  # (5 out, 5 in, 3, 3): a conv over x's 5 channels

    def run(mod):
        y, mean, rstd = mod.bn_act_conv_forward(x, gamma[:5], beta[:5], None, None, w, None, True, EPS,
                                                [1, 1], [1, 1], [1, 1], "relu", 1)
        return (y, mean, rstd), mod.bn_act_conv_backward(x, gamma[:5], beta[:5], w, None, mean, rstd, grad[:, :5],
                                                          True, EPS, [1, 1], [1, 1], [1, 1], "relu", None, 1)

    out, grads = run(B)
    run(B)
    assert len(B._PLANS) == 2
    monkeypatch.setattr(K, "FLAT_K_MAX_CHANNELS", K.FLAT_K_MAX_CHANNELS)  # a set on conv_bn_act, same value
    assert len(B._PLANS) == 0
    d = {n: t.double() for n, t in (("x", x), ("w", w), ("g", gamma[:5]), ("b", beta[:5]), ("grad", grad[:, :5]))}
    y_r, mean_r, rstd_r = R.bn_act_conv_forward(d["x"], d["g"], d["b"], None, None, d["w"], None, True, EPS,
                                               [1, 1], [1, 1], [1, 1], "relu", 1)
    grads_r = R.bn_act_conv_backward(d["x"], d["g"], d["b"], d["w"], None, mean_r, rstd_r, d["grad"], True, EPS,
                                     [1, 1], [1, 1], [1, 1], "relu", None, 1)
    for o, r in zip((*out, *grads), (y_r, mean_r, rstd_r, *grads_r)):
        if r is None:
            assert o is None
            continue
        assert ((o.double() - r).norm() / r.norm()) < 1e-5
