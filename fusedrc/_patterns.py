"""Recognise blocks that a fused op can run, and build the call.

``match(block, args, kwargs)`` returns a zero-argument callable running the fused
op, or None when the block is not a recognised pattern or the call has
something the fused op does not model (hooks, a dtype mismatch, a dropout other
than ``nn.Dropout`` between an FFN's layers, a BatchNorm in an unusual configuration). None
means the generic recompute path, which is always correct.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.nn.modules import module as _module_mod
from torch.nn.utils.parametrize import type_before_parametrizations

from .reference import leaky_relu_name

_ACT_MODULES = {nn.ReLU: "relu", nn.SiLU: "silu", nn.ReLU6: "relu6", nn.Hardswish: "hardswish"}


def activation_name(module):
    """The fused activation name of an activation module, or None."""
    if type(module) in _ACT_MODULES:
        return _ACT_MODULES[type(module)]
    if type(module) is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    if type(module) is nn.LeakyReLU and math.isfinite(module.negative_slope):
        return leaky_relu_name(module.negative_slope)
    return None


def _foreign_forward(module):
    f = module.__dict__.get("forward")
    return f is not None and not getattr(f, "_fusedrc_forward", False)


def _user_hooks(hooks):
    return any(not getattr(h, "_fusedrc_hook", False) for h in hooks.values())


def _own_hooks(module):
    """Hooks registered on the module itself (fusedrc's own aside: a converted model's norm scope),
    or a forward replaced on the instance."""
    return bool(
        _user_hooks(module._forward_hooks) or _user_hooks(module._forward_pre_hooks)
        or getattr(module, "_backward_hooks", None) or getattr(module, "_backward_pre_hooks", None)
        or _foreign_forward(module)
    )


def _has_hooks(module):
    """Whether calling ``module`` does more than its class's forward: hooks on it or global module
    hooks (module trackers, flop counters), or a forward replaced on the instance (adapters,
    accelerate; ``mark``'s forward, marked ``_fusedrc_forward``, runs the class's computation).
    The fused paths then leave the call to the module."""
    return _own_hooks(module) or global_hooks()


def global_hooks():
    """Whether global module hooks (module trackers, flop counters) are registered, fusedrc's own aside."""
    _m = _module_mod
    return bool(
        _m._global_forward_hooks or _m._global_backward_hooks or getattr(_m, "_global_backward_pre_hooks", None)
        or any(not getattr(h, "_fusedrc_hook", False) for h in _m._global_forward_pre_hooks.values())
    )


def _is_noop_dropout(module, training=None):
    training = module.training if training is None else training
    return isinstance(module, nn.Dropout) and (module.p == 0 or not training)


def fused_dropout_p(module, training=None):
    """The probability a fused FFN applies for ``module`` between its layers: 0.0 for None or a
    dropout that does nothing now, ``p`` for a training ``nn.Dropout`` (the exact class: a
    subclass may draw its mask otherwise), None for anything the fused op cannot stand for.
    ``training`` overrides the module's mode (True: whether it can be fused in either mode)."""
    if module is None or _is_noop_dropout(module, training) or type(module) is nn.Identity:
        return 0.0
    return float(module.p) if type(module) is nn.Dropout else None


def _dtype_ok(m, x):
    # under autocast the functional layer casts both operands, as F.linear/F.conv2d do
    return m.weight.dtype == x.dtype or torch.is_autocast_enabled(x.device.type)


# Linear subclasses whose forward is F.linear's computation, written out: Falcon's FalconLinear is
# ``input @ weight.T + bias``. Known by class name (fusedrc imports no model library).
LINEAR_EQUIVALENTS = frozenset({"FalconLinear"})


def is_linear(m, parametrized=False):
    """An ``nn.Linear`` whose call is ``F.linear`` (not a subclass doing more, a LoRA layer, ...).
    ``parametrized``: one with parametrizations counts too (its class is a generated subclass);
    for callers that read its ``weight`` once a call, as the module does (each read reruns the
    parametrization, and spectral_norm's updates its state)."""
    t = type_before_parametrizations(m) if parametrized else type(m)
    return t is nn.Linear or t.__name__ in LINEAR_EQUIVALENTS and isinstance(m, nn.Linear)


def _plain_linear(m, x):
    return is_linear(m) and _dtype_ok(m, x) and m.weight.device == x.device


def _conv_padding(conv):
    """``conv``'s symmetric zero padding per spatial dimension, or None where it pads one side more
    (a 'same' padding of an even kernel extent, timm's ``Conv2dSame``)."""
    if is_conv_same(conv):
        return None
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return [0, 0]
        if conv.stride != (1, 1) or any((d * (k - 1)) % 2 for k, d in zip(conv.kernel_size, conv.dilation)):
            return None  # asymmetric 'same' padding
        return [d * (k - 1) // 2 for k, d in zip(conv.kernel_size, conv.dilation)]
    return list(conv.padding)


def is_same_depthwise(conv, channels=None):
    """A plain ``nn.Conv2d`` that is a Mix-FFN's depthwise conv: one odd k x k filter per channel
    (``channels`` of them, where given), stride 1, no dilation, zero "same" padding k // 2, no hooks of
    its own: what :func:`fusedrc.functional.mix_ffn` computes."""
    if type(conv) is not nn.Conv2d or _own_hooks(conv):
        return False
    k = conv.kernel_size
    c = conv.in_channels
    return (c == conv.out_channels == conv.groups and (channels is None or c == channels) and k[0] == k[1]
            and k[0] % 2 == 1 and conv.stride == (1, 1) and conv.dilation == (1, 1)
            and conv.padding_mode == "zeros" and _conv_padding(conv) == [k[0] // 2, k[0] // 2])


def is_conv_same(m):
    """timm's ``Conv2dSame``: an ``nn.Conv2d`` (padding 0) whose forward pads its input the way
    TensorFlow's 'SAME' does, by the input's size (EfficientNet's and MobileNetV3's ``tf_`` models)."""
    t = type(m)
    return (t.__name__ == "Conv2dSame" and t.__module__.startswith("timm.") and isinstance(m, nn.Conv2d)
            and "forward" not in m.__dict__ and tuple(m.padding) == (0, 0))


def is_mixed_conv(m):
    """timm's ``MixedConv2d`` (MixNet): the input's channels split among convolutions of different kernel
    sizes (plain or ``Conv2dSame``, padding zeros), their outputs concatenated. A BatchNorm after it is
    per channel, so each split's Conv-BN runs on its own share of the norm's channels."""
    t = type(m)
    if not (t.__name__ == "MixedConv2d" and t.__module__.startswith("timm.") and isinstance(m, nn.ModuleDict)
            and "forward" not in m.__dict__ and len(m)):
        return False
    convs = list(m.values())
    return (all((type(c) is nn.Conv2d or is_conv_same(c)) and c.padding_mode == "zeros" and c.stride == convs[0].stride
                for c in convs)
            and list(getattr(m, "splits", ())) == [c.in_channels for c in convs]
            and getattr(m, "out_channels", None) == sum(c.out_channels for c in convs))


def conv_parts(conv):
    """The convolutions a conv-BN chain's conv runs: a MixedConv2d's splits, else the conv itself."""
    return tuple(conv.values()) if is_mixed_conv(conv) else (conv,)


def conv_weight(conv):
    """The weight of a conv-BN chain's conv (a MixedConv2d's first split's: they share device and dtype)."""
    return conv_parts(conv)[0].weight


def _conv_pads(conv, size):
    """(before, after) zero rows / columns ``conv`` pads an input of spatial ``size`` with, per dimension."""
    if is_conv_same(conv):
        pads = []
        for n, k, s, d in zip(size, conv.kernel_size, conv.stride, conv.dilation):
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads.append((total // 2, total - total // 2))
        return pads
    if isinstance(conv.padding, str) and conv.padding == "same":  # stride 1: aten pads the odd one at the end
        return [(d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for k, d in zip(conv.kernel_size, conv.dilation)]
    return [(p, p) for p in _conv_padding(conv)]


def conv_call_padding(conv, x):
    """``conv``'s padding of ``x`` as the fused conv-BN op takes it: ``[h, w]``, or ``[left, right, top,
    bottom]`` where one side is padded wider."""
    (top, bottom), (left, right) = _conv_pads(conv, x.shape[-2:])
    return [top, left] if (top, left) == (bottom, right) else [left, right, top, bottom]


def _plain_conv(m, x, asymmetric=False):
    """``asymmetric``: a padding that pads one side more is modelled too (the conv-BN op's own), and
    MixNet's MixedConv2d (one op per split)."""
    if asymmetric and is_mixed_conv(m):
        ok = True  # is_mixed_conv checked its splits
    else:
        ok = ((type(m) is nn.Conv2d or asymmetric and is_conv_same(m)) and m.padding_mode == "zeros"
              and (asymmetric or _conv_padding(m) is not None))
    w = conv_weight(m) if ok else None
    return ok and (w.dtype == x.dtype or torch.is_autocast_enabled(x.device.type)) and w.device == x.device \
        and x.dim() == 4


def bn_call_args(bn):
    """(training, momentum, running_mean, running_var) as nn.BatchNorm2d.forward derives them,
    incrementing ``num_batches_tracked`` the way it does. Call once per forward."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    use_batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
    track = not bn.training or bn.track_running_stats
    return use_batch_stats, factor, bn.running_mean if track else None, bn.running_var if track else None


def _plain_bn(m, c):
    return type(m) is nn.BatchNorm2d and m.num_features == c


def same_attributes(before, after, ignore=()):
    """Whether a module's ``__dict__`` after a forward (``after``) holds the very objects it held before
    (``before``, a copy), keys in ``ignore`` aside: a forward that sets attributes changes it."""
    return after.keys() == before.keys() and all(after[k] is v for k, v in before.items() if k not in ignore)


def _rms_probe(m, cls, w, eps):
    """The RMS kind (``"llama_rms"``, ``"rms"`` or ``"gemma_rms"``) that ``cls.forward`` computes on ``m``, bit for bit,
    or None. Class names say nothing of the casts (T5's and Llama's norms round twice in 16-bit dtypes,
    Helium's once, Gemma's multiplies by 1 + weight), so it is run once on a probe: random input and a
    random weight in the weight's dtype (a fresh all-ones weight would hide the rounding), on a shallow
    copy of ``m``, through the class's forward (no hooks run, autocast off)."""
    from . import reference

    if isinstance(eps, bool) or not isinstance(eps, float):
        return None
    gen = torch.Generator().manual_seed(0)
    size = w.shape[0]
    probe = (torch.randn(4, size, generator=gen) * 3).to(w.dtype).to(w.device)
    weight = (torch.randn(size, generator=gen) + 1).to(w.dtype).to(w.device)
    stand_in = copy.copy(m)
    stand_in.__dict__.pop("weight", None)  # an nn.DataParallel replica holds it as a plain attribute
    stand_in._parameters = dict(m._parameters, weight=nn.Parameter(weight, requires_grad=False))
    state = dict(stand_in.__dict__)
    try:
        with torch.no_grad(), torch.autocast(w.device.type, enabled=False):
            out = cls.forward(stand_in, probe)
    except Exception:
        return None
    if not same_attributes(state, stand_in.__dict__):
        return None  # it sets attributes (a counter, cached statistics): a functional form would skip that
    for kind in ("llama_rms", "rms", "gemma_rms"):
        want = reference.norm_forward(probe, kind, weight, None, eps)
        if isinstance(out, torch.Tensor) and out.dtype == want.dtype and torch.equal(out, want):
            return kind
    return None


def norm_kind(m, cls=None):
    """``(kind, eps)`` of a norm module that a fused FFN can run before its first layer
    (``reference.NORMS``), or None: ``nn.LayerNorm`` and ``nn.RMSNorm`` over one dimension, and
    modules named ``*RMSNorm``/``*LayerNorm``/``*RmsNorm`` (timm's) holding a 1-D ``weight`` and a float epsilon whose forward
    computes an RMS kind (checked on a probe, once per weight dtype, device and epsilon; not while
    torch.compile traces). ``cls``: the class whose forward ``m`` runs (a wrapper's original class).
    ``nn.RMSNorm``'s eps may be None (see ``norm_call_args``). Read at each call: a changed eps counts."""
    t = type(m) if cls is None else cls
    if t is nn.LayerNorm and len(m.normalized_shape) == 1:
        return "layer", m.eps
    if t is getattr(nn, "RMSNorm", None) and len(m.normalized_shape) == 1:
        return "rms", m.eps
    if (t.__module__ == "timm.layers.norm" and t.__name__ == "LayerNorm" and issubclass(t, nn.LayerNorm)
            and len(m.normalized_shape) == 1 and m.__dict__.get("_fast_norm") is False):
        return "layer", m.eps  # timm's LayerNorm: F.layer_norm unless its fast (apex / low-precision) path is on
    if not isinstance(m, nn.Module) or issubclass(t, (nn.LayerNorm, nn.Linear)) or \
            not t.__name__.endswith(("RMSNorm", "LayerNorm", "RmsNorm")):
        return None
    if t.__module__.startswith("timm.") and m.__dict__.get("_fast_norm", False) is not False:
        return None  # timm's fast path (apex, or its low-precision kernels) is not what the probe saw
    w = getattr(m, "weight", None)  # (a replica's parameters are plain attributes, not in _parameters)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.is_floating_point() or w.device.type == "meta":
        return None
    # the kinds read one weight: another parameter or a buffer is state the probe cannot see the use of
    # (a zero-initialised shift looks absent until training moves it)
    if set(m._parameters) - {"weight"} or m._modules or any(b is not None for b in m._buffers.values()):
        return None
    key = (t, w.dtype, w.device, tuple(w.shape), eps)
    cached = m.__dict__.get("_fusedrc_norm_probe")
    if cached is not None and cached[0] == key:
        return cached[1]
    if torch.compiler.is_compiling():
        return None
    kind = _rms_probe(m, t, w, eps)
    kind = None if kind is None else (kind, eps)
    m.__dict__["_fusedrc_norm_probe"] = (key, kind)
    return kind


def norm_call_args(m, x, cls=None):
    """``dict(norm=..., norm_weight=..., norm_bias=..., norm_eps=...)`` for a fused FFN running norm
    module ``m`` on ``x`` first, or None where the fused op would not compute what ``m(x)`` does
    (hooks, no fused form, x's dtype not the norm's, another size or device). ``cls``: as in ``norm_kind``."""
    if _has_hooks(m):
        return None
    kind = norm_kind(m, cls)
    if kind is None:
        return None
    kind, eps = kind
    # attributes, not _parameters: an nn.DataParallel replica holds its parameters as plain attributes
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    size = w.shape[0] if isinstance(w, torch.Tensor) else m.normalized_shape[0]
    if x.shape[-1] != size or any(isinstance(t, torch.Tensor) and (t.dtype != x.dtype or t.device != x.device)
                                  for t in (w, b)):
        return None
    if eps is None:  # nn.RMSNorm's default: the epsilon of the dtype it computes in (float32 for 16-bit x)
        eps = torch.finfo(torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype).eps
    return dict(norm=kind, norm_weight=w, norm_bias=b if kind == "layer" else None, norm_eps=eps)


def match(block, args, kwargs):
    from . import functional as F
    from . import nn as fnn

    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if not x.is_floating_point():
        return None
    if isinstance(block, (fnn.LinearReLU, fnn.FusedMLP, fnn.GatedMLP, fnn.ConvBNReLU, fnn.BNReLUConv)):
        # the class's forward, not block(x): a marked module's call comes back here
        return None if _has_hooks(block) else (lambda: type(block).forward(block, x))
    if type(block) is not nn.Sequential or _has_hooks(block):
        return None
    mods = [m for m in block if not _is_noop_dropout(m)]
    if any(_has_hooks(c) for m in block for c in (m, *conv_parts(m))):  # a MixedConv2d's splits too
        return None
    # a norm first, then an FFN or a gated FFN (the norm runs inside the fused op)
    norm = norm_call_args(mods[0], x) if len(mods) in (4, 5) else None
    if norm is not None:
        fc1 = mods[1]
        p = fused_dropout_p(mods[3]) if len(mods) == 5 else 0.0
        if (p is not None and _plain_linear(fc1, x) and activation_name(mods[2]) and _plain_linear(mods[-1], x)
                and mods[-1].in_features == fc1.out_features):
            act, fc2 = activation_name(mods[2]), mods[-1]
            return lambda: F.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, act, dropout_p=p, **norm)
        return None
    if len(mods) == 2 and _plain_linear(mods[0], x) and activation_name(mods[1]):
        lin, act = mods[0], activation_name(mods[1])
        return lambda: F.linear_act(x, lin.weight, lin.bias, act)
    p = fused_dropout_p(mods[2]) if len(mods) == 4 else 0.0
    if (
        len(mods) in (3, 4) and p is not None and _plain_linear(mods[0], x) and activation_name(mods[1])
        and _plain_linear(mods[-1], x) and mods[-1].in_features == mods[0].out_features
    ):
        fc1, act, fc2 = mods[0], activation_name(mods[1]), mods[-1]
        return lambda: F.fused_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, act, dropout_p=p)
    if (
        len(mods) in (2, 3) and _plain_conv(mods[0], x, asymmetric=True) and _plain_bn(mods[1], mods[0].out_channels)
        and (len(mods) == 2 or activation_name(mods[2]))
    ):
        conv, bn, act = mods[0], mods[1], (activation_name(mods[2]) if len(mods) == 3 else None)
        return lambda: conv_bn_act_call(conv, bn, x, activation=act)
    if (
        len(mods) == 3 and type(mods[0]) is nn.BatchNorm2d and activation_name(mods[1]) and x.dim() == 4
        and mods[0].num_features == x.shape[1] and _plain_conv(mods[2], x) and mods[2].in_channels == x.shape[1]
    ):
        bn, act, conv = mods[0], activation_name(mods[1]), mods[2]
        return lambda: bn_act_conv_call(bn, conv, x, activation=act)
    return None


def conv_bn_act_call(conv, bn, x, residual=None, activation="relu"):
    """``act(bn(conv(x)) [+ residual])`` through the fused op, with ``nn.BatchNorm2d``'s
    bookkeeping (running statistics, ``num_batches_tracked``) done once per forward. ``activation``
    None: no activation."""
    from . import functional as F

    training, factor, rm, rv, counted = _bn_call(bn)

    def call(conv, x, part=lambda t: t):
        return F.conv_bn_act(
            x, conv.weight, part(bn.weight), part(bn.bias), part(rm), part(rv), training=training, momentum=factor,
            eps=bn.eps, stride=list(conv.stride), padding=conv_call_padding(conv, x), dilation=list(conv.dilation),
            bias=conv.bias, residual=None if residual is None else part(residual), activation=activation,
            groups=conv.groups,
        )

    try:
        if not is_mixed_conv(conv):
            return call(conv, x)
        # MixNet's: one op per split on its channels of the norm (views: the running statistics of each
        # slice updated in place), bookkeeping once; each op keeps its split of x, a view. (A split whose op
        # raises leaves the earlier slices updated: splits of mixed dtypes or devices, which raise unfused too.)
        outs, start = [], 0
        for c, xs in zip(conv.values(), torch.split(x, conv.splits, 1)):
            stop = start + c.out_channels
            outs.append(call(c, xs, lambda t, a=start, b=stop: None if t is None else t[a:b] if t.dim() == 1
                             else t[:, a:b]))
            start = stop
        return torch.cat(outs, 1)
    except Exception:
        _uncount(bn, counted)
        raise


def _bn_call(bn):
    """(training, momentum, running_mean, running_var, whether num_batches_tracked was counted) for a
    fused call of BatchNorm ``bn``, with ``nn.BatchNorm2d``'s bookkeeping done once per forward."""
    from ._state import _bn_pre_hook, in_recompute, inside_region

    if in_recompute() and not inside_region():
        # a rerun inside an outer region: normalize as before, touch no buffer
        training = bn.training or (bn.running_mean is None and bn.running_var is None)
        return training, 0.0, (None if training else bn.running_mean), (None if training else bn.running_var), False
    if inside_region():  # in a region's rerun: the buffers are restored when it ends, as a BatchNorm module's
        _bn_pre_hook(bn, ())
    counted = bn.training and bn.track_running_stats and bn.num_batches_tracked is not None
    return (*bn_call_args(bn), counted)


def _uncount(bn, counted):
    # the call did not happen (rejected arguments, or the op raised): it counts no batch
    if counted:
        with torch.no_grad():
            bn.num_batches_tracked.sub_(1)


def bn_act_conv_call(bn, conv, x, activation="relu"):
    """``conv(act(bn(x)))`` through the fused op, with ``nn.BatchNorm2d``'s bookkeeping (running
    statistics, ``num_batches_tracked``) done once per forward. ``activation`` None: none."""
    from . import functional as F

    training, factor, rm, rv, counted = _bn_call(bn)
    try:
        return F.bn_act_conv(
            x, bn.weight, bn.bias, rm, rv, conv.weight, training=training, momentum=factor, eps=bn.eps,
            stride=list(conv.stride), padding=_conv_padding(conv), dilation=list(conv.dilation),
            bias=conv.bias, activation=activation, groups=conv.groups,
        )
    except Exception:
        _uncount(bn, counted)
        raise
