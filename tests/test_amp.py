"""Mixed precision: fused ops, recompute regions and converted models under autocast.

Every test runs the fusedrc model and its eager twin (same parameters) under the
same autocast and checks: the output dtype is eager's, values and gradients are
close (bf16 tolerances; on the CPU reference path forwards are bitwise equal,
since the same aten ops run on the same casts), parameter gradients keep the
parameters' dtype, BatchNorm running statistics and ``num_batches_tracked``
follow eager, and the fused ops really ran (not a silent fallback).

CPU: bf16 autocast (the reference backend). CUDA (skipped without a GPU): fp16
and bf16 through the Triton kernels, a converted model, and GradScaler training
that must skip the same overflowing steps as eager. ``tests/test_amp_cuda.py``
has the basic CUDA autocast/GradScaler checks on recompute patterns; the ones
here add ``fusedrc.nn``/functional, ``convert`` and forced overflow.
"""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedrc

from _utils import FusedOpLog, fused_without_norms, rel_err

BF16 = torch.bfloat16


def _twin(module):
    return copy.deepcopy(module)


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _assert_grads(model, ref, tol, skip=()):
    named, pairs = list(model.named_parameters()), list(ref.named_parameters())
    assert named and len(named) == len(pairs)
    for (n, p), (_, q) in zip(named, pairs):  # same order (the twins may name them differently)
        assert p.grad is not None and q.grad is not None, n
        assert p.grad.dtype == q.grad.dtype == p.dtype, n
        if n in skip:
            continue
        # an absolute floor for gradients that are zero in theory (a conv bias before BatchNorm)
        assert (p.grad - q.grad).double().norm() <= tol * q.grad.double().norm() + 1e-4, (n, rel_err(p.grad, q.grad))


def _assert_buffers(model, ref, tol=1e-2):
    for (n, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        assert a.dtype == b.dtype, n
        if a.is_floating_point():
            assert rel_err(a, b) < tol, (n, rel_err(a, b))
        else:
            assert torch.equal(a, b), n


def _run(model, x, device_type, dtype, call=None, seed=0, enabled=True):
    """Forward under autocast, backward of a float loss outside it; returns (y, x.grad)."""
    x = _leaf(x)
    torch.manual_seed(seed)
    with torch.autocast(device_type, dtype=dtype, enabled=enabled):
        y = (call or model)(x)
    w = torch.linspace(-1, 1, y.numel(), device=y.device, dtype=torch.float64).view_as(y)
    (y.double() * w).sum().backward()
    return y, x.grad


def _assert_no_worse(model, ref, exact, gx, gx_ref, gx_exact, slack):
    """Half gradients through BatchNorm layers differ from eager's by a few percent either way;
    fusedrc's (fp32 BatchNorm backward) must be no farther from the float64 truth than eager's."""
    trios = [("input", gx, gx_ref, gx_exact)] + [
        (n, p.grad, q.grad, r.grad)
        for (n, p), q, r in zip(model.named_parameters(), ref.parameters(), exact.parameters())
    ]
    for n, a, b, t in trios:
        assert a.dtype == b.dtype, n
        if t.norm() < 1e-8:  # zero in theory (a conv bias before BatchNorm): both are rounding noise
            continue
        err, err_ref = rel_err(a, t), rel_err(b, t)
        assert err <= 1.5 * err_ref + slack, (n, err, err_ref)


def _compare(fused, eager, x, device_type, dtype, *, tol, call=None, eager_call=None, expect_ops=None,
             exact_forward=False, skip=(), vs_float64=False):
    """Run ``fused`` and its twin ``eager`` under the same autocast. With ``vs_float64``, gradients are
    judged against a float64 copy of ``eager`` run without autocast instead of against eager."""
    exact = copy.deepcopy(eager).double() if vs_float64 else None
    with FusedOpLog() as log:
        y, gx = _run(fused, x, device_type, dtype, call)
    y_ref, gx_ref = _run(eager, x, device_type, dtype, eager_call)
    assert y.dtype == y_ref.dtype, (y.dtype, y_ref.dtype)
    assert gx.dtype == gx_ref.dtype == x.dtype
    if exact_forward:
        assert torch.equal(y, y_ref)
    assert rel_err(y, y_ref) < tol, rel_err(y, y_ref)
    if vs_float64:
        assert eager_call is None
        _, gx_exact = _run(exact, x.double(), device_type, dtype=dtype, enabled=False)
        _assert_no_worse(fused, eager, exact, gx, gx_ref, gx_exact, slack=tol / 2)
    else:
        assert rel_err(gx, gx_ref) < tol, rel_err(gx, gx_ref)
        _assert_grads(fused, eager, tol, skip)
    _assert_buffers(fused, eager)
    if expect_ops is not None:
        ops = [o.removesuffix("_triton") for o in log.ops]  # on CUDA the triton_op twins run
        ran = [o for o in ops if not o.endswith("_backward")]
        assert sorted(set(ran)) == sorted(expect_ops), log.ops
        assert any(o.endswith("_backward") for o in ops) == bool(expect_ops), "fused backward: " + str(log.ops)
    return y, y_ref


# --------------------------------------------------------------------------- CPU, bf16: fusedrc.nn and functional
CPU_TOL = 2e-2


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_linear_act_module_bf16(activation):
    torch.manual_seed(0)
    m = fusedrc.nn.LinearReLU(24, 40, activation=activation)
    act = {"relu": nn.ReLU(), "gelu": nn.GELU(), "silu": nn.SiLU()}[activation]
    ref = nn.Sequential(nn.Linear(24, 40), act)
    ref[0].load_state_dict(m.state_dict())
    x = torch.randn(3, 5, 24)  # N-D input
    with FusedOpLog() as log:
        y, gx = _run(m, x, "cpu", BF16)
    y_ref, gx_ref = _run(ref, x, "cpu", BF16)
    assert y.dtype == y_ref.dtype == BF16 and y.shape == y_ref.shape
    assert not y._is_view(), "the fused output must not be a view (as F.linear's is not)"
    assert torch.equal(y, y_ref)
    assert rel_err(gx, gx_ref) < CPU_TOL
    for name in ("weight", "bias"):
        g, g_ref = getattr(m, name).grad, getattr(ref[0], name).grad
        assert g.dtype == g_ref.dtype == torch.float32
        assert rel_err(g, g_ref) < CPU_TOL, name
    assert log.ops == ["linear_act", "linear_act_backward"]


def test_fused_mlp_module_bf16():
    torch.manual_seed(0)
    m = fusedrc.nn.FusedMLP(16, 64, 12, activation="gelu_tanh")
    ref = nn.Sequential(_twin(m.fc1), nn.GELU(approximate="tanh"), _twin(m.fc2))
    x = torch.randn(2, 7, 16)
    with FusedOpLog() as log:
        y, gx = _run(m, x, "cpu", BF16)
    y_ref, gx_ref = _run(ref, x, "cpu", BF16)
    assert y.dtype == y_ref.dtype == BF16
    assert torch.equal(y, y_ref)
    assert rel_err(gx, gx_ref) < CPU_TOL
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and rel_err(p.grad, q.grad) < CPU_TOL, n
    assert log.ops == ["fused_mlp", "fused_mlp_backward"]


def _conv_bn_relu_twins(bias=False, momentum=0.1):
    torch.manual_seed(0)
    m = fusedrc.nn.ConvBNReLU(3, 8, 3, padding=1, bias=bias, momentum=momentum)
    with torch.no_grad():
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.5, 0.5)
    ref = nn.Sequential(_twin(m.conv), _twin(m.bn), nn.ReLU())
    return m, ref


@pytest.mark.parametrize("momentum", [0.1, None], ids=["ema", "cumulative"])
def test_conv_bn_relu_module_bf16_train_steps(momentum):
    """Three training forwards/backwards: output dtype, values, gradients, running statistics."""
    m, ref = _conv_bn_relu_twins(bias=True, momentum=momentum)
    for step in range(3):
        x = torch.randn(4, 3, 8, 8)
        m.zero_grad()
        ref.zero_grad()
        _compare(m, ref, x, "cpu", BF16, tol=CPU_TOL, expect_ops=["conv_bn_act"], exact_forward=True,
                 skip=("conv.bias",))
    assert int(m.bn.num_batches_tracked) == int(ref[1].num_batches_tracked) == 3


def test_conv_bn_relu_module_bf16_eval():
    m, ref = _conv_bn_relu_twins()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.2, 0.2)
        m.bn.running_var.uniform_(0.5, 2.0)
        ref[1].load_state_dict(m.bn.state_dict())
    m.eval()
    ref.eval()
    _compare(m, ref, torch.randn(2, 3, 8, 8), "cpu", BF16, tol=CPU_TOL, expect_ops=["conv_bn_act"])


def test_conv_bn_relu_residual_bf16():
    """A half residual (what a ResNet's identity is under autocast) stays fused and matches eager."""
    m, ref = _conv_bn_relu_twins()
    x = torch.randn(2, 3, 8, 8)
    r = torch.randn(2, 8, 8, 8).to(BF16)
    _compare(m, ref, x, "cpu", BF16, tol=CPU_TOL, call=lambda t: m(t, r),
             eager_call=lambda t: torch.relu(ref[1](ref[0](t)) + r), expect_ops=["conv_bn_act"])


def test_functional_ops_bf16_match_eager():
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    w1, b1 = torch.randn(32, 16, requires_grad=True), torch.randn(32, requires_grad=True)
    w2, b2 = torch.randn(8, 32, requires_grad=True), torch.randn(8, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        y = fusedrc.functional.fused_mlp(x, w1, b1, w2, b2, "silu")
        y_ref = F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)
        z = fusedrc.functional.linear_act(x, w1, None, "relu")
        z_ref = F.relu(F.linear(x, w1))
    assert y.dtype == y_ref.dtype == z.dtype == z_ref.dtype == BF16
    assert torch.equal(y, y_ref) and torch.equal(z, z_ref)
    grads = torch.autograd.grad(y.float().sum() + z.float().sum(), (w1, b1, w2, b2))
    grads_ref = torch.autograd.grad(y_ref.float().sum() + z_ref.float().sum(), (w1, b1, w2, b2))
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == torch.float32 and rel_err(g, g_ref) < CPU_TOL

    xc = torch.randn(2, 3, 6, 6)
    wc = torch.randn(4, 3, 3, 3, requires_grad=True)
    gamma, beta = torch.rand(4, requires_grad=True), torch.randn(4, requires_grad=True)
    rm, rv = torch.zeros(4), torch.ones(4)
    rm_ref, rv_ref = rm.clone(), rv.clone()
    with torch.autocast("cpu", dtype=BF16):
        y = fusedrc.functional.conv_bn_act(xc, wc, gamma, beta, rm, rv, training=True, padding=1)
        y_ref = F.relu(F.batch_norm(F.conv2d(xc, wc, padding=1), rm_ref, rv_ref, gamma, beta, True))
    assert y.dtype == y_ref.dtype == BF16
    assert torch.equal(y, y_ref)
    assert rel_err(rm, rm_ref) < 1e-2 and rel_err(rv, rv_ref) < 1e-2
    grads = torch.autograd.grad(y.float().pow(2).sum(), (wc, gamma, beta))
    grads_ref = torch.autograd.grad(y_ref.float().pow(2).sum(), (wc, gamma, beta))
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == torch.float32 and rel_err(g, g_ref) < CPU_TOL


def test_float64_is_not_cast_by_autocast():
    """autocast leaves float64 alone (eager F.linear stays float64); so do the fused ops."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8).double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        y = fusedrc.functional.linear_act(x, lin.weight, lin.bias)
        y_rc = fusedrc.recompute(nn.Sequential(lin, nn.ReLU()), x)
        y_ref = torch.relu(lin(x))
    assert y.dtype == y_rc.dtype == y_ref.dtype == torch.float64
    assert torch.equal(y, y_ref) and torch.equal(y_rc, y_ref)


def test_autocast_disabled_inside_region():
    """A nested ``autocast(enabled=False)`` inside a recompute region is honoured in forward and rerun."""
    torch.manual_seed(0)
    ffn = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def block(t):
        with torch.autocast("cpu", enabled=False):
            return ffn(t.float())

    x = torch.randn(4, 16)
    y, gx = _run(None, x, "cpu", BF16, call=lambda t: fusedrc.recompute(block, t))
    y_ref, gx_ref = _run(None, x, "cpu", BF16, call=block)
    assert y.dtype == y_ref.dtype == torch.float32
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)


# --------------------------------------------------------------------------- CPU, bf16: recompute
@pytest.mark.parametrize("pattern", ["linear_act", "ffn_dropout0", "conv_bn_relu"])
def test_recompute_patterns_bf16_params_and_stats(pattern):
    """Fused recompute patterns under autocast: every parameter gradient and the running
    statistics over two steps (test_recompute checks the output and x's gradient)."""
    torch.manual_seed(0)
    if pattern == "linear_act":
        block, shape, ops = nn.Sequential(nn.Linear(16, 24), nn.SiLU()), (5, 16), ["linear_act"]
    elif pattern == "ffn_dropout0":
        block = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Dropout(0.0), nn.Linear(48, 16))
        shape, ops = (2, 5, 16), ["fused_mlp"]
    else:
        block = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU())
        shape, ops = (4, 3, 6, 6), ["conv_bn_act"]
    ref = _twin(block)
    for _ in range(2):
        _compare(block, ref, torch.randn(*shape), "cpu", BF16, tol=CPU_TOL,
                 call=lambda t: fusedrc.recompute(block, t), expect_ops=ops, exact_forward=True)


class _Generic(nn.Module):
    """Not a pattern: LayerNorm, a Linear-GELU-Dropout-Linear FFN, a Conv-BN-Tanh branch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh())
        self.norm = nn.LayerNorm(8)
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        h = self.norm(self.conv(x).mean((2, 3)))
        return h + self.fc2(self.drop(F.gelu(self.fc1(h))))


def test_generic_region_bf16_is_bitwise_eager():
    """A generic region reruns the same ops under the replayed autocast and RNG state: output, every
    gradient and the running statistics (updated once) are bitwise eager's."""
    torch.manual_seed(0)
    block = _Generic()
    ref = _twin(block)
    x = torch.randn(4, 3, 6, 6)
    y, gx = _run(block, x, "cpu", BF16, call=lambda t: fusedrc.recompute(block, t), seed=3)
    y_ref, gx_ref = _run(ref, x, "cpu", BF16, seed=3)
    assert y.dtype == y_ref.dtype == BF16
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    for (n, p), q in zip(block.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    for (n, a), b in zip(block.named_buffers(), ref.buffers()):
        assert torch.equal(a, b), n
    assert int(block.conv[1].num_batches_tracked) == 1


def test_marked_block_with_fused_op_inside_bf16():
    """A generic region (``mark``) around a fused unit, under autocast; backward outside it. Inside the
    region the unit runs as the plain composition (forward and rerun): no fused op, eager's exact output."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    ref = _twin(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = fusedrc.mark(fusedrc.convert(inner))
    assert fused_without_norms(block.fusedrc_plan) == ["1"]
    _compare(block, ref, torch.randn(6, 16), "cpu", BF16, tol=CPU_TOL, expect_ops=[], exact_forward=True)


# --------------------------------------------------------------------------- CPU, bf16: a converted model
class _ConvertNet(nn.Module):
    """Two FFNs in a row (the second gets a half input under autocast), a Linear-act, a
    Conv-BN-ReLU chain, and a generic recompute region."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        # the BatchNorm after the Tanh: no Conv-BN pattern, a generic region with a plain BatchNorm
        self.gen = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.Tanh(), nn.BatchNorm2d(16))
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16),
                                 nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.0), nn.Linear(64, 16),
                                 nn.Linear(16, 32), nn.SiLU(), nn.LayerNorm(32), nn.Linear(32, 10))

    def forward(self, x):
        h = self.stem(x)
        h = fusedrc.recompute(self.gen, h) if getattr(self, "fused", False) else self.gen(h)
        return self.mlp(h.mean((2, 3)))


def _convert_twins(device="cpu"):
    torch.manual_seed(0)
    ref = _ConvertNet().to(device)
    model = fusedrc.convert(ref)
    model.fused = True
    assert sorted(fused_without_norms(model.fusedrc_plan)) == ["mlp.0", "mlp.3", "mlp.7", "stem.0", "stem.3"]
    return model, ref


def test_converted_model_bf16_every_unit_stays_fused():
    model, ref = _convert_twins()
    for step in range(2):
        model.zero_grad()
        ref.zero_grad()
        with FusedOpLog() as log:
            y, y_ref = _compare(model, ref, torch.randn(4, 3, 8, 8), "cpu", BF16, tol=CPU_TOL, vs_float64=True)
        fwd = [o for o in (o.removesuffix("_triton") for o in log.ops) if not o.endswith("_backward")]
        assert sorted(fwd) == ["conv_bn_act", "conv_bn_act", "fused_mlp", "fused_mlp", "linear_act"], log.ops
        assert y.dtype == BF16


def test_converted_basicblock_bf16_matches_torchvision():
    """torchvision adds the identity in place (``out += identity``): under autocast an fp32 identity
    is added into the half BN output, which stays half. The fused tail casts the residual to half
    and adds it in the kernel: same dtype, values within bf16 rounding; both units stay fused."""
    from fusedrc.convert import _import_torchvision

    try:
        _import_torchvision()
    except ImportError:
        pytest.skip("torchvision is not installed (test extra)")
    from torchvision.models.resnet import BasicBlock

    torch.manual_seed(0)
    ref = BasicBlock(8, 8)
    model = fusedrc.convert(ref)
    assert model.fusedrc_plan.fused == ["conv1", "conv2"]
    for x in (torch.randn(2, 8, 6, 6), torch.randn(2, 8, 6, 6).to(BF16)):  # fp32 and half identity
        model.zero_grad()
        ref.zero_grad()
        y, y_ref = _compare(model, ref, x, "cpu", BF16, tol=CPU_TOL, expect_ops=["conv_bn_act"], vs_float64=True)
        assert y.dtype == y_ref.dtype == BF16


# --------------------------------------------------------------------------- CUDA: fp16 and bf16 on the kernels
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (fp16 autocast, GradScaler, Triton)")
HALF = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
CUDA_TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.fixture
def no_tf32():
    prev = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev


@cuda
@pytest.mark.parametrize("dtype", HALF)
def test_cuda_modules_autocast(dtype, no_tf32):
    """fusedrc.nn modules on the Triton kernels under CUDA autocast: dtype, values, every gradient,
    running statistics; a half residual; eval mode."""
    dev = "cuda"
    tol = CUDA_TOL[dtype]
    torch.manual_seed(0)
    lin = fusedrc.nn.LinearReLU(64, 96, activation="gelu").to(dev)
    lin_ref = nn.Sequential(nn.Linear(64, 96), nn.GELU()).to(dev)
    lin_ref[0].load_state_dict(lin.state_dict())
    _compare(lin, lin_ref, torch.randn(3, 40, 64, device=dev), dev, dtype, tol=tol, expect_ops=["linear_act"])

    mlp = fusedrc.nn.FusedMLP(64, 256, activation="relu").to(dev)
    mlp_ref = nn.Sequential(_twin(mlp.fc1), nn.ReLU(), _twin(mlp.fc2))
    _compare(mlp, mlp_ref, torch.randn(100, 64, device=dev), dev, dtype, tol=tol, expect_ops=["fused_mlp"])

    m, ref = _conv_bn_relu_twins()
    m, ref = m.to(dev), ref.to(dev)
    for _ in range(2):
        _compare(m, ref, torch.randn(4, 3, 12, 12, device=dev), dev, dtype, tol=tol, expect_ops=["conv_bn_act"])
    r = torch.randn(4, 8, 12, 12, device=dev, dtype=dtype)
    _compare(m, ref, torch.randn(4, 3, 12, 12, device=dev), dev, dtype, tol=tol, call=lambda t: m(t, r),
             eager_call=lambda t: torch.relu(ref[1](ref[0](t)) + r), expect_ops=["conv_bn_act"])
    m.eval()
    ref.eval()
    _compare(m, ref, torch.randn(4, 3, 12, 12, device=dev), dev, dtype, tol=tol, expect_ops=["conv_bn_act"])


@cuda
@pytest.mark.parametrize("dtype", HALF)
def test_cuda_converted_model_autocast(dtype, no_tf32):
    model, ref = _convert_twins("cuda")
    for _ in range(2):
        model.zero_grad()
        ref.zero_grad()
        with FusedOpLog() as log:
            y, _ = _compare(model, ref, torch.randn(8, 3, 16, 16, device="cuda"), "cuda", dtype,
                            tol=CUDA_TOL[dtype], vs_float64=True)
        fwd = [o for o in (o.removesuffix("_triton") for o in log.ops) if not o.endswith("_backward")]
        assert sorted(fwd) == ["conv_bn_act", "conv_bn_act", "fused_mlp", "fused_mlp", "linear_act"], log.ops
        assert y.dtype == dtype


@cuda
def test_cuda_gradscaler_skips_the_same_overflowing_steps(no_tf32):
    """fp16 + GradScaler on a converted model: the first step overflows on purpose (a huge initial
    scale): the fused backward must produce non-finite gradients so that the step is skipped, as
    eager's is; the following steps train like eager."""
    model, ref = _convert_twins("cuda")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref)]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0 ** 40, backoff_factor=2.0 ** -28) for _ in range(2)]
    start = [p.detach().clone() for p in ref.parameters()]
    scales = [[], []]
    losses = [[], []]
    for step in range(5):
        g = torch.Generator(device="cpu").manual_seed(step)
        x = torch.randn(8, 3, 16, 16, generator=g).cuda()
        t = torch.randint(0, 10, (8,), generator=g).cuda()
        for i, (m, opt, sc) in enumerate(zip((model, ref), opts, scalers)):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(m(x), t)
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            scales[i].append(sc.get_scale())
            losses[i].append(loss.item())
        if step == 0:
            for p, q in zip(model.parameters(), start):
                assert torch.equal(p, q), "the overflowing first step must be skipped"
    assert scales[0] == scales[1] and scales[0][0] < 2.0 ** 40
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=2e-2, atol=2e-2)
    for (n, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start):
        if n == "stem.0.bias":  # a conv bias before BatchNorm: zero gradient in theory, rounding noise
            continue
        assert rel_err(p - p0, q - p0) < 5e-2, (n, rel_err(p - p0, q - p0))
    _assert_buffers(model, ref, tol=2e-2)
