"""Disk tier moves as positioned vector I/O (issue #41): one ``preadv`` / ``pwritev`` per run of consecutive file
slots, straight between the file and the other pool's rows.

Going through the pool file's mapping instead costs a NumPy gather into a temporary and a scatter (two copies) plus
a page fault per 4 KiB touched; positioned I/O copies once, in requests as large as the run of file slots (and
never faults on a hole: a write there fails with an error instead of SIGBUS). The kernel keeps the mapping and the
file coherent, so the mapped view stays valid.
"""

from __future__ import annotations

import errno
import os
from typing import Final

import numpy as np
import numpy.typing as npt

from ..kernels._checks import IndexVector, check_unique, index_vector, row_table

MAX_BUFFERS_PER_CALL: Final = 1024
"""Buffers per ``preadv`` / ``pwritev`` call (Linux's ``IOV_MAX``); a longer run takes several calls."""


def file_runs(file_ids: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], list[int]]:
    """The order that sorts ``file_ids`` and the bounds of its runs of consecutive ids (``bounds[k]:bounds[k+1]``
    of that order is one run, so one positioned call)."""
    order = np.argsort(file_ids, kind="stable")
    breaks = np.flatnonzero(np.diff(file_ids[order]) != 1) + 1
    return order, [0, *breaks.tolist(), int(file_ids.shape[0])]


def move_file_rows(
    fd: int,
    file_rows: IndexVector,
    file_num_rows: int,
    table: npt.NDArray[np.uint8],
    table_rows: IndexVector,
    to_file: bool,
    names: tuple[str, str] = ("file_rows", "table_rows"),
) -> None:
    """Row ``file_rows[i]`` of the file (rows as wide as ``table``'s) <-> row ``table_rows[i]`` of ``table``, written
    to the file when ``to_file``, else read from it; ``names`` are the two row arguments' names in errors. Checks
    everything before the first call (destination rows must not repeat); an I/O error (or a short transfer) raises
    ``OSError`` with the file offset."""
    table_num_rows, row_bytes = row_table(table, "table")
    count = len(file_rows)
    file_ids = index_vector(file_rows, names[0], count, 0, file_num_rows)
    table_ids = index_vector(table_rows, names[1], count, 0, table_num_rows)
    if to_file:
        check_unique(file_ids, names[0])
    else:
        check_unique(table_ids, names[1])
    order, bounds = file_runs(file_ids)
    file_sorted = file_ids[order].tolist()
    table_sorted = table_ids[order].tolist()
    for run in range(len(bounds) - 1):
        for first in range(bounds[run], bounds[run + 1], MAX_BUFFERS_PER_CALL):
            last = min(bounds[run + 1], first + MAX_BUFFERS_PER_CALL)
            buffers = [table[row] for row in table_sorted[first:last]]
            offset = file_sorted[first] * row_bytes
            if to_file:
                done = os.pwritev(fd, buffers, offset)
            else:
                done = os.preadv(fd, buffers, offset)
            if done != (last - first) * row_bytes:
                verb = "wrote" if to_file else "read"
                raise OSError(errno.EIO, f"disk tier: {verb} {done} of {(last - first) * row_bytes} bytes at {offset}")
