"""LoRA adapters on a gated FFN's projections: the low-rank terms inside the dual kernels' tiles (Triton's
interpreter on the CPU) against the float64 reference, ``functional.gated_mlp``'s adapters against their
composition, and ``fusedrc.convert`` on a PEFT-wrapped Llama (``get_peft_model``, all-linear LoRA).
"""
import copy

import pytest
import torch
import torch.nn.functional as TF

import fusedrc
from fusedrc import reference as R
from _utils import SavedBytes, backend_device, rel_err

triton = pytest.importorskip("triton")
from fusedrc.kernels import gated_mlp  # noqa: E402
from test_kernels_dense import TOL, _check, _d, _near_zero_inputs, _rand  # noqa: E402
from test_kernels_gated import NAMES, _inputs  # noqa: E402

LORA_NAMES = ["d_lora_a", "d_lora_gate", "d_lora_up", "d_lora_down_a", "d_lora_down_b"]


def _terms(K, H, N, rg, ru, rd, dtype, device):
    """Op-form terms of separate gate (rank rg) and up (rank ru) adapters, and a down adapter of rank rd."""
    a = _rand(rg + ru, K, dtype=dtype, device=device, scale=K ** -0.5)
    bg, bu = _rand(H, rg, dtype=dtype, device=device), _rand(H, ru, dtype=dtype, device=device)
    zg, zu = torch.zeros(H, ru, dtype=dtype, device=device), torch.zeros(H, rg, dtype=dtype, device=device)
    return R.GatedLoRA(a, torch.cat([bg, zg], 1), torch.cat([zu, bu], 1),
                       _rand(rd, H, dtype=dtype, device=device, scale=H ** -0.5), _rand(N, rd, dtype=dtype, device=device))


def _composition(x, wg, bg, wu, bu, wd, bd, act, lora):
    t = x @ lora.a.t()
    p = R.gated_product(TF.linear(x, wg, bg) + t @ lora.gate.t(), TF.linear(x, wu, bu) + t @ lora.up.t(), act)
    return TF.linear(p, wd, bd) + (p @ lora.down_a.t()) @ lora.down_b.t()


def test_reference_is_the_composition():
    """The reference's forward and its 12 gradients are autograd's on the written-out composition (float64)."""
    x, wg, bg, wu, bu, wd, bd, g = (_d(t) for t in _inputs(13, 9, 20, 7, torch.float64, "cpu"))
    lora = R.GatedLoRA(*(_d(t) for t in _terms(9, 20, 7, 3, 2, 4, torch.float64, "cpu")[:5]))
    leaves = [t.clone().requires_grad_() for t in (x, wg, bg, wu, bu, wd, bd, *lora[:5])]
    want = _composition(*leaves[:7], "silu", R.GatedLoRA(*leaves[7:]))
    grads = torch.autograd.grad(want, leaves, g)
    out = R.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, "silu", lora=lora)
    got = R.gated_mlp_backward(x, wg, bg, wu, bu, wd, bd, g, "silu", lora=lora)
    assert rel_err(out, want) < 1e-12
    for name, a, b in zip(NAMES[1:] + LORA_NAMES, got, grads):
        assert rel_err(a, b) < 1e-12, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_lora_kernels(dtype, act, device):
    """Several tiles in M and H, a ragged K loop and ranks ragged against BLOCK_K (gate 5 + up 3); the forward,
    the seven FFN gradients and the five low-rank terms' against float64."""
    M, K, H, N = 37, 33, 50, 20
    x, wg, bg, wu, bu, wd, bd, g = _inputs(M, K, H, N, dtype, device)
    lora = _terms(K, H, N, 5, 3, 4, dtype, device)
    out = gated_mlp.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, act, lora=lora)
    grads = gated_mlp.gated_mlp_backward(x, wg, bg, wu, bu, wd, bd, g, act, lora=lora)
    ref = [_d(t) for t in (x, wg, bg, wu, bu, wd, bd)]
    ref_lora = R.GatedLoRA(*(_d(t) for t in lora[:5]))
    out_ref = R.gated_mlp_forward(*ref, act, lora=ref_lora)
    grads_ref = R.gated_mlp_backward(*ref, _d(g), act, lora=ref_lora)
    _check([out, *grads], [out_ref, *grads_ref], dtype, NAMES + LORA_NAMES)
    # the low-rank terms change the result: a kernel that dropped them fails above
    plain = gated_mlp.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, act)
    assert rel_err(plain, out_ref) > 10 * TOL[dtype]


def test_lora_recompute_matches_forward_bit_for_bit(device):
    """With the low-rank terms in the tiles the backward kernel's product equals the forward's bit for bit, on
    data whose ReLU gate sits on its kink."""
    M, K, H = 40, 100, 36
    x, wg, bg = _near_zero_inputs(M, K, H, torch.float32, device)
    wu = _rand(H, K, dtype=torch.float32, device=device, scale=K ** -0.5)
    lora = _terms(K, H, 8, 4, 4, 1, torch.float32, device)
    t = x @ lora.a.t()
    low_rank = (t, 0.05 * lora.gate, lora.up)  # small: the gate stays near its kink
    ones = torch.ones(M, H, device=device)
    a = gated_mlp.gated_act(x, wg, wu, bg, None, "relu", lora=low_rank)
    _, ghu, a_bwd, _, _ = gated_mlp.gated_act_grad(x, wg, wu, bg, None, ones, "relu", lora=low_rank)
    assert torch.equal(a_bwd, a)
    assert 0.2 < (ghu != 0).float().mean() < 0.8  # the data really sits on the kink
    assert not torch.equal(a, gated_mlp.gated_act(x, wg, wu, bg, None, "relu"))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_frozen_base_wants_the_adapters_alone(backend):
    """LoRA training: base weights frozen, x wanting no gradient (a first layer) or one. The masked gradients are
    None; with nothing of the gate and up wanted but the down adapter, that adapter's gradients still come."""
    impl = gated_mlp if backend == "triton" else R
    M, K, H, N = 21, 12, 24, 10
    x, wg, bg, wu, bu, wd, bd, g = _inputs(M, K, H, N, torch.float32, "cpu")
    lora = _terms(K, H, N, 3, 3, 2, torch.float32, "cpu")
    full = R.gated_mlp_backward(*(_d(t) for t in (x, wg, bg, wu, bu, wd, bd)), _d(g), "silu",
                                lora=R.GatedLoRA(*(_d(t) for t in lora[:5])))
    for mask in ([True] + [False] * 6 + [True] * 5, [False] * 7 + [True] * 5, [False] * 10 + [True] * 2):
        got = impl.gated_mlp_backward(x, wg, bg, wu, bu, wd, bd, g, "silu", output_mask=mask, lora=lora)
        for name, m, a, b in zip(NAMES[1:] + LORA_NAMES, mask, got, full):
            if not m:
                assert a is None, name
            else:
                assert rel_err(a, b) < TOL[torch.float32], name


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_lora_dropout(backend):
    """Each adapter's dropout on its own input (gate's and up's on x, the down's on the product), its mask a function
    of its seed: the backend's (the Triton kernels' Philox, ``philox_keep``; the reference's Bernoulli sampler); the
    forward and all 12 gradients against the composition with those masks, in float64."""
    impl = gated_mlp if backend == "triton" else R
    M, K, H, N, rg, ru, rd = 19, 24, 40, 12, 3, 5, 2
    x, wg, bg, wu, bu, wd, bd, g = _inputs(M, K, H, N, torch.float32, "cpu")
    terms = _terms(K, H, N, rg, ru, rd, torch.float32, "cpu")[:5]
    seed, ps = torch.tensor([11, 22, 33]), (0.3, 0.5, 0.25)
    lora = R.GatedLoRA(*terms, ranks=(rg, ru), dropout=ps, seed=seed)

    def factor(i, rows, cols):
        if backend == "triton":
            return R.philox_keep(int(seed[i]), rows, cols, ps[i]).double() / (1 - ps[i])
        return R.dropout_factor(seed[i:i + 1], (rows, cols), ps[i], torch.empty(0)).double()

    masks = [factor(0, M, K), factor(1, M, K), factor(2, M, H)]
    assert not torch.equal(masks[0], masks[1])  # each adapter draws its own
    leaves = [_d(t).requires_grad_() for t in (x, wg, bg, wu, bu, wd, bd, *terms)]
    xx, wgg, bgg, wuu, buu, wdd, bdd, a, lg, lu, da, db = leaves
    t = torch.cat([(xx * masks[0]) @ a[:rg].t(), (xx * masks[1]) @ a[rg:].t()], 1)
    p = R.gated_product(TF.linear(xx, wgg, bgg) + t @ lg.t(), TF.linear(xx, wuu, buu) + t @ lu.t(), "silu")
    want = TF.linear(p, wdd, bdd) + ((p * masks[2]) @ da.t()) @ db.t()
    expected = torch.autograd.grad(want, leaves, _d(g))
    out = impl.gated_mlp_forward(x, wg, bg, wu, bu, wd, bd, "silu", lora=lora)
    got = impl.gated_mlp_backward(x, wg, bg, wu, bu, wd, bd, g, "silu", lora=lora)
    _check([out, *got], [want.detach(), *expected], torch.float32, NAMES + LORA_NAMES)


def _adapter(r, inp, out, scaling, dtype=torch.float32, device="cpu"):
    return (torch.randn(r, inp, dtype=dtype, device=device) * inp ** -0.5).requires_grad_(), \
        torch.randn(out, r, dtype=dtype, device=device).requires_grad_(), scaling


def _peft_mlp(x, gate, up, down, lg, lu, ld, norm_weight=None):
    """What PEFT's LoRA layers compute around a Llama MLP (adapters in their own dtype, the input cast to it)."""
    if norm_weight is not None:
        x = TF.rms_norm(x, x.shape[-1:], norm_weight, 1e-6)

    def proj(z, w, adapter):
        out = TF.linear(z, w)
        if adapter is None:
            return out
        a, b, s = adapter
        return (out + TF.linear(TF.linear(z.to(a.dtype), a), b) * s).to(out.dtype)

    return proj(TF.silu(proj(x, gate, lg)) * proj(x, up, lu), down, ld)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_functional_adapters(backend):
    """gated_mlp's lora_gate/lora_up/lora_down against PEFT's computation: the output and every gradient (base
    weights, adapters, the norm's weight, x), with the RMSNorm inside the op; one adapter shared by gate and up
    (Phi-3's joint projection, its A one tensor); only the gate adapted. Tokens beyond x keep no bytes."""
    dev = backend_device(backend)
    torch.manual_seed(0)
    K, H = 16, 40
    gate, up, down = (torch.randn(o, i, device=dev) * i ** -0.5 for o, i in ((H, K), (H, K), (K, H)))
    nw = (1 + 0.1 * torch.randn(K, device=dev)).requires_grad_()
    shared = _adapter(4, K, H, 0.5, device=dev)
    cases = {
        "separate": (_adapter(4, K, H, 2.0, device=dev), _adapter(3, K, H, 0.5, device=dev),
                     _adapter(2, H, K, 1.0, device=dev)),
        "shared_a": (shared, (shared[0], torch.randn(H, 4, device=dev).requires_grad_(), 0.5), None),
        "gate_only": (_adapter(2, K, H, 1.0, device=dev), None, None),
    }
    for name, (lg, lu, ld) in cases.items():
        leaves = [nw, *(t for ad in (lg, lu, ld) if ad is not None for t in ad[:2])]
        leaves = list({id(t): t for t in leaves}.values())
        saved = []
        for tokens in (6, 14):
            x = torch.randn(2, tokens, K, device=dev, requires_grad=True)
            want = _peft_mlp(x, gate, up, down, lg, lu, ld, nw)
            gout = torch.randn_like(want)
            expected = torch.autograd.grad(want, [x, *leaves], gout)
            with fusedrc.use_backend(backend), SavedBytes() as kept:
                y = fusedrc.functional.gated_mlp(x, gate, None, up, None, down, None, "silu", norm="rms",
                                                 norm_weight=nw, norm_eps=1e-6, lora_gate=lg, lora_up=lu,
                                                 lora_down=ld)
                got = torch.autograd.grad(y, [x, *leaves], gout)
            assert rel_err(y, want) < 1e-5, name
            for i, (a, b) in enumerate(zip(got, expected)):
                assert rel_err(a, b) < 1e-5, (name, i)
            saved.append(kept.bytes)
        # x is what grows with the tokens (the weights here are plain tensors, kept as they are)
        assert saved[1] - saved[0] == 2 * (14 - 6) * K * 4, (name, saved)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_functional_adapter_dropout(backend):
    """An adapter's dropout_p through gated_mlp: p = 1 drops every term (the base MLP's output, zero gradients for the
    adapters, through the masks regenerated in backward); p = 0.5 keeps no more bytes than p = 0 (seeds only)."""
    dev = backend_device(backend)
    torch.manual_seed(0)
    K, H = 16, 40
    gate, up, down = (torch.randn(o, i, device=dev) * i ** -0.5 for o, i in ((H, K), (H, K), (K, H)))
    x = torch.randn(3, 7, K, device=dev, requires_grad=True)
    adapters = [_adapter(4, K, H, 2.0, device=dev), _adapter(3, K, H, 0.5, device=dev), _adapter(2, H, K, 1.0, device=dev)]
    base = _peft_mlp(x, gate, up, down, None, None, None)
    gx = torch.autograd.grad(base.sum(), x)[0]
    kept = []
    for p in (1.0, 0.5, 0.0):
        with fusedrc.use_backend(backend), SavedBytes() as saved:
            y = fusedrc.functional.gated_mlp(x, gate, None, up, None, down, None, lora_gate=(*adapters[0], p),
                                             lora_up=(*adapters[1], p), lora_down=(*adapters[2], p))
        kept.append(saved.bytes)
        grads = torch.autograd.grad(y.sum(), [x, *(t for ad in adapters for t in ad[:2])])
        if p == 1.0:
            assert rel_err(y, base) < 1e-6 and rel_err(grads[0], gx) < 1e-5
            assert all(float(g.abs().max()) == 0 for g in grads[1:])
        else:
            assert rel_err(y, base) > 1e-3 and all(float(g.abs().max()) > 0 for g in grads[1:])
    assert kept[1] == kept[2] + 3 * 8, kept


def test_functional_adapters_in_another_dtype():
    """float32 adapters on float16 weights (PEFT's default, autocast_adapter_dtype): the terms run in the weights'
    dtype, the adapters' gradients come back in float32."""
    torch.manual_seed(0)
    K, H = 16, 32
    x = torch.randn(5, K).half()
    gate, up, down = (torch.randn(o, i).half() * i ** -0.5 for o, i in ((H, K), (H, K), (K, H)))
    lg, ld = _adapter(4, K, H, 1.0), _adapter(2, H, K, 1.0)
    with fusedrc.use_backend("triton"):
        y = fusedrc.functional.gated_mlp(x, gate, None, up, None, down, None, lora_gate=lg, lora_down=ld)
    y.float().sum().backward()
    want = _peft_mlp(x.double(), gate.double(), up.double(), down.double(),
                     (lg[0].double(), lg[1].double(), 1.0), None, (ld[0].double(), ld[1].double(), 1.0))
    assert y.dtype == torch.float16 and rel_err(y, want) < TOL[torch.float16]
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in (*lg[:2], *ld[:2]))


def test_bad_adapters_name_the_argument():
    x, w, wd = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
    f = fusedrc.functional.gated_mlp
    with pytest.raises(ValueError, match="lora_gate.*shape"):
        f(x, w, None, w, None, wd, None, lora_gate=(torch.randn(2, 9), torch.randn(16, 2), 1.0))
    with pytest.raises(ValueError, match="lora_down.*shape"):
        f(x, w, None, w, None, wd, None, lora_down=(torch.randn(2, 16), torch.randn(8, 3), 1.0))
    with pytest.raises(TypeError, match="lora_up.*scaling"):
        f(x, w, None, w, None, wd, None, lora_up=(torch.randn(2, 8), torch.randn(16, 2), "1"))
    with pytest.raises(TypeError, match="lora_up"):
        f(x, w, None, w, None, wd, None, lora_up=torch.randn(2, 8))


# --------------------------------------------------------------------------- convert on PEFT models
def _peft():
    from test_convert import _transformers

    tr = _transformers()
    return tr, pytest.importorskip("peft", reason="peft is not installed (test extra)")


def _peft_llama(tr, peft, family="Llama", **lora_kw):
    torch.manual_seed(0)
    cfg = getattr(tr, f"{family}Config")(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2)
    model = peft.get_peft_model(getattr(tr, f"{family}ForCausalLM")(cfg), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", **lora_kw))
    for n, p in model.named_parameters():
        if "lora_B" in n:  # PEFT starts B at zero: the adapters' terms would vanish
            torch.nn.init.normal_(p, std=0.2)
    return model


def _step(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(a, b, ids):
    (la, ga), (lb, gb) = _step(a, ids), _step(b, ids)
    assert rel_err(lb, la) < 1e-5
    assert ga.keys() == gb.keys() and any("lora_A" in n for n in ga)
    for n in ga:
        assert rel_err(gb[n], ga[n]) < 1e-4, n


class _Spy:
    """Records the adapters each fused gated_mlp call got."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = fusedrc.functional.gated_mlp

        self.dropout = []

        def spy(*args, **kwargs):
            adapters = [kwargs.get(k) for k in ("lora_gate", "lora_up", "lora_down")]
            self.calls.append(tuple(a is not None for a in adapters))
            self.dropout.append(tuple(a[3] if a is not None and len(a) > 3 else 0.0 for a in adapters))
            return real(*args, **kwargs)

        monkeypatch.setattr(fusedrc.functional, "gated_mlp", spy)


@pytest.mark.parametrize("family, backend", [("Llama", "triton"), ("Llama", "reference"), ("Phi3", "triton")])
def test_convert_peft_llama(family, backend, monkeypatch):
    """An all-linear LoRA Llama from get_peft_model: its MLPs fused with their adapters (and the RMSNorm before
    them), loss and every trained gradient (the adapters') as the PEFT model's, fewer bytes kept. Phi-3's joint
    gate_up_proj: one adapter, its A shared by the gate's and the up's terms."""
    tr, peft = _peft()
    model = _peft_llama(tr, peft, family)
    conv = fusedrc.convert(model)
    mlps = [u.name for u in conv.fusedrc_plan.units if u.selected and u.kind in ("gated_ffn", "norm_gated_ffn")]
    assert [n.rsplit(".", 3)[-3:] for n in mlps] == [["layers", str(i), "mlp"] for i in range(2)], mlps
    ids = torch.randint(0, 64, (2, 12))
    spy = _Spy(monkeypatch)
    with fusedrc.use_backend(backend):
        _assert_same_step(model, conv, ids)
    assert spy.calls == [(True, True, True)] * 2
    from fusedrc.convert import _set_impl, saved_bytes
    kept = saved_bytes(conv, (ids,))
    assert kept < 0.6 * saved_bytes(model, (ids,))
    # no more than torch.utils.checkpoint on the same units: the adapters' terms are no kept copies
    assert kept <= saved_bytes(_set_impl(copy.deepcopy(conv), "checkpoint"), (ids,))


def test_convert_peft_adapter_states(monkeypatch):
    """The adapters as PEFT's forward reads them at each call: disabled (the base alone, fused), merged (the base
    weight holds them: fused), two adapters active (their terms stacked along the rank), DoRA (the LoRA layers'
    own forward: not fused), a LoRA dropout (fused with its p in training, 0 in eval). Each step equals the PEFT
    model's, where the masks allow."""
    tr, peft = _peft()
    model = _peft_llama(tr, peft)
    conv = fusedrc.convert(model, inplace=False)
    ids = torch.randint(0, 64, (2, 12))
    spy = _Spy(monkeypatch)
    with fusedrc.use_backend("reference"):
        with model.disable_adapter(), conv.disable_adapter():
            assert rel_err(conv(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-5
        assert spy.calls == [(False, False, False)] * 2
        spy.calls.clear()
        second = peft.LoraConfig(r=2, target_modules="all-linear")
        for m in (model, conv):
            m.add_adapter("second", second)
            m.base_model.set_adapter(["default", "second"])
        for n, p in model.named_parameters():
            if "lora_B.second" in n:
                torch.nn.init.normal_(p, std=0.2)
        conv.load_state_dict(model.state_dict())
        _assert_same_step(model, conv, ids)
        assert spy.calls == [(True, True, True)] * 2
        spy.calls.clear()
        for m in (model, conv):
            m.base_model.set_adapter("default")
            m.merge_adapter()
        assert rel_err(conv(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-5
        assert spy.calls == [(False, False, False)] * 2
        spy.calls.clear()
        for m in (model, conv):
            m.unmerge_adapter()

        spy.calls.clear()
        model = _peft_llama(tr, peft, use_dora=True)
        conv = fusedrc.convert(model, inplace=False)
        _assert_same_step(model, conv, ids)
        assert spy.calls == []

        model = _peft_llama(tr, peft, lora_dropout=0.1)
        conv = fusedrc.convert(model, inplace=False)
        spy.calls.clear(), spy.dropout.clear()
        (la, ga), (lb, gb) = _step(model, ids), _step(conv, ids)  # masks of their own: close, not equal
        assert ga.keys() == gb.keys() and abs(float(lb) - float(la)) < 0.1 * float(la)
        assert spy.calls == [(True, True, True)] * 2 and spy.dropout == [(0.1, 0.1, 0.1)] * 2
        spy.calls.clear(), spy.dropout.clear()
        model.eval(), conv.eval()  # an eval-mode dropout does nothing
        assert rel_err(conv(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-5
        assert spy.calls == [(True, True, True)] * 2 and spy.dropout == [(0.0, 0.0, 0.0)] * 2


def test_convert_then_get_peft_model(monkeypatch):
    """LoRA layers put in a converted model's place (get_peft_model after convert) are fused with their
    adapters."""
    tr, peft = _peft()
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    base = tr.LlamaForCausalLM(cfg)
    config = peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(copy.deepcopy(base), config)
    conv = peft.get_peft_model(fusedrc.convert(base), config)
    conv.load_state_dict(model.state_dict())
    for m in (model, conv):
        for n, p in m.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(len(n)), std=0.2)
    spy = _Spy(monkeypatch)
    ids = torch.randint(0, 64, (2, 12))
    with fusedrc.use_backend("reference"):
        _assert_same_step(model, conv, ids)
    assert spy.calls == [(True, True, True)] * 2


def test_compile_with_adapters():
    """torch.compile over the op with adapters on all three projections (reference backend on the CPU, adapters'
    dropout on: its seeds drawn in the graph): one graph; with p = 0 eager's results, the adapters' gradients
    included (the gate's and up's A gradients distinct tensors: a custom op's outputs may not alias). The same
    under a dispatch mode (the ops through the dispatcher: FlopCounterMode), on both backends."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    K, H = 8, 24
    gate, up, down = (torch.randn(o, i) * i ** -0.5 for o, i in ((H, K), (H, K), (K, H)))
    lg, lu, ld = _adapter(4, K, H, 2.0), _adapter(2, K, H, 0.5), _adapter(2, H, K, 1.0)
    leaves = [t for ad in (lg, lu, ld) for t in ad[:2]]
    x = torch.randn(2, 5, K, requires_grad=True)

    def f(x, p):
        return fusedrc.functional.gated_mlp(x, gate, None, up, None, down, None, lora_gate=(*lg, p),
                                            lora_up=(*lu, p), lora_down=(*ld, p)).square().sum()

    with fusedrc.use_backend("reference"):
        explain = torch._dynamo.explain(f)(x, 0.25)
        assert explain.graph_break_count == 0 and explain.graph_count == 1
        torch._dynamo.reset()
        y = torch.compile(f, backend="aot_eager")(x, 0.0)
        grads = torch.autograd.grad(y, [x, *leaves])
        ye = f(x, 0.0)
        want = torch.autograd.grad(ye, [x, *leaves])
    assert rel_err(y, ye) < 1e-6 and all(rel_err(a, b) < 1e-6 for a, b in zip(grads, want))
    for backend in ("reference", "triton"):
        with fusedrc.use_backend(backend), FlopCounterMode(display=False):
            got = torch.autograd.grad(f(x, 0.0), [x, *leaves])
        assert all(rel_err(a, b) < 1e-5 for a, b in zip(got, want)), backend


def test_convert_peft_t5_gated(monkeypatch):
    """T5 v1.1's gated FFN (T5DenseGatedActDense: wi_0, wi_1, wo) under PEFT's all-linear LoRA: its four FFNs fused
    with their adapters, the loss and every adapter gradient equal to the PEFT model's."""
    tr, peft = _peft()
    torch.manual_seed(0)
    cfg = tr.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0)
    model = peft.get_peft_model(tr.T5ForConditionalGeneration(cfg), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.2)
    conv = fusedrc.convert(model)
    assert sum(u.kind.endswith("gated_ffn") for u in conv.fusedrc_plan.units if u.selected) == 4
    spy = _Spy(monkeypatch)
    ids = torch.randint(0, 64, (2, 10))

    def step(m):
        m.zero_grad()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    with fusedrc.use_backend("reference"):
        (la, ga), (lb, gb) = step(model), step(conv)
    assert rel_err(lb, la) < 1e-5 and ga.keys() == gb.keys() and any("wi_0.lora_A" in n for n in ga)
    assert all(rel_err(gb[n], ga[n]) < 1e-4 for n in ga)
    assert spy.calls == [(True, True, True)] * 4
