"""``fusedrc-bench``: memory-vs-speed curves of activation recomputation strategies.

Run ``fusedrc-bench`` (or ``python -m fusedrc.bench``) for the default sweep,
``fusedrc-bench kernels`` for the per-kernel microbenchmarks and
``fusedrc-bench plot RESULTS.json`` to redraw plots from a saved result file.

One concern per module: ``workloads`` (the models), ``strategies`` (how a
model's blocks are run), ``measure`` (timers, saved-bytes counter, environment),
``sweep`` / ``kernels`` (the two benchmarks), ``results`` (JSON/CSV files),
``schema`` (the result file's schema and its validator), ``plot`` (matplotlib),
``cli`` (the command line).
"""
from .cli import main

__all__ = ["main"]
