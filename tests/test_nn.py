"""fusedrc.nn modules against the unfused torch modules (reference backend on CPU)."""
import copy

import pytest
import torch
import torch.nn as nn

import fusedrc
from _utils import FusedOpLog, SavedBytes, rel_err


def _check_grads(a_params, b_params, tol=1e-5):
    for a, b in zip(a_params, b_params):
        assert (a.grad - b.grad).norm() <= tol * max(b.grad.norm(), 10.0)


@pytest.mark.parametrize("activation,act", [("relu", nn.ReLU()), ("gelu_tanh", nn.GELU("tanh")), ("silu", nn.SiLU()),
                                            ("leaky_relu", nn.LeakyReLU()), ("leaky_relu:0.2", nn.LeakyReLU(0.2))])
def test_linear_relu_state_dict_and_numerics(activation, act):
    lin = nn.Linear(12, 20)
    m = fusedrc.nn.LinearReLU(12, 20, activation=activation)
    m.load_state_dict(lin.state_dict())
    nn.Linear(12, 20).load_state_dict(m.state_dict())
    x = torch.randn(3, 4, 12, requires_grad=True)
    y, ref = m(x), act(lin(x))
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    y.backward(g)
    gx = x.grad.clone()
    x.grad = None
    ref.backward(g)
    assert rel_err(gx, x.grad) < 1e-6
    _check_grads(m.parameters(), lin.parameters())
    shared = fusedrc.nn.LinearReLU.from_modules(lin, act)
    assert shared.weight is lin.weight and shared.activation == activation


def test_fused_mlp_module():
    ref = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 6))
    m = fusedrc.nn.FusedMLP(8, 32, 6, activation="gelu")
    m.load_state_dict({"fc1.weight": ref[0].weight, "fc1.bias": ref[0].bias,
                       "fc2.weight": ref[2].weight, "fc2.bias": ref[2].bias})
    x = torch.randn(5, 8, requires_grad=True)
    with SavedBytes() as s:
        y = m(x)
    assert s.bytes == x.numel() * 4
    assert torch.equal(y, ref(x))
    y.sum().backward()
    ref(x.detach()).sum().backward()
    _check_grads(m.parameters(), ref.parameters())
    m2 = fusedrc.nn.FusedMLP.from_modules(ref[0], ref[1], ref[2])
    assert m2.fc1 is ref[0] and m2.activation == "gelu"
    with pytest.raises(ValueError, match="act must be a supported activation"):
        fusedrc.nn.FusedMLP.from_modules(ref[0], nn.Tanh(), ref[2])


@pytest.mark.parametrize("momentum", [0.1, None])
def test_conv_bn_relu_training_and_eval(momentum):
    conv, bn = nn.Conv2d(3, 6, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(6, momentum=momentum)
    m = fusedrc.nn.ConvBNReLU(3, 6, 3, stride=2, padding=1, momentum=momentum)
    m.load_state_dict({"conv." + k: v for k, v in conv.state_dict().items()}
                      | {"bn." + k: v for k, v in bn.state_dict().items()})
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8, requires_grad=True)
        res = torch.randn(4, 6, 4, 4, requires_grad=True)
        y = m(x, res)
        ref = torch.relu(bn(conv(x)) + res)
        assert torch.equal(y, ref)
        g = torch.randn_like(y)
        (gx, gr) = torch.autograd.grad(y, (x, res), g)
        (rx, rr) = torch.autograd.grad(ref, (x, res), g)
        assert rel_err(gx, rx) < 1e-5 and torch.equal(gr, rr)
    assert int(m.bn.num_batches_tracked) == int(bn.num_batches_tracked) == 3
    assert rel_err(m.bn.running_mean, bn.running_mean) < 1e-6
    assert rel_err(m.bn.running_var, bn.running_var) < 1e-6
    m.eval(), bn.eval()
    x = torch.randn(2, 3, 8, 8)
    assert rel_err(m(x), torch.relu(bn(conv(x)))) < 1e-6
    assert int(m.bn.num_batches_tracked) == 3


def test_conv_bn_relu_from_modules_shares_parameters():
    conv, bn = nn.Conv2d(2, 4, 1, bias=False), nn.BatchNorm2d(4)
    m = fusedrc.nn.ConvBNReLU.from_modules(conv, bn)
    assert m.conv is conv and m.bn is bn
    with pytest.raises(ValueError, match="num_features"):
        fusedrc.nn.ConvBNReLU.from_modules(conv, nn.BatchNorm2d(5))


def test_conv_bn_relu_inside_a_recompute_region_updates_stats_once():
    m = fusedrc.nn.ConvBNReLU(3, 4, 3, padding=1)
    plain = copy.deepcopy(m)

    def region(x):
        return m(x).tanh()

    for _ in range(2):
        x = torch.randn(2, 3, 5, 5, requires_grad=True)
        fusedrc.recompute(region, x).sum().backward()
        plain(x).tanh().sum().backward()
    assert int(m.bn.num_batches_tracked) == 2
    assert rel_err(m.bn.running_mean, plain.bn.running_mean) < 1e-6
    assert rel_err(m.bn.running_var, plain.bn.running_var) < 1e-6


def test_rejected_conv_bn_relu_call_leaves_num_batches_tracked():
    """A call rejected before anything runs (wrong channel count) does not count as a batch, for
    the module and for a recomputed Conv-BN-ReLU Sequential alike."""
    torch.manual_seed(0)
    bad = torch.randn(2, 5, 8, 8)
    m = fusedrc.nn.ConvBNReLU(3, 4, 3, padding=1).train()
    seq = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()).train()
    for call, bn in ((lambda: m(bad), m.bn), (lambda: fusedrc.recompute(seq, bad), seq[1])):
        with pytest.raises(ValueError):
            call()
        assert bn.num_batches_tracked.item() == 0


@pytest.mark.parametrize("activation,act", [("silu", nn.SiLU()), ("gelu", nn.GELU()),
                                            ("leaky_relu:0.1", nn.LeakyReLU(0.1, inplace=True))])
def test_conv_bn_act_module(activation, act):
    """ConvBNReLU with another activation (EfficientNet's and YOLO's Conv-BN-SiLU), with a residual:
    outputs, gradients and running statistics as the plain modules'; from_modules takes the
    activation module; the fused op runs (not the generic path) and keeps x and mean/rstd."""
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
    m = fusedrc.nn.ConvBNReLU(3, 6, 3, padding=1, activation=activation)
    assert f"activation='{activation}'" in repr(m)
    m.load_state_dict({"conv." + k: v for k, v in conv.state_dict().items()}
                      | {"bn." + k: v for k, v in bn.state_dict().items()})
    for _ in range(2):
        x = torch.randn(4, 3, 5, 5, requires_grad=True)
        res = torch.randn(4, 6, 5, 5, requires_grad=True)
        ops = []
        with SavedBytes() as saved:
            with FusedOpLog(ops):
                y = m(x, res)
        assert ops == ["conv_bn_act"] and saved.bytes == 4 * (x.numel() + res.numel()) + 2 * 4 * 6
        ref = act(bn(conv(x)) + res)
        assert torch.equal(y, ref)
        g = torch.randn_like(y)
        got = torch.autograd.grad(y, (x, res, m.conv.weight, m.bn.weight, m.bn.bias), g)
        want = torch.autograd.grad(ref, (x, res, conv.weight, bn.weight, bn.bias), g)
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-5
    assert rel_err(m.bn.running_var, bn.running_var) < 1e-6
    shared = fusedrc.nn.ConvBNReLU.from_modules(conv, bn, act)
    assert shared.conv is conv and shared.activation == activation
    shared.eval(), bn.eval()
    x = torch.randn(2, 3, 5, 5)
    assert rel_err(shared(x), act(bn(conv(x)))) < 1e-6
    with pytest.raises(ValueError, match="act must be a supported activation"):
        fusedrc.nn.ConvBNReLU.from_modules(conv, bn, nn.Tanh())
    with pytest.raises(ValueError, match="activation"):
        fusedrc.nn.ConvBNReLU(3, 6, 3, activation="tanh")
    # a module pickled before the argument existed loads as ReLU
    state = dict(m.__dict__)
    del state["activation"]
    old = fusedrc.nn.ConvBNReLU.__new__(fusedrc.nn.ConvBNReLU)
    old.__setstate__(state)
    assert old.activation == "relu"


@pytest.mark.parametrize("groups", [2, 4], ids=["grouped", "depthwise"])
def test_conv_bn_relu_grouped(groups):
    """Grouped and depthwise convolutions (ResNeXt, RegNet, MobileNet/EfficientNet) through the fused
    op: outputs, gradients and running statistics as the plain modules' over two training steps and
    in eval; the module built with groups= holds the same nn.Conv2d as nn.Conv2d(groups=) would."""
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(4, 8, 3, padding=1, groups=groups, bias=False), nn.BatchNorm2d(8)
    m = fusedrc.nn.ConvBNReLU.from_modules(copy.deepcopy(conv), copy.deepcopy(bn), nn.SiLU())
    built = fusedrc.nn.ConvBNReLU(4, 8, 3, padding=1, groups=groups)
    assert built.conv.groups == groups and built.conv.weight.shape == conv.weight.shape
    built.load_state_dict(m.state_dict())
    for _ in range(2):
        x = torch.randn(3, 4, 6, 6, requires_grad=True)
        ops = []
        with FusedOpLog(ops):
            y = m(x)
        assert ops == ["conv_bn_act"]
        ref = nn.functional.silu(bn(conv(x)))
        assert rel_err(y, ref) < 1e-6
        g = torch.randn_like(y)
        got = torch.autograd.grad(y, (x, m.conv.weight, m.bn.weight, m.bn.bias), g)
        want = torch.autograd.grad(ref, (x, conv.weight, bn.weight, bn.bias), g)
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-5
    assert rel_err(m.bn.running_var, bn.running_var) < 1e-6 and int(m.bn.num_batches_tracked) == 2
    m.eval(), bn.eval()
    x = torch.randn(2, 4, 6, 6)
    assert rel_err(m(x), nn.functional.silu(bn(conv(x)))) < 1e-6
    with pytest.raises(ValueError, match=r"out_channels \(6\) must be divisible by groups \(4\)"):
        fusedrc.nn.ConvBNReLU(4, 6, 3, groups=4)


def test_conv_bn_without_activation():
    """ConvBNReLU(activation=None) and from_modules(conv, bn, None): Conv-BN with no activation (a
    projection or downsample branch) through the fused op, which keeps x and mean/rstd, not the conv
    output BatchNorm would keep; outputs, gradients and running statistics as the plain modules'."""
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 6, 1, stride=2, bias=False), nn.BatchNorm2d(6)
    m = fusedrc.nn.ConvBNReLU.from_modules(copy.deepcopy(conv), copy.deepcopy(bn), None)
    assert m.activation is None and "activation=None" in repr(m)
    built = fusedrc.nn.ConvBNReLU(3, 6, 1, stride=2, activation=None)
    assert built.activation is None
    x = torch.randn(4, 3, 8, 8, requires_grad=True)
    ops = []
    with SavedBytes() as saved, FusedOpLog(ops):
        y = m(x)
    assert ops == ["conv_bn_act"] and saved.bytes == 4 * x.numel() + 2 * 4 * 6
    ref = bn(conv(x))
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (x, m.conv.weight, m.bn.weight, m.bn.bias), g),
                    torch.autograd.grad(ref, (x, conv.weight, bn.weight, bn.bias), g)):
        assert rel_err(a, b) < 1e-5
    assert rel_err(m.bn.running_var, bn.running_var) < 1e-6


def test_conv_bn_without_activation_residual_gradient_is_its_own_tensor():
    """activation=None with a residual: the residual's gradient is the incoming one, which the
    backward op must return as a new tensor (a custom op may not return an input), or the dispatcher
    path (dispatch modes, torch.compile) fails."""
    torch.manual_seed(0)
    m = fusedrc.nn.ConvBNReLU(4, 4, 1, activation=None)
    x, r = torch.randn(2, 4, 5, 5), torch.randn(2, 4, 5, 5, requires_grad=True)
    g = torch.randn(2, 4, 5, 5)
    ops = []
    with FusedOpLog(ops):
        (dr,) = torch.autograd.grad(m(x, r), r, g)
    assert ops == ["conv_bn_act", "conv_bn_act_backward"] and torch.equal(dr, g)
    y = torch.compile(m, backend="aot_eager", fullgraph=True)(x, r)
    (dr,) = torch.autograd.grad(y, r, g)
    assert torch.equal(dr, g)


def _prune_like(module):
    """An old-style weight hook, as torch.nn.utils.prune installs it: ``weight`` is recomputed
    from ``weight_orig`` by a forward pre-hook at every call."""
    import torch.nn.utils.prune as prune

    prune.l1_unstructured(module, "weight", amount=0.5)
    return module


_GELU = nn.GELU()


@pytest.mark.parametrize("make, first, plain", [
    (lambda: fusedrc.nn.FusedMLP(8, 24, activation="gelu"), lambda m: m.fc1,
     lambda m, x: m.fc2(_GELU(m.fc1(x)))),
    (lambda: fusedrc.nn.GatedMLP(8, 24, bias=True), lambda m: m.up_proj,
     lambda m, x: m.down_proj(nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))),
    (lambda: fusedrc.nn.ConvBNReLU(3, 8, 3, padding=1), lambda m: m.conv,
     lambda m, x: torch.relu(m.bn(m.conv(x)))),
], ids=["FusedMLP", "GatedMLP", "ConvBNReLU"])
def test_hooks_on_held_modules_are_honoured(make, first, plain):
    """A pre-hook computing a held module's weight (pruning) or a forward hook on it: the module
    runs its submodules as they are (unfused), so each step uses the weight of that step, training
    steps work (no stale weight from an earlier graph), and the hook fires."""
    torch.manual_seed(0)
    m = make()
    _prune_like(first(m))
    seen = []
    first(m).register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    conv = isinstance(m, fusedrc.nn.ConvBNReLU)
    x = torch.randn(2, 3, 6, 6) if conv else torch.randn(5, 8)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for _ in range(2):  # the second step sees weight_orig moved by the optimizer
        opt.zero_grad()
        m(x).square().sum().backward()
        opt.step()
    assert len(seen) == 2
    m.eval()
    y = m(x)
    assert len(seen) == 3 and torch.equal(y, plain(m, x))
    with torch.no_grad():
        first(m).weight_orig.add_(1.0)
    assert torch.equal(m(x), plain(m, x)) and not torch.equal(m(x), y)


def test_from_modules_refuses_what_the_fused_op_would_skip():
    """from_modules takes the exact torch classes: a subclass's own forward (QAT fake quantization,
    timm's BatchNormAct2d) would be lost; LinearReLU shares a Linear's parameters, so a Linear whose
    weight a hook or parametrization computes is refused with the way out."""
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class ConvPlus(nn.Conv2d):
        pass

    lin, dbl = nn.Linear(8, 16), Doubled(8, 16)
    with pytest.raises(TypeError, match="linear must be an nn.Linear, got the subclass Doubled"):
        fusedrc.nn.LinearReLU.from_modules(dbl)
    with pytest.raises(TypeError, match="fc2 must be an nn.Linear, got the subclass Doubled"):
        fusedrc.nn.FusedMLP.from_modules(lin, "relu", Doubled(16, 8))
    with pytest.raises(TypeError, match="up_proj must be an nn.Linear, got the subclass Doubled"):
        fusedrc.nn.GatedMLP.from_modules(lin, dbl, nn.Linear(16, 8), "silu")
    with pytest.raises(TypeError, match="conv must be an nn.Conv2d, got the subclass ConvPlus"):
        fusedrc.nn.ConvBNReLU.from_modules(ConvPlus(3, 8, 3), nn.BatchNorm2d(8))
    with pytest.raises(ValueError, match="linear has hooks or parametrizations"):
        fusedrc.nn.LinearReLU.from_modules(_prune_like(nn.Linear(8, 16)))
    with pytest.raises(ValueError, match="apply them to the LinearReLU instead"):
        fusedrc.nn.LinearReLU.from_modules(torch.nn.utils.parametrizations.weight_norm(nn.Linear(8, 16)))
    # the way out works: a parametrization on the LinearReLU itself
    torch.manual_seed(0)
    m = torch.nn.utils.parametrizations.weight_norm(fusedrc.nn.LinearReLU(8, 16))
    x = torch.randn(4, 8)
    assert rel_err(m(x), torch.relu(nn.functional.linear(x, m.weight, m.bias))) < 1e-6
    # a module that holds its Linears takes parametrized ones, and runs fused: reading weight computes it
    fc1 = torch.nn.utils.parametrizations.weight_norm(nn.Linear(8, 16))
    mlp = fusedrc.nn.FusedMLP.from_modules(fc1, "relu", nn.Linear(16, 8))
    with FusedOpLog() as log:
        y = mlp(x)
    assert log.ops == ["fused_mlp"] and rel_err(y, mlp.fc2(torch.relu(fc1(x)))) < 1e-6
