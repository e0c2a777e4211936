"""Triton kernels and their launchers, installed as ``fusedrc.kernels``.

One module per fused pattern. Each launcher has the signature of its reference
twin in ``fusedrc.reference``; nothing here knows about autograd. Modules are
imported lazily by the triton backend, so ``import fusedrc`` never imports Triton.
"""
