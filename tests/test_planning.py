"""Memory planning, rebalancing, statistics and KV events (SPEC §8)."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2 import (
    BatchDesc,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.fuzz.checks import check_sentence_figures
from tests.helpers import KIB, MIB, attention, make_config, ssm

TPB = 32


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def swa_and_full() -> list[LayerConfig]:
    return [attention(0, 2 * KIB, window=128), attention(1, 4 * KIB)]


def slot_counts(manager: KVCacheManager, level: int = 0) -> list[int]:
    return [stat.total for stat in manager.get_storage_statistics(level)]


def test_typical_step_sets_the_split() -> None:
    short = KVCacheManager(make_config(swa_and_full(), typical_step=BatchDesc([KVCacheDesc(256, 255)] * 8)))
    long = KVCacheManager(make_config(swa_and_full(), typical_step=BatchDesc([KVCacheDesc(8192, 8191)] * 8)))
    # Short requests keep their whole history inside the 128-token window: SWA needs ~5 of every 8 blocks.
    # Long ones need ~5 SWA blocks against 256 full blocks, so the full-attention group takes almost everything.
    short_swa, short_full = slot_counts(short)
    long_swa, long_full = slot_counts(long)
    assert short_swa / short_full > 0.3
    assert long_swa / long_full < 0.05
    # Shared system prompts count once for full attention.
    shared = KVCacheManager(
        make_config(swa_and_full(), typical_step=BatchDesc([KVCacheDesc(4096, 4095)] * 8, system_prompt_length=4000))
    )
    assert slot_counts(shared)[1] < slot_counts(long)[1] * 2 and slot_counts(shared)[0] > long_swa


def test_constraints_are_floors_and_run_at_the_minimum_quota() -> None:
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=128), attention(1, 4 * KIB), ssm(2, 8 * KIB, 1 * KIB)]
    constraint = BatchDesc([KVCacheDesc(1000, 999)] * 3)
    probe = KVCacheManager(make_config(layers, constraints=[constraint], max_util_for_resume=1.0))
    floors = internals_of(probe).planner.floors
    assert floors == [3 * 5, 3 * 32, 3]  # SWA: blocks 27..31 of each; full: 32 each; one SSM state each
    slot_bytes = [sum(probe.get_slot_bytes(group)) for group in range(3)]
    minimum = sum(count * size for count, size in zip(floors, slot_bytes))
    manager = KVCacheManager(
        make_config(layers, gpu_quota=minimum, constraints=[constraint], max_util_for_resume=1.0)
    )
    assert slot_counts(manager) == floors
    engine = FakeEngine(manager)
    caches = []
    for seed in range(3):
        tokens = tokens_of(seed, 1000)
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(1000, 999)
        engine.write(cache, tokens, 871, 1000)
        caches.append(cache)
    for cache in caches:
        cache.suspend()
    assert not manager.resize(0, minimum - 1)  # shrinking below the floors is refused
    refusal = manager.last_refusal
    assert refusal is not None and refusal.call == "KVCacheManager.resize" and not refusal.fits_empty_manager
    assert "constraints" in refusal.detail
    for cache in caches:
        cache.close()


@pytest.mark.parametrize("batch_size", [1, 3, 7])
def test_clamp_max_seq_len_matches_brute_force(batch_size: int) -> None:
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=128, sinks=4), attention(1, 4 * KIB), ssm(2)]
    manager = KVCacheManager(make_config(layers, gpu_quota=4 * MIB, max_util_for_resume=1.0))
    clamped = manager.clamp_max_seq_len_for_mem(batch_size, 100_000)

    def fits(length: int) -> bool:
        caches = [manager.create_kv_cache() for _ in range(batch_size)]
        ok = all(cache.resume() and cache.resize(length, length - 1) for cache in caches)
        for cache in caches:
            cache.close()
        manager.clear_reusable_blocks()
        return ok

    assert clamped > 0 and fits(clamped) and not fits(clamped + 1)
    assert manager.clamp_max_seq_len_for_mem(batch_size, 40) == 40
    assert manager.clamp_max_seq_len_for_mem(10_000, 100) == 0


def lengths_the_manager_holds(manager: KVCacheManager, batch_size: int, bound: int) -> list[bool]:
    """Ground truth from the real manager: ``holds[L]`` = whether ``batch_size`` fresh caches all get capacity
    ``L`` with history ``L - 1`` at once (``holds[0]`` is a placeholder)."""
    holds = [False]
    for length in range(1, bound + 1):
        caches = [manager.create_kv_cache() for _ in range(batch_size)]
        holds.append(all(cache.resume() for cache in caches) and all(c.resize(length, length - 1) for c in caches))
        for cache in caches:
            cache.close()
    return holds


def largest_held(holds: list[bool], bound: int) -> int:
    return max((length for length in range(1, bound + 1) if holds[length]), default=0)


@pytest.mark.parametrize("tpb", [4, 16])
@pytest.mark.parametrize("sinks", [None, 3])
def test_clamp_max_seq_len_is_the_largest_length_the_manager_holds_for_any_window(
    tpb: int, sinks: int | None
) -> None:
    bound = 8 * tpb + 3
    for window in (1, 5, tpb, tpb + 4, 2 * tpb + 3):
        for slots in (1, 2, 4):
            layers: list[LayerConfig] = [attention(0, 512, window=window, sinks=sinks)]
            manager = KVCacheManager(make_config(layers, gpu_quota=slots * KIB, tokens_per_block=tpb))
            assert slot_counts(manager) == [slots]
            for batch_size in (1, 2):
                holds = lengths_the_manager_holds(manager, batch_size, bound)
                for upper in range(bound + 1):
                    assert manager.clamp_max_seq_len_for_mem(batch_size, upper) == largest_held(holds, upper), (
                        f"window {window}, tpb {tpb}, sinks {sinks}, {slots} slot(s), batch {batch_size}, "
                        f"bound {upper}"
                    )
            manager.shutdown()


def test_clamp_max_seq_len_does_not_stop_at_a_length_that_does_not_fit() -> None:
    # Window 20, tpb 16, 2 slots: lengths 33-35 need 3 pages, but 36-48 need 2 again (and so on up to 200).
    manager = KVCacheManager(make_config([attention(0, 512, window=20)], gpu_quota=2 * KIB, tokens_per_block=16))
    holds = lengths_the_manager_holds(manager, 1, 200)
    assert not any(holds[33:36]) and holds[200]
    assert manager.clamp_max_seq_len_for_mem(1, 200) == 200
    # Window 5, 1 slot: every length up to a block boundary past the window's reach fits in one page.
    manager = KVCacheManager(make_config([attention(0, 512, window=5)], gpu_quota=KIB, tokens_per_block=16))
    assert manager.clamp_max_seq_len_for_mem(1, 100) == 96


def test_clamp_max_seq_len_counts_every_layer_group_as_the_manager_allocates() -> None:
    # A windowed and a full layer sharing one pool group, and an SSM layer with its own.
    layers: list[LayerConfig] = [attention(0, 512, window=20, sinks=4), attention(1, 512), ssm(2, 512, 512)]
    floors = [BatchDesc([KVCacheDesc(16, 15)] * 3)]  # SSM slots for 3 caches
    manager = KVCacheManager(
        make_config(layers, gpu_quota=24 * KIB, tokens_per_block=16, max_util_for_resume=1.0, constraints=floors)
    )
    assert slot_counts(manager)[1] == 3
    for batch_size in (1, 2, 3):
        holds = lengths_the_manager_holds(manager, batch_size, 400)
        assert not holds[400]
        for upper in range(401):
            assert manager.clamp_max_seq_len_for_mem(batch_size, upper) == largest_held(holds, upper), upper
    manager.shutdown()


def test_adjust_follows_a_shifted_workload_without_losing_held_pages() -> None:
    manager = KVCacheManager(
        make_config(
            swa_and_full(),
            tiers=[GpuCacheTierConfig(8 * MIB), HostCacheTierConfig(8 * MIB)],
            typical_step=BatchDesc([KVCacheDesc(160, 159)] * 8),
        )
    )
    engine = FakeEngine(manager)
    base = manager.get_mem_pool_base_address(1, "key")
    before = slot_counts(manager)
    held = manager.create_kv_cache()
    held_tokens = tokens_of(99, 300)
    assert held.resume() and held.resize(300)
    engine.step(held, held_tokens)
    held.resize(300, 300)
    assert not manager.need_adjustment
    for seed in range(20):  # the real workload is long requests
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(1200, 1199)
        cache.close()
    assert bool(manager.need_adjustment)  # bool(): keeps mypy from narrowing the property for later lines
    with pytest.raises(ValueError, match="suspended"):
        manager.adjust()
    held.suspend()
    assert manager.adjust()
    after = slot_counts(manager)
    assert after[1] > before[1] and after[0] < before[0]
    assert not manager.need_adjustment
    assert manager.get_mem_pool_base_address(1, "key") == base
    assert held.resume()
    engine.check(held, held_tokens)
    held.close()
    manager.check_invariants()


def test_adjust_refused_by_held_pages_says_which_pool_group_and_changes_nothing() -> None:
    """30 suspended caches hold 150 pages of the windowed pool group on a GPU-only manager; the long requests seen
    since would shrink that group to 126 slots, and there is no colder tier to move pages to."""
    manager = KVCacheManager(
        make_config(swa_and_full(), tiers=[GpuCacheTierConfig(8 * MIB)], typical_step=BatchDesc([KVCacheDesc(160, 159)] * 8))
    )
    held = []
    for _ in range(30):
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(160, 150)
        held.append(cache)
    for _ in range(20):
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(1200, 1199)
        cache.close()
    for cache in held:
        cache.suspend()
    before = slot_counts(manager)
    assert bool(manager.need_adjustment) and not manager.adjust()
    assert slot_counts(manager) == before
    refusal = manager.last_refusal
    assert refusal is not None and refusal.call == "KVCacheManager.adjust"
    assert (refusal.level, refusal.pool_group, refusal.pages_needed) == (0, 0, 150)
    assert refusal.pages_available < 150 and refusal.fits_empty_manager
    for cache in held:
        cache.close()
    assert manager.adjust()  # with the pages gone, the same split is made
    manager.check_invariants()


def test_iteration_stats_and_events_follow_a_scripted_scenario() -> None:
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=64), attention(1, 2 * KIB)]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(12 * 8 * KIB), HostCacheTierConfig(4 * 8 * KIB)]
    manager = KVCacheManager(make_config(layers, tiers=tiers, enable_kv_events=True, max_util_for_resume=1.0))
    engine = FakeEngine(manager)
    prompt = tokens_of(1, 4 * TPB)
    cache = manager.create_kv_cache(None, prompt)
    assert cache.resume() and cache.resize(len(prompt))
    engine.step(cache, prompt)
    cache.commit(prompt)
    cache.close()
    stats = manager.get_iteration_stats()
    assert [s.allocated_pages for s in stats] == [4, 4]
    assert [s.missed_blocks for s in stats] == [4, 4]
    events = manager.get_latest_events()
    stored = [e for e in events if e.kind == "stored"]
    assert len(stored) == 8 and {e.layer_group_id for e in stored} == {0, 1}
    first = [e for e in stored if e.layer_group_id == 1]
    assert first[0].parent_hash is not None and list(first[0].tokens) == prompt[:TPB]
    assert first[1].parent_hash == first[0].block_hash
    assert manager.get_latest_events() == []
    follower = manager.create_kv_cache(None, prompt + [5])
    stats = manager.get_iteration_stats()
    # The window at 128 needs only blocks 2 and 3 of the SWA group; the full group reuses all four.
    assert [s.reused_full_blocks for s in stats] == [2, 4]
    assert [s.missed_blocks for s in stats] == [1, 1]
    assert follower.resume() and follower.resize(13 * TPB)  # 18 new pages, 16 free: the cached SWA blocks 0, 1 go
    follower.close()
    moved = [e for e in manager.get_latest_events() if e.kind == "updated"]
    assert len(moved) == 2 and {(e.layer_group_id, e.level) for e in moved} == {(0, 1)}
    assert [s.offloaded_pages for s in manager.get_iteration_stats()] == [2, 0]
    manager.clear_reusable_blocks()
    removed = [e for e in manager.get_latest_events() if e.kind == "removed"]
    assert removed and manager.probe_reuse(None, prompt) == 0
    quiet = KVCacheManager(make_config(layers))
    cache = quiet.create_kv_cache(None, prompt)
    assert cache.resume() and cache.resize(len(prompt))
    cache.commit(prompt)
    cache.close()
    assert quiet.get_latest_events() == []  # off by default


def test_a_gpu_quota_below_the_constraints_is_refused_stating_the_figures_it_carries() -> None:
    """No split of a quota below the constraints' floors exists: the refusal carried ``pages_needed=1,
    pages_available=0`` for pool group 0, and its sentence stated neither. It now names the pool group with the
    largest floor, carries that floor and 0, and says both."""
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=128), attention(1, 4 * KIB), ssm(2, 8 * KIB, 1 * KIB)]
    constraint = BatchDesc([KVCacheDesc(1000, 999)] * 3)
    manager = KVCacheManager(make_config(layers, constraints=[constraint], max_util_for_resume=1.0))
    slot_bytes = [sum(manager.get_slot_bytes(group)) for group in range(3)]
    minimum = sum(count * size for count, size in zip([3 * 5, 3 * 32, 3], slot_bytes))
    before = manager.get_quota(0)
    assert not manager.resize(0, minimum - 1) and manager.get_quota(0) == before
    why = manager.last_refusal
    assert why is not None and (why.pool_group, why.pages_needed, why.pages_available) == (1, 96, 0), why
    assert f"({minimum} bytes): no split exists, so pool group 1 would get 0 slots, at least 96 slots needed" in why.detail
    check_sentence_figures(why)
    assert manager.resize(0, minimum)


def test_a_gpu_quota_starving_a_pool_group_is_refused_stating_the_figures_it_carries() -> None:
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=128), attention(1, 4 * KIB)]
    manager = KVCacheManager(make_config(layers))
    tiny = sum(manager.get_slot_bytes(1))  # one full-attention slot: the window's pool group gets none
    assert not manager.resize(0, tiny)
    why = manager.last_refusal
    assert why is not None and (why.pages_needed, why.pages_available) == (1, 0), why
    assert f"pool group {why.pool_group} would get 0 slots, at least 1 slot needed" in why.detail, why
    check_sentence_figures(why)


def test_a_resume_that_never_fits_after_a_quota_shrink_names_a_way_out_with_one_pool_group() -> None:
    """With one pool group the sentence ended at "it may use at most 3 of 4" (several pool groups name the split).
    It now names the way out, and the way out works: raising the quota back, the resume keeps the cache's content."""
    kv_slot = 16 * KIB  # attention(0, 8 KiB): one GPU page of K and V
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * kv_slot), HostCacheTierConfig(20 * kv_slot)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    engine = FakeEngine(manager)
    tokens = tokens_of(7, 8 * 32)  # 8 blocks of make_config's 32 tokens
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(len(tokens), len(tokens) - 1)
    engine.write(cache, tokens, 0, len(tokens))
    cache.suspend()
    assert manager.resize(0, 4 * kv_slot)  # the suspended cache's pages go to the host tier
    assert not cache.resume()
    why = cache.last_refusal
    assert why is not None and not why.fits_empty_manager and why.pages_needed == 8, why
    assert why.detail.endswith(
        "it may use at most 3 of 4: the GPU tier has fewer slots than it needs: raise its quota "
        "(KVCacheManager.resize, within the tier's max_quota), or close the cache"
    ), why.detail
    check_sentence_figures(why)
    assert manager.resize(0, 10 * kv_slot) and cache.resume()
    engine.check(cache, tokens)
    cache.close()
