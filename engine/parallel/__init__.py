"""Parallelism applied from outside the model: process groups, all-reduce, context parallelism.

The only part of `engine/` that imports torch.distributed.
"""
