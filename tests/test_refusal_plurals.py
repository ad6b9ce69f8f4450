"""Refusal sentences count in English: "1 GPU page needed", "1 of ... GPU pages is held", never "1 GPU pages"."""

from __future__ import annotations

import re
from typing import Callable

import pytest

from kv_cache_manager_v2 import (
    BatchDesc, GpuCacheTierConfig, HostCacheTierConfig, KVCacheDesc, KVCacheManager, Refusal,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from tests.fuzz.checks import COUNTED
from tests.helpers import KIB, attention, make_config, ssm

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


KV_SLOT = 16 * KIB  # attention(0, 8 KiB): one GPU page of K and V
TPB_32 = 32  # make_config's tokens per block


def _one_ssm_slot() -> KVCacheManager:
    """A hybrid whose SSM pool group gets 1 GPU slot (split for one 256-token cache): no new cache is admissible
    under the default ``max_util_for_resume``."""
    step = BatchDesc([KVCacheDesc(256, 255)])
    return KVCacheManager(make_config([attention(0), ssm(1)], gpu_quota=50 * KIB, typical_step=step))


def _counts(detail: str) -> dict[tuple[int, str], bool]:
    """The sentence's counts, each (count, noun) with whether it was written plural; a figure stated twice must
    be written alike."""
    found: dict[tuple[int, str], bool] = {}
    for match in COUNTED.finditer(detail):
        key, plural = (int(match.group(1)), match.group(2)), bool(match.group(3))
        assert found.setdefault(key, plural) == plural, detail
    return found


def _quota_bytes(count: int) -> tuple[Refusal, list[tuple[int, str]]]:
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], gpu_quota=10 * KV_SLOT))
    assert not manager.resize(0, count)
    refusal = manager.last_refusal
    assert refusal is not None
    return refusal, [(count, "byte")]


def _beyond_reservation(count: int) -> tuple[Refusal, list[tuple[int, str]]]:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * KV_SLOT), HostCacheTierConfig(0, max_quota=(count - 1) * KV_SLOT)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    assert not manager.resize(1, count * KV_SLOT)
    refusal = manager.last_refusal
    assert refusal is not None and refusal.pages_needed == count
    return refusal, [(count, "slot")]


def _held_on_host(count: int) -> tuple[Refusal, list[tuple[int, str]]]:
    """``count`` pages of a suspended cache offloaded to the host (no disk to move them to), its quota shrunk to
    one slot fewer: ``count`` pages stay, ``count - 1`` slots would be kept."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * KV_SLOT), HostCacheTierConfig(4 * KV_SLOT)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(count * TPB_32)
    cache.commit(list(range(count * TPB_32)))
    cache.suspend()
    assert cache.offload() == count
    assert not manager.resize(1, (count - 1) * KV_SLOT)
    refusal = manager.last_refusal
    assert refusal is not None and (refusal.pages_needed, refusal.pages_available) == (count, count - 1)
    return refusal, [(count, "page"), (count - 1, "slot")]


def _one_token_caches(count: int) -> tuple[Refusal, list[tuple[int, str]]]:
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], gpu_quota=count * KV_SLOT))
    assert manager.clamp_max_seq_len_for_mem(count + 1, 1000) == 0
    refusal = manager.last_refusal
    assert refusal is not None and (refusal.pages_needed, refusal.pages_total) == (count + 1, count)
    return refusal, [(count + 1, "cache"), (count + 1, "GPU page"), (count, "slot")]


def _step_too_big(count: int) -> tuple[Refusal, list[tuple[int, str]]]:
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], gpu_quota=count * KV_SLOT))
    assert not manager.can_fit((count + 1) * TPB_32, count)
    refusal = manager.last_refusal
    assert refusal is not None and (refusal.pages_needed, refusal.pages_total) == (count + 1, count)
    return refusal, [(count, "token"), (count + 1, "GPU page"), (count, "slot")]


def _batch_of_hybrids(count: int) -> tuple[Refusal, list[tuple[int, str]]]:
    """``count`` hybrid caches whose resumes lock more SSM live states than an admission may: 1 on a 1-slot SSM
    group (0 admissible), 2 on a 2-slot one (1 admissible)."""
    if count == 1:
        manager = _one_ssm_slot()
    else:
        manager = KVCacheManager(make_config([attention(0), ssm(1), ssm(2)], gpu_quota=160 * KIB))
    assert manager.clamp_max_seq_len_for_mem(count, 100) == 0
    refusal = manager.last_refusal
    assert refusal is not None and (refusal.pages_needed, refusal.pages_total) == (count, count)
    return refusal, [(count, "cache"), (count, "SSM live state"), (count, "slot")]


def _new_hybrid(count: int) -> tuple[Refusal, list[tuple[int, str]]]:
    """A new hybrid cache's one SSM live state over the admission limit, on an SSM group of ``count`` slots."""
    if count == 1:
        manager = _one_ssm_slot()
    else:
        step = BatchDesc([KVCacheDesc(256, 255)] * 2)  # its split gives the SSM pool group 2 slots, 0 admissible
        layers: list[LayerConfig] = [attention(0), ssm(1), ssm(2)]
        manager = KVCacheManager(make_config(layers, gpu_quota=160 * KIB, max_util_for_resume=0.4, typical_step=step))
    assert not manager.can_fit(10)
    refusal = manager.last_refusal
    assert refusal is not None and (refusal.pages_needed, refusal.pages_total) == (1, count)
    return refusal, [(1, "SSM live state"), (count, "slot")]


SITES: dict[str, Callable[[int], tuple[Refusal, list[tuple[int, str]]]]] = {
    "manager.resize to too few bytes": _quota_bytes,
    "manager.resize past max_quota": _beyond_reservation,
    "manager.resize below the held pages": _held_on_host,
    "clamp_max_seq_len_for_mem pages": _one_token_caches,
    "can_fit step": _step_too_big,
    "clamp_max_seq_len_for_mem SSM live states": _batch_of_hybrids,
    "can_fit SSM live state": _new_hybrid,
}


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("site", list(SITES))
def test_every_counted_noun_agrees_with_its_count(site: str, count: int) -> None:
    """Each sentence ``quotas.py`` writes, built for real with its figures at 1 and at 2: every count it states
    carries its noun singular for one, plural otherwise, and the figures the case is built on are stated. Before
    (at count 1): "1 SSM live states", "1 caches lock", "1 bytes", "it has 1 slots", "computing 1 tokens"."""
    refusal, stated = SITES[site](count)
    counts = _counts(refusal.detail)
    for (figure, noun), plural in counts.items():
        assert plural == (figure != 1), (figure, noun, refusal.detail)
    for figure, noun in stated:
        assert (figure, noun) in counts, (figure, noun, refusal.detail)
