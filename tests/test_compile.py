"""torch.compile: fused ops trace with zero graph breaks and match eager (issue 7.1, DESIGN.md §2).

Each check compiles with ``fullgraph=True`` (any graph break raises) and also asks
``torch._dynamo.explain`` for its break count and the ops in the graph; then it runs
two training steps eagerly and compiled on twins of one model and compares outputs,
input and parameter gradients, and buffers (BatchNorm running statistics).
CPU runs use the reference backend with ``aot_eager`` (inductor on CPU costs
~20 s a compile here: one test); the CUDA test runs the Triton backend under inductor.
"""
import copy
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fusedrc
from fusedrc import functional as F
from fusedrc.convert import _import_torchvision
from _utils import FusedOpLog, fused_without_norms, rel_err

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # one module's forward is compiled for many models: no cache-limit fallbacks
    yield
    torch._dynamo.reset()


def _graph_ops(fn, *args):
    """(graph count, break count, op names) from torch._dynamo.explain."""
    torch._dynamo.reset()
    e = torch._dynamo.explain(fn)(*args)
    ops = [str(op) for graph in e.ops_per_graph for op in graph]
    torch._dynamo.reset()
    return e.graph_count, e.graph_break_count, ops


def _compare(make, shape, *, device="cpu", dtype=torch.float32, backend="aot_eager", expect_ops=(), steps=2,
             atol=1e-5, tol=None, fullgraph=True):
    """Compile a twin of ``make()`` and check it against eager over ``steps`` training steps."""
    torch.manual_seed(0)
    eager = make().to(device)
    torch.manual_seed(0)
    twin = make().to(device)
    twin.load_state_dict(eager.state_dict())
    if fullgraph:
        probe = make().to(device)  # explain runs the model: a third twin, so the others' BN stats stay equal
        graphs, breaks, ops = _graph_ops(probe, torch.randn(*shape, device=device, dtype=dtype, requires_grad=True))
        assert (graphs, breaks) == (1, 0), ops
        for name in expect_ops:
            assert any(name in op for op in ops), (name, ops)
    compiled = torch.compile(twin, backend=backend, fullgraph=fullgraph)  # fullgraph: any break raises
    for step in range(steps):
        x = torch.randn(*shape, device=device, dtype=dtype)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(step)
        ye = eager(xe)
        torch.manual_seed(step)
        yc = compiled(xc)
        g = torch.randn_like(ye)
        ye.backward(g)
        yc.backward(g)
        pairs = [("output", ye, yc), ("input grad", xe.grad, xc.grad)]
        pairs += [(f"grad {n}", p.grad, q.grad) for (n, p), q in zip(eager.named_parameters(), twin.parameters())]
        pairs += [(f"buffer {n}", b, c) for (n, b), c in zip(eager.named_buffers(), twin.buffers())]
        for what, a, b in pairs:
            assert (a is None) == (b is None), what
            if a is None:
                continue
            if not a.is_floating_point():
                assert torch.equal(a, b), (what, a, b)
            elif tol is not None:
                assert rel_err(b, a) < tol, (what, rel_err(b, a))
            else:
                torch.testing.assert_close(b, a, atol=atol, rtol=1e-5, msg=f"step {step}: {what}")
        for p in list(eager.parameters()) + list(twin.parameters()):
            p.grad = None
    return compiled


# --------------------------------------------------------------------------- models
class _Functional(nn.Module):
    def __init__(self, kind, activation):
        super().__init__()
        self.kind, self.activation = kind, activation
        if kind == "conv_bn_act":
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
        else:
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        if self.kind == "linear_act":
            return F.linear_act(x, self.fc1.weight, self.fc1.bias, self.activation)
        if self.kind == "fused_mlp":
            return F.fused_mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self.activation)
        bn = self.bn
        return F.conv_bn_act(x, self.conv.weight, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                             training=self.training, momentum=bn.momentum, eps=bn.eps, padding=1,
                             bias=self.conv.bias, activation=self.activation)


def _net():
    """Conv-BN-ReLU stem, Linear-ReLU-Linear FFN and a lone Linear-ReLU, as plain torch modules."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 32), nn.ReLU(), nn.Linear(32, 16),
        nn.Linear(16, 24), nn.ReLU(),
    )


class _More(nn.Module):
    """The other kernels: BN -> ReLU -> Conv, a Conv-BN with a residual, a Mix-FFN over the pixels and an
    RMS-normed FFN, both with dropout, and an xIELU FFN (its alphas trained through the op)."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.pre = fusedrc.nn.BNReLUConv(3, 8, 3, padding=1)
        self.res = fusedrc.nn.ConvBNReLU(8, 8, 1)
        self.mix = fusedrc.nn.MixFFN(8, 16, dropout=dropout)
        self.ffn = fusedrc.nn.FusedMLP(8 * 6 * 6, 32, out_features=16, dropout=dropout, norm="rms")
        self.up, self.down = nn.Linear(16, 24, bias=False), nn.Linear(24, 16)
        self.alphas = nn.Parameter(torch.tensor([0.3, -0.2]))

    def forward(self, x):
        y = self.pre(x)
        tokens = self.res(y, residual=y).flatten(2).transpose(1, 2)
        h = self.ffn(self.mix(tokens, 6, 6).flatten(1))
        a = nn.functional.softplus(self.alphas)
        return fusedrc.functional.xielu_mlp(h, self.up.weight, None, self.down.weight, self.down.bias, a[0], a[1] + 0.5)


_FUSED_NET_OPS = ("fusedrc.conv_bn_act", "fusedrc.fused_mlp", "fusedrc.linear_act")


class _Recomputed(nn.Module):
    """``fusedrc.recompute`` of a block inside a model."""

    def __init__(self, block, **kwargs):
        super().__init__()
        self.block, self.kwargs = block, kwargs

    def forward(self, x):
        return fusedrc.recompute(self.block, x, **self.kwargs)


# --------------------------------------------------------------------------- fake implementations
def _fake_matches_real(op, *args):
    """The op's fake outputs have the real outputs' shapes, strides, dtypes and devices
    (inductor asserts the strides; opcheck does not compare them)."""
    real = op(*args)
    mode = FakeTensorMode()
    with mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
    assert len(real) == len(fake)
    for i, (r, f) in enumerate(zip(real, fake)):
        meta = lambda t: (tuple(t.shape), t.stride() if t.numel() else None, t.dtype, t.device)  # noqa: E731
        assert meta(r) == meta(f), (op, i, meta(r), meta(f))
    return real


def _layout_cases(device, backend, ops_by_name):
    """(op, args) for every fused op; ``ops_by_name``: ``ops._CUSTOM_OPS`` or ``ops._TRITON_OPS``."""
    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=device, dtype=dtype)

    op = ops_by_name.__getitem__
    x = t(16, 4).t()  # non-contiguous (16, 4) -> strides (1, 16)
    w1, b1, w2, b2 = t(8, 16), t(8), t(5, 8), t(5)
    g = t(4, 8)
    yield op("linear_act"), (x, w1, b1, "relu", backend)
    yield op("linear_act_backward"), (x, w1, b1, g, "relu", backend)
    yield op("linear_act_backward"), (x, w1, None, g, "gelu", backend)
    yield op("fused_mlp"), (x, w1, None, w2, b2, "silu", backend, 0.0, None)
    yield op("fused_mlp_backward"), (x, w1, None, w2, b2, t(4, 5), "silu", backend, 0.0, None)
    seed = torch.tensor([7], device=device)
    yield op("fused_mlp"), (x, w1, b1, w2, b2, "gelu", backend, 0.25, seed)
    yield op("fused_mlp_backward"), (x, w1, b1, w2, b2, t(4, 5), "gelu", backend, 0.25, seed)
    # the Mix-FFN on x's 4 rows as one 2 x 2 image, a 3 x 3 depthwise conv; with and without biases and dropout
    wd, bd = t(8, 1, 3, 3), t(8)
    yield op("mix_ffn"), (x, w1, b1, wd, bd, w2, b2, 2, 2, "gelu", backend, 0.0, None)
    yield op("mix_ffn_backward"), (x, w1, None, wd, None, w2, b2, t(4, 5), 2, 2, "gelu", backend, 0.25, seed)
    yield op("mix_ffn_backward"), (x, w1, b1, wd, bd, w2, None, t(4, 5), 2, 2, "relu", backend, 0.0, None,
                                   [True, False, True, True, False, True, False])
    # xIELU's FFN: the alphas 1-element tensors (one bf16, as Apertus's default makes them)
    alphas = (t(1).abs(), t(1, dtype=torch.bfloat16).abs())
    yield op("xielu_mlp"), (x, w1, b1, w2, None, *alphas, 0.5, -1e-6, backend)
    yield op("xielu_mlp_backward"), (x, w1, b1, w2, None, *alphas, 0.5, -1e-6, t(4, 5), backend)
    yield op("xielu_mlp_backward"), (x, w1, None, w2, b2, *alphas, 0.5, -1e-6, t(4, 5), backend,
                                     [False, True, False, True, False, True, False])
    if "moe_experts" in ops_by_name:  # no triton_op twin: it loops over the routed experts
        idx, wts = torch.tensor([[0, 2], [1, 2], [2, 0], [0, 1]], device=device), t(4, 2)
        gate_up, down = t(3, 6, 16).transpose(1, 2).contiguous().transpose(1, 2), t(3, 5, 3)  # strided gate_up
        yield op("moe_experts"), (x, idx, wts, gate_up, down, "silu", backend)
        yield op("moe_experts_backward"), (x, idx, wts, gate_up, down, t(4, 5), "silu", backend)
        yield op("moe_experts_backward"), (x, idx, wts, gate_up, down, t(4, 5), "silu", backend,
                                           [True, False, False, True, False, False])
        gate, up = gate_up[:, :3], gate_up[:, 3:]  # up projections apart (DBRX's), a SwiGLU limit
        yield op("moe_experts"), (x, idx, wts, gate, down, "silu|limit=0.5", backend, True, up)
        for mask in (None, [True, True, False, True, False, False]):  # up's gradient follows gate's flag
            yield op("moe_experts_backward"), (x, idx, wts, gate, down, t(4, 5), "silu|limit=0.5", backend, mask,
                                               True, up)
        # gpt-oss's: interleaved gate/up rows, per-expert biases, its gate (alpha, up offset)
        act, biases = "silu|limit=0.5|alpha=1.702|up_offset=1.0", (t(3, 6), t(3, 5))
        yield op("moe_experts"), (x, idx, wts, gate_up, down, act, backend, True, None, *biases, True)
        for mask in (None, [False, True, True, False, True, False]):
            yield op("moe_experts_backward"), (x, idx, wts, gate_up, down, t(4, 5), act, backend, mask, True, None,
                                               *biases, True)
    geometry = (1e-5, [1, 1], [1, 1], [1, 1], "relu", backend)
    for dtype, cl in ((torch.float32, True), (torch.float32, False), (torch.float16, True), (torch.float64, False)):
        if dtype == torch.float16 and device == "cpu" and backend == "reference":
            continue  # CPU half conv: not every torch build has it
        xc = t(2, 4, 5, 5, dtype=dtype)
        xc = xc.to(memory_format=torch.channels_last) if cl else xc
        wc, res = t(6, 4, 3, 3, dtype=dtype), t(2, 6, 5, 5, dtype=dtype)  # residual contiguous either way
        wc = wc.to(memory_format=torch.channels_last) if cl else wc  # dW takes the weight's layout
        bn = torch.float64 if dtype == torch.float64 else torch.float32  # fp32 BN with fp16 x, as under autocast
        gamma, beta, rm, rv = t(6, dtype=bn), t(6, dtype=bn), t(6, dtype=bn), t(6, dtype=bn).abs() + 0.5
        for training in (True, False):
            y, mean, rstd = _fake_matches_real(
                op("conv_bn_act"), xc, wc, None, gamma, beta, rm, rv, res, training, *geometry)
            yield op("conv_bn_act_backward"), (xc, wc, None, gamma, beta, mean, rstd, res, torch.randn_like(y),
                                               training, *geometry)
            bg, bb, brm, brv = t(4, dtype=bn), t(4, dtype=bn), t(4, dtype=bn), t(4, dtype=bn).abs() + 0.5
            y, mean, rstd = _fake_matches_real(
                op("bn_act_conv"), xc, bg, bb, brm, brv, wc, None, training, *geometry)
            yield op("bn_act_conv_backward"), (xc, bg, bb, wc, None, mean, rstd, torch.randn_like(y),
                                               training, *geometry)
    # a padding wider on one side, (left, right, top, bottom): the output 7x6, dx cropped to x's 5x5
    xc = t(2, 4, 5, 5).to(memory_format=torch.channels_last)
    wc, gamma, beta = t(6, 4, 3, 3), t(6), t(6)
    wider = (1e-5, [1, 1], [0, 3, 1, 3], [1, 1], "relu", backend)
    y, mean, rstd = _fake_matches_real(op("conv_bn_act"), xc, wc, None, gamma, beta, None, None, None, True, *wider)
    assert y.shape == (2, 6, 7, 6)
    yield op("conv_bn_act_backward"), (xc, wc, None, gamma, beta, mean, rstd, None, torch.randn_like(y), True, *wider)


def test_fake_implementations_match_real_layouts():
    from fusedrc import ops

    for op, args in _layout_cases("cpu", "reference", ops._CUSTOM_OPS):
        _fake_matches_real(op, *args)


def _needs_triton_op():
    if not fusedrc._backend.triton_available():
        pytest.skip("Triton is not installed")
    if not hasattr(torch.library, "triton_op"):
        pytest.skip("torch < 2.6 has no triton_op: the custom ops run the Triton backend")


def _needs_triton(device):
    if not fusedrc._backend.triton_available():
        pytest.skip("Triton is not installed")
    if device.type == "cpu" and not fusedrc._backend.interpreter_active():
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1")
    fusedrc._backend.has_triton_kernel("linear_act", "linear_act_forward")  # registers the triton_op twins


def test_fake_implementations_match_triton_layouts(device):
    from fusedrc import ops

    _needs_triton(device)
    for op, args in _layout_cases(device.type, "triton", ops._CUSTOM_OPS):
        _fake_matches_real(op, *args)
    if device.type == "cuda":  # a triton_op's fake is its own body, traced: not under the interpreter
        for op, args in _layout_cases(device.type, "triton", ops._TRITON_OPS):
            _fake_matches_real(op, *args)


# What each kernel writes: its outputs, never an operand (torch's mutation analysis, on the TTIR).
_KERNEL_OUTPUTS = {
    "_conv_bn_fwd_kernel": {"y_ptr", "z_ptr", "pmean_ptr", "pm2_ptr"},
    "_bn_stats_finalize_kernel": {"mean_ptr", "rstd_ptr"},
    "_conv_bn_bwd_kernel": {"dz_ptr", "dres_ptr", "pg_ptr", "pgx_ptr", "pdb_ptr"},
    "_channel_stats_kernel": {"pmean_ptr", "pm2_ptr"},
    "_bn_act_conv_fwd_kernel": {"y_ptr"},
    "_bn_act_apply_kernel": {"a_ptr"},
    "_bn_act_grad_reduce_kernel": {"pg_ptr", "pgx_ptr"},
    "_bn_act_grad_dx_kernel": {"dx_ptr"},
    "_rms_norm_fwd_kernel": {"y_ptr", "rstd_ptr"},
    "_rms_norm_bwd_kernel": {"dx_ptr", "pdw_ptr"},
    "_gemm_act_kernel": {"c_ptr"},
    "_gemm_act_grad_kernel": {"gh_ptr", "act_ptr", "part_ptr", "dscale_ptr", "xielu_part_ptr"},
    "_gated_act_kernel": {"c_ptr"},
    "_gated_act_grad_kernel": {"ghg_ptr", "ghu_ptr", "act_ptr", "partg_ptr", "partu_ptr", "dscale_ptr"},
    "_dwconv_act_kernel": {"a_ptr"},
    "_dwconv_act_grad_kernel": {"gh_ptr", "act_ptr", "wpart_ptr", "bpart_ptr"},
    "_dwconv_input_grad_kernel": {"out_ptr", "part_ptr"},
}


@pytest.mark.parametrize("net,launches,kernels", [
    # forward: conv+BN (conv with statistics, finalize, apply) 3, FFN 2, Linear+ReLU 1; backward:
    # conv+BN 2 (+ aten.convolution_backward), FFN 5, Linear+ReLU 3 (plain GEMMs are Triton off CUDA)
    ("ffn", [6, 10], {"_conv_bn_fwd_kernel", "_bn_stats_finalize_kernel", "_conv_bn_bwd_kernel", "_gemm_act_kernel",
                      "_gemm_act_grad_kernel"}),
    # two gated FFNs: forward dual GEMM + down GEMM each; backward dAct, the dual grad kernel, dW_down,
    # dW_gate, dW_up and dX's two GEMMs each
    ("gated", [4, 14], {"_gated_act_kernel", "_gemm_act_kernel", "_gated_act_grad_kernel"}),
    # BN-ReLU-Conv, a Conv-BN-ReLU with a residual, a Mix-FFN, an RMS-normed FFN with dropout and an xIELU FFN:
    # three launches each forward (the xIELU FFN two: its activation is a GEMM epilogue); backward the rest of the
    # kernels (and aten's conv backward), the Mix-FFN's 7, the xIELU FFN's 5
    ("more", [14, 24], {"_channel_stats_kernel", "_bn_stats_finalize_kernel", "_bn_act_conv_fwd_kernel",
                        "_conv_bn_fwd_kernel", "_rms_norm_fwd_kernel", "_gemm_act_kernel", "_gemm_act_grad_kernel",
                        "_rms_norm_bwd_kernel", "_conv_bn_bwd_kernel", "_bn_act_apply_kernel",
                        "_bn_act_grad_reduce_kernel", "_bn_act_grad_dx_kernel", "_dwconv_act_kernel",
                        "_dwconv_act_grad_kernel", "_dwconv_input_grad_kernel"}),
])
def test_triton_op_twins_compile_into_their_launches(net, launches, kernels):
    """torch.compile of a model through the triton_op twins, forward and backward compiled
    together: the graphs that reach the compiler hold the Triton launches
    (triton_kernel_wrapper_functional) and aten ops, no opaque fusedrc op; torch's analysis of
    which arguments each kernel writes succeeds and finds only its outputs (an operand counted as
    written is cloned in the forward; in the backward AOTAutograd rejects the joint graph).
    Compiled on the CPU up to the graphs, never run (tests/_trace_triton_ops.py); the GPU test
    below runs them."""
    _needs_triton_op()
    script = os.path.join(os.path.dirname(__file__), "_trace_triton_ops.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, script] + ([] if net == "ffn" else [net]), env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["analysis_warnings"] == []
    assert [_launch_count(out[kind]) for kind in ("forward", "backward")] == launches
    assert set(out["written"]) == kernels
    for kernel, written in out["written"].items():
        assert written and set(written) <= _KERNEL_OUTPUTS[kernel], (kernel, written)
    if net != "gated":
        assert "aten.convolution_backward.default" in out["backward"]


def _capturing_backend():
    """aot_eager that keeps the forward and backward graphs it is given."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return aot_autograd(fw_compiler=capture, bw_compiler=capture), graphs


def _launch_count(targets):
    """Triton launches among a graph's call_function targets; no opaque fusedrc op may be left."""
    assert not [t for t in targets if t.startswith("fusedrc.")], targets
    return targets.count("triton_kernel_wrapper_functional")


def _launches(graphs):
    """Triton launches in the first forward and backward graphs; no fusedrc op left in any."""
    counts = [_launch_count([str(n.target) for n in gm.graph.nodes if n.op == "call_function"]) for gm in graphs]
    assert len(counts) >= 2, counts  # forward and backward
    return counts[0], counts[1]


def test_triton_backend_runs_the_triton_op_twins(device):
    """Eager Triton calls go through the triton_op twins (fusedrc::*_triton), forward and backward;
    under torch.compile on the interpreter, the opaque custom ops (the interpreter cannot be traced)."""
    from fusedrc import ops

    _needs_triton(device)
    _needs_triton_op()
    assert set(ops._TRITON_OPS) == set(ops._CUSTOM_OPS) - ops._NO_TRITON_TWIN
    model = fusedrc.convert(_net()).to(device)
    x = torch.randn(2, 3, 6, 6, device=device, requires_grad=True)
    with fusedrc.use_backend("triton"), FusedOpLog() as log:
        model(x).sum().backward()
    fused = ("conv_bn_act", "fused_mlp", "linear_act")
    assert sorted(log.ops) == sorted([f"{n}_triton" for n in fused] + [f"{n}_backward_triton" for n in fused])
    with fusedrc.use_backend("reference"), FusedOpLog() as log:
        model(x).sum().backward()
    assert sorted(log.ops) == sorted(list(fused) + [f"{n}_backward" for n in fused])
    if device.type == "cpu":
        with fusedrc.use_backend("triton"):
            _, _, names = _graph_ops(model, x)
        assert [n for n in names if "fusedrc" in n] == ["fusedrc.conv_bn_act.default", "fusedrc.fused_mlp.default",
                                                         "fusedrc.linear_act.default"], names


# --------------------------------------------------------------------------- reference backend, CPU
@pytest.fixture
def reference():
    with fusedrc.use_backend("reference"):
        yield


@pytest.mark.parametrize("kind,activation,shape", [
    ("linear_act", "gelu", (2, 5, 16)),
    ("fused_mlp", "silu", (6, 16)),
    ("conv_bn_act", "relu", (2, 3, 6, 6)),
])
def test_functional_ops(reference, kind, activation, shape):
    _compare(lambda: _Functional(kind, activation), shape, expect_ops=(f"fusedrc.{kind}",))


@pytest.mark.parametrize("make,shape,op", [
    (lambda: fusedrc.nn.LinearReLU(16, 24), (4, 16), "fusedrc.linear_act"),
    (lambda: fusedrc.nn.FusedMLP(16, 32, activation="gelu_tanh"), (3, 16), "fusedrc.fused_mlp"),
    (lambda: fusedrc.nn.ConvBNReLU(3, 8, 3, padding=1), (2, 3, 6, 6), "fusedrc.conv_bn_act"),
    (lambda: fusedrc.nn.ConvBNReLU(3, 8, 3, stride=2, padding=1, bias=True).eval(), (2, 3, 7, 7),
     "fusedrc.conv_bn_act"),
    (lambda: fusedrc.nn.BNReLUConv(3, 8, 3, stride=2, padding=1), (2, 3, 7, 7), "fusedrc.bn_act_conv"),
], ids=["LinearReLU", "FusedMLP", "ConvBNReLU", "ConvBNReLU-eval", "BNReLUConv"])
def test_modules(reference, make, shape, op):
    _compare(make, shape, expect_ops=(op,), steps=3)


def test_conv_bn_cumulative_momentum(reference):
    # momentum=None: the averaging factor 1/num_batches_tracked is read from a tensor every
    # step, a graph break (torch's own BatchNorm2d(momentum=None) does not compile with
    # fullgraph=True either); the results are still right
    def make():
        m = fusedrc.nn.ConvBNReLU(3, 8, 3, padding=1)
        m.bn.momentum = None
        return m

    _compare(make, (2, 3, 6, 6), steps=3, fullgraph=False)


def test_converted_model(reference):
    _compare(lambda: fusedrc.convert(_net()), (2, 3, 6, 6), expect_ops=_FUSED_NET_OPS, steps=3)


def test_converted_padding_wider_on_one_side(reference):
    """Conv-BN whose conv pads one side wider, converted: timm's Conv2dSame (padded by the input's size,
    read in the graph) and a MixedConv2d of an odd and an even 'same' kernel (one op per split). One
    graph, as eager over training steps; with dynamic sizes too (the padding follows the input)."""
    _import_torchvision()  # timm imports torchvision
    layers = pytest.importorskip("timm.layers", reason="timm is not installed (test extra)")

    def make():
        return fusedrc.convert(nn.Sequential(
            layers.Conv2dSame(3, 6, 3, stride=2, bias=False), nn.BatchNorm2d(6), nn.SiLU(),
            layers.MixedConv2d(6, 8, [3, 4], padding="same"), nn.BatchNorm2d(8), nn.ReLU()))

    _compare(make, (2, 3, 9, 8), expect_ops=("conv_bn_act",))
    torch.manual_seed(0)
    eager = make()
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager", fullgraph=True, dynamic=True)
    for hw in ((9, 8), (12, 11)):
        x = torch.randn(2, 3, *hw)
        torch.testing.assert_close(compiled(x), eager(x), atol=1e-5, rtol=1e-5)


def test_converted_densenet(reference):
    """torchvision DenseNet converted: its dense layers (a rule's Wrapper, list inputs) and transitions
    (fx) run pre-activation units; zero graph breaks, eager's outputs, gradients and statistics."""
    _import_torchvision()
    import torchvision

    def make():
        torch.manual_seed(0)
        return fusedrc.convert(torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16,
                                                           bn_size=2, num_classes=5))

    _compare(make, (2, 3, 32, 32), expect_ops=("fusedrc.bn_act_conv", "fusedrc.conv_bn_act"), steps=2)


class _DropoutFFN(nn.Module):
    """A forward reading self.training (F.dropout): convert gives it one fx graph per mode."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(nn.functional.dropout(x, 0.25, training=self.training))))


@pytest.mark.parametrize("training", [True, False])
def test_converted_model_with_a_graph_per_mode(reference, training):
    def make():
        conv = fusedrc.convert(_DropoutFFN()).train(training)
        assert conv.fusedrc_plan.fused == ["fc1"]
        return conv
    _compare(make, (4, 16), expect_ops=["fusedrc.fused_mlp"])


@pytest.mark.parametrize("form", ["split", "packed"])
def test_converted_gated_ffn_found_by_fx(reference, form):
    """A gated FFN the fx pass found (two Linears of one input; one Linear's chunked halves, the op on row
    views of its weight), its norm inside the op: one graph, the fused op in it, eager's results."""
    from test_convert import _FxGated

    def make():
        torch.manual_seed(0)
        conv = fusedrc.convert(_FxGated(form))
        assert [u.kind for u in conv.fusedrc_plan.units] == ["norm_gated_ffn"]
        return conv
    _compare(make, (3, 5, 12), expect_ops=["fusedrc.gated_mlp"])


def test_converted_written_out_activations(reference):
    """Activations written out as elementwise ops that the fx pass took for fused ones (Conv-BN-Swish, ESM's
    erf GELU in an FFN, a tanh GELU before a scale): one graph, the fused ops in it, eager's results."""
    from test_convert import _Written

    def make():
        torch.manual_seed(0)
        return fusedrc.convert(_Written())
    _compare(make, (4, 3, 6, 6), expect_ops=["fusedrc.conv_bn_act", "fusedrc.fused_mlp", "fusedrc.linear_act"])


def test_converted_model_inductor(reference):
    # inductor asserts the custom ops' real output strides against their fake implementations
    _compare(lambda: fusedrc.convert(_net()), (2, 3, 6, 6), backend="inductor", steps=2, atol=1e-4)


class _HFLayer(nn.Module):
    """One Hugging Face BertLayer or MPNetLayer on hidden states (the FFN split over intermediate and
    output: BERT's in feed_forward_chunk, MPNet's inline in the layer's forward)."""

    def __init__(self, transformers, family):
        super().__init__()
        config = transformers.BertConfig if family == "bert" else transformers.MPNetConfig
        cfg = config(hidden_size=32, intermediate_size=64, num_attention_heads=4, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
        cfg._attn_implementation = "eager"  # standalone: no model picked the attention
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        self.layer = getattr(module, "BertLayer" if family == "bert" else "MPNetLayer")(cfg)

    def forward(self, x):
        y = self.layer(x)
        return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("family", ["bert", "mpnet"])
def test_converted_bert_style_layer(reference, family):
    """convert's BERT rules: dynamo follows the feed_forward_chunk set on BertLayer's instance, and MPNet's
    stand-ins (found through their layer, not its frame, while compiling) into the fused op."""
    try:  # transformers imports torchvision when it is installed: fusedrc's way first
        _import_torchvision()
    except ImportError:
        pass
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (test extra)")

    def make():
        conv = fusedrc.convert(_HFLayer(transformers, family).train())
        assert fused_without_norms(conv.fusedrc_plan) == ["layer.intermediate"]
        return conv
    _compare(make, (2, 5, 32), expect_ops=["fusedrc.fused_mlp"])


@pytest.mark.parametrize("block,shape,op", [
    (lambda: nn.Sequential(nn.Linear(16, 24), nn.ReLU()), (4, 16), "fusedrc.linear_act"),
    (lambda: nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Dropout(0.0), nn.Linear(48, 16)), (4, 16),
     "fusedrc.fused_mlp"),
    (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()), (2, 3, 6, 6),
     "fusedrc.conv_bn_act"),
    (lambda: fusedrc.nn.ConvBNReLU(3, 8, 3, padding=1), (2, 3, 6, 6), "fusedrc.conv_bn_act"),
    (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU()), (2, 3, 6, 6),
     "fusedrc.conv_bn_act"),
    (lambda: nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, groups=2), nn.BatchNorm2d(8), nn.ReLU()), (2, 4, 6, 6),
     "fusedrc.conv_bn_act"),
], ids=["linear_relu", "ffn", "conv_bn_relu", "ConvBNReLU", "conv_bn_silu", "grouped"])
def test_recompute_of_a_pattern_is_the_fused_op(reference, block, shape, op):
    # pattern matching runs at trace time: the graph holds the fused op, no checkpoint
    _compare(lambda: _Recomputed(block()), shape, expect_ops=(op,))
    _, _, ops = _graph_ops(_Recomputed(block()), torch.randn(*shape, requires_grad=True))
    assert not any("checkpoint" in o for o in ops), ops


def _generic(p=0.3):
    # aot_eager draws dropout masks from the eager RNG stream; inductor has its own generator
    return nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.Tanh(), nn.Dropout(p), nn.Linear(32, 16))


def test_generic_region_goes_through_torch_checkpoint(reference):
    # the saved-tensors-hook engine is not traceable: under compile a generic region is
    # torch.utils.checkpoint (dynamo's tag_activation_checkpoint), no graph break
    _compare(lambda: _Recomputed(_generic()), (4, 16), expect_ops=("tag_activation_checkpoint",), steps=2)


def test_generic_region_with_batchnorm_updates_running_stats_once(reference):
    block = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh())  # noqa: E731
    _compare(lambda: _Recomputed(block()), (2, 3, 6, 6), expect_ops=("tag_activation_checkpoint",), steps=3)


def test_generic_region_options_under_compile(reference):
    # output_recompute has no effect under compile (the output is kept), nor do early_stop and
    # determinism_check (the rerun is part of the compiled backward); results are unchanged
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = _generic(), _generic()

        def forward(self, x):
            h = fusedrc.recompute(self.a, x, output_recompute=True)
            return fusedrc.recompute(self.b, h, determinism_check="none", early_stop=False)

    _compare(Two, (4, 16), expect_ops=("tag_activation_checkpoint",))


def test_marked_modules(reference):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.generic = fusedrc.mark(_generic())
            self.ffn = fusedrc.mark(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)))

        def forward(self, x):
            return self.ffn(self.generic(x))

    _compare(Net, (4, 16), expect_ops=("tag_activation_checkpoint", "fusedrc.fused_mlp"))


def test_backend_choice_is_guarded(monkeypatch, device):
    # the backend is resolved at trace time; switching it recompiles instead of reusing the graph
    from fusedrc import ops

    seen = []
    real = ops.get_impl
    monkeypatch.setattr(ops, "get_impl", lambda backend, *a: seen.append(backend) or real(backend, *a))
    model = fusedrc.nn.LinearReLU(16, 8).to(device)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    with fusedrc.use_backend("reference"):
        compiled(x).sum().backward()
    assert seen == ["reference", "reference"]
    del seen[:]
    if not fusedrc._backend.triton_available():
        pytest.skip("Triton is not installed")
    if device.type == "cpu" and not fusedrc._backend.interpreter_active():
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1")
    with fusedrc.use_backend("triton"):  # on the CPU: Triton's interpreter
        y = compiled(x)
        y.sum().backward()
    # on CUDA the triton_op twins trace their bodies at compile time (inductor then runs the kernels
    # without get_impl); on the interpreter the opaque custom ops call it at run time, once each way
    assert seen and set(seen) == {"triton"}, seen
    torch.testing.assert_close(y, model(x), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- Triton backend, CUDA
@pytest.mark.skipif(not CUDA, reason="needs CUDA: the Triton backend under inductor is checked on a GPU")
def test_triton_backend_on_cuda_inductor():
    with fusedrc.use_backend("triton"):
        _compare(lambda: fusedrc.convert(_net()), (8, 3, 6, 6), device="cuda", backend="inductor",
                 expect_ops=_FUSED_NET_OPS, steps=3, tol=1e-4)
        _compare(lambda: _Recomputed(_generic(p=0.0)), (8, 16), device="cuda", backend="inductor",
                 expect_ops=("tag_activation_checkpoint",), tol=1e-4)
        for dtype in (torch.float16, torch.bfloat16):
            _compare(lambda: fusedrc.nn.FusedMLP(64, 128, activation="gelu").to(dtype), (32, 64), device="cuda",
                     dtype=dtype, backend="inductor", expect_ops=("fusedrc.fused_mlp",), tol=1e-2)
        # the dual-GEMM kernels (torch's mutation analysis once counted their operands as written)
        _compare(lambda: fusedrc.nn.GatedMLP(64, 96, bias=True), (32, 64), device="cuda", backend="inductor",
                 expect_ops=("fusedrc.gated_mlp",), tol=1e-4)
        _compare(lambda: _More(dropout=0.0), (8, 3, 6, 6), device="cuda", backend="inductor", tol=1e-4)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: compiled triton_op graphs run on a GPU (the CPU test stops at the graphs)")
def test_triton_ops_expose_their_kernels_to_the_compiler():
    """On CUDA, compiled graphs of a converted model hold the twins' Triton launches, forward and
    backward, and match eager. The plain GEMMs are cuBLAS there: forward conv+BN 3 + FFN 1 +
    Linear+ReLU 1; backward conv+BN 2 + FFN 1 + Linear+ReLU 1."""
    backend, graphs = _capturing_backend()
    with fusedrc.use_backend("triton"):
        _compare(lambda: fusedrc.convert(_net()), (8, 3, 6, 6), device="cuda", backend=backend,
                 expect_ops=_FUSED_NET_OPS, steps=2, tol=1e-4)
    fw, bw = _launches(graphs)
    assert (fw, bw) == (5, 4)


class _TracedNet(nn.Module):
    """Not a Sequential: convert rewrites it with torch.fx (an instance forward)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.fc2(torch.relu(self.fc1(h)))


@pytest.mark.parametrize("strict", [False, True])
def test_export_of_an_fx_converted_model(strict):
    """torch.export reads an instance forward as a function (its __code__, non-strict): an
    fx-rewritten model, marked or not, exports and runs as the eager one (a marked one non-strict:
    a strict export of a checkpoint region fails in torch itself)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    for marked in (False, True) if not strict else (False,):
        m = fusedrc.convert(_TracedNet().eval())
        assert [u.kind for u in m.fusedrc_plan.units] == ["conv_bn_relu", "ffn"]
        if marked:
            fusedrc.mark(m)
        ep = torch.export.export(m, (x,), strict=strict)
        assert rel_err(ep.module()(x), m(x)) <= 1e-6, marked


def test_export_training_batchnorm_and_dynamic_batch():
    """torch.export of fused modules: a training-mode ConvBNReLU exports (strict or not) with its
    running statistics updated by the exported program, and the dense modules keep a dynamic batch."""
    torch.manual_seed(0)
    for strict in (False, True):
        m = fusedrc.nn.ConvBNReLU(3, 4, 3, padding=1).train()
        ep = torch.export.export(m, (torch.randn(2, 3, 6, 6),), strict=strict)
        out = ep.module()
        before = out.bn.running_mean.clone()
        out(torch.randn(2, 3, 6, 6))
        assert not torch.equal(out.bn.running_mean, before), strict
    batch = torch.export.Dim("batch", min=2)
    for m, x in ((fusedrc.nn.LinearReLU(8, 16), torch.randn(3, 8)),
                 (fusedrc.nn.FusedMLP(8, 16), torch.randn(3, 8))):
        ep = torch.export.export(m, (x,), dynamic_shapes=({0: batch},), strict=False)
        y = ep.module()(torch.randn(5, 8))
        assert y.shape[0] == 5
