"""Compiles the CUDA sources with CuPy (once per process) and shapes launch grids.

CuPy is imported only inside the functions that need a device, so the package (and its cpu backend) imports and
works where CuPy is missing or sees no GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import ContextManager, Final, Protocol, cast

import numpy as np
import numpy.typing as npt

from ._checks import ArrayMeta
from ._source import kernel_directory, kernel_source

THREADS_PER_BLOCK: Final = 256
VECTORS_IN_FLIGHT: Final = 4  # 16-byte vectors each lane keeps in flight (kernels/copy_common.cuh copy_span)
MAX_GRID_Y: Final = 65535
MAX_FLAT_BLOCKS: Final = 65536
NULL: Final = np.uint64(0)
"""A null pointer argument (an 8-byte zero; CuPy passes numpy scalars by value)."""


class Kernel(Protocol):
    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[object, ...]) -> None: ...


class _RawModule(Protocol):
    def get_function(self, name: str) -> Kernel: ...


class _Pointer(Protocol):
    @property
    def ptr(self) -> int: ...


class _DeviceArray(Protocol):
    @property
    def data(self) -> _Pointer: ...


_MODULES: Final[dict[tuple[str, tuple[str, ...]], _RawModule]] = {}


def compile_options() -> tuple[str, ...]:
    """NVRTC options; the digest of the shared headers keys CuPy's on-disk cache, which hashes only the main file."""
    directory = kernel_directory()
    digest = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        if name.endswith(".cuh"):
            digest.update(name.encode())
            with open(os.path.join(directory, name), "rb") as handle:
                digest.update(handle.read())
    return ("--std=c++17", f"-I{directory}", f"-DKVCM_HEADERS_DIGEST=0x{digest.hexdigest()[:15]}")


def kernel(file_name: str, function_name: str, defines: tuple[str, ...] = ()) -> Kernel:
    """An ``extern "C"`` kernel of one ``kernels/*.cu`` file, compiling the file (with the extra ``-D`` options
    ``defines``, one variant each) on first use in this process."""
    key = (file_name, defines)
    module = _MODULES.get(key)
    if module is None:
        import cupy

        options = compile_options() + defines
        module = cast(_RawModule, cupy.RawModule(code=kernel_source(file_name), options=options))
        _MODULES[key] = module
    return module.get_function(function_name)


def on_stream(stream: object | None) -> ContextManager[object]:
    """Makes ``stream`` (a ``cupy.cuda.Stream``) current, so uploads, temporaries and the launch share it."""
    if stream is None:
        return contextlib.nullcontext()
    return cast(ContextManager[object], stream)


def device_array(array: object, name: str) -> ArrayMeta:
    """``array`` if it is a CuPy array; launchers take device arrays only."""
    import cupy

    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"{name} must be a CuPy array, got {type(array).__name__}")
    return cast(ArrayMeta, array)


def upload(array: npt.NDArray[np.int32] | npt.NDArray[np.int64]) -> object:
    """A host array copied to the device on the current stream."""
    import cupy

    return cast(object, cupy.asarray(array))


def device_address(array: object) -> int:
    """Address of a CuPy array's first element."""
    return int(cast(_DeviceArray, array).data.ptr)


def row_geometry(num_rows: int, row_bytes: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Grid and block of the row kernels: x lanes over one row's bytes, y rows (see kernels/copy_common.cuh).

    Example: 64 KiB rows -> 4096 vectors -> 256 lanes x 4 blocks per row, 1 row per block; 512-byte rows -> 32 lanes,
    8 rows per block.
    """
    vectors = max(1, -(-row_bytes // 16))
    lane_steps = -(-vectors // VECTORS_IN_FLIGHT)
    lanes = min(THREADS_PER_BLOCK, -(-lane_steps // 32) * 32)
    rows_per_block = THREADS_PER_BLOCK // lanes
    grid_x = -(-lane_steps // lanes)
    grid_y = min(MAX_GRID_Y, -(-num_rows // rows_per_block))
    return (grid_x, grid_y), (lanes, rows_per_block)


def flat_geometry(total: int) -> tuple[tuple[int], tuple[int]]:
    """Grid and block of a one-thread-per-element grid-stride kernel over ``total`` elements."""
    return (min(MAX_FLAT_BLOCKS, -(-total // THREADS_PER_BLOCK)),), (THREADS_PER_BLOCK,)
