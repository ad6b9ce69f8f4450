"""The remote tier over the in-memory store (``MemoryStoreConfig``): fills under eviction pressure, backends that
answer badly, store restarts and tensor-parallel ranks (issue #35). Both modes; one attention layer with K/V of
512 bytes (a slot is 1 KiB), ``tokens_per_block`` 16, cpu backend."""

from __future__ import annotations

from typing import Iterator

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, Priority, RemoteCacheTierConfig, RemoteStore
from kv_cache_manager_v2._base.remote_store import HostBuffer
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.helpers import KIB, attention, make_config

TPB = 16


def manager_over(backend: object, gpu_slots: int, namespace: str = "test") -> KVCacheManager:
    remote = RemoteCacheTierConfig(0, backend, namespace=namespace)  # type: ignore[arg-type]
    return KVCacheManager(make_config(
        [attention(0, 512)], tiers=[GpuCacheTierConfig(gpu_slots * 1024), remote], tokens_per_block=TPB,
    ))


def tokens_of(seed: int, length: int) -> list[int]:
    return [seed * 100_000 + i for i in range(length)]


def serve(manager: KVCacheManager, engine: FakeEngine, tokens: list[int], low_first_blocks: int = 0) -> int:
    """Compute ``tokens`` after the reused prefix (checked), commit, close; the reused length. The first
    ``low_first_blocks`` blocks get the lowest eviction priority, the others a high one."""
    cache = manager.create_kv_cache(
        None, tokens, custom_priority_callback=lambda ordinal, _: Priority(1 if ordinal < low_first_blocks else 90),
    )
    reused = cache.num_committed_tokens
    assert cache.resume()
    engine.check(cache, tokens)
    assert cache.resize(len(tokens))
    engine.step(cache, tokens)
    cache.commit(tokens[reused:])
    cache.close()
    manager.check_invariants()
    return reused


def test_a_fill_keeps_the_blocks_it_fills_while_evicting_for_their_slots() -> None:
    fill_under_pressure(MemoryStoreConfig(), "test")


def fill_under_pressure(store: object, namespace: str) -> None:
    """Item 1 (also run on Mooncake by ``tests/test_remote_tier.py``). The tree holds blocks A0 and A1 whose pages were dropped (kept by their child B2's page); a prompt
    A0 A1 A2 is fetched from the store while the GPU tier is full, so its slots come from evicting B2, which used
    to prune A1 and A0 and hand their objects back out within the same fill: fetched pages landed on recycled
    blocks (two slots lost, the prefix never matched, another prompt's blocks carrying this one's pages)."""
    shared = tokens_of(1, 2 * TPB)
    prompt = shared + tokens_of(2, TPB) + tokens_of(3, 5)
    other = shared + tokens_of(4, TPB) + tokens_of(5, 5)
    writer = manager_over(store, 16, namespace)
    serve(writer, FakeEngine(writer), prompt)  # A0 A1 A2 in the store
    manager = manager_over(store, 6, namespace)
    engine = FakeEngine(manager)
    assert serve(manager, engine, other, low_first_blocks=2) == 2 * TPB  # A0 A1 fetched, B2 computed
    busy_tokens = tokens_of(6, 4 * TPB)
    busy = manager.create_kv_cache(None, busy_tokens)  # 4 of the 6 slots, locked: A0's and A1's pages go first
    assert busy.resume() and busy.resize(len(busy_tokens))
    engine.step(busy, busy_tokens)
    fetched = manager.create_kv_cache(None, prompt)  # the two slots left get A0 and A1 again
    assert fetched.num_committed_tokens == 2 * TPB
    manager.check_invariants()
    busy.close()
    assert fetched.resume()
    engine.check(fetched, prompt)
    fetched.close()
    assert serve(manager, engine, prompt) == 3 * TPB  # now with room for A2 too
    assert serve(manager, engine, other) == 3 * TPB  # B2 from the store; the other prompt's blocks carry their own content
    writer.shutdown()
    manager.shutdown()


class AnsweringStoreConfig:
    """Opens in-memory stores whose ``get_batch`` / ``exists_batch`` answers are rewritten by ``answer``."""

    def __init__(self, inner: MemoryStoreConfig, get_answer: str = "", exists_answer: str = "") -> None:
        self.inner = inner
        self.get_answer = get_answer
        self.exists_answer = exists_answer
        self.removed: list[str] = []

    def open(self, quota: int) -> RemoteStore:
        return AnsweringStore(self.inner.open(quota), self)


class Unreadable(list[object]):
    """A list of results whose iteration raises (a backend's own result type gone wrong)."""

    def __iter__(self) -> Iterator[object]:
        raise RuntimeError("these results cannot be read")


def rewritten(results: list[object], how: str) -> object:
    if how == "unreadable":
        return Unreadable(results)
    if how == "nan":
        return [float("nan")] * len(results)
    if how == "bools":
        return [True] * len(results)
    if how == "huge":
        return [10**30] * len(results)
    if how == "negative":  # an error code the tier does not know
        return [-7] * len(results)
    if how == "short":
        return results[:-1]
    if how == "long":
        return results + results
    if how == "strings":
        return [str(result) for result in results]
    if how == "none":
        return None
    return results


class AnsweringStore:
    def __init__(self, inner: RemoteStore, config: AnsweringStoreConfig) -> None:
        self.inner = inner
        self.config = config

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        return self.inner.put_batch(keys, buffers)

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        answer: list[int] = rewritten(list(self.inner.get_batch(keys, buffers)), self.config.get_answer)  # type: ignore[assignment]
        return answer

    def exists_batch(self, keys: list[str]) -> list[bool]:
        answer: list[bool] = rewritten(list(self.inner.exists_batch(keys)), self.config.exists_answer)  # type: ignore[assignment]
        return answer

    def remove_batch(self, keys: list[str]) -> list[bool]:
        self.config.removed.extend(keys)
        return self.inner.remove_batch(keys)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize(("get_answer", "exists_answer", "fetched"), [
    ("short", "", 3), ("long", "", 4), ("strings", "", 0), ("none", "", 0),
    ("", "short", 3), ("", "long", 4), ("", "strings", 0), ("", "none", 0),
    ("unreadable", "", 0), ("nan", "", 0), ("bools", "", 0), ("huge", "", 0), ("negative", "", 0),
    ("", "unreadable", 0), ("", "nan", 0),
])
def test_a_store_answering_too_few_too_many_or_wrong_results_loses_no_slot(
    get_answer: str, exists_answer: str, fetched: int,
) -> None:
    """Item 13. A missing result is a failed fetch (its slot freed), a surplus is ignored, a wrong type is a
    failure: each counted and warned about, the prefix served as far as the well-answered pages go. None of
    those answers is an object read back wrong: the store keeps every object."""
    store = MemoryStoreConfig()
    prompt = tokens_of(7, 4 * TPB + 3)
    writer = manager_over(store, 16)
    serve(writer, FakeEngine(writer), prompt)
    answering = AnsweringStoreConfig(store, get_answer, exists_answer)
    reader = manager_over(answering, 16)
    assert serve(reader, FakeEngine(reader), prompt) == fetched * TPB
    assert answering.removed == []
    stats = reader.get_remote_tier_statistics()
    assert stats is not None and stats.fetched_pages == fetched and stats.warnings >= 1
    assert stats.fetch_failures == (
        4 - fetched if get_answer in ("short", "strings", "none", "nan", "bools", "unreadable") else 0
    )
    assert stats.rejected_pages == (4 if get_answer in ("huge", "negative") else 0)  # not the object's length
    # A page whose lookup was not answered (a missing or non-bool result, an answer that cannot be read) is a
    # failure, not a miss. Before, such pages were counted nowhere but in ``warnings``.
    assert stats.probe_failures == {"short": 1, "strings": 4, "none": 4, "unreadable": 4, "nan": 4}.get(exists_answer, 0)
    assert stats.probed_pages >= 4
    reader.check_invariants()  # among them: used + free slots == slots in every tier and pool group
    writer.shutdown()
    reader.shutdown()


def test_a_failed_fill_leaves_the_partial_block_of_the_local_match() -> None:
    """Found by the fuzzer: locally the prompt matches 3 tokens of a cached block (partial reuse); the store has
    the prompt's blocks but every read fails, and the GPU tier is full. Making room for the fill used to evict the
    page the partial match needed: the cache reused nothing though ``probe_reuse`` had said 3 tokens."""
    store = MemoryStoreConfig()
    prompt = tokens_of(20, 2 * TPB + 1)
    writer = manager_over(store, 16)
    serve(writer, FakeEngine(writer), prompt)  # the prompt's two blocks in the store
    reader = manager_over(AnsweringStoreConfig(store, get_answer="none"), 6)
    engine = FakeEngine(reader)
    serve(reader, engine, prompt[:3] + tokens_of(21, TPB - 3 + 1))  # a block sharing 3 tokens, and a partial one
    busy_tokens = tokens_of(22, 4 * TPB)
    busy = reader.create_kv_cache(None, busy_tokens)  # the other 4 slots, locked
    assert busy.resume() and busy.resize(len(busy_tokens))
    assert reader.probe_reuse(None, prompt) == 3
    cache = reader.create_kv_cache(None, prompt)
    assert cache.num_committed_tokens == 3
    busy.close()
    assert cache.resume()
    engine.check(cache, prompt)
    cache.close()
    reader.check_invariants()
    writer.shutdown()
    reader.shutdown()


def test_a_fill_that_failed_in_part_does_not_hide_a_partial_match() -> None:
    """Found by the fuzzer: the prompt's one full block is fetched for the full layer while its windowed layer's
    page fails (the store answers one result short); that block, unusable without it, used to hide the 3-token
    partial match of its sibling, so the cache reused nothing though ``probe_reuse`` had said 3 tokens."""
    store = MemoryStoreConfig()
    prompt = tokens_of(30, TPB + 1)
    layers = [attention(0, 512), attention(1, 512, window=32)]

    def manager(backend: object) -> KVCacheManager:
        remote = RemoteCacheTierConfig(0, backend, namespace="windowed")  # type: ignore[arg-type]
        return KVCacheManager(make_config(layers, tiers=[GpuCacheTierConfig(64 * KIB), remote], tokens_per_block=TPB))

    writer = manager(store)
    serve(writer, FakeEngine(writer), prompt)
    reader = manager(AnsweringStoreConfig(store, get_answer="short"))
    engine = FakeEngine(reader)
    serve(reader, engine, prompt[:3] + tokens_of(31, TPB - 3 + 1))
    assert reader.probe_reuse(None, prompt) == 3
    cache = reader.create_kv_cache(None, prompt)
    stats = reader.get_remote_tier_statistics()
    assert stats is not None and stats.fetched_pages == 1 and stats.fetch_failures == 1
    assert cache.num_committed_tokens == 3
    assert cache.resume()
    engine.check(cache, prompt)
    cache.close()
    reader.check_invariants()
    writer.shutdown()
    reader.shutdown()


def test_pages_are_stored_again_after_the_store_restarted_empty() -> None:
    """Decided: a store that lost its objects gets them again. The tier used to skip every key it had stored
    once, so after a restart the shared prefix stayed out of the store for good."""
    store = MemoryStoreConfig()
    prompt = tokens_of(8, 3 * TPB + 1)
    writer = manager_over(store, 4)
    engine = FakeEngine(writer)
    serve(writer, engine, prompt)
    assert len(store.objects) == 3
    store.restart()
    for seed in (9, 10):  # push the prompt's pages out of the only local tier: recomputed below
        serve(writer, engine, tokens_of(seed, 3 * TPB + 1))
    assert serve(writer, engine, prompt) == 0
    assert len(store.objects) >= 3
    reader = manager_over(store, 16)
    assert serve(reader, FakeEngine(reader), prompt) == 3 * TPB
    writer.shutdown()
    reader.shutdown()


def test_tensor_parallel_ranks_never_read_each_others_pages() -> None:
    """Decided: ranks of one tensor-parallel group hold different heads in pages of the same shape, so the rank
    and the group's size are part of the key; equal ranks of two groups of one size still share. Before the size
    was in the key, rank 1 of a group of 4 read the pages rank 1 of a group of 2 stored (with 2 KV heads, rank 1
    of 4 holds head 0 and rank 1 of 2 head 1)."""
    store = MemoryStoreConfig()
    prompt = tokens_of(11, 2 * TPB + 1)

    def rank_manager(rank: int, size: int = 2) -> KVCacheManager:
        remote = RemoteCacheTierConfig(0, store, "model/fp16", tensor_parallel_rank=rank, tensor_parallel_size=size)
        return KVCacheManager(make_config(
            [attention(0, 512)], tiers=[GpuCacheTierConfig(16 * 1024), remote], tokens_per_block=TPB,
        ))

    rank0, rank1, rank1_of_4, rank1_elsewhere = rank_manager(0), rank_manager(1), rank_manager(1, 4), rank_manager(1)
    alone = rank_manager(0, 1)  # a group of one keeps its former keys: those must not be rank 0 of 2's either
    serve(rank0, FakeEngine(rank0), prompt)
    assert serve(alone, FakeEngine(alone), prompt) == 0
    assert serve(rank1, FakeEngine(rank1), prompt) == 0
    assert serve(rank1_of_4, FakeEngine(rank1_of_4), prompt) == 0
    assert serve(rank1_elsewhere, FakeEngine(rank1_elsewhere), prompt) == 2 * TPB
    with pytest.raises(ValueError, match="tensor_parallel_rank"):
        RemoteCacheTierConfig(0, store, "m", tensor_parallel_rank=-1)
    with pytest.raises(ValueError, match=r"tensor_parallel_rank must be in \[0, tensor_parallel_size\) = \[0, 1\), got 1"):
        RemoteCacheTierConfig(0, store, "m", tensor_parallel_rank=1)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        RemoteCacheTierConfig(0, store, "m", tensor_parallel_size=0)
    for manager in (rank0, rank1, rank1_of_4, rank1_elsewhere, alone):
        manager.shutdown()
