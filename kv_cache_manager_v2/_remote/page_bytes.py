"""A page's bytes as the remote tier moves them: every pool of its slot, one row each, in one host buffer.

Device rows are copied through the host (the caller holds ``StreamOrder.host_access``); disk tier rows are read and
written by positioned I/O, so a cut or failing file raises ``OSError`` instead of a SIGBUS.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .._base.remote_store import HostBuffer
from .._storage.memory import DiskPoolMemory, PoolMemory, rows_view


def read_slot(pools: Sequence[PoolMemory], row_bytes: Sequence[int], slot: int) -> HostBuffer:
    """Slot ``slot``'s row of every pool in a row (``row_bytes`` per pool); ``OSError`` when a disk file fails."""
    parts: list[HostBuffer] = []
    for memory, size in zip(pools, row_bytes):
        if isinstance(memory, DiskPoolMemory):
            row: HostBuffer = np.empty((1, size), dtype=np.uint8)
            memory.move_rows([slot], row, [0], False, ("slot", "row"))
            parts.append(row[0])
        else:
            parts.append(_row(rows_view(memory, size, memory.nbytes // size), slot))
    return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()


def write_slot(pools: Sequence[PoolMemory], row_bytes: Sequence[int], slot: int, payload: HostBuffer) -> None:
    """Write ``payload`` (``read_slot``'s layout) into slot ``slot``; ``OSError`` when a disk file fails."""
    offset = 0
    for memory, size in zip(pools, row_bytes):
        part = payload[offset : offset + size]
        offset += size
        if isinstance(memory, DiskPoolMemory):
            memory.move_rows([slot], part.reshape(1, size), [0], True, ("slot", "row"))
            continue
        table = rows_view(memory, size, memory.nbytes // size)
        if isinstance(table, np.ndarray):
            table[slot] = part
        else:
            import cupy

            device: Any = table
            device[slot] = cupy.asarray(part)


def _row(table: object, slot: int) -> HostBuffer:
    """One slot's row as host bytes (a device row is copied to the host)."""
    if isinstance(table, np.ndarray):
        row: HostBuffer = table[slot]
        return row
    import cupy

    device: Any = table
    host: HostBuffer = cupy.asnumpy(device[slot])
    return host
