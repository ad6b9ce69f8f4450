"""Device and mapped pinned memory the pools own outright, not borrowed from CuPy's caching pools.

CuPy's pools keep freed blocks for CuPy's next allocation: a pool carved from them stays reserved after
``shutdown`` for every other user of the device (torch, a second manager) and of the host's page-locked memory.
Allocating directly makes closing a pool give its bytes back to the driver.
"""

from __future__ import annotations

from typing import Any

_CUDA_ERROR_MEMORY_ALLOCATION = 2


def _out_of_memory(error: BaseException) -> bool:
    return getattr(error, "status", None) == _CUDA_ERROR_MEMORY_ALLOCATION


def device_bytes(nbytes: int) -> object:
    """A zeroed CuPy uint8 array of ``nbytes`` on the current device, freed when the last reference goes.

    Blocks CuPy's own pool caches are released first if the device is out of memory (CuPy does the same for its
    pool's allocations)."""
    import cupy

    cuda: Any = cupy.cuda
    try:
        memory = cuda.Memory(nbytes)
    except cuda.runtime.CUDARuntimeError as error:
        if not _out_of_memory(error):
            raise
        cupy.get_default_memory_pool().free_all_blocks()
        memory = cuda.Memory(nbytes)
    array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cuda.MemoryPointer(memory, 0))
    cuda.runtime.memset(int(array.data.ptr), 0, nbytes)
    return array


def mapped_pinned_bytes(nbytes: int) -> object:
    """Page-locked host memory of ``nbytes`` (at least 1), mapped into the device's address space (a buffer
    NumPy can view), freed when the last reference goes."""
    import cupy

    cuda: Any = cupy.cuda
    flags = cuda.runtime.hostAllocPortable | cuda.runtime.hostAllocMapped
    try:
        memory = cuda.PinnedMemory(max(nbytes, 1), flags)
    except cuda.runtime.CUDARuntimeError as error:
        if not _out_of_memory(error):
            raise
        cupy.get_default_pinned_memory_pool().free_all_blocks()
        memory = cuda.PinnedMemory(max(nbytes, 1), flags)
    return cuda.PinnedMemoryPointer(memory, 0)
