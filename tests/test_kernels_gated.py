"""Gated FFN (SwiGLU/GeGLU) Triton kernels against the float64 reference, and the op around them.

Under Triton's interpreter on the CPU (tests/conftest.py): small awkward shapes, several tiles in
M and H, a ragged K loop.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as TF

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import fusedrc  # noqa: E402
from fusedrc import reference as R  # noqa: E402
from fusedrc.kernels import _common, gated_mlp  # noqa: E402
from _utils import GemmCounter, SavedBytes, record_launches, rel_err  # noqa: E402
from test_kernels_dense import TOL, _check, _d, _near_zero_inputs, _rand, spy_launches  # noqa: E402

SHAPES = [(1, 1, 1, 1), (37, 33, 50, 20)]  # (M, K, H, N)
NAMES = ["out", "dx", "dw_gate", "db_gate", "dw_up", "db_up", "dw_down", "db_down"]


def _inputs(M, K, H, N, dtype, device, bias=True, up_bias=None):
    up_bias = bias if up_bias is None else up_bias
    x = _rand(M, K, dtype=dtype, device=device)
    wg = _rand(H, K, dtype=dtype, device=device, scale=max(K, 1) ** -0.5)
    wu = _rand(H, K, dtype=dtype, device=device, scale=max(K, 1) ** -0.5)
    wd = _rand(N, H, dtype=dtype, device=device, scale=H ** -0.5)
    bg = _rand(H, dtype=dtype, device=device, scale=0.5) if bias else None
    bu = _rand(H, dtype=dtype, device=device, scale=0.5) if up_bias else None
    bd = _rand(N, dtype=dtype, device=device, scale=0.5) if bias else None
    g = _rand(M, N, dtype=dtype, device=device)
    return x, wg, bg, wu, bu, wd, bd, g


def _check_gated(x, wg, bg, wu, bu, wd, bd, g, act, dtype):
    out = gated_mlp.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, act)
    grads = gated_mlp.gated_mlp_backward(x, wg, bg, wu, bu, wd, bd, g, act)
    ref_args = [_d(t) for t in (x, wg, bg, wu, bu, wd, bd)]
    out_ref = R.gated_mlp_forward(*ref_args, act)
    grads_ref = R.gated_mlp_backward(*ref_args, _d(g), act)
    _check([out, *grads], [out_ref, *grads_ref], dtype, NAMES)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "relu", "quick_gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gated_mlp(shape, dtype, act, bias, device):
    _check_gated(*_inputs(*shape, dtype, device, bias), act, dtype)


@pytest.mark.parametrize("act", ["gelu", "relu2", "leaky_relu:0.2"])
def test_gated_mlp_other_activations_and_one_bias(act, device):
    """The remaining activations; a gate bias without an up bias (the kernel adds zeros for it)."""
    _check_gated(*_inputs(29, 40, 36, 11, torch.float32, device, bias=True, up_bias=False), act, torch.float32)


def test_gated_mlp_noncontiguous(device):
    """Transposed operands, and gate/up weights of different strides."""
    x, wg, bg, wu, bu, wd, bd, g = _inputs(21, 18, 40, 13, torch.float32, device)
    x = x.t().contiguous().t()
    wg = wg.t().contiguous().t()
    wd = wd.t().contiguous().t()
    g = g.t().contiguous().t()
    assert wg.stride() != wu.stride()
    _check_gated(x, wg, bg, wu, bu, wd, bd, g, "silu", torch.float32)


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_interleaved_gate_and_up_rows(transposed, dtype, device):
    """Gate and up rows alternating in one tensor (gpt-oss's gate_up_proj, stored (K, 2H) when ``transposed``):
    the kernels read one operand of 2 * BLOCK_N adjacent columns in place (INTERLEAVED, no copy) and split it;
    every output and gradient against float64 (gpt-oss's clamped gate too), the recompute's product equal to
    the forward's bit for bit, over several tiles in M and H and a ragged K loop."""
    M, K, H, N = 37, 33, 50, 20
    x, _, bg, _, bu, wd, bd, g = _inputs(M, K, H, N, dtype, device)
    both = _rand(K, 2 * H, dtype=dtype, device=device, scale=K ** -0.5)
    pair = both.t() if transposed else both.t().contiguous()  # (2H, K), gate rows even
    wg, wu = pair[0::2], pair[1::2]
    cfg, operands, _, scalars, meta, _, _ = gated_mlp._dual_launch(x, wg, wu, bg, bu)
    assert meta["INTERLEAVED"] and operands[1].data_ptr() == pair.data_ptr()
    assert scalars[6] == (1 if transposed else K)  # stride_bn: contiguous columns in gpt-oss's storage
    assert H > cfg.BLOCK_N
    for act in ("silu", "silu|limit=0.7|alpha=1.702|up_offset=1.0"):
        _check_gated(x, wg, bg, wu, bu, wd, bd, g, act, dtype)
        ga = _rand(M, H, dtype=dtype, device=device)
        _, _, a_bwd, _, _ = gated_mlp.gated_act_grad(x, wg, wu, bg, bu, ga, act)
        assert torch.equal(a_bwd, gated_mlp.gated_act(x, wg, wu, bg, bu, act)), act
    # other row pairings are not interleaved: two operands
    assert not gated_mlp._dual_launch(x, pair[:H], pair[H:], bg, bu)[4]["INTERLEAVED"]
    assert not gated_mlp._dual_launch(x, pair[1::2], pair[0::2], bg, bu)[4]["INTERLEAVED"]
    assert not gated_mlp._dual_launch(x, wg.clone(), wu, bg, bu)[4]["INTERLEAVED"]
    # views autograd kept without their base (the same storage): found by data pointer
    assert gated_mlp._joint_rows(wg.detach(), wu.detach())[0] == "interleaved"
    # under tracing (fake tensors have no data pointer): found from the views' base, no data pointer read
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(K, 2 * H).t()
        assert gated_mlp._joint_rows(fake[0::2], fake[1::2])[0] == "interleaved"
        assert gated_mlp._joint_rows(fake[:H], fake[H:])[0] == "halves"
        assert gated_mlp._joint_rows(fake[0::2].detach(), fake[1::2].detach()) is None


@pytest.mark.parametrize("kind", ["interleaved", "halves"])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_gate_and_up_gradients_in_the_weights_row_order(kind, transposed, device, monkeypatch):
    """Gate and up rows of one tensor (gpt-oss's interleaved, Mixtral's halves; stored (K, 2H) when
    ``transposed``): the grad kernel writes g_hg and g_hu into one (M, 2H) buffer in the weights' row order, and
    ``input_grads`` takes dX and a stacked weight gradient's two halves in one GEMM each, written in place (a
    transposed stacked gradient too); all equal to the two-buffer path's. Rows that only look alike (two
    tensors, swapped halves) keep two buffers."""
    M, K, H = 37, 33, 50
    x = _rand(M, K, dtype=torch.float32, device=device)
    bg, bu = _rand(H, dtype=torch.float32, device=device), _rand(H, dtype=torch.float32, device=device)
    both = _rand(K, 2 * H, dtype=torch.float32, device=device, scale=K ** -0.5)
    pair = both.t() if transposed else both.t().contiguous()  # (2H, K)

    def rows(t):
        return (t[0::2], t[1::2]) if kind == "interleaved" else (t[:H], t[H:])

    wg, wu = rows(pair)
    assert gated_mlp._joint_rows(wg, wu)[0] == kind
    ga = _rand(M, H, dtype=torch.float32, device=device)
    act = "silu|limit=0.7|alpha=1.702|up_offset=1.0"
    ghg, ghu, a, dbg, dbu = gated_mlp.gated_act_grad(x, wg, wu, bg, bu, ga, act)
    joint = gated_mlp._joint_rows(ghg.t(), ghu.t())
    assert joint is not None and joint[0] == kind and joint[1].shape == (2 * H, M)
    apart = gated_mlp.gated_act_grad(x, wg.clone(), wu.clone(), bg, bu, ga, act)
    assert gated_mlp._joint_rows(apart[0].t(), apart[1].t()) is None
    for got, want in zip((ghg, ghu, a, dbg, dbu), apart):
        assert rel_err(got, want) < 1e-6
    # a stacked gradient (2 experts), laid out as the weights: expert 1's halves written by one GEMM in place
    stacked = torch.zeros(2, K, 2 * H, device=device).transpose(1, 2) if transposed else \
        torch.zeros(2, 2 * H, K, device=device)
    out = rows(stacked[1])
    calls = []
    real = gated_mlp.plain_gemm

    def spy(a, b, *args, **kwargs):
        calls.append(tuple(a.shape))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(gated_mlp, "plain_gemm", spy)
    dx, dwg, dwu = gated_mlp.input_grads(x, wg, wu, ghg, ghu, True, True, True, out)
    monkeypatch.undo()
    assert calls == [(M, 2 * H), (2 * H, M)]  # dX and both weight gradients: one GEMM each
    assert dwg is out[0] and dwu is out[1] and float(stacked[0].abs().sum()) == 0
    want = gated_mlp.input_grads(x, wg.clone(), wu.clone(), *apart[:2], True, True, True)
    for got, ref in zip((dx, dwg, dwu), want):
        assert rel_err(got, ref) < 1e-5
    # not the weights' order: the up rows first, or rows of two tensors
    swapped = gated_mlp.gated_act_grad(x, wu, wg, bu, bg, ga, "silu")
    assert gated_mlp._joint_rows(swapped[0].t(), swapped[1].t()) is None
    # the launch's output arguments cover every element the kernel writes (a traced launch's functionalization
    # copies back the written arguments' own elements): interleaved, the whole buffer through ghg_ptr and an
    # input at ghu_ptr; halves, the two halves
    seen = record_launches(monkeypatch, gated_mlp, args=True)
    ghg, ghu, *_ = gated_mlp.gated_act_grad(x, wg, wu, bg, bu, ga, act)
    monkeypatch.undo()
    launch_args = seen[-1][-1]
    at = gated_mlp._gated_act_grad_kernel.arg_names.index("ghg_ptr")
    ghg_arg, ghu_arg = launch_args[at:at + 2]
    if kind == "interleaved":
        assert ghg_arg.shape == (M, 2 * H) and ghg_arg.is_contiguous() and ghg._base is ghg_arg
        assert ghu_arg is launch_args[0]  # x: an input, never written
    else:
        assert ghg_arg is ghg and ghu_arg is ghu


def test_gated_mlp_empty(device):
    x, wg, bg, wu, bu, wd, bd, _ = _inputs(0, 5, 6, 7, torch.float32, device)
    out = gated_mlp.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, "silu")
    assert out.shape == (0, 7)
    dx, dwg, dbg, dwu, dbu, dwd, dbd = gated_mlp.gated_mlp_backward(
        x, wg, bg, wu, bu, wd, bd, torch.empty(0, 7, device=device), "silu")
    assert dx.shape == (0, 5) and float(dwg.abs().sum()) == 0 and float(dbg.abs().sum()) == 0
    assert dwd.shape == wd.shape and float(dbd.abs().sum()) == 0


def test_gated_mlp_bf16_upcast(device):
    """bf16 through the interpreter's upcast path (GPU: native bf16), against float64."""
    x, wg, bg, wu, bu, wd, bd, g = _inputs(20, 24, 40, 16, torch.bfloat16, device)
    out = gated_mlp.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, "silu")
    ref = R.gated_mlp_forward(*[_d(t) for t in (x, wg, bg, wu, bu, wd, bd)], "silu")
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_recompute_matches_forward_bit_for_bit(dtype, device):
    """The backward kernel's a = act(h_g) * h_u equals the forward's bit for bit, for every
    activation, on data whose gate pre-activation sits on the ReLU's kink; the ReLU mask of
    g_hg is the forward's sign."""
    M, K, H = 40, 100, 36
    x, wg, bg = _near_zero_inputs(M, K, H, dtype, device)
    wu = _rand(H, K, dtype=dtype, device=device, scale=K ** -0.5)
    bu = _rand(H, dtype=dtype, device=device)
    ones = torch.ones(M, H, dtype=dtype, device=device)
    for act in ("relu", "relu2", "gelu", "gelu_tanh", "silu"):
        a = gated_mlp.gated_act(x, wg, wu, bg, bu, act)
        ghg, ghu, a_bwd, _, _ = gated_mlp.gated_act_grad(x, wg, wu, bg, bu, ones, act)
        assert torch.equal(a_bwd, a), act
        if act == "relu":
            # g_hu = act(h_g): zero exactly where the forward's gate was cut
            gate_on = ghu != 0
            nz = a != 0
            assert torch.equal(gate_on[nz], torch.ones_like(gate_on[nz]))
            assert torch.equal(ghg != 0, gate_on & (ghg != 0))
            assert 0.2 < gate_on.float().mean() < 0.8  # the data really sits on the kink


def test_gated_tiles_other_than_the_table(device):
    """Tiles a sweep may try (the sm_90 table's 128x64 with BLOCK_K 64; a ragged 16-wide one) give
    the same results; the recompute under the same tile equals its forward bit for bit."""
    x, wg, bg, wu, bu, wd, bd, g = _inputs(140, 70, 130, 9, torch.float32, device)
    ref = R.gated_mlp_forward(*[_d(t) for t in (x, wg, bg, wu, bu, wd, bd)], "silu")
    ga = _rand(140, 130, dtype=torch.float32, device=device)
    for cfg in (_common.GemmConfig(128, 64, 64, 8, 8, 3), _common.GemmConfig(16, 16, 32, 1, 4, 1)):
        a = gated_mlp.gated_act(x, wg, wu, bg, bu, "silu", config=cfg)
        _, _, a_bwd, _, _ = gated_mlp.gated_act_grad(x, wg, wu, bg, bu, ga, "silu", config=cfg)
        assert torch.equal(a, a_bwd)
        out = torch.nn.functional.linear(a, wd, bd)
        assert rel_err(out, ref) < TOL[torch.float32], cfg


def test_gated_grad_epilogue_split(device):
    """The grad kernel's epilogue in column slices (``EPILOGUE_SPLIT`` 2 and 4, as the sm_90 128x128 entry
    runs it) emits the same g_hg, g_hu and product, bit for bit, as in one piece (values only, never the
    recomputed h), with the product dropout's mask and ragged tiles; the bias gradients and a routed
    expert's row-scale gradient (sums over the slices) agree to rounding; the recompute still equals
    the forward bit for bit."""
    x, wg, bg, wu, bu, wd, bd, g = _inputs(45, 40, 70, 9, torch.float32, device)
    ga = _rand(45, 70, dtype=torch.float32, device=device)
    scale = _rand(45, dtype=torch.float32, device=device)
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    runs = {}
    for split in (1, 2, 4):
        cfg = _common.GemmConfig(32, 64, 32, 2, 4, 1, split)
        plain = gated_mlp.gated_act_grad(x, wg, wu, bg, bu, ga, "gelu", config=cfg)
        dropped = gated_mlp.gated_act_grad(x, wg, wu, bg, bu, ga, "gelu", config=cfg, dropout=(0.3, seed))
        routed = gated_mlp.gated_act_grad(x, wg, wu, None, None, ga, "silu", config=cfg, row_scale=scale)
        # a SwiGLU clamp after the activation (its launches split a split tile's epilogue further: _clamp_split)
        clamped = gated_mlp.gated_act_grad(x, wg, wu, bg, bu, ga, R.gated_name("silu", 0.3, True), config=cfg)
        assert torch.equal(gated_mlp.gated_act(x, wg, wu, bg, bu, "gelu", config=cfg, dropout=(0.3, seed)), dropped[2])
        runs[split] = plain, dropped, routed, clamped
    for split in (2, 4):
        for got, want in zip(runs[split], runs[1]):
            for i in range(3):  # g_hg, g_hu, the product
                assert torch.equal(got[i], want[i]), (split, i)
        for i in (3, 4):  # the bias gradients
            assert rel_err(runs[split][0][i], runs[1][0][i]) < 1e-6
        assert rel_err(runs[split][2][5], runs[1][2][5]) < 1e-6  # d row_scale
    assert (runs[4][1][2] == 0).float().mean() > 0.2  # the mask really dropped
    assert (gated_mlp._clamp_split(4, 128, 10.0), gated_mlp._clamp_split(4, 128, 0.0),
            gated_mlp._clamp_split(1, 128, 10.0), gated_mlp._clamp_split(2, 64, 10.0)) == (8, 4, 1, 4)


def test_gated_table_choice():
    """The table's dual tile on sm_90 (a pure function of shape, dtype and dropout, so a forward and its
    recompute agree): 16-bit medium/large shapes take 128x128 whole with the epilogue in quarters (eighths
    and 2 stages when launched persistent: neither changes a value), with dropout the halved tile; sm_80 and fp32
    the halved one."""
    whole = gated_mlp._gated_table_config(8192, 11008, 4096, torch.bfloat16, "ieee", (9, 0))
    assert (whole.BLOCK_M, whole.BLOCK_N, whole.EPILOGUE_SPLIT) == (128, 128, 4)
    assert gated_mlp._launch_config(whole, False) == whole
    launched = gated_mlp._launch_config(whole, True)  # the tile and its K order are the table's
    assert (launched.EPILOGUE_SPLIT, launched.num_stages) == (8, 2)
    assert launched._replace(EPILOGUE_SPLIT=4, num_stages=3) == whole
    dropped = gated_mlp._gated_table_config(8192, 11008, 4096, torch.bfloat16, "ieee", (9, 0), dropout=True)
    assert (dropped.BLOCK_N, dropped.EPILOGUE_SPLIT) == (64, 1) and gated_mlp._launch_config(dropped, True) == dropped
    # not the dense table's wide 256-row large entry: two accumulators of that size would not fit
    assert _common._wide_tile(_common.gemm_config(8192, 11008, 4096, torch.bfloat16, "ieee", (9, 0)))
    assert dropped.BLOCK_M == 128
    for dtype, cap in ((torch.bfloat16, (8, 0)), (torch.float32, (9, 0))):
        dense = _common.gemm_config(8192, 11008, 4096, dtype, "ieee", cap)
        assert gated_mlp._gated_table_config(8192, 11008, 4096, dtype, "ieee", cap).BLOCK_N == max(16, dense.BLOCK_N // 2)


def test_gated_mlp_nan_propagates(device):
    x, wg, bg, wu, bu, wd, bd, g = _inputs(9, 12, 10, 6, torch.float32, device)
    x[3, 5] = float("nan")
    for act in ("relu", "silu"):
        out = gated_mlp.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, act)
        ref = R.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, act)
        assert torch.isnan(ref[3]).all() and torch.equal(torch.isnan(out), torch.isnan(ref))


def _clamped_torch(x, wg, bg, wu, bu, wd, bd, limit, after):
    """The clamped SwiGLU as the models write it, in torch ops (autograd gives the oracle's gradients)."""
    hg, hu = TF.linear(x, wg, bg), TF.linear(x, wu, bu).clamp(min=-limit, max=limit)
    gate = TF.silu(hg).clamp(max=limit) if after else TF.silu(hg.clamp(max=limit))
    return TF.linear(gate * hu, wd, bd)


@pytest.mark.parametrize("after", [False, True], ids=["before_act", "after_act"])
def test_swiglu_clamp(after, device):
    """A SwiGLU clamp at a limit that bites (DeepSeek-V4's before the activation, Step-3.7's after it): the
    reference against torch's clamps through autograd in float64, the kernels against the reference in fp32
    and fp16, the recomputed product equal to the forward's bit for bit, NaN propagated as in torch."""
    act = R.gated_name("silu", 0.4, after)
    args = _inputs(37, 33, 50, 20, torch.float64, "cpu")
    leaves = [t.clone().requires_grad_() for t in args[:7]]
    want = _clamped_torch(*leaves, 0.4, after)
    grads = torch.autograd.grad(want, leaves, args[7])
    got = [R.gated_mlp_forward(*args[:7], act), *R.gated_mlp_backward(*args, act)]
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(got, [want, *grads]))
    hu = TF.linear(args[0], args[3], args[4])
    assert 0.2 < (hu.abs() > 0.4).double().mean() < 0.8  # the clamp bites
    for dtype in (torch.float32, torch.float16):
        _check_gated(*_inputs(37, 33, 50, 20, dtype, device), act, dtype)
    x, wg, bg, wu, bu, wd, bd, g = _inputs(40, 24, 36, 8, torch.float32, device)
    a = gated_mlp.gated_act(x, wg, wu, bg, bu, act)
    assert torch.equal(gated_mlp.gated_act_grad(x, wg, wu, bg, bu, torch.ones_like(a), act)[2], a)
    x[3, 5] = float("nan")
    out = gated_mlp.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, act)
    ref = _clamped_torch(x, wg, bg, wu, bu, wd, bd, 0.4, after)
    assert torch.isnan(ref[3]).all() and torch.equal(torch.isnan(out), torch.isnan(ref))


@pytest.mark.parametrize("after", [False, True], ids=["before_act", "after_act"])
def test_swiglu_clamp_bounds(after, device):
    """Gate and up pre-activations at the clamp's bounds exactly, just inside and outside them, at +-inf, 0 and NaN
    (every pair; the biases set them: x and the weights are zero): the product and both pre-activations'
    gradients as torch's clamps give them through autograd (bounds inclusive, a NaN passes none)."""
    values = torch.tensor([-float("inf"), -5.0, -0.5, -0.4999, 0.0, 0.4999, 0.5, 0.5001, 5.0, float("inf"),
                           float("nan")])
    hg0, hu0 = torch.cartesian_prod(values, values).t()
    H = hg0.numel()
    x, w = torch.zeros(2, 8, device=device), torch.zeros(H, 8, device=device)
    act = R.gated_name("silu", 0.5, after)
    a = gated_mlp.gated_act(x, w, w, hg0.to(device), hu0.to(device), act)
    ghg, ghu, a_bwd, _, _ = gated_mlp.gated_act_grad(x, w, w, hg0.to(device), hu0.to(device), torch.ones_like(a), act)
    hg, hu = hg0.clone().requires_grad_(), hu0.clone().requires_grad_()
    gate = TF.silu(hg).clamp(max=0.5) if after else TF.silu(hg.clamp(max=0.5))
    want = gate * hu.clamp(min=-0.5, max=0.5)
    want_hg, want_hu = torch.autograd.grad(want, (hg, hu), torch.ones_like(want))
    for got, ref, name in ((a[0], want, "product"), (a_bwd[0], want, "recomputed product"), (ghg[0], want_hg, "g_hg"),
                           (ghu[0], want_hu, "g_hu")):
        assert torch.allclose(got.cpu(), ref.detach(), rtol=1e-6, atol=1e-7, equal_nan=True), name


def _check_gated_form(model_ops, act, device, **op_kwargs):
    """A shaped gated product (``act``: its activation string; ``op_kwargs``: its ``gated_mlp`` arguments): the
    reference against the model's torch ops ``model_ops`` through autograd in float64, the kernels against the
    reference in fp32 and fp16, the recomputed product equal to the forward's bit for bit, and the op on both
    backends against the model's ops in fp32. Returns the fp32 inputs used there."""
    args = _inputs(37, 33, 50, 20, torch.float64, "cpu")
    leaves = [t.clone().requires_grad_() for t in args[:7]]
    want = model_ops(*leaves)
    grads = torch.autograd.grad(want, leaves, args[7])
    got = [R.gated_mlp_forward(*args[:7], act), *R.gated_mlp_backward(*args, act)]
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(got, [want, *grads]))
    for dtype in (torch.float32, torch.float16):
        _check_gated(*_inputs(37, 33, 50, 20, dtype, device), act, dtype)
    inputs = _inputs(21, 16, 24, 8, torch.float32, device)
    x, wg, bg, wu, bu, wd, bd, g = inputs
    a = gated_mlp.gated_act(x, wg, wu, bg, bu, act)
    assert torch.equal(gated_mlp.gated_act_grad(x, wg, wu, bg, bu, torch.ones_like(a), act)[2], a)
    leaves = [t.clone().requires_grad_() for t in inputs[:7]]
    want = model_ops(*leaves)
    grads = torch.autograd.grad(want, leaves, g)
    for backend in ("triton", "reference"):
        ours = [t.clone().requires_grad_() for t in inputs[:7]]
        with fusedrc.use_backend(backend):
            y = fusedrc.functional.gated_mlp(*ours, **op_kwargs)
            got = torch.autograd.grad(y, ours, g)
        assert rel_err(y, want) < 1e-5 and all(rel_err(a, b) < 1e-5 for a, b in zip(got, grads)), backend
    return inputs


@pytest.mark.parametrize("limit, after, offset", [(None, False, 1.0), (0.5, False, 1.0), (0.5, True, -0.5)],
                         ids=["no_limit", "limit", "limit_after_negative_offset"])
def test_swiglu_alpha_and_up_offset(limit, after, offset, device):
    """MiniMax-M3's (and gpt-oss's) gated product, ``(clamp(h_u) + 1) * (g * sigmoid(g * alpha))`` on the clamped
    gate (and the clamp after that activation, a negative offset): the reference against the model's torch ops
    through autograd in float64, the kernels against the reference in fp32 and fp16, the recomputed product equal
    to the forward's bit for bit; through the op on both backends; bad alphas, offsets and options are named."""
    act = R.gated_name("silu", limit, after, 1.702, offset)

    def model_ops(x, wg, bg, wu, bu, wd, bd):
        gate, up = TF.linear(x, wg, bg), TF.linear(x, wu, bu)
        if limit is not None:
            up = up.clamp(min=-limit, max=limit)
            gate = gate if after else gate.clamp(max=limit)
        glu = gate * torch.sigmoid(gate * 1.702)
        return TF.linear((up + offset) * (glu.clamp(max=limit) if after else glu), wd, bd)

    x, wg, bg, wu, bu, wd, bd, _ = _check_gated_form(model_ops, act, device, swiglu_limit=limit,
                                                     limit_after_act=after, swiglu_alpha=1.702, up_offset=offset)
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="swiglu_alpha"):
            fusedrc.functional.gated_mlp(x, wg, bg, wu, bu, wd, bd, swiglu_alpha=bad)
    for bad in (float("inf"), None):
        with pytest.raises(ValueError, match="up_offset"):
            fusedrc.functional.gated_mlp(x, wg, bg, wu, bu, wd, bd, up_offset=bad)
    for bad in ("silu|up_offset=0|up_offset=1.0", "silu|limit=7|limit_after=3", "silu|alpha=1_0", "silu|limit= 7",
                "gelu|alpha=1.7"):  # each option once, plain numbers, alpha with silu
        with pytest.raises(ValueError, match="gated activation's options"):
            R.split_gated(bad)
    with pytest.raises(ValueError, match="activation='silu'"):
        fusedrc.functional.gated_mlp(x, wg, bg, wu, bu, wd, bd, activation="gelu", swiglu_alpha=1.702)


@pytest.mark.parametrize("alpha, limit", [(None, None), (1.702, 0.8)], ids=["plain", "alpha_limit"])
def test_softcapped_swiglu(alpha, limit, device):
    """Inkling2's gated product ``s_g tanh(h_g / s_g) * sigmoid(h_g) * s_u tanh(h_u / s_u)`` (and with an alpha and
    a clamp before the caps): the reference against the model's torch ops through autograd in float64, the kernels
    against the reference in fp32 and fp16 (caps that bite: the pre-activations reach several times them), the
    recomputed product equal to the forward's bit for bit; the op on both backends; bad caps are named."""
    caps = dict(gate_cap=0.4, up_cap=0.3)
    act = R.gated_name("silu", limit, False, alpha, 0.0, **caps)

    def model_ops(x, wg, bg, wu, bu, wd, bd):
        gate, up = TF.linear(x, wg, bg), TF.linear(x, wu, bu)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        glu = torch.tanh(gate / 0.4) * 0.4 * torch.sigmoid(gate * (alpha or 1.0))
        return TF.linear(glu * (torch.tanh(up / 0.3) * 0.3), wd, bd)

    x, wg, bg, wu, bu, wd, bd, _ = _check_gated_form(model_ops, act, device, swiglu_limit=limit, swiglu_alpha=alpha,
                                                     gate_softcap=0.4, up_softcap=0.3)
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="gate_softcap"):
            fusedrc.functional.gated_mlp(x, wg, bg, wu, bu, wd, bd, gate_softcap=bad)
        with pytest.raises(ValueError, match="up_softcap"):
            fusedrc.functional.gated_mlp(x, wg, bg, wu, bu, wd, bd, up_softcap=bad)
    with pytest.raises(ValueError, match="activation='silu'"):
        fusedrc.functional.gated_mlp(x, wg, bg, wu, bu, wd, bd, activation="gelu", gate_softcap=4.0)
    for bad in ("gelu|gate_softcap=4.0", "silu|up_softcap=2|up_softcap=3", "silu|gate_softcap=-1"):
        with pytest.raises(ValueError, match="gated activation's options"):
            R.split_gated(bad)


@pytest.mark.parametrize("activation, scale, limit", [("silu", 0.37, None), ("gelu_tanh", -1.5, 0.5)],
                         ids=["silu", "gelu_tanh_negative_limit"])
def test_gate_scale(activation, scale, limit, device):
    """Falcon-H1's gate multiplier ``act(m h_g) * h_u`` (and a negative one before a SwiGLU clamp): the reference
    against the model's torch ops through autograd in float64, the kernels against the reference in fp32 and
    fp16, the recomputed product equal to the forward's bit for bit; the op on both backends; bad multipliers
    are named."""
    act = R.gated_name(activation, limit, False, scale=scale)
    fn = {"silu": TF.silu, "gelu_tanh": lambda h: TF.gelu(h, approximate="tanh")}[activation]

    def model_ops(x, wg, bg, wu, bu, wd, bd):
        gate, up = TF.linear(x, wg, bg) * scale, TF.linear(x, wu, bu)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return TF.linear(fn(gate) * up, wd, bd)

    x, wg, bg, wu, bu, wd, bd, _ = _check_gated_form(model_ops, act, device, activation=activation,
                                                     swiglu_limit=limit, gate_scale=scale)
    for bad in (0, float("nan"), float("inf"), True, None):
        with pytest.raises(ValueError, match="gate_scale"):
            fusedrc.functional.gated_mlp(x, wg, bg, wu, bu, wd, bd, gate_scale=bad)
    for bad in ("silu|gate_scale=0", "silu|gate_scale=2|gate_scale=3", "silu|gate_scale=inf"):
        with pytest.raises(ValueError, match="gated activation's options"):
            R.split_gated(bad)
    assert R.split_gated(R.gated_name("silu", scale=1.0)) == R.GatedSpec("silu")  # 1.0 writes nothing


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, gated_mlp._tanh(tl.load(x_ptr + offs, mask=mask)), mask=mask)


def test_tanh_helper(device):
    """The kernels' tanh (no libdevice one in the interpreter) within a few ulps of torch's over its whole range,
    both sides of the switch at |x| = 0.3; NaN stays NaN, +-inf gives +-1."""
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.logspace(-30, 1, 200), -torch.logspace(-30, 1, 200),
                   torch.tensor([0.0, -0.0, 0.3, -0.3, 0.29999998, float("inf"), float("-inf"), float("nan")])])
    x = x.to(device)
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = torch.tanh(x.double())
    ok = torch.isfinite(want)
    assert float(((y.double() - want).abs() / want.abs().clamp_min(1e-30))[ok & (want != 0)].max()) < 4e-7
    assert torch.equal(y[want == 0], want[want == 0].float()) and torch.isnan(y[-1])
    assert y[-3] == 1 and y[-2] == -1


def test_swiglu_clamp_through_the_op(device):
    """``fusedrc.functional.gated_mlp(swiglu_limit=..., limit_after_act=...)`` on the Triton and reference
    backends against torch's clamps; bad limits are named."""
    x, wg, bg, wu, bu, wd, bd, g = _inputs(21, 16, 24, 8, torch.float32, device)
    for after in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, wg, bg, wu, bu, wd, bd)]
        want = _clamped_torch(*leaves, 0.5, after)
        grads = torch.autograd.grad(want, leaves, g)
        for backend in ("triton", "reference"):
            ours = [t.clone().requires_grad_() for t in (x, wg, bg, wu, bu, wd, bd)]
            with fusedrc.use_backend(backend):
                y = fusedrc.functional.gated_mlp(*ours, swiglu_limit=0.5, limit_after_act=after)
                got = torch.autograd.grad(y, ours, g)
            assert rel_err(y, want) < 1e-5 and all(rel_err(a, b) < 1e-5 for a, b in zip(got, grads)), backend
    for bad in (0, -1.0, float("inf"), float("nan"), True, "7"):
        with pytest.raises(ValueError, match="swiglu_limit"):
            fusedrc.functional.gated_mlp(x, wg, bg, wu, bu, wd, bd, swiglu_limit=bad)
    with pytest.raises(TypeError, match="limit_after_act"):
        fusedrc.functional.gated_mlp(x, wg, bg, wu, bu, wd, bd, swiglu_limit=1.0, limit_after_act=1)
    with pytest.raises(ValueError, match="activation"):
        fusedrc.functional.gated_mlp(x, wg, bg, wu, bu, wd, bd, activation="silu|limit=1.0")


def test_gated_mlp_kernel_launches(device, monkeypatch):
    """Forward: one dual kernel + the down GEMM; backward: one recompute kernel and 6 plain GEMMs
    (g_a, dWd, dX in two, dWg, dWu): the down GEMM is never rerun."""
    calls = []
    monkeypatch.setattr(_common, "PLAIN_GEMM", "triton")
    spy_launches(monkeypatch, calls, _common, _gemm_act_kernel="gemm")
    spy_launches(monkeypatch, calls, gated_mlp, _gated_act_kernel="dual", _gated_act_grad_kernel="recompute")
    x, wg, bg, wu, bu, wd, bd, g = _inputs(8, 8, 16, 8, torch.float32, device)
    gated_mlp.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, "silu")
    assert calls == ["dual", "gemm"]
    calls.clear()
    gated_mlp.gated_mlp_backward(x, wg, bg, wu, bu, wd, bd, g, "silu")
    assert calls.count("recompute") == 1 and calls.count("gemm") == 6 and len(calls) == 7


# --------------------------------------------------------------------------- the op, the module
def _llama_mlp(d, h, bias=False):
    gate, up, down = nn.Linear(d, h, bias=bias), nn.Linear(d, h, bias=bias), nn.Linear(h, d, bias=bias)
    return gate, up, down, lambda x: down(TF.silu(gate(x)) * up(x))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_functional_keeps_only_x(backend, device):
    gate, up, down, plain = _llama_mlp(16, 40)
    for m in (gate, up, down):
        m.to(device)
    base = torch.randn(3, 24, 16, device=device)
    x = base[:, ::2].detach().requires_grad_()  # N-D and sliced
    with fusedrc.use_backend(backend), SavedBytes() as saved, GemmCounter() as c:
        y = fusedrc.functional.gated_mlp(x, gate.weight, None, up.weight, None, down.weight, None)
        y.backward(torch.ones_like(y))
    assert saved.bytes == x.numel() * 4, "only x is kept for backward"
    if backend == "triton":
        from fusedrc.kernels import _common as common
        plain_gemms = 7 if common.uses_aten_gemm(x, gate.weight) else 0  # down, g_a, dWd, dX x2, dWg, dWu
        assert c.gemms == plain_gemms, c.ops
    grads = [x.grad.clone()] + [p.grad.clone() for p in (gate.weight, up.weight, down.weight)]
    x.grad = None
    for p in (gate.weight, up.weight, down.weight):
        p.grad = None
    ref = plain(x)
    ref.backward(torch.ones_like(ref))
    assert y.shape == ref.shape and rel_err(y, ref) < 1e-5
    for a, b in zip(grads, [x.grad, gate.weight.grad, up.weight.grad, down.weight.grad]):
        assert rel_err(a, b) < 1e-5


def test_module_state_dict_and_from_modules(device):
    gate, up, down, plain = _llama_mlp(12, 30, bias=True)
    for mod in (gate, up, down):
        mod.to(device)
    m = fusedrc.nn.GatedMLP(12, 30, bias=True).to(device)
    holder = nn.Module()
    holder.gate_proj, holder.up_proj, holder.down_proj = gate, up, down
    m.load_state_dict(holder.state_dict())
    assert list(m.state_dict()) == list(holder.state_dict())
    x = torch.randn(5, 12, device=device)
    with fusedrc.use_backend("triton"):
        assert rel_err(m(x), plain(x)) < 1e-5
        w = fusedrc.nn.GatedMLP.from_modules(gate, up, down, nn.SiLU())
        assert w.gate_proj is gate and rel_err(w(x), plain(x)) < 1e-5
    with pytest.raises(ValueError, match="up_proj"):
        fusedrc.nn.GatedMLP.from_modules(gate, nn.Linear(12, 31, device=device), down, "silu")
    with pytest.raises(ValueError, match="act"):
        fusedrc.nn.GatedMLP.from_modules(gate, up, down, nn.Tanh())


def test_bad_input_names_the_argument(device):
    x = torch.randn(4, 8, device=device)
    wg, wu, wd = torch.randn(16, 8, device=device), torch.randn(16, 8, device=device), torch.randn(8, 16, device=device)
    f = fusedrc.functional.gated_mlp
    with pytest.raises(ValueError, match="w_up"):
        f(x, wg, None, torch.randn(15, 8, device=device), None, wd, None)
    with pytest.raises(ValueError, match="w_down"):
        f(x, wg, None, wu, None, torch.randn(8, 15, device=device), None)
    with pytest.raises(ValueError, match="b_down"):
        f(x, wg, None, wu, None, wd, torch.randn(7, device=device))
    with pytest.raises(ValueError, match="w_gate"):
        f(torch.randn(4, 9, device=device), wg, None, wu, None, wd, None)
    with pytest.raises(TypeError, match="w_up"):
        f(x, wg, None, wu.half(), None, wd, None)
    with pytest.raises(ValueError, match="activation"):
        f(x, wg, None, wu, None, wd, None, activation="tanh")


def test_double_backward_raises(device):
    gate, up, down, _ = _llama_mlp(8, 16)
    for mod in (gate, up, down):
        mod.to(device)
    x = torch.randn(3, 8, device=device, requires_grad=True)
    y = fusedrc.functional.gated_mlp(x, gate.weight, None, up.weight, None, down.weight, None)
    with pytest.raises(RuntimeError, match="double backward through the fused op fusedrc::gated_mlp"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_compile_no_graph_breaks():
    """torch.compile over the op (reference backend on the CPU): one graph, eager's results."""
    gate, up, down, _ = _llama_mlp(8, 24)
    x = torch.randn(2, 5, 8, requires_grad=True)

    def f(x):
        return fusedrc.functional.gated_mlp(x, gate.weight, None, up.weight, None, down.weight, None).square().sum()

    with fusedrc.use_backend("reference"):
        explain = torch._dynamo.explain(f)(x)
        assert explain.graph_break_count == 0 and explain.graph_count == 1
        torch._dynamo.reset()
        y = torch.compile(f, backend="aot_eager")(x)
        (gx,) = torch.autograd.grad(y, x)
        ye = f(x)
        (gxe,) = torch.autograd.grad(ye, x)
    assert rel_err(y, ye) < 1e-6 and rel_err(gx, gxe) < 1e-6


def test_recompute_and_mark_run_the_fused_op():
    """recompute(GatedMLP) and a marked GatedMLP run the fused op once (only x kept), not a generic
    region around it, whose backward would rerun the module's forward op."""
    m = fusedrc.nn.GatedMLP(12, 28, bias=True)
    x = torch.randn(4, 6, 12, requires_grad=True)

    def forward_ops(call):
        with fusedrc.use_backend("reference"), SavedBytes() as saved, GemmCounter() as c:
            y = call()
            (gx,) = torch.autograd.grad(y.sum(), x)
        assert saved.bytes == x.numel() * 4
        return y, gx, sum(op.startswith("fusedrc.gated_mlp.") for op in c.ops)

    y, gx, n = forward_ops(lambda: fusedrc.recompute(m, x))
    assert n == 1
    fusedrc.mark(m)
    y_marked, _, n_marked = forward_ops(lambda: m(x))
    fusedrc.unmark(m)
    assert n_marked == 1 and torch.equal(y, y_marked)
    # a callable: the generic region, for contrast; inside it the module runs as the plain composition
    with GemmCounter() as c:
        generic = fusedrc.recompute(lambda t: m(t) * 1.0, x)
        generic.sum().backward()
    assert not any(op.startswith("fusedrc.gated_mlp.") for op in c.ops)
    assert torch.equal(generic, m.down_proj(TF.silu(m.gate_proj(x)) * m.up_proj(x)))
    ref = m.down_proj(TF.silu(m.gate_proj(x)) * m.up_proj(x))
    (gx_ref,) = torch.autograd.grad(ref.sum(), x)
    assert rel_err(y, ref) < 1e-5 and rel_err(gx, gx_ref) < 1e-5


def test_persistent_launch_matches_one_program_per_tile(device, monkeypatch):
    """The dual kernels under GEMM_PERSISTENT (2 programs walking the tiles): output and every
    gradient equal the one-program-per-tile launch's bit for bit (bias gradients to rounding), and
    the recomputed product equals the forward's."""
    from test_kernels_dense import _rel, persistent_runs

    # 260 rows: 3 row tiles of any table's tile, so 2 programs each walk more than one (on an H100 the
    # table's 128x128 tile leaves 70 rows one tile, and one program)
    x, wg, bg, wu, bu, wd, bd, g = _inputs(260, 40, 72, 36, torch.float16, device)

    def run():
        out = gated_mlp.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, "silu")
        grads = gated_mlp.gated_mlp_backward(x, wg, bg, wu, bu, wd, bd, g, "silu")
        a = gated_mlp.gated_act(x, wg, wu, bg, bu, "silu")
        a_bwd = gated_mlp.gated_act_grad(x, wg, wu, bg, bu, torch.ones_like(a), "silu")[2]
        return out, grads, a, a_bwd

    (out0, grads0, a0, _), (out1, grads1, a1, a1_bwd), seen = persistent_runs(
        monkeypatch, gated_mlp, ("_gated_act_kernel", "_gated_act_grad_kernel"), run)
    assert len(seen) == 4 and all(p and n == 2 for n, p in seen)
    assert torch.equal(out0, out1) and torch.equal(a0, a1) and torch.equal(a1, a1_bwd)
    for name, t0, t1 in zip(NAMES[1:], grads0, grads1):
        if name.startswith("db"):
            assert _rel(t1, t0.double()) < 1e-6, name
        else:
            assert torch.equal(t0, t1), name
    _check([out1], [R.gated_mlp_forward(*[_d(t) for t in (x, wg, bg, wu, bu, wd, bd)], "silu")],
           torch.float16, ["out"])
