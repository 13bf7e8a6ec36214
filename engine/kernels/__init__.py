"""Kernels, each with a checking wrapper and a torch reference test.

Triton kernels for the CUDA path (the tests run them under TRITON_INTERPRET=1 on CPU), and one C++ kernel
for CPU decode attention over the paged cache (`cpu_decode`, built with torch's cpp_extension on first use).
"""
