"""The pre-activation op ``conv(act(bn(x)))``: functional.bn_act_conv, nn.BNReLUConv, recompute of
``Sequential(BN, act, Conv)`` and convert's pre-activation units (DenseNet), on the reference path.
The Triton kernels' tests are in test_kernels_conv.py."""
import copy

import pytest
import torch
from torch import nn

import fusedrc
from fusedrc import functional as F
from fusedrc.convert import _import_torchvision, _set_impl
from _utils import FusedOpLog, GemmCounter, SavedBytes, rel_err


@pytest.fixture(autouse=True)
def reference():
    with fusedrc.use_backend("reference"):
        yield


def _pair(bn_c, out_c, k, *, act=nn.ReLU, affine=True, bias=False, momentum=0.1, dtype=torch.float64, **conv_kw):
    """(fused BNReLUConv, the same modules' eager Sequential), sharing nothing, equal parameters."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.BatchNorm2d(bn_c, affine=affine, momentum=momentum), act(),
                          nn.Conv2d(bn_c, out_c, k, bias=bias, **conv_kw)).to(dtype)
    with torch.no_grad():
        if affine:
            eager[0].weight.uniform_(0.5, 1.5)
            eager[0].bias.uniform_(-0.5, 0.5)
        eager[0].running_mean.uniform_(-0.2, 0.2)
        eager[0].running_var.uniform_(0.5, 2.0)
    fused = copy.deepcopy(eager)
    return fusedrc.nn.BNReLUConv.from_modules(fused[0], fused[2], fused[1]), eager


def _step_matches(fused, eager, x, tol, steps=2):
    for _ in range(steps):
        xf, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        yf, ye = fused(xf), eager(xe)
        assert rel_err(yf, ye) <= tol
        g = torch.randn_like(ye)
        yf.backward(g)
        ye.backward(g)
        assert rel_err(xf.grad, xe.grad) <= tol
        for (name, p), q in zip(fused.named_parameters(), eager.parameters()):
            assert rel_err(p.grad, q.grad) <= tol, name
        for (name, b), c in zip(fused.named_buffers(), eager.buffers()):
            assert rel_err(b, c) <= tol if b.is_floating_point() else torch.equal(b, c), name


@pytest.mark.parametrize("case", [
    dict(k=3, padding=1),
    dict(k=3, stride=2, padding=1, dilation=2, bias=True),
    dict(k=1, act=nn.SiLU, affine=False),
    dict(k=3, padding=1, groups=3, out_c=6),
    dict(k=1, momentum=None, channels_last=True),
], ids=["3x3", "strided-dilated-bias", "1x1-silu-no-affine", "grouped", "cumulative-channels_last"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_matches_eager(case, training, dtype, tol):
    """Output, every gradient, the running statistics and num_batches_tracked equal eager's."""
    case = dict(case)
    cl = case.pop("channels_last", False)
    fused, eager = _pair(3, case.pop("out_c", 5), case.pop("k"), dtype=dtype, **case)
    fused.train(training)
    eager.train(training)
    x = torch.randn(2, 3, 9, 7, dtype=dtype)
    x = x.to(memory_format=torch.channels_last) if cl else x
    _step_matches(fused, eager, x, tol)


def test_keeps_only_its_input_and_runs_the_fused_op():
    """Eager keeps x and the activation (the conv's input); the fused op keeps x and two
    per-channel vectors, and its backward runs no forward convolution."""
    fused, eager = _pair(16, 8, 3, padding=1, dtype=torch.float32)
    x = torch.randn(4, 16, 12, 12, requires_grad=True)
    with SavedBytes() as kept_eager:
        eager(x)
    with SavedBytes() as kept, FusedOpLog() as log:
        y = fused(x)
    assert kept.bytes == x.numel() * 4 + 2 * 16 * 4
    assert kept_eager.bytes >= 2 * x.numel() * 4
    assert "bn_act_conv" in " ".join(log.ops)
    with GemmCounter() as seen:
        y.sum().backward()
    ops = [op.split(".")[1] for op in seen.ops if op.startswith("aten.")]
    assert "convolution_backward" in ops and "convolution" not in ops and "conv2d" not in ops, ops


def test_recompute_of_bn_act_conv_is_the_fused_op():
    torch.manual_seed(0)
    block = nn.Sequential(nn.BatchNorm2d(4), nn.GELU(), nn.Dropout(0.0), nn.Conv2d(4, 6, 3, padding=1)).double()
    twin = copy.deepcopy(block)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with FusedOpLog() as log:
        y = fusedrc.recompute(block, x)
    assert any("bn_act_conv" in op for op in log.ops), log.ops
    y2 = twin(x2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert rel_err(y, y2) < 1e-12 and rel_err(x.grad, x2.grad) < 1e-12
    assert torch.allclose(block[0].running_mean, twin[0].running_mean, rtol=0, atol=1e-15)
    assert int(block[0].num_batches_tracked) == int(twin[0].num_batches_tracked) == 1


def test_autocast_bf16():
    """As in eager, BatchNorm and the activation run on fp32 x and only the conv's input is bf16: an
    input far from 0 (mean 100, spread 1) keeps its signal (BatchNorm on a bf16 copy lost most of it:
    0.15 off in y, 0.41 in dx); the errors against float64 are eager autocast's."""
    fused, eager = _pair(8, 8, 3, padding=1, dtype=torch.float32)
    oracle = copy.deepcopy(eager).double()
    x = torch.randn(4, 8, 10, 10) + 100.0
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ye, yf = eager(xs[0]), fused(xs[1])
    yo = oracle(xs[2])
    assert yf.dtype == ye.dtype == torch.bfloat16
    g = torch.randn_like(yo)
    for y, t in zip((ye, yf, yo), xs):
        y.backward(g.to(y.dtype))
    assert xs[1].grad.dtype == torch.float32
    assert rel_err(yf, yo) < 2 * rel_err(ye, yo) + 1e-3
    assert rel_err(xs[1].grad, xs[2].grad) < 2 * rel_err(xs[0].grad, xs[2].grad) + 1e-3
    assert rel_err(fused.bn.running_var, oracle[0].running_var) < 1e-5


class _PreActNet(nn.Module):
    """A traced forward with pre-activation chains after a Conv-BN-ReLU and a Linear-ReLU chain whose
    units touch (the fx pass must not give a node to two units)."""

    def __init__(self):
        super().__init__()
        self.conv0, self.bn0 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1, self.conv2 = nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1)
        self.l1, self.l2, self.l3 = nn.Linear(4, 16), nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x):
        h = self.conv1(torch.relu(self.bn0(self.conv0(x)))) + x.mean(1, keepdim=True)
        h = self.conv2(torch.relu(self.bn1(h))).mean((2, 3))
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(h)))))


def test_convert_fx_pre_activation_and_touching_chains():
    torch.manual_seed(0)
    model = _PreActNet()
    conv = fusedrc.convert(model)
    # l2 ends the FFN l1-relu-l2 and would start another (l2-relu-l3): it is the first one's only
    kinds = {u.name: u.kind for u in conv.fusedrc_plan.units}
    assert kinds == {"conv0": "conv_bn_relu", "bn1": "bn_relu_conv", "l1": "ffn"}, kinds
    x = torch.randn(2, 3, 6, 6)
    torch.manual_seed(1)
    y = model(x)
    y.sum().backward()
    y2 = conv(x)  # the deep copy's parameters; model's gradients are set
    y2.sum().backward()
    assert rel_err(y2, y) < 1e-6
    for (name, p), q in zip(model.named_parameters(), conv.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-5, name


def test_convert_sequential_pre_activation():
    seq = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2), nn.Tanh(), nn.Conv2d(2, 2, 1))
    conv = fusedrc.convert(seq)
    plan = conv.fusedrc_plan
    assert [(u.name, u.kind) for u in plan.units] == [("0", "conv_bn_relu"), ("3", "bn_relu_conv")]
    assert any(name == "6" and "Tanh" in why for name, why in plan.skipped), plan.skipped
    x = torch.randn(2, 3, 7, 7)
    assert rel_err(conv(x), seq(x)) < 1e-6


def _dense_net(**kw):
    _import_torchvision()
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, bn_size=2,
                                       num_classes=5, **kw)


def _same_steps(model, conv, x, steps=2):
    for _ in range(steps):
        y, y2 = model(x), conv(x)
        assert rel_err(y2, y) < 1e-5
        g = torch.randn_like(y)
        y.backward(g)
        y2.backward(g)
    for (name, p), q in zip(model.named_parameters(), conv.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-4, name
    for (name, b), c in zip(model.named_buffers(), conv.buffers()):
        assert (rel_err(c, b) < 1e-5) if b.is_floating_point() else torch.equal(b, c), name


def test_densenet():
    """torchvision DenseNet: each ``_DenseLayer`` (a rule: ``FusedDenseLayer``, a block) holds two
    pre-activation units, the transitions one each (fx), the stem a Conv-BN-ReLU (before, only
    conv1-norm2-relu2 was a unit: 0.85 of the original's bytes); at most checkpoint's bytes on the same
    units and 0.62 of the original's here; outputs, gradients and running statistics as the original's."""
    model = _dense_net()
    conv = fusedrc.convert(model)
    layer = conv.features.denseblock1.denselayer1
    assert type(layer).__name__ == "FusedDenseLayer" and list(conv.state_dict()) == list(model.state_dict())
    units = {u.name: u.kind for u in conv.fusedrc_plan.units}
    assert units["features.denseblock1.denselayer1.norm1"] == "bn_relu_conv"
    assert units["features.transition1.norm"] == "bn_relu_conv" and units["features.conv0"] == "conv_bn_relu"
    assert list(units.values()).count("bn_relu_conv") == 2 * 4 + 1 and len(units) == 10, units
    assert len(conv.fusedrc_plan.blocks) == 4
    x = torch.randn(2, 3, 32, 32)
    with SavedBytes() as orig:
        model(x)
    with SavedBytes() as fused:
        conv(x)
    with SavedBytes() as ckpt:
        _set_impl(conv, "checkpoint")(x)
    _set_impl(conv, "fused")
    # (a fused BatchNorm keeps its mean and rstd: 2 floats a channel more)
    assert fused.bytes <= ckpt.bytes + 8 * sum(m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert fused.bytes < 0.65 * orig.bytes, fused.bytes / orig.bytes  # 0.62 (densenet121 at 64 px: 0.52)
    conv.load_state_dict(model.state_dict())  # the measuring steps moved the running statistics unequally
    _same_steps(model, conv, x)
    # a layer called by hand with one tensor, as torchvision's forward allows; its own methods
    h = torch.randn(2, 16, 8, 8)
    assert torch.equal(layer(h), model.features.denseblock1.denselayer1(h))
    assert torch.equal(layer.bn_function([h]), model.features.denseblock1.denselayer1.bn_function([h]))


def test_densenet_memory_efficient_blocks_and_budget():
    """memory_efficient=True: torchvision's own checkpoint of concat + norm1-relu1-conv1 runs as it is, the
    second unit fused; policy="blocks" recomputes whole layers; a budget of 0.5 (fused units alone: 0.62) is met
    with blocks."""
    x = torch.randn(2, 3, 32, 32)
    model = _dense_net(memory_efficient=True)
    conv = fusedrc.convert(model)
    with SavedBytes() as orig:
        model(x)
    with SavedBytes() as fused:
        conv(x)
    assert fused.bytes < 0.8 * orig.bytes, fused.bytes / orig.bytes
    conv.load_state_dict(model.state_dict())
    _same_steps(model, conv, x)
    model = _dense_net()
    blocks = fusedrc.convert(model, policy="blocks")
    assert len(blocks.fusedrc_plan.recomputed_blocks) == 4
    _same_steps(model, blocks, x)
    budget = fusedrc.convert(model, memory_budget=0.5, example_inputs=(x,))
    plan = budget.fusedrc_plan
    assert plan.recomputed_blocks and plan.final_bytes <= 0.5 * plan.baseline_bytes


def test_converted_layer_attributes_are_the_original_classes(monkeypatch):
    """A rule's Wrapper reads the original class's attributes as Python would: methods bound, a class
    attribute that is a descriptor class returned as it is, a property's getter and setter."""
    _import_torchvision()
    from torchvision.models import densenet as D

    class Desc:
        def __get__(self, obj, owner):
            return 1

    def get_p(self):
        return self.__dict__.get("_p", 0)

    def set_p(self, v):
        self.__dict__["_p"] = v * 10

    monkeypatch.setattr(D._DenseLayer, "desc_cls", Desc, raising=False)
    monkeypatch.setattr(D._DenseLayer, "p", property(get_p, set_p), raising=False)
    layer = D._DenseLayer(16, 8, 2, 0.0, False)
    conv = fusedrc.convert(nn.Sequential(copy.deepcopy(layer)))[0]
    assert type(conv).__name__ == "FusedDenseLayer"
    assert conv.desc_cls is Desc is layer.desc_cls
    layer.p = conv.p = 3
    assert conv.p == layer.p == 30
    assert conv.any_requires_grad([torch.ones(1, requires_grad=True)]) is True
    with pytest.raises(AttributeError):
        conv.no_such_attribute


class _ConvBNConv(nn.Module):
    def __init__(self, norm=nn.BatchNorm2d, padding_mode="zeros"):
        super().__init__()
        self.c0 = nn.Conv2d(3, 8, 3, padding=1, padding_mode=padding_mode)
        self.bn = norm(8)
        self.c1 = nn.Conv2d(8, 8, 3, padding=1, padding_mode=padding_mode)

    def forward(self, x):
        return self.c1(torch.relu(self.bn(self.c0(x))))


@pytest.mark.parametrize("case", ["syncbn", "reflect"])
def test_fx_reports_what_it_leaves_once(case):
    """Conv -> BN -> ReLU -> Conv traced by fx with a SyncBatchNorm, or with reflect-padded convs: no unit,
    and the plan says why, once."""
    model = _ConvBNConv(nn.SyncBatchNorm) if case == "syncbn" else _ConvBNConv(padding_mode="reflect")
    with pytest.warns(UserWarning, match=r"no pattern found in _ConvBNConv; the model is unchanged \(left as they "
                                         r"are: (c0|bn): "):
        plan = fusedrc.convert(model).fusedrc_plan
    assert not plan.units
    assert [name for name, _ in plan.skipped] == ["c0" if case == "syncbn" else "bn"], plan.skipped
    assert ("SyncBatchNorm" if case == "syncbn" else "zero-padded") in plan.skipped[0][1]
