"""Reuse the remote tier used to lose, content checked with FakeEngine: a local full block holding only a shorter
sibling's page (partial reuse) in one layer group no longer ends the prefix the store serves; a key this instance
remembers as stored is stored again once a get finds the store lost it. In-process store (the first also on
a real Mooncake master on loopback), cpu backend."""

from __future__ import annotations

from typing import Sequence

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, RemoteCacheTierConfig, RemoteStore
from kv_cache_manager_v2._base.remote_store import HostBuffer
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig, contextual_tokens
from tests.forwarding_store import ForwardingStore
from tests.helpers import attention, make_config
from tests.mooncake_helpers import cluster  # noqa: F401  (the fixture, for the Mooncake case)
from tests.test_remote_tier import stats_of

TPB = 16
# Full attention and a window of two blocks: no SSM layers, so partial reuse merges a partial block into a full
# sibling extending it (``partial_siblings.py``), one life cycle at a time.
LAYERS: list[LayerConfig] = [attention(0, 512), attention(1, 512, window=32)]
PROMPT = [5_000 + i for i in range(8 * TPB + 5)]  # eight full blocks and a partial one
K = 4  # the block of PROMPT the reader holds a shorter sibling's page of


def manager(backend: object, layers: Sequence[LayerConfig] = LAYERS) -> KVCacheManager:
    remote = RemoteCacheTierConfig(0, backend, namespace="gaps", retry_after_s=0.0)  # type: ignore[arg-type]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(1 << 20), remote]
    return KVCacheManager(make_config(layers, tiers=tiers, tokens_per_block=TPB))


def serve(manager: KVCacheManager, tokens: list[int]) -> int:
    """Admit ``tokens`` (what it reused checked against the one model's K/V), compute the rest, commit, close; the
    reused length."""
    engine = FakeEngine(manager)
    written = contextual_tokens(tokens, "model")
    cache = manager.create_kv_cache(None, tokens)
    reused = cache.num_committed_tokens
    assert cache.resume()
    engine.check(cache, written)
    assert cache.resize(len(tokens))
    engine.step(cache, written)
    cache.commit(tokens[reused:])
    cache.close()
    manager.check_invariants()
    return reused


@pytest.mark.parametrize("backend", ["memory", "mooncake"])
def test_a_full_block_holding_only_a_shorter_siblings_page_is_fetched_whole_and_still_serves_the_sibling(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """Instance A stores PROMPT. B first reads its first K + 3 blocks (the window group's pages of the last two only:
    block K gets none), then serves a prompt ending 8 tokens into block K: with partial reuse its window page of
    that partial block moves into block K, the full sibling lacking one. B then asks for K + 2 blocks of PROMPT:
    the window reads block K, whose page there covers 8 tokens; the store holds the whole page. It used to be
    neither probed nor counted, ending the servable prefix at K blocks (B reused 72 tokens, partially into block K,
    of the 101 the store serves); now it is fetched in its place, and the shorter prompt still reuses all it did."""
    store: object = MemoryStoreConfig() if backend == "memory" else request.getfixturevalue("cluster").config()
    writer = manager(store)
    assert serve(writer, PROMPT) == 0
    writer.shutdown()
    reader = manager(store)
    assert serve(reader, PROMPT[: (K + 3) * TPB]) == (K + 3) * TPB
    shorter = PROMPT[: K * TPB + 8]
    assert serve(reader, shorter) == K * TPB  # its window pages of blocks K - 2 and K - 1 fetched, block K computed
    before = stats_of(reader).fetched_pages
    asked = PROMPT[: (K + 2) * TPB + 5]
    assert serve(reader, asked) == len(asked)  # content checked: A's pages for these tokens
    assert stats_of(reader).fetched_pages == before + 1  # the window page of block K, no more
    assert serve(reader, shorter) == len(shorter)  # the whole page now serves the shorter prompt's 8 tokens
    reader.shutdown()


class LosingOnGet(ForwardingStore):
    """Loses ``key``, once set, between the probe that found it and the get."""

    def __init__(self, inner: RemoteStore) -> None:
        super().__init__(inner)
        self.key: str | None = None

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        if self.key in keys:
            self.inner.remove_batch([self.key])
            self.key = None
        return self.inner.get_batch(keys, buffers)


class LosingOnGetConfig:
    def __init__(self, inner: MemoryStoreConfig) -> None:
        self.inner = inner
        self.opened: list[LosingOnGet] = []

    def open(self, quota: int) -> RemoteStore:
        self.opened.append(LosingOnGet(self.inner.open(quota)))
        return self.opened[-1]


def test_a_stored_key_lost_before_its_get_is_stored_again_by_the_instance_that_stored_it() -> None:
    """B stores PROMPT (write-through), then drops it locally (nothing sent: the store has it); one of its objects
    goes between B's probe and its get. The fill's second plan probes it and misses: B forgets the keys it stored,
    so the page it recomputes is stored again and another instance reads every full block (the README's remote
    tier section)."""
    store = MemoryStoreConfig()
    config = LosingOnGetConfig(store)
    instance = manager(config)
    assert serve(instance, PROMPT) == 0
    instance.clear_reusable_blocks()
    full_blocks = len(PROMPT) // TPB * TPB
    assert serve(manager(store), PROMPT) == full_blocks  # the control: the store holds every full block
    lost = sorted(key for key in store.objects if "/lg0/" in key)[0]  # one full-attention page
    config.opened[0].key = lost
    reused = serve(instance, PROMPT)  # content checked
    assert reused < full_blocks and lost in store.objects, (reused, stats_of(instance))
    instance.shutdown()
    assert serve(manager(store), PROMPT) == full_blocks
