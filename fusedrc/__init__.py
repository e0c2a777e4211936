"""fusedrc: activation recomputation with the rerun fused into the backward kernels.

Public API::

    fusedrc.recompute(block, *args, ...)          # torch.utils.checkpoint / mindspore.recompute
    fusedrc.recompute_sequential(fns, segments, x) # checkpoint_sequential
    fusedrc.mark(module) / fusedrc.unmark(module)  # MindSpore Cell.recompute()
    fusedrc.use_backend("auto"|"triton"|"reference"), fusedrc.current_backend()
    fusedrc.RecomputeError
    fusedrc.functional.{linear_act, fused_mlp, gated_mlp, moe_experts, conv_bn_act}
    fusedrc.nn.{LinearReLU, FusedMLP, GatedMLP, MoEExperts, ConvBNReLU}
    fusedrc.convert(model, policy=..., memory_budget=..., example_inputs=...)
"""
import importlib.util as _ilu
import os as _os
import sys as _sys


def _source_tree_kernels():
    # Running from a source checkout with a non-editable install (or none), the
    # local fusedrc/ shadows the installed one and lacks the mapped subpackage.
    if _ilu.find_spec("fusedrc.kernels") is not None:
        return
    path = _os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "kernels", "__init__.py")
    if _os.path.exists(path):
        spec = _ilu.spec_from_file_location("fusedrc.kernels", path, submodule_search_locations=[_os.path.dirname(path)])
        mod = _ilu.module_from_spec(spec)
        _sys.modules["fusedrc.kernels"] = mod
        spec.loader.exec_module(mod)


from ._backend import current_backend, use_backend  # noqa: E402
from .errors import RecomputeError  # noqa: E402
from . import functional, nn, ops, reference  # noqa: E402,F401
from .recompute import mark, recompute, recompute_sequential, unmark  # noqa: E402
from .convert import convert, register_rule  # noqa: E402

_source_tree_kernels()

__version__ = "0.1.0"
__all__ = [
    "recompute", "recompute_sequential", "mark", "unmark", "use_backend", "current_backend",
    "RecomputeError", "functional", "nn", "convert", "register_rule",
]
