"""Refusal sentences count in English: "1 GPU page needed", "1 of ... GPU pages is held", never "1 GPU pages"."""

from __future__ import annotations

import re

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager
from tests.helpers import attention, make_config

TPB = 16
SLOT = 2 * TPB * 64  # one page: K and V of one layer, 64 bytes a token each
ONE_PLURAL = re.compile(r"(?<![\d.])1 (GPU |free )?(pages|slots)\b|(?<![\d.])1 of [^;]* (are|stay)\b")


def _manager(pages: int) -> KVCacheManager:
    return KVCacheManager(make_config([attention(0, TPB * 64)], tiers=[GpuCacheTierConfig(pages * SLOT)],
                                      tokens_per_block=TPB, max_util_for_resume=1.0))


def test_one_page_short_is_singular() -> None:
    manager = _manager(4)
    other = manager.create_kv_cache()
    assert other.resume() and other.resize(4 * TPB)  # every GPU page locked
    cache = manager.create_kv_cache()
    assert cache.resume()
    assert not cache.resize(TPB)
    refusal = cache.last_refusal
    assert refusal is not None and refusal.pages_needed == 1
    assert refusal.detail.startswith("1 GPU page needed in pool group 0, 0 free or evictable"), refusal.detail
    assert not ONE_PLURAL.search(refusal.detail), refusal.detail
    assert not cache.resize(6 * TPB)  # more than the tier: the plural stays plural
    refusal = cache.last_refusal
    assert refusal is not None and "needs 6 GPU pages in pool group 0" in refusal.detail, refusal
    for each in (other, cache):
        each.close()
    manager.shutdown()


def test_one_held_page_is_singular() -> None:
    manager = _manager(4)
    held = manager.create_kv_cache()
    assert held.resume() and held.resize(TPB)
    other = manager.create_kv_cache()
    assert other.resume() and other.resize(3 * TPB)
    cache = manager.create_kv_cache()
    assert cache.resume()
    hold = held.hold("a transfer in flight")
    assert not cache.resize(TPB)
    hold.release()
    refusal = cache.last_refusal
    assert refusal is not None and refusal.held_pages == 1
    assert "; 1 of pool group 0's GPU pages is in held caches (KVCache.hold)" in refusal.detail, refusal.detail
    assert not ONE_PLURAL.search(refusal.detail), refusal.detail
    for each in (held, other, cache):
        each.close()
    manager.shutdown()
