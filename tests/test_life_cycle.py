"""Stale and scratch range formulas, table-driven; the blocks a step reads; life-cycle grouping; the life cycle a
priority callback is handed cannot be changed."""

from __future__ import annotations

from typing import Callable

import pytest

from kv_cache_manager_v2 import KVCacheManager, Priority
from kv_cache_manager_v2._model.life_cycle import NO_WINDOW, LifeCycle, LifeCycleRegistry, scratch_range, stale_range
from kv_cache_manager_v2.config import LayerConfig
from tests.helpers import attention, make_config, ssm

TPB = 32


@pytest.mark.parametrize(
    ("history", "window", "sink_blocks", "expected"),
    [
        (0, NO_WINDOW, 0, (0, 0)),
        (5000, NO_WINDOW, 0, (0, 0)),
        (0, 128, 0, (0, 0)),
        (127, 128, 0, (0, 0)),  # live window [0, 127]
        (160, 128, 0, (0, 1)),  # live window [33, 160]: block 0 (tokens 0..31) is out
        (1024, 128, 0, (0, 28)),  # the scratch headline: (1025 - 128) // 32 = 28
        (1000, 128, 1, (1, 27)),  # a sink block is never stale
        (10, 128, 1, (1, 1)),
        (0, 128, 2, (0, 0)),  # no history yet: start = min(ceil(0/32), 2) = 0
        (40, 8, 2, (2, 2)),  # ceil(40/32) = 2 sink blocks already, (41 - 8) // 32 = 1 -> empty
        (100, 8, 2, (2, 2)),  # (101-8)//32 = 2 -> still empty
        (200, 8, 2, (2, 6)),
    ],
)
def test_stale_range(history: int, window: int, sink_blocks: int, expected: tuple[int, int]) -> None:
    assert stale_range(history, TPB, window, sink_blocks) == expected


@pytest.mark.parametrize(
    ("history", "capacity", "rewind", "window", "expected"),
    [
        (0, 1024, 0, 128, (0, 28)),  # the scratch headline: a 1,024-token chunk, window 128
        (0, 1024, 0, NO_WINDOW, (0, 0)),
        (0, 100, 0, 128, (0, 0)),
        (1024, 2048, 0, 128, (32, 60)),  # second chunk starts at block 32
        (1000, 2048, 0, 128, (32, 60)),  # unaligned history: block 31 still holds history
        (0, 1024, 64, 128, (0, 26)),  # rewind keeps two more blocks alive
        (0, 150, 0, 128, (0, 0)),
    ],
)
def test_scratch_range(history: int, capacity: int, rewind: int, window: int, expected: tuple[int, int]) -> None:
    beg, end = scratch_range(history, capacity, rewind, TPB, window, 0)
    assert (beg, end) == expected or (beg == end and expected[0] == expected[1])


def test_life_cycles_keyed_by_window_and_sink_blocks() -> None:
    layers: list[LayerConfig] = [
        attention(0),
        attention(1, window=128),
        attention(2, window=128, sinks=4),
        attention(3, window=128, sinks=30),  # 4 and 30 tokens are both one sink block
        ssm(4),
        attention(5),
        attention(6, window=256),
        ssm(7),
    ]
    registry = LifeCycleRegistry(layers, TPB)
    assert [lc.layer_ids for lc in registry.life_cycles] == [(0, 5), (1,), (2, 3), (4, 7), (6,)]
    assert [lc.describe() for lc in registry.life_cycles] == [
        "full attention",
        "sliding window 128",
        "sliding window 128, 1 sink block",
        "ssm",
        "sliding window 256",
    ]
    with pytest.raises(ValueError, match="unknown layer_id 99"):
        registry.of_layer(99)


@pytest.mark.parametrize(("sinks", "words"), [(4, "1 sink block"), (33, "2 sink blocks")])
def test_a_window_counts_its_sink_blocks_in_english(sinks: int, words: str) -> None:
    """Before: "sliding window 128, 1 sink block(s)" (and "2 sink block(s)")."""
    registry = LifeCycleRegistry([attention(0, window=128, sinks=sinks)], TPB)
    assert registry.life_cycles[0].describe() == f"sliding window 128, {words}"


def test_pages_needed_counts_only_live_blocks() -> None:
    registry = LifeCycleRegistry([attention(0), attention(1, window=128), ssm(2)], TPB)
    full, window, state = registry.life_cycles
    assert full.pages_needed(1024, 1023) == 32
    assert window.pages_needed(1024, 1023) == 32 - 28  # stale [0, (1023 + 1 - 128) // 32) = [0, 28)
    assert state.pages_needed(10**6, 10**6 - 1) == 1


def _kinds() -> list[LifeCycle]:
    """Full attention, a 64-token window with one sink block, SSM (tpb 32)."""
    return LifeCycleRegistry([attention(0), attention(1, window=64, sinks=TPB), ssm(2)], TPB).life_cycles


@pytest.mark.parametrize(
    ("kind", "history", "expected"),
    [
        (0, 0, ((0, 0), (0, 0))),
        (0, 100, ((0, 0), (0, 4))),  # every block, the partial last one included
        (1, 100, ((0, 1), (1, 4))),  # window [37, 100]: block 1 (32..63) is still in it
        (1, 256, ((0, 1), (6, 8))),  # window [193, 256]: the sink block and blocks 6, 7
        (2, 0, ()),  # an empty prefix needs no snapshot
        (2, 256, ((7, 8),)),  # the snapshot on the block ending at 256
        (2, 100, None),  # inside a block: no snapshot holds that state
    ],
)
def test_read_runs(kind: int, history: int, expected: tuple[tuple[int, int], ...] | None) -> None:
    assert _kinds()[kind].read_runs(history) == expected


def test_reads_block_is_read_runs() -> None:
    full, window, state = _kinds()
    assert [o for o in range(8) if full.reads_block(o, 256)] == list(range(8))
    assert [o for o in range(8) if window.reads_block(o, 256)] == [0, 6, 7]
    assert [o for o in range(8) if state.reads_block(o, 256)] == [7]
    assert not any(state.reads_block(o, 250) for o in range(8))


@pytest.mark.parametrize(
    ("kind", "present", "length", "expected"),
    [
        (1, [0, 6, 7], 256, True),  # the gap [1, 6) is stale: not needed
        (1, [1, 2, 3, 4, 5, 6, 7], 256, False),  # the sink block is missing
        (1, [0, 6], 256, False),  # the window's last block is missing
        (0, [0, 1, 2, 3, 4, 5, 7], 256, False),  # full attention needs every block
        (2, [7], 256, True),
        (2, [0, 1, 2, 3, 4, 5, 6], 256, False),  # no snapshot at the end
        (2, [0, 1, 2, 3, 4, 5, 6, 7], 250, False),  # not on a block boundary
        (2, [], 0, True),
    ],
)
def test_servable_follows_read_runs(kind: int, present: list[int], length: int, expected: bool) -> None:
    counts = [0]
    for ordinal in range(8):
        counts.append(counts[-1] + (1 if ordinal in present else 0))
    assert _kinds()[kind].servable(length, counts) is expected


MUTATIONS: dict[str, Callable[[LifeCycle], object]] = {
    "id": lambda life_cycle: setattr(life_cycle, "id", 1),
    "tokens_per_block": lambda life_cycle: setattr(life_cycle, "tokens_per_block", 1),
    "layer_ids": lambda life_cycle: setattr(life_cycle, "layer_ids", ()),
    "layer_ids.clear": lambda life_cycle: getattr(life_cycle.layer_ids, "clear")(),
    "layer_ids.append": lambda life_cycle: getattr(life_cycle.layer_ids, "append")(5),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_priority_callback_cannot_change_the_life_cycle_it_is_given(mutation: str) -> None:
    """The callback gets the manager's own ``LifeCycle``: ``layer_ids.clear()`` emptied ``layer_grouping``
    ([[0], [1]] became [[], []]) and ``tokens_per_block = 1`` changed every later stale range, the call going on as
    if nothing happened. Each assignment now raises ``AttributeError``, which fails the call with nothing changed."""
    manager = KVCacheManager(make_config([attention(0, window=2 * TPB), attention(1)], tokens_per_block=TPB))
    grouping = manager.layer_grouping

    def mutate(ordinal: int, life_cycle: LifeCycle) -> Priority:
        MUTATIONS[mutation](life_cycle)
        return Priority(35)

    cache = manager.create_kv_cache(custom_priority_callback=mutate)
    assert cache.resume()
    with pytest.raises(AttributeError):
        cache.resize(4 * TPB)
    assert cache.capacity == 0 and manager.layer_grouping == grouping == [[0], [1]]
    manager.check_invariants()
    cache.close()
    other = manager.create_kv_cache()
    assert other.resume() and other.resize(4 * TPB)
    other.commit(list(range(4 * TPB)))
    assert other.resize(4 * TPB + 1)  # the window's stale blocks, in the manager's block size
    pages = list(other.get_base_page_indices(0))
    assert pages[:2] == [-1, -1] and -1 not in pages[2:], pages
    other.close()
    manager.check_invariants()
    manager.shutdown()
