"""Apertus's FFN with xIELU (two learned alphas): the reference against the module's formula, the Triton kernels
against float64 (Triton's interpreter on the CPU), the op's gradients (the alphas' included) and saved bytes.
"""
import pytest
import torch
import torch.nn.functional as TF

import fusedrc
from fusedrc import reference as R
from _utils import SavedBytes, backend_device, rel_err
from test_kernels_dense import _check, _d, _rand

NAMES = ["out", "dx", "dw1", "db1", "dw2", "db2", "dalpha_p", "dalpha_n"]
BETA, EPS = 0.5, -1e-6


def _module_xielu(h, alpha_p_raw, alpha_n_raw, beta, eps):
    """Hugging Face's XIELUActivation._xielu_python, written out on its parameters and buffers."""
    alpha_p = TF.softplus(alpha_p_raw)
    alpha_n = beta + TF.softplus(alpha_n_raw)
    return torch.where(h > 0, alpha_p * h * h + beta * h, (torch.expm1(torch.min(h, eps)) - h) * alpha_n + beta * h)


def _inputs(M, K, H, N, dtype, device, bias=True):
    x = _rand(M, K, dtype=dtype, device=device)
    w1 = _rand(H, K, dtype=dtype, device=device, scale=K ** -0.5 * 2)
    w2 = _rand(N, H, dtype=dtype, device=device, scale=H ** -0.5)
    b1, b2 = ((_rand(n, dtype=dtype, device=device, scale=0.5) if bias else None) for n in (H, N))
    alphas = (torch.tensor([0.8], device=device), torch.tensor([1.3], device=device))
    return (x, w1, b1, w2, b2, *alphas), _rand(M, N, dtype=dtype, device=device)


def test_reference_is_the_module():
    """The reference's xIELU is the module's formula bit for bit, its gradients autograd's of it (the alphas' through
    softplus included), the tie at eps too; a masked-off gradient is None and the others unchanged."""
    h = torch.cat([torch.randn(200), torch.tensor([0.0, EPS, -1e-7, -30.0])]).requires_grad_()
    raw_p, raw_n = torch.tensor([0.3], requires_grad=True), torch.tensor([-0.2], requires_grad=True)
    beta, eps = torch.tensor(BETA), torch.tensor(EPS)
    ap, an = TF.softplus(raw_p), beta + TF.softplus(raw_n)
    assert torch.equal(R.xielu(h, ap, an, BETA, EPS), _module_xielu(h, raw_p, raw_n, beta, eps))
    x, w1, w2 = torch.randn(6, 4), torch.randn(10, 4), torch.randn(3, 10)
    g = torch.randn(6, 3)
    full = R.xielu_mlp_backward(x, w1, None, w2, None, ap.detach(), an.detach(), BETA, EPS, g)
    params = [t.requires_grad_() for t in (x.clone(), w1.clone(), w2.clone(), ap.detach().clone(), an.detach().clone())]
    expected = torch.autograd.grad(R.xielu_mlp_forward(params[0], params[1], None, params[2], None, *params[3:], BETA,
                                                       EPS), params, g)
    got = [full[i] for i in (0, 1, 3, 5, 6)]
    for a, b in zip(got, expected):  # (autograd adds h's two factors of alpha_p h h apart: rounding apart)
        assert rel_err(a, b) < 1e-6
    assert full[2] is None and full[4] is None
    mask = [False, True, False, False, False, True, False]
    masked = R.xielu_mlp_backward(x, w1, None, w2, None, ap.detach(), an.detach(), BETA, EPS, g, mask)
    assert [t is None for t in masked] == [True, False, True, True, True, False, True]
    assert torch.equal(masked[1], full[1]) and torch.equal(masked[5], full[5])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(37, 16, 40, 12), (3, 5, 7, 2)], ids=str)
def test_kernels_against_float64(shape, dtype, bias, device):
    """Several blocks and a ragged last one; pre-activations spread over both branches and the far negative side."""
    from fusedrc.kernels import xielu_mlp

    args, g = _inputs(*shape, dtype, device, bias)
    out = xielu_mlp.xielu_mlp_forward(*args, BETA, EPS)
    grads = xielu_mlp.xielu_mlp_backward(*args, BETA, EPS, g)
    ref_args = [_d(t) for t in args]
    ref = [R.xielu_mlp_forward(*ref_args, BETA, EPS), *R.xielu_mlp_backward(*ref_args, BETA, EPS, _d(g))]
    # the alphas' gradients are fp32 whatever x's dtype (their own dtype): checked at the outputs' tolerance
    _check([out, *grads[:5]], ref[:6], dtype, NAMES[:6])
    for got, want, name in zip(grads[5:], ref[6:], NAMES[6:]):
        assert got.dtype == torch.float32 and rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2), name


def test_epilogue_gemms_and_recompute(device, monkeypatch):
    """xIELU is the dense kernels' epilogue: 2 GEMMs forward, 5 backward with one recomputing h (no GEMM writes h);
    the activation the backward rebuilds for dW2 is the forward's bit for bit; only dW2 wanted: the forward's kernel
    rebuilds it and g_a is never formed; NaN and inf pre-activations reach the output as torch's formula takes them
    and g_h and the alphas' gradients as the reference's (``R.xielu_grad``)."""
    from fusedrc.kernels import _common, xielu_mlp
    from test_kernels_dense import spy_launches

    calls = []
    monkeypatch.setattr(_common, "PLAIN_GEMM", "triton")  # on CUDA too: count every GEMM here
    spy_launches(monkeypatch, calls, _common, _gemm_act_kernel="gemm", _gemm_act_grad_kernel="recompute")
    args, g = _inputs(37, 16, 40, 12, torch.float32, device)
    xielu_mlp.xielu_mlp_forward(*args, BETA, EPS)
    assert calls == ["gemm", "gemm"]
    calls.clear()
    xielu_mlp.xielu_mlp_backward(*args, BETA, EPS, g)
    assert sorted(calls) == ["gemm"] * 4 + ["recompute"]
    calls.clear()
    xielu_mlp.xielu_mlp_backward(*args, BETA, EPS, g, [False, False, False, True, True, False, False])
    assert calls == ["gemm", "gemm"]

    x, w1, b1 = args[:3]
    alphas = (torch.cat(args[5:7]), BETA, EPS)
    a = _common.gemm_act(x, w1.t(), b1, "xielu", xielu=alphas)
    _, a_again, _, _ = _common.gemm_act_grad(x, w1.t(), b1, torch.ones_like(a), "xielu", store_act=True,
                                             xielu=alphas)
    assert torch.equal(a, a_again)

    # row 5's h: +inf and -inf (x = inf); then row 3's NaN too. The alphas' gradients: +inf each from the
    # infinities alone (both branches' factors are +inf), NaN for alpha_n's once a NaN h joins
    for rows in ((5,), (5, 3)):
        x = args[0].clone()
        for r in rows:
            x[r, 0] = float("inf") if r == 5 else float("nan")
        a = _common.gemm_act(x, w1.t(), b1, "xielu", xielu=alphas)
        gh, _, _, dalphas = _common.gemm_act_grad(x, w1.t(), b1, torch.ones_like(a), "xielu", xielu=alphas)
        h = TF.linear(x.double(), w1.double(), b1.double())
        want_a = R.xielu(h, args[5].double(), args[6].double(), BETA, EPS)
        want_gh, *want_dalphas = R.xielu_grad(h, torch.ones_like(h), args[5].double(), args[6].double(), BETA, EPS)
        assert h[5].isinf().all() and (h[5] < 0).any() and (h[5] > 0).any()  # both infinities
        for got, want in ((a, want_a), (gh, want_gh), (dalphas, torch.cat(want_dalphas))):
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
            ok = want.isfinite()
            assert rel_err(got[ok], want[ok]) < 1e-5
        assert dalphas[0] == float("inf") and (dalphas[1] == float("inf") if rows == (5,) else dalphas[1].isnan())
    assert gh[3].isnan().all() and not gh[:3].isnan().any()


def test_alphas_of_another_16bit_dtype_under_autocast():
    """fp16 alphas (the module's parameters' dtype) under bf16 autocast, on the Triton backend: the op runs and the
    alphas' gradients are the reference's, in fp16."""
    x = torch.randn(6, 8, requires_grad=True)
    w1, w2 = torch.randn(24, 8) * 0.3, torch.randn(8, 24) * 0.2
    grads = {}
    for backend in ("reference", "triton"):
        ap = torch.tensor([0.8], dtype=torch.float16, requires_grad=True)
        an = torch.tensor([1.3], dtype=torch.float16, requires_grad=True)
        with fusedrc.use_backend(backend), torch.autocast("cpu", dtype=torch.bfloat16):
            y = fusedrc.functional.xielu_mlp(x, w1, None, w2, None, ap, an, BETA, EPS)
        grads[backend] = torch.autograd.grad(y.float().sum(), (ap, an))
    for got, want in zip(grads["triton"], grads["reference"]):
        assert got.dtype == torch.float16 and rel_err(got, want) < 2e-2


def test_activation_across_its_range(device):
    """The GEMM epilogue's xIELU against float64 from -60 to 4 and near 0 (where expm1(h) - h cancels): as close as
    torch's own fp32 evaluation of the formula, relative to the value or 1e-7 of |h|. The pre-activations are h
    times an identity (exact in fp32), 64 a row."""
    from fusedrc.kernels._common import gemm_act

    h = torch.cat([torch.linspace(-60, 4, 20001, dtype=torch.float64), -torch.logspace(-9, 0, 500, dtype=torch.float64),
                   torch.logspace(-9, 0, 500, dtype=torch.float64), torch.tensor([EPS], dtype=torch.float64)])
    h = torch.cat([h, h[:-h.numel() % 64]])  # whole rows of 64
    ap, an = torch.tensor([0.8], dtype=torch.float64), torch.tensor([1.3], dtype=torch.float64)
    ref = R.xielu(h, ap, an, BETA, EPS)
    alphas = torch.cat([ap, an]).float().to(device)
    got = gemm_act(h.float().reshape(-1, 64).to(device), torch.eye(64, device=device), None, "xielu",
                   xielu=(alphas, BETA, EPS)).reshape(-1).double()
    torch_fp32 = R.xielu(h.float(), ap.float(), an.float(), BETA, EPS).double()

    def err(t):
        return ((t.cpu() - ref).abs() / (ref.abs() + 1e-7 * h.abs() + 1e-30)).max().item()

    assert err(got) <= max(2 * err(torch_fp32), 1e-6)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_op_trains_the_alphas_and_keeps_only_x(backend):
    """Through autograd from the module's raw parameters (bf16 ones, as Apertus's default dtype makes them, and an
    fp32 input): outputs and every gradient, the alphas' through softplus, as the module's formula in eager; the
    op keeps x (the eager form about seven hidden-sized tensors); a frozen first layer and input skip their GEMMs
    and the rest is unchanged."""
    device = backend_device(backend)
    up, down = torch.nn.Linear(8, 32, bias=False).to(device), torch.nn.Linear(32, 8, bias=False).to(device)
    raw_p = torch.tensor([0.4], dtype=torch.bfloat16, device=device, requires_grad=True)
    raw_n = torch.tensor([-0.3], dtype=torch.bfloat16, device=device, requires_grad=True)
    beta = torch.tensor(BETA, dtype=torch.bfloat16, device=device)
    eps = torch.tensor(EPS, dtype=torch.bfloat16, device=device)
    x = torch.randn(3, 5, 8, device=device, requires_grad=True)
    params = [x, up.weight, down.weight, raw_p, raw_n]
    with SavedBytes() as eager_saved:
        y = down(_module_xielu(up(x), raw_p, raw_n, beta, eps))
    g = torch.randn_like(y)
    expected = torch.autograd.grad(y, params, g)
    with fusedrc.use_backend(backend), SavedBytes() as fused_saved:
        yf = fusedrc.functional.xielu_mlp(x, up.weight, None, down.weight, None, TF.softplus(raw_p),
                                          beta + TF.softplus(raw_n), float(beta), float(eps))
    assert rel_err(yf, y) < 1e-5
    for a, b, n in zip(torch.autograd.grad(yf, params, g), expected, ("x", "up", "down", "alpha_p", "alpha_n")):
        assert a.dtype == b.dtype and rel_err(a, b) < (1e-2 if a.dtype == torch.bfloat16 else 1e-5), n
    # x, plus the alphas' softplus inputs autograd keeps outside the op (1-element tensors)
    assert fused_saved.bytes <= x.numel() * 4 + 16
    assert eager_saved.bytes >= 5 * 3 * 5 * 32 * 4
    up.weight.requires_grad_(False)
    with fusedrc.use_backend(backend):
        yf = fusedrc.functional.xielu_mlp(x.detach(), up.weight, None, down.weight, None, TF.softplus(raw_p),
                                          beta + TF.softplus(raw_n), float(beta), float(eps))
    for a, b in zip(torch.autograd.grad(yf, params[2:], g), expected[2:]):
        assert rel_err(a, b) < 1e-2


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_module_loads_apertus_and_trains(backend):
    """``fusedrc.nn.XIELUMLP`` takes Hugging Face's ApertusMLP state_dict key for key and computes its output; a
    training step gives every parameter the module's gradient (the alphas' included); a hook on the activation
    runs it eagerly; ``fusedrc.nn.XIELU`` alone is the module's activation."""
    from test_convert import _transformers

    tr = _transformers()
    if not hasattr(tr, "ApertusConfig"):
        pytest.skip(f"transformers {tr.__version__} has no ApertusConfig")
    from transformers.models.apertus.modeling_apertus import ApertusMLP

    device = backend_device(backend)
    torch.manual_seed(0)
    hf = ApertusMLP(tr.ApertusConfig(hidden_size=16, intermediate_size=48)).to(device)
    mlp = fusedrc.nn.XIELUMLP(16, 48, device=device)
    mlp.load_state_dict(hf.state_dict())
    assert sorted(mlp.state_dict()) == sorted(hf.state_dict())
    x = torch.randn(2, 5, 16, device=device)
    h = torch.randn(40, device=device)
    assert torch.equal(mlp.act_fn(h), hf.act_fn(h))
    with fusedrc.use_backend(backend):
        y = mlp(x)
        y.square().sum().backward()
    y_ref = hf(x)
    y_ref.square().sum().backward()
    assert rel_err(y, y_ref) < 1e-5
    for (n, p), (_, q) in zip(sorted(mlp.named_parameters()), sorted(hf.named_parameters())):
        assert rel_err(p.grad, q.grad) < 1e-5, n
    seen = []
    mlp.act_fn.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with fusedrc.use_backend(backend):
        assert rel_err(mlp(x), y_ref) < 1e-5
    assert seen == [torch.Size([2, 5, 48])]


def test_module_on_meta_and_state_dict_constants():
    """A meta-device XIELUMLP (shapes only) runs; beta and eps loaded from a state_dict are what the fused op gets."""
    meta = fusedrc.nn.XIELUMLP(8, 16, device="meta")
    assert meta(torch.empty(2, 8, device="meta")).shape == (2, 8)
    mlp = fusedrc.nn.XIELUMLP(8, 16)
    state = dict(mlp.state_dict(), **{"act_fn.beta": torch.tensor(0.25), "act_fn.eps": torch.tensor(-1e-3)})
    mlp.load_state_dict(state)
    assert (mlp.act_fn._beta_scalar, mlp.act_fn._eps_scalar) == (0.25, float(torch.tensor(-1e-3)))
    x = torch.randn(3, 8)
    h = mlp.up_proj(x)
    ap, an = mlp.act_fn.alphas()
    assert torch.allclose(mlp(x), mlp.down_proj(R.xielu(h, ap, an, 0.25, float(torch.tensor(-1e-3)))), atol=1e-6)
