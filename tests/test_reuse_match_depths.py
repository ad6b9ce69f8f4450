"""Where a reuse was cut (issue #37): ``KVCache._get_num_reusable_tokens_before_pruning`` is how far the input
tokens ran along the radix tree, ``_get_num_reusable_tokens_before_hybrid_pruning`` what the attention groups alone
could serve, and ``num_committed_tokens`` what SSM snapshots allowed; each is at most the one before."""

from __future__ import annotations

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2.config import LayerConfig
from tests.helpers import KIB, attention, make_config, ssm

TPB = 32


def tokens_from(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 104_729) % 50_000 for i in range(length)]


def hybrid_manager(partial_reuse: bool = True) -> KVCacheManager:
    layers: list[LayerConfig] = [attention(0, 2 * KIB), ssm(1)]
    return KVCacheManager(make_config(layers, tokens_per_block=TPB, enable_partial_reuse=partial_reuse,
                                      commit_min_snapshot=True, snapshot_prefill_chunks=False))


def commit_in_chunks(manager: KVCacheManager, tokens: list[int], ends: list[int]) -> None:
    """Commit ``tokens`` one chunk per end (each commit ending on a block boundary snapshots the SSM state)."""
    cache = manager.create_kv_cache()
    assert cache.resume()
    for end in ends:
        assert cache.resize(end)
        cache.commit(tokens[cache.num_committed_tokens : end])
    cache.close()


def depths(manager: KVCacheManager, tokens: list[int]) -> tuple[int, int, int]:
    cache = manager.create_kv_cache(None, tokens)
    found = (
        cache._get_num_reusable_tokens_before_pruning(),
        cache._get_num_reusable_tokens_before_hybrid_pruning(),
        cache.num_committed_tokens,
    )
    cache.close()
    return found


def test_a_lookup_inside_a_block_walks_past_the_last_snapshot() -> None:
    manager = hybrid_manager()
    prompt = tokens_from(1, 96)
    commit_in_chunks(manager, prompt, [32, 64])  # snapshots at 32 and 64
    assert depths(manager, prompt[:48]) == (48, 48, 32)  # attention could copy 16 rows; the SSM state is at 32
    assert depths(manager, prompt[:64]) == (64, 64, 64)
    manager.shutdown()


def test_a_fork_past_the_only_snapshot_is_found_but_not_reused() -> None:
    manager = hybrid_manager()
    shared = tokens_from(2, 64)
    commit_in_chunks(manager, shared + tokens_from(3, 32), [96])  # one snapshot, at 96
    assert depths(manager, shared + tokens_from(4, 32)) == (64, 64, 0)
    assert depths(manager, tokens_from(5, 64)) == (0, 0, 0)
    manager.shutdown()


def test_without_partial_reuse_the_walk_stops_at_block_boundaries() -> None:
    manager = hybrid_manager(partial_reuse=False)
    prompt = tokens_from(6, 96)
    commit_in_chunks(manager, prompt, [32, 64])
    assert manager.enable_partial_match is False
    assert depths(manager, prompt[:48]) == (32, 32, 32)
    manager.shutdown()


def test_the_depths_never_grow_along_the_pruning() -> None:
    manager = hybrid_manager()
    prompt = tokens_from(7, 128)
    commit_in_chunks(manager, prompt, [32, 64, 96])
    assert manager.enable_partial_match is True
    for length in range(8, 129, 8):
        walked, attention_only, reused = depths(manager, prompt[:length])
        assert reused <= attention_only <= walked <= length
    manager.shutdown()
