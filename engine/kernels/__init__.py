"""Kernels, each with a checking wrapper and a torch reference test.

Triton kernels for the CUDA path (the tests run them under TRITON_INTERPRET=1 on CPU), and C++ kernels for
the CPU, built with torch's cpp_extension on first use (`cpu_ops`): decode attention over the paged cache
(`cpu_decode`), and RMSNorm, the residual add before it and RoPE, one pass over each row (`cpu_norm_rope.cpp`,
called from engine/model.py and engine/attention.py).
"""
