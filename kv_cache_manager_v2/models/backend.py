"""Where the model's arrays live: NumPy (cpu backend, fp32 KV pages) or CuPy (cuda backend, fp16 KV pages).

The math is written once against NumPy's API; on the cuda backend the arrays are CuPy arrays and NumPy's
functions dispatch to CuPy (``__array_ufunc__`` / ``__array_function__``), so only moving data between host and
device, and making an array contiguous (NumPy's array constructors do not dispatch), is backend-specific. Matrix
products and norms run in fp32 on both backends (Gemma's residual stream overflows fp16); what the cuda backend
stores and attends in fp16 is the KV cache — the manager's pages.
"""

from __future__ import annotations

from typing import Final, cast

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float32]
"""A float array of the backend (typed as NumPy: CuPy arrays quack the same)."""

BACKENDS: Final = ("cpu", "cuda")


class ArrayBackend:
    """``cpu`` or ``cuda``: device transfers and the KV element type the manager's pages hold."""

    def __init__(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
        self.name = name
        self.kv_element_type = "float32" if name == "cpu" else "float16"
        self.kv_dtype: type[np.generic] = np.float32 if name == "cpu" else np.float16

    def to_device(self, host: npt.NDArray[np.generic]) -> Array:
        if self.name == "cpu":
            return cast(Array, host)
        import cupy

        return cast(Array, cupy.asarray(host))

    def to_host(self, array: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
        if self.name == "cpu":
            return array
        return cast(npt.NDArray[np.generic], cast(object, array).get())  # type: ignore[attr-defined]

    def contiguous(self, array: Array) -> Array:
        """``array`` in C order (itself when it already is): NumPy's array constructors do not dispatch to CuPy."""
        if self.name == "cpu":
            return np.ascontiguousarray(array)
        import cupy

        return cast(Array, cupy.ascontiguousarray(array))

    def synchronize(self) -> None:
        """Wait for queued device work (so host timers measure it)."""
        if self.name == "cuda":
            import cupy

            cupy.cuda.get_current_stream().synchronize()


def cuda_available() -> bool:
    """Whether CuPy is installed and sees a device (the one guard the GPU tests use)."""
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.is_available())
