"""Eviction order in small scripted cases (README "Eviction order"): which blocks leave the GPU first, what offload,
prefetch and a quota shrink do to the order, and what a window releases; some compared with
``tests/eviction_model.py``'s model through ``tests/eviction_workload.py``."""

from __future__ import annotations

import random

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2._introspection import swa_life_cycle_ids
from kv_cache_manager_v2.testing import FakeEngine
from tests.eviction_workload import (
    SLOT,
    TPB,
    WINDOW,
    Priorities,
    TierObserver,
    block_tokens,
    build_run,
    compare,
    compute,
    decode,
    open_cache,
    pressure_blocks,
    serve_prompt,
)
from tests.helpers import KIB, attention, make_config


def test_a_copy_source_once_copied_is_room_for_the_next_copy() -> None:
    # GPU only, 9 slots: a cached prompt of 2 blocks (4 pages: full + windowed layer group), 4 pages held by a
    # suspended cache, 1 free. A request sharing block 0 and half of block 1 copies that half in both layer
    # groups: 2 new pages, room for 1 until the first copy's source is filed (reusable, nobody else uses it).
    run = build_run([9], layers=[attention(0, KIB), attention(1, KIB, window=WINDOW)], partial_reuse=True)
    prompt = [token for ordinal in range(2) for token in block_tokens(0, ordinal, TPB // 2)]
    serve_prompt(run, prompt, Priorities((35,)), hold=False)
    holder, holder_id = open_cache(run, [], Priorities((35,)))
    assert holder.resume() == run.model.resume(holder_id, 1.0) is True
    assert holder.resize(2 * TPB) == run.model.resize(holder_id, 2 * TPB) is True
    holder.suspend()
    run.model.suspend(holder_id)
    request = prompt[:TPB] + block_tokens(1, 1, TPB // 2)
    cache, cache_id = open_cache(run, request, Priorities((35,)))
    assert cache.num_committed_tokens == TPB + TPB // 2
    assert compute(run, cache, cache_id, request, 0)  # resumed (the model agrees), computed and committed
    cache.close()
    run.model.close(cache_id)
    compare(run)
    holder.close()
    run.manager.shutdown()


def four_block_manager(gpu_slots: int, host_slots: int) -> tuple[KVCacheManager, list[int], TierObserver]:
    """A GPU + host manager with one prompt of 4 blocks computed and cached."""
    config = make_config(
        [attention(0, KIB)],
        tiers=[GpuCacheTierConfig(gpu_slots * SLOT), HostCacheTierConfig(host_slots * SLOT)],
        tokens_per_block=TPB,
        enable_partial_reuse=False,
        enable_kv_events=True,
    )
    manager = KVCacheManager(config)
    tokens = [token for ordinal in range(4) for token in block_tokens(0, ordinal)]
    first = manager.create_kv_cache(None, tokens)
    assert first.resume() and first.resize(len(tokens))
    FakeEngine(manager).step(first, tokens)
    first.commit(tokens)
    first.close()
    observer = TierObserver()
    observer.read(manager)
    return manager, tokens, observer


def ordinals_at(observer: TierObserver, manager: KVCacheManager, level: int) -> list[int]:
    observer.read(manager)
    return sorted(len(path) // TPB - 1 for (_, path), at in observer.levels.items() if at == level)


def add_pressure(manager: KVCacheManager, blocks: int) -> None:
    pressure = manager.create_kv_cache()
    assert pressure.resume() and pressure.resize(blocks * TPB)
    pressure.close()


@pytest.mark.parametrize("resume_first", [False, True])
def test_a_suspended_caches_deepest_blocks_leave_the_gpu_first(resume_first: bool) -> None:
    # As a closed cache's: eviction shortens the GPU-resident prefix, it does not cut its head. The cache is held
    # since create_kv_cache (resume_first: resumed, then suspended).
    manager, tokens, observer = four_block_manager(5, 4)
    cache = manager.create_kv_cache(None, tokens)
    if resume_first:
        assert cache.resume()
        cache.suspend()
    add_pressure(manager, 3)
    assert ordinals_at(observer, manager, 1) == [2, 3]
    cache.close()


def test_offload_into_few_free_slots_sends_the_deepest_blocks() -> None:
    manager, tokens, observer = four_block_manager(5, 2)
    cache = manager.create_kv_cache(None, tokens)
    assert cache.offload() == 2
    assert ordinals_at(observer, manager, 1) == [2, 3]
    cache.close()


def test_prefetched_pages_leave_the_gpu_deepest_first() -> None:
    manager, tokens, observer = four_block_manager(5, 4)
    cache = manager.create_kv_cache(None, tokens)
    assert cache.offload() == 4
    assert cache.prefetch() == 4
    add_pressure(manager, 3)
    assert ordinals_at(observer, manager, 1) == [2, 3]
    cache.close()


def test_every_layer_groups_last_block_is_evicted_before_an_earlier_block() -> None:
    # A full-attention and a windowed layer group in one pool group: a closed cache's pages are filed block by
    # block, so eviction takes the last block's pages of both groups before the full group's earlier blocks (full
    # attention reuses nothing past a block without a page: the windowed pages of later blocks would stay for
    # nothing). The window's first blocks, filed when it passed them, go first.
    run = build_run([8], layers=[attention(0, KIB), attention(1, KIB, window=WINDOW)])
    tokens = [token for ordinal in range(4) for token in block_tokens(0, ordinal)]
    cache, cache_id = open_cache(run, tokens, Priorities((35,)))
    assert compute(run, cache, cache_id, tokens, 0)
    cache.close()
    add_pressure(run.manager, 2)  # 4 pages of 2 layer groups
    run.observer.read(run.manager)
    kept = sorted((lc, len(path) // TPB - 1) for lc, path in run.observer.levels)
    full, windowed = sorted(set(range(2)) - set(swa_life_cycle_ids(run.manager))) + swa_life_cycle_ids(run.manager)
    assert kept == sorted([(full, 0), (full, 1), (full, 2), (windowed, 2)])
    run.manager.shutdown()


def test_a_quota_shrink_keeps_the_lru_order_of_the_pages_it_compacts() -> None:
    # Prompts A then B (4 blocks each) fill 8 GPU slots, B's in slots 4-7. Shrinking to 6 slots drops A's last two
    # blocks and moves B's pages out of slots 6 and 7: a move inside the tier, not a use, so B's last block stays
    # the next victim after A's.
    run = build_run([8])
    prompts = [[token for ordinal in range(4) for token in block_tokens(variant, ordinal)] for variant in (1, 2)]
    for tokens in prompts:
        cache, cache_id = open_cache(run, tokens, Priorities((35,)))
        assert compute(run, cache, cache_id, tokens, 0)
        cache.close()
    assert run.manager.resize(0, 6 * SLOT)
    assert run.manager.probe_reuse(None, prompts[0]) == 2 * TPB
    add_pressure(run.manager, 3)
    assert run.manager.probe_reuse(None, prompts[0]) == 0
    assert run.manager.probe_reuse(None, prompts[1]) == 3 * TPB
    run.manager.shutdown()



def test_a_window_releases_a_page_its_committed_block_no_longer_uses() -> None:
    # Cache A keeps its committed prompt suspended on the host tier; B recomputes its first two blocks, so the tree
    # takes B's GPU pages and A's colder ones leave it (A keeps using them). Once A's window has passed block 1, A's
    # windowed page of it serves nothing and must be freed, not held until A closes.
    run = build_run([8, 7], layers=[attention(0, KIB), attention(1, KIB, window=WINDOW)])
    prompt = [token for ordinal in range(3) for token in block_tokens(0, ordinal)]
    serve_prompt(run, prompt, Priorities((35,)), hold=True)
    ((cache_id, (cache, _)),) = run.suspended.items()
    assert cache.offload() == run.model.offload(cache_id) == 7
    pressure_blocks(run, 4, Priorities((35,)))  # drops A's windowed block 0 (reusable, no colder room)
    serve_prompt(run, prompt[: 2 * TPB], Priorities((35,)), hold=False)
    compare(run)
    decode(run, random.Random(0))  # A resumes, computes and commits block 3: its window passes block 1
    compare(run)
    cache.close()
    run.manager.shutdown()


