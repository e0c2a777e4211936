"""Drop-in modules whose forward is a fused recompute op.

Parameters and buffers are laid out exactly as in the unfused modules, so
state_dicts load both ways (``LinearReLU`` <-> ``nn.Linear``; ``FusedMLP`` holds
``fc1``/``fc2``; ``GatedMLP`` ``gate_proj``/``up_proj``/``down_proj`` as Llama's MLP;
``MixFFN`` ``fc1``/``dwconv``/``fc2`` as timm's PVT-v2 MLP; ``XIELUMLP`` ``up_proj``/``act_fn``/``down_proj`` as
Apertus's MLP; ``MoEExperts`` ``gate_up_proj``/``down_proj`` as
Hugging Face's experts; ``ConvBNReLU`` holds
``conv``/``bn``).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as TF
from torch.nn.utils import parametrize

from . import functional as F
from ._patterns import (_conv_padding, _own_hooks, activation_name, bn_act_conv_call, conv_bn_act_call, is_linear,
                        is_same_depthwise, norm_call_args, norm_kind)
from ._validate import check_activation, check_int, check_module, check_number, check_probability, check_tensor, pair
from .reference import ACTIVATIONS, activation_forward, xielu

__all__ = ["LinearReLU", "FusedMLP", "GatedMLP", "MixFFN", "XIELU", "XIELUMLP", "MoEExperts", "ConvBNReLU",
           "BNReLUConv"]


def _act_name(act):
    name = act if isinstance(act, str) else activation_name(act)
    if name is None:
        raise ValueError(
            f"act must be a supported activation (nn.ReLU, nn.GELU, nn.SiLU, nn.ReLU6, nn.Hardswish, "
            f"nn.LeakyReLU or one of the names {sorted(ACTIVATIONS)} or 'leaky_relu:<negative slope>'), "
            f"got {act!r}"
        )
    return check_activation(name, "act")


def _as_built(*linears) -> bool:
    """Whether the held Linears are still what the fused op computes with: plain ``nn.Linear``
    without hooks of their own. A pre-hook may compute the weight at each call (pruning, the old
    ``weight_norm``), a module put in one's place (a LoRA layer) computes more: then the module
    runs its submodules as they are, unfused (parametrizations need nothing: reading ``weight``
    computes it)."""
    return all(is_linear(m, parametrized=True) and not _own_hooks(m) for m in linears)


def _check_linear_module(m, name):
    """An ``nn.Linear`` whose call is ``F.linear``: a subclass with its own forward (QAT's
    fake-quantized Linear, ...) would lose it in the fused op."""
    check_module(m, name, nn.Linear)
    if not is_linear(m, parametrized=True):
        raise TypeError(f"{name} must be an nn.Linear, got the subclass {type(m).__name__}, whose own forward the "
                        "fused op would skip")


def _check_features(x, name, expected, owner):
    check_tensor(x, "input", min_ndim=1)
    if x.shape[-1] != expected:
        raise ValueError(
            f"input must have last dimension {name}={expected} for {owner}, got shape {tuple(x.shape)}"
        )


def _make_norm(norm, size, eps, device, dtype):
    """The FFN modules' ``norm`` argument as a module: None, ``nn.LayerNorm`` or ``nn.RMSNorm``."""
    if norm is None:
        return None
    eps = check_number(eps, "norm_eps", min_value=0.0)
    if norm == "layer":
        return nn.LayerNorm(size, eps=eps, device=device, dtype=dtype)
    if norm == "rms":
        return nn.RMSNorm(size, eps=eps, device=device, dtype=dtype)
    raise ValueError(f"norm must be None, 'layer' (nn.LayerNorm) or 'rms' (nn.RMSNorm), got {norm!r}")


def _check_norm_module(norm, size):
    if norm is None:
        return
    if not isinstance(norm, nn.Module) or norm_kind(norm) is None:
        raise TypeError(f"norm must be None, an nn.LayerNorm or nn.RMSNorm over the last dimension, or a module "
                        f"computing Hugging Face's Llama or Gemma RMSNorm, got {type(norm).__name__}")
    w = getattr(norm, "weight", None)
    got = w.shape[0] if isinstance(w, torch.Tensor) else norm.normalized_shape[0]
    if got != size:
        raise ValueError(f"norm must normalize {size} features (the first layer's in_features), got {got}")


def _ffn_input(module, x, fused=True):
    """``(x, the fused op's norm arguments)`` of an FFN module holding a ``norm``: the norm runs inside
    the op where it can (``fused``), else here, as the module it is (hooks, another dtype)."""
    norm = module._modules.get("norm")
    if norm is None:
        return x, {}
    args = norm_call_args(norm, x) if fused else None
    return (norm(x), {}) if args is None else (x, args)


_NORM_ARGS = """norm: None, ``"layer"`` or ``"rms"``: an ``nn.LayerNorm`` or ``nn.RMSNorm`` over
            ``in_features`` (held as ``norm``, epsilon ``norm_eps``) run first, inside the fused op:
            it keeps the norm's input in place of its output (a pre-norm transformer's FFN sublayer)."""


class LinearReLU(nn.Linear):
    """``act(Linear(x))`` keeping only ``x`` for backward; ``activation`` defaults to ReLU.

    An ``nn.Linear`` (same parameters, same state_dict keys) whose forward runs
    :func:`fusedrc.functional.linear_act`: the pre-activation is never stored; the
    backward recomputes it inside the gradient kernel.

    Args:
        in_features, out_features, bias, device, dtype: as in ``nn.Linear``.
        activation: ``"relu"`` (default), ``"relu2"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``,
            ``"relu6"``, ``"hardswish"``, ``"quick_gelu"`` or ``"leaky_relu"`` (``"leaky_relu:0.1"``:
            negative slope 0.1).

    Example::

        >>> m = fusedrc.nn.LinearReLU(16, 32, activation="gelu")
        >>> m(torch.randn(4, 16)).shape
        torch.Size([4, 32])
    """

    def __init__(self, in_features, out_features, bias=True, activation="relu", device=None, dtype=None):
        check_int(in_features, "in_features")
        check_int(out_features, "out_features")
        check_activation(activation)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation

    @classmethod
    def from_modules(cls, linear: nn.Linear, act: nn.Module | str = "relu"):
        """Wrap an ``nn.Linear`` (sharing its parameters) and an activation module or name."""
        _check_linear_module(linear, "linear")
        if _own_hooks(linear) or parametrize.is_parametrized(linear):
            raise ValueError(
                "linear has hooks or parametrizations (pruning, weight_norm, spectral_norm, ...) that compute its "
                "weight at each call; a LinearReLU shares the Linear's parameters, not its hooks: apply them to "
                "the LinearReLU instead")
        name = _act_name(act)
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.weight, m.bias = linear.weight, linear.bias
        m.activation = name
        return m

    def forward(self, x):
        """``act(x @ weight.T + bias)`` for ``x`` of shape ``(*, in_features)``."""
        _check_features(x, "in_features", self.in_features, type(self).__name__)
        return F.linear_act(x, self.weight, self.bias, self.activation)

    def extra_repr(self):
        return super().extra_repr() + f", activation={self.activation!r}"


class FusedMLP(nn.Module):
    """The transformer FFN ``fc2(act(fc1(x)))``, keeping only ``x`` for backward.

    Holds ``fc1``/``fc2`` as ``nn.Linear`` submodules (state_dicts map to the plain
    FFN's); its forward runs :func:`fusedrc.functional.fused_mlp`: the hidden
    activation never reaches memory, and backward runs 5 GEMMs.

    Args:
        in_features, hidden_features: widths of the input and the hidden layer.
        out_features: width of the output (default ``in_features``).
        bias, device, dtype: as in ``nn.Linear``, for both layers.
        activation: ``"relu"`` (default), ``"relu2"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``,
            ``"relu6"``, ``"hardswish"``, ``"quick_gelu"`` or ``"leaky_relu"`` (``"leaky_relu:0.1"``:
            negative slope 0.1).
        dropout: dropout probability on the hidden activation in training mode (``nn.Dropout``
            between the layers), fused: its mask is regenerated in backward, never stored.
        {norm}

    Example::

        >>> ffn = fusedrc.nn.FusedMLP(16, 64, activation="gelu_tanh")
        >>> ffn(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, in_features, hidden_features, out_features=None, bias=True, activation="relu",
                 device=None, dtype=None, *, dropout=0.0, norm=None, norm_eps=1e-5):
        check_int(in_features, "in_features")
        check_int(hidden_features, "hidden_features")
        if out_features is not None:
            check_int(out_features, "out_features")
        check_activation(activation)
        dropout = check_probability(dropout, "dropout")
        norm = _make_norm(norm, in_features, norm_eps, device, dtype)
        super().__init__()
        self.norm = norm
        self.dropout = dropout
        out_features = in_features if out_features is None else out_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = check_activation(activation)

    @classmethod
    def from_modules(cls, fc1: nn.Linear, act: nn.Module | str, fc2: nn.Linear, dropout: float = 0.0, *,
                     norm: nn.Module | None = None):
        """Wrap two ``nn.Linear`` layers (sharing their parameters), an activation module or name,
        a dropout probability (or the ``nn.Dropout`` between them) and the norm before them, if any
        (``nn.LayerNorm``, ``nn.RMSNorm`` or a Hugging Face Llama RMSNorm)."""
        _check_linear_module(fc1, "fc1")
        _check_linear_module(fc2, "fc2")
        _check_norm_module(norm, fc1.in_features)
        name = _act_name(act)
        if fc2.in_features != fc1.out_features:
            raise ValueError(f"fc2.in_features ({fc2.in_features}) must equal fc1.out_features ({fc1.out_features})")
        if isinstance(dropout, nn.Module):
            if type(dropout) is not nn.Dropout:
                raise TypeError(f"dropout must be a float or an nn.Dropout, got {type(dropout).__name__}")
            dropout = dropout.p
        p = check_probability(dropout, "dropout")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.norm, m.fc1, m.fc2, m.activation, m.dropout = norm, fc1, fc2, name, p
        return m

    def forward(self, x):
        """``fc2(dropout(act(fc1(norm(x)))))`` for ``x`` of shape ``(*, in_features)``."""
        _check_features(x, "in_features", self.fc1.in_features, type(self).__name__)
        p = self.dropout if self.training else 0.0
        if not _as_built(self.fc1, self.fc2):
            x, _ = _ffn_input(self, x, fused=False)
            return self.fc2(TF.dropout(activation_forward(self.fc1(x), self.activation), p))
        x, norm = _ffn_input(self, x)
        return F.fused_mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self.activation,
                           dropout_p=p, **norm)

    def extra_repr(self):
        return f"activation={self.activation!r}" + (f", dropout={self.dropout}" if self.dropout else "")

    def __setstate__(self, state):
        state.setdefault("dropout", 0.0)  # pickled before dropout existed
        super().__setstate__(state)


class GatedMLP(nn.Module):
    """The gated FFN ``down_proj(act(gate_proj(x)) * up_proj(x))`` (SwiGLU with ``"silu"``, as in
    Llama, Mistral and Qwen2; GeGLU with ``"gelu_tanh"``, as in Gemma), keeping only ``x`` for backward.

    Holds ``gate_proj``, ``up_proj`` and ``down_proj`` as ``nn.Linear`` submodules, the names
    Hugging Face's ``LlamaMLP`` uses, so its state_dict loads as is. The forward runs
    :func:`fusedrc.functional.gated_mlp`: no hidden-sized intermediate is kept, and backward
    never reruns ``down_proj``.

    Args:
        in_features, hidden_features: widths of the input and the hidden layer.
        out_features: width of the output (default ``in_features``).
        bias, device, dtype: as in ``nn.Linear``, for the three layers (Llama: ``bias=False``).
        activation: ``"silu"`` (default), ``"relu"``, ``"relu2"``, ``"gelu"``, ``"gelu_tanh"``, ``"relu6"``,
            ``"hardswish"``, ``"quick_gelu"`` or ``"leaky_relu"`` (``"leaky_relu:0.1"``: negative slope 0.1).
        dropout: dropout probability on the gated product in training mode (T5 v1.1's
            ``T5DenseGatedActDense``); its mask is regenerated in backward, never stored.
        {norm}

    Example::

        >>> mlp = fusedrc.nn.GatedMLP(16, 48, bias=False)
        >>> mlp(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, in_features, hidden_features, out_features=None, bias=False, activation="silu",
                 device=None, dtype=None, *, dropout=0.0, norm=None, norm_eps=1e-5):
        check_int(in_features, "in_features")
        check_int(hidden_features, "hidden_features")
        dropout = check_probability(dropout, "dropout")
        if out_features is not None:
            check_int(out_features, "out_features")
        norm = _make_norm(norm, in_features, norm_eps, device, dtype)
        super().__init__()
        self.norm = norm
        out_features = in_features if out_features is None else out_features
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(in_features, hidden_features, **kw)
        self.up_proj = nn.Linear(in_features, hidden_features, **kw)
        self.down_proj = nn.Linear(hidden_features, out_features, **kw)
        self.activation = check_activation(activation)
        self.dropout = dropout

    @classmethod
    def from_modules(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, act: nn.Module | str, *,
                     norm: nn.Module | None = None):
        """Wrap three ``nn.Linear`` layers (sharing their parameters), an activation module or name and
        the norm before them, if any (``nn.LayerNorm``, ``nn.RMSNorm`` or a Hugging Face Llama RMSNorm:
        Llama's ``post_attention_layernorm``)."""
        _check_norm_module(norm, gate_proj.in_features)
        _check_linear_module(gate_proj, "gate_proj")
        _check_linear_module(up_proj, "up_proj")
        _check_linear_module(down_proj, "down_proj")
        name = _act_name(act)
        if up_proj.weight.shape != gate_proj.weight.shape:
            raise ValueError(f"up_proj must have gate_proj's shape (out_features={gate_proj.out_features}, "
                             f"in_features={gate_proj.in_features}), got ({up_proj.out_features}, "
                             f"{up_proj.in_features})")
        if down_proj.in_features != gate_proj.out_features:
            raise ValueError(f"down_proj.in_features ({down_proj.in_features}) must equal "
                             f"gate_proj.out_features ({gate_proj.out_features})")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.norm = norm
        m.gate_proj, m.up_proj, m.down_proj, m.activation, m.dropout = gate_proj, up_proj, down_proj, name, 0.0
        return m

    def forward(self, x):
        """``down_proj(act(gate_proj(h)) * up_proj(h))``, ``h = norm(x)``, for ``x`` of shape ``(*, in_features)``."""
        _check_features(x, "in_features", self.gate_proj.in_features, type(self).__name__)
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        p = self.dropout if self.training else 0.0
        if not _as_built(g, u, d):
            x, _ = _ffn_input(self, x, fused=False)
            return d(TF.dropout(activation_forward(g(x), self.activation) * u(x), p))
        x, norm = _ffn_input(self, x)
        return F.gated_mlp(x, g.weight, g.bias, u.weight, u.bias, d.weight, d.bias, self.activation, dropout_p=p,
                           **norm)

    def extra_repr(self):
        return f"activation={self.activation!r}" + (f", dropout={self.dropout}" if self.dropout else "")

    def __setstate__(self, state):
        state.setdefault("dropout", 0.0)  # pickled before dropout existed
        super().__setstate__(state)


for _cls in (FusedMLP, GatedMLP):
    if _cls.__doc__:  # None under python -OO
        _cls.__doc__ = _cls.__doc__.replace("{norm}", _NORM_ARGS)


class MixFFN(nn.Module):
    """SegFormer's Mix-FFN ``fc2(dropout(act(dwconv(fc1(x)))))``, the depthwise conv over each image's
    grid of tokens, keeping only ``x`` for backward (:func:`fusedrc.functional.mix_ffn`).

    Holds ``fc1``, ``dwconv`` (``nn.Conv2d(hidden, hidden, kernel_size, padding=kernel_size // 2,
    groups=hidden)``) and ``fc2``, named as in timm's PVT-v2 ``MlpWithDepthwiseConv``.

    Args:
        in_features, hidden_features: widths of the input and the hidden layer.
        out_features: width of the output (default ``in_features``).
        kernel_size: the depthwise conv's (odd) kernel size, 3 by default.
        activation: as in :class:`FusedMLP`; ``"gelu"`` by default.
        relu_first: a ReLU between fc1 and the conv (PVT-v2's linear variant, timm's ``extra_relu``).
        dropout: dropout probability after the activation in training mode, fused (as :class:`FusedMLP`'s).
        bias, device, dtype: as in ``nn.Linear``, for the three layers.

    Example::

        >>> ffn = fusedrc.nn.MixFFN(32, 128)
        >>> ffn(torch.randn(2, 4 * 6, 32), 4, 6).shape
        torch.Size([2, 24, 32])
    """

    def __init__(self, in_features, hidden_features, out_features=None, kernel_size=3, activation="gelu",
                 dropout=0.0, bias=True, device=None, dtype=None, *, relu_first=False):
        check_int(in_features, "in_features")
        check_int(hidden_features, "hidden_features")
        if out_features is not None:
            check_int(out_features, "out_features")
        if check_int(kernel_size, "kernel_size", min_value=1) % 2 == 0:
            raise ValueError(f"kernel_size must be odd (a 'same' depthwise conv), got {kernel_size}")
        super().__init__()
        out_features = in_features if out_features is None else out_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias, device=device, dtype=dtype)
        self.dwconv = nn.Conv2d(hidden_features, hidden_features, kernel_size, padding=kernel_size // 2,
                                groups=hidden_features, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = check_activation(activation)
        self.dropout = check_probability(dropout, "dropout")
        if not isinstance(relu_first, bool):
            raise TypeError(f"relu_first must be a bool, got {type(relu_first).__name__}")
        self.relu_first = relu_first

    def forward(self, x, height, width):
        """``x`` of shape ``(*, height * width, in_features)``: each image's tokens in row-major order."""
        _check_features(x, "in_features", self.fc1.in_features, type(self).__name__)
        height, width = check_int(height, "height", min_value=1), check_int(width, "width", min_value=1)
        if x.dim() < 2 or x.shape[-2] != height * width:
            raise ValueError(f"input must have shape (*, height * width, in_features) = (*, {height * width}, "
                             f"{x.shape[-1]}) for height {height} and width {width}, got {tuple(x.shape)}")
        p = self.dropout if self.training else 0.0
        conv = self.dwconv
        if not (_as_built(self.fc1, self.fc2) and is_same_depthwise(conv, self.fc1.out_features)):
            # a layer swapped or hooked: the modules as they are, on the (B, hidden, height, width) view
            h = torch.relu(self.fc1(x)) if self.relu_first else self.fc1(x)
            images = h.reshape(-1, *h.shape[-2:]).transpose(1, 2).reshape(-1, h.shape[-1], height, width)
            h = activation_forward(conv(images).flatten(2).transpose(1, 2), self.activation)
            return self.fc2(TF.dropout(h, p)).reshape(*x.shape[:-1], self.fc2.out_features)
        return F.mix_ffn(x, height, width, self.fc1.weight, self.fc1.bias, conv.weight, conv.bias, self.fc2.weight,
                         self.fc2.bias, self.activation, p, relu_first=self.relu_first)

    def extra_repr(self):
        return f"activation={self.activation!r}" + (f", dropout={self.dropout}" if self.dropout else "") \
            + (", relu_first=True" if self.relu_first else "")


class XIELU(nn.Module):
    """The xIELU activation (arXiv 2411.13010) with its learned alphas, laid out as Hugging Face's
    ``XIELUActivation`` (parameters ``alpha_p``, ``alpha_n``, buffers ``beta``, ``eps``): ``alpha_p h² + beta h``
    for ``h > 0``, ``alpha_n (expm1(min(h, eps)) - h) + beta h`` otherwise, with ``alpha_p = softplus(self.alpha_p)``
    and ``alpha_n = beta + softplus(self.alpha_n)``. Alone it runs eagerly; inside :class:`XIELUMLP` it is fused."""

    def __init__(self, alpha_p_init=0.8, alpha_n_init=0.8, beta=0.5, eps=-1e-6, device=None, dtype=None):
        for v, name in ((alpha_p_init, "alpha_p_init"), (alpha_n_init - beta, "alpha_n_init - beta")):
            if not check_number(v, name) > 0:
                raise ValueError(f"{name} must be > 0 (the softplus of a parameter), got {v}")
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        inv_softplus = lambda v: torch.log(torch.expm1(torch.tensor(float(v), **kw))).reshape(1)  # noqa: E731
        self.alpha_p = nn.Parameter(inv_softplus(alpha_p_init))
        self.alpha_n = nn.Parameter(inv_softplus(alpha_n_init - beta))
        self.register_buffer("beta", torch.tensor(float(check_number(beta, "beta")), **kw))
        self.register_buffer("eps", torch.tensor(float(check_number(eps, "eps")), **kw))
        self._beta_scalar, self._eps_scalar = float(beta), float(eps)  # (a meta module keeps these)
        self._scalars()

    def _scalars(self):
        # the buffers' values as floats for the fused op (read here, not at each call: no device sync)
        if self.beta.device.type != "meta":
            self._beta_scalar, self._eps_scalar = float(self.beta), float(self.eps)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._scalars()

    def alphas(self):
        """(alpha_p, alpha_n): the effective values, differentiable in the parameters."""
        return TF.softplus(self.alpha_p), self.beta + TF.softplus(self.alpha_n)

    def forward(self, h):
        """xIELU of ``h``, elementwise (the module's formula, in ``h``'s promoted dtype)."""
        return xielu(h, *self.alphas(), self.beta, self._eps_scalar)


class XIELUMLP(nn.Module):
    """Apertus's MLP ``down_proj(act_fn(up_proj(x)))`` with :class:`XIELU`, keeping only ``x`` for backward
    (:func:`fusedrc.functional.xielu_mlp`); its state_dict is Hugging Face's ``ApertusMLP``'s.

    Args:
        in_features, hidden_features: widths of the input and the hidden layer.
        out_features: width of the output (default ``in_features``).
        bias, device, dtype: as in ``nn.Linear`` (Apertus: no biases, the default).
        alpha_p_init, alpha_n_init, beta, eps: :class:`XIELU`'s.

    Example::

        >>> mlp = fusedrc.nn.XIELUMLP(16, 64)
        >>> mlp(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, in_features, hidden_features, out_features=None, bias=False, device=None, dtype=None, *,
                 alpha_p_init=0.8, alpha_n_init=0.8, beta=0.5, eps=-1e-6):
        check_int(in_features, "in_features")
        check_int(hidden_features, "hidden_features")
        if out_features is not None:
            check_int(out_features, "out_features")
        super().__init__()
        out_features = in_features if out_features is None else out_features
        self.up_proj = nn.Linear(in_features, hidden_features, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(hidden_features, out_features, bias=bias, device=device, dtype=dtype)
        self.act_fn = XIELU(alpha_p_init, alpha_n_init, beta, eps, device=device, dtype=dtype)

    def forward(self, x):
        """``down_proj(act_fn(up_proj(x)))`` for ``x`` of shape ``(*, in_features)``; fused while the three modules
        are as built (no hooks of their own, not swapped)."""
        _check_features(x, "in_features", self.up_proj.in_features, type(self).__name__)
        if not (_as_built(self.up_proj, self.down_proj) and type(self.act_fn) is XIELU
                and not _own_hooks(self.act_fn)):
            return self.down_proj(self.act_fn(self.up_proj(x)))
        act = self.act_fn
        return F.xielu_mlp(x, self.up_proj.weight, self.up_proj.bias, self.down_proj.weight, self.down_proj.bias,
                           *act.alphas(), act._beta_scalar, act._eps_scalar)


class MoEExperts(nn.Module):
    """A Mixture-of-Experts layer's routed experts, in Hugging Face's layout: token ``t``'s output is
    ``sum_j top_k_weights[t, j] * expert_e(x[t])``, ``e = top_k_index[t, j]``, each expert a gated
    FFN ``(act(x Wg_eᵀ) * (x Wu_eᵀ)) Wd_eᵀ`` (or, ``gated=False``, ``act(x Wu_eᵀ) Wd_eᵀ``). The router
    stays yours: it hands the forward the chosen experts and their weights.

    Parameters: ``gate_up_proj`` ``(num_experts, 2 * intermediate_size, hidden_size)`` (each expert's
    gate rows, then its up rows; ``up_proj`` ``(num_experts, intermediate_size, hidden_size)`` when
    ungated) and ``down_proj`` ``(num_experts, out_features, intermediate_size)``: the names and
    shapes of transformers' ``MixtralExperts`` / ``NemotronHExperts``, so their state_dicts load as
    they are. The forward runs :func:`fusedrc.functional.moe_experts`: only its inputs are kept for
    backward.

    Args:
        num_experts, hidden_size, intermediate_size: the experts' count and widths.
        out_features: width of the output (default ``hidden_size``).
        activation: as in :class:`GatedMLP` (``"silu"`` by default).
        gated: False for ungated experts.
        device, dtype: of the parameters.

    Example::

        >>> experts = fusedrc.nn.MoEExperts(num_experts=4, hidden_size=16, intermediate_size=32)
        >>> x = torch.randn(6, 16)
        >>> weights, index = torch.randn(6, 4).softmax(-1).topk(2)
        >>> experts(x, index, weights).shape
        torch.Size([6, 16])
    """

    def __init__(self, num_experts, hidden_size, intermediate_size, out_features=None, activation="silu",
                 gated=True, device=None, dtype=None):
        for v, name in ((num_experts, "num_experts"), (hidden_size, "hidden_size"),
                        (intermediate_size, "intermediate_size")):
            check_int(v, name, min_value=1)
        if out_features is not None:
            check_int(out_features, "out_features", min_value=1)
        if not isinstance(gated, bool):
            raise TypeError(f"gated must be a bool, got {type(gated).__name__} {gated!r}")
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        rows = 2 * intermediate_size if gated else intermediate_size
        self.num_experts, self.gated = num_experts, gated
        self.activation = check_activation(activation)
        first = nn.Parameter(torch.empty(num_experts, rows, hidden_size, **kw))
        self.register_parameter("gate_up_proj" if gated else "up_proj", first)
        self.down_proj = nn.Parameter(torch.empty(num_experts, out_features or hidden_size, intermediate_size, **kw))
        self.reset_parameters()

    def reset_parameters(self):
        """Each expert's matrices as ``nn.Linear`` initializes its weight (Kaiming uniform, a = sqrt(5))."""
        for p in (self._first(), self.down_proj):
            for e in range(p.shape[0]):
                nn.init.kaiming_uniform_(p[e], a=math.sqrt(5))

    def _first(self):
        return self.gate_up_proj if self.gated else self.up_proj

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """``(*, hidden_size)`` states, ``(*, k)`` chosen experts and their weights -> ``(*, out_features)``."""
        first = self._first()
        _check_features(hidden_states, "hidden_size", first.shape[2], type(self).__name__)
        lead = hidden_states.shape[:-1]
        for t, name in ((top_k_index, "top_k_index"), (top_k_weights, "top_k_weights")):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != len(lead) + 1 or t.shape[:-1] != lead:
                raise ValueError(f"{name} must have shape ({', '.join(map(str, lead))}, k) to match hidden_states' "
                                 f"leading dimensions, got {tuple(t.shape)}")
        y = F.moe_experts(hidden_states.reshape(-1, first.shape[2]), top_k_index.reshape(-1, top_k_index.shape[-1]),
                          top_k_weights.reshape(-1, top_k_weights.shape[-1]), first, self.down_proj, self.activation,
                          gated=self.gated)
        return y.reshape(*lead, self.down_proj.shape[1])

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, hidden_size={self._first().shape[2]}, "
                f"intermediate_size={self.down_proj.shape[2]}, out_features={self.down_proj.shape[1]}, "
                f"activation={self.activation!r}" + ("" if self.gated else ", gated=False"))


class ConvBNReLU(nn.Module):
    """``act(bn(conv(x)) [+ residual])`` with the conv recomputed in backward; ``activation``
    defaults to ReLU (``"silu"``: the Conv-BN-SiLU block of EfficientNet and YOLO).

    Keeps ``x`` and the per-channel batch statistics (and ``residual``) for backward.
    BatchNorm semantics follow ``nn.BatchNorm2d``: ``num_batches_tracked``,
    ``momentum=None`` (cumulative average), eval mode with running statistics.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, bias, device,
            dtype, groups: as in ``nn.Conv2d`` (zero padding; ``padding="same"`` of an even kernel
            extent pads the far side one more, as ``nn.Conv2d`` does). Grouped convs with a
            multiple of 16 output channels per group run fused Triton kernels too (a GEMM per
            group); other groupings, depthwise convs among them, the op's reference implementation
            (a direct-conv kernel is opt-in: ``kernels.conv_bn_act.DIRECT_MAX_GROUP_CHANNELS``).
        eps, momentum: as in ``nn.BatchNorm2d``.
        activation: ``"relu"`` (default), ``"relu2"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``,
            ``"relu6"``, ``"hardswish"``, ``"quick_gelu"`` or ``"leaky_relu"`` (``"leaky_relu:0.1"``: negative
            slope 0.1); None: no activation (a projection or downsample Conv-BN).

    Example::

        >>> m = fusedrc.nn.ConvBNReLU(3, 8, 3, padding=1)
        >>> m(torch.randn(2, 3, 8, 8)).shape
        torch.Size([2, 8, 8, 8])
        >>> fusedrc.nn.ConvBNReLU(3, 8, 3, padding=1, activation="silu").activation
        'silu'
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 eps=1e-5, momentum=0.1, bias=False, device=None, dtype=None, activation="relu", groups=1):
        super().__init__()
        self.activation = activation
        self.conv = _checked_conv(in_channels, out_channels, kernel_size, stride, padding, dilation, eps, momentum,
                                  bias, device, dtype, activation, groups, asymmetric=True)
        self.bn = nn.BatchNorm2d(out_channels, eps=eps, momentum=momentum, device=device, dtype=dtype)

    @classmethod
    def from_modules(cls, conv: nn.Conv2d, bn: nn.BatchNorm2d, act: nn.Module | str | None = "relu"):
        """Wrap an ``nn.Conv2d`` and an ``nn.BatchNorm2d`` (sharing their parameters and buffers)
        and an activation module or name (None: no activation)."""
        check_module(conv, "conv", nn.Conv2d, exact=True)
        check_module(bn, "bn", nn.BatchNorm2d, exact=True)
        _check_conv(conv, "conv.padding", asymmetric=True)
        if bn.num_features != conv.out_channels:
            raise ValueError(f"bn.num_features ({bn.num_features}) must equal conv.out_channels ({conv.out_channels})")
        name = None if act is None else _act_name(act)
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.activation = name
        m.conv, m.bn = conv, bn
        return m

    def forward(self, x, residual=None):
        """``act(bn(conv(x)) [+ residual])`` for ``x`` of shape ``(N, in_channels, H, W)``."""
        conv, bn = self.conv, self.bn
        if _unfused_conv_bn(self, x):
            y = bn(conv(x))
            y = y if residual is None else y + residual
            return y if self.activation is None else activation_forward(y, self.activation)
        return conv_bn_act_call(conv, bn, x, residual, self.activation)

    def extra_repr(self):
        return f"activation={self.activation!r}"

    def __setstate__(self, state):
        state.setdefault("activation", "relu")  # pickled before activation existed
        super().__setstate__(state)


class BNReLUConv(nn.Module):
    """``conv(act(bn(x)))``, the pre-activation order of DenseNet and pre-activation ResNets, with
    the normalized activation rebuilt in backward (one elementwise pass; no conv reruns).

    Keeps ``x`` and its per-channel batch statistics for backward, where eager keeps ``x`` and
    the activation. BatchNorm semantics follow ``nn.BatchNorm2d`` (over ``in_channels``).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, bias, groups, device,
            dtype: as in ``nn.Conv2d`` (zero padding); ``bias`` defaults to False.
        eps, momentum: as in ``nn.BatchNorm2d``.
        activation: as in :class:`ConvBNReLU`; ``"relu"`` by default; None: none.

    Example::

        >>> m = fusedrc.nn.BNReLUConv(8, 4, 3, padding=1)
        >>> m(torch.randn(2, 8, 6, 6)).shape
        torch.Size([2, 4, 6, 6])
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 eps=1e-5, momentum=0.1, bias=False, device=None, dtype=None, activation="relu", groups=1):
        conv = _checked_conv(in_channels, out_channels, kernel_size, stride, padding, dilation, eps, momentum,
                             bias, device, dtype, activation, groups)
        super().__init__()
        self.activation = activation
        self.bn = nn.BatchNorm2d(in_channels, eps=eps, momentum=momentum, device=device, dtype=dtype)
        self.conv = conv

    @classmethod
    def from_modules(cls, bn: nn.BatchNorm2d, conv: nn.Conv2d, act: nn.Module | str | None = "relu"):
        """Wrap an ``nn.BatchNorm2d``, an activation module or name (None: none) and an
        ``nn.Conv2d``, sharing their parameters and buffers."""
        check_module(bn, "bn", nn.BatchNorm2d, exact=True)
        check_module(conv, "conv", nn.Conv2d, exact=True)
        _check_conv(conv, "conv.padding")
        if bn.num_features != conv.in_channels:
            raise ValueError(f"bn.num_features ({bn.num_features}) must equal conv.in_channels ({conv.in_channels})")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.activation = None if act is None else _act_name(act)
        m.bn, m.conv = bn, conv
        return m

    def forward(self, x):
        """``conv(act(bn(x)))`` for ``x`` of shape ``(N, in_channels, H, W)``."""
        bn, conv = self.bn, self.conv
        if _unfused_conv_bn(self, x):
            a = bn(x)
            return conv(a if self.activation is None else activation_forward(a, self.activation))
        return bn_act_conv_call(bn, conv, x, self.activation)

    def extra_repr(self):
        return f"activation={self.activation!r}"


def _unfused_conv_bn(module, x) -> bool:
    """Check ``x`` against a conv-BN module's conv; whether its submodules must run as they are,
    unfused: hooks of their own (pruning, a pre-hook computing the weight) or other modules put in
    their place."""
    check_tensor(x, "input", ndim=4)
    conv, bn = module.conv, module.bn
    if x.shape[1] != conv.in_channels:
        raise ValueError(
            f"input must have in_channels={conv.in_channels} channels (N, {conv.in_channels}, H, W) "
            f"for {type(module).__name__}, got shape {tuple(x.shape)}"
        )
    return (parametrize.type_before_parametrizations(conv) is not nn.Conv2d or type(bn) is not nn.BatchNorm2d
            or _own_hooks(conv) or _own_hooks(bn))


def _checked_conv(in_channels, out_channels, kernel_size, stride, padding, dilation, eps, momentum, bias, device,
                  dtype, activation, groups, asymmetric=False):
    """The ``nn.Conv2d`` of a conv-BN module, its arguments checked (the BatchNorm's too); ``asymmetric``:
    a 'same' padding wider on the far side is allowed (a Conv-BN's input is padded as aten pads it)."""
    check_int(in_channels, "in_channels")
    check_int(out_channels, "out_channels")
    pair(kernel_size, "kernel_size", min_value=1)
    pair(stride, "stride", min_value=1)
    pair(dilation, "dilation", min_value=1)
    if not isinstance(padding, str):
        pair(padding, "padding", min_value=0)
    check_number(eps, "eps", min_value=0)
    if momentum is not None:
        check_number(momentum, "momentum")
    if activation is not None:
        check_activation(activation)
    check_int(groups, "groups", min_value=1)
    for name, channels in (("in_channels", in_channels), ("out_channels", out_channels)):
        if channels % groups:
            raise ValueError(f"{name} ({channels}) must be divisible by groups ({groups})")
    conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, groups=groups,
                     bias=bias, device=device, dtype=dtype)
    _check_conv(conv, "padding", asymmetric)
    return conv


def _check_conv(conv, name, asymmetric=False):
    if conv.padding_mode != "zeros":
        raise ValueError(f"conv.padding_mode must be 'zeros', got {conv.padding_mode!r}")
    if not asymmetric and _conv_padding(conv) is None:
        raise ValueError(
            f"{name}='same' needs an odd kernel extent dilation*(kernel_size-1)+1 (symmetric padding), got "
            f"kernel_size={tuple(conv.kernel_size)}, dilation={tuple(conv.dilation)}"
        )
