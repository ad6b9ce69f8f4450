"""The slot allocator: O(1) allocate/release, grow and shrink only over free slots."""

from __future__ import annotations

from kv_cache_manager_v2._storage.slots import SlotAllocator
from kv_cache_manager_v2._base.types import SlotId


def test_allocates_lowest_first_then_reuses_released() -> None:
    allocator = SlotAllocator(3)
    assert [allocator.allocate() for _ in range(4)] == [0, 1, 2, -1]
    allocator.release(SlotId(1))
    assert allocator.num_free == 1 and allocator.allocate() == 1


def test_grow_and_shrink() -> None:
    allocator = SlotAllocator(4)
    taken = [allocator.allocate(), allocator.allocate()]
    assert taken == [0, 1]
    assert allocator.resize(6) and allocator.num_slots == 6 and allocator.num_free == 4
    assert allocator.resize(2) and allocator.num_free == 0
    assert not allocator.resize(1)  # slot 1 is in use
    assert allocator.num_slots == 2
    allocator.release(SlotId(1))
    assert allocator.resize(1) and allocator.allocate() == -1
    assert allocator.num_used == 1
