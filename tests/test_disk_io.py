"""Disk tier moves by positioned vector I/O (issue #41): one ``preadv`` / ``pwritev`` per run of consecutive file
slots between the pool file and the other host-side pool, coherent with the file's mapped view; runs longer than
one call's buffer limit, scattered slots, repeated sources, and bad rows refused before any byte moves."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2._storage.disk_io import MAX_BUFFERS_PER_CALL, file_runs
from kv_cache_manager_v2._storage.memory import DiskPoolMemory, HostPoolMemory, copy_rows

ROW = 48  # not a power of two


def pools(tmp_path: Path, rows: int) -> tuple[HostPoolMemory, DiskPoolMemory]:
    host, disk = HostPoolMemory(rows * ROW), DiskPoolMemory(rows * ROW, str(tmp_path / "tier.pool"))
    assert disk.reserve(rows * ROW)
    return host, disk


def table(memory: HostPoolMemory) -> npt.NDArray[np.uint8]:
    return memory.host_array().reshape(-1, ROW)


def test_runs_are_the_consecutive_stretches_of_the_sorted_file_rows() -> None:
    order, bounds = file_runs(np.array([7, 2, 3, 9, 4, 8], dtype=np.int64))
    assert order.tolist() == [1, 2, 4, 0, 5, 3]  # file rows 2, 3, 4, 7, 8, 9
    assert bounds == [0, 3, 6]
    assert file_runs(np.array([5, 5], dtype=np.int64))[1] == [0, 1, 2]  # a repeated source row starts a new run


def test_pages_go_to_the_file_and_come_back_with_their_bytes(tmp_path: Path) -> None:
    rows = 3 * MAX_BUFFERS_PER_CALL
    host, disk = pools(tmp_path, rows)
    rng = np.random.default_rng(1)
    content = rng.integers(0, 256, (rows, ROW), dtype=np.uint8)
    table(host)[...] = content
    long_run = list(range(10, 10 + 2 * MAX_BUFFERS_PER_CALL + 7))  # three calls for one run
    scattered = [int(r) for r in rng.choice(np.arange(2100, rows), 300, replace=False)]
    file_rows = long_run + scattered
    host_rows = [int(r) for r in rng.permutation(rows)[: len(file_rows)]]
    copy_rows(disk, file_rows, host, host_rows, ROW)
    mapped = table(disk)  # the file's mapping sees what the positioned writes put there
    assert np.array_equal(mapped[file_rows], content[host_rows])
    untouched = np.setdiff1d(np.arange(rows), file_rows)
    assert not mapped[untouched].any()
    table(host)[...] = 0
    back = [int(r) for r in rng.permutation(rows)[: len(file_rows)]]
    copy_rows(host, np.array(back, dtype=np.int64), disk, np.array(file_rows, dtype=np.int64), ROW)
    assert np.array_equal(table(host)[back], content[host_rows])
    assert not table(host)[np.setdiff1d(np.arange(rows), back)].any()


def test_one_file_row_read_into_several_host_rows(tmp_path: Path) -> None:
    host, disk = pools(tmp_path, 8)
    table(disk)[3] = 7
    table(disk)[4] = 9
    copy_rows(host, [0, 5, 6], disk, [3, 4, 3], ROW)
    assert table(host)[[0, 6]].tolist() == [[7] * ROW] * 2 and np.all(table(host)[5] == 9)


def test_bad_rows_are_refused_before_any_byte_moves(tmp_path: Path) -> None:
    host, disk = pools(tmp_path, 8)
    table(host)[...] = 1
    with pytest.raises(ValueError, match=r"dst_rows\[1\] = 8 is outside \[0, 8\)"):
        copy_rows(disk, [0, 8], host, [0, 1], ROW)
    with pytest.raises(ValueError, match="dst_rows names 2 more than once"):
        copy_rows(disk, [2, 2], host, [0, 1], ROW)
    with pytest.raises(ValueError, match=r"src_rows\[0\] = -1"):
        copy_rows(disk, [0, 1], host, [-1, 1], ROW)
    with pytest.raises(ValueError, match="dst_rows names 3 more than once"):
        copy_rows(host, [3, 3], disk, [0, 1], ROW)
    assert not table(disk).any() and np.all(table(host) == 1)


def test_a_copy_between_disk_slots_reads_every_source_before_writing(tmp_path: Path) -> None:
    _, disk = pools(tmp_path, 8)
    content = np.random.default_rng(3).integers(0, 256, (8, ROW), dtype=np.uint8)
    table(disk)[...] = content
    copy_rows(disk, [1, 2, 3], disk, [0, 1, 2], ROW)  # compaction-like, overlapping rows
    assert np.array_equal(table(disk)[[1, 2, 3]], content[[0, 1, 2]])
    with pytest.raises(ValueError, match=r"dst_rows\[0\] = 9"):
        copy_rows(disk, [9], disk, [0], ROW)
    assert np.array_equal(table(disk)[[1, 2, 3]], content[[0, 1, 2]])


def test_a_copy_between_disk_slots_of_a_file_cut_short_is_an_os_error_not_a_sigbus(tmp_path: Path) -> None:
    """Through the file's mapping, reading past a cut file's end kills the process (SIGBUS); by positioned I/O it
    is a short read, an ``OSError`` the page store turns into lost pages."""
    _, disk = pools(tmp_path, 256)  # rows past the first 4 KiB page, which a cut file no longer backs
    pool_file = str(tmp_path / "tier.pool")
    [descriptor, *_] = [name for name in os.listdir("/proc/self/fd") if _points_at(name, pool_file)]
    cutter = os.open(f"/proc/self/fd/{descriptor}", os.O_RDWR)
    try:
        os.ftruncate(cutter, 2 * ROW)
        with pytest.raises(OSError, match="read 0 of"):
            copy_rows(disk, [0], disk, [200], ROW)
        os.ftruncate(cutter, 256 * ROW)
    finally:
        os.close(cutter)
    disk.close()


def _points_at(descriptor: str, path: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{descriptor}").startswith(path)
    except OSError:
        return False
