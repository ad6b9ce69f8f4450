"""``KVCacheManager.probe_reuse_by_tier``: the split agrees with what ``create_kv_cache`` + ``resume`` then move.

An SGLang-style engine budgets the load-back of host pages before admitting a prefill (its ``match_prefix`` answers
the device hit and the host hit apart). Each workload below serves seeded chats over a shared system prompt on a
GPU tier too small to keep them, with host and disk tiers under it, and before each admission compares the probe
with the admission: the tokens, the pages onboarded (``movement_counters`` and the iteration statistics), the
pages copied (a block reused partially, an SSM snapshot), and, where the resume evicted nothing, the slots freed
on each colder tier (``get_usage``), level by level.
"""

from __future__ import annotations

import random

import pytest

from kv_cache_manager_v2 import (CacheTier, CacheTierConfig, DiskCacheTierConfig, GpuCacheTierConfig,
                                 HostCacheTierConfig, KVCache, KVCacheManager, LayerConfig, ReuseByTier)
from tests.helpers import KIB, attention, make_config, ssm

TPB = 16
SYSTEM = list(range(1, 3 * TPB + 5))  # 52 tokens: three blocks and a partial one


def _manager(kind: str, tmp_path: str) -> KVCacheManager:
    layers: list[LayerConfig]
    if kind == "full":
        layers = [attention(0, KIB), attention(1, KIB)]
    elif kind == "windowed":
        layers = [attention(0, KIB, window=2 * TPB), attention(1, KIB)]
    else:
        layers = [attention(0, KIB), ssm(1, state=KIB, conv=KIB)]
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(96 * KIB), HostCacheTierConfig(64 * KIB), DiskCacheTierConfig(1024 * KIB, tmp_path)
    ]
    return KVCacheManager(make_config(layers, tiers=tiers, tokens_per_block=TPB, ssm_reuse_interval=TPB))


def _free(manager: KVCacheManager) -> list[int]:
    free = [0] * len(manager.cache_tier_list)
    for usage in manager.get_usage():
        free[usage.level] += usage.free
    return free


def _serve(manager: KVCacheManager, tokens: list[int]) -> tuple[ReuseByTier, bool]:
    """Probe, then admit, compute and close ``tokens``; asserts the probe against the admission. Returns the probe
    and whether the level-by-level check applied (the resume evicted nothing)."""
    split = manager.probe_reuse_by_tier(None, tokens)
    assert split.tokens == manager.probe_reuse(None, tokens)
    assert sum(split.tokens_by_level) == split.tokens
    assert split.onboard_pages[0] == 0
    manager.get_and_reset_iteration_stats()
    moved, free = manager.movement_counters, _free(manager)
    cache = manager.create_kv_cache(input_tokens=tokens)
    assert cache.num_committed_tokens == split.tokens
    if not cache.resume():
        cache.close()
        return split, False
    after = manager.movement_counters
    stats = manager.get_and_reset_iteration_stats()
    assert after.onboarded_pages - moved.onboarded_pages == sum(split.onboard_pages)
    assert sum(delta.iter_onboard_blocks for delta in stats.values()) == sum(split.onboard_pages)
    assert after.copied_pages - moved.copied_pages == sum(split.copied_pages)
    level_checked = after.offloaded_pages == moved.offloaded_pages and after.dropped_pages == moved.dropped_pages
    if level_checked:
        freed = [now - then for now, then in zip(_free(manager), free)]
        assert freed[1:] == list(split.onboard_pages[1:]), (freed, split)
    for level in range(1, len(split.tiers)):
        if split.tokens_by_level[level]:
            assert split.onboard_pages[level] + split.copied_pages[level], split
    _compute(cache, tokens)
    cache.close()
    return split, level_checked


def _compute(cache: KVCache, tokens: list[int]) -> None:
    """Compute and commit the rest of ``tokens`` in chunks a block long: an SSM snapshot at each boundary."""
    while cache.num_committed_tokens < len(tokens):
        end = min(len(tokens), (cache.num_committed_tokens // TPB + 1) * TPB)
        assert cache.resize(end)
        cache.commit(tokens[cache.num_committed_tokens : end])


@pytest.mark.parametrize("kind", ["full", "windowed", "hybrid"])
def test_split_agrees_with_what_resume_moves(kind: str, tmp_path: object) -> None:
    manager = _manager(kind, str(tmp_path))
    rng = random.Random(7)
    served: list[list[int]] = []
    seen_tiers: set[CacheTier] = set()
    checked = copies = 0
    try:
        for step in range(120):
            if served and rng.random() < 0.6:
                earlier = rng.choice(served)
                tokens = earlier[: rng.randrange(TPB, len(earlier) + 1)] + [90_000 + step] * rng.randrange(0, 20)
            else:
                tokens = SYSTEM + [rng.randrange(100, 30_000) for _ in range(rng.randrange(1, 5 * TPB))]
            split, level_checked = _serve(manager, tokens)
            served.append(tokens)
            checked += level_checked
            copies += sum(split.copied_pages[1:])
            seen_tiers.update(tier for tier in CacheTier if split.tokens_on(tier) and tier != CacheTier.GPU_MEM)
            manager.check_invariants()
    finally:
        manager.shutdown()
    # The workload reached what the test is about: tokens found on both colder tiers, level-checked admissions,
    # pages copied from a colder tier.
    assert seen_tiers == {CacheTier.HOST_MEM, CacheTier.DISK}
    assert checked >= 10
    assert copies > 0


def test_gpu_only_manager_answers_every_token_on_the_gpu() -> None:
    layers: list[LayerConfig] = [attention(0, KIB), ssm(1, state=KIB, conv=KIB)]
    manager = KVCacheManager(make_config(layers, tokens_per_block=TPB, ssm_reuse_interval=TPB))
    cache = manager.create_kv_cache(input_tokens=SYSTEM)
    assert cache.resume()
    _compute(cache, SYSTEM)
    cache.close()
    split = manager.probe_reuse_by_tier(None, SYSTEM + [7])
    reused = manager.probe_reuse(None, SYSTEM + [7])
    assert reused > 0
    assert split == ReuseByTier(reused, (CacheTier.GPU_MEM,), (reused,), (0,), split.copied_pages)
    assert split.gpu_tokens == reused and split.pages_to_move == 0
    assert split.copied_pages[0] >= 1  # the SSM snapshot where the match ends
    assert manager.probe_reuse_by_tier(None, None) == ReuseByTier(0, (CacheTier.GPU_MEM,), (0,), (0,), (0,))
    with pytest.raises(TypeError, match="input_tokens"):
        manager.probe_reuse_by_tier(None, "abc")  # type: ignore[arg-type]
    manager.shutdown()
