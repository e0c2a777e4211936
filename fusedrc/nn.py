"""Drop-in modules whose forward is a fused recompute op.

Parameters and buffers are laid out exactly as in the unfused modules, so
state_dicts load both ways (``LinearReLU`` <-> ``nn.Linear``; ``FusedMLP`` holds
``fc1``/``fc2``; ``ConvBNReLU`` holds ``conv``/``bn``).
"""
from __future__ import annotations

import torch
from torch import nn

from . import functional as F
from ._patterns import activation_name, conv_bn_relu_call
from .reference import check_activation

__all__ = ["LinearReLU", "FusedMLP", "ConvBNReLU"]


class LinearReLU(nn.Linear):
    """``act(Linear(x))`` keeping only ``x`` for backward; ``activation`` defaults to ReLU."""

    def __init__(self, in_features, out_features, bias=True, activation="relu", device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = check_activation(activation)

    @classmethod
    def from_modules(cls, linear: nn.Linear, act: nn.Module | str = "relu"):
        """Wrap an ``nn.Linear`` (sharing its parameters) and an activation module or name."""
        name = act if isinstance(act, str) else activation_name(act)
        if name is None:
            raise ValueError(f"act must be a supported activation (ReLU, GELU, SiLU or a name), got {act!r}")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.weight, m.bias = linear.weight, linear.bias
        m.activation = check_activation(name)
        return m

    def forward(self, x):
        return F.linear_act(x, self.weight, self.bias, self.activation)

    def extra_repr(self):
        return super().extra_repr() + f", activation={self.activation!r}"


class FusedMLP(nn.Module):
    """The transformer FFN ``fc2(act(fc1(x)))``, keeping only ``x`` for backward."""

    def __init__(self, in_features, hidden_features, out_features=None, bias=True, activation="relu",
                 device=None, dtype=None):
        super().__init__()
        out_features = in_features if out_features is None else out_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = check_activation(activation)

    @classmethod
    def from_modules(cls, fc1: nn.Linear, act: nn.Module | str, fc2: nn.Linear):
        name = act if isinstance(act, str) else activation_name(act)
        if name is None:
            raise ValueError(f"act must be a supported activation (ReLU, GELU, SiLU or a name), got {act!r}")
        if fc2.in_features != fc1.out_features:
            raise ValueError(f"fc2.in_features ({fc2.in_features}) must equal fc1.out_features ({fc1.out_features})")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.fc1, m.fc2, m.activation = fc1, fc2, check_activation(name)
        return m

    def forward(self, x):
        return F.fused_mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self.activation)

    def extra_repr(self):
        return f"activation={self.activation!r}"


class ConvBNReLU(nn.Module):
    """``relu(bn(conv(x)) [+ residual])`` with the conv recomputed in backward.

    Keeps ``x`` and the per-channel batch statistics (and ``residual``) for backward.
    BatchNorm semantics follow ``nn.BatchNorm2d``: ``num_batches_tracked``,
    ``momentum=None`` (cumulative average), eval mode with running statistics.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 eps=1e-5, momentum=0.1, bias=False, device=None, dtype=None):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation,
                              bias=bias, device=device, dtype=dtype)
        self.bn = nn.BatchNorm2d(out_channels, eps=eps, momentum=momentum, device=device, dtype=dtype)

    @classmethod
    def from_modules(cls, conv: nn.Conv2d, bn: nn.BatchNorm2d):
        if conv.groups != 1:
            raise ValueError(f"conv must have groups=1, got groups={conv.groups}")
        if bn.num_features != conv.out_channels:
            raise ValueError(f"bn.num_features ({bn.num_features}) must equal conv.out_channels ({conv.out_channels})")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.conv, m.bn = conv, bn
        return m

    def forward(self, x, residual=None):
        return conv_bn_relu_call(self.conv, self.bn, x, residual)
