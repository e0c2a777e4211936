"""Bad input to every public function and module: a clear error naming the argument.

One table, parametrized once: each row is (id, call, exception type, regex the
message must match). The regex names the offending argument and what was
expected. Device mismatches use the 'meta' device (no GPU needed). Then NaN and
Inf: they propagate through the fused ops (forward and gradients, both
backends) exactly where plain PyTorch puts them, and are never replaced.
"""
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as TF

import fusedrc
from fusedrc import functional as F
from fusedrc import nn as fnn
from fusedrc.convert import register_rule
from fusedrc.reference import activation_forward

from _utils import backend_device

RecomputeError = fusedrc.RecomputeError
META = "meta"


def r(*shape, dtype=torch.float32, device="cpu", grad=False):
    return torch.randn(*shape, dtype=dtype, device=device, requires_grad=grad)


def x2():
    return r(2, 3)


def x4():
    return r(2, 3, 5, 5)


def w4():
    return r(4, 3, 3, 3)


def lin(x, w, b=None, **kw):
    return lambda: F.linear_act(x(), w(), b() if callable(b) else b, **kw)


def mlp(x, w1, b1, w2, b2, **kw):
    c = lambda v: v() if callable(v) else v  # noqa: E731
    return lambda: F.fused_mlp(c(x), c(w1), c(b1), c(w2), c(b2), **kw)


def gated(x, wg, bg, wu, bu, wd, bd, **kw):
    c = lambda v: v() if callable(v) else v  # noqa: E731
    return lambda: F.gated_mlp(c(x), c(wg), c(bg), c(wu), c(bu), c(wd), c(bd), **kw)


def mix(x=None, size=(3, 4), w1=None, wd=None, bd=None, **kw):
    """mix_ffn on 2 images of 3 x 4 tokens of 8 features, 16 hidden units, each default replaceable."""
    x = r(2, 12, 8) if x is None else x
    w1 = r(16, 8) if w1 is None else w1
    wd = r(16, 1, 3, 3) if wd is None else wd
    return lambda: F.mix_ffn(x, *size, w1, None, wd, bd, r(8, 16), None, **kw)


def moe(x=None, idx=None, w=None, gate_up=None, down=None, **kw):
    """moe_experts on 3 tokens of 4 features, top-2 of 3 experts of 5 hidden units, each default replaceable."""
    def call():
        args = [x() if x else r(3, 4), idx() if idx else torch.tensor([[0, 1], [1, 2], [2, 0]]),
                w() if w else r(3, 2), gate_up() if gate_up else r(3, 10, 4), down() if down else r(3, 4, 5)]
        return F.moe_experts(*args, **kw)
    return call


def cba(x=x4, w=w4, gamma=None, beta=None, rm=None, rv=None, **kw):
    c = lambda v: v() if callable(v) else v  # noqa: E731
    return lambda: F.conv_bn_act(c(x), c(w), c(gamma), c(beta), c(rm), c(rv), **kw)


def bac(x=x4, gamma=None, beta=None, rm=None, rv=None, w=w4, **kw):
    c = lambda v: v() if callable(v) else v  # noqa: E731
    return lambda: F.bn_act_conv(c(x), c(gamma), c(beta), c(rm), c(rv), c(w), **kw)


def _ffn():
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 3))


def _stack(n=4):
    return nn.Sequential(*[nn.Linear(3, 3) for _ in range(n)])


def _nested_mark():
    inner = nn.Linear(3, 3)
    fusedrc.mark(inner)
    try:
        fusedrc.mark(nn.Sequential(inner, nn.ReLU()))
    finally:
        fusedrc.unmark(inner)


def _marked_called_inside_marked():
    inner = nn.Linear(3, 3)
    outer = fusedrc.mark(nn.Sequential(inner, nn.Tanh()))
    fusedrc.mark(inner)
    outer(r(2, 3, grad=True))


def _convert(**kw):
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 3))

    def call():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fusedrc.convert(model, **kw)

    return call


EX = (torch.randn(2, 3),)
ACT = (r"activation must be one of \['gelu', 'gelu_tanh', 'hardswish', 'leaky_relu', 'quick_gelu', 'relu', 'relu2', "
       r"'relu6', 'silu'\] or 'leaky_relu:<negative slope>'")
f64 = torch.float64

# (id, call, exception, regex naming the argument and the expectation)
CASES = [
    # ------------------------------------------------------------ functional.linear_act
    ("linear_act/input-not-tensor", lambda: F.linear_act([[1.0]], r(4, 3)), TypeError,
     r"input must be a torch\.Tensor, got list"),
    ("linear_act/input-0d", lin(lambda: torch.tensor(1.0), lambda: r(4, 3)), ValueError,
     r"input must have at least 1 dimension"),
    ("linear_act/input-int", lin(lambda: torch.ones(2, 3, dtype=torch.long), lambda: r(4, 3)), TypeError,
     r"input must be a floating-point tensor of dtype float16, bfloat16, float32 or float64, got dtype torch\.int64"),
    ("linear_act/input-fp8", lin(lambda: r(2, 3).to(torch.float8_e4m3fn), lambda: r(4, 3)), TypeError,
     r"input must be a floating-point tensor of dtype .*, got dtype torch\.float8_e4m3fn"),
    ("linear_act/input-sparse", lin(lambda: r(2, 3).to_sparse(), lambda: r(4, 3)), TypeError,
     r"input must be a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    ("linear_act/weight-not-tensor", lambda: F.linear_act(x2(), nn.Linear(3, 4)), TypeError,
     r"weight must be a torch\.Tensor, got Linear"),
    ("linear_act/weight-1d", lin(x2, lambda: r(3)), ValueError, r"weight must be 2-D, got 1-D"),
    ("linear_act/weight-3d", lin(x2, lambda: r(1, 4, 3)), ValueError, r"weight must be 2-D, got 3-D"),
    ("linear_act/weight-in-features", lin(x2, lambda: r(4, 5)), ValueError,
     r"weight must have shape \(out_features, 3\) to match input's last dimension 3, got \(4, 5\)"),
    ("linear_act/weight-dtype", lin(x2, lambda: r(4, 3, dtype=f64)), TypeError,
     r"weight has dtype torch\.float64 but input has dtype torch\.float32; expected the same dtype"),
    ("linear_act/weight-int", lin(x2, lambda: torch.ones(4, 3, dtype=torch.long)), TypeError,
     r"weight must be a floating-point tensor"),
    ("linear_act/weight-device", lin(x2, lambda: r(4, 3, device=META)), ValueError,
     r"weight is on meta but input is on cpu; expected the same device"),
    ("linear_act/input-device", lin(lambda: r(2, 3, device=META), lambda: r(4, 3)), ValueError,
     r"weight is on cpu but input is on meta; expected the same device"),
    ("linear_act/bias-size", lin(x2, lambda: r(4, 3), lambda: r(5)), ValueError,
     r"bias must have shape \(4,\), got \(5,\)"),
    ("linear_act/bias-2d", lin(x2, lambda: r(4, 3), lambda: r(1, 4)), ValueError, r"bias must be 1-D"),
    ("linear_act/bias-dtype", lin(x2, lambda: r(4, 3), lambda: r(4, dtype=f64)), TypeError,
     r"bias has dtype torch\.float64 but input has dtype torch\.float32"),
    ("linear_act/bias-device", lin(x2, lambda: r(4, 3), lambda: r(4, device=META)), ValueError,
     r"bias is on meta but input is on cpu"),
    ("linear_act/activation-unknown", lin(x2, lambda: r(4, 3), activation="tanh"), ValueError, ACT + ", got 'tanh'"),
    ("linear_act/activation-none", lin(x2, lambda: r(4, 3), activation=None), ValueError, ACT + ", got None"),
    ("linear_act/leaky-slope-text", lin(x2, lambda: r(4, 3), activation="leaky_relu:big"), ValueError,
     r"activation: the slope of 'leaky_relu:big' must be a finite float"),
    ("linear_act/leaky-slope-inf", lin(x2, lambda: r(4, 3), activation="leaky_relu:inf"), ValueError,
     r"activation: the slope of 'leaky_relu:inf' must be a finite float"),
    ("linear_act/other-slope", lin(x2, lambda: r(4, 3), activation="relu:0.1"), ValueError, ACT + ", got 'relu:0.1'"),
    ("linear_act/activation-list", lin(x2, lambda: r(4, 3), activation=["relu"]), ValueError,
     ACT + r", got \['relu'\]"),
    # ------------------------------------------------------------ functional.fused_mlp
    ("fused_mlp/input-3-vs-w1", mlp(x2, r(8, 4), None, r(3, 8), None), ValueError,
     r"w1 must have shape \(out_features, 3\) to match input's last dimension 3, got \(8, 4\)"),
    ("fused_mlp/w1-none", mlp(x2, None, None, r(3, 8), None), TypeError, r"w1 must be a torch\.Tensor, got NoneType"),
    ("fused_mlp/w1-1d", mlp(x2, r(8), None, r(3, 8), None), ValueError, r"w1 must be 2-D"),
    ("fused_mlp/b1-size", mlp(x2, r(8, 3), r(7), r(3, 8), None), ValueError, r"b1 must have shape \(8,\), got \(7,\)"),
    ("fused_mlp/w2-hidden", mlp(x2, r(8, 3), None, r(3, 6), None), ValueError,
     r"w2 must have shape \(out_features, 8\) to match w1's out_features \(the hidden size 8\), got \(3, 6\)"),
    ("fused_mlp/w2-3d", mlp(x2, r(8, 3), None, r(1, 3, 8), None), ValueError, r"w2 must be 2-D, got 3-D"),
    ("fused_mlp/b2-size", mlp(x2, r(8, 3), None, r(3, 8), r(8)), ValueError, r"b2 must have shape \(3,\), got \(8,\)"),
    ("fused_mlp/w1-dtype", mlp(x2, r(8, 3, dtype=f64), None, r(3, 8), None), TypeError,
     r"w1 has dtype torch\.float64 but input has dtype torch\.float32"),
    ("fused_mlp/w2-dtype", mlp(x2, r(8, 3), None, r(3, 8, dtype=torch.float16), None), TypeError,
     r"w2 has dtype torch\.float16 but input has dtype torch\.float32"),
    ("fused_mlp/b2-dtype", mlp(x2, r(8, 3), None, r(3, 8), r(3, dtype=f64)), TypeError, r"b2 has dtype torch\.float64"),
    ("fused_mlp/w2-device", mlp(x2, r(8, 3), None, r(3, 8, device=META), None), ValueError,
     r"w2 is on meta but input is on cpu"),
    ("fused_mlp/input-device", mlp(r(2, 3, device=META), r(8, 3), None, r(3, 8), None), ValueError,
     r"w1 is on cpu but input is on meta"),
    ("fused_mlp/activation", mlp(x2, r(8, 3), None, r(3, 8), None, activation="gelu_erf"), ValueError,
     ACT + ", got 'gelu_erf'"),
    ("fused_mlp/dropout_p-above-1", mlp(x2, r(8, 3), None, r(3, 8), None, dropout_p=1.5), ValueError,
     r"dropout_p must be a probability in \[0, 1\], got 1\.5"),
    ("fused_mlp/dropout_p-negative", mlp(x2, r(8, 3), None, r(3, 8), None, dropout_p=-0.1), ValueError,
     r"dropout_p must be >= 0\.0, got -0\.1"),
    ("fused_mlp/dropout_p-nan", mlp(x2, r(8, 3), None, r(3, 8), None, dropout_p=float("nan")), ValueError,
     r"dropout_p must be a finite float"),
    ("fused_mlp/dropout_p-str", mlp(x2, r(8, 3), None, r(3, 8), None, dropout_p="0.1"), TypeError,
     r"dropout_p must be a float, got str"),
    # ------------------------------------------------------------ functional.gated_mlp
    ("gated_mlp/input-3-vs-w_gate", gated(x2, r(8, 4), None, r(8, 4), None, r(3, 8), None), ValueError,
     r"w_gate must have shape \(out_features, 3\) to match input's last dimension 3, got \(8, 4\)"),
    ("gated_mlp/w_up-shape", gated(x2, r(8, 3), None, r(7, 3), None, r(3, 8), None), ValueError,
     r"w_up must have w_gate's shape \(8, 3\), got \(7, 3\)"),
    ("gated_mlp/w_up-none", gated(x2, r(8, 3), None, None, None, r(3, 8), None), TypeError,
     r"w_up must be a torch\.Tensor, got NoneType"),
    ("gated_mlp/b_gate-size", gated(x2, r(8, 3), r(7), r(8, 3), None, r(3, 8), None), ValueError,
     r"b_gate must have shape \(8,\), got \(7,\)"),
    ("gated_mlp/b_up-dtype", gated(x2, r(8, 3), None, r(8, 3), r(8, dtype=f64), r(3, 8), None), TypeError,
     r"b_up has dtype torch\.float64 but input has dtype torch\.float32"),
    ("gated_mlp/w_down-hidden", gated(x2, r(8, 3), None, r(8, 3), None, r(3, 6), None), ValueError,
     r"w_down must have shape \(out_features, 8\) to match w_gate's out_features \(the hidden size 8\)"),
    ("gated_mlp/b_down-size", gated(x2, r(8, 3), None, r(8, 3), None, r(3, 8), r(8)), ValueError,
     r"b_down must have shape \(3,\), got \(8,\)"),
    ("gated_mlp/w_up-device", gated(x2, r(8, 3), None, r(8, 3, device=META), None, r(3, 8), None), ValueError,
     r"w_up is on meta but input is on cpu"),
    ("gated_mlp/activation", gated(x2, r(8, 3), None, r(8, 3), None, r(3, 8), None, activation="swish"), ValueError,
     ACT + ", got 'swish'"),
    # ------------------------------------------------------------ functional.moe_experts
    ("moe_experts/hidden_states-3d", moe(x=lambda: r(1, 3, 4)), ValueError, r"hidden_states must be 2-D, got 3-D"),
    ("moe_experts/top_k_index-float", moe(idx=lambda: r(3, 2)), TypeError,
     r"top_k_index must be an integer tensor \(the chosen experts\), got dtype torch\.float32"),
    ("moe_experts/top_k_index-tokens", moe(idx=lambda: torch.zeros(2, 2, dtype=torch.long)), ValueError,
     r"top_k_index must have shape \(tokens, k\) = \(3, k\) to match hidden_states, got \(2, 2\)"),
    ("moe_experts/top_k_index-range", moe(idx=lambda: torch.tensor([[0, 1], [1, 3], [2, 0]])), ValueError,
     r"top_k_index must hold expert numbers in \[0, 3\), got values in \[0, 3\]"),
    ("moe_experts/top_k_weights-shape", moe(w=lambda: r(3, 1)), ValueError,
     r"top_k_weights must have top_k_index's shape \(3, 2\), got \(3, 1\)"),
    ("moe_experts/gate_up_proj-features", moe(gate_up=lambda: r(3, 10, 5)), ValueError,
     r"gate_up_proj must have shape \(num_experts, 2 \* intermediate, 4\) to match hidden_states' last dimension, "
     r"got \(3, 10, 5\)"),
    ("moe_experts/gate_up_proj-2d", moe(gate_up=lambda: r(10, 4)), ValueError, r"gate_up_proj must be 3-D, got 2-D"),
    ("moe_experts/down_proj-intermediate", moe(down=lambda: r(3, 4, 6)), ValueError,
     r"down_proj must have shape \(3, out_features, 5\) to match gate_up_proj's experts and intermediate size, "
     r"got \(3, 4, 6\)"),
    ("moe_experts/down_proj-dtype", moe(down=lambda: r(3, 4, 5, dtype=f64)), TypeError,
     r"down_proj has dtype torch\.float64 but hidden_states has dtype torch\.float32"),
    ("moe_experts/gate_up_proj-device", moe(gate_up=lambda: r(3, 10, 4, device=META)), ValueError,
     r"gate_up_proj is on meta but hidden_states is on cpu"),
    ("moe_experts/activation", moe(activation="swish"), ValueError, ACT + ", got 'swish'"),
    ("moe_experts/gated-str", moe(gated="no"), TypeError, r"gated must be a bool, got str 'no'"),
    ("moe_experts/ungated-down_proj", moe(gated=False), ValueError,
     r"down_proj must have shape \(3, out_features, 10\) to match gate_up_proj's experts and intermediate size"),
    # ------------------------------------------------------------ functional.conv_bn_act
    ("conv_bn_act/input-3d", cba(x=lambda: r(3, 5, 5)), ValueError, r"input must be 4-D, got 3-D"),
    ("conv_bn_act/input-int", cba(x=lambda: torch.ones(2, 3, 5, 5, dtype=torch.int32)), TypeError,
     r"input must be a floating-point tensor"),
    ("conv_bn_act/weight-2d", cba(w=lambda: r(4, 3)), ValueError, r"weight must be 4-D, got 2-D"),
    ("conv_bn_act/weight-channels", cba(w=lambda: r(4, 2, 3, 3)), ValueError,
     r"weight must have shape \(out_channels, 3, kh, kw\) with out_channels divisible by groups=1, to match "
     r"input's 3 channels, got \(4, 2, 3, 3\)"),
    ("conv_bn_act/weight-groups", cba(x=lambda: r(2, 4, 5, 5), w=lambda: r(3, 2, 3, 3), groups=2), ValueError,
     r"weight must have shape \(out_channels, 2, kh, kw\) with out_channels divisible by groups=2, .*"
     r"got \(3, 2, 3, 3\)"),
    ("conv_bn_act/groups-0", cba(groups=0), ValueError, r"groups must be a positive int, got 0"),
    ("conv_bn_act/groups-float", cba(groups=2.0), TypeError, r"groups must be an int, got float 2\.0"),
    ("conv_bn_act/groups-input", cba(groups=2), ValueError, r"input's 3 channels must be divisible by groups=2"),
    ("conv_bn_act/weight-dtype", cba(w=lambda: r(4, 3, 3, 3, dtype=f64)), TypeError,
     r"weight has dtype torch\.float64 but input has dtype torch\.float32"),
    ("conv_bn_act/weight-device", cba(w=lambda: r(4, 3, 3, 3, device=META)), ValueError,
     r"weight is on meta but input is on cpu"),
    ("conv_bn_act/input-device", cba(x=lambda: r(2, 3, 5, 5, device=META)), ValueError,
     r"weight is on cpu but input is on meta"),
    ("conv_bn_act/kernel-too-big", cba(x=lambda: r(2, 3, 2, 2)), ValueError,
     r"weight's kernel \(3, 3\) \(dilation \(1, 1\)\) is larger than input's padded spatial size \(2, 2\)"),
    ("conv_bn_act/bias-size", cba(bias=r(3)), ValueError, r"bias must have shape \(4,\), got \(3,\)"),
    ("conv_bn_act/bn_weight-size", cba(gamma=lambda: torch.ones(3)), ValueError,
     r"bn_weight must have shape \(4,\), got \(3,\)"),
    ("conv_bn_act/bn_weight-2d", cba(gamma=lambda: torch.ones(4, 1)), ValueError, r"bn_weight must be 1-D"),
    ("conv_bn_act/bn_bias-size", cba(beta=lambda: torch.ones(5)), ValueError, r"bn_bias must have shape \(4,\)"),
    ("conv_bn_act/bn_weight-dtype", cba(gamma=lambda: torch.ones(4, dtype=f64)), TypeError,
     r"bn_weight has dtype torch\.float64 but input has dtype torch\.float32"),
    ("conv_bn_act/bn_bias-device", cba(beta=lambda: torch.ones(4, device=META)), ValueError,
     r"bn_bias is on meta but input is on cpu"),
    ("conv_bn_act/running_mean-alone", cba(rm=lambda: torch.zeros(4)), ValueError,
     r"running_mean and running_var must both be tensors or both be None"),
    ("conv_bn_act/running_mean-size", cba(rm=lambda: torch.zeros(3), rv=lambda: torch.ones(4)), ValueError,
     r"running_mean must have shape \(4,\), got \(3,\)"),
    ("conv_bn_act/running_var-device", cba(rm=lambda: torch.zeros(4), rv=lambda: torch.ones(4, device=META)),
     ValueError, r"running_var is on meta but input is on cpu"),
    ("conv_bn_act/residual-shape", cba(residual=r(2, 4, 5, 5)), ValueError,
     r"residual must have the conv output's shape \(2, 4, 3, 3\), got \(2, 4, 5, 5\)"),
    ("conv_bn_act/residual-3d", cba(residual=r(4, 3, 3)), ValueError, r"residual must be 4-D"),
    ("conv_bn_act/training-int", cba(training=1), TypeError, r"training must be a bool, got int 1"),
    ("conv_bn_act/residual-dtype", cba(residual=r(2, 4, 3, 3, dtype=f64)), TypeError,
     r"residual has dtype torch\.float64 but input has dtype torch\.float32"),
    ("conv_bn_act/residual-device", cba(residual=r(2, 4, 3, 3, device=META)), ValueError,
     r"residual is on meta but input is on cpu"),
    ("conv_bn_act/stride-0", cba(stride=0), ValueError, r"stride must be positive, got 0"),
    ("conv_bn_act/stride-negative", cba(stride=(1, -2)), ValueError, r"stride must be positive, got \(1, -2\)"),
    ("conv_bn_act/stride-float", cba(stride=1.5), TypeError, r"stride must be an int or a pair of ints, got 1\.5"),
    ("conv_bn_act/padding-negative", cba(padding=-1), ValueError, r"padding must be non-negative, got -1"),
    ("conv_bn_act/padding-triple", cba(padding=(1, 1, 1)), TypeError,
     r"padding must be an int, a pair of ints, 4 ints \(left, right, top, bottom\), 'same' or 'valid', got \(1, 1, 1\)"),
    ("conv_bn_act/padding-four-negative", cba(padding=(1, -1, 0, 0)), ValueError,
     r"padding must be non-negative, got \(1, -1, 0, 0\)"),
    ("conv_bn_act/padding-four-float", cba(padding=(1, 1.0, 0, 0)), TypeError, r"padding must be an int, a pair"),
    ("conv_bn_act/padding-string", cba(padding="full"), ValueError,
     r"padding must be 'same' or 'valid' as a string, got 'full'"),
    ("conv_bn_act/padding-same-strided", cba(padding="same", stride=2), ValueError,
     r"padding='same' is not supported for strided convolutions, got stride=\(2, 2\)"),
    ("conv_bn_act/dilation-0", cba(dilation=0), ValueError, r"dilation must be positive, got 0"),
    ("conv_bn_act/eps-str", cba(eps="1e-5"), TypeError, r"eps must be a float, got str"),
    ("conv_bn_act/eps-negative", cba(eps=-1e-5), ValueError, r"eps must be >= 0, got -1e-05"),
    ("conv_bn_act/eps-zero-training", cba(eps=0.0), ValueError,
     r"eps must be positive when batch statistics normalize \(training, or no running statistics\), got 0\.0"),
    ("conv_bn_act/eps-nan", cba(eps=math.nan), ValueError, r"eps must be a finite float, got nan"),
    ("conv_bn_act/momentum-none", cba(rm=lambda: torch.zeros(4), rv=lambda: torch.ones(4), momentum=None),
     TypeError, r"momentum must be a float, got NoneType"),
    ("conv_bn_act/activation", cba(activation="tanh"), ValueError, ACT + ", got 'tanh'"),
    ("conv_bn_act/bn_weight-dtype-half-input", cba(x=lambda: r(2, 3, 5, 5).half(), w=lambda: w4().half(),
                                                   gamma=lambda: r(4, dtype=f64)), TypeError,
     r"bn_weight has dtype torch\.float64 but input has dtype torch\.float16; expected torch\.float16 or "
     r"torch\.float32"),
    ("conv_bn_act/bn-params-mixed", cba(x=lambda: r(2, 3, 5, 5).half(), w=lambda: w4().half(),
                                        gamma=lambda: r(4).half(), beta=lambda: r(4)), TypeError,
     r"bn_weight has dtype torch\.float16 but bn_bias has dtype torch\.float32; expected the same dtype"),
    ("conv_bn_act/running_mean-expanded", cba(rm=lambda: torch.zeros(1).expand(4), rv=lambda: torch.ones(4)),
     ValueError, r"running_mean is updated in place and must not have overlapping memory"),
    ("conv_bn_act/activation-none-str", cba(activation="none"), ValueError, ACT + ", got 'none'"),
    ("conv_bn_act/one-value-per-channel", cba(x=lambda: r(1, 3, 3, 3)), ValueError,
     r"Expected more than 1 value per channel when training"),
    # ------------------------------------------------------------ nn.LinearReLU
    ("LinearReLU/in_features-negative", lambda: fnn.LinearReLU(-1, 4), ValueError,
     r"in_features must be a non-negative int, got -1"),
    ("LinearReLU/out_features-float", lambda: fnn.LinearReLU(3, 4.0), TypeError,
     r"out_features must be an int, got float 4\.0"),
    ("LinearReLU/activation", lambda: fnn.LinearReLU(3, 4, activation="tanh"), ValueError, ACT + ", got 'tanh'"),
    ("LinearReLU/forward-features", lambda: fnn.LinearReLU(3, 4)(r(2, 5)), ValueError,
     r"input must have last dimension in_features=3 for LinearReLU, got shape \(2, 5\)"),
    ("LinearReLU/forward-0d", lambda: fnn.LinearReLU(3, 4)(torch.tensor(1.0)), ValueError,
     r"input must have at least 1 dimension"),
    ("LinearReLU/forward-not-tensor", lambda: fnn.LinearReLU(3, 4)(3.0), TypeError,
     r"input must be a torch\.Tensor, got float"),
    ("LinearReLU/forward-dtype", lambda: fnn.LinearReLU(3, 4)(r(2, 3, dtype=f64)), TypeError,
     r"weight has dtype torch\.float32 but input has dtype torch\.float64"),
    ("LinearReLU/forward-device", lambda: fnn.LinearReLU(3, 4)(r(2, 3, device=META)), ValueError,
     r"weight is on cpu but input is on meta"),
    ("LinearReLU/from_modules-lazy", lambda: fnn.LinearReLU.from_modules(nn.LazyLinear(4)), ValueError,
     r"linear is a lazy module whose parameters are not initialized yet"),
    ("LinearReLU/from_modules-type", lambda: fnn.LinearReLU.from_modules(nn.Conv2d(3, 4, 1)), TypeError,
     r"linear must be an nn\.Linear, got Conv2d"),
    ("LinearReLU/from_modules-act", lambda: fnn.LinearReLU.from_modules(nn.Linear(3, 4), nn.Tanh()), ValueError,
     r"act must be a supported activation .*got Tanh"),
    ("LinearReLU/from_modules-act-name", lambda: fnn.LinearReLU.from_modules(nn.Linear(3, 4), "tanh"), ValueError,
     r"act must be one of .*, got 'tanh'"),
    # ------------------------------------------------------------ nn.MoEExperts
    ("MoEExperts/num_experts-zero", lambda: fnn.MoEExperts(0, 4, 8), ValueError,
     r"num_experts must be a positive int, got 0"),
    ("MoEExperts/gated-int", lambda: fnn.MoEExperts(2, 4, 8, gated=1), TypeError, r"gated must be a bool, got int 1"),
    ("MoEExperts/forward-features", lambda: fnn.MoEExperts(2, 4, 8)(r(3, 5), torch.zeros(3, 1, dtype=torch.long),
                                                                    r(3, 1)), ValueError,
     r"input must have last dimension hidden_size=4 for MoEExperts, got shape \(3, 5\)"),
    ("MoEExperts/forward-index-lead", lambda: fnn.MoEExperts(2, 4, 8)(r(2, 3, 4), torch.zeros(6, 1, dtype=torch.long),
                                                                      r(2, 3, 1)), ValueError,
     r"top_k_index must have shape \(2, 3, k\) to match hidden_states' leading dimensions, got \(6, 1\)"),
    ("MoEExperts/forward-weights-list", lambda: fnn.MoEExperts(2, 4, 8)(r(3, 4), torch.zeros(3, 1, dtype=torch.long),
                                                                        [[1.0]] * 3), TypeError,
     r"top_k_weights must be a torch\.Tensor, got list"),
    # ------------------------------------------------------------ nn.GatedMLP
    ("GatedMLP/hidden-negative", lambda: fnn.GatedMLP(3, -8), ValueError,
     r"hidden_features must be a non-negative int, got -8"),
    ("GatedMLP/activation", lambda: fnn.GatedMLP(3, 8, activation="swish"), ValueError, ACT + ", got 'swish'"),
    ("GatedMLP/forward-features", lambda: fnn.GatedMLP(3, 8)(r(2, 4)), ValueError,
     r"input must have last dimension in_features=3 for GatedMLP, got shape \(2, 4\)"),
    ("GatedMLP/from_modules-up_proj", lambda: fnn.GatedMLP.from_modules(nn.Linear(3, 8), nn.Conv1d(3, 8, 1),
                                                                         nn.Linear(8, 3), "silu"),
     TypeError, r"up_proj must be an nn\.Linear, got Conv1d"),
    ("GatedMLP/from_modules-down_proj", lambda: fnn.GatedMLP.from_modules(nn.Linear(3, 8), nn.Linear(3, 8),
                                                                           nn.Linear(7, 3), "silu"),
     ValueError, r"down_proj\.in_features \(7\) must equal gate_proj\.out_features \(8\)"),
    # ------------------------------------------------------------ functional.mix_ffn / nn.MixFFN
    ("mix_ffn/tokens", mix(size=(3, 5)), ValueError,
     r"input must have shape \(\*, height \* width, in_features\) = \(\*, 15, 8\) for height 3 and width 5, "
     r"got \(2, 12, 8\)"),
    ("mix_ffn/input-1d", mix(x=r(12)), ValueError, r"input must have at least 2 dimension\(s\), got shape \(12,\)"),
    ("mix_ffn/height-float", mix(size=(3.0, 4)), TypeError, r"height must be an int, got float 3\.0"),
    ("mix_ffn/width-zero", mix(size=(3, 0)), ValueError, r"width must be a positive int, got 0"),
    ("mix_ffn/w_dw-even", mix(wd=r(16, 1, 2, 2)), ValueError,
     r"w_dw must be a depthwise conv weight of shape \(16, 1, k, k\) with k odd .*got \(16, 1, 2, 2\)"),
    ("mix_ffn/w_dw-channels", mix(wd=r(8, 1, 3, 3)), ValueError, r"w_dw must be a depthwise conv weight of shape "
     r"\(16, 1, k, k\)"),
    ("mix_ffn/w_dw-3d", mix(wd=r(16, 3, 3)), ValueError, r"w_dw must be 4-D, got 3-D"),
    ("mix_ffn/w_dw-dtype", mix(wd=r(16, 1, 3, 3, dtype=f64)), TypeError, r"w_dw has dtype torch\.float64"),
    ("mix_ffn/b_dw-size", mix(bd=r(5)), ValueError, r"b_dw must have shape \(16,\), got \(5,\)"),
    ("mix_ffn/w1-features", mix(w1=r(16, 7)), ValueError, r"w1 must have shape \(out_features, 8\)"),
    ("mix_ffn/activation", mix(activation="swish"), ValueError, ACT + ", got 'swish'"),
    ("mix_ffn/dropout_p", mix(dropout_p=1.5), ValueError, r"dropout_p must be a probability in \[0, 1\]"),
    ("MixFFN/kernel-even", lambda: fnn.MixFFN(8, 16, kernel_size=4), ValueError,
     r"kernel_size must be odd \(a 'same' depthwise conv\), got 4"),
    ("MixFFN/forward-tokens", lambda: fnn.MixFFN(8, 16)(r(2, 12, 8), 4, 4), ValueError,
     r"input must have shape \(\*, height \* width, in_features\) = \(\*, 16, 8\)"),
    ("MixFFN/forward-features", lambda: fnn.MixFFN(8, 16)(r(2, 12, 6), 3, 4), ValueError,
     r"input must have last dimension in_features=8 for MixFFN, got shape \(2, 12, 6\)"),
    # ------------------------------------------------------------ functional.xielu_mlp
    ("xielu_mlp/alpha-shape", lambda: F.xielu_mlp(r(2, 3), r(8, 3), None, r(3, 8), None, r(2), r(1)), ValueError,
     r"alpha_p must hold one element \(xIELU's effective alpha\), got shape \(2,\)"),
    ("xielu_mlp/alpha-int", lambda: F.xielu_mlp(r(2, 3), r(8, 3), None, r(3, 8), None, r(1), torch.ones(1, dtype=torch.int64)),
     TypeError, r"alpha_n must be a floating-point tensor"),
    ("xielu_mlp/alpha-device", lambda: F.xielu_mlp(r(2, 3), r(8, 3), None, r(3, 8), None, r(1, device=META), r(1)),
     ValueError, r"alpha_p is on meta"),
    ("xielu_mlp/beta-nan", lambda: F.xielu_mlp(r(2, 3), r(8, 3), None, r(3, 8), None, r(1), r(1), beta=float("nan")),
     ValueError, r"beta must be a finite"),
    ("xielu_mlp/w2-hidden", lambda: F.xielu_mlp(r(2, 3), r(8, 3), None, r(3, 6), None, r(1), r(1)), ValueError,
     r"w2 must have shape \(out_features, 8\)"),
    ("XIELU/alpha_p_init", lambda: fnn.XIELU(alpha_p_init=0.0), ValueError,
     r"alpha_p_init must be > 0 \(the softplus of a parameter\), got 0\.0"),
    ("XIELU/alpha_n_init", lambda: fnn.XIELU(alpha_n_init=0.4), ValueError, r"alpha_n_init - beta must be > 0"),
    ("XIELUMLP/hidden-str", lambda: fnn.XIELUMLP(8, "16"), TypeError, r"hidden_features must be an int, got str"),
    ("XIELUMLP/forward-features", lambda: fnn.XIELUMLP(8, 16)(r(2, 6)), ValueError,
     r"input must have last dimension in_features=8 for XIELUMLP, got shape \(2, 6\)"),
    # ------------------------------------------------------------ nn.FusedMLP
    ("FusedMLP/hidden-negative", lambda: fnn.FusedMLP(3, -8), ValueError,
     r"hidden_features must be a non-negative int, got -8"),
    ("FusedMLP/in_features-str", lambda: fnn.FusedMLP("3", 8), TypeError, r"in_features must be an int, got str"),
    ("FusedMLP/out_features-bool", lambda: fnn.FusedMLP(3, 8, True), TypeError,
     r"out_features must be an int, got bool"),
    ("FusedMLP/activation", lambda: fnn.FusedMLP(3, 8, activation="swish"), ValueError, ACT + ", got 'swish'"),
    ("FusedMLP/dropout", lambda: fnn.FusedMLP(3, 8, dropout=2.0), ValueError,
     r"dropout must be a probability in \[0, 1\], got 2\.0"),
    ("FusedMLP/dropout-negative", lambda: fnn.FusedMLP(3, 8, dropout=-0.1), ValueError,
     r"dropout must be >= 0\.0, got -0\.1"),
    ("FusedMLP/dropout-nan", lambda: fnn.FusedMLP(3, 8, dropout=float("nan")), ValueError,
     r"dropout must be a finite float"),
    ("FusedMLP/dropout-str", lambda: fnn.FusedMLP(3, 8, dropout="0.1"), TypeError, r"dropout must be a float, got str"),
    ("FusedMLP/from_modules-dropout", lambda: fnn.FusedMLP.from_modules(nn.Linear(4, 8), "relu", nn.Linear(8, 4),
                                                                        dropout=nn.AlphaDropout(0.1)), TypeError,
     r"dropout must be a float or an nn\.Dropout, got AlphaDropout"),
    ("FusedMLP/forward-features", lambda: fnn.FusedMLP(3, 8)(r(2, 4)), ValueError,
     r"input must have last dimension in_features=3 for FusedMLP, got shape \(2, 4\)"),
    ("FusedMLP/forward-dtype", lambda: fnn.FusedMLP(3, 8)(r(2, 3, dtype=f64)), TypeError,
     r"w1 has dtype torch\.float32 but input has dtype torch\.float64"),
    ("FusedMLP/forward-device", lambda: fnn.FusedMLP(3, 8, device=META)(r(2, 3)), ValueError,
     r"w1 is on meta but input is on cpu"),
    ("FusedMLP/from_modules-fc1", lambda: fnn.FusedMLP.from_modules(nn.Conv2d(3, 8, 1), "relu", nn.Linear(8, 3)),
     TypeError, r"fc1 must be an nn\.Linear, got Conv2d"),
    ("FusedMLP/from_modules-fc2", lambda: fnn.FusedMLP.from_modules(nn.Linear(3, 8), "relu", nn.ReLU()),
     TypeError, r"fc2 must be an nn\.Linear, got ReLU"),
    ("FusedMLP/from_modules-hidden", lambda: fnn.FusedMLP.from_modules(nn.Linear(3, 8), "relu", nn.Linear(6, 3)),
     ValueError, r"fc2\.in_features \(6\) must equal fc1\.out_features \(8\)"),
    ("FusedMLP/from_modules-act", lambda: fnn.FusedMLP.from_modules(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3)),
     ValueError, r"act must be a supported activation"),
    # ------------------------------------------------------------ nn.ConvBNReLU
    ("ConvBNReLU/in_channels-negative", lambda: fnn.ConvBNReLU(-3, 4, 3), ValueError,
     r"in_channels must be a non-negative int, got -3"),
    ("ConvBNReLU/kernel_size-0", lambda: fnn.ConvBNReLU(3, 4, 0), ValueError, r"kernel_size must be positive, got 0"),
    ("ConvBNReLU/stride-0", lambda: fnn.ConvBNReLU(3, 4, 3, stride=0), ValueError, r"stride must be positive, got 0"),
    ("ConvBNReLU/padding-negative", lambda: fnn.ConvBNReLU(3, 4, 3, padding=-1), ValueError,
     r"padding must be non-negative, got -1"),
    ("ConvBNReLU/dilation-float", lambda: fnn.ConvBNReLU(3, 4, 3, dilation=1.0), TypeError,
     r"dilation must be an int or a pair of ints, got 1\.0"),
    ("BNReLUConv/padding-same-even", lambda: fnn.BNReLUConv(3, 4, 4, padding="same"), ValueError,
     r"padding='same' needs an odd kernel extent .*kernel_size=\(4, 4\)"),
    ("ConvBNReLU/eps-negative", lambda: fnn.ConvBNReLU(3, 4, 3, eps=-1.0), ValueError, r"eps must be >= 0"),
    ("ConvBNReLU/momentum-str", lambda: fnn.ConvBNReLU(3, 4, 3, momentum="0.1"), TypeError,
     r"momentum must be a float, got str"),
    ("ConvBNReLU/activation", lambda: fnn.ConvBNReLU(3, 4, 3, activation="hardtanh"), ValueError,
     ACT + ", got 'hardtanh'"),
    ("ConvBNReLU/from_modules-act", lambda: fnn.ConvBNReLU.from_modules(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4),
                                                                        nn.Hardsigmoid()),
     ValueError, r"act must be a supported activation .*got Hardsigmoid"),
    ("ConvBNReLU/forward-3d", lambda: fnn.ConvBNReLU(3, 4, 3)(r(3, 5, 5)), ValueError, r"input must be 4-D, got 3-D"),
    ("ConvBNReLU/forward-channels", lambda: fnn.ConvBNReLU(3, 4, 3)(r(2, 5, 5, 5)), ValueError,
     r"input must have in_channels=3 channels \(N, 3, H, W\) for ConvBNReLU, got shape \(2, 5, 5, 5\)"),
    ("ConvBNReLU/forward-dtype", lambda: fnn.ConvBNReLU(3, 4, 3)(r(2, 3, 5, 5, dtype=f64)), TypeError,
     r"weight has dtype torch\.float32 but input has dtype torch\.float64"),
    ("ConvBNReLU/forward-device", lambda: fnn.ConvBNReLU(3, 4, 3, device=META)(x4()), ValueError,
     r"weight is on meta but input is on cpu"),
    ("ConvBNReLU/forward-residual", lambda: fnn.ConvBNReLU(3, 4, 3)(x4(), r(2, 4, 5, 5)), ValueError,
     r"residual must have the conv output's shape \(2, 4, 3, 3\)"),
    ("ConvBNReLU/from_modules-conv", lambda: fnn.ConvBNReLU.from_modules(nn.Linear(3, 4), nn.BatchNorm2d(4)),
     TypeError, r"conv must be an nn\.Conv2d, got Linear"),
    ("ConvBNReLU/from_modules-bn", lambda: fnn.ConvBNReLU.from_modules(nn.Conv2d(3, 4, 1), nn.BatchNorm1d(4)),
     TypeError, r"bn must be an nn\.BatchNorm2d, got BatchNorm1d"),
    ("ConvBNReLU/groups", lambda: fnn.ConvBNReLU(4, 6, 3, groups=4), ValueError,
     r"out_channels \(6\) must be divisible by groups \(4\)"),
    ("ConvBNReLU/from_modules-padding_mode",
     lambda: fnn.ConvBNReLU.from_modules(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(4)),
     ValueError, r"conv\.padding_mode must be 'zeros', got 'reflect'"),
    ("ConvBNReLU/from_modules-num_features", lambda: fnn.ConvBNReLU.from_modules(nn.Conv2d(3, 4, 1),
                                                                                 nn.BatchNorm2d(5)),
     ValueError, r"bn\.num_features \(5\) must equal conv\.out_channels \(4\)"),
    # ------------------------------------------------------------ functional.bn_act_conv (BN over the input's 3)
    ("bn_act_conv/input-3d", bac(x=lambda: r(3, 5, 5)), ValueError, r"input must be 4-D, got 3-D"),
    ("bn_act_conv/weight-channels", bac(w=lambda: r(4, 2, 3, 3)), ValueError,
     r"weight must have shape \(out_channels, 3, kh, kw\) .* to match input's 3 channels, got \(4, 2, 3, 3\)"),
    ("bn_act_conv/weight-dtype", bac(w=lambda: r(4, 3, 3, 3, dtype=f64)), TypeError,
     r"weight has dtype torch\.float64 but input has dtype torch\.float32"),
    ("bn_act_conv/bn_weight-size", bac(gamma=lambda: torch.ones(4)), ValueError,
     r"bn_weight must have shape \(3,\), got \(4,\)"),
    ("bn_act_conv/bn_bias-device", bac(beta=lambda: torch.ones(3, device=META)), ValueError,
     r"bn_bias is on meta but input is on cpu"),
    ("bn_act_conv/running_var-alone", bac(rv=lambda: torch.ones(3)), ValueError,
     r"running_mean and running_var must both be tensors or both be None"),
    ("bn_act_conv/bias-size", bac(bias=r(3)), ValueError, r"bias must have shape \(4,\), got \(3,\)"),
    ("bn_act_conv/kernel-too-big", bac(x=lambda: r(2, 3, 2, 2)), ValueError,
     r"weight's kernel \(3, 3\) .* larger than input's padded spatial size \(2, 2\)"),
    ("bn_act_conv/one-value", bac(x=lambda: r(1, 3, 1, 1), w=lambda: r(4, 3, 1, 1)), ValueError,
     r"Expected more than 1 value per channel when training"),
    ("bn_act_conv/activation", bac(activation="tanh"), ValueError, ACT + ", got 'tanh'"),
    ("bn_act_conv/training-str", bac(training="yes"), TypeError, r"training must be a bool, got str 'yes'"),
    ("bn_act_conv/stride-0", bac(stride=0), ValueError, r"stride must be positive, got 0"),
    ("bn_act_conv/eps-zero-training", bac(eps=0.0), ValueError, r"eps must be positive when batch statistics"),
    # ------------------------------------------------------------ nn.BNReLUConv
    ("BNReLUConv/in_channels-negative", lambda: fnn.BNReLUConv(-3, 4, 3), ValueError,
     r"in_channels must be a non-negative int, got -3"),
    ("BNReLUConv/activation", lambda: fnn.BNReLUConv(3, 4, 3, activation="hardtanh"), ValueError,
     r"activation must be one of"),
    ("BNReLUConv/forward-channels", lambda: fnn.BNReLUConv(3, 4, 3)(r(2, 5, 5, 5)), ValueError,
     r"input must have in_channels=3 channels \(N, 3, H, W\) for BNReLUConv, got shape \(2, 5, 5, 5\)"),
    ("BNReLUConv/forward-dtype", lambda: fnn.BNReLUConv(3, 4, 3)(r(2, 3, 5, 5, dtype=f64)), TypeError,
     r"weight has dtype torch\.float32 but input has dtype torch\.float64"),
    ("BNReLUConv/from_modules-bn", lambda: fnn.BNReLUConv.from_modules(nn.BatchNorm1d(3), nn.Conv2d(3, 4, 1)),
     TypeError, r"bn must be an nn\.BatchNorm2d, got BatchNorm1d"),
    ("BNReLUConv/from_modules-num_features", lambda: fnn.BNReLUConv.from_modules(nn.BatchNorm2d(4),
                                                                                 nn.Conv2d(3, 4, 1)),
     ValueError, r"bn\.num_features \(4\) must equal conv\.in_channels \(3\)"),
    # ------------------------------------------------------------ recompute
    ("recompute/block-not-callable", lambda: fusedrc.recompute(42, r(2, 3, grad=True)), TypeError,
     r"block must be a callable or nn\.Module, got int"),
    ("recompute/block-none", lambda: fusedrc.recompute(None, r(2, 3, grad=True)), TypeError,
     r"block must be a callable or nn\.Module, got NoneType"),
    ("recompute/use_reentrant", lambda: fusedrc.recompute(_ffn(), r(2, 3, grad=True), use_reentrant=True), ValueError,
     r"use_reentrant=True is not supported.*Use use_reentrant=False"),
    ("recompute/determinism_check", lambda: fusedrc.recompute(torch.sin, r(2, grad=True), determinism_check="strict"),
     ValueError, r"determinism_check must be one of \('default', 'none'\), got 'strict'"),
    ("recompute/context_fn-returns-int", lambda: fusedrc.recompute(torch.sin, r(2, grad=True), context_fn=lambda: 1),
     TypeError, r"context_fn must return a pair of context managers \(forward, rerun\), got 1"),
    ("recompute/use_reentrant-str", lambda: fusedrc.recompute(torch.sin, r(2, grad=True), use_reentrant="no"),
     TypeError, r"use_reentrant must be a bool \(False\), got str 'no'"),
    ("recompute/context_fn", lambda: fusedrc.recompute(torch.sin, r(2, grad=True), context_fn=3), TypeError,
     r"context_fn must be a callable returning two context managers"),
    ("recompute/input-device", lambda: fusedrc.recompute(_ffn().to(META), r(2, 3, grad=True)), ValueError,
     r"input tensor #0 of block's arguments is on cpu, but the block's parameters are on meta"),
    ("recompute/input-device-kwarg", lambda: fusedrc.recompute(nn.Linear(3, 3), input=r(2, 3, device=META, grad=True)),
     ValueError, r"input tensor #0 of block's arguments is on meta, but the block's parameters are on cpu"),
    ("recompute/fused-input-features", lambda: fusedrc.recompute(_ffn(), r(2, 5, grad=True)), ValueError,
     r"w1 must have shape \(out_features, 5\) to match input's last dimension 5, got \(8, 3\)"),
    ("recompute/fused-module-dtype", lambda: fusedrc.recompute(fnn.FusedMLP(3, 8), r(2, 3, dtype=f64, grad=True)),
     TypeError, r"w1 has dtype torch\.float32 but input has dtype torch\.float64"),
    ("recompute/fused-conv-channels", lambda: fusedrc.recompute(fnn.ConvBNReLU(3, 4, 3), r(2, 5, 5, 5, grad=True)),
     ValueError, r"input must have in_channels=3 channels"),
    ("recompute/fused-meta-weights", lambda: fusedrc.recompute(fnn.LinearReLU(3, 4, device=META), r(2, 3, grad=True)),
     ValueError, r"input tensor #0 .* is on cpu, but the block's parameters are on meta"),
    # ------------------------------------------------------------ recompute_sequential
    ("recompute_sequential/reentrant", lambda: fusedrc.recompute_sequential(_stack(), 2, r(2, 3), use_reentrant=True),
     ValueError, r"use_reentrant=True is not supported"),
    ("recompute_sequential/segments-0", lambda: fusedrc.recompute_sequential(_stack(), 0, r(2, 3, grad=True)),
     ValueError, r"segments must be between 1 and 4 \(the number of functions\), got 0"),
    ("recompute_sequential/segments-too-many", lambda: fusedrc.recompute_sequential(_stack(), 5, r(2, 3, grad=True)),
     ValueError, r"segments must be between 1 and 4 \(the number of functions\), got 5"),
    ("recompute_sequential/segments-negative", lambda: fusedrc.recompute_sequential(_stack(), -1, r(2, 3)),
     ValueError, r"segments must be between 1 and 4"),
    ("recompute_sequential/segments-float", lambda: fusedrc.recompute_sequential(_stack(), 2.0, r(2, 3)), TypeError,
     r"segments must be an int, got float"),
    ("recompute_sequential/segments-bool", lambda: fusedrc.recompute_sequential(_stack(), True, r(2, 3)), TypeError,
     r"segments must be an int, got bool"),
    ("recompute_sequential/functions-module", lambda: fusedrc.recompute_sequential(nn.Linear(3, 3), 1, r(2, 3)),
     TypeError, r"functions must be an nn\.Sequential or a list of modules, got Linear"),
    ("recompute_sequential/functions-not-callable",
     lambda: fusedrc.recompute_sequential([nn.ReLU(), 3], 1, r(2, 3)), TypeError, r"functions\[1\] must be callable"),
    ("recompute_sequential/functions-empty", lambda: fusedrc.recompute_sequential([], 1, r(2, 3)), ValueError,
     r"functions must hold at least one module or callable"),
    ("recompute_sequential/two-inputs", lambda: fusedrc.recompute_sequential(_stack(), 2, r(2, 3), r(2, 3)), TypeError,
     r"recompute_sequential takes one input, got 2"),
    ("recompute_sequential/kwargs", lambda: fusedrc.recompute_sequential(_stack(), 2, r(2, 3), debug=True),
     TypeError, r"unexpected keyword arguments \['debug'\]"),
    # ------------------------------------------------------------ mark / unmark
    ("mark/not-module", lambda: fusedrc.mark(lambda x: x), TypeError, r"module must be an nn\.Module, got function"),
    ("mark/script-module", lambda: fusedrc.mark(torch.jit.script(nn.Linear(3, 3))), TypeError,
     r"module must be an eager nn\.Module, got a TorchScript"),
    ("unmark/not-module", lambda: fusedrc.unmark("block"), TypeError, r"module must be an nn\.Module, got str"),
    ("mark/nested", _nested_mark, RecomputeError, r"its submodule '0' is already marked"),
    ("mark/called-inside-marked", _marked_called_inside_marked, RecomputeError,
     r"a marked Linear was called inside another marked module"),
    # ------------------------------------------------------------ use_backend
    ("use_backend/unknown", lambda: fusedrc.use_backend("cuda"), ValueError,
     r"backend name must be one of \('auto', 'triton', 'reference'\), got 'cuda'"),
    ("use_backend/none", lambda: fusedrc.use_backend(None), ValueError, r"backend name must be one of .*, got None"),
    ("use_backend/case", lambda: fusedrc.use_backend("Triton"), ValueError, r"got 'Triton'"),
    # ------------------------------------------------------------ convert
    ("convert/model", lambda: fusedrc.convert("resnet50"), TypeError, r"model must be an nn\.Module, got str"),
    ("convert/policy", _convert(policy="some"), ValueError, r"policy must be 'all', 'blocks', a list of .*got 'some'"),
    ("convert/policy-list-of-ints", _convert(policy=[1, 2]), ValueError, r"policy must be .*got \[1, 2\]"),
    ("convert/memory_budget-0", _convert(memory_budget=0.0, example_inputs=EX), ValueError,
     r"memory_budget as a fraction must be in \(0, 1\], got 0\.0"),
    ("convert/memory_budget-above-1", _convert(memory_budget=1.5, example_inputs=EX), ValueError,
     r"memory_budget as a fraction must be in \(0, 1\], got 1\.5"),
    ("convert/memory_budget-negative-fraction", _convert(memory_budget=-0.5, example_inputs=EX), ValueError,
     r"memory_budget as a fraction must be in \(0, 1\], got -0\.5"),
    ("convert/memory_budget-nan", _convert(memory_budget=math.nan, example_inputs=EX), ValueError,
     r"memory_budget as a fraction must be in \(0, 1\], got nan"),
    ("convert/memory_budget-negative-bytes", _convert(memory_budget=-1024, example_inputs=EX), ValueError,
     r"memory_budget in bytes must be positive, got -1024"),
    ("convert/memory_budget-zero-bytes", _convert(memory_budget=0, example_inputs=EX), ValueError,
     r"memory_budget in bytes must be positive, got 0"),
    ("convert/memory_budget-str", _convert(memory_budget="50%", example_inputs=EX), TypeError,
     r"memory_budget must be a float in \(0, 1\] or an int number of bytes, got '50%'"),
    ("convert/memory_budget-bool", _convert(memory_budget=True, example_inputs=EX), TypeError,
     r"memory_budget must be a float in \(0, 1\] or an int number of bytes, got True"),
    ("convert/memory_budget-without-example_inputs", _convert(memory_budget=0.5), ValueError,
     r"memory_budget needs example_inputs"),
    ("convert/example_inputs-list", _convert(example_inputs=[torch.randn(2, 3)]), TypeError,
     r"example_inputs must be a tuple of positional arguments, got list"),
    ("convert/example_inputs-mismatch", _convert(example_inputs=(torch.randn(2, 5),)), ValueError,
     r"example_inputs: calling the model with them failed \(RuntimeError: .*\); expected a tuple"),
    ("convert/policy-callable-arity", _convert(policy=lambda: True), TypeError,
     r"policy must be a callable \(name, module\) -> bool, got <function .*\(too many positional arguments\)"),
    ("convert/inplace-str", _convert(inplace="yes"), TypeError, r"inplace must be a bool, got str 'yes'"),
    ("register_rule/bare", lambda: register_rule(lambda ctx, name, m: m), TypeError,
     r"register_rule takes class names \(str\), got function"),
    ("register_rule/empty", lambda: register_rule(), TypeError, r"register_rule needs at least one class name"),
    ("register_rule/not-callable", lambda: register_rule("NoSuchBlockForTests")(3), TypeError,
     r"rule must be a callable \(ctx, name, module\) -> module, got int"),
]


@pytest.mark.parametrize("call,exc,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_valid_unusual_inputs_are_accepted():
    """Not errors: meta tensors (shapes only) on every backend, the FFN's dropout included; a numpy
    integer for segments; torch's use_reentrant=None spelling."""
    import numpy as np

    backends = ["reference", "auto"] + (["triton"] if fusedrc._backend.interpreter_active() else [])
    for backend in backends:
        with fusedrc.use_backend(backend):
            y = F.linear_act(r(2, 3, device=META), r(4, 3, device=META))
            z = F.fused_mlp(r(2, 3, device=META), r(8, 3, device=META), None, r(3, 8, device=META), None,
                            dropout_p=0.1)
            c = F.conv_bn_act(r(2, 3, 5, 5, device=META), r(4, 3, 3, 3, device=META), None, None, None, None)
            m = F.mix_ffn(r(2, 6, 3, device=META), 2, 3, r(8, 3, device=META), None, r(8, 1, 3, 3, device=META),
                          None, r(3, 8, device=META), None, dropout_p=0.1)
        assert y.shape == (2, 4) and z.shape == (2, 3) and c.shape == (2, 4, 3, 3) and y.device.type == META
        assert m.shape == (2, 6, 3) and m.device.type == META
    x, model = r(2, 3, grad=True), _stack()
    assert torch.equal(fusedrc.recompute_sequential(model, np.int64(2), x), model(x))
    assert torch.equal(fusedrc.recompute(torch.sin, x, use_reentrant=None), torch.sin(x))


def test_table_covers_every_public_callable():
    """Every public function, module and constructor appears in the table."""
    covered = {c[0].split("/")[0] for c in CASES}
    public = {"linear_act", "fused_mlp", "gated_mlp", "mix_ffn", "xielu_mlp", "moe_experts", "conv_bn_act", "bn_act_conv",
              "LinearReLU", "FusedMLP", "GatedMLP", "MixFFN", "XIELU", "XIELUMLP", "MoEExperts", "ConvBNReLU", "BNReLUConv", "recompute",
              "recompute_sequential", "mark", "unmark", "use_backend", "convert", "register_rule"}
    assert set(F.__all__) | set(fnn.__all__) <= public
    assert {n for n in fusedrc.__all__ if callable(getattr(fusedrc, n))} - {"current_backend", "RecomputeError"} \
        <= public
    assert public <= covered, public - covered
    assert len({c[0] for c in CASES}) == len(CASES), "duplicate ids"


def test_errors_leave_state_usable():
    """After a rejected call the backend, marks and modules work as before."""
    before = fusedrc.current_backend()
    for _, call, exc, _ in CASES:
        with pytest.raises(exc):
            call()
    assert fusedrc.current_backend() == before
    m = fnn.FusedMLP(3, 8)
    x = r(2, 3, grad=True)
    fusedrc.recompute(m, x).sum().backward()
    assert x.grad is not None


def test_rejected_conv_call_leaves_batchnorm_state_alone():
    m = fnn.ConvBNReLU(3, 4, 3)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    for bad in [lambda: m(x4(), r(2, 4, 5, 5)), lambda: m(x4().double()), lambda: m(x4(), r(2, 4, 3, 3).double())]:
        with pytest.raises((TypeError, ValueError)):
            bad()
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), k
    m(x4())
    assert int(m.bn.num_batches_tracked) == 1


# --------------------------------------------------------------------------- NaN / Inf
NAN, INF = float("nan"), float("inf")
BACKENDS = ["reference", "triton"]


def _same_nonfinite(a, b):
    """NaN, +Inf and -Inf in the same places; the finite entries close."""
    a, b = a.detach(), b.detach()
    for pred in (torch.isnan, torch.isposinf, torch.isneginf):
        if not torch.equal(pred(a), pred(b)):
            return False
    fin = torch.isfinite(a)
    return torch.allclose(a[fin], b[fin], rtol=1e-4, atol=1e-4)


def _act_ref(h, activation, backend):
    if activation == "gelu" and backend == "triton":
        # PyTorch's own fp32 CPU GELU is inconsistent at +-Inf: its vectorized kernel
        # returns NaN for gelu(+Inf) while its scalar path (and the CUDA kernel, and
        # float64) returns +Inf. The kernels follow the formula, as float64 torch does.
        return activation_forward(h.double(), activation).to(h.dtype)
    return activation_forward(h, activation)


def _leaves(*ts):
    return [t.clone().requires_grad_() if t is not None else None for t in ts]


def _grads(ts):
    return [t.grad for t in ts if t is not None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["x", "weight", "bias"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_nonfinite_linear_act(backend, value, where, activation):
    x, w, b = torch.randn(5, 6), torch.randn(7, 6), torch.randn(7)
    {"x": x, "weight": w, "bias": b}[where].view(-1)[3] = value
    x, w, b = (t.to(backend_device(backend)) for t in (x, w, b))
    ours, ref = _leaves(x, w, b), _leaves(x, w, b)
    with fusedrc.use_backend(backend):
        y = F.linear_act(*ours, activation=activation)
    if activation == "gelu" and backend == "triton":
        h = TF.linear(*ref)
        y_ref = _act_ref(h, activation, backend)
        y_plain = activation_forward(h, activation)
    else:
        y_ref = y_plain = activation_forward(TF.linear(*ref), activation)
    assert _same_nonfinite(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_plain.backward(g)  # gradients: plain torch, also for gelu (the backward kernels agree with aten)
    for a, c in zip(_grads(ours), _grads(ref)):
        assert _same_nonfinite(a, c)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["x", "w1", "b1", "w2"])
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_nonfinite_fused_mlp(backend, value, where, activation):
    x, w1, b1, w2, b2 = torch.randn(5, 6), torch.randn(8, 6), torch.randn(8), torch.randn(7, 8), torch.randn(7)
    {"x": x, "w1": w1, "b1": b1, "w2": w2}[where].view(-1)[3] = value
    x, w1, b1, w2, b2 = (t.to(backend_device(backend)) for t in (x, w1, b1, w2, b2))
    ours, ref = _leaves(x, w1, b1, w2, b2), _leaves(x, w1, b1, w2, b2)
    with fusedrc.use_backend(backend):
        y = F.fused_mlp(*ours, activation=activation)
    y_ref = TF.linear(activation_forward(TF.linear(*ref[:3]), activation), *ref[3:])
    _assert_same_nonfinite_step(y, y_ref, ours, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["x", "w_gate", "b_up", "w_down"])
def test_nonfinite_gated_mlp(backend, value, where):
    ts = dict(x=torch.randn(5, 6), w_gate=torch.randn(8, 6), b_gate=torch.randn(8), w_up=torch.randn(8, 6),
              b_up=torch.randn(8), w_down=torch.randn(7, 8), b_down=torch.randn(7))
    ts[where].view(-1)[3] = value
    vals = [t.to(backend_device(backend)) for t in ts.values()]
    ours, ref = _leaves(*vals), _leaves(*vals)
    with fusedrc.use_backend(backend):
        y = F.gated_mlp(*ours, activation="silu")
    x, wg, bg, wu, bu, wd, bd = ref
    y_ref = TF.linear(TF.silu(TF.linear(x, wg, bg)) * TF.linear(x, wu, bu), wd, bd)
    _assert_same_nonfinite_step(y, y_ref, ours, ref)


def _assert_same_nonfinite_step(y, y_ref, ours, ref):
    """y and, after one backward of the same gradient, every input's gradient: the non-finite pattern
    of plain torch's, finite values close."""
    assert _same_nonfinite(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    for a, c in zip(_grads(ours), _grads(ref)):
        assert _same_nonfinite(a, c)


def _conv_case(where, value):
    x, w = torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3)
    gamma, beta = torch.randn(4), torch.randn(4)
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    {"x": x, "weight": w, "bn_weight": gamma, "bn_bias": beta}[where].view(-1)[3] = value
    return (x, w, gamma, beta), rm, rv


def _covers(a, c):
    """Every non-finite entry of ``c`` (plain torch) is non-finite in ``a``."""
    return not (~torch.isfinite(c.detach()) & torch.isfinite(a.detach())).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["x", "weight", "bn_weight", "bn_bias"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_nonfinite_conv_bn_act(backend, value, where, training):
    params, rm, rv = _conv_case(where, value)
    params, rm, rv = tuple(t.to(backend_device(backend)) for t in params), rm.to(backend_device(backend)), rv.to(backend_device(backend))
    ours, ref = _leaves(*params), _leaves(*params)
    rm1, rv1, rm2, rv2 = rm.clone(), rv.clone(), rm.clone(), rv.clone()
    with fusedrc.use_backend(backend):
        y = F.conv_bn_act(ours[0], ours[1], ours[2], ours[3], rm1, rv1, training=training, padding=1)
    y_ref = torch.relu(TF.batch_norm(TF.conv2d(ref[0], ref[1], padding=1), rm2, rv2, ref[2], ref[3], training))
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    pairs = [(y, y_ref), (rm1, rm2), (rv1, rv2)] + list(zip(_grads(ours), _grads(ref)))
    # an Inf BatchNorm weight goes through the (z - mean)*rstd*gamma + beta formula: in the kernels,
    # and on the reference path in eval (one formula for the forward and its recompute)
    inf_gamma = where == "bn_weight" and value == value and (backend == "triton" or not training)
    if not inf_gamma and (backend == "reference" or where in ("x", "bn_bias", "bn_weight")):
        for a, c in pairs:
            assert _same_nonfinite(a, c)
    elif where == "weight":
        # The Triton conv multiplies zeros by the weight where torch skips the product: the
        # zero-padded taps of the forward and the out-of-range taps of the input gradient.
        # 0 * NaN = NaN, so its non-finite entries are a superset of torch's, never fewer
        # (finite gradient entries then differ too: they follow from different forward values).
        for a, c in pairs:
            assert _covers(a, c)
        assert not torch.isfinite(y_ref).all() and not torch.isfinite(ours[0].grad).all()
    else:
        # An Inf BatchNorm weight: torch normalizes as z*scale + shift (Inf - Inf = NaN in
        # places), the kernel as (z - mean)*rstd*gamma + beta (+-Inf there, which ReLU
        # maps to +Inf or 0). The other channels are untouched in both; in the poisoned
        # one, the kernel's output is +Inf or 0, and +Inf wherever torch's is. The
        # gradients follow from these forward values and are not compared.
        c = 3  # the poisoned output channel: _conv_case sets bn_weight[3]
        keep = [i for i in range(y.shape[1]) if i != c]
        assert _same_nonfinite(y[:, keep], y_ref[:, keep])
        yc, rc = y[:, c].detach(), y_ref[:, c].detach()
        assert ((yc == 0) | torch.isposinf(yc)).all()
        assert torch.isposinf(yc[torch.isposinf(rc)]).all()
        assert _same_nonfinite(rm1, rm2) and _same_nonfinite(rv1, rv2)
