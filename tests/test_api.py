"""Public API surface: backends, recompute_sequential, mark/unmark, clear errors, packaging."""
import contextlib
import copy
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn

import fusedrc
from _utils import FusedOpLog, SavedBytes, backend_device


def test_public_names():
    for name in ["recompute", "recompute_sequential", "mark", "unmark", "use_backend", "current_backend",
                 "RecomputeError"]:
        assert hasattr(fusedrc, name)
        assert getattr(fusedrc, name).__doc__, f"{name} needs a docstring"
    assert issubclass(fusedrc.RecomputeError, RuntimeError)


# --------------------------------------------------------------------------- backends
def test_use_backend_call_and_context_manager():
    assert fusedrc.current_backend() == "auto"
    fusedrc.use_backend("reference")
    assert fusedrc.current_backend() == "reference"
    with fusedrc.use_backend("triton"):
        assert fusedrc.current_backend() == "triton"
    assert fusedrc.current_backend() == "reference"
    fusedrc.use_backend("auto")


def test_use_backend_is_thread_local():
    seen = {}
    with fusedrc.use_backend("reference"):
        t = threading.Thread(target=lambda: seen.setdefault("other", fusedrc.current_backend()))
        t.start()
        t.join()
        assert fusedrc.current_backend() == "reference"
    assert seen["other"] == "auto"


@pytest.mark.parametrize("name", ["cuda", "Triton", "", None, 3])
def test_unknown_backend_name(name):
    with pytest.raises(ValueError, match="backend name must be one of"):
        fusedrc.use_backend(name)
    assert fusedrc.current_backend() == "auto"


def test_triton_on_cpu_outside_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(4, 8)
    lin = nn.Linear(8, 8)
    with fusedrc.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fusedrc.functional.linear_act(x, lin.weight, lin.bias)


def test_auto_uses_reference_for_cpu_tensors():
    from fusedrc._backend import resolve_backend

    assert resolve_backend(torch.randn(2), "linear_act", "linear_act_forward") == "reference"


def test_triton_backend_falls_back_for_float64(device):
    from fusedrc._backend import resolve_backend

    x = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    lin = nn.Linear(4, 5, dtype=torch.float64, device=device)
    with fusedrc.use_backend("triton"):
        assert resolve_backend(x, "linear_act", "linear_act_forward") == "reference"
        y = fusedrc.functional.linear_act(x, lin.weight, lin.bias)
    assert torch.equal(y, torch.relu(lin(x)))


def test_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, fusedrc\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))\n"
        "x = torch.randn(2, 4, requires_grad=True)\n"
        "fusedrc.recompute(m, x).sum().backward()\n"
        "assert 'triton' not in [k for k, v in sys.modules.items() if v is not None]\n"
        "print('ok', fusedrc.current_backend())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ok auto" in out.stdout


def test_import_does_not_import_triton():
    code = "import sys, fusedrc; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- recompute_sequential
def _stack(n=6, d=12):
    layers = []
    for i in range(n):
        layers += [nn.Linear(d, d), nn.Tanh() if i % 2 else nn.ReLU()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("segments", [1, 2, 5, 12])
def test_recompute_sequential_matches_plain(segments):
    model = _stack()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 12, requires_grad=True)
    y = fusedrc.recompute_sequential(model, segments, x)
    y_plain = twin(x)
    assert torch.equal(y, y_plain)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    y_plain.sum().backward()
    assert torch.allclose(g, x.grad, atol=1e-6, rtol=0)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=0)


def test_recompute_sequential_saves_less():
    model = _stack(8, 64)
    x = torch.randn(32, 64, requires_grad=True)
    with SavedBytes() as plain:
        model(x)
    with SavedBytes() as rc:
        fusedrc.recompute_sequential(model, 4, x)
    # plain: x and the 8 activations' outputs; 4 segments: the first 3 keep their inputs, the last
    # (2 Linears and their activations, never recomputed, as checkpoint_sequential) its 3 tensors
    assert rc.bytes == plain.bytes * 6 // 9


def test_recompute_sequential_accepts_a_list():
    fns = [nn.Linear(5, 5), torch.tanh, nn.Linear(5, 5)]
    x = torch.randn(2, 5, requires_grad=True)
    y = fusedrc.recompute_sequential(fns, 2, x)
    assert torch.equal(y, fns[2](torch.tanh(fns[0](x))))


@pytest.mark.parametrize("segments", [0, -1, 13])
def test_recompute_sequential_segments_out_of_range(segments):
    with pytest.raises(ValueError, match="segments must be between 1 and 12"):
        fusedrc.recompute_sequential(_stack(), segments, torch.randn(2, 12))


def test_recompute_sequential_rejects_second_input():
    with pytest.raises(TypeError, match="takes one input"):
        fusedrc.recompute_sequential(_stack(), 2, torch.randn(2, 12), torch.randn(2, 12))


def test_recompute_sequential_bad_types():
    with pytest.raises(TypeError, match="segments must be an int"):
        fusedrc.recompute_sequential(_stack(), 2.0, torch.randn(2, 12))
    with pytest.raises(TypeError, match="functions must be"):
        fusedrc.recompute_sequential(nn.Linear(2, 2), 1, torch.randn(2, 2))


# --------------------------------------------------------------------------- mark / unmark
def test_mark_recomputes_every_call_and_unmark_undoes_it():
    block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Tanh())
    x = torch.randn(8, 32, requires_grad=True)
    with SavedBytes() as plain:
        y_plain = block(x)
    assert fusedrc.mark(block) is block
    with SavedBytes() as marked:
        y = block(x)
    assert marked.bytes == x.numel() * 4 < plain.bytes
    assert torch.equal(y, y_plain)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    y_plain.sum().backward()
    assert torch.equal(g, x.grad)
    state = block.state_dict()
    assert fusedrc.unmark(block) is block
    with SavedBytes() as again:
        block(x)
    assert again.bytes == plain.bytes
    block.load_state_dict(state)


def test_mark_takes_the_fused_path_for_patterns():
    from _utils import GemmCounter

    ffn = fusedrc.mark(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)))
    with GemmCounter() as c:
        ffn(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert c.gemms == 7 and any("fused_mlp" in op for op in c.ops)


def test_nested_mark_raises():
    inner = nn.Linear(4, 4)
    outer = nn.Sequential(inner, nn.Tanh())
    fusedrc.mark(inner)
    with pytest.raises(fusedrc.RecomputeError, match="already marked"):
        fusedrc.mark(outer)
    # marked the other way round: caught when called
    fusedrc.unmark(inner)
    fusedrc.mark(outer)
    fusedrc.mark(inner)
    with pytest.raises(fusedrc.RecomputeError, match="inside another marked module"):
        outer(torch.randn(2, 4, requires_grad=True))


def test_mark_output_recompute_merges_chained_blocks():
    a = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    b = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    x = torch.randn(8, 16, requires_grad=True)
    fusedrc.mark(a, output_recompute=True)
    fusedrc.mark(b)
    with SavedBytes() as s:
        y = b(a(x))
    assert s.bytes == x.numel() * 4
    y.sum().backward()
    g = x.grad.clone()
    fusedrc.unmark(a), fusedrc.unmark(b)
    x.grad = None
    b(a(x)).sum().backward()
    assert torch.equal(g, x.grad)


def test_mark_rejects_non_modules():
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        fusedrc.mark(lambda x: x)


# --------------------------------------------------------------------------- clear errors
def test_non_callable_block():
    with pytest.raises(TypeError, match="block must be a callable"):
        fusedrc.recompute(42, torch.randn(2))


def test_use_reentrant_is_rejected_with_a_reason():
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        fusedrc.recompute(nn.Linear(2, 2), torch.randn(1, 2), use_reentrant=True)


def test_input_on_another_device_than_the_parameters():
    block = nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="is on cpu, but the block's parameters are on meta"):
        fusedrc.recompute(block, torch.randn(2, 4, requires_grad=True))


def test_bad_determinism_check_and_context_fn():
    with pytest.raises(ValueError, match="determinism_check"):
        fusedrc.recompute(torch.sin, torch.randn(2, requires_grad=True), determinism_check="strict")
    with pytest.raises(TypeError, match="context_fn"):
        fusedrc.recompute(torch.sin, torch.randn(2, requires_grad=True), context_fn=3)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: fusedrc.functional.linear_act(torch.randn(2, 3), torch.randn(4, 5)), ValueError, "weight"),
        (lambda: fusedrc.functional.linear_act(torch.randn(2, 3), torch.randn(4, 3), torch.randn(5)),
         ValueError, "bias"),
        (lambda: fusedrc.functional.linear_act(torch.randn(2, 3), torch.randn(4, 3, dtype=torch.float64)),
         TypeError, "weight has dtype"),
        (lambda: fusedrc.functional.linear_act(torch.randn(2, 3), torch.randn(4, 3), activation="tanh"),
         ValueError, "activation"),
        (lambda: fusedrc.functional.fused_mlp(torch.randn(2, 3), torch.randn(4, 3), None, torch.randn(2, 5), None),
         ValueError, "w2"),
        (lambda: fusedrc.functional.conv_bn_act(torch.randn(2, 3, 4), torch.randn(4, 3, 1, 1), None, None, None,
                                                None), ValueError, "input must be 4-D"),
        (lambda: fusedrc.functional.conv_bn_act(torch.randn(1, 3, 4, 4), torch.randn(4, 2, 1, 1), None, None, None,
                                                None), ValueError, "weight must have shape"),
        (lambda: fusedrc.functional.conv_bn_act(torch.randn(1, 3, 4, 4), torch.randn(4, 3, 1, 1), torch.ones(3),
                                                None, None, None), ValueError, "bn_weight"),
    ],
)
def test_functional_argument_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_fallback_for_unfusable_blocks_is_correct():
    # a dropout other than nn.Dropout between the FFN's layers: the generic path, still correct and minimal
    ffn = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.AlphaDropout(0.5), nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(5)
    with SavedBytes() as s:
        y = fusedrc.recompute(ffn, x)
    assert s.bytes == x.numel() * 4
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    torch.manual_seed(5)
    y2 = ffn(x)
    y2.sum().backward()
    assert torch.equal(y, y2) and torch.equal(g, x.grad)


def _backend_device(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    return backend_device(backend)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_inputs_as_eager(backend):
    """An empty batch through conv+BN+ReLU in training, and in_features 0 through the dense ops:
    the shapes, values and (empty or zero) gradients eager PyTorch gives; statistics untouched."""
    dev = _backend_device(backend)
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(3, 4, 3, padding=1, device=dev), torch.nn.BatchNorm2d(4, device=dev)
    x = torch.randn(0, 3, 8, 8, device=dev, requires_grad=True)
    with fusedrc.use_backend(backend):
        y = fusedrc.functional.conv_bn_act(x, conv.weight, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                           padding=1)
        y.sum().backward()
        assert y.shape == (0, 4, 8, 8) and x.grad.shape == x.shape
        assert torch.equal(bn.running_mean, torch.zeros(4, device=dev))
        assert torch.equal(bn.running_var, torch.ones(4, device=dev))
        fc1, fc2 = torch.nn.Linear(0, 5, device=dev), torch.nn.Linear(5, 3, device=dev)
        x = torch.randn(4, 0, device=dev, requires_grad=True)
        y1 = fusedrc.functional.linear_act(x, fc1.weight, fc1.bias)
        y2 = fusedrc.functional.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    assert torch.equal(y1, torch.relu(fc1.bias).expand(4, 5))
    assert torch.allclose(y2, fc2(torch.relu(fc1.bias)).expand(4, 3))
    (y1.sum() + y2.sum()).backward()
    assert torch.allclose(fc1.bias.grad, torch.nn.functional.linear(torch.ones(4, 0, device=dev), fc1.weight, fc1.bias)
                          .gt(0).float().sum(0) * (1 + fc2.weight.sum(0)))


def test_reference_eval_recompute_mask_matches_forward():
    """Eval-mode BatchNorm on the reference path: the backward's recomputed pre-activation is the
    forward's bit for bit, so the ReLU mask of the gradient is the output's."""
    torch.manual_seed(0)
    c, eps = 64, 1e-5
    rv, rm = torch.rand(c) * 3 + 0.1, torch.randn(c)
    gamma = (torch.rand(c) + 0.5).requires_grad_()
    # a zero input: every pre-activation is beta - mean * gamma * rstd, within ulps of 0
    beta = (rm * (gamma / torch.sqrt(rv + eps))).detach().requires_grad_()
    x = torch.zeros(1, 3, 4, 4, requires_grad=True)
    w = torch.randn(c, 3, 1, 1, requires_grad=True)
    with fusedrc.use_backend("reference"):
        y = fusedrc.functional.conv_bn_act(x, w, gamma, beta, rm, rv, training=False, eps=eps)
    y.backward(torch.ones_like(y))
    assert 0 < (y > 0).sum() < y.numel()  # the data straddles 0
    # d bn_bias = number of elements the ReLU let through: exactly the count of y > 0
    assert torch.equal(beta.grad, (y > 0).sum((0, 2, 3)).float())


def test_use_backend_object_reused_as_context_manager():
    fusedrc.use_backend("auto")
    ref = fusedrc.use_backend("reference")
    fusedrc.use_backend("auto")
    for _ in range(2):
        with ref:
            assert fusedrc.current_backend() == "reference"
        assert fusedrc.current_backend() == "auto"
    cm = fusedrc.use_backend("triton")
    fusedrc.use_backend("reference")
    with cm:
        assert fusedrc.current_backend() == "triton"
    assert fusedrc.current_backend() == "reference"
    with fusedrc.use_backend("auto"):  # the usual form restores what was there before the call
        pass
    assert fusedrc.current_backend() == "reference"
    fusedrc.use_backend("auto")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_modules_inside_a_region_run_plain(backend):
    """Inside a generic recompute region (its forward and its rerun) fused modules run as the plain
    composition of torch ops: the region keeps only its inputs either way, and a fused op's own
    recompute would add a third pass of its GEMM/conv. BatchNorm's statistics move once; outputs and
    gradients are the plain model's; the same modules outside a region run fused."""
    dev = _backend_device(backend)
    seen = []
    torch.manual_seed(0)
    block = nn.Sequential(fusedrc.nn.ConvBNReLU(3, 4, 3, padding=1), nn.Flatten(), fusedrc.nn.LinearReLU(64, 8),
                          fusedrc.nn.FusedMLP(8, 16, activation="gelu"), nn.Tanh())
    lin = nn.Linear(64, 8)
    lin.load_state_dict(block[2].state_dict())
    plain = nn.Sequential(copy.deepcopy(block[0].conv), copy.deepcopy(block[0].bn), nn.ReLU(), nn.Flatten(), lin,
                          nn.ReLU(), copy.deepcopy(block[3].fc1), nn.GELU(), copy.deepcopy(block[3].fc2), nn.Tanh())
    block, plain = block.to(dev), plain.to(dev)
    x = torch.randn(2, 3, 4, 4, device=dev, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    with fusedrc.use_backend(backend), FusedOpLog(seen):
        y = fusedrc.recompute(block, x)
        y.sum().backward()
    assert seen == [], seen
    y_ref = plain(xr)
    y_ref.sum().backward()
    assert torch.allclose(y, y_ref, atol=1e-6)
    assert torch.allclose(x.grad, xr.grad, atol=1e-6)
    for (name, p), pr in zip(block.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, pr.grad, atol=1e-6), name
    bn = block[0].bn
    assert bn.num_batches_tracked.item() == 1
    assert torch.allclose(bn.running_mean, plain[1].running_mean) and torch.allclose(bn.running_var,
                                                                                    plain[1].running_var)
    with fusedrc.use_backend(backend), FusedOpLog(seen):
        block(x)
    seen = [op.removesuffix("_triton") for op in seen]  # the triton backend's ops carry its name
    assert seen == ["conv_bn_act", "linear_act", "fused_mlp"], seen


def test_torch_checkpoint_nested_in_a_region_keeps_its_fused_ops():
    """A torch.utils.checkpoint inside a region: its recompute runs outside the region, so its fused
    modules stay fused in its forward too (the same tensors saved both times), and the region's own
    ops around it run plain; BatchNorm statistics move as eager's under the same nesting."""
    import torch.utils.checkpoint as cp

    seen = []
    torch.manual_seed(0)
    lin = fusedrc.nn.LinearReLU(8, 8)
    unit = fusedrc.nn.ConvBNReLU(3, 4, 3, padding=1)
    x = torch.randn(3, 8, requires_grad=True)
    with FusedOpLog(seen):
        y = fusedrc.recompute(lambda t: cp.checkpoint(lin, t, use_reentrant=False) * 2, x)
        y.sum().backward()
    assert set(seen) == {"linear_act", "linear_act_backward"}, seen  # fused in the checkpoint
    xr = x.detach().clone().requires_grad_(True)
    (torch.relu(nn.functional.linear(xr, lin.weight, lin.bias)) * 2).sum().backward()
    assert torch.allclose(x.grad, xr.grad, atol=1e-6)
    seen.clear()
    xi = torch.randn(2, 3, 5, 5, requires_grad=True)
    with FusedOpLog(seen):
        out = fusedrc.recompute(lambda t: torch.tanh(cp.checkpoint(unit, t, use_reentrant=False)), xi)
        out.sum().backward()
    assert set(seen) == {"conv_bn_act", "conv_bn_act_backward"}, seen
    assert xi.grad is not None and unit.bn.num_batches_tracked.item() >= 1


def test_region_checks_residual_like_the_op():
    """Inside a region the plain composition rejects a bad residual as the fused op does."""
    m = fusedrc.nn.ConvBNReLU(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    for r, err in ((torch.randn(1, 4, 1, 1), ValueError), (torch.randn(2, 4, 4, 4, dtype=torch.float64), TypeError)):
        with pytest.raises(err, match="residual"):
            m(x, r)
        with pytest.raises(err, match="residual"):
            fusedrc.recompute(lambda t: m(t, r), x)
    assert m.bn.num_batches_tracked.item() == 0  # rejected calls count no batch


def test_hooks_on_inner_modules_run_and_the_unit_runs_unfused():
    """Hooks on a ConvBNReLU's inner conv/bn (a pre-hook may compute the weight, as pruning does):
    the module calls them as plain modules, unfused, outside a region and inside, so the hooks
    run and see what they would see in an unfused model."""
    m = fusedrc.nn.ConvBNReLU(3, 4, 3, padding=1)
    calls = []
    m.conv.register_forward_pre_hook(lambda *a: calls.append("conv"))
    m.bn.register_forward_hook(lambda mod, i, o: calls.append(("bn", o.shape)))
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    with FusedOpLog() as log:
        m(x).sum().backward()
    assert calls == ["conv", ("bn", (2, 4, 4, 4))] and log.ops == []
    calls.clear()
    fusedrc.recompute(lambda t: m(t) * 1.0, x).sum().backward()
    assert calls[:2] == ["conv", ("bn", (2, 4, 4, 4))]  # (and again in the region's rerun)


@pytest.mark.parametrize("fn, setting", [
    ("linear_act_backward", "matmul"), ("fused_mlp_backward", "matmul"), ("conv_bn_act_backward", "matmul"),
    ("conv_bn_act_backward", "cudnn"),  # the conv the opt-in CONV_Z="aten" path takes from cuDNN
])
def test_backward_recomputes_at_the_forwards_fp32_precision(monkeypatch, fn, setting):
    """torch's tf32 setting (matmuls, or cuDNN's convs) flipped between forward and backward: the
    backward (whose recompute must match the forward bit for bit) still sees the forward's
    precision, and the setting is the user's again after it."""
    from fusedrc import _state, reference

    flags, allowed = ((torch.backends.cuda.matmul, _state.tf32_matmul_allowed) if setting == "matmul"
                      else (torch.backends.cudnn.conv, _state.cudnn_conv_tf32))
    seen, real = [], getattr(reference, fn)
    monkeypatch.setattr(reference, fn, lambda *a: seen.append(allowed()) or real(*a))
    before = flags.fp32_precision
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    try:
        for forward_tf32 in (False, True):
            flags.fp32_precision = "tf32" if forward_tf32 else "ieee"
            with fusedrc.use_backend("reference"):
                if fn == "conv_bn_act_backward":
                    y = fusedrc.nn.ConvBNReLU(4, 5, 3)(x)
                elif fn == "fused_mlp_backward":
                    y = fusedrc.nn.FusedMLP(6, 8)(x)
                else:
                    y = fusedrc.nn.LinearReLU(6, 8)(x)
            flags.fp32_precision = "ieee" if forward_tf32 else "tf32"
            y.sum().backward()
            assert seen.pop() is forward_tf32
            assert allowed() is not forward_tf32  # the pin ends with the backward
    finally:
        flags.fp32_precision = before


def test_sixteen_bit_ops_pin_no_precision(monkeypatch):
    """tf32 applies to fp32 operands only: a bf16 op's setup reads neither tf32 setting and its
    backward enters no pinning context; an fp32 op's does both."""
    from fusedrc import ops

    reads = []
    for name in ("tf32_matmul_allowed", "cudnn_conv_tf32"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda real=real, name=name: reads.append(name) or real())
    for dtype in (torch.bfloat16, torch.float32):
        reads.clear()
        m = fusedrc.nn.ConvBNReLU(4, 5, 3).to(dtype)
        x = torch.randn(2, 4, 6, 6, dtype=dtype, requires_grad=True)
        with fusedrc.use_backend("reference"):
            m(x).float().sum().backward()
        assert x.grad is not None and x.grad.dtype == dtype
        assert reads == ([] if dtype == torch.bfloat16 else ["tf32_matmul_allowed", "cudnn_conv_tf32"])


def _fused_and_plain(op):
    torch.manual_seed(0)
    if op == "linear_act":
        fused, x = fusedrc.nn.LinearReLU(6, 8), torch.randn(3, 6)
        plain = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        plain[0].load_state_dict(fused.state_dict())
    elif op == "fused_mlp":
        fused, x = fusedrc.nn.FusedMLP(6, 8, activation="gelu"), torch.randn(3, 6)
        plain = nn.Sequential(copy.deepcopy(fused.fc1), nn.GELU(), copy.deepcopy(fused.fc2))
    else:
        fused, x = fusedrc.nn.ConvBNReLU(3, 4, 3, padding=1), torch.randn(2, 3, 5, 5)
        plain = nn.Sequential(copy.deepcopy(fused.conv), copy.deepcopy(fused.bn), nn.ReLU())
    return fused, plain, x


@pytest.mark.parametrize("op", ["linear_act", "fused_mlp", "conv_bn_act"])
def test_torch_func_and_forward_ad_run_the_plain_composition(op):
    """The fused ops define a reverse-mode backward only: under torch.func transforms and forward-mode
    AD they run as the plain composition of torch ops, with the unfused layers' derivatives."""
    import torch.autograd.forward_ad as fwad

    fused, plain, x = _fused_and_plain(op)
    for argnum in (0, 1):  # d/d input, d/d parameters; buffers are arguments (BatchNorm updates them)
        grads = []
        for m in (fused, plain):
            def loss(x, params, buffers, m=m):
                return torch.func.functional_call(m, {**params, **buffers}, (x,)).square().sum()

            buffers = {k: v.clone() for k, v in m.named_buffers()}
            g = torch.func.grad(loss, argnums=argnum)(x, dict(m.named_parameters()), buffers)
            grads.append(torch.cat([t.flatten() for t in (g.values() if isinstance(g, dict) else [g])]))
        assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6), argnum
    tangent = torch.randn_like(x)
    tangents = []
    for m in (fused, plain):
        with fwad.dual_level():
            tangents.append(fwad.unpack_dual(m(fwad.make_dual(x, tangent))).tangent)
    assert tangents[0] is not None and torch.allclose(tangents[0], tangents[1], rtol=1e-5, atol=1e-6)
    if op != "conv_bn_act":  # vmap over training-mode BatchNorm is torch's own limitation
        xs = torch.randn(4, *x.shape)
        assert torch.allclose(torch.func.vmap(fused)(xs), torch.func.vmap(plain)(xs), rtol=1e-5, atol=1e-6)
    # outside the transforms the fused op still runs
    with fusedrc.use_backend("reference"):
        names = {"linear_act": "LinearAct", "fused_mlp": "FusedMlp", "conv_bn_act": "ConvBnAct"}
        assert type(fused(x).grad_fn).__name__ == f"{names[op]}FunctionBackward"


def test_conv_bn_relu_call_that_raises_counts_no_batch(monkeypatch):
    """Any exception from the op (a bad channel count; a RuntimeError from inside, such as backend
    'triton' without CUDA or the interpreter) leaves num_batches_tracked as it was."""
    m = fusedrc.nn.ConvBNReLU(3, 4, 3).train()
    with pytest.raises(ValueError):
        m(torch.randn(2, 5, 8, 8))

    def fail(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(fusedrc.functional, "conv_bn_act", fail)
    with pytest.raises(RuntimeError, match="kernel failed"):
        m(torch.randn(2, 3, 8, 8))
    assert m.bn.num_batches_tracked.item() == 0


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_plain_eager_calls_skip_the_dispatcher_with_the_same_results(backend):
    """A plain eager call runs the op's body through an autograd.Function (no dispatcher overhead);
    under a dispatch mode the custom ops run, seen by the mode. Same outputs and gradients, bit
    for bit, on both paths; frozen parameters get no gradient on either."""
    torch.manual_seed(0)
    models = [fusedrc.nn.FusedMLP(6, 10, 5, activation="gelu"), fusedrc.nn.GatedMLP(6, 10, 5),
              fusedrc.nn.LinearReLU(6, 8), fusedrc.nn.ConvBNReLU(3, 4, 3, padding=1)]
    models[0].fc1.weight.requires_grad_(False)
    dev = _backend_device(backend)
    for m in models:
        m.to(dev)
        x = torch.randn(2, 3, 5, 5, device=dev) if isinstance(m, fusedrc.nn.ConvBNReLU) else torch.randn(4, 6, device=dev)
        x.requires_grad_(True)
        results = []
        for watch in (None, FusedOpLog()):
            state = copy.deepcopy(m.state_dict())
            with fusedrc.use_backend(backend), (watch or contextlib.nullcontext()):
                y = m(x)
                grads = torch.autograd.grad(y.square().sum(), [x, *[p for p in m.parameters() if p.requires_grad]])
            results.append((y, grads, copy.deepcopy(m.state_dict())))
            m.load_state_dict(state)  # the same BatchNorm buffers for the second run
            if watch is None:
                assert type(y.grad_fn).__name__.endswith("FunctionBackward")
            else:
                fwd, bwd = watch.ops  # the triton_op twins on the triton backend: name_triton
                assert bwd == fwd.replace("_triton", "") + "_backward" + ("_triton" if backend == "triton" else "")
        (y0, g0, s0), (y1, g1, s1) = results
        assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
        # the running statistics: one Triton launch in the plain call, torch ops (a visible mutation) under a
        # dispatch mode; the same formula, rounded alike but for torch's fused multiply-add in its CPU lerp
        assert all(torch.equal(s0[k], s1[k]) if backend == "reference" or "running" not in k
                   else torch.allclose(s0[k], s1[k], rtol=1e-6, atol=0) for k in s0)
