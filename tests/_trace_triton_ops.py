"""Compile a converted model through the triton_op twins on CPU, up to the graphs: nothing runs.

Run as a script by ``test_compile.test_triton_op_twins_compile_into_their_launches``, in a process
*without* ``TRITON_INTERPRET``: ``wrap_triton`` records launches only of real ``JITFunction``s
(the interpreter's kernels cannot be traced, DESIGN §2), and a CPU has nothing to launch them on.
So the script

- tells fusedrc the interpreter is on (the Triton backend accepts CPU tensors, the conv launchers
  too) and picks the triton_op twins also under torch.compile, forward and backward;
- makes Triton's active driver report an sm_90 target: torch's mutation analysis then compiles
  each kernel to IR (as ``fusedrc.inspect`` does) and finds the arguments it writes, as on a GPU;
- compiles forward and backward together (``force_non_lazy_backward_lowering``) with
  ``aot_autograd``, captures both graphs and stops before running them.

Prints one JSON object: the call_function targets of the forward and backward graphs, the
warnings torch logged about its mutation analysis (none expected) and, per kernel, the arguments
that analysis found written (the kernel's outputs only: an operand counted as written is cloned in
the forward and rejected in a joint graph). ``python _trace_triton_ops.py gated`` traces two
gated FFNs (the dual-GEMM kernels), ``... more`` the other kernels (``test_compile._More``),
instead of the converted Conv/FFN/Linear net.
"""
import json
import logging
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402


class _Captured(Exception):
    pass


class _Sm90Target:
    """Only what torch's mutation analysis asks of the driver: the compile target."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def main():
    import triton
    from torch._dynamo.backends.common import aot_autograd

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fusedrc
    from fusedrc import _backend, ops
    from test_compile import _More, _net

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").addHandler(handler)

    _backend.interpreter_active = lambda: True
    assert _backend.has_triton_kernel("conv_bn_act", "conv_bn_act_forward")  # registers the twins
    from fusedrc.kernels import conv_bn_act

    conv_bn_act.interpreting = lambda: True
    ops._twin_traceable = lambda x: True
    triton.runtime.driver.set_active(_Sm90Target())
    torch._functorch.config.force_non_lazy_backward_lowering = True

    import torch._higher_order_ops.triton_kernel_wrap as kernel_wrap

    written = {}
    analyse = kernel_wrap.get_mutated_tensors

    def recording(kernel_idx, *args):
        names = analyse(kernel_idx, *args)
        kernel = kernel_wrap.kernel_side_table.get_kernel(kernel_idx)
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        written[name] = sorted(set(written.get(name, [])) | set(names))
        return names

    kernel_wrap.get_mutated_tensors = recording

    graphs = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            if kind == "backward":
                raise _Captured  # both graphs are in: stop before anything runs
            return gm.forward
        return compiler

    if sys.argv[1:] == ["gated"]:
        model = torch.nn.Sequential(fusedrc.nn.GatedMLP(16, 24, out_features=20),
                                    fusedrc.nn.GatedMLP(20, 12, bias=False, activation="gelu_tanh"))
        x = torch.randn(5, 16, requires_grad=True)
    elif sys.argv[1:] == ["more"]:
        model, x = _More(), torch.randn(2, 3, 6, 6, requires_grad=True)
    else:
        model = fusedrc.convert(_net())
        x = torch.randn(2, 3, 6, 6, requires_grad=True)
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=capture("forward"),
                                                         bw_compiler=capture("backward")), fullgraph=True)
    with fusedrc.use_backend("triton"):
        try:
            compiled(x)
        except Exception as e:  # dynamo wraps the backend's exception
            if not any(isinstance(c, _Captured) for c in _causes(e)):
                raise
    print(json.dumps({**graphs, "analysis_warnings": warnings, "written": written}))


def _causes(e):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


if __name__ == "__main__":
    main()
