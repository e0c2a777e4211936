"""Frozen parameters and inputs that need no gradient: the backward ops skip the work.

Every backward (both backends) takes ``output_mask``, one bool per gradient; the
autograd layer fills it from ``ctx.needs_input_grad``. A gradient still wanted must
equal, bit for bit, what the full backward returns; one masked off is None, and the
GEMMs / convolution passes only it needed do not run.
"""
import pytest
import torch
import torch.nn as nn

import fusedrc
from fusedrc import reference as R
from fusedrc.kernels import _common, conv_bn_act, fused_mlp, gated_mlp, linear_act
from test_kernels_dense import _rand, spy_launches
from _utils import GemmCounter

BACKENDS = {"reference": R, "triton": None}  # None: the op's kernels module


def _dense_case(op, device, bias=True, dropout=False):
    M, K, H, N = 9, 12, 20, 7

    def w(*shape):
        return _rand(*shape, dtype=torch.float32, device=device, scale=shape[-1] ** -0.5)

    def b(n):
        return _rand(n, dtype=torch.float32, device=device, scale=0.5) if bias else None

    x = _rand(M, K, dtype=torch.float32, device=device)
    if op == "linear_act":
        return linear_act, "linear_act_backward", (x, w(H, K), b(H), _rand(M, H, dtype=torch.float32, device=device),
                                                   "relu"), {}
    g = _rand(M, N, dtype=torch.float32, device=device)
    extra = {"dropout_p": 0.25, "seed": torch.tensor([1234], device=device)} if dropout else {}
    if op == "fused_mlp":
        return fused_mlp, "fused_mlp_backward", (x, w(H, K), b(H), w(N, H), b(N), g, "gelu"), extra
    return gated_mlp, "gated_mlp_backward", (x, w(H, K), b(H), w(H, K), b(H), w(N, H), b(N), g, "silu"), extra


def _conv_case(device, training):
    N, C_in, HW, C_out = 2, 3, 5, 5
    x = _rand(N, C_in, HW, HW, dtype=torch.float32, device=device)
    weight = _rand(C_out, C_in, 3, 3, dtype=torch.float32, device=device, scale=(C_in * 9) ** -0.5)
    bias = _rand(C_out, dtype=torch.float32, device=device, scale=0.5)
    gamma = (1 + 0.3 * torch.randn(C_out)).to(device)
    beta = _rand(C_out, dtype=torch.float32, device=device, scale=0.3)
    residual = _rand(N, C_out, HW, HW, dtype=torch.float32, device=device)
    mean = _rand(C_out, dtype=torch.float32, device=device, scale=0.2)
    rstd = (0.5 + torch.rand(C_out)).to(device)
    g = _rand(N, C_out, HW, HW, dtype=torch.float32, device=device)
    args = (x, weight, bias, gamma, beta, mean, rstd, residual, g, training, 1e-5, [1, 1], [1, 1], [1, 1], "relu")
    return conv_bn_act, "conv_bn_act_backward", args, {}


def _masks(n):
    """Each gradient off alone, each on alone, and all off but the first (x) and the last."""
    masks = [[i != j for i in range(n)] for j in range(n)]
    masks += [[i == j for i in range(n)] for j in range(n)]
    return masks + [[True] + [False] * (n - 1), [False] * (n - 1) + [True]]


def _check_masks(module, fn_name, args, extra, masks=None):
    fn = getattr(module, fn_name)
    full = fn(*args, **extra)
    assert all(g is not None for g in full), "the case should have every gradient"
    for mask in masks or _masks(len(full)):
        got = fn(*args, **extra, output_mask=mask)
        assert len(got) == len(full)
        for i, (g, f, m) in enumerate(zip(got, full, mask)):
            if m:
                assert g is not None and torch.equal(g, f), f"{fn_name} mask {mask}: gradient {i} differs"
            else:
                assert g is None, f"{fn_name} mask {mask}: gradient {i} was computed"


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("op", ["linear_act", "fused_mlp", "fused_mlp_dropout", "gated_mlp", "gated_mlp_dropout"])
def test_dense_output_mask(op, backend, device):
    module, fn_name, args, extra = _dense_case(op.replace("_dropout", ""), device, dropout=op.endswith("dropout"))
    _check_masks(BACKENDS[backend] or module, fn_name, args, extra)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_conv_output_mask(backend, training, device, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # bitwise comparisons; cuDNN's dW on a GPU
    module, fn_name, args, extra = _conv_case(device, training)
    # each gradient off alone, and the BN statistics' gradients only (the interpreter is slow)
    masks = _masks(6)[:6] + [[False, False, False, True, True, False]]
    _check_masks(BACKENDS[backend] or module, fn_name, args, extra, masks)
    if backend == "triton":  # the Triton dX/dW kernels, and the backward that reruns the conv once
        monkeypatch.setattr(conv_bn_act, "CONV_GRAD", "triton")
        monkeypatch.setattr(conv_bn_act, "BWD_RECOMPUTE_TWICE", False)
        _check_masks(module, fn_name, args, extra, masks[:2] + masks[-1:])


def test_dense_mask_skips_gemms(device, monkeypatch):
    """Frozen weights drop their GEMMs; a frozen FFN input layer drops g_a and the recompute kernel."""
    calls = []
    monkeypatch.setattr(_common, "PLAIN_GEMM", "triton")
    spy_launches(monkeypatch, calls, _common, _gemm_act_kernel="gemm", _gemm_act_grad_kernel="recompute")
    spy_launches(monkeypatch, calls, gated_mlp, _gated_act_kernel="dual", _gated_act_grad_kernel="dual_recompute")

    def run(op, mask):
        module, fn_name, args, extra = _dense_case(op, device)
        calls.clear()
        getattr(module, fn_name)(*args, **extra, output_mask=mask)
        return sorted(calls)

    assert run("linear_act", [True, True, True]) == ["gemm", "gemm", "recompute"]
    assert run("linear_act", [True, False, False]) == ["gemm", "recompute"]       # frozen layer: dX only
    assert run("fused_mlp", [True] * 5) == ["gemm"] * 4 + ["recompute"]
    assert run("fused_mlp", [True, False, False, False, False]) == ["gemm", "gemm", "recompute"]  # g_a, dX
    # only W2 trains (x and the first layer frozen): the forward's kernel rebuilds a, no g_a
    assert run("fused_mlp", [False, False, False, True, True]) == ["gemm", "gemm"]
    assert run("gated_mlp", [True] * 7) == ["dual_recompute"] + ["gemm"] * 6
    assert run("gated_mlp", [True] + [False] * 6) == ["dual_recompute"] + ["gemm"] * 3   # g_a, dX in two
    assert run("gated_mlp", [False] * 5 + [True, True]) == ["dual", "gemm"]


def test_conv_mask_skips_passes(device, monkeypatch):
    """A first layer's dX, a frozen conv's dW and, for BN-only training, the dz pass are skipped."""
    module, fn_name, args, _ = _conv_case(device, True)
    masks = []
    real = torch.ops.aten.convolution_backward

    class Spy:
        def __call__(self, *a):
            masks.append(list(a[-1]))
            return real(*a)

    monkeypatch.setattr(torch.ops.aten, "convolution_backward", Spy())
    calls = []
    spy_launches(monkeypatch, calls, conv_bn_act, _conv_bn_bwd_kernel="pass")
    module.conv_bn_act_backward(*args, output_mask=[False, True, True, True, True, True])
    assert masks == [[False, True, False]] and calls == ["pass", "pass"]
    masks.clear(), calls.clear()
    module.conv_bn_act_backward(*args, output_mask=[False, False, False, True, True, True])
    assert masks == [] and calls == ["pass"]   # statistics only: no dz, no conv backward


# --------------------------------------------------------------------------- through autograd
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_frozen_modules_match_and_skip(backend, device):
    """Freezing parameters (and an input without grad) gives the same gradients for the rest,
    None for the frozen ones, and fewer GEMMs in the reference backward."""
    torch.manual_seed(0)
    mlp = fusedrc.nn.FusedMLP(12, 20, 7, activation="gelu").to(device)
    gated = fusedrc.nn.GatedMLP(12, 20, 7).to(device)
    x = torch.randn(3, 5, 12, device=device)
    with fusedrc.use_backend(backend):
        for model in (mlp, gated):
            params = dict(model.named_parameters())
            full = torch.autograd.grad(model(x).square().sum(), list(params.values()))
            full = dict(zip(params, full))
            frozen = [n for n in params if not n.startswith(("fc2", "down_proj"))]
            for n in frozen:
                params[n].requires_grad_(False)
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
            for n, p in params.items():
                if n in frozen:
                    assert p.grad is None
                else:
                    assert torch.equal(p.grad, full[n]), n
            for n in frozen:
                params[n].requires_grad_(True)
    if backend == "reference":
        # the FFN with only fc2 trainable and x without grad: h recomputed, dW2; no g_a, dX, dW1
        mlp.fc1.requires_grad_(False)
        with fusedrc.use_backend("reference"):
            y = mlp(x)
            with GemmCounter() as counter:
                y.sum().backward()
        assert counter.gemms == 2


def test_frozen_conv_skips_dx_and_dw(device, monkeypatch):
    """ConvBNReLU as a ResNet stem (input without grad) with a frozen conv: BN's parameters
    still get their gradients, equal to the full run's; the conv backward never runs."""
    block = fusedrc.nn.ConvBNReLU(3, 6, 3, padding=1).to(device)
    x = torch.randn(2, 3, 9, 9, device=device)
    block(x).square().sum().backward()
    full = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    block.conv.requires_grad_(False)
    calls = []
    real = torch.ops.aten.convolution_backward
    monkeypatch.setattr(torch.ops.aten, "convolution_backward", lambda *a: calls.append(a) or real(*a))
    block(x).square().sum().backward()
    assert calls == [] and block.conv.weight.grad is None
    for n in ("bn.weight", "bn.bias"):
        assert torch.equal(dict(block.named_parameters())[n].grad, full[n]), n


def test_frozen_under_compile():
    """torch.compile traces the mask through AOTAutograd: same gradients as eager, frozen ones None."""
    torch.manual_seed(0)
    mlp = fusedrc.nn.FusedMLP(8, 16, 8)
    mlp.fc1.requires_grad_(False)
    x = torch.randn(4, 8)
    with fusedrc.use_backend("reference"):
        mlp(x).sum().backward()
        eager = [p.grad.clone() for p in mlp.fc2.parameters()]
        mlp.zero_grad(set_to_none=True)
        torch.compile(mlp, backend="aot_eager", fullgraph=True)(x).sum().backward()
    assert mlp.fc1.weight.grad is None and mlp.fc1.bias.grad is None
    for p, e in zip(mlp.fc2.parameters(), eager):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("op", ["mix_ffn", "mix_ffn_relu_first", "xielu_mlp"])
def test_mix_ffn_and_xielu_output_mask(op, backend, device):
    """The Mix-FFN's (dropout on; PVT-v2's ReLU first) and the xIELU FFN's backward: each mask's wanted gradients
    bit for bit the full backward's, the others None."""
    import importlib

    M, K, H, N = 2 * 3 * 4, 12, 20, 7
    x = _rand(M, K, dtype=torch.float32, device=device)
    w1, b1 = _rand(H, K, dtype=torch.float32, device=device, scale=K ** -0.5), _rand(H, dtype=torch.float32,
                                                                                    device=device, scale=0.5)
    w2, b2 = _rand(N, H, dtype=torch.float32, device=device, scale=H ** -0.5), _rand(N, dtype=torch.float32,
                                                                                    device=device, scale=0.5)
    g = _rand(M, N, dtype=torch.float32, device=device)
    module = R if backend == "reference" else importlib.import_module(f"fusedrc.kernels.{op[:7] if 'mix' in op else op}")
    if op.startswith("mix_ffn"):
        wd, bd = _rand(H, 1, 3, 3, dtype=torch.float32, device=device, scale=0.3), _rand(H, dtype=torch.float32,
                                                                                        device=device, scale=0.5)
        args = (x, w1, b1, wd, bd, w2, b2, g, 3, 4, "gelu", 0.25, torch.tensor([99], device=device))
        _check_masks(module, "mix_ffn_backward", args, {"relu_first": op.endswith("relu_first")})
    else:
        alphas = (torch.tensor([0.8], device=device), torch.tensor([1.2], device=device))
        _check_masks(module, "xielu_mlp_backward", (x, w1, b1, w2, b2, *alphas, 0.5, -1e-6, g), {})
