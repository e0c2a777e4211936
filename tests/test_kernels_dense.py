"""Dense Triton kernels (Linear+act, FFN) against the float64 reference.

Without a GPU these run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so the shapes are small but awkward: not multiples of the
tiles, several tiles in M and N, a K loop with a ragged last step.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from fusedrc import reference as R  # noqa: E402
from fusedrc.kernels import _common, fused_mlp, linear_act  # noqa: E402

from _utils import record_launches  # noqa: E402

ACTS = ["relu", "relu2", "gelu", "gelu_tanh", "silu"]  # the full grid; relu6 and hardswish: test_piecewise_*
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _rel(out, ref):
    """Relative Frobenius error; NaN anywhere never passes."""
    assert out is not None and out.shape == ref.shape, (None if out is None else out.shape, ref.shape)
    out = out.double()
    assert not torch.isnan(out).any(), "NaN in output"
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


def _check(outs, refs, dtype, names):
    for o, r, n in zip(outs, refs, names):
        if r is None:
            assert o is None, f"{n} should be None"
            continue
        assert o.dtype == dtype, (n, o.dtype)
        err = _rel(o, r)
        assert err < TOL[dtype], f"{n}: rel err {err:.3e} >= {TOL[dtype]:.0e}"


def _d(t):
    return None if t is None else t.double()


def _rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


class _LaunchSpy:
    """Stands for a @triton.jit kernel: records its name at each launch, then launches it."""

    def __init__(self, kernel, name, calls):
        self.kernel, self.name, self.calls = kernel, name, calls

    def __getitem__(self, grid):
        self.calls.append(self.name)
        return self.kernel[grid]


def spy_launches(monkeypatch, calls, module, **names):
    """Replace ``module``'s kernels (attribute -> label) by spies appending their label to ``calls``."""
    for attr, label in names.items():
        monkeypatch.setattr(module, attr, _LaunchSpy(getattr(module, attr), label, calls))


# --------------------------------------------------------------------------- Linear + act
LIN_SHAPES = [(1, 1, 1), (17, 33, 65), (64, 32, 48)]  # (M, K, N)


def _linear_inputs(M, K, N, dtype, device, bias):
    x = _rand(M, K, dtype=dtype, device=device)
    w = _rand(N, K, dtype=dtype, device=device, scale=max(K, 1) ** -0.5)
    b = _rand(N, dtype=dtype, device=device, scale=0.5) if bias else None
    g = _rand(M, N, dtype=dtype, device=device)
    return x, w, b, g


def _check_linear(x, w, b, g, act, dtype):
    y = linear_act.linear_act_forward(x, w, b, act)
    grads = linear_act.linear_act_backward(x, w, b, g, act)
    y_ref = R.linear_act_forward(_d(x), _d(w), _d(b), act)
    grads_ref = R.linear_act_backward(_d(x), _d(w), _d(b), _d(g), act)
    _check([y, *grads], [y_ref, *grads_ref], dtype, ["y", "dx", "dw", "db"])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", LIN_SHAPES, ids=str)
def test_linear_act(shape, dtype, act, bias, device):
    _check_linear(*_linear_inputs(*shape, dtype, device, bias), act, dtype)


def test_linear_act_noncontiguous(device):
    M, K, N = 19, 37, 41
    dtype = torch.float32
    x = _rand(K, M, dtype=dtype, device=device).t()                # column-major x
    w = _rand(K, N, dtype=dtype, device=device, scale=max(K, 1) ** -0.5).t()  # column-major W
    b = _rand(2 * N, dtype=dtype, device=device)[::2]                # strided bias
    g = _rand(M, 2 * N, dtype=dtype, device=device)[:, ::2]          # strided grad
    assert not (x.is_contiguous() or w.is_contiguous() or b.is_contiguous() or g.is_contiguous())
    _check_linear(x, w, b, g, "gelu", dtype)


@pytest.mark.parametrize("shape", [(0, 5, 7), (4, 0, 7), (4, 5, 0)], ids=str)
def test_linear_act_empty(shape, device):
    M, K, N = shape
    x, w, b, g = _linear_inputs(M, K, N, torch.float32, device, True)
    y = linear_act.linear_act_forward(x, w, b, "gelu")
    torch.testing.assert_close(y, R.linear_act_forward(x, w, b, "gelu"))
    for o, r in zip(linear_act.linear_act_backward(x, w, b, g, "gelu"), R.linear_act_backward(x, w, b, g, "gelu")):
        torch.testing.assert_close(o, r)


def test_linear_act_bf16_upcast(device):
    """bf16 goes through fp32 under the interpreter (UPCAST flag); plain bf16 on a GPU."""
    _check_linear(*_linear_inputs(33, 40, 20, torch.bfloat16, device, True), "silu", torch.bfloat16)


def test_relu_propagates_nan(device):
    M, K, N = 9, 12, 10
    x, w, b, _ = _linear_inputs(M, K, N, torch.float32, device, True)
    x[3, 5] = float("nan")
    w[7, 2] = float("nan")
    y = linear_act.linear_act_forward(x, w, b, "relu")
    y_ref = R.linear_act_forward(x, w, b, "relu")
    assert torch.isnan(y_ref).sum() > 0
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref))
    ok = ~torch.isnan(y_ref)
    torch.testing.assert_close(y[ok], y_ref[ok], rtol=1e-5, atol=1e-6)
    for act in ("relu2", "silu", "gelu", "quick_gelu", "leaky_relu"):  # the others keep NaN too
        assert torch.equal(torch.isnan(linear_act.linear_act_forward(x, w, b, act)), torch.isnan(y_ref))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_relu2_gradient_of_nonfinite_where_cut(backend, device):
    """relu2's gradient is 0 where h <= 0 even for an infinite or NaN incoming gradient, as autograd
    of square(relu(h)) gives it (threshold_backward last); NaN h lets it through."""
    import fusedrc

    x = torch.tensor([[-1.0], [2.0], [float("nan")]], device=device)
    w = torch.ones(3, 1, device=device)
    g = torch.tensor([[float("inf"), float("nan"), 1.0]] * 3, device=device)
    xe = x.clone().requires_grad_()
    h_e = torch.nn.functional.linear(xe, w)
    torch.square(torch.relu(h_e)).backward(g)
    xf = x.clone().requires_grad_()
    with fusedrc.use_backend(backend):
        fusedrc.functional.linear_act(xf, w, None, "relu2").backward(g)
    assert xe.grad[0].item() == 0.0 and torch.isnan(xe.grad[1:]).all()
    assert torch.equal(torch.isnan(xf.grad), torch.isnan(xe.grad)) and xf.grad[0].item() == 0.0


@pytest.mark.parametrize("op", ["linear_act", "gated_mlp"])
def test_gelu_tanh_saturates_as_torch(op, device):
    """gelu_tanh where tanh(u) rounds to -1 (h about -10 to -5.5): act(h) and its derivative are
    exactly 0 as in torch, so an infinite factor gives NaN as in torch, not inf times a tiny
    value; elsewhere (other h, an inf or NaN h) values and gradients follow torch's too."""
    import fusedrc

    inf = float("inf")
    h = torch.tensor([-inf, -60.0, -9.0, -7.0, -6.0, -5.0, -3.0, 0.0, 3.0, 6.0, inf, float("nan")], device=device)
    x = torch.zeros(2, 1, device=device)
    w = torch.zeros(len(h), 1, device=device)
    if op == "linear_act":  # h is the bias: x W^T = 0 adds nothing, not even a NaN from inf * 0
        def run(b):
            return fusedrc.functional.linear_act(x, w, b, "gelu_tanh")
    else:  # gate = h, up = inf: act(h) * inf, NaN where act(h) is exactly 0; hidden size 1 per
        # value, so that no product with a zero weight mixes the values
        up, one = torch.tensor([inf], device=device), torch.ones(1, 1, device=device)

        def run(b):
            return torch.cat([fusedrc.functional.gated_mlp(x, w[:1], b[i:i + 1], w[:1], up, one, None, "gelu_tanh")
                              for i in range(len(h))], dim=1)
    outs = {}
    for backend in ("triton", "reference"):
        for g in (1.0, inf):
            b = h.clone().requires_grad_()
            with fusedrc.use_backend(backend):
                y = run(b)
            y.backward(torch.full_like(y, g))
            outs[backend, g] = y.detach(), b.grad
    for g in (1.0, inf):
        (y_t, gb_t), (y_r, gb_r) = outs["triton", g], outs["reference", g]
        assert torch.equal(torch.isnan(y_t), torch.isnan(y_r)) and torch.equal(torch.isnan(gb_t), torch.isnan(gb_r))
        torch.testing.assert_close(y_t, y_r, rtol=1e-5, atol=0, equal_nan=True)
        torch.testing.assert_close(gb_t, gb_r, rtol=1e-4, atol=0, equal_nan=True)
    y_r = outs["reference", 1.0][0][0]
    assert (y_r[1:5] == 0).all() if op == "linear_act" else torch.isnan(y_r[1:5]).all()  # the saturated range
    assert not torch.isnan(y_r[[5, 6, 8, 9]]).any()  # h = -5, -3, 3, 6: outside it


def _near_zero_inputs(M, K, N, dtype, device):
    """h = x W^T + b with most entries within rounding noise of 0.

    Rows of x are one base row plus tiny perturbations, and b cancels the base
    row's product, so the sign of many h entries is decided by the accumulation
    order (relative size of h to its terms is ~1e-7).
    """
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(1, K, generator=gen, dtype=torch.float64)
    eps = 1e-6 if dtype == torch.float32 else 1e-3  # fp16 cannot hold a smaller perturbation
    x = base + eps * torch.randn(M, K, generator=gen, dtype=torch.float64)
    w = torch.randn(N, K, generator=gen, dtype=torch.float64)
    x, w = x.to(dtype), w.to(dtype)
    b = -(x[:1].double() @ w.double().t()).squeeze(0)
    return x.to(device), w.to(device), b.to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_recompute_mask_matches_forward_sign(dtype, device):
    """The backward's ReLU mask equals the sign of the forward's output, bit for bit."""
    M, K, N = 40, 100, 36  # K loop of several steps with a ragged tail
    x, w, b = _near_zero_inputs(M, K, N, dtype, device)
    y = linear_act.linear_act_forward(x, w, b, "relu")
    h_ref = x.double() @ w.double().t() + b.double()
    near = 1e-4 if dtype == torch.float32 else 5e-2
    assert (h_ref.abs() < near).float().mean() > 0.3  # the data really sits on the ReLU's kink
    assert 0.2 < (y > 0).float().mean() < 0.8
    ones = torch.ones(M, N, dtype=dtype, device=device)
    gh, db = linear_act.linear_act_grad_h(x, w, b, ones, "relu")
    mask = gh != 0
    if dtype == torch.float32:
        # y = h where h > 0 else 0, exactly: y > 0 <=> h > 0 <=> mask
        assert torch.equal(mask, y > 0)
    else:
        # fp16 storage may flush a tiny positive h to +0: compare where y is not 0,
        # and check the mask against the forward's pre-activation sign bit
        nz = y != 0
        assert torch.equal(mask[nz], (y > 0)[nz])
        h_fwd = _common.gemm_act(x, w.t(), b, "none")
        assert torch.equal(mask, ~torch.signbit(h_fwd) & ((h_fwd != 0) | mask))
    # the FFN's recompute kernel emits act(h) equal bit for bit to the forward's
    for act in _common.ACTIVATIONS:
        y_act = linear_act.linear_act_forward(x, w, b, act)
        _, a, _ = _common.gemm_act_grad(x, w.t(), b, ones, act, store_act=True)
        assert torch.equal(a, y_act), act
    # the data is adversarial: another BLOCK_K (summation order) flips some signs
    if device.type == "cpu" and dtype == torch.float32:
        cfg = _common.gemm_config(M, N, K, dtype, "ieee", None)
        other = cfg._replace(BLOCK_K=16)
        h_other = _common.gemm_act(x, w.t(), b, "none", out_dtype=torch.float32, config=other)
        h_same = _common.gemm_act(x, w.t(), b, "none", out_dtype=torch.float32, config=cfg)
        assert torch.equal(h_same > 0, mask)
        assert not torch.equal(h_other > 0, mask), "data not sensitive to the K order"


# --------------------------------------------------------------------------- FFN
MLP_SHAPES = [(1, 1, 1, 1), (17, 33, 65, 20), (40, 24, 48, 37)]  # (M, K, H, N)


def _mlp_inputs(M, K, H, N, dtype, device, bias):
    x = _rand(M, K, dtype=dtype, device=device)
    w1 = _rand(H, K, dtype=dtype, device=device, scale=max(K, 1) ** -0.5)
    w2 = _rand(N, H, dtype=dtype, device=device, scale=H ** -0.5)
    b1 = _rand(H, dtype=dtype, device=device, scale=0.5) if bias else None
    b2 = _rand(N, dtype=dtype, device=device, scale=0.5) if bias else None
    g = _rand(M, N, dtype=dtype, device=device)
    return x, w1, b1, w2, b2, g


def _check_mlp(x, w1, b1, w2, b2, g, act, dtype):
    out = fused_mlp.fused_mlp_forward(x, w1, b1, w2, b2, act)
    grads = fused_mlp.fused_mlp_backward(x, w1, b1, w2, b2, g, act)
    out_ref = R.fused_mlp_forward(_d(x), _d(w1), _d(b1), _d(w2), _d(b2), act)
    grads_ref = R.fused_mlp_backward(_d(x), _d(w1), _d(b1), _d(w2), _d(b2), _d(g), act)
    _check([out, *grads], [out_ref, *grads_ref], dtype, ["out", "dx", "dw1", "db1", "dw2", "db2"])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", MLP_SHAPES, ids=str)
def test_fused_mlp(shape, dtype, act, bias, device):
    _check_mlp(*_mlp_inputs(*shape, dtype, device, bias), act, dtype)


@pytest.mark.parametrize("act", ["relu6", "hardswish", "quick_gelu", "leaky_relu", "leaky_relu:0.2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_piecewise_activations(act, dtype, device):
    """relu6 and hardswish (MobileNet's), CLIP's quick_gelu and LeakyReLU (default and another
    slope): Linear+act and the FFN, ragged shapes, pre-activations spread over all their pieces
    (below -3, -3..0, 0..3/6, above 6)."""
    x, w, b, g = _linear_inputs(37, 21, 19, dtype, device, True)
    _check_linear(x * 4, w, b, g, act, dtype)
    x, w1, b1, w2, b2, g = _mlp_inputs(*MLP_SHAPES[1], dtype, device, True)
    _check_mlp(x * 4, w1, b1, w2, b2, g, act, dtype)


@pytest.mark.parametrize("act", ["relu6", "hardswish"])
def test_piecewise_activations_nan_and_kinks(act, device):
    """At the pieces' ends (0 and 6; -3 and 3) and at +-inf: values and derivatives as the reference
    (aten) gives them, incoming gradient 1 and inf; at NaN: NaN, and the incoming gradient through
    (torch's CUDA kernels; its CPU kernels differ by path). x is the pre-activation itself (one
    input feature, weight 1), so dx is act'(h) * g."""
    nan = float("nan")
    h = torch.tensor([float("inf"), -float("inf"), -3.0, 3.0, 0.0, 6.0, -0.0, 2.5, 7.0, -2.0, -4.0, 5.999, 1e-30,
                      -1e-30, nan], device=device)[:, None]
    w = torch.ones(1, 1, device=device)
    y, y_ref = linear_act.linear_act_forward(h, w, None, act), R.linear_act_forward(h, w, None, act)
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref)) and torch.isnan(y[-1])
    ok = ~torch.isnan(y_ref)
    assert torch.allclose(y[ok], y_ref[ok], rtol=1e-6, atol=0)
    for gval in (1.0, float("inf")):
        g = torch.full_like(h, gval)
        got = linear_act.linear_act_backward(h, w, None, g, act)[0]
        want = R.linear_act_backward(h[:-1], w, None, g[:-1], act)[0]
        assert torch.equal(got[-1], g[-1])  # the NaN pre-activation
        got = got[:-1]
        assert torch.equal(torch.isnan(got), torch.isnan(want)), gval
        ok = ~torch.isnan(want)
        assert torch.allclose(got[ok], want[ok], rtol=1e-6, atol=0), (gval, got.flatten(), want.flatten())


@pytest.mark.parametrize("act", ["leaky_relu", "leaky_relu:0.2", "leaky_relu:-1.5"])
def test_leaky_relu_matches_aten_everywhere(act, device):
    """LeakyReLU at its kink (0), tiny, huge and infinite values and NaN: forward and input gradient
    equal to aten's leaky_relu / leaky_relu_backward bit for bit (x > 0 ? x : x * slope; a NaN
    pre-activation takes the slope side in backward), incoming gradients 1, -inf and NaN; a
    negative slope too."""
    nan, inf = float("nan"), float("inf")
    h = torch.tensor([inf, -inf, 0.0, -0.0, 1e-30, -1e-30, 2.5, -2.5, 1e38, -3e38, nan], device=device)[:, None]
    w = torch.ones(1, 1, device=device)
    y, y_ref = linear_act.linear_act_forward(h, w, None, act), R.linear_act_forward(h, w, None, act)
    assert torch.equal(y.isnan(), y_ref.isnan()) and torch.equal(y.nan_to_num(), y_ref.nan_to_num())
    for gval in (1.0, -inf, nan):
        g = torch.full_like(h, gval)
        got = linear_act.linear_act_backward(h, w, None, g, act)[0]
        want = R.linear_act_backward(h, w, None, g, act)[0]
        assert torch.equal(got.isnan(), want.isnan()), gval
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), (gval, got.flatten(), want.flatten())


def test_fused_mlp_noncontiguous(device):
    M, K, H, N = 21, 18, 40, 13
    dtype = torch.float32
    x, w1, b1, w2, b2, g = _mlp_inputs(M, K, H, N, dtype, device, True)
    x = x.t().contiguous().t()
    w1 = w1.t().contiguous().t()
    w2 = w2.t().contiguous().t()
    g = g.t().contiguous().t()
    _check_mlp(x, w1, b1, w2, b2, g, "relu2", dtype)


def test_fused_mlp_gemm_count(device, monkeypatch):
    """7 GEMMs forward + backward, the output GEMM not rerun; with PLAIN_GEMM="triton" (as under
    the interpreter) all of them run in the two kernels, only one of them recomputing."""
    calls = []
    monkeypatch.setattr(_common, "PLAIN_GEMM", "triton")  # on CUDA too: count every GEMM here
    spy_launches(monkeypatch, calls, _common, _gemm_act_kernel="gemm", _gemm_act_grad_kernel="recompute")
    x, w1, b1, w2, b2, g = _mlp_inputs(8, 8, 16, 8, torch.float32, device, True)
    fused_mlp.fused_mlp_forward(x, w1, b1, w2, b2, "gelu")
    assert calls == ["gemm", "gemm"]
    fused_mlp.fused_mlp_backward(x, w1, b1, w2, b2, g, "gelu")
    assert calls.count("recompute") == 1 and len(calls) == 7
    calls.clear()
    linear_act.linear_act_backward(x, w1, b1, torch.randn(8, 16, device=device), "relu")
    assert calls == ["recompute", "gemm", "gemm"]


# --------------------------------------------------------------------------- GPU tile table
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_table_configs_run(dtype, device, monkeypatch):
    """The sm_90 table's tiles (BLOCK_K 64, GROUP_M 8, 128x128) give correct results."""
    if device.type == "cpu" and dtype == torch.float32:
        monkeypatch.setattr(_common, "device_capability", lambda t: (9, 0))
    M, K, N = 140, 70, 130  # medium bucket: 2 x 2 tiles of 128, ragged K tail
    assert _common.gemm_config(M, N, K, dtype, "ieee", (9, 0)).BLOCK_M >= 64
    _check_linear(*_linear_inputs(M, K, N, dtype, device, True), "relu", dtype)


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_large_table_entry_runs(act, device):
    """The large bucket's entry (sm_90: 256x128, epilogues in eighths) on a GPU: forward, g_h, the
    recomputed act(h) equal to the forward's bit for bit, and the bias gradient, against float64."""
    if device.type != "cuda":
        pytest.skip("the table's GPU entries run on a GPU; the interpreter takes its own small tile")
    M, K, N = 2100, 530, 2060  # large bucket, ragged in M, N and K
    x, w, b, g = _linear_inputs(M, K, N, torch.bfloat16, device, True)
    cfg = _common.gemm_config(M, N, K, x.dtype, "ieee", _common.device_capability(x))
    assert _common._shape_bucket(M, N, K) == "large", cfg
    y = _common.gemm_act(x, w.t(), b, act)
    gh, a, db = _common.gemm_act_grad(x, w.t(), b, g, act, store_act=True)
    assert torch.equal(a, y)
    h_ref = _d(x) @ _d(w).t() + _d(b)
    gh_ref = R.activation_backward(_d(g), h_ref, act)
    assert _rel(y, R.activation_forward(h_ref, act)) < TOL[torch.bfloat16]
    assert _rel(gh, gh_ref) < TOL[torch.bfloat16] and _rel(db, gh_ref.sum(0)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_wide_tile_adds_the_bias_per_slice(grouped, device):
    """On a wide tile (256x128: SLICE_BIAS) the grad kernel adds the bias per epilogue slice, not to the whole
    accumulator up front (as the forward does): the recomputed act(h) is the forward's bit for bit, g_h and the
    bias gradient against float64; grouped experts read each expert's bias row."""
    M, K, N = 300, 40, 150  # the wide tile's last row and column tiles ragged
    x, w, b, g = _linear_inputs(M, K, N, torch.float32, device, True)
    wide = _common.GemmConfig(256, 128, 32, 1, 8, 1, 8)
    if grouped:  # two experts' stacked (N, K) weights and biases: rows [0, 170) expert 0's, the rest expert 1's
        w_stack, b_stack = torch.stack([w, w.flip(0)]), torch.stack([b, b.flip(0)])
        kw = dict(groups=_common.ExpertGroups((170, 130), w_stack.stride(0), b_stack.stride(0)))
        h_ref = torch.cat([_d(x[:170]) @ _d(w_stack[0]).t() + _d(b_stack[0]),
                           _d(x[170:]) @ _d(w_stack[1]).t() + _d(b_stack[1])])
        args = (x, w_stack[0].t(), b_stack[0])
    else:
        kw, h_ref, args = {}, _d(x) @ _d(w).t() + _d(b), (x, w.t(), b)
    gh, a, db = _common.gemm_act_grad(*args, g, "gelu", store_act=True, config=wide, **kw)
    assert torch.equal(a, _common.gemm_act(*args, "gelu", config=wide, **kw))
    gh_ref = R.activation_backward(_d(g), h_ref, "gelu")
    assert _rel(gh, gh_ref) < 1e-5 and _rel(a, R.activation_forward(h_ref, "gelu")) < 1e-5
    if not grouped:
        assert _rel(db, gh_ref.sum(0)) < 1e-5


def test_tile_table_rules():
    smem = {"sm90": 227 * 1024, "sm80": 163 * 1024, "small_smem": 99 * 1024}
    for (family, cls, bucket), c in _common._TABLE.items():
        nbytes = 2 if cls == "16bit" else 4
        assert (c.BLOCK_M + c.BLOCK_N) * c.BLOCK_K * nbytes * c.num_stages <= smem[family], (family, cls, bucket)
        assert c.num_warps in (4, 8) and c.GROUP_M >= 1
        if family == "sm90" and cls != "fp32":  # HGMMA
            assert c.BLOCK_M >= 64 and c.num_warps % 4 == 0
        assert c.EPILOGUE_SPLIT in (1, 2, 4, 8) and c.BLOCK_N // c.EPILOGUE_SPLIT >= 16, (family, cls, bucket)
    for family in smem:
        for cls in ("16bit", "tf32", "fp32"):
            for bucket in ("small", "medium", "large"):
                assert (family, cls, bucket) in _common._TABLE
    # a wide entry's narrow stand-in (launches with dropout, the gated kernels) is the 128x128 it replaced
    for key, c in _common._NARROW.items():
        assert _common._wide_tile(_common._TABLE[key]) and not _common._wide_tile(c), key
    assert _common.gemm_config(8192, 16384, 4096, torch.bfloat16, "ieee", (9, 0), narrow=True) == \
        _common._NARROW[("sm90", "16bit", "large")]
    assert _common.gemm_config(512, 512, 512, torch.bfloat16, "ieee", (9, 0), narrow=True) == \
        _common._TABLE[("sm90", "16bit", "medium")]
    # a pure function: forward and recompute read the same entry
    a = _common.gemm_config(4096, 4096, 1024, torch.float16, "ieee", (9, 0))
    assert a == _common.gemm_config(4096, 4096, 1024, torch.float16, "ieee", (9, 0))
    assert _common.dot_precision(torch.empty(1)) == "ieee"  # CPU: never tf32


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_epilogue_split(act, device):
    """The grad kernel's epilogue in 1, 2 or 4 column slices: the same g_h and act(h) bit for bit
    (ragged M and N, so the last tile's slices are partly or wholly masked); the bias gradient to
    rounding (a slice's column sums are laid out over other threads on a GPU, which changes the
    order of the row additions; seen on an H200)."""
    M, K, N = 70, 40, 90
    x, w, b, g = _linear_inputs(M, K, N, torch.float32, device, True)
    base = _common.gemm_config(M, N, K, torch.float32, "ieee", _common.device_capability(x))
    base = base._replace(BLOCK_N=64)
    outs = [_common.gemm_act_grad(x, w.t(), b, g, act, store_act=True, config=base._replace(EPILOGUE_SPLIT=s))
            for s in (1, 2, 4)]
    for other in outs[1:]:
        assert torch.equal(outs[0][0], other[0]) and torch.equal(outs[0][1], other[1])
        assert _rel(other[2], outs[0][2]) < 1e-6
    gh, a, db = outs[0]
    h_ref = _d(x) @ _d(w).t() + _d(b)
    gh_ref = R.activation_backward(_d(g), h_ref, act)
    a_ref = R.activation_forward(h_ref, act)
    assert _rel(gh, gh_ref) < 1e-5 and _rel(a, a_ref) < 1e-5
    assert _rel(db, gh_ref.sum(0)) < 1e-5


def test_wide_tile_forward_epilogue_split(device, monkeypatch):
    """A wide tile (its accumulator alone 128 registers a thread: sm_90's 256x128 large entry) splits
    the forward's epilogue too, the activation computed per slice: the same y bits at every split, with
    and without dropout, equal to the grad kernel's recomputed act(h); the forward at split 8 matches the
    float64 reference. A wide tile is launched one program per tile under GEMM_PERSISTENT (its tile
    loop's registers would spill); a narrow one persistent."""
    M, K, N = 150, 40, 200  # 2 x 2 tiles of 128, ragged in M and N, a K tail
    x, w, b, g = _linear_inputs(M, K, N, torch.float32, device, True)
    wide = _common.GemmConfig(128, 128, 32, 2, 4, 1, 1)
    assert _common._wide_tile(wide) and not _common._wide_tile(wide._replace(num_warps=8))
    seed = torch.tensor([99], dtype=torch.int64, device=device)
    launches = record_launches(monkeypatch, _common)
    for dropout in (None, (0.25, seed)):
        outs = []
        for split in (1, 2, 4, 8):
            cfg = wide._replace(EPILOGUE_SPLIT=split)
            launches.clear()
            outs.append(_common.gemm_act(x, w.t(), b, "gelu", config=cfg, dropout=dropout))
            assert [kw["EPILOGUE_SPLIT"] for _, kw in launches] == [split]
            _, a, _ = _common.gemm_act_grad(x, w.t(), b, torch.ones_like(outs[-1]), "gelu", store_act=True,
                                            config=cfg, dropout=dropout)
            assert torch.equal(a, outs[-1])
        for other in outs[1:]:
            assert torch.equal(outs[0], other)
    h_ref = _d(x) @ _d(w).t() + _d(b)
    assert _rel(outs[0], R.activation_forward(h_ref, "gelu") * (outs[0] != 0) / 0.75) < 1e-5
    assert 0.15 < (outs[0] == 0).double().mean().item() < 0.35  # the dropout mask really dropped
    y = _common.gemm_act(x, w.t(), b, "gelu", config=wide._replace(EPILOGUE_SPLIT=8))
    assert _rel(y, R.activation_forward(h_ref, "gelu")) < 1e-5
    monkeypatch.setattr(_common, "GEMM_PERSISTENT", 2)
    for cfg, persistent in ((wide, False), (wide._replace(num_warps=8), True)):
        launches.clear()
        _common.gemm_act(x, w.t(), b, "gelu", config=cfg)
        _common.gemm_act_grad(x, w.t(), b, g, "gelu", config=cfg)
        assert [kw["PERSISTENT"] for _, kw in launches] == [persistent, persistent]


def test_dropout_launches_ask_the_narrow_tile(device, monkeypatch):
    """Every dense launch of an FFN with dropout (its forward and its recompute alike) asks the table for
    the narrow tile, every launch without dropout for the table's own."""
    asked = []
    real = _common.gemm_config

    def spy(*args, **kwargs):
        asked.append(args[6] if len(args) > 6 else kwargs.get("narrow", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(_common, "gemm_config", spy)
    monkeypatch.setattr(_common, "PLAIN_GEMM", "triton")
    x, w1, b1, w2, b2, g = _mlp_inputs(20, 12, 24, 10, torch.float32, device, True)
    seed = torch.tensor([7], dtype=torch.int64, device=device)
    for p in (0.2, 0.0):
        asked.clear()
        fused_mlp.fused_mlp_forward(x, w1, b1, w2, b2, "gelu", p, seed)
        fused_mlp.fused_mlp_backward(x, w1, b1, w2, b2, g, "gelu", p, seed)
        assert asked and (True in asked) == (p > 0)
        if p:  # the activation's two launches (forward, recompute) with dropout; plain GEMMs without
            assert asked.count(True) == 2


# --------------------------------------------------------------------------- TMA loads
def _spy_tma(monkeypatch):
    """[(kernel, TMA flag)] of every dense launch, in order."""
    seen = []
    for name in ("_gemm_act_kernel", "_gemm_act_grad_kernel"):
        real = getattr(_common, name)

        class _Spy:
            def __getitem__(self, grid, real=real, name=name):
                def run(*args, **kw):
                    seen.append((name, kw["TMA"]))
                    return real[grid](*args, **kw)
                return run
        monkeypatch.setattr(_common, name, _Spy())
    return seen


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_tma_loads(dtype, act, device, monkeypatch):
    """GEMM_TMA: the forward and the recompute read x and W through TMA descriptors (tiles past M,
    N and the K tail zero-filled), the results match the float64 reference, and the FFN's output
    GEMM (activation x W2^T, both K-contiguous) takes them too."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("TMA needs sm_90 or newer")
    monkeypatch.setattr(_common, "GEMM_TMA", True)
    monkeypatch.setattr(_common, "PLAIN_GEMM", "triton")
    seen = _spy_tma(monkeypatch)
    M, K, N = 37, 40, 72  # K: a 16-byte row pitch, not a multiple of the tile's BLOCK_K
    _check_linear(*_linear_inputs(M, K, N, dtype, device, True), act, dtype)
    # forward, then the recompute; the backward's plain GEMMs (g_h W, g_h^T x) have operands
    # that are not K-contiguous and keep the pointer loads
    assert seen[:2] == [("_gemm_act_kernel", True), ("_gemm_act_grad_kernel", True)]
    assert [t for _, t in seen[2:]] == [False, False]
    seen.clear()
    _check_mlp(*_mlp_inputs(M, K, 48, 24, dtype, device, True), act, dtype)
    # forward: fc1 with its activation, the output GEMM; backward: g_a = g W2 (W2 is not
    # K-contiguous there), the recompute, then the plain GEMMs
    assert seen[:4] == [("_gemm_act_kernel", True), ("_gemm_act_kernel", True), ("_gemm_act_kernel", False),
                        ("_gemm_act_grad_kernel", True)]
    assert not any(t for _, t in seen[4:])


def test_tma_falls_back_on_layouts_it_cannot_read(device, monkeypatch):
    """Rows whose pitch is not a multiple of 16 bytes, a misaligned base, fp32 on FMA units,
    the switch off or "auto" off a GPU: pointer loads, same results."""
    monkeypatch.setattr(_common, "GEMM_TMA", True)
    seen = _spy_tma(monkeypatch)
    dtype = torch.float16
    x, w, b, g = _linear_inputs(19, 33, 20, dtype, device, True)  # 66-byte rows
    _check_linear(x, w, b, g, "relu", dtype)
    assert seen and not any(t for _, t in seen)
    x, w, _, _ = _linear_inputs(8, 40, 16, dtype, device, False)
    assert _common._use_tma(x, w.t()) is (device.type == "cpu" or torch.cuda.get_device_capability(device)[0] >= 9)
    shifted = torch.empty(8 * 40 + 1, dtype=dtype, device=device)[1:].view(8, 40)
    assert not _common._use_tma(shifted, w.t())                       # base 2 bytes off
    assert not _common._use_tma(x.float(), w.t().float())            # fp32 "ieee": FMA units
    assert not _common._use_tma(x.t().contiguous().t(), w.t())       # x not K-contiguous
    assert not _common._use_tma(x, w.t().contiguous())                 # W^T not K-contiguous
    monkeypatch.setattr(_common, "GEMM_TMA", False)
    assert not _common._use_tma(x, w.t())
    if device.type == "cpu":
        monkeypatch.setattr(_common, "GEMM_TMA", "auto")
        assert not _common._use_tma(x, w.t())


def test_tma_recompute_mask_matches_forward_sign(device, monkeypatch):
    """With TMA loads the recomputed ReLU mask still equals the forward's, bit for bit."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("TMA needs sm_90 or newer")
    monkeypatch.setattr(_common, "GEMM_TMA", True)
    seen = _spy_tma(monkeypatch)
    dtype = torch.float16
    M, K, N = 40, 104, 36  # several K steps with a ragged tail
    x, w, b = _near_zero_inputs(M, K, N, dtype, device)
    y = linear_act.linear_act_forward(x, w, b, "relu")
    ones = torch.ones(M, N, dtype=dtype, device=device)
    gh, _ = linear_act.linear_act_grad_h(x, w, b, ones, "relu")
    assert seen == [("_gemm_act_kernel", True), ("_gemm_act_grad_kernel", True)]
    assert 0.2 < (y > 0).float().mean() < 0.8
    mask = gh != 0
    nz = y != 0
    assert torch.equal(mask[nz], (y > 0)[nz])
    h_fwd = _common.gemm_act(x, w.t(), b, "none")
    assert torch.equal(mask, ~torch.signbit(h_fwd) & ((h_fwd != 0) | mask))


def test_dot_precision_follows_either_tf32_api():
    # torch >= 2.9 raises on reading allow_tf32 once fp32_precision was set: the kernels must not
    matmul = torch.backends.cuda.matmul
    if getattr(matmul, "fp32_precision", None) is None:
        pytest.skip("this torch has no fp32_precision API")
    cuda_fp32 = type("T", (), {"dtype": torch.float32, "device": torch.device("cuda")})()
    prev = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert _common.dot_precision(cuda_fp32) == "tf32"
        matmul.fp32_precision = "ieee"
        assert _common.dot_precision(cuda_fp32) == "ieee"
    finally:
        matmul.fp32_precision = prev
    assert _common.dot_precision(cuda_fp32) == ("tf32" if matmul.allow_tf32 else "ieee")


# --------------------------------------------------------------------------- persistent launches
def persistent_runs(monkeypatch, module, names, run):
    """``run()`` launched one program per tile, then persistent on 2 programs (GEMM_PERSISTENT=2 on
    one pretend SM): (first results, second results, [(grid size, PERSISTENT)] of the second's
    launches of the kernels ``names`` of ``module``)."""
    monkeypatch.setattr(_common, "PLAIN_GEMM", "triton")
    first = run()
    launches = record_launches(monkeypatch, module, grids=True)
    monkeypatch.setattr(_common, "GEMM_PERSISTENT", 2)
    monkeypatch.setattr(_common, "_INTERPRETER_SMS", 1)
    monkeypatch.setattr(_common, "_sm_count", lambda index: 1)
    second = run()
    return first, second, [(grid[0], kw["PERSISTENT"]) for name, kw, grid in launches if name in names]


@pytest.mark.parametrize("dropout,tma", [(0.0, False), (0.3, False), (0.3, True)],
                         ids=["plain", "dropout", "dropout-tma"])
def test_persistent_launch_matches_one_program_per_tile(dropout, tma, device, monkeypatch):
    """GEMM_PERSISTENT: 2 programs walk every output tile of each dense launch (the tile loop
    flattened into the K loop); a tile's arithmetic is unchanged, so the FFN's output and its
    gradients equal the one-program-per-tile launch's bit for bit (the bias gradients, column
    sums of per-tile partials, to rounding: a GPU may add a tile's rows in another order), the
    recomputed activation equals the forward's, and dropout's mask is the same. Also with TMA loads
    (GEMM_TMA, where the operands allow them: the forward and the recompute of fc1)."""
    if tma and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("TMA needs sm_90 or newer")
    monkeypatch.setattr(_common, "GEMM_TMA", tma)
    dtype = torch.float16
    x, w1, b1, w2, b2, g = _mlp_inputs(70, 40, 100, 36, dtype, device, True)
    assert _common._use_tma(x, w1.t()) is tma
    seed = torch.tensor([1234], dtype=torch.int64, device=device)

    def run():
        out = fused_mlp.fused_mlp_forward(x, w1, b1, w2, b2, "gelu", dropout, seed)
        grads = fused_mlp.fused_mlp_backward(x, w1, b1, w2, b2, g, "gelu", dropout, seed)
        a = _common.gemm_act(x, w1.t(), b1, "gelu", dropout=(dropout, seed))
        _, a_bwd, _ = _common.gemm_act_grad(x, w1.t(), b1, torch.ones_like(a), "gelu", store_act=True,
                                            dropout=(dropout, seed))
        return out, grads, a, a_bwd

    (out0, grads0, a0, _), (out1, grads1, a1, a1_bwd), seen = persistent_runs(
        monkeypatch, _common, ("_gemm_act_kernel", "_gemm_act_grad_kernel"), run)
    # at most 2 programs per launch, each persistent; a GPU's table tile may cover a whole launch
    # here (one program), the interpreter's small tile never does
    assert seen and all(p and n in (1, 2) for n, p in seen) and any(n == 2 for n, _ in seen), seen
    if device.type == "cpu":
        assert all(n == 2 for n, _ in seen), seen
    assert torch.equal(out0, out1) and torch.equal(a0, a1) and torch.equal(a1, a1_bwd)
    for name, t0, t1 in zip(["dx", "dw1", "db1", "dw2", "db2"], grads0, grads1):
        if name.startswith("db"):
            assert _rel(t1, t0.double()) < 1e-6, name
        else:
            assert torch.equal(t0, t1), name
    out_ref = R.fused_mlp_forward(_d(x), _d(w1), _d(b1), _d(w2), _d(b2), "gelu")
    if dropout == 0:
        _check([out1], [out_ref], dtype, ["out"])
    else:  # a fresh mask, same keep rate
        assert 0.55 < (a1 != 0).float().mean().item() < 0.85
