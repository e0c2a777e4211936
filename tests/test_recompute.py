"""DESIGN.md §3: the recompute contract, each point against a plain run of the same model."""
import copy
import functools
import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fusedrc
import fusedrc.functional as FF
from _utils import GemmCounter, SavedBytes, rel_err


def _generic_block(d=16):
    return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))


PATTERNS = {
    "generic": lambda: (_generic_block(), (4, 16)),
    "linear_relu": lambda: (nn.Sequential(nn.Linear(16, 24), nn.ReLU()), (5, 16)),
    "ffn": lambda: (nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 16)), (2, 5, 16)),
    "ffn_gelu_dropout0": lambda: (
        nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Dropout(0.0), nn.Linear(48, 16)), (6, 16)),
    "conv_bn_relu": lambda: (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()), (2, 3, 6, 6)),
    "conv_bn_silu": lambda: (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU()), (2, 3, 6, 6)),
    # 'same' of an even kernel: one more row and column of padding at the far side (padded before the op)
    "conv_bn_relu_same_even": lambda: (
        nn.Sequential(nn.Conv2d(3, 8, 4, padding="same"), nn.BatchNorm2d(8), nn.ReLU()), (2, 3, 7, 6)),
    # no conv bias: before BatchNorm with nothing after it, its gradient is pure rounding noise
    "conv_bn": lambda: (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)), (2, 3, 6, 6)),
}


def _params_grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_outputs_bitwise_and_gradients_equal_plain(name):
    model, shape = PATTERNS[name]()
    twin = copy.deepcopy(model)
    x = torch.randn(*shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y = fusedrc.recompute(model, x)
    y_plain = twin(x2)
    assert torch.equal(y, y_plain), "forward must be bitwise equal on the CPU reference path"
    g = torch.randn_like(y)
    y.backward(g)
    y_plain.backward(g)
    assert rel_err(x.grad, x2.grad) < 1e-6
    for a, b in zip(_params_grads(model), _params_grads(twin)):
        # absolute floor: a conv bias before BatchNorm has a gradient of pure rounding noise
        assert (a - b).norm() <= 1e-6 * max(b.norm(), 10.0)
    if name == "generic":  # same ops, same order: bitwise
        assert torch.equal(x.grad, x2.grad)


def test_autograd_grad_and_backward_inputs():
    block = _generic_block()
    x = torch.randn(3, 16, requires_grad=True)
    (gx,) = torch.autograd.grad(fusedrc.recompute(block, x).sum(), x)
    (gx_plain,) = torch.autograd.grad(block(x).sum(), x)
    assert torch.equal(gx, gx_plain)
    w = block[1].weight
    fusedrc.recompute(block, x).sum().backward(inputs=[w])
    assert x.grad is None and w.grad is not None
    gw = w.grad.clone()
    w.grad = None
    block(x).sum().backward(inputs=[w])
    assert torch.equal(gw, w.grad)


def test_retain_graph_second_backward():
    block = _generic_block()
    x = torch.randn(3, 16, requires_grad=True)
    y = fusedrc.recompute(block, x).sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward()
    assert torch.allclose(x.grad, 2 * first)


def test_kwargs_nested_and_non_tensor_inputs_outputs():
    lin = nn.Linear(8, 8)

    def fn(pair, scale, *, extra, mode="sum"):
        a, b = pair
        out = {"y": lin(a) * scale + extra["bias"], "z": [torch.tanh(b), mode]}
        return out, 3

    a = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(4, 8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)
    out, k = fusedrc.recompute(fn, (a, b), 0.5, extra={"bias": bias}, mode="max")
    assert k == 3 and out["z"][1] == "max"
    (out["y"].sum() + out["z"][0].pow(2).sum()).backward()
    grads = [t.grad.clone() for t in (a, b, bias)]
    for t in (a, b, bias):
        t.grad = None
    ref, _ = fn((a, b), 0.5, extra={"bias": bias}, mode="max")
    (ref["y"].sum() + ref["z"][0].pow(2).sum()).backward()
    for g, t in zip(grads, (a, b, bias)):
        assert torch.equal(g, t.grad)


def test_inputs_without_requires_grad():
    block = _generic_block()
    x = torch.randn(3, 16)  # no grad: only the parameters get gradients
    fusedrc.recompute(block, x).sum().backward()
    grads = _params_grads(block)
    block.zero_grad()
    block(x).sum().backward()
    for a, b in zip(grads, _params_grads(block)):
        assert torch.equal(a, b)


def test_nested_regions():
    inner = _generic_block()
    outer_lin = nn.Linear(16, 16)

    def outer(x):
        return outer_lin(fusedrc.recompute(inner, torch.sin(x))).tanh()

    x = torch.randn(4, 16, requires_grad=True)
    fusedrc.recompute(outer, x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    outer_lin.zero_grad(), inner.zero_grad()
    (outer_lin(inner(torch.sin(x))).tanh()).sum().backward()
    assert torch.allclose(g, x.grad, atol=1e-7, rtol=0)


def test_double_backward_through_generic_region():
    def fn(x):
        return (x.sin() * x).pow(2)

    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(fusedrc.recompute(fn, x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    (g_ref,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    (gg_ref,) = torch.autograd.grad(g_ref.sum(), x)
    assert torch.allclose(g, g_ref) and torch.allclose(gg, gg_ref)


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_plain_call_without_grad(ctx):
    block = _generic_block()
    x = torch.randn(2, 16)
    with ctx(), SavedBytes() as s:
        y = fusedrc.recompute(block, x)
    assert s.bytes == 0 and not y.requires_grad
    assert torch.equal(y, block(x))


def test_dropout_masks_and_rng_stream():
    block = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 32), nn.Dropout(0.3))
    x = torch.randn(16, 32, requires_grad=True)
    torch.manual_seed(123)
    y = fusedrc.recompute(block, x)
    y.sum().backward()
    after_rc = torch.rand(4)
    g = x.grad.clone()
    x.grad = None
    torch.manual_seed(123)
    y_plain = block(x)
    y_plain.sum().backward()
    after_plain = torch.rand(4)
    assert torch.equal(y, y_plain)
    assert torch.equal(g, x.grad), "the rerun must draw the same dropout masks"
    assert torch.equal(after_rc, after_plain), "the global RNG stream must be where a plain run leaves it"


def test_autocast_state_restored_for_rerun():
    lin = nn.Linear(16, 16)
    dtypes = []

    def fn(x):
        h = lin(x)
        dtypes.append(h.dtype)
        return h.float().tanh()

    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fusedrc.recompute(fn, x)
    y.sum().backward()  # outside autocast: the rerun must still run in bf16
    assert dtypes == [torch.bfloat16, torch.bfloat16]
    g = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = fn(x)
    ref.sum().backward()
    assert torch.equal(y, ref) and torch.equal(g, x.grad)


def _bn_block():
    # not a fused pattern (Tanh): exercises the generic path
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh())


@pytest.mark.parametrize("make", [_bn_block, PATTERNS["conv_bn_relu"]], ids=["generic", "fused"])
def test_batchnorm_running_stats_change_once_per_forward(make):
    block = make()
    block = block[0] if isinstance(block, tuple) else block
    block[1].momentum = None  # cumulative average: sensitive to num_batches_tracked as well
    plain, via_torch = copy.deepcopy(block), copy.deepcopy(block)
    for step in range(3):
        x = torch.randn(2, 3, 6, 6, requires_grad=True)
        fusedrc.recompute(block, x).sum().backward()
        plain(x).sum().backward()
        checkpoint(via_torch, x, use_reentrant=False).sum().backward()
    bn, ref, bad = block[1], plain[1], via_torch[1]
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 3
    assert rel_err(bn.running_mean, ref.running_mean) < 1e-6
    assert rel_err(bn.running_var, ref.running_var) < 1e-6
    # the point of the test: torch's checkpoint updates a second time in the rerun
    assert int(bad.num_batches_tracked) == 6


def test_functional_conv_bn_act_in_a_region_updates_running_stats_once():
    """A direct fusedrc.functional.conv_bn_act call (no BatchNorm module for the rerun's pre-hook to
    see) inside a generic region: its rerun in backward must not move the running statistics again."""
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    rm, rv = torch.zeros(4), torch.ones(4)
    ref_m, ref_v = rm.clone(), rv.clone()

    def fn(x, rm, rv):
        return FF.conv_bn_act(torch.tanh(x), w, None, None, rm, rv, training=True, momentum=0.3, padding=1)

    for _ in range(2):
        x = torch.randn(2, 3, 5, 5, requires_grad=True)
        fusedrc.recompute(lambda x: fn(x, rm, rv), x).sum().backward()
        g = x.grad
        x.grad = None
        fn(x, ref_m, ref_v).sum().backward()
        assert rel_err(g, x.grad) < 1e-5
    assert rel_err(rm, ref_m) < 1e-6 and rel_err(rv, ref_v) < 1e-6


@pytest.mark.parametrize("make", [_bn_block, lambda: nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))],
                         ids=["generic_bn", "fused_ffn"])
def test_forward_ad_through_a_region(make):
    """Forward-mode AD (dual inputs) runs through a region like through torch.utils.checkpoint: the
    tangent is the plain block's, and a reverse backward after it still recomputes correctly."""
    import torch.autograd.forward_ad as fwad

    block = make()
    plain = copy.deepcopy(block)
    shape = (2, 3, 6, 6) if isinstance(block[0], nn.Conv2d) else (5, 6)
    x = torch.randn(shape, requires_grad=True)
    tangent = torch.randn(shape)
    outs = []
    for m, run in ((block, functools.partial(fusedrc.recompute, block)), (plain, plain)):
        with fwad.dual_level():
            primal, dual = fwad.unpack_dual(run(fwad.make_dual(x, tangent)))
            primal.square().sum().backward()
        outs.append((primal.detach(), dual, x.grad))
        x.grad = None
    (y, t, g), (y_ref, t_ref, g_ref) = outs
    assert t is not None
    assert rel_err(y, y_ref) < 1e-6 and rel_err(t, t_ref) < 1e-5 and rel_err(g, g_ref) < 1e-5
    for name in ("running_mean", "running_var"):
        if isinstance(block[1], nn.BatchNorm2d):
            assert torch.equal(getattr(block[1], name), getattr(plain[1], name))


def test_torch_func_transforms_run_a_region_plainly():
    """Inside torch.func.grad / vmap / jvp / jacfwd a region runs its block as it is (the transform
    differentiates it; saved-tensor hooks do not compose with its levels): the plain block's results,
    also for a reverse backward after vmap."""
    torch.manual_seed(0)
    block = _tanh_mlp()
    plain = copy.deepcopy(block)
    run = functools.partial(fusedrc.recompute, block)
    xs = torch.randn(3, 5, 6, requires_grad=True)
    y = torch.func.vmap(run)(xs)
    y.square().sum().backward()
    g = xs.grad.clone()
    xs.grad = None
    torch.func.vmap(plain)(xs).square().sum().backward()
    assert torch.equal(g, xs.grad) and torch.equal(block[0].weight.grad, plain[0].weight.grad)
    x, t = xs[0].detach(), torch.randn(5, 6)
    assert torch.equal(torch.func.jvp(run, (x,), (t,))[1], torch.func.jvp(plain, (x,), (t,))[1])
    assert torch.equal(torch.func.jacfwd(run)(x[0]), torch.func.jacfwd(plain)(x[0]))
    params = dict(block.named_parameters())

    def loss(p, x, recomputed):
        f = functools.partial(torch.func.functional_call, block, p)
        return (fusedrc.recompute(lambda v: f((v,)), x) if recomputed else f((x,))).sum()

    got, ref = torch.func.grad(loss)(params, x, True), torch.func.grad(loss)(params, x, False)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


class _Flaky(nn.Module):
    """Saves a differently shaped tensor when rerun."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.fail_with = None

    def forward(self, x):
        self.calls += 1
        if self.fail_with is not None and self.calls > 1:
            raise self.fail_with
        n = x.shape[1] if self.calls == 1 else x.shape[1] - 1
        return (x[:, :n] * x[:, :n]).sum(1)


def test_recomputed_tensor_mismatch_raises():
    x = torch.randn(3, 5, requires_grad=True)
    y = fusedrc.recompute(_Flaky(), x)
    with pytest.raises(fusedrc.RecomputeError, match="shape"):
        y.sum().backward()
    assert issubclass(fusedrc.RecomputeError, torch.utils.checkpoint.CheckpointError)


def test_rerun_saving_fewer_tensors_raises():
    state = {"first": True}

    def fn(x):
        y = x.sin()
        if state.pop("first", False):
            y = y.exp()  # one more saved tensor in the forward only
        return y

    x = torch.randn(4, requires_grad=True)
    y = fusedrc.recompute(fn, x)
    with pytest.raises(fusedrc.RecomputeError, match="saved 1 tensors but the forward saved 2"):
        y.sum().backward()


def test_exception_inside_rerun_leaves_everything_usable():
    flaky = _Flaky()
    flaky.fail_with = KeyError("boom")
    bn_block = _bn_block()
    x = torch.randn(2, 3, 4, 4, requires_grad=True)

    def region(inp):  # BatchNorm runs in the rerun before the failure
        return flaky(bn_block(inp).flatten(1))

    y = fusedrc.recompute(region, x)
    stats = [b.clone() for b in bn_block[1].buffers()]
    with pytest.raises(KeyError, match="boom"):
        y.sum().backward()
    assert not fusedrc._state.in_recompute()
    for before, after in zip(stats, bn_block[1].buffers()):
        assert torch.equal(before, after), "the failed rerun must not leave BatchNorm updated"
    # the next step works and matches a plain step
    flaky.fail_with = None
    plain = copy.deepcopy(bn_block)
    x.grad = None
    fusedrc.recompute(bn_block, x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    plain(x).sum().backward()
    assert rel_err(g, x.grad) < 1e-6
    for a, b in zip(bn_block[1].buffers(), plain[1].buffers()):
        assert torch.equal(a, b)


def test_no_reference_cycles():
    block = _generic_block(64)
    x = torch.randn(32, 64, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        h = x * 2  # non-leaf: only the region's graph keeps it once `h` is deleted
        y = fusedrc.recompute(block, h)
        h_ref, out_ref = weakref.ref(h), weakref.ref(y)
        del h
        assert h_ref() is not None, "the region must keep its input while the output lives"
        del y
        assert out_ref() is None and h_ref() is None, "input freed with the output: no reference cycle"
    finally:
        gc.enable()


def test_saved_bytes_equal_region_inputs():
    block = _generic_block(32)
    x = torch.randn(16, 32, requires_grad=True)
    y0 = torch.randn(16, 32, requires_grad=True)

    def fn(a, b):
        return block(a) * torch.sigmoid(b)

    with SavedBytes() as plain:
        fn(x, y0)
    with SavedBytes() as rc:
        fusedrc.recompute(fn, x, y0)
    assert plain.bytes > 4 * x.numel() * 4
    assert rc.bytes == (x.numel() + y0.numel()) * 4


def test_fused_ffn_runs_seven_gemms():
    ffn = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.randn(8, 16, requires_grad=True)
    with GemmCounter() as c:
        fusedrc.recompute(ffn, x).sum().backward()
    assert c.gemms == 7
    assert any(op.startswith("fusedrc.fused_mlp") for op in c.ops)
    with GemmCounter() as c_plain:
        ffn(x).sum().backward()
    assert c_plain.gemms == 6


def test_generic_block_follows_torch_checkpoint():
    block = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 16))
    x = torch.randn(8, 16, requires_grad=True)
    with GemmCounter() as ours:
        fusedrc.recompute(block, x).sum().backward()
    with GemmCounter() as theirs:
        checkpoint(block, x, use_reentrant=False).sum().backward()
    with GemmCounter() as full:
        checkpoint(block, x, use_reentrant=False, early_stop=False).sum().backward()
    assert ours.gemms == theirs.gemms < full.gemms


def test_output_recompute_drops_the_intermediate():
    a_block, b_block = _generic_block(32), _generic_block(32)
    x = torch.randn(16, 32, requires_grad=True)

    def run(flag):
        with SavedBytes() as s:
            h = fusedrc.recompute(a_block, x, output_recompute=flag)
            y = fusedrc.recompute(b_block, h)
        y.pow(2).sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in (*a_block.parameters(), *b_block.parameters())]
        x.grad = None
        a_block.zero_grad(), b_block.zero_grad()
        return s.bytes, grads

    kept, g_kept = run(False)
    merged, g_merged = run(True)
    assert kept == 2 * x.numel() * 4 and merged == x.numel() * 4
    for a, b in zip(g_kept, g_merged):
        assert torch.equal(a, b)
    # a consumer that is not recomputed: no effect
    with SavedBytes() as s1:
        b_block(fusedrc.recompute(a_block, x, output_recompute=True))
    with SavedBytes() as s2:
        b_block(fusedrc.recompute(a_block, x))
    assert s1.bytes == s2.bytes


def test_context_fn_is_used():
    entered = []

    class Ctx:
        def __init__(self, tag):
            self.tag = tag

        def __enter__(self):
            entered.append(self.tag)

        def __exit__(self, *a):
            return False

    x = torch.randn(3, 16, requires_grad=True)
    y = fusedrc.recompute(_generic_block(), x, context_fn=lambda: (Ctx("fwd"), Ctx("rerun")))
    assert entered == ["fwd"]
    y.sum().backward()
    assert entered == ["fwd", "rerun"]


def test_output_recompute_on_a_fused_pattern_producer():
    producer = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
    consumer = _generic_block(32)
    x = torch.randn(16, 32, requires_grad=True)
    with SavedBytes() as s:
        y = fusedrc.recompute(consumer, fusedrc.recompute(producer, x, output_recompute=True))
    assert s.bytes == x.numel() * 4
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    consumer(producer(x)).sum().backward()
    assert torch.equal(g, x.grad)


@pytest.mark.parametrize("name", ["ffn", "conv_bn_relu", "conv_bn_silu"])
def test_fused_patterns_under_autocast_match_eager(name):
    model, shape = PATTERNS[name]()
    twin = copy.deepcopy(model)
    x = torch.randn(*shape, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), SavedBytes() as s:
        y = fusedrc.recompute(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = twin(x)
    assert y.dtype == ref.dtype == torch.bfloat16
    # the fused path keeps the bf16 casts of x and of the GEMM/conv weights (as eager does)
    # and, for conv+BN, the fp32 per-channel mean and rstd
    casts = [p for n, p in model.named_parameters() if n.startswith(("0.", "2.")) or name == "ffn"]
    expected = 2 * (x.numel() + sum(p.numel() for p in casts))
    if name.startswith("conv_bn"):
        expected += 2 * 4 * model[1].num_features
    assert s.bytes == expected
    assert rel_err(y, ref) < 1e-2
    y.float().sum().backward()
    g = x.grad.clone()
    x.grad = None
    ref.float().sum().backward()
    assert rel_err(g, x.grad) < 2e-2


def test_marked_module_survives_deepcopy():
    """A deep copy of a marked module is marked and computes with its own parameters."""
    import copy

    m = fusedrc.mark(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)))
    c = copy.deepcopy(m)
    with torch.no_grad():
        for p in c.parameters():
            p.add_(1.0)
    x = torch.randn(3, 4, requires_grad=True)
    with SavedBytes() as saved:
        y = c(x)
    assert saved.bytes == x.numel() * 4, "the copy is still recomputed: only x is kept"
    y.sum().backward()
    assert all(p.grad is None for p in m.parameters()), "gradients went to the original"
    assert all(p.grad is not None for p in c.parameters())
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    ref.load_state_dict(c.state_dict())
    torch.testing.assert_close(y, ref(x))


def test_cpu_scalar_tensor_beside_parameters_on_another_device():
    """A 0-dim CPU tensor is a scalar torch ops take on any device: accepted, as by a plain call
    and torch.utils.checkpoint (the meta device stands in for a GPU); a 1-element vector is not."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4, device="meta")

        def forward(self, x, s):
            return self.fc(x) * s

    m = Scaled()
    x = torch.randn(2, 4, device="meta", requires_grad=True)
    assert fusedrc.recompute(m, x, torch.tensor(2.0)).device.type == "meta"
    # integer side tensors (lengths, indices) may live elsewhere by design
    class Trim(Scaled):
        def forward(self, x, n):
            return self.fc(x)[:, : int(n[0])]

    y = fusedrc.recompute(Trim(), x, torch.tensor([3]))
    assert y.shape == (2, 3) and y.device.type == "meta"
    with pytest.raises(ValueError, match=r"input tensor #1 .* on cpu"):
        fusedrc.recompute(m, x, torch.tensor([2.0]))


def test_batchnorm_buffers_keep_their_version():
    """Neither the rerun's restore of BatchNorm buffers nor the fused conv+BN's statistics update
    bumps the buffers' version counters (BatchNorm's own kernel does not): a graph that saved
    them (x * bn.running_var) still runs backward, as plain calls and torch's checkpoint do."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    x = torch.randn(6, 3, requires_grad=True)
    h = x * bn.running_var
    fusedrc.recompute(lambda t: bn(t).tanh(), h).pow(2).sum().backward()
    assert x.grad is not None
    seq = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    h = x * seq[1].running_mean[:3].view(1, 3, 1, 1)
    version = seq[1].running_mean._version
    y = fusedrc.recompute(seq, h)
    assert seq[1].running_mean._version == version
    y.sum().backward()
    assert x.grad is not None


def test_mark_is_idempotent_and_takes_fusedrc_modules():
    lin = fusedrc.mark(fusedrc.nn.LinearReLU(4, 8))
    assert fusedrc.mark(lin) is lin  # twice is once
    x = torch.randn(3, 4, requires_grad=True)
    lin(x).sum().backward()  # used to recurse: the fused path called the marked module again
    ref = torch.relu(nn.functional.linear(x, lin.weight, lin.bias))
    assert torch.equal(lin(x), ref)
    fusedrc.unmark(lin)
    assert "forward" not in lin.__dict__ and torch.equal(lin(x), ref)


def test_fused_path_respects_instance_forward_and_global_hooks():
    """A child whose forward was replaced on the instance (adapters), or global module hooks
    (trackers), take the call away from the fused op: the results and hook calls are plain's."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 4)
    inner = lin.forward
    lin.forward = lambda x: inner(x) * 10.0
    m = nn.Sequential(lin, nn.ReLU())
    x = torch.randn(2, 3)
    assert torch.equal(fusedrc.recompute(m, x), m(x))
    seen = []
    handle = nn.modules.module.register_module_forward_pre_hook(lambda mod, args: seen.append(type(mod).__name__))
    try:
        fusedrc.recompute(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), x)
    finally:
        handle.remove()
    assert seen == ["Sequential", "Linear", "ReLU"]


def test_output_recompute_pass_through_input_is_freed():
    """output_recompute=True on a block that returns one of its inputs as is: nothing outlives the
    step (the registry used to hold the frame, which held the input, its own key)."""

    def block(x, mask):
        return x.tanh() * mask, mask

    x, mask = torch.randn(8, 8, requires_grad=True), torch.ones(8, 8)
    y, m = fusedrc.recompute(block, x, mask, output_recompute=True)
    assert m is mask
    y.sum().backward()
    wx, wm = weakref.ref(x), weakref.ref(mask)
    del x, mask, y, m
    gc.collect()
    assert wx() is None and wm() is None


def test_output_recompute_nested_and_with_context_fn():
    """output_recompute inside an outer region, or with a context_fn: correct gradients (such
    outputs are saved as usual instead of regenerated)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x0 = torch.randn(4, 8)

    def producer(x):
        return (x @ w1).tanh()

    def consumer(h):
        return (h @ w2).sin()

    def grads(run):
        x = x0.clone().requires_grad_()
        run(x).sum().backward()
        out = [t.grad.clone() for t in (x, w1, w2)]
        w1.grad = w2.grad = None
        return out

    ref = grads(lambda x: consumer(producer(x * 2)).exp())
    nested = grads(lambda x: fusedrc.recompute(
        lambda t: fusedrc.recompute(consumer, fusedrc.recompute(producer, t * 2, output_recompute=True)).exp(), x))
    ctx = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    with_ctx = grads(lambda x: consumer(fusedrc.recompute(producer, x * 2, output_recompute=True,
                                                          context_fn=ctx)).exp())
    for got in (nested, with_ctx):
        for a, b in zip(got, ref):
            assert torch.allclose(a, b, atol=1e-6)


def _tanh_mlp(width=6):
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())


def test_output_recompute_under_outer_hooks_and_nested_consumers():
    """A tagged output is regenerated only for a top-level consumer: a chain inside
    torch.utils.checkpoint (its placeholders unpack once per backward), and a consumer that hands the
    tagged tensor on to a nested region or fused pattern (the outer rerun's input is untagged, so the
    nested region must save it in the forward too) give plain gradients."""
    torch.manual_seed(0)
    a, b = _tanh_mlp(), _tanh_mlp()
    fusedrc.mark(a, output_recompute=True)
    fusedrc.mark(b)
    x = torch.randn(3, 6, requires_grad=True)
    ref = torch.autograd.grad(b(a(x)).sum(), x)[0]
    got = torch.autograd.grad(checkpoint(lambda v: b(a(v)), x, use_reentrant=False).sum(), x)[0]
    assert torch.allclose(got, ref, atol=1e-6)
    fusedrc.unmark(a), fusedrc.unmark(b)
    for inner in (_tanh_mlp(), nn.Sequential(nn.Linear(6, 6), nn.ReLU())):  # generic, fused pattern
        def outer(v, inner=inner):
            return fusedrc.recompute(inner, v).sin()
        ref = torch.autograd.grad(outer(a(x)).sum(), x)[0]
        got = torch.autograd.grad(fusedrc.recompute(outer, fusedrc.recompute(a, x, output_recompute=True)).sum(),
                                  x)[0]
        assert torch.allclose(got, ref, atol=1e-6)


def test_output_recompute_producer_with_a_fused_dropout_ffn():
    """The regenerated output of a producer holding a fused FFN with dropout is the forward's: the
    regeneration runs the FFN's plain composition as the region's forward did (same mask)."""
    torch.manual_seed(0)
    producer0 = nn.Sequential(nn.LayerNorm(8), fusedrc.nn.FusedMLP(8, 32, dropout=0.5))
    consumer0 = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh())
    x0 = torch.randn(16, 8)
    grads = []
    for merge in (False, True):
        producer, consumer = copy.deepcopy(producer0), copy.deepcopy(consumer0)
        fusedrc.mark(producer, output_recompute=merge)
        fusedrc.mark(consumer)
        x = x0.clone().requires_grad_()
        torch.manual_seed(7)
        (consumer(producer(x)) * torch.arange(8.0)).sum().backward()
        grads.append((x.grad, consumer[1].weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_marked_norm_module_updates_running_stats_once():
    """mark() on a BatchNorm (or a subclass: timm's BatchNormAct2d) and an InstanceNorm with running
    statistics inside a region: the rerun calls forward, not __call__, or runs a non-BatchNorm _NormBase;
    statistics still move once per forward."""
    class BatchNormTanh(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x).tanh()

    for make in (lambda: nn.BatchNorm2d(4, momentum=None), lambda: BatchNormTanh(4)):
        bn, plain = make(), make()
        fusedrc.mark(bn)
        for _ in range(3):
            x = torch.randn(2, 4, 5, 5, requires_grad=True)
            bn(x).tanh().sum().backward()
            plain(x).tanh().sum().backward()
        assert int(bn.num_batches_tracked) == int(plain.num_batches_tracked) == 3
        assert torch.allclose(bn.running_mean, plain.running_mean) and torch.allclose(bn.running_var, plain.running_var)
    block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True), nn.Tanh())
    plain = copy.deepcopy(block)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    fusedrc.recompute(block, x).sum().backward()
    plain(x).sum().backward()
    assert torch.allclose(block[1].running_mean, plain[1].running_mean)
    assert torch.allclose(block[1].running_var, plain[1].running_var)


def test_running_stats_handed_as_views_of_one_buffer():
    """One layer applied twice in a region with its statistics sliced from one buffer per call
    (rm[0]): every view is restored to its value from before the rerun."""
    w = torch.randn(3, 3, 3, 3, requires_grad=True)

    def block(x, rm, rv):
        for _ in range(2):
            x = FF.conv_bn_act(x, w, None, None, rm[0], rv[0], training=True, momentum=0.5, padding=1,
                               activation="silu")
        return x

    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    rm, rv, rm_ref, rv_ref = torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3), torch.ones(1, 3)
    fusedrc.recompute(block, x, rm, rv).sum().backward()
    block(x, rm_ref, rv_ref).sum().backward()
    assert torch.allclose(rm, rm_ref, atol=1e-6) and torch.allclose(rv, rv_ref, atol=1e-5)


def test_recompute_sequential_takes_use_reentrant_false():
    """torch asks checkpoint_sequential's callers to pass use_reentrant=False: accepted."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    x = torch.randn(2, 3, requires_grad=True)
    assert torch.equal(fusedrc.recompute_sequential(model, 2, x, use_reentrant=False), model(x))


def test_marked_module_replica_uses_its_own_parameters():
    """nn.DataParallel's replicate copies a module's __dict__: the replica of a marked module must
    run with the replica's parameters, not the original's (emulated on the CPU)."""
    torch.manual_seed(0)
    lin = fusedrc.mark(nn.Linear(3, 4))
    replica = lin._replicate_for_data_parallel()
    replica.weight, replica.bias = torch.randn(4, 3), lin.bias * 2  # as replicate() sets them: tensors
    x = torch.randn(2, 3, requires_grad=True)
    assert torch.equal(replica(x), nn.functional.linear(x, replica.weight, replica.bias))
    assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))
    fusedrc.unmark(lin)
    assert "_replicate_for_data_parallel" not in lin.__dict__
