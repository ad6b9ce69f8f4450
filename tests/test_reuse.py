"""Prefix reuse through the radix tree (SPEC §4), content-checked by the FakeEngine."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2._base.hashing import ReuseScope, block_key, root_key
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, gemma_like_layers, make_config, ssm

TPB = 32


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def prefill(manager: KVCacheManager, engine: FakeEngine, tokens: list[int], scope: ReuseScope | None = None) -> int:
    """Admit, compute and commit a whole prompt, then close; returns how many tokens were reused."""
    cache = manager.create_kv_cache(scope, tokens)
    reused = cache.num_committed_tokens
    assert cache.resume()
    assert cache.resize(len(tokens))
    engine.step(cache, tokens)
    cache.commit(tokens[reused:])
    cache.close()
    return reused


def test_aligned_and_unaligned_prefixes_are_reused_with_their_content() -> None:
    manager = KVCacheManager(make_config(gemma_like_layers(), enable_partial_reuse=False))
    engine = FakeEngine(manager)
    system = tokens_of(1, 200)
    assert prefill(manager, engine, system + tokens_of(2, 100)) == 0
    # 200 shared tokens: 6 full blocks (192 tokens) are reusable without partial reuse.
    follower = system + tokens_of(3, 90)
    assert manager.probe_reuse(None, follower) == 192
    cache = manager.create_kv_cache(None, follower)
    assert (cache.capacity, cache.history_length, cache.num_committed_tokens) == (192, 192, 192)
    assert cache.resume() and cache.resize(len(follower))
    engine.step(cache, follower)  # checks the 192 reused tokens (full layer: all; SWA: window) first
    cache.commit(follower[192:])
    cache.close()
    aligned = system[:192]
    assert manager.probe_reuse(None, aligned) == 192
    assert manager.probe_reuse(None, aligned[:191]) == 160


def test_swa_only_needs_the_window_and_sinks() -> None:
    layers = [attention(0, window=64, sinks=10), attention(1, window=64, sinks=10)]
    manager = KVCacheManager(make_config(layers))
    engine = FakeEngine(manager)
    prompt = tokens_of(4, 320)
    prefill(manager, engine, prompt)
    cache = manager.create_kv_cache(None, prompt + [1])
    assert cache.num_committed_tokens == 320
    assert cache.resume()
    indices = list(cache.get_base_page_indices(0))
    # History 320: sink block 0 plus the window from block (321 - 64) // 32 = 8 on; blocks 1..7 are stale.
    assert indices[0] >= 0 and indices[1:8] == [-1] * 7 and indices[8:] != [-1] * 2
    assert cache.get_base_page_indices(0)[9] >= 0
    engine.check(cache, prompt + [1])
    cache.close()


def test_scopes_isolate_reuse() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    engine = FakeEngine(manager)
    prompt = tokens_of(5, 128)
    prefill(manager, engine, prompt, ReuseScope(lora_id=0))
    assert manager.probe_reuse(ReuseScope(lora_id=0), prompt) == 128
    assert manager.probe_reuse(None, prompt) == 0
    assert manager.probe_reuse(ReuseScope(lora_id=None, salt=b"x"), prompt) == 0
    assert manager.probe_reuse(ReuseScope(lora_id=1), prompt) == 0
    assert root_key(None) == root_key(ReuseScope()) != root_key(ReuseScope(lora_id=0))
    assert block_key(root_key(None), [1, 2]) != block_key(root_key(None), [1, 3])


def test_partial_reuse_copies_on_write() -> None:
    manager = KVCacheManager(make_config([attention(0), attention(1, window=96)]))
    engine = FakeEngine(manager)
    first = tokens_of(6, 96)
    prefill(manager, engine, first)
    # Shares 32 + 8 tokens with `first`: one full block and 8 tokens of the second block.
    second = first[:40] + tokens_of(7, 50)
    assert manager.probe_reuse(None, second) == 40
    cache = manager.create_kv_cache(None, second)
    assert cache.num_committed_tokens == 40
    assert cache.resume() and cache.resize(len(second))
    engine.step(cache, second)  # checks the 8 copied tokens, then overwrites the rest of its private copy
    cache.commit(second[40:])
    cache.close()
    # The source block was never written in place: `first` is still fully reusable with its content.
    third = manager.create_kv_cache(None, first + [9])
    assert third.num_committed_tokens == 96
    assert third.resume()
    engine.check(third, first)
    third.close()


def test_partial_reuse_is_off_with_ssm_layers() -> None:
    manager = KVCacheManager(make_config([attention(0), ssm(1)], ssm_reuse_interval=TPB))
    assert not manager.config.partial_reuse_enabled


def test_rebasing_adopts_an_identical_committed_block() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    engine = FakeEngine(manager)
    prompt = tokens_of(8, 96)
    a = manager.create_kv_cache(None, prompt)
    b = manager.create_kv_cache(None, prompt)
    for cache in (a, b):
        assert cache.resume() and cache.resize(96)
        engine.step(cache, prompt)
    used_before = manager.get_storage_statistics(0)[0].free
    a.commit(prompt)
    b.commit(prompt)  # same blocks already in the tree: b switches to a's pages and frees its own
    assert manager.get_storage_statistics(0)[0].free == used_before + 3
    assert list(a.get_base_page_indices(0)) == list(b.get_base_page_indices(0))
    engine.check(b, prompt)
    a.close()
    b.close()
    assert manager.get_storage_statistics(0)[0].evictable == 3


def test_stop_committing_publishes_the_partial_block_at_close() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    engine = FakeEngine(manager)
    prompt = tokens_of(9, 70)
    cache = manager.create_kv_cache(None, prompt)
    assert cache.resume() and cache.resize(70)
    engine.step(cache, prompt)
    cache.commit(prompt)
    cache.stop_committing()
    decoded = prompt + tokens_of(10, 5)
    assert cache.resize(75)
    engine.step(cache, decoded)  # writes past the committed 70 tokens into the same page
    cache.close()
    assert manager.probe_reuse(None, prompt) == 70
    follower = manager.create_kv_cache(None, prompt[:68] + [1, 2, 3])
    assert follower.num_committed_tokens == 68
    assert follower.resume()
    engine.check(follower, prompt)
    follower.close()


def test_multimodal_tokens_share_blocks_by_digest() -> None:
    manager = KVCacheManager(make_config([attention(0)], vocab_size=1000))
    engine = FakeEngine(manager)
    image = manager.gen_multimodal_cache_key_tokens(b"image-digest-1".ljust(32, b"."), 40)
    assert image[0] == b"image-digest-1".ljust(32, b".") and image[1:3] == [1001, 1002] and len(image) == 40
    prompt = [1, 2, 3] + image + [4] * 21
    cache = manager.create_kv_cache(None, prompt)
    assert cache.resume() and cache.resize(64)
    engine.step(cache, prompt)
    cache.commit(prompt)
    cache.close()
    assert manager.probe_reuse(None, prompt) == 64
    other = [1, 2, 3] + manager.gen_multimodal_cache_key_tokens(b"image-digest-2".ljust(32, b"."), 40) + [4] * 21
    assert manager.probe_reuse(None, other) == 3
    with pytest.raises(TypeError, match=r"input_tokens\[1\]"):
        manager.probe_reuse(None, [1, 2.5])  # type: ignore[list-item]


def test_clear_reusable_blocks_refuses_while_a_cache_is_open_then_drops_everything() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    engine = FakeEngine(manager)
    kept = tokens_of(11, 64)
    dropped = tokens_of(12, 64)
    prefill(manager, engine, dropped)
    live = manager.create_kv_cache(None, kept)
    assert live.resume() and live.resize(64)
    engine.step(live, kept)
    live.commit(kept)
    with pytest.raises(RuntimeError, match="1 KV cache"):
        manager.clear_reusable_blocks()
    assert manager.probe_reuse(None, dropped) == 64 and manager.probe_reuse(None, kept) == 64  # nothing dropped
    live.close()
    manager.clear_reusable_blocks()
    assert manager.probe_reuse(None, dropped) == 0 and manager.probe_reuse(None, kept) == 0
    stats = manager.get_storage_statistics(0)[0]
    assert stats.evictable == 0 and stats.free == stats.total


def test_single_use_scopes_leave_no_root_behind() -> None:
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=64 * 1024, tokens_per_block=16))
    for salt in range(500):  # each scope caches one block; the 64 GPU slots keep the newest 64
        tokens = [salt * 100 + i for i in range(16)]
        cache = manager.create_kv_cache(ReuseScope(salt=salt), tokens)
        assert cache.resume() and cache.resize(16)
        cache.commit(tokens)
        cache.close()
    assert manager.num_reuse_scopes == 64
    assert manager.probe_reuse(ReuseScope(salt=499), [499 * 100 + i for i in range(16)]) == 16
    assert manager.probe_reuse(ReuseScope(salt=0), list(range(16))) == 0
    manager.clear_reusable_blocks()
    assert manager.num_reuse_scopes == 0


def test_a_live_cache_keeps_its_scope_root_until_it_closes() -> None:
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=64 * 1024, tokens_per_block=16))
    scope = ReuseScope(lora_id=7)
    tokens = list(range(40))
    idle = manager.create_kv_cache(scope)
    assert manager.num_reuse_scopes == 1
    writer = manager.create_kv_cache(scope)
    assert writer.resume() and writer.resize(len(tokens))
    writer.commit(tokens)
    idle.close()  # the writer still uses the root: it stays, and so does everything committed under it
    writer.stop_committing()
    writer.close()
    assert manager.num_reuse_scopes == 1 and manager.probe_reuse(scope, tokens) == len(tokens)
    manager.clear_reusable_blocks()
    assert manager.num_reuse_scopes == 0 and manager.probe_reuse(scope, tokens) == 0
    # A new root for the same scope serves new content as before.
    again = manager.create_kv_cache(scope, tokens)
    assert again.resume() and again.resize(len(tokens))
    again.commit(tokens)
    again.close()
    assert manager.num_reuse_scopes == 1 and manager.probe_reuse(scope, tokens) == 40  # close publishes the partial block
    manager.check_invariants()


def test_a_closed_cache_loses_its_deepest_blocks_first() -> None:
    """Pages released together are evicted last block first: eviction shortens a cached prefix instead of cutting
    off its head, which would leave every later page unreachable (full attention needs all of them)."""
    manager = KVCacheManager(make_config([attention(0, KIB)], gpu_quota=8 * KIB, tokens_per_block=4))  # 4 slots
    prompt = list(range(16))
    cache = manager.create_kv_cache(None, prompt)
    assert cache.resume() and cache.resize(len(prompt))
    cache.commit(prompt)
    cache.close()
    assert manager.probe_reuse(None, prompt) == 16
    others = []
    for evicted in range(1, 4):
        other = manager.create_kv_cache(None, [1000 + evicted] * 4)
        assert other.resume() and other.resize(4)  # a full pool: one cached page goes
        others.append(other)
        assert manager.probe_reuse(None, prompt) == 16 - 4 * evicted
    for other in others:
        other.close()
    manager.check_invariants()
    manager.shutdown()
