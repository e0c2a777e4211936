"""``fusedrc-bench``: memory-vs-speed curves of activation recomputation strategies.

Run ``fusedrc-bench`` (or ``python -m fusedrc.bench``) for the default sweep,
``fusedrc-bench kernels`` for the per-kernel microbenchmarks and
``fusedrc-bench plot RESULTS.json`` to redraw plots from a saved result file.

``fusedrc-bench --workload models`` (or ``resnet50``, ``opt``) runs the real models
instead: torchvision ResNet-50 and a small Hugging Face OPT, original vs
``torch.utils.checkpoint`` vs ``fusedrc.convert`` (policies and memory budgets).

One concern per module: ``workloads`` (the synthetic models), ``strategies`` (how a
model's blocks are run), ``models`` (the real models and their strategies),
``measure`` (timers, saved-bytes counter, environment),
``sweep`` / ``kernels`` (the two benchmarks), ``results`` (JSON/CSV files),
``schema`` (the result file's schema and its validator), ``plot`` (matplotlib),
``cli`` (the command line).
"""
from .cli import main

__all__ = ["main"]
