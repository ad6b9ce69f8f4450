"""Row ids as the page store hands them over (int64 arrays, made once per run of copies; issue #41): the host side
of a device <-> pinned move uses them without a per-page conversion, bad ids are refused the same way whatever
their container, and a copy within one pool whose rows overlap still reads every source before writing; two
threads (two managers on one device) never fill the same row-table buffer. Runs without a GPU: ``row_ids`` and
``pack_row_tables`` are plain NumPy, and the ring of row-table buffers takes a stand-in for its CUDA slots."""

from __future__ import annotations

import threading
from array import array

import numpy as np
import pytest

from kv_cache_manager_v2._storage.memory import HostPoolMemory, copy_rows
from kv_cache_manager_v2.kernels._checks import IndexVector
from kv_cache_manager_v2.kernels.mapped_copy import RowTableRing, pack_row_tables, row_ids


def test_an_int64_array_of_row_ids_is_used_as_it_is() -> None:
    ids = np.array([5, 0, 3], dtype=np.int64)
    assert row_ids(ids, "dst_rows", 3, 8) is ids  # no copy: one per pool and page was the launch's main cost


@pytest.mark.parametrize("kind", ["list", "int64", "int32", "array"])
def test_every_container_gives_the_same_ids_and_packs_both_tables(kind: str) -> None:
    values = [7, 2, 0, 5]
    containers: dict[str, IndexVector] = {
        "list": values,
        "int64": np.array(values, dtype=np.int64),
        "int32": np.array(values, dtype=np.int32),
        "array": array("q", values),
    }
    given = containers[kind]
    dst = row_ids(given, "dst_rows", 4, 8)
    assert dst.dtype == np.int64 and dst.tolist() == values
    table = np.full(8, -1, dtype=np.int32)
    pack_row_tables(table, dst, np.arange(4, dtype=np.int64))
    assert table.tolist() == [7, 2, 0, 5, 0, 1, 2, 3]


@pytest.mark.parametrize("as_array", [False, True])
def test_bad_row_ids_are_refused_naming_the_argument(as_array: bool) -> None:
    def ids(values: list[int]) -> IndexVector:
        return np.array(values, dtype=np.int64) if as_array else values

    with pytest.raises(ValueError, match=r"src_rows\[1\] = 8 is outside \[0, 8\)"):
        row_ids(ids([0, 8]), "src_rows", 2, 8)
    with pytest.raises(ValueError, match=r"src_rows\[0\] = -1"):
        row_ids(ids([-1, 2]), "src_rows", 2, 8)
    with pytest.raises(ValueError, match="dst_rows must have 3 entries, got 2"):
        row_ids(ids([0, 1]), "dst_rows", 3, 8)


@pytest.mark.parametrize("as_array", [False, True])
@pytest.mark.parametrize("bad", [[0, 1.5], [True, False]])
def test_row_ids_that_are_not_integers_are_refused_in_any_container(as_array: bool, bad: list[float]) -> None:
    # A list of floats became rows [0, 1] through np.fromiter (a page copied from or to the wrong row), where an
    # array of the same values, and every other launcher's ids, were refused.
    given: IndexVector = np.array(bad) if as_array else bad  # type: ignore[assignment]
    with pytest.raises(TypeError, match="src_rows must hold integers"):
        row_ids(given, "src_rows", 2, 8)


def test_a_two_dimensional_array_is_refused() -> None:
    with pytest.raises(ValueError, match="dst_rows must be 1-D"):
        row_ids(np.zeros((2, 1), dtype=np.int64), "dst_rows", 2, 8)


def test_an_overlapping_copy_within_one_pool_given_arrays_reads_every_source_first() -> None:
    pool = HostPoolMemory(4 * 8)
    rows = pool.host_array().reshape(4, 8)
    rows[...] = np.arange(4, dtype=np.uint8)[:, None]
    copy_rows(pool, np.array([1, 2, 3], dtype=np.int64), pool, np.array([0, 1, 2], dtype=np.int64), 8)
    assert rows[:, 0].tolist() == [0, 0, 1, 2]


class StandInSlot:
    """A row-table slot without a GPU: busy from its launch (``recorded``, as the CUDA event's record) until done."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.queued = False
        self.done = True

    def recorded(self) -> None:
        self.done = False

    def busy(self) -> bool:
        return self.queued and not self.done

    def wait(self) -> None:
        self.done = True


def test_two_threads_never_fill_the_same_row_table_buffer() -> None:
    ring = RowTableRing(StandInSlot)
    ring.queue(4, lambda slot: None)  # one slot, free again (its work done)
    used: dict[str, StandInSlot] = {}
    first_inside = threading.Event()

    def second_move() -> None:
        assert first_inside.wait(5)
        ring.queue(4, lambda slot: used.setdefault("second", slot).recorded())

    second = threading.Thread(target=second_move)
    second.start()

    def first_launch(slot: StandInSlot) -> None:
        used["first"] = slot
        first_inside.set()
        second.join(0.5)  # the second move takes its slot now unless it must wait for this one to be queued
        slot.recorded()

    ring.queue(4, first_launch)
    second.join(5)
    assert used["first"] is not used["second"], "two moves filled the same row-table buffer at once"
