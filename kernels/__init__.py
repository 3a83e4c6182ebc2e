"""Triton kernels that make recomputation cheap (installed as ``fastpipe.kernels``)."""
