"""Direct launches (fusedrc/kernels/_common.py: DirectLaunch, launch): after a plan's launch site has gone
through Triton's JIT once, later launches call the compiled binary's launcher with the arguments the
JIT would have bound. On the CPU there is no compiled binary (Triton's interpreter runs the kernels),
so the mechanism is checked against a stand-in with the JIT function's and the binary's launch
surface; on a GPU, the conv op's results with direct launches on must equal those with them off."""
import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

import fusedrc  # noqa: E402
from fusedrc.kernels import _common as C  # noqa: E402
from fusedrc.kernels import conv_bn_act as K  # noqa: E402

STREAM = 1234


class _Param:
    """The parts of Triton's KernelParam that a direct launch reads."""

    def __init__(self, name, constexpr=False, default=inspect.Parameter.empty):
        self.name, self.is_constexpr, self.default = name, constexpr, default
        self.has_default = default is not inspect.Parameter.empty


class _Binary:
    """A compiled kernel: ``run`` is its launcher (grid, stream, function, metadata, launch metadata,
    hooks, then every bound argument)."""

    def __init__(self):
        self.function, self.packed_metadata, self.calls = object(), object(), []

    def run(self, *args):
        self.calls.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream)


class _Kernel:
    """A JIT function: ``kernel[grid](*args, **meta)`` compiles (once) and launches, returns its binary."""

    def __init__(self, *params):
        self.params = list(params)
        self.binary = _Binary()
        self.jit_launches = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.jit_launches.append((grid, args, meta))
            return self.binary
        return run


@pytest.fixture
def direct(monkeypatch):
    """Direct launches on, outside the interpreter, with a stand-in driver and no launch hooks."""
    monkeypatch.setattr(C, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(C, "interpreting", lambda: False)
    monkeypatch.setattr(C, "_driver_calls", lambda: (lambda: 0, lambda device: STREAM))
    hooks = type("Knobs", (), {"launch_enter_hook": None, "launch_exit_hook": None})()
    monkeypatch.setattr(C, "_runtime_knobs", lambda: hooks)
    return hooks


def _kernel():
    # x_ptr, y_ptr, n, eps, then constexprs: BLOCK (passed), ACT (passed), FLAG (its default)
    return _Kernel(_Param("x_ptr"), _Param("y_ptr"), _Param("n"), _Param("eps"), _Param("BLOCK", True),
                   _Param("ACT", True), _Param("FLAG", True, default=False))


def test_second_launch_is_direct_with_the_jits_bound_arguments(direct):
    k, sites = _kernel(), {}
    x, y = torch.zeros(32), torch.zeros(32)
    meta = dict(BLOCK=16, ACT="relu", num_warps=4)
    C.launch(sites, "a", k, (3,), (x, y, 32, 0.5), meta)
    assert len(k.jit_launches) == 1 and not k.binary.calls
    assert isinstance(sites["a"], C.DirectLaunch)
    x2, y2 = torch.ones(32), torch.ones(32)
    C.launch(sites, "a", k, (3, 2), (x2, y2, 32, 0.25), meta)
    assert len(k.jit_launches) == 1
    (call,) = k.binary.calls
    assert call[:4] == (3, 2, 1, STREAM)
    assert call[4] is k.binary.function and call[5] is k.binary.packed_metadata
    assert call[6] == ("meta", (3, 2), STREAM) and call[7:9] == (None, None)
    tail = call[9:]
    # positional arguments as given, then the constexprs in signature order (a default filled in);
    # options such as num_warps are the binary's, not arguments
    assert tail[0] is x2 and tail[1] is y2 and tail[2:] == (32, 0.25, 16, "relu", False)
    # the hooks are read at each launch: a profiler attached later sees the direct launches
    direct.launch_enter_hook = "enter"
    C.launch(sites, "a", k, (1,), (x2, y2, 32, 0.25), meta)
    assert k.binary.calls[-1][7] == "enter"


@pytest.mark.parametrize("change", ["dtype", "unaligned", "int", "none"])
def test_guard_sends_a_changed_specialization_to_the_jit(change, direct):
    """A launch whose specialization the binary was not compiled for goes through the JIT: another
    dtype, a pointer off 16-byte alignment, another int (its value-1 and divisibility hints), None."""
    k, sites = _kernel(), {}
    x, y = torch.zeros(33), torch.zeros(32)
    C.launch(sites, "a", k, (1,), (x, y, 32, 0.5), dict(BLOCK=16, ACT="relu"))
    args = {"dtype": (x.half(), y, 32, 0.5), "unaligned": (x[1:], y, 32, 0.5), "int": (x, y, 1, 0.5),
            "none": (x, y, None, 0.5)}[change]
    C.launch(sites, "a", k, (1,), args, dict(BLOCK=16, ACT="relu"))
    assert len(k.jit_launches) == 2 and not k.binary.calls
    C.launch(sites, "a", k, (1,), (x, y, 32, 0.75), dict(BLOCK=16, ACT="relu"))  # floats are not specialized
    assert len(k.jit_launches) == 2 and len(k.binary.calls) == 1


def test_switch_off_launches_through_the_jit(monkeypatch, direct):
    monkeypatch.setattr(C, "DIRECT_LAUNCH", False)
    k, sites = _kernel(), {}
    x = torch.zeros(16)
    for _ in range(3):
        C.launch(sites, "a", k, (1,), (x, x, 16, 1.0), dict(BLOCK=16, ACT="relu"))
    assert len(k.jit_launches) == 3 and not k.binary.calls and not sites


@pytest.mark.parametrize("case", ["runtime_param_by_name", "missing_constexpr", "unaligned_first", "no_launcher"])
def test_record_refuses_launches_of_another_shape(case, direct):
    """Where the first launch does not have the expected shape, the site stays with the JIT."""
    x = torch.zeros(32)
    k = _kernel()
    args, meta = (x, x, 32, 0.5), dict(BLOCK=16, ACT="relu")
    if case == "runtime_param_by_name":
        args, meta = (x, x, 32), dict(eps=0.5, BLOCK=16, ACT="relu")
    elif case == "missing_constexpr":
        meta = dict(BLOCK=16)
    elif case == "unaligned_first":
        args = (x[1:], x, 31, 0.5)
    else:
        del k.binary.packed_metadata
    sites = {}
    C.launch(sites, "a", k, (1,), args, meta)
    assert sites == {"a": None}
    C.launch(sites, "a", k, (1,), args, meta)
    assert len(k.jit_launches) == 2


def test_interpreter_records_nothing(monkeypatch):
    """Under Triton's interpreter a launch returns no binary: the switch changes nothing there."""
    if not C.interpreting():
        pytest.skip("runs under Triton's interpreter (no GPU)")
    monkeypatch.setattr(C, "DIRECT_LAUNCH", True)
    conv = torch.nn.Conv2d(3, 6, 3, padding=1, bias=False)
    bn = torch.nn.BatchNorm2d(6)
    fused = fusedrc.nn.ConvBNReLU.from_modules(conv, bn)
    x = torch.randn(2, 3, 5, 5)
    with fusedrc.use_backend("triton"):
        fused(x).sum().backward()
    plans = [p for p in K._PLANS._entries.values() if p is not None]
    assert plans and all(site is None for site in _sites(K._PLANS))


def _sites(plans):
    """Every launch site of a LaunchPlans: a plan's ``sites``, or the plan itself where it is the sites'
    dict (False: a call the kernels do not cover)."""
    return [s for p in plans._entries.values() if p for s in (p if isinstance(p, dict) else p.sites).values()]


def _tritons_binder(kernel):
    """Triton's own binder of ``kernel`` (what ``JITFunction.run`` binds a launch's arguments with),
    built for an sm_90 target without a GPU; None where this Triton builds it another way."""
    from triton.runtime import jit

    make = getattr(jit, "create_function_from_signature", None)
    if make is None:
        return None
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    fn = jit.JITFunction(getattr(kernel, "fn", kernel))  # under the interpreter: the Python function
    return fn, make(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))


def test_bound_arguments_are_tritons(monkeypatch):
    """Every launch site of the conv ops (a training and an eval step of ConvBNReLU, with a residual,
    and a training step of BNReLUConv): the arguments a direct launch passes after the positional
    ones are those Triton's binder binds, in its order (constexprs from the launch's keywords or
    their defaults, launch options left out); and the binder specializes no float argument."""
    from fusedrc.kernels import bn_act_conv as B

    seen, real = [], C.launch

    def spy(sites, name, kernel, grid, args, meta):
        seen.append((kernel, args, meta))
        return real(sites, name, kernel, grid, args, meta)

    monkeypatch.setattr(K, "launch", spy)
    monkeypatch.setattr(B, "launch", spy)
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(5, 6, 3, padding=1, bias=True), torch.nn.BatchNorm2d(6)
    fused = fusedrc.nn.ConvBNReLU.from_modules(conv, bn)
    pre = fusedrc.nn.BNReLUConv(5, 4, 1)
    x, res = torch.randn(2, 5, 6, 6, requires_grad=True), torch.randn(2, 6, 6, 6)
    with fusedrc.use_backend("triton"):
        fused(x, res).sum().backward()
        pre(x).sum().backward()
        fused.eval()
        fused(x, res)
    names = {getattr(k, "fn", k).__name__ for k, _, _ in seen}
    assert {"_conv_bn_fwd_kernel", "_bn_stats_finalize_kernel", "_conv_bn_bwd_kernel", "_bn_running_update_kernel",
            "_channel_stats_kernel", "_bn_act_conv_fwd_kernel", "_bn_act_grad_reduce_kernel",
            "_bn_act_grad_dx_kernel"} <= names
    for kernel, args, meta in seen:
        built = _tritons_binder(kernel)
        if built is None:
            pytest.skip("this Triton has no create_function_from_signature")
        fn, binder = built
        bound_args, spec, _ = binder(*args, **meta)
        bound = tuple(bound_args.values())
        # the guard leaves float arguments out: Triton compiles one binary whatever their value
        other = tuple(a + 0.375 if type(a) is float else a for a in args)
        assert binder(*other, **meta)[1] == spec, fn.__name__
        tail = (*args, *C._constexpr_tail(fn.params, args, meta))
        assert len(tail) == len(bound), fn.__name__
        for a, b in zip(tail, bound):
            assert a is b or (not isinstance(a, torch.Tensor) and type(a) is type(b) and a == b), fn.__name__


def _same_bits_off_and_on(monkeypatch, steps, plans):
    """``steps()`` (a fresh layer's training steps: the tensors to compare) with direct launches off,
    then on, from the same seed: equal bits; and every launch site of ``plans`` (a LaunchPlans)
    bound to its binary."""
    # cuDNN computes dX/dW (and z with CONV_Z="aten"): its deterministic algorithms, or two runs differ anyway
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    runs = []
    for direct in (False, True):
        monkeypatch.setattr(C, "DIRECT_LAUNCH", direct)
        K.clear_launch_plans()
        plans.clear()
        torch.manual_seed(0)
        runs.append(steps())
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    sites = _sites(plans)
    assert sites and all(isinstance(s, C.DirectLaunch) for s in sites)


def _image(*shape):
    return torch.randn(*shape, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_(True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="direct launches need compiled kernels (a GPU)")
@pytest.mark.parametrize("conv_z", ["aten", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_layer_same_bits_with_direct_launches(conv_z, dtype, monkeypatch):
    """Three training steps and an eval step of a residual Conv-BN-ReLU layer, channels_last, with
    direct launches off and on: equal outputs, gradients and running statistics, bit for bit."""
    monkeypatch.setattr(K, "CONV_Z", conv_z)

    def steps():
        conv = torch.nn.Conv2d(24, 40, 3, stride=2, padding=1, bias=True).cuda()
        bn = torch.nn.BatchNorm2d(40).cuda()
        fused = fusedrc.nn.ConvBNReLU.from_modules(conv, bn).to(memory_format=torch.channels_last)
        out = []
        with fusedrc.use_backend("triton"), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            for _ in range(3):
                x, res = _image(4, 24, 15, 15), _image(4, 40, 8, 8)
                y = fused(x, res)
                y.float().square().sum().backward()
                out += [y.detach().clone(), x.grad, res.grad, conv.weight.grad.clone(), bn.weight.grad.clone()]
            fused.eval()
            out.append(fused(x.detach(), res.detach()))
        return out + [bn.running_mean.clone(), bn.running_var.clone()]

    _same_bits_off_and_on(monkeypatch, steps, K._PLANS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="direct launches need compiled kernels (a GPU)")
@pytest.mark.parametrize("conv_grad", ["aten", "triton"])
def test_pre_activation_layer_same_bits_with_direct_launches(conv_grad, monkeypatch):
    """The same for BNReLUConv (bn_act_conv's plans: statistics, finalize, conv; in the backward the
    apply, reduce and dx passes), bf16 autocast, channels_last."""
    from fusedrc.kernels import bn_act_conv as B

    monkeypatch.setattr(K, "CONV_GRAD", conv_grad)

    def steps():
        layer = fusedrc.nn.BNReLUConv(24, 40, 3, padding=1).cuda().to(memory_format=torch.channels_last)
        out = []
        with fusedrc.use_backend("triton"), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(3):
                x = _image(4, 24, 15, 15)
                y = layer(x)
                y.float().square().sum().backward()
                out += [y.detach().clone(), x.grad, layer.conv.weight.grad.clone(), layer.bn.weight.grad.clone()]
        return out + [layer.bn.running_mean.clone(), layer.bn.running_var.clone()]

    _same_bits_off_and_on(monkeypatch, steps, B._PLANS)
