"""Measuring helpers shared by the tests."""
import contextlib

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

GEMM_OPS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "linear", "_addmm_activation"}


def backend_device(backend):
    """Where a test case for ``backend`` runs: the Triton backend's on CUDA when there is a GPU (the
    kernels need CUDA tensors there; CPU tensors under the interpreter elsewhere), the reference
    backend's on the CPU."""
    return torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")


class SavedBytes(contextlib.AbstractContextManager):
    """Bytes autograd keeps through saved tensors, parameters and their views excluded (counted once each)."""

    def __init__(self):
        self.bytes = 0
        self.count = 0
        self._seen = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, t):
        # a view of a parameter (a 1x1 conv's weight.flatten(1), a Conv1D's weight.t()) is no activation
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += t.numel() * t.element_size()
                self.count += 1
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class GemmCounter(TorchDispatchMode):
    """Counts matrix multiplications, looking inside fusedrc's custom ops."""

    # On a GPU, the Triton launches inside an op reach the mode as a higher-order operator
    # (``wrap_triton``'s triton_kernel_wrapper_mutation): they are run as they are, uncounted.
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.gemms = 0
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.ops.append(str(func))
        if name in GEMM_OPS:
            self.gemms += 1
        if func.namespace == "fusedrc":
            # custom ops are opaque to the mode: run their CPU kernel with the mode on
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        return func(*args, **kwargs)


class FusedOpLog(TorchDispatchMode):
    """Names of the fusedrc ops that ran inside it, forward and backward, in order (``ops``, or
    the list handed in). Under it the ops go through the dispatcher, not the plain-eager path."""

    def __init__(self, ops=None):
        super().__init__()
        self.ops = [] if ops is None else ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusedrc":
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def rel_err(a, b):
    a, b = a.double(), b.to(a.device, torch.float64)  # an oracle on the CPU beside a result on CUDA
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def replicate_on_cpu(network, scale=2.0):
    """``torch.nn.parallel.replicate`` for one replica, on the CPU: each module's
    ``_replicate_for_data_parallel()`` in ``network.modules()`` order, then children, parameters
    (as non-leaf tensors, scaled by ``scale`` so that a replica reading the original's shows)
    and buffers set on the replicas the way replicate sets them."""
    modules = list(network.modules())
    copies = [m._replicate_for_data_parallel() for m in modules]
    index = {m: i for i, m in enumerate(modules)}
    for m, r in zip(modules, copies):
        for key, child in m._modules.items():
            setattr(r, key, None if child is None else copies[index[child]])
        for key, p in m._parameters.items():
            if p is None:
                r._parameters[key] = None
            else:
                setattr(r, key, p * scale)
        for key, b in m._buffers.items():
            if b is None:
                r._buffers[key] = None
            else:
                setattr(r, key, b.clone())
    return copies[0]


def record_launches(monkeypatch, module, grids=False, args=False):
    """Every launch through ``module.launcher`` (a kernels module's), in order: [(kernel name, the
    launch's keyword arguments: its constexpr flags)], with ``grids`` [(name, kwargs, grid)], with
    ``args`` the positional arguments last (pointers and scalars)."""
    seen = []
    real = module.launcher

    def spy(kernel, probe):
        launch = real(kernel, probe)

        class _Grid:
            def __getitem__(self, grid):
                def run(*pos, **kw):
                    name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
                    seen.append((name, kw) + ((grid,) if grids else ()) + ((pos,) if args else ()))
                    return launch[grid](*pos, **kw)
                return run
        return _Grid()

    monkeypatch.setattr(module, "launcher", spy)
    return seen


def fused_without_norms(plan):
    """``plan.fused`` less convert's norm units (norms whose output the ops after them do not keep,
    tested in test_recomputed_norm.py): the names of the fused FFN / Conv-BN units switched on."""
    return [u.name for u in plan.units if u.selected and u.kind != "norm"]


def norm_units(plan):
    return [u.name for u in plan.units if u.selected and u.kind == "norm"]


class LlamaRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, written out (its forward, word for word)."""

    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """Hugging Face's GemmaRMSNorm (Gemma 1-3, Qwen3-Next's is the same), written out: times (1 + weight)
    in float32, rounded once (kind "gemma_rms"). Its weight starts at zero."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class InputScaledRMSNorm(LlamaRMSNorm):
    """Scales x by (1 + weight) before it normalizes (transformers' MuseSpark input norm): no kind
    models it, so convert reruns its own forward."""

    def forward(self, x):
        h = (x.float() * (1.0 + self.weight.float())).type_as(x).float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).type_as(x)
