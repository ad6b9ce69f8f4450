"""``plan_committed_block_drop``: an expired turn's sliding-window blocks (and SSM endpoint snapshot) dropped on
demand, while full-attention and sink blocks stay reusable for any request sharing the prefix."""

from __future__ import annotations

import gc

import pytest

from kv_cache_manager_v2 import KVCache, KVCacheManager, _introspection
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import attention, compute_prompt, make_config, ssm

TPB = 8
WINDOW = 8


def swa_manager(sinks: int | None = None) -> KVCacheManager:
    layers: list[LayerConfig] = [attention(0, window=WINDOW, sinks=sinks), attention(1)]
    return KVCacheManager(make_config(layers, tokens_per_block=TPB))


def finished_turn(manager: KVCacheManager, tokens: list[int]) -> KVCache:
    cache = compute_prompt(manager, FakeEngine(manager), tokens)
    cache.stop_committing()
    return cache


def test_drop_removes_the_window_blocks_and_keeps_full_attention() -> None:
    manager = swa_manager()
    long_tokens = list(range(100, 124))
    short_tokens = long_tokens[:8]
    long_cache = finished_turn(manager, long_tokens)
    long_handle = long_cache.plan_committed_block_drop()
    long_cache.close()
    short_cache = finished_turn(manager, short_tokens)
    short_handle = short_cache.plan_committed_block_drop()
    short_cache.close()
    assert long_handle is not None and short_handle is not None
    assert manager.probe_reuse(None, short_tokens) == 8
    short_handle.drop()
    assert manager.probe_reuse(None, short_tokens) == 0
    assert manager.probe_reuse(None, long_tokens) == 24  # block 0 is out of the long turn's window
    long_handle.drop()
    assert manager.probe_reuse(None, long_tokens) == 24 - WINDOW
    with pytest.raises(RuntimeError, match="already been dropped"):
        long_handle.drop()


def test_sink_blocks_are_never_planned() -> None:
    manager = swa_manager(sinks=TPB)
    tokens = list(range(40))
    cache = finished_turn(manager, tokens)
    handle = cache.plan_committed_block_drop()
    cache.close()
    assert handle is not None
    before = manager.get_storage_statistics()
    handle.drop()
    after = manager.get_storage_statistics()
    swa_group = manager.get_pool_group_index(manager.get_layer_group_id(0))
    assert after[swa_group].free - before[swa_group].free == 1  # block 4 only: the window, not the sink block 0


def test_pages_a_cache_uses_again_are_kept() -> None:
    manager = swa_manager()
    tokens = list(range(24))
    cache = finished_turn(manager, tokens)
    handle = cache.plan_committed_block_drop()
    cache.close()
    assert handle is not None
    user = manager.create_kv_cache(None, tokens + [7])
    assert user.resume()
    handle.drop()
    user.close()
    assert manager.probe_reuse(None, tokens) == 24


def test_a_forgotten_handle_applies_its_plan() -> None:
    manager = swa_manager()
    tokens = list(range(16))
    cache = finished_turn(manager, tokens)
    handle = cache.plan_committed_block_drop()
    cache.close()
    assert handle is not None
    assert manager.probe_reuse(None, tokens) == 16
    del handle
    gc.collect()
    assert manager.probe_reuse(None, tokens) == 16 - WINDOW


def test_planning_needs_stop_committing_and_something_committed() -> None:
    manager = swa_manager()
    cache = compute_prompt(manager, FakeEngine(manager), list(range(16)))
    with pytest.raises(RuntimeError, match="stop_committing"):
        cache.plan_committed_block_drop()
    cache.close()
    empty = manager.create_kv_cache(None, [1, 2, 3])
    empty.stop_committing()
    assert empty.plan_committed_block_drop() is None
    empty.close()
    with pytest.raises(ValueError, match="closed"):
        empty.plan_committed_block_drop()


def test_the_turn_end_snapshot_goes_with_the_last_plan_naming_it() -> None:
    layers: list[LayerConfig] = [ssm(0), attention(1)]
    manager = KVCacheManager(make_config(layers, tokens_per_block=TPB, commit_min_snapshot=True))
    tokens = list(range(4 * TPB))
    cache = compute_prompt(manager, FakeEngine(manager), tokens, stops=(2 * TPB,))
    cache.stop_committing()
    first, second = cache.plan_committed_block_drop(), cache.plan_committed_block_drop()
    cache.close()
    assert first is not None and second is not None
    assert manager.probe_reuse(None, tokens) == 4 * TPB
    first.drop()
    assert manager.probe_reuse(None, tokens) == 4 * TPB  # the second plan still names the snapshot
    second.drop()
    assert manager.probe_reuse(None, tokens) == 2 * TPB  # back to the snapshot of the first chunk


@pytest.mark.parametrize("partial_reuse", [False, True])
def test_a_hybrid_turn_ending_inside_a_block_plans_its_partial_window_page_and_snapshot(partial_reuse: bool) -> None:
    layers: list[LayerConfig] = [attention(0, window=WINDOW), ssm(1)]
    config = make_config(layers, tokens_per_block=TPB, commit_min_snapshot=True, enable_partial_reuse=partial_reuse)
    manager = KVCacheManager(config)
    tokens = list(range(TPB + 3))
    cache = finished_turn(manager, tokens)
    handle = cache.plan_committed_block_drop()
    assert handle is not None
    swa_group = manager.get_pool_group_index(manager.get_layer_group_id(0))
    ssm_group = manager.get_pool_group_index(manager.get_layer_group_id(1))
    cache.close()
    assert manager.probe_reuse(None, tokens) == len(tokens)
    before = manager.get_storage_statistics()
    handle.drop()
    after = manager.get_storage_statistics()
    assert after[swa_group].free - before[swa_group].free == 2  # block 0 and the partial block: both in the window
    assert after[ssm_group].free - before[ssm_group].free == 1  # the snapshot at the turn's end
    assert manager.probe_reuse(None, tokens) == 0
    manager.shutdown()


def test_a_planned_page_a_wider_sibling_took_over_is_still_dropped() -> None:
    """With partial reuse, a turn ending inside a block plans its partial block's window page; a later commit of a
    sibling extending those tokens without a window page of its own (its history declared past that block) takes
    the page over, same content. The drop used to compare the page's block with the planned one: it skipped the
    page, which stayed cached with its planned-drop count stuck at 1."""
    tpb, full, swa = 32, 0, 1
    manager = KVCacheManager(make_config(
        [attention(0), attention(1, window=16)], enable_partial_reuse=True, commit_min_snapshot=True,
    ))
    turn_tokens = list(range(100, 132)) + list(range(200, 210))  # block 0, then 10 tokens of block 1
    sibling_tokens = turn_tokens + list(range(210, 232)) + list(range(300, 340))  # block 1 whole, and more
    sibling = manager.create_kv_cache(None, sibling_tokens)
    assert sibling.resume() and sibling.resize(len(sibling_tokens), len(sibling_tokens))  # block 1: no window page
    turn = finished_turn(manager, turn_tokens)
    plan = turn.plan_committed_block_drop()
    turn.close()
    assert plan is not None
    _, turn_pages = _introspection.reuse_match_pages(manager, None, turn_tokens, swa)
    sibling.commit(sibling_tokens)
    sibling.close()
    _, sibling_pages = _introspection.reuse_match_pages(manager, None, sibling_tokens[: 2 * tpb], swa)
    assert sibling_pages[1] == turn_pages[1]  # the turn's 10-token window page, now the sibling block's
    plan.drop()
    _, after = _introspection.reuse_match_pages(manager, None, sibling_tokens[: 2 * tpb], swa)
    assert after == [None, None]  # both window pages the turn planned are gone
    _, full_pages = _introspection.reuse_match_pages(manager, None, sibling_tokens, full)
    assert None not in full_pages  # full attention stays reusable
    manager.check_invariants()
    manager.shutdown()
