"""Trace every triton_op twin the way torch.compile's AOTAutograd does, on CPU, without running it.

Run as a script by ``test_compile.test_triton_op_twins_trace_into_their_kernels``, in a process
*without* ``TRITON_INTERPRET``: ``wrap_triton`` only records real ``JITFunction`` launches (the
interpreter's kernels cannot be traced), and a CPU machine has no GPU to run them. So each op is
traced with fake CPU tensors through ``aot_function``, the graph is captured, and execution stops
there. Prints one JSON object: op name -> the call_function targets of its graph.

Without a GPU driver Triton cannot build a kernel's IR, so torch's mutation analysis falls back to
"every tensor argument may be written" (it logs a warning): the graphs are correct, only more
conservative than on a GPU.
"""
import json
import logging
import os

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from functorch.compile import aot_function  # noqa: E402

import fusedrc  # noqa: E402
from fusedrc import ops  # noqa: E402


class _Captured(Exception):
    pass


def _graph_targets(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        raise _Captured  # a CPU has nothing to launch these kernels on

    try:
        aot_function(fn, fw_compiler=capture)(*args)
    except _Captured:
        pass
    (gm,) = graphs
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def main():
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
    assert fusedrc._backend.has_triton_kernel("conv_bn_act", "conv_bn_act_forward")  # registers the twins
    from fusedrc.kernels import conv_bn_act

    # the conv launchers take CPU tensors only under the interpreter; the trace never runs them
    conv_bn_act._interpreting = lambda: True
    twin = ops._TRITON_OPS

    def t(*shape):
        return torch.randn(*shape)

    x, w1, b1, w2, b2 = t(64, 32), t(48, 32), t(48), t(16, 48), t(16)
    xc, wc, gamma, beta, rm, rv = t(2, 4, 6, 6), t(8, 4, 3, 3), t(8), t(8), t(8), t(8).abs() + 0.5
    xc = xc.to(memory_format=torch.channels_last)
    geometry = (1e-5, [1, 1], [1, 1], [1, 1], "relu", "triton")
    mean, rstd = t(8), t(8).abs() + 0.5
    cases = {
        "linear_act": (lambda *a: twin["linear_act"](*a, "gelu", "triton"), (x, w1, b1)),
        "linear_act_backward": (lambda *a: twin["linear_act_backward"](*a, "gelu", "triton"),
                                (x, w1, b1, t(64, 48))),
        "fused_mlp": (lambda *a: twin["fused_mlp"](*a, "relu", "triton"), (x, w1, b1, w2, b2)),
        "fused_mlp_backward": (lambda *a: twin["fused_mlp_backward"](*a, "relu", "triton"),
                               (x, w1, b1, w2, b2, t(64, 16))),
        "conv_bn_act": (lambda *a: twin["conv_bn_act"](*a, None, True, *geometry), (xc, wc, None, gamma, beta, rm, rv)),
        "conv_bn_act_eval": (lambda *a: twin["conv_bn_act"](*a, None, False, *geometry),
                             (xc, wc, None, gamma, beta, rm, rv)),
        "conv_bn_act_backward": (lambda *a: twin["conv_bn_act_backward"](*a, True, *geometry),
                                 (xc, wc, None, gamma, beta, mean, rstd, None,
                                  t(2, 8, 6, 6).to(memory_format=torch.channels_last))),
    }
    out = {}
    for name, (fn, args) in cases.items():
        out[name] = _graph_targets(fn, *args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
