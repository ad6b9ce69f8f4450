"""Finds the CUDA C sources: shipped inside the installed package, or the repository's ``kernels/`` in fast mode."""

from __future__ import annotations

import os

# realpath: a strict editable install links the modules into a tree that lacks the CUDA sources.
_PACKAGE_DIR = os.path.dirname(os.path.realpath(__file__))


def kernel_directory() -> str:
    """Directory holding the ``.cu``/``.cuh`` files (also the include path for NVRTC)."""
    shipped = os.path.join(_PACKAGE_DIR, "cuda")
    if os.path.isdir(shipped) and os.listdir(shipped):
        return shipped
    repository = os.path.join(os.path.dirname(os.path.dirname(_PACKAGE_DIR)), "kernels")
    if os.path.isdir(repository):
        return repository
    raise FileNotFoundError(f"no CUDA sources found in {shipped} or {repository}")


def kernel_source(file_name: str) -> str:
    """Text of one CUDA source file, e.g. ``kernel_source("page_copy.cu")``."""
    path = os.path.join(kernel_directory(), file_name)
    with open(path, encoding="utf-8") as handle:
        return handle.read()
