"""Partial coverage of a tree block (issue #37): a page records how many of its block's tokens it holds; with partial
reuse and no SSM layers a partial block's pages join a sibling extending its tokens, the widest page of each life
cycle stays, and a page holding fewer tokens than its block serves only matches ending within them."""

from __future__ import annotations

from collections import Counter

from kv_cache_manager_v2 import KVCacheManager, _introspection
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import attention, make_config

TPB = 32
FULL, SWA = 0, 1  # layer groups: full attention first, then the 16-token window


def _manager(window: int = 16, kv_events: bool = False) -> tuple[KVCacheManager, FakeEngine]:
    config = make_config(
        [attention(0), attention(1, window=window)], enable_partial_reuse=True, commit_min_snapshot=True,
        enable_kv_events=kv_events,
    )
    manager = KVCacheManager(config)
    return manager, FakeEngine(manager)


def _computed_turn(manager: KVCacheManager, engine: FakeEngine, tokens: list[int]) -> int:
    """Reuse, compute the rest (the engine checks every reused row it reads), commit, close; returns the reuse."""
    cache = manager.create_kv_cache(None, tokens)
    reused = cache.num_committed_tokens
    assert cache.resume() and cache.resize(len(tokens))
    engine.step(cache, tokens)
    cache.commit(tokens[reused:])
    cache.close()
    return reused


def _declared_turn(manager: KVCacheManager, tokens: list[int]) -> int:
    """A turn whose history the engine declares up front (``resize(n, n)``): the out-of-window pages a resize makes
    stale are freed (``commit_min_snapshot``), so the committed blocks lack them."""
    cache = manager.create_kv_cache(None, tokens)
    reused = cache.num_committed_tokens
    assert cache.resume() and cache.resize(len(tokens), len(tokens))
    cache.commit(tokens[reused:])
    cache.close()
    return reused


def _chunked_turn(manager: KVCacheManager, engine: FakeEngine, tokens: list[int], chunk: int) -> None:
    """Compute ``tokens`` in chunks, each resize declaring the previous chunks history, and commit them at the end:
    the window pages a resize makes stale before their block is committed are freed (``commit_min_snapshot``)."""
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume()
    for end in range(chunk, len(tokens) + chunk, chunk):
        assert cache.resize(min(end, len(tokens)), end - chunk)
        engine.step(cache, tokens)
    cache.commit(tokens[cache.num_committed_tokens :])
    cache.close()


def _tail_coverage(manager: KVCacheManager, tokens: list[int], group: int) -> int:
    """Tokens held by ``group``'s page on the last tree block matching ``tokens`` (0 without one)."""
    _, pages = _introspection.reuse_match_pages(manager, None, tokens, group, True)
    assert pages
    return 0 if pages[-1] is None else int(pages[-1][1] or 0)


def _all_slots_free(manager: KVCacheManager) -> bool:
    manager.clear_reusable_blocks()
    return all(stats.free == stats.total for stats in manager.get_storage_statistics())


BASE = list(range(80))  # two full blocks and 16 tokens of the third
EXTENDED = BASE + list(range(1000, 1080))


def test_a_longer_sibling_takes_the_window_page_of_the_partial_block_it_extends() -> None:
    manager, engine = _manager()
    assert _computed_turn(manager, engine, BASE) == 0
    assert _declared_turn(manager, EXTENDED) == 80  # block 2 is stale at 160: committed without its window page
    rewind = BASE + [2000]
    assert _tail_coverage(manager, rewind, FULL) == TPB  # one block 2, holding its own full-attention page
    assert _tail_coverage(manager, rewind, SWA) == 16  # and the partial block's window page
    assert manager.probe_reuse(None, rewind) == 80
    assert manager.probe_reuse(None, EXTENDED) == 160
    # The 16 window rows come from the moved page: the engine checks them.
    assert _computed_turn(manager, engine, BASE + list(range(3000, 3040))) == 80
    assert _all_slots_free(manager)


def test_a_partial_block_published_after_its_longer_sibling_joins_it() -> None:
    manager, engine = _manager()
    _chunked_turn(manager, engine, EXTENDED, TPB)
    assert _tail_coverage(manager, BASE + [2000], SWA) == 0  # block 2 lost its window page to the chunks
    assert _computed_turn(manager, engine, BASE) == 0  # no window page along the extended prompt's blocks
    assert _tail_coverage(manager, BASE + [2000], SWA) == 16
    assert manager.probe_reuse(None, BASE + [2000]) == 80
    assert _computed_turn(manager, engine, BASE + list(range(3000, 3040))) == 80


def test_a_page_holding_part_of_its_block_never_serves_a_match_passing_it() -> None:
    manager, engine = _manager()
    _computed_turn(manager, engine, BASE)
    _declared_turn(manager, EXTENDED)
    # At 100 tokens the window reads all of block 2, whose window page holds 16 tokens: the match ends there.
    request = EXTENDED[:100]
    assert manager.probe_reuse(None, request) == 80
    assert _computed_turn(manager, engine, request) == 80


def test_the_widest_page_of_a_life_cycle_stays() -> None:
    manager, engine = _manager()
    longer = BASE + list(range(1000, 1008))  # 24 tokens of block 2
    _computed_turn(manager, engine, BASE)
    assert _computed_turn(manager, engine, longer) == 80
    assert _tail_coverage(manager, BASE + [2000], SWA) == 24  # the 24-token pages replaced the 16-token ones
    assert manager.probe_reuse(None, longer + [2000]) == 88
    assert _computed_turn(manager, engine, BASE) == 80  # a narrower page published later does not replace it
    assert _tail_coverage(manager, BASE + [2000], SWA) == 24
    assert _computed_turn(manager, engine, longer + [2000]) == 88
    assert _all_slots_free(manager)


def test_stop_committing_publishes_the_trailing_partial_block() -> None:
    manager, engine = _manager()
    first = list(range(72))
    owner = manager.create_kv_cache(None, first)
    assert owner.resume() and owner.resize(len(first))
    engine.step(owner, first)
    owner.commit(first, is_end=True)
    assert _introspection.committed_page_is_linked(owner, 2, FULL) is True
    assert manager.probe_reuse(None, first + [500]) == 72  # reusable while the owner stays open
    assert _computed_turn(manager, engine, list(range(80))) == 72
    # The 16-token block took the place of the 8-token one: the owner's page left the tree, the owner keeps it.
    assert _introspection.committed_page_is_linked(owner, 2, FULL) is False
    owner.close()
    assert manager.probe_reuse(None, first + [500]) == 72
    assert _all_slots_free(manager)


def test_a_reused_partial_page_that_gave_way_is_freed_with_its_holder() -> None:
    manager, engine = _manager()
    short = list(range(72))
    _computed_turn(manager, engine, short)
    holder = manager.create_kv_cache(None, short)  # holds the 8-token pages, not resumed
    assert holder.num_committed_tokens == 72
    assert _introspection.committed_page_is_linked(holder, 2, FULL) is True
    assert _computed_turn(manager, engine, list(range(80))) == 72
    assert _introspection.committed_page_is_linked(holder, 2, FULL) is False
    holder.close()
    assert _all_slots_free(manager)


def test_kv_events_describe_only_pages_holding_their_whole_block() -> None:
    manager, engine = _manager(kv_events=True)
    _computed_turn(manager, engine, BASE)
    _declared_turn(manager, EXTENDED)
    events = manager.get_latest_events()
    block_2 = tuple(EXTENDED[2 * TPB : 3 * TPB])
    assert not [e for e in events if e.kind == "stored" and e.layer_group_id == SWA and e.tokens == block_2]
    manager.clear_reusable_blocks()
    events += manager.get_latest_events()
    cached: Counter[tuple[int, bytes]] = Counter()
    for event in events:  # every removal follows its store, and nothing stays stored once the tree is empty
        if event.kind != "updated":
            cached[(event.layer_group_id, event.block_hash)] += 1 if event.kind == "stored" else -1
            assert cached[(event.layer_group_id, event.block_hash)] in (0, 1)
    assert set(cached.values()) == {0}


def test_a_match_stepping_back_from_a_pageless_block_copies_from_a_sibling() -> None:
    # Found by the eviction-model helper: behind a block with no pages that an open cache keeps in the tree, the
    # match walked into that block, stepped back whole blocks and never tried a sibling holding the first rows
    # of the request's block there; the request reused 4 tokens instead of 6.
    manager = KVCacheManager(make_config([attention(0, 256, window=8, sinks=4)], tokens_per_block=4))
    engine = FakeEngine(manager)
    prefix = [1, 2, 3, 4]  # block 0: the sink block, never dropped
    lived = prefix + [10, 11, 30, 31] + list(range(40, 52))
    live = manager.create_kv_cache(None, lived)
    assert live.resume() and live.resize(len(lived), 0)
    engine.step(live, lived)
    live.commit(lived)  # its window passed block 1 (10, 11, 30, 31): released, still cached
    turn = manager.create_kv_cache(None, lived[:8])
    assert turn.resume()
    turn.stop_committing()
    plan = turn.plan_committed_block_drop()
    turn.close()
    assert plan is not None
    plan.drop()  # block 1 loses its page; `live` keeps it in the tree
    assert _introspection.reuse_match_pages(manager, None, lived[:8], 0) == (8, [(0, 4), None])
    assert _computed_turn(manager, engine, prefix + [10, 11, 12, 13, 20, 21, 22, 23]) == 4  # the sibling
    request = prefix + [10, 11, 30, 31, 77, 78, 79, 80]
    assert manager.probe_reuse(None, request) == 6
    assert _computed_turn(manager, engine, request) == 6  # the engine checks the rows copied from the sibling
    live.close()
