"""CUDA kernels (sources in the repository's top-level ``kernels/``) with their NumPy reference twins."""
