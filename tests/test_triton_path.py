"""recompute/functional/nn on the "triton" backend (interpreter on CPU, real kernels on CUDA)."""
import copy

import pytest
import torch
import torch.nn as nn

import fusedrc
from _utils import GemmCounter, SavedBytes, record_launches, rel_err

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _triton():
    with fusedrc.use_backend("triton"):
        yield


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Sequential(nn.Linear(24, 40), nn.ReLU()),
        lambda: nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Dropout(0.0), nn.Linear(40, 24)),
        lambda: nn.Sequential(nn.Linear(24, 40), nn.SiLU(), nn.Linear(40, 8)),
    ],
    ids=["linear_relu", "ffn_gelu", "ffn_silu"],
)
def test_recompute_pattern_runs_the_kernels(make, device):
    block = make().to(device)
    x = torch.randn(3, 11, 24, device=device, requires_grad=True)
    with SavedBytes() as saved, GemmCounter() as c:
        y = fusedrc.recompute(block, x)
        y.backward(torch.ones_like(y))
    assert saved.bytes == x.numel() * 4, "only x is kept for backward"
    # No aten GEMM recomputes h. The plain GEMMs (dX, dW; the FFN's g_a, dW2 and its forward
    # output GEMM too) run as cuBLAS on CUDA (fusedrc/kernels/_common.py PLAIN_GEMM), Triton otherwise.
    from fusedrc.kernels import _common

    plain = 2 if len(block) == 2 else 5
    expected = plain if _common.uses_aten_gemm(x, block[0].weight) else 0
    assert c.gemms == expected, f"expected {expected} aten GEMMs on the triton path, saw {c.ops}"
    gx = x.grad.clone()
    grads = [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()
    ref = block(x)
    ref.backward(torch.ones_like(ref))
    assert rel_err(y, ref) < 1e-5 and rel_err(gx, x.grad) < 1e-5
    for a, p in zip(grads, block.parameters()):
        assert rel_err(a, p.grad) < 1e-5


def test_modules_on_triton(device):
    m = fusedrc.nn.FusedMLP(16, 48, activation="gelu_tanh").to(device)
    ref = nn.Sequential(m.fc1, nn.GELU("tanh"), m.fc2)
    x = torch.randn(20, 16, device=device, requires_grad=True)
    assert rel_err(m(x), ref(x)) < 1e-5


# --------------------------------------------------------------------------- dense: inputs
def test_functional_noncontiguous_nd_inputs(device):
    """Transposed and sliced N-D inputs give the reference's result on the kernels."""
    w1, b1 = torch.randn(40, 17, device=device), torch.randn(40, device=device)
    w2, b2 = torch.randn(9, 40, device=device), torch.randn(9, device=device)
    base = torch.randn(17, 5, 3, device=device)
    x = base.permute(2, 1, 0)[:, 1:]  # (3, 4, 17), non-contiguous
    assert not x.is_contiguous()
    for fn, args in ((fusedrc.functional.linear_act, (w1, b1)), (fusedrc.functional.fused_mlp, (w1, b1, w2, b2))):
        xt = x.detach().requires_grad_(True)
        xr = x.detach().requires_grad_(True)
        y = fn(xt, *args, activation="gelu")
        with fusedrc.use_backend("reference"):
            yr = fn(xr, *args, activation="gelu")
        assert y.shape == yr.shape and rel_err(y, yr) < 1e-5
        g = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, xt, g)
        (gxr,) = torch.autograd.grad(yr, xr, g)
        assert rel_err(gx, gxr) < 1e-5


def test_deterministic_mode_bitwise_repeatable(device):
    """Under use_deterministic_algorithms the kernels (no atomics) repeat bit for bit."""
    block = nn.Sequential(nn.Linear(33, 70), nn.ReLU(), nn.Linear(70, 19)).to(device)
    conv = nn.Sequential(nn.Conv2d(3, 7, 3, padding=1), nn.BatchNorm2d(7), nn.ReLU()).to(device)
    x = torch.randn(45, 33, device=device)
    xc = torch.randn(2, 3, 6, 6, device=device)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            out = []
            for m, inp in ((block, x), (conv, xc)):
                m.zero_grad()
                xi = inp.clone().requires_grad_(True)
                y = fusedrc.recompute(m, xi)
                y.backward(torch.ones_like(y))
                out += [y.detach(), xi.grad] + [p.grad.clone() for p in m.parameters()]
            runs.append(out)
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("row_stride,rows", [(2**24, 160), (2**30 + 16, 4)], ids=["bases-past-2^31", "huge-stride"])
def test_int64_offsets(row_stride, rows):
    """Operands past 2**31 elements: strided views into a large, lazily committed buffer.

    Row bases past 2**31 elements need 64-bit tile offsets; a stride so large that
    one tile overflows int32 makes the launcher copy the operand.
    """
    if torch.cuda.is_available():
        pytest.skip("CPU-only: relies on the OS committing only the touched pages of a multi-GiB buffer")
    from fusedrc import reference as R
    from fusedrc.kernels import linear_act as K

    big = torch.empty(rows * row_stride + 64, dtype=torch.float16)
    x = big.as_strided((rows, 24), (row_stride, 1))
    assert x.storage_offset() + (rows - 1) * row_stride > 2**31
    x.copy_(torch.randn(rows, 24, dtype=torch.float16))
    w = torch.randn(8, 24, dtype=torch.float16)
    b = torch.randn(8, dtype=torch.float16)
    y = K.linear_act_forward(x, w, b, "relu")
    assert rel_err(y, R.linear_act_forward(x.double(), w.double(), b.double(), "relu")) < 1e-2
    g = torch.randn(rows, 8, dtype=torch.float16)
    grads = K.linear_act_backward(x, w, b, g, "relu")
    grads_ref = R.linear_act_backward(x.double(), w.double(), b.double(), g.double(), "relu")
    for o, r in zip(grads, grads_ref):
        assert rel_err(o, r) < 1e-2


def test_autocast_on_triton_matches_eager(device):
    """Under autocast the fused op casts like F.linear and stays on the kernels."""
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(device)
    x = torch.randn(10, 16, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=dtype), GemmCounter() as c:
        y = fusedrc.recompute(block, x)
    with torch.autocast(device.type, dtype=dtype):
        y_ref = block(x)
    assert y.dtype == y_ref.dtype == dtype
    # the FFN's output GEMM is never rerun: cuBLAS on CUDA (plain_gemm), a Triton GEMM elsewhere
    assert c.gemms == (1 if device.type == "cuda" else 0)
    assert rel_err(y, y_ref) < 2e-2


# --------------------------------------------------------------------------- conv + BN + ReLU
# Forward conv / batch norm only: dX and dW are backward convolutions of dz (cuDNN's by default,
# fusedrc/kernels/conv_bn_act.py CONV_GRAD), not a rerun of the forward.
_CONV_OPS = ("convolution", "conv2d", "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
             "cudnn_batch_norm", "miopen_batch_norm", "native_batch_norm_backward")


def _conv_ops(counter):
    return [o for o in counter.ops if o.startswith("aten.") and o.split(".")[1] in _CONV_OPS]


def _conv_block(cin, cout, k, stride, padding, bias, device, channels_last=False):
    block = nn.Sequential(nn.Conv2d(cin, cout, k, stride, padding, bias=bias), nn.BatchNorm2d(cout), nn.ReLU())
    with torch.no_grad():
        block[1].weight.uniform_(0.5, 1.5)
        block[1].bias.uniform_(-0.3, 0.3)
    block = block.to(device)
    if channels_last:
        block = block.to(memory_format=torch.channels_last)
    return block


@pytest.mark.parametrize(
    "cin,cout,k,stride,padding,bias,hw,batch,channels_last",
    [
        (3, 6, 3, 2, 1, True, 9, 2, False),     # 3x3 stride 2, conv bias
        (5, 7, 1, 1, 0, False, 7, 1, False),    # 1x1, batch 1, 7x7
        (3, 5, 7, 2, 3, False, 9, 2, True),     # the ResNet stem shape, channels_last
        (4, 9, 3, 1, 1, False, 15, 1, True),    # 3x3 stride 1, 15x15, channels_last
        (3, 6, 4, 1, "same", False, 7, 2, True),  # 'same' of an even kernel: the far side padded wider
    ],
    ids=["3x3s2-bias", "1x1-batch1", "7x7s2p3-cl", "3x3s1-cl", "4x4same-cl"],
)
def test_recompute_conv_bn_relu_runs_the_kernels(cin, cout, k, stride, padding, bias, hw, batch, channels_last,
                                                  device, strictly_fused_conv):
    """Three training steps: only x and the per-channel vectors kept, no aten conv/BN anywhere,
    gradients and running statistics equal to Conv2d -> BatchNorm2d -> ReLU's."""
    torch.manual_seed(1)
    block = _conv_block(cin, cout, k, stride, padding, bias, device, channels_last)
    _three_steps_like_eager(block, batch, hw, channels_last, device)


@pytest.mark.parametrize("conv,act,channels_last", [
    (lambda: nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False), nn.SiLU, True),       # MBConv's depthwise
    (lambda: nn.Conv2d(4, 8, 5, stride=2, padding=2, groups=4), nn.ReLU6, False),        # channel multiplier 2
    (lambda: nn.Conv2d(9, 6, 3, padding=2, dilation=2, groups=3), nn.Hardswish, True),   # 3 per group
    (lambda: nn.Conv2d(68, 32, 3, padding=1, groups=2), nn.ReLU, False),                 # 34 in, 16 out per group
], ids=["depthwise-silu-cl", "mult2-5x5s2-relu6", "grouped-dilated-hardswish-cl", "wide-groups-gemm"])
def test_recompute_grouped_conv_runs_the_kernels(conv, act, channels_last, device, direct_conv_kernels,
                                                  strictly_fused_conv):
    """The same of grouped and depthwise convs (the DIRECT kernels, opt-in, or the per-group implicit
    GEMM for wide groups; dX/dW by aten's conv backward)."""
    torch.manual_seed(2)
    block = nn.Sequential(conv(), nn.BatchNorm2d(conv().out_channels), act())
    with torch.no_grad():
        block[1].weight.uniform_(0.5, 1.5)
        block[1].bias.uniform_(-0.3, 0.3)
    block = block.to(device=device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    _three_steps_like_eager(block, 2, 7, channels_last, device)


def test_recompute_timm_conv2d_same_runs_the_kernels(device, strictly_fused_conv):
    """timm's Conv2dSame (TensorFlow's 'SAME', by the input's size: stride 2 on an even side pads its far
    side alone) the same way: x kept as it came, the padded copy transient."""
    from fusedrc.convert import _import_torchvision

    _import_torchvision()  # timm imports torchvision
    layers = pytest.importorskip("timm.layers", reason="timm is not installed (test extra)")
    torch.manual_seed(3)
    block = nn.Sequential(layers.Conv2dSame(3, 6, 3, stride=2, bias=False), nn.BatchNorm2d(6), nn.SiLU()).to(device)
    _three_steps_like_eager(block, 2, 8, False, device)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
def test_recompute_timm_mixed_conv_runs_the_kernels(channels_last, device, strictly_fused_conv):
    """timm's MixedConv2d (MixNet: the channels split among kernel sizes, 'same' padding of an even one
    wider on the far side) before a BatchNorm: one fused op per split on its share of the norm's
    channels and running statistics; x (the splits are views of it) and the vectors kept."""
    from fusedrc.convert import _import_torchvision

    _import_torchvision()
    layers = pytest.importorskip("timm.layers", reason="timm is not installed (test extra)")
    torch.manual_seed(5)
    mixed = layers.MixedConv2d(5, 7, [3, 4, 5], padding="same", bias=False)
    block = nn.Sequential(mixed, nn.BatchNorm2d(7), nn.ReLU()).to(device)
    assert [c.kernel_size for c in mixed.values()] == [(3, 3), (4, 4), (5, 5)]
    _three_steps_like_eager(block, 2, 7, channels_last, device)


@pytest.mark.parametrize("padding,k,channels_last", [("same", 4, False), ((2, 0, 1, 3), 3, True)],
                         ids=["same-4x4", "ltrb-3x3-cl"])
def test_functional_conv_bn_act_padding_wider_on_one_side(padding, k, channels_last, device, strictly_fused_conv):
    """``conv_bn_act(padding="same" | (left, right, top, bottom))``, either side the wider: output and
    every gradient (the residual's too) against the float64 composition of F.pad, conv, batch norm and
    SiLU; only the inputs (x as it came) and the per-channel vectors kept; no aten conv."""
    torch.manual_seed(4)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 3, 7, 6).to(memory_format=fmt)
    w, gamma, beta = torch.randn(5, 3, k, k) / 5, torch.rand(5) + 0.5, torch.randn(5)
    sides = (1, 2, 1, 2) if padding == "same" else padding  # (left, right, top, bottom)
    out = (7 + sides[2] + sides[3] - k + 1, 6 + sides[0] + sides[1] - k + 1)
    res, g = torch.randn(2, 5, *out), torch.randn(2, 5, *out)
    ours = [t.to(device).requires_grad_() for t in (x, w, gamma, beta, res)]
    rm, rv = torch.zeros(5, device=device), torch.ones(5, device=device)
    with SavedBytes() as saved, GemmCounter() as c:
        y = fusedrc.functional.conv_bn_act(ours[0], ours[1], ours[2], ours[3], rm, rv, padding=padding,
                                           residual=ours[4], activation="silu")
        grads = torch.autograd.grad(y, ours, g.to(device))
    # the inputs (x as it came, not its padded copy) and the per-channel mean and rstd
    assert saved.bytes == (sum(t.numel() for t in (x, w, gamma, beta, res)) + 2 * 5) * 4 and _conv_ops(c) == []
    ref64 = [t.double().requires_grad_() for t in (x, w, gamma, beta, res)]
    z = nn.functional.conv2d(nn.functional.pad(ref64[0], sides), ref64[1])
    ref = nn.functional.silu(nn.functional.batch_norm(z, None, None, ref64[2], ref64[3], True) + ref64[4])
    assert y.shape == ref.shape and rel_err(y, ref) < 1e-5
    assert rel_err(rm, 0.1 * z.detach().mean((0, 2, 3))) < 1e-5
    for name, got, want in zip(["dx", "dw", "dgamma", "dbeta", "dres"], grads, torch.autograd.grad(ref, ref64, g.double())):
        assert got.shape == want.shape and rel_err(got, want) < 1e-5, name


def _three_steps_like_eager(block, batch, hw, channels_last, device):
    ref = copy.deepcopy(block)
    cin, cout = block[0].in_channels, block[0].out_channels
    for _ in range(3):
        x = torch.randn(batch, cin, hw, hw, device=device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(True)
        xr = x.detach().clone().requires_grad_(True)
        with SavedBytes() as saved, GemmCounter() as c:
            y = fusedrc.recompute(block, x)
            g = torch.randn_like(y)
            y.backward(g)
        assert saved.bytes == x.numel() * 4 + 2 * cout * 4, "x, mean and rstd only"
        assert _conv_ops(c) == [], f"aten conv/BN ran on the triton path: {_conv_ops(c)}"
        y_ref = ref(xr)
        y_ref.backward(g)
        assert rel_err(y, y_ref) < 1e-5
        assert rel_err(x.grad, xr.grad) < 1e-5
        for (name, p), pr in zip(block.named_parameters(), ref.parameters()):
            if name == "0.bias":  # cancelled by BN: ~0, compare on the weight gradient's scale
                assert (p.grad - pr.grad).abs().max() < 1e-5 * block[0].weight.grad.abs().max()
            else:
                assert rel_err(p.grad, pr.grad) < 1e-5, name
    bn, bn_ref = block[1], ref[1]
    assert torch.allclose(bn.running_mean, bn_ref.running_mean, rtol=1e-5, atol=1e-6)
    assert torch.allclose(bn.running_var, bn_ref.running_var, rtol=1e-5, atol=1e-6)
    assert bn.num_batches_tracked.item() == bn_ref.num_batches_tracked.item() == 3


def test_conv_bn_relu_residual_module(device):
    """relu(bn(conv(x)) + identity): d(identity) right; keeps x, the identity and the vectors."""
    m = fusedrc.nn.ConvBNReLU(4, 6, 3, padding=1).to(device)
    conv, bn = nn.Conv2d(4, 6, 3, padding=1, bias=False).to(device), nn.BatchNorm2d(6).to(device)
    conv.load_state_dict(m.conv.state_dict())
    bn.load_state_dict(m.bn.state_dict())
    x = torch.randn(2, 4, 5, 5, device=device, requires_grad=True)
    idn = torch.randn(2, 6, 5, 5, device=device, requires_grad=True)
    with SavedBytes() as saved:
        y = m(x, idn)
    g = torch.randn_like(y)
    gx, gi = torch.autograd.grad(y, (x, idn), g)
    assert saved.bytes == (x.numel() + idn.numel() + 2 * 6) * 4
    y_ref = torch.relu(bn(conv(x)) + idn)
    gx_r, gi_r = torch.autograd.grad(y_ref, (x, idn), g)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(gx, gx_r) < 1e-5 and rel_err(gi, gi_r) < 1e-5


@pytest.mark.parametrize("bn_dtype", [torch.float32, torch.float16], ids=["bn-fp32", "bn-fp16"])
def test_conv_bn_relu_half_input(bn_dtype, device):
    """fp16 x and conv weight with BatchNorm parameters and statistics in fp32 (as under AMP) or fp16."""
    x = torch.randn(2, 3, 7, 7, device=device).half().requires_grad_(True)
    w = (torch.randn(5, 3, 3, 3, device=device) * 0.3).half().requires_grad_(True)
    gamma = torch.rand(5, device=device).add(0.5).to(bn_dtype).requires_grad_(True)
    beta = torch.randn(5, device=device).mul(0.2).to(bn_dtype).requires_grad_(True)
    rm = torch.zeros(5, device=device, dtype=bn_dtype)
    rv = torch.ones(5, device=device, dtype=bn_dtype)
    y = fusedrc.functional.conv_bn_act(x, w, gamma, beta, rm, rv, training=True, padding=1)
    assert y.dtype == torch.float16 and rm.dtype == rv.dtype == bn_dtype
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w, gamma, beta), g)
    assert [t.dtype for t in grads] == [torch.float16, torch.float16, bn_dtype, bn_dtype]
    xd, wd, gd, bd = (t.detach().double().requires_grad_(True) for t in (x, w, gamma, beta))
    rmd, rvd = torch.zeros(5, dtype=torch.float64, device=device), torch.ones(5, dtype=torch.float64, device=device)
    y_ref = torch.relu(torch.nn.functional.batch_norm(
        torch.nn.functional.conv2d(xd, wd, padding=1), rmd, rvd, gd, bd, True, 0.1, 1e-5))
    grads_ref = torch.autograd.grad(y_ref, (xd, wd, gd, bd), g.double())
    assert rel_err(y, y_ref) < 1e-2
    for o, r in zip(grads, grads_ref):
        assert rel_err(o, r) < 1e-2
    assert torch.allclose(rm.double(), rmd, atol=1e-3) and torch.allclose(rv.double(), rvd, atol=1e-3)


def test_conv_grouped_and_float64_take_correct_paths(device):
    """groups != 1 (3 out per group: the reference path by default) and float64 (reference op) are right
    on the triton backend."""
    for block, dtype in ((nn.Sequential(nn.Conv2d(4, 6, 3, groups=2), nn.BatchNorm2d(6), nn.ReLU()), torch.float32),
                         (_conv_block(3, 5, 3, 1, 1, False, "cpu", False), torch.float64)):
        block = block.to(device=device, dtype=dtype)
        ref = copy.deepcopy(block)
        x = torch.randn(2, block[0].in_channels, 6, 6, device=device, dtype=dtype, requires_grad=True)
        y = fusedrc.recompute(block, x)
        y.backward(torch.ones_like(y))
        xr = x.detach().clone().requires_grad_(True)
        ref(xr).backward(torch.ones_like(y))
        assert rel_err(x.grad, xr.grad) < 1e-6
        assert torch.allclose(block[1].running_var, ref[1].running_var)


def test_conv_bn_one_value_per_channel_raises_like_torch(device):
    m = fusedrc.nn.ConvBNReLU(3, 4, 1).to(device)
    x = torch.randn(1, 3, 1, 1, device=device)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        m(x)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        nn.BatchNorm2d(4)(torch.randn(1, 4, 1, 1))
    m.eval()
    assert m(x).shape == (1, 4, 1, 1)  # eval uses the running statistics


def test_conv_bn_relu_autocast_on_triton(device, strictly_fused_conv):
    """Under autocast the recognised conv pattern stays on the kernels and matches eager's dtype and values."""
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    block = _conv_block(3, 6, 3, 1, 1, False, device)
    ref = copy.deepcopy(block)
    x = torch.randn(2, 3, 6, 6, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=dtype), GemmCounter() as c:
        y = fusedrc.recompute(block, x)
    with torch.autocast(device.type, dtype=dtype):
        y_ref = ref(x)
    assert y.dtype == y_ref.dtype
    assert _conv_ops(c) == []
    assert rel_err(y, y_ref) < 3e-2
    assert torch.allclose(block[1].running_mean, ref[1].running_mean, rtol=1e-2, atol=1e-3)


def test_default_conv_path_on_this_device(device):
    """The default (CONV_Z="auto") on 16-bit operands: on a GPU, z from cuDNN's conv once in the
    forward and once in the backward (its rerun), the Triton passes over it; on the CPU, the Triton
    conv, no aten conv. Either way eager's results and only x and the vectors kept."""
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    block = _conv_block(8, 16, 3, 1, 1, False, device, channels_last=True)
    ref = copy.deepcopy(block)
    x = torch.randn(2, 8, 7, 7, device=device).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    with torch.autocast(device.type, dtype=dtype), GemmCounter() as c:
        with SavedBytes() as saved:
            y = fusedrc.recompute(block, x)
        y.float().square().sum().backward()
    with torch.autocast(device.type, dtype=dtype):
        ref(xr).float().square().sum().backward()
    convs = [o for o in _conv_ops(c) if o.split(".")[1] in ("convolution", "conv2d")]
    assert convs == (["aten.convolution.default"] * 2 if device.type == "cuda" else []), _conv_ops(c)
    assert not [o for o in _conv_ops(c) if "batch_norm" in o]
    # autocast's 16-bit copies of x and of the weight, mean and rstd
    assert saved.bytes == (x.numel() + block[0].weight.numel()) * 2 + 2 * 16 * 4, saved.bytes
    assert rel_err(x.grad, xr.grad) < 3e-2
    assert rel_err(block[0].weight.grad, ref[0].weight.grad) < 3e-2


def test_converted_inverted_residual_runs_the_kernels(device, monkeypatch, direct_conv_kernels,
                                                      strictly_fused_conv):
    """A converted MobileNetV2 block (expand 1x1 Conv-BN-ReLU6, depthwise 3x3 Conv-BN-ReLU6 on the
    DIRECT kernels, turned on, projection Conv-BN, identity add): two training steps match the block's own."""
    from fusedrc.convert import _import_torchvision
    from fusedrc.kernels import conv_bn_act as K

    try:
        tv = _import_torchvision()
    except ImportError:
        pytest.skip("torchvision is not installed (test extra)")
    torch.manual_seed(0)
    block = tv.models.mobilenetv2.InvertedResidual(8, 8, 1, 3).to(device).train()
    ref = copy.deepcopy(block)
    conv = fusedrc.convert(block)
    assert sorted(u.kind for u in conv.fusedrc_plan.units) == ["conv_bn", "conv_bn_act", "conv_bn_act"]
    seen = record_launches(monkeypatch, K)
    exact = copy.deepcopy(block).double()  # the judge: fp32 eager's own error on dgamma is ~1e-3 here
    for _ in range(2):
        x = torch.randn(2, 8, 6, 6, device=device, requires_grad=True)
        xr, xd = (x.detach().clone().requires_grad_(True) for _ in range(2))
        y, y_ref, y_exact = conv(x), ref(xr), exact(xd.double())
        assert rel_err(y, y_exact) < 1e-5
        g = torch.randn_like(y)
        for out in (y, y_ref, y_exact):
            out.backward(g.to(out.dtype))
        assert rel_err(x.grad, xd.grad) < 1e-5
    direct = [kw.get("DIRECT") for _, kw in seen]
    assert True in direct and False in direct  # the depthwise unit on DIRECT, the 1x1 units on the GEMM
    for (name, p), pr, pe in zip(conv.named_parameters(), ref.parameters(), exact.parameters()):
        # no worse than eager in fp32, both judged against float64
        assert rel_err(p.grad, pe.grad) <= 2 * rel_err(pr.grad, pe.grad) + 1e-5, name
    for b, br in zip([m for m in conv.modules() if isinstance(m, nn.BatchNorm2d)],
                     [m for m in ref.modules() if isinstance(m, nn.BatchNorm2d)]):
        assert torch.allclose(b.running_var, br.running_var, rtol=1e-5, atol=1e-6)
        assert b.num_batches_tracked.item() == br.num_batches_tracked.item() == 2
