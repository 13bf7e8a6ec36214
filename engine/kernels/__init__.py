"""Triton kernels for the CUDA path, each with a checking wrapper and a torch reference test.

On CPU the engine uses torch; the tests run these kernels under TRITON_INTERPRET=1.
"""
