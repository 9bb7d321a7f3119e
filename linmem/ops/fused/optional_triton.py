"""Triton if it is installed (the optional "gpu" extra): ``triton``, ``tl`` and ``jit``; without it ``triton`` and
``tl`` are None and ``jit`` leaves a function as it is, so a module can define its kernels and still import, and
runs its torch path only."""

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:
    triton = tl = None

    def jit(fn):
        return fn
