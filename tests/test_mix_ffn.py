"""SegFormer's Mix-FFN (fc1 -> depthwise conv over the token grid -> act -> [dropout] -> fc2): the reference
against the modules, the Triton kernels against the float64 reference (Triton's interpreter on the CPU, small
grids spanning several tiles and image edges), the op's saved bytes, bad input, and the modules it replaces.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as TF

import fusedrc
from fusedrc import reference as R
from _utils import SavedBytes, backend_device, rel_err
from test_kernels_dense import TOL, _check, _d, _rand

NAMES = ["out", "dx", "dw1", "db1", "dw_dw", "db_dw", "dw2", "db2"]


def _inputs(B, height, width, K, H, N, k, dtype, device, bias=True):
    M = B * height * width
    x = _rand(M, K, dtype=dtype, device=device)
    w1 = _rand(H, K, dtype=dtype, device=device, scale=K ** -0.5)
    wd = _rand(H, 1, k, k, dtype=dtype, device=device, scale=1.0 / k)
    w2 = _rand(N, H, dtype=dtype, device=device, scale=H ** -0.5)
    b1, bd, b2 = ((_rand(n, dtype=dtype, device=device, scale=0.5) if bias else None) for n in (H, H, N))
    return (x, w1, b1, wd, bd, w2, b2), _rand(M, N, dtype=dtype, device=device)


class _HFMixFFN(nn.Module):
    """The modules' computation as Hugging Face's SegformerMixMLP writes it (the oracle of the reference)."""

    def __init__(self, K, H, N, k, bias=True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(K, H, bias=bias), nn.Linear(H, N, bias=bias)
        self.dwconv = nn.Conv2d(H, H, k, 1, k // 2, groups=H, bias=bias)

    def forward(self, x, height, width):
        h = self.fc1(x)
        B, _, C = h.shape
        h = self.dwconv(h.transpose(1, 2).view(B, C, height, width)).flatten(2).transpose(1, 2)
        return self.fc2(TF.gelu(h))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("k", [3, 5])
def test_reference_is_the_modules(k, bias):
    """The reference's forward and every gradient equal the modules' autograd bit for bit on the CPU (the same
    aten ops), a gradient masked off is None and the others unchanged."""
    B, height, width = 2, 4, 6
    m = _HFMixFFN(8, 20, 8, k, bias)
    x = torch.randn(B, height * width, 8, requires_grad=True)
    y = m(x, height, width)
    g = torch.randn_like(y)
    params = [x, m.fc1.weight, m.fc1.bias, m.dwconv.weight, m.dwconv.bias, m.fc2.weight, m.fc2.bias]
    expected = torch.autograd.grad(y, [p for p in params if p is not None], g)
    args = (x.detach().reshape(-1, 8), *params[1:])
    assert torch.equal(R.mix_ffn_forward(*args, height, width, "gelu"), y.detach().reshape(-1, 8))
    got = R.mix_ffn_backward(*args, g.reshape(-1, 8), height, width, "gelu")
    got = [t for t, p in zip(got, params) if p is not None]
    for a, b in zip(got, expected):
        assert torch.equal(a.reshape(b.shape), b)
    mask = [False, True, True, False, True, False, True]  # dw1, db1, db_dw, db2 (dx, dw_dw, dw2 off)
    masked = R.mix_ffn_backward(*args, g.reshape(-1, 8), height, width, "gelu", output_mask=mask)
    full = R.mix_ffn_backward(*args, g.reshape(-1, 8), height, width, "gelu")
    for want, a, b in zip(mask, masked, full):
        assert (a is None) if not want or b is None else torch.equal(a, b)


# (B, height, width, K, H, N, k): images whose rows and edges cross the interpreter's 16 x 16 tiles
SHAPES = [(2, 5, 7, 12, 40, 9, 3), (1, 3, 11, 8, 20, 8, 5), (3, 1, 1, 4, 4, 4, 3)]


@pytest.mark.parametrize("act", ["gelu", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernels_against_float64(shape, dtype, act, device):
    from fusedrc.kernels import mix_ffn

    B, height, width, K, H, N, k = shape
    args, g = _inputs(B, height, width, K, H, N, k, dtype, device, bias=act == "gelu")
    out = mix_ffn.mix_ffn_forward(*args, height, width, act)
    grads = mix_ffn.mix_ffn_backward(*args, g, height, width, act)
    ref = [R.mix_ffn_forward(*map(_d, args), height, width, act),
           *R.mix_ffn_backward(*map(_d, args), _d(g), height, width, act)]
    _check([out, *grads], ref, dtype, NAMES)


def test_kernels_dropout_and_recompute(device):
    """With dropout the kernels apply Philox's mask (``reference.philox_keep``, the FFN's) to the activation
    and to its gradient; the grad kernel's recomputed activation equals the forward kernel's bit for bit, on a
    tile of another shape (taller: fewer weight-gradient partials), as on a GPU."""
    from fusedrc.kernels import mix_ffn

    for tiles in ((mix_ffn._INTERPRETER_TILE, mix_ffn._INTERPRETER_GRAD_TILE), (mix_ffn._GPU_TILE, mix_ffn._GPU_GRAD_TILE)):
        (fm, fc, _), (gm, gc, _) = tiles
        assert gm > fm and gm * gc == fm * fc

    B, height, width, K, H, N, k, p = 2, 5, 7, 12, 40, 9, 3, 0.3
    args, g = _inputs(B, height, width, K, H, N, k, torch.float32, device)
    x, w1, b1, wd, bd, w2, b2 = args
    seed = torch.tensor([1234], device=device)
    h1 = x @ w1.t() + b1
    a = mix_ffn.dwconv_act(h1, wd, bd, height, width, "gelu", dropout=(p, seed))
    _, a_again, _, _ = mix_ffn.dwconv_act_grad(h1, wd, bd, torch.ones_like(h1), height, width, "gelu",
                                               store_act=True, dropout=(p, seed))
    assert torch.equal(a, a_again)
    keep = R.philox_keep(1234, h1.shape[0], H, p).double().to(device) / (1 - p)
    assert 0.5 < keep.ne(0).double().mean().item() < 0.9
    d = [_d(t) for t in args]
    h2 = R._dwconv_tokens(d[0] @ d[1].t() + d[2], d[3], d[4], height, width).requires_grad_()
    out_ref = TF.linear(TF.gelu(h2) * keep, d[5], d[6])
    assert rel_err(mix_ffn.mix_ffn_forward(*args, height, width, "gelu", p, seed), out_ref) < 1e-5
    grads = mix_ffn.mix_ffn_backward(*args, g, height, width, "gelu", p, seed)
    (gh2,) = torch.autograd.grad(out_ref, h2, _d(g))
    got_gh2, _, _, _ = mix_ffn.dwconv_act_grad(h1, wd, bd, g @ w2, height, width, "gelu", dropout=(p, seed))
    assert rel_err(got_gh2, gh2) < 1e-5
    dw2 = _d(g).t() @ (TF.gelu(h2) * keep)
    assert rel_err(grads[5], dw2) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_op_keeps_only_x_and_matches_the_modules(backend):
    """Through autograd on each backend: outputs and every gradient against the modules; the op keeps x (and
    the seed) where the modules keep fc1's, the conv's and the activation's outputs too."""
    device = backend_device(backend)
    B, height, width, K, H = 2, 4, 5, 8, 32
    m = _HFMixFFN(K, H, K, 3).to(device)
    x = torch.randn(B, height * width, K, device=device, requires_grad=True)
    params = [x, *m.parameters()]
    with SavedBytes() as plain_saved:
        y = m(x, height, width)
    g = torch.randn_like(y)
    expected = torch.autograd.grad(y, params, g)
    with fusedrc.use_backend(backend), SavedBytes() as fused_saved:
        yf = fusedrc.functional.mix_ffn(x, height, width, m.fc1.weight, m.fc1.bias, m.dwconv.weight, m.dwconv.bias,
                                        m.fc2.weight, m.fc2.bias, "gelu")
    assert yf.shape == y.shape and rel_err(yf, y) < 1e-5
    for a, b in zip(torch.autograd.grad(yf, params, g), expected):
        assert rel_err(a, b) < 1e-5
    assert fused_saved.bytes == x.numel() * x.element_size()
    assert plain_saved.bytes >= x.numel() * x.element_size() * (1 + 3 * H // K)


def test_module_and_dropout():
    """``fusedrc.nn.MixFFN``: its state_dict is timm's PVT-v2 MLP's names; eval equals the modules; a training
    dropout zeroes about p of the hidden activation (fc2 without bias: zero rows come out where every hidden
    element of a token is dropped, never otherwise); a swapped conv runs the modules."""
    ffn = fusedrc.nn.MixFFN(8, 16, dropout=0.5, bias=False)
    assert set(ffn.state_dict()) == {"fc1.weight", "dwconv.weight", "fc2.weight"}
    x = torch.randn(3, 6 * 4, 8)
    ref = R.mix_ffn_forward(x.reshape(-1, 8), ffn.fc1.weight, None, ffn.dwconv.weight, None, ffn.fc2.weight, None,
                            6, 4, "gelu").reshape(3, 24, 8)
    ffn.eval()
    assert torch.allclose(ffn(x, 6, 4), ref, atol=1e-6)
    ffn.train()
    y1, y2 = ffn(x, 6, 4), ffn(x, 6, 4)
    assert not torch.equal(y1, y2)
    ffn.dwconv = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False, padding_mode="reflect")
    ffn.eval()
    h = ffn.dwconv(ffn.fc1(x).transpose(1, 2).reshape(3, 16, 6, 4)).flatten(2).transpose(1, 2)
    assert torch.allclose(ffn(x, 6, 4), ffn.fc2(TF.gelu(h)), atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_frozen_parameters_and_views(backend):
    """Gradients autograd does not want are not computed (output_mask): a frozen fc1 and conv, an input that needs
    none, frozen fc2; each remaining gradient equals the full backward's; a strided view of x is taken as is."""
    device = backend_device(backend)
    m = _HFMixFFN(8, 24, 8, 3).to(device)
    base = torch.randn(2, 8, 20, device=device)
    for frozen in (("fc1.weight", "fc1.bias", "dwconv.weight"), ("fc2.weight", "fc2.bias", "dwconv.bias"), ()):
        for n, p in m.named_parameters():
            p.requires_grad_(n not in frozen)
        x = base.transpose(1, 2).requires_grad_(not frozen)  # (2, 20, 8), not contiguous
        args = (m.fc1.weight, m.fc1.bias, m.dwconv.weight, m.dwconv.bias, m.fc2.weight, m.fc2.bias)
        with fusedrc.use_backend(backend):
            y = fusedrc.functional.mix_ffn(x, 4, 5, *args)
        g = torch.randn_like(y)
        wanted = [t for t in (x, *args) if t.requires_grad]
        got = torch.autograd.grad(y, wanted, g)
        xd = x.detach().double().requires_grad_(x.requires_grad)
        ref = R.mix_ffn_forward(xd.reshape(-1, 8), *(_d(t).requires_grad_(t.requires_grad) for t in args), 4, 5,
                                "gelu")
        assert rel_err(y.reshape(-1, 8), ref) < 1e-5
        full = R.mix_ffn_backward(xd.detach().reshape(-1, 8), *map(_d, args), _d(g).reshape(-1, 8), 4, 5, "gelu")
        expected = [f for t, f in zip((x, *args), full) if t.requires_grad]
        for a, b in zip(got, expected):
            assert rel_err(a.reshape(b.shape), b) < 1e-5


def test_autocast_and_compile():
    """Under CPU bf16 autocast the op casts as F.linear / F.conv2d do (outputs and gradients as the modules'
    under the same autocast); torch.compile (aot_eager, reference backend) traces it without a graph break."""
    m = _HFMixFFN(8, 24, 8, 3)
    x = torch.randn(2, 20, 8, requires_grad=True)
    args = (m.fc1.weight, m.fc1.bias, m.dwconv.weight, m.dwconv.bias, m.fc2.weight, m.fc2.bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fusedrc.functional.mix_ffn(x, 4, 5, *args)
        y_ref = m(x, 4, 5)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [x, *args], g), torch.autograd.grad(y_ref, [x, *args], g)):
        assert a.dtype == b.dtype and rel_err(a, b) < 1e-2

    def f(x):
        return fusedrc.functional.mix_ffn(x, 4, 5, *args, activation="relu").sum()

    with fusedrc.use_backend("reference"):
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        (gc,) = torch.autograd.grad(compiled(x), x)
        (ge,) = torch.autograd.grad(f(x), x)
    assert torch.allclose(gc, ge, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_relu_first(backend):
    """PVT-v2's linear variant, ``dwconv(relu(fc1(x)))``: the reference as the modules bit for bit, the Triton
    kernels against float64 (the ReLU in every tap's load and through the conv's transpose), through autograd;
    with pre-activations at exactly 0 (relu's kink: torch passes no gradient there)."""
    device = backend_device(backend)
    B, height, width, K, H, N = 2, 5, 7, 12, 40, 9
    m = _HFMixFFN(K, H, N, 3).to(device)
    with torch.no_grad():
        m.fc1.weight[:3] = 0.0  # three channels of h1 exactly fc1's bias
        m.fc1.bias[:2] = 0.0  # two of them exactly 0
    x = torch.randn(B, height * width, K, device=device, requires_grad=True)
    params = [x, m.fc1.weight, m.fc1.bias, m.dwconv.weight, m.dwconv.bias, m.fc2.weight, m.fc2.bias]

    def module(x):
        h = torch.relu(m.fc1(x))
        h = m.dwconv(h.transpose(1, 2).reshape(B, H, height, width)).flatten(2).transpose(1, 2)
        return m.fc2(TF.gelu(h))

    y = module(x)
    g = torch.randn_like(y)
    expected = torch.autograd.grad(y, params, g)
    with fusedrc.use_backend(backend):
        yf = fusedrc.functional.mix_ffn(x, height, width, *params[1:], "gelu", relu_first=True)
    got = torch.autograd.grad(yf, params, g)
    if backend == "reference":
        assert torch.equal(yf, y) and all(torch.equal(a, b) for a, b in zip(got, expected))
    else:
        d = [_d(t.detach()) for t in params]
        ref = R.mix_ffn_backward(d[0].reshape(-1, K), *d[1:], _d(g).reshape(-1, N), height, width, "gelu",
                                 relu_first=True)
        assert rel_err(yf, y) < 1e-5
        for a, b in zip(got, ref):
            assert rel_err(a.reshape(b.shape), b) < 1e-5
        assert got[0].abs().sum() > 0
