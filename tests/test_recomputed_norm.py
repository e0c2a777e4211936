"""Norms whose output is not kept (convert's units of kind ``norm``).

A converted model's norm keeps only its input; inside the model's call, the ops that keep its output
(the attention's projections, the head) keep a recipe and the output is rebuilt once in backward.
The rebuilt output is the same ops on the same values, so outputs and gradients equal the
original model's bit for bit; the bytes kept drop by at least the norm outputs' size.
"""
import copy
import pickle
import sys

import pytest
import torch
from torch import nn

import fusedrc
from fusedrc.convert import saved_bytes
from fusedrc import _recomputed_norm as RN
from fusedrc.errors import RecomputeError

from _utils import GemmaRMSNorm, InputScaledRMSNorm, LlamaRMSNorm

C = sys.modules["fusedrc.convert"]


NORMS = {
    "layer": lambda d: nn.LayerNorm(d),
    "rms": lambda d: nn.RMSNorm(d, eps=1e-6),
    "llama_rms": lambda d: LlamaRMSNorm(d),
    "gemma_rms": lambda d: GemmaRMSNorm(d),
    # no functional form models these three: they rerun their own forward
    "input_scaled_rms": lambda d: InputScaledRMSNorm(d),
    "cohere_layer": lambda d: CohereLayerNorm(d),
    "weightless_layer": lambda d: WeightlessLayerNorm(d),
}


class CohereLayerNorm(nn.Module):
    """Hugging Face's CohereLayerNorm, written out: mean-centred, in float32, no bias."""

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight.to(torch.float32) * hidden_states
        return hidden_states.to(input_dtype)


class WeightlessLayerNorm(nn.Module):
    """OLMo's: no parameters, float32."""

    def __init__(self, hidden_size):
        super().__init__()
        self.normalized_shape = (hidden_size,)

    def forward(self, x):
        return nn.functional.layer_norm(x.float(), self.normalized_shape, None, None, eps=1e-5).to(x.dtype)


class Attention(nn.Module):
    """A pre-norm attention block: the norm's output feeds three projections that keep it."""

    def __init__(self, d, norm):
        super().__init__()
        self.norm = NORMS[norm](d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / 4.0, -1) @ self.v(h)
        return x + self.o(a)


class Net(nn.Module):
    def __init__(self, d=16, norm="layer", layers=2):
        super().__init__()
        self.layers = nn.ModuleList(Attention(d, norm) for _ in range(layers))
        self.norm = NORMS[norm](d)
        self.head = nn.Linear(d, 11)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _net(norm="layer", dtype=torch.float32, **kw):
    torch.manual_seed(0)
    net = Net(norm=norm, **kw).to(dtype).train()
    with torch.no_grad():
        for m in net.modules():
            if hasattr(m, "variance_epsilon") or hasattr(m, "eps"):
                for p in m.parameters():
                    p.add_(torch.randn_like(p) * 0.3)
    return net


def _x(dtype=torch.float32, shape=(2, 7, 16)):
    torch.manual_seed(1)
    return torch.randn(shape, dtype=dtype)


def _grads(model, x, autocast=None):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
        out = model(x)
    (out.float() ** 2).sum().backward()
    g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out.detach(), x.grad, g


def _assert_same(a, b, exact=True):
    """Equal outputs and gradients: bit for bit, or (``exact=False``) within rounding where the norm's
    eager autograd reads x twice (nn.RMSNorm's composite ops; Llama's in float32, where x.float() is x):
    its two gradient terms then meet the residual's in another order."""
    out_a, dx_a, g_a = a
    out_b, dx_b, g_b = b
    same = torch.equal if exact else (lambda u, v: torch.allclose(u, v, rtol=1e-5, atol=1e-6))
    assert torch.equal(out_a, out_b)
    assert same(dx_a, dx_b)
    assert g_a.keys() == g_b.keys()
    for k in g_a:
        assert same(g_a[k], g_b[k]), k


NORM_UNITS = ["layers.0.norm", "layers.1.norm", "norm"]


@pytest.mark.parametrize("norm,dtype,exact", [("layer", torch.float32, True), ("rms", torch.float32, False),
                                              ("llama_rms", torch.bfloat16, True), ("llama_rms", torch.float32, False),
                                              ("gemma_rms", torch.bfloat16, True), ("input_scaled_rms", torch.bfloat16, True),
                                              ("cohere_layer", torch.bfloat16, True),
                                              ("weightless_layer", torch.bfloat16, True),
                                              ("cohere_layer", torch.float32, False)])
def test_outputs_and_gradients_are_the_originals_and_the_norm_outputs_are_not_kept(norm, dtype, exact):
    net, x = _net(norm, dtype), _x(dtype)
    conv = C.convert(net)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units if u.kind == "norm"] == [(n, "norm") for n in NORM_UNITS]
    _assert_same(_grads(net, x), _grads(conv, x), exact)
    before, after = saved_bytes(net, (x,)), saved_bytes(conv, (x,))
    norm_out = x.numel() * x.element_size()
    # each of the three norm outputs was kept (by the projections, the head): none is now
    assert after <= before - 3 * norm_out, (before, after)


def test_the_norms_own_saves_are_its_input_alone():
    # Llama's RMSNorm in bfloat16 keeps float32 copies of its input: the recomputed one keeps x only
    norm = LlamaRMSNorm(16).bfloat16()
    conv = C.convert(nn.Sequential(norm, nn.Tanh()))  # tanh keeps its output, not the norm's
    x = _x(torch.bfloat16).requires_grad_()
    assert saved_bytes(conv, (x,)) == x.numel() * x.element_size() * 2  # x and tanh's output
    assert saved_bytes(nn.Sequential(LlamaRMSNorm(16).bfloat16(), nn.Tanh()), (x,)) > 4 * x.numel() * 2


def test_under_autocast_the_casts_of_a_norm_output_are_recipes_too():
    # float32 parameters, bfloat16 autocast: every projection casts the norm's output and keeps the cast
    net, x = _net("llama_rms"), _x()
    conv = C.convert(net)
    # (float32 x: the norm's x.to(float32) is x itself, read twice)
    _assert_same(_grads(net, x, autocast=True), _grads(conv, x, autocast=True), exact=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before, after = saved_bytes(net, (x,)), saved_bytes(conv, (x,))
    # per layer three bfloat16 casts, and the final norm's one cast (head), are no longer kept
    assert after <= before - 7 * x.numel() * 2, (before, after)


def test_a_norm_output_changed_in_place_after_a_consumer_kept_it():
    # eager raises (the Linear kept h for its weight's gradient); converted, the Linear kept a recipe
    # of h as it read it, and the gradient is the one of what was computed
    class Scaled(nn.Module):
        def __init__(self, in_place):
            super().__init__()
            self.norm, self.fc, self.in_place = nn.LayerNorm(16), nn.Linear(16, 16), in_place

        def forward(self, x):
            h = self.norm(x)
            a = self.fc(h)
            h = h.mul_(2.0) if self.in_place else h * 2.0
            return a + self.fc(h)  # h after the change: kept as it is

    torch.manual_seed(0)
    net, x = Scaled(True), _x()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grads(net, x)
    ref = copy.deepcopy(net)
    ref.in_place = False
    _assert_same(_grads(ref, x), _grads(C.convert(net), x))


def test_a_norm_input_changed_in_place_raises_as_in_eager():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x):
            x = x * 1.0
            y = self.fc(self.norm(x))
            x.add_(1.0)
            return y

    torch.manual_seed(0)
    net = Bad()
    for model in (net, C.convert(net)):
        out = model(_x().requires_grad_())
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_double_backward_raises_a_clear_error():
    net, x = _net(), _x().requires_grad_()
    conv = C.convert(net)
    out = conv(x)
    with pytest.raises(RecomputeError, match="double backward"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


@pytest.mark.parametrize("outer", ["save_on_cpu", "checkpoint"])
def test_under_outer_saved_tensor_hooks_the_gradients_hold(outer):
    net, x = _net("llama_rms"), _x()
    conv = C.convert(net)
    ref = _grads(net, x)
    xg = x.clone().requires_grad_()
    if outer == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            out = conv(xg)
    else:
        out = torch.utils.checkpoint.checkpoint(conv, xg, use_reentrant=False)
    (out.float() ** 2).sum().backward()
    got = (out.detach(), xg.grad, {n: p.grad.clone() for n, p in conv.named_parameters()})
    _assert_same(ref, got, exact=False)  # (float32: Llama's norm reads x twice)


def test_a_norm_module_called_twice_and_a_shared_output():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.a, self.b = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            h = self.norm(x)
            g = self.norm(h * 0.5 + 1.0)
            return self.a(h) * self.b(g) + h  # h kept by a, read again at the end

    torch.manual_seed(0)
    net, x = Shared(), _x()
    _assert_same(_grads(net, x), _grads(C.convert(net), x))


def test_policy_hooks_and_marks_leave_a_norm_as_it_is():
    net = _net()
    conv = C.convert(net, policy=lambda name, m: not name.endswith("norm"))
    assert not [u.name for u in conv.fusedrc_plan.units if u.kind == "norm" and u.selected]
    x = _x()
    assert saved_bytes(conv, (x,)) == saved_bytes(net, (x,))
    # with no norm unit on, the model's call opens no scope (no saved-tensor hook on every op)
    scopes = []
    conv.head.register_forward_pre_hook(lambda m, a: scopes.append(RN.current_scope()))
    conv(x.requires_grad_())
    C.convert(conv, inplace=True)(x)
    assert scopes[0] is None and isinstance(scopes[1], RN.NormScope)
    hooked = _net()
    hooked.norm.register_forward_hook(lambda m, i, o: None)
    with pytest.warns(UserWarning, match="hooks registered on the norm"):
        plan = C.convert(hooked).fusedrc_plan
    assert "norm" not in [u.name for u in plan.units]
    marked = _net()
    fusedrc.mark(marked.layers[0])
    with pytest.warns(UserWarning, match="already marked"):
        plan = C.convert(marked).fusedrc_plan
    assert [u.name for u in plan.units if u.kind == "norm"] == ["layers.1.norm", "norm"]


def test_a_budget_takes_the_norms_first():
    net, x = _net(), _x()
    conv = C.convert(net, memory_budget=0.99, example_inputs=(x,))
    plan = conv.fusedrc_plan
    assert plan.final_bytes <= plan.target_bytes
    # the norms cost no GEMM to recompute: chosen before anything else
    assert [u.kind for u in plan.units if u.selected] == ["norm"] * len([u for u in plan.units if u.selected])


def test_copies_pickles_and_a_second_convert_keep_one_scope():
    net, x = _net(), _x()
    conv = C.convert(C.convert(net))
    assert sum(h is C.scope_enter for h in conv._forward_pre_hooks.values()) == 1
    ref = _grads(net, x)
    for model in (conv, copy.deepcopy(conv), pickle.loads(pickle.dumps(conv))):
        _assert_same(ref, _grads(model, x))
        assert saved_bytes(model, (x,)) < saved_bytes(net, (x,))


def test_a_norm_called_outside_the_models_call_still_keeps_only_its_input():
    # no scope (a submodule called by hand): its consumers keep its output, it keeps x alone
    net, x = _net("llama_rms", torch.bfloat16), _x(torch.bfloat16)
    conv = C.convert(net)
    layer, plain = conv.layers[0], net.layers[0]
    xg = x.clone().requires_grad_()
    # eager keeps x's float32 copy (and its normalized rows in bfloat16) in place of x
    assert saved_bytes(layer, (xg,)) <= saved_bytes(plain, (xg,)) - 2 * x.numel() * 2
    _assert_same(_grads(plain, x), _grads(layer, x))


def test_torch_compile_runs_the_norms_as_they_are_with_no_graph_break():
    net, x = _net(), _x()
    conv = C.convert(net)
    explain = torch._dynamo.explain(conv)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(conv, backend="aot_eager")
    out, dx, g = _grads(compiled, x)
    ref = _grads(net, x)
    torch.testing.assert_close(out, ref[0])
    torch.testing.assert_close(dx, ref[1])
    for k, v in ref[2].items():
        torch.testing.assert_close(g["_orig_mod." + k], v)


class BufferedRMSNorm(LlamaRMSNorm):
    def __init__(self, d):
        super().__init__(d)
        self.register_buffer("scale", torch.full((d,), 2.0))

    def forward(self, x):
        return super().forward(x) * self.scale


class NoisyRMSNorm(LlamaRMSNorm):
    def forward(self, x):
        return super().forward(x) + torch.randn_like(x) * 0.1


class PassThroughNorm(nn.Module):
    def __init__(self, d):
        super().__init__()

    def forward(self, x):
        return x


class ScaledNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.inner = nn.LayerNorm(d)

    def forward(self, x):
        return self.inner(x) * 2.0


def test_a_norm_with_buffers_or_submodules_is_left_as_it_is():
    """The own-forward path admits only modules that hold at most two parameters: a buffer could be
    state the forward changes, a submodule code of its own (it is looked into instead)."""
    net = nn.Sequential(BufferedRMSNorm(16), nn.Linear(16, 4))
    with pytest.warns(UserWarning, match="no pattern found"):
        conv = C.convert(net)
    assert not conv.fusedrc_plan.units and type(conv[0]) is BufferedRMSNorm
    conv = C.convert(nn.Sequential(ScaledNorm(16), nn.Linear(16, 4)))
    assert [u.name for u in conv.fusedrc_plan.units] == ["0.inner"] and type(conv[0]) is ScaledNorm


@pytest.mark.parametrize("norm_cls", [NoisyRMSNorm, PassThroughNorm])
def test_a_norm_whose_forward_is_not_a_fresh_pure_function_runs_as_it_is(norm_cls):
    """A *Norm class whose forward draws random numbers, or returns its input, fails the check its first
    call runs (two runs agree bit for bit, a fresh output): it runs as it is, and the check leaves the
    random stream where it was."""
    torch.manual_seed(0)
    net = nn.Sequential(norm_cls(16), nn.Linear(16, 4))
    conv = C.convert(net)
    assert [u.kind for u in conv.fusedrc_plan.units] == ["norm"]
    x = _x()
    for _ in range(2):
        torch.manual_seed(5)
        ref = _grads(net, x)
        torch.manual_seed(5)
        got = _grads(conv, x)
        _assert_same(ref, got)
    assert saved_bytes(conv, (x,)) == saved_bytes(net, (x,))
    assert list(conv[0].__dict__["_fusedrc_pure"].values()) == [False]


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """A LayerNorm over the channels of an NCHW tensor through ``super().forward`` (Hugging Face's
    ConvNeXt and SAM norms): a class no form models, whose forward needs an instance of itself."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def test_an_own_forward_norm_calling_super():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), ChannelsFirstLayerNorm(8), nn.Conv2d(8, 4, 1))
    with torch.no_grad():
        net[1].weight.normal_()
    conv = C.convert(net)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("1", "norm")]
    x = torch.randn(2, 3, 7, 7)
    _assert_same(_grads(net, x), _grads(conv, x))
    # the second conv kept the norm's output (a channels-last view): a recipe now
    assert saved_bytes(conv, (x,)) <= saved_bytes(net, (x,)) - 2 * 8 * 49 * 4
    with torch.no_grad():  # the norm as it was (its plain call)
        assert torch.equal(conv(x), net(x))


def test_nemotron_layer_norm_1p_reruns_its_own_forward():
    """Hugging Face Nemotron's LayerNorm1P (F.layer_norm with 1 + weight, autocast off): a norm unit that
    reruns its own forward; outputs and gradients bit for bit, its output no longer kept."""
    try:
        C.import_torchvision()  # transformers imports torchvision where it is installed
    except ImportError:
        pass
    tr = pytest.importorskip("transformers", reason="transformers is not installed (test extra)")
    norm_cls = tr.models.nemotron.modeling_nemotron.NemotronLayerNorm1P
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), norm_cls(16), nn.Linear(16, 8))
    with torch.no_grad():
        net[1].weight.normal_(0, 0.3)
    conv = C.convert(net)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("1", "norm")]
    x = _x()
    _assert_same(_grads(net, x), _grads(conv, x))
    assert saved_bytes(conv, (x,)) <= saved_bytes(net, (x,)) - x.numel() * 4


def test_a_replicas_own_forward_norm_reads_the_replicas_parameters():
    """An nn.DataParallel replica holds its parameters as plain attributes: the own-forward path reads
    them by the names convert recorded, and they get their gradients."""
    from _utils import replicate_on_cpu

    net = _net("cohere_layer", torch.bfloat16)
    conv = C.convert(net)
    replica = replicate_on_cpu(conv, scale=2.0)
    ref = copy.deepcopy(net)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(2)
    x = _x(torch.bfloat16)
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ref(xr).float() ** 2).sum().backward()
    out = replica(xc)
    w = replica.norm.weight  # a non-leaf tensor (twice the original's): its gradient reaches the original
    (gw,) = torch.autograd.grad((out.float() ** 2).sum(), [w], retain_graph=True)
    assert torch.equal(out, ref(x))
    assert torch.equal(gw, ref.norm.weight.grad)


def test_group_norm_before_an_activation_and_a_conv():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 4, 3)).train()
    with torch.no_grad():
        net[1].weight.add_(torch.randn(8) * 0.3)
    conv = C.convert(net)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("1", "norm")]
    x = torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last)
    _assert_same(_grads(net, x), _grads(conv, x))
    # the GroupNorm's output (SiLU keeps it) and its statistics are no longer kept
    assert saved_bytes(conv, (x,)) <= saved_bytes(net, (x,)) - 2 * 8 * 9 * 9 * 4


class _OffloadOnce(torch.autograd.graph.saved_tensors_hooks):
    """An offloading hook that frees what it keeps at its unpack (as torchtune's does): each saved
    tensor may be unpacked once."""

    def __init__(self):
        self.kept, self.next = {}, 0

        def pack(t):
            self.next += 1
            self.kept[self.next] = (t.clone(), t._version)  # a copy: its own version counter
            return self.next

        def unpack(i):
            assert i in self.kept, f"tensor {i} unpacked twice"
            return self.kept.pop(i)[0]

        super().__init__(pack, unpack)


def test_offloading_hooks_below_get_one_pack_and_one_unpack_per_tensor():
    class InPlaceInput(Net):
        def forward(self, x):
            x = x * 1.0
            x += 0.5  # the norm's input at version 1: an offloader's copy is at 0
            return super().forward(x)

    torch.manual_seed(0)
    net, x = InPlaceInput(), _x()
    conv = C.convert(net)
    ref = _grads(net, x)
    for hooks in (_OffloadOnce, torch.autograd.graph.save_on_cpu):
        xg = x.clone().requires_grad_()
        with hooks():
            out = conv(xg)
        (out.float() ** 2).sum().backward()
        _assert_same(ref, (out.detach(), xg.grad, {n: p.grad.clone() for n, p in conv.named_parameters()}))
        conv.zero_grad()


def test_the_rerun_reads_the_parameters_the_forward_read():
    net, x = _net(), _x()
    conv = C.convert(net)
    ref = _grads(net, x)
    # torch.func.functional_call: the module's own parameters are back by backward time
    params = {n: p.detach().clone().requires_grad_() for n, p in conv.named_parameters()}
    out = torch.func.functional_call(conv, params, (x,))
    (out.float() ** 2).sum().backward()
    for n, g in ref[2].items():
        assert torch.equal(params[n].grad, g), n
    # a tensor hook on a norm parameter runs once, as in eager
    calls = []
    conv.norm.weight.register_hook(lambda g: calls.append(1) or g * 0.5)
    got = _grads(conv, x)
    assert len(calls) == 1 and torch.equal(got[2]["norm.weight"], ref[2]["norm.weight"] * 0.5)
    # a weight changed in place after the forward: the consumers get the output the forward computed
    out = conv(x)
    with torch.no_grad():
        conv.layers[0].norm.weight.mul_(3.0)
    (out.float() ** 2).sum().backward()
    with torch.no_grad():
        conv.layers[0].norm.weight.div_(3.0)
    torch.testing.assert_close(conv.head.weight.grad, ref[2]["head.weight"], rtol=0, atol=0)


def _norm_calls(t):
    """The RecomputedNormFunction states in ``t``'s graph."""
    seen, stack, found = set(), [t.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(getattr(node, "shared", None), RN._Shared):
            found.append(node.shared)
        stack.extend(n for n, _ in node.next_functions)
    return found


def test_a_partial_backward_keeps_no_rerun_and_inference_mode_backward_works():
    net, x = _net(), _x()
    conv = C.convert(net)
    loss = (conv(x.clone().requires_grad_()) ** 2).sum()
    for _ in range(3):
        torch.autograd.grad(loss, [conv.head.weight], retain_graph=True)  # reruns the final norm only
    shared = _norm_calls(loss)
    assert len(shared) == 3 and all(not s.reruns for s in shared)
    del loss, shared
    ref = _grads(net, x)
    xg = x.clone().requires_grad_()
    out = conv(xg)
    loss = (out.float() ** 2).sum()
    with torch.inference_mode():  # the rerun in backward leaves it
        loss.backward()
    _assert_same(ref, (out.detach(), xg.grad, {n: p.grad.clone() for n, p in conv.named_parameters()}))


def test_an_interrupted_call_leaves_no_scope_behind_its_next_call():
    class Interrupted(Net):
        stop = False

        def forward(self, x):
            if self.stop:
                self.layers[0](x)
                raise KeyboardInterrupt  # skips the always-called forward hooks
            return super().forward(x)

    torch.manual_seed(0)
    conv = C.convert(Interrupted())
    conv.stop = True
    with pytest.raises(KeyboardInterrupt):
        conv(_x().requires_grad_())
    conv.stop = False
    (conv(_x().requires_grad_()) ** 2).sum().backward()
    assert RN.current_scope() is None and not RN._local.stack


def test_transforms_traces_and_other_tensors_run_the_norms_as_they_are():
    net, x = _net(), _x()
    conv = C.convert(net)
    loss = lambda m: lambda x: (m(x) ** 2).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.grad(loss(conv))(x), torch.func.grad(loss(net))(x))
    with torch.autograd.forward_ad.dual_level():
        tangent = torch.ones_like(x)
        got = torch.autograd.forward_ad.unpack_dual(conv(torch.autograd.forward_ad.make_dual(x, tangent))).tangent
        want = torch.autograd.forward_ad.unpack_dual(net(torch.autograd.forward_ad.make_dual(x, tangent))).tangent
    torch.testing.assert_close(got, want)
    traced = torch.jit.trace(conv, (x,), check_trace=False)
    torch.testing.assert_close(traced(x), net(x))

    class Sparse(nn.Module):  # a sparse tensor saved inside the scope
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x):
            adj = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (2, 2))
            return torch.sparse.mm(adj, self.net(x).flatten(1))

    torch.manual_seed(0)
    sparse = Sparse()
    out = C.convert(sparse)(x.requires_grad_())
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_norm_module_held_twice_is_one_unit():
    net = _net()
    net.layers[1].norm = net.layers[0].norm
    plan = C.convert(net).fusedrc_plan
    assert [u.name for u in plan.units] == ["layers.0.norm", "norm"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the norms' recipes on GPU tensors under autocast")
@pytest.mark.parametrize("norm", ["layer", "llama_rms"])
def test_on_cuda_under_autocast(norm):
    net, x = _net(norm).cuda(), _x().cuda()
    conv = C.convert(net)

    def run(model):
        xg = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(xg)
        (out.float() ** 2).sum().backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        return out.detach(), xg.grad, g

    _assert_same(run(net), run(conv), exact=norm == "layer")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        before, after = saved_bytes(net, (x,)), saved_bytes(conv, (x,))
    assert after <= before - 7 * x.numel() * 2, (before, after)


class StyleNorm(nn.Module):
    """Adaptive instance norm: a style (gamma, beta) set as plain attributes before each call."""

    def forward(self, x):
        return nn.functional.instance_norm(x) * self.gamma[:, :, None, None] + self.beta[:, :, None, None]


def test_a_norm_holding_other_tensors_runs_as_it_is():
    """A tensor the forward reads that is no parameter (a style computed elsewhere) would get no gradient
    through the recomputed op, and could change before backward: such a norm runs as it is."""
    torch.manual_seed(0)
    style = nn.Linear(4, 16)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), StyleNorm(), nn.Conv2d(8, 3, 1))
    conv = C.convert(net)
    assert [u.kind for u in conv.fusedrc_plan.units] == ["norm"]
    x, z = torch.randn(2, 3, 5, 5), torch.randn(2, 4)

    def grads(model):
        style.zero_grad()
        model.zero_grad()
        loss = 0
        for scale in (1.0, -2.0):  # two calls, the style changed between them, one backward
            model[1].gamma, model[1].beta = (style(z * scale)[:, :8], style(z * scale)[:, 8:])
            loss = loss + (model(x) ** 2).sum()
        loss.backward()
        return [p.grad.clone() for p in (*model.parameters(), *style.parameters())]

    for a, b in zip(grads(net), grads(conv)):
        assert torch.equal(a, b)


class CountingRMSNorm(LlamaRMSNorm):
    def forward(self, x):
        self.calls = self.__dict__.get("calls", 0) + 1
        return super().forward(x)


class GradModeLayerNorm(nn.LayerNorm):
    def forward(self, x):
        if torch.is_grad_enabled():
            return super().forward(x)
        return super().forward(x.bfloat16().float())  # a "fast path" without autograd


@pytest.mark.parametrize("norm_cls", [CountingRMSNorm, GradModeLayerNorm])
def test_a_norm_that_writes_its_attributes_or_reads_the_grad_mode_runs_as_it_is(norm_cls):
    """The check runs the forward as the op does (no autograd) and as its rerun does: a forward that
    sets an attribute (lost on the rerun's instance), or computes otherwise without autograd, fails it."""
    net = nn.Sequential(nn.Linear(16, 16), norm_cls(16), nn.Linear(16, 4))
    conv = C.convert(copy.deepcopy(net))
    x = _x()
    _assert_same(_grads(net, x), _grads(conv, x))
    assert list(conv[1].__dict__["_fusedrc_pure"].values()) == [False]
    if norm_cls is CountingRMSNorm:
        before = conv[1].calls
        conv(x)
        assert conv[1].calls == before + 1


def test_a_parametrization_on_a_converted_norm():
    """A parametrization registered after convert: the norm is no longer a candidate (it holds a
    submodule now) and runs as it is, with and without autograd."""
    from torch.nn.utils import parametrize

    class Positive(nn.Module):
        def forward(self, w):
            return w.abs() + 0.5

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    conv = C.convert(copy.deepcopy(net))
    for m in (net, conv):
        parametrize.register_parametrization(m[1], "weight", Positive())
    x = _x()
    _assert_same(_grads(net, x), _grads(conv, x))
    with torch.no_grad():
        assert torch.equal(conv(x), net(x))


def test_a_norm_kind_needs_its_parameters_alone_and_instance_norms_rerun_their_forward():
    """An RMSNorm class with a parameter beside its weight (here a shift, zero at first: the probe would
    not see it) matches no kind and is no candidate (three parameters); an nn.InstanceNorm2d without
    running statistics reruns its own forward."""
    from fusedrc._patterns import norm_kind

    class ShiftedRMSNorm(LlamaRMSNorm):
        def __init__(self, d):
            super().__init__(d)
            self.shift, self.gate = nn.Parameter(torch.zeros(d)), nn.Parameter(torch.zeros(d))

        def forward(self, x):
            return super().forward(x) + self.shift * self.gate

    assert norm_kind(ShiftedRMSNorm(16)) is None
    with pytest.warns(UserWarning, match="no pattern found"):
        assert not C.convert(nn.Sequential(ShiftedRMSNorm(16), nn.Linear(16, 4))).fusedrc_plan.units
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8, affine=True), nn.Conv2d(8, 2, 1))
    conv = C.convert(copy.deepcopy(net))
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("1", "norm")]
    x = torch.randn(2, 3, 7, 7)
    _assert_same(_grads(net, x), _grads(conv, x))
    assert saved_bytes(conv, (x,)) < saved_bytes(net, (x,))
