"""Triton kernels (installed as `sglang_dsv41.kernels`)."""
