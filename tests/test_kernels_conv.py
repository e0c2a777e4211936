"""Conv2d + BatchNorm2d + activation Triton kernels against the float64 reference.

Without a GPU these run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), where the tile table is replaced by 16x16x16 tiles: the
tiny, awkward shapes below still cover several tiles in M and N, ragged edges,
padding, stride, dilation, K loops over taps and channel blocks, and the split-K
of the weight gradient.
"""
import math

import pytest
import torch

triton = pytest.importorskip("triton")

import fusedrc  # noqa: E402
from fusedrc import reference as R  # noqa: E402
from fusedrc.kernels import conv_bn_act as K  # noqa: E402

from _utils import record_launches  # noqa: E402

# The DIRECT kernels are opt-in (measured slower than the reference path on an H200); this file's
# tests run with them on (tests/conftest.py: direct_conv_kernels), and on the Triton conv on a GPU
# too (strictly_fused_conv; a GPU's default takes z from cuDNN): tests of CONV_Z set it themselves.
_DEFAULT_DIRECT_MAX = K.DIRECT_MAX_GROUP_CHANNELS
_DEFAULT_CONV_Z = K.CONV_Z
pytestmark = pytest.mark.usefixtures("direct_conv_kernels", "strictly_fused_conv")

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
EPS = 1e-5
NAMES = ("dx", "dweight", "dbias", "dbn_weight", "dbn_bias", "dresidual")

# (N, C_in, H, W, C_out, k, stride, padding, dilation)
SHAPES = {
    "3x3s2": (2, 3, 7, 7, 5, 3, 2, 1, 1),
    "3x3s2d2": (2, 3, 7, 7, 5, 3, 2, 1, 2),
    "3x3s1": (1, 18, 5, 6, 17, 3, 1, 1, 1),
    "1x1": (2, 20, 5, 5, 7, 1, 1, 0, 1),
    "cout1": (2, 3, 6, 5, 1, 3, 1, 1, 1),
}
# grouped convs, the DIRECT kernels (opt-in): (N, C_in, H, W, C_out, k, stride, padding, dilation, groups)
GROUPED = {
    "dw3x3": (2, 18, 5, 6, 18, 3, 1, 1, 1, 18),      # depthwise, channels ragged over 16-wide tiles
    "dw5x5s2": (1, 17, 7, 7, 17, 5, 2, 2, 1, 17),    # MBConv's 5x5 stride-2 depthwise, batch 1
    "mult2": (2, 5, 6, 5, 10, 3, 2, 1, 1, 5),        # depthwise with a channel multiplier of 2
    "g4d2": (2, 12, 7, 6, 20, 3, 1, 2, 2, 4),        # ResNeXt-like: 3 in / 5 out per group, dilated
}
# wide groups, the implicit GEMM per group (more than DIRECT_MAX_GROUP_CHANNELS in, a multiple of 16 out)
GROUPED_GEMM = {
    "g2w34": (2, 68, 5, 5, 64, 3, 1, 1, 1, 2),       # 34 in / 32 out: two 16-wide tiles a group, ragged K
    "g3s2": (1, 120, 6, 7, 48, 3, 2, 1, 1, 3),       # 40 in / 16 out, stride 2, batch 1
}
ALL_SHAPES = {**SHAPES, **GROUPED, **GROUPED_GEMM}


def _d(t):
    return None if t is None else t.double()


def _rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)


def _rel(out, ref, den=None):
    assert out is not None and tuple(out.shape) == tuple(ref.shape), (None if out is None else out.shape, ref.shape)
    out = out.double()
    assert not torch.isnan(out).any(), "NaN in output"
    den = ref.norm().item() if den is None else den
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


def _inputs(shape, dtype, *, bias, affine, residual, device):
    N, C_in, H, W, C_out, k, s, p, d, *groups = shape
    groups = groups[0] if groups else 1
    oh = (H + 2 * p - d * (k - 1) - 1) // s + 1
    ow = (W + 2 * p - d * (k - 1) - 1) // s + 1
    cin_g = C_in // groups
    t = dict(
        x=_rand(N, C_in, H, W, dtype=dtype),
        weight=_rand(C_out, cin_g, k, k, dtype=dtype, scale=(cin_g * k * k) ** -0.5),
        bias=_rand(C_out, dtype=dtype, scale=0.5) if bias else None,
        bn_weight=(1 + 0.3 * torch.randn(C_out, dtype=torch.float64)).to(dtype) if affine else None,
        bn_bias=_rand(C_out, dtype=dtype, scale=0.3) if affine else None,
        running_mean=_rand(C_out, dtype=torch.float32, scale=0.2),
        running_var=(0.5 + torch.rand(C_out)).float(),
        residual=_rand(N, C_out, oh, ow, dtype=dtype) if residual else None,
        grad_out=_rand(N, C_out, oh, ow, dtype=dtype),
    )
    t = {k_: (None if v is None else v.to(device)) for k_, v in t.items()}
    geom = dict(stride=[s, s], padding=[p, p], dilation=[d, d], groups=groups)
    return t, geom


def _forward(mod, t, geom, training, activation="relu"):
    return mod.conv_bn_act_forward(
        t["x"], t["weight"], t["bias"], t["bn_weight"], t["bn_bias"], t["running_mean"], t["running_var"],
        t["residual"], training, EPS, geom["stride"], geom["padding"], geom["dilation"], activation, geom["groups"])


def _backward(mod, t, geom, mean, rstd, training, activation="relu"):
    return mod.conv_bn_act_backward(
        t["x"], t["weight"], t["bias"], t["bn_weight"], t["bn_bias"], mean, rstd, t["residual"], t["grad_out"],
        training, EPS, geom["stride"], geom["padding"], geom["dilation"], activation, None, geom["groups"])


def _check_all(t, geom, training, dtype, activation="relu"):
    """Forward and every gradient of the kernels vs the reference run in float64."""
    td = {k: _d(v) for k, v in t.items()}
    y, mean, rstd = _forward(K, t, geom, training, activation)
    y_r, mean_r, rstd_r = _forward(R, td, geom, training, activation)
    tol = TOL[dtype]
    assert y.dtype == dtype and mean.dtype == torch.float32 and rstd.dtype == torch.float32
    assert mean.shape == rstd.shape == (t["weight"].shape[0],)
    # a mean near 0 is judged against the channel's spread (rounding of z scales with it)
    mean_den = (mean_r.double().abs() + rstd_r.double().reciprocal()).norm().item()
    for name, o, r, den in (("y", y, y_r, None), ("mean", mean, mean_r, mean_den), ("rstd", rstd, rstd_r, None)):
        err = _rel(o, r, den)
        assert err < tol, f"{name}: rel err {err:.3e}"
    # the backward gets the kernels' own statistics (as the op does); the reference its own
    grads = _backward(K, t, geom, mean, rstd, training, activation)
    grads_r = _backward(R, td, geom, mean_r.double(), rstd_r.double(), training, activation)
    inputs = (t["x"], t["weight"], t["bias"], t["bn_weight"], t["bn_bias"], t["residual"])
    for name, o, r, inp in zip(NAMES, grads, grads_r, inputs):
        if inp is None:
            assert o is None, f"{name} should be None"
            continue
        assert o.dtype == inp.dtype, (name, o.dtype)
        den = None
        if name == "dbias" and training:
            # BN cancels the conv bias: its gradient is ~0, compare against its natural scale
            gamma = td["bn_weight"] if td["bn_weight"] is not None else torch.ones_like(rstd_r.double())
            m = y.numel() // y.shape[1]
            den = (gamma.abs() * rstd_r.double()).norm().item() * math.sqrt(m) * td["grad_out"].std().item()
        err = _rel(o, r, den)
        assert err < tol, f"{name}: rel err {err:.3e}"
    return y, grads


# --------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_conv_bn_relu_fp32(shape, training, device):
    t, geom = _inputs(SHAPES[shape], torch.float32, bias=True, affine=True, residual=False, device=device)
    _check_all(t, geom, training, torch.float32)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
def test_residual_and_affine(training, affine, device):
    t, geom = _inputs(SHAPES["3x3s2"], torch.float32, bias=False, affine=affine, residual=True, device=device)
    _check_all(t, geom, training, torch.float32)


@pytest.mark.parametrize("shape", ["3x3s2d2", "1x1"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_fp16(shape, training, device):
    t, geom = _inputs(SHAPES[shape], torch.float16, bias=True, affine=True, residual=True, device=device)
    _check_all(t, geom, training, torch.float16)


def test_channels_last(device):
    t, geom = _inputs(SHAPES["3x3s1"], torch.float32, bias=True, affine=True, residual=True, device=device)
    t["x"] = t["x"].contiguous(memory_format=torch.channels_last)
    t["residual"] = t["residual"].contiguous(memory_format=torch.channels_last)
    y, grads = _check_all(t, geom, True, torch.float32)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert grads[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("shape,fwd_recompute,bwd_twice,conv_grad,conv_z", [
    ("3x3s2d2", True, False, "triton", "triton"),
    ("3x3s2d2", False, True, "triton", "triton"),
    ("3x3s2d2", False, False, "aten", "triton"),
    ("3x3s2d2", "auto", "auto", "aten", "auto"),
    ("3x3s2d2", False, True, "aten", "aten"),
    # grouped (DIRECT): CONV_GRAD="triton" takes aten's grouped conv backward (the Triton dX/dW
    # kernels are groups=1 GEMMs); CONV_Z="aten" a grouped z
    ("mult2", True, False, "triton", "triton"),
    ("mult2", "auto", "auto", "aten", "auto"),
    ("mult2", False, True, "aten", "aten"),
    ("g2w34", True, False, "triton", "triton"),  # grouped GEMM
    ("g2w34", False, True, "aten", "aten"),
], ids=["fwd-recompute+bwd-buffer+triton-grad", "triton-conv-grad", "bwd-buffer", "auto", "aten-z",
        "grouped-fwd-recompute+bwd-buffer+triton-grad", "grouped-auto", "grouped-aten-z",
        "grouped-gemm-fwd-recompute+bwd-buffer+triton-grad", "grouped-gemm-aten-z"])
def test_strategies(shape, fwd_recompute, bwd_twice, conv_grad, conv_z, monkeypatch, device):
    """The measured-on-GPU alternatives give the same results as the defaults."""
    monkeypatch.setattr(K, "FWD_RECOMPUTE", fwd_recompute)
    monkeypatch.setattr(K, "BWD_RECOMPUTE_TWICE", bwd_twice)
    monkeypatch.setattr(K, "CONV_GRAD", conv_grad)
    monkeypatch.setattr(K, "CONV_Z", conv_z)
    t, geom = _inputs(ALL_SHAPES[shape], torch.float32, bias=True, affine=True, residual=True,
                      device=device)
    _check_all(t, geom, True, torch.float32)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_aten_z(training, channels_last, monkeypatch, device):
    """CONV_Z="aten": z from aten.convolution in both directions, every Triton pass reads it
    (FROM_Z, elementwise tiles: no Triton conv runs), results as the float64 reference."""
    monkeypatch.setattr(K, "CONV_Z", "aten")
    seen = record_launches(monkeypatch, K)
    t, geom = _inputs(SHAPES["3x3s1"], torch.float32, bias=True, affine=True, residual=True, device=device)
    if channels_last:
        t["x"] = t["x"].contiguous(memory_format=torch.channels_last)
    y, grads = _check_all(t, geom, training, torch.float32)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt) and grads[0].is_contiguous(memory_format=fmt)
    conv_kernels = [kw for name, kw in seen if name in ("_conv_bn_fwd_kernel", "_conv_bn_bwd_kernel")]
    assert len(conv_kernels) == (4 if training else 2)
    assert all(kw["FROM_Z"] and not kw.get("STORE_Z", False) for kw in conv_kernels)


@pytest.mark.parametrize("conv_z", ["triton", "aten"])
def test_switch_changes_kernel_passes(conv_z, monkeypatch, device):
    """The spy above sees the default's Triton conv passes (no FROM_Z in the backward) too."""
    monkeypatch.setattr(K, "CONV_Z", conv_z)
    seen = record_launches(monkeypatch, K)
    t, geom = _inputs(SHAPES["1x1"], torch.float32, bias=False, affine=True, residual=False, device=device)
    _check_all(t, geom, True, torch.float32)
    bwd = [kw["FROM_Z"] for name, kw in seen if name == "_conv_bn_bwd_kernel"]
    assert bwd == ([True, True] if conv_z == "aten" else [False, False])


# a stem: 7x7, stride 2, on 3 channels (K = 147: 10 flat steps of the interpreter's 16)
STEM = (2, 3, 11, 10, 12, 7, 2, 3, 1)


@pytest.mark.parametrize("flat_max", [K.FLAT_K_MAX_CHANNELS, 0], ids=["flat", "per-tap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_flat_k_loop(flat_max, dtype, training, monkeypatch, device):
    """Few input channels (a stem's 3): every conv pass walks K = (kh, kw, c) as one flat index
    (FLAT_K), BLOCK_K clamped to the whole K, and the results are the reference's; with the switch
    off (0), the per-tap loop, results the same. Layers with more channels never take it."""
    monkeypatch.setattr(K, "FLAT_K_MAX_CHANNELS", flat_max)
    seen = record_launches(monkeypatch, K)
    t, geom = _inputs(STEM, dtype, bias=False, affine=True, residual=True, device=device)
    _check_all(t, geom, training, dtype)
    conv = [kw for name, kw in seen if name in ("_conv_bn_fwd_kernel", "_conv_bn_bwd_kernel") and not kw["FROM_Z"]]
    assert conv and all(kw["FLAT_K"] is bool(flat_max) for kw in conv)
    if flat_max:
        assert K.flat_k(t["weight"], 1) and not K.flat_k(t["weight"].repeat(1, 3, 1, 1), 1)  # 9 channels
        assert not K.flat_k(t["weight"].repeat(3, 1, 1, 1), 3)  # grouped: never
        # on sm_90 in bf16: the table entry's 64, not clamped to a tap's 3 channels (16) as the
        # per-tap loop of 24 channels is (32)
        assert K.layer_config(t["weight"], 1, torch.bfloat16, "ieee", (9, 0)).BLOCK_K == 64
        assert K.layer_config(t["weight"].repeat(1, 8, 1, 1), 1, torch.bfloat16, "ieee", (9, 0)).BLOCK_K == 32


def test_flat_k_mask_consistency(monkeypatch, device):
    """The flat K loop's recomputed z is the forward's, bit for bit (fp16, training)."""
    _mask_consistency(STEM, torch.float16, True, "triton", monkeypatch, device)


def test_aten_z_layout_follows_the_kernels_buffer():
    """z from aten is handed to the kernels in the layout their stride arguments describe."""
    x = torch.randn(2, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    w = torch.randn(6, 4, 3, 3)
    for like_fmt in (torch.contiguous_format, torch.channels_last):
        like = torch.empty(2, 6, 5, 5).contiguous(memory_format=like_fmt)
        z = K._aten_z(x, w, None, [1, 1], [1, 1], [1, 1], like)
        assert z.stride() == like.stride()
        torch.testing.assert_close(z, torch.nn.functional.conv2d(x, w, None, 1, 1))


def test_conv_z_setting_is_checked(monkeypatch):
    monkeypatch.setattr(K, "CONV_Z", "cudnn")
    with pytest.raises(ValueError, match="CONV_Z"):
        K.conv_plan(torch.empty(1, 3, 4, 4), torch.empty(2, 3, 1, 1), 16, "ieee")


@pytest.mark.parametrize("c_in,c_out,k,expected", [
    (64, 64, 3, False),     # 3x3, compute-bound: a rerun costs more than writing and reading z
    (512, 512, 3, False),
    (64, 256, 1, True),     # 1x1 expanding: reading x is cheaper than a 4x wider z round trip
    (256, 64, 1, False),    # 1x1 reducing: x is 4x wider than z
    (3, 64, 3, True),       # stem-like, tiny C_in: the rerun is cheap
])
def test_auto_strategy_cost_model(c_in, c_out, k, expected):
    """"auto" reruns the conv only where the roofline estimate says it beats a z buffer (bf16)."""
    x = torch.empty(32, c_in, 28, 28, dtype=torch.bfloat16)
    w = torch.empty(c_out, c_in, k, k, dtype=torch.bfloat16)
    assert K._rerun_beats_buffer(x, w, 32 * 28 * 28, "ieee") is expected
    assert K._strategy("auto", x, w, 32 * 28 * 28, "ieee") is expected
    assert K._strategy(True, x, w, 1, "ieee") is True and K._strategy(False, x, w, 1, "ieee") is False


@pytest.mark.parametrize("c_in,c_out,k,expected", [
    (64, 64, 3, True),      # 3x3: compute-bound, cuDNN's GEMM speed pays for the z round trips
    (512, 512, 3, True),
    (64, 256, 1, False),    # 1x1: memory-bound, the fused epilogues' saved passes matter more
    (256, 64, 1, False),
    (512, 2048, 1, True),   # a wide 1x1 is compute-bound too (~200 flops per byte)
])
def test_aten_conv_cost_model(c_in, c_out, k, expected, monkeypatch):
    """The roofline guess "auto" goes by for fp32 operands on a GPU; "aten" takes z from aten whatever
    the shape; "auto" on the CPU never does (the interpreter's runs test the Triton conv)."""
    x = torch.empty(32, c_in, 28, 28, dtype=torch.bfloat16)
    w = torch.empty(c_out, c_in, k, k, dtype=torch.bfloat16)
    assert K._aten_conv_pays(x, w, 32 * 28 * 28, "ieee") is expected
    assert K._auto_z_from_aten("cuda", "fp32", lambda: K._aten_conv_pays(x, w, 32 * 28 * 28, "ieee")) is expected
    monkeypatch.setattr(K, "CONV_Z", "auto")
    assert K.conv_plan(x, w, 32 * 28 * 28, "ieee")[0] is False
    monkeypatch.setattr(K, "CONV_Z", "aten")
    assert K.conv_plan(x, w, 1, "ieee") == (True, False, False)


def test_default_conv_z_is_measured_choice():
    """The default, "auto": z from cuDNN on a GPU for 16-bit operands (measured faster on 14 of
    ResNet-50's 16 layer shapes, within 2% on the others), never on the CPU; fp32 on a GPU by the roofline."""
    assert _DEFAULT_CONV_Z == "auto"
    never = lambda: pytest.fail("the roofline is only asked for fp32 operands on a GPU")  # noqa: E731
    assert K._auto_z_from_aten("cuda", "16bit", never) is True
    for opclass in ("16bit", "tf32", "fp32"):
        assert K._auto_z_from_aten("cpu", opclass, never) is False
    for bound in (True, False):
        assert K._auto_z_from_aten("cuda", "tf32", lambda: bound) is bound

@pytest.mark.parametrize("fwd_recompute", [False, True], ids=["zbuf", "fwdrc"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_epilogue_split_same_bits(training, fwd_recompute, monkeypatch):
    """The forward's and the backward's epilogues on 1, 2 or 4 column slices give the same bits
    (C_out 40 over 32-wide tiles: the second tile's slices are partly and wholly masked). The
    forward's split epilogue runs in eval and with FWD_RECOMPUTE (normalize in the conv pass)."""
    if not K.interpreting():
        pytest.skip("the interpreter's tile is patched here; a GPU run covers the table's splits")
    monkeypatch.setattr(K, "FWD_RECOMPUTE", fwd_recompute)
    torch.manual_seed(0)
    t, geom = _inputs((2, 6, 5, 5, 40, 3, 1, 1, 1), torch.float32, bias=True, affine=True, residual=True,
                      device="cpu")
    outs = []
    for split in (1, 2, 4):
        monkeypatch.setattr(K, "_INTERPRETER_CONFIG", K.ConvConfig(16, 32, 16, 2, 4, 1, split))
        if split == 1:  # also against the float64 reference
            y, grads = _check_all(t, geom, training, torch.float32)
            outs.append((y, *grads))
        else:
            y, mean, rstd = _forward(K, t, geom, training)
            outs.append((y, *_backward(K, t, geom, mean, rstd, training)))
    for other in outs[1:]:
        for name, a, b in zip(("y",) + NAMES, outs[0], other):
            assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_conv_dx_dw_kernels(shape, dtype, device):
    """The Triton dX (transposed implicit GEMM) and split-K dW kernels against float64 aten."""
    t, geom = _inputs(SHAPES[shape], dtype, bias=False, affine=False, residual=False, device=device)
    x, w, dz = t["x"], t["weight"], t["grad_out"]
    prec, cap = K.dot_precision(x), K.device_capability(x)
    dx = K.conv_dx(dz, w, x.shape, torch.contiguous_format, geom["stride"], geom["padding"], geom["dilation"],
                   prec, cap)
    dw = K.conv_dw(dz, x, w.shape, geom["stride"], geom["padding"], geom["dilation"], prec, cap)
    rdx, rdw, _ = torch.ops.aten.convolution_backward(
        dz.double(), x.double(), w.double(), None, geom["stride"], geom["padding"], geom["dilation"],
        False, [0, 0], 1, [True, True, False])
    k = SHAPES[shape][1] * SHAPES[shape][5] ** 2
    assert dx.dtype == dtype and _rel(dx, rdx) < TOL[dtype] * math.sqrt(k)
    assert _rel(dw, rdw) < TOL[dtype] * math.sqrt(dz.numel() / dz.shape[1])


def test_running_buffers_untouched_and_deterministic(device, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # dX/dW are cuDNN's on a GPU
    t, geom = _inputs(SHAPES["3x3s2"], torch.float32, bias=True, affine=True, residual=True, device=device)
    rm, rv = t["running_mean"].clone(), t["running_var"].clone()
    y1, m1, r1 = _forward(K, t, geom, True)
    y2, m2, r2 = _forward(K, t, geom, True)
    assert torch.equal(t["running_mean"], rm) and torch.equal(t["running_var"], rv)
    assert torch.equal(y1, y2) and torch.equal(m1, m2) and torch.equal(r1, r2)
    g1 = _backward(K, t, geom, m1, r1, True)
    g2 = _backward(K, t, geom, m1, r1, True)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def _activations_launched(seen):
    """The ACTIVATION of every launch that applies it (forward APPLY passes, every backward pass)."""
    return {kw["ACTIVATION"] for name, kw in seen
            if name == "_conv_bn_bwd_kernel" or (name == "_conv_bn_fwd_kernel" and kw["APPLY"])}


@pytest.mark.parametrize("activation", ["relu2", "gelu", "gelu_tanh", "silu", "relu6", "hardswish", "quick_gelu",
                                        "leaky_relu:0.1", "none"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_activations(activation, training, monkeypatch, device):
    """Every activation of the dense kernels runs in the conv epilogues (residual and conv bias
    on), in the kernels, not through the reference path, against the float64 reference; "none" is
    Conv-BN without one."""
    seen = record_launches(monkeypatch, K)
    t, geom = _inputs(SHAPES["3x3s2"], torch.float32, bias=True, affine=True, residual=True, device=device)
    _check_all(t, geom, training, torch.float32, activation)
    assert _activations_launched(seen) == {activation.partition(":")[0]}
    if activation.startswith("leaky_relu"):  # the slope reaches the kernels
        assert {kw["NEG_SLOPE"] for _, kw in seen if kw.get("ACTIVATION") == "leaky_relu"} == {0.1}


@pytest.mark.parametrize("activation,conv_z", [("silu", "triton"), ("gelu", "aten")])
def test_activations_fp16_and_z_buffer(activation, conv_z, monkeypatch, device):
    """fp16, channels_last; also the passes that read a z buffer (CONV_Z="aten")."""
    monkeypatch.setattr(K, "CONV_Z", conv_z)
    seen = record_launches(monkeypatch, K)
    t, geom = _inputs(SHAPES["3x3s1"], torch.float16, bias=False, affine=True, residual=True, device=device)
    t["x"] = t["x"].contiguous(memory_format=torch.channels_last)
    _check_all(t, geom, True, torch.float16, activation)
    assert _activations_launched(seen) == {activation}


def _conv_launches(seen):
    """(kernel name, DIRECT) of every conv-pass launch (forward and backward kernels)."""
    return [(name, kw["DIRECT"]) for name, kw in seen if name in ("_conv_bn_fwd_kernel", "_conv_bn_bwd_kernel")]


@pytest.mark.parametrize("shape", list(GROUPED))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_grouped_conv(shape, training, monkeypatch, device):
    """Grouped convs (depthwise, channel multiplier, several channels per group) run the DIRECT
    kernels in every pass, conv bias, residual and BN affine on, against the float64 reference."""
    seen = record_launches(monkeypatch, K)
    t, geom = _inputs(GROUPED[shape], torch.float32, bias=True, affine=True, residual=True, device=device)
    _, grads = _check_all(t, geom, training, torch.float32)
    assert grads[1].shape == t["weight"].shape
    launches = _conv_launches(seen)
    assert launches and all(direct for _, direct in launches), launches
    assert {name for name, _ in launches} == {"_conv_bn_fwd_kernel", "_conv_bn_bwd_kernel"}


@pytest.mark.parametrize("shape,activation", [("dw3x3", "silu"), ("g4d2", "hardswish")])
def test_grouped_fp16_channels_last(shape, activation, device):
    """fp16 channels_last (MobileNet/EfficientNet under AMP), another activation."""
    t, geom = _inputs(GROUPED[shape], torch.float16, bias=False, affine=True, residual=True, device=device)
    t["x"] = t["x"].contiguous(memory_format=torch.channels_last)
    y, grads = _check_all(t, geom, True, torch.float16, activation)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert grads[0].is_contiguous(memory_format=torch.channels_last)


def test_direct_tile_choice():
    """Plain depthwise (1 channel per group in and out) takes the 64-wide DIRECT tile; a channel
    multiplier or several channels per group (runtime group widths) the half-wide one; the
    interpreter its tiny tile."""
    sm90 = (9, 0)
    assert K.direct_config(1, 1, sm90) == K._DIRECT_CONFIG and K._DIRECT_CONFIG.BLOCK_N == 64
    assert K.direct_config(1, 2, sm90) == K.direct_config(4, 4, sm90) == K._DIRECT_GROUPED_CONFIG
    assert K._DIRECT_GROUPED_CONFIG.BLOCK_N == 32
    assert K.direct_config(1, 1, None) == K._INTERPRETER_CONFIG


@pytest.mark.parametrize("shape", list(GROUPED_GEMM))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_grouped_gemm(shape, training, monkeypatch, device):
    """Groups wider than DIRECT_MAX_GROUP_CHANNELS with a multiple of 16 output channels each run the
    implicit GEMM per group (DIRECT off, the group's width passed), against the float64 reference."""
    seen = record_launches(monkeypatch, K)
    t, geom = _inputs(GROUPED_GEMM[shape], torch.float32, bias=True, affine=True, residual=True, device=device)
    _check_all(t, geom, training, torch.float32)
    groups = GROUPED_GEMM[shape][-1]
    launches = [kw for name, kw in seen if name in ("_conv_bn_fwd_kernel", "_conv_bn_bwd_kernel")]
    assert launches and not any(kw["DIRECT"] for kw in launches)
    cfg = K.layer_config(t["weight"], groups, torch.float32, "ieee", None)
    assert (t["weight"].shape[0] // groups) % cfg.BLOCK_N == 0


def test_grouped_gemm_fp16_channels_last_and_small_groups(monkeypatch, device):
    """fp16 channels_last; and a narrow group (3 in, K padded to 16) forced onto the per-group GEMM."""
    t, geom = _inputs(GROUPED_GEMM["g2w34"], torch.float16, bias=False, affine=True, residual=True, device=device)
    t["x"] = t["x"].contiguous(memory_format=torch.channels_last)
    y, grads = _check_all(t, geom, True, torch.float16, "silu")
    assert y.is_contiguous(memory_format=torch.channels_last)
    monkeypatch.setattr(K, "DIRECT_MAX_GROUP_CHANNELS", 0)
    t, geom = _inputs((2, 6, 5, 5, 32, 3, 1, 1, 1, 2), torch.float32, bias=True, affine=True, residual=False,
                      device=device)
    assert K.group_strategy(t["weight"], 2) == "gemm"
    _check_all(t, geom, True, torch.float32)


def test_grouped_gemm_on_the_gpu_tiles(monkeypatch):
    """The interpreter's 16-wide tile never narrows: with sm_90's fp32 entry (64x64, split epilogue) a
    group of 112 output channels gets 16-column tiles and one of 96 gets 32 (split in halves),
    several tiles a group, against the float64 reference."""
    if not K.interpreting():
        pytest.skip("the capability is patched to run the table's tiles under the interpreter")
    monkeypatch.setattr(K, "device_capability", lambda t: (9, 0))
    for shape in ((1, 72, 6, 5, 224, 3, 2, 1, 1, 2), (1, 66, 5, 5, 192, 3, 1, 2, 2, 2)):
        t, geom = _inputs(shape, torch.float32, bias=True, affine=True, residual=True, device="cpu")
        cfg = K.layer_config(t["weight"], shape[-1], torch.float32, "ieee", (9, 0))
        assert cfg.BLOCK_N in (16, 32) and cfg.BLOCK_M == 64
        _check_all(t, geom, True, torch.float32)


def test_group_strategy():
    """Which kernels a grouped conv's tiles run, and a GEMM tile never straddles two groups."""
    w = lambda c_out, c_in: torch.empty(c_out, c_in, 3, 3, device="meta")  # noqa: E731
    assert K.group_strategy(w(64, 64), 1) == "gemm"
    assert K.group_strategy(w(32, 1), 32) == K.group_strategy(w(256, 32), 8) == "direct"
    assert K.group_strategy(w(128, 64), 2) == K.group_strategy(w(224, 112), 2) == "gemm"  # RegNet 112 wide
    assert K.group_strategy(w(112, 56), 2) is None  # 56 out per group: no multiple of 16
    sm90 = (9, 0)
    for c_out, c_in, groups, block_n in ((128, 64, 2, 64), (224, 112, 2, 16), (96, 48, 2, 16), (192, 48, 2, 32)):
        cfg = K.layer_config(w(c_out, c_in), groups, torch.bfloat16, "ieee", sm90)
        assert cfg.BLOCK_N == block_n and (c_out // groups) % cfg.BLOCK_N == 0
        assert cfg.BLOCK_N // cfg.EPILOGUE_SPLIT >= 16
        assert cfg.BLOCK_M == K._TABLE[("sm90", "16bit", "narrow" if c_out // groups <= 64 else "wide")].BLOCK_M


def test_grouped_default_is_reference_or_group_gemm(monkeypatch, device):
    """By default (DIRECT off) depthwise and narrow groups take the reference path (cuDNN on CUDA),
    groups with a multiple of 16 output channels the implicit GEMM per group, a depthwise conv
    with a channel multiplier of 16 (one input channel a group: K is the taps alone) included."""
    assert _DEFAULT_DIRECT_MAX == 0
    monkeypatch.setattr(K, "DIRECT_MAX_GROUP_CHANNELS", _DEFAULT_DIRECT_MAX)
    w = lambda c_out, c_in: torch.empty(c_out, c_in, 3, 3, device="meta")  # noqa: E731
    assert K.group_strategy(w(32, 1), 32) is None  # depthwise
    assert K.group_strategy(w(128, 4), 32) is None  # ResNeXt-50 32x4d's first stage
    assert K.group_strategy(w(512, 16), 32) == K.group_strategy(w(64, 1), 4) == "gemm"  # 16 out per group
    assert K.group_strategy(w(64, 64), 1) == "gemm"
    t, geom = _inputs((2, 2, 6, 5, 32, 3, 2, 1, 1, 2), torch.float32, bias=True, affine=True, residual=True,
                      device=device)
    assert K.group_strategy(t["weight"], 2) == "gemm"
    _check_all(t, geom, True, torch.float32)


def test_wide_groups_take_the_reference_path(monkeypatch, device):
    """More channels per group than DIRECT_MAX_GROUP_CHANNELS and no multiple of 16 out: the launchers
    hand the call to the reference implementation (no Triton launch), forward and backward, with the
    grouped conv's results."""
    monkeypatch.setattr(K, "DIRECT_MAX_GROUP_CHANNELS", 2)
    seen = record_launches(monkeypatch, K)
    t, geom = _inputs(GROUPED["g4d2"], torch.float32, bias=True, affine=True, residual=True, device=device)
    _check_all(t, geom, True, torch.float32, "silu")
    assert not seen
    monkeypatch.setattr(K, "DIRECT_MAX_GROUP_CHANNELS", 3)
    _check_all(t, geom, True, torch.float32, "silu")
    assert _conv_launches(seen)


def test_large_mean_stats(device):
    """Channel means far from 0 relative to the spread: shifted partials keep the variance exact."""
    t, geom = _inputs(SHAPES["1x1"], torch.float32, bias=True, affine=True, residual=False, device=device)
    t["bias"] = torch.full_like(t["bias"], 300.0)
    td = {k: _d(v) for k, v in t.items()}
    _, mean, rstd = _forward(K, t, geom, True)
    _, mean_r, rstd_r = _forward(R, td, geom, True)
    assert _rel(mean, mean_r) < 1e-6
    assert _rel(rstd, rstd_r) < 1e-4


# --------------------------------------------------------------------------- mask and NaN
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("conv_z", ["triton", "aten"])
def test_mask_consistency(dtype, training, conv_z, monkeypatch, device):
    """Pre-activations crowded around 0: the backward's recomputed ReLU mask equals the forward's y > 0."""
    _mask_consistency(SHAPES["3x3s1"], dtype, training, conv_z, monkeypatch, device)


@pytest.mark.parametrize("shape", ["dw3x3", "g4d2", "g2w34"])
def test_grouped_mask_consistency(shape, monkeypatch, device):
    """The same of the DIRECT and the grouped GEMM kernels (fp16, training: the recomputed z is the
    forward's, bit for bit)."""
    _mask_consistency(ALL_SHAPES[shape], torch.float16, True, "triton", monkeypatch, device)


def _mask_consistency(shape, dtype, training, conv_z, monkeypatch, device):
    monkeypatch.setattr(K, "CONV_Z", conv_z)
    t, geom = _inputs(shape, dtype, bias=True, affine=True, residual=True, device=device)
    td = {k: _d(v) for k, v in t.items()}
    # residual = -BN(conv(x)) in float64, rounded: pre-activations are rounding noise around 0
    z = torch.nn.functional.conv2d(td["x"], td["weight"], td["bias"], geom["stride"], geom["padding"],
                                   geom["dilation"], geom["groups"])
    if training:
        bn_out = torch.nn.functional.batch_norm(z, None, None, td["bn_weight"], td["bn_bias"], True, 0.0, EPS)
    else:
        bn_out = torch.nn.functional.batch_norm(z, td["running_mean"], td["running_var"], td["bn_weight"],
                                                td["bn_bias"], False, 0.0, EPS)
    t["residual"] = (-bn_out).to(dtype)
    t["grad_out"] = torch.ones_like(t["grad_out"])
    y, mean, rstd = _forward(K, t, geom, training)
    dres = _backward(K, t, geom, mean, rstd, training)[5]
    fwd_mask = y > 0
    assert 0 < fwd_mask.sum() < fwd_mask.numel()  # both sides are populated
    assert torch.equal(fwd_mask, dres != 0)
    assert (y[~fwd_mask] == 0).all()


@pytest.mark.parametrize("activation,shape", [("relu", "3x3s1"), ("silu", "3x3s1"), ("gelu_tanh", "3x3s1"),
                                              ("relu", "dw3x3"), ("relu", "g3s2")])
def test_nan_propagation(activation, shape, device):
    """NaN in x and in the residual: the NaN pattern of y and of the residual's gradient (the
    activation's derivative at a NaN or infinite pre-activation) is torch's."""
    t, geom = _inputs(ALL_SHAPES[shape], torch.float32, bias=False, affine=True, residual=True,
                      device=device)
    t["x"][0, 1, 2, 3] = float("nan")
    t["residual"][0, 2, 0, 0] = float("nan")
    t["residual"][0, 3, 1, 1] = float("inf")
    t["residual"][0, 4, 1, 2] = -float("inf")
    td = {k: _d(v) for k, v in t.items()}
    for training in (False, True):
        y, mean, rstd = _forward(K, t, geom, training, activation)
        y_r, mean_r, rstd_r = _forward(R, td, geom, training, activation)
        nan = torch.isnan(y)
        assert nan.any()
        assert torch.equal(nan, torch.isnan(y_r)), "NaN pattern differs from torch"
        if (~nan).any():
            assert torch.allclose(y[~nan].double(), y_r[~nan], rtol=1e-4, atol=1e-5)
        dres = _backward(K, t, geom, mean, rstd, training, activation)[5]
        dres_r = _backward(R, td, geom, mean_r, rstd_r, training, activation)[5]
        assert torch.equal(torch.isnan(dres), torch.isnan(dres_r)), "NaN pattern of the gradient differs"


# --------------------------------------------------------------------------- running statistics
@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("momentum, n", [(0.1, 98), (1 / 3, 2), (1.0, 1)], ids=["m0.1", "cumulative", "n1"])
def test_running_stats_update_kernel(buf_dtype, momentum, n, monkeypatch, device):
    """One launch updates the buffers as the reference's four aten ops do (in fp32, rounded once
    to the buffers' dtype), strided buffers and channels ragged over the block included; their
    version counters stay as they were, as BatchNorm's kernel leaves them."""
    C = 37
    mean = torch.randn(C, device=device)
    rstd = torch.rand(C, device=device) * 4 + 0.1
    base = torch.randn(2, 2 * C, device=device).abs_().add_(0.5).to(buf_dtype)
    rm, rv = base[0, ::2], base[1, ::2]  # every other element: stride 2
    between = base[:, 1::2].clone()
    rm_ref, rv_ref = rm.double().clone(), rv.double().clone()
    versions = rm._version, rv._version
    seen = record_launches(monkeypatch, K)
    K.update_running_stats_(rm, rv, mean, rstd, EPS, momentum, n)
    assert [name for name, _ in seen] == ["_bn_running_update_kernel"]
    assert (rm._version, rv._version) == versions
    var = (rstd.double() ** -2 - EPS) * n / max(n - 1, 1)
    rm_ref += momentum * (mean.double() - rm_ref)
    rv_ref += momentum * (var - rv_ref)
    tol = 1e-6 if buf_dtype == torch.float32 else 1e-3
    assert rm.dtype == buf_dtype and _rel(rm, rm_ref) < tol and _rel(rv, rv_ref) < tol
    assert torch.equal(base[:, 1::2], between)  # the elements between the strided ones untouched


def test_running_stats_update_falls_back_to_the_reference(monkeypatch, device):
    """float64 statistics (the reference path's, for float64 input) take the reference's aten ops."""
    f64 = dict(device=device, dtype=torch.float64)
    mean, rstd = torch.randn(5, **f64), torch.rand(5, **f64) + 1
    rm, rv = torch.zeros(5, **f64), torch.ones(5, **f64)
    rm2, rv2 = rm.clone(), rv.clone()
    seen = record_launches(monkeypatch, K)
    K.update_running_stats_(rm, rv, mean, rstd, EPS, 0.1, 10)
    assert not seen
    R.update_running_stats_(rm2, rv2, mean, rstd, EPS, 0.1, 10)
    assert torch.equal(rm, rm2) and torch.equal(rv, rv2) and not torch.equal(rm, torch.zeros_like(rm))


def test_running_stats_update_bf16_buffers(monkeypatch, device):
    """bf16 buffers (a model cast to bf16): the kernel on a GPU, rounded once from fp32; the
    reference's ops under the interpreter (its bf16 arithmetic is broken)."""
    mean, rstd = torch.randn(40, device=device), torch.rand(40, device=device) + 0.5
    rm, rv = torch.zeros(40, device=device, dtype=torch.bfloat16), torch.ones(40, device=device, dtype=torch.bfloat16)
    seen = record_launches(monkeypatch, K)
    K.update_running_stats_(rm, rv, mean, rstd, EPS, 0.1, 50)
    assert [name for name, _ in seen] == ([] if K.interpreting() else ["_bn_running_update_kernel"])
    var = (rstd.double() ** -2 - EPS) * 50 / 49
    assert _rel(rm, 0.1 * mean.double()) < 1e-2 and _rel(rv, 0.9 + 0.1 * var) < 1e-2


def test_training_step_updates_running_stats_in_one_launch(monkeypatch, device):
    """Through the module: the forward's launches end with the update; no aten arithmetic on the
    buffers (their version counters unchanged) and the statistics match nn.BatchNorm2d's after three
    steps with a cumulative average (momentum None)."""
    conv = torch.nn.Conv2d(3, 6, 3, padding=1, bias=True).to(device)
    bn = torch.nn.BatchNorm2d(6, momentum=None).to(device)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1, bias=True), torch.nn.BatchNorm2d(6, momentum=None),
                              torch.nn.ReLU()).to(device)
    ref[0].load_state_dict(conv.state_dict())
    fused = fusedrc.nn.ConvBNReLU.from_modules(conv, bn)
    versions = bn.running_mean._version, bn.running_var._version
    seen = record_launches(monkeypatch, K)
    with fusedrc.use_backend("triton"):
        for _ in range(3):
            x = torch.randn(2, 3, 5, 5, device=device)
            del seen[:]
            fused(x)
            ref(x)
            assert seen[-1][0] == "_bn_running_update_kernel"
    assert (bn.running_mean._version, bn.running_var._version) == versions
    assert torch.allclose(bn.running_mean, ref[1].running_mean, rtol=1e-5, atol=1e-6)
    assert torch.allclose(bn.running_var, ref[1].running_var, rtol=1e-5, atol=1e-6)
    assert int(bn.num_batches_tracked) == 3


# --------------------------------------------------------------------------- through the op
def test_functional_autograd_matches_modules(device):
    """fusedrc.functional.conv_bn_act on the triton backend vs Conv2d -> BatchNorm2d -> ReLU."""
    conv = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1, bias=False).to(device)
    bn = torch.nn.BatchNorm2d(5).to(device)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 3, 7, 7, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    with fusedrc.use_backend("triton"):
        y = fusedrc.functional.conv_bn_act(
            x, conv.weight, bn.weight, bn.bias, rm, rv, training=True, momentum=bn.momentum, eps=bn.eps,
            stride=2, padding=1)
    g = torch.randn_like(y)
    gx, gw, gg, gb = torch.autograd.grad(y, (x, conv.weight, bn.weight, bn.bias), g)
    y_ref = torch.relu(bn(conv(x_ref)))
    gx_r, gw_r, gg_r, gb_r = torch.autograd.grad(y_ref, (x_ref, conv.weight, bn.weight, bn.bias), g)
    for o, r in ((y, y_ref), (gx, gx_r), (gw, gw_r), (gg, gg_r), (gb, gb_r)):
        assert _rel(o, r.double()) < 1e-5
    assert torch.allclose(rm, bn.running_mean, atol=1e-6) and torch.allclose(rv, bn.running_var, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("op", ["conv_bn_act", "bn_act_conv"])
@pytest.mark.parametrize("k", [1, 3])
def test_weight_gradient_is_accumulated_without_a_copy(backend, op, k, device):
    """A channels_last model's conv weight gets its gradient in its own layout, which autograd's
    accumulation takes as it is: no dense row-major copy in the op and no copy back into the
    weight's layout after it."""
    fmt = torch.channels_last
    conv = torch.nn.Conv2d(6, 5, k, padding=k // 2, bias=False).to(device, memory_format=fmt)
    bn = torch.nn.BatchNorm2d(6 if op == "bn_act_conv" else 5).to(device)
    x = torch.randn(2, 6, 5, 5, device=device).contiguous(memory_format=fmt).requires_grad_(True)
    ptrs = []
    conv.weight.register_hook(lambda g: ptrs.append((g.data_ptr(), g.stride())))  # no reference kept
    with fusedrc.use_backend(backend):
        if op == "conv_bn_act":
            y = fusedrc.functional.conv_bn_act(x, conv.weight, bn.weight, bn.bias, None, None, padding=k // 2)
        else:
            y = fusedrc.functional.bn_act_conv(x, bn.weight, bn.bias, None, None, conv.weight, padding=k // 2)
        y.sum().backward()
    (ptr, stride), = ptrs
    assert conv.weight.grad.data_ptr() == ptr  # stolen by the accumulation, not cloned
    assert all(n == 1 or a == b for n, a, b in zip(conv.weight.shape, stride, conv.weight.stride()))
    ref = torch.nn.functional.conv2d(
        torch.relu(torch.nn.functional.batch_norm(x, None, None, bn.weight, bn.bias, True)) if op == "bn_act_conv"
        else x, conv.weight, padding=k // 2)
    if op == "conv_bn_act":
        ref = torch.relu(torch.nn.functional.batch_norm(ref, None, None, bn.weight, bn.bias, True))
    g_ref, = torch.autograd.grad(ref.sum(), conv.weight)
    assert _rel(conv.weight.grad, g_ref.double()) < 1e-5


def test_samples_past_32_bit_offsets_take_the_reference_path(monkeypatch):
    # in-sample offsets are 32-bit in the kernels: a sample of >= 2**31 elements (x's or the
    # output's) must not reach them (shapes only: meta tensors, which pass the device check only
    # as the interpreter's CPU tensors do: on a GPU host it is patched so)
    monkeypatch.setattr(K, "interpreting", lambda: True)
    w = torch.empty(64, 48, 1, 1, device="meta")
    small = torch.empty(2, 48, 64, 64, device="meta")
    assert K._supported(small, w, "relu", (1, 1), (0, 0), (1, 1))
    big_x = torch.empty(1, 48, 8192, 8192, device="meta")  # 3.2e9 elements in one sample
    assert not K._supported(big_x, w, "relu", (4096, 4096), (0, 0), (1, 1))
    wide_out = torch.empty(1, 48, 6000, 6000, device="meta")  # x fits (1.7e9), the output (2.3e9) does not
    assert not K._supported(wide_out, w, "relu", (1, 1), (0, 0), (1, 1))
    strided = small.as_strided(small.shape, (48 * 64 * 64, 2**26, 64, 1))  # a huge channel stride
    assert not K._supported(strided, w, "relu", (1, 1), (0, 0), (1, 1))
    # the residual keeps the caller's strides: a view of a huge buffer must not reach them either
    residual = torch.empty(2, 64, 64, 64, device="meta")
    assert K._supported(small, w, "relu", (1, 1), (0, 0), (1, 1), 1, residual)
    far = residual.as_strided(residual.shape, (64 * 64 * 64, 2**26, 64, 1))
    assert not K._supported(small, w, "relu", (1, 1), (0, 0), (1, 1), 1, far)
