"""Triton kernels for the CUDA path; each has a PyTorch reference elsewhere in the package."""
