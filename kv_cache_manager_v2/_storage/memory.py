"""Memory backends: the one seam between the manager and real memory (NumPy host, CuPy device, disk files).

Each pool of each tier is one contiguous reservation whose base address never moves for the manager's life
(kernels hold those addresses). Everything above this module deals in slot ids and byte offsets; only here (and in the kernels and
the view-returning API) do NumPy/CuPy arrays appear.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import resource
import secrets
import time
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from .cuda_allocations import device_bytes, mapped_pinned_bytes
from .disk_io import move_file_rows
from .disk_staging import DiskStaging
from .stream_order import CudaStreamOrder, StreamOrder
from .._base.interrupts import DeferredInterrupts
from .._base.types import CacheTier
from ..kernels._checks import IndexVector
from ..kernels.mapped_copy import copy_rows_mapped
from ..kernels.page_copy import copy_rows_cuda, copy_rows_reference
from .._base.wording import counted

HostArray = npt.NDArray[np.uint8]

logger = logging.getLogger("kv_cache_manager_v2.storage")

_UINT8: Final = np.uint8


def cuda_device_available() -> bool:
    """True when CuPy imports and sees a device (the ``backend="auto"`` rule)."""
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.is_available())


class PoolMemory:
    """One pool's reserved bytes in one tier."""

    def __init__(self, nbytes: int, address: int) -> None:
        self.nbytes = nbytes
        self.address = address

    @property
    def on_device(self) -> bool:
        return False

    def array(self) -> object:
        """The whole reservation as a 1-D uint8 array (NumPy, NumPy over a mapped file, or CuPy)."""
        raise NotImplementedError

    def reserve(self, nbytes: int) -> bool:
        """Make sure writing the first ``nbytes`` can never fault for lack of backing store (disk blocks);
        False when the backing store is full. Memory reserved at allocation needs nothing more."""
        return True

    def trim(self, nbytes: int) -> None:
        """Give back the backing store past the first ``nbytes`` (the slots there are unused); addresses stay."""

    def close(self) -> None:
        """Release the memory; the object is unusable afterwards."""


class HostPoolMemory(PoolMemory):
    """NumPy host memory: the cpu backend's "GPU" tier and every host tier. ``np.zeros`` reserves lazily."""

    def __init__(self, nbytes: int) -> None:
        self._data: HostArray = np.zeros(nbytes, dtype=_UINT8)
        super().__init__(nbytes, int(self._data.ctypes.data))

    def array(self) -> object:
        return self._data

    def host_array(self) -> HostArray:
        return self._data


class DiskPoolMemory(HostPoolMemory):
    """A file in the disk tier's directory, mapped into memory.

    The file is unlinked as soon as it is created, so the mapping (and the open descriptor) are its only
    references: a killed process leaves no ``*.pool`` file behind. Its name carries 64 random bits (``allocate``),
    not only the pid and an object's address, which a restarted container's process repeats: a file left by a
    process killed between create and unlink, or another manager's in the same directory, never collides. A write into a sparse part of a mapped file
    on a full filesystem kills the process with SIGBUS, so slots are only ever handed out inside ``backed_bytes``,
    the prefix whose disk blocks ``reserve`` has allocated (``posix_fallocate``). On the cuda backend ``staging``
    carries moves to and from device pools (``disk_staging``). The descriptor is closed by ``close`` or, for a
    manager collected without ``shutdown``, when this object is: an open descriptor of an unlinked file keeps
    its disk blocks allocated for the life of the process.
    """

    def __init__(
        self, nbytes: int, path: str, staging: DiskStaging | None = None, interrupts: DeferredInterrupts | None = None
    ) -> None:
        self.path = path
        self.staging = staging
        # where its warnings go: the manager's ``CallGuard`` holds them until the call ends (``DeferredInterrupts``)
        self.interrupts: DeferredInterrupts = DeferredInterrupts() if interrupts is None else interrupts
        self.backed_bytes = 0
        self._fd = -1  # set before the open: __del__ runs also for an object whose __init__ raised
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise pool_file_error(os.path.dirname(path), error) from error
        try:
            os.unlink(path)
            os.ftruncate(self._fd, nbytes)
            self._map: mmap.mmap | None = mmap.mmap(self._fd, nbytes)
        except BaseException as error:
            self._close_descriptor()
            if isinstance(error, OSError) and error.errno == errno.EFBIG:
                raise file_too_large_error(os.path.dirname(path), nbytes) from error
            raise
        self._data = np.frombuffer(self._map, dtype=_UINT8)
        PoolMemory.__init__(self, nbytes, int(self._data.ctypes.data))

    def reserve(self, nbytes: int) -> bool:
        """Allocate the file's blocks up to ``nbytes``; False when the file cannot have them: a full filesystem, a
        quota, a size limit, or a file that refuses (a filesystem gone read-only, an I/O error; logged), so a disk
        tier that cannot grow is refused like a full one, never an error out of a quota change."""
        if nbytes <= self.backed_bytes:
            return True
        try:
            os.posix_fallocate(self._fd, self.backed_bytes, nbytes - self.backed_bytes)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                self.interrupts.warn(
                    logger, "disk tier: allocating %r up to %d bytes failed: %s", self.path, nbytes, str(error)
                )
            return False
        self.backed_bytes = nbytes
        return True

    def move_rows(
        self, file_rows: IndexVector, table: HostArray, table_rows: IndexVector, to_file: bool, names: tuple[str, str]
    ) -> None:
        """Rows between this file and ``table`` (another host-side pool's rows) by positioned vector I/O."""
        move_file_rows(self._fd, file_rows, self.nbytes // int(table.shape[1]), table, table_rows, to_file, names)

    def move_device_rows(
        self, file_rows: IndexVector, device: PoolMemory, device_rows: IndexVector, row_bytes: int, to_file: bool,
        names: tuple[str, str],
    ) -> None:
        """Rows between this file and a device pool through the backend's staging (pinned, device-mapped)."""
        staging = self.staging
        if staging is None:
            raise RuntimeError(f"disk pool {self.path!r} has no staging for device moves (cpu backend)")
        staging.move(
            self._fd, file_rows, self.nbytes // row_bytes, device.address, device.nbytes // row_bytes, device_rows,
            row_bytes, to_file, names,
        )

    def trim(self, nbytes: int) -> None:
        """Give the blocks past ``nbytes`` back. A file that refuses (a filesystem gone read-only, an I/O error)
        keeps them, with a warning: the shrink that asked has already moved its slots, so it must not fail."""
        if nbytes >= self.backed_bytes:
            return
        # Cutting the file and growing it back turns the tail into a hole: its blocks go back to the
        # filesystem while the mapping's length (and so every address) stays. Nothing lives in the tail.
        try:
            os.ftruncate(self._fd, nbytes)
            self.backed_bytes = nbytes
            # Left short, the file grows again as ``reserve`` allocates (before any slot there is used).
            os.ftruncate(self._fd, self.nbytes)
        except OSError as error:
            self.interrupts.warn(
                logger, "disk tier: giving back the blocks of %r past %d bytes failed: %s", self.path, nbytes, str(error)
            )

    def close(self) -> None:
        if self.staging is not None:
            self.staging.wait()
        self._data = np.zeros(0, dtype=_UINT8)
        self._map = None
        self._close_descriptor()

    def __del__(self) -> None:
        self._close_descriptor()  # only the descriptor: the mapping and the arrays free themselves

    def _close_descriptor(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def disk_bytes_available(directory: str) -> int:
    """Bytes an unprivileged process may still allocate on the filesystem holding ``directory``."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def disk_space_error(directory: str, requested: int) -> OSError:
    """The error a disk tier raises at construction when its filesystem cannot hold it (ENOSPC)."""
    available = disk_bytes_available(directory)
    return OSError(
        errno.ENOSPC,
        f"DiskCacheTierConfig.path {directory!r}: the disk tier needs {requested} bytes but the filesystem has "
        f"{available} bytes available ({max(0, requested - available)} bytes short); no pool file was kept",
    )


def file_too_large_error(directory: str, nbytes: int) -> OSError:
    """The error a disk tier raises at construction when a pool file may not be as large as it needs (EFBIG): the
    process's file size limit (``ulimit -f``) or the filesystem's largest file is smaller."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
    return OSError(
        errno.EFBIG,
        f"DiskCacheTierConfig.path {directory!r}: a pool file of the disk tier needs {nbytes} bytes, more than this "
        f"process may write (RLIMIT_FSIZE, ulimit -f: {shown}) or the filesystem's largest file; no pool file was "
        f"kept",
    )


def pool_file_error(directory: str, error: OSError) -> OSError:
    """The error a disk tier raises at construction when its directory refuses a new file (read-only, no write
    permission, out of inodes): the configured path and the reason, where the bare error named only a generated
    file name."""
    return OSError(
        error.errno,
        f"DiskCacheTierConfig.path {directory!r}: cannot create a pool file there ({error.strerror}); the disk tier "
        f"needs a directory this process may write",
    )


class CudaPoolMemory(PoolMemory):
    """Device memory, reserved once for the pool's maximum size and returned to the device at ``close``."""

    def __init__(self, nbytes: int) -> None:
        import cupy

        self._data: object = device_bytes(nbytes)
        super().__init__(nbytes, int(cupy.asarray(self._data).data.ptr))

    @property
    def on_device(self) -> bool:
        return True

    def array(self) -> object:
        return self._data

    def close(self) -> None:
        self._data = None


_STREAMS_KEPT: Final = 8
"""Streams a pinned pool tracks before it forgets those whose work on it has finished."""


class PinnedPoolMemory(HostPoolMemory):
    """Page-locked host memory for the host tier of the cuda backend, mapped into the device's address space, so
    page moves to and from a device pool run as kernels on a stream (``kernels/mapped_copy.py``).

    Those moves are asynchronous, so every host access (``array``, ``host_array``, ``close``) first waits for the
    device work queued on this pool; one reusable event per stream that touched it.
    """

    def __init__(self, nbytes: int) -> None:
        import cupy

        self._pinned: object = mapped_pinned_bytes(nbytes)
        self._data = np.frombuffer(cast(memoryview, self._pinned), dtype=_UINT8, count=nbytes)
        PoolMemory.__init__(self, nbytes, int(self._data.ctypes.data))
        runtime: Any = cupy.cuda.runtime
        self.device_address = int(runtime.pointerGetAttributes(self.address).devicePointer)
        self._device_users: dict[int, Any] = {}

    def note_device_use(self) -> None:
        """Work just queued on the current CuPy stream reads or writes this pool."""
        import cupy

        stream: Any = cupy.cuda.get_current_stream()
        event = self._device_users.get(int(stream.ptr))
        if event is None:
            if len(self._device_users) >= _STREAMS_KEPT:  # an engine making streams per request: forget idle ones
                self._device_users = {ptr: user for ptr, user in self._device_users.items() if not user.done}
            event = self._device_users[int(stream.ptr)] = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)

    @property
    def num_streams_tracked(self) -> int:
        """Streams whose last use of this pool ``wait_for_device`` may still have to wait for."""
        return len(self._device_users)

    def wait_for_device(self) -> None:
        """Block until the device work queued on this pool has finished (the host may touch its bytes then)."""
        for event in self._device_users.values():
            event.synchronize()

    def array(self) -> object:
        self.wait_for_device()
        return self._data

    def host_array(self) -> HostArray:
        self.wait_for_device()
        return self._data

    def close(self) -> None:
        self.wait_for_device()
        self._device_users = {}
        self._data = np.zeros(0, dtype=_UINT8)
        self._pinned = None


class MemoryBackend:
    """Allocates pool memory for each kind of tier; ``name`` is ``"cpu"`` or ``"cuda"``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._disk_staging: DiskStaging | None = None
        self.interrupts: DeferredInterrupts = DeferredInterrupts()  # the manager sets its CallGuard (disk warnings)

    def reserves_lazily(self, tier: CacheTier) -> bool:
        """True when untouched reserved bytes cost no physical memory (NumPy's calloc, sparse disk files)."""
        return self.name == "cpu" or tier == CacheTier.DISK

    def stream_order(self) -> StreamOrder:
        """How slot reuse is ordered across the caches' CUDA streams (nothing to order on the cpu backend)."""
        return CudaStreamOrder() if self.name == "cuda" else StreamOrder()

    def allocate(self, tier: CacheTier, nbytes: int, directory: str | None) -> PoolMemory:
        if tier == CacheTier.DISK:
            assert directory is not None
            name = f"kv_cache_manager_v2-{os.getpid()}-{secrets.token_hex(8)}.pool"
            if self.name == "cuda" and self._disk_staging is None:
                self._disk_staging = DiskStaging()  # its pinned buffers are allocated at the first move
            return DiskPoolMemory(nbytes, os.path.join(directory, name), self._disk_staging, self.interrupts)
        if self.name == "cuda":
            return CudaPoolMemory(nbytes) if tier == CacheTier.GPU_MEM else PinnedPoolMemory(nbytes)
        return HostPoolMemory(nbytes)


def choose_backend(requested: str) -> MemoryBackend:
    """Resolve ``"auto"`` (cuda only when CuPy sees a device) and check that ``"cuda"`` can work."""
    if requested == "auto":
        return MemoryBackend("cuda" if cuda_device_available() else "cpu")
    if requested == "cuda" and not cuda_device_available():
        raise ValueError("KVCacheManagerConfig.backend='cuda' but CuPy sees no CUDA device")
    return MemoryBackend(requested)


def rows_view(memory: PoolMemory, row_bytes: int, num_rows: int) -> object:
    """The first ``num_rows`` rows of ``row_bytes`` bytes of a pool, as a 2-D array (NumPy or CuPy)."""
    data = memory.array()
    if isinstance(data, np.ndarray):
        return data[: num_rows * row_bytes].reshape(num_rows, row_bytes)
    import cupy

    device = cupy.asarray(data)
    return device[: num_rows * row_bytes].reshape(num_rows, row_bytes)


class CopyClock:
    """Time this process spent inside ``copy_rows`` (page copies between slots, any tier), so that a caller timing
    manager calls can split them into bookkeeping and data movement (the simulator's table). On the cpu backend
    it is the copies themselves; on the cuda backend copies are asynchronous and it counts their launches."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0


COPY_CLOCK: Final = CopyClock()


def copy_rows(
    dst: PoolMemory, dst_rows: IndexVector, src: PoolMemory, src_rows: IndexVector, row_bytes: int
) -> None:
    """Copy whole slots between pools of any tiers, each side in one batched launch (kernels/page_copy.cu).

    Pool to pool when both sit on the same side (device or host) and no row is both read and written, or when one
    is a device pool and the other a pinned pool (one asynchronous launch through the pinned pool's mapped
    address), or by positioned vector I/O between a disk pool and another host-side pool (``_disk_io``);
    otherwise a gather into a staging table on the source side, one transfer, and a scatter on the destination
    side. Row ids are ints or, cheapest for the device <-> pinned path, int64 NumPy arrays.
    """
    if len(dst_rows) == 0:
        return
    start = time.perf_counter_ns()
    _copy_rows(dst, dst_rows, src, src_rows, row_bytes)
    COPY_CLOCK.ns += time.perf_counter_ns() - start
    COPY_CLOCK.calls += 1


def _copy_rows(dst: PoolMemory, dst_rows: IndexVector, src: PoolMemory, src_rows: IndexVector, row_bytes: int) -> None:
    pinned = _pinned_side(dst, src)
    if pinned is not None:
        copy_rows_mapped(_kernel_address(dst), dst.nbytes // row_bytes, dst_rows,
                         _kernel_address(src), src.nbytes // row_bytes, src_rows, row_bytes)
        pinned.note_device_use()
        return
    if _disk_move(dst, dst_rows, src, src_rows, row_bytes) or _staged_disk_move(dst, dst_rows, src, src_rows, row_bytes):
        return
    dst_table = rows_view(dst, row_bytes, dst.nbytes // row_bytes)
    src_table = rows_view(src, row_bytes, src.nbytes // row_bytes)
    aliased = dst is src and not set(np.asarray(dst_rows).tolist()).isdisjoint(np.asarray(src_rows).tolist())
    if dst.on_device == src.on_device and not aliased:
        _copy(dst_table, dst_rows, src_table, src_rows, dst.on_device)
        return
    staging = _gather(src_table, src_rows, row_bytes, src.on_device)
    if dst.on_device != src.on_device:
        staging = _transfer(staging, dst.on_device)
    _scatter(dst_table, dst_rows, staging, dst.on_device)


def _disk_move(dst: PoolMemory, dst_rows: IndexVector, src: PoolMemory, src_rows: IndexVector, row_bytes: int) -> bool:
    """A move between a disk pool and another host-side pool (pinned: after its queued device work), or between
    disk slots (through a host staging table: a media error is then an ``OSError``, not a SIGBUS in the file's
    mapping), by positioned I/O (``_disk_io``); False for any other pair, which takes the paths below."""
    if isinstance(dst, DiskPoolMemory) and isinstance(src, DiskPoolMemory):
        count = len(dst_rows)
        staging = np.empty((count, row_bytes), dtype=_UINT8)
        staged = np.arange(count, dtype=np.int64)
        if len(src_rows) != count:
            raise ValueError(f"src_rows must have {counted(count, 'entry', 'entries')}, got {len(src_rows)}")
        src.move_rows(src_rows, staging, staged, False, ("src_rows", "staging"))
        dst.move_rows(dst_rows, staging, staged, True, ("dst_rows", "staging"))
        return True
    if isinstance(dst, DiskPoolMemory) and not isinstance(src, DiskPoolMemory) and not src.on_device:
        table = cast(HostArray, rows_view(src, row_bytes, src.nbytes // row_bytes))
        dst.move_rows(dst_rows, table, src_rows, True, ("dst_rows", "src_rows"))
        return True
    if isinstance(src, DiskPoolMemory) and not isinstance(dst, DiskPoolMemory) and not dst.on_device:
        table = cast(HostArray, rows_view(dst, row_bytes, dst.nbytes // row_bytes))
        src.move_rows(src_rows, table, dst_rows, False, ("src_rows", "dst_rows"))
        return True
    return False


def _staged_disk_move(
    dst: PoolMemory, dst_rows: IndexVector, src: PoolMemory, src_rows: IndexVector, row_bytes: int
) -> bool:
    """A move between a disk pool and a device pool through the cuda backend's pinned staging; False otherwise."""
    if isinstance(dst, DiskPoolMemory) and dst.staging is not None and src.on_device:
        dst.move_device_rows(dst_rows, src, src_rows, row_bytes, True, ("dst_rows", "src_rows"))
        return True
    if isinstance(src, DiskPoolMemory) and src.staging is not None and dst.on_device:
        src.move_device_rows(src_rows, dst, dst_rows, row_bytes, False, ("src_rows", "dst_rows"))
        return True
    return False


def _pinned_side(dst: PoolMemory, src: PoolMemory) -> PinnedPoolMemory | None:
    """The pinned pool of a device <-> pinned move (the direct path), else None."""
    if isinstance(dst, PinnedPoolMemory) and isinstance(src, CudaPoolMemory):
        return dst
    if isinstance(src, PinnedPoolMemory) and isinstance(dst, CudaPoolMemory):
        return src
    return None


def _kernel_address(memory: PoolMemory) -> int:
    """Where a kernel reaches ``memory``: the device pool's address, or the pinned pool's mapped one."""
    return memory.device_address if isinstance(memory, PinnedPoolMemory) else memory.address


def _copy(dst: object, dst_rows: IndexVector | None, src: object, src_rows: IndexVector | None, on_device: bool) -> None:
    if on_device:
        copy_rows_cuda(dst, dst_rows, src, src_rows)
    else:
        copy_rows_reference(cast(HostArray, dst), dst_rows, cast(HostArray, src), src_rows)


def _gather(table: object, rows: IndexVector, row_bytes: int, on_device: bool) -> object:
    """The rows, in order, as a new contiguous staging table on the table's side."""
    if on_device:
        import cupy

        staging: object = cupy.empty((len(rows), row_bytes), dtype=cupy.uint8)
    else:
        staging = np.empty((len(rows), row_bytes), dtype=_UINT8)
    _copy(staging, None, table, rows, on_device)
    return staging


def _transfer(staging: object, to_device: bool) -> object:
    """One host <-> device copy of a whole staging table."""
    import cupy

    return cupy.asarray(staging) if to_device else cupy.asnumpy(staging)


def _scatter(table: object, rows: IndexVector, staging: object, on_device: bool) -> None:
    _copy(table, rows, staging, None, on_device)
