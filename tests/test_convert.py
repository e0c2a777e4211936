"""fusedrc.convert on real models (torchvision ResNet-18/50, Hugging Face OPT and T5) and plain ones.

Tolerance: on the CPU the reference backend computes the fused ops with the same
aten ops as the modules, in a different order inside conv+BN (batch statistics
from the recomputed conv), so outputs, gradients and BatchNorm running
statistics are compared with a relative error (norm of the difference over the
norm of the reference) of at most 1e-4 in float32; transformer FFNs are bitwise
equal in practice, still held to the same bound.
"""
import collections
import copy
import functools
import math
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import fusedrc
from fusedrc.convert import _Frozen, _import_torchvision, _set_impl, saved_bytes
from fusedrc.recompute import _is_marked

from _utils import (FusedOpLog, GemmCounter, SavedBytes, backend_device, fused_without_norms, norm_units, rel_err,
                    replicate_on_cpu)

TOL = 1e-4


def _resnet(name):
    try:
        _import_torchvision()
    except ImportError:
        pytest.skip("torchvision is not installed (test extra)")
    from torchvision.models import resnet

    return getattr(resnet, name)(num_classes=10)


def _transformers():
    _import_torchvision_quiet()
    return pytest.importorskip("transformers", reason="transformers is not installed (test extra)")


def _import_torchvision_quiet():
    # transformers imports torchvision when it is installed; a CUDA-only wheel would break that import
    try:
        _import_torchvision()
    except ImportError:
        pass


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_close_models(a, b, tol=TOL):
    ga, gb = _grads(a), _grads(b)
    assert ga.keys() == gb.keys() and ga
    for n in ga:  # an absolute floor for gradients that are zero in theory (a conv bias before BN)
        assert (gb[n] - ga[n]).double().norm() <= tol * ga[n].double().norm() + 1e-6, n
    for (n, x), (_, y) in zip(a.named_buffers(), b.named_buffers()):
        if x.is_floating_point():
            assert rel_err(y, x) <= tol, n
        else:
            assert torch.equal(x, y), n


def _assert_same_step(ref, conv, x, loss=lambda y: y.square().sum()):
    """One forward + backward of both models on ``x``: outputs, gradients and buffers match.
    Returns the two inputs (their gradients are there to compare)."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), conv(xb)
    assert rel_err(yb, ya) <= TOL
    loss(ya).backward()
    loss(yb).backward()
    _assert_close_models(ref, conv)
    return xa, xb


def _copy_forward_ops(model, x):
    """The fusedrc ops of a forward on ``x``, run on a copy of ``model`` (a training forward updates the running
    statistics)."""
    ops = []
    with FusedOpLog(ops):
        copy.deepcopy(model)(x)
    return ops


def _checkpoint_bytes(converted, example):
    """Saved bytes with torch.utils.checkpoint on the very units that convert fused."""
    ck = _set_impl(copy.deepcopy(converted), "checkpoint")
    return saved_bytes(ck, example)


# --------------------------------------------------------------------------- torchvision ResNet
@pytest.mark.parametrize("name, ratio", [("resnet18", 0.59), ("resnet50", 0.56), ("resnext50_32x4d", 0.55)])
def test_resnet_forward_backward_bytes(name, ratio):
    # ResNeXt's grouped 3x3 convs (groups=32) are fused units too (keeping x only: cuDNN's grouped conv, or
    # the per-group GEMM on a GPU where a group has a multiple of 16 channels);
    # so are the downsample branches' Conv-BN (no activation: kind "conv_bn")
    torch.manual_seed(0)
    model = _resnet(name).train()
    x = torch.randn(2, 3, 64, 64)
    conv = fusedrc.convert(model, example_inputs=(x,))
    assert type(conv).__name__ == "FusedResNet"
    plan = conv.fusedrc_plan
    n_blocks = 8 if name == "resnet18" else 16
    per_block = 2 if name == "resnet18" else 3
    downsamples = 3 if name == "resnet18" else 4
    assert len(plan.fused) == 1 + n_blocks * per_block + downsamples and not plan.skipped
    assert sorted(u.name for u in plan.units if u.kind == "conv_bn") == [
        f"layer{i}.0.downsample.0" for i in range(5 - downsamples, 5)]
    # same keys; the original state_dict loads
    assert list(conv.state_dict()) == list(model.state_dict())
    conv.load_state_dict(model.state_dict())
    # bytes kept: no more than torch.utils.checkpoint on the same units (conv+BN keeps 2 floats a channel more)
    assert plan.final_bytes / plan.baseline_bytes <= ratio
    channels = sum(m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d))
    assert plan.final_bytes <= _checkpoint_bytes(conv, (x,)) + 8 * channels
    assert plan.baseline_bytes == saved_bytes(model, (x,))
    # forward, backward and BatchNorm statistics match the original's
    xa, xb = _assert_same_step(model, conv, x)
    assert rel_err(xb.grad, xa.grad) <= TOL
    model.eval(), conv.eval()
    with torch.no_grad():
        assert rel_err(conv(x), model(x)) <= TOL


def test_resnet18_training_steps_match():
    torch.manual_seed(0)
    model = _resnet("resnet18").train()
    conv = fusedrc.convert(model)
    xs = [torch.randn(4, 3, 32, 32) for _ in range(3)]
    ys = [torch.randint(0, 10, (4,)) for _ in range(3)]
    losses = []
    for m in (model, conv):
        opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)
        out = []
        for x, y in zip(xs, ys):
            loss = nn.functional.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        losses.append(out)
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    # the weights after the steps: float32 rounding differences (1e-7 a step) grow through
    # BatchNorm over 4-sample batches (layer4 is 1x1 at 32 px) and momentum, hence 5e-3 here;
    # one step's gradients match to 1e-4 (test_resnet_forward_backward_bytes)
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    assert rel_err(flat(conv), flat(model)) <= 5e-3


def test_resnet_inplace_shares_tensors_and_blocks_policy():
    torch.manual_seed(0)
    model = _resnet("resnet18").train()
    params = {n: p for n, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    conv = fusedrc.convert(model, inplace=True, policy="blocks")
    for n, p in conv.named_parameters():
        assert p is params[n]
    plan = conv.fusedrc_plan
    assert len(plan.recomputed_blocks) == 8
    from fusedrc.recompute import _is_marked

    assert _is_marked(conv.layer1[0])
    x = torch.randn(2, 3, 32, 32)
    _assert_same_step(ref, conv, x, loss=torch.sum)
    # whole blocks keep less than fused units alone
    assert saved_bytes(conv, (x,)) < saved_bytes(fusedrc.convert(ref), (x,))


def test_resnet50_memory_budget():
    torch.manual_seed(0)
    model = _resnet("resnet50").train()
    x = torch.randn(2, 3, 64, 64)
    conv = fusedrc.convert(model, memory_budget=0.35, example_inputs=(x,))
    plan = conv.fusedrc_plan
    assert plan.final_bytes <= 0.35 * plan.baseline_bytes
    assert saved_bytes(conv, (x,)) == plan.final_bytes
    assert plan.recomputed_blocks  # units alone reach about 0.62: blocks were needed
    _assert_same_step(model, conv, x)
    # an unreachable budget names the smallest reachable
    with pytest.raises(ValueError, match="smallest reachable"):
        fusedrc.convert(model, memory_budget=0.01, example_inputs=(x,))
    # the cheapest units first: a loose budget fuses some units and no block
    loose = fusedrc.convert(model, memory_budget=0.9, example_inputs=(x,)).fusedrc_plan
    assert loose.final_bytes <= 0.9 * loose.baseline_bytes
    assert 0 < len(loose.fused) < len(plan.units) and not loose.recomputed_blocks


def test_resnet_policies():
    model = _resnet("resnet18")
    only = fusedrc.convert(model, policy=["layer1.*"]).fusedrc_plan.fused
    assert only and all(n.startswith("layer1.") for n in only)
    named = fusedrc.convert(model, policy=["conv1", "layer4.1"]).fusedrc_plan.fused
    assert named == ["conv1", "layer4.1.conv1", "layer4.1.conv2"]
    tails = fusedrc.convert(model, policy=lambda name, m: name.endswith("conv2")).fusedrc_plan
    assert tails.fused and all(n.endswith("conv2") for n in tails.fused)
    assert all(u.kind == "conv_bn_add_relu" for u in tails.units if u.selected)


# --------------------------------------------------------------------------- Hugging Face
def _opt(**kw):
    tr = _transformers()
    cfg = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
               max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, use_cache=False)
    cfg.update(kw)
    torch.manual_seed(0)
    return tr.OPTForCausalLM(tr.OPTConfig(**cfg)).train()


def _t5(**kw):
    tr = _transformers()
    cfg = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4,
               dropout_rate=0.0, feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0,
               use_cache=False)
    cfg.update(kw)
    torch.manual_seed(0)
    return tr.T5ForConditionalGeneration(tr.T5Config(**cfg)).train()


def _train_losses(model, batches, call):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for b in batches:
        loss = call(model, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def test_opt_forward_backward_bytes_steps():
    model = _opt()
    ids = torch.randint(0, 128, (2, 32))
    conv = fusedrc.convert(model, example_inputs=(ids,))
    plan = conv.fusedrc_plan
    assert fused_without_norms(plan) == ["model.decoder.layers.0.fc1", "model.decoder.layers.1.fc1"]
    # the attention's norms and the final one: their outputs are not kept (the FFNs' run inside their op)
    assert sorted(norm_units(plan)) == ["model.decoder.final_layer_norm"] + \
        [f"model.decoder.layers.{i}.self_attn_layer_norm" for i in range(2)]
    assert list(conv.state_dict()) == list(model.state_dict())
    conv.load_state_dict(model.state_dict())
    # weight views (a Linear saves weight.t()) are not counted: at this tiny size the attention's
    # activations weigh more than the FFNs', hence 0.72 rather than the ~0.62 of a count with views
    assert plan.final_bytes / plan.baseline_bytes <= 0.75
    assert plan.final_bytes <= _checkpoint_bytes(conv, (ids,))
    la, lb = model(ids, labels=ids).loss, conv(ids, labels=ids).loss
    assert rel_err(lb, la) <= TOL
    la.backward()
    lb.backward()
    _assert_close_models(model, conv)
    batches = [torch.randint(0, 128, (2, 16)) for _ in range(3)]
    call = lambda m, b: m(b, labels=b).loss  # noqa: E731
    ref = _train_losses(copy.deepcopy(model), batches, call)
    assert _train_losses(copy.deepcopy(conv), batches, call) == pytest.approx(ref, rel=1e-4)


def test_opt_blocks_and_dropout_after_fc2():
    model = _opt(dropout=0.1)  # dropout after fc2 is outside the fused FFN: still fused, same masks
    ids = torch.randint(0, 128, (2, 16))
    conv = fusedrc.convert(model, policy="blocks", example_inputs=(ids,))
    plan = conv.fusedrc_plan
    assert len(fused_without_norms(plan)) == 2 and len(plan.recomputed_blocks) == 2
    assert plan.final_bytes < 0.3 * plan.baseline_bytes
    torch.manual_seed(1)
    la = model(ids, labels=ids).loss
    torch.manual_seed(1)
    lb = conv(ids, labels=ids).loss
    assert rel_err(lb, la) <= TOL
    la.backward()
    lb.backward()
    _assert_close_models(model, conv)


def test_t5_forward_backward_bytes_steps():
    model = _t5()
    ids, dec = torch.randint(1, 128, (2, 16)), torch.randint(1, 128, (2, 8))
    conv = fusedrc.convert(model, example_inputs=(ids, None, dec))
    plan = conv.fusedrc_plan
    assert len(fused_without_norms(plan)) == 4 and all(n.endswith("DenseReluDense") for n in fused_without_norms(plan))
    assert list(conv.state_dict()) == list(model.state_dict())
    # bytes are whole storages kept alive (the attention saves views of larger buffers, which
    # count in full): 0.80 here, where counting each saved view's own size gave about 0.69
    assert plan.final_bytes / plan.baseline_bytes <= 0.80
    assert plan.final_bytes <= _checkpoint_bytes(conv, (ids, None, dec))
    la = model(input_ids=ids, labels=dec).loss
    lb = conv(input_ids=ids, labels=dec).loss
    assert rel_err(lb, la) <= TOL
    la.backward()
    lb.backward()
    _assert_close_models(model, conv)
    batches = [(torch.randint(1, 128, (2, 8)), torch.randint(1, 128, (2, 4))) for _ in range(3)]
    call = lambda m, b: m(input_ids=b[0], labels=b[1]).loss  # noqa: E731
    ref = _train_losses(copy.deepcopy(model), batches, call)
    assert _train_losses(copy.deepcopy(conv), batches, call) == pytest.approx(ref, rel=1e-4)


def _spy_dropout_p(monkeypatch, op):
    """The dropout_p of every call of fusedrc.functional.``op`` from now on (the list, filled in)."""
    ps = []
    real = getattr(fusedrc.functional, op)

    def spy(*args, dropout_p=0.0, **kwargs):
        ps.append(dropout_p)
        return real(*args, dropout_p=dropout_p, **kwargs)
    monkeypatch.setattr(fusedrc.functional, op, spy)
    return ps


def test_t5_v1_1_gated_ffn(monkeypatch):
    """T5 v1.1 / Flan-T5 (feed_forward_proj="gated-gelu"): each T5DenseGatedActDense is one fused
    gated FFN, its dropout (their default 0.1) included: outputs and gradients as the original's
    without dropout and in eval; with it, the op applies the module's p (its own mask stream)."""
    model = _t5(feed_forward_proj="gated-gelu")
    ids, dec = torch.randint(1, 128, (2, 16)), torch.randint(1, 128, (2, 8))
    conv = fusedrc.convert(model, example_inputs=(ids, None, dec))
    plan = conv.fusedrc_plan
    assert len(fused_without_norms(plan)) == 4 and all(n.endswith("DenseReluDense") for n in fused_without_norms(plan))
    # T5LayerFF's layer_norm runs inside the op; the attention layers' and the stacks' final norms are recomputed
    assert {u.kind for u in plan.units} == {"norm_gated_ffn", "norm"}
    assert plan.final_bytes <= _checkpoint_bytes(conv, (ids, None, dec))
    with FusedOpLog() as log:
        lb = conv(input_ids=ids, labels=dec).loss
    assert log.ops.count("gated_mlp") == 4
    la = model(input_ids=ids, labels=dec).loss
    assert rel_err(lb, la) <= TOL
    la.backward()
    lb.backward()
    _assert_close_models(model, conv)
    dropped = _t5(feed_forward_proj="gated-gelu", dropout_rate=0.1)
    conv = fusedrc.convert(dropped)
    ps = _spy_dropout_p(monkeypatch, "gated_mlp")
    conv(input_ids=ids, labels=dec).loss.backward()
    assert ps == [0.1] * 4
    assert saved_bytes(conv, (ids, None, dec)) < 0.9 * saved_bytes(dropped, (ids, None, dec))
    conv.eval(), dropped.eval()
    with FusedOpLog() as log:
        assert rel_err(conv(input_ids=ids, labels=dec).loss, dropped(input_ids=ids, labels=dec).loss) <= TOL
    assert log.ops.count("gated_mlp") == 4


def test_t5_dropout_between_is_fused(monkeypatch):
    # T5's default dropout_rate (0.1) sits between wi and wo: the fused FFN applies it, its mask
    # regenerated in backward (own stream: equal to the original's in eval, in distribution in training)
    model = _t5(dropout_rate=0.1)
    conv = fusedrc.convert(model)
    plan = conv.fusedrc_plan
    assert len(fused_without_norms(plan)) == 4 and not plan.skipped
    ps = _spy_dropout_p(monkeypatch, "fused_mlp")
    ids, dec = torch.randint(1, 128, (2, 8)), torch.randint(1, 128, (2, 4))
    model.eval(), conv.eval()
    assert rel_err(conv(input_ids=ids, labels=dec).loss, model(input_ids=ids, labels=dec).loss) <= TOL
    assert ps == [0.0] * 4
    conv.train()
    ps.clear()
    torch.manual_seed(1)
    la = conv(input_ids=ids, labels=dec).loss
    torch.manual_seed(1)
    lb = conv(input_ids=ids, labels=dec).loss
    assert ps == [0.1] * 8 and torch.equal(la, lb)
    la.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in conv.parameters() if p.requires_grad)


def _moshi_config(tr, **kw):
    return tr.MoshiConfig(vocab_size=100, hidden_size=32, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, audio_vocab_size=50, num_codebooks=2, depth_hidden_size=16,
                          depth_num_hidden_layers=1, depth_num_attention_heads=2, depth_ffn_dim=32,
                          max_position_embeddings=64, sliding_window=64, use_cache=False, **kw)


def _hf_family(family):
    """Tiny Hugging Face models of other families, their inputs and the units convert finds."""
    tr = _transformers()
    torch.manual_seed(0)
    ids, dec = torch.randint(3, 100, (2, 12)), torch.randint(3, 100, (2, 6))
    if family == "llama":  # gated MLP: LlamaMLP found by its forward, one fused gated FFN
        cfg = tr.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        model, args, kwargs = tr.LlamaForCausalLM(cfg), (ids,), {}
        units = [f"model.layers.{i}.mlp" for i in range(2)]
    elif family == "phi3":  # gate and up projections in one Linear: Phi3MLP found by its forward
        cfg = tr.Phi3Config(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, use_cache=False)
        model, args, kwargs = tr.Phi3ForCausalLM(cfg), (ids,), {}
        units = [f"model.layers.{i}.mlp" for i in range(2)]
    elif family == "moshi":  # Moshi's gating MLP: fc1's output viewed in halves, found by its forward
        cfg = _moshi_config(tr)
        model, args, kwargs = tr.MoshiForCausalLM(cfg), (ids,), {}
        units = [f"model.layers.{i}.mlp" for i in range(2)]
    elif family == "bert":  # the split-FFN rule on BertLayer, fx on the MLM head's transform (dense + GELU)
        cfg = tr.BertConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model, args, kwargs = tr.BertForMaskedLM(cfg), (ids,), {}
        units = [f"bert.encoder.layer.{i}.intermediate" for i in range(2)] + ["cls.predictions.transform.dense"]
    elif family == "gpt2":  # GPT2MLP's Conv1D layers hold (in, out) weights: fused on their transposes
        cfg = tr.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, embd_pdrop=0.0, attn_pdrop=0.0,
                            resid_pdrop=0.0, use_cache=False)
        model, args, kwargs = tr.GPT2LMHeadModel(cfg), (ids,), {}
        units = [f"transformer.h.{i}.mlp" for i in range(2)]
    elif family == "openai":  # OpenAI GPT's MLP is GPT-2's by its parts, its forward through h and h2
        cfg = tr.OpenAIGPTConfig(vocab_size=100, n_embd=32, n_layer=2, n_head=4, embd_pdrop=0.0, attn_pdrop=0.0,
                                 resid_pdrop=0.0, afn="gelu")
        model, args, kwargs = tr.OpenAIGPTLMHeadModel(cfg), (ids,), {}
        units = [f"transformer.h.{i}.mlp" for i in range(2)]
    elif family == "starcoder2":  # F.dropout(training=self.training) after c_proj: one fx graph per mode
        cfg = tr.Starcoder2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        model, args, kwargs = tr.Starcoder2ForCausalLM(cfg), (ids,), {}
        units = [f"model.layers.{i}.mlp.c_fc" for i in range(2)]
    elif family == "bloom":  # BloomGelu (the tanh GELU written out), dropout_add(training=...) per mode
        cfg = tr.BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4, use_cache=False)
        model, args, kwargs = tr.BloomForCausalLM(cfg), (ids,), {}
        units = [f"transformer.h.{i}.mlp.dense_h_to_4h" for i in range(2)]
    elif family == "falcon":  # FalconLinear: an nn.Linear subclass computing F.linear written out
        cfg = tr.FalconConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              use_cache=False)
        model, args, kwargs = tr.FalconForCausalLM(cfg), (ids,), {}
        units = [f"transformer.h.{i}.mlp.dense_h_to_4h" for i in range(2)]
    elif family == "biogpt":  # BART's layer copied, not in the rule's list: found by its shape
        cfg = tr.BioGptConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                              use_cache=False)
        model, args, kwargs = tr.BioGptForCausalLM(cfg), (ids,), {}
        units = [f"biogpt.layers.{i}.fc1" for i in range(2)]
    elif family == "fsmt":  # BART's layer again, in transformers classes that are no checkpointing layer
        cfg = tr.FSMTConfig(langs=["en", "de"], src_vocab_size=100, tgt_vocab_size=100, d_model=32, encoder_layers=1,
                            decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, activation_function="relu", dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0, use_cache=False)
        model, args, kwargs = tr.FSMTForConditionalGeneration(cfg), (ids,), {"decoder_input_ids": dec}
        units = ["model.encoder.layers.0.fc1", "model.decoder.layers.0.fc1"]
    elif family == "rwkv":  # RWKV's channel mix by name: key -> relu^2 -> value fused, its time shift and gate kept
        cfg = tr.RwkvConfig(vocab_size=100, context_length=32, hidden_size=32, attention_hidden_size=32,
                            num_hidden_layers=2)
        model, args, kwargs = tr.RwkvForCausalLM(cfg), (ids,), {}
        units = [f"rwkv.blocks.{i}.feed_forward" for i in range(2)]
    else:  # BART inlines its FFN as x = act(fc1(x)): the inline-FFN rule
        cfg = tr.BartConfig(vocab_size=100, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=1,
                            decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                            dropout=0.0, use_cache=False)
        model, args, kwargs = tr.BartForConditionalGeneration(cfg), (ids,), {"decoder_input_ids": dec}
        units = ["model.encoder.layers.0.fc1", "model.decoder.layers.0.fc1"]
    return model.train(), args, kwargs, units


@pytest.mark.parametrize("tf_padding", [True, False], ids=["tf_padding", "symmetric"])
def test_hugging_face_mobilenet_conv_layers(tf_padding):
    """Hugging Face's MobileNet V1/V2 conv layers (TensorFlow 'SAME' padding by the input's size where the config
    says, then Conv -> BatchNorm -> ReLU6, depthwise ones too): every layer with a norm one fused Conv-BN[-act]
    unit; a training step's output, input and parameter gradients and the running statistics the original's (an
    odd input size: the tf padding wider on one side); on the Triton backend too (one stride-2 depthwise layer)."""
    tr = _transformers()
    from transformers.models.mobilenet_v2 import modeling_mobilenet_v2 as M2

    torch.manual_seed(0)
    for cls, cfg in ((tr.MobileNetV2Model, tr.MobileNetV2Config(depth_multiplier=0.25, min_depth=4, image_size=33,
                                                               tf_padding=tf_padding)),
                     (tr.MobileNetV1Model, tr.MobileNetV1Config(depth_multiplier=0.25, min_depth=4, image_size=33,
                                                               tf_padding=tf_padding))):
        model = cls(cfg).train()
        conv = fusedrc.convert(model)
        kinds = collections.Counter(u.kind for u in conv.fusedrc_plan.units)
        layers = [m for m in model.modules() if type(m).__name__.endswith("ConvLayer")]
        assert kinds["conv_bn_act"] + kinds["conv_bn"] == sum(m.normalization is not None for m in layers) > 10
        x = torch.randn(2, 3, 33, 33)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with FusedOpLog() as log:
            yb = conv(xb).last_hidden_state
            yb.square().sum().backward()
        ya = model(xa).last_hidden_state
        ya.square().sum().backward()
        assert "conv_bn_act" in log.ops
        assert rel_err(yb, ya) < 1e-5 and rel_err(xb.grad, xa.grad) < 1e-5, cls.__name__
        for (n, a), b in zip(model.named_parameters(), conv.parameters()):
            assert rel_err(b.grad, a.grad) < 1e-5, n
        for (n, a), b in zip(model.named_buffers(), conv.buffers()):
            assert torch.allclose(b.double(), a.double(), rtol=1e-5, atol=1e-6), n
    layer = M2.MobileNetV2ConvLayer(tr.MobileNetV2Config(tf_padding=tf_padding), 8, 8, 3, stride=2, groups=8).train()
    fused = fusedrc.convert(layer)
    device = backend_device("triton")
    layer.to(device), fused.to(device)
    x = torch.randn(2, 8, 9, 9, device=device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with fusedrc.use_backend("triton"):
        yb = fused(xb)
        yb.square().sum().backward()
    ya = layer(xa)
    ya.square().sum().backward()
    assert rel_err(yb, ya) < 1e-5 and rel_err(xb.grad, xa.grad) < 1e-5
    assert rel_err(fused.convolution.weight.grad, layer.convolution.weight.grad) < 1e-5


def test_sam3_mlp_dropout_before_the_activation():
    """SAM 3's MLPs (fc1 -> dropout -> GELU -> fc2): one fused FFN while the dropout does nothing (p = 0, or eval
    mode), output and gradients the module's; a dropout that acts there (training, p > 0) runs the module's forward;
    a forward of another shape is reported and left."""
    _transformers()
    try:
        from transformers.models.sam3 import modeling_sam3 as M
    except ImportError:
        pytest.skip("this transformers has no SAM 3")
    cfg = types.SimpleNamespace(hidden_act="gelu", hidden_size=16, intermediate_size=40, hidden_dropout=0.0)
    torch.manual_seed(0)
    mlp = M.Sam3MLP(cfg).train()
    conv = fusedrc.convert(mlp)
    assert [u.kind for u in conv.fusedrc_plan.units] == ["ffn"] and conv.fusedrc_plan.fused == [""]
    x = torch.randn(3, 5, 16)
    for p, train, fused in ((0.0, True, True), (0.3, False, True), (0.3, True, False)):
        mlp.dropout.p = conv.dropout.p = p
        mlp.train(train), conv.train(train)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(1)
        ya = mlp(xa)
        torch.manual_seed(1)
        with FusedOpLog() as log:
            yb = conv(xb)
            yb.square().sum().backward()
        ya.square().sum().backward()
        assert bool(log.ops) == fused, (p, train, log.ops)
        assert rel_err(yb, ya) < 1e-6 and rel_err(xb.grad, xa.grad) < 1e-6, (p, train)
        for (n, a), b in zip(mlp.named_parameters(), conv.parameters()):
            assert rel_err(b.grad, a.grad) < 1e-6, (n, p, train)
            a.grad = b.grad = None

    class Other(M.Sam3MLP):
        def forward(self, hidden_states):
            return self.fc2(self.dropout(self.activation_fn(self.fc1(hidden_states))) * 2)

    Other.__name__ = Other.__qualname__ = "Sam3MLP"  # the rule's class name, another forward
    plan = fusedrc.convert(Other(cfg)).fusedrc_plan
    assert "ffn" not in [u.kind for u in plan.units]
    assert any("fc1 -> dropout -> activation_fn -> fc2" in r for _, r in plan.skipped), plan


@pytest.mark.parametrize("family", ["llama", "phi3", "moshi", "bert", "gpt2", "bart", "starcoder2", "bloom", "falcon",
                                    "biogpt", "fsmt", "rwkv"])
def test_other_hugging_face_families(family):
    """Beyond the OPT and T5 rules: fx on the submodules that trace (one graph per training mode
    where the forward reads it), the rules for GPT-2's MLP and BART-style layers (named, or by
    shape), Linear subclasses that are F.linear, and every GradientCheckpointingLayer a block
    (policy="blocks", budgets)."""
    model, args, kwargs, units = _hf_family(family)
    conv = fusedrc.convert(model, example_inputs=args)
    plan = conv.fusedrc_plan
    assert fused_without_norms(plan) == units and not plan.skipped
    assert list(conv.state_dict()) == list(model.state_dict())
    assert plan.final_bytes < plan.baseline_bytes
    assert plan.final_bytes <= _checkpoint_bytes(conv, args)
    ya, yb = model(*args, **kwargs).logits, conv(*args, **kwargs).logits
    assert rel_err(yb, ya) <= TOL
    ya.square().mean().backward()
    yb.square().mean().backward()
    _assert_close_models(model, conv)
    blocks = fusedrc.convert(model, policy="blocks", example_inputs=args)
    assert len(blocks.fusedrc_plan.recomputed_blocks) == 2
    assert blocks.fusedrc_plan.final_bytes < 0.5 * plan.baseline_bytes
    model.zero_grad()
    ya, yb = model(*args, **kwargs).logits, blocks(*args, **kwargs).logits
    assert rel_err(yb, ya) <= TOL
    ya.square().mean().backward()
    yb.square().mean().backward()
    _assert_close_models(model, blocks)
    budget = fusedrc.convert(model, memory_budget=0.5, example_inputs=args).fusedrc_plan
    assert budget.final_bytes <= budget.target_bytes
    assert bool(budget.recomputed_blocks) == (plan.final_bytes > budget.target_bytes)  # blocks when units fall short
    # GPT-2: Conv1D FLOPs; the norms rerun no GEMM (cost 0: taken first)
    assert all((u.cost > 0) == (u.kind != "norm") for u in budget.units) and all(b.cost > 0 for b in budget.blocks)


def test_fsmt_decoder_with_its_cache_is_not_recomputed():
    """FSMT's decoder layers take their KV cache as ``layer_state`` (FSMTConfig's default use_cache=True):
    such a call runs without recompute, said once (a rerun would append the keys and values twice);
    gradients as the original's."""
    tr = _transformers()
    torch.manual_seed(0)
    cfg = tr.FSMTConfig(langs=["en", "de"], src_vocab_size=100, tgt_vocab_size=100, d_model=32, encoder_layers=1,
                        decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    assert cfg.use_cache
    model = tr.FSMTModel(cfg).train()
    blocks = fusedrc.convert(model, policy="blocks")
    assert len(blocks.fusedrc_plan.recomputed_blocks) == 2
    ids, dec = torch.randint(3, 100, (2, 7)), torch.randint(3, 100, (2, 5))
    with pytest.warns(UserWarning, match="called with a KV cache"):
        yb = blocks(ids, decoder_input_ids=dec).last_hidden_state
    ya = model(ids, decoder_input_ids=dec).last_hidden_state
    assert rel_err(yb, ya) <= TOL
    ya.square().mean().backward()
    yb.square().mean().backward()
    _assert_close_models(model, blocks)


def test_openai_gpt_mlp_found_by_its_parts():
    """OpenAI GPT's ``MLP`` (GPT-2's parts, its forward through ``h``/``h2``): one fused FFN per layer,
    found by its Conv1D layers and checked forward; outputs, gradients as the original's, fewer bytes.
    (Its Block is no GradientCheckpointingLayer: policy="blocks" has no block to take.)"""
    model, args, kwargs, units = _hf_family("openai")
    conv = fusedrc.convert(model)
    plan = conv.fusedrc_plan
    assert fused_without_norms(plan) == units and not plan.skipped
    with SavedBytes() as a:
        ya = model(*args).logits
    with SavedBytes() as b:
        yb = conv(*args).logits
    assert b.bytes < a.bytes and rel_err(yb, ya) <= TOL
    ya.square().mean().backward()
    yb.square().mean().backward()
    _assert_close_models(model, conv)


def test_albert_shared_layer_ffn():
    """ALBERT: its one shared AlbertLayer's ff_chunk (ffn -> gelu_new -> ffn_output) is a fused FFN,
    each of the layer's calls keeping its own input; the MLM head's dense + GELU a fused Linear+act;
    outputs and gradients as the original's, the bytes of checkpoint on the same units; a changed
    ff_chunk is reported and left."""
    tr = _transformers()
    torch.manual_seed(0)
    cfg = tr.AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=3, num_attention_heads=4, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    model = tr.AlbertForMaskedLM(cfg).train()
    ids = torch.randint(3, 100, (2, 12))
    conv = fusedrc.convert(model, example_inputs=(ids,))
    plan = conv.fusedrc_plan
    assert fused_without_norms(plan) == ["albert.encoder.albert_layer_groups.0.albert_layers.0.ffn", "predictions.dense"]
    assert not plan.skipped and list(conv.state_dict()) == list(model.state_dict())
    assert plan.final_bytes < 0.5 * plan.baseline_bytes
    assert plan.final_bytes <= _checkpoint_bytes(conv, (ids,))
    with FusedOpLog() as log:
        yb = conv(ids).logits
    assert log.ops.count("fused_mlp") == 3  # the shared layer, called once per hidden layer
    ya = model(ids).logits
    assert rel_err(yb, ya) <= TOL
    ya.square().mean().backward()
    yb.square().mean().backward()
    _assert_close_models(model, conv)  # attention.key.bias: a gradient zero in theory, float noise

    layer_cls = type(model.albert.encoder.albert_layer_groups[0].albert_layers[0])
    other = type("AlbertLayer", (layer_cls,), {"ff_chunk": lambda self, x: self.ffn_output(self.activation(self.ffn(x)))})
    changed = copy.deepcopy(model)
    changed.albert.encoder.albert_layer_groups[0].albert_layers[0].__class__ = other
    with pytest.warns(UserWarning, match="ff_chunk is not ffn -> activation -> ffn_output"):
        assert fused_without_norms(fusedrc.convert(changed).fusedrc_plan) == ["predictions.dense"]


def _split_ffn_model(tr, family, chunk=0, dropout=0.1):
    common = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0, chunk_size_feed_forward=chunk)
    if family == "electra":
        return tr.ElectraModel(tr.ElectraConfig(embedding_size=32, **common)).train()
    if family == "roberta":
        return tr.RobertaModel(tr.RobertaConfig(pad_token_id=1, **common), add_pooling_layer=False).train()
    if family == "deberta_v2":  # the two calls inline in the layer's forward: stand-ins
        return tr.DebertaV2Model(tr.DebertaV2Config(**common)).train()
    if family == "mpnet":
        return tr.MPNetModel(tr.MPNetConfig(**common), add_pooling_layer=False).train()
    if family == "esm":  # a pre-FFN LayerNorm in feed_forward_chunk, erf GELU as a function, no norm after
        return tr.EsmModel(tr.EsmConfig(pad_token_id=1, **common), add_pooling_layer=False).train()
    if family == "megatron_bert":  # a pre-FFN LayerNorm in feed_forward_chunk, output's `return input_tensor + h`
        return tr.MegatronBertModel(tr.MegatronBertConfig(**common), add_pooling_layer=False).train()
    if family == "longformer":  # its layer's method is ff_chunk(self, attn_output)
        return tr.LongformerModel(tr.LongformerConfig(pad_token_id=1, attention_window=4, **common),
                                  add_pooling_layer=False).train()
    return tr.BertModel(tr.BertConfig(**common), add_pooling_layer=False).train()


def _same_seed_step(model, conv, ids):
    """Both models' outputs from the same random stream (the dropout masks), then one backward each;
    the fused ops the converted model's step ran."""
    torch.manual_seed(1)
    ya = model(ids).last_hidden_state
    torch.manual_seed(1)
    with FusedOpLog() as log:
        yb = conv(ids).last_hidden_state
        yb.square().mean().backward()
    assert rel_err(yb, ya) <= TOL
    ya.square().mean().backward()
    _assert_close_models(model, conv)
    return log.ops


@pytest.mark.parametrize("family", ["bert", "roberta", "electra", "longformer", "deberta_v2", "mpnet", "esm",
                                    "megatron_bert"])
def test_split_ffn_layers(family):
    """BERT-style layers, found by their code (feed_forward_chunk, intermediate's and output's forwards):
    intermediate's dense and activation and output's dense run as one fused FFN, output's dropout
    (p=0.1: the same random stream as the original's) and LayerNorm as the modules they are. Outputs and
    gradients as the original's; the bytes of checkpoint on the same units, well below what the fused
    Linear+GELU alone (the fx pass's find before this rule) kept."""
    tr = _transformers()
    torch.manual_seed(0)
    model = _split_ffn_model(tr, family)
    ids = torch.randint(3, 100, (2, 12))
    conv = fusedrc.convert(model, example_inputs=(ids,))
    plan = conv.fusedrc_plan
    assert fused_without_norms(plan) == [f"encoder.layer.{i}.intermediate" for i in range(2)] and not plan.skipped
    assert type(conv.encoder.layer[0]) is type(model.encoder.layer[0])  # its class (HF's checkpointing) stays
    assert list(conv.state_dict()) == list(model.state_dict())
    assert plan.final_bytes <= _checkpoint_bytes(conv, (ids,))
    # both (tokens, 64) fp32 tensors of each layer's FFN gone, the GELU's input and output (the fused
    # Linear+GELU the fx pass found before this rule dropped only the first)
    assert plan.baseline_bytes - plan.final_bytes >= 2 * 2 * ids.numel() * 64 * 4
    assert sorted(_same_seed_step(model, conv, ids)) == ["fused_mlp"] * 2 + ["fused_mlp_backward"] * 2
    if family == "longformer":  # its method's own argument name, by keyword
        h = torch.randn(2, 3, 32)
        conv.eval(), model.eval()
        assert rel_err(conv.encoder.layer[0].ff_chunk(attn_output=h), model.encoder.layer[0].ff_chunk(attn_output=h)) <= TOL


@pytest.mark.parametrize("body, form", [
    ("h = self.dense(x)\nh = self.dropout(h)\nh = self.LayerNorm(h + r)\nreturn h", (True, "LayerNorm")),
    ("h = self.dense(x)\nh = self.dropout(h)\nh = self.norm(r + h)\nreturn h", (True, "norm")),
    ("h = self.dense(x)\nh = self.dropout(h)\nh = h + r\nreturn h", (True, "")),  # ESM's
    ("h = self.dense(x)\nh = self.LayerNorm(h + r)\nreturn h", (False, "LayerNorm")),  # MobileBERT's FFNOutput
    ("h = self.dense(x)\nh = self.dropout(h)\nreturn r + h", (True, "")),  # Megatron-BERT's
    ("h = self.dense(x)\nreturn h + r", (False, "")),
    ("h = self.dense(x)\nh = self.dropout(h)\nreturn r + x", None),
    ("h = self.dense(x)\nh = self.dropout(h)\nreturn h * r", None),
    ("h = self.dense(x)\nh = self.dropout(h)\nh = h + r\nreturn r", None),
    ("h = self.dense(x)\nh = h + r\nh = self.dropout(h)\nreturn h", None),  # the dropout after the sum
    ("r = self.dense(x)\nreturn r + r", None),
])
def test_split_ffn_output_forms(body, form):
    """The forms of a BERT-style ``output`` forward the split-FFN rule takes: dense, [dropout], the residual
    added in either order, [a norm of the sum]."""
    from fusedrc.convert import _split_ffn_norm

    got = _split_ffn_norm(["def forward(self, x, r):", *body.splitlines()])
    assert (got if got is None else tuple(got)) == form


def test_split_ffn_esm_pre_norm_and_function_activation():
    """ESM's feed_forward_chunk: LayerNorm first, then intermediate (dense, then the module-level erf
    ``gelu`` function, named by the float64 probe) and output (dense, dropout, + the un-normed input, no
    norm). The norm runs once (in the fused path and in the fallback a hook on intermediate forces, where
    the hook sees the activation), the method by keyword gives the original's, and a look-alike whose
    function is not an activation fusedrc knows is reported, not fused as an FFN."""
    tr = _transformers()
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 12))
    model = _split_ffn_model(tr, "esm", dropout=0.0)
    conv = fusedrc.convert(model)
    norm_calls = []
    for m in (model, conv):
        m.encoder.layer[0].LayerNorm.register_forward_hook(lambda *a: norm_calls.append(1))
    seen = []
    handle = conv.encoder.layer[1].intermediate.register_forward_hook(lambda m, i, o: seen.append(o.shape[-1]))
    assert _same_seed_step(model, conv, ids).count("fused_mlp") == 1 and seen == [64]
    assert len(norm_calls) == 2  # once in each model's forward
    handle.remove()
    layer, ref = conv.encoder.layer[0], model.encoder.layer[0]
    h = torch.randn(2, 3, 32)
    conv.eval(), model.eval()
    assert rel_err(layer.feed_forward_chunk(attention_output=h), ref.feed_forward_chunk(attention_output=h)) <= TOL

    esm = sys.modules[type(model.encoder.layer[0].intermediate).__module__]
    real = esm.gelu
    try:
        esm.gelu = lambda x: x * torch.sigmoid(x) * 0.5  # not one of the fused activations (convert reads it then)
        plan = fusedrc.convert(_split_ffn_model(tr, "esm", dropout=0.0)).fusedrc_plan
    finally:
        esm.gelu = real
    assert [reason for _, reason in plan.skipped] == ["activation <lambda> has no fused form"] * 2
    # the fx pass then finds x * sigmoid(x) after intermediate's Linear: a fused Linear+SiLU, the 0.5 after
    assert fused_without_norms(plan) == [f"encoder.layer.{i}.intermediate.dense" for i in range(2)]

    # a method that writes the norm back into its argument adds the normed value as the residual: not
    # ESM's form, so no split FFN (intermediate's Linear+GELU is the fx pass's find), and the same outputs
    layer_cls = type(model.encoder.layer[0])

    class NormedInPlace(layer_cls):
        def feed_forward_chunk(self, attention_output):
            attention_output = self.LayerNorm(attention_output)
            intermediate_output = self.intermediate(attention_output)
            layer_output = self.output(intermediate_output, attention_output)
            return layer_output

    other = _split_ffn_model(tr, "esm", dropout=0.0)
    for layer in other.encoder.layer:
        layer.__class__ = NormedInPlace
    conv = fusedrc.convert(other)
    assert fused_without_norms(conv.fusedrc_plan) == [f"encoder.layer.{i}.intermediate.dense" for i in range(2)]
    assert rel_err(conv(ids).last_hidden_state, other(ids).last_hidden_state) <= TOL


@pytest.mark.parametrize("family", ["bert", "deberta_v2"])
def test_split_ffn_fallbacks_chunks_copies_and_replicas(tmp_path, family):
    """The BERT rules' edges, for the feed_forward_chunk form (BERT) and the inline one (DeBERTa's
    stand-ins): chunked feed-forward (BERT: one fused FFN a chunk); a hook put on intermediate after
    convert (the layer runs its modules as they are: the hook sees the activation), and intermediate
    called by hand (itself); a layer whose output is not dense -> [dropout] -> norm(h + input) (reported;
    the fx pass fuses intermediate's Linear+act instead); converting again, torch.save / load, and a
    DataParallel replica on its own parameters."""
    tr = _transformers()
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 12))
    model = _split_ffn_model(tr, family, chunk=4)
    conv = fusedrc.convert(model)
    chunks = 3 if family == "bert" else 1  # 12 tokens in chunks of 4; DeBERTa does not chunk its FFN
    assert _same_seed_step(model, conv, ids).count("fused_mlp") == 2 * chunks

    model = _split_ffn_model(tr, family, dropout=0.0)
    conv = fusedrc.convert(model)
    seen = []
    handle = conv.encoder.layer[1].intermediate.register_forward_hook(lambda m, i, o: seen.append(o.shape[-1]))
    model.zero_grad()
    assert _same_seed_step(model, conv, ids).count("fused_mlp") == 1 and seen == [64]
    handle.remove()
    h = torch.randn(2, 3, 32)
    assert torch.equal(conv.encoder.layer[0].intermediate(h), model.encoder.layer[0].intermediate(h))
    if family == "bert":  # the method by keyword, as the class's takes it
        layer, ref = conv.encoder.layer[0], model.encoder.layer[0]
        assert rel_err(layer.feed_forward_chunk(attention_output=h), ref.feed_forward_chunk(attention_output=h)) <= TOL

    # a mark on output (the user's: the layer runs its modules as they are), and a layer class whose
    # code differs from what convert checked (a subclass swapped in): neither runs the fused FFN
    for m in (model, conv):
        fusedrc.mark(m.encoder.layer[0].output)
        m.zero_grad()
    assert _same_seed_step(model, conv, ids).count("fused_mlp") == 1
    for m in (model, conv):
        fusedrc.unmark(m.encoder.layer[0].output)
    layer_cls = type(model.encoder.layer[0])
    if family == "bert":
        body = {"feed_forward_chunk": lambda self, a: self.output(self.intermediate(a) * 0.5, a)}
    else:
        def forward(self, hidden_states, attention_mask, *args, **kwargs):
            a, _ = self.attention(hidden_states, attention_mask, *args, **kwargs)
            return self.output(self.intermediate(a) * 0.5, a), None
        body = {"forward": forward}
    other = type(layer_cls.__name__, (layer_cls,), body)
    for m in (model, conv):
        m.encoder.layer[1].__class__ = other
        m.zero_grad()
    assert _same_seed_step(model, conv, ids).count("fused_mlp") == 1
    for m in (model, conv):
        m.encoder.layer[1].__class__ = layer_cls

    again = fusedrc.convert(conv, inplace=True)
    assert again.fusedrc_plan.fused == conv.fusedrc_plan.fused and again is conv
    path = tmp_path / f"{family}.pt"
    torch.save(conv, path)
    back = torch.load(path, weights_only=False)
    model.zero_grad()
    assert _same_seed_step(model, back, ids).count("fused_mlp") == 2

    replica = replicate_on_cpu(conv, scale=2.0)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(2)
    with FusedOpLog() as log:
        yb = replica(ids).last_hidden_state
    assert log.ops.count("fused_mlp") == 2 and rel_err(yb, ref(ids).last_hidden_state) <= TOL

    out_cls = type(model.encoder.layer[0].output)
    other = type(out_cls.__name__, (out_cls,), {"forward": lambda self, h, r: self.LayerNorm(self.dense(h) + r)})
    changed = copy.deepcopy(model)
    for layer in changed.encoder.layer:
        layer.output.__class__ = other
    with pytest.warns(UserWarning, match=r"is not dense -> \[dropout\] -> \[norm\]"):
        plan = fusedrc.convert(changed).fusedrc_plan
    assert fused_without_norms(plan) == [f"encoder.layer.{i}.intermediate.dense" for i in range(2)]


def test_mobilebert_ffn_stacks():
    """MobileBERT's stacked FFNs (``FFNLayer``: ``intermediate`` then ``FFNOutput``, ``dense -> norm(h + residual)``
    with no dropout and its own variable names; 3 a layer before the layer's own FFN): one fused FFN each, found
    by the inline form; loss and every gradient as the original's; the layer's own FFN (a bottleneck after it)
    stays as it was."""
    tr = _transformers()
    torch.manual_seed(0)
    cfg = tr.MobileBertConfig(vocab_size=100, hidden_size=64, embedding_size=32, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=48, intra_bottleneck_size=32,
                              num_feedforward_networks=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = tr.MobileBertModel(cfg, add_pooling_layer=False).train()
    conv = fusedrc.convert(model)
    plan = conv.fusedrc_plan
    stacked = [f"encoder.layer.{i}.ffn.{j}.intermediate" for i in range(2) for j in range(3)]
    units = {u.name: u.kind for u in plan.units if u.selected}
    assert all(units.get(n) == "ffn" for n in stacked), units
    assert not any("FFNOutput" in reason for _, reason in plan.skipped), plan.skipped
    ids = torch.randint(3, 100, (2, 12))
    assert _same_seed_step(model, conv, ids).count("fused_mlp") >= len(stacked)


def test_levit_linear_bn():
    """LeViT's Linear -> BatchNorm1d modules (Hugging Face's ``MLPLayerWithBN``: every projection of the model;
    timm's ``LinearNorm``), forward checked: the fused Conv-BN op on the tokens as 1x1 images. A whole Hugging Face
    LeViT on the reference backend (every projection a unit, output, gradients, running statistics and
    num_batches_tracked as the original's, fewer bytes kept), each class on the Triton backend; a call of
    another rank runs the module; a Linear-BN of another forward, or with a LayerNorm, is reported."""
    tr = _transformers()
    from transformers.models.levit.modeling_levit import LevitMLPLayer, MLPLayerWithBN

    torch.manual_seed(0)
    model = tr.LevitModel(tr.LevitConfig(image_size=64, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3],
                                         depths=[1, 1, 1], key_dim=[8, 8, 8])).train()
    conv = fusedrc.convert(copy.deepcopy(model))
    plan = conv.fusedrc_plan
    kinds = collections.Counter(u.kind for u in plan.units)
    assert kinds == {"linear_bn": 22, "conv_bn": 4} and not plan.skipped, (kinds, plan.skipped)
    x = torch.randn(2, 3, 64, 64)
    with fusedrc.use_backend("reference"):
        assert saved_bytes(conv, (x,)) < 0.8 * saved_bytes(model, (x,))
        for m in (model, conv):  # (saved_bytes ran a step: the statistics from here on)
            m.load_state_dict(model.state_dict())
        with FusedOpLog() as log:
            y = conv(x).last_hidden_state
            y.square().mean().backward()
    y_ref = model(x).last_hidden_state
    y_ref.square().mean().backward()
    assert log.ops.count("conv_bn_act") == 26 and rel_err(y, y_ref) <= TOL
    # 26 training-mode BatchNorms over 8 to 512 rows: this LeViT's fp32 gradients are ~1% off its float64 ones,
    # the original's and the converted model's alike; between them a 1x1 conv's summation order shows at 1e-4,
    # and a BatchNorm bias a later BatchNorm cancels has only rounding noise for a gradient (the floor)
    ga, gb = _grads(model), _grads(conv)
    floor = 1e-6 * max(g.double().norm() for g in ga.values())
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        assert (gb[n] - ga[n]).double().norm() <= 1e-3 * ga[n].double().norm() + floor, n
    for (n, a), (_, b) in zip(model.named_buffers(), conv.named_buffers()):  # (running means of zero-mean
        # inputs, a normalized tensor through a bias-free Linear, are rounding noise of ~1e-8: the floor)
        assert torch.equal(a, b) if not a.is_floating_point() else (b - a).norm() <= TOL * a.norm() + 1e-6, n

    pytest.importorskip("timm")
    from timm.models.levit import LevitMlp, LinearNorm

    def timm_mlp(drop=0.0):
        mlp = LevitMlp(16, 32, act_layer=nn.Hardswish, drop=drop)
        with torch.no_grad():
            mlp.ln2.bn.weight.normal_()  # (timm starts it at 0: an output of zeros)
        return mlp

    # LeViT's MLPs (the activation inside the first unit's op), and the Linear-BN modules in a Sequential
    for make, fused_act in ((lambda: LevitMLPLayer(16, 32), True), (timm_mlp, True),
                            (lambda: nn.Sequential(LinearNorm(16, 32), nn.Hardswish(), LinearNorm(32, 16)), False)):
        torch.manual_seed(0)
        mlp = make().train()
        fused = fusedrc.convert(copy.deepcopy(mlp))
        assert [u.kind for u in fused.fusedrc_plan.units] == ["linear_bn", "linear_bn"]
        assert (type(fused).__name__ == "FusedLevitMLP") == fused_act
        h, g = torch.randn(2, 7, 16, requires_grad=True), torch.randn(2, 7, 16)
        hr = h.detach().clone().requires_grad_(True)
        with fusedrc.use_backend("triton"), FusedOpLog() as log:
            out = fused(h)
            out.backward(g)  # (not a sum of squares: that of a BatchNorm's output hardly depends on its input)
        out_ref = mlp(hr)
        out_ref.backward(g)
        assert [op.removesuffix("_triton") for op in log.ops].count("conv_bn_act") == 2
        assert rel_err(out, out_ref) <= TOL and rel_err(h.grad, hr.grad) <= TOL
        _assert_close_models(mlp, fused)
        if fused_act:  # the activation's input is not kept: less than the Linear-BN units alone keep
            mlp.eval(), fused.eval()  # (dropout off, the statistics as they are)
            parts = copy.deepcopy(nn.Sequential(*(c for c in fused.children() if not isinstance(c, nn.Dropout))))
            with fusedrc.use_backend("reference"):
                assert saved_bytes(fused, (h,)) + 14 * 32 * 4 <= saved_bytes(parts, (h,))
            # another activation swapped in, or a dropout that acts: the module's forward, right
            for m in (mlp, fused):
                setattr(m, "act" if hasattr(m, "act") else "activation", nn.GELU())
            with fusedrc.use_backend("triton"):
                assert rel_err(fused(h), mlp(h)) <= TOL
    mlp = timm_mlp(drop=0.25).train()
    fused = fusedrc.convert(copy.deepcopy(mlp))
    torch.manual_seed(3)
    out = fused(h)
    torch.manual_seed(3)
    assert rel_err(out, mlp(h)) <= TOL  # the dropout acts: the module's own forward, the same mask
    one = fusedrc.convert(MLPLayerWithBN(16, 8).train())
    with FusedOpLog() as log:  # a 4-D call: flatten(0, 1) hands BatchNorm1d (B * N, M, C), the module's own
        with pytest.raises(RuntimeError):
            one(torch.randn(2, 3, 5, 16))
    assert log.ops == []

    def forward(self, hidden_state):  # no reshape_as: another forward
        return self.batch_norm(self.linear(hidden_state).flatten(0, 1))

    layer_norm = MLPLayerWithBN(16, 8)
    layer_norm.batch_norm = nn.LayerNorm(8)
    other = type("MLPLayerWithBN", (MLPLayerWithBN,), {"forward": forward})(16, 8)  # the rule goes by class name
    with pytest.warns(UserWarning, match="left these as they are"):
        skipped = dict(fusedrc.convert(nn.ModuleDict({"a": layer_norm, "b": other})).fusedrc_plan.skipped)
    assert skipped["a"] == "the norm is not an nn.BatchNorm1d over the Linear's features"
    assert skipped["b"] == "MLPLayerWithBN.forward is not bn(linear(x).flatten(0, 1)).reshape_as(linear(x))"


def _mix_ffn_models(tr, dropout=0.0, linear=False):
    common = dict(num_channels=3, num_encoder_blocks=2, depths=[1, 2], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                  patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[4, 4],
                  hidden_dropout_prob=dropout, drop_path_rate=0.0)
    return {"segformer": lambda: tr.SegformerForSemanticSegmentation(tr.SegformerConfig(
                **common, decoder_hidden_size=32, num_labels=3)),
            "pvt_v2": lambda: tr.PvtV2ForImageClassification(tr.PvtV2Config(
                **common, num_labels=3, linear_attention=linear)),
            "glpn": lambda: tr.GLPNForDepthEstimation(tr.GLPNConfig(**common, decoder_hidden_size=16))}


@pytest.mark.parametrize("name", ["segformer", "pvt_v2", "glpn"])
def test_mix_ffn_models(name):
    """SegFormer's Mix-FFN (fc1 -> depthwise conv over the token grid -> act -> dropout -> fc2 -> dropout) in
    Hugging Face's SegFormer, PVT-v2 and GLPN: one ``mix_ffn`` unit per layer, forward checked; on the reference
    backend the converted model's output and gradients are the original's bit for bit (the same aten ops) and it
    keeps fewer bytes; a whole step on the Triton backend against the original."""
    tr = _transformers()
    torch.manual_seed(0)
    model = _mix_ffn_models(tr)[name]().train()
    key = "predicted_depth" if name == "glpn" else "logits"
    conv = fusedrc.convert(copy.deepcopy(model))
    kinds = collections.Counter(u.kind for u in conv.fusedrc_plan.units)
    assert kinds["mix_ffn"] == 3 and not conv.fusedrc_plan.skipped, (kinds, conv.fusedrc_plan.skipped)
    x = torch.randn(2, 3, 32, 32)
    with fusedrc.use_backend("reference"):
        assert saved_bytes(conv, (x,)) < 0.9 * saved_bytes(model, (x,))
        for m in (model, conv):  # (saved_bytes ran a step: a decode head's BatchNorm statistics from here on)
            m.load_state_dict(model.state_dict())
        with FusedOpLog() as log:
            torch.manual_seed(1)  # (the decode head's and the attention's dropouts: the same masks)
            y = conv(x)[key]
            y.square().mean().backward()
    torch.manual_seed(1)
    y_ref = model(x)[key]
    y_ref.square().mean().backward()
    assert log.ops.count("mix_ffn") == 3 and log.ops.count("mix_ffn_backward") == 3
    assert torch.equal(y, y_ref)
    ga, gb = _grads(model), _grads(conv)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)
    if name != "segformer":
        return
    model.zero_grad(), conv.zero_grad()
    with fusedrc.use_backend("triton"), FusedOpLog() as log:
        torch.manual_seed(1)
        y = conv(x)[key]
        y.square().mean().backward()
    torch.manual_seed(1)
    y_ref = model(x)[key]
    y_ref.square().mean().backward()
    assert [op.removesuffix("_triton") for op in log.ops].count("mix_ffn") == 3
    assert rel_err(y, y_ref) <= TOL
    _assert_close_models(model, conv)


def test_mix_ffn_calls_and_forms():
    """Keyword calls are fused; a token count other than height x width, a swapped conv and a dropout in
    training run the module's own forward or the fused op with that dropout; PVT-v2's linear variant (a ReLU
    before the conv) is fused too (on both backends, against the original), another module there and another
    forward are reported; timm's PVT-v2 MLP is fused too."""
    tr = _transformers()
    from transformers.models.segformer.modeling_segformer import SegformerMixMLP

    torch.manual_seed(0)
    config = tr.SegformerConfig(hidden_dropout_prob=0.25)
    mlp = SegformerMixMLP(config, 8, 32).train()
    fused = fusedrc.convert(copy.deepcopy(mlp))
    assert type(fused).__name__ == "FusedMixFFN"
    x = torch.randn(2, 12, 8)
    mlp.eval(), fused.eval()
    with FusedOpLog() as log:
        assert torch.equal(fused(hidden_states=x, height=3, width=4), mlp(x, 3, 4))
        with pytest.raises(RuntimeError):  # 12 tokens are no 3 x 5 grid: the module's own error
            fused(x, 3, 5)
    assert log.ops == ["mix_ffn"]
    fused.train()
    y = fused(x, 3, 4)  # both dropouts act (p = 0.25): about a quarter of the outputs zero
    assert 0.1 < (y == 0).double().mean().item() < 0.4
    fused.dwconv.dwconv.padding_mode = "circular"
    mlp.dwconv.dwconv.padding_mode = "circular"
    fused.eval(), mlp.eval()
    with FusedOpLog() as log:
        assert torch.equal(fused(x, 3, 4), mlp(x, 3, 4))
    assert log.ops == []

    # PVT-v2's linear variant: a ReLU between fc1 and the conv, inside the op (relu_first); a GELU there is left
    torch.manual_seed(0)
    model = _mix_ffn_models(tr, linear=True)["pvt_v2"]().train()
    linear = fusedrc.convert(copy.deepcopy(model))
    assert collections.Counter(u.kind for u in linear.fusedrc_plan.units)["mix_ffn"] == 3
    x = torch.randn(2, 3, 32, 32)
    for backend in ("reference", "triton"):
        model.zero_grad(), linear.zero_grad()
        with fusedrc.use_backend(backend), FusedOpLog() as log:
            torch.manual_seed(1)
            y = linear(x).logits
            y.square().mean().backward()
        torch.manual_seed(1)
        y_ref = model(x).logits
        y_ref.square().mean().backward()
        assert [op.removesuffix("_triton") for op in log.ops].count("mix_ffn") == 3
        assert rel_err(y, y_ref) <= TOL
        _assert_close_models(model, linear)
    gelu = _mix_ffn_models(tr, linear=True)["pvt_v2"]()
    gelu.pvt_v2.encoder.layers[0].blocks[0].mlp.relu = nn.GELU()
    with pytest.warns(UserWarning, match="left these as they are"):
        skipped = dict(fusedrc.convert(gelu).fusedrc_plan.skipped)
    assert skipped == {"pvt_v2.encoder.layers.0.blocks.0.mlp": "a GELU between fc1 and the depthwise conv has no "
                                                                "fused form"}

    def forward(self, hidden_states, height, width):  # the activation before the conv: another forward
        return self.fc2(self.dwconv(self.activation_fn(self.fc1(hidden_states)), height, width))

    other = type("SegformerMixMLP", (SegformerMixMLP,), {"forward": forward})(config, 8, 32)
    with pytest.warns(UserWarning, match="left these as they are"):
        kept = fusedrc.convert(other)
    assert type(kept) is type(other) and "is not fc1 -> depthwise conv" in str(kept.fusedrc_plan.skipped)

    timm = pytest.importorskip("timm")
    model = timm.create_model("pvt_v2_b0", pretrained=False, num_classes=3).eval()
    conv = fusedrc.convert(copy.deepcopy(model))
    assert collections.Counter(u.kind for u in conv.fusedrc_plan.units)["mix_ffn"] == 8
    x = torch.randn(1, 3, 64, 64)
    with fusedrc.use_backend("reference"), FusedOpLog() as log:
        assert torch.equal(conv(x), model(x))
    assert log.ops.count("mix_ffn") == 8


def test_stand_ins_pair_per_thread():
    """The stand-ins' pass-through flag is armed per thread: a converted DeBERTa shared by threads (each
    running its own forward, thread switches forced often) pairs every head with its own thread's tail."""
    import threading

    from fusedrc.convert import _PassThrough

    flag, seen = _PassThrough(), []
    flag.arm()
    t = threading.Thread(target=lambda: seen.append(flag.armed))
    t.start()
    t.join()
    assert seen == [False] and flag.armed
    flag.arm(False)
    assert not flag.armed

    tr = _transformers()
    torch.manual_seed(0)
    model = _split_ffn_model(tr, "deberta_v2", dropout=0.0).eval()
    conv = fusedrc.convert(model)
    ids = torch.randint(3, 100, (1, 4))
    with torch.no_grad():
        ref = model(ids).last_hidden_state
    errors, outs = [], []

    def work():
        try:
            with torch.no_grad():
                outs.extend(rel_err(conv(ids).last_hidden_state, ref) for _ in range(150))
        except Exception as e:  # noqa: BLE001 - collected, asserted below
            errors.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors and len(outs) == 600 and max(outs) <= TOL


def _gated_unit_step(mlp, backend, dev):
    """``mlp`` converted into one fused gated FFN unit and a step of both on ``backend``: outputs and
    gradients equal, the op and its backward (the backend's twin) ran. Returns (converted, x, xa, xb)."""
    conv = fusedrc.convert(mlp)
    assert conv.fusedrc_plan.fused == [""] and conv.fusedrc_plan.units[0].kind == "gated_ffn"
    x = torch.randn(2, 5, 32, device=dev)
    with fusedrc.use_backend(backend), FusedOpLog() as log:
        xa, xb = _assert_same_step(mlp, conv, x)
    twin = "_triton" if backend == "triton" else ""
    assert log.ops == [f"gated_mlp{twin}", f"gated_mlp_backward{twin}"]
    return conv, x, xa, xb


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_phi3_gate_up_mlp(backend):
    """Phi-3's MLP (gate and up projections in one Linear, split by chunk): one fused gated FFN on the two
    row halves of gate_up_proj's weight (views: the Triton kernels read them in place), its gradient the
    original's; a forward that differs is reported."""
    tr = _transformers()
    torch.manual_seed(0)
    cfg = tr.Phi3Config(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
    dev = backend_device(backend)
    mlp = tr.models.phi3.modeling_phi3.Phi3MLP(cfg).to(dev)
    conv, x, xa, xb = _gated_unit_step(mlp, backend, dev)
    assert rel_err(xb.grad, xa.grad) <= TOL
    assert conv.gate_up_proj.weight.grad.shape == (96, 32)

    conv.activation_fn = nn.Tanh()  # no fused form: converting again leaves no unit of the first plan on
    with pytest.warns(UserWarning, match="no pattern found"):
        assert not fusedrc.convert(conv, inplace=True).fusedrc_plan.fused
    assert not conv.sites["gated_ffn"].enabled

    other = type("Phi3MLP", (type(mlp),), {"forward": lambda self, h: self.down_proj(
        self.activation_fn(self.gate_up_proj(h)[..., :48]) * self.gate_up_proj(h)[..., 48:])})
    changed = copy.deepcopy(mlp)
    changed.__class__ = other
    with pytest.warns(UserWarning, match="no pattern found"):
        plan = fusedrc.convert(changed).fusedrc_plan
    assert not plan.fused and "is not gate, up = gate_up_proj" in dict(plan.skipped)[""]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_moshi_gating_mlp(backend):
    """Moshi's gating MLP (fc1's output viewed as (batch, sequence, 2, -1), activation_fn of half 0 times
    half 1, then fc2): one fused gated FFN on the two row halves of fc1's weight, its gradients the
    original's. Calls the fused op does not model run the module's forward: a codebook's layer_idx, an
    input that is not 3-D (which raises there as in the original). The depth decoder's per-codebook
    Linears are reported; a forward that differs is not taken."""
    tr = _transformers()
    gating = tr.models.moshi.modeling_moshi.MoshiGatingMLP
    torch.manual_seed(0)
    cfg = _moshi_config(tr, hidden_act="gelu")
    dev = backend_device(backend)
    mlp = gating(cfg).to(dev)
    conv, x, xa, xb = _gated_unit_step(mlp, backend, dev)
    assert rel_err(xb.grad, xa.grad) <= TOL and conv.fc1.weight.grad.shape == (96, 32)
    with FusedOpLog() as log:
        assert torch.equal(conv(x, layer_idx=None), mlp(x, layer_idx=None))  # two arguments: the module's own
        with pytest.raises(ValueError):
            conv(x[0])
    assert log.ops == []

    flexible = gating(cfg, use_flexible_linear=True)
    with pytest.warns(UserWarning, match="no pattern found"):
        plan = fusedrc.convert(flexible).fusedrc_plan
    assert "fc1/fc2 are not plain nn.Linear" in dict(plan.skipped)[""]
    other = type("MoshiGatingMLP", (gating,), {"forward": lambda self, h, layer_idx=None: self.fc2(
        self.activation_fn(self.fc1(h)[..., :48]) * self.fc1(h)[..., 48:])})
    changed = copy.deepcopy(mlp)
    changed.__class__ = other
    with pytest.warns(UserWarning, match="no pattern found"):
        assert not fusedrc.convert(changed).fusedrc_plan.fused


_DROP = ("activation_dropout", "training")


@pytest.mark.parametrize("code, reason, dropout", [
    ("h = self.fc1(h)\nh = self.activation_fn(h)\nh = self.fc2(h)", None, None),
    ("h = self.activation_fn(self.fc1(x))\nh = nn.functional.dropout(h, p=self.activation_dropout, "
     "training=self.training)\nh = self.fc2(h)", None, _DROP),
    ("h = self.fc1(x)\nh = self.activation_fn(h)\nh = nn.functional.dropout(h, p=self.activation_dropout, "
     "training=self.is_training)\nh = self.fc2(h)", None, ("activation_dropout", "is_training")),
    # a dropout before the activation, of another tensor, twice, or with a p the layer does not hold
    ("h = self.fc1(x)\nh = nn.functional.dropout(h, p=self.activation_dropout, training=self.training)\n"
     "h = self.activation_fn(h)\nh = self.fc2(h)", "between fc1 and fc2", None),
    ("h = self.activation_fn(self.fc1(x))\nh = nn.functional.dropout(x, p=self.activation_dropout, "
     "training=self.training)\nh = self.fc2(h)", "between fc1 and fc2", None),
    ("h = self.activation_fn(self.fc1(x))\n" + "h = nn.functional.dropout(h, p=self.p, training=self.training)\n" * 2
     + "h = self.fc2(h)", "between fc1 and fc2", None),
    ("h = self.activation_fn(self.fc1(x))\nh = nn.functional.dropout(h, p=0.1, training=self.training)\n"
     "h = self.fc2(h)", "between fc1 and fc2", None),
    ("h = self.fc1(h)\nh = self.activation_fn(h) * 2\nh = self.fc2(h)", "between fc1 and fc2", None),
    ("h = self.fc1(h)\ng = self.activation_fn(h)\nh = self.fc2(h)", "between fc1 and fc2", None),
    ("h = self.fc1(h) + 1\nh = self.activation_fn(h)\nh = self.fc2(h)", "at fc1", None),
    ("h = self.activation_fn(self.fc1(h))\nh = self.fc2(h + r)", "at fc2", None),
    ("h = self.fc1(h)\nh = self.fc2(h)\nh = self.activation_fn(h)", "unexpected code", None),
    ("h = self.fc1(h)\nh = self.activation_fn(h)\nh = self.fc2(self.fc1(h))", "once each", None),
])
def test_inline_ffn_code_check(code, reason, dropout):
    """The inline-FFN rule fuses only a forward whose fc1 -> activation_fn -> [dropout] -> fc2
    lines carry one variable straight through; it names the attributes the dropout line reads."""
    from fusedrc.convert import _inline_ffn

    got, got_dropout = _inline_ffn(["def forward(self, h):", *code.splitlines(), "return h"])
    assert (got is None) == (reason is None) and (reason is None or reason in got), got
    assert got_dropout == dropout


def _tiny_bart(activation_dropout):
    """A one-layer BART encoder-decoder in training mode whose only dropout that acts is its activation dropout."""
    tr = _transformers()
    cfg = tr.BartConfig(vocab_size=100, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=1,
                        decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=activation_dropout, use_cache=False)
    torch.manual_seed(0)
    return tr.BartModel(cfg).train()


class _FusedFFNOracle(nn.Module):
    """A layer's fc1, standing for its whole FFN as one fused op with dropout p (drawing its mask's
    seed where the converted layer's head does)."""

    def __init__(self, fc1, fc2, activation, p):
        super().__init__()
        self.fc1, self.fc2, self.activation, self.p = fc1, fc2, activation, p

    def forward(self, x):
        return fusedrc.functional.fused_mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                                            self.activation, self.p)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_inline_ffn_activation_dropout_is_fused(backend):
    """BART's activation_dropout (p > 0, training): the FFN runs as one fused op whose dropout is its own
    regenerated mask. The layer's own dropout line gets an empty tensor (no mask drawn, no pass over the
    output) and fc2 hands the FFN's output back: outputs and gradients are bit for bit those of the layer
    with its FFN replaced by the fused op with that p. The mask is not kept (its seed is); p is read
    at each call (raised after convert: the new p); in eval, the original's outputs."""
    model = _tiny_bart(activation_dropout=0.25)
    conv = fusedrc.convert(model)
    assert {"encoder.layers.0.fc1", "decoder.layers.0.fc1"} <= set(conv.fusedrc_plan.fused)
    layers = lambda m: (m.encoder.layers[0], m.decoder.layers[0])  # noqa: E731
    ids = torch.randint(3, 100, (2, 8))
    twin = "_triton" if backend == "triton" else ""
    with fusedrc.use_backend(backend):
        for p in (0.25, 0.5):
            for layer in layers(conv):
                layer.activation_dropout = p
            oracle = copy.deepcopy(model)
            for layer in layers(oracle):
                layer.fc1 = _FusedFFNOracle(layer.fc1, layer.fc2, "gelu", p)
                layer.activation_fn, layer.fc2, layer.activation_dropout = nn.Identity(), nn.Identity(), 0.0
            torch.manual_seed(3)
            with FusedOpLog() as log:
                y = conv(ids).last_hidden_state
                grads = torch.autograd.grad(y.square().sum(), list(conv.parameters()))
            assert log.ops == [f"fused_mlp{twin}"] * 2 + [f"fused_mlp_backward{twin}"] * 2
            torch.manual_seed(3)
            yo = oracle(ids).last_hidden_state
            grads_o = torch.autograd.grad(yo.square().sum(), list(oracle.parameters()))
            assert torch.equal(y, yo) and all(torch.equal(a, b) for a, b in zip(grads, grads_o))
            torch.manual_seed(3)
            assert not torch.equal(y, model(ids).last_hidden_state)  # another mask than F.dropout's
        flags = [m.__dict__["_fusedrc_pass"] for m in conv.modules() if "_fusedrc_pass" in m.__dict__]
        assert len(flags) == 4 and not any(f.value() is not None or f.armed for f in flags)  # no output held
        kept = saved_bytes(conv, (ids,))
        for layer in layers(conv):
            layer.activation_dropout = 0.0
        assert saved_bytes(conv, (ids,)) + 2 * 8 == kept  # each mask's int64 seed, not the mask
        for m in (conv, model):
            for layer in layers(m):
                layer.activation_dropout = 0.5
        # the unit's checkpoint impl (a budget's choice) runs the modules' composition: F.dropout's masks
        _set_impl(conv, "checkpoint")
        torch.manual_seed(3)
        y = conv(ids).last_hidden_state
        torch.manual_seed(3)
        assert torch.equal(y, model(ids).last_hidden_state)
        _set_impl(conv, "fused")
        conv.eval(), model.eval()
        assert rel_err(conv(ids).last_hidden_state, model(ids).last_hidden_state) <= TOL
    flags[0].arm(value=y)
    assert copy.deepcopy(flags[0]).value() is None  # a copy starts disarmed, holding nothing
    flags[0].arm(False)


def test_inline_ffn_dropout_attributes_it_cannot_read_run_the_layer():
    """A dropout line whose p is not a number in [0, 1] (or whose training flag is not a bool) is the
    layer's own to apply: the FFN runs split, with the original's draws and errors."""
    model = _tiny_bart(activation_dropout=0.0)
    conv = fusedrc.convert(model)
    ids = torch.randint(3, 100, (2, 8))
    for m in (model, conv):
        m.encoder.layers[0].activation_dropout = torch.tensor(0.5)  # F.dropout takes a 0-d tensor as p
    torch.manual_seed(3)
    with FusedOpLog() as log:
        y = conv(ids).last_hidden_state
    assert log.ops == ["fused_mlp"]  # the decoder's alone
    torch.manual_seed(3)
    assert torch.equal(y, model(ids).last_hidden_state)
    conv.encoder.layers[0].activation_dropout = 2.0
    with pytest.raises(ValueError, match="dropout probability"):
        conv(ids)


def _pixel_decoder_model(tr, kind, **kw):
    """Mask2Former / OneFormer at a tiny config: their pixel decoder's encoder layers inline the FFN with
    ``activation_fn = nn.functional.relu``."""
    swin = tr.SwinConfig(embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], image_size=64, window_size=2,
                         out_features=["stage1", "stage2", "stage3", "stage4"], drop_path_rate=0.0,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    common = dict(backbone_config=swin, hidden_dim=32, encoder_feedforward_dim=32, encoder_layers=1,
                  decoder_layers=2, num_attention_heads=2, num_queries=4, dim_feedforward=32, **kw)
    torch.manual_seed(0)
    if kind == "mask2former":
        return tr.Mask2FormerModel(tr.Mask2FormerConfig(feature_size=32, mask_feature_size=32, **common))
    return tr.OneFormerModel(tr.OneFormerConfig(conv_dim=32, mask_dim=32, text_encoder_n_ctx=4, **common))


@pytest.mark.parametrize("kind", ["mask2former", "oneformer"])
def test_pixel_decoder_function_activation(kind):
    """Mask2Former's and OneFormer's pixel decoder layers hold F.relu as activation_fn (a function, not a
    module): fused, outputs and gradients the original's; disabled, the function is back in its place.
    OneFormer's dropout line reads is_training, not training: the fused op's p follows it."""
    tr = _transformers()
    model = _pixel_decoder_model(tr, kind, dropout=0.0).train()
    conv = fusedrc.convert(model)
    unit = "pixel_level_module.decoder.encoder.layers.0.fc1"
    assert unit in conv.fusedrc_plan.fused
    layer = conv.pixel_level_module.decoder.encoder.layers[0]
    x = torch.randn(1, 3, 64, 64)
    args = (x,) if kind == "mask2former" else (x, torch.randint(0, 10, (1, 77)))
    key = "pixel_decoder_last_hidden_state" if kind == "mask2former" else "transformer_decoder_mask_predictions"
    out = lambda m: getattr(m(*args), key)  # noqa: E731
    with FusedOpLog() as log:
        y = out(conv)
        grads = torch.autograd.grad(y.square().sum(), list(conv.parameters()), allow_unused=True)
    fused_calls = log.ops.count("fused_mlp")
    assert fused_calls
    ya = out(model)
    grads_a = torch.autograd.grad(ya.square().sum(), list(model.parameters()), allow_unused=True)
    assert rel_err(y, ya) <= TOL
    assert all((a is None) == (b is None) and (a is None or rel_err(a, b) <= TOL) for a, b in zip(grads, grads_a))
    if kind == "oneformer":  # its dropout acts by is_training, in eval mode too
        conv.eval(), model.eval()
        layer.activation_dropout = 0.5
        for flag, p in ((True, 0.5), (False, 0.0)):
            layer.is_training = flag
            assert layer.fc1._dropout_p(layer) == p
        def seeded(seed):
            torch.manual_seed(seed)
            return out(conv)

        with torch.no_grad():
            ys = [seeded(1), seeded(2)]
            assert rel_err(ys[0], out(model)) <= TOL  # is_training False: no dropout
            layer.is_training = True
            ys += [seeded(1), seeded(2)]
        assert torch.equal(ys[0], ys[1]) and not torch.equal(ys[2], ys[3])
        layer.is_training = False
        conv.train(), model.train()
    switch = next(u for u in conv.fusedrc_plan.units if u.name == unit)
    switch.disable()
    assert layer.activation_fn is nn.functional.relu and "activation_fn" not in layer._modules
    switch.enable()
    assert isinstance(layer._modules["activation_fn"], nn.Module) and "activation_fn" not in layer.__dict__
    again = fusedrc.convert(conv)  # planned afresh: the function back in its place first
    assert unit in again.fusedrc_plan.fused
    assert rel_err(out(again), ya) <= TOL
    with pytest.raises(TypeError, match="child module"):  # torch's error for a function over a child module
        layer.activation_fn = nn.functional.gelu
    del layer.activation_fn
    layer.activation_fn = nn.functional.gelu  # then the layer runs it, unfused
    with FusedOpLog() as log:
        y = out(conv)
    assert log.ops.count("fused_mlp") == fused_calls - 1
    model.pixel_level_module.decoder.encoder.layers[0].activation_fn = nn.functional.gelu
    assert rel_err(y, out(model)) <= TOL


# --------------------------------------------------------------------------- plain models
class _Net(nn.Module):
    """Not a Sequential: found by torch.fx."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)

    def forward(self, x):
        h = self.relu(self.bn(self.conv(x)))
        return self.fc2(self.act(self.fc1(h.mean((2, 3)))))


def test_fx_traced_model():
    torch.manual_seed(0)
    model = _Net().train()
    x = torch.randn(4, 3, 8, 8)
    conv = fusedrc.convert(model, example_inputs=(x,))
    assert sorted(u.kind for u in conv.fusedrc_plan.units) == ["conv_bn_relu", "ffn"]
    assert set(conv.state_dict()) == set(model.state_dict())
    _assert_same_step(model, conv, x)
    assert conv.fusedrc_plan.final_bytes < conv.fusedrc_plan.baseline_bytes


class _MaskedNet(nn.Module):
    """fx traces ``if mask is not None`` as taken: its graph is wrong for a call without mask."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x, mask=None):
        if mask is not None:
            x = x * mask
        return self.fc2(torch.relu(self.fc1(x)))


class _UnusedDefaultNet(_MaskedNet):
    def forward(self, x, return_dict=True):
        return self.fc2(torch.relu(self.fc1(x)))


class _VarArgsNet(_MaskedNet):
    def forward(self, *xs):
        return self.fc2(torch.relu(self.fc1(xs[0])))


class _Mlp(nn.Module):
    def __init__(self, gate=False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.up = nn.Linear(8, 32) if gate else None

    def forward(self, x):
        h = nn.functional.silu(self.fc1(x))
        return self.fc2(h * self.up(x) if self.up is not None else h)


class _DataDependentNet(nn.Module):
    """Does not trace (a branch on a tensor's value); its MLP submodules do."""

    def __init__(self):
        super().__init__()
        self.mlp, self.gated = _Mlp(), _Mlp(gate=True)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU())

    def forward(self, x):
        x = self.mlp(x)
        if x.sum() > 0:
            x = -x
        return self.head(self.gated(x))


class _FxGated(nn.Module):
    """Gated FFNs as a traceable model writes them: two Linears of one input (``split``; the method
    ``mul`` and a functional tanh GELU in ``split_method``, a SiLU written out in ``split_written``), or one
    Linear's output halves (``packed``:
    timm's GluMlp, the gate the second half; ``packed_first``: SwiGLUPacked's, the gate the first),
    after a LayerNorm whose only readers they are; a dropout of the product in ``split``."""

    def __init__(self, form, p=0.0):
        super().__init__()
        self.form, packed = form, form.startswith("packed")
        self.norm = nn.LayerNorm(12)
        self.fc1 = nn.Linear(12, 40 if packed else 20)
        self.up = None if packed else nn.Linear(12, 20)
        self.act, self.drop, self.fc2 = nn.SiLU(), nn.Dropout(p), nn.Linear(20, 12)

    def forward(self, x):
        v = self.norm(x)
        if self.form == "split":
            h = self.act(self.fc1(v)) * self.up(v)
        elif self.form == "split_method":
            h = self.up(v).mul(nn.functional.gelu(self.fc1(v), approximate="tanh"))
        elif self.form == "split_written":  # the gate's SiLU written out
            g = self.fc1(v)
            h = g * torch.sigmoid(g) * self.up(v)
        else:
            a, b = self.fc1(v).chunk(2, dim=-1)
            h = a * self.act(b) if self.form == "packed" else self.act(a) * b
        return self.fc2(self.drop(h))


@pytest.mark.parametrize("form, backend", [("split", "reference"), ("split_method", "reference"),
                                           ("split_written", "reference"), ("packed", "reference"),
                                           ("packed_first", "triton")])
def test_fx_finds_gated_ffns(form, backend):
    """The fx pass finds the gated FFN in each form of ``_FxGated`` (timm's SwiGLU, GluMlp and SwiGLUPacked are
    these forms), its norm inside the op: one fused gated FFN on the gate/up weights (a packed Linear's
    row halves, views), outputs and gradients the original's, fewer bytes kept; switched off, the
    original computation, bit for bit."""
    torch.manual_seed(0)
    dev = backend_device(backend)
    model = _FxGated(form).to(dev).train()
    conv = fusedrc.convert(model)
    plan = conv.fusedrc_plan
    assert [(u.name, u.kind) for u in plan.units] == [("fc1", "norm_gated_ffn")] and not plan.skipped
    x = torch.randn(3, 5, 12, device=dev)
    with fusedrc.use_backend(backend), FusedOpLog() as log:
        _assert_same_step(model, conv, x)
    twin = "_triton" if backend == "triton" else ""
    assert log.ops == [f"gated_mlp{twin}", f"gated_mlp_backward{twin}"]
    with SavedBytes() as a:
        model(x.clone().requires_grad_())
    with SavedBytes() as b:
        conv(x.clone().requires_grad_())
    assert b.bytes < a.bytes
    off = fusedrc.convert(model, policy=[])
    assert not off.fusedrc_plan.fused and torch.equal(off(x), model(x))


def test_fx_gated_ffn_dropout_and_lookalikes():
    """A training nn.Dropout of the gated product is the op's own dropout (its p handed to it); what only
    looks gated is not fused as one: an up projection of another input, or of one output (a broadcast
    gate), a product read twice, a chunk along another dimension; each still runs as written."""
    torch.manual_seed(0)
    model = _FxGated("split", p=0.25).train()
    conv = fusedrc.convert(model)
    assert [u.kind for u in conv.fusedrc_plan.units] == ["norm_gated_ffn"]
    x = torch.randn(3, 5, 12)
    calls, real = [], fusedrc.functional.gated_mlp
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fusedrc.functional, "gated_mlp", lambda *a, **k: calls.append(k["dropout_p"]) or real(*a, **k))
        conv(x)
        conv.eval()
        assert torch.equal(conv(x), conv(x)) and rel_err(conv(x), model.eval()(x)) <= TOL
    assert calls == [0.25, 0.0, 0.0, 0.0]

    class Lookalike(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.how, self.g = how, nn.Linear(8, 16)
            self.u = nn.Linear(8, 1 if how == "broadcast" else 16)
            self.d = nn.Linear(8 if how == "chunk0" else 16, 8)

        def forward(self, x):
            if self.how == "chunk0":
                a, b = self.g(x).chunk(2, dim=0)
                return self.d(nn.functional.silu(a) * b)
            p = nn.functional.silu(self.g(x)) * self.u(x.flip(0) if self.how == "other_input" else x)
            return self.d(p) + p.sum() if self.how == "read_twice" else self.d(p)

    for how in ("other_input", "broadcast", "read_twice"):
        model = Lookalike(how)
        conv = fusedrc.convert(model)
        assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("g", "linear_act")], how
        _assert_same_step(model, conv, torch.randn(4, 8))
    with pytest.warns(UserWarning, match="no pattern found"):
        assert not fusedrc.convert(Lookalike("chunk0")).fusedrc_plan.units


class _Written(nn.Module):
    """Activations a model writes out as elementwise ops: ESM's erf GELU after a Linear (its output read
    twice), a Swish after a BatchNorm, and a GELU whose ops are followed by more (a scale: not an activation
    of its own, the GELU inside it is)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 24), nn.Linear(24, 8)
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 16)

    def forward(self, img):
        y = self.bn(self.conv(img))
        y = y * torch.sigmoid(y)  # Swish
        h = self.fc1(y.mean((2, 3)))
        h = h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0)))  # ESM's gelu
        h = self.fc2(h)
        g = self.head(h)
        return 2.0 * (0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * torch.pow(g, 3.0)))))


def test_fx_finds_activations_written_out(tmp_path):
    """The fx pass knows an activation written out as elementwise ops by what it computes (checked on a
    float64 probe): Conv-BN-Swish, an FFN with ESM's GELU, a Linear with the tanh GELU followed by a scale
    (the scale runs as written); outputs and gradients the original's within rounding, fewer bytes; switched
    off, the ops as written, bit for bit."""
    torch.manual_seed(0)
    model = _Written().train()
    conv = fusedrc.convert(model)
    plan = conv.fusedrc_plan
    assert [(u.name, u.kind) for u in plan.units] == [("conv", "conv_bn_act"), ("fc1", "ffn"), ("head", "linear_act")]
    fx = [m for m in conv.__dict__.values() if type(m).__name__ == "_FxFused"]
    acts = sorted(m.fused for f in fx for m in f.__dict__["_fusedrc_fixed"].values() if hasattr(m, "fused"))
    assert acts == ["gelu", "gelu_tanh", "silu"]
    x = torch.randn(4, 3, 6, 6)
    with FusedOpLog() as log:
        _assert_same_step(model, conv, x)
    assert sorted(set(log.ops)) == ["conv_bn_act", "conv_bn_act_backward", "fused_mlp", "fused_mlp_backward",
                                    "linear_act", "linear_act_backward"]
    with SavedBytes() as a:
        model(x.clone().requires_grad_())
    with SavedBytes() as b:
        conv(x.clone().requires_grad_())
    assert b.bytes < 0.7 * a.bytes
    off = fusedrc.convert(model, policy=[])
    assert not off.fusedrc_plan.fused and torch.equal(off(x), model(x))
    # the recorded ops travel with the model: a saved and loaded copy, a deep copy
    path = tmp_path / "written.pt"
    torch.save(conv, path)
    for twin in (torch.load(path, weights_only=False), copy.deepcopy(conv)):
        assert torch.equal(twin(x), conv(x))


def test_fx_written_ops_that_are_no_activation():
    """Elementwise ops after a Linear that compute no fused activation (a sigmoid gate, a product with
    another tensor, a cube) are left as they are: no unit, the same results."""
    class Near(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            h = h * torch.sigmoid(2.0 * h)  # not quick_gelu's 1.702
            k = self.b(h) * torch.sigmoid(x)  # another tensor in it
            c = self.c(k)
            return c * c * c

    torch.manual_seed(0)
    model = Near()
    with pytest.warns(UserWarning, match="no pattern found"):
        conv = fusedrc.convert(model)
    assert not conv.fusedrc_plan.units
    x = torch.randn(3, 8)
    assert torch.equal(conv(x), model(x))


def test_fx_graph_must_hold_without_the_defaulted_arguments():
    """A forward whose fx graph changes when a defaulted argument is left out is not rewritten
    (the rewrite used to fail on model(x) once traced as model(x, mask)); an argument the graph
    does not depend on is fine, with and without it; *args forwards are left alone."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = _MaskedNet()
    with pytest.warns(UserWarning, match="no pattern found"):
        conv = fusedrc.convert(model)
    assert any("defaulted arguments (mask)" in r for _, r in conv.fusedrc_plan.skipped)
    assert torch.equal(conv(x), model(x)) and torch.equal(conv(x, x), model(x, x))
    model = _UnusedDefaultNet()
    conv = fusedrc.convert(model)
    assert conv.fusedrc_plan.fused == ["fc1"]
    assert rel_err(conv(x), model(x)) <= TOL and rel_err(conv(x, return_dict=False), model(x)) <= TOL
    with pytest.warns(UserWarning, match="no pattern found"):
        conv = fusedrc.convert(_VarArgsNet())
    assert any("*args" in r for _, r in conv.fusedrc_plan.skipped)


class _ContextNet(nn.Module):
    """An FFN whose forward runs part of its work under another grad mode / autocast state, or
    recomputes it: torch.fx records none of that."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc1, self.fc2, self.side = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 8)

    def ffn(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def forward(self, x):
        if self.how == "no_grad":
            with torch.no_grad():
                t = self.side(x)
            return self.ffn(x) + t
        if self.how == "enable_grad":
            with torch.enable_grad():
                return self.ffn(x) + self.side(x)
        if self.how == "autocast_off":
            with torch.autocast("cpu", enabled=False):
                return self.ffn(x).float() + self.side(x.float())
        if self.how == "cuda_autocast_off":  # converted on a CPU machine, run under CUDA AMP later
            with torch.autocast("cuda", enabled=False):
                return self.ffn(x) + self.side(x)
        if self.how == "recompute":
            return fusedrc.recompute(self.ffn, x) + self.side(x)
        return torch.utils.checkpoint.checkpoint(self.ffn, x, use_reentrant=False) + self.side(x)


@pytest.mark.parametrize("how", ["no_grad", "enable_grad", "autocast_off", "cuda_autocast_off", "recompute",
                                 "checkpoint"])
def test_fx_leaves_forwards_with_grad_autocast_or_recompute_contexts(how):
    """fx would drop a no_grad / enable_grad / autocast block or a recompute/checkpoint call from the
    graph: such a forward is not rewritten, and the converted model behaves as the original (grads,
    dtypes under autocast, requires_grad under no_grad, bytes kept)."""
    torch.manual_seed(0)
    model = _ContextNet(how)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no pattern found"
        conv = fusedrc.convert(model)
    assert "forward" not in conv.__dict__
    assert any("does not record" in r for _, r in conv.fusedrc_plan.skipped), conv.fusedrc_plan.skipped
    x = torch.randn(4, 8, requires_grad=True)
    assert saved_bytes(conv, (x,)) == saved_bytes(model, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv(x).dtype == model(x).dtype
    with torch.no_grad():
        assert conv(x).requires_grad == model(x).requires_grad
    conv(x).sum().backward()
    model(x).sum().backward()
    for (name, p), q in zip(conv.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad), name


def test_blocks_policy_without_known_blocks_warns():
    """policy="blocks" on a model with fused units but no block any rule knows: a warning says so."""
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    with pytest.warns(UserWarning, match="found no block it knows"):
        conv = fusedrc.convert(model, policy="blocks")
    assert conv.fusedrc_plan.fused == ["0"] and not conv.fusedrc_plan.recomputed_blocks


def test_fx_keeps_marked_and_converted_modules_as_calls():
    """Modules marked by the user, and an already converted model converted again: the fx rewrite
    of their parent calls them (their recompute stays), it does not inline their plain computation."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

        def forward(self, x):
            return torch.sigmoid(self.b1(self.c1(x))) * x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.blocks = nn.ModuleList([Block() for _ in range(2)])

        def forward(self, x):
            x = torch.relu(self.bn(self.stem(x)))
            for b in self.blocks:
                x = b(x)
            return x.mean((2, 3))

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    model = Net()
    for b in model.blocks:
        fusedrc.mark(b)
    marked = saved_bytes(model, (x,))
    conv = fusedrc.convert(model)
    assert all(_is_marked(b) for b in conv.blocks)
    assert conv.fusedrc_plan.fused == ["stem"]  # the parent's rewrite fused its stem and kept the blocks' calls
    assert saved_bytes(conv, (x,)) < marked
    with pytest.warns(UserWarning, match="already marked"):  # the stem is planned afresh, the marks kept
        again = fusedrc.convert(conv)
    assert again.fusedrc_plan.fused == ["stem"] and all(_is_marked(b) for b in again.blocks)
    assert saved_bytes(again, (x,)) == saved_bytes(conv, (x,))


def test_fx_rewrites_the_traceable_submodules_of_an_untraceable_model():
    torch.manual_seed(0)
    model = _DataDependentNet().train()
    x = torch.randn(6, 8)
    conv = fusedrc.convert(model, example_inputs=(x,))
    plan = conv.fusedrc_plan
    assert [(u.name, u.kind) for u in plan.units] == [
        ("head.0", "linear_act"), ("mlp.fc1", "ffn"), ("gated.fc1", "gated_ffn")]
    assert not plan.skipped and type(conv.mlp) is _Mlp and list(conv.state_dict()) == list(model.state_dict())
    assert _fused_ops(conv, x) == ["fusedrc.fused_mlp.default", "fusedrc.gated_mlp.default",
                                   "fusedrc.linear_act.default"]
    _assert_same_step(model, conv, x)
    assert plan.final_bytes < plan.baseline_bytes
    # a DataParallel replica's submodule forward runs on the replica's parameters
    replica = replicate_on_cpu(conv, scale=2.0)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(2)
    assert rel_err(replica(x), ref(x)) <= TOL
    # an untraceable model with no pattern below says why; fx traces the class's forward, so
    # modules with an instance forward are left alone
    model = _DataDependentNet()
    model.mlp.fc2, model.gated.fc2, model.head = nn.Identity(), nn.Identity(), nn.Identity()
    model.mlp.forward = model.gated.forward = lambda x: x
    with pytest.warns(UserWarning, match="no pattern found"):
        plan = fusedrc.convert(model).fusedrc_plan
    assert not plan.units and [r for _, r in plan.skipped if "cannot trace _DataDependentNet" in r]


def test_sequential_patterns_and_dropout_report():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten()),
        nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.0), nn.Linear(32, 8)),
        nn.Sequential(nn.Linear(8, 16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Dropout(0.2), nn.Linear(32, 16)),
    ).train()
    x = torch.randn(4, 3, 8, 8)
    with pytest.warns(UserWarning, match=r"other than one nn.Dropout"):
        conv = fusedrc.convert(model, example_inputs=(x,), verbose=True)
    plan = conv.fusedrc_plan
    assert [(u.name, u.kind) for u in plan.units] == [("0.0", "conv_bn_relu"), ("1.0", "ffn"), ("2.0", "linear_act")]
    assert plan.skipped[0][0] == "3.0"
    assert list(conv.state_dict()) == list(model.state_dict())
    assert isinstance(conv[0], nn.Sequential) and type(conv[3]) is nn.Sequential  # the dropout FFN is untouched
    torch.manual_seed(3)
    xa = x.clone().requires_grad_()
    ya = model(xa)
    torch.manual_seed(3)
    xb = x.clone().requires_grad_()
    yb = conv(xb)
    assert rel_err(yb, ya) <= TOL
    ya.square().sum().backward()
    yb.square().sum().backward()
    _assert_close_models(model, conv)


def test_no_pattern_warns_and_is_unchanged(capsys):
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    with pytest.warns(UserWarning, match="no pattern found"):
        conv = fusedrc.convert(model, verbose=True)
    assert type(conv) is nn.Sequential and not conv.fusedrc_plan.units
    assert "fusedrc.convert plan" in capsys.readouterr().out
    x = torch.randn(2, 4)
    assert torch.equal(conv(x), model(x))


def test_argument_errors():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with pytest.raises(ValueError, match="example_inputs"):
        fusedrc.convert(model, memory_budget=0.5)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        fusedrc.convert(model, memory_budget=1.5, example_inputs=(torch.randn(2, 4),))
    with pytest.raises(TypeError, match="tuple"):
        fusedrc.convert(model, memory_budget=0.5, example_inputs=torch.randn(2, 4))
    with pytest.raises(ValueError, match="policy"):
        fusedrc.convert(model, policy="some")
    with pytest.raises(TypeError, match="nn.Module"):
        fusedrc.convert(lambda x: x)
    # an int budget is bytes
    x = torch.randn(2, 4)
    conv = fusedrc.convert(model, memory_budget=10**9, example_inputs=(x,))
    assert not conv.fusedrc_plan.fused  # already within budget: nothing recomputed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fusedrc.convert(model)


class _FunctionalNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.b, self.l = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 8)

    def forward(self, x):
        return torch.relu(self.l(nn.functional.relu(self.b(self.c(x))).mean((2, 3))))


class _InplaceActNet(nn.Module):
    """torchvision's GoogLeNet/Inception BasicConv2d: F.relu(bn(conv(x)), inplace=True); and an
    in-place ReLU on a BN output something else reads too (not fused: its other reader would see
    the ReLU's result)."""

    def __init__(self):
        super().__init__()
        # no conv bias: BatchNorm cancels it, its gradient is rounding noise around 0
        self.c, self.b = nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4)
        self.c2, self.b2 = nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x):
        y = nn.functional.relu(self.b(self.c(x)), inplace=True)
        z = self.b2(self.c2(y))
        return nn.functional.relu(z, inplace=True) + z


def test_fx_functional_activations():
    torch.manual_seed(0)
    model = _FunctionalNet().train()
    conv = fusedrc.convert(model)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("c", "conv_bn_relu"), ("l", "linear_act")]
    x = torch.randn(2, 3, 8, 8)
    _assert_same_step(model, conv, x, loss=torch.sum)
    model = _InplaceActNet().train()
    conv = fusedrc.convert(model)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("c", "conv_bn_relu"), ("c2", "conv_bn")]
    _assert_same_step(model, conv, x, loss=torch.sum)


# --------------------------------------------------------------------------- nn.DataParallel
def _fused_ops(model, x):
    with GemmCounter() as counter:
        model(x)
    return sorted(op for op in counter.ops if op.startswith("fusedrc."))


@pytest.mark.parametrize("build", ["fx", "fx_marked", "sequential"])
def test_data_parallel_replica_runs_fused_on_its_own_parameters(build):
    """nn.DataParallel's replicate builds each replica from a copy of the module's __dict__, then
    sets its children and parameters (emulated on the CPU, replica parameters = 2 x the original's):
    a replica of a converted model runs the same fused ops, on its own parameters."""
    torch.manual_seed(0)
    if build == "sequential":
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(), nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    else:
        model = _Net()
    model.train()
    conv = fusedrc.convert(model)
    if build == "fx_marked":
        fusedrc.mark(conv)
    x = torch.randn(4, 3, 8, 8)
    replica = replicate_on_cpu(conv, scale=2.0)
    ops = _fused_ops(conv, x)
    assert _fused_ops(replica, x) == ops
    assert bool(ops) == (build != "fx_marked")  # inside mark's recompute region the units run plain
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(2)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), replica(xb)
    assert rel_err(yb, ya) <= TOL
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert rel_err(xb.grad, xa.grad) <= TOL
    # d/dp of f(2p) = 2 f'(2p); an absolute floor for the conv bias before BN (zero in theory)
    for (n, p), q in zip(ref.named_parameters(), conv.parameters()):
        assert (q.grad - 2 * p.grad).norm() <= TOL * (2 * p.grad).norm() + 1e-5, n
    assert all(p.grad is None for p in model.parameters())


def test_unmark_keeps_converts_replica_hook_and_a_marked_root_is_not_rewritten():
    """mark then unmark on a fused Sequential leaves convert's replica hook (its replicas stay fused);
    convert leaves a marked root as it is (no fx rewrite under the mark)."""
    torch.manual_seed(0)
    conv = fusedrc.convert(nn.Sequential(nn.Linear(6, 16, bias=False), nn.ReLU(), nn.Linear(16, 6)))
    x = torch.randn(3, 6)
    fusedrc.unmark(fusedrc.mark(conv))
    assert _fused_ops(replicate_on_cpu(conv), x) == _fused_ops(conv, x) == ["fusedrc.fused_mlp.default"]
    marked = fusedrc.mark(_Net().train())
    with pytest.warns(UserWarning):
        out = fusedrc.convert(marked)
    assert not out.fusedrc_plan.units and type(out.__dict__["forward"]).__name__ == "_MarkedForward"
    fusedrc.unmark(out)
    assert "forward" not in out.__dict__ and "_replicate_for_data_parallel" not in out.__dict__


@pytest.mark.parametrize("key", ["fc2", "activation_fn"])
def test_opt_marked_stand_in_runs_the_layer_as_it_is(key):
    """A fusedrc.mark put on an inlined FFN's fc2 or activation slot after convert: the head does not fuse
    (a marked stand-in is called through its mark, not from the layer's forward, and would not pass
    through), so the layer computes what the original does."""
    tr = _transformers()
    cfg = tr.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                       max_position_embeddings=32, dropout=0.0)
    torch.manual_seed(0)
    model = tr.OPTModel(cfg).eval()
    conv = fusedrc.convert(model)
    fusedrc.mark(getattr(conv.decoder.layers[0], key))
    ids = torch.randint(3, 64, (1, 5))
    with FusedOpLog() as log:
        out = conv(ids).last_hidden_state
    assert "fused_mlp" not in log.ops and rel_err(out, model(ids).last_hidden_state) <= TOL


def test_data_parallel_replica_of_an_inlined_ffn_runs_fused():
    """OPT's FFN is inlined in the decoder layer: replicate builds each module's replica before its
    siblings', so the stand-ins find each other through the layer calling them, at run time. A
    replica runs the fused FFN on its own parameters, with its own pass-through flags."""
    transformers = _transformers()
    cfg = transformers.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                 num_attention_heads=2, max_position_embeddings=32, dropout=0.0,
                                 attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    layer = transformers.models.opt.modeling_opt.OPTDecoderLayer(cfg).train()
    conv = fusedrc.convert(layer, policy=["fc1"])
    replica = replicate_on_cpu(conv, scale=2.0)
    assert type(replica.fc1).__name__ == "_FFNHead" and replica.fc2 is not conv.fc2
    ref = copy.deepcopy(layer)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(2)
    x = torch.randn(2, 5, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with FusedOpLog() as log:
        y = replica(x)[0]
        y.square().sum().backward()
    assert log.ops == ["fused_mlp", "fused_mlp_backward"]
    yr = ref(xr)[0]
    yr.square().sum().backward()
    assert rel_err(y, yr) <= TOL and rel_err(x.grad, xr.grad) <= TOL
    flags = [m.__dict__["_fusedrc_pass"] for net in (conv, replica) for m in (net.activation_fn, net.fc2)]
    assert len({id(f) for f in flags}) == 4 and not any(f.armed for f in flags)  # none left armed
    with FusedOpLog() as log:
        assert torch.equal(conv(x)[0], conv(x)[0])  # the original still runs, fused
    assert log.ops == ["fused_mlp", "fused_mlp"]
    # called by hand, the replica's stand-ins are the plain modules, as the original's
    h = torch.randn(3, 16)
    torch.testing.assert_close(replica.fc1(h), torch.nn.functional.linear(h, 2 * layer.fc1.weight, 2 * layer.fc1.bias))


def test_opt_inlined_ffn_compiles_fused_without_graph_breaks():
    """Under torch.compile the stand-ins read no frames (dynamo inlines the layer's forward): the
    graph holds one fused FFN per layer, no break the original has not (none on transformers 5.24;
    5.17's OPT breaks 3 times by itself), the eager outputs and gradients, no flag left armed.
    Where the original breaks in its decoder's loop (5.17), dynamo runs that frame eagerly and compiles
    each module it calls as a frame of its own: torch.nn's modules are skipped there, fusedrc's
    recomputed norms are not, so each such norm is one graph more (torch 2.11 counts it as a break)."""
    original = _opt(num_hidden_layers=1)
    conv = fusedrc.convert(original)
    ids = torch.randint(0, 128, (2, 7))
    own = torch._dynamo.explain(original)(ids)
    own_breaks = own.graph_break_count
    torch._dynamo.reset()
    with fusedrc.use_backend("reference"):
        eager = conv(ids).logits
        eager_grads = torch.autograd.grad(eager.square().sum(), list(conv.parameters()))
        explained = torch._dynamo.explain(conv)(ids)
        torch._dynamo.reset()
        compiled = torch.compile(conv, backend="aot_eager")(ids).logits
        grads = torch.autograd.grad(compiled.square().sum(), list(conv.parameters()))
    torch._dynamo.reset()

    def norm_only_graphs(e):
        calls = [[str(n.target) for n in g.graph.nodes if n.op.startswith("call")] for g in e.graphs]
        return sum(bool(c) and all("layer_norm" in t for t in c) for c in calls)

    extra = norm_only_graphs(explained) - norm_only_graphs(own)
    assert explained.graph_break_count == own_breaks + extra and (extra == 0 or own_breaks > 0)
    assert sum("fused_mlp" in str(n.target) for g in explained.graphs for n in g.graph.nodes) == 1
    assert rel_err(compiled, eager) <= TOL and all(rel_err(a, b) <= TOL for a, b in zip(grads, eager_grads))
    assert not any(m.__dict__["_fusedrc_pass"].armed for m in conv.modules() if "_fusedrc_pass" in m.__dict__)


# --------------------------------------------------------------------------- the converted object
def test_inplace_rewrites_the_given_object():
    """inplace=True converts the object handed in, the root included, and a hook handle taken
    before still removes its hook."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.randn(8, 16, requires_grad=True)
    before = saved_bytes(seq, (x,))
    assert fusedrc.convert(seq, inplace=True) is seq
    assert seq.fusedrc_plan.fused == ["0"] and saved_bytes(seq, (x,)) < before
    model = _resnet("resnet18").train()
    calls = []
    handle = model.layer1[0].register_forward_hook(lambda *a: calls.append(1))
    block = model.layer1[0]
    assert fusedrc.convert(model, inplace=True) is model
    assert model.layer1[0] is block and "conv1" in model.fusedrc_plan.fused  # the stem too
    handle.remove()
    model(torch.randn(2, 3, 32, 32))
    assert not calls and not block._forward_hooks


def test_a_model_torch_cannot_copy_gets_a_clear_error():
    """A module holding a tensor computed with autograd (Hugging Face's RecurrentGemma keeps its
    recurrent state so) cannot be deep-copied: convert says which tensor and what to do;
    inplace=True converts it."""
    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.ffn = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
            self.state = None

        def forward(self, x):
            self.state = x * 2
            return self.ffn(x)

    model = Stateful()
    model(torch.randn(2, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"cannot deep-copy Stateful\.state.*inplace=True"):
        fusedrc.convert(model)
    assert fusedrc.convert(model, inplace=True).fusedrc_plan.fused == ["ffn.0"]


def test_converted_model_pickles_and_copies(tmp_path):
    """torch.save / torch.load round trip; a deep copy's plan switches the copy's units."""
    torch.manual_seed(0)
    model = _resnet("resnet18").train()
    conv = fusedrc.convert(model)
    path = tmp_path / "m.pt"
    torch.save(conv, path)
    back = torch.load(path, weights_only=False)
    x = torch.randn(2, 3, 32, 32)
    _assert_same_step(model, back, x, loss=torch.sum)
    assert back.fusedrc_plan.fused == conv.fusedrc_plan.fused
    twin = copy.deepcopy(conv)
    twin.fusedrc_plan.units[0].disable()
    assert not twin.sites["conv1"].enabled and conv.sites["conv1"].enabled


def test_video_resnet_blocks_are_not_matched():
    _resnet("resnet18")
    from torchvision.models.video import r3d_18

    model = r3d_18(num_classes=4)
    with pytest.warns(UserWarning, match="no pattern found"):
        conv = fusedrc.convert(model)
    assert not conv.fusedrc_plan.units


def test_opt_hooks_after_convert_see_the_original_tensors():
    """A hook registered on a fused FFN's fc1 / activation / fc2 after convert sees what it would see
    unconverted (the FFN then runs split for that call), and a hook editing fc1's output counts."""
    model = _opt().eval()
    conv = fusedrc.convert(model)
    ids = torch.randint(0, 128, (2, 8))

    def run(m, edit=False):
        seen, layer = {}, m.model.decoder.layers[0]
        hooks = [layer.fc1.register_forward_hook(lambda mod, i, o: seen.__setitem__("fc1", o.clone())),
                 layer.activation_fn.register_forward_hook(lambda mod, i, o: seen.__setitem__("act", o.clone())),
                 layer.fc2.register_forward_pre_hook(lambda mod, i: seen.__setitem__("fc2_in", i[0].clone()))]
        if edit:
            hooks.append(layer.fc1.register_forward_hook(lambda mod, i, o: o * 0.5))
        out = m(ids).logits
        for h in hooks:
            h.remove()
        return out, seen

    for edit in (False, True):
        (ya, sa), (yb, sb) = run(model, edit), run(conv, edit)
        assert rel_err(yb, ya) <= TOL
        assert sa.keys() == sb.keys() == {"fc1", "act", "fc2_in"}
        for k in sa:
            assert sb[k].shape == sa[k].shape and rel_err(sb[k], sa[k]) <= TOL, k
    # without hooks the fused path is back
    assert rel_err(conv(ids).logits, model(ids).logits) <= TOL


def test_opt_ffn_modules_called_alone_are_the_plain_modules():
    """Outside the layer's forward, fc1 / activation_fn / fc2 of a fused OPT FFN compute what they
    did unconverted; the layer's own calls stay fused, before and after."""
    model = _opt().eval()
    conv = fusedrc.convert(model)
    ids = torch.randint(0, 128, (2, 8))
    layer, plain = conv.model.decoder.layers[0], model.model.decoder.layers[0]
    x = torch.randn(3, 64)
    h = layer.fc1(x)
    assert h.shape == (3, 256) and torch.equal(h, plain.fc1(x))
    assert torch.equal(layer.activation_fn(h), plain.activation_fn(h))
    assert torch.equal(layer.fc2(h), plain.fc2(h))
    calls = []
    with FusedOpLog(calls):
        out = conv(ids).logits
    assert calls.count("fused_mlp") == 2 and rel_err(out, model(ids).logits) <= TOL
    # a probe calling fc1 by hand from a hook on the layer (another forward on the stack)
    handle = layer.register_forward_hook(lambda mod, i, o: calls.append(tuple(mod.fc1(i[0]).shape)))
    calls.clear()
    with FusedOpLog(calls):
        conv(ids)
    handle.remove()
    assert (2, 8, 256) in calls and calls.count("fused_mlp") == 2


def test_opt_blocks_with_kv_cache_run_plainly():
    """policy="blocks" with use_cache=True: a layer handed a KV cache is not recomputed (a rerun
    would update the cache twice); loss, gradients and the returned cache match."""
    model = _opt(use_cache=True)
    conv = fusedrc.convert(model, policy="blocks")
    ids = torch.randint(0, 128, (2, 8))
    oa = model(ids, labels=ids)
    with pytest.warns(UserWarning, match="KV cache"):
        ob = conv(ids, labels=ids)
    assert rel_err(ob.loss, oa.loss) <= TOL
    oa.loss.backward()
    ob.loss.backward()
    _assert_close_models(model, conv)
    assert ob.past_key_values.get_seq_length() == oa.past_key_values.get_seq_length() == 8


def test_sequential_slices_and_edits_stay_correct():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 16), nn.ReLU())
    conv = fusedrc.convert(seq)
    x = torch.randn(4, 8)
    assert type(conv[0:3]) is nn.Sequential and rel_err(conv[0:3](x), seq[0:3](x)) <= TOL
    first = nn.Linear(8, 8)
    seq.insert(0, first)
    conv.insert(0, first)  # the groups' modules moved: they run plainly, correctly
    assert rel_err(conv(x), seq(x)) <= TOL
    del seq[0], conv[0]
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    seq(xa).sum().backward()
    conv(xb).sum().backward()
    _assert_close_models(seq, conv)


class _TrainingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.p = 0.5

    def forward(self, x):
        x = nn.functional.dropout(x, self.p, training=self.training)
        return self.fc2(torch.relu(self.fc1(x)))


class _MethodNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale

    def describe(self):
        return "method kept"


def test_fx_keeps_the_model_and_its_modes(monkeypatch):
    """The fx rewrite keeps the model's class, methods, attributes and live buffers. A forward that
    reads self.training (fx would freeze the mode) gets one rewritten graph per mode, picked at
    each call; with the modes of the modules it inlines at odds, the class's forward runs."""
    torch.manual_seed(0)
    model = _TrainingNet().train()
    conv = fusedrc.convert(model)
    assert conv.fusedrc_plan.fused == ["fc1"]
    ps = _spy_dropout_p(monkeypatch, "fused_mlp")
    x = torch.randn(4, 8)
    for mode in (True, False):
        torch.manual_seed(1)
        ref = model.train(mode)(x)
        torch.manual_seed(1)
        assert torch.equal(conv.train(mode)(x), ref)  # the input's dropout drew the same mask
        assert len(ps) == 1 and ps.pop() == 0.0  # the FFN ran fused in both modes
    assert not torch.equal(model.train()(x), model.eval()(x))  # the modes do differ
    inner = _TrainingNet()
    outer = nn.Sequential(nn.Identity(), inner)  # fx inlines `inner` into the outer graph
    outer[1].load_state_dict(model.state_dict())
    conv = fusedrc.convert(outer)
    assert conv.fusedrc_plan.fused == ["1.fc1"]
    conv.train()
    conv[1].eval()  # inlined, and now in another mode than the graph the root's mode picks
    assert torch.equal(conv(x), inner.eval()(x)) and not ps  # the class's forward ran, unfused
    conv.train()
    torch.manual_seed(2)
    ref = inner.train()(x)
    torch.manual_seed(2)
    assert torch.equal(conv(x), ref) and ps == [0.0]
    model = _MethodNet()
    conv = fusedrc.convert(model)
    assert type(conv) is _MethodNet and conv.describe() == "method kept"
    assert conv.fusedrc_plan.fused == ["fc1"]
    conv.scale.fill_(3.0)
    model.scale.fill_(3.0)
    conv.double()
    model.double()
    assert rel_err(conv(x.double()), model(x.double())) <= TOL
    back = copy.deepcopy(conv)
    assert back.fusedrc_plan.fused == ["fc1"] and rel_err(back(x.double()), model(x.double())) <= TOL


def test_policy_entry_matching_nothing_warns_and_numpy_budget():
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    with pytest.warns(UserWarning, match=r"policy entries \['fc9'\] match no fusable unit"):
        conv = fusedrc.convert(seq, policy=["0", "fc9"])
    assert conv.fusedrc_plan.fused == ["0"]
    x = torch.randn(16, 8)
    conv = fusedrc.convert(seq, memory_budget=np.float32(0.5), example_inputs=(x,))
    assert conv.fusedrc_plan.final_bytes <= 0.5 * conv.fusedrc_plan.baseline_bytes
    conv = fusedrc.convert(seq, memory_budget=np.int64(10**9), example_inputs=(x,))
    assert conv.fusedrc_plan.target_bytes == 10**9


class _RuleTestBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x))) * 2


def test_register_rule_from_the_package_namespace():
    """The README's way to add a rule: @fusedrc.register_rule on a Wrapper-based rewrite."""
    from fusedrc.convert import _RULES, Wrapper, _cbr, _declare_cbr

    class FusedRuleTestBlock(Wrapper):
        def forward(self, x):
            return _cbr(self.sites.get("conv"), self.conv, self.bn, self.act, x) * 2

    @fusedrc.register_rule("_RuleTestBlock")
    def rule(ctx, name, m):
        new = FusedRuleTestBlock.wrap(m)
        _declare_cbr(ctx, new, name, "conv", m.conv, m.bn, m.act)
        ctx.block(name, new)
        return new

    try:
        torch.manual_seed(0)
        model = nn.Sequential(_RuleTestBlock(), nn.Flatten()).train()
        conv = fusedrc.convert(model)
        assert conv.fusedrc_plan.fused == ["0.conv"]
        _assert_same_step(model, conv, torch.randn(2, 3, 6, 6))
    finally:
        del _RULES["_RuleTestBlock"]


def test_saved_bytes_counts_each_storage_once():
    """A buffer saved as itself and as a reshaped view is one buffer (OPT's attention does this)."""

    class TwoViews(nn.Module):
        def forward(self, x):
            h = x * 2
            return (h.sin() + h.reshape(-1).cos().reshape(h.shape)).sum()

    x = torch.randn(4, 8, 16, requires_grad=True)
    nbytes = x.numel() * x.element_size()
    assert saved_bytes(TwoViews(), (x,)) == nbytes  # h, saved by sin and (as a view) by cos


class _DropNet(nn.Module):
    """An FFN with dropout between its layers, found by torch.fx."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.drop, self.fc2 = nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 8)),
    _DropNet,
], ids=["sequential", "fx"])
def test_ffn_dropout_is_fused(make):
    torch.manual_seed(0)
    model = make().train()
    x = torch.randn(5, 8)
    conv = fusedrc.convert(model, example_inputs=(x,))
    assert [u.kind for u in conv.fusedrc_plan.units] == ["ffn"] and not conv.fusedrc_plan.skipped
    fc1, fc2 = (model[0], model[3]) if isinstance(model, nn.Sequential) else (model.fc1, model.fc2)
    torch.manual_seed(2)
    y = conv(x)
    torch.manual_seed(2)
    ref = fusedrc.functional.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, "gelu", dropout_p=0.3)
    assert torch.equal(y, ref) and (y != model.eval()(x)).any()
    conv.eval()
    assert torch.equal(conv(x), model(x))


def test_import_torchvision_missing_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"torchvision is not installed: pip install"):
        _import_torchvision()


@pytest.mark.parametrize("act, fused", [
    ("GELUActivation", "gelu"), ("NewGELUActivation", "gelu_tanh"), ("FastGELUActivation", "gelu_tanh"),
    ("AccurateGELUActivation", "gelu_tanh"), ("bloom.modeling_bloom.BloomGelu", "gelu_tanh"),
    ("QuickGELUActivation", "quick_gelu"), ("ClippedGELUActivation", None),
])
def test_hugging_face_activations(monkeypatch, act, fused):
    """Hugging Face's activation modules: the tanh GELU written out three ways (and Bloom's) is the
    fused gelu_tanh (equal to fp32 rounding), CLIP's QuickGELU the fused quick_gelu; one with no
    fused form is reported, not fused."""
    import importlib

    _transformers()
    path, _, cls = act.rpartition(".")
    module = importlib.import_module(f"transformers.models.{path}" if path else "transformers.activations")
    torch.manual_seed(0)
    act_mod = getattr(module, cls)(-1.0, 1.0) if cls == "ClippedGELUActivation" else getattr(module, cls)()
    seq = nn.Sequential(nn.Linear(8, 32), act_mod, nn.Linear(32, 8))
    conv = fusedrc.convert(seq) if fused else None
    if fused is None:
        with pytest.warns(UserWarning, match="no pattern found"):
            conv = fusedrc.convert(seq)
        assert conv.fusedrc_plan.fused == [] and "no fused form" in conv.fusedrc_plan.skipped[0][1]
        return
    assert conv.fusedrc_plan.fused == ["0"] and conv.fusedrc_plan.units[0].kind == "ffn"
    acts, real = [], fusedrc.functional.fused_mlp
    monkeypatch.setattr(fusedrc.functional, "fused_mlp", lambda *a, **k: acts.append(a[5]) or real(*a, **k))
    x = torch.randn(16, 8) * 3
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = seq(xa), conv(xb)
    assert acts == [fused] and rel_err(yb, ya) <= TOL
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert rel_err(xb.grad, xa.grad) <= TOL
    _assert_close_models(seq, conv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma3_norms_are_all_recomputed(dtype):
    """Gemma 3 has six RMSNorms a layer (times 1 + weight): the pre-FFN one runs inside the fused
    gated FFN, the others (input, post-attention, post-FFN, per-head q/k) and the final norm are
    recomputed. Outputs equal the original's bit for bit, gradients within rounding (bit for bit in
    bfloat16, where each norm reads its input once, through its float32 copy)."""
    tr = _transformers()
    torch.manual_seed(0)
    cfg = tr.Gemma3TextConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False,
                              attn_implementation="eager")
    model = tr.Gemma3ForCausalLM(cfg).to(dtype).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.3)  # Gemma's norm weights start at 0 (a scale of 1)
    conv = fusedrc.convert(model)
    plan = conv.fusedrc_plan
    assert [u.kind for u in plan.units if u.kind != "norm"] == ["norm_gated_ffn"] * 2 and not plan.skipped
    assert len(norm_units(plan)) == 2 * 5 + 1
    ids = torch.randint(3, 100, (2, 12))
    outs = []
    for m in (model, conv):
        m.zero_grad()
        with SavedBytes() as saved:
            y = m(ids).logits
        y.float().square().mean().backward()
        outs.append((y, {n: p.grad for n, p in m.named_parameters()}, saved.bytes))
    (ya, ga, bytes_a), (yb, gb, bytes_b) = outs
    assert torch.equal(ya, yb) and ga.keys() == gb.keys()
    for n in ga:
        if dtype == torch.bfloat16:
            assert torch.equal(ga[n], gb[n]), n
        else:
            assert rel_err(gb[n], ga[n]) <= 1e-5, n
    assert bytes_b < 0.6 * bytes_a, (bytes_a, bytes_b)


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_gated_mlps_found_by_their_forward(family):
    """Llama-form MLPs of other classes (Qwen2: SiLU; Gemma: tanh GELU) become one fused gated FFN
    each, found by the module's forward, not its class name; outputs and gradients as before."""
    tr = _transformers()
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 10))
    common = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, use_cache=False)
    if family == "qwen2":
        model = tr.Qwen2ForCausalLM(tr.Qwen2Config(**common))
    else:
        model = tr.GemmaForCausalLM(tr.GemmaConfig(head_dim=8, hidden_act="gelu_pytorch_tanh", **common))
    model.train()
    conv = fusedrc.convert(model)
    plan = conv.fusedrc_plan
    assert fused_without_norms(plan) == [f"model.layers.{i}.mlp" for i in range(2)] and not plan.skipped
    # both families' pre-FFN norms (Qwen2's is Llama's, Gemma's times 1 + weight) run inside the op;
    # the other norms (each layer's input norm, the final one) are recomputed on their own
    assert all(u.kind == "norm_gated_ffn" for u in plan.units if u.kind != "norm")
    assert len(norm_units(plan)) == 3
    with SavedBytes() as a:
        ya = model(ids).logits
    with SavedBytes() as b:
        yb = conv(ids).logits
    assert b.bytes < a.bytes
    assert rel_err(yb, ya) <= TOL
    ya.square().mean().backward()
    yb.square().mean().backward()
    _assert_close_models(model, conv)


@pytest.mark.parametrize("family", ["recurrent_gemma", "t5gemma", "gte", "seed_oss"])
def test_gated_mlp_forms_with_a_local_or_a_dropout(family, monkeypatch):
    """Gated MLPs written otherwise than Llama's: RecurrentGemma's through a local variable, T5Gemma's
    and GTE's with an nn.Dropout of the gated product (the op's own dropout; GTE's down_proj has a
    bias), Seed-OSS's with F.dropout of the output (after the op). One fused gated FFN each: in eval
    its outputs and gradients are the module's; in training the dropout reaches the op (its p) or
    runs after it, and the output's expectation is the module's."""
    tr = _transformers()
    config_class = {"recurrent_gemma": "RecurrentGemmaConfig", "t5gemma": "T5GemmaModuleConfig", "gte": "GteConfig",
                    "seed_oss": "SeedOssConfig"}[family]
    if not hasattr(tr, config_class):
        pytest.skip(f"transformers {tr.__version__} has no {config_class}")
    torch.manual_seed(0)
    mods = tr.models
    if family == "recurrent_gemma":
        cfg = tr.RecurrentGemmaConfig(hidden_size=16, intermediate_size=48, hidden_activation="gelu_pytorch_tanh")
        mlp = mods.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaMlp(cfg)
    elif family == "t5gemma":
        cfg = tr.T5GemmaModuleConfig(hidden_size=16, intermediate_size=24, hidden_activation="gelu_pytorch_tanh",
                                     dropout_rate=0.25)
        mlp = mods.t5gemma.modeling_t5gemma.T5GemmaMLP(cfg)
    elif family == "gte":
        cfg = tr.GteConfig(hidden_size=16, intermediate_size=24, hidden_act="silu", hidden_dropout_prob=0.25)
        mlp = mods.gte.modeling_gte.GteMLP(cfg)
    else:
        cfg = tr.SeedOssConfig(hidden_size=16, intermediate_size=24, hidden_act="silu", residual_dropout=0.25)
        mlp = mods.seed_oss.modeling_seed_oss.SeedOssMLP(cfg)
    conv = fusedrc.convert(mlp)
    plan = conv.fusedrc_plan
    assert [(u.name, u.kind) for u in plan.units if u.selected] == [("", "gated_ffn")] and not plan.skipped
    x = torch.randn(3, 5, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    mlp.eval(), conv.eval()
    y, y_ref = conv(x), mlp(xr)
    assert rel_err(y, y_ref) <= TOL
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert rel_err(x.grad, xr.grad) <= TOL
    _assert_close_models(mlp, conv)
    conv.train()
    calls = []
    real = fusedrc.functional.gated_mlp
    monkeypatch.setattr(fusedrc.functional, "gated_mlp", lambda *a, **k: calls.append(k["dropout_p"]) or real(*a, **k))
    ones = torch.ones(4000, 16)
    with torch.no_grad():
        y_train, y_eval = conv(ones), mlp.eval()(ones)
    assert calls == [0.25 if family in ("t5gemma", "gte") else 0.0]
    if family == "recurrent_gemma":
        assert torch.equal(y_train, y_eval)
    else:  # inverted dropout: the same mean, a different sample
        assert not torch.equal(y_train, y_eval)
        assert rel_err(y_train.mean(0), y_eval.mean(0)) <= 0.1


def _step_both(original, converted, backend, device, shape=(3, 5, 16)):
    """One step of a sum of squares through both models on the same random input: (x, its copy, the converted
    model's output, the original's, the fused ops that ran, ``_triton`` twins named as their ops)."""
    x = torch.randn(*shape, device=device, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    with fusedrc.use_backend(backend), FusedOpLog() as log:
        y = converted(x)
        y.square().sum().backward()
    y_ref = original(xr)
    y_ref.square().sum().backward()
    return x, xr, y, y_ref, [op.removesuffix("_triton") for op in log.ops]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_falcon_h1_mlp_multipliers(backend):
    """Falcon-H1's MLP, ``down_proj(up_proj(x) * act_fn(gate_proj(x) * m_g)) * m_d`` (biases on): one fused gated
    FFN, m_g the op's gate_scale and m_d a scale of its output; output, input and every parameter gradient as
    the module's, the multipliers read at each call (changed after convert); one that is no finite number other
    than 0 runs the module's own forward, and at convert time such a one is reported."""
    tr = _transformers()
    if not hasattr(tr, "FalconH1Config"):
        pytest.skip(f"transformers {tr.__version__} has no FalconH1Config")
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP

    torch.manual_seed(0)
    cfg = tr.FalconH1Config(hidden_size=16, intermediate_size=24, hidden_act="silu", mlp_bias=True,
                            mlp_multipliers=[0.8838834764831843, 0.5859375])
    mlp = FalconH1MLP(cfg)
    conv = fusedrc.convert(mlp)
    plan = conv.fusedrc_plan
    assert [(u.name, u.kind) for u in plan.units if u.selected] == [("", "gated_ffn")] and not plan.skipped
    device = backend_device(backend)
    mlp, conv = mlp.to(device), conv.to(device)
    for scales, fused in (((0.8838834764831843, 0.5859375), True), ((-1.75, 2.0), True), ((0, 2.0), False),
                          ((1.5, torch.tensor(2.0)), False)):
        for m in (mlp, conv):
            m.gate_multiplier, m.down_multiplier = scales
            m.zero_grad()
        x, xr, y, y_ref, ops = _step_both(mlp, conv, backend, device)
        assert (ops == ["gated_mlp", "gated_mlp_backward"]) == fused, (scales, log.ops)
        assert rel_err(y, y_ref) <= TOL and rel_err(x.grad, xr.grad) <= TOL, scales
        _assert_close_models(mlp, conv)
    bad = FalconH1MLP(cfg)
    bad.down_multiplier = float("inf")
    with pytest.warns(UserWarning, match="no pattern found"):
        skipped = dict(fusedrc.convert(bad).fusedrc_plan.skipped)
    assert skipped[""] == ("its multipliers self.gate_multiplier = 0.8838834764831843 and self.down_multiplier = inf "
                           "are not finite numbers other than 0")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gemma3n_mlp_without_its_activation_sparsity(backend):
    """Gemma 3n's MLP, Llama's through local variables with activation sparsity (``_gaussian_topk``, a row
    statistic of the gate's pre-activation) where ``activation_sparsity > 0``: its layers without it (Gemma 3n's
    later 25 of 35) one fused gated FFN each, those with it reported; sparsity switched on after convert runs
    the module's forward; a 4-layer Gemma 3n text model's output as the original's."""
    tr = _transformers()
    if not hasattr(tr, "Gemma3nTextConfig"):
        pytest.skip(f"transformers {tr.__version__} has no Gemma3nTextConfig")
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

    torch.manual_seed(0)
    cfg = tr.Gemma3nTextConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                               activation_sparsity_pattern=[0.95, 0.0])
    sparse, dense = Gemma3nTextMLP(cfg, 0), Gemma3nTextMLP(cfg, 1)
    with pytest.warns(UserWarning, match="no pattern found"):
        skipped = dict(fusedrc.convert(sparse).fusedrc_plan.skipped)
    assert skipped[""].startswith("activation sparsity self.activation_sparsity = 0.95 (a statistic of each row")
    conv = fusedrc.convert(copy.deepcopy(dense))
    assert [u.kind for u in conv.fusedrc_plan.units] == ["gated_ffn"] and not conv.fusedrc_plan.skipped
    device = backend_device(backend)
    dense, conv = dense.to(device), conv.to(device)
    for sparsity, fused in ((0.0, True), (0.9, False)):
        for m in (dense, conv):
            m.activation_sparsity = sparsity
            m.zero_grad()
        x, xr, y, y_ref, ops = _step_both(dense, conv, backend, device)
        assert (ops == ["gated_mlp", "gated_mlp_backward"]) == fused
        assert rel_err(y, y_ref) <= TOL and rel_err(x.grad, xr.grad) <= TOL, sparsity
        _assert_close_models(dense, conv)
    if backend == "triton":
        return
    small = tr.Gemma3nTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=16, vocab_size=64, vocab_size_per_layer_input=64,
                                 hidden_size_per_layer_input=8, activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
                                 layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=0,
                                 laurel_rank=4, altup_num_inputs=2)
    model = tr.Gemma3nTextModel(small).train()
    with pytest.warns(UserWarning, match="left these as they are"):
        conv = fusedrc.convert(copy.deepcopy(model))
    kinds = collections.Counter(u.kind for u in conv.fusedrc_plan.units)
    assert kinds["norm_gated_ffn"] == 2 and [n for n, _ in conv.fusedrc_plan.skipped] == ["layers.0.mlp", "layers.1.mlp"]
    ids = torch.randint(0, 64, (2, 7))
    assert torch.equal(conv(ids).last_hidden_state, model(ids).last_hidden_state)


_GLM_MERGERS = {"glm4v": "Glm4vVisionPatchMerger", "glm4v_moe": "Glm4vMoeVisionPatchMerger",
                "glm5_next": "Glm5NextVisionPatchMerger"}


def _glm_merger(family):
    """A GLM vision patch merger of ``family`` (16 wide, its gated MLP 24; GLM-5-Next's SwiGLU limit 0.5), or a skip
    where the installed transformers has none."""
    _transformers()
    modeling = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(modeling, _GLM_MERGERS[family], None)
    if cls is None:
        pytest.skip(f"transformers has no {_GLM_MERGERS[family]}")
    return cls(16, 24, "silu", **({"swiglu_limit": 0.5} if family == "glm5_next" else {}))


def _assert_same_grads(a, b, exact):
    """Every parameter gradient of ``a`` as ``b``'s: bit for bit (``exact``) or within TOL."""
    ga, gb = _grads(a), _grads(b)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        assert torch.equal(ga[n], gb[n]) if exact else rel_err(ga[n], gb[n]) <= TOL, n


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("family", ["glm4v", "glm4v_moe", "glm5_next"])
def test_glm_vision_patch_merger(family, backend):
    """GLM's vision patch mergers (GLM-4V, GLM-4.xV-MoE, GLM-5-Next), ``proj -> post_projection_norm -> act1`` and
    then Llama's gated MLP (GLM-5-Next's with its SwiGLU clamp before the activation): the three modules run as the
    module calls them, the gated tail is one fused gated FFN unit (the norm its own norm unit); the output, the
    input's and every parameter's gradient as the module's (bit for bit on the reference backend), GLM-5-Next's
    limit read at each call, and the gated tail's hidden-sized tensors no longer kept."""
    merger = _glm_merger(family)
    torch.manual_seed(0)
    conv = fusedrc.convert(copy.deepcopy(merger))
    plan = conv.fusedrc_plan
    assert [(u.name, u.kind) for u in plan.units] == [("", "gated_ffn"), ("post_projection_norm", "norm")]
    assert not plan.skipped and conv.__dict__["_fusedrc_prelude"] == ("proj", "post_projection_norm", "act1")
    device, exact = backend_device(backend), backend == "reference"
    merger, conv = merger.to(device), conv.to(device)
    outs = {}
    for limit in (0.5, 0.05, float("inf")) if family == "glm5_next" else (None,):
        for m in (merger, conv):
            m.zero_grad()
            if limit is not None:
                m.swiglu_limit = limit
        x, xr, y, y_ref, ops = _step_both(merger, conv, backend, device, shape=(6, 16))
        assert ops == ["gated_mlp", "gated_mlp_backward"], (limit, ops)
        for a, b in ((y, y_ref), (x.grad, xr.grad)):
            assert torch.equal(a, b) if exact else rel_err(a, b) <= TOL, limit
        _assert_same_grads(conv, merger, exact)
        outs[limit] = y_ref
    if family == "glm5_next":  # the limits clamp: a limit the op ignored would not match
        assert not torch.equal(outs[0.05], outs[float("inf")])
    if not exact:
        return
    h = torch.randn(6, 16)
    # the op keeps its input alone: gate, up, act(gate) and their product (6 x 24 floats each) are not kept
    assert saved_bytes(merger, (h,)) - saved_bytes(conv, (h,)) >= 4 * 6 * 24 * 4
    if family == "glm5_next":
        merger.swiglu_limit = conv.swiglu_limit = 0.05
    ck = _set_impl(copy.deepcopy(conv), "checkpoint")  # the tail written out, under torch.utils.checkpoint
    with FusedOpLog() as log:
        assert torch.equal(conv(hidden_state=h), merger(h))  # the input by its name
        assert torch.equal(ck(h), merger(h))
    assert log.ops == ["gated_mlp"]


def test_glm_vision_patch_merger_fallbacks():
    """A converted GLM-4V patch merger: a hook on proj (its prelude) fires and the tail stays fused; hooks on a gated
    projection or on the merger, an activation or projection swapped in, the unit switched off run the module's
    own forward; projections of two dtypes under autocast run the tail module by module after the prelude, and so
    does torch.utils.checkpoint on the unit (``impl="checkpoint"``): every output the module's, bit for bit. A
    forward whose prelude is not module calls, or a gated form other than the plain or clamped one after it, is
    reported."""
    merger = _glm_merger("glm4v")
    torch.manual_seed(0)
    conv = fusedrc.convert(copy.deepcopy(merger))
    x = torch.randn(6, 16)

    def check(fused, a=conv, b=merger):
        with fusedrc.use_backend("reference"), FusedOpLog() as log:
            y = a(x)
        assert torch.equal(y, b(x)) and log.ops == (["gated_mlp"] if fused else [])

    check(True)
    calls = []
    handle = conv.proj.register_forward_hook(lambda *a: calls.append("proj"))
    check(True)
    handle.remove()
    for m in (conv.gate_proj, conv):
        handle = m.register_forward_pre_hook(lambda *a: calls.append("pre"))
        check(False)
        handle.remove()
    assert calls == ["proj", "pre", "pre"]
    check(True)
    for attr, new in (("act_fn", nn.Tanh()), ("up_proj", nn.Sequential(copy.deepcopy(merger.up_proj)))):
        a, b = copy.deepcopy(conv), copy.deepcopy(merger)
        setattr(a, attr, new), setattr(b, attr, copy.deepcopy(new))
        check(False, a, b)
    conv.fusedrc_plan.units[0].disable()
    check(False)
    conv.fusedrc_plan.units[0].enable()
    check(True)
    a, b = copy.deepcopy(conv), copy.deepcopy(merger)
    a.down_proj.half(), b.down_proj.half()  # cast to bfloat16 by autocast, as the others
    with torch.autocast("cpu", dtype=torch.bfloat16):
        check(False, a, b)
    ck = _set_impl(copy.deepcopy(conv), "checkpoint")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ck(xa), merger(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    _assert_same_grads(ck, merger, exact=True)

    class ScaledMerger(type(merger)):
        def forward(self, hidden_state):
            hidden_state = self.proj(hidden_state) * 2
            hidden_state = self.act1(self.post_projection_norm(hidden_state))
            return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))

    class DropoutMerger(type(merger)):
        def forward(self, hidden_state):
            hidden_state = self.proj(hidden_state)
            return self.down_proj(self.dropout(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state)))

    for cls, reason in ((ScaledMerger, "ScaledMerger.forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"),
                        (DropoutMerger, "a dropout gated MLP after proj has no fused form")):
        changed = copy.deepcopy(merger)
        changed.__class__, changed.dropout = cls, nn.Dropout(0.0)
        with pytest.warns(UserWarning, match="left these as they are"):  # (its norm a unit of its own)
            plan = fusedrc.convert(changed).fusedrc_plan
        assert dict(plan.skipped)[""].startswith(reason) and "" not in plan.fused  # (left to the fx pass)


def _glm_vision_model(tr, family):
    """A tiny GLM vision tower of ``family`` (no download): one block, 32 wide, patches of 2, merged 2 x 2 into 24-wide
    tokens by the patch merger (its gated MLP 48 wide); with its input (16 patches of one 4 x 4 image)."""
    names = {"glm4v": ("Glm4vVisionConfig", "Glm4vVisionModel"), "glm5_next": ("Glm5NextVisionConfig",
                                                                               "Glm5NextVisionModel")}[family]
    if not all(hasattr(tr, n) for n in names):
        pytest.skip(f"transformers {tr.__version__} has no {names[1]}")
    torch.manual_seed(0)
    extra = {"projection_intermediate_size": 48} if family == "glm5_next" else {}
    cfg = getattr(tr, names[0])(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=24,
                                patch_size=2, image_size=8, temporal_patch_size=1, spatial_merge_size=2, **extra)
    return getattr(tr, names[1])(cfg).train(), (torch.randn(16, 12), torch.tensor([[1, 4, 4]]))


@pytest.mark.parametrize("family", ["glm4v", "glm5_next"])
def test_glm_vision_model_merger(family):
    """A GLM-4V / GLM-5-Next vision tower from its config (model types glm4v_vision, glm5_next_vision): its patch
    merger one fused gated FFN unit beside the block's MLP, nothing reported; the merged tokens and every gradient
    of a step as the original's (reference backend; bit for bit with the merger's unit alone on: the other units'
    norms, recomputed or inside the block MLP's op, round their gradients otherwise), the merger's unit keeping the
    tail's hidden-sized tensors less."""
    tr = _transformers()
    model, inputs = _glm_vision_model(tr, family)
    conv = fusedrc.convert(copy.deepcopy(model))
    plan = conv.fusedrc_plan
    units = {u.name: u for u in plan.units}
    assert units["merger"].kind == "gated_ffn" and units["blocks.0.mlp"].kind == "norm_gated_ffn" and not plan.skipped
    assert collections.Counter(u.kind for u in plan.units if u.kind != "norm") == {"gated_ffn": 1, "norm_gated_ffn": 1}
    with fusedrc.use_backend("reference"):
        fused = saved_bytes(conv, inputs)
        assert fused < 0.6 * saved_bytes(model, inputs)
        units["merger"].disable()
        assert saved_bytes(conv, inputs) - fused >= 4 * 4 * 48 * 4  # the tail's 4 x 48 tensors: gate, up, act, product
        units["merger"].enable()
        for merger_alone in (False, True):
            for u in plan.units:
                (u.enable if u.name == "merger" or not merger_alone else u.disable)()
            model.zero_grad(), conv.zero_grad()
            with FusedOpLog() as log:
                y = conv(*inputs).pooler_output
                y.square().mean().backward()
            y_ref = model(*inputs).pooler_output
            y_ref.square().mean().backward()
            assert log.ops.count("gated_mlp") == (1 if merger_alone else 2) and "gated_mlp_backward" in log.ops
            assert torch.equal(y, y_ref)
            _assert_same_grads(conv, model, exact=merger_alone)


def _gemma4_vision_mlp(tr, **kw):
    if not hasattr(tr, "Gemma4VisionConfig"):
        pytest.skip(f"transformers {tr.__version__} has no Gemma4VisionConfig")
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionMLP

    torch.manual_seed(0)
    return Gemma4VisionMLP(tr.Gemma4VisionConfig(hidden_size=16, intermediate_size=24, **kw))


_GEMMA4_CLIPPING = ("gate_proj/up_proj/down_proj clip (use_clipped_linears: the Linear's input and output clamped to "
                    "bounds held in buffers): no fused form")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gemma4_vision_mlp_clippable_linears(backend):
    """Gemma 4's vision MLP, Llama's form on three ``Gemma4ClippableLinear``: while none clips
    (``use_clipped_linears`` False, read at each call) one fused gated FFN on their inner Linears' weights, its output
    and every gradient the module's (bit for bit on the reference backend); one switched to clipping after convert
    (its bounds finite) runs the module's forward, as does a hook on an inner Linear. Clipping ones at convert time
    are reported (their bounds, buffers, would be read at each call), as is a ClippableLinear whose forward
    differs."""
    tr = _transformers()
    clipped = _gemma4_vision_mlp(tr, use_clipped_linears=True)  # its bounds: buffers, +-inf
    with pytest.warns(UserWarning, match="no pattern found"):
        assert dict(fusedrc.convert(copy.deepcopy(clipped)).fusedrc_plan.skipped)[""] == _GEMMA4_CLIPPING
    mlp = copy.deepcopy(clipped)
    for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        p.use_clipped_linears = False
        p.output_max.fill_(0.05)  # the bounds a clipping one applies
    conv = fusedrc.convert(copy.deepcopy(mlp))
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("", "gated_ffn")] and not conv.fusedrc_plan.skipped
    device, exact = backend_device(backend), backend == "reference"
    mlp, conv = mlp.to(device), conv.to(device)
    for clip in (False, True, False):
        for m in (mlp, conv):
            m.up_proj.use_clipped_linears = clip
            m.zero_grad()
        x, xr, y, y_ref, ops = _step_both(mlp, conv, backend, device)
        assert ops == ([] if clip else ["gated_mlp", "gated_mlp_backward"]), clip
        for a, b in ((y, y_ref), (x.grad, xr.grad)):
            assert torch.equal(a, b) if exact else rel_err(a, b) <= TOL, clip
        _assert_same_grads(conv, mlp, exact)
        assert conv.up_proj.linear.weight.grad.abs().sum() > 0
    x = torch.randn(3, 5, 16, device=device)
    with torch.no_grad():  # the bound clips: a fused call with it on would not match
        mlp.up_proj.use_clipped_linears = True
        on = mlp(x)
        mlp.up_proj.use_clipped_linears = False
        assert not torch.equal(on, mlp(x))
    if not exact:
        return
    calls = []
    handle = conv.down_proj.linear.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(3, 5, 16)
    with FusedOpLog() as log:
        assert torch.equal(conv(x), mlp(x))
    assert log.ops == [] and calls == [1]
    handle.remove()
    assert saved_bytes(mlp, (x,)) - saved_bytes(conv, (x,)) >= 4 * 15 * 24 * 4  # gate, up, act(gate), the product

    base = type(mlp.gate_proj)

    class AlwaysClipped(base):
        def forward(self, hidden_states):
            return torch.clamp(self.linear(hidden_states), self.output_min, self.output_max)

    changed = copy.deepcopy(mlp)
    changed.gate_proj.__class__ = AlwaysClipped
    with pytest.warns(UserWarning, match="no pattern found"):
        skipped = dict(fusedrc.convert(copy.deepcopy(changed)).fusedrc_plan.skipped)
    assert skipped[""] == "gate_proj/up_proj/down_proj are not plain nn.Linear of matching shapes"
    conv.gate_proj.__class__ = AlwaysClipped  # after convert: the module's forward
    with FusedOpLog() as log:
        assert torch.equal(conv(x), changed(x))
    assert log.ops == []


def test_gemma4_vision_model():
    """A 2-layer Gemma 4 vision model from its config (model type gemma4_vision; no download): each layer's MLP one
    fused gated FFN with its pre-FFN norm inside (``norm_gated_ffn``), nothing reported; the pooled tokens and every
    gradient of a step as the original's (reference backend; bit for bit where the norms run as they are: a hook on
    the pre-FFN norms, the norm units off), and fewer bytes kept. With ``use_clipped_linears`` both MLPs are
    reported."""
    tr = _transformers()
    if not hasattr(tr, "Gemma4VisionModel"):
        pytest.skip(f"transformers {tr.__version__} has no Gemma4VisionModel")
    torch.manual_seed(0)
    kw = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, patch_size=2, pooling_kernel_size=2, position_embedding_size=16)
    model = tr.Gemma4VisionModel(tr.Gemma4VisionConfig(**kw)).train()
    conv = fusedrc.convert(copy.deepcopy(model))
    plan = conv.fusedrc_plan
    assert fused_without_norms(plan) == ["encoder.layers.0.mlp", "encoder.layers.1.mlp"] and not plan.skipped
    assert all(u.kind == "norm_gated_ffn" for u in plan.units if u.kind != "norm")
    pos = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij"), -1).reshape(1, 16, 2)
    inputs = (torch.rand(2, 16, 12), pos.repeat(2, 1, 1))
    hooked = copy.deepcopy(model)
    for layer in hooked.encoder.layers:
        layer.pre_feedforward_layernorm.register_forward_hook(lambda *a: None)
    with pytest.warns(UserWarning, match="pre_feedforward_layernorm: hooks registered on the norm"):
        hooked = fusedrc.convert(hooked)
    assert [u.kind for u in hooked.fusedrc_plan.units if u.kind != "norm"] == ["gated_ffn"] * 2
    for u in hooked.fusedrc_plan.units:
        if u.kind == "norm":
            u.disable()
    with fusedrc.use_backend("reference"):
        assert saved_bytes(conv, inputs) < 0.5 * saved_bytes(model, inputs)
        for c, exact in ((conv, False), (hooked, True)):
            model.zero_grad()
            with FusedOpLog() as log:
                y = c(*inputs).last_hidden_state
                y.square().mean().backward()
            y_ref = model(*inputs).last_hidden_state
            y_ref.square().mean().backward()
            assert log.ops.count("gated_mlp") == 2 and log.ops.count("gated_mlp_backward") == 2
            assert torch.equal(y, y_ref)
            _assert_same_grads(c, model, exact)
    clipped = tr.Gemma4VisionModel(tr.Gemma4VisionConfig(use_clipped_linears=True, **kw))
    with pytest.warns(UserWarning, match="left these as they are"):
        skipped = fusedrc.convert(clipped).fusedrc_plan.skipped
    assert skipped == [(f"encoder.layers.{i}.mlp", _GEMMA4_CLIPPING) for i in range(2)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_apertus_xielu_mlp(backend):
    """Apertus's MLP, ``down_proj(act_fn(up_proj(x)))`` with xIELU (learned alphas): one fused ``xielu_mlp`` unit
    per layer, the activation's formula checked; a 2-layer Apertus's output and every gradient (the alphas'
    included) as the original's, and far fewer bytes kept; another activation in an Apertus MLP is left to fx; an
    activation swapped in after convert runs the module."""
    tr = _transformers()
    if not hasattr(tr, "ApertusConfig"):
        pytest.skip(f"transformers {tr.__version__} has no ApertusConfig")
    torch.manual_seed(0)
    cfg = tr.ApertusConfig(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=64)
    model = tr.ApertusModel(cfg).train()
    conv = fusedrc.convert(copy.deepcopy(model))
    kinds = collections.Counter(u.kind for u in conv.fusedrc_plan.units)
    assert kinds["ffn"] == 2 and not conv.fusedrc_plan.skipped, (kinds, conv.fusedrc_plan.skipped)
    ids = torch.randint(0, 64, (2, 7))
    if backend == "reference":
        with fusedrc.use_backend("reference"):
            assert saved_bytes(conv, (ids,)) < 0.4 * saved_bytes(model, (ids,))
    device = backend_device(backend)
    model, conv, ids = model.to(device), conv.to(device), ids.to(device)
    with fusedrc.use_backend(backend), FusedOpLog() as log:
        y = conv(ids).last_hidden_state
        y.square().mean().backward()
    y_ref = model(ids).last_hidden_state
    y_ref.square().mean().backward()
    assert [op.removesuffix("_triton") for op in log.ops].count("xielu_mlp") == 2
    assert rel_err(y, y_ref) <= TOL
    _assert_close_models(model, conv)
    assert conv.layers[0].mlp.act_fn.alpha_p.grad.abs().sum() > 0
    mlp = conv.layers[1].mlp
    mlp.act_fn = model.layers[1].mlp.act_fn = nn.SiLU()
    x = torch.randn(3, 32, device=device)
    with fusedrc.use_backend(backend), FusedOpLog() as log:
        assert torch.equal(mlp(x), model.layers[1].mlp(x))
    assert log.ops == []


def _rwkv(tr):
    """A tiny RWKV language model (no download): hidden 16, key/value width 64 (4 x hidden), two blocks."""
    torch.manual_seed(0)
    cfg = tr.RwkvConfig(vocab_size=64, context_length=32, hidden_size=16, attention_hidden_size=16,
                        num_hidden_layers=2)
    return tr.RwkvForCausalLM(cfg)


_RWKV_UNITS = ["rwkv.blocks.0.feed_forward", "rwkv.blocks.1.feed_forward"]


def _kept_bytes(model, args):
    """saved_bytes, each saved tensor held until the end: RWKV's attention drops the graph of its last state update
    (no return_state), whose freed storages saved_bytes could meet again at the same address, a few bytes off
    at random; held, the count is exact."""
    params, kept = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept.setdefault(storage.data_ptr(), (storage.nbytes(), t))
        return t

    with _Frozen(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return sum(n for n, _ in kept.values())


def _assert_same(a, b, exact):
    """Bit for bit (``exact``: the reference backend computes the chain with the module's aten ops), else
    within TOL (the Triton kernels accumulate in another order)."""
    assert torch.equal(a, b) if exact else rel_err(a, b) <= TOL


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_rwkv_feed_forward(backend):
    """RWKV's channel mix, ``RwkvFeedForward``: its key -> relu^2 -> value one fused FFN (activation relu2, no
    biases) per block, its time shift, mixing and receptance gate as the module's; the logits and every parameter
    gradient of a training step as the original model's (bit for bit on the reference backend), the same
    state_dict (an inplace convert keeps the very tensors), and each unit keeps the two hidden-sized tensors less
    (relu's output and its square, 2 x batch x tokens x 64 floats)."""
    tr = _transformers()
    model = _rwkv(tr).train()
    conv = fusedrc.convert(copy.deepcopy(model))
    plan = conv.fusedrc_plan
    assert fused_without_norms(plan) == _RWKV_UNITS and not plan.skipped, plan
    assert [u.kind for u in plan.units if u.name in _RWKV_UNITS] == ["ffn", "ffn"]
    assert type(conv.rwkv.blocks[1].feed_forward).__name__ == "FusedRwkvFeedForward"
    assert list(conv.state_dict()) == list(model.state_dict())
    conv.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 7))
    exact = backend == "reference"
    if exact:
        with fusedrc.use_backend("reference"):
            off = copy.deepcopy(conv)
            for u in off.fusedrc_plan.units:
                if u.kind == "ffn":
                    u.disable()
            kept, kept_off = _kept_bytes(conv, (ids,)), _kept_bytes(off, (ids,))
            assert kept_off - kept == 2 * (2 * 2 * 7 * 64 * 4)  # two blocks, two (2, 7, 64) float32 tensors each
            assert kept < 0.75 * _kept_bytes(model, (ids,))
    device = backend_device(backend)
    model, conv, ids = model.to(device), conv.to(device), ids.to(device)
    # a random projection of the logits: a sum of their squares would send ln_out a gradient along its output
    # (the head is orthogonal at init), which its backward all but cancels, leaving the blocks ill-conditioned ones
    weights = torch.randn(2, 7, 64, device=device)
    with fusedrc.use_backend(backend), FusedOpLog() as log:
        y = conv(ids).logits
        (y * weights).sum().backward()
    y_ref = model(ids).logits
    (y_ref * weights).sum().backward()
    ops = [op.removesuffix("_triton") for op in log.ops]
    assert ops.count("fused_mlp") == 2 and ops.count("fused_mlp_backward") == 2, ops
    _assert_same(y, y_ref, exact)
    grads, grads_ref = _grads(conv), _grads(model)
    assert grads.keys() == grads_ref.keys() and "rwkv.blocks.0.feed_forward.key.weight" in grads
    for n in grads_ref:
        _assert_same(grads[n], grads_ref[n], exact)
    if exact:  # inplace: the module objects and parameters themselves
        same = _rwkv(tr)
        params = dict(same.named_parameters())
        assert fusedrc.convert(same, inplace=True) is same
        assert type(same.rwkv.blocks[0].feed_forward).__name__ == "FusedRwkvFeedForward"
        assert all(p is params[n] for n, p in same.named_parameters()) and len(params) == len(list(same.parameters()))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_rwkv_feed_forward_with_state(backend):
    """Inference with RWKV's state: a prompt with ``use_cache=True`` (the state made and written), then one token
    (the shift read from the state itself) and then three (the state in the shift's first row), each call's
    logits and all five state tensors as the original's, the fused op run; greedy generation gives the same
    tokens. The module called with a state with autograd on (forward only; HF's own backward through a state
    written in place fails): output and the state it writes as the module's. Batch 1: with one token and a state,
    Hugging Face's RWKV broadcasts the (batch, hidden) shift against the (batch, 1, hidden) input, a batch of
    several tokens' worth of rows (both models alike; not decoding)."""
    tr = _transformers()
    model = _rwkv(tr).eval()
    conv = fusedrc.convert(copy.deepcopy(model))
    assert fused_without_norms(conv.fusedrc_plan) == _RWKV_UNITS
    exact = backend == "reference"
    device = backend_device(backend)
    model, conv = model.to(device), conv.to(device)
    ids = torch.randint(0, 64, (1, 9), device=device)
    state = state_ref = None
    with fusedrc.use_backend(backend), torch.no_grad():
        for part in (ids[:, :5], ids[:, 5:6], ids[:, 6:]):
            with FusedOpLog() as log:
                out = conv(part, state=state, use_cache=True)
            ref = model(part, state=state_ref, use_cache=True)
            assert out.logits.shape == (*part.shape, 64)
            assert [op.removesuffix("_triton") for op in log.ops] == ["fused_mlp"] * 2
            _assert_same(out.logits, ref.logits, exact)
            assert len(out.state) == len(ref.state) == 5
            for s, s_ref in zip(out.state, ref.state):
                _assert_same(s, s_ref, exact)
            state, state_ref = out.state, ref.state
        if exact:
            assert torch.equal(conv.generate(ids[:, :4], max_new_tokens=4, do_sample=False),
                               model.generate(ids[:, :4], max_new_tokens=4, do_sample=False))
    ff, ff_ref = conv.rwkv.blocks[1].feed_forward, model.rwkv.blocks[1].feed_forward
    for tokens in (1, 3):
        hidden = torch.randn(1, tokens, 16, device=device)
        st = [torch.randn(1, 16, 2, device=device) for _ in range(5)]
        st_ref = [t.clone() for t in st]
        with fusedrc.use_backend(backend), FusedOpLog() as log:
            y, st_out = ff(hidden, state=st)
        y_ref, st_ref_out = ff_ref(hidden, st_ref)
        assert log.ops and st_out is st and st_ref_out is st_ref and y.shape == hidden.shape
        _assert_same(y, y_ref, exact)
        assert torch.equal(st[0], st_ref[0]) and torch.equal(st[0][:, :, 1], hidden[:, -1])
        assert all(torch.equal(a, b) for a, b in zip(st[1:], st_ref[1:]))


def test_rwkv_feed_forward_fallbacks():
    """What the fused op does not model runs the module's own forward, and still matches: a hook on the module,
    on key or value, key marked with fusedrc.mark, a LoRA adapter swapped in for value, the unit switched off, a
    call the forward does not bind (its own error). At convert time, a forward of another shape (the same lines,
    the state's write into the shift's first row outside the else: a nesting the stripped lines do not show),
    hooks, a value that is no Linear and an input named as one of the body's locals are reported, not fused;
    arguments of other names are bound by name."""
    tr = _transformers()
    from transformers.models.rwkv.modeling_rwkv import RwkvFeedForward

    model = _rwkv(tr).train()
    conv = fusedrc.convert(copy.deepcopy(model))
    ff, ff_ref = conv.rwkv.blocks[0].feed_forward, model.rwkv.blocks[0].feed_forward
    x = torch.randn(2, 5, 16)

    def check(fused, **kw):
        for m in (ff, ff_ref):
            m.zero_grad()
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with fusedrc.use_backend("reference"), FusedOpLog() as log:
            y, _ = ff(xa, **kw)
            y.square().sum().backward()
        y_ref, _ = ff_ref(xb)
        y_ref.square().sum().backward()
        assert (log.ops == ["fused_mlp", "fused_mlp_backward"]) == fused, log.ops
        assert rel_err(y, y_ref) <= TOL and rel_err(xa.grad, xb.grad) <= TOL
        _assert_close_models(ff_ref, ff)

    check(True)
    check(True, state=None)
    for target in (ff, ff.key, ff.value):
        handle = target.register_forward_hook(lambda *a: None)
        check(False)
        handle.remove()
    handle = ff.register_forward_pre_hook(lambda *a: None)
    check(False)
    handle.remove()
    check(True)
    unit = next(u for u in conv.fusedrc_plan.units if u.name == _RWKV_UNITS[0])
    unit.disable()
    check(False)
    unit.enable()
    fusedrc.mark(ff.key)
    check(False)
    fusedrc.unmark(ff.key)
    check(True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
        ff(x=x)
    for m in (ff, ff_ref):
        torch.manual_seed(1)
        _swap(m, "value", lambda base: _LoraLinear(base))
    check(False)

    # at convert time: another forward, hooks, a value that is no Linear
    def shift_outside_else(self, hidden, state=None):
        if hidden.size(1) == 1 and state is not None:
            shifted = state[0][:, :, self.layer_id]
        else:
            shifted = self.time_shift(hidden)
        if state is not None:
            shifted[:, 0] = state[0][:, :, self.layer_id]
        key = hidden * self.time_mix_key + shifted * (1 - self.time_mix_key)
        receptance = hidden * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)

        key = torch.square(torch.relu(self.key(key)))
        value = self.value(key)
        receptance = torch.sigmoid(self.receptance(receptance))

        if state is not None:
            state[0][:, :, self.layer_id] = hidden[:, -1]

        return receptance * value, state

    def renamed(self, hidden_states: torch.Tensor, cache=None) -> tuple:
        """RWKV's channel mix, its arguments renamed (and annotated)."""
        if hidden_states.size(1) == 1 and cache is not None:
            shifted = cache[0][:, :, self.layer_id]
        else:
            shifted = self.time_shift(hidden_states)
            if cache is not None:  # a comment
                shifted[:, 0] = cache[0][:, :, self.layer_id]
        key = hidden_states * self.time_mix_key + shifted * (1 - self.time_mix_key)
        receptance = hidden_states * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)
        key = torch.square(torch.relu(self.key(key)))
        value = self.value(key)
        receptance = torch.sigmoid(self.receptance(receptance))
        if cache is not None:
            cache[0][:, :, self.layer_id] = hidden_states[:, -1]
        return receptance * value, cache

    def shadowed(self, key, state=None):  # the input named as a local: the body rebinds it, another computation
        if key.size(1) == 1 and state is not None:
            shifted = state[0][:, :, self.layer_id]
        else:
            shifted = self.time_shift(key)
            if state is not None:
                shifted[:, 0] = state[0][:, :, self.layer_id]
        key = key * self.time_mix_key + shifted * (1 - self.time_mix_key)
        receptance = key * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)
        key = torch.square(torch.relu(self.key(key)))
        value = self.value(key)
        receptance = torch.sigmoid(self.receptance(receptance))
        if state is not None:
            state[0][:, :, self.layer_id] = key[:, -1]
        return receptance * value, state

    from fusedrc.convert import _source_lines

    cfg = model.config
    other = type("RwkvFeedForward", (RwkvFeedForward,), {"forward": shift_outside_else})(cfg, 0)
    assert _source_lines(other)[1:] == _source_lines(RwkvFeedForward(cfg, 0))[1:]  # the lines alone agree
    hooked = RwkvFeedForward(cfg, 0)
    hooked.key.register_forward_hook(lambda *a: None)
    lora = RwkvFeedForward(cfg, 0)
    lora.value = _LoraLinear(lora.value)
    good = type("RwkvFeedForward", (RwkvFeedForward,), {"forward": renamed})(cfg, 0)
    shadow = type("RwkvFeedForward", (RwkvFeedForward,), {"forward": shadowed})(cfg, 0)
    with pytest.warns(UserWarning, match="left these as they are"):
        converted = fusedrc.convert(nn.ModuleDict({"other": other, "hooked": hooked, "lora": lora, "good": good,
                                                   "shadow": shadow}))
    plan, good = converted.fusedrc_plan, converted["good"]
    skipped = dict(plan.skipped)
    for name in ("other", "shadow"):
        assert skipped[name].startswith("RwkvFeedForward.forward is not transformers' RWKV channel mix")
    assert skipped["hooked"] == "hooks registered on the modules"
    assert skipped["lora"] == "key/value are not nn.Linears of one hidden width"
    assert [(u.name, u.kind) for u in plan.units] == [("good", "ffn")]
    ref = RwkvFeedForward(cfg, 0)  # the same parameters (a module built alone holds torch.empty's)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    good.load_state_dict(ref.state_dict())
    st = [torch.randn(2, 16, 1) for _ in range(5)]
    st_ref = [t.clone() for t in st]
    with fusedrc.use_backend("reference"), FusedOpLog() as log:
        y, _ = good(hidden_states=x, cache=st)
    y_ref, _ = ref(x, st_ref)
    assert log.ops == ["fused_mlp"] and torch.equal(y, y_ref) and torch.equal(st[0], st_ref[0])


def test_gated_mlp_dropout_forms_the_op_cannot_stand_for_are_reported():
    """A dropout of the gated product that is no nn.Dropout (its mask drawn otherwise), and an output
    dropout whose p is no number: left as they are, said why."""
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
            self.act_fn, self.dropout, self.p = nn.SiLU(), nn.AlphaDropout(0.1), None

    class ProductDropout(Gated):
        def forward(self, x):
            h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
            return self.down_proj(self.dropout(h))

    class OutputDropout(Gated):
        def forward(self, x):
            out = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return nn.functional.dropout(out, p=self.p, training=self.training)

    class UnreadCall(Gated):  # a call whose value is never read is still a call: not the gated form
        def forward(self, x):
            aux = self.dropout(x)
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    no_dropout = ProductDropout()
    del no_dropout.dropout
    with pytest.warns(UserWarning, match="AlphaDropout between the gate and down_proj has no fused form"):
        plan = fusedrc.convert(nn.ModuleDict({"a": ProductDropout(), "b": OutputDropout(), "c": UnreadCall(),
                                              "d": no_dropout})).fusedrc_plan
    skipped = dict(plan.skipped)
    assert skipped["b"] == "the output dropout's p, self.p, is not a number"
    assert skipped["c"].startswith("UnreadCall.forward is not down_proj(")
    assert skipped["d"] == "NoneType between the gate and down_proj has no fused form"
    # the fx pass still finds the gated chains of b (it ends at down_proj, the dropout after it runs as written)
    # and c (its unread call stays in the graph); a's AlphaDropout is no nn.Dropout: its gate is a Linear+act
    assert [(u.name, u.kind) for u in plan.units if u.selected and "gated" in u.kind] == [
        ("b.gate_proj", "gated_ffn"), ("c.gate_proj", "gated_ffn")]
    assert ("a.gate_proj", "linear_act") in [(u.name, u.kind) for u in plan.units]


def test_gated_mlp_look_alike_with_another_forward_is_reported():
    """gate_proj/up_proj/down_proj/act_fn with a forward that is not Llama's: not a gated FFN, said why
    (fx still finds its act(gate_proj(x)), a Linear+act)."""
    class GatedLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    class Llamaish(GatedLike):
        def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
            out = self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))
            return out

    model = nn.ModuleDict({"a": GatedLike(), "b": Llamaish()})
    with pytest.warns(UserWarning, match=r"a: GatedLike\.forward is not down_proj"):
        conv = fusedrc.convert(model)
    plan = conv.fusedrc_plan
    assert {u.name: u.kind for u in plan.units if u.selected} == {"a.gate_proj": "linear_act", "b": "gated_ffn"}
    assert [n for n, _ in plan.skipped] == ["a"]
    x = torch.randn(3, 8)
    for key in ("a", "b"):
        assert rel_err(conv[key](x), model[key](x)) < 1e-6
    # called by its own argument name, as a parent module may
    assert rel_err(conv["b"](hidden_state=x), model["b"](x)) < 1e-6
    with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
        conv["b"](x=x)
    # a class of your own named as torchvision's and timm's blocks (nanoGPT's Block, ...) is not
    # theirs: the checks by shape still apply to it
    Block = type("Block", (Llamaish,), {})
    conv = fusedrc.convert(nn.ModuleDict({"b": Block()}))
    assert {u.name: u.kind for u in conv.fusedrc_plan.units} == {"b": "gated_ffn"}


class _LoraLinear(nn.Module):
    """A LoRA adapter in PEFT's form (``peft.tuners.lora.Linear``): holds the base layer, exposes
    its weight and bias, adds a low-rank update."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base_layer = base
        n_in, n_out = base.weight.shape[1], base.weight.shape[0]
        self.lora_A, self.lora_B = nn.Linear(n_in, rank, bias=False), nn.Linear(rank, n_out, bias=False)
        nn.init.normal_(self.lora_B.weight)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def _swap(model, path, make):
    parent, _, key = path.rpartition(".")
    owner = model.get_submodule(parent)
    setattr(owner, key, make(getattr(owner, key)))


@pytest.mark.parametrize("case", [
    "opt-lora-fc1", "opt-lora-fc2", "opt-act", "t5-lora-wi", "t5-act", "llama-lora-up", "llama-act",
    "bert-lora-intermediate", "bert-act", "phi3-lora-gate_up", "phi3-act",
])
def test_modules_replaced_after_convert_are_honoured(case):
    """A LoRA adapter (as PEFT's get_peft_model puts it) or another activation module swapped into a
    fused unit after convert: the unit runs the modules as they now are, as the original would."""
    tr = _transformers()
    family, what, *rest = case.split("-")
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 8))
    if family == "opt":
        model = _opt(vocab_size=100, hidden_size=32, ffn_dim=64)
        path = {"lora": f"model.decoder.layers.0.{rest[0] if rest else 'fc1'}",
                "act": "model.decoder.layers.0.activation_fn"}
    elif family == "t5":
        model = _t5(vocab_size=100, d_model=32, d_ff=64)
        path = {"lora": "encoder.block.0.layer.1.DenseReluDense.wi", "act": "encoder.block.0.layer.1.DenseReluDense.act"}
    elif family == "llama":
        model = tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48,
                                                   num_hidden_layers=1, num_attention_heads=4, use_cache=False))
        path = {"lora": "model.layers.0.mlp.up_proj", "act": "model.layers.0.mlp.act_fn"}
    elif family == "phi3":
        model = tr.Phi3ForCausalLM(tr.Phi3Config(vocab_size=100, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=1, num_attention_heads=4, pad_token_id=0,
                                                 bos_token_id=1, eos_token_id=2, use_cache=False))
        path = {"lora": "model.layers.0.mlp.gate_up_proj", "act": "model.layers.0.mlp.activation_fn"}
    else:
        model = tr.BertForMaskedLM(tr.BertConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=4, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0))
        path = {"lora": "bert.encoder.layer.0.intermediate.dense",
                "act": "bert.encoder.layer.0.intermediate.intermediate_act_fn"}
    model.eval()
    conv = fusedrc.convert(model)
    assert conv.fusedrc_plan.fused
    make = (lambda base: _LoraLinear(base)) if what == "lora" else (lambda act: nn.Tanh())
    for m in (model, conv):
        torch.manual_seed(1)
        _swap(m, path[what], make)
    args = (ids, None, ids[:, :4]) if family == "t5" else (ids,)
    with torch.no_grad():
        assert rel_err(conv(*args).logits, model(*args).logits) <= TOL


def test_blocks_around_a_marked_module_are_left_unmarked():
    """policy="blocks" on a model in which the user marked a submodule already: the layer around it
    is not made a block (marks cannot nest), reported; the other layers are."""
    tr = _transformers()
    model = tr.BertModel(tr.BertConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0))
    fusedrc.mark(model.encoder.layer[0].attention)
    with pytest.warns(UserWarning, match="already marked"):
        conv = fusedrc.convert(model, policy="blocks", inplace=True)
    plan = conv.fusedrc_plan
    assert plan.recomputed_blocks == ["encoder.layer.1"]
    assert "encoder.layer.0" in dict(plan.skipped)


def test_t5_blocks_are_whole_layers():
    """T5's unit of recompute for policy="blocks" is the T5Block (attention and FFN), as in Hugging
    Face's own gradient checkpointing."""
    model = _t5(vocab_size=100, d_model=32, d_ff=64)
    ids, dec = torch.randint(1, 100, (2, 12)), torch.randint(1, 100, (2, 6))
    conv = fusedrc.convert(model, policy="blocks", example_inputs=(ids, None, dec))
    plan = conv.fusedrc_plan
    assert plan.recomputed_blocks == [f"{s}.block.{i}" for s in ("encoder", "decoder") for i in range(2)]
    assert plan.final_bytes < 0.3 * plan.baseline_bytes
    la, lb = model(input_ids=ids, labels=dec).loss, conv(input_ids=ids, labels=dec).loss
    assert rel_err(lb, la) <= TOL
    la.backward()
    lb.backward()
    _assert_close_models(model, conv)


def test_layer_with_an_instance_forward_is_not_rewritten():
    model = _opt(vocab_size=100, hidden_size=32, ffn_dim=64)
    layer = model.model.decoder.layers[0]
    layer.forward = types.MethodType(type(layer).forward, layer)
    with pytest.warns(UserWarning, match="forward set on the instance"):
        conv = fusedrc.convert(model, inplace=True)
    assert fused_without_norms(conv.fusedrc_plan) == ["model.decoder.layers.1.fc1"]
    assert type(layer.fc1) is nn.Linear


# --------------------------------------------------------------------------- Conv-BN with other activations
class _ConvActNet(nn.Module):
    """fx-traced chains: Conv-BN-SiLU as modules, Conv-BN-gelu functional, Conv-BN-Tanh (no fused form)."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1, self.a1 = nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.SiLU()
        self.c2, self.b2 = nn.Conv2d(6, 5, 1, bias=False), nn.BatchNorm2d(5)
        self.c3, self.b3, self.a3 = nn.Conv2d(5, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Tanh()

    def forward(self, x):
        x = nn.functional.gelu(self.b2(self.c2(self.a1(self.b1(self.c1(x))))), approximate="tanh")
        return self.a3(self.b3(self.c3(x)))


def test_conv_bn_other_activations_sequential_and_fx():
    """Conv -> BatchNorm2d -> SiLU / GELU chains are fused (kind "conv_bn_act"), in a Sequential and
    through fx (module and functional activations); before an activation with no fused form the
    Conv-BN is (kind "conv_bn"), the activation runs as is; outputs, gradients and running statistics
    match the original's over two steps (convs without bias: one before BatchNorm has a gradient of
    pure rounding noise)."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.SiLU(),
                        nn.Conv2d(6, 4, 1, bias=False), nn.BatchNorm2d(4), nn.GELU(),
                        nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4), nn.Hardsigmoid()).train()
    fx = _ConvActNet().train()
    x = torch.randn(2, 3, 7, 7)
    for model, names in ((seq, ["0", "3", "6"]), (fx, ["c1", "c2", "c3"])):
        conv = fusedrc.convert(model, example_inputs=(x,))
        plan = conv.fusedrc_plan
        assert [(u.name, u.kind) for u in plan.units] == list(zip(names, ["conv_bn_act", "conv_bn_act", "conv_bn"]))
        assert not plan.skipped
        ops = []
        with FusedOpLog(ops):
            copy.deepcopy(conv)(x)  # a copy: a training forward updates the running statistics
        assert ops == ["conv_bn_act"] * 3
        for _ in range(2):
            model.zero_grad(), conv.zero_grad()
            _assert_same_step(model, conv, x)
        assert plan.final_bytes < plan.baseline_bytes


def _wider_far_side_chains():
    """Conv-BN chains whose padding is wider on the far side: ``padding="same"`` of even kernel extents
    (aten pads the odd row / column at the end), and timm's Conv2dSame (TensorFlow's 'SAME', by the input's
    size: stride 2 on an even side pads the far side alone) where timm is installed."""
    chains = [nn.Conv2d(3, 6, 4, padding="same", bias=False), nn.BatchNorm2d(6), nn.ReLU(),
              nn.Conv2d(6, 4, (2, 3), padding="same", bias=False), nn.BatchNorm2d(4), nn.SiLU()]
    kinds = ["conv_bn_relu", "conv_bn_act"]
    try:
        _import_torchvision_quiet()
        from timm.layers import Conv2dSame
    except ImportError:
        return chains, kinds
    chains += [Conv2dSame(4, 5, 3, stride=2, bias=False), nn.BatchNorm2d(5), nn.ReLU()]
    return chains, kinds + ["conv_bn_relu"]


class _WiderFarSideNet(nn.Module):
    def __init__(self, mods):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        for m in self.mods:
            x = m(x)
        return x


def test_conv_bn_with_padding_wider_on_the_far_side():
    """Conv-BN chains whose padding is wider on the far side (``_wider_far_side_chains``) are fused, in
    a Sequential and through fx: the input padded at its far side, the rest in the op; output, gradients
    and running statistics the original's over two steps, on odd and even sizes; on the Triton backend
    (the interpreter on the CPU) too. BN -> ReLU -> such a Conv stays as it is, reported (the padded
    input would be normalized too). ``fusedrc.nn.ConvBNReLU(padding="same")`` of an even kernel matches
    nn.Conv2d's."""
    torch.manual_seed(0)
    mods, kinds = _wider_far_side_chains()
    seq = nn.Sequential(*mods).train()
    fx = _WiderFarSideNet(copy.deepcopy(mods)).train()
    names = [str(i) for i in range(0, len(mods), 3)]
    for model, prefix in ((seq, ""), (fx, "mods.")):
        x = torch.randn(2, 3, 7, 8)
        conv = fusedrc.convert(model, example_inputs=(x,))
        plan = conv.fusedrc_plan
        assert [(u.name, u.kind) for u in plan.units] == [(prefix + n, k) for n, k in zip(names, kinds)]
        # x kept as it came (the wider side is padded on a transient copy): checkpoint's bytes at most, and
        # the per-channel fp32 mean and rstd
        stats = 2 * 4 * sum(m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d))
        assert not plan.skipped and plan.final_bytes <= _checkpoint_bytes(conv, (x,)) + stats < plan.baseline_bytes
        assert _copy_forward_ops(conv, x) == ["conv_bn_act"] * len(kinds)
        for size in ((7, 8), (8, 9)):
            model.zero_grad(), conv.zero_grad()
            _assert_same_step(model, conv, torch.randn(2, 3, *size))

    dev = backend_device("triton")
    model = copy.deepcopy(seq).to(dev)
    conv = fusedrc.convert(model)
    x = torch.randn(2, 3, 6, 9, device=dev)
    with fusedrc.use_backend("triton"), FusedOpLog() as log:
        _assert_same_step(model, conv, x)
    assert log.ops.count("conv_bn_act_triton") == len(kinds)

    pre = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 4, 2, padding="same"))
    with pytest.warns(UserWarning, match="no pattern found"):
        plan = fusedrc.convert(pre).fusedrc_plan
    assert "(symmetric padding)" in dict(plan.skipped)["0"]

    ours = fusedrc.nn.ConvBNReLU(3, 4, 4, padding="same").train()
    plain = nn.Sequential(collections.OrderedDict(conv=copy.deepcopy(ours.conv), bn=copy.deepcopy(ours.bn),
                                                  act=nn.ReLU())).train()
    _assert_same_step(plain, ours, torch.randn(2, 3, 5, 6))


class _DeepStemNet(nn.Module):
    """timm's deep stem: a Sequential ending in a conv whose BatchNorm and activation are the model's."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                                   nn.Conv2d(6, 8, 3, stride=2, padding=1, bias=False))
        self.bn1, self.drop, self.act1 = nn.BatchNorm2d(8), nn.Identity(), nn.ReLU()  # timm's drop_block placeholder
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.act1(self.drop(self.bn1(self.conv1(x)))).mean((2, 3)))


def test_sequential_tail_conv_fused_with_the_norm_after_it():
    """The last conv of a Sequential (in none of its fused groups) and the model's BatchNorm and ReLU after
    it are one unit (named by the conv), found through fx: two fused ops, output, gradients and running
    statistics the original's. A module put in the conv's place after convert runs as it is (a conv still
    fused), as in the original with the same change; so do a hook on the stem (it fires) and a module put in
    the drop_block placeholder's place."""
    torch.manual_seed(0)
    model = _DeepStemNet().train()
    conv = fusedrc.convert(model)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("conv1.0", "conv_bn_relu"),
                                                                    ("conv1.3", "conv_bn_relu")]
    x = torch.randn(2, 3, 9, 8)
    assert _copy_forward_ops(conv, x) == ["conv_bn_act"] * 2
    for _ in range(2):
        model.zero_grad(), conv.zero_grad()
        _assert_same_step(model, conv, x)
    for new, fused in ((nn.Conv2d(6, 8, 1, bias=False), 2), (nn.Sequential(nn.Conv2d(6, 8, 1), nn.Tanh()), 1)):
        model.conv1[3], conv.conv1[3] = new, copy.deepcopy(new)
        assert _copy_forward_ops(conv, x) == ["conv_bn_act"] * fused
        model.zero_grad(), conv.zero_grad()
        _assert_same_step(model, conv, x)
    # a hook on the stem: the Sequential is called as it is (its own group fused), the hook sees its output;
    # then a module in the placeholder's place: the chain's modules as they are
    torch.manual_seed(0)
    model = _DeepStemNet().train()
    conv = fusedrc.convert(model)
    for swap, fused in ((False, 1), (True, 1)):
        calls = []
        if swap:
            model.drop, conv.drop = nn.Dropout(0.0), nn.Dropout(0.0)
        else:
            for m in (model, conv):
                m.conv1.register_forward_hook(lambda mod, args, out: calls.append(tuple(out.shape)))
        assert _copy_forward_ops(conv, x) == ["conv_bn_act"] * fused
        model.zero_grad(), conv.zero_grad()
        _assert_same_step(model, conv, x)
        assert calls == [(2, 8, 5, 4)] * 3


def test_timm_mixed_conv_then_batch_norm_one_op_per_split():
    """timm's MixedConv2d (MixNet: channels split among kernel sizes, here all Conv2dSame) before a
    BatchNorm2d (momentum None: the cumulative average, counted once a call) and a ReLU in a Sequential: one
    unit, its cost its splits' FLOPs, one fused op per split; two training steps match the original's
    outputs, gradients and running statistics. A hook on a split runs the modules as they are."""
    _timm()
    from timm.layers import MixedConv2d

    torch.manual_seed(0)
    model = nn.Sequential(MixedConv2d(5, 7, [3, 4, 5], stride=2, padding="same"), nn.BatchNorm2d(7, momentum=None),
                          nn.ReLU()).train()
    x = torch.randn(2, 5, 9, 8)
    conv = fusedrc.convert(model, memory_budget=0.9, example_inputs=(x,))
    (unit,) = conv.fusedrc_plan.units
    splits = list(model[0].values())
    # out 5x4 ('same' with stride 2 on 9x8); per split 2 * its output's size * cin * k * k
    assert unit.kind == "conv_bn_relu" and unit.cost == sum(
        2 * (2 * c.out_channels * 5 * 4) * c.in_channels * c.kernel_size[0] ** 2 for c in splits)
    assert _copy_forward_ops(conv, x) == ["conv_bn_act"] * 3
    for _ in range(2):
        model.zero_grad(), conv.zero_grad()
        _assert_same_step(model, conv, x)
    assert conv[1].num_batches_tracked.item() == model[1].num_batches_tracked.item()
    calls = []
    conv[0]["1"].register_forward_hook(lambda *args: calls.append("convert"))
    model[0]["1"].register_forward_hook(lambda *args: calls.append("original"))
    ops = []
    with FusedOpLog(ops):
        copy.deepcopy(conv)(x)
        fusedrc.recompute(copy.deepcopy(model), x)  # recompute's pattern match sees the splits' hooks too
    assert ops == [] and calls == ["convert", "original"]
    model.zero_grad(), conv.zero_grad()
    _assert_same_step(model, conv, x)


class _LeakyNet(nn.Module):
    """LeakyReLU written the ways models write it: positional and keyword slopes, in place, the
    default, and a slope the graph computes (no fused form: the chain is Conv-BN, then the call)."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.c2, self.b2 = nn.Conv2d(6, 6, 1, bias=False), nn.BatchNorm2d(6)
        self.c3, self.b3 = nn.Conv2d(6, 4, 3, bias=False), nn.BatchNorm2d(4)
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 3)

    def forward(self, x):
        x = nn.functional.leaky_relu(self.b1(self.c1(x)), 0.1)
        x = nn.functional.leaky_relu(self.b2(self.c2(x)), negative_slope=0.2, inplace=True)
        x = self.b3(self.c3(x))
        x = nn.functional.leaky_relu(x, x.shape[1] / 100)  # a slope from the graph: 0.04, as is
        return self.fc2(nn.functional.leaky_relu(self.fc1(x.mean((2, 3)))))


def test_leaky_relu_sequential_and_fx():
    """Conv-BN-LeakyReLU (DarkNet's, YOLO's) and a Linear-LeakyReLU-Linear FFN are fused, each with
    its own slope, from nn.LeakyReLU modules and from F.leaky_relu calls; a slope that is not a
    number fixed in the code leaves a Conv-BN unit; two training steps match the original's."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.LeakyReLU(0.1, inplace=True),
                        nn.Flatten(), nn.Linear(6 * 25, 16), nn.LeakyReLU(), nn.Linear(16, 3)).train()
    fx = _LeakyNet().train()
    x = torch.randn(2, 3, 5, 5)
    cases = ((seq, [("0", "conv_bn_act", "leaky_relu:0.1"), ("4", "ffn", "leaky_relu")]),
             (fx, [("c1", "conv_bn_act", "leaky_relu:0.1"), ("c2", "conv_bn_act", "leaky_relu:0.2"),
                   ("c3", "conv_bn", None), ("fc1", "ffn", "leaky_relu")]))
    for model, want in cases:
        conv = fusedrc.convert(model)
        assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [w[:2] for w in want]
        acts = []
        with fusedrc.use_backend("reference"):
            orig = fusedrc.reference.activation_forward

            def spy(h, activation):
                acts.append(activation)
                return orig(h, activation)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(fusedrc.reference, "activation_forward", spy)
                copy.deepcopy(conv)(x)
        assert [a for a in acts if a != "none"] == [w[2] for w in want if w[2]]
        for _ in range(2):
            model.zero_grad(), conv.zero_grad()
            _assert_same_step(model, conv, x)


def _assert_step_matches_in_float64(model, conv, x):
    """One training step of ``model`` and its conversion ``conv`` on ``x``, judged against ``model`` in
    float64: the BatchNorm biases in front of a conv + BN (MBConv's projections) have a gradient of 0
    in theory, a sum of terms whose size the BN weight's gradient shows, rounding noise in float32
    either way: each error may be 4x the original's, TOL of the gradient, and for a BN bias 1e-6 of
    its weight's gradient. Outputs and running statistics within TOL of the original's."""
    exact = copy.deepcopy(model).double()
    outs = []
    for m, dtype in ((model, torch.float32), (conv, torch.float32), (exact, torch.float64)):
        torch.manual_seed(1)  # stochastic depth and dropout draw from the global generator
        y = m(x.to(dtype))
        y.square().sum().backward()
        outs.append(y)
    assert rel_err(outs[1], outs[0]) <= TOL
    params = [dict(m.named_parameters()) for m in (model, conv, exact)]
    bn_weights = {n + ".weight" for n, m in exact.named_modules() if isinstance(m, nn.BatchNorm2d)}
    for n, p64 in params[2].items():
        err_orig = (params[0][n].grad.double() - p64.grad).norm()
        err_conv = (params[1][n].grad.double() - p64.grad).norm()
        weight = n.removesuffix(".bias") + ".weight"
        noise = 1e-6 * params[2][weight].grad.norm() if n.endswith(".bias") and weight in bn_weights else 0.0
        assert err_conv <= 4 * err_orig + TOL * p64.grad.norm() + noise, n
    for (n, a), (_, b) in zip(model.named_buffers(), conv.named_buffers()):
        assert rel_err(b, a) <= TOL if a.is_floating_point() else torch.equal(a, b), n


def _torchvision_model(name, dropout=0.0):
    """A torchvision classifier, 10 classes, its classifier dropout off (the fused FFN of MobileNetV3 draws
    its own masks; stochastic depth stays, the comparisons seed it), in training mode."""
    try:
        tv = _import_torchvision()
    except ImportError:
        pytest.skip("torchvision is not installed (test extra)")
    torch.manual_seed(0)
    kwargs = {} if dropout is None else {"dropout": dropout}  # None: a model without the argument
    return getattr(tv.models, name)(num_classes=10, **kwargs).train()


@pytest.mark.parametrize("name, blocks, ratio", [("efficientnet_b0", 16, 0.1), ("mobilenet_v2", 17, 0.1)])
def test_mobile_blocks_and_budget(name, blocks, ratio):
    """torchvision's MBConv / InvertedResidual are blocks: policy="blocks" recomputes them whole (fused
    ops inside; stochastic depth replayed), a memory budget below what the units reach is met with
    them; outputs, gradients and statistics match the original's."""
    model = _torchvision_model(name)
    x = torch.randn(2, 3, 32, 32)
    conv = fusedrc.convert(model, policy="blocks", example_inputs=(x,))
    plan = conv.fusedrc_plan
    assert len(plan.blocks) == blocks and all(b.selected and _is_marked(b.module) for b in plan.blocks)
    assert plan.final_bytes / plan.baseline_bytes < ratio
    _assert_step_matches_in_float64(model, conv, x)
    budget = fusedrc.convert(model, memory_budget=0.25, example_inputs=(x,)).fusedrc_plan
    units_only = fusedrc.convert(model, example_inputs=(x,)).fusedrc_plan
    assert budget.final_bytes / budget.baseline_bytes <= 0.25 < units_only.final_bytes / units_only.baseline_bytes


@pytest.mark.parametrize("name, blocks", [("regnet_y_400mf", 16), ("shufflenet_v2_x0_5", 16), ("mnasnet0_5", 16)])
def test_other_torchvision_blocks(name, blocks):
    """RegNet's ResBottleneckBlock, ShuffleNetV2's InvertedResidual and MNASNet's blocks are blocks
    too: policy="blocks" recomputes them whole, as the original computes."""
    model = _torchvision_model(name, dropout=0.0 if name.startswith("mnasnet") else None)
    x = torch.randn(2, 3, 32, 32)
    conv = fusedrc.convert(model, policy="blocks", example_inputs=(x,))
    plan = conv.fusedrc_plan
    assert len(plan.blocks) == blocks and all(b.selected and _is_marked(b.module) for b in plan.blocks)
    assert plan.final_bytes / plan.baseline_bytes < 0.4
    _assert_step_matches_in_float64(model, conv, x)


@pytest.mark.parametrize("name, units, depthwise, kinds", [
    ("efficientnet_b0", 49, 16, {"conv_bn_act", "conv_bn"}),  # Conv-BN-SiLU, the projections' Conv-BN
    ("mobilenet_v3_small", 35, 11, {"conv_bn_act", "conv_bn_relu", "conv_bn", "ffn"}),  # Hardswish, ReLU; SE unfused
    ("mobilenet_v2", 52, 17, {"conv_bn_act", "conv_bn"}),  # ReLU6
])
def test_efficientnet_mobilenet_units(name, units, depthwise, kinds):
    """torchvision EfficientNet-B0 and MobileNetV3: their Conv-BN-act chains (stem, 1x1 expansions,
    depthwise convs, head; SiLU, Hardswish, ReLU) and MobileNetV3's classifier FFN are fused through
    fx; outputs, gradients and BatchNorm statistics match; the bytes kept are no more than
    torch.utils.checkpoint's on the same units (+ mean/rstd)."""
    model = _torchvision_model(name)
    x = torch.randn(2, 3, 32, 32)
    conv = fusedrc.convert(model, example_inputs=(x,))
    plan = conv.fusedrc_plan
    assert sum(m.groups > 1 for m in model.modules() if isinstance(m, nn.Conv2d)) == depthwise
    assert len(plan.fused) == units and {u.kind for u in plan.units} == kinds and not plan.skipped
    # every BatchNorm (each follows a conv) is in a unit
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert sum(u.kind.startswith("conv_bn") for u in plan.units) == n_bn
    assert list(conv.state_dict()) == list(model.state_dict())
    channels = sum(m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert plan.final_bytes < plan.baseline_bytes
    assert plan.final_bytes <= _checkpoint_bytes(conv, (x,)) + 8 * channels
    _assert_step_matches_in_float64(model, conv, x)


@pytest.mark.parametrize("swap", ["silu", "tanh"])
def test_resnet_activation_swapped_after_convert(swap):
    """A BasicBlock's ReLU swapped after convert: to another fused activation, the units run fused
    with it; to one with no fused form, they run the modules. Either way as the original would."""
    torch.manual_seed(0)
    model = _resnet("resnet18").train()
    conv = fusedrc.convert(model)
    for m in (model, conv):
        m.layer1[0].relu = nn.SiLU() if swap == "silu" else nn.Tanh()
    x = torch.randn(2, 3, 32, 32)
    ops = []
    with FusedOpLog(ops):
        copy.deepcopy(conv.layer1[0])(torch.randn(2, 64, 8, 8))
    assert ops == (["conv_bn_act"] * 2 if swap == "silu" else [])
    _assert_same_step(model, conv, x)


@pytest.mark.parametrize("family", ["resnet18", "llama", "opt", "fx", "rwkv"])
def test_converting_a_converted_model_again(family):
    """convert on a converted model plans it afresh, as convert on the original does: the rules'
    rewritten blocks (ResNet's, Llama's gated MLP found by its forward), fused Sequentials and
    convert's own block marks and OPT's inlined-FFN stand-ins are taken as what they were; a block
    marked by hand stays."""
    torch.manual_seed(0)
    if family == "resnet18":
        model, args, kwargs = _resnet("resnet18").train(), (torch.randn(2, 3, 32, 32),), {}
    elif family == "fx":  # an fx-rewritten submodule, one graph per mode, in a model fx cannot trace
        model = _Outer().train()
        args, kwargs = (torch.randn(4, 8),), {}
    elif family == "opt":
        model, args, kwargs = _opt(), (torch.randint(0, 128, (2, 16)),), {}
    else:
        model, args, kwargs, _ = _hf_family(family)
    out = (lambda m: m(*args, **kwargs)) if family in ("resnet18", "fx") else (lambda m: m(*args, **kwargs).logits)
    first = fusedrc.convert(model)
    for policy in ("blocks", "all") if family != "fx" else ("all", "all"):
        fresh = fusedrc.convert(model, policy=policy).fusedrc_plan
        again = fusedrc.convert(first, policy=policy)
        plan = again.fusedrc_plan
        assert plan.fused == fresh.fused and plan.recomputed_blocks == fresh.recomputed_blocks
        assert plan.skipped == fresh.skipped and plan.units[0].kind == fresh.units[0].kind
        assert plan.fused and (policy == "all" or plan.recomputed_blocks)
        assert list(again.state_dict()) == list(model.state_dict())
        first = again
    model.zero_grad()
    torch.manual_seed(5)  # the same dropout masks
    ya = out(model)
    torch.manual_seed(5)
    yb = out(again)
    assert rel_err(yb, ya) <= TOL
    ya.square().mean().backward()
    yb.square().mean().backward()
    _assert_close_models(model, again)
    blocks = fusedrc.convert(again, policy="blocks") if family != "fx" else again
    name = blocks.fusedrc_plan.recomputed_blocks[0] if family != "fx" else "net"
    fusedrc.mark(blocks.get_submodule(name))  # now marked by hand: a later convert leaves it
    with pytest.warns(UserWarning, match="already marked" if family != "fx" else "no pattern found"):
        plan = fusedrc.convert(blocks, policy="blocks" if family != "fx" else "all").fusedrc_plan
    assert (name, "already marked with fusedrc.mark") in plan.skipped
    assert copy.deepcopy(again).fusedrc_plan.fused == again.fusedrc_plan.fused
    if family == "opt":  # a hook on a stand-in: that layer is left as it is, and said
        again.model.decoder.layers[1].fc2.register_forward_hook(lambda *a: None)
        plan = fusedrc.convert(again).fusedrc_plan
        assert fused_without_norms(plan) == ["model.decoder.layers.0.fc1"]
        assert any(n == "model.decoder.layers.1.fc1" and "converted already" in r for n, r in plan.skipped)


class _Outer(nn.Module):
    """A model fx cannot trace whole (``*rest``) around one it can (whose forward reads training)."""

    def __init__(self):
        super().__init__()
        self.net, self.blocks = _TrainingNet(), nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x, *rest):
        return self.blocks[0](self.net(x))


def test_parametrized_linears_are_left_as_they_are():
    """A Linear with a parametrization (weight_norm, spectral_norm: its weight computed at each
    read, spectral_norm's power iteration updating its state) is not fused by convert: a stand-in
    would freeze the computed weight, and the fused paths read it more than once a call."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    seq = nn.Sequential(weight_norm(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 8))
    with pytest.warns(UserWarning, match="no pattern found"):
        assert fusedrc.convert(seq).fusedrc_plan.fused == []
    model = _opt()
    weight_norm(model.model.decoder.layers[0].fc1)
    conv = fusedrc.convert(model)
    assert fused_without_norms(conv.fusedrc_plan) == ["model.decoder.layers.1.fc1"]
    assert list(conv.state_dict()) == list(model.state_dict())
    batches = [torch.randint(0, 128, (2, 16)) for _ in range(2)]
    call = lambda m, b: m(b, labels=b).loss  # noqa: E731
    ref = _train_losses(copy.deepcopy(model), batches, call)
    assert _train_losses(conv, batches, call) == pytest.approx(ref, rel=1e-4)


class _LayerDrop(nn.Module):
    """LayerDrop: which blocks run is drawn in Python at each training call."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_MethodNet() for _ in range(2))  # fused by fx: the root is traced first

    def forward(self, x):
        for b in self.blocks:
            if self.training and torch.rand([]) < 0.5:
                continue
            x = b(x)
        return x


def test_fx_refuses_a_forward_drawing_random_numbers():
    """A forward whose control flow draws random numbers (LayerDrop) is not rewritten by fx (the
    draw would be frozen into the graph); its blocks are fused on their own, and convert leaves
    the RNG stream where it was."""
    torch.manual_seed(0)
    model = _LayerDrop().train()
    state = torch.random.get_rng_state()
    conv = fusedrc.convert(model)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert conv.fusedrc_plan.fused == ["blocks.0.fc1", "blocks.1.fc1"] and "forward" not in conv.__dict__
    assert "draws random numbers" in sys.modules["fusedrc.convert"]._fx_trace(model)[1]
    x = torch.randn(4, 8)
    runs = set()
    for seed in range(12):  # the converted model draws its layers as the original does
        torch.manual_seed(seed)
        ya = model(x)
        torch.manual_seed(seed)
        yb = conv(x)
        assert rel_err(yb, ya) <= TOL
        runs.add(round(ya.sum().item(), 4))
    assert len(runs) > 2


class _Probe(nn.Module):
    """A wrapper reaching its backbone through methods, not calls: the backbone's code (and its
    training flag) is in the wrapper's graph."""

    def __init__(self):
        super().__init__()
        self.backbone = _TrainingNet()

    def forward(self, x):
        return self.backbone.forward(x)


def test_fx_per_mode_graph_watches_modules_reached_through_methods():
    torch.manual_seed(0)
    model = _Probe()
    conv = fusedrc.convert(model)
    assert conv.fusedrc_plan.fused == ["backbone.fc1"]
    x = torch.randn(4, 8)
    model.train()
    model.backbone.eval()  # a linear probe: the backbone deterministic
    conv.train()
    conv.backbone.eval()
    assert torch.equal(conv(x), model(x)) and torch.equal(conv(x), conv(x))


def _timm():
    _import_torchvision_quiet()  # timm imports torchvision
    return pytest.importorskip("timm", reason="timm is not installed (test extra)")


@pytest.mark.parametrize("name, kwargs, kinds, blocks", [
    # BatchNormAct2d (timm's BN + act module): Conv-BN-SiLU and Conv-BN units
    ("efficientnet_b0", {}, {"conv_bn_act": 33, "conv_bn": 16}, 16),
    # nn.Identity placeholders (drop_block, aa) between BN and the activation
    ("resnet18", {}, {"conv_bn_relu": 9, "conv_bn": 11}, 8),
    # timm's deep stem: a Sequential of three convs, the last in no group of it, then the model's bn1 and act1
    ("resnet10t", {}, {"conv_bn_relu": 7, "conv_bn": 7}, 4),
    # timm's Conv2dSame (TensorFlow's 'SAME', padded by the input's size) in the stem and the stride-2
    # depthwise convs: the far side padded before the op
    ("tf_mobilenetv3_small_075", {}, {"conv_bn_act": 18, "conv_bn_relu": 5, "conv_bn": 11}, 11),
    # MixNet's MixedConv2d (its channels split among kernel sizes, Conv2dSame among them) before a BatchNormAct2d:
    # one fused op per split
    ("tf_mixnet_s", {}, {"conv_bn_act": 26, "conv_bn_relu": 7, "conv_bn": 16}, 16),
    # FastViT's ConvMlp (depthwise Conv-BN, then the 1x1-conv FFN): both fused; RepMixerBlocks as blocks
    ("fastvit_t8", {}, {"conv_ffn": 10, "conv_bn": 46}, 10),
    # RDNet's blocks: Sequentials of a depthwise conv, timm's LayerNorm2d, then 1x1 conv -> GELU -> 1x1 conv
    ("rdnet_tiny", {}, {"conv_ffn": 21, "norm": 29}, 21),
    # SwiftFormer: its ConvEncoder's pwconv1 -> GELU -> pwconv2 found by fx, its Mlp (BatchNorm2d first) by the rule
    ("swiftformer_xs", {}, {"conv_bn_relu": 2, "conv_ffn": 20, "conv_bn": 19}, 16),
    # timm's Mlp: fc1 -> GELU -> Dropout -> Identity (norm) -> fc2, one per block, with the block's norm2
    # before it (self.mlp(self.norm2(x))) inside the op
    # the attention's norm1 and the final norm: outputs not kept
    ("vit_tiny_patch16_224", dict(img_size=32), {"norm_ffn": 12, "norm": 13}, 12),
    # gated MLPs found by the fx pass, the block's norm2 inside the op: EVA-02's GluMlp (one fc1, the gate its
    # first half; EvaBlock a block), DINOv2-giant's SwiGLUPacked, AIMv2's SwiGLU (fc1_g, fc1_x) after timm's RmsNorm
    ("eva02_tiny_patch14_224", dict(img_size=32, patch_size=16, depth=2), {"norm_gated_ffn": 2, "norm": 3}, 2),
    ("vit_giant_patch14_dinov2", dict(img_size=32, patch_size=16, embed_dim=48, depth=2, num_heads=2),
     {"norm_gated_ffn": 2, "norm": 3}, 2),
    ("aimv2_large_patch14_224", dict(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=2),
     {"norm_gated_ffn": 2, "norm": 4}, 2),
    # Conv-BN-LeakyReLU(0.01) through BatchNormAct2d; cspnet's DarkBlock
    ("darknet17", {}, {"conv_bn_act": 16}, 5),
    # conv_mlp=True: timm's Mlp of 1x1 convs (timm's GELU) in every ConvNeXtBlock, a fused FFN over channels
    # (timm's LayerNorm2d, channels first, has no functional form modelled: its own forward is rerun)
    ("convnext_atto", {}, {"conv_ffn": 12, "norm": 17}, 12),
    # conv_mlp=False: the block's timm LayerNorm over the permuted channels, then its Mlp of Linears: the
    # norm a leaf of the fx graph, run inside the FFN's op
    ("convnext_atto", dict(conv_mlp=False), {"norm_ffn": 12, "norm": 5}, 12),
    # pre-activation BatchNormAct2d -> Conv units (the stem a Conv-BN-ReLU); dense layers as blocks
    ("densenet121", {}, {"bn_relu_conv": 119, "conv_bn_relu": 1}, 58),
    # PreActBottleneck: norm1 -> conv1 unless a downsample shares norm1's output (then conv1 -> norm2)
    ("resnetv2_50", {}, {"bn_relu_conv": 36, "conv_bn_relu": 8}, 16),
])
def test_timm_models(name, kwargs, kinds, blocks):
    """timm models (built from code, no weights): convert fuses their Conv-BN-act chains and
    MLPs; outputs, gradients and BatchNorm statistics match the original; fewer bytes kept;
    policy="blocks" recomputes timm's blocks."""
    timm = _timm()
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs).train()
    conv = fusedrc.convert(model)
    found = {}
    for u in conv.fusedrc_plan.units:
        found[u.kind] = found.get(u.kind, 0) + 1
    assert found == kinds and not conv.fusedrc_plan.skipped
    assert list(conv.state_dict()) == list(model.state_dict())
    # these end 1x1 at 32 px: BatchNorm over 2 values per channel amplifies float noise
    hw = 64 if name in ("tf_mixnet_s", "swiftformer_xs") else 32
    x = torch.randn(2, 3, hw, hw)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = model(xa), conv(xb)
    assert rel_err(yb, ya) <= TOL
    ya.square().sum().backward()
    yb.square().sum().backward()
    # all gradients as one vector: EfficientNet's projection BN biases have gradients that are
    # zero in theory (the next training BN removes the mean), float noise of the whole's scale
    flat = lambda m: torch.cat([p.grad.flatten() for p in m.parameters()])  # noqa: E731
    assert rel_err(xb.grad, xa.grad) <= TOL and rel_err(flat(conv), flat(model)) <= TOL
    for (n, u), v in zip(model.named_buffers(), conv.buffers()):
        assert rel_err(v, u) <= TOL if u.is_floating_point() else torch.equal(u, v), n
    with SavedBytes() as b:
        conv(x.clone().requires_grad_())
    with SavedBytes() as a:
        model(x.clone().requires_grad_())
    assert b.bytes < a.bytes
    whole = fusedrc.convert(model, policy="blocks")
    assert len(whole.fusedrc_plan.recomputed_blocks) == blocks
    with SavedBytes() as c:
        yc = whole(x.clone().requires_grad_())
    assert c.bytes < b.bytes and rel_err(yc, model(x)) <= TOL  # one more training step each


def test_timm_mlps_with_something_between_their_layers():
    """timm's GatedMlp with gMLP's spatial gating unit, and its Mlp with a norm between the layers: fc1 -> act
    is a fused Linear+act (its pre-activation not kept), the dropout and what follows run as written (the
    gating unit's LayerNorm a recomputed norm); outputs and gradients the original's."""
    _timm()
    from timm.layers import GatedMlp, Mlp
    from timm.models.mlp_mixer import SpatialGatingUnit
    torch.manual_seed(0)
    for mlp, kinds in [(GatedMlp(16, 32, gate_layer=functools.partial(SpatialGatingUnit, seq_len=5), drop=0.1),
                        [("fc1", "linear_act"), ("gate.norm", "norm")]),
                       (Mlp(16, 32, norm_layer=nn.LayerNorm), [("fc1", "linear_act"), ("norm", "norm")])]:
        conv = fusedrc.convert(mlp.eval())
        assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == kinds and not conv.fusedrc_plan.skipped
        with FusedOpLog() as log:
            _assert_same_step(mlp, conv, torch.randn(3, 5, 16))
        assert log.ops.count("linear_act") == 1


def test_timm_vgg_conv_mlp_is_reported():
    """timm's VGG has a ConvMlp of its own (fc1 -> act1 -> drop -> fc2 -> act2, no ``act``): reported as
    not timm's layers.ConvMlp and left as it is."""
    _timm()
    from timm.models.vgg import ConvMlp

    torch.manual_seed(0)
    model = nn.Sequential(ConvMlp(8, 16, kernel_size=3, drop_rate=0.0)).eval()
    with pytest.warns(UserWarning, match="ConvMlp.forward is not timm's"):
        conv = fusedrc.convert(model)
    assert ("0", "ConvMlp.forward is not timm's") in conv.fusedrc_plan.skipped  # (its forward branches: no fx)
    x = torch.randn(2, 8, 5, 5)
    assert torch.equal(conv(x), model(x))


def test_timm_conv_mlps():
    """timm's MLPs of 1x1 convolutions (Mlp(use_conv=True), ConvMlp and inception_next's copy) run as
    one fused FFN over each pixel's channels: NCHW or channels_last in, the same memory format out, the
    bytes a checkpoint of the MLP keeps; the dropout between act and fc2 fused (same results in eval,
    the fused op in training); a norm inside or a changed forward is reported and left."""
    timm = _timm()
    from timm.layers import ConvMlp, Mlp

    mlps = {"mlp": Mlp(16, 48, use_conv=True, drop=0.25), "conv_mlp": ConvMlp(16, 48, act_layer=nn.GELU),
            "inception_next": timm.create_model("inception_next_atto").stages[0].blocks[0].mlp}
    for name, m in mlps.items():
        c = 40 if name == "inception_next" else 16
        conv = fusedrc.convert(nn.Sequential(m))
        assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("0", "conv_ffn")]
        for channels_last in (False, True):
            x = torch.randn(2, c, 5, 8)
            # channels_last: a slice, not dense (its output is channels_last all the same, as the conv's)
            x = x.to(memory_format=torch.channels_last)[..., :7] if channels_last else x[..., :7]
            m.eval(), conv.eval()
            assert rel_err(conv(x), m(x)) <= 1e-6
            m.train(), conv.train()
            if name == "mlp":  # its dropout: fused (mask regenerated in backward), so draws differ
                with FusedOpLog() as log:
                    conv(x)
                assert log.ops == ["fused_mlp"]
                continue
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            with SavedBytes() as kept:
                yb = conv(xb)
            ya = m(xa)
            assert yb.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
            assert kept.bytes == x.numel() * 4  # x's rows (a copy unless a dense channels_last), nothing hidden-sized
            ya.square().sum().backward()
            yb.square().sum().backward()
            assert rel_err(xb.grad, xa.grad) <= TOL
            for p, q in zip(m.parameters(), conv.parameters()):
                assert rel_err(q.grad, p.grad) <= TOL
            m.zero_grad()
            conv.zero_grad()
    dev = backend_device("triton")  # the kernels: on CUDA, or Triton's interpreter on the CPU
    m = mlps["conv_mlp"].to(dev)
    conv = fusedrc.convert(nn.Sequential(m))
    x = torch.randn(2, 16, 3, 5, device=dev).to(memory_format=torch.channels_last)
    with fusedrc.use_backend("triton"), FusedOpLog() as log:
        y = conv(x)
    assert log.ops == ["fused_mlp_triton"] and rel_err(y, m(x)) <= 1e-5
    class Mlp(nn.Module):  # a user's class named like timm's: the checks by shape apply, not timm's rule
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    assert [(u.name, u.kind) for u in fusedrc.convert(nn.Sequential(Mlp())).fusedrc_plan.units] == [("0", "gated_ffn")]
    normed = ConvMlp(16, 48, norm_layer=nn.BatchNorm2d)  # the fx pass fuses fc1 -> BN -> ReLU instead
    with pytest.warns(UserWarning, match="a BatchNorm2d inside the MLP has no fused form"):
        plan = fusedrc.convert(nn.Sequential(normed)).fusedrc_plan
    assert [(u.name, u.kind) for u in plan.units] == [("0.fc1", "conv_bn_relu")]


def test_timm_fastvit_conv_mlp():
    """FastViT's ConvMlp (its depthwise Conv-BN, then fc1 -> GELU -> Dropout -> fc2 -> the same Dropout): the
    Conv-BN (found by fx inside the rule's wrapper) and the FFN each a fused unit; training steps the
    original's. A hook on fc1 runs the FFN's modules as they are, the Conv-BN still fused."""
    _timm()
    from timm.models.fastvit import ConvMlp

    torch.manual_seed(0)
    model = nn.Sequential(ConvMlp(8, 24)).train()
    conv = fusedrc.convert(model)
    assert sorted((u.name, u.kind) for u in conv.fusedrc_plan.units) == [("0", "conv_ffn"), ("0.conv.conv", "conv_bn")]
    x = torch.randn(2, 8, 7, 6)
    for fused in (["conv_bn_act", "fused_mlp"], ["conv_bn_act"]):
        assert _copy_forward_ops(conv, x) == fused
        model.zero_grad(), conv.zero_grad()
        _assert_same_step(model, conv, x)
        model[0].fc1.register_forward_hook(lambda *args: None)
        conv[0].fc1.register_forward_hook(lambda *args: None)


def test_sequential_pointwise_conv_ffn():
    """``nn.Sequential(1x1 conv, act, [Dropout], 1x1 conv)`` (RDNet's blocks, a ConvNeXt written with convs): one
    fused FFN over each pixel's channels (kind conv_ffn), keeping x alone; training steps the original's, NCHW
    and channels_last; the same chain found by fx in a module's forward. An activation with no fused form is
    reported; a 3x3 conv after the act is no FFN, nor is a squeeze-excitation's narrowing MLP."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 32, 1), nn.GELU(), nn.Dropout(0.0), nn.Conv2d(32, 8, 1)).train()
    conv = fusedrc.convert(model)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("0", "conv_ffn")]
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(2, 8, 5, 7).contiguous(memory_format=fmt)
        ops = []
        with FusedOpLog(ops), SavedBytes() as kept:
            conv(x.clone().requires_grad_())
        assert ops == ["fused_mlp"] and kept.bytes == x.numel() * 4
        model.zero_grad(), conv.zero_grad()
        _assert_same_step(model, conv, x)
    # found by fx too: attributes, a functional GELU, a Dropout; the residual reads the input
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.pw1, self.drop, self.pw2 = nn.Conv2d(8, 32, 1), nn.Dropout(0.0), nn.Conv2d(32, 8, 1)

        def forward(self, x):
            return x + self.pw2(self.drop(nn.functional.gelu(self.pw1(x))))

    model = Encoder().train()
    conv = fusedrc.convert(model)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("pw1", "conv_ffn")]
    x = torch.randn(2, 8, 5, 7)
    ops = []
    with FusedOpLog(ops):
        conv(x)
    assert ops == ["fused_mlp"]
    _assert_same_step(model, conv, x)
    with pytest.warns(UserWarning, match="activation ELU has no fused form"):
        plan = fusedrc.convert(nn.Sequential(nn.Conv2d(8, 32, 1), nn.ELU(), nn.Conv2d(32, 8, 1))).fusedrc_plan
    assert plan.units == [] and plan.skipped == [("0", "activation ELU has no fused form")]
    for seq in (nn.Sequential(nn.Conv2d(8, 32, 1), nn.ReLU(), nn.Conv2d(32, 8, 3)),
                nn.Sequential(nn.Conv2d(8, 2, 1), nn.ReLU(), nn.Conv2d(2, 8, 1))):  # squeeze-excitation's: narrows
        with pytest.warns(UserWarning, match="no pattern"):
            assert fusedrc.convert(seq).fusedrc_plan.units == []


def test_timm_metaformer_star_relu():
    """timm's MetaFormer MLPs with StarReLU (``scale * relu(h) ** 2 + bias``, learned scalars), CAFormer's
    layout: 1x1-conv MLPs (stages 0-1) and Linear MLPs found by fx (stages 2-3) run as one fused
    squared-ReLU FFN, scale and bias folded into the second layer (``(s a + b) W^T = a (s W)^T + b W 1``);
    outputs and every gradient (scale's and bias's too) the original's, fewer bytes kept. A lone
    Linear -> StarReLU is a fused Linear + squared ReLU with the scale and bias after it; a dropout
    between the layers (the bias would not fold through it) is reported and left."""
    timm = _timm()
    from timm.models.metaformer import Attention, LayerNorm2dNoBias, LayerNormNoBias, MetaFormer, SepConv, StarReLU
    torch.manual_seed(0)
    model = MetaFormer(depths=(1, 1, 1, 1), dims=(16, 32, 64, 64), num_classes=10,
                       token_mixers=[SepConv, SepConv, Attention, Attention],
                       norm_layers=[LayerNorm2dNoBias] * 2 + [LayerNormNoBias] * 2).train()
    for m in model.modules():
        if isinstance(m, StarReLU):
            with torch.no_grad():
                m.scale.uniform_(0.5, 1.5), m.bias.uniform_(-0.5, 0.5)
    conv = fusedrc.convert(model)
    units = [(u.name, u.kind) for u in conv.fusedrc_plan.units if u.kind != "norm"]
    assert units == [("stages.0.blocks.0.mlp", "conv_ffn"), ("stages.1.blocks.0.mlp", "conv_ffn"),
                     ("stages.2.blocks.0.mlp.fc1", "ffn"), ("stages.3.blocks.0.mlp.fc1", "ffn"),
                     ("head.fc.fc1", "linear_act")] and not conv.fusedrc_plan.skipped
    x = torch.randn(2, 3, 64, 64)
    with FusedOpLog() as log:
        xa, xb = _assert_same_step(model, conv, x)
    assert log.ops.count("fused_mlp") == 4
    assert rel_err(xb.grad, xa.grad) <= TOL
    for (n, p), q in zip(model.named_parameters(), conv.parameters()):
        assert rel_err(q.grad, p.grad) <= 1e-4, n
    with SavedBytes() as b:
        conv(x.clone().requires_grad_())
    with SavedBytes() as a:
        model(x.clone().requires_grad_())
    assert b.bytes < 0.7 * a.bytes

    lone = nn.Sequential(nn.Linear(8, 12), StarReLU(scale_value=0.7, bias_value=0.2))
    conv = fusedrc.convert(lone)
    assert [(u.name, u.kind) for u in conv.fusedrc_plan.units] == [("0", "linear_act")]
    with FusedOpLog() as log:
        _assert_same_step(lone, conv, torch.randn(3, 8))
    assert log.ops == ["linear_act", "linear_act_backward"]


@pytest.mark.parametrize("form", ["ffn", "lone"])
def test_star_relu_under_autocast_and_in_bf16(form):
    """StarReLU's scale and bias (fp32 parameters) folded under bf16 autocast, and in a bf16 model: the
    output's dtype is the original's (StarReLU's fp32 scalars promote a lone unit's output to fp32 under
    autocast) and it and every gradient agree to bf16's rounding."""
    _timm()
    from timm.models.metaformer import StarReLU
    torch.manual_seed(0)
    layers = [nn.Linear(16, 48), StarReLU(scale_value=0.8, bias_value=0.3)]
    model = nn.Sequential(*layers, nn.Linear(48, 16)) if form == "ffn" else nn.Sequential(*layers)
    conv = fusedrc.convert(model)
    assert [u.kind for u in conv.fusedrc_plan.units] == ["ffn" if form == "ffn" else "linear_act"]
    x = torch.randn(5, 16)
    for ref, new, cast in ((model, conv, True), (copy.deepcopy(model).bfloat16(), copy.deepcopy(conv).bfloat16(), False)):
        xa = x.to(next(ref.parameters()).dtype).detach().requires_grad_()
        xb = xa.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
            ya, yb = ref(xa), new(xb)
        assert yb.dtype == ya.dtype and rel_err(yb, ya) < 2e-2
        ya.float().square().sum().backward()
        yb.float().square().sum().backward()
        assert rel_err(xb.grad, xa.grad) < 3e-2
        for (n, p), q in zip(ref.named_parameters(), new.parameters()):
            assert q.grad.dtype == p.grad.dtype and rel_err(q.grad, p.grad) < 3e-2, n
    dropped = nn.Sequential(nn.Linear(8, 12), StarReLU(), nn.Dropout(0.1), nn.Linear(12, 8))
    with pytest.warns(UserWarning, match="bias does not fold through the dropout"):
        plan = fusedrc.convert(dropped).fusedrc_plan
    assert not plan.fused


class _Gate(nn.Module):
    """A submodule fx inlines into its parent's graph (not a torch module)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(8, 8)

    def forward(self, x):
        return x * torch.sigmoid(self.scale(x))


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.gate = nn.Linear(8, 32), nn.Linear(32, 8), _Gate()

    def forward(self, x):
        return self.gate(self.fc2(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("change", ["hook", "swap", "delete_leaf", "mark"])
def test_fx_graph_gives_way_to_changes_of_the_modules_it_inlined(change):
    """The fx graph holds the code of the submodules it inlined: a hook added to one after
    convert, one replaced (timm's reparameterize_model), a called module deleted, one marked:
    the class's forward runs then, unfused, and computes what the original does."""
    torch.manual_seed(0)
    model = _Gated()
    conv = fusedrc.convert(model)
    assert conv.fusedrc_plan.fused == ["fc1"] and "forward" in conv.__dict__
    x = torch.randn(4, 8)
    calls = []
    for m in (model, conv):
        if change == "hook":
            m.gate.register_forward_hook(lambda mod, i, o: calls.append(1) or o * 0)
        elif change == "swap":
            m.gate = nn.Identity()
        elif change == "delete_leaf":  # a module called by the graph removed (its parent reworked)
            del m.gate.scale
            m.gate.__class__ = type("Reworked", (nn.Module,), {"forward": lambda self, x: x + 1})
        else:
            fusedrc.mark(m.gate)
    with FusedOpLog() as log:
        y = conv(x)
    assert torch.equal(y, model(x)) and log.ops == []
    if change == "hook":
        assert calls == [1, 1] and not y.any()


def test_batchnormact_swapped_into_a_unit_runs_the_modules_as_they_are():
    """timm's BatchNormAct2d put where a fused unit's BatchNorm2d was (its own activation, then
    the unit's activation and residual): the unit runs its modules as they now are."""
    timm = _timm()
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    model = _resnet("resnet18").train()
    conv = fusedrc.convert(model)
    for m in (model, conv):
        bn = BatchNormAct2d(64, apply_act=False)
        torch.manual_seed(1)
        bn.weight.data.uniform_(0.5, 1.5)
        m.layer1[0].bn2 = bn  # the residual tail's norm
    x = torch.randn(2, 3, 32, 32)
    assert rel_err(conv(x), model(x)) <= TOL
    assert timm is not None


def test_fx_refuses_python_and_numpy_random_draws():
    """LayerDrop drawn with Python's random (MusicGen) or NumPy's (wav2vec2) is random control
    flow too: no fx rewrite of that forward, and both generators are left where they were."""
    import random

    np = pytest.importorskip("numpy")

    class Drop(nn.Module):
        def __init__(self, numpy):
            super().__init__()
            self.numpy, self.blocks = numpy, nn.ModuleList(_MethodNet() for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                if self.training and (np.random.rand() if self.numpy else random.random()) < 0.5:
                    continue
                x = b(x)
            return x

    for numpy in (False, True):
        model = Drop(numpy).train()
        py, npy = random.getstate(), np.random.get_state()
        conv = fusedrc.convert(model)
        assert random.getstate() == py and np.random.get_state()[2:] == npy[2:]
        assert "forward" not in conv.__dict__ and len(conv.fusedrc_plan.fused) == 3
        x = torch.randn(4, 8)
        for seed in range(6):
            random.seed(seed)
            np.random.seed(seed)
            ya = model(x)
            random.seed(seed)
            np.random.seed(seed)
            assert rel_err(conv(x), ya) <= TOL


class _Flagged(nn.Module):
    """A forward branching on a plain attribute (timm's grad_checkpointing, a drop rate)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.double = nn.Linear(8, 32), nn.Linear(32, 8), False

    def forward(self, x):
        x = self.fc2(torch.relu(self.fc1(x)))
        return 2 * x if self.double else x


def test_fx_graph_gives_way_to_a_changed_attribute():
    """fx freezes the plain attributes a forward reads: when one changes after convert (timm's
    set_grad_checkpointing), the model's own forward runs, and computes what the original does."""
    torch.manual_seed(0)
    model = _Flagged()
    conv = fusedrc.convert(model)
    assert conv.fusedrc_plan.fused == ["fc1"]
    x = torch.randn(4, 8)
    assert torch.equal(conv(x), model(x))
    model.double = conv.double = True
    assert torch.equal(conv(x), model(x))
    timm = _timm()
    net = fusedrc.convert(timm.create_model("resnet18", pretrained=False, num_classes=10))
    calls = []
    real = torch.utils.checkpoint.checkpoint
    try:
        torch.utils.checkpoint.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)
        net.set_grad_checkpointing(True)
        net(torch.randn(2, 3, 32, 32, requires_grad=True)).sum().backward()
    finally:
        torch.utils.checkpoint.checkpoint = real
    assert len(calls) == 8  # one per block, as unconverted


def test_fx_traces_what_a_graph_calls_on_its_own():
    """Modules a graph calls rather than inlines are traced on their own: one kept a call for its
    forward hook (feature extraction), a Hugging Face layer (a block under policy="blocks", whose
    mark must see its calls)."""
    class Stem(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()

        def forward(self, x):
            return self.relu(self.bn(self.conv(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = Stem()
            self.head = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())

        def forward(self, x):
            return self.head(self.stem(x))

    torch.manual_seed(0)
    model = Net()
    model.stem.register_forward_hook(lambda *a: None)
    assert sorted(fusedrc.convert(model).fusedrc_plan.fused) == ["head.0", "stem.conv"]

    tr = _transformers()
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Layer(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.proj, self.act = nn.Linear(16, 16), nn.ReLU()
            self.mlp = tr.models.llama.modeling_llama.LlamaMLP(tr.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                                                              num_key_value_heads=2))

        def forward(self, x):
            return self.mlp(self.act(self.proj(x)))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Layer()

        def forward(self, x):
            return self.layer(x)

    outer = Outer()
    x = torch.randn(2, 4, 16)
    for policy in ("all", "blocks"):
        conv = fusedrc.convert(outer, policy=policy)
        assert sorted(conv.fusedrc_plan.fused) == ["layer.mlp", "layer.proj"]
        with FusedOpLog() as log:
            y = conv(x)
        assert rel_err(y, outer(x)) <= TOL
        if policy == "all":
            assert {"linear_act", "gated_mlp"} <= set(log.ops) and "forward" not in conv.__dict__
        else:  # the layer recomputed whole (its units run plain inside the region)
            assert conv.fusedrc_plan.recomputed_blocks == ["layer"]
