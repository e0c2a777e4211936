"""A norm run inside the FFN ops (``norm=`` of fused_mlp / gated_mlp): pre-norm transformers' ``mlp(norm(x))``.

The op keeps x, the norm's input, in place of the norm's output, and computes the norm again in
backward. References: the unfused modules (nn.LayerNorm, nn.RMSNorm, Hugging Face's Llama RMSNorm
written out) under plain autograd. On the reference backend the forward is the same aten ops in the
same order: bitwise equal; gradients within float32 rounding (the RMSNorm backward is written out).
Under Triton's interpreter the GEMMs differ in summation order: relative error 1e-5 in float32,
2e-2 in bfloat16.
"""
import copy
import sys

import pytest
import torch
import torch.nn.functional as TF
from torch import nn

import fusedrc
from fusedrc import reference as R
from fusedrc.convert import saved_bytes

from _utils import FusedOpLog, GemmaRMSNorm, InputScaledRMSNorm, LlamaRMSNorm, SavedBytes, backend_device, rel_err

C = sys.modules["fusedrc.convert"]  # the module (fusedrc.convert is the function)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}


def _norm_module(kind, size, dtype):
    torch.manual_seed(1)
    m = {"layer": lambda: nn.LayerNorm(size), "rms": lambda: nn.RMSNorm(size, eps=1e-6),
         "llama_rms": lambda: LlamaRMSNorm(size), "gemma_rms": lambda: GemmaRMSNorm(size)}[kind]().to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m


def _norm_args(m, kind):
    return dict(norm=kind, norm_weight=m.weight, norm_bias=getattr(m, "bias", None) if kind == "layer" else None,
                norm_eps=getattr(m, "variance_epsilon", getattr(m, "eps", None)))


def _ffn(gated, k, hidden, n, dtype, device):
    torch.manual_seed(2)
    mods = [nn.Linear(k, hidden), nn.Linear(k, hidden)] if gated else [nn.Linear(k, hidden)]
    mods.append(nn.Linear(hidden, n))
    return [m.to(device=device, dtype=dtype) for m in mods]


def _eager(norm, linears, gated, x):
    h = norm(x)
    if gated:
        g, u, d = linears
        return d(TF.silu(g(h)) * u(h))
    fc1, fc2 = linears
    return fc2(TF.gelu(fc1(h)))


def _fused(norm, kind, linears, gated, x):
    args = _norm_args(norm, kind)
    if gated:
        g, u, d = linears
        return fusedrc.functional.gated_mlp(x, g.weight, g.bias, u.weight, u.bias, d.weight, d.bias, "silu", **args)
    fc1, fc2 = linears
    return fusedrc.functional.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, "gelu", **args)


def _leaves(x, norm, linears):
    return [x, *norm.parameters(), *(p for m in linears for p in m.parameters())]


@pytest.mark.parametrize("kind", R.NORMS)
@pytest.mark.parametrize("gated", [False, True], ids=["ffn", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_matches_the_modules(kind, gated, dtype):
    norm = _norm_module(kind, 24, dtype)
    linears = _ffn(gated, 24, 40, 17, dtype, "cpu")
    x = torch.randn(3, 5, 24, dtype=dtype, requires_grad=True)
    with fusedrc.use_backend("reference"):
        y = _fused(norm, kind, linears, gated, x)
    y_ref = _eager(norm, linears, gated, x)
    assert y.dtype == dtype and y.shape == (3, 5, 17)
    assert torch.equal(y, y_ref)  # the same aten ops, in the same order
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, _leaves(x, norm, linears), g)
    want = torch.autograd.grad(y_ref, _leaves(x, norm, linears), g)
    # Hugging Face's RMSNorms compute a float64 input in float32
    tol = 1e-12 if dtype == torch.float64 and kind in ("layer", "rms") else 1e-5
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol


@pytest.mark.parametrize("kind,gated,dtype", [
    ("layer", False, torch.float32), ("rms", True, torch.float32), ("llama_rms", False, torch.float32),
    ("llama_rms", True, torch.bfloat16), ("layer", True, torch.bfloat16), ("gemma_rms", True, torch.bfloat16),
])
def test_triton_path(kind, gated, dtype):
    """The Triton FFN kernels on the norm's output (Triton's interpreter on the CPU), against the
    modules in float64: rows and features that are multiples of no block size."""
    device = backend_device("triton")
    norm = _norm_module(kind, 19, dtype).to(device)
    linears = _ffn(gated, 19, 33, 7, dtype, device)
    x = torch.randn(2, 9, 19, dtype=dtype, device=device, requires_grad=True)
    with fusedrc.use_backend("triton"), FusedOpLog() as log:
        y = _fused(norm, kind, linears, gated, x)
        g = torch.randn_like(y)
        got = torch.autograd.grad(y, _leaves(x, norm, linears), g)
    op = "gated_mlp" if gated else "fused_mlp"
    assert log.ops in ([op, op + "_backward"], [op + "_triton", op + "_backward_triton"])
    n64, l64 = copy.deepcopy(norm).double(), [copy.deepcopy(m).double() for m in linears]
    x64 = x.detach().double().requires_grad_(True)
    y64 = _eager(n64, l64, gated, x64)
    want = torch.autograd.grad(y64, _leaves(x64, n64, l64), g.double())
    assert rel_err(y, y64) <= TOL[dtype]
    for a, b in zip(got, want):
        assert rel_err(a, b) <= TOL[dtype] * 2


@pytest.mark.parametrize("kind", ["layer", "llama_rms"])
def test_keeps_only_the_norms_input(kind):
    """The op keeps x (the norm's input), not the norm's output: its bytes are those of the same
    FFN without a norm; eager keeps the norm's output and its own tensors besides."""
    norm = _norm_module(kind, 32, torch.float32)
    fc1, fc2 = _ffn(False, 32, 128, 32, torch.float32, "cpu")
    x = torch.randn(4, 16, 32, requires_grad=True)
    with SavedBytes() as fused:
        _fused(norm, kind, [fc1, fc2], False, x)
    with SavedBytes() as plain_ffn:
        fusedrc.functional.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, "gelu")
    with SavedBytes() as eager:
        _eager(norm, [fc1, fc2], False, x)
    assert fused.bytes == plain_ffn.bytes == x.numel() * 4
    assert eager.bytes > fused.bytes + x.numel() * 4 * 4  # the norm's output, the hidden layer's four


def test_output_mask_frozen_norm_and_input():
    """A frozen norm weight and an input without grad: the op returns what autograd asks for, right."""
    norm = _norm_module("layer", 16, torch.float32)
    norm.weight.requires_grad_(False)
    fc1, fc2 = _ffn(False, 16, 32, 8, torch.float32, "cpu")
    x = torch.randn(6, 16)
    _fused(norm, "layer", [fc1, fc2], False, x).sum().backward()
    got = [norm.bias.grad, fc1.weight.grad, fc2.weight.grad]
    for p in (norm.bias, fc1.weight, fc2.weight):
        p.grad = None
    _eager(norm, [fc1, fc2], False, x).sum().backward()
    assert norm.weight.grad is None
    for a, b in zip(got, [norm.bias.grad, fc1.weight.grad, fc2.weight.grad]):
        assert rel_err(a, b) <= 1e-6


def test_autocast_float32_norm_then_bf16_ffn():
    """AMP: a float32 residual stream and float32 parameters under bf16 autocast. The norm runs in
    float32 (as LayerNorm does under autocast), the FFN in bfloat16, the output is bfloat16."""
    norm = _norm_module("layer", 24, torch.float32)
    fc1, fc2 = _ffn(False, 24, 48, 24, torch.float32, "cpu")
    x = torch.randn(10, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _fused(norm, "layer", [fc1, fc2], False, x)
        y_ref = _eager(norm, [fc1, fc2], False, x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert rel_err(y, y_ref) <= 1e-2
    got = torch.autograd.grad(y.float().sum(), [x, norm.weight, fc1.weight])
    want = torch.autograd.grad(y_ref.float().sum(), [x, norm.weight, fc1.weight])
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and rel_err(a, b) <= 2e-2


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(norm="batch"), ValueError, "norm must be None or one of"),
    (dict(norm="layer", norm_weight=torch.ones(5)), ValueError, "norm_weight must have shape (8,)"),
    (dict(norm="rms", norm_bias=torch.zeros(8)), ValueError, "norm_bias: a 'rms' norm has no bias"),
    (dict(norm_weight=torch.ones(8)), ValueError, "norm_weight was given without a norm"),
    (dict(norm="layer", norm_weight=torch.ones(8, dtype=torch.float64)), TypeError, "norm_weight has dtype"),
    (dict(norm="layer", norm_eps=-1.0), ValueError, "norm_eps must be >= 0"),
    (dict(norm="layer", norm_eps="small"), TypeError, "norm_eps must be a float"),
])
def test_bad_norm_arguments(kwargs, error, words):
    fc1, fc2 = _ffn(False, 8, 16, 8, torch.float32, "cpu")
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        fusedrc.functional.fused_mlp(torch.randn(3, 8), fc1.weight, fc1.bias, fc2.weight, fc2.bias, **kwargs)
    g, u, d = _ffn(True, 8, 16, 8, torch.float32, "cpu")
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        fusedrc.functional.gated_mlp(torch.randn(3, 8), g.weight, g.bias, u.weight, u.bias, d.weight, d.bias, **kwargs)


@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(32), lambda: nn.RMSNorm(32), lambda: nn.RMSNorm(32, eps=None)],
                         ids=["LayerNorm", "RMSNorm", "RMSNorm-eps-None"])
def test_recompute_sequential_norm_ffn(make):
    """``recompute(Sequential(norm, Linear, act, Dropout(0), Linear))`` runs one fused op keeping x."""
    torch.manual_seed(0)
    block = nn.Sequential(make(), nn.Linear(32, 96), nn.GELU(), nn.Dropout(0.0), nn.Linear(96, 32))
    x = torch.randn(4, 8, 32, requires_grad=True)
    with FusedOpLog() as log:
        y = fusedrc.recompute(block, x)
        gx, *gp = torch.autograd.grad(y.sum(), [x, *block.parameters()])
    assert log.ops == ["fused_mlp", "fused_mlp_backward"]
    y_ref = block(x)
    gx_ref, *gp_ref = torch.autograd.grad(y_ref.sum(), [x, *block.parameters()])
    assert torch.equal(y, y_ref)
    for a, b in zip([gx, *gp], [gx_ref, *gp_ref]):
        assert rel_err(a, b) <= 1e-6

    class Region(nn.Module):
        def forward(self, x):
            return fusedrc.recompute(block, x)

    assert saved_bytes(Region(), (x,)) == x.numel() * 4


def test_compile_no_graph_breaks():
    """Under torch.compile (reference backend on the CPU) the op with a norm is one opaque custom op:
    no graph break, the eager results."""
    norm = _norm_module("llama_rms", 16, torch.float32)
    g, u, d = _ffn(True, 16, 32, 16, torch.float32, "cpu")

    def f(x):
        return _fused(norm, "llama_rms", [g, u, d], True, x)

    x = torch.randn(6, 16, requires_grad=True)
    explain = torch._dynamo.explain(f)(x)
    assert explain.graph_break_count == 0
    y = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    y_ref = _eager(norm, [g, u, d], True, x)
    assert rel_err(y, y_ref) <= 1e-6
    assert rel_err(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(y_ref.sum(), x)[0]) <= 1e-5


# --------------------------------------------------------------------------- convert
class GatedMLP(nn.Module):
    """Llama's MLP, as Hugging Face writes it (convert finds it by its forward)."""

    def __init__(self, size=16, hidden=40):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(size, hidden, bias=False), nn.Linear(size, hidden, bias=False)
        self.down_proj, self.act_fn = nn.Linear(hidden, size, bias=False), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PreNormLayer(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm, self.mlp = norm, GatedMLP()

    def forward(self, x):
        h = self.norm(x)
        h = self.mlp(h)
        return x + h


class ReusedNormLayer(PreNormLayer):
    """The norm's output is read again after the FFN: it must stay the norm's output."""

    def forward(self, x):
        h = self.norm(x)
        y = self.mlp(h)
        return x + y + h


def _stack(layer_cls, norm_cls, n=2):
    torch.manual_seed(0)
    model = nn.Sequential(*[layer_cls(norm_cls(16)) for _ in range(n)])
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (LlamaRMSNorm, nn.LayerNorm)):
                m.weight.add_(torch.randn_like(m.weight) * 0.2)
    return model


def _step(model, x):
    x = x.clone().requires_grad_(True)
    y = model(x)
    grads = torch.autograd.grad(y.square().sum(), [x, *model.parameters()], allow_unused=True)
    return y, [torch.zeros(()) if g is None else g for g in grads]  # an unused norm: no gradient


@pytest.mark.parametrize("layer_cls,norm_cls,fused", [
    (PreNormLayer, LlamaRMSNorm, True), (PreNormLayer, nn.LayerNorm, True),
    (PreNormLayer, GemmaRMSNorm, True), (PreNormLayer, InputScaledRMSNorm, False),
    (ReusedNormLayer, LlamaRMSNorm, False),
], ids=["llama-rms", "layernorm", "gemma-rms", "no-fused-form", "output-read-again"])
def test_convert_runs_the_norm_in_the_ffn(layer_cls, norm_cls, fused):
    """convert joins a layer's norm to the fused FFN after it where the layer's code reads the
    norm's output only there and the norm has a fused form; elsewhere the FFN alone is fused."""
    model = _stack(layer_cls, norm_cls)
    x = torch.randn(3, 5, 16)
    conv = fusedrc.convert(model)
    kinds = [u.kind for u in conv.fusedrc_plan.units if u.kind != "norm"]
    assert kinds == ["norm_gated_ffn" if fused else "gated_ffn"] * 2
    # a norm the op does not run is recomputed on its own (its output not kept): through its functional
    # form, or its own forward (an input-scaled RMSNorm)
    expected = C._NormFirst if fused else C._RecomputedNorm
    assert all(type(conv[i].norm) is expected for i in range(2))
    y_ref, g_ref = _step(model, x)
    with FusedOpLog() as log:
        y, g = _step(conv, x)
    assert log.ops == ["gated_mlp"] * 2 + ["gated_mlp_backward"] * 2
    assert rel_err(y, y_ref) <= 1e-6
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) <= 1e-5
    ratio = saved_bytes(conv, (x.requires_grad_(),)) / saved_bytes(model, (x,))
    assert ratio < (0.5 if fused and norm_cls is LlamaRMSNorm else 0.75)


def _hf_pre_norm(family):
    try:
        C.import_torchvision()  # transformers imports torchvision where it is installed
    except ImportError:
        pass
    tr = pytest.importorskip("transformers", reason="transformers is not installed (test extra)")
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 12))
    if family == "llama":
        cfg = tr.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        return tr.LlamaForCausalLM(cfg), (ids,), "norm_gated_ffn", "model.layers.0.post_attention_layernorm"
    if family == "opt":  # the norm called at two places of the layer's forward: the fused one by its line
        cfg = tr.OPTConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                           word_embed_proj_dim=32, dropout=0.0, use_cache=False)
        return tr.OPTForCausalLM(cfg), (ids,), "norm_ffn", "model.decoder.layers.0.final_layer_norm"
    if family == "t5":
        cfg = tr.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                          dropout_rate=0.0, feed_forward_proj="relu", decoder_start_token_id=0, use_cache=False)
        return tr.T5ForConditionalGeneration(cfg), (ids, None, ids[:, :6]), "norm_ffn", \
            "encoder.block.0.layer.1.layer_norm"
    cfg = tr.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, embd_pdrop=0.0, attn_pdrop=0.0,
                        resid_pdrop=0.0, use_cache=False)
    return tr.GPT2LMHeadModel(cfg), (ids,), "norm_ffn", "transformer.h.0.ln_2"


def _loss_grads(model, inputs):
    model.zero_grad()
    out = model(*inputs)
    loss = out.logits.float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "opt", "t5", "gpt2"])
def test_convert_hugging_face_pre_norm_layers(family):
    """Llama's post_attention_layernorm -> mlp, OPT's final_layer_norm -> fc1 (inlined FFN), T5's
    T5LayerFF and GPT-2's ln_2 -> mlp: every FFN unit takes its norm; the loss and every gradient
    as the original's; fewer bytes than the same units without their norms (a hook on a norm
    makes it run as itself); the norm called by hand is the norm."""
    model, inputs, kind, norm_name = _hf_pre_norm(family)
    model.train()
    conv = fusedrc.convert(model)
    units = conv.fusedrc_plan.units
    assert units and all(u.kind == kind for u in units if "ffn" in u.kind)
    norm = conv.get_submodule(norm_name)
    assert isinstance(norm, C._NormFirst)
    loss_ref, g_ref = _loss_grads(model, inputs)
    loss, g = _loss_grads(conv, inputs)
    assert torch.equal(loss, loss_ref)
    assert g.keys() == g_ref.keys()
    for n in g:
        assert rel_err(g[n], g_ref[n]) <= 1e-5, n
    fused_bytes = saved_bytes(conv, inputs)
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
             for m in conv.modules() if isinstance(m, C._NormFirst)]
    hooked_bytes = saved_bytes(conv, inputs)
    loss_hooked, _ = _loss_grads(conv, inputs)
    for h in hooks:
        h.remove()
    assert fused_bytes < hooked_bytes
    assert torch.equal(loss_hooked, loss_ref)
    x, out = seen[0]  # a hook sees the norm's output, not its input passed through
    assert not torch.equal(x, out) and torch.equal(out, norm.plain(x))
    assert torch.equal(norm(x), norm.plain(x))  # called by hand: the norm


def test_convert_norm_copies_and_units_off():
    """A deep copy of a converted model computes the same; with the FFN's unit off (policy) the norm
    runs as itself, and the bytes are the original's."""
    model = _stack(PreNormLayer, LlamaRMSNorm)
    x = torch.randn(3, 5, 16)
    conv = fusedrc.convert(model)
    twin = copy.deepcopy(conv)
    y_ref, g_ref = _step(model, x)
    for m in (conv, twin):
        y, g = _step(m, x)
        assert rel_err(y, y_ref) <= 1e-6 and all(rel_err(a, b) <= 1e-5 for a, b in zip(g, g_ref))
    assert saved_bytes(twin, (x.requires_grad_(),)) == saved_bytes(conv, (x,))
    off = fusedrc.convert(model, policy=["0.mlp"])  # the second layer's FFN not fused
    assert [u.selected for u in off.fusedrc_plan.units] == [True, False]
    y, g = _step(off, x)
    assert rel_err(y, y_ref) <= 1e-6 and all(rel_err(a, b) <= 1e-5 for a, b in zip(g, g_ref))
    with pytest.warns(UserWarning, match="match no fusable unit"):
        none = fusedrc.convert(model, policy=["nothing"])
    assert saved_bytes(none, (x,)) == saved_bytes(model, (x,))


def test_convert_norm_with_blocks_recomputed():
    """policy="blocks": the layers recomputed whole (Hugging Face's layers are blocks) with the norm
    inside the fused FFN during the forward and the rerun alike."""
    model, inputs, _, _ = _hf_pre_norm("llama")
    model.train()
    conv = fusedrc.convert(model, policy="blocks")
    assert conv.fusedrc_plan.recomputed_blocks
    loss_ref, g_ref = _loss_grads(model, inputs)
    loss, g = _loss_grads(conv, inputs)
    assert torch.equal(loss, loss_ref)
    for n in g:
        assert rel_err(g[n], g_ref[n]) <= 1e-5, n


# --------------------------------------------------------------------------- modules
@pytest.mark.parametrize("cls,norm", [(fusedrc.nn.FusedMLP, "layer"), (fusedrc.nn.GatedMLP, "rms")])
def test_modules_with_a_norm(cls, norm):
    """``FusedMLP(..., norm=...)`` / ``GatedMLP(..., norm=...)`` hold the norm as ``norm``: one fused op
    keeping x, equal to the modules composed by hand; a hook on the norm runs it as itself."""
    torch.manual_seed(0)
    m = cls(16, 40, norm=norm, norm_eps=1e-6)
    assert type(m.norm) is (nn.LayerNorm if norm == "layer" else nn.RMSNorm) and m.norm.eps == 1e-6
    assert list(m.state_dict())[0] == "norm.weight"
    x = torch.randn(2, 7, 16, requires_grad=True)

    def by_hand(x):
        h = m.norm(x)
        if cls is fusedrc.nn.FusedMLP:
            return m.fc2(TF.relu(m.fc1(h)))
        return m.down_proj(TF.silu(m.gate_proj(h)) * m.up_proj(h))

    with SavedBytes() as kept:
        y = m(x)
    assert kept.bytes == x.numel() * 4
    y_ref = by_hand(x)
    assert torch.equal(y, y_ref)
    got = torch.autograd.grad(y.sum(), [x, *m.parameters()])
    want = torch.autograd.grad(y_ref.sum(), [x, *m.parameters()])
    assert all(rel_err(a, b) <= 1e-6 for a, b in zip(got, want))
    seen = []
    m.norm.register_forward_hook(lambda mod, i, o: seen.append(o))
    assert torch.equal(m(x), y_ref) and len(seen) == 1


def test_from_modules_with_a_norm():
    norm = _norm_module("llama_rms", 16, torch.float32)
    g, u, d = _ffn(True, 16, 40, 16, torch.float32, "cpu")
    m = fusedrc.nn.GatedMLP.from_modules(g, u, d, nn.SiLU(), norm=norm)
    x = torch.randn(5, 16)
    assert m.norm is norm and torch.equal(m(x), _eager(norm, [g, u, d], True, x))
    with pytest.raises(TypeError, match="norm must be None, an nn.LayerNorm or nn.RMSNorm"):
        fusedrc.nn.GatedMLP.from_modules(g, u, d, nn.SiLU(), norm=InputScaledRMSNorm(16))
    with pytest.raises(ValueError, match="norm must normalize 16 features"):
        fusedrc.nn.GatedMLP.from_modules(g, u, d, nn.SiLU(), norm=nn.LayerNorm(8))
    with pytest.raises(ValueError, match="norm must be None, 'layer'"):
        fusedrc.nn.FusedMLP(16, 32, norm="batch")


class TracedPreNorm(nn.Module):
    """A pre-norm FFN sublayer that torch.fx traces whole: norm -> fc1 -> act -> fc2, plus the residual."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.act, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 48), nn.GELU(), nn.Dropout(0.0),
                          nn.Linear(48, 16)),
    TracedPreNorm,
], ids=["sequential", "fx"])
def test_convert_sequential_and_fx_norm_chains(make):
    """A norm right before an FFN in an nn.Sequential or an fx graph (its output read by fc1 alone) is part
    of the FFN's unit (kind norm_ffn, named by fc1): the bytes of the norm's output are not kept; outputs
    and gradients as the original's; a hook on the norm after convert runs it as itself and sees its output."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(4, 6, 16)
    conv = fusedrc.convert(model)
    units = [u for u in conv.fusedrc_plan.units if u.kind != "norm"]
    assert [u.kind for u in units] == ["norm_ffn"] and units[0].name.endswith("fc1" if make is TracedPreNorm else "2")
    y_ref, g_ref = _step(model, x)
    y, g = _step(conv, x)
    assert torch.equal(y, y_ref) and all(rel_err(a, b) <= 1e-6 for a, b in zip(g, g_ref))
    kept = saved_bytes(conv, (x.requires_grad_(),))
    norm = conv[1] if isinstance(conv, nn.Sequential) else conv.norm
    seen = []
    norm.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    assert saved_bytes(conv, (x,)) >= kept + x.numel() * 4  # the norm's output, kept for fc1 (and its stats)
    y, g = _step(conv, x)
    assert torch.equal(y, y_ref) and all(rel_err(a, b) <= 1e-6 for a, b in zip(g, g_ref))
    assert seen and not torch.equal(*seen[-1])


# --------------------------------------------------------------------------- guards (review of 2026-11-26)
class CondReassignLayer(PreNormLayer):
    """y reassigned on one branch only: still read after the FFN on the other."""

    def __init__(self, norm):
        super().__init__(norm)
        self.keep = False

    def forward(self, x):
        h = self.norm(x)
        out = self.mlp(h)
        if self.keep:
            h = x
        return out + h


class LambdaLayer(PreNormLayer):
    def forward(self, x):
        h = self.norm(x)
        out = (lambda: self.mlp(h))()
        return x + out


class GeneratorLayer(PreNormLayer):
    def forward(self, x):
        h = self.norm(x)
        out = sum(self.mlp(h) for _ in range(2))
        return x + out


class BranchNormLayer(PreNormLayer):
    """OPT's shape: the norm in a branch, the FFN right after the branch."""

    def __init__(self, norm):
        super().__init__(norm)
        self.pre = True

    def forward(self, x):
        if self.pre:
            h = self.norm(x)
        else:
            h = x
        h = self.mlp(h)
        return x + h


@pytest.mark.parametrize("layer_cls,fused", [
    (CondReassignLayer, False), (LambdaLayer, False), (GeneratorLayer, False), (BranchNormLayer, True),
])
def test_convert_source_check(layer_cls, fused):
    """The layer's code is read as a syntax tree: the norm's output read on some path after the FFN,
    or the FFN called in a lambda or a generator: the norm stays the norm. The norm in a branch whose
    next statement is the FFN (OPT's) is joined: when the branch runs, its output goes to the FFN only.
    Either way the model computes what it did, in both of the branch's ways."""
    model = _stack(layer_cls, LlamaRMSNorm)
    x = torch.randn(3, 5, 16)
    conv = fusedrc.convert(model)
    assert [u.kind for u in conv.fusedrc_plan.units if u.kind != "norm"] == ["norm_gated_ffn" if fused else "gated_ffn"] * 2
    assert any(isinstance(m, C._NormFirst) for m in conv.modules()) == fused
    for pre in (True, False):
        for m in (*model, *conv):
            m.pre = pre
        y_ref, g_ref = _step(model, x)
        y, g = _step(conv, x)
        assert rel_err(y, y_ref) <= 1e-6 and all(rel_err(a, b) <= 1e-5 for a, b in zip(g, g_ref))


def test_source_check_finds_the_norm_in_a_branch_before_the_ffn():
    """``if pre: y = self.norm(x)`` with ``z = self.mlp(y)`` right after the branch (OPT's pre-norm
    branch) is found; with an ``else`` assigning y otherwise the norm is not the only way to y."""
    src = ["def forward(self, x):\n", "    if self.pre:\n", "        x = self.norm(x)\n", "    x = self.mlp(x)\n",
           "    if not self.pre:\n", "        x = self.norm(x)\n", "    return x\n"]
    assert C._norm_call_line(src, "norm", "mlp") == 2
    assert C._norm_call_line(src, "norm", "other") is None
    nested = ["def forward(self, x):\n", "    y = self.norm(x)\n", "    z = self.act(self.fc1(y))\n",
              "    return x + z\n"]
    assert C._norm_call_line(nested, "norm", "fc1") == 1
    assert C._norm_call_line(nested[:3] + ["    return z + y\n"], "norm", "fc1") is None


def test_convert_norm_guards_after_convert(monkeypatch):
    """After convert: a mark on the FFN, a changed epsilon, the checkpoint implementation of the units
    (the benchmarks' comparison) and torch.compile of the norm called by hand all compute what the
    unconverted model does; convert's probe of a norm runs no hook."""
    model = _stack(PreNormLayer, LlamaRMSNorm)
    seen = []
    model[0].norm.register_forward_hook(lambda m, i, o: seen.append(o))
    conv = fusedrc.convert(model)
    assert not seen and [u.kind for u in conv.fusedrc_plan.units] == ["gated_ffn", "norm_gated_ffn"]
    x = torch.randn(3, 5, 16)
    for m in conv.modules():
        m._forward_hooks.clear()
    model[0].norm._forward_hooks.clear()
    conv = fusedrc.convert(model)
    fusedrc.mark(conv[0].mlp)
    y_ref, _ = _step(model, x)
    assert rel_err(_step(conv, x)[0], y_ref) <= 1e-6
    for layer in (model[1], conv[1]):
        layer.norm.variance_epsilon = 0.5
    assert rel_err(_step(conv, x)[0], _step(model, x)[0]) <= 1e-6
    C._set_impl(conv, "checkpoint")
    with FusedOpLog() as log:
        assert rel_err(_step(conv, x)[0], _step(model, x)[0]) <= 1e-6
    assert log.ops == []
    by_hand = torch.compile(lambda t: conv[1].norm(t), backend="eager")(x)
    assert torch.equal(by_hand, model[1].norm(x))


class HeliumRMSNorm(LlamaRMSNorm):
    """Helium's: the weight times the float32 normalized input, rounded once (F.rms_norm's "rms")."""

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * out).to(x.dtype)


def test_norm_kind_probe_tells_the_roundings_apart():
    """The probe runs the class's forward on a random weight in the weight's dtype: in bfloat16 a norm
    rounding once is "rms" and Llama's (rounding twice) "llama_rms", whatever the module's own weight
    (a fresh all-ones weight rounds the same either way); Gemma's (1 + weight, rounded once) is
    "gemma_rms"; one that scales x before it normalizes has no fused form."""
    from fusedrc._patterns import norm_kind

    for cls, kinds in ((LlamaRMSNorm, ("llama_rms", "llama_rms")), (HeliumRMSNorm, ("llama_rms", "rms")),
                       (GemmaRMSNorm, ("gemma_rms", "gemma_rms")), (InputScaledRMSNorm, (None, None))):
        m = cls(16)
        got = [None if k is None else k[0] for k in (norm_kind(m), norm_kind(m.bfloat16()))]
        assert got == list(kinds), cls.__name__
    model = _stack(PreNormLayer, HeliumRMSNorm).bfloat16()
    conv = fusedrc.convert(model)
    assert [u.kind for u in conv.fusedrc_plan.units] == ["norm_gated_ffn"] * 2
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    with fusedrc.use_backend("reference"):
        assert torch.equal(conv(x), model(x))


def test_rmsnorm_default_eps_in_bfloat16():
    """nn.RMSNorm(eps=None) uses the epsilon of the dtype it computes in, float32's for 16-bit x."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.RMSNorm(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).bfloat16()
    x = torch.randn(4, 16, dtype=torch.bfloat16) * 1e-2  # small rows: eps matters
    with FusedOpLog() as log:
        y = fusedrc.recompute(block, x.requires_grad_())
    assert log.ops == ["fused_mlp"] and torch.equal(y, block(x))


def test_float64_input_under_autocast_is_refused_as_eager_refuses_it():
    """Autocast never casts float64: a float64 norm output meets bfloat16 weights, an error in eager too."""
    fc1, fc2 = _ffn(False, 8, 16, 8, torch.float32, "cpu")
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="w1 has dtype torch.bfloat16"):
        fusedrc.functional.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, norm="rms",
                                     norm_weight=torch.ones(8, dtype=torch.float64))


def _vit(family):
    try:
        C.import_torchvision()
    except ImportError:
        pass
    torch.manual_seed(0)
    if family == "hf_vit":
        tr = pytest.importorskip("transformers", reason="transformers is not installed (test extra)")
        cfg = tr.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           image_size=32, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return tr.ViTForImageClassification(cfg), torch.randn(2, 3, 32, 32), "vit.layers.0.layernorm_after"
    timm = pytest.importorskip("timm", reason="timm is not installed (test extra)")
    return timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, depth=2), \
        torch.randn(2, 3, 32, 32), "blocks.0.norm2"


@pytest.mark.parametrize("family", ["hf_vit", "timm_vit"])
def test_convert_vision_transformers(family):
    """Hugging Face's ViT (``layernorm_after`` then an MLP module the fx pass rewrote) and timm's
    (``self.mlp(self.norm2(x))`` in one expression; timm's LayerNorm): the norm joins the FFN's unit
    through the MLP's graph, whose input feeds its FFN alone. Outputs and gradients as the original's,
    fewer bytes than without the norms (a hook on each makes it run as itself)."""
    model, x, norm_name = _vit(family)
    model.train()
    conv = fusedrc.convert(model)
    assert {u.kind for u in conv.fusedrc_plan.units} == {"norm_ffn", "norm"}  # the attention's norms: "norm"
    assert isinstance(conv.get_submodule(norm_name), C._NormFirst)

    def step(m):
        y = m(x)
        y = getattr(y, "logits", y)
        return y, torch.autograd.grad(y.square().sum(), list(m.parameters()))

    y_ref, g_ref = step(model)
    y, g = step(conv)
    assert torch.equal(y, y_ref) and all(rel_err(a, b) <= 1e-5 for a, b in zip(g, g_ref))
    fused = saved_bytes(conv, (x,))
    hooks = [m.register_forward_hook(lambda *a: None) for m in conv.modules() if isinstance(m, C._NormFirst)]
    assert saved_bytes(conv, (x,)) > fused
    assert torch.equal(step(conv)[0], y_ref)
    for h in hooks:
        h.remove()
