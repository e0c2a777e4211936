"""``fusedrc.convert``: rewrite a real model so its recompute-friendly chains run fused.

``convert(model)`` finds, without changing what the model computes,

* every ``Conv2d -> BatchNorm2d -> act`` chain (act: ReLU, or SiLU, GELU, ... as for the
  FFN; EfficientNet's and YOLO's Conv-BN-SiLU; a conv padding one side wider, 'same' of an
  even kernel or timm's ``Conv2dSame``, included; timm's ``MixedConv2d`` as one op per split;
  timm's deep stem's last conv with the ``bn1``/``act1`` after it) and every
  ``Conv2d -> BatchNorm2d -> (+ identity) -> ReLU`` residual tail (torchvision
  ``BasicBlock``/``Bottleneck`` and the ResNet stem): they run
  :func:`fusedrc.functional.conv_bn_act` (``residual=`` for the tail);
* every FFN ``Linear -> act -> [Dropout] -> Linear`` (plain ``nn.Sequential``,
  Hugging Face ``OPTDecoderLayer`` and ``T5DenseActDense``): it runs
  :func:`fusedrc.functional.fused_mlp`, an ``nn.Dropout`` between the layers fused into it
  (mask regenerated in backward: same distribution, its own random stream); a lone
  ``Linear -> act`` runs ``linear_act``; a pre-norm layer's norm before its FFN runs inside
  the FFN's op (``norm_ffn``);
* every other norm module with a functional form (``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``,
  timm's LayerNorm, Hugging Face RMSNorm classes that pass ``norm_kind``'s probe): it keeps only its
  input, and within the converted model's call the ops that keep its output keep a recipe instead,
  rebuilt once in backward (kind ``norm``, ``_RecomputedNorm``);

and, with ``policy="blocks"`` or a ``memory_budget``, recomputes whole blocks with
:func:`fusedrc.mark` (MindSpore's ``Cell.recompute()``), fused ops inside.

Parameters and buffers are the original tensors (``inplace=True``) or copies of
them, and every state_dict key is unchanged: the rewritten blocks are wrapper
modules that hold the very same submodules under the same names.

How patterns are found
----------------------
1. **Rules** for known block classes, looked up by class name (so fusedrc never
   imports torchvision or transformers): ``BasicBlock``, ``Bottleneck``, ``ResNet``
   (the stem) from ``torchvision.models.resnet``, and as blocks ``InvertedResidual``
   (MobileNetV2/V3, ShuffleNetV2), ``MBConv``/``FusedMBConv`` (EfficientNet), MNASNet's, RegNet's
   ``ResBottleneckBlock``, ConvNeXt's ``CNBlock``, Swin's and ViT's encoder blocks; from ``transformers``,
   ``OPTDecoderLayer`` and the BART-style layers that inline their FFN the same way
   (``_INLINE_FFN_LAYERS``, and by shape any ``GradientCheckpointingLayer`` holding
   ``fc1``/``activation_fn``/``fc2``; the rule reads the forward's source and checks its lines),
   ``GPT2MLP`` and its copies (``Conv1D`` layers), SAM 3's ``Sam3MLP`` / ``Sam3LiteTextMLP`` (a dropout before the
   activation), ``T5DenseActDense`` / ``T5DenseGatedActDense`` / ``T5Block``,
   ``AlbertLayer`` (its ``ff_chunk``), RWKV's ``RwkvFeedForward`` (its ``key -> relu^2 -> value``; the time shift,
   receptance gate and state as the module has them);
   and, by shape rather than class name, every layer whose ``feed_forward_chunk``, ``intermediate``
   and ``output`` are BERT's (``_split_ffn_layer``: RoBERTa, XLM-R, ELECTRA, ... copy them; DeBERTa and
   MPNet call the two inline, ``_inline_split_ffn_layer``), every module
   whose forward is Phi-3's MLP or Moshi's gating MLP (``_gate_up_mlp``: gate and up projections in one
   ``gate_up_proj`` or ``fc1``), every module holding ``gate_proj`` /
   ``up_proj`` / ``down_proj`` / ``act_fn`` whose forward is Llama's gated MLP
   (``_gated_mlp``: Llama, Mistral, Qwen, Gemma, OLMo, ...; Gemma 4's vision MLP on ``ClippableLinear`` projections
   that do not clip; GLM's vision patch mergers, their ``proj``/norm/``act1`` prelude run as the module's), and every
   Mixture-of-Experts
   experts module under transformers' experts interface (``_experts``: Mixtral, Qwen2/3-MoE,
   OLMoE, DeepSeek-V3, ...; it runs :func:`fusedrc.functional.moe_experts`; JetMoE's ``JetMoeMoE``, Llama 4's
   ``Llama4TextExperts``,
   LongCat-Flash's ``LongcatFlashExperts`` (identity experts), DBRX's ``DbrxExperts`` and Step-3.7's
   ``Step3p7Experts`` (its clamped SwiGLU) by name; DeepSeek-V4's, GLM-5-Next's, HY-V4's and MiniMax-M3's
   clamped ``_apply_gate`` under the interface, and gpt-oss's and the OpenAI privacy filter's (biases, gpt-oss's
   interleaved gate/up rows), Beam's fp32 one and Inkling2's softcapped one; MiniMax-M3's dense MLP and Inkling's
   shared experts by name); timm's
   MLPs of 1x1
   convolutions (``Mlp(use_conv=True)``, ``ConvMlp``, FastViT's ``ConvMlp`` after its Conv-BN and
   SwiftFormer's ``Mlp`` after its BatchNorm2d: a fused FFN
   over each pixel's channels; with MetaFormer's StarReLU, ``_affine_act``, folded into the second layer,
   as in fx's FFNs).
2. **Plain ``nn.Sequential``** runs of the patterns above, anywhere in the model (and
   ``1x1 conv -> act -> [Dropout] -> 1x1 conv``, RDNet's, as the same fused FFN over channels).
3. **torch.fx**, on the outermost modules with no rule's or Sequential's find inside
   that trace (the model itself when it does; Hugging Face models mostly do not, their
   MLP modules do): ``call_module`` chains Conv2d -> BatchNorm2d -> act,
   Linear -> act -> [Dropout] -> Linear (or a lone Linear -> act) and its 1x1-conv twin
   (SwiftFormer's ``ConvEncoder``), and gated FFNs (two Linears
   of one input, or one Linear's chunked halves, one through act times the other, then the down
   Linear: timm's SwiGLU and GluMlp) become one call of a parameter-free fused module. An
   activation may be a module, a function, or written out as elementwise ops (``_WrittenAct``:
   ESM's erf GELU, a Swish), known by what it computes on a float64 probe. A graph is used only where it holds for every call
   (see ``_fx_trace``); a forward that reads ``training`` gets one graph per mode.
   Linear subclasses that compute ``F.linear`` (``LINEAR_EQUIVALENTS``: Falcon's) count as Linears.

Every Hugging Face ``GradientCheckpointingLayer`` that no rule made a block in, around
or inside becomes a block too.

Anything that would change semantics is left as it is and reported in the plan
(a dropout inside an FFN other than one ``nn.Dropout``, an unknown activation, a padding mode
other than zeros, hooks on the modules, a forward that does not have the expected shape).

How to add a rule
-----------------
A rule is a function ``rule(ctx, name, module)`` registered for a class name with
:func:`register_rule`. It returns the module that replaces ``module`` (or
``module`` itself) after declaring what can be recomputed:

* ``ctx.unit(name, kind, enable, disable, recompute_modules)`` declares one fused
  unit: ``enable()``/``disable()`` switch it on and off (convert toggles units to
  measure them), ``recompute_modules`` are the Linear/Conv2d modules whose
  forward the fused op reruns in backward (its time cost);
* ``ctx.block(name, module)`` declares a whole block that ``policy="blocks"`` or a
  budget may recompute with :func:`fusedrc.mark`;
* ``ctx.skip(name, reason)`` reports a pattern left unfused.

The usual way to rewrite a block is a :class:`Wrapper` subclass: ``Wrapper.wrap(m)``
turns ``m`` itself into the subclass (its submodules, parameters, buffers, attributes
and hooks stay; convert works on a deep copy unless ``inplace=True``), and
``self.plain(*args)`` runs the original class's forward. Switches handed to
``ctx.unit`` should be picklable objects, not closures, so converted models pickle. Its
forward checks ``self.sites[key]`` (a :class:`Site`) and calls the fused op when the
site is enabled and the call is one the op models (``_cbr`` below). Example for a
block ``y = relu(bn(conv(x)))`` held as ``self.conv``/``self.bn``/``self.act``::

    class FusedMyBlock(Wrapper):
        def forward(self, x):
            return _cbr(self.sites["conv"], self.conv, self.bn, self.act, x)

    @register_rule("MyBlock")
    def _my_block(ctx, name, m):
        new = FusedMyBlock.wrap(m)
        _declare_cbr(ctx, new, name, "conv", m.conv, m.bn, m.act)
        ctx.block(name, new)
        return new

Rules run before the Sequential and fx passes; submodules of a rewritten block
are still visited (a Sequential inside it is matched as usual).
"""
from __future__ import annotations

import ast as _ast
import contextlib
import copy
import fnmatch
import functools
import inspect as _inspect
import math
import numbers
import operator
import random as _random
import re as _re
import textwrap as _textwrap
import sys as _sys
import threading as _threading
import types
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from . import functional as F
from ._patterns import (_bn_call, _conv_padding, _foreign_forward, _has_hooks, _own_hooks, _user_hooks, activation_name,
                        bn_act_conv_call, conv_bn_act_call, conv_parts, conv_weight, fused_dropout_p, global_hooks,
                        is_conv_same, is_linear, is_mixed_conv, is_same_depthwise, norm_call_args, norm_kind,
                        same_attributes, _uncount)
from ._recomputed_norm import recomputed_norm, scope_enter, scope_exit
from ._recomputed_norm import usable as recomputable
from ._saved import SavedBytes
from ._state import inside_region, top_saved_tensors_pack, traced, under_recompute_hooks
from .recompute import _MARK, _is_marked, _mark, bind_replicas, unmark
from . import reference
from .reference import leaky_relu_name, norm_forward

__all__ = ["convert", "register_rule", "Wrapper", "Site", "ConvertPlan", "saved_bytes", "import_torchvision"]

# --------------------------------------------------------------------------- measuring


class _Frozen:
    """Run a model without leaving a trace: buffers (BatchNorm statistics) and RNG restored."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.buffers = [(b, b.clone()) for b in self.model.buffers()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def saved_bytes(model, example_inputs):
    """Bytes autograd keeps for one forward of ``model(*example_inputs)`` (parameters and their views excluded).

    The model's buffers and the RNG state are left as they were.
    """
    counter = SavedBytes(model.parameters())
    with _Frozen(model), torch.enable_grad(), counter:
        out = model(*example_inputs)
    del out
    return counter.activation_bytes


def _baseline_bytes(model, example_inputs):
    """saved_bytes of the model as it computes unconverted (every unit and block off): a failure
    there is the example's, and says so."""
    try:
        return saved_bytes(model, example_inputs)
    except Exception as e:
        raise ValueError(
            f"example_inputs: calling the model with them failed ({type(e).__name__}: {e}); expected a tuple "
            "of the model's positional arguments, on its device and in its dtype") from e


def _flops(module, inp, out):
    if isinstance(module, nn.Conv2d):
        k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels // module.groups
        return 2 * out.numel() * k
    if isinstance(module, nn.Linear):
        return 2 * out.numel() * module.in_features
    if _is_conv1d(module):
        return 2 * out.numel() * module.weight.shape[0]
    if _is_parallel_experts(module):  # JetMoE's: one F.linear per expert on its rows
        return 2 * out.numel() * module.weight.shape[2]
    return 0


def _is_parallel_experts(module):
    """JetMoE's ``JetMoeParallelExperts``: a (num_experts, out, in) weight, each expert's rows through
    ``F.linear``."""
    return type(module).__name__ == "JetMoeParallelExperts" and isinstance(module._parameters.get("weight"), nn.Parameter) \
        and module.weight.dim() == 3


def _is_conv1d(module):
    """transformers' ``Conv1D`` (GPT-2): ``x @ weight + bias``, weight (in, out)."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor) \
        and module.weight.dim() == 2 and module.weight.shape[1] == getattr(module, "nf", None)


_EXPERTS_NAMES = ("hidden_states", "top_k_index", "top_k_weights")  # the experts interface's arguments


def _experts_flops(module, args, kwargs):
    """(the experts' forward, the gate and up projections a fused unit reruns in backward) in FLOPs."""
    gate_up, down = _experts_weights(module)
    return _routed_flops(args, kwargs, gate_up.shape[1:], down.shape[1:],
                         names=module.__dict__.get("_fusedrc_names", _EXPERTS_NAMES))


def _routed_flops(args, kwargs, gate_up, down, count=None, names=_EXPERTS_NAMES):
    """(forward, rerun) FLOPs of an experts call ``(hidden_states, top_k_index, top_k_weights)``: each routed choice
    (``count(top_k_index)`` of them; every choice by default) runs its gate and up GEMMs, ``gate_up`` (2I, K) an
    expert (rerun in backward), and its down GEMM, ``down`` (N, I); (0, 0) for a call of another shape."""
    try:
        idx = _experts_args(args, kwargs, names)[1]
    except TypeError:
        return 0, 0
    if not isinstance(idx, torch.Tensor):
        return 0, 0
    n = idx.numel() if count is None else count(idx)
    rerun = 2 * n * gate_up[0] * gate_up[1]
    return rerun + 2 * n * down[0] * down[1], rerun


def _measure_flops(model, example_inputs):
    flops, handles = {}, []
    for m in model.modules():
        if hasattr(type(m), "_fusedrc_flops"):  # experts: their FLOPs depend on the routing
            def hook(mod, args, kwargs, out):
                whole, rerun = mod._fusedrc_flops(args, kwargs)
                key = id(mod.__dict__["_fusedrc_recompute"])
                flops[id(mod)], flops[key] = flops.get(id(mod), 0) + whole, flops.get(key, 0) + rerun
            handles.append(m.register_forward_hook(hook, with_kwargs=True))
            continue
        if isinstance(m, (nn.Conv2d, nn.Linear)) or _is_conv1d(m) or _is_parallel_experts(m):
            def hook(mod, i, o):
                if isinstance(o, torch.Tensor):
                    flops[id(mod)] = flops.get(id(mod), 0) + _flops(mod, i, o)
            handles.append(m.register_forward_hook(hook))
    try:
        with _Frozen(model), torch.no_grad():
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return flops


# --------------------------------------------------------------------------- wrappers and sites


class Site:
    """One fusable chain inside a wrapper: ``enabled`` switches the fused op on."""

    __slots__ = ("enabled", "impl")

    def __init__(self):
        self.enabled = False
        self.impl = "fused"  # "checkpoint": torch.utils.checkpoint on the same unit (for comparisons)

    def __deepcopy__(self, memo):
        s = Site()
        s.enabled, s.impl = self.enabled, self.impl
        return s


class Wrapper(nn.Module):
    """Base of rewritten blocks: shares the original module's state, keeps its keys."""

    @classmethod
    def wrap(cls, module):
        """``module`` itself, turned into this class: its submodules, parameters, buffers,
        attributes and hooks stay as they are, and a user's references to it see the fused
        module (``convert(inplace=True)`` rewrites the object it was given; without inplace,
        convert works on a deep copy). ``self.plain`` runs the original class's forward."""
        original = _class_of(module)  # a Wrapper already (an earlier convert): its original class
        module.__class__ = cls
        module.__dict__["_fusedrc_original_class"] = original
        module.__dict__["sites"] = {}
        return module

    def plain(self, *args, **kwargs):
        """The original class's forward, on this module's (shared) submodules."""
        return self._fusedrc_original_class.forward(self, *args, **kwargs)

    def __getattr__(self, name):
        # submodules, parameters and buffers first; then the original class's methods and class
        # attributes, which its own code (and its users) call on this module: torchvision ResNet's
        # _forward_impl, DenseNet's bn_function under its checkpoint
        try:
            return super().__getattr__(name)
        except AttributeError:
            attr = self._fusedrc_static(name)
            if attr is _MISSING:
                raise
            get = getattr(type(attr), "__get__", None)  # as Python binds: through the attribute's type
            return attr if get is None else get(attr, self, self._fusedrc_original_class)

    def __setattr__(self, name, value):
        # a property (data descriptor) of the original class runs its setter, as on the original
        attr = self._fusedrc_static(name) if not hasattr(type(self), name) else _MISSING
        setter = getattr(type(attr), "__set__", None) if attr is not _MISSING else None
        if setter is not None:
            setter(attr, self, value)
        else:
            super().__setattr__(name, value)

    def _fusedrc_static(self, name):
        original = self.__dict__.get("_fusedrc_original_class")
        return _inspect.getattr_static(original, name, _MISSING) if original is not None else _MISSING

    def _get_name(self):
        return "Fused" + self._fusedrc_original_class.__name__


def _class_of(m):
    """The class a module had before convert: a rule's :class:`Wrapper` (an earlier convert's)
    remembers it. Rules and checks look at this one, so converting a converted model again
    rewrites its blocks afresh, as the first convert did."""
    return m.__dict__.get("_fusedrc_original_class", type(m)) if isinstance(m, (Wrapper, _FusedSequential)) \
        else type(m)


def _sites(model):
    """Every :class:`Site` held in ``model``'s modules (a Wrapper's, a stand-in's, a split FFN's)."""
    for m in model.modules():
        yield from m.__dict__.get("sites", {}).values()
        if isinstance(m.__dict__.get("site"), Site):
            yield m.__dict__["site"]
        yield from (f.site for f in _split_ffns(m).values())


def _set_impl(model, impl):
    """Run every fused unit of a converted model as ``impl``: "fused" (default) or "checkpoint"
    (``torch.utils.checkpoint`` on the same unit; for comparisons)."""
    for s in _sites(model):
        s.impl = impl
    return model


def _nohooks(*mods):
    return not any(m is not None and _has_hooks(m) for m in mods)


def _free(*mods) -> bool:
    """No hooks on the modules and none marked with ``fusedrc.mark``: what a head that fuses across its
    peers' calls needs (a marked peer is called through its mark, not from its layer's forward, so it
    would not see that the head ran for it; the user's mark is honoured instead)."""
    return _nohooks(*mods) and not any(m is not None and _is_marked(m) for m in mods)


def _run_site(site, fused, plain, *args):
    if site is None or not site.enabled:
        return plain(*args)
    if site.impl == "checkpoint":
        if torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(plain, *args, use_reentrant=False)
        return plain(*args)
    return fused(*args)


def _is_conv2d(m):
    """An ``nn.Conv2d``, timm's ``Conv2dSame`` (a Conv-BN chain's conv: its asymmetric padding modelled) or
    timm's ``MixedConv2d`` (one Conv-BN per split)."""
    return type(m) is nn.Conv2d or is_conv_same(m) or is_mixed_conv(m)


def _static_conv_ok(conv, asymmetric=False):
    """``asymmetric``: a padding that pads one side more ('same' of an even kernel, timm's Conv2dSame) is
    modelled too (the fused Conv-BN op pads a transient copy of the input wider on that side), and
    MixNet's MixedConv2d (``is_mixed_conv`` checks its splits)."""
    if asymmetric and is_mixed_conv(conv):
        return True
    return (_is_conv2d(conv) if asymmetric else type(conv) is nn.Conv2d) and conv.padding_mode == "zeros" \
        and (asymmetric or _conv_padding(conv) is not None)


def _static_cbr(conv, bn, act):
    if not _static_conv_ok(conv, asymmetric=True):
        return "the Conv2d is not a plain zero-padded convolution"
    if isinstance(bn, nn.SyncBatchNorm):
        return "SyncBatchNorm is not fused (its batch statistics span processes); left as it is"
    if not (type(bn) is nn.BatchNorm2d or _is_bn_act(bn)) or bn.num_features != conv.out_channels:
        return "the norm is not an nn.BatchNorm2d over the conv's channels"
    if _is_bn_act(bn) and (type(bn.drop) is not nn.Identity or _bn_act_name(bn) is False):
        return f"timm's BatchNormAct2d with {type(bn.drop).__name__} / {type(bn.act).__name__}: no fused form"
    if act is not None and _act_name(act) is None:
        return f"activation {type(act).__name__} has no fused form"
    return None


def _is_bn_act(m):
    """timm's ``BatchNormAct2d``: an ``nn.BatchNorm2d`` subclass whose forward is BatchNorm2d's
    followed by ``self.drop`` and ``self.act`` (EfficientNet, MobileNetV3, ... in timm)."""
    t = type(m)
    return t.__name__ == "BatchNormAct2d" and t.__module__.startswith("timm.") and isinstance(m, nn.BatchNorm2d)


def _bn_act_name(bn):
    """The fused activation of a BatchNormAct2d: None for ``nn.Identity`` (no activation), False
    for one with no fused form."""
    act = bn.act
    if type(act) is nn.Identity:
        return None
    name = _act_name(act)
    return False if name is None else name


def _cbr_kind(act, residual=False):
    """The plan's kind of a conv unit: "conv_bn_relu" / "conv_bn_add_relu" for ReLU, "conv_bn_act" /
    "conv_bn_add_act" for another fused activation, "conv_bn" without one."""
    if act is None:
        return "conv_bn"
    tail = "relu" if _act_name(act) == "relu" else "act"
    return f"conv_bn_add_{tail}" if residual else f"conv_bn_{tail}"


def _runtime_cbr_ok(conv, bn, act, x):
    # the static checks again: a module put in the unit's place after convert (a wrapper around
    # the conv, another norm, an activation with no fused form) runs the modules as they now are
    return _static_cbr(conv, bn, act) is None and _conv_input_ok(x, conv) and _nohooks(conv, *conv_parts(conv), bn, act)


def _conv_input_ok(x, conv):
    """Whether the fused conv ops model ``x`` as ``conv``'s input (the dtype: or autocast casts it)."""
    return (
        isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point() and x.device == conv_weight(conv).device
        and (x.dtype == conv_weight(conv).dtype or torch.is_autocast_enabled(x.device.type))
    )


def _cbr(site, conv, bn, act, x, residual=None):
    """``act(bn(conv(x)) [+ residual])`` (``act`` None: none): fused when ``site`` is on and the call is
    modelled. The activation is the one ``act`` is now (a ReLU swapped for a SiLU after convert runs
    fused as SiLU)."""

    if _is_bn_act(bn) and act is None and residual is None:  # timm's BatchNormAct2d: its own activation
        return _cbr_bn_act(site, conv, bn, x)

    def plain(x, residual=None):
        y = bn(conv(x))
        if residual is not None:
            y += residual  # in place, as torchvision's blocks: an fp32 identity under autocast keeps y half
        return y if act is None else act(y)

    if site is None or not site.enabled or not _runtime_cbr_ok(conv, bn, act, x) or _is_bn_act(bn):
        # (a BatchNormAct2d put where a unit's BatchNorm2d was: its activation, then the unit's)
        return plain(x) if residual is None else plain(x, residual)
    name = None if act is None else _act_name(act)
    if residual is None:
        return _run_site(site, lambda x: conv_bn_act_call(conv, bn, x, activation=name), plain, x)
    return _run_site(site, lambda x, r: conv_bn_act_call(conv, bn, x, r, name), plain, x, residual)


def _cbr_bn_act(site, conv, bn, x):
    """``bn(conv(x))`` for timm's BatchNormAct2d ``bn`` (its drop an Identity, its act a fused
    one or an Identity), fused when ``site`` is on and the call is modelled."""
    def plain(x):
        return bn(conv(x))

    act = None if type(bn.act) is nn.Identity else bn.act
    if site is None or not site.enabled or not _runtime_cbr_ok(conv, bn, act, x) or not _nohooks(bn.drop):
        return plain(x)
    name = _bn_act_name(bn)
    return _run_site(site, lambda x: conv_bn_act_call(conv, bn, x, activation=name), plain, x)


_BAC_KINDS = ("bn_relu_conv", "bn_act_conv")


def _bac_kind(act):
    """The plan's kind of a pre-activation unit: "bn_relu_conv" for ReLU, else "bn_act_conv"."""
    return "bn_relu_conv" if _act_name(act) == "relu" else "bn_act_conv"


def _static_bac(bn, act, conv):
    """Why ``conv(act(bn(x)))`` has no fused form, or None. ``act`` None: ``bn`` is timm's
    BatchNormAct2d, its own activation."""
    if isinstance(bn, nn.SyncBatchNorm):
        return "SyncBatchNorm is not fused (its batch statistics span processes); left as it is"
    if act is None and _is_bn_act(bn):
        if type(bn.drop) is not nn.Identity or not _bn_act_name(bn):
            return f"timm's BatchNormAct2d with {type(bn.drop).__name__} / {type(bn.act).__name__}: no fused form"
    elif type(bn) is not nn.BatchNorm2d or act is None:
        return "not an nn.BatchNorm2d over a plain zero-padded Conv2d's input channels"
    if not _static_conv_ok(conv) or bn.num_features != conv.in_channels:
        # (a padding wider on one side: the padded input would be normalized too)
        return "not an nn.BatchNorm2d over a plain zero-padded Conv2d's input channels (symmetric padding)"
    if act is not None and _act_name(act) is None:
        return f"activation {type(act).__name__} has no fused form"
    return None


def _bac(site, bn, act, conv, x):
    """``conv(act(bn(x)))`` (``act`` None: timm's BatchNormAct2d ``bn`` with its own activation): fused
    when ``site`` is on and the call is modelled, with the activation ``act`` is now."""
    def plain(x):
        h = bn(x)
        return conv(h if act is None else act(h))

    if site is None or not site.enabled or _static_bac(bn, act, conv) is not None \
            or not _nohooks(bn, act, conv, *((bn.drop, bn.act) if act is None else ())) or not _conv_input_ok(x, conv):
        return plain(x)
    name = _act_name(act) if act is not None else _bn_act_name(bn)
    return _run_site(site, lambda x: bn_act_conv_call(bn, conv, x, activation=name), plain, x)


class FusedBasicBlock(Wrapper):
    """torchvision ``BasicBlock``: conv1-bn1-relu fused, conv2-bn2-(+identity)-relu fused."""

    def forward(self, x):
        if not _nohooks(self):
            return self.plain(x)
        s = self.sites
        out = _cbr(s.get("conv1"), self.conv1, self.bn1, self.relu, x)
        identity = x if self.downsample is None else self.downsample(x)
        return _cbr(s.get("conv2"), self.conv2, self.bn2, self.relu, out, identity)


class FusedBottleneck(Wrapper):
    """torchvision ``Bottleneck``: conv1/conv2 chains and the conv3-bn3-(+identity)-relu tail fused."""

    def forward(self, x):
        if not _nohooks(self):
            return self.plain(x)
        s = self.sites
        out = _cbr(s.get("conv1"), self.conv1, self.bn1, self.relu, x)
        out = _cbr(s.get("conv2"), self.conv2, self.bn2, self.relu, out)
        identity = x if self.downsample is None else self.downsample(x)
        return _cbr(s.get("conv3"), self.conv3, self.bn3, self.relu, out, identity)


class FusedResNet(Wrapper):
    """torchvision ``ResNet`` with the stem conv1-bn1-relu fused."""

    def forward(self, x):
        if not _nohooks(self):
            return self.plain(x)
        x = _cbr(self.sites.get("conv1"), self.conv1, self.bn1, self.relu, x)
        x = self.maxpool(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def _chain_dropout_p(drops, training=None):
    """The one dropout probability a fused FFN applies for the dropout modules between its
    layers (0.0: none acts now), or None: one of them is not an ``nn.Dropout``, or two act.
    ``training=True`` asks whether the chain can be fused in either mode (convert's static check)."""
    ps = [fused_dropout_p(d, training) for d in drops]
    if None in ps or sum(p > 0 for p in ps) > 1:
        return None
    return max(ps, default=0.0)


def _static_dropouts_ok(drops) -> bool:
    return _chain_dropout_p(drops, training=True) is not None


def _dense_runtime_ok(x, first, *more):
    """Whether the dense fused ops model a call on ``x`` with these Linears (hooks: the callers')."""
    return (
        isinstance(x, torch.Tensor) and x.is_floating_point()
        and all(m.weight.dtype == first.weight.dtype for m in more)
        # under autocast the input of a later FFN is already half: the op casts as F.linear does
        and (x.dtype == first.weight.dtype or torch.is_autocast_enabled(x.device.type))
        and x.device == first.weight.device
    )


def _still(act, act_mod, *linears):
    """Whether the modules a fused unit reads are still of the kinds convert fused: plain Linears
    (not, say, a LoRA wrapper put in their place later) and an activation module of the same fused
    activation (not one swapped in). Otherwise the unit runs its modules as they now are."""
    return all(is_linear(m) for m in linears) and _act_name(act_mod) == act


_CBR_KINDS = ("conv_bn_relu", "conv_bn_act", "conv_bn")


def _run_chain(site, kind, act, chain, x, packed=None):
    """A fused group's modules on ``x``: Conv-BN[-act] (2 or 3 modules) or a dense chain (``packed``:
    a packed gated FFN's gate half)."""
    if kind in _BAC_KINDS:  # BN, act, Conv; or timm's BatchNormAct2d, Conv
        return _bac(site, chain[0], chain[1] if len(chain) == 3 else None, chain[-1], x)
    if kind in _CBR_KINDS:
        conv, bn = chain[0], chain[1]
        stem = isinstance(conv, _FusedSequential)  # its last module is the conv (a deep stem's)
        # a module put in an Identity's place, or a stem with hooks of its own (called as it is): the modules
        if any(type(m) is not nn.Identity for m in chain[2:-1]) or stem and _has_hooks(conv):
            for m in chain:
                x = m(x)
            return x
        if stem:  # the stem's other modules first
            x, conv = conv.run_until(x, len(conv) - 1), conv[-1]
        act_mod = chain[-1] if kind != "conv_bn" and len(chain) > 2 else None
        return _cbr(site, conv, bn, act_mod, x)
    if kind in ("norm_ffn", "norm_gated_ffn"):
        return _run_dense(site, kind[5:], act, chain[1:], x, norm=chain[0], packed=packed)
    if kind == "conv_ffn":
        return _run_conv_ffn(site, act, chain, x)
    return _run_dense(site, kind, act, chain, x, packed=packed)


def _run_conv_ffn(site, act, mods, x):
    """A ``1x1 conv -> act -> [Dropout...] -> 1x1 conv`` group: one fused FFN over each pixel's channels
    (:func:`_conv_ffn`) where ``site`` is on and the call is modelled, else module by module."""
    fc1, fc2 = mods[0], mods[-1]

    def plain(x):
        for m in mods:
            x = m(x)
        return x

    p = _chain_dropout_p(mods[2:-1])
    # inside a recomputed region (a block) the convolutions themselves: the region keeps its inputs
    if (site is None or not site.enabled or p is None or inside_region() or _act_name(mods[1]) != act
            or not _pointwise_ffn(fc1, fc2) or not _nohooks(*mods)
            or not (isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[1] == fc1.in_channels)
            or not _dense_runtime_ok(x, fc1, fc2)):
        return plain(x)
    return _run_site(site, lambda x: _conv_ffn(x, fc1, fc2, act, p), plain, x)


def _gated_parts(mods, packed):
    """``(Linears, dropouts, gated product of x, (w_gate, b_gate, w_up, b_up))`` of a gated FFN group
    found by the fx pass: ``[gate, act, up, *dropouts, down]``, or with ``packed`` (the index of the
    gate's half) ``[fc1, act, *dropouts, down]`` for one Linear whose output halves are the gate and the
    up projection (timm's GluMlp; row views of its weight)."""
    a, down = mods[1], mods[-1]
    if packed is None:
        gate, up = mods[0], mods[2]
        return (gate, up, down), mods[3:-1], lambda x: a(gate(x)) * up(x), \
            lambda: (gate.weight, gate.bias, up.weight, up.bias)
    fc1, n = mods[0], down.in_features

    def product(x):
        halves = fc1(x).chunk(2, dim=-1)
        return a(halves[packed]) * halves[1 - packed]

    def weights():
        w, b = fc1.weight, fc1.bias
        rows = (slice(n * packed, n * (packed + 1)), slice(n * (1 - packed), n * (2 - packed)))
        return tuple(t for r in rows for t in (w[r], None if b is None else b[r]))

    return (fc1, down), mods[2:-1], product, weights


def _run_dense(site, kind, act, mods, x, norm=None, packed=None):
    """A ``Linear -> act -> [Dropout...] -> Linear`` (``kind`` "ffn"), ``Linear -> act`` or gated FFN
    group (``kind`` "gated_ffn", laid out as ``_gated_parts`` reads it): fused where ``site`` is on
    and the call is modelled, else module by module. ``norm``: a norm module before an FFN, run
    inside its fused op where the op models it."""
    first, last = mods[0], mods[-1]
    if kind == "gated_ffn":
        linears, drops, product, gate_up = _gated_parts(mods, packed)

        def plain(x):
            x = product(x)
            for m in drops:
                x = m(x)
            return last(x)

        p = _chain_dropout_p(drops)
        if packed is not None and first.out_features != 2 * last.in_features:  # a Linear swapped in since
            p = None
    else:
        def plain(x):
            for m in mods:
                x = m(x)
            return x

        p = _chain_dropout_p(mods[2:-1]) if kind == "ffn" else 0.0
        linears = (first, last) if kind == "ffn" else (first,)
    affine = _affine_act(mods[1]) if kind != "gated_ffn" else None
    if affine is not None and (affine[0] != act or p != 0 or not all(is_linear(m) for m in linears)):
        p = None  # a dropout of s * act + b: b no longer a constant through the second Linear
    args = {}
    if norm is not None:
        # a norm that passed its input through (a _NormFirst) runs as its class, never passing through
        run_norm = norm.plain if isinstance(norm, _NormFirst) else norm
        args = _norm_args(norm, x) if site is not None and site.enabled else None
        if args is None:  # the norm runs as itself: the unit off, hooks on it, a dtype the op does not model
            x, args = run_norm(x), {}
    if site is None or not site.enabled or p is None or not _nohooks(*mods) \
            or affine is None and not _still(act, mods[1], *linears) or not _dense_runtime_ok(x, *linears):
        return plain(run_norm(x) if args else x)
    if kind == "ffn":
        def fused(x):
            w2, b2 = (last.weight, last.bias) if affine is None else _fold_affine(last.weight, last.bias, *affine[1:])
            return F.fused_mlp(x, first.weight, first.bias, w2, b2, act, dropout_p=p, **args)
        return _run_site(site, fused, (lambda x: plain(run_norm(x))) if args else plain, x)
    if kind == "gated_ffn":
        return _run_site(site, lambda x: F.gated_mlp(x, *gate_up(), last.weight, last.bias, act, dropout_p=p, **args),
                         (lambda x: plain(run_norm(x))) if args else plain, x)
    if affine is not None:  # as the module computes it: scale * act(h) + bias (its product keeps act(h))
        return _run_site(site, lambda x: affine[1] * F.linear_act(x, first.weight, first.bias, act) + affine[2],
                         plain, x)
    return _run_site(site, lambda x: F.linear_act(x, first.weight, first.bias, act), plain, x)


class FusedT5DenseActDense(Wrapper):
    """Hugging Face ``T5DenseActDense`` (wi -> act -> dropout -> wo) as one fused FFN."""

    def _fusedrc_site(self):
        return self.sites.get("ffn")

    def _fusedrc_fusable(self, x):
        site = self._fusedrc_site()
        return (site is not None and site.enabled and fused_dropout_p(self.dropout) is not None
                and _nohooks(self, self.wi, self.act, self.dropout, self.wo)
                and _still(self.__dict__["_fusedrc_act"], self.act, self.wi, self.wo)
                and _dense_runtime_ok(x, self.wi, self.wo))

    def forward(self, hidden_states):
        act = self.__dict__["_fusedrc_act"]
        return _with_norm(
            self, hidden_states, lambda x, **norm: F.fused_mlp(
                x, self.wi.weight, self.wi.bias, self.wo.weight, self.wo.bias, act,
                dropout_p=fused_dropout_p(self.dropout), **norm),
            self.plain)


_STAND_IN_FILES = (__file__, nn.modules.module.__file__)


def _forward_code(cls):
    """The code object of ``cls.forward`` under its decorators (the code convert checked)."""
    return getattr(_inspect.unwrap(cls.forward), "__code__", None)


def _calling_layer(stand_in, key, line=None):
    """The layer whose own forward is calling ``stand_in`` now (through ``nn.Module.__call__``)
    and holds it at ``key``: the layer convert rewrote, where it checked that fc1, the activation
    and fc2 run one after the other on one tensor, or a copy of it, or an ``nn.DataParallel``
    replica. The stand-ins find each other through it at run time: a replica's cannot be linked
    when it is built (``replicate`` builds each module's replica before its siblings'). None when
    called from anywhere else (``layer.fc1(x)`` by hand, a wrapper, a probe, an fx tracer): there
    a stand-in is the plain module it replaced. ``line``: the call must come from that line of the
    layer's source file (a norm the layer's forward calls at more than one place)."""
    layer = stand_in.__dict__.get("_fusedrc_layer")
    if torch.compiler.is_compiling():
        # dynamo inlines the layer's forward and reads no frames: the layer convert rewrote (a
        # replica's modules would be the original's, so a compiled replica runs them plainly)
        return None if layer is None or stand_in.__dict__.get("_is_replica", False) else layer
    frame = _sys._getframe(1)  # past the stand-in's frames (this file) and nn.Module.__call__'s
    while frame is not None and frame.f_code.co_filename in _STAND_IN_FILES:
        frame = frame.f_back
    caller = None if frame is None else frame.f_locals.get("self")
    if (caller is None or type(caller) is not type(layer) or caller._modules.get(key) is not stand_in
            or frame.f_code is not _forward_code(type(caller)) or line is not None and frame.f_lineno != line):
        return None
    return caller


class _PassThrough:
    """Armed by an inlined FFN's head when it ran the whole FFN: the activation's slot and fc2
    then pass their input (the FFN's output) through on their next call from the layer. One per
    stand-in; a DataParallel replica gets its own. Armed per thread: a model shared by threads
    (each running its own forward) pairs each head with its own thread's stand-ins. While
    torch.compile traces, one plain flag (dynamo follows it as a side effect)."""

    def __init__(self):
        self.traced = False
        # the threads whose head ran fused, by ident (dict set/pop: atomic), each to what the head handed over
        # with the flag: None (the input passes through), or fc2's FFN output where the layer's own dropout line
        # sits between the activation's slot and fc2 (the slot hands that line an empty tensor, fc2 returns this)
        self.values = {}
        self.traced_value = None

    def arm(self, on=True, value=None):
        if torch.compiler.is_compiling():
            self.traced, self.traced_value = on, value
        elif on:
            self.values[_threading.get_ident()] = value
        else:
            self.values.pop(_threading.get_ident(), None)

    @property
    def armed(self):
        return self.traced if torch.compiler.is_compiling() else _threading.get_ident() in self.values

    def value(self):
        """The output handed over with the flag (None where the input passes through)."""
        return self.traced_value if torch.compiler.is_compiling() else self.values.get(_threading.get_ident())

    def __getstate__(self):
        return {"traced": False, "values": {}, "traced_value": None}  # a copy or a pickle starts disarmed

    def _fusedrc_rebind(self, replica):
        return _PassThrough()


def _stand_in(module, layer):
    """Set up ``module`` as the activation's slot or fc2 of an inlined FFN in ``layer``."""
    module.__dict__["_fusedrc_layer"] = layer
    module.__dict__["_fusedrc_pass"] = _PassThrough()
    bind_replicas(module)  # a fresh _PassThrough on each replica


def _passes_through(stand_in, key):
    """Whether the head armed ``stand_in`` and its layer's forward is calling it: disarmed then. True, or
    the tensor the head handed over with the flag (the FFN's output, for fc2), or False."""
    flag = stand_in.__dict__["_fusedrc_pass"]
    if flag.armed and _calling_layer(stand_in, key) is not None:
        value = flag.value()
        flag.arm(False)
        return True if value is None else value
    return False


class _FFNHead(nn.Linear):
    """Stands in for an FFN's first Linear (same parameters, same key) and runs the whole FFN.

    Used where the FFN is inlined in a larger forward (OPT): ``fc1`` computes
    ``fc2(act(fc1(x)))`` fused, and the activation's slot (an :class:`_FFNAct`) and ``fc2``
    (an :class:`_FFNTail`) pass their input through. When a hook sits on any of the three,
    or another module sits at one of their keys (a LoRA adapter, another activation), the
    head computes ``fc1`` alone and the two others the activation and ``fc2``: each hook sees
    what it would see unconverted. Called from anywhere but the layer's own forward
    (``layer.fc1(x)`` by hand), each of the three is the plain module it replaced.
    """

    def __init__(self, fc1, act_name, layer, dropout):
        nn.Module.__init__(self)
        self.in_features, self.out_features = fc1.in_features, fc1.out_features
        self.weight, self.bias = fc1.weight, fc1.bias
        self.__dict__["_fusedrc_act"] = act_name
        # the layer's attributes its forward's dropout line between the activation and fc2 reads as p and
        # training (``_inline_ffn``), or None: the fused op applies that dropout (its own mask stream)
        self.__dict__["_fusedrc_dropout"] = dropout
        self.__dict__["site"] = Site()
        self.site.enabled = True
        self.__dict__["_fusedrc_layer"] = layer  # the head never passes through: no flag

    def _peers(self):
        """(the layer calling, the activation's slot, fc2's) when called from the layer's forward."""
        layer = _calling_layer(self, "fc1")
        if layer is None:
            return None, None, None
        return layer, layer._modules.get("activation_fn"), layer._modules.get("fc2")

    def _dropout_p(self, layer):
        """The p of the layer's dropout line as it would run now: 0.0 without one or out of training, None
        where its attributes are not a training bool and a p in [0, 1] (the layer's own line decides)."""
        names = self.__dict__["_fusedrc_dropout"]
        if names is None:
            return 0.0
        p, training = (getattr(layer, k, None) for k in names)
        if type(training) is not bool or type(p) not in (int, float) or not 0 <= p <= 1:
            return None
        return float(p) if training else 0.0

    def _whole(self, layer, act_slot, tail):
        """Whether this call may compute the whole FFN (its peers in place, no hooks, a dropout it takes)."""
        return (isinstance(act_slot, _FFNAct) and isinstance(tail, _FFNTail) and _free(self, act_slot, tail)
                and self._dropout_p(layer) is not None)

    def _fusedrc_site(self):
        return self.site

    def _fusedrc_fusable(self, x):
        """Whether a call from the layer now would run the whole FFN fused (asked by a norm before it)."""
        layer, act_slot, tail = self._peers()
        return self._whole(layer, act_slot, tail) and _dense_runtime_ok(x, self, tail)

    def forward(self, x):
        norm, norm_args = _armed_norm(self, x)
        prenorm = (lambda x: x) if norm is None else norm.plain  # the norm passed x through: run it unfused
        layer, act_slot, tail = self._peers()
        peers = [m for m in (act_slot, tail) if isinstance(m, (_FFNAct, _FFNTail))]
        for m in peers:  # left armed by a layer call that raised half-way
            m.__dict__["_fusedrc_pass"].arm(False)
        if not self._whole(layer, act_slot, tail):
            return nn.functional.linear(prenorm(x), self.weight, self.bias)
        act_mod, act = act_slot.__dict__["_fusedrc_act_mod"], self.__dict__["_fusedrc_act"]
        p = self._dropout_p(layer)

        def plain(x):  # fc2's parameters from the tail, the module registered in the layer
            h = act_mod(nn.functional.linear(prenorm(x), self.weight, self.bias))
            return nn.functional.linear(nn.functional.dropout(h, p) if p else h, tail.weight, tail.bias)

        if not _dense_runtime_ok(x, self, tail) or norm is not None and norm_args is None:
            out = plain(x)
        else:
            out = _run_site(self.site, lambda x: F.fused_mlp(x, self.weight, self.bias, tail.weight, tail.bias, act,
                                                             p, **(norm_args or {})),
                            plain, x)
        # where the layer's dropout line will draw a mask (p > 0), it gets an empty tensor from the activation's
        # slot (no draw, no pass over the output) and fc2 hands the FFN's output back
        for m in peers:
            m.__dict__["_fusedrc_pass"].arm(value=out if p else None)
        return out

    def _get_name(self):
        return "FusedFFN(fc1)"


class _FFNAct(nn.Module):
    """The activation's slot in a fused inlined FFN: its input is the FFN's output (passed
    through) when the head ran fused, else ``fc1``'s output (then it applies the activation).
    Where the head's op took the layer's dropout (p > 0), it hands that line an empty slice."""

    def __init__(self, act_mod, layer):
        super().__init__()
        self.__dict__["_fusedrc_act_mod"] = act_mod
        _stand_in(self, layer)

    def forward(self, x):
        through = _passes_through(self, "activation_fn")
        if through is False:
            return self.__dict__["_fusedrc_act_mod"](x)
        return x if through is True else x.narrow(-1, 0, 0)

    def _get_name(self):
        return "FusedFFN(activation, computed in fc1)"


class _FFNTail(nn.Linear):
    """Holds the FFN's second Linear (same parameters, same key); its input is already the FFN's
    output when the head ran fused (or, after the layer's dropout of the empty slice, the head
    handed the output over), else the activation's (then it applies the Linear)."""

    def __init__(self, fc2, layer):
        nn.Module.__init__(self)
        self.in_features, self.out_features = fc2.in_features, fc2.out_features
        self.weight, self.bias = fc2.weight, fc2.bias
        _stand_in(self, layer)

    def forward(self, x):
        through = _passes_through(self, "fc2")
        if through is False:
            return nn.functional.linear(x, self.weight, self.bias)
        return x if through is True else through

    def _get_name(self):
        return "FusedFFN(fc2, computed in fc1)"


# --------------------------------------------------------------------------- norms whose output is not kept
# Outside the FFN, a norm's output goes to GEMMs (attention's q/k/v projections, the LM head, a post-norm
# layer's successor) that keep it; the norm's autograd keeps its input as well. A _RecomputedNorm keeps the
# input alone, and inside the converted model's call (a NormScope, opened by a forward pre-hook on the
# root) whatever keeps its output keeps a recipe instead: _recomputed_norm.py.

def _group_norm(x, weight, bias, *, groups, eps):
    return torch.nn.functional.group_norm(x, groups, weight, bias, eps)


def _norm_form(x, weight, bias, *, kind, eps, torch_rms):
    if kind == "layer":
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)
    if torch_rms:  # nn.RMSNorm's own function (Hugging Face's "rms" classes: their ops, written out)
        return torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)
    return norm_forward(x, kind, weight, None, eps)


def _norm_call(norm, x):
    """``(functional form, weight, bias)`` computing what norm module ``norm`` computes on ``x``, or None
    where there is none (the dtype or size of x not the norm's, hooks, a class no form models)."""
    cls = _class_of(norm)
    if cls is nn.GroupNorm:
        w, b = getattr(norm, "weight", None), getattr(norm, "bias", None)
        if x.dim() < 2 or x.shape[1] != norm.num_channels or any(
                t is not None and (t.dtype != x.dtype or t.device != x.device) for t in (w, b)):
            return _own_form(norm, x)
        return functools.partial(_group_norm, groups=norm.num_groups, eps=norm.eps), w, b
    args = _norm_args(norm, x)
    if args is None:
        return _own_form(norm, x)
    form = functools.partial(_norm_form, kind=args["norm"], eps=args["norm_eps"],
                             torch_rms=cls is getattr(nn, "RMSNorm", None))
    return form, args["norm_weight"], args["norm_bias"]


# A norm no functional form models (Cohere's mean-centred float32 LayerNorm, OLMo's weightless one,
# DeBERTa's, channels-first LayerNorm2d, timm's RmsNorm2d, a LayerNorm with a float32 weight under
# bfloat16 input...) reruns its own class's forward. The rerun runs on an instance of that class holding
# the module's state as the forward found it (its attributes then; in backward, the copies of the
# parameters the forward read), so what changes on the module between forward and backward does not
# reach the rerun. Admitted by name and shape: a class named *Norm/*Norm1d/*Norm2d/*Norm3d, not a
# BatchNorm, whose forward takes one argument, with no submodules, no buffers and at most two parameters
# (not a parametrization's module, weight_norm's _WeightNorm); at each call, one holding no tensor but
# its parameters (another tensor, a style vector set from outside, would get no gradient). Before its
# first recomputed call per input dtype, device, rank and training mode, a check runs the forward as the
# op does (no autograd) and as its rerun does (autograd on detached leaves): both must give the same bits
# and a fresh tensor, and leave x, the parameters and the module's attributes as they were. Torch's and
# Python's random states are restored after. One host sync: a CUDA graph's warm-up calls make it.
_NORM_SUFFIXES = ("norm", "norm1d", "norm2d", "norm3d", "norm1p")  # norm1p: Nemotron's LayerNorm1P (1 + weight)
_ONE_ARGUMENT = {}  # forward function -> whether it takes one positional argument


def _one_argument(fn):
    got = _ONE_ARGUMENT.get(fn)
    if got is None:
        try:
            params = list(_inspect.signature(fn).parameters.values())[1:]
        except (TypeError, ValueError):
            params = ()
        got = _ONE_ARGUMENT[fn] = len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY,
                                                                            params[0].POSITIONAL_OR_KEYWORD)
    return got


def _own_form_candidate(m):
    cls = _class_of(m)
    name = cls.__name__.lower()
    return (name.endswith(_NORM_SUFFIXES) and "batchnorm" not in name and cls.forward is not nn.Module.forward
            and not m._modules and all(b is None for b in m._buffers.values()) and len(m._parameters) <= 2
            and _one_argument(cls.forward))


def _uses_class_cell(fn):
    # a zero-argument super() (or __class__) in fn: it must run on an instance of its class
    return "__class__" in getattr(getattr(fn, "__code__", None), "co_freevars", ())


def _as_original(cls, state):
    """An instance of ``cls`` (a module's original class) holding ``state`` as its ``__dict__``."""
    inst = object.__new__(cls)
    object.__setattr__(inst, "__dict__", state)
    return inst


def _run_own(x, params, cls, state, names):
    inst = _as_original(cls, dict(state, _parameters=dict(zip(names, params))))
    return cls.forward(inst, x), inst.__dict__


def _own_forward(x, *params, cls, state, names):
    return _run_own(x, params, cls, state, names)[0]


def _holds_tensors(state, names):
    for key, v in state.items():
        if key in names or key in ("_parameters", "_buffers"):
            continue
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
        if any(isinstance(t, torch.Tensor) for t in items):
            return True
    return False


def _same_values(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and bool(((a == b) | (a != a) & (b != b)).all()))


def _pure_on(x, params, cls, state, names):
    """Whether the own forward is a pure function of x and the parameters (see above): True, False, or
    None where the check itself failed (an exception: decided at a later call)."""
    versions = [t._version for t in (x, *params) if t is not None]
    py_random = _random.getstate()
    try:
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            with torch.no_grad():
                a, state_a = _run_own(x, params, cls, state, names)
            leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in (x, *params)]
            with torch.enable_grad():
                b, state_b = _run_own(leaves[0], leaves[1:], cls, state, names)
    except Exception:
        return None
    finally:
        _random.setstate(py_random)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if versions != [t._version for t in (x, *params) if t is not None] or not all(
            same_attributes(state, d, ignore=("_parameters",)) for d in (state_a, state_b)):
        return False  # changed its input, a parameter or its own attributes
    try:
        alias = {t.untyped_storage().data_ptr() for t in (x, *params) if t is not None}
        return a.untyped_storage().data_ptr() not in alias and _same_values(a, b.detach())
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor with no storage to compare (a subclass)
        return False


def _own_form(norm, x):
    """``(form, weight, bias)`` running ``norm``'s own forward (see above), or None."""
    names = norm.__dict__.get("_fusedrc_param_names")
    if (names is None or x.layout != torch.strided or x.device.type == "meta"
            or not _own_form_candidate(norm) or len(names) > 2):
        return None
    state = dict(norm.__dict__)
    params = [state.pop(n) if n in state else getattr(norm, n, None) for n in names]  # (a replica's: in state)
    if (any(p is not None and not isinstance(p, torch.Tensor) for p in params) or _holds_tensors(state, names)
            or not recomputable(x, *params)):
        return None
    cls = _class_of(norm)
    key = (x.dtype, x.device, x.dim(), norm.training,
           tuple(None if p is None else (p.dtype, p.device) for p in params))
    pure = norm.__dict__.setdefault("_fusedrc_pure", {})
    if key not in pure:
        got = _pure_on(x, params, cls, state, names)
        if got is None:
            return None
        pure[key] = got
    if not pure[key]:
        return None
    return functools.partial(_own_forward, cls=cls, state=state, names=names), *params, *[None] * (2 - len(params))


class _RecomputedNorm(Wrapper):
    """A norm that keeps only its input for backward, whose consumers keep that input and a recipe in
    place of its output (rebuilt once in backward, the norm's backward reusing it). Its module's
    functional form computes (the same ops). Called with anything but one tensor, without autograd, inside
    a recompute (a fusedrc region, torch.utils.checkpoint), under torch.compile, a torch.func transform or
    a jit trace, or with hooks or a mark on it, it is the norm as it was."""

    def forward(self, *args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) else None
        site = self.sites.get("norm")
        if (x is None or site is None or not site.enabled or not torch.is_grad_enabled()
                or torch.compiler.is_compiling() or traced(x) or under_recompute_hooks() or not _free(self)):
            return self.plain(*args, **kwargs)
        call = _norm_call(self, x)
        if call is None or not recomputable(x, *call[1:]):
            return self.plain(x)
        if site.impl == "checkpoint":
            return torch.utils.checkpoint.checkpoint(self.plain, x, use_reentrant=False)
        return recomputed_norm(*call[:1], x, *call[1:])

    def plain(self, *args, **kwargs):
        cls = _class_of(self)
        if _uses_class_cell(cls.forward):  # super() wants an instance of cls: one sharing this module's state
            return cls.forward(_as_original(cls, self.__dict__), *args, **kwargs)
        return cls.forward(self, *args, **kwargs)

    def _get_name(self):
        return f"RecomputedNorm({_class_of(self).__name__})"


def _recomputable_norm(m):
    """A norm module with a functional form: ``nn.GroupNorm``, and those ``norm_kind`` models
    (``nn.LayerNorm``, ``nn.RMSNorm``, timm's LayerNorm, Hugging Face RMSNorm classes that pass its probe);
    or one whose own forward may be rerun (``_own_form_candidate``)."""
    if isinstance(m, Wrapper) and not isinstance(m, _RecomputedNorm):
        return False  # run by a rule's code (a _NormFirst: inside the FFN's op)
    return _class_of(m) is nn.GroupNorm or norm_kind(m, _class_of(m)) is not None or _own_form_candidate(m)


def _fx_inlined(model):
    """ids of the modules whose code an fx-rewritten forward runs inline (never called as modules)."""
    out = set()
    for m in model.modules():
        fx = m.__dict__.get("forward")
        if isinstance(fx, _FxForward):
            for name in fx.inlined:
                try:
                    out.add(id(m.get_submodule(name)))
                except AttributeError:
                    pass
    return out


def _recomputed_norms(ctx, model):
    """Each norm module convert has not joined to an FFN becomes a unit of kind ``norm``; the root gets the
    forward hooks that open a NormScope around its calls."""
    inlined = _fx_inlined(model)
    sites, seen = [], set()

    def visit(module, prefix):
        for key, child in module._modules.items():
            if child is None or _is_marked(child) or id(child) in seen:  # a user's mark: left as it is
                continue
            if isinstance(child, nn.utils.parametrize.ParametrizationList):  # computes a parameter
                continue
            seen.add(id(child))  # a module held twice (ALBERT's shared layer): one unit
            name = _join(prefix, key)
            if _recomputable_norm(child) and id(child) not in inlined and id(child) not in ctx.joined_norms:
                if not _nohooks(child):
                    ctx.skip(name, "hooks registered on the norm")
                    continue
                child.__dict__["_fusedrc_param_names"] = tuple(child._parameters)  # (what a replica loses)
                sites.append(_site_unit(ctx, _RecomputedNorm.wrap(child), name, "norm", "norm", ()))
            else:
                visit(child, name)

    if not _is_marked(model):
        visit(model, "")
    model.__dict__["_fusedrc_norm_sites"] = sites  # the scope opens while one of them is on
    if sites and not any(h is scope_enter for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(scope_enter)
        model.register_forward_hook(scope_exit, always_call=True)


# --------------------------------------------------------------------------- a norm run inside the FFN
# Pre-norm transformers compute ``y = self.norm(x)`` and then ``z = self.mlp(y)``; y is read by nothing
# else. With the FFN's unit on, the norm (a _NormFirst) passes x through on that call and arms the FFN
# (its ``_fusedrc_norm_pass`` flag), which runs the norm inside its fused op: the op keeps x, the norm's
# input, in place of y (one hidden-sized tensor less a layer; for Hugging Face's RMSNorm also the
# float32 copies its eager autograd keeps). A consumer is a fused FFN wrapper or an inlined FFN's head.


class _NormFirst(Wrapper):
    """A pre-norm layer's norm whose output only the fused FFN after it reads (checked on the
    layer's code). Called from that line of the layer's forward while the FFN can run it fused,
    it returns its input and the FFN normalizes inside its fused op; anywhere else (called by hand,
    hooks or a mark on it or on the FFN, the FFN's unit off, a dtype the fused op does not model,
    torch.compile on either) it is the norm."""

    def forward(self, *args, **kwargs):
        d = self.__dict__
        x = args[0] if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) else None
        # eager only: under torch.compile no frame tells who called the norm (it could be called by
        # hand in a compiled function), and its partitioner chooses what to keep anyway
        if x is None or torch.compiler.is_compiling():
            return self.plain(*args, **kwargs)
        layer = _calling_layer(self, d["_fusedrc_key"], d["_fusedrc_line"])
        consumer = None if layer is None else layer._modules.get(d["_fusedrc_consumer"])
        flag = None if consumer is None else consumer.__dict__.get("_fusedrc_norm_pass")
        if flag is not None:
            flag.arm(False)  # left armed by a layer call that raised half-way
        if (flag is None or getattr(consumer, "_compiled_call_impl", None) is not None or not _free(self)
                or not _consumer_free(consumer) or _norm_args(self, x) is None or not consumer._fusedrc_fusable(x)):
            return self.plain(*args, **kwargs)
        flag.arm()
        return x

    def _get_name(self):
        return f"NormFirst({_class_of(self).__name__}, computed in {self.__dict__['_fusedrc_consumer']})"


def _consumer_free(m):
    """``_free`` for the FFN after a norm: no hooks, no mark; an fx pass's instance forward is convert's own."""
    fwd = m.__dict__.get("forward")
    if not isinstance(fwd, _FxForward):
        return _free(m)
    return not (_is_marked(m) or global_hooks() or _user_hooks(m._forward_hooks) or _user_hooks(m._forward_pre_hooks)
                or getattr(m, "_backward_hooks", None) or getattr(m, "_backward_pre_hooks", None))


def _norm_args(norm, x):
    """The fused FFN's norm arguments for norm module ``norm`` (a _NormFirst or a plain one) on ``x``, or
    None where its op would not compute what the norm's class computes (its epsilon and dtype read now)."""
    return norm_call_args(norm, x, _class_of(norm))


def _armed_norm(consumer, x):
    """``(norm module, its fused-op arguments)`` when the norm before ``consumer`` passed its input
    through for this call (``x`` is then the norm's input), else ``(None, None)``."""
    d = consumer.__dict__
    flag = d.get("_fusedrc_norm_pass")
    if flag is None or torch.compiler.is_compiling() or not flag.armed:
        return None, None
    flag.arm(False)
    layer = _calling_layer(consumer, d["_fusedrc_normed_key"])
    norm = None if layer is None else layer._modules.get(d["_fusedrc_norm_key"])
    if not isinstance(norm, _NormFirst):
        return None, None
    return norm, _norm_args(norm, x)


def _with_norm(consumer, x, fused, plain):
    """Run a consumer's call: ``fused(x, **norm_args)`` and ``plain(x)`` are its fused op and its
    module-by-module forward; where the norm passed its input through, the fused op runs it (or,
    where the op cannot, the norm's own forward runs first)."""
    norm, args = _armed_norm(consumer, x)
    site = consumer._fusedrc_site()
    if norm is None:
        return _run_site(site, fused, plain, x) if consumer._fusedrc_fusable(x) else plain(x)
    if args is None or not consumer._fusedrc_fusable(x):
        return plain(norm.plain(x))
    return _run_site(site, lambda x: fused(x, **args), lambda x: plain(norm.plain(x)), x)


def _self_call(node, attr, arg=None):
    """Whether ``node`` is ``self.<attr>(<name>)``, the name ``arg`` if given: one positional name (with
    ``arg=...``, any one positional expression)."""
    return (isinstance(node, _ast.Call) and isinstance(node.func, _ast.Attribute) and node.func.attr == attr
            and isinstance(node.func.value, _ast.Name) and node.func.value.id == "self" and len(node.args) == 1
            and not node.keywords
            and (arg is ... or isinstance(node.args[0], _ast.Name) and arg in (None, node.args[0].id)))


def _norm_call_line(lines, key, consumer_key):
    """The 0-based line (in ``lines``, a forward's source) of ``y = self.<key>(x)`` where the next
    statement that runs is ``z = ...self.<consumer_key>(y)...`` (the call ``z`` or an argument of calls
    only: no lambda, comprehension or branch around it) and ``y`` is read nowhere else: no later read
    before a plain ``y = ...`` in the same block, no loop around either. None when there is none. The
    norm may be called elsewhere too (OPT's post-norm branch): the fused call is told by its line."""
    try:
        tree = _ast.parse(_textwrap.dedent("".join(lines)))
    except (SyntaxError, ValueError):
        return None
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (_ast.FunctionDef, _ast.AsyncFunctionDef)):
        return None
    parents = {}  # node -> (parent, the list holding it or None, its index there)
    for node in _ast.walk(fn):
        for value in _ast.iter_fields(node):
            value = value[1]
            if isinstance(value, list):
                for i, c in enumerate(value):
                    if isinstance(c, _ast.AST):
                        parents[c] = (node, value, i)
            elif isinstance(value, _ast.AST):
                parents[value] = (node, None, None)

    def looped(node):  # a loop, comprehension, lambda or inner function around it
        while node in parents and parents[node][0] is not fn:
            node = parents[node][0]
            if isinstance(node, (_ast.For, _ast.AsyncFor, _ast.While, _ast.comprehension, _ast.Lambda,
                                 _ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)):
                return True
        return False

    def next_stmt(stmt):  # the statement that runs when ``stmt`` completes
        parent, block, i = parents[stmt]
        if block is None:
            return None
        if i + 1 < len(block):
            return block[i + 1]
        if parent is not fn and isinstance(parent, (_ast.If, _ast.With, _ast.AsyncWith)):
            return next_stmt(parent)
        return None

    def reads(node, y):
        return any(isinstance(n, _ast.Name) and n.id == y for n in _ast.walk(node))

    def dead_after(stmt, y):  # no read of y after stmt before a plain ``y = ...`` in stmt's block
        parent, block, i = parents[stmt]
        for later in block[i + 1:]:
            if isinstance(later, _ast.Assign) and len(later.targets) == 1 and isinstance(later.targets[0], _ast.Name) \
                    and later.targets[0].id == y and not reads(later.value, y):
                return True
            if reads(later, y):
                return False
        return parent is fn or dead_after(parent, y)

    def calls_on(line):
        return sum(1 for n in _ast.walk(fn) if isinstance(n, _ast.Call) and getattr(n, "lineno", None) == line
                   and isinstance(n.func, _ast.Attribute) and n.func.attr == key)

    for call in _ast.walk(fn):
        # ``self.<consumer_key>(self.<key>(x))``: the norm's output goes to the FFN and nowhere else (timm's
        # ``self.mlp(self.norm2(x))``); told by its line, so the only norm call there
        if (_self_call(call, consumer_key, ...) and _self_call(call.args[0], key) and not looped(call)
                and calls_on(call.args[0].lineno) == 1):
            return call.args[0].lineno - 1
    for stmt in _ast.walk(fn):
        if not (isinstance(stmt, _ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], _ast.Name)
                and _self_call(stmt.value, key)) or looped(stmt):
            continue
        y, nxt = stmt.targets[0].id, next_stmt(stmt)
        if not (isinstance(nxt, _ast.Assign) and len(nxt.targets) == 1 and isinstance(nxt.targets[0], _ast.Name)):
            continue
        calls = [n for n in _ast.walk(nxt.value) if _self_call(n, consumer_key, y)]
        if len(calls) != 1 or sum(isinstance(n, _ast.Name) and n.id == y for n in _ast.walk(nxt.value)) != 1:
            continue
        node = calls[0]
        while node is not nxt.value and isinstance(parents[node][0], _ast.Call) and parents[node][1] is not None \
                and parents[node][1] is parents[node][0].args:
            node = parents[node][0]
        if node is nxt.value and (nxt.targets[0].id == y or dead_after(nxt, y)):
            return stmt.value.lineno - 1
    return None


def _norm_consumer(ctx, model, unit):
    """``(layer, key, consumer, its instance attributes to set)`` of a fused FFN unit that a norm could
    run first in: a fused FFN wrapper at ``layer.<key>``, an inlined FFN's head (its ``fc1``), or an MLP
    module the fx pass rewrote whose input feeds the FFN alone; else None."""
    head = unit.enable.attrs.get("fc1") if isinstance(unit.enable, _Switch) else None
    if isinstance(head, _FFNHead):
        return unit.enable.target, "fc1", head, {}
    if unit.name in ctx.fx_consumers:
        name, module, fused = ctx.fx_consumers[unit.name]
        parent, _, key = name.rpartition(".")
        layer = _lookup(model, parent)
        if layer is None or layer._modules.get(key) is not module:
            return None
        # its consumer interface, set on the instance when a norm joins it
        return layer, key, module, dict(_fusedrc_fx_entry=fused, _fusedrc_fusable=_FxConsumer(module, fused, "fusable"),
                                        _fusedrc_site=_FxConsumer(module, fused, "site"))
    module = _lookup(model, unit.name)
    if not isinstance(module, _NORM_CONSUMERS) or not unit.name or module.__dict__.get("_fusedrc_prelude"):
        return None  # (a prelude's modules run on the input before the op)
    parent, _, key = unit.name.rpartition(".")
    layer = _lookup(model, parent)
    return None if layer is None else (layer, key, module, {})


def _norm_first(ctx, model):
    """After the rules: in each layer whose forward runs ``y = self.<norm>(x); z = self.<ffn>(y)``,
    with a fused FFN unit at ``<ffn>`` and a norm the FFN ops model at ``<norm>``, the norm joins the
    FFN's unit (its kind gets a ``norm_`` prefix)."""
    for unit in ctx.units:
        found = _norm_consumer(ctx, model, unit)
        if found is None:
            continue
        layer, ckey, consumer, interface = found
        if isinstance(layer, Wrapper) or _foreign_forward(layer):
            continue  # its forward is not its class's code
        try:
            raw, start = _inspect.getsourcelines(_inspect.unwrap(_class_of(layer).forward))
        except (AttributeError, OSError, TypeError):
            continue
        for nkey, norm in layer._modules.items():
            i = None if norm is None or nkey == ckey else _norm_call_line(raw, nkey, ckey)
            if i is None:
                continue
            if not _nohooks(norm) or norm_kind(norm, _class_of(norm)) is None:
                break  # the norm runs as it is, the FFN fused after it
            new = _NormFirst.wrap(norm)
            new.__dict__.update(_fusedrc_layer=layer, _fusedrc_key=nkey, _fusedrc_line=start + i,
                                _fusedrc_consumer=ckey)
            consumer.__dict__.update(_fusedrc_layer=layer, _fusedrc_normed_key=ckey, _fusedrc_norm_key=nkey,
                                     _fusedrc_norm_pass=_PassThrough(), **interface)
            bind_replicas(consumer)
            unit.kind = "norm_" + unit.kind
            unit.recompute_modules += (new,)
            break


class _Groups(dict):
    """A fused Sequential's groups: start index -> (kind, site, activation, the group's modules)."""

    @staticmethod
    def in_place(seq, start, placed):
        """Whether the group's modules still sit where convert found them."""
        chain = list(seq._modules.values())[start:start + len(placed)]
        return len(chain) == len(placed) and all(a is b for a, b in zip(chain, placed))

    def _fusedrc_rebind(self, replica):
        # nn.DataParallel: the replica still holds the original's children when this runs and gets
        # their replicas at the same keys afterwards, so the groups in place carry over by key
        keys = list(replica._modules.keys())
        return _ReplicaGroups({i: (kind, site, act, tuple(keys[i:i + len(placed)]))
                               for i, (kind, site, act, placed) in self.items() if self.in_place(replica, i, placed)})


class _ReplicaGroups(dict):
    """The groups of a replica: a group's keys in place of its modules."""

    @staticmethod
    def in_place(seq, start, placed):
        return list(seq._modules.keys())[start:start + len(placed)] == list(placed)


class _FusedSequential(nn.Sequential):
    """An ``nn.Sequential`` (same children, same keys) whose pattern runs are fused.

    A group runs fused only while its modules still sit where convert found them: after an
    ``insert``, ``append`` or ``del`` the shifted ones run plainly; a slice is a plain
    ``nn.Sequential`` of the same modules."""

    groups = types.MappingProxyType({})  # a slice or a copy built by nn.Sequential: no groups

    @classmethod
    def wrap(cls, seq):
        new = Wrapper.wrap.__func__(cls, seq)
        new.__dict__["groups"] = _Groups()
        bind_replicas(new)
        return new

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def forward(self, x):
        return self.run_until(x, len(self._modules))

    def run_until(self, x, stop):
        """The modules before index ``stop`` on ``x`` (their groups fused)."""
        mods = list(self._modules.values())[:stop]
        i = 0
        while i < len(mods):
            g = self.groups.get(i)
            if g is not None and i + len(g[3]) <= len(mods) and self.groups.in_place(self, i, g[3]):
                # a group runs fused, or module by module when its call is not modelled
                kind, site, act, placed = g
                chain = mods[i:i + len(placed)]
                x = _run_chain(site, kind, act, chain, x)
                i += len(chain)
                continue
            x = mods[i](x)
            i += 1
        return x

    def _get_name(self):
        return "FusedSequential"


class _FxFused(nn.Module):
    """A parameter-free fused call inserted by the fx pass. The graph hands it the chain's modules
    as arguments (``get_attr`` of their names), so a call reaches the modules registered at those
    names on the module running the graph (an ``nn.DataParallel`` replica's own, for one);
    ``fixed`` maps a chain position to a module the model does not hold (a functional
    activation's equivalent)."""

    def __init__(self, kind, fixed, act, packed=None):
        super().__init__()
        self.__dict__["_fusedrc_fixed"] = dict(fixed)
        self.__dict__["site"] = Site()
        self.kind, self.act, self.packed = kind, act, packed

    def forward(self, x, *registered):
        fixed, live = self.__dict__["_fusedrc_fixed"], iter(registered)
        mods = [fixed[i] if i in fixed else next(live) for i in range(len(fixed) + len(registered))]
        mods = [m for m in mods if m is not None]  # (a function's node in the chain: a placeholder)
        # the norm before the module whose graph starts with this chain passed x through (_FxForward)
        pending = self.__dict__.get("_fusedrc_pending")
        norm = None if pending is None or torch.compiler.is_compiling() else \
            pending.pop(_threading.get_ident(), None)
        if norm is not None:
            return _run_dense(self.site, self.kind, self.act, mods, x, norm=norm, packed=self.packed)
        return _run_chain(self.site, self.kind, self.act, mods, x, self.packed)

    def extra_repr(self):
        return f"kind={self.kind!r}"


# --------------------------------------------------------------------------- activations

_HF_ACTS = {
    "ReLU": "relu", "GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh", "FastGELUActivation": "gelu_tanh", "AccurateGELUActivation": "gelu_tanh",
    "BloomGelu": "gelu_tanh",  # the tanh approximation, written out (equal to fp32 rounding)
    "SiLU": "silu", "SiLUActivation": "silu", "ReLUSquaredActivation": "relu2",
    "QuickGELUActivation": "quick_gelu", "QuickGELU": "quick_gelu",  # CLIP's (HF, open_clip): h * sigmoid(1.702 h)
    # activations without a fused form: named so that fx keeps them as calls and the plan says why
    "ClippedGELUActivation": None, "MishActivation": None, "LaplaceActivation": None,
    "SqrtSoftplusActivation": None, "XIELUActivation": None,
}


class _WrittenAct(nn.Module):
    """An activation a traced forward writes out as elementwise ops on one tensor (ESM's
    ``x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))``, a Swish ``x * torch.sigmoid(x)``): the ops
    themselves, as fx recorded them (``graph``), which the unit's unfused path runs, and the fused
    activation they compute (``fused``, found on a float64 probe: ``_probe_act``)."""

    def __init__(self, graph, fused):
        super().__init__()
        self.graph, self.fused = graph, fused

    def forward(self, x):
        return self.graph(x)

    def extra_repr(self):
        return f"fused={self.fused!r}"


# elementwise ops an activation written out may use (on its input, earlier ones' values and numbers)
_POINTWISE_FUNCTIONS = frozenset({
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.mul, torch.add, torch.sub, torch.div, torch.true_divide, torch.neg, torch.pow, torch.square,
    torch.erf, torch.tanh, torch.sigmoid, torch.exp, nn.functional.tanh, nn.functional.sigmoid,
})
_POINTWISE_METHODS = frozenset({"mul", "add", "sub", "div", "neg", "pow", "square", "erf", "tanh", "sigmoid", "exp"})
# the activations a written-out one is compared with, in this order (the first that matches)
_PROBED_ACTS = ("gelu", "gelu_tanh", "silu", "quick_gelu", "relu2", "hardswish")


def _pointwise(n):
    """Whether fx node ``n`` is one elementwise op of ``_POINTWISE_*`` on nodes and plain numbers."""
    if n.kwargs or not (n.op == "call_function" and n.target in _POINTWISE_FUNCTIONS
                        or n.op == "call_method" and n.target in _POINTWISE_METHODS):
        return False
    return all(isinstance(a, torch.fx.Node) or type(a) in (int, float) for a in n.args)


@functools.lru_cache(maxsize=1)
def _act_probe():
    """(probe values across the activations' curved range, float64; each probed activation on them)."""
    t = torch.cat([torch.linspace(-12, 12, 2401, dtype=torch.float64),
                   torch.tensor([0.0, 1e-6, -1e-6, 40.0, -40.0], dtype=torch.float64)])
    return t, {name: reference.activation_forward(t, name) for name in _PROBED_ACTS}


def _probe_act(graph):
    """The fused activation that ``graph`` (one tensor in, one out) computes, or None: compared in
    float64 on ``_act_probe``'s values, within 1e-9 relative."""
    t, wanted = _act_probe()
    try:
        with torch.no_grad():
            out = graph(t.clone())
    except Exception:  # an op that does not take this probe: not an activation fusedrc knows
        return None
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float64 or out.shape != t.shape:
        return None
    return next((name for name in _PROBED_ACTS if torch.allclose(out, wanted[name], rtol=1e-9, atol=1e-12)), None)


def _act_graph(h, nodes, sink):
    """A GraphModule of ``nodes`` (in graph order) as a function of ``h``'s value, returning ``sink``'s."""
    g = torch.fx.Graph()
    env = {h: g.placeholder("x")}
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[sink])
    return torch.fx.GraphModule(nn.Module(), g)


def _act_name(mod):
    """The fused activation name of an activation module (torch or Hugging Face), or None."""
    name = activation_name(mod) if isinstance(mod, nn.Module) else None
    if name is not None:
        return name
    if type(mod) is _WrittenAct:
        return mod.fused
    cls = type(mod).__name__
    if cls == "GELUActivation" and getattr(mod, "act", None) is not None:
        return "gelu"
    if cls == "GELU" and type(mod).__module__ == "timm.layers.activations":  # F.gelu(input), erf
        return "gelu"
    return _HF_ACTS.get(cls)


# --------------------------------------------------------------------------- plan and context


@dataclass
class _Unit:
    name: str
    kind: str
    enable: object
    disable: object
    recompute_modules: tuple = ()
    block: str | None = None
    saved: int = 0
    cost: int = 0
    selected: bool = False


@dataclass
class _Block:
    name: str
    module: nn.Module
    when: object = None  # (args, kwargs) -> bool: whether a call may be recomputed
    units: list = field(default_factory=list)
    saved: int = 0
    cost: int = 0
    selected: bool = False


@dataclass
class ConvertPlan:
    """What ``convert`` did: fused units, recomputed blocks, skipped patterns, measured bytes."""

    units: list
    blocks: list
    skipped: list
    baseline_bytes: int | None = None
    final_bytes: int | None = None
    target_bytes: int | None = None

    @property
    def fused(self):
        """Names of the fused units switched on."""
        return [u.name for u in self.units if u.selected]

    @property
    def recomputed_blocks(self):
        """Names of the blocks recomputed whole with :func:`fusedrc.mark`."""
        return [b.name for b in self.blocks if b.selected]

    def __str__(self):
        lines = ["fusedrc.convert plan"]
        if self.baseline_bytes is not None:
            lines.append(f"  activation bytes kept: original {self.baseline_bytes / 2**20:.2f} MiB")
            if self.final_bytes is not None:
                r = self.final_bytes / max(self.baseline_bytes, 1)
                lines.append(f"  after conversion: {self.final_bytes / 2**20:.2f} MiB ({r:.3f} of original)")
            if self.target_bytes is not None:
                lines.append(f"  budget: {self.target_bytes / 2**20:.2f} MiB")
        lines.append(f"  fused units ({len(self.fused)} of {len(self.units)}):")
        for u in self.units:
            if u.selected:
                extra = f"  saves {u.saved / 2**10:.1f} KiB, recompute {u.cost / 1e6:.2f} MFLOP" if u.saved else ""
                lines.append(f"    {u.name:40s} {u.kind}{extra}")
        if self.recomputed_blocks:
            lines.append("  whole blocks recomputed (fusedrc.mark):")
            for b in self.blocks:
                if b.selected:
                    lines.append(f"    {b.name}")
        if self.skipped:
            lines.append("  left as they are:")
            for name, reason in self.skipped:
                lines.append(f"    {name or '<model>'}: {reason}")
        return "\n".join(lines)

    __repr__ = __str__


class _Context:
    def __init__(self):
        self.units, self.blocks, self.skipped = [], [], []
        self.fx_consumers = {}  # FFN unit name -> (module name, module, its _FxFused): an fx-rewritten MLP module
        self.joined_norms = set()  # ids of the norm modules a Sequential's or an fx graph's norm_ffn unit runs

    def unit(self, name, kind, enable, disable, recompute_modules=()):
        # a MixedConv2d's FLOPs are its splits'
        recompute_modules = tuple(p for m in recompute_modules for p in conv_parts(m))
        self.units.append(_Unit(name, kind, enable, disable, recompute_modules))

    def block(self, name, module, when=None):
        self.blocks.append(_Block(name, module, when))

    def skip(self, name, reason):
        if (name, reason) not in self.skipped:  # the Sequential pass and an fx graph may both see it
            self.skipped.append((name, reason))


def _join(prefix, name):
    return f"{prefix}.{name}" if prefix else name


class _Switch:
    """``enable``/``disable`` of a unit: an object, not a closure, so that a converted model
    pickles (``torch.save``) and ``copy.deepcopy`` rebinds the plan to the copy's modules."""

    def __init__(self, target, **attrs):
        self.target, self.attrs = target, attrs

    def __call__(self):
        for k, v in self.attrs.items():
            if isinstance(self.target, nn.Module) and not isinstance(v, nn.Module) and v is not None:
                self.target._modules.pop(k, None)  # a function back in a module's slot (Mask2Former's activation)
            setattr(self.target, k, v)


def _site_switches(site):
    return _Switch(site, enabled=True), _Switch(site, enabled=False)


def _site_unit(ctx, wrapper, name, key, kind, recompute_modules):
    site = Site()
    wrapper.sites[key] = site
    ctx.unit(name, kind, *_site_switches(site), recompute_modules)
    return site


def _declare(ctx, wrapper, block_name, key, reason, mods, kind, recompute_modules):
    """A rule's unit ``<block_name>.<key>`` on ``wrapper``, or the reason it is left (hooks on ``mods``)."""
    name = _join(block_name, key)
    if reason is not None or not _nohooks(*mods):
        ctx.skip(name, reason or "hooks registered on the modules")
        return
    _site_unit(ctx, wrapper, name, key, kind, recompute_modules)


def _declare_cbr(ctx, wrapper, block_name, key, conv, bn, act, residual=False):
    _declare(ctx, wrapper, block_name, key, _static_cbr(conv, bn, act), (conv, bn, act), _cbr_kind(act, residual),
             (conv,))


# --------------------------------------------------------------------------- rule registry

_RULES = {}


def register_rule(*class_names):
    """Register ``rule(ctx, name, module) -> module`` for modules whose class has one of these names.

    Used as a decorator, ``@register_rule("MyBlock", "MyOtherBlock")``; see the module
    docstring ("How to add a rule") for what a rule declares. A later registration
    for the same class name replaces the earlier one.
    """
    if not class_names:
        raise TypeError("register_rule needs at least one class name, e.g. @register_rule('MyBlock')")
    for c in class_names:
        if not isinstance(c, str):
            raise TypeError(
                f"register_rule takes class names (str), got {type(c).__name__} {c!r}; "
                "use it as @register_rule('MyBlock'), not bare @register_rule"
            )

    def deco(fn):
        if not callable(fn):
            raise TypeError(f"rule must be a callable (ctx, name, module) -> module, got {type(fn).__name__}")
        for c in class_names:
            _RULES[c] = fn
        return fn

    return deco


def _from_torchvision(m):
    # the 2-D ResNet blocks only: torchvision.models.video has 3-D classes of the same names
    return _class_of(m).__module__ == "torchvision.models.resnet"


# timm's residual blocks and transformer layers, by class name -> the modules defining it: each
# is a block for policy="blocks" and budgets (the module itself, unchanged); the fx pass finds
# the Conv-BN-act chains and MLPs inside
_TIMM_BLOCKS = {
    "BasicBlock": ("timm.models.resnet", "timm.models.byobnet"),
    "Bottleneck": ("timm.models.resnet", "timm.models.regnet", "timm.models.resnetv2"),
    # cspnet: CSPResNet, CSPDarkNet, DarkNet (Conv-BN-LeakyReLU)
    "BottleneckBlock": ("timm.models.byobnet", "timm.models.cspnet"),
    "DarkBlock": ("timm.models.byobnet", "timm.models.cspnet"), "EdgeBlock": ("timm.models.byobnet", "timm.models.cspnet"),
    "DepthwiseSeparableConv": ("timm.models._efficientnet_blocks",),
    "InvertedResidual": ("timm.models._efficientnet_blocks",), "EdgeResidual": ("timm.models._efficientnet_blocks",),
    "Block": ("timm.models.vision_transformer", "timm.models.beit", "timm.models.pvt_v2", "timm.models.twins",
              "timm.models.rdnet", "timm.models.swiftformer"),
    "ConvEncoder": ("timm.models.swiftformer",),
    "BlockESE": ("timm.models.rdnet",),
    "MixerBlock": ("timm.models.mlp_mixer",), "SwinTransformerBlock": ("timm.models.swin_transformer",),
    "EvaBlock": ("timm.models.eva",), "EvaBlockPostNorm": ("timm.models.eva",),
    "ConvNeXtBlock": ("timm.models.convnext",),
    "RepMixerBlock": ("timm.models.fastvit",), "AttentionBlock": ("timm.models.fastvit",),
    # pre-activation: BatchNormAct2d -> Conv units inside (timm's DenseNet layers, ResNetV2's blocks)
    "DenseLayer": ("timm.models.densenet",),
    "PreActBottleneck": ("timm.models.resnetv2",), "PreActBasic": ("timm.models.resnetv2",),
}


def _timm_block(ctx, name, m):
    """Whether ``m`` is one of timm's blocks (then declared one)."""
    cls = _class_of(m)
    if cls.__module__ in _TIMM_BLOCKS.get(cls.__name__, ()):
        ctx.block(name, m)
        return True
    return False


@register_rule("BasicBlock")
def _basic_block(ctx, name, m):
    if _timm_block(ctx, name, m) or not _from_torchvision(m):
        return m
    new = FusedBasicBlock.wrap(m)
    _declare_cbr(ctx, new, name, "conv1", m.conv1, m.bn1, m.relu)
    _declare_cbr(ctx, new, name, "conv2", m.conv2, m.bn2, m.relu, residual=True)
    ctx.block(name, new)
    return new


@register_rule("Bottleneck")
def _bottleneck(ctx, name, m):
    if _timm_block(ctx, name, m) or not _from_torchvision(m):
        return m
    new = FusedBottleneck.wrap(m)
    _declare_cbr(ctx, new, name, "conv1", m.conv1, m.bn1, m.relu)
    _declare_cbr(ctx, new, name, "conv2", m.conv2, m.bn2, m.relu)
    _declare_cbr(ctx, new, name, "conv3", m.conv3, m.bn3, m.relu, residual=True)
    ctx.block(name, new)
    return new


@register_rule("ResNet")
def _resnet(ctx, name, m):
    if not _from_torchvision(m):
        return m
    new = FusedResNet.wrap(m)
    _declare_cbr(ctx, new, name, "conv1", m.conv1, m.bn1, m.relu)
    return new


def _declare_bac(ctx, wrapper, block_name, key, bn, act, conv):
    _declare(ctx, wrapper, block_name, key, _static_bac(bn, act, conv), (bn, act, conv), _bac_kind(act), (bn,))


class FusedDenseLayer(Wrapper):
    """torchvision DenseNet's ``_DenseLayer``: concat -> norm1-relu1-conv1 and norm2-relu2-conv2, each a fused
    pre-activation unit. With ``memory_efficient`` (torchvision checkpoints the concat and the first unit,
    keeping only the inputs) the first part runs as torchvision runs it."""

    def forward(self, input):
        if not _nohooks(self):
            return self.plain(input)
        prev = [input] if isinstance(input, torch.Tensor) else input
        s = self.sites
        if self.memory_efficient and self.any_requires_grad(prev):
            h = self.call_checkpoint_bottleneck(prev)
        else:
            h = _bac(s.get("norm1"), self.norm1, self.relu1, self.conv1, torch.cat(prev, 1))
        new = _bac(s.get("norm2"), self.norm2, self.relu2, self.conv2, h)
        if self.drop_rate > 0:
            new = nn.functional.dropout(new, p=self.drop_rate, training=self.training)
        return new


@register_rule("_DenseLayer")
def _dense_layer(ctx, name, m):
    if _class_of(m).__module__ != "torchvision.models.densenet":
        return m
    new = FusedDenseLayer.wrap(m)
    _declare_bac(ctx, new, name, "norm1", m.norm1, m.relu1, m.conv1)
    _declare_bac(ctx, new, name, "norm2", m.norm2, m.relu2, m.conv2)
    ctx.block(name, new)
    return new


# torchvision's residual blocks other than ResNet's, by class name -> the modules defining it
_TORCHVISION_BLOCKS = {
    "InvertedResidual": ("torchvision.models.mobilenetv2", "torchvision.models.mobilenetv3",
                         "torchvision.models.shufflenetv2"),
    "MBConv": ("torchvision.models.efficientnet",), "FusedMBConv": ("torchvision.models.efficientnet",),
    "_InvertedResidual": ("torchvision.models.mnasnet",),
    "ResBottleneckBlock": ("torchvision.models.regnet",),
    "CNBlock": ("torchvision.models.convnext",),
    "SwinTransformerBlock": ("torchvision.models.swin_transformer",),
    "SwinTransformerBlockV2": ("torchvision.models.swin_transformer",),
    "EncoderBlock": ("torchvision.models.vision_transformer",),
}


@register_rule(*_TORCHVISION_BLOCKS, *(n for n in _TIMM_BLOCKS if n not in ("BasicBlock", "Bottleneck")))
def _torchvision_block(ctx, name, m):
    """torchvision's residual blocks: MobileNetV2/V3 and ShuffleNetV2 ``InvertedResidual``,
    EfficientNet ``MBConv``/``FusedMBConv``, MNASNet's, RegNet ``ResBottleneckBlock``, ConvNeXt
    ``CNBlock``, Swin and ViT encoder blocks: each is a block for ``policy="blocks"`` and budgets
    (the module itself, unchanged); the fx pass finds the Conv-BN[-act] chains and FFNs inside it.
    timm's blocks (``_TIMM_BLOCKS``) likewise. A class of the same name from elsewhere is left to
    the other passes."""
    cls = _class_of(m)
    if cls.__module__ in _TORCHVISION_BLOCKS.get(cls.__name__, ()):
        ctx.block(name, m)
    else:
        _timm_block(ctx, name, m)
    return m


# rules for torchvision's and timm's classes, by their names: another library's class of the same
# name is not theirs
_LIBRARY_RULES = (_basic_block, _bottleneck, _resnet, _torchvision_block, _dense_layer)


class FusedConvMlp(Wrapper):
    """timm's MLPs of 1x1 convolutions, ``Mlp(use_conv=True)`` (``fc1 -> act -> drop1 -> norm -> fc2 ->
    drop2``: the MLP of timm's small ConvNeXts, ``conv_mlp=True``, and of MetaFormer/PoolFormer-style
    models) and ``ConvMlp`` (``fc1 -> norm -> act -> drop -> fc2``), ``norm`` an ``nn.Identity``, and
    FastViT's ``ConvMlp`` and SwiftFormer's ``Mlp`` (``conv`` / ``norm1 -> fc1 -> act -> drop -> fc2 ->
    drop``, the depthwise Conv-BN / the BatchNorm2d run as it is, before): one fused FFN over the
    channels of each pixel (:func:`_conv_ffn`)."""

    def forward(self, x):
        site, fc1, fc2 = self.sites.get("ffn"), self.fc1, self.fc2
        form = self.__dict__["_fusedrc_form"]
        mid, after = form.mid, form.after

        def layers(x):  # fc1 -> act -> dropout -> fc2, unfused
            return fc2(getattr(self, mid)(self.act(fc1(x))))

        if form.before is not None:
            # (its own fused units inside); the rest, unfused, is the checked lines written out
            x = getattr(self, form.before)(x)
            plain = lambda x: getattr(self, after)(layers(x))  # noqa: E731
        else:
            plain = self.plain
        act = self.__dict__["_fusedrc_act"]
        p = fused_dropout_p(getattr(self, mid))
        affine = _affine_act(self.act)
        # inside a recomputed region (a block) the convolutions themselves: the region keeps its inputs
        if (site is None or not site.enabled or p is None or _conv_mlp_reason(self, form) is not None
                or inside_region() or (affine[0] if affine else _act_name(self.act)) != act
                or affine and p != 0  # dropout(s * act + b): b no longer a constant through fc2
                or not _nohooks(self, *(c for k, c in self._modules.items() if k != form.before))  # it ran as is
                or not (isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[1] == fc1.in_channels)
                or not _dense_runtime_ok(x, fc1, fc2)):
            return plain(x)
        y = _run_site(site, lambda x: _conv_ffn(x, fc1, fc2, act, p, affine), layers, x)
        return getattr(self, after)(y) if after else y

    def _fusedrc_fx_children(self):
        """The children the fx pass still looks into: the module its forward runs as it is before fc1."""
        before = self.__dict__["_fusedrc_form"].before
        return () if before is None else (before,)


def _conv_ffn(x, fc1, fc2, act, p, affine=None):
    """``fc2(dropout(act(fc1(x))))`` for 1x1 convolutions on NCHW ``x``, as one fused FFN on its
    (pixels, channels) rows: a view of a channels_last input, one copy (the tensor the op keeps,
    as a checkpoint keeps x) of a contiguous one; the output in the memory format the conv would
    give (channels_last when x's channels are its innermost dimension, as torch decides it).
    ``affine``: ``_affine_act``'s (act, scale, bias) of an activation ``scale * act(h) + bias``, folded
    into fc2 (no dropout between)."""
    from torch._prims_common import suggest_memory_format  # eager's Tensor::suggest_memory_format

    channels_last = suggest_memory_format(x) == torch.channels_last
    w2, b2 = fc2.weight.flatten(1), fc2.bias
    if affine is not None:
        w2, b2 = _fold_affine(w2, b2, affine[1], affine[2])
    y = F.fused_mlp(x.permute(0, 2, 3, 1), fc1.weight.flatten(1), fc1.bias, w2, b2, act,
                    dropout_p=p).permute(0, 3, 1, 2)
    return y if channels_last else y.contiguous()


def _affine_act(mod):
    """``(activation, scale, bias)`` of an activation module computing ``scale * act(x) + bias`` with
    learned one-element ``scale`` and ``bias``: timm's StarReLU (MetaFormer's, ``scale * relu(x) ** 2 +
    bias``), known by its forward's code; else None. No fused activation stands for it alone: an FFN
    folds it into its second layer (``_fold_affine``)."""
    if type(mod).__name__ != "StarReLU" or type(mod._modules.get("relu")) is not nn.ReLU:
        return None
    scale, bias = mod._parameters.get("scale"), mod._parameters.get("bias")
    if scale is None or bias is None or scale.numel() != 1 or bias.numel() != 1:
        return None
    cls = type(mod)
    if cls not in _AFFINE_CODE:  # its source read once a class: this runs at every call of a fused FFN
        lines = _source_lines(mod)
        _AFFINE_CODE[cls] = lines is not None and _forward_arg(lines) == "x" and lines[1:] == [
            "return self.scale * self.relu(x) ** 2 + self.bias"]
    return ("relu2", scale, bias) if _AFFINE_CODE[cls] else None


_AFFINE_CODE = {}  # activation class -> whether its forward is StarReLU's


def _fold_affine(w2, b2, scale, bias):
    """The second layer's weight and bias with ``scale * a + bias`` folded in: ``(scale * a + bias) W2^T + b2
    = a (scale W2)^T + (b2 + bias * W2 1)``, equal up to rounding; differentiable in all four."""
    w = w2 * scale.to(w2.dtype)
    b = bias.to(w2.dtype) * w2.sum(1)
    return w, b if b2 is None else b2 + b


@dataclass(frozen=True)
class _ConvMlpForm:
    lines: tuple  # its forward's lines after the def
    mid: str  # the dropout between act and fc2
    after: str = None  # the module after fc2
    before: str = None  # the module before fc1 (run as it is)
    norm: str = "norm"  # the norm between the layers (must be an nn.Identity)


# class name -> the forwards of that name the rule fuses
_CONV_MLP_FORMS = {
    "Mlp": [_ConvMlpForm(("x = self.fc1(x)", "x = self.act(x)", "x = self.drop1(x)", "x = self.norm(x)",
                          "x = self.fc2(x)", "x = self.drop2(x)", "return x"), "drop1", "drop2"),
            # SwiftFormer's: its BatchNorm2d first, one Dropout module after act and after fc2
            _ConvMlpForm(("x = self.norm1(x)", "x = self.fc1(x)", "x = self.act(x)", "x = self.drop(x)",
                          "x = self.fc2(x)", "x = self.drop(x)", "return x"), "drop", "drop", "norm1", None)],
    "ConvMlp": [_ConvMlpForm(("x = self.fc1(x)", "x = self.norm(x)", "x = self.act(x)", "x = self.drop(x)",
                              "x = self.fc2(x)", "return x"), "drop"),
                # FastViT's: its depthwise Conv-BN first, one Dropout module after act and after fc2
                _ConvMlpForm(("x = self.conv(x)", "x = self.fc1(x)", "x = self.act(x)", "x = self.drop(x)",
                              "x = self.fc2(x)", "x = self.drop(x)", "return x"), "drop", "drop", "conv", None)],
}


def _is_pointwise(conv):
    return (type(conv) is nn.Conv2d and conv.kernel_size == (1, 1) and conv.stride == (1, 1)
            and conv.groups == 1 and _conv_padding(conv) == [0, 0])


def _widening_pointwise(conv):
    """A 1x1 conv that widens: an FFN's first layer (a squeeze-excitation's narrowing MLP runs on the pooled
    1x1 map: nothing worth fusing there)."""
    return _is_pointwise(conv) and conv.out_channels >= conv.in_channels


def _pointwise_ffn(fc1, fc2):
    """Whether 1x1 convs ``fc1 -> act -> fc2`` found in a Sequential or a graph are an FFN over channels."""
    return _widening_pointwise(fc1) and _is_pointwise(fc2) and fc2.in_channels == fc1.out_channels


def _conv_mlp_reason(m, form):
    if not (_is_pointwise(m.fc1) and _is_pointwise(m.fc2)) or m.fc2.in_channels != m.fc1.out_channels:
        return "fc1/fc2 are not plain 1x1 convolutions (stride 1, no padding, groups 1) of matching channels"
    if form.norm is not None and type(getattr(m, form.norm)) is not nn.Identity:
        return f"a {type(getattr(m, form.norm)).__name__} inside the MLP has no fused form"
    if fused_dropout_p(getattr(m, form.mid), training=True) is None:
        return f"{type(getattr(m, form.mid)).__name__} between the activation and fc2 has no fused form"
    return None


@register_rule(*_CONV_MLP_FORMS)
def _conv_mlp(ctx, name, m):
    """timm's ``Mlp`` with 1x1 convolutions and ``ConvMlp`` (timm.layers.mlp, or a copy in a timm model
    file; FastViT's, SwiftFormer's), their forwards checked line by line; a Linear ``Mlp`` is left to the
    fx pass."""
    cls = _class_of(m)
    # timm.layers.mlp's, and copies in timm's model files (inception_next's ConvMlp): the lines decide
    if not cls.__module__.startswith("timm.") or type(getattr(m, "fc1", None)) is not nn.Conv2d:
        return m
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    form = next((f for f in _CONV_MLP_FORMS[cls.__name__] if tuple(lines[1:]) == f.lines), None)
    reason = f"{cls.__name__}.forward is not timm's" if form is None else _conv_mlp_reason(m, form)
    # read only once the lines matched: another ConvMlp (timm's VGG's: act1, act2) has no .act
    affine = _affine_act(m.act) if reason is None else None
    act = (affine[0] if affine else _act_name(m.act)) if reason is None else None
    if reason is None and act is None:
        reason = f"activation {type(m.act).__name__} has no fused form"
    if affine and fused_dropout_p(getattr(m, form.mid), training=True) != 0:
        reason = f"{type(m.act).__name__}'s bias does not fold through the dropout before fc2"
    if reason is None and not _nohooks(*(c for k, c in m._modules.items() if k != form.before)):
        reason = "hooks registered on the modules"
    new = _wrapped_unit(ctx, name, m, reason, FusedConvMlp, act, "ffn", "conv_ffn", (m.fc1,))
    if reason is None:
        new.__dict__["_fusedrc_form"] = form
    return new


def _wrapped_unit(ctx, name, m, reason, wrapper, act, key, kind, recompute_modules):
    """``m`` turned into ``wrapper`` holding one fused unit (its activation ``act``, site ``key``), or,
    with a ``reason``, ``m`` itself and the reason in the plan."""
    if reason is not None:
        ctx.skip(name, reason)
        return m
    new = wrapper.wrap(m)
    new.__dict__["_fusedrc_act"] = act
    _site_unit(ctx, new, name, key, kind, recompute_modules)
    return new


class FusedAlbertLayer(Wrapper):
    """Hugging Face ``AlbertLayer``: its ``ff_chunk`` (``ffn -> activation -> ffn_output``, which
    ``apply_chunking_to_forward`` calls) as one fused FFN; the rest of the layer as it is. ALBERT
    shares its layers across depth: each call keeps its own input."""

    def forward(self, *args, **kwargs):
        return self.plain(*args, **kwargs)  # the original forward, whose self.ff_chunk is the one below

    def ff_chunk(self, attention_output):
        # the original ff_chunk is these three modules in a row (its lines are checked): a dense chain
        return _run_dense(self.sites.get("ffn"), "ffn", self.__dict__["_fusedrc_act"],
                          [self.ffn, self.activation, self.ffn_output], attention_output)


_ALBERT_FF_CHUNK = ["def ff_chunk(self, attention_output: torch.Tensor) -> torch.Tensor:",
                    "ffn_output = self.ffn(attention_output)", "ffn_output = self.activation(ffn_output)",
                    "ffn_output = self.ffn_output(ffn_output)", "return ffn_output"]


@register_rule("AlbertLayer")
def _albert_layer(ctx, name, m):
    if not hasattr(_class_of(m), "ff_chunk"):  # another library's AlbertLayer: not this rule's
        return m
    lines = _source_lines(m, "ff_chunk")
    act = _act_name(getattr(m, "activation", None))
    # the annotations may differ between versions: the body decides
    if not lines or lines[1:] != _ALBERT_FF_CHUNK[1:] or not lines[0].startswith("def ff_chunk(self, attention_output"):
        reason = f"{_class_of(m).__name__}.ff_chunk is not ffn -> activation -> ffn_output"
    elif act is None:
        reason = f"activation {type(m.activation).__name__} has no fused form"
    elif not (is_linear(m.ffn) and is_linear(m.ffn_output)) or not _nohooks(m.ffn, m.activation, m.ffn_output) \
            or _foreign_forward(m):
        reason = "ffn/ffn_output are not plain nn.Linear without hooks"
    else:
        reason = None
    return _wrapped_unit(ctx, _join(name, "ffn"), m, reason, FusedAlbertLayer, act, "ffn", "ffn",
                         (getattr(m, "ffn", None),))


# BERT's FFN spans two modules its layer calls in a row: ``intermediate`` (dense -> act) and
# ``output`` (dense -> dropout -> LayerNorm(h + residual)). About 35 Hugging Face families copy
# the three methods word for word (RoBERTa, ELECTRA, XLM-R, CamemBERT, ERNIE, LayoutLM, ...);
# Longformer names the layer's method ff_chunk.
_SPLIT_FFN_METHODS = ("feed_forward_chunk", "ff_chunk")
_SPLIT_FFN_INTERMEDIATE = ["hidden_states = self.dense(hidden_states)",
                           "hidden_states = self.intermediate_act_fn(hidden_states)", "return hidden_states"]


class _SplitTailForm(NamedTuple):
    """What ``output``'s forward does after its dense: a dropout or not, and the norm module it applies to
    ``h + residual`` ("": none)."""
    dropout: bool
    norm: str


def _split_ffn_norm(lines):
    """The :class:`_SplitTailForm` of ``output``'s forward of two arguments ``(x, r)`` when its body is BERT's
    ``v = self.dense(x); v = self.dropout(v); v = self.<norm>(v + r); return v``, without the norm (ESM's,
    after a pre-FFN norm: ``v = v + r``, or Megatron-BERT's ``return r + v``) or without the dropout
    (MobileBERT's ``FFNOutput``); the sum in either order (IEEE addition commutes); else None."""
    args = _forward_args(lines)
    if args is None or len(args) != 2 or not 3 <= len(lines) <= 5:
        return None
    x, r = args
    head = _re.fullmatch(rf"(\w+) = self\.dense\({x}\)", lines[1])
    v = head and head.group(1)
    if v is None or v == r:
        return None
    body = lines[2:]
    dropout = bool(body) and body[0] == f"{v} = self.dropout({v})"
    body = body[dropout:]
    total = rf"(?:{v} \+ {r}|{r} \+ {v})"
    if len(body) == 1:
        return _SplitTailForm(dropout, "") if _re.fullmatch(rf"return {total}", body[0]) else None
    if len(body) != 2 or body[1] != f"return {v}":
        return None
    if _re.fullmatch(rf"{v} = {total}", body[0]):
        return _SplitTailForm(dropout, "")
    norm = _re.fullmatch(rf"{v} = self\.(\w+)\({total}\)", body[0])
    return _SplitTailForm(dropout, norm.group(1)) if norm else None


def _split_tail(out, form, h, residual):
    """``output``'s forward after its dense (``form``: a :class:`_SplitTailForm`): dropout, the residual and its
    norm."""
    y = (out.dropout(h) if form.dropout else h) + residual
    return getattr(out, form.norm)(y) if form.norm else y


def _split_ffn_act_fn(inter):
    """``(fused activation, the callable)`` of an ``intermediate`` whose forward is ``dense`` then an
    activation: its ``intermediate_act_fn`` module (BERT's), or a function of its class's module applied
    by name (ESM's ``gelu``, erf written out: named by a float64 probe, as a written-out activation);
    ``(None, None)`` otherwise."""
    lines = (_source_lines(inter) or [""])[1:]
    if lines == _SPLIT_FFN_INTERMEDIATE:
        fn = getattr(inter, "intermediate_act_fn", None)
        return _act_name(fn), fn
    call = _re.fullmatch(r"hidden_states = (\w+)\(hidden_states\)", lines[1]) if len(lines) == 3 else None
    if call is None or lines[0] != _SPLIT_FFN_INTERMEDIATE[0] or lines[2] != "return hidden_states":
        return None, None
    fn = getattr(_sys.modules.get(_class_of(inter).__module__), call.group(1), None)
    return (_probe_act(fn), fn) if isinstance(fn, types.FunctionType) else (None, None)


def _split_ffn_method(m):
    """``(name, argument, pre-norm)`` of ``m``'s class method that is BERT's ``feed_forward_chunk`` word
    for word (its argument named as it likes; pre-norm None), or that with a norm module of the layer
    applied first, its output the intermediate's input and the argument the residual (ESM's; pre-norm
    that module's name), or None."""
    for method in _SPLIT_FFN_METHODS:
        lines = _source_lines(m, method) if hasattr(_class_of(m), method) else None
        head = _re.match(rf"def {method}\(self, (\w+)", lines[0]) if lines else None
        if head is None:
            continue
        arg = head.group(1)
        pre = _re.fullmatch(rf"(\w+) = self\.(\w+)\({arg}\)", lines[1]) if len(lines) == 5 else None
        normed, norm = (pre.group(1), pre.group(2)) if pre else (arg, None)
        body = [f"intermediate_output = self.intermediate({normed})",
                f"layer_output = self.output(intermediate_output, {arg})", "return layer_output"]
        # a norm written back into the argument would make the residual the normed value: not this form
        if lines[2 if pre else 1:] == body and not (pre and normed in (arg, "intermediate_output")):
            return method, arg, norm
    return None


def _holds_split_ffn(m):
    return not isinstance(m, Wrapper) and all(isinstance(m._modules.get(k), nn.Module) for k in ("intermediate", "output"))


def _looks_split_ffn_layer(m):
    """Found by shape: a module holding ``intermediate`` and ``output`` whose class has BERT's
    ``feed_forward_chunk`` (checked word for word)."""
    return _holds_split_ffn(m) and _split_ffn_method(m) is not None


class _SplitFFN:
    """A BERT-style layer's ``feed_forward_chunk``, set on the layer instance (its class, so
    Hugging Face's gradient checkpointing and ``isinstance`` checks, stays as it is): the two
    Linears and the activation as one fused FFN, then ``output``'s dropout and norm as modules.
    Where the layer's modules are no longer what convert checked (another class at the layer,
    ``intermediate`` or ``output``; hooks or a ``fusedrc.mark`` on them or on their Linears, a LoRA
    layer at a Linear's place, another activation), the class's own method runs."""

    def __init__(self, layer, method, arg, site, act, norm, classes, pre_norm=None, act_fn=None):
        self.layer, self.method, self.arg, self.site = layer, method, arg, site
        # norm: output's _SplitTailForm; classes: the layer's, intermediate's, output's
        self.act, self.norm, self.classes = act, norm, classes
        # pre_norm: the layer's norm module the method applies first (ESM's); act_fn: a function activation
        # the intermediate applies by name (None: its intermediate_act_fn module)
        self.pre_norm, self.act_fn = pre_norm, act_fn
        # the method's signature (apply_chunking_to_forward counts its parameters), built here: dynamo
        # before torch 2.13 breaks the graph building a Signature inside a compiled forward
        self.__signature__ = _inspect.Signature([_inspect.Parameter(arg, _inspect.Parameter.POSITIONAL_OR_KEYWORD)])

    def _fusedrc_rebind(self, replica):
        return _SplitFFN(replica, self.method, self.arg, self.site, self.act, self.norm, self.classes,
                         self.pre_norm, self.act_fn)

    def __call__(self, *args, **kwargs):
        layer = self.layer
        inter, out = layer._modules.get("intermediate"), layer._modules.get("output")
        one = len(args) + len(kwargs) == 1 and (not kwargs or self.arg in kwargs)
        if not (one and self.site.enabled and (type(layer), type(inter), type(out)) == self.classes):
            return getattr(type(layer), self.method)(layer, *args, **kwargs)
        x = args[0] if args else kwargs[self.arg]
        pre = None if self.pre_norm is None else layer._modules.get(self.pre_norm)
        if self.pre_norm is not None and not isinstance(pre, nn.Module):
            return getattr(type(layer), self.method)(layer, *args, **kwargs)
        normed = x if pre is None else pre(x)
        h = _split_ffn_run(self.site, self.act, inter, out, normed, self.act_fn)
        if h is None:
            if pre is None:
                return getattr(type(layer), self.method)(layer, *args, **kwargs)
            return out(inter(normed), x)  # the rest of the method as its code reads (checked), the norm run once
        return _split_tail(out, self.norm, h, x)


def _split_ffn_run(site, act, inter, out, x, act_fn=None):
    """``output.dense(act(intermediate.dense(x)))`` as one fused FFN (``site``'s impl), or None where the
    modules are not as convert checked them (hooks, a mark, a LoRA layer or another activation swapped in).
    ``act_fn``: the function activation the intermediate applies by name (ESM's), else its module's."""
    fc1, fc2 = inter.dense, out.dense
    # a function activation is the class's code, checked at convert: only a module one can be swapped
    act_mod = inter.intermediate_act_fn if act_fn is None else None
    if (not _free(inter, out, fc1, act_mod, fc2) or not (is_linear(fc1) and is_linear(fc2))
            or (act_mod is not None and _act_name(act_mod) != act) or not _dense_runtime_ok(x, fc1, fc2)):
        return None
    run_act = act_fn or act_mod
    return _run_site(site, lambda x: F.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, act),
                     lambda x: fc2(run_act(fc1(x))), x)


def _split_ffns(m):
    """The :class:`_SplitFFN` an earlier convert set on ``m``, by method name."""
    return {k: v for k, v in m.__dict__.items() if isinstance(v, _SplitFFN)}


def _split_ffn_reason(inter, out):
    """Why ``intermediate``/``output`` cannot be one fused FFN (None: they can), ``output``'s
    :class:`_SplitTailForm`, the fused activation and the function activation (None: the intermediate_act_fn
    module)."""
    norm = _split_ffn_norm(_source_lines(out))
    act, fn = _split_ffn_act_fn(inter)
    module_act = fn is getattr(inter, "intermediate_act_fn", None)
    if _foreign_forward(inter) or _foreign_forward(out):
        reason = "a forward set on the instance of intermediate or output: its code is not the class's"
    elif fn is None and act is None:
        reason = f"{_class_of(inter).__name__}.forward is not dense -> intermediate_act_fn (or a known function)"
    elif norm is None or (norm.dropout and not isinstance(getattr(out, "dropout", None), nn.Module)) \
            or (norm.norm and not isinstance(getattr(out, norm.norm, None), nn.Module)):
        reason = f"{_class_of(out).__name__}.forward is not dense -> [dropout] -> [norm](h + input_tensor)"
    elif act is None:
        reason = f"activation {type(fn).__name__ if module_act else fn.__name__} has no fused form"
    elif not (is_linear(getattr(inter, "dense", None)) and is_linear(getattr(out, "dense", None))) \
            or out.dense.in_features != inter.dense.out_features:
        reason = "intermediate.dense/output.dense are not plain nn.Linear of matching shapes"
    elif not _nohooks(inter, out, inter.dense, fn if module_act else None, out.dense):
        reason = "hooks registered on the modules"
    else:
        reason = None
    return reason, norm, act, (None if module_act else fn)


def _split_ffn_layer(ctx, name, m):
    """A BERT-style layer (``_looks_split_ffn_layer``): its FFN, ``intermediate`` then ``output``'s
    dense, as one fused FFN unit named ``<layer>.intermediate``."""
    for key in _split_ffns(m):
        del m.__dict__[key]  # an earlier convert's: planned afresh
    method, arg, pre_norm = _split_ffn_method(m)
    unit = _join(name, "intermediate")
    inter, out = m.intermediate, m.output
    reason, norm, act, act_fn = _split_ffn_reason(inter, out)
    if reason is None and pre_norm is not None and not isinstance(m._modules.get(pre_norm), nn.Module):
        reason = f"{method} applies self.{pre_norm} first, which is not a submodule"
    if method in m.__dict__:
        reason = f"a {method} set on the instance: its code is not the class's"
    if reason is not None:
        ctx.skip(unit, reason)
        return m  # its children are visited as usual: intermediate may still be a fused Linear+act
    site = Site()
    m.__dict__[method] = _SplitFFN(m, method, arg, site, act, norm, (type(m), type(inter), type(out)), pre_norm,
                                   act_fn)
    bind_replicas(m)
    ctx.unit(unit, "ffn", *_site_switches(site), (inter.dense,))
    return m


# DeBERTa, MPNet and a few others make the same two calls inline in their layer's forward:
#     intermediate_output = self.intermediate(attention_output)
#     layer_output = self.output(intermediate_output, attention_output)
# There the two modules become stand-ins that find their layer by its forward's frame (as an
# inlined FFN's do, _calling_layer): intermediate computes the whole FFN and output skips its dense.
class _SplitHead(Wrapper):
    """``intermediate`` of an inline BERT-style layer (same submodules, same keys): called from its
    layer's forward, the whole FFN (dense -> act -> output.dense) fused, and ``output`` told to skip
    its dense; called from anywhere else, or where a hook or a swapped module is in the way, itself."""

    def forward(self, *args, **kwargs):
        layer = _calling_layer(self, "intermediate") if len(args) == 1 and not kwargs else None
        tail = None if layer is None else layer._modules.get("output")
        if isinstance(tail, _SplitTail):
            tail.__dict__["_fusedrc_pass"].arm(False)  # left armed by a layer call that raised half-way
        site = self.sites.get("ffn")
        if layer is None or not isinstance(tail, _SplitTail) or site is None or not site.enabled:
            return self.plain(*args, **kwargs)
        # the layer's class as convert checked its forward (a subclass swapped in may call them otherwise)
        h = None if type(layer) is not self.__dict__["_fusedrc_layer_cls"] else \
            _split_ffn_run(site, self.__dict__["_fusedrc_act"], self, tail, args[0], self.__dict__["_fusedrc_act_fn"])
        if h is None:
            return self.plain(*args, **kwargs)
        tail.__dict__["_fusedrc_pass"].arm()
        return h


class _SplitTail(Wrapper):
    """``output`` of an inline BERT-style layer: after its ``intermediate`` ran the whole FFN, its input
    is the FFN's output already (dropout and norm remain); else itself."""

    def forward(self, *args, **kwargs):
        if len(args) == 2 and not kwargs and _passes_through(self, "output"):
            h, residual = args
            return _split_tail(self, self.__dict__["_fusedrc_norm"], h, residual)
        return self.plain(*args, **kwargs)


def _inline_split_ffn(lines) -> bool:
    """Whether a layer's forward calls ``v = self.intermediate(x)`` then ``self.output(v, x)`` on the next
    line, ``v`` used nowhere else."""
    lines = lines or []
    at = [i for i, ln in enumerate(lines) if "self.intermediate(" in ln]
    if len(at) != 1 or sum("self.output(" in ln for ln in lines) != 1 or at[0] + 1 >= len(lines):
        return False
    first = _re.fullmatch(r"(\w+) = self\.intermediate\((\w+)\)", lines[at[0]])
    if first is None:
        return False
    v, x = first.groups()
    uses = sum(len(_re.findall(rf"\b{v}\b", ln)) for ln in lines)
    return _re.fullmatch(rf"\w+ = self\.output\({v}, {x}\)", lines[at[0] + 1]) is not None and uses == 2


def _looks_inline_split_ffn_layer(m):
    """Found by shape: a module holding ``intermediate`` and ``output`` whose forward calls them in a row
    on one tensor (DeBERTa, MPNet, ...), BERT's ``feed_forward_chunk`` absent."""
    return (_holds_split_ffn(m) and _split_ffn_method(m) is None and not _foreign_forward(m)
            and _inline_split_ffn(_source_lines(m)))


def _inline_split_ffn_layer(ctx, name, m):
    """An inline BERT-style layer (``_looks_inline_split_ffn_layer``): one fused FFN unit named
    ``<layer>.intermediate``, through the :class:`_SplitHead` / :class:`_SplitTail` stand-ins."""
    inter, out = m.intermediate, m.output
    unit = _join(name, "intermediate")
    reason, norm, act, act_fn = _split_ffn_reason(inter, out)
    if reason is not None:
        ctx.skip(unit, reason)
        return m
    head, tail = _SplitHead.wrap(inter), _SplitTail.wrap(out)
    head.__dict__["_fusedrc_layer"], head.__dict__["_fusedrc_act"] = m, act
    head.__dict__["_fusedrc_act_fn"] = act_fn
    head.__dict__["_fusedrc_layer_cls"] = type(m)
    tail.__dict__["_fusedrc_norm"] = norm
    _stand_in(tail, m)
    _site_unit(ctx, head, unit, "ffn", "ffn", (head.dense,))
    return m


@register_rule("T5DenseActDense")
def _t5_dense(ctx, name, m):
    act = _act_name(m.act)
    if act is None:
        ctx.skip(name, f"activation {type(m.act).__name__} has no fused form")
        return m
    if not _static_dropouts_ok([m.dropout]):
        ctx.skip(name, f"{type(m.dropout).__name__} between wi and wo has no fused form")
        return m
    if not (is_linear(m.wi) and is_linear(m.wo)):
        ctx.skip(name, "wi/wo are not plain nn.Linear")
        return m
    new = FusedT5DenseActDense.wrap(m)
    new.__dict__["_fusedrc_act"] = act
    _site_unit(ctx, new, name, "ffn", "ffn", (m.wi,))
    return new


def _gated_unit(ctx, name, m, wrapper, act_key, keys, linear=lambda mod: mod):
    """``m`` wrapped by ``wrapper`` as one fused gated FFN unit, its activation at ``act_key`` and its
    gate/up/down Linears at ``keys`` (``linear``: the Linear the op reads for the module there); ``m`` itself
    (the reason in the plan) where the gated op cannot stand for it: an activation with no fused form, Linears
    that are not plain or do not match."""
    act_mod = getattr(m, act_key)
    act = _act_name(act_mod)
    if act is None:
        ctx.skip(name, f"activation {type(act_mod).__name__} has no fused form")
        return m
    g, u, d = (linear(getattr(m, k)) for k in keys)
    if not (all(is_linear(lin) for lin in (g, u, d)) and g.weight.shape == u.weight.shape
            and d.in_features == g.out_features and (g.bias is None) == (u.bias is None)):
        ctx.skip(name, f"{'/'.join(keys)} are not plain nn.Linear of matching shapes")
        return m
    new = wrapper.wrap(m)
    new.__dict__["_fusedrc_act"] = act
    _site_unit(ctx, new, name, "gated_ffn", "gated_ffn", (g, u))
    return new


@register_rule("T5DenseGatedActDense")
def _t5_dense_gated(ctx, name, m):
    """T5 v1.1 / Flan-T5 / mT5: act(wi_0(x)) * wi_1(x) -> dropout -> wo, the gated FFN."""
    if type(m.dropout) is not nn.Dropout:
        ctx.skip(name, f"{type(m.dropout).__name__} between the gate and wo has no fused form")
        return m
    return _gated_unit(ctx, name, m, FusedT5DenseGatedActDense, "act", ("wi_0", "wi_1", "wo"), linear=_base_linear)


class FusedT5DenseGatedActDense(Wrapper):
    """Hugging Face ``T5DenseGatedActDense`` (T5 v1.1, Flan-T5, mT5: ``wo(dropout(act(wi_0(x)) *
    wi_1(x)))``) as one fused gated FFN, its dropout included (mask regenerated in backward, its own
    stream: equal in distribution to ``nn.Dropout``'s). T5's ``wo`` kept in fp32 beside half
    ``wi_*`` weights (``_keep_in_fp32_modules``) runs the module. PEFT LoRA layers in the Linears' places run
    fused with their adapters, as ``FusedGatedMLP``'s."""

    def _fusedrc_site(self):
        return self.sites.get("gated_ffn")

    def _fusedrc_fusable(self, x):
        site, now = self._fusedrc_site(), [_projection_now(m) for m in (self.wi_0, self.wi_1, self.wo)]
        if site is None or not site.enabled or None in now:
            return False
        g, u, d = (lin for lin, _ in now)
        return (fused_dropout_p(self.dropout) is not None
                and _nohooks(self, self.wi_0, self.wi_1, self.wo, g, u, d, self.act, self.dropout)
                and _still(self.__dict__["_fusedrc_act"], self.act, g, u, d) and _dense_runtime_ok(x, g, u, d))

    def forward(self, hidden_states):
        act = self.__dict__["_fusedrc_act"]

        def fused(x, **norm):
            (g, lg), (u, lu), (d, ld) = (_projection_now(m) for m in (self.wi_0, self.wi_1, self.wo))
            return F.gated_mlp(x, g.weight, g.bias, u.weight, u.bias, d.weight, d.bias, act,
                               dropout_p=fused_dropout_p(self.dropout), lora_gate=lg, lora_up=lu, lora_down=ld,
                               **norm)

        return _with_norm(self, hidden_states, fused, self.plain)


class FusedConv1DMLP(Wrapper):
    """Hugging Face ``GPT2MLP`` and its copies: c_fc -> act -> c_proj -> dropout, the two layers
    ``Conv1D`` (``x @ weight + bias``: the weight held as (in, out)); c_fc -> act -> c_proj run as
    one fused FFN on the weights' transposed views (read through their strides, no copy)."""

    def _fusedrc_site(self):
        return self.sites.get("ffn")

    def _fusedrc_fusable(self, x):
        site, fc, proj = self._fusedrc_site(), self.c_fc, self.c_proj
        return (site is not None and site.enabled and _nohooks(self, fc, self.act, proj)
                and _is_conv1d(fc) and _is_conv1d(proj) and _act_name(self.act) == self.__dict__["_fusedrc_act"]
                and _dense_runtime_ok(x, fc, proj))

    def forward(self, hidden_states):
        fc, proj, act = self.c_fc, self.c_proj, self.__dict__["_fusedrc_act"]
        hidden_states = _with_norm(
            self, hidden_states,
            lambda x, **norm: F.fused_mlp(x, fc.weight.t(), fc.bias, proj.weight.t(), proj.bias, act, **norm),
            lambda x: proj(self.act(fc(x))))
        return self.dropout(hidden_states)


def _looks_conv1d_mlp(m):
    """GPT-2's MLP by its parts, whatever its class's name (OpenAI GPT's is ``MLP``): Conv1D ``c_fc``
    and ``c_proj``, modules ``act`` and ``dropout``; its forward is checked by the rule."""
    return all(isinstance(getattr(m, a, None), nn.Module) for a in ("c_fc", "c_proj", "act", "dropout")) \
        and _is_conv1d(m.c_fc) and _is_conv1d(m.c_proj) and not _class_of(m).__module__.startswith("torch.") \
        and (not isinstance(m, Wrapper) or isinstance(m, FusedConv1DMLP))


@register_rule("GPT2MLP", "ImageGPTMLP", "DecisionTransformerGPT2MLP")
def _conv1d_mlp(ctx, name, m):
    """``dropout(c_proj(act(c_fc(x))))``, in one expression or through local variables (GPT-2's
    one variable reassigned, OpenAI GPT's ``h``/``h2``)."""
    body = _forward_lines(ctx, name, m)
    if body is None:
        return m
    v = _forward_arg(body)
    if v is None or _inlined_return(body) != f"self.dropout(self.c_proj(self.act(self.c_fc({v}))))":
        ctx.skip(name, f"{_class_of(m).__name__}.forward is not c_fc -> act -> c_proj -> dropout")
        return m
    act = _act_name(m.act)
    if act is None:
        ctx.skip(name, f"activation {type(m.act).__name__} has no fused form")
        return m
    if not all(_is_conv1d(c) and c.bias is not None for c in (m.c_fc, m.c_proj)):
        ctx.skip(name, "c_fc/c_proj are not transformers' Conv1D (x @ weight + bias)")
        return m
    new = FusedConv1DMLP.wrap(m)
    new.__dict__["_fusedrc_act"] = act
    _site_unit(ctx, new, name, "ffn", "ffn", (m.c_fc,))
    return new


class FusedPreDropoutMLP(Wrapper):
    """Hugging Face's SAM 3 MLPs (``Sam3MLP``, ``Sam3LiteTextMLP``): ``fc2(activation_fn(dropout(fc1(x))))``, the
    dropout before the activation. One fused FFN while that dropout does nothing (p = 0, SAM 3's default
    ``hidden_dropout``, or eval mode); a dropout that acts there runs the module's forward (the op's dropout
    comes after the activation: the same only for a ReLU)."""

    def _fusedrc_site(self):
        return self.sites.get("ffn")

    def _fusedrc_fusable(self, x):
        site, fc1, fc2, act = self._fusedrc_site(), self.fc1, self.fc2, self.__dict__["_fusedrc_act"]
        return (site is not None and site.enabled and fused_dropout_p(self.dropout) == 0.0
                and _nohooks(self, fc1, self.dropout, self.activation_fn, fc2)
                and _still(act, self.activation_fn, fc1, fc2) and _dense_runtime_ok(x, fc1, fc2))

    def forward(self, *args, **kwargs):
        x = _only_input(self, args, kwargs)
        if x is None:
            return self.plain(*args, **kwargs)
        fc1, fc2, act = self.fc1, self.fc2, self.__dict__["_fusedrc_act"]
        return _with_norm(self, x, lambda x, **norm: F.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, act,
                                                                 **norm), self.plain)


@register_rule("Sam3MLP", "Sam3LiteTextMLP")
def _pre_dropout_mlp(ctx, name, m):
    """SAM 3's MLPs, their forward checked (fc1 -> dropout -> activation_fn -> fc2 on one variable)."""
    body = _forward_lines(ctx, name, m)
    if body is None:
        return m
    v = _forward_arg(body)
    if v is None or _inlined_return(body) != f"self.fc2(self.activation_fn(self.dropout(self.fc1({v}))))":
        ctx.skip(name, f"{_class_of(m).__name__}.forward is not fc1 -> dropout -> activation_fn -> fc2")
        return m
    act = _act_name(getattr(m, "activation_fn", None))
    if act is None:
        ctx.skip(name, f"activation {type(getattr(m, 'activation_fn', None)).__name__} has no fused form")
        return m
    if not (all(is_linear(m._modules.get(k)) for k in ("fc1", "fc2")) and type(m._modules.get("dropout")) is nn.Dropout
            and m.fc2.in_features == m.fc1.out_features):
        ctx.skip(name, "fc1/fc2 are not Linears of one hidden width, or dropout is not an nn.Dropout")
        return m
    new = FusedPreDropoutMLP.wrap(m)
    new.__dict__["_fusedrc_act"], new.__dict__["_fusedrc_arg"] = act, v
    _site_unit(ctx, new, name, "ffn", "ffn", (m.fc1,))
    return new


def _bound_by_names(names, args, kwargs):
    """A call's arguments by a forward's own parameter ``names`` (positional first), or None where it would not bind
    them so: more positionals than names, a keyword that is no name or names one already given."""
    if len(args) > len(names):
        return None
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names or k in bound:
            return None
        bound[k] = v
    return bound


class FusedMixFFN(Wrapper):
    """SegFormer's Mix-FFN, ``fc1 -> depthwise conv over the token grid -> act -> dropout -> fc2 -> dropout``
    (Hugging Face's ``SegformerMixMLP`` / ``SegformerMixFFN``, ``GLPNMixFFN``, ``PvtV2ConvFeedForwardNetwork``
    with its ``relu``, an ``nn.ReLU`` in its linear variant; timm's PVT-v2 ``MlpWithDepthwiseConv``) as one fused op
    (:func:`fusedrc.functional.mix_ffn`), the dropout after the activation inside it (its own mask stream,
    as the FFN's), the one after fc2 the module's. Neither the conv's output nor the activation is kept.
    A call the op does not model (a module swapped or hooked, another dropout, a token count other than
    height x width) runs the module's forward."""

    def _fusedrc_parts(self):
        keys = self.__dict__["_fusedrc_keys"]
        mods = {k: (self._modules.get(v) if v else None) for k, v in keys.items() if k != "conv"}
        dw = mods["dw"]
        mods["conv"] = dw._modules.get(keys["conv"]) if keys["conv"] and dw is not None else dw
        return mods

    def _fusedrc_size(self, args, kwargs):
        """(x, height, width) of a call by the forward's own argument names, or None."""
        names = self.__dict__["_fusedrc_args"]
        bound = _bound_by_names(names, args, kwargs) if len(args) + len(kwargs) == len(names) else None
        if bound is None:
            return None
        if len(names) == 2:  # timm's (x, feat_size)
            size = bound[names[1]]
            if not isinstance(size, (list, tuple)) or len(size) != 2:
                return None
            return bound[names[0]], size[0], size[1]
        return tuple(bound[n] for n in names)

    def forward(self, *args, **kwargs):
        call = self._fusedrc_size(args, kwargs)
        site = self.sites.get("mix_ffn")
        if call is None or site is None or not site.enabled:
            return self.plain(*args, **kwargs)
        x, height, width = call
        m = self._fusedrc_parts()
        fc1, conv, fc2, drop = m["fc1"], m["conv"], m["fc2"], m["drop"]
        p = fused_dropout_p(drop)
        if (p is None or not all(type(v) is int and v > 0 for v in (height, width))
                or not _still(self.__dict__["_fusedrc_act"], m["act"], fc1, fc2)
                or not is_same_depthwise(conv, fc1.out_features) or type(m["dw"]) is not self.__dict__["_fusedrc_dw"]
                or type(m["relu"]) not in (type(None), nn.Identity, nn.ReLU)
                or not _nohooks(self, *m.values()) or not _dense_runtime_ok(x, fc1, fc2)
                or conv.weight.dtype != fc1.weight.dtype or x.dim() != 3 or x.shape[1] != height * width):
            return self.plain(*args, **kwargs)

        def fused(x):
            return drop(F.mix_ffn(x, height, width, fc1.weight, fc1.bias, conv.weight, conv.bias, fc2.weight,
                                  fc2.bias, self.__dict__["_fusedrc_act"], p, relu_first=type(m["relu"]) is nn.ReLU))

        return _run_site(site, fused, lambda x: self.plain(*args, **kwargs), x)


# Hugging Face's Mix-FFN forward, inlined (_inlined_return), for arguments v, h, w: the dropout's, fc2's, the
# activation's, the depthwise conv module's, [PVT-v2's relu's,] fc1's keys
_HF_MIX_FFN = (r"self\.(?P<drop>\w+)\(self\.(?P<fc2>\w+)\(self\.(?P=drop)\(self\.(?P<act>\w+)\(self\.(?P<dw>\w+)\("
               r"(?:self\.(?P<relu>\w+)\()?self\.(?P<fc1>\w+)\({v}\)(?(relu)\)), {h}, {w}\)\)\)\)\)")
# its depthwise conv module's forward after the def line (arguments v, h, w; the conv's key)
_HF_DWCONV = ["batch_size, seq_len, num_channels = {v}.shape",
              "{v} = {v}.transpose(1, 2).view(batch_size, num_channels, {h}, {w})",
              "{v} = self.{conv}({v})", "{v} = {v}.flatten(2).transpose(1, 2)", "return {v}"]
# timm's MlpWithDepthwiseConv.forward after the def line (arguments v, s)
_TIMM_MIX_FFN = ["{v} = self.fc1({v})", "B, N, C = {v}.shape", "{v} = {v}.transpose(1, 2).view(B, C, {s}[0], {s}[1])",
                 "{v} = self.relu({v})", "{v} = self.dwconv({v})", "{v} = {v}.flatten(2).transpose(1, 2)",
                 "{v} = self.act({v})", "{v} = self.drop({v})", "{v} = self.fc2({v})", "{v} = self.drop({v})",
                 "return {v}"]


def _hf_mix_ffn_keys(m, lines, args):
    """The module keys of a Hugging Face Mix-FFN whose forward (and its conv module's) has the checked form,
    else None."""
    if args is None or len(args) != 3:
        return None
    expr = _inlined_return(lines)
    form = None if expr is None else _re.fullmatch(_HF_MIX_FFN.format(**{k: _re.escape(a) for k, a in
                                                                       zip("vhw", args)}), expr)
    if form is None:
        return None
    keys = form.groupdict()
    dw_lines = _source_lines(m._modules.get(keys["dw"])) if isinstance(m._modules.get(keys["dw"]), nn.Module) else None
    dw_args = _forward_args(dw_lines)
    if dw_args is None or len(dw_args) != 3 or len(dw_lines) != 6:
        return None
    conv = _re.fullmatch(r"\w+ = self\.(\w+)\(\w+\)", dw_lines[3])
    v, h, w = dw_args
    if conv is None or dw_lines[1:] != [t.format(v=v, h=h, w=w, conv=conv.group(1)) for t in _HF_DWCONV]:
        return None
    return dict(keys, conv=conv.group(1))


@register_rule("SegformerMixMLP", "SegformerMixFFN", "GLPNMixFFN", "PvtV2ConvFeedForwardNetwork",
               "MlpWithDepthwiseConv")
def _mix_ffn(ctx, name, m):
    """SegFormer's Mix-FFN in Hugging Face's classes and timm's PVT-v2, their forwards checked."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    args = _forward_args(lines)
    if args is not None and len(args) == 2 and lines[1:] == [t.format(v=args[0], s=args[1]) for t in _TIMM_MIX_FFN]:
        keys = dict(fc1="fc1", relu="relu", dw="dwconv", conv=None, act="act", drop="drop", fc2="fc2")
    else:
        keys = _hf_mix_ffn_keys(m, lines, args)
    if keys is None:
        ctx.skip(name, f"{_class_of(m).__name__}.forward is not fc1 -> depthwise conv over (height, width) -> act "
                       "-> dropout -> fc2 -> dropout")
        return m
    fc1, fc2, act, relu, drop, dw = (m._modules.get(keys[k]) if keys[k] else None
                                     for k in ("fc1", "fc2", "act", "relu", "drop", "dw"))
    conv = dw._modules.get(keys["conv"]) if keys["conv"] and isinstance(dw, nn.Module) else dw
    if not (is_linear(fc1) and is_linear(fc2) and fc2.in_features == fc1.out_features):
        reason = "fc1/fc2 are not nn.Linears of one hidden width"
    elif not is_same_depthwise(conv, fc1.out_features):
        reason = "the conv is not a depthwise 'same' nn.Conv2d (odd square kernel, stride 1) over fc1's features"
    elif type(relu) not in (type(None), nn.Identity, nn.ReLU):
        reason = f"a {type(relu).__name__} between fc1 and the depthwise conv has no fused form"
    elif _act_name(act) is None:
        reason = f"activation {type(act).__name__} has no fused form"
    elif fused_dropout_p(drop, training=True) is None:
        reason = f"{type(drop).__name__} after the activation has no fused form"
    elif not _nohooks(fc1, fc2, act, relu, drop, dw, conv):
        reason = "hooks registered on the modules"
    else:
        reason = None
    new = _wrapped_unit(ctx, name, m, reason, FusedMixFFN, _act_name(act), "mix_ffn", "mix_ffn", (fc1, conv))
    if reason is None:
        new.__dict__.update(_fusedrc_keys=keys, _fusedrc_args=tuple(args), _fusedrc_dw=type(dw))
    return new


class FusedXIELUMLP(Wrapper):
    """Apertus's MLP, ``down_proj(act_fn(up_proj(x)))`` with Hugging Face's ``XIELUActivation`` (learned alphas), as
    one fused op (:func:`fusedrc.functional.xielu_mlp`): the alphas as the module computes them at each call,
    ``softplus(alpha_p)`` and ``beta + softplus(alpha_n)``, so they train through the op; beta and eps read at
    convert time (buffers, constant). A module swapped or hooked runs the module's forward."""

    def forward(self, *args, **kwargs):
        x = _only_input(self, args, kwargs)
        site, up, down, act = self.sites.get("ffn"), self.up_proj, self.down_proj, self.act_fn
        if (x is None or site is None or not site.enabled or not (is_linear(up) and is_linear(down))
                or type(act) is not self.__dict__["_fusedrc_act_class"] or not _nohooks(self, up, down, act)
                or not _dense_runtime_ok(x, up, down) or act.alpha_p.device != x.device):
            return self.plain(*args, **kwargs)
        beta, eps = self.__dict__["_fusedrc_consts"]

        def fused(x):
            softplus = torch.nn.functional.softplus
            return F.xielu_mlp(x, up.weight, up.bias, down.weight, down.bias, softplus(act.alpha_p),
                               act.beta + softplus(act.alpha_n), beta, eps)

        return _run_site(site, fused, self.plain, x)


# XIELUActivation._xielu_python's lines after its def (transformers 4.56 to 5.25): what the op computes
_XIELU_LINES = ["alpha_p = nn.functional.softplus(self.alpha_p)",
                "alpha_n = self.beta + nn.functional.softplus(self.alpha_n)",
                "return torch.where(", "x > 0,", "alpha_p * x * x + self.beta * x,",
                "(torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x,", ")"]


@register_rule("ApertusMLP", "Apertus1p5TextMLP")
def _xielu_mlp(ctx, name, m):
    """Apertus's MLPs, their forward and the activation's formula checked."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    v = _forward_arg(lines)
    act = m._modules.get("act_fn")
    if v is None or _inlined_return(lines) != f"self.down_proj(self.act_fn(self.up_proj({v})))":
        reason = f"{_class_of(m).__name__}.forward is not down_proj(act_fn(up_proj(x)))"
    elif not (is_linear(m._modules.get("up_proj")) and is_linear(m._modules.get("down_proj"))
              and m.down_proj.in_features == m.up_proj.out_features):
        reason = "up_proj/down_proj are not nn.Linears of one hidden width"
    elif type(act).__name__ != "XIELUActivation":
        # another activation: Llama-style MLPs without a gate are torch.fx's (it traces them)
        reason = f"activation {type(act).__name__} is not xIELU (the fx pass fuses the others)"
    elif (_source_lines(act, "_xielu_python") or [])[1:] != _XIELU_LINES:
        reason = "XIELUActivation._xielu_python is not the xIELU formula fusedrc computes"
    elif not all(isinstance(getattr(act, a, None), torch.Tensor) and getattr(act, a).numel() == 1
                 for a in ("alpha_p", "alpha_n", "beta", "eps")):
        reason = "xIELU's alpha_p, alpha_n, beta and eps are not one-element tensors"
    else:
        reason = None
    new = _wrapped_unit(ctx, name, m, reason, FusedXIELUMLP, None, "ffn", "ffn", (m._modules.get("up_proj"),))
    if reason is None:
        new.__dict__.update(_fusedrc_arg=v, _fusedrc_act_class=type(act), _fusedrc_consts=_xielu_consts(act))
    return new


def _xielu_consts(act):
    """(beta, eps) of an XIELUActivation as its python path uses them (its buffers' values); on the meta device
    (no values) the scalars it keeps beside them."""
    if act.beta.device.type == "meta" or act.eps.device.type == "meta":
        return float(act._beta_scalar), float(act._eps_scalar)
    return float(act.beta), float(act.eps)


class FusedRwkvFeedForward(Wrapper):
    """Hugging Face's RWKV channel mix, ``RwkvFeedForward``: its ``key -> relu^2 -> value`` as one fused FFN
    (:func:`fusedrc.functional.fused_mlp`, activation "relu2"), which keeps only the mixed key for backward,
    not the two hidden-sized tensors (the ReLU's output and its square) autograd keeps; the time shift and the
    mixing, the receptance gate and the ``state`` (read, and written in place) are the module's forward, line
    for line (``_RWKV_FFN``). A call the op does not model runs the module's forward: hooks on the module or
    its key/value (or either marked with :func:`fusedrc.mark`), a key/value that is no longer a plain Linear;
    a mixed key of a dtype or device the op does not take runs the module's own key -> relu^2 -> value lines."""

    def _fusedrc_call(self, args, kwargs):
        """``(hidden, state)`` of a call by the forward's own argument names (state defaulting to None), or None
        for a call the forward would not bind (which it takes as it is, raising its own error)."""
        names = self.__dict__["_fusedrc_args"]
        bound = _bound_by_names(names, args, kwargs)
        return (bound[names[0]], bound.get(names[1])) if bound is not None and names[0] in bound else None

    def forward(self, *args, **kwargs):
        call = self._fusedrc_call(args, kwargs)
        site, k, v = self.sites.get("ffn"), self._modules.get("key"), self._modules.get("value")
        if (call is None or site is None or not site.enabled or not (is_linear(k) and is_linear(v))
                or not _nohooks(self) or not _free(k, v)):
            return self.plain(*args, **kwargs)
        hidden, state = call

        def chain(key):  # the module's lines
            key = torch.square(torch.relu(k(key)))
            return v(key)

        # RwkvFeedForward.forward (as in transformers 5.25), its key -> relu^2 -> value through the fused op
        if hidden.size(1) == 1 and state is not None:
            shifted = state[0][:, :, self.layer_id]
        else:
            shifted = self.time_shift(hidden)
            if state is not None:
                shifted[:, 0] = state[0][:, :, self.layer_id]
        key = hidden * self.time_mix_key + shifted * (1 - self.time_mix_key)
        receptance = hidden * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)

        if _dense_runtime_ok(key, k, v) and k.out_features == v.in_features:
            act = self.__dict__["_fusedrc_act"]
            value = _run_site(site, lambda x: F.fused_mlp(x, k.weight, k.bias, v.weight, v.bias, act), chain, key)
        else:
            value = chain(key)
        receptance = torch.sigmoid(self.receptance(receptance))

        if state is not None:
            state[0][:, :, self.layer_id] = hidden[:, -1]

        return receptance * value, state


# RwkvFeedForward.forward (as in transformers 5.25) for arguments h, s: what FusedRwkvFeedForward computes,
# compared as syntax trees (the nesting of its branches included; annotations and a docstring aside)
_RWKV_FFN = """\
def forward(self, {h}, {s}=None):
    if {h}.size(1) == 1 and {s} is not None:
        shifted = {s}[0][:, :, self.layer_id]
    else:
        shifted = self.time_shift({h})
        if {s} is not None:
            shifted[:, 0] = {s}[0][:, :, self.layer_id]
    key = {h} * self.time_mix_key + shifted * (1 - self.time_mix_key)
    receptance = {h} * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)
    key = torch.square(torch.relu(self.key(key)))
    value = self.value(key)
    receptance = torch.sigmoid(self.receptance(receptance))
    if {s} is not None:
        {s}[0][:, :, self.layer_id] = {h}[:, -1]
    return receptance * value, {s}
"""


# every name the forward uses besides its two arguments' (self, torch, its locals)
_RWKV_FFN_NAMES = frozenset(n.id for n in _ast.walk(_ast.parse(_RWKV_FFN.format(h="_h", s="_s")))
                            if isinstance(n, _ast.Name)) - {"_h", "_s"}


def _function_tree(fn):
    """``fn``'s definition as a syntax tree without annotations or a leading docstring, or None where its source
    cannot be read or is not one plain ``def``."""
    try:
        tree = _ast.parse(_textwrap.dedent(_inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    node = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(node, _ast.FunctionDef) or node.decorator_list:
        return None
    a = node.args
    for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
        if p is not None:
            p.annotation = None
    node.returns = None
    body = node.body
    if len(body) > 1 and isinstance(body[0], _ast.Expr) and isinstance(body[0].value, _ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:]
    return node


def _is_template(fn, template, **names):
    """Whether the syntax tree ``fn`` (``_function_tree``'s) is ``template`` with ``names`` filled in, whatever name
    its function was defined under."""
    fn.name = "forward"
    return _ast.dump(fn) == _ast.dump(_ast.parse(template.format(**names)).body[0])


def _rwkv_ffn_args(m):
    """The argument names ``(hidden, state)`` of ``m``'s forward where it is ``_RWKV_FFN``, else None."""
    fn = _function_tree(getattr(_class_of(m), "forward", None))
    if fn is None or [p.arg for p in fn.args.args[:1]] != ["self"] or len(fn.args.args) != 3:
        return None
    h, s = (p.arg for p in fn.args.args[1:])
    if h == s or {h, s} & _RWKV_FFN_NAMES:  # an argument named as a local would be rebound by the body
        return None
    return (h, s) if _is_template(fn, _RWKV_FFN, h=h, s=s) else None


@register_rule("RwkvFeedForward")
def _rwkv_feed_forward(ctx, name, m):
    """RWKV's channel mix: its key -> relu^2 -> value one fused FFN, the rest of its forward (checked) as it is."""
    if _forward_lines(ctx, name, m) is None:
        return m
    args = _rwkv_ffn_args(m)
    key, value = m._modules.get("key"), m._modules.get("value")
    if args is None:
        reason = (f"{_class_of(m).__name__}.forward is not transformers' RWKV channel mix (time shift and mixing, "
                  "value(square(relu(key(k)))), sigmoid(receptance(r)) gate, state)")
    elif not (is_linear(key) and is_linear(value) and value.in_features == key.out_features):
        reason = "key/value are not nn.Linears of one hidden width"
    elif not _nohooks(key, value):
        reason = "hooks registered on the modules"
    else:
        reason = None
    new = _wrapped_unit(ctx, name, m, reason, FusedRwkvFeedForward, "relu2", "ffn", "ffn", (key,))
    if reason is None:
        new.__dict__["_fusedrc_args"] = args
    return new


class FusedTFPaddedConvLayer(Wrapper):
    """Hugging Face's MobileNet V1/V2 conv layers (``MobileNetV1ConvLayer``, ``MobileNetV2ConvLayer``): TensorFlow's
    'SAME' padding of the input where ``config.tf_padding`` (the model module's own ``apply_tf_padding``, as the
    layer calls it), then convolution -> BatchNorm2d [-> activation] as one fused Conv-BN[-act] unit (depthwise
    convolutions too: the op's grouped path). The fused op keeps the padded input, as the conv did."""

    def forward(self, *args, **kwargs):
        x = _only_input(self, args, kwargs)
        if x is None:
            return self.plain(*args, **kwargs)
        if self.config.tf_padding:
            x = self.__dict__["_fusedrc_pad"](x, self.convolution)
        return _cbr(self.sites.get("conv"), self.convolution, self.normalization, self.activation, x)


# MobileNetV1ConvLayer.forward's and MobileNetV2ConvLayer.forward's lines (transformers 4.x to 5.25)
_TF_PADDED_CONV_LINES = [
    "if self.config.tf_padding:", "features = apply_tf_padding(features, self.convolution)",
    "features = self.convolution(features)", "if self.normalization is not None:",
    "features = self.normalization(features)", "if self.activation is not None:",
    "features = self.activation(features)", "return features"]


@register_rule("MobileNetV1ConvLayer", "MobileNetV2ConvLayer")
def _tf_padded_conv_layer(ctx, name, m):
    """Hugging Face's MobileNet conv layers, their forward checked line by line."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    pad = getattr(_sys.modules.get(_class_of(m).__module__), "apply_tf_padding", None)
    conv, bn, act = (m._modules.get(k) for k in ("convolution", "normalization", "activation"))
    if _forward_arg(lines) != "features" or lines[1:] != _TF_PADDED_CONV_LINES or not callable(pad):
        reason = (f"{_class_of(m).__name__}.forward is not [tf padding] -> convolution -> [normalization] -> "
                  "[activation]")
    elif bn is None:
        reason = "no normalization after the convolution: nothing to fuse"
    elif getattr(getattr(m, "config", None), "tf_padding", None) not in (True, False):
        reason = "config.tf_padding is not a bool"
    elif conv is not None and m.config.tf_padding and tuple(getattr(conv, "padding", ())) != (0, 0):
        reason = "a padded convolution after the tf padding"
    else:
        reason = _static_cbr(conv, bn, act) if isinstance(conv, nn.Module) else "no convolution module"
        if reason is None and not _nohooks(conv, bn, act):
            reason = "hooks registered on the modules"
    kind = _cbr_kind(act) if reason is None else None
    new = _wrapped_unit(ctx, name, m, reason, FusedTFPaddedConvLayer, _act_name(act) if act is not None else None,
                        "conv", kind, (conv,))
    if reason is None:
        new.__dict__["_fusedrc_pad"], new.__dict__["_fusedrc_arg"] = pad, "features"
    return new


class FusedLinearBN(Wrapper):
    """LeViT's Linear -> BatchNorm1d over the flattened tokens, ``bn(linear(x).flatten(0, 1)).reshape_as(...)``
    (Hugging Face's ``MLPLayerWithBN``, timm's ``LinearNorm``: every projection of the model), as the fused
    Conv-BN op on the ``(B * N, C, 1, 1)`` view of the tokens: a Linear is a 1x1 convolution, and BatchNorm1d
    over the rows is BatchNorm2d over those images. It keeps the input and the per-channel statistics, not the
    Linear's output; the running statistics are updated once, as the module does. A call of another rank
    than 3 (where the module's flatten(0, 1) feeds BatchNorm1d something else) runs the module."""

    def forward(self, *args, **kwargs):
        x = _only_input(self, args, kwargs)
        if x is None:
            return self.plain(*args, **kwargs)
        return self._fusedrc_call(x, None, self.plain)

    def _fusedrc_call(self, x, activation, plain):
        """``activation`` (None: none) of the module's output, fused where the unit is on and the call modelled,
        else ``plain(x)`` (LeViT's MLP hands its activation in: :class:`FusedLevitMLP`)."""
        lin_key, bn_key = self.__dict__["_fusedrc_keys"]
        site, lin, bn = self.sites.get("linear_bn"), self._modules.get(lin_key), self._modules.get(bn_key)
        if (site is None or not site.enabled or _static_linear_bn(lin, bn) is not None
                or not _nohooks(self, lin, bn) or x.dim() != 3 or not x.is_floating_point()
                or x.device != lin.weight.device or (x.dtype != lin.weight.dtype
                                                     and not torch.is_autocast_enabled(x.device.type))):
            return plain(x)
        return _run_site(site, lambda x: _linear_bn_call(lin, bn, x, activation), plain, x)


class FusedLevitMLP(Wrapper):
    """LeViT's MLP, Linear-BN -> activation [-> a dropout that does nothing] -> Linear-BN (Hugging Face's
    ``LevitMLPLayer``, timm's ``LevitMlp``): the first Linear-BN unit runs the activation in its fused op, so the
    BatchNorm's output (the activation's input) is never kept; the second is its own unit. Where the first is no
    longer the fused Linear-BN convert made, another activation is in place, a hook is on the activation or the
    dropout acts, the module's forward runs."""

    def forward(self, *args, **kwargs):
        x = _only_input(self, args, kwargs)
        up_key, act_key, drop_key, down_key = self.__dict__["_fusedrc_keys"]
        up, act, down = (self._modules.get(k) for k in (up_key, act_key, down_key))
        drop = self._modules.get(drop_key) if drop_key else None
        name = self.__dict__["_fusedrc_act"]
        if (x is None or not isinstance(up, FusedLinearBN) or _act_name(act) != name or not _nohooks(self, act, drop)
                or (drop_key and fused_dropout_p(drop) != 0.0)):
            return self.plain(*args, **kwargs)
        return down(up._fusedrc_call(x, name, lambda x: act(up.plain(x))))


# LeViT's MLP forwards, inlined: (Linear-BN, activation, dropout or None, Linear-BN) keys
_LEVIT_MLPS = {"self.linear_down(self.activation(self.linear_up({v})))": ("linear_up", "activation", None,
                                                                           "linear_down"),
               "self.ln2(self.drop(self.act(self.ln1({v}))))": ("ln1", "act", "drop", "ln2")}


@register_rule("LevitMLPLayer", "LevitMlp")
def _levit_mlp(ctx, name, m):
    """LeViT's MLPs (Hugging Face's and timm's), their forward checked: the activation into the first Linear-BN's
    fused op (the two Linear-BN modules become units as every LeViT Linear-BN does)."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    v = _forward_arg(lines)
    keys = None if v is None else next((k for e, k in _LEVIT_MLPS.items() if _inlined_return(lines) == e.format(v=v)),
                                       None)
    if keys is None:
        ctx.skip(name, f"{_class_of(m).__name__}.forward is not Linear-BN -> activation -> [dropout] -> Linear-BN")
        return m
    up, act, drop, down = (m._modules.get(k) if k else None for k in keys)
    if not all(_class_of(c).__name__ in ("MLPLayerWithBN", "LinearNorm") for c in (up, down)):
        reason = "its Linear-BN modules are not LeViT's (timm's use_conv: Conv-BN units)"
    elif _act_name(act) is None:
        reason = f"activation {type(act).__name__} has no fused form"
    elif drop is not None and type(drop) is not nn.Dropout:
        reason = f"{type(drop).__name__} after the activation has no fused form"
    else:
        reason = None
    if reason is not None:
        ctx.skip(name, reason)
        return m
    new = FusedLevitMLP.wrap(m)
    new.__dict__.update(_fusedrc_keys=keys, _fusedrc_act=_act_name(act), _fusedrc_arg=v)
    return new


def _linear_bn_call(lin, bn, x, activation=None):
    """``act(bn(lin(x).flatten(0, 1)).reshape_as(lin(x)))`` (None: no act) through the fused Conv-BN op (views of x
    and the weight: no copy kept), with the BatchNorm's bookkeeping once."""
    training, factor, rm, rv, counted = _bn_call(bn)
    try:
        y = F.conv_bn_act(x.reshape(-1, x.shape[-1], 1, 1), lin.weight[:, :, None, None], bn.weight, bn.bias, rm, rv,
                          training=training, momentum=factor, eps=bn.eps, bias=lin.bias, activation=activation)
    except Exception:
        _uncount(bn, counted)
        raise
    return y.reshape(*x.shape[:-1], lin.out_features)


def _static_linear_bn(lin, bn):
    """Why ``lin`` -> ``bn`` over the flattened tokens is no fused Conv-BN unit (None: it is)."""
    if not is_linear(lin):
        return "the projection is not a plain nn.Linear"
    if type(bn) is not nn.BatchNorm1d or bn.num_features != lin.out_features:
        return "the norm is not an nn.BatchNorm1d over the Linear's features"
    return None


# LeViT's Linear-BN forward, inlined (_inlined_return): group 1 the BatchNorm's key, group 2 the Linear's
_LINEAR_BN = r"self\.(\w+)\(self\.(\w+)\({v}\)\.flatten\(0, 1\)\)\.reshape_as\(self\.\2\({v}\)\)"


@register_rule("MLPLayerWithBN", "LinearNorm")
def _linear_bn(ctx, name, m):
    """LeViT's Linear-BN modules (Hugging Face's and timm's), their forward checked."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    v = _forward_arg(lines)
    expr = None if v is None else _inlined_return(lines)
    form = None if expr is None else _re.fullmatch(_LINEAR_BN.format(v=_re.escape(v)), expr)
    if form is None:
        reason = f"{_class_of(m).__name__}.forward is not bn(linear(x).flatten(0, 1)).reshape_as(linear(x))"
    else:
        lin, bn = m._modules.get(form.group(2)), m._modules.get(form.group(1))
        reason = _static_linear_bn(lin, bn)
        if reason is None and not _nohooks(lin, bn):
            reason = "hooks registered on the modules"
    new = _wrapped_unit(ctx, name, m, reason, FusedLinearBN, None, "linear_bn", "linear_bn",
                        (lin,) if reason is None else ())
    if reason is None:
        new.__dict__["_fusedrc_keys"], new.__dict__["_fusedrc_arg"] = (form.group(2), form.group(1)), v
    return new


def _only_input(wrapper, args, kwargs):
    """A wrapped MLP's one input, by position or by its forward's own argument name (not always ``x``),
    or None for any other call (which the original forward takes as it is)."""
    if len(args) + len(kwargs) != 1 or (kwargs and next(iter(kwargs)) != wrapper.__dict__["_fusedrc_arg"]):
        return None
    return args[0] if args else next(iter(kwargs.values()))


# Gemma 4's ClippableLinear.forward (transformers 5.x; DiffusionGemma's copy) for argument h, compared as syntax
# trees: its ``linear`` alone where ``use_clipped_linears`` is false; where it is true, the Linear's input and output
# clamped to bounds held in four buffers (no fused form)
_CLIPPABLE_LINEAR = """\
def forward(self, {h}):
    if self.use_clipped_linears:
        {h} = torch.clamp({h}, self.input_min, self.input_max)
    {h} = self.linear({h})
    if self.use_clipped_linears:
        {h} = torch.clamp({h}, self.output_min, self.output_max)
    return {h}
"""
_CLIPPABLE_CHECKED = {}  # (class, its forward's code) -> whether that forward is _CLIPPABLE_LINEAR


def _is_clippable(m):
    """Whether ``m``'s class's forward is Gemma 4's ClippableLinear's (its code checked once per class and code)."""
    cls = type(m)
    key = (cls, _forward_code(cls))
    ok = _CLIPPABLE_CHECKED.get(key)
    if ok is None:
        fn = _function_tree(getattr(cls, "forward", None))
        ok = fn is not None and len(fn.args.args) == 2 and fn.args.args[1].arg != "self"
        if ok:
            ok = _is_template(fn, _CLIPPABLE_LINEAR, h=fn.args.args[1].arg)
        _CLIPPABLE_CHECKED[key] = ok
    return ok


def _is_lora_linear(m):
    """A PEFT LoRA layer around a plain ``nn.Linear`` (``peft.tuners.lora.layer.Linear``, known by name: fusedrc
    imports no model library; its quantized and other variants are other classes)."""
    t = type(m)
    return t.__name__ == "Linear" and t.__module__ == "peft.tuners.lora.layer" \
        and is_linear(m._modules.get("base_layer")) and isinstance(m._modules.get("lora_A"), nn.ModuleDict)


def _lora_now(m):
    """``(base Linear, adapter)`` that calling PEFT LoRA layer ``m`` amounts to now, its forward's branches read
    as it reads them: adapter None where no adapter acts (adapters disabled, merged into the base weight, none
    active), else ``(A, B, scaling, dropout_p)`` for ``gated_mlp`` (its LoRA dropout's p now: 0 in eval mode;
    several active adapters without dropout stacked along the rank: the sum of their terms). None where the call
    is more than that: a merged layer with adapters disabled (its forward unmerges), a LoRA variant (DoRA, ...),
    a dropout that is no ``nn.Dropout``, several adapters of which one drops, biases or hooks on the adapters,
    Conv1D's transposed weights."""
    base = m._modules["base_layer"]
    if m.disable_adapters:
        return None if m.merged else (base, None)
    if m.merged:
        return base, None
    if getattr(m, "fan_in_fan_out", False):
        return None
    variants, terms = getattr(m, "lora_variant", {}), []
    for key in m.active_adapters:
        if key not in m.lora_A:
            continue
        a, b, drop, scaling = m.lora_A[key], m.lora_B[key], m.lora_dropout[key], m.scaling[key]
        p = fused_dropout_p(drop)
        if (key in variants or not (is_linear(a) and is_linear(b)) or a.bias is not None or b.bias is not None
                or p is None or not _nohooks(a, b, drop)
                or isinstance(scaling, bool) or not isinstance(scaling, numbers.Real)):
            return None
        terms.append((a.weight, b.weight, float(scaling), p))
    if len(terms) <= 1:
        return base, terms[0] if terms else None
    if any(t[3] for t in terms):  # each adapter its own mask: no one stacked term
        return None
    return base, (torch.cat([t[0] for t in terms]), torch.cat([t[1] * t[2] for t in terms], 1), 1.0, 0.0)


def _base_linear(m):
    """What convert checks of a projection: a PEFT LoRA layer's base Linear, else the module itself."""
    return m._modules["base_layer"] if _is_lora_linear(m) else m


def _projection_now(m):
    """``(plain nn.Linear, LoRA adapter or None)`` that calling projection ``m`` amounts to now (``_inner_linear``,
    ``_lora_now``), or None."""
    if _is_lora_linear(m):
        return _lora_now(m) if _nohooks(m) else None
    lin = _inner_linear(m)
    return None if lin is None else (lin, None)


def _inner_linear(m):
    """The plain ``nn.Linear`` that calling ``m`` amounts to now: ``m`` itself, or the ``linear`` of a Gemma 4
    ClippableLinear while its ``use_clipped_linears`` is False (read now); else None (a clipping one, another
    module). A PEFT LoRA layer's base is not: the layer adds its adapters (``_projection_now``)."""
    if is_linear(m):
        return m
    if not isinstance(m, nn.Module) or getattr(m, "use_clipped_linears", None) is not False:
        return None
    inner = m._modules.get("linear")
    return inner if is_linear(inner) and _is_clippable(m) else None


class FusedGatedMLP(Wrapper):
    """A gated MLP in Llama's form, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Llama,
    Mistral, Qwen2/3, Gemma, OLMo, DeepSeek's dense MLP, RecurrentGemma and the other Hugging Face
    classes with that forward), as one fused gated FFN (:func:`fusedrc.functional.gated_mlp`); also
    with an ``nn.Dropout`` of the gated product (T5Gemma, GTE: the op's own dropout, its mask drawn
    from its own stream) or a dropout of the output (Seed-OSS: after the op, as the module has it); a SwiGLU
    clamped at ``self.<attr>`` before the activation (DeepSeek-V4, GLM-5-Next) or after it (Step-3.7): the op's
    ``swiglu_limit``, read at each call; or Falcon-H1's multipliers, ``down_proj(up_proj(x) * act_fn(gate_proj(x) *
    self.<m_g>)) * self.<m_d>``: the op's ``gate_scale`` and a scale of its output, read at each call; or Gemma 3n's
    MLP while its ``activation_sparsity`` is 0 (read at each call: the module's forward where it is not).

    The projections may be Gemma 4's ``ClippableLinear`` (its vision MLP): while none clips (``use_clipped_linears``
    False, read at each call) the op reads their inner Linears' weights; the module's forward runs where one does.
    A plain or clamped gated MLP may follow a prelude of the module's own modules called in a chain on its input,
    ``v = self.<a>(self.<b>(v))`` lines (GLM-4V's, GLM-4.xV-MoE's and GLM-5-Next's vision patch mergers: ``proj``,
    ``post_projection_norm``, ``act1``): they run as the module calls them (their hooks fire), then the gated tail is
    fused on their output (written out module by module where a call of the op is not modelled)."""

    def _fusedrc_site(self):
        return self.sites.get("gated_ffn")

    def _fusedrc_dropout(self):
        """The dropout of the gated product the op runs in the "dropout" form; None (p = 0) otherwise."""
        return self._modules.get("dropout") if self.__dict__["_fusedrc_form"][0] == "dropout" else None

    def _fusedrc_gate_kwargs(self):
        """``gated_mlp``'s clamp arguments now (None where its limit is no number > 0), or its gate_scale (None
        where a multiplier is no finite number other than 0)."""
        kind, attr = self.__dict__["_fusedrc_form"]
        if kind == "sparse":  # Gemma 3n's: fused while its activation sparsity is off
            return {} if _sparsity_off(self, attr) else None
        if kind == "scaled":
            scales = _multipliers(self, attr)
            return None if scales is None else dict(gate_scale=scales[0])
        form = _CLAMP_FORMS.get(kind)
        return _gate_kwargs(self, form and form._replace(limit=attr))

    def _fusedrc_projections(self):
        """The gate's, up's and down's ``(nn.Linear, LoRA adapter or None)`` the op reads now (a ClippableLinear's
        inner one while it does not clip, a PEFT LoRA layer's base and adapters), or None."""
        now = tuple(_projection_now(m) for m in (self.gate_proj, self.up_proj, self.down_proj))
        return None if None in now else now

    def _fusedrc_linears(self):
        """The gate, up and down ``nn.Linear`` the op reads now (``_fusedrc_projections``), or None."""
        now = self._fusedrc_projections()
        return None if now is None else tuple(lin for lin, _ in now)

    def _fusedrc_ready(self):
        """The Linears the op would read where everything but the input lets the op stand for the call now (the
        unit on, no hooks, its activation, dropout and gate arguments modelled), else None."""
        site, dropout, lins = self._fusedrc_site(), self._fusedrc_dropout(), self._fusedrc_linears()
        if (site is None or not site.enabled or lins is None
                or not _nohooks(self, self.gate_proj, self.up_proj, self.down_proj, *lins, self.act_fn, dropout)
                or fused_dropout_p(dropout) is None or self._fusedrc_gate_kwargs() is None
                or not _still(self.__dict__["_fusedrc_act"], self.act_fn, *lins)):
            return None
        return lins

    def _fusedrc_fusable(self, x):
        lins = self._fusedrc_ready()
        return lins is not None and _dense_runtime_ok(x, *lins)

    def _fusedrc_tail(self, x):
        """After a prelude: the plain or clamped gated MLP on ``x`` module by module, the values the forward computes
        (in another order of calls, which nothing sees: with hooks on these modules the forward itself runs)."""
        kind, attr = self.__dict__["_fusedrc_form"]
        limit = getattr(self, attr) if kind in _CLAMP_FORMS else None
        gate, up = self.gate_proj(x), self.up_proj(x)
        if kind == "clamped_pre":
            gate = gate.clamp(max=limit)
        gate = self.act_fn(gate)
        if kind == "clamped":
            gate = gate.clamp(max=limit)
        if limit is not None:
            up = up.clamp(min=-limit, max=limit)
        return self.down_proj(gate * up)

    def forward(self, *args, **kwargs):
        x = _only_input(self, args, kwargs)
        if x is None:
            return self.plain(*args, **kwargs)
        act = self.__dict__["_fusedrc_act"]
        kind, p_attr = self.__dict__["_fusedrc_form"]

        def fused(x, **norm):
            ((g, lg), (u, lu), (d, ld)), p = self._fusedrc_projections(), fused_dropout_p(self._fusedrc_dropout())
            out = F.gated_mlp(x, g.weight, g.bias, u.weight, u.bias, d.weight, d.bias, act, dropout_p=p, **norm,
                              lora_gate=lg, lora_up=lu, lora_down=ld,
                              **self._fusedrc_gate_kwargs())  # the clamp's limit as it is now
            if kind == "out_dropout":  # after the op, as the module's forward applies it
                out = torch.nn.functional.dropout(out, p=getattr(self, p_attr), training=self.training)
            elif kind == "scaled":  # the down multiplier (autograd keeps nothing for a number's product)
                out = out * getattr(self, p_attr[1])
            return out

        prelude = self.__dict__.get("_fusedrc_prelude")
        if not prelude:
            return _with_norm(self, x, fused, self.plain)
        if self._fusedrc_ready() is None:  # hooks on the gated modules, the unit off, ...: the forward as it is
            return self.plain(*args, **kwargs)
        for key in prelude:  # as the forward calls them
            x = getattr(self, key)(x)
        if not self._fusedrc_fusable(x):
            return self._fusedrc_tail(x)
        return _run_site(self._fusedrc_site(), fused, self._fusedrc_tail, x)


_NORM_CONSUMERS = (FusedGatedMLP, FusedT5DenseActDense, FusedT5DenseGatedActDense, FusedConv1DMLP)


_GATED_MLP_ATTRS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _forward_args(lines):
    """The argument names after ``self`` of a forward whose code lines start with ``def forward(self, a[: T],
    ...)[ -> T]:`` (no defaults, no ``*``/``**``), else None."""
    if not lines or not lines[0].startswith("def forward("):
        return None
    try:
        fn = _ast.parse(lines[0] + " pass").body[0]
    except SyntaxError:  # a signature over several lines
        return None
    a = fn.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults or [p.arg for p in a.args[:1]] != ["self"]:
        return None
    return [p.arg for p in a.args[1:]]


def _forward_arg(lines):
    """The one argument's name of a forward whose code lines start with ``def forward(self, v[: T])[ -> T]:``,
    else None."""
    names = _forward_args(lines)
    return names[0] if names is not None and len(names) == 1 else None


def _inlined_return(lines):
    """The return expression of a forward whose body is assignments to plain names and one final
    ``return``, each on one line (a docstring allowed first), with every name assigned before
    substituted in: the one expression the forward computes, as ``ast.unparse`` writes it (parentheses
    only where precedence needs them). None for any other body (a branch, a loop, a multi-line
    statement, a tuple assignment, ...)."""
    env, unread = {}, set()

    class _Inline(_ast.NodeTransformer):
        def visit_Name(self, node):
            if isinstance(node.ctx, _ast.Load) and node.id in env:
                unread.discard(node.id)
                return copy.deepcopy(env[node.id])
            return node

    body = lines[1:]
    for i, ln in enumerate(body):
        try:
            stmts = _ast.parse(ln).body
        except SyntaxError:
            return None
        if len(stmts) != 1:
            return None
        st = stmts[0]
        if i == 0 and isinstance(st, _ast.Expr) and isinstance(st.value, _ast.Constant) \
                and isinstance(st.value.value, str):
            continue
        if isinstance(st, _ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], _ast.Name):
            value = _Inline().visit(st.value)
            if st.targets[0].id in unread:  # a value never read: its call would vanish from the expression
                return None
            env[st.targets[0].id] = value
            unread.add(st.targets[0].id)
            continue
        if isinstance(st, _ast.Return) and st.value is not None and i == len(body) - 1:
            expr = _ast.unparse(_Inline().visit(st.value))
            return None if unread else expr
        return None
    return None


# The gated forms the fused op stands for, on the gated product P = act_fn(gate_proj(v)) * up_proj(v):
# "plain" down_proj(P) (Llama, RecurrentGemma's through a local), "fp32" Beam's (P in fp32, rounded once), "dropout"
# down_proj(dropout(P)) with
# an nn.Dropout ``self.dropout`` (T5Gemma, GTE: the op's own dropout between the layers), "out_dropout"
# F.dropout(down_proj(P), p=self.<attr>, training=self.training) (Seed-OSS: after the op, as written).
_OUT_DROPOUT = r"(?:nn\.functional|F|torch\.nn\.functional)\.dropout\(self\.down_proj\({core}\), " \
               r"p=self\.(\w+), training=self\.training\)"
# SwiGLU clamps at L = self.<attr>, the op's swiglu_limit (none while L is +inf): "clamped" Step-3.7's,
# down_proj(act_fn(gate_proj(v)).clamp(max=L) * up_proj(v).clamp(min=-L, max=L)) (limit_after_act), "clamped_pre"
# DeepSeek-V4's, GLM-5-Next's,
# down_proj(act_fn(gate_proj(v).clamp([min=None, ]max=L)) * up_proj(v).clamp(min=-L, max=L)).
_CLAMPED = r"self\.down_proj\(self\.act_fn\(self\.gate_proj\({v}\)\)\.clamp\(max=self\.(\w+)\) \* " \
           r"self\.up_proj\({v}\)\.clamp\(min=-self\.(\w+), max=self\.(\w+)\)\)"
_CLAMPED_PRE = r"self\.down_proj\(self\.act_fn\(self\.gate_proj\({v}\)\.clamp\((?:min=None, )?max=self\.(\w+)\)\) \* " \
               r"self\.up_proj\({v}\)\.clamp\(min=-self\.(\w+), max=self\.(\w+)\)\)"


# "clamped_optional" Step-3.7's since transformers 5.25: "clamped" while L is not None, no clamp while it is
_CLAMPED_OPTIONAL = (r"(\w+), (\w+) = self\.act_fn\(self\.gate_proj\({v}\)\), self\.up_proj\({v}\)\n"
                     r"if self\.(\w+) is not None:\n"
                     r"\1 = \1\.clamp\(max=self\.\3\)\n"
                     r"\2 = \2\.clamp\(min=-self\.\3, max=self\.\3\)\n"
                     r"return self\.down_proj\(\1 \* \2\)")


# Gemma 3n's: Llama's MLP through local variables, with activation sparsity (a row statistic of the gate's
# pre-activation, ``_gaussian_topk``) where ``self.<attr>`` > 0: fused only where it is not (its later layers)
_SPARSE = (r"(\w+) = self\.gate_proj\({v}\)\n"
           r"if self\.(\w+) > 0\.0:\n"
           r"\1 = self\._gaussian_topk\(\1\)\n"
           r"(\w+) = self\.act_fn\(\1\)\n"
           r"(\w+) = self\.up_proj\({v}\)\n"
           r"(\w+) = self\.down_proj\(\3 \* \4\)\n"
           r"return \5")


def _sparsity_off(m, attr):
    """Whether Gemma 3n's gate runs without its activation sparsity now (``self.<attr> > 0.0`` is false)."""
    s = getattr(m, attr, None)
    return isinstance(s, numbers.Real) and not s > 0.0


# Falcon-H1's: the gate's pre-activation and the output each times a multiplier attribute
_SCALED = r"self\.down_proj\(self\.up_proj\({v}\) \* self\.act_fn\(self\.gate_proj\({v}\) \* self\.(\w+)\)\) \* " \
          r"self\.(\w+)"


def _multipliers(m, attrs):
    """Falcon-H1's ``(gate, down)`` multipliers, ``m``'s attributes ``attrs`` now, as floats; None where one is no
    finite real number other than 0."""
    values = [getattr(m, a, None) for a in attrs]
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v != 0
               for v in values):
        return None
    return tuple(float(v) for v in values)


def _gated_mlp_body(lines):
    """``(v, form, out-dropout attribute or None)`` when a forward of one argument ``v`` computes one of
    the gated forms above (straight, or through local variables); else None."""
    v = _forward_arg(lines)
    optional = None if v is None else _re.fullmatch(_CLAMPED_OPTIONAL.format(v=_re.escape(v)), "\n".join(lines[1:]))
    if optional is not None and optional.group(1) != optional.group(2):
        return v, "clamped_optional", optional.group(3)
    sparse = None if v is None else _re.fullmatch(_SPARSE.format(v=_re.escape(v)), "\n".join(lines[1:]))
    if sparse is not None and len({sparse.group(i) for i in (1, 3, 4, 5)}) == 4:
        return v, "sparse", sparse.group(2)
    expr = None if v is None else _inlined_return(lines)
    if expr is None:
        return None
    core = f"self.act_fn(self.gate_proj({v})) * self.up_proj({v})"
    # Beam's: the activation and product in fp32, rounded once to the projections' dtype (as the kernels do)
    fp32 = f"(self.act_fn(self.gate_proj({v}).float()) * self.up_proj({v}).float()).to(self.gate_proj({v}).dtype)"
    if expr == f"self.down_proj({core})":
        return v, "plain", None
    if expr == f"self.down_proj({fp32})":
        return v, "fp32", None
    for kind, pattern in (("clamped", _CLAMPED), ("clamped_pre", _CLAMPED_PRE)):
        clamped = _re.fullmatch(pattern.format(v=_re.escape(v)), expr)
        if clamped is not None and clamped.group(1) == clamped.group(2) == clamped.group(3):
            return v, kind, clamped.group(1)
    if expr == f"self.down_proj(self.dropout({core}))":
        return v, "dropout", None
    scaled = _re.fullmatch(_SCALED.format(v=_re.escape(v)), expr)
    if scaled is not None and scaled.group(1) != scaled.group(2):
        return v, "scaled", (scaled.group(1), scaled.group(2))
    out = _re.fullmatch(_OUT_DROPOUT.format(core=_re.escape(core)), expr)
    return (v, "out_dropout", out.group(1)) if out is not None else None


def _gated_prelude(lines, m):
    """``(keys, lines)``: the modules of ``m`` (not the gated MLP's own) that a forward of one argument ``v`` first
    calls in a chain on it, ``v = self.<a>(self.<b>(v))`` lines (GLM-4V's patch merger: ``proj``, then
    ``post_projection_norm`` and ``act1``), in call order, and the forward's lines without them."""
    v, keys, i = _forward_arg(lines), [], 1
    while v is not None and i < len(lines):
        try:
            stmts = _ast.parse(lines[i]).body
        except SyntaxError:
            break
        st = stmts[0] if len(stmts) == 1 else None
        if not (isinstance(st, _ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], _ast.Name)
                and st.targets[0].id == v):
            break
        node, chain = st.value, []
        while _self_call(node, getattr(getattr(node, "func", None), "attr", None), ...):
            chain.append(node.func.attr)
            node = node.args[0]
        if not (chain and isinstance(node, _ast.Name) and node.id == v
                and all(isinstance(m._modules.get(k), nn.Module) and k not in _GATED_MLP_ATTRS + ("dropout",)
                        for k in chain)):
            break
        keys += reversed(chain)
        i += 1
    return tuple(keys), lines[:1] + lines[i:]


# the gated forms that may follow a prelude (FusedGatedMLP._fusedrc_tail writes them out)
_PRELUDE_KINDS = ("plain", "clamped", "clamped_pre")


def _looks_gated_mlp(m):
    return all(isinstance(getattr(m, a, None), nn.Module) for a in _GATED_MLP_ATTRS) \
        and not _class_of(m).__module__.startswith("torch.") \
        and (not isinstance(m, Wrapper) or isinstance(m, FusedGatedMLP))


def _gated_mlp(ctx, name, m):
    """Found by shape, not class name: a module holding ``gate_proj``/``up_proj``/``down_proj``
    Linears and ``act_fn`` whose forward is Llama's MLP, word for word."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    prelude, lines = _gated_prelude(lines, m)
    form = _gated_mlp_body(lines)
    if form is None:
        ctx.skip(name, f"{_class_of(m).__name__}.forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x)) "
                       "(with, at most, a dropout of the product or of the output, a SwiGLU clamp, multipliers or Gemma 3n's "
                       "activation sparsity; or a plain or clamped one after its own modules called in a chain on x)")
        return m
    arg, kind, p_attr = form
    if prelude and kind not in _PRELUDE_KINDS:
        ctx.skip(name, f"a {kind} gated MLP after {'/'.join(prelude)} has no fused form")
        return m
    projections = ("gate_proj", "up_proj", "down_proj")
    clipping = [k for k in projections if not is_linear(getattr(m, k)) and _is_clippable(getattr(m, k))
                and getattr(getattr(m, k), "use_clipped_linears", None) is not False]
    if clipping:
        ctx.skip(name, f"{'/'.join(clipping)} clip (use_clipped_linears: the Linear's input and output clamped to "
                       "bounds held in buffers): no fused form")
        return m
    dropout = m._modules.get("dropout")
    if kind == "dropout" and (dropout is None or fused_dropout_p(dropout, training=True) is None):
        ctx.skip(name, f"{type(dropout).__name__} between the gate and down_proj has no fused form")
        return m
    if kind == "out_dropout" and not isinstance(getattr(m, p_attr, None), numbers.Real):
        ctx.skip(name, f"the output dropout's p, self.{p_attr}, is not a number")
        return m
    if kind == "scaled" and _multipliers(m, p_attr) is None:
        ctx.skip(name, f"its multipliers self.{p_attr[0]} = {getattr(m, p_attr[0], None)!r} and self.{p_attr[1]} = "
                       f"{getattr(m, p_attr[1], None)!r} are not finite numbers other than 0")
        return m
    if kind == "sparse" and not _sparsity_off(m, p_attr):
        ctx.skip(name, f"activation sparsity self.{p_attr} = {getattr(m, p_attr, None)!r} (a statistic of each row of "
                       "the gate before the activation) has no fused form")
        return m
    if kind in _CLAMP_FORMS and _gate_kwargs(m, _CLAMP_FORMS[kind]._replace(limit=p_attr)) is None:
        ctx.skip(name, f"its SwiGLU limit self.{p_attr} = {getattr(m, p_attr, None)!r} is not a number > 0")
        return m
    new = _gated_unit(ctx, name, m, FusedGatedMLP, "act_fn", projections,
                      linear=lambda mod: _inner_linear(_base_linear(mod)) or mod)
    if isinstance(new, FusedGatedMLP):  # (wrap may rewrite m itself: not an identity test)
        new.__dict__["_fusedrc_arg"] = arg
        new.__dict__["_fusedrc_form"] = (kind, p_attr)
        new.__dict__["_fusedrc_prelude"] = prelude
    return new


class FusedGateUpMLP(Wrapper):
    """A gated MLP whose gate and up projections are one Linear, Phi-3's
    ``up = gate_up_proj(x); gate, up = up.chunk(2, dim=-1); down_proj(up * activation_fn(gate))``
    (Phi-3/3.5/4-mini, Phi-4-multimodal, GLM, ...), or Moshi's ``MoshiGatingMLP`` (``fc1``'s output
    viewed as (batch, sequence, 2, -1), ``activation_fn`` of half 0 times half 1, then ``fc2``: the same
    halves), as one fused gated FFN on the two halves of the first Linear's weight (row views: no copy).
    A call the module's forward takes otherwise (Moshi's with a codebook's ``layer_idx``, an input of
    another rank there) runs that forward."""

    def forward(self, *args, **kwargs):
        x = _only_input(self, args, kwargs)
        (gu_name, d_name), rank = self.__dict__["_fusedrc_form"]
        site, act_mod = self.sites.get("gated_ffn"), self.activation_fn
        now = [_projection_now(getattr(self, key)) for key in (gu_name, d_name)]  # PEFT LoRA layers: base, adapter
        if (x is None or site is None or not site.enabled or None in now
                or not _nohooks(self, getattr(self, gu_name), getattr(self, d_name), act_mod)):
            return self.plain(*args, **kwargs)
        (gu, gu_lora), (d, d_lora) = now
        if (not _still(self.__dict__["_fusedrc_act"], act_mod, gu, d) or not _nohooks(gu, d)
                or gu.out_features != 2 * d.in_features or not _dense_runtime_ok(x, gu, d)
                or rank not in (None, x.dim())):
            return self.plain(*args, **kwargs)
        act, n = self.__dict__["_fusedrc_act"], d.in_features
        w, b = gu.weight, gu.bias
        # one adapter on the joint projection: its A shared, its B's row halves the gate's and the up's
        halves = (None, None) if gu_lora is None else ((gu_lora[0], gu_lora[1][:n], *gu_lora[2:]),
                                                      (gu_lora[0], gu_lora[1][n:], *gu_lora[2:]))
        return _run_site(
            site, lambda x: F.gated_mlp(x, w[:n], None if b is None else b[:n], w[n:], None if b is None else b[n:],
                                        d.weight, d.bias, act, lora_gate=halves[0], lora_up=halves[1],
                                        lora_down=d_lora),
            self.plain, x)


def _gate_up_body(lines):
    """The name of a forward's one argument ``v`` when its code lines are Phi-3's MLP, word for word; else None."""
    v = _forward_arg(lines)
    if v is None:
        return None
    body = [f"up_states = self.gate_up_proj({v})", "gate, up_states = up_states.chunk(2, dim=-1)",
            "up_states = up_states * self.activation_fn(gate)", "return self.down_proj(up_states)"]
    return v if lines[1:] == body else None


def _moshi_gating_body(lines):
    """The name of a forward's input ``v`` when its code lines are Moshi's gating MLP, word for word
    (``def forward(self, v[: T], layer_idx[: T] = None)``); else None."""
    if not lines or not lines[0].startswith("def forward("):
        return None
    try:
        a = _ast.parse(lines[0] + " pass").body[0].args
    except SyntaxError:
        return None
    if (a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or len(a.args) != 3 or a.args[0].arg != "self"
            or a.args[2].arg != "layer_idx" or len(a.defaults) != 1 or not _is_none(a.defaults[0])):
        return None
    v = a.args[1].arg
    body = [f"{v} = self.fc1({v}) if layer_idx is None else self.fc1({v}, layer_idx)",
            f"batch_size, sequence_length, _ = {v}.shape",
            f"{v} = {v}.view(batch_size, sequence_length, 2, -1)",
            f"{v} = self.activation_fn({v}[..., 0, :]) * {v}[..., 1, :]",
            f"{v} = self.fc2({v}) if layer_idx is None else self.fc2({v}, layer_idx)", f"return {v}"]
    return v if lines[1:] == body else None


def _is_none(node):
    return isinstance(node, _ast.Constant) and node.value is None


# the gated MLPs of one packed Linear: (first Linear, down Linear), the input rank the forward needs
# (None: any), the check of the forward's code (the input's name, or None)
_GATE_UP_FORMS = ((("gate_up_proj", "down_proj"), None, _gate_up_body), (("fc1", "fc2"), 3, _moshi_gating_body))


def _gate_up_form(m):
    """The ``_GATE_UP_FORMS`` entry whose two Linears and ``activation_fn`` ``m`` holds, or None."""
    return next((f for f in _GATE_UP_FORMS
                 if all(isinstance(getattr(m, a, None), nn.Module) for a in (*f[0], "activation_fn"))), None)


def _looks_gate_up_mlp(m):
    if _class_of(m).__module__.startswith("torch.") or isinstance(m, Wrapper) and not isinstance(m, FusedGateUpMLP):
        return False
    form = _gate_up_form(m)
    if form is None:
        return False
    if form[0][0] == "gate_up_proj":
        return True
    lines = _source_lines(m)  # fc1/fc2 modules of other forwards (CLIP's MLP, ...) are the fx pass's
    return lines is not None and form[2](lines) is not None


def _gate_up_mlp(ctx, name, m):
    """Found by shape: a module holding ``gate_up_proj``/``down_proj`` Linears and ``activation_fn``
    whose forward is Phi-3's MLP, word for word; or ``fc1``/``fc2`` and ``activation_fn`` with
    Moshi's gating MLP as its forward."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    (gu_name, d_name), rank, body = _gate_up_form(m)
    arg = body(lines)
    act = _act_name(m.activation_fn)
    gu, d = _base_linear(getattr(m, gu_name)), _base_linear(getattr(m, d_name))
    if arg is None:
        reason = (f"{_class_of(m).__name__}.forward is not gate, up = gate_up_proj(x).chunk(2); "
                  "down_proj(up * activation_fn(gate))")
    elif act is None:
        reason = f"activation {type(m.activation_fn).__name__} has no fused form"
    elif not (is_linear(gu) and is_linear(d)) or gu.out_features != 2 * d.in_features:
        reason = f"{gu_name}/{d_name} are not plain nn.Linear of matching shapes"
    else:
        reason = None
    if reason is not None:
        ctx.skip(name, reason)
        return m
    new = FusedGateUpMLP.wrap(m)
    new.__dict__["_fusedrc_act"], new.__dict__["_fusedrc_arg"] = act, arg
    new.__dict__["_fusedrc_form"] = ((gu_name, d_name), rank)
    _site_unit(ctx, new, name, "gated_ffn", "gated_ffn", (gu,))
    return new


class FusedClampedGluMLP(Wrapper):
    """MiniMax-M3's dense MLP (``MiniMaxM3VLDenseMLP``): ``gate, up = gate_up_proj(x).chunk(2)``, both clamped at
    ``swiglu_limit``, then ``down_proj((up + 1.0) * (gate * sigmoid(gate * swiglu_alpha)))``, as one fused gated
    FFN on the row halves of ``gate_up_proj``'s weight (views), its limit and alpha read at each call."""

    def forward(self, *args, **kwargs):
        x = _only_input(self, args, kwargs)
        site, gu, d = self.sites.get("gated_ffn"), self.gate_up_proj, self.down_proj
        gate_kwargs = _gate_kwargs(self, _MINIMAX_DENSE_GATE)
        if (x is None or site is None or not site.enabled or not _nohooks(self, gu, d) or gate_kwargs is None
                or not (is_linear(gu) and is_linear(d)) or gu.out_features != 2 * d.in_features
                or not _dense_runtime_ok(x, gu, d)):
            return self.plain(*args, **kwargs)
        n, w, b = d.in_features, gu.weight, gu.bias
        return _run_site(
            site, lambda x: F.gated_mlp(x, w[:n], None if b is None else b[:n], w[n:], None if b is None else b[n:],
                                        d.weight, d.bias, "silu", **gate_kwargs),
            self.plain, x)


_MINIMAX_DENSE_LINES = [
    "gate_up = self.gate_up_proj(hidden_states)", "gate, up = gate_up.chunk(2, dim=-1)",
    "gate = gate.clamp(max=self.swiglu_limit)", "up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)",
    "glu = gate * torch.sigmoid(gate * self.swiglu_alpha)", "return self.down_proj((up + 1.0) * glu)"]


@register_rule("MiniMaxM3VLDenseMLP")
def _minimax_dense_mlp(ctx, name, m):
    """MiniMax-M3's dense MLP (its forward checked line by line)."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    gu, d = m._modules.get("gate_up_proj"), m._modules.get("down_proj")
    reads = getattr(_inspect.getattr_static(_class_of(m), "forward"), "__globals__", {})
    if lines[0] != "def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:" \
            or lines[1:] != _MINIMAX_DENSE_LINES or reads.get("torch") is not torch:
        reason = f"{_class_of(m).__name__}.forward is not MiniMax-M3's dense MLP"
    elif not (is_linear(gu) and is_linear(d)) or gu.out_features != 2 * d.in_features:
        reason = "gate_up_proj/down_proj are not plain nn.Linear of matching shapes"
    elif _gate_kwargs(m, _MINIMAX_DENSE_GATE) is None:
        reason = "its swiglu_limit or swiglu_alpha is not a number > 0"
    elif not _nohooks(m, gu, d):
        reason = "hooks registered on the modules"
    else:
        reason = None
    if reason is not None:
        ctx.skip(name, reason)
        return m
    new = FusedClampedGluMLP.wrap(m)
    new.__dict__["_fusedrc_act"], new.__dict__["_fusedrc_arg"] = "silu", "hidden_states"
    _site_unit(ctx, new, name, "gated_ffn", "gated_ffn", (gu,))
    return new


class _ExpertsCall(Wrapper):
    """An experts module called as ``(hidden_states, top_k_index, top_k_weights)``: one fused experts call,
    ``_fusedrc_fused(h, i, r)``, where its unit is on, outside a recomputed region (whose inputs are all it keeps
    already) and ``_fusedrc_ok(h, i, r)`` holds; else, and for any other call, the module's own forward."""

    def forward(self, *args, **kwargs):
        try:
            hs, idx, w = _experts_args(args, kwargs, self.__dict__.get("_fusedrc_names", _EXPERTS_NAMES))
        except TypeError:
            return self.plain(*args, **kwargs)
        site = self.sites.get("experts")
        if site is None or not site.enabled or inside_region() or not self._fusedrc_ok(hs, idx, w):
            return self.plain(*args, **kwargs)
        return _run_site(site, self._fusedrc_fused, self.plain, hs, idx, w)


class FusedExperts(_ExpertsCall):
    """A Mixture-of-Experts layer's experts under transformers' experts interface
    (``@use_experts_implementation``: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE and the
    other classes with stacked ``gate_up_proj``/``down_proj`` weights; Nemotron-H's ungated ``up_proj``
    experts; gpt-oss's with biases and interleaved gate/up rows) as one :func:`fusedrc.functional.moe_experts`
    call: each expert's FFN fused, the routing
    weights' gradient from the recompute, only the call's inputs kept. Whatever the config's
    ``experts_implementation`` (eager, grouped_mm, ...), the fused call computes the same function."""

    def __getattr__(self, name):
        # the original class's own attributes (its _apply_gate, ...) for the plain forward
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_fusedrc_original_class")
            if original is None or not hasattr(original, name):
                raise
            attr = _inspect.getattr_static(original, name)
            return attr.__get__(self, original) if hasattr(attr, "__get__") else attr

    def _fusedrc_flops(self, args, kwargs):
        return _experts_flops(self, args, kwargs)

    # (inside a recomputed region the original implementation: transformers' grouped_mm beats a plain
    # per-expert loop)
    def _fusedrc_ok(self, hs, idx, w):
        form = self.__dict__.get("_fusedrc_clamp")  # a _GateForm: a clamped _apply_gate's
        act_fn = self._modules.get("act_fn")  # GLM-5-Next's, HY-V4's and MiniMax-M3's gate without it: none
        gate_mods = self.__dict__.get("_fusedrc_gate_modules", ())
        return (_nohooks(self, act_fn, *gate_mods)
                and (not gate_mods or act_fn is not None and (act_fn, *act_fn.children()) == gate_mods)
                and (form is not None and form.act or _act_name(act_fn) == self.__dict__["_fusedrc_act"])
                and _gate_kwargs(self, form) is not None and _experts_runtime_ok(self, hs, idx, w)
                and all(b is None or b.device == hs.device and (b.dtype == hs.dtype
                                                                  or torch.is_autocast_enabled(hs.device.type))
                        for b in _experts_biases(self))
                # sharded weights (expert parallelism's DTensors, where its forward does not make them local)
                and not any(_is_dtensor(t) for t in (*_experts_weights(self), *_experts_biases(self))))

    def _fusedrc_fused(self, h, i, r):
        gate_up, down = _experts_weights(self)
        form = self.__dict__.get("_fusedrc_clamp")
        gate_up_bias, down_bias = _experts_biases(self)
        # its limit and alpha as they are now; transformers' implementations return hidden_states' dtype, also
        # under autocast. Under expert parallelism (an instance flag, transformers 5.24; 5.17 has none) num_experts
        # is this rank's count and the ids of other ranks' experts are sentinels at or past it: skipped, as the
        # implementations mask them (no output, no routing weight gradient)
        return F.moe_experts(h, i, r, gate_up, down, self.__dict__["_fusedrc_act"], gated=self.has_gate,
                             skip_out_of_range=bool(self.__dict__.get("_is_expert_parallel", False)),
                             gate_up_proj_bias=gate_up_bias, down_proj_bias=down_bias,
                             interleaved=form is not None and form.interleaved, **_gate_kwargs(self, form)).to(h.dtype)


# has_post_expert_norm came later (transformers 5.24 has it, 5.17 not): absent means no norm
_EXPERTS_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
def _experts_args(args, kwargs, names=_EXPERTS_NAMES):
    """An experts forward's three arguments bound by a call, ``names`` the forward's own parameter names
    (gpt-oss's are (hidden_states, router_indices, routing_weights)); TypeError where they do not fit. By hand:
    dynamo before torch 2.13 breaks the graph in ``Signature.bind``."""
    if len(args) > 3 or set(kwargs) != set(names[len(args):]):
        raise TypeError("not an experts call")
    return (*args, *(kwargs[n] for n in names[len(args):]))


def _experts_weights(m):
    """(gate_up (E, 2I, K), down (E, N, I)) of an experts module: views when stored transposed; an
    ungated one's up_proj (E, I, K) in gate_up's place."""
    gate_up, down = (m.gate_up_proj if m.has_gate else m.up_proj), m.down_proj
    return (gate_up.transpose(1, 2), down.transpose(1, 2)) if m.is_transposed else (gate_up, down)


def _is_dtensor(t):
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _experts_bias_names(m):
    return ("gate_up_proj_bias" if m.has_gate else "up_proj_bias", "down_proj_bias")


def _experts_biases(m):
    """(gate_up bias (E, 2I) or an ungated one's up bias (E, I), down bias (E, N)) of experts with biases (both
    laid out the same whether the weights are stored transposed or not); (None, None) without."""
    return tuple(getattr(m, n) for n in _experts_bias_names(m)) if m.has_bias else (None, None)


def _experts_runtime_ok(m, hs, idx, w):
    return _routing_ok(hs, idx, w, _experts_weights(m)[0], m.down_proj)


def _looks_experts(m):
    """transformers' experts classes, found by what ``@use_experts_implementation`` sets (its flags,
    an interface-dispatching forward) rather than by name: 60-odd classes share the layout."""
    return (all(isinstance(m.__dict__.get(f), bool) for f in _EXPERTS_FLAGS)
            and isinstance(getattr(m, "num_experts", None), int)
            and hasattr(_class_of(m).forward, "__wrapped__")
            and (not isinstance(m, Wrapper) or isinstance(m, FusedExperts)))


def _looks_own_experts(m):
    """An experts module that has the interface's flags but a forward of its own (a subclass overriding the
    decorated forward: Ergo's ``ErgoExperts``, its per-route norm after each expert): reported, left."""
    return (all(isinstance(m.__dict__.get(f), bool) for f in _EXPERTS_FLAGS)
            and isinstance(getattr(m, "num_experts", None), int) and not isinstance(m, Wrapper)
            and not hasattr(_class_of(m).forward, "__wrapped__"))


def _own_experts(ctx, name, m):
    ctx.skip(name, f"{_class_of(m).__name__}.forward is its own, not transformers' experts interface "
                   "(the experts computed some other way): no fused form")
    return m


def _experts(ctx, name, m):
    cls = _class_of(m)
    gate = _inspect.getattr_static(cls, "_apply_gate", None)
    default = getattr(gate, "__name__", None) == "_default_apply_gate" \
        or (_source_lines(m, "_apply_gate") or [])[1:] == _FP32_GATE_LINES
    clamp = _experts_clamp(m) if m.has_gate and not default else None
    act = getattr(m, "act_fn", None)  # gpt-oss's experts have none: they gate inline
    own = list(_inspect.signature(cls.forward.__wrapped__).parameters.values())[1:]
    if len(own) != 3 or own[0].name != "hidden_states" \
            or any(p.kind is not _inspect.Parameter.POSITIONAL_OR_KEYWORD for p in own):
        reason = (f"{cls.__name__}.forward takes (self, {', '.join(p.name for p in own)}), not (hidden_states, "
                  "top_k_index, top_k_weights)")
    elif m.__dict__.get("has_post_expert_norm", False):
        reason = "a norm after each expert has no fused form"
    # the gate's code, not is_concatenated, says how gate_up's rows split: transformers' implementations all call it
    elif m.has_gate and not default and clamp is None:
        reason = f"{cls.__name__} gates its experts its own way (not act(gate) * up on the halves of gate_up_proj)"
    elif clamp is not None and _gate_kwargs(m, clamp) is None:
        reason = (f"its SwiGLU limit self.{clamp.limit} = {getattr(m, clamp.limit, None)!r} or alpha is not a number"
                  " > 0" if clamp.limit else "its gate's alpha or softcaps are not numbers > 0")
    elif not (clamp is not None and clamp.act) and (not isinstance(act, nn.Module) or _act_name(act) is None):
        reason = f"activation {type(act).__name__} has no fused form"
    elif not _nohooks(m, act, *(act.children() if isinstance(act, nn.Module) else ())):
        reason = "hooks registered on the modules"
    else:
        reason = None
        names = ("gate_up_proj" if m.has_gate else "up_proj", "down_proj")
        gate_up, down = _experts_weights(m) if all(
            isinstance(getattr(m, k, None), nn.Parameter) and getattr(m, k).dim() == 3 for k in names) else (None, None)
        if gate_up is None or down.shape[0] != gate_up.shape[0] \
                or down.shape[2] * (2 if m.has_gate else 1) != gate_up.shape[1]:
            reason = f"{'/'.join(names)} are not 3-D parameters of matching expert and intermediate sizes"
        elif m.has_bias and not all(isinstance(getattr(m, n, None), nn.Parameter) and tuple(getattr(m, n).shape)
                                    == tuple(t.shape[:2]) for n, t in zip(_experts_bias_names(m), (gate_up, down))):
            reason = f"{'/'.join(_experts_bias_names(m))} are not parameters of shapes (experts, output rows)"
    # the unit's cost: the gate and up projections its backward reruns (_experts_flops)
    act = (clamp.act if clamp is not None and clamp.act else _act_name(act)) if reason is None else None
    new = _experts_unit(ctx, name, m, reason, FusedExperts, act)
    if reason is None:
        new.__dict__["_fusedrc_clamp"] = clamp
        new.__dict__["_fusedrc_names"] = tuple(p.name for p in own)
        # a softcapped gate's modules as converted: another module put in their place runs the module's forward
        gate_mod = m._modules.get("act_fn")
        new.__dict__["_fusedrc_gate_modules"] = (gate_mod, *gate_mod.children()) \
            if clamp is not None and clamp.gate_cap else ()
    return new


def _experts_unit(ctx, name, m, reason, wrapper, act):
    """``m`` as ``wrapper``, one fused experts unit whose recompute cost depends on the routing (the wrapper's
    ``_fusedrc_flops``, measured per call); or, with a ``reason``, ``m`` itself and the reason in the plan."""
    key = _RecomputeKey()
    new = _wrapped_unit(ctx, name, m, reason, wrapper, act, "experts", "moe_experts", (key,))
    if reason is None:
        new.__dict__["_fusedrc_recompute"] = key
    return new


class _GateForm(NamedTuple):
    """A shaped SwiGLU a module computes: its limit attribute (None: no clamp), whether the clamp follows the
    activation, the activation it fixes (None: ``self.act_fn``'s), its alpha attribute (``h * sigmoid(h * alpha)``;
    None: none), its up offset, whether gate and up alternate in the projection's output (gpt-oss's ``[..., ::2]``),
    and the dotted attribute paths of its gate and up softcaps (Inkling2's; None: none); ``optional``: its code
    clamps only while the limit attribute is not None (Step-3.7's since transformers 5.25), so None there is no
    clamp."""
    limit: str | None
    after: bool = False
    act: str | None = None
    alpha: str | None = None
    offset: float = 0.0
    interleaved: bool = False
    gate_cap: str | None = None
    up_cap: str | None = None
    optional: bool = False


_MINIMAX_DENSE_GATE = _GateForm("swiglu_limit", act="silu", alpha="swiglu_alpha", offset=1.0)
_STEP3P7_GATE = _GateForm("limit", after=True)
_STEP3P7_GATE_OPTIONAL = _STEP3P7_GATE._replace(optional=True)  # transformers 5.25's: no clamp while limit is None
# the gated MLP rule's clamped forms (their limit: the attribute its code names)
_CLAMP_FORMS = {"clamped": _GateForm("", after=True), "clamped_pre": _GateForm(""),
                "clamped_optional": _GateForm("", after=True, optional=True)}


# Beam's experts gate: the default act(gate) * up in fp32, rounded once (as the kernels compute it)
_FP32_GATE_LINES = ["gate, up = gate_up.chunk(2, dim=-1)",
                    "return (self.act_fn(gate.float()) * up.float()).to(gate.dtype)"]
_GATE_SPLITS = {"gate, up = gate_up.chunk(2, dim=-1)": False, "gate, up = gate_up[..., ::2], gate_up[..., 1::2]": True}


def _experts_clamp(m):
    """The ``_GateForm`` of experts whose ``_apply_gate`` clamps a SwiGLU before its activation on the halves of
    gate_up_proj, ``act(gate.clamp(max=L)) * up.clamp(-L, L)`` (DeepSeek-V4's with ``self.act_fn``, GLM-5-Next's
    and HY-V4's with ``F.silu``), or ``(up + c) * (gate * torch.sigmoid(gate * self.<alpha>))`` on the clamped
    halves (MiniMax-M3's, the OpenAI privacy filter's; gpt-oss's on the interleaved rows, its product named
    before it is returned); else None."""
    lines = _source_lines(m, "_apply_gate")
    if lines is not None and lines[1:] == ["gate, up = gate_up.chunk(2, dim=-1)", "return self.act_fn(gate, up)"]:
        return _softcapped_gate(m)
    if lines is None or len(lines) not in (5, 6, 7) or lines[1] not in _GATE_SPLITS:
        return None
    interleaved = _GATE_SPLITS[lines[1]]
    g = _re.fullmatch(r"gate = gate\.clamp\((?:min=None, )?max=self\.(\w+)\)", lines[2])
    u = _re.fullmatch(r"up = up\.clamp\(min=-self\.(\w+), max=self\.(\w+)\)", lines[3])
    if not (g and u and g.group(1) == u.group(1) == u.group(2)):
        return None
    fn = _inspect.getattr_static(_class_of(m), "_apply_gate", None)
    names = getattr(fn, "__globals__", {})  # the F or torch the method reads must be torch's
    if len(lines) > 5:
        glu = _re.fullmatch(r"glu = gate \* torch\.sigmoid\(gate \* self\.(\w+)\)", lines[4])
        product = r"\(up \+ (\d+(?:\.\d*)?)\) \* glu"
        out = _re.fullmatch(rf"return {product}", lines[5]) if len(lines) == 6 else _re.fullmatch(
            rf"(\w+) = {product}", lines[5])
        if not (glu and out) or len(lines) == 7 and lines[6] != f"return {out.group(1)}" \
                or names.get("torch") is not torch:
            return None
        return _GateForm(g.group(1), act="silu", alpha=glu.group(1), offset=float(out.group(len(lines) - 5)),
                         interleaved=interleaved)
    a = _re.fullmatch(r"return (self\.act_fn|F\.silu)\(gate\) \* up", lines[4])
    if a is None or a.group(1) == "F.silu" and names.get("F") is not torch.nn.functional:
        return None
    return _GateForm(g.group(1), act="silu" if a.group(1) == "F.silu" else None, interleaved=interleaved)


# Inkling2's gate module (``act_fn(gate, up)``) and its softcaps, line by line
_SOFTCAP_SWIGLU_LINES = [
    "def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:", "input_dtype = gate.dtype",
    "gate, up = gate.float(), up.float()",
    "return (self.gate_softcap(gate) * torch.sigmoid(gate) * self.up_softcap(up)).to(input_dtype)"]
_SOFTCAP_LINES = ["def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:",
                  "return torch.tanh(hidden_states / self.softcap) * self.softcap"]


def _softcapped_gate(m):
    """The ``_GateForm`` of experts gating ``self.act_fn(gate, up)`` on the halves of gate_up_proj with Inkling2's
    softcapped SwiGLU, ``s_g tanh(g / s_g) * sigmoid(g) * s_u tanh(u / s_u)`` in fp32, rounded once (its module and
    its two softcap modules checked line by line; their ``softcap`` read at each call); else None."""
    act = m._modules.get("act_fn")
    caps = [None if act is None else act._modules.get(n) for n in ("gate_softcap", "up_softcap")]
    if act is None or None in caps or _source_lines(act) != _SOFTCAP_SWIGLU_LINES \
            or any(_source_lines(c) != _SOFTCAP_LINES for c in caps):
        return None
    if any(getattr(type(mod).forward, "__globals__", {}).get("torch") is not torch for mod in (act, *caps)):
        return None
    return _GateForm(None, act="silu", gate_cap="act_fn.gate_softcap.softcap", up_cap="act_fn.up_softcap.softcap")


def _gate_kwargs(m, form):
    """The gated ops' gate arguments (``swiglu_limit``, ...) of a module computing ``form`` (None: a plain gate), its
    limit, alpha and softcaps read from ``m`` now (a limit of +inf clamps nothing); None where one is no number > 0
    (the module's own forward runs)."""
    if form is None:
        return {}
    def value(path, default):  # m.<a>.<b>... now; ``default`` without a path
        if path is None:
            return default
        obj = m
        for part in path.split("."):
            obj = getattr(obj, part, None)
        return obj

    limit, alpha = value(form.limit, math.inf), value(form.alpha, 1.0)
    if limit is None and form.optional:
        limit = math.inf
    caps = value(form.gate_cap, 1.0), value(form.up_cap, 1.0)
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0 for v in (limit, alpha, *caps)) \
            or not all(math.isfinite(v) for v in (alpha, *caps)):
        return None
    return dict(swiglu_limit=None if limit == math.inf else float(limit), limit_after_act=form.after,
                swiglu_alpha=float(alpha) if form.alpha else None, up_offset=form.offset,
                gate_softcap=float(caps[0]) if form.gate_cap else None,
                up_softcap=float(caps[1]) if form.up_cap else None)


class FusedJetMoeMoE(Wrapper):
    """JetMoE's ``JetMoeMoE``: its experts (``input_linear`` (E, 2H, D), gate then up; ``output_linear``
    (E, D, H); ``JetMoeParallelExperts``) as one :func:`fusedrc.functional.moe_experts` call on the
    router's choices, which its sorted pairs give back per token; the router and the output bias as they
    are. Only the call's inputs are kept for the experts."""

    def forward(self, *args, **kwargs):
        x = _only_input(self, args, kwargs)
        site, act, up, down = self.sites.get("experts"), self.__dict__["_fusedrc_act"], self.input_linear, \
            self.output_linear
        if (x is None or site is None or not site.enabled or inside_region()
                or not _nohooks(self, self.activation, up, down) or _act_name(self.activation) != act
                or _jetmoe_reason(self) is not None or not isinstance(x, torch.Tensor) or x.dim() != 3
                or not x.is_floating_point() or x.device != up.weight.device
                or not (x.dtype == up.weight.dtype == down.weight.dtype or torch.is_autocast_enabled(x.device.type))):
            return self.plain(*args, **kwargs)
        bsz, length, emb_size = x.size()
        flat = x.reshape(-1, emb_size)
        index_sorted, batch_index, batch_gates, expert_size, _ = self.router(flat)

        def fused(h, index_sorted, batch_gates):
            # the router sorted the (token, choice) pairs by expert: back to (tokens, k) per token
            k, experts = self.router.top_k, up.weight.shape[0]
            inverse = torch.empty_like(index_sorted)
            inverse[index_sorted] = torch.arange(index_sorted.numel(), device=index_sorted.device)
            chosen = torch.repeat_interleave(torch.arange(experts, device=h.device),
                                             torch.as_tensor(expert_size, device=h.device), output_size=h.shape[0] * k)
            return F.moe_experts(h, chosen[inverse].view(-1, k), batch_gates[inverse].view(-1, k), up.weight,
                                 down.weight, act).to(h.dtype)

        def plain(h, index_sorted, batch_gates):  # the module's own lines (checkpoint's comparison)
            hidden = up(h[batch_index], expert_size).chunk(2, dim=-1)
            out = down(self.activation(hidden[0]) * hidden[1], expert_size) * batch_gates[:, None]
            return torch.zeros((h.shape[0], h.shape[1]), dtype=out.dtype, device=out.device).index_add(0, batch_index, out)

        out = _run_site(site, fused, plain, flat, index_sorted, batch_gates)
        return out.view(bsz, length, emb_size) + self.bias


# JetMoE's MoE and router lines the fused call relies on (the router: how its sorted pairs are laid out)
_JETMOE_LINES = ["bsz, length, emb_size = layer_input.size()", "layer_input = layer_input.reshape(-1, emb_size)",
                 "_, batch_index, batch_gates, expert_size, router_logits = self.router(layer_input)",
                 "expert_inputs = layer_input[batch_index]",
                 "hidden_states = self.input_linear(expert_inputs, expert_size)",
                 "chunked_hidden_states = hidden_states.chunk(2, dim=-1)",
                 "hidden_states = self.activation(chunked_hidden_states[0]) * chunked_hidden_states[1]",
                 "expert_outputs = self.output_linear(hidden_states, expert_size)",
                 "expert_outputs = expert_outputs * batch_gates[:, None]",
                 "zeros = torch.zeros((bsz * length, self.input_size), dtype=expert_outputs.dtype, "
                 "device=expert_outputs.device)",
                 "layer_output = zeros.index_add(0, batch_index, expert_outputs)",
                 "layer_output = layer_output.view(bsz, length, self.input_size)",
                 "layer_output = layer_output + self.bias", "return layer_output"]
_JETMOE_ROUTER_LINES = ["top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)  # [num_tokens, top_k]",
                        "gates = zeros.scatter(1, top_k_indices, 1)  # [num_tokens, num_experts]",
                        "expert_size = gates.long().sum(0)  # [num_experts,]",
                        "expert_size = expert_size.tolist()",
                        "top_k_experts = top_k_indices.flatten()  # [num_tokens * top_k]",
                        "_, index_sorted_experts = top_k_experts.sort(0)  # [num_tokens * top_k]",
                        "batch_index = index_sorted_experts.div(self.top_k, rounding_mode=\"trunc\")  # [num_tokens * top_k]",
                        "top_k_gates = top_k_gates.flatten()  # [num_tokens * top_k]",
                        "batch_gates = top_k_gates[index_sorted_experts]  # [num_tokens * top_k]",
                        "return index_sorted_experts, batch_index, batch_gates, expert_size, logits"]


def _jetmoe_reason(m):
    """Why JetMoE's MoE module ``m`` cannot be one fused experts call now, or None."""
    up, down, router = m._modules.get("input_linear"), m._modules.get("output_linear"), m._modules.get("router")
    if not (_is_parallel_experts(up) and _is_parallel_experts(down)) or up.weight.shape[0] != down.weight.shape[0] \
            or up.weight.shape[1] != 2 * down.weight.shape[2] or down.weight.shape[1] != up.weight.shape[2]:
        return "input_linear/output_linear are not JetMoeParallelExperts of matching expert and hidden sizes"
    if type(router).__name__ != "JetMoeTopKGating" or not isinstance(getattr(router, "top_k", None), int) \
            or getattr(router, "num_experts", None) != up.weight.shape[0]:
        return f"the router {type(router).__name__} is not JetMoE's top-k gating"
    if not isinstance(m._parameters.get("bias"), nn.Parameter):
        return "no output bias parameter"
    return None


@register_rule("JetMoeMoE")
def _jetmoe_moe(ctx, name, m):
    """JetMoE's Mixture-of-Experts layer (``JetMoeMoE``; its experts' forward checked line by line, and
    the router's lines that lay out its sorted pairs)."""
    lines, router_lines = _forward_lines(ctx, name, m), _source_lines(m._modules.get("router"))
    if lines is None:
        return m
    act = _act_name(getattr(m, "activation", None))
    if lines[0] != "def forward(self, layer_input):" or not _contains_run(lines, _JETMOE_LINES):
        reason = f"{_class_of(m).__name__}.forward is not JetMoE's"
    elif router_lines is None or not all(ln in router_lines for ln in _JETMOE_ROUTER_LINES):
        reason = "the router's forward is not JetMoE's top-k gating"
    elif act is None:
        reason = f"activation {type(getattr(m, 'activation', None)).__name__} has no fused form"
    else:
        reason = _jetmoe_reason(m)
    return _wrapped_unit(ctx, name, m, reason, FusedJetMoeMoE, act, "experts", "moe_experts",
                         (m.input_linear,) if reason is None else ())


class FusedLlama4TextExperts(Wrapper):
    """Llama 4's ``Llama4TextExperts``: every expert's gated FFN on its own equal share of the rows
    (the MoE layer repeats each token once per expert, scaled by its router score), ``gate_up_proj``
    (E, hidden, 2I) and ``down_proj`` (E, I, hidden) applied by ``bmm``, as one
    :func:`fusedrc.functional.moe_experts` call routing row ``r`` to expert ``r // rows_per_expert``
    with weight 1. Only the call's input is kept, not the (E, rows, 2I) projection and its products."""

    def _fusedrc_flops(self, args, kwargs):
        x = _only_input(self, args, kwargs)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            return 0, 0
        hidden, inter2 = self.gate_up_proj.shape[1:]
        rerun = 2 * x.shape[0] * hidden * inter2
        return rerun + 2 * x.shape[0] * self.down_proj.shape[1] * self.down_proj.shape[2], rerun

    def forward(self, *args, **kwargs):
        x = _only_input(self, args, kwargs)
        site, gate_up, down = self.sites.get("experts"), self.gate_up_proj, self.down_proj
        if (x is None or site is None or not site.enabled or inside_region() or not _nohooks(self, self.act_fn)
                or _act_name(self.act_fn) != self.__dict__["_fusedrc_act"] or _llama4_experts_reason(self) is not None
                or not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point()
                or x.shape[1] != gate_up.shape[1] or x.shape[0] % gate_up.shape[0] or x.device != gate_up.device
                or not (x.dtype == gate_up.dtype == down.dtype or torch.is_autocast_enabled(x.device.type))):
            return self.plain(*args, **kwargs)
        experts, act = gate_up.shape[0], self.__dict__["_fusedrc_act"]

        def fused(h):
            rows = torch.arange(h.shape[0], device=h.device) // (h.shape[0] // experts)
            ones = torch.ones(h.shape[0], 1, dtype=torch.float32, device=h.device)
            # bmm's output dtype: the autocast dtype under autocast, as moe_experts' own
            return F.moe_experts(h, rows[:, None], ones, gate_up.transpose(1, 2), down.transpose(1, 2), act)

        return _run_site(site, fused, self.plain, x)


# Llama4TextExperts.forward's lines (transformers 4.51 to 5.x; its docstring aside)
_LLAMA4_EXPERTS_LINES = [
    "hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)",
    "gate_up = torch.bmm(hidden_states, self.gate_up_proj)",
    "gate, up = gate_up.chunk(2, dim=-1)  # not supported for DTensors",
    "next_states = torch.bmm((up * self.act_fn(gate)), self.down_proj)",
    "next_states = next_states.view(-1, self.hidden_size)", "return next_states"]


def _llama4_experts_reason(m):
    """Why Llama 4's experts module ``m`` cannot be one fused experts call now (its weights), or None."""
    gate_up, down = m._parameters.get("gate_up_proj"), m._parameters.get("down_proj")
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3
            and gate_up.shape[2] % 2 == 0 and down.shape[:2] == (gate_up.shape[0], gate_up.shape[2] // 2)
            and gate_up.shape[1] == down.shape[2] == getattr(m, "hidden_size", None)):
        return "gate_up_proj/down_proj are not (E, hidden, 2I) / (E, I, hidden) parameters"
    return None


@register_rule("Llama4TextExperts")
def _llama4_text_experts(ctx, name, m):
    """Llama 4's experts (``Llama4TextExperts``, its forward checked line by line)."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    act = getattr(m, "act_fn", None)
    reason = _rule_reason(
        [(lines[0].startswith("def forward(self, hidden_states") and _contains_run(lines, _LLAMA4_EXPERTS_LINES),
          f"{_class_of(m).__name__}.forward is not Llama 4's bmm experts")],
        act, (m, act), lambda: _llama4_experts_reason(m))
    new = _experts_unit(ctx, name, m, reason, FusedLlama4TextExperts, _act_name(act))
    if reason is None:
        new.__dict__["_fusedrc_arg"] = "hidden_states"
    return new


class FusedInklingSharedExperts(Wrapper):
    """Inkling's shared experts (``InklingSharedExperts``): every token through each of ``n_shared_experts`` gated
    FFNs (stacked gate, up and down weights applied by ``bmm``), weighted by the router's per-token ``gammas`` and
    summed in fp32, as one :func:`fusedrc.functional.moe_experts` call choosing every expert for every token with
    the gammas as routing weights (the gate and up stacks apart): only the call's inputs kept, not the (n, T, I)
    projections and their products. The gammas scale each expert's output rather than its product (the same
    function, rounded once less in half precision)."""

    def _fusedrc_flops(self, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor):
            return 0, 0
        n, inter, hidden = self.gate_proj.shape
        rows = x.numel() // max(1, hidden) * n
        rerun = 4 * rows * hidden * inter
        return rerun + 2 * rows * hidden * inter, rerun

    def _args(self, args, kwargs):
        """(hidden_states, gammas) of a call by position or by the forward's names, else None."""
        names = ("hidden_states", "gammas")
        if len(args) + len(kwargs) != 2 or set(kwargs) - set(names[len(args):]):
            return None
        bound = dict(zip(names, args), **kwargs)
        return bound["hidden_states"], bound["gammas"]

    def forward(self, *args, **kwargs):
        call = self._args(args, kwargs)
        site, act = self.sites.get("experts"), self.__dict__["_fusedrc_act"]
        if call is None or site is None or not site.enabled or inside_region() or not _nohooks(self, self.act_fn) \
                or _act_name(self.act_fn) != act or _inkling_shared_reason(self) is not None:
            return self.plain(*args, **kwargs)
        x, gammas = call
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        n = gate.shape[0]
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.shape[-1] == gate.shape[2]
                and isinstance(gammas, torch.Tensor) and gammas.is_floating_point() and gammas.numel() * x.shape[-1]
                == x.numel() * n and x.device == gate.device == gammas.device
                and (x.dtype == gate.dtype == up.dtype == down.dtype or torch.is_autocast_enabled(x.device.type))):
            return self.plain(*args, **kwargs)

        def fused(h, g):
            flat = h.reshape(-1, h.shape[-1])
            every = torch.arange(n, device=h.device).expand(flat.shape[0], n)
            out = F.moe_experts(flat, every, g.reshape(-1, n), gate, down, act, up_proj=up)
            return out.to(h.dtype).view(h.shape)

        return _run_site(site, fused, self.plain, x, gammas)


# InklingSharedExperts.forward's lines (transformers 5.25)
_INKLING_SHARED_LINES = [
    "input_shape = hidden_states.shape",
    "hidden_states = hidden_states.reshape(1, -1, input_shape[-1]).expand(self.n_shared_experts, -1, -1)",
    "gammas = gammas.reshape(-1, self.n_shared_experts, 1).transpose(0, 1)",
    "gate = torch.bmm(hidden_states, self.gate_proj.transpose(1, 2))",
    "up = torch.bmm(hidden_states, self.up_proj.transpose(1, 2))",
    "activated = self.act_fn(gate) * up * gammas",
    "down = torch.bmm(activated, self.down_proj.transpose(1, 2))",
    "out = down.float().sum(dim=0).to(hidden_states.dtype)",
    "return out.view(input_shape)"]


def _inkling_shared_reason(m):
    """Why Inkling's shared experts ``m`` cannot be one fused experts call now (its weights), or None."""
    gate, up, down = (m._parameters.get(k) for k in ("gate_proj", "up_proj", "down_proj"))
    if not (all(isinstance(t, nn.Parameter) and t.dim() == 3 for t in (gate, up, down))
            and gate.shape == up.shape and down.shape == (gate.shape[0], gate.shape[2], gate.shape[1])
            and getattr(m, "n_shared_experts", None) == gate.shape[0]):
        return "gate_proj/up_proj/down_proj are not (n, I, hidden) / (n, hidden, I) parameters"
    return None


@register_rule("InklingSharedExperts")
def _inkling_shared_experts(ctx, name, m):
    """Inkling's shared experts (its forward checked line by line)."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    act = getattr(m, "act_fn", None)
    reason = _rule_reason(
        [(lines[0].startswith("def forward(self, hidden_states, gammas") and lines[1:] == _INKLING_SHARED_LINES,
          f"{_class_of(m).__name__}.forward is not Inkling's bmm shared experts")],
        act, (m, act), lambda: _inkling_shared_reason(m))
    return _experts_unit(ctx, name, m, reason, FusedInklingSharedExperts, _act_name(act))


class FusedLongcatFlashExperts(_ExpertsCall):
    """LongCat-Flash's experts (``LongcatFlashExperts``): routed gated experts, and identity ("zero")
    experts numbered after them whose output is the token scaled by its routing weight. The routed choices
    are one :func:`fusedrc.functional.moe_experts` call with ``skip_out_of_range=True`` on the first
    ``num_routed_experts`` entries of ``gate_up_proj`` (the class allocates entries for the zero experts
    too and never reads them); the zero experts' choices add ``x`` times their weights' sum. Only the call's
    inputs are kept, and a zero expert costs no GEMM."""

    def _fusedrc_flops(self, args, kwargs):
        # the routed choices only (convert's planning pass: a sync is fine there)
        return _routed_flops(args, kwargs, self.gate_up_proj.shape[1:], self.down_proj.shape[1:],
                             lambda idx: int((idx < self.num_routed_experts).sum()))

    def _fusedrc_ok(self, hs, idx, w):
        return (_longcat_experts_reason(self) is None and _nohooks(self, self.act_fn, self.identity_expert)
                and _act_name(self.act_fn) == self.__dict__["_fusedrc_act"]
                and _routing_ok(hs, idx, w, self.gate_up_proj, self.down_proj)
                and _indices_below(idx, self.total_experts))  # else the original raises (its one_hot)

    def _fusedrc_fused(self, h, i, r):
        routed = self.num_routed_experts
        y = F.moe_experts(h, i, r, self.gate_up_proj[:routed], self.down_proj, self.__dict__["_fusedrc_act"],
                          skip_out_of_range=True)
        zero = (r * (i >= routed)).sum(1, keepdim=True)  # the zero experts' weights, summed per token
        return (y + h * zero).to(h.dtype)


def _indices_below(idx, n):
    """Whether every expert index is in [0, n) (one host sync; not checked under torch.compile)."""
    if idx.numel() == 0 or torch.compiler.is_compiling() or idx.device.type == "meta":
        return True
    lo, hi = torch.stack(torch.aminmax(idx)).tolist()
    return lo >= 0 and hi < n


# LongcatFlashExperts.forward's lines (transformers 5.x)
_LONGCAT_EXPERTS_LINES = [
    "final_hidden_states = torch.zeros_like(hidden_states)",
    "if top_k_index.numel() == 0:", "return final_hidden_states",
    "expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.total_experts).permute(2, 1, 0)",
    "expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)",
    "for expert_idx_tensor in expert_hit:", "expert_idx = int(expert_idx_tensor.item())",
    "selection_idx, token_idx = torch.where(expert_mask[expert_idx].squeeze(0))",
    "if token_idx.numel() == 0:", "continue", "current_state = hidden_states[token_idx]",
    "if expert_idx >= self.num_routed_experts or self.gate_up_proj is None:",
    "current_hidden_states = self.identity_expert(current_state)", "else:",
    "gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)",
    "current_hidden_states = self.act_fn(gate) * up",
    "current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])",
    "current_hidden_states = current_hidden_states * top_k_weights[token_idx, selection_idx, None]",
    "final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(hidden_states.dtype))",
    "return final_hidden_states"]


def _longcat_experts_reason(m):
    """Why LongCat-Flash's experts module ``m`` cannot be one fused experts call now (its weights and
    counts), or None."""
    gate_up, down = m._parameters.get("gate_up_proj"), m._parameters.get("down_proj")
    routed, total = getattr(m, "num_routed_experts", None), getattr(m, "total_experts", None)
    if not (isinstance(routed, int) and isinstance(total, int) and 0 < routed <= total):
        return "no routed experts (num_routed_experts, total_experts)"
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3
            and gate_up.shape[0] == total and down.shape[0] == routed and gate_up.shape[1] == 2 * down.shape[2]
            and gate_up.shape[2] == down.shape[1]):
        return "gate_up_proj/down_proj are not (total_experts, 2I, hidden) / (num_routed_experts, hidden, I) parameters"
    if not isinstance(m._modules.get("identity_expert"), nn.Identity):
        return "its identity_expert is not an nn.Identity"
    return None


def _routing_ok(hs, idx, w, gate_up, down):
    """Whether an experts call's arguments are what the fused op takes: (tokens, hidden) floating states,
    (tokens, k) integer choices and floating weights on their device, in the weights' dtype or under autocast."""
    return (isinstance(hs, torch.Tensor) and hs.dim() == 2 and hs.is_floating_point()
            and isinstance(idx, torch.Tensor) and not idx.is_floating_point() and idx.dim() == 2
            and idx.shape[0] == hs.shape[0] and isinstance(w, torch.Tensor) and w.shape == idx.shape
            and w.is_floating_point() and idx.device == w.device == hs.device
            and (hs.dtype == gate_up.dtype or torch.is_autocast_enabled(hs.device.type))
            and hs.device == gate_up.device and down.dtype == gate_up.dtype)


@register_rule("LongcatFlashExperts")
def _longcat_flash_experts(ctx, name, m):
    """LongCat-Flash's experts with identity experts (``LongcatFlashExperts``, its forward checked line by line);
    since transformers 5.25 transformers' experts interface (its MoE layer routes the identity experts around
    them): the generic rule's."""
    if _looks_experts(m):
        return _experts(ctx, name, m)
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    act = getattr(m, "act_fn", None)
    reason = _rule_reason(
        [(lines[0] == "def forward(self, hidden_states, top_k_index, top_k_weights):"
          and _contains_run(lines, _LONGCAT_EXPERTS_LINES),
          f"{_class_of(m).__name__}.forward is not LongCat-Flash's experts loop")],
        act, (m, *m._modules.values()), lambda: _longcat_experts_reason(m))
    return _experts_unit(ctx, name, m, reason, FusedLongcatFlashExperts, _act_name(act))


class FusedStep3p7Experts(_ExpertsCall):
    """Step-3.7's experts (``Step3p7Experts``: transformers' stacked ``gate_up_proj``/``down_proj`` layout, its
    own loop, a SwiGLU clamped after its activation at ``self.limit``, +inf for "no clamp") as one
    :func:`fusedrc.functional.moe_experts` call (``swiglu_limit``, ``limit_after_act``)."""

    def _fusedrc_flops(self, args, kwargs):
        return _routed_flops(args, kwargs, self.gate_up_proj.shape[1:], self.down_proj.shape[1:])

    def _fusedrc_ok(self, hs, idx, w):
        return (_step3p7_experts_reason(self, self.__dict__["_fusedrc_gate_form"]) is None
                and _nohooks(self, self.act_fn)
                and _act_name(self.act_fn) == self.__dict__["_fusedrc_act"]
                and _routing_ok(hs, idx, w, self.gate_up_proj, self.down_proj)
                and _indices_below(idx, self.num_experts + 1))  # else the original's one_hot raises

    def _fusedrc_fused(self, h, i, r):
        # index num_experts, the expert-parallel sentinel, is skipped as the module's own loop skips it
        gate = _gate_kwargs(self, self.__dict__["_fusedrc_gate_form"])
        return F.moe_experts(h, i, r, self.gate_up_proj, self.down_proj, self.__dict__["_fusedrc_act"],
                             skip_out_of_range=True, **gate).to(h.dtype)


_STEP3P7_EXPERTS_LINES = [
    "final = torch.zeros_like(hidden_states)", "with torch.no_grad():",
    "mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)",
    "hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()", "for expert_idx in hit:",
    "expert_idx = expert_idx[0]", "if expert_idx == self.num_experts:", "continue",
    "top_k_pos, token_idx = torch.where(mask[expert_idx])",
    "current = self._apply_gate(F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]))",
    "current = F.linear(current, self.down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]",
    "final.index_add_(0, token_idx, current.to(final.dtype))", "return final"]
_STEP3P7_GATE_LINES = ["gate, up = gate_up.chunk(2, dim=-1)", "gate = self.act_fn(gate).clamp(max=self.limit)",
                       "up = up.clamp(min=-self.limit, max=self.limit)", "return gate * up"]
# transformers 5.25's: the clamps only while self.limit is not None
_STEP3P7_GATE_OPTIONAL_LINES = ["gate, up = gate_up.chunk(2, dim=-1)", "gate = self.act_fn(gate)",
                                "if self.limit is not None:", "gate = gate.clamp(max=self.limit)",
                                "up = up.clamp(min=-self.limit, max=self.limit)", "return gate * up"]


def _step3p7_experts_reason(m, form):
    """Why Step-3.7's experts module ``m``, gating as ``form`` says, cannot be one fused experts call now, or None."""
    if _gate_kwargs(m, form) is None:
        return f"its SwiGLU limit self.limit = {getattr(m, 'limit', None)!r} is not a number > 0"
    gate_up, down = m._parameters.get("gate_up_proj"), m._parameters.get("down_proj")
    E = getattr(m, "num_experts", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3
            and gate_up.shape[0] == down.shape[0] == E and gate_up.shape[1] == 2 * down.shape[2]
            and gate_up.shape[2] == down.shape[1]):
        return "gate_up_proj/down_proj are not (num_experts, 2I, hidden) / (num_experts, hidden, I) parameters"
    return None


@register_rule("Step3p7Experts")
def _step3p7_experts(ctx, name, m):
    """Step-3.7's experts (``Step3p7Experts``, its forward and ``_apply_gate`` checked line by line)."""
    lines, gate = _forward_lines(ctx, name, m), _source_lines(m, "_apply_gate")
    if lines is None:
        return m
    act, cls = getattr(m, "act_fn", None), _class_of(m).__name__
    # transformers 5.25's gate clamps only while limit is not None; 5.24's takes +inf for no clamp
    form = _STEP3P7_GATE_OPTIONAL if gate is not None and gate[1:] == _STEP3P7_GATE_OPTIONAL_LINES else _STEP3P7_GATE
    reason = _rule_reason(
        [(lines[0] == "def forward(" and _contains_run(lines, _STEP3P7_EXPERTS_LINES),
          f"{cls}.forward is not Step-3.7's experts loop"),
         (gate is not None and gate[1:] in (_STEP3P7_GATE_LINES, _STEP3P7_GATE_OPTIONAL_LINES),
          f"{cls}._apply_gate is not Step-3.7's clamped SwiGLU")],
        act, (m, act), lambda: _step3p7_experts_reason(m, form))
    new = _experts_unit(ctx, name, m, reason, FusedStep3p7Experts, _act_name(act))
    if isinstance(new, FusedStep3p7Experts):
        new.__dict__["_fusedrc_gate_form"] = form
    return new


class FusedDbrxExperts(_ExpertsCall):
    """DBRX's experts (``DbrxExperts``; its ``mlp``, a ``DbrxExpertGLU``, holds every expert's gate ``w1``,
    up ``v1`` and down ``w2`` projections as (num_experts * ffn_hidden_size, hidden) stacks) as one
    :func:`fusedrc.functional.moe_experts` call on views of them (``up_proj`` apart, ``w2`` transposed per
    expert): no copy of a weight, only the call's inputs kept."""

    def _fusedrc_flops(self, args, kwargs):
        inter, hidden = self.ffn_hidden_size, self.hidden_size
        return _routed_flops(args, kwargs, (2 * inter, hidden), (hidden, inter))

    def _fusedrc_ok(self, hs, idx, w):
        mlp = self.mlp
        return (_dbrx_experts_reason(self) is None and _nohooks(self, mlp, mlp.activation_fn)
                and _act_name(mlp.activation_fn) == self.__dict__["_fusedrc_act"]
                and isinstance(hs, torch.Tensor) and hs.dim() >= 2 and hs.shape[-1] == self.hidden_size
                and _routing_ok(hs.reshape(-1, self.hidden_size), idx, w, mlp.w1, mlp.w2)
                and (mlp.v1.dtype, mlp.v1.device) == (mlp.w1.dtype, mlp.w1.device))

    def _fusedrc_fused(self, h, i, r):
        mlp, split = self.mlp, (-1, self.ffn_hidden_size, self.hidden_size)
        y = F.moe_experts(h.reshape(-1, self.hidden_size), i, r, mlp.w1.view(split), mlp.w2.view(split).transpose(1, 2),
                          self.__dict__["_fusedrc_act"], up_proj=mlp.v1.view(split))
        return y.to(h.dtype).view(h.shape[0], -1, self.hidden_size)


# DbrxExperts.forward's lines and its DbrxExpertGLU's (transformers 5.x)
_DBRX_EXPERTS_LINES = [
    "batch_size = hidden_states.shape[0]", "hidden_states = hidden_states.reshape(-1, self.hidden_size)",
    "next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, device=hidden_states.device)",
    "with torch.no_grad():",
    "expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)",
    "expert_mask = expert_mask.permute(2, 1, 0)",
    "expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()",
    "split_expert_shape = (-1, self.ffn_hidden_size, self.hidden_size)", "for expert_idx in expert_hit:",
    "expert_idx = expert_idx[0]", "with torch.no_grad():", "idx, token_idx = torch.where(expert_mask[expert_idx])",
    "v1 = self.mlp.v1.view(split_expert_shape)[expert_idx]", "w1 = self.mlp.w1.view(split_expert_shape)[expert_idx]",
    "w2 = self.mlp.w2.view(split_expert_shape)[expert_idx]",
    "states = self.mlp(hidden_states[token_idx], w1, v1, w2)",
    "states = states.view(-1, self.hidden_size) * top_k_weights[token_idx, idx, None]",
    "next_states.index_add_(0, token_idx, states)", "next_states = next_states.view(batch_size, -1, self.hidden_size)",
    "return next_states"]
_DBRX_GLU_LINES = ["gate_proj = x.matmul(expert_w1.T)", "up_proj = x.matmul(expert_v1.T)",
                   "gate_proj = self.activation_fn(gate_proj)", "intermediate_states = gate_proj * up_proj",
                   "down_proj = intermediate_states.matmul(expert_w2)", "return down_proj"]


def _dbrx_experts_reason(m):
    """Why DBRX's experts module ``m`` cannot be one fused experts call now (its sizes and stacks), or None."""
    mlp, sizes = m._modules.get("mlp"), [getattr(m, k, None) for k in ("num_experts", "ffn_hidden_size", "hidden_size")]
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        return "no num_experts / ffn_hidden_size / hidden_size"
    stacks = [getattr(mlp, k, None) for k in ("w1", "v1", "w2")]
    if not all(isinstance(t, nn.Parameter) and tuple(t.shape) == (sizes[0] * sizes[1], sizes[2]) for t in stacks):
        return "mlp.w1/v1/w2 are not (num_experts * ffn_hidden_size, hidden_size) parameters"
    return None


@register_rule("DbrxExperts")
def _dbrx_experts(ctx, name, m):
    """DBRX's experts (``DbrxExperts`` and its ``DbrxExpertGLU``, both forwards checked line by line)."""
    lines = _forward_lines(ctx, name, m)
    if lines is None:
        return m
    mlp = m._modules.get("mlp")
    glu, act = _source_lines(mlp), getattr(mlp, "activation_fn", None)
    reason = _rule_reason(
        [(lines[0] == "def forward(" and _contains_run(lines, _DBRX_EXPERTS_LINES),
          f"{_class_of(m).__name__}.forward is not DBRX's experts loop"),
         (glu is not None and _contains_run(glu, _DBRX_GLU_LINES),
          f"its mlp's forward ({type(mlp).__name__}) is not DBRX's gated expert")],
        act, (m, mlp, act), lambda: _dbrx_experts_reason(m))
    return _experts_unit(ctx, name, m, reason, FusedDbrxExperts, _act_name(act))


def _rule_reason(code_checks, act, hooked, weights_reason):
    """Why a rule that reads its module's code cannot fuse it, or None: the first failing ``(ok, reason)`` of
    ``code_checks``, then an activation module ``act`` with no fused form, hooks on ``hooked``, then
    ``weights_reason()`` (its parameters and sizes)."""
    for ok, reason in code_checks:
        if not ok:
            return reason
    if _act_name(act) is None:
        return f"activation {type(act).__name__} has no fused form"
    if not _nohooks(*hooked):
        return "hooks registered on the modules"
    return weights_reason()


def _contains_run(lines, run):
    """Whether ``run`` appears in ``lines`` as consecutive lines."""
    n = len(run)
    return any(lines[i:i + n] == run for i in range(len(lines) - n + 1))


class _RecomputeKey:
    """Stands in ``recompute_modules`` for the part of a module a fused unit reruns (its FLOPs are
    measured under this object's id; the module's own id holds its whole forward, a block's cost)."""


@register_rule("T5Block")
def _t5_block(ctx, name, m):
    # the whole layer (attention and FFN sublayers), as Hugging Face's gradient checkpointing
    # recomputes it; not while a KV cache is handed to it
    ctx.block(name, m, when=_no_kv_cache)
    return m


def _source_lines(m, method="forward"):
    """The code lines of ``m``'s class ``method`` (stripped, no blanks or comments; the ``def``
    line first), or None when its source cannot be read."""
    try:
        src = _inspect.getsource(getattr(_class_of(m), method))
    except (AttributeError, OSError, TypeError):
        return None
    return [ln.strip() for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _forward_lines(ctx, unit, m):
    """``_source_lines``, the failure reported: a rule reads them to check the shape of the code it fuses."""
    lines = _source_lines(m)
    if lines is None:
        ctx.skip(unit, f"cannot read {_class_of(m).__name__}.forward to check the FFN")
    return lines


def _inline_ffn(lines):
    """Check that a layer's forward runs ``fc1 -> activation_fn -> [dropout] -> fc2`` on one
    variable, as OPT's ``x = fc1(x); x = act(x); x = fc2(x)`` or BART's
    ``x = act(fc1(x)); x = dropout(x, p=self.activation_dropout); x = fc2(x)``.
    Returns ``(reason or None, dropout)``: ``dropout`` is None, or the names of the layer's attributes
    that its dropout line reads as ``p`` and as ``training`` (``("activation_dropout", "training")``;
    OneFormer's pixel decoder reads ``is_training``)."""
    src = "\n".join(lines)
    if src.count("self.fc1(") != 1 or src.count("self.fc2(") != 1 or src.count("self.activation_fn(") != 1:
        return "the forward does not call fc1 -> activation_fn -> fc2 once each", None
    i = next(k for k, ln in enumerate(lines) if "self.fc1(" in ln)
    j = next((k for k, ln in enumerate(lines) if "self.fc2(" in ln), -1)
    first = _re.fullmatch(r"(\w+) = (self\.activation_fn\()?self\.fc1\(\w+\)(\))?", lines[i])
    if j <= i or first is None or bool(first.group(2)) != bool(first.group(3)):
        return f"unexpected code at fc1: {lines[i]!r}", None
    if not any("self.activation_fn(" in ln for ln in lines[i:j]):
        return "unexpected code: activation_fn is not called between fc1 and fc2", None
    v, dropout, acted = first.group(1), None, bool(first.group(2))
    for ln in lines[i + 1:j]:
        if ln == f"{v} = self.activation_fn({v})":
            acted = True
            continue
        drop = _re.fullmatch(rf"{v} = (?:nn\.functional|F|torch\.nn\.functional)\.dropout\({v}, "
                             rf"p=self\.(\w+), training=self\.(\w+)\)", ln)
        if drop is not None and dropout is None and acted:  # the op's dropout is of the activation
            dropout = drop.groups()
            continue
        return f"unexpected code between fc1 and fc2: {ln!r}", None
    if lines[j] != f"{v} = self.fc2({v})":
        return f"unexpected code at fc2: {lines[j]!r}", None
    return None, dropout


_KV_CACHE_CALLS = [0]  # calls of block-marked layers refused for their KV cache (the budget's error hint)


def _no_kv_cache(args, kwargs):
    """Whether a decoder layer's call may be recomputed: not when it is handed a KV cache, which
    the call updates (a rerun would append the keys and values twice). Such calls run plainly
    (warned about once per call site, by the warnings module's own registry)."""
    # (FSMT's decoder layers take theirs as layer_state)
    caches = [kwargs.get(k) for k in ("past_key_values", "past_key_value", "layer_past", "cache", "layer_state")]
    if all(c is None for c in caches) and not kwargs.get("use_cache"):
        return True
    _KV_CACHE_CALLS[0] += 1
    warnings.warn("fusedrc: a decoder layer marked for recompute was called with a KV cache "
                  "(use_cache=True); such calls run without recompute. Train with use_cache=False "
                  "(config.use_cache = False) to recompute the layers.", stacklevel=3)
    return False


# an inlined FFN's activation_fn set to a function (Mask2Former's, OneFormer's pixel decoder: F.relu)
_FUNCTION_ACTS = {torch.relu: "relu", nn.functional.relu: "relu", nn.functional.gelu: "gelu",
                  nn.functional.silu: "silu", nn.functional.relu6: "relu6", nn.functional.hardswish: "hardswish"}

_INLINE_FFN_LAYERS = (
    "OPTDecoderLayer", "BartEncoderLayer", "BartDecoderLayer", "MBartEncoderLayer", "MBartDecoderLayer",
    "PLBartEncoderLayer", "PLBartDecoderLayer", "MarianEncoderLayer", "MarianDecoderLayer",
    "WhisperEncoderLayer", "WhisperDecoderLayer", "M2M100EncoderLayer", "M2M100DecoderLayer",
    "XGLMDecoderLayer", "BlenderbotEncoderLayer", "BlenderbotDecoderLayer",
    "PegasusEncoderLayer", "PegasusDecoderLayer",
)


def _plain_linear_of(stand_in):
    """An ``nn.Linear`` holding a stand-in's parameters (the same tensors, so the same keys)."""
    lin = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(lin)
    lin.in_features, lin.out_features = stand_in.in_features, stand_in.out_features
    lin.weight, lin.bias = stand_in.weight, stand_in.bias
    lin.training = stand_in.training
    return lin


def _unfuse_inline_ffn(layer) -> bool:
    """Put plain modules back where an earlier convert put an inlined FFN's stand-ins (fc1's
    parameters, the activation module, fc2's), so the rule can plan the layer afresh; False (left
    as it is) when one of them has hooks of its own or is not convert's."""
    head, act, tail = (layer._modules.get(k) for k in ("fc1", "activation_fn", "fc2"))
    if not (isinstance(head, _FFNHead) and isinstance(act, _FFNAct) and isinstance(tail, _FFNTail)) \
            or any(_own_hooks(s) for s in (head, act, tail)):
        return False
    layer._modules["fc1"], layer._modules["fc2"] = _plain_linear_of(head), _plain_linear_of(tail)
    _Switch(layer, activation_fn=act.__dict__["_fusedrc_act_mod"])()
    return True


def _hf_layer(m):
    """A Hugging Face layer: what its own gradient checkpointing recomputes."""
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__[1:])


def _looks_inline_ffn_layer(m):
    """Found by shape, not class name: a Hugging Face layer holding ``fc1``/``fc2`` Linears and an
    ``activation_fn`` (BioGPT, LED, TrOCR, Speech2Text, MusicGen, ... copy BART's layer; FSMT's
    ``EncoderLayer``/``DecoderLayer``, transformers classes named ``*Layer`` but no checkpointing layers: an
    MLP module of that shape, ViT's, is the fx pass's); its forward's code is checked as the named ones' is."""
    cls = _class_of(m)
    hf = _hf_layer(m) or cls.__module__.startswith("transformers.models.") and cls.__name__.endswith("Layer")
    if not (hf and not isinstance(m, Wrapper) and hasattr(m, "activation_fn")
            and all(isinstance(m._modules.get(k), nn.Linear) for k in ("fc1", "fc2"))):
        return False
    lines = _source_lines(m)  # only a forward that passes the rule's code check: the others are the fx pass's
    return lines is not None and _inline_ffn(lines)[0] is None


@register_rule(*_INLINE_FFN_LAYERS)
def _inline_ffn_layer(ctx, name, m):
    """Hugging Face layers whose forward inlines the FFN on ``self.fc1``/``activation_fn``/``fc2``
    (OPT, BART and its descendants, Whisper, ...; others by shape, ``_looks_inline_ffn_layer``)."""
    ctx.block(name, m, when=_no_kv_cache)
    unit = _join(name, "fc1")
    if _foreign_forward(m):
        ctx.skip(unit, f"{type(m).__name__} has a forward set on the instance: its code is not the class's")
        return m
    if isinstance(m.__dict__["_modules"].get("fc1"), _FFNHead) and not _unfuse_inline_ffn(m):
        ctx.skip(unit, "converted already, by an earlier fusedrc.convert (hooks on its stand-ins)")
        return m
    lines = _forward_lines(ctx, unit, m)
    if lines is None:
        return m
    reason, dropout = _inline_ffn(lines)
    if reason is not None:
        ctx.skip(unit, f"{type(m).__name__}: {reason}")
        return m
    fn = m.activation_fn
    act = _act_name(fn) if isinstance(fn, nn.Module) else _FUNCTION_ACTS.get(fn)
    if act is None:
        what = type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, "__name__", type(fn).__name__)
        ctx.skip(unit, f"activation {what} has no fused form")
        return m
    if not (is_linear(m.fc1) and is_linear(m.fc2)) or not _nohooks(m.fc1, m.fc2, fn if isinstance(fn, nn.Module) else None):
        ctx.skip(unit, "fc1/fc2 are not plain nn.Linear without hooks")
        return m
    fc1, act_mod, fc2 = m.fc1, m.activation_fn, m.fc2
    # the head reads fc2's parameters from the tail, the module registered in the tree, so that
    # anything replacing registered parameters (load_state_dict(assign=True), FSDP2) reaches both
    tail = _FFNTail(fc2, m)
    act_slot = _FFNAct(act_mod, m)
    head = _FFNHead(fc1, act, m, dropout)
    ctx.unit(unit, "ffn", _Switch(m, fc1=head, activation_fn=act_slot, fc2=tail),
             _Switch(m, fc1=fc1, activation_fn=act_mod, fc2=fc2), (fc1,))
    return m


# --------------------------------------------------------------------------- Sequential and fx passes


def _seq_groups(seq, prefix, ctx):
    mods = list(seq._modules.values())
    keys = list(seq._modules.keys())
    groups, i = [], 0
    while i < len(mods):
        m = mods[i]
        if _is_conv2d(m) and i + 1 < len(mods) and type(mods[i + 1]) in (nn.BatchNorm2d, nn.SyncBatchNorm):
            # Conv-BN and the activation after it when it has a fused form (else it runs on its own)
            nxt = mods[i + 2] if i + 2 < len(mods) else None
            act = nxt if nxt is not None and _act_name(nxt) is not None else None
            reason = _static_cbr(m, mods[i + 1], act)
            if reason is None:
                end = i + (3 if act is not None else 2)
                groups.append((i, end, _cbr_kind(act), None, (m,)))
                i = end
                continue
            ctx.skip(_join(prefix, keys[i]), reason)
        if type(m) in (nn.BatchNorm2d, nn.SyncBatchNorm) and i + 2 < len(mods) and _is_act_module(mods[i + 1]) \
                and type(mods[i + 2]) is nn.Conv2d:
            # BN -> act -> Conv (pre-activation; a Conv-BN before it was grouped above)
            reason = _static_bac(m, mods[i + 1], mods[i + 2])
            if reason is None:
                groups.append((i, i + 3, _bac_kind(mods[i + 1]), None, (m,)))
                i += 3
                continue
            # a Conv just before it, in no group, tried this BN and reported why not
            if i == 0 or type(mods[i - 1]) is not nn.Conv2d or (groups and groups[-1][1] == i):
                ctx.skip(_join(prefix, keys[i]), reason)
        if _widening_pointwise(m) and i + 1 < len(mods) and _is_act_module(mods[i + 1]):
            # 1x1 conv -> act -> [Dropout] -> 1x1 conv (RDNet's, a ConvNeXt written with convs): an FFN over
            # each pixel's channels
            act, j = _act_name(mods[i + 1]), i + 2
            while j < len(mods) and isinstance(mods[j], nn.Dropout):
                j += 1
            if j < len(mods) and _pointwise_ffn(m, mods[j]):
                if act is None:
                    ctx.skip(_join(prefix, keys[i]), f"activation {type(mods[i + 1]).__name__} has no fused form")
                elif not _static_dropouts_ok(mods[i + 2:j]):
                    ctx.skip(_join(prefix, keys[i]), "dropouts between the FFN's convs other than one "
                                                     "nn.Dropout: no fused form")
                else:
                    groups.append((i, j + 1, "conv_ffn", act, (m,)))
                    i = j + 1
                    continue
        if is_linear(m) and i + 1 < len(mods) and _is_act_module(mods[i + 1]):
            act = _act_name(mods[i + 1])
            j = i + 2
            drops = []
            while j < len(mods) and isinstance(mods[j], nn.Dropout):
                drops.append(mods[j])
                j += 1
            if j < len(mods) and is_linear(mods[j]) and mods[j].in_features == m.out_features:
                if act is None:
                    ctx.skip(_join(prefix, keys[i]), f"activation {type(mods[i + 1]).__name__} has no fused form")
                elif not _static_dropouts_ok(drops):
                    ctx.skip(_join(prefix, keys[i]), "dropouts between the FFN's Linears other than one "
                                                     "nn.Dropout: no fused form")
                else:
                    # a norm just before, in no group, runs inside the FFN's op (a pre-norm FFN sublayer)
                    normed = i > 0 and norm_kind(mods[i - 1]) is not None and not (groups and groups[-1][1] > i - 1)
                    groups.append((i - 1, j + 1, "norm_ffn", act, (m,)) if normed else (i, j + 1, "ffn", act, (m,)))
                    i = j + 1
                    continue
            elif act is not None:
                groups.append((i, i + 2, "linear_act", act, (m,)))
                i += 2
                continue
        i += 1
    return groups


def _is_act_module(m):
    return _act_name(m) is not None or type(m).__name__ in _HF_ACTS or isinstance(
        m, (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Hardswish, nn.Hardtanh,
            nn.Hardsigmoid))


def _sequential(ctx, name, seq):
    groups = _seq_groups(seq, name, ctx)
    if not groups:
        return seq
    new = _FusedSequential.wrap(seq)
    keys = list(seq._modules.keys())
    for start, end, kind, act, rec in groups:
        key = keys[start + 1] if kind == "norm_ffn" else keys[start]  # an FFN's unit is named by its fc1
        if kind == "norm_ffn":
            ctx.joined_norms.add(id(seq[start]))
        site = _site_unit(ctx, new, _join(name, key), key, kind, rec)
        new.groups[start] = (kind, site, act, tuple(seq._modules.values())[start:end])
    return new


_PLAIN = (bool, int, float, str, type(None))
_MISSING = object()


def _plain_attrs(module, names, mods=None):
    """``{name: {attribute: value}}`` of the plain-valued attributes (bool, int, float, str, None;
    not ``training``, not private) of ``module`` ("") and its submodules ``names`` (``mods``: the
    same, resolved)."""
    mods = [module.get_submodule(n) for n in names] if mods is None else mods
    return {n: {k: v for k, v in m.__dict__.items() if type(v) in _PLAIN and k != "training" and not k.startswith("_")}
            for n, m in zip(("", *names), (module, *mods))}


class _FxForward:
    """The instance ``forward`` of a model rewritten by the fx pass: the rewritten graph's code run
    on the model itself, so its attributes, methods, hooks and live parameters and buffers are the
    model's (``model.to(...)`` reaches them). An object, not a closure: the model pickles, and an
    ``nn.DataParallel`` replica gets one bound to itself.

    A forward whose graph depends on the training mode (``F.dropout(training=self.training)``)
    has one graph per mode (``by_mode``), picked at each call by the module's mode.

    The graph holds the code of the submodules it does not call (``inlined``: their names) and
    calls the others by name (``called``). When one of the inlined ones is no longer the module
    traced (replaced or deleted: timm's ``reparameterize_model``), has hooks or a forward of its
    own (added after convert, a ``fusedrc.mark``), or is in the other training mode than the
    module (a per-mode graph), or a called one is gone, the class's own forward runs, unfused:
    the model then computes what it would unconverted."""

    def __init__(self, module, gm, by_mode=None, inlined=(), called=(), frozen=None):
        self.module, self.gm, self.by_mode, self.inlined = module, gm, by_mode, tuple(inlined)
        self.called = tuple(called)
        # the plain attributes (flags, rates) of the module and of those it inlined, as traced: fx
        # froze their values into the graph (timm's grad_checkpointing, a drop rate)
        self.frozen = _plain_attrs(module, inlined) if frozen is None else frozen
        self._watched = None  # resolved at the first call

    def _fusedrc_rebind(self, replica):
        return _FxForward(replica, self.gm, self.by_mode, self.inlined, self.called, self.frozen)

    @property
    def __code__(self):  # read as a plain function's by torch.export (non-strict) for its shape env's name
        return type(self.gm).forward.__code__

    def _slot(self, name):
        """(parent, key, the module there now) of a submodule name."""
        parent_name, _, key = name.rpartition(".")
        parent = self.module.get_submodule(parent_name) if parent_name else self.module
        return parent, key, parent._modules.get(key)

    def _graph(self):
        """The graph to run now, or None: the class's forward (see the class docstring)."""
        watched = getattr(self, "_watched", None)
        if watched is None:
            try:
                watched = ([self._slot(n) for n in self.inlined],
                           [self._slot(n)[:2] for n in getattr(self, "called", ())])
            except AttributeError:  # a module on the way is gone already
                return None
            self._watched = watched
        inlined, called = watched
        mode = self.module.training
        for parent, key, m in inlined:
            if (parent._modules.get(key) is not m or _own_hooks(m) or "forward" in m.__dict__
                    or self.by_mode is not None and m.training != mode):
                return None
        if any(parent._modules.get(key) is None for parent, key in called):
            return None
        frozen = getattr(self, "frozen", None)
        if frozen:  # (in the order of ("", *inlined): _plain_attrs)
            for m, attrs in zip((self.module, *(m for _, _, m in inlined)), frozen.values()):
                d = m.__dict__
                if any(d.get(k, _MISSING) != v for k, v in attrs.items()):
                    return None
        return self.gm if self.by_mode is None else self.by_mode[mode]

    def __call__(self, *args, **kwargs):
        gm = self._graph()
        fused = self.module.__dict__.get("_fusedrc_fx_entry")
        if fused is not None and len(args) == 1 and not kwargs:
            # the norm before this module passed x through: the graph's first chain (x's one user) runs it
            norm, norm_args = _armed_norm(self.module, args[0])
            if norm is not None:
                if gm is None or norm_args is None:
                    args = (norm.plain(args[0]),)
                else:
                    fused.__dict__.setdefault("_fusedrc_pending", {})[_threading.get_ident()] = norm
                    try:
                        return type(gm).forward(self.module, *args)
                    finally:
                        fused.__dict__["_fusedrc_pending"].pop(_threading.get_ident(), None)
        if gm is None:
            return type(self.module).forward(self.module, *args, **kwargs)
        return type(gm).forward(self.module, *args, **kwargs)


class _FxConsumer:
    """An fx-rewritten MLP module's consumer interface (``_fusedrc_fusable``, ``_fusedrc_site``: set on the
    instance) for the norm before it: its graph's input feeds only its first FFN chain (checked by the fx
    pass), which runs the norm when the norm passed its input through."""

    def __init__(self, module, fused, what):
        self.module, self.fused, self.what = module, fused, what

    def _fusedrc_rebind(self, replica):
        return _FxConsumer(replica, self.fused, self.what)

    def __call__(self, x=None):
        site = self.fused.site
        if self.what == "site":
            return site
        fx = self.module.__dict__.get("forward")
        return site.enabled and isinstance(fx, _FxForward) and fx._graph() is not None


def _symbolic_trace(model, concrete_args=None, flipped=False, leaves=frozenset()):
    """``torch.fx.symbolic_trace``, keeping as called modules (leaves, not inlined) the activation
    modules of any library (Hugging Face's GELUActivation, ...) and the modules with hooks or an
    instance forward: the graph then calls whatever sits at their names at run time, so an
    activation swapped in, a hook added or removed after convert, act as they would unconverted."""
    import torch.fx as fx

    class _Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            # also kept as calls: a marked module, a converted one (a rule's Wrapper, a fused unit)
            # and any module with an instance forward (mark's, an earlier fx rewrite's): inlined,
            # the graph would run the plain computation without the recompute
            # a norm the fused FFN models (timm's LayerNorm, Hugging Face's RMSNorms) too: traced through, it
            # would be an F.layer_norm call the chain before an FFN cannot join, and no norm unit
            return (super().is_leaf_module(m, qualname) or _is_act_module(m) or _affine_act(m) is not None
                    or _own_hooks(m) or is_linear(m) or is_conv_same(m) or is_mixed_conv(m)
                    or _is_bn_act(m) or (id(m) in leaves or _hf_layer(m)) and m is not model  # blocks: marked later
                    or m is not model and norm_kind(m) is not None
                    or "forward" in m.__dict__
                    or isinstance(m, (Wrapper, _FusedSequential, _FFNHead, _FFNAct, _FFNTail, _FxFused)))

        def create_node(self, *args, **kwargs):
            # fx records tensor ops only: an op traced under another grad mode, autocast state or
            # saved-tensors hooks (a no_grad / autocast block, a recompute or checkpoint call in the
            # forward) would lose that context in the graph
            if _trace_context() != self.context:
                raise _ContextChanged
            return super().create_node(*args, **kwargs)

    tracer = _Tracer()
    # grad mode on: a recompute/checkpoint call in the forward then pushes its hooks (seen above).
    # ``flipped``: grad mode off and CPU autocast on instead, so that an enable_grad or an
    # autocast(enabled=False) block in the forward is a change too
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad() if flipped else torch.enable_grad())
        if flipped:
            stack.enter_context(torch.autocast("cpu"))
            # CUDA's flag set directly: torch.autocast("cuda") disables itself on a machine without CUDA,
            # and a model converted there may run its forward's autocast("cuda", enabled=False) later
            cuda_enabled = torch.is_autocast_enabled("cuda")
            torch.set_autocast_enabled("cuda", True)
            stack.callback(torch.set_autocast_enabled, "cuda", cuda_enabled)
        tracer.context = _trace_context()
        # a random draw while tracing (LayerDrop's `if torch.rand([]) < p:`) would be frozen into
        # the graph: seen as a moved RNG state, which is then put back (convert draws nothing)
        states = _rng_states()
        try:
            graph = tracer.trace(model, concrete_args=concrete_args)
        finally:
            drew = _rng_moved(states)
        if drew:
            raise _RandomAtTrace
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    # the modules whose code the graph holds (their attributes, `training` among them, frozen in
    # it): all but the ones it calls, and what those hold
    called = [n.target for n in graph.nodes if n.op == "call_module"]
    gm.__dict__["_fusedrc_inlined"] = {
        name for name, _ in model.named_modules(remove_duplicate=False)
        if name and not any(name == c or name.startswith(c + ".") for c in called)}
    gm.__dict__["_fusedrc_called"] = set(called)
    return gm


def _rng_states():
    """The random generators a forward may draw from in Python: torch's (CPU, and CUDA's when
    initialized), Python's ``random`` (MusicGen's LayerDrop) and NumPy's (when imported)."""
    np = _sys.modules.get("numpy")
    return (torch.random.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            _random.getstate(), np.random.get_state() if np is not None else None)


def _rng_moved(states) -> bool:
    """Whether any generator moved since ``_rng_states()``; each is put back where it was."""
    cpu, cuda, py, npy = states
    moved = not torch.equal(cpu, torch.random.get_rng_state())
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        now = torch.cuda.get_rng_state_all()
        moved |= any(not torch.equal(a, b) for a, b in zip(cuda, now))
        torch.cuda.set_rng_state_all(cuda)
    moved |= _random.getstate() != py
    _random.setstate(py)
    if npy is not None:
        np = _sys.modules["numpy"]
        now = np.random.get_state()
        moved |= now[1].tobytes() != npy[1].tobytes() or now[2:] != npy[2:]
        np.random.set_state(npy)
    return moved


class _RandomAtTrace(RuntimeError):
    """The forward drew random numbers while fx traced it (random control flow)."""


class _ContextChanged(RuntimeError):
    """A traced op ran under another grad mode, autocast state or saved-tensors hooks."""


def _trace_context():
    return (
        torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
        tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
        top_saved_tensors_pack(),
    )


def _fx_trace(model, leaves=frozenset()):
    """``(graphs, None)`` for a ``model`` whose torch.fx graphs hold for every call, else
    ``(None, reason)``. ``graphs`` maps a training mode to its graph: ``{None: graph}`` when the
    graph is the same in both modes; one per mode when the forward reads ``training`` (fx freezes
    the mode it traces in, e.g. ``F.dropout(training=self.training)``); see ``_FxForward``.
    Refused: a forward that does not trace, or whose graph depends on whether a defaulted argument
    is passed (fx traces ``if mask is not None:`` as taken, and a call without ``mask`` would then
    fail or compute something else)."""

    cls = type(model).__name__
    if "forward" in model.__dict__:  # set by a library's hook (accelerate's, for one)
        return None, f"{cls} has an instance forward (torch.fx traces the class's); no fx rewrite"
    try:
        params = list(_inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None, f"{cls}.forward has no readable signature; no fx rewrite"
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None, f"{cls}.forward takes *args or **kwargs; no fx rewrite"
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    required = [p.name for p in params if p.default is p.empty]
    modes = [(m, m.training) for m in model.modules()]
    graphs = {}
    try:
        for training in (True, False):
            model.train(training)
            gm = _symbolic_trace(model, leaves=leaves)
            if training:
                _symbolic_trace(model, flipped=True, leaves=leaves)  # the context checks only
            as_default = _symbolic_trace(model, concrete_args=defaults, leaves=leaves) if defaults else gm
            if _graph_ops(gm) != _graph_ops(as_default, bool(defaults), required):
                return None, (f"{cls}.forward computes something else when its defaulted arguments "
                              f"({', '.join(defaults)}) are left out (torch.fx traces one case); no fx rewrite")
            graphs[training] = gm
    except _ContextChanged:
        return None, (f"{cls}.forward changes the grad mode, autocast or saved-tensors hooks (no_grad, "
                      "autocast, recompute or checkpoint inside), which torch.fx does not record; no fx rewrite")
    except _RandomAtTrace:
        return None, (f"{cls}.forward draws random numbers in Python (random control flow such as LayerDrop), "
                      "which torch.fx would freeze; no fx rewrite")
    except Exception as e:  # noqa: BLE001 - any tracing failure means: no fx rewrite
        return None, f"torch.fx cannot trace {cls} ({type(e).__name__}); no fx rewrite"
    finally:
        for m, training in modes:
            m.training = training
    if graphs[True].code == graphs[False].code:
        return {None: graphs[True]}, None
    return graphs, None


def _graph_ops(gm, specialized=False, required=()):
    """A graph's computation without its inputs; with ``specialized``, also without the checks
    fx adds for ``concrete_args`` (the nodes reading an input not named in ``required``)."""
    checks, ops = set(), []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if specialized and n.target not in required:
                checks.add(n)
        elif checks.intersection(n.all_input_nodes):
            checks.add(n)
        else:
            ops.append((n.op, str(n.target), repr(n.args), repr(n.kwargs)))
    return ops


def _sequential_tail_conv(m):
    """The last module of fused Sequential ``m`` when it is a Conv2d in none of its groups (timm's deep
    stem ends so; the model's ``bn1`` and ``act1`` follow it), else None."""
    if not isinstance(m, _FusedSequential) or not len(m):
        return None
    last = len(m) - 1
    if any(start <= last < start + len(g[3]) for start, g in m.groups.items()):
        return None
    return m[last] if _static_conv_ok(m[last], asymmetric=True) else None


def _fx_chains(gm, prefix, skip):
    """The fusable chains of an fx graph, in graph order: ``(key, node, chain, kind, modules, act, packed)``
    (``key`` names the chain by its ops and modules, the same in another trace of the forward; ``modules``
    has one entry per chain node, None where the call needs no module (a product, a chunk, a written-out
    activation's later ops); ``packed`` the gate's half of a packed gated FFN, else None);
    ``skip(name, reason)`` hears of the patterns left as they are."""
    mods = dict(gm.named_modules())

    def mod(node):
        return mods.get(node.target) if node.op == "call_module" else None

    def single(node):
        return len(node.users) == 1 and next(iter(node.users))

    def act_of(node):
        """(fused activation name, an equivalent module) of an activation node, or (None, None)."""
        if not node:
            return None, None
        if node.op == "call_module":
            a = mod(node)
            return (_act_name(a), a) if _act_name(a) is not None else (None, None)
        # inplace=True is fine: act_of sees only an activation that is its input's one user (single())
        if node.op != "call_function":
            return None, None
        if node.target in (torch.relu, nn.functional.relu):
            return "relu", nn.ReLU()
        if node.target is nn.functional.silu:
            return "silu", nn.SiLU()
        if node.target is nn.functional.relu6:
            return "relu6", nn.ReLU6()
        if node.target is nn.functional.hardswish:
            return "hardswish", nn.Hardswish()
        if node.target is nn.functional.gelu:
            approx = node.kwargs.get("approximate", "none")
            return {"none": "gelu", "tanh": "gelu_tanh"}.get(approx), nn.GELU(approximate=approx)
        if node.target is nn.functional.leaky_relu:
            slope = node.args[1] if len(node.args) > 1 else node.kwargs.get("negative_slope", 0.01)
            # a number fixed in the code (not a tensor or a value computed in the graph)
            if type(slope) in (int, float) and math.isfinite(slope):
                return leaky_relu_name(slope), nn.LeakyReLU(slope)
        return None, None

    def plain_args(c):
        kw = dict(c.kwargs)
        kw.pop("inplace", None)
        kw.pop("approximate", None)
        kw.pop("negative_slope", None)
        max_args = 2 if c.target is nn.functional.leaky_relu else 1  # its slope may be positional
        return 1 <= len(c.args) <= max_args and not kw

    def is_mul(n, a, b):
        """Whether ``n`` computes ``a * b`` (either order) and nothing more."""
        return bool(n) and a is not b and not n.kwargs and len(n.args) == 2 and set(n.args) == {a, b} and (
            n.op == "call_function" and n.target in (operator.mul, torch.mul) or n.op == "call_method" and n.target == "mul")

    def chunk_items(n, src):
        """``(first half, second half)`` getitem nodes of ``n = src.chunk(2, dim=-1)``, each half's only
        reader, or None."""
        dim = n.args[2] if len(n.args) == 3 else n.kwargs.get("dim")
        if not (n.op == "call_method" and n.target == "chunk" and n.args[:1] == (src,) and len(n.args) >= 2
                and n.args[1] == 2 and dim == -1 and len(n.args) + len(n.kwargs) == 3 and set(n.kwargs) <= {"dim"}):
            return None
        items = {u.args[1]: u for u in n.users if u.op == "call_function" and u.target is operator.getitem
                 and len(u.args) == 2 and u.args[0] is n and not u.kwargs}
        return (items[0], items[1]) if len(n.users) == 2 and set(items) == {0, 1} else None

    def drops_after(n):
        """``(Dropout/Identity nodes, the node after them)``: the run of them that reads ``n``, each the
        one reader of the one before."""
        drops, nxt = [], single(n)
        while nxt and (isinstance(mod(nxt), nn.Dropout) or type(mod(nxt)) is nn.Identity):
            drops.append(nxt)
            nxt = single(nxt)
        return drops, nxt

    def norm_before(node, readers):
        """The norm module's node whose output ``node`` reads, when ``readers`` (an FFN's first Linear, a
        gated one's gate and up) are all that read it: the norm then runs inside the FFN's op. Else None."""
        src = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        if (isinstance(src, torch.fx.Node) and src.op == "call_module" and src not in taken
                and set(src.users) == readers and norm_kind(mod(src)) is not None
                and len(src.args) == 1 and not src.kwargs):
            return src
        return None

    def gate_act(h):
        """``(act, module, nodes)`` of the activation applied to ``h`` alone: one node (a module or a
        function, reading ``h``) or written out (``written_act``); ``(None, None, None)`` otherwise."""
        n = single(h)
        act, a = act_of(n)
        if act is not None and plain_args(n) and n.args[0] is h:
            return act, a, [n]
        w = written_act(h)
        return w if w is not None else (None, None, None)

    def gated(node):
        """``(chain, modules, act, packed)`` of a gated FFN whose first Linear is ``node``: ``act(g(v)) *
        u(v)`` (g = ``node``, u a Linear of the same ``v`` and shape; Llama's, timm's SwiGLU), or one Linear's
        output halves, ``fc1(v).chunk(2, dim=-1)``, one through act times the other (timm's GluMlp and
        SwiGLUPacked; ``packed``: the gate's half); then Dropout/Identity modules and the down Linear
        reading the product. Laid out as ``_gated_parts`` reads it. None for anything else."""
        m, n1 = mod(node), single(node)
        if len(node.args) != 1 or node.kwargs:
            return None
        items = chunk_items(n1, node) if n1 else None
        if items is not None:
            if m.out_features % 2:
                return None
            for packed in (0, 1):
                act, a, acts = gate_act(items[packed])
                mul = act is not None and single(acts[-1])
                if mul and single(items[1 - packed]) is mul and is_mul(mul, acts[-1], items[1 - packed]):
                    break
            else:
                return None
            width = m.out_features // 2
            chain, modules = [node, *acts, n1, *items, mul], [m, a] + [None] * (len(acts) + 3)
        else:
            act, a, acts = gate_act(node)
            mul = act is not None and single(acts[-1])
            if not mul or not (len(mul.args) == 2 and acts[-1] in mul.args):
                return None
            up_node = mul.args[1] if mul.args[0] is acts[-1] else mul.args[0]
            up = mod(up_node) if isinstance(up_node, torch.fx.Node) else None
            if not (is_linear(up) and single(up_node) is mul and is_mul(mul, acts[-1], up_node)
                    and up_node.args == node.args and not up_node.kwargs and up.weight.shape == m.weight.shape
                    and (up.bias is None) == (m.bias is None)):
                return None
            chain, modules = [node, *acts, up_node, mul], [m, a] + [None] * (len(acts) - 1) + [up, None]
            width, packed = m.out_features, None
        drops, nxt = drops_after(mul)
        down = mod(nxt) if nxt else None
        if not (is_linear(down) and down.in_features == width) \
                or any(not plain_args(c) or c.args[0] is not prev for prev, c in zip([mul, *drops], [*drops, nxt])):
            return None
        if not _static_dropouts_ok([mod(d) for d in drops]):
            skip(_join(prefix, node.target), "dropouts between the gated FFN's product and its down Linear other "
                                             "than one nn.Dropout: no fused form")
            return None
        return [*chain, *drops, nxt], [*modules, *map(mod, drops), down], act, packed

    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def written_act(h):
        """``(fused name, _WrittenAct, its nodes in graph order)`` of an activation written out as
        elementwise ops on ``h`` (ESM's erf GELU, a Swish): the smallest set of ``_pointwise`` nodes that
        holds every reader of ``h``, reads nothing else but numbers, has one value read outside it (its
        last node's) and computes a fused activation (``_probe_act``); None where there is none."""
        region, todo = [], list(h.users)
        while todo and len(region) < 16:
            n = todo.pop(0)
            if n not in region and _pointwise(n):
                region.append(n)
                todo.extend(n.users)
        region.sort(key=order.__getitem__)
        for sink in region:
            sub, stack, closed = {sink}, [sink], True
            while stack and closed:  # the ops the sink's value depends on, back to h
                for a in stack.pop().all_input_nodes:
                    if a is h or a in sub:
                        continue
                    closed = a in region
                    if not closed:
                        break
                    sub.add(a)
                    stack.append(a)
            if not closed or not set(h.users) <= sub or any(u not in sub for n in sub - {sink} for u in n.users):
                continue
            nodes = sorted(sub, key=order.__getitem__)
            graph = _act_graph(h, nodes, sink)
            name = _probe_act(graph)
            if name is not None:
                return name, _WrittenAct(graph, name), nodes
        return None

    found, taken, said = [], set(), {}  # said: node -> the reason reported for it

    def report(node, reason):
        said[node] = reason
        skip(_join(prefix, node.target), reason)

    def report_bn(node, reason):
        # not again when the Conv before it reported the same (Conv -> BatchNormAct2d(drop) -> Conv)
        src = node.args[0] if node.args else None
        if said.get(src) != reason:
            report(node, reason)

    for node in list(gm.graph.nodes):
        if node in taken:  # in an earlier chain (Linear-act-Linear-act: the second Linear)
            continue
        m = mod(node)
        chain, packed, written = None, None, []  # written: an activation's nodes, written out (its last read on)
        if type(m) in (nn.BatchNorm2d, nn.SyncBatchNorm):
            # BN -> act -> Conv, the pre-activation order (a Conv before the BN took it first)
            n1 = single(node)
            act, a = act_of(n1)
            n2 = act is not None and single(n1)
            if n2 and type(mod(n2)) is nn.Conv2d:
                reason = _static_bac(m, a, mod(n2))
                if reason is not None:
                    report_bn(node, reason)
                else:
                    chain, kind, modules = [node, n1, n2], _bac_kind(a), [m, a, mod(n2)]
        elif _is_bn_act(m) and _bn_act_name(m):
            # timm's BatchNormAct2d -> Conv (timm's DenseNet, pre-activation ResNetV2)
            n1 = single(node)
            if n1 and type(mod(n1)) is nn.Conv2d:
                reason = _static_bac(m, None, mod(n1))
                if reason is not None:
                    report_bn(node, reason)
                else:
                    chain, kind, modules, act = [node, n1], _bac_kind(m.act), [m, mod(n1)], _bn_act_name(m)
        elif (cv := m if _static_conv_ok(m, asymmetric=True) else _sequential_tail_conv(m)) is not None:
            # (cv: the conv; m a fused Sequential ending in it, timm's deep stem, whose bn1 and act1 follow)
            n1 = single(node)
            if n1 and _is_bn_act(mod(n1)) and mod(n1).num_features == cv.out_channels:
                bn = mod(n1)
                reason = _static_cbr(cv, bn, None)
                if reason is not None:
                    report(node, reason)
                else:  # timm's BatchNorm + act in one module
                    act = _bn_act_name(bn)
                    kind = "conv_bn" if act is None else _cbr_kind(bn.act)
                    chain, modules = [node, n1], [m, bn]
            elif n1 and isinstance(mod(n1), nn.SyncBatchNorm):
                report(node, _static_cbr(cv, mod(n1), None))
            elif n1 and type(mod(n1)) is nn.BatchNorm2d and mod(n1).num_features == cv.out_channels:
                ids, n2 = [], single(n1)
                while n2 and type(mod(n2)) is nn.Identity:  # timm's drop_block placeholders
                    ids.append(n2)
                    n2 = single(n2)
                act, a = act_of(n2)
                if act is None and (w := written_act(ids[-1] if ids else n1)) is not None:
                    act, a, written = w
                if written:
                    chain, kind = [node, n1, *ids, *written], _cbr_kind(a)
                    modules = [m, mod(n1), *map(mod, ids), a] + [None] * (len(written) - 1)
                elif act is not None:
                    chain, kind, modules = [node, n1, *ids, n2], _cbr_kind(a), [m, mod(n1), *map(mod, ids), a]
                else:  # Conv-BN; what follows (an activation with no fused form, an add, ...) runs as is
                    chain, kind, modules = [node, n1], "conv_bn", [m, mod(n1)]
            elif _widening_pointwise(m) and n1 and (a := act_of(n1))[0] is not None:
                # 1x1 conv -> act -> [Dropout] -> 1x1 conv (SwiftFormer's ConvEncoder): an FFN over each pixel's
                # channels, as the Sequential pass finds it
                drops, nxt = drops_after(n1)
                if nxt and _pointwise_ffn(m, mod(nxt)):
                    if not _static_dropouts_ok([mod(d) for d in drops]):
                        skip(_join(prefix, node.target), "dropouts between the FFN's convs other than one "
                                                         "nn.Dropout: no fused form")
                    else:
                        act, a = a
                        chain, kind, modules = [node, n1, *drops, nxt], "conv_ffn", [m, a, *map(mod, drops), mod(nxt)]
        elif is_linear(m) and (g := gated(node)) is not None:
            chain, modules, act, packed = g
            kind, readers = "gated_ffn", {c for c, x in zip(chain[:-1], modules) if is_linear(x)}  # gate (and up)
            # a norm module whose readers are the gate and up Linears runs inside the op, as for the FFN
            src = norm_before(node, readers)
            if src is not None:
                chain, kind, modules = [src, *chain], "norm_gated_ffn", [mod(src), *modules]
        elif is_linear(m):
            n1 = single(node)
            act, a = act_of(n1)
            acts = [n1]
            # an activation with learned scale and bias (StarReLU): folded into an FFN's second Linear
            affine = act is None and n1 and plain_args(n1) and n1.args[0] is node and _affine_act(mod(n1))
            if affine:
                act, a = affine[0], mod(n1)
            if act is None and (w := written_act(node)) is not None:
                act, a, written = w
                acts, n1 = written, written[-1]
            pad = [None] * (len(acts) - 1)  # the written-out activation's other nodes: no module
            if act is None and n1 and _is_act_module(mod(n1)):
                skip(_join(prefix, node.target), f"activation {type(mod(n1)).__name__} has no fused form")
            if act is not None:
                drops, nxt = drops_after(n1)
                if nxt and is_linear(mod(nxt)) and mod(nxt).in_features == m.out_features:
                    if not _static_dropouts_ok([mod(d) for d in drops]):
                        skip(_join(prefix, node.target), "dropouts between the FFN's Linears other than one nn.Dropout: "
                                              "no fused form")
                    elif affine and _chain_dropout_p([mod(d) for d in drops], training=True) != 0:
                        skip(_join(prefix, node.target), f"{type(a).__name__}'s bias does not fold through the "
                                                         "dropout before the second Linear")
                    else:
                        chain = [node, *acts, *drops, nxt]
                        kind, modules = "ffn", [m, a, *pad, *[mod(d) for d in drops], mod(nxt)]
                        src = norm_before(node, {node})
                        if src is not None:
                            chain, kind, modules = [src, *chain], "norm_ffn", [mod(src), *modules]
                else:  # dropouts and whatever follows them (gMLP's gating unit, a norm) run as they are
                    chain, kind, modules = [node, *acts], "linear_act", [m, a, *pad]
        if chain is None:
            continue
        node = chain[0]  # a norm before an FFN: the chain starts there
        # each link reads the one before; a written-out activation stands as its last node (its ops were
        # checked as it was found, as a gated chain's links were)
        sink = written[-1] if written else None
        linked = [c for c in chain if c not in written[:-1]]
        if any(c in taken for c in chain) or len(node.args) != 1 or node.kwargs or "gated" not in kind and any(
                c is not sink and (not plain_args(c) or c.args[0] is not prev) for prev, c in zip(linked, linked[1:])):
            continue
        taken.update(chain)
        key = (kind, (act, packed), tuple((c.op, str(c.target)) for c in chain))
        key += (sum(1 for f in found if f[0][:3] == key),)  # the same chain called again
        found.append((key, node, chain, kind, modules, act, packed))
    return found


def _only_input_user(gm, chain):
    """Whether ``chain`` starts on the graph's one input and reads it alone (a gated FFN's gate and up
    Linears both)."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return len(inputs) == 1 and chain[0].args[:1] == (inputs[0],) and set(inputs[0].users) <= set(chain)


def _fx_pass(ctx, model, prefix="", leaves=frozenset()):
    """Rewrite ``model``'s fused chains through its fx graph(s): the number found, or the reason it
    could not be traced (a str). With one graph per training mode, a chain is fused when every
    graph has it (the same ``_FxFused`` in each, so one switch turns it on and off)."""
    graphs, reason = _fx_trace(model, leaves)
    if graphs is None:
        return reason
    # the submodules the graphs call (their code is not in them): _fx_tree traces them on their own
    ctx.fx_called = sorted(set().union(*(gm.__dict__["_fusedrc_called"] for gm in graphs.values())))
    reported = set()

    def skip(name, why):
        if (name, why) not in reported:
            reported.add((name, why))
            ctx.skip(name, why)

    chains = {mode: _fx_chains(gm, prefix, skip) for mode, gm in graphs.items()}
    common = set.intersection(*({c[0] for c in found} for found in chains.values()))
    first = next(iter(chains.values()))
    mods = dict(next(iter(graphs.values())).named_modules())
    fused_by_key, found = {}, 0
    for key, node, chain, kind, modules, act, packed in first:
        if key not in common:
            continue
        # the modules the model does not hold at the chain's node (a functional activation's
        # equivalent; None for a function's node) travel with the call, the rest by name
        fixed = {i: c for i, (n, c) in enumerate(zip(chain, modules))
                 if n.op != "call_module" or c is not mods.get(n.target)}
        fused_by_key[key] = (_FxFused(kind, fixed, act, packed), f"_fusedrc_fx_{found}")
        normed = kind.startswith("norm_")
        if normed:
            ctx.joined_norms.add(id(modules[0]))
        # an FFN's unit is named by its fc1 (a gated one's by its gate), whose FLOPs it reruns, with the up Linear's
        recomputed, name = modules[normed:normed + 1], _join(prefix, chain[normed].target)
        if "gated" in kind and packed is None:
            recomputed.append([x for x in modules[normed:] if is_linear(x)][1])
        if isinstance(modules[0], _FusedSequential):  # its last conv's unit
            recomputed, name = [modules[0][-1]], f"{name}.{list(modules[0]._modules)[-1]}"
        ctx.unit(name, kind, *_site_switches(fused_by_key[key][0].site), tuple(recomputed))
        if kind in ("ffn", "gated_ffn") and prefix and all(any(c[0] == key and _only_input_user(gm, c[2]) for c in chains[mode])
                                            for mode, gm in graphs.items()):
            # the module's input feeds this FFN alone: a norm before the module can run inside it
            ctx.fx_consumers[_join(prefix, chain[normed].target)] = (prefix, model, fused_by_key[key][0])
        found += 1
    if not found:
        return 0
    for mode, gm in graphs.items():
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for key, node, chain, kind, modules, act, packed in chains[mode]:
            if key not in fused_by_key:
                continue
            fused, sub = fused_by_key[key]
            fixed = fused.__dict__["_fusedrc_fixed"]
            gm.add_submodule(sub, fused)
            with gm.graph.inserting_before(chain[-1]):
                registered = [gm.graph.get_attr(n.target) for i, n in enumerate(chain) if i not in fixed]
                new_node = gm.graph.call_module(sub, (node.args[0], *registered))
            chain[-1].replace_all_uses_with(new_node)
            for c in sorted(chain, key=order.__getitem__, reverse=True):  # readers first (a gated chain's are not in line)
                gm.graph.erase_node(c)
        gm.graph.lint()
        gm.recompile()
        # the graph runs on the model itself; it may reach fewer names (a tied weight), never others
        # (non-persistent buffers included: gm's copies of them are persistent)
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        names |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
        if not set(gm.state_dict().keys()) <= names:  # tensors fx baked in as constants, for one
            del ctx.units[len(ctx.units) - found:]
            return (f"the torch.fx graph of {type(model).__name__} reaches names the model does not hold "
                    "(tensors baked in as constants); no fx rewrite")
    for fused, sub in fused_by_key.values():  # parameter-free; reached as self.<name> by the graphs' code
        model.__dict__[sub] = fused
    gms = list(graphs.values())
    inlined = set().union(*(gm.__dict__["_fusedrc_inlined"] for gm in gms))
    called = set().union(*(gm.__dict__["_fusedrc_called"] for gm in gms))
    by_mode = graphs if len(graphs) > 1 else None
    model.__dict__["forward"] = _FxForward(model, gms[0], by_mode, sorted(inlined), sorted(called))
    bind_replicas(model)
    return found


def _fx_tree(ctx, module, prefix="", leaves=None):
    """The fx pass on the outermost modules that trace, below any rule's or Sequential's finds:
    most Hugging Face models do not trace as a whole, but their MLP modules do. The blocks rules
    declared are calls in a graph (``leaves``: a later mark must see their calls) and are traced
    on their own. The reason the root could not be traced, or None."""
    if leaves is None:
        leaves = frozenset(id(b.module) for b in ctx.blocks)
    claimed = isinstance(module, (Wrapper, _FusedSequential)) or any(
        (not prefix or u.name == prefix or u.name.startswith(prefix + ".")) and _held_inline(module, prefix, u.name)
        for u in ctx.units)
    # a Sequential below the root had its runs found by the Sequential pass
    if not claimed and any(is_linear(m) or _is_conv2d(m) for m in module.modules()) \
            and not isinstance(module, (nn.ModuleList, nn.ModuleDict, _FusedSequential)) \
            and not (prefix and type(module) is nn.Sequential):
        reason = _fx_pass(ctx, module, prefix, leaves)
        if not isinstance(reason, str):
            # what the graph calls may hold chains it has not seen (a block, a fused Sequential's
            # other children, a module kept a call for its hooks): each traced on its own
            for name in ctx.fx_called:
                child = module.get_submodule(name)
                if not _is_act_module(child) and not _is_bn_act(child):
                    for sub, path in _fx_visits(child, _join(prefix, name)):
                        _fx_tree(ctx, sub, path, leaves)
            return None
    else:
        reason = None
    for key, child in module._modules.items():
        # torch's own modules are fx leaves, its containers are not
        # a Wrapper: converted already (by a rule, or an earlier convert); a fused Sequential's
        # ungrouped children (torchvision's Conv2dNormActivation beside a grouped Conv-BN) may trace
        for sub, path in _fx_visits(child, _join(prefix, key)):
            _fx_tree(ctx, sub, path, leaves)
    return reason


def _fx_visits(child, name):
    """``(module, name)`` pairs the fx pass looks into for ``child``: ``child`` unless skipped; for a rule's
    Wrapper, the children its forward runs as they are (its ``_fusedrc_fx_children()``: FastViT's ConvMlp's
    depthwise Conv-BN before the fused FFN)."""
    if isinstance(child, Wrapper) and not _is_marked(child):
        keys = child._fusedrc_fx_children() if hasattr(type(child), "_fusedrc_fx_children") else ()
        return [(child._modules[k], _join(name, k)) for k in keys]
    return [] if _skip_in_fx_tree(child) else [(child, name)]


def _skip_in_fx_tree(child):
    """Modules the fx pass never looks into: torch's own (fx leaves; its containers are not), a
    marked one, a rule's Wrapper (converted already, by a rule or an earlier convert) and the
    fused units' stand-ins. A fused Sequential is looked into: its ungrouped children
    (torchvision's Conv2dNormActivation beside a grouped Conv-BN) may trace."""
    return (child is None or _is_marked(child)
            or isinstance(child, (_FFNHead, _FFNAct, _FFNTail, _FxFused, Wrapper))
            or type(child).__module__.startswith("torch.")
            and not isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)))


def _held_inline(module, prefix, unit):
    """Whether fused ``unit`` (a name below ``module``, at ``prefix``) lives in code an fx graph of
    ``module`` would inline: its owner is not a call in that graph. Owners that are calls: a rule's
    Wrapper, a fused Sequential, a module an earlier fx pass rewrote (its instance forward). An
    OPT-style layer holding its FFN's stand-ins is not, nor an inline BERT-style layer holding a
    :class:`_SplitHead`: they find their layer by its forward's frame, which a graph would replace."""
    rel = unit[len(prefix) + 1:] if prefix else unit
    try:
        at = module.get_submodule(rel)
        # a split FFN's head finds its layer by the layer's forward frame, as an inlined FFN's stand-ins do
        owner = at if isinstance(at, Wrapper) and not isinstance(at, _SplitHead) \
            else module.get_submodule(rel.rpartition(".")[0])
    except AttributeError:
        return True
    return not (isinstance(owner, (Wrapper, _FusedSequential)) or "forward" in owner.__dict__) or owner is module


# the rules found by a module's shape and code rather than its class name, in the order they are tried
_SHAPE_RULES = ((_looks_gated_mlp, _gated_mlp), (_looks_inline_ffn_layer, _inline_ffn_layer), (_looks_experts, _experts),
                (_looks_own_experts, _own_experts), (_looks_split_ffn_layer, _split_ffn_layer),
                (_looks_gate_up_mlp, _gate_up_mlp),
                (_looks_inline_split_ffn_layer, _inline_split_ffn_layer), (_looks_conv1d_mlp, _conv1d_mlp))


def _rewrite(ctx, module, prefix=""):
    """Apply rules and the Sequential pass top-down; returns the (possibly new) module."""
    if _is_marked(module):
        if not module.__dict__[_MARK].get("by_convert"):
            ctx.skip(prefix, "already marked with fusedrc.mark")
            return module
        unmark(module)  # an earlier convert's block: planned again
    if isinstance(module.__dict__.get("forward"), _FxForward):  # an earlier convert's fx rewrite: traced again
        for key in [k for k in module.__dict__ if k == "forward" or k.startswith("_fusedrc_fx_")]:
            del module.__dict__[key]
        if not any(hasattr(v, "_fusedrc_rebind") for k, v in module.__dict__.items()
                   if k != "_replicate_for_data_parallel"):
            module.__dict__.pop("_replicate_for_data_parallel", None)
    cls = _class_of(module)
    rule = _RULES.get(cls.__name__)
    if rule in _LIBRARY_RULES + (_conv_mlp,) and not cls.__module__.startswith(("torchvision.", "timm.")):
        rule = None  # a class of your own named BasicBlock or Block: the checks by shape apply
    if rule is None:
        rule = next((r for looks, r in _SHAPE_RULES if looks(module)), None)
    if rule is not None:
        module = rule(ctx, prefix, module)
    elif cls is nn.Sequential:
        module = _sequential(ctx, prefix, module)
    for key, child in list(module._modules.items()):
        if child is None or isinstance(child, (_FFNHead, _FFNAct, _FFNTail, _FxFused)):
            continue
        new = _rewrite(ctx, child, _join(prefix, key))
        if new is not child:
            module._modules[key] = new
    return module


def _layer_blocks(ctx, model):
    """Hugging Face layers (subclasses of transformers' ``GradientCheckpointingLayer``: what its
    own gradient checkpointing recomputes) become blocks where no rule made one in, around or
    inside them."""
    taken = [b.name for b in ctx.blocks]

    def nested(a, b):
        return not b or a == b or a.startswith(b + ".")

    for name, m in model.named_modules():
        if not _hf_layer(m) or _is_marked(m) or any(nested(name, t) or nested(t, name) for t in taken):
            continue
        ctx.block(name, m, when=_no_kv_cache)
        taken.append(name)


def _drop_nesting_blocks(ctx, model):
    """Blocks that would nest with a module the user (or an earlier convert) marked already: marks
    cannot nest, so they stay unmarked, reported."""
    kept = []
    for b in ctx.blocks:
        parts = b.name.split(".") if b.name else []
        above = [_lookup(model, ".".join(parts[:k])) for k in range(len(parts))]
        if any(_is_marked(m) for m in b.module.modules()) or any(m is not None and _is_marked(m) for m in above):
            ctx.skip(b.name, "a module in or around it is already marked with fusedrc.mark (marks cannot "
                             "nest): not recomputed as a block")
        else:
            kept.append(b)
    ctx.blocks[:] = kept


# --------------------------------------------------------------------------- policy and budget


def _matches(policy, name, module):
    if policy == "all" or policy == "blocks":
        return True
    if callable(policy):
        return bool(policy(name, module))
    parts = name.split(".")
    prefixes = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(p, pat) for pat in policy for p in prefixes)


def _lookup(model, name):
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None


def _set_block(block, on):
    if on and not _is_marked(block.module):
        _mark(block.module, when=block.when)
        block.module.__dict__[_MARK]["by_convert"] = True  # a later convert re-plans it
    elif not on and _is_marked(block.module):
        unmark(block.module)


def _apply(units, blocks):
    for u in units:
        (u.enable if u.selected else u.disable)()
    for b in blocks:
        _set_block(b, b.selected)


def _validate_args(policy, memory_budget, example_inputs):
    if not (policy in ("all", "blocks") or callable(policy)
            or (isinstance(policy, (list, tuple)) and all(isinstance(p, str) for p in policy))):
        raise ValueError(
            f"policy must be 'all', 'blocks', a list of submodule names or glob patterns, or a callable "
            f"(name, module) -> bool; got {policy!r}"
        )
    if callable(policy) and not isinstance(policy, str):
        try:
            _inspect.signature(policy).bind("name", None)
        except TypeError as e:
            raise TypeError(f"policy must be a callable (name, module) -> bool, got {policy!r} ({e})") from None
        except ValueError:  # no signature to read (a builtin): asked as is
            pass
    if memory_budget is not None:
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Real):
            raise TypeError(f"memory_budget must be a float in (0, 1] or an int number of bytes, got {memory_budget!r}")
        # numpy scalars and other number types: an integer is bytes, anything else a fraction
        memory_budget = int(memory_budget) if isinstance(memory_budget, numbers.Integral) else float(memory_budget)
        if isinstance(memory_budget, float) and not 0 < memory_budget <= 1:
            raise ValueError(f"memory_budget as a fraction must be in (0, 1], got {memory_budget}")
        if isinstance(memory_budget, int) and memory_budget <= 0:
            raise ValueError(f"memory_budget in bytes must be positive, got {memory_budget}")
        if example_inputs is None:
            raise ValueError("memory_budget needs example_inputs (a tuple of positional arguments for model)")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        raise TypeError(f"example_inputs must be a tuple of positional arguments, got {type(example_inputs).__name__}")
    return memory_budget


def _block_of(unit_name, blocks):
    best = None
    for b in blocks:
        if unit_name.startswith(b.name + ".") and (best is None or len(b.name) > len(best.name)):
            best = b
    return best


def _plan_budget(model, example_inputs, units, blocks, target, baseline):
    _KV_CACHE_CALLS[0] = 0
    flops = _measure_flops(model, example_inputs)

    def measure():
        return saved_bytes(model, example_inputs)

    for u in units:
        u.cost = sum(flops.get(id(m), 0) for m in u.recompute_modules)
        u.selected = True
        _apply([u], [])
        u.saved = baseline - measure()
        u.selected = False
        _apply([u], [])
    for b in blocks:
        b.units = [u for u in units if u.block is b]
        b.cost = sum(flops.get(id(m), 0) for m in b.module.modules())
        for u in b.units:
            u.selected = True
        b.selected = True
        _apply(b.units, [b])
        b.saved = baseline - measure() - sum(u.saved for u in b.units)  # beyond its units
        b.selected = False
        for u in b.units:
            u.selected = False
        _apply(b.units, [b])

    order = sorted((u for u in units if u.saved > 0), key=lambda u: u.cost / u.saved)
    border = sorted((b for b in blocks if b.saved > 0), key=lambda b: b.cost / b.saved)
    queue = [("unit", u) for u in order] + [("block", b) for b in border]
    current = estimate = baseline
    for kind, c in queue:
        if current <= target:
            break
        if kind == "unit":
            if c.selected:
                continue
            c.selected = True
            estimate -= c.saved
        else:
            c.selected = True
            estimate -= c.saved
            for u in c.units:
                if not u.selected:
                    u.selected = True
                    estimate -= u.saved
        if estimate <= target:  # the estimate fits: check by measuring
            _apply(units, blocks)
            current = estimate = measure()
    _apply(units, blocks)
    current = measure()
    if current > target:
        for u in units:
            u.selected = True
        for b in blocks:
            b.selected = True
        _apply(units, blocks)
        smallest = measure()
        for u in units:
            u.selected = False
        for b in blocks:
            b.selected = False
        _apply(units, blocks)
        hint = ""
        if _KV_CACHE_CALLS[0]:
            hint = ("; some layers were called with a KV cache and cannot be recomputed then: train with "
                    "config.use_cache = False (for an encoder-decoder, the decoder's config too)")
        raise ValueError(
            f"memory_budget cannot be met: it asks for at most {target} bytes kept "
            f"({target / baseline:.3f} of the original's {baseline}); the smallest reachable with the "
            f"candidates allowed by the policy is {smallest} bytes ({smallest / baseline:.3f} of the original)"
            + hint
        )
    return current


def _deep_copy(model):
    """``copy.deepcopy(model)``; where torch refuses, an error that names the tensor and the way out."""
    try:
        return copy.deepcopy(model)
    except RuntimeError as e:
        held = next((f"{name or type(model).__name__}.{k}" for name, m in model.named_modules()
                     for k, v in vars(m).items()
                     if isinstance(v, torch.Tensor) and not v.is_leaf), None)
        if held is None:
            raise
        raise RuntimeError(
            f"convert(inplace=False) deep-copies the model, and torch cannot deep-copy {held}: a tensor "
            "computed with autograd (a state a forward left on the module, as Hugging Face's RecurrentGemma "
            "keeps its recurrent state). Convert before the first forward, set that attribute to None, or "
            "pass inplace=True") from e


def convert(model, *, policy="all", memory_budget=None, example_inputs=None, inplace=False, verbose=False):
    """Rewrite ``model`` so its Conv-BN-ReLU chains, residual tails and FFNs are fused recompute ops.

    Args:
        model: an ``nn.Module`` (torchvision ResNet, Hugging Face OPT/T5/BART/Llama/BERT/...,
            anything with ``nn.Sequential`` patterns or submodules that ``torch.fx`` traces).
        policy: ``"all"`` (every fused unit), ``"blocks"`` (every unit, and every known
            block recomputed whole with :func:`fusedrc.mark`), a list of submodule names or
            glob patterns (a unit is chosen when its name or one of its ancestors' matches),
            or a callable ``(name, module) -> bool`` asked for each unit.
        memory_budget: a float in (0, 1] (fraction of the original's activation bytes)
            or an int (bytes). Needs ``example_inputs``. Units are chosen cheapest
            recompute FLOPs per byte saved first, whole blocks where units are not enough.
        example_inputs: a tuple of positional arguments for ``model``, to measure bytes.
        inplace: rewrite ``model`` itself (its parameters and buffers are kept) instead of a copy.
        verbose: print the plan. The plan is always attached as ``model.fusedrc_plan``.

    Returns:
        The converted model (same state_dict keys; the original's state_dict loads).

    Raises:
        ValueError: on a bad argument, or when ``memory_budget`` cannot be met (the message
        names the smallest reachable).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    memory_budget = _validate_args(policy, memory_budget, example_inputs)
    for flag, value in (("inplace", inplace), ("verbose", verbose)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {type(value).__name__} {value!r}")
    if not inplace:
        model = _deep_copy(model)
    for site in _sites(model):  # an earlier convert's units: off unless this plan selects them again
        site.enabled = False
    ctx = _Context()
    model = _rewrite(ctx, model)
    ctx.root = model
    if not _is_marked(model):  # a marked root is left as it is
        reason = _fx_tree(ctx, model)
        _norm_first(ctx, model)
        _recomputed_norms(ctx, model)
        _layer_blocks(ctx, model)
        _drop_nesting_blocks(ctx, model)
        if reason is not None and not ctx.units and not ctx.blocks:
            ctx.skip("", reason)
    for u in ctx.units:
        u.block = _block_of(u.name, ctx.blocks)
    candidates = [u for u in ctx.units if _matches(policy, u.name, _lookup(model, u.name))]
    blocks = list(ctx.blocks) if policy == "blocks" or memory_budget is not None and policy == "all" else []
    if memory_budget is not None and policy not in ("all", "blocks"):
        blocks = [b for b in ctx.blocks if _matches(policy, b.name, b.module)]
    if isinstance(policy, (list, tuple)):
        names = [u.name for u in ctx.units] + [b.name for b in ctx.blocks]
        unmatched = [p for p in policy if not any(_matches([p], n, None) for n in names)]
        if unmatched:
            warnings.warn(f"fusedrc.convert: policy entries {unmatched} match no fusable unit or block "
                          f"(units: {[u.name for u in ctx.units]})", stacklevel=2)
    if policy == "blocks" and ctx.units and not ctx.blocks:
        warnings.warn(
            f"fusedrc.convert: policy='blocks' found no block it knows in {type(model).__name__} (no rule's "
            "block, no Hugging Face GradientCheckpointingLayer); only the fused units are recomputed. Mark "
            "blocks with fusedrc.mark(module) or add a rule with fusedrc.register_rule", stacklevel=2)
    plan = ConvertPlan(ctx.units, ctx.blocks, ctx.skipped)
    if not ctx.units and not ctx.blocks:
        left = "; ".join(f"{n or '<model>'}: {r}" for n, r in ctx.skipped)
        warnings.warn(
            f"fusedrc.convert: no pattern found in {type(model).__name__}; the model is unchanged"
            + (f" (left as they are: {left})" if left else ""),
            stacklevel=2,
        )
    elif ctx.skipped:
        warnings.warn(
            "fusedrc.convert left these as they are (fusing would change semantics): "
            + "; ".join(f"{n or '<model>'}: {r}" for n, r in ctx.skipped),
            stacklevel=2,
        )
    if memory_budget is None:
        for u in candidates:
            u.selected = True
        for b in blocks:
            b.selected = True
        _apply(ctx.units, ctx.blocks)
        if example_inputs is not None:
            for u in ctx.units:
                u.disable()
            for b in ctx.blocks:
                _set_block(b, False)
            plan.baseline_bytes = _baseline_bytes(model, example_inputs)
            _apply(ctx.units, ctx.blocks)
            plan.final_bytes = saved_bytes(model, example_inputs)
    else:
        for u in ctx.units:
            u.selected = False
        _apply(ctx.units, ctx.blocks)
        baseline = _baseline_bytes(model, example_inputs)
        target = int(memory_budget * baseline) if isinstance(memory_budget, float) else memory_budget
        plan.baseline_bytes, plan.target_bytes = baseline, target
        plan.final_bytes = _plan_budget(model, example_inputs, candidates, blocks, target, baseline)
    model.__dict__["fusedrc_plan"] = plan
    if verbose:
        print(plan)
    return model


# --------------------------------------------------------------------------- environment
_TV_LIB = None


def _import_torchvision():
    """Import torchvision; where its C++ ops cannot load, import its pure-Python parts anyway.

    PyPI's Linux torchvision wheel is built against CUDA torch. With the CPU build of
    torch its ``_C`` extension does not load, and torchvision 0.28 then fails at import
    (``operator torchvision::nms does not exist``: an unguarded fake registration),
    which also breaks ``import transformers``. The models (ResNet) need none of those
    ops: declaring the two op schemas that the registration looks for lets the import
    finish; calling torchvision's detection ops still fails, as it would anyway.
    """
    global _TV_LIB
    import importlib
    import sys

    try:
        return importlib.import_module("torchvision")
    except ModuleNotFoundError as e:
        if e.name != "torchvision":
            raise
        raise ModuleNotFoundError("torchvision is not installed: pip install torchvision (a build matching "
                                  "torch's), or fusedrc's test extra: pip install -e \".[test]\"",
                                  name="torchvision") from e
    except ImportError:
        raise
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
    for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[k]
    if _TV_LIB is None:
        _TV_LIB = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            if not hasattr(torch.ops.torchvision, op) or not torch._C._dispatch_has_kernel(f"torchvision::{op}"):
                try:
                    _TV_LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                except RuntimeError:
                    pass
    return importlib.import_module("torchvision")


import_torchvision = _import_torchvision  # public name: users on CPU torch with PyPI's torchvision wheel
