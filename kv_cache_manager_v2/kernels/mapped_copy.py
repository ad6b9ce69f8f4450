"""Page moves between a device pool and a pinned host pool in one launch (cuda backend, issue #41).

Pinned host memory is mapped into the device's address space (UVA), so ``page_copy_rows`` can gather or scatter
pages straight across the link: no staging table, no transfer of its own, no host wait. The row tables reach the
device through a ring of reusable pinned + device buffers: the host fills the pinned one, one asynchronous copy
on the stream uploads it, and an event recorded after the launch says when both may be refilled. Nothing is
allocated per move once the ring has grown to the batches in use.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Final, Protocol, cast

import numpy as np
import numpy.typing as npt

from ._checks import IndexVector, check_range, check_unique, index_vector
from ._launch import device_address, kernel, row_geometry
from .._base.wording import counted

MAX_RING_SLOTS: Final = 64
"""Row-table buffers kept per device; a move finding them all still in use waits for the oldest. One flush queues a
move per pool and per run of same-direction copies behind the engine's work on the stream, so this many moves can
be queued before the host ever waits (at most ~32 MiB of pinned + device buffers at 65,536-page batches)."""
MIN_TABLE_ENTRIES: Final = 4096


class RowTableSlot:
    """One pinned staging buffer of int32 row ids and its device twin; free again once ``event`` completed."""

    def __init__(self, entries: int) -> None:
        import cupy

        self.entries = entries
        self.pinned: object = cupy.cuda.alloc_pinned_memory(entries * 4)
        self.host: npt.NDArray[np.int32] = np.frombuffer(
            cast(memoryview, self.pinned), dtype=np.int32, count=entries
        )
        self.device: object = cupy.empty(entries, dtype=cupy.int32)
        self.event: Any = cupy.cuda.Event(block=False, disable_timing=True)
        self.queued = False

    def busy(self) -> bool:
        """True while an upload or launch queued with these buffers may not have finished."""
        return self.queued and not bool(self.event.done)

    def wait(self) -> None:
        """Block until the work queued with these buffers finished."""
        self.event.synchronize()


class TableSlot(Protocol):
    """What ``RowTableRing`` needs of a slot (``RowTableSlot``; a test's stand-in without a GPU)."""

    entries: int
    queued: bool

    def busy(self) -> bool: ...
    def wait(self) -> None: ...


class RowTableRing:
    """The row-table buffers of one device, taken in turn by every manager (and thread) moving pages on it.

    ``queue`` is one step under the ring's lock: take a slot nobody uses, fill and launch with it, mark it queued.
    Without the lock a second thread could take the same slot between the first's take and its mark (the slot
    still looks free) and overwrite its row ids before the upload read them: pages copied to the wrong rows."""

    def __init__(self, make_slot: Callable[[int], TableSlot] = RowTableSlot) -> None:
        self.slots: list[TableSlot] = []
        self.next: int = 0
        self._make_slot = make_slot
        self._lock = threading.Lock()

    def queue(self, entries: int, launch: Callable[[Any], None]) -> None:
        """Call ``launch`` with a slot of at least ``entries`` ids that no queued work reads any more (it fills the
        slot's buffers and queues the work that reads them, recording the slot's event after it), then mark the slot
        queued; one move at a time per device."""
        with self._lock:
            slot = self._take(entries)
            launch(slot)
            slot.queued = True

    def _take(self, entries: int) -> TableSlot:
        """Grows the ring when all slots are busy, up to ``MAX_RING_SLOTS``; then waits for the oldest."""
        count = len(self.slots)
        for _ in range(count):
            slot = self.slots[self.next]
            self.next = (self.next + 1) % count
            if not slot.busy():
                return self._fitted(slot, entries)
        if count < MAX_RING_SLOTS:
            slot = self._make_slot(_table_entries(entries))
            self.slots.append(slot)
            return slot
        slot = self.slots[self.next]
        self.next = (self.next + 1) % count
        slot.wait()
        return self._fitted(slot, entries)

    def _fitted(self, slot: TableSlot, entries: int) -> TableSlot:
        if slot.entries >= entries:
            return slot
        index = self.slots.index(slot)
        self.slots[index] = self._make_slot(_table_entries(entries))
        return self.slots[index]


_RINGS: Final[dict[int, RowTableRing]] = {}


def _table_entries(entries: int) -> int:
    """Capacity for ``entries`` ids: a power of two, so a ring settles after a few growing batches."""
    size = MIN_TABLE_ENTRIES
    while size < entries:
        size *= 2
    return size


def row_ids(values: IndexVector, name: str, count: int, num_rows: int) -> npt.NDArray[np.int64]:
    """Row ids in ``[0, num_rows)`` as int64. The page store hands over int64 arrays (made once per run of copies,
    for all its pools): those are only range-checked, no copy. Anything else (a list too) takes the generic path,
    which refuses floats and bools like every other launcher (``np.fromiter`` truncated 1.5 to row 1)."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        ids = cast(npt.NDArray[np.int64], values)
    else:
        return index_vector(values, name, count, 0, num_rows)
    if int(ids.shape[0]) != count:
        raise ValueError(f"{name} must have {counted(count, 'entry', 'entries')}, got {int(ids.shape[0])}")
    check_range(ids, name, 0, num_rows)
    return ids


def pack_row_tables(
    table: npt.NDArray[np.int32], dst_ids: npt.NDArray[np.int64], src_ids: npt.NDArray[np.int64]
) -> None:
    """One upload carries both row tables: ``table[:n]`` the destination rows, ``table[n:2n]`` the source rows."""
    count = int(dst_ids.shape[0])
    table[:count] = dst_ids
    table[count : 2 * count] = src_ids


def copy_rows_mapped(
    dst_address: int,
    dst_num_rows: int,
    dst_rows: IndexVector,
    src_address: int,
    src_num_rows: int,
    src_rows: IndexVector,
    row_bytes: int,
) -> None:
    """Row ``dst_rows[i]`` at ``dst_address`` <- row ``src_rows[i]`` at ``src_address`` (rows of ``row_bytes``), in
    one ``page_copy_rows`` launch on the current CuPy stream; returns once it is queued.

    Addresses are device-visible (a device pool, or a pinned pool's mapped address); the two pools must not overlap.
    The caller keeps both pools alive, and the host away from a pinned side's bytes, until the stream got past it.
    """
    import cupy

    count = len(dst_rows)
    dst_ids = row_ids(dst_rows, "dst_rows", count, dst_num_rows)
    src_ids = row_ids(src_rows, "src_rows", count, src_num_rows)
    if count and int(np.max(np.bincount(dst_ids))) > 1:
        check_unique(dst_ids, "dst_rows")  # names the repeated row
    if count == 0:
        return
    device = int(cupy.cuda.Device().id)
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS.setdefault(device, RowTableRing())  # two threads here at once keep the same ring
    stream: Any = cupy.cuda.get_current_stream()
    grid, block = row_geometry(count, row_bytes)

    def launch(slot: RowTableSlot) -> None:
        pack_row_tables(slot.host, dst_ids, src_ids)
        table = device_address(slot.device)
        runtime: Any = cupy.cuda.runtime
        runtime.memcpyAsync(table, int(slot.host.ctypes.data), 8 * count, runtime.memcpyHostToDevice, stream.ptr)
        args = (np.uint64(dst_address), np.uint64(table), np.uint64(src_address), np.uint64(table + 4 * count),
                np.int64(row_bytes), np.int32(count))
        kernel("page_copy.cu", "page_copy_rows")(grid, block, args)
        slot.event.record(stream)

    ring.queue(2 * count, launch)
