"""The simulator's content check sees what real K/V depends on: the whole prefix and the reuse scope. The FakeEngine's
records depend on a token and its position only, so the simulator hands it ``check_codes`` (``ContextualTokens``):
a page computed for another prompt or scope fails the check even where it holds the same tokens at the same
positions (the shape of a remote fetch that once served one prompt another prompt's KV)."""

from __future__ import annotations

import numpy as np
import pytest

from kv_cache_manager_v2 import KVCache, KVCacheManager
from kv_cache_manager_v2.sim.scheduler import SimulatedBatchRequest
from kv_cache_manager_v2.sim.workload import TraceRequest
from kv_cache_manager_v2.testing import ContentError, FakeEngine
from tests.helpers import attention, make_config

TPB = 32


def computed(manager: KVCacheManager, engine: FakeEngine, request: SimulatedBatchRequest, written: list[int]) -> KVCache:
    cache = manager.create_kv_cache(request.scope)
    assert cache.resume() and cache.resize(len(request.tokens))
    engine.step(cache, written)
    assert cache.resize(len(request.tokens), len(request.tokens))  # every token is history: the check reads it
    return cache


def copy_block(manager: KVCacheManager, source: KVCache, target: KVCache, ordinal: int) -> None:
    """What a wrong match would do: the target's block ``ordinal`` gets the source's bytes."""
    for role in ("key", "value"):
        pages = np.from_dlpack(manager.get_page_view(0, role))
        rows = manager.get_page_index_converter(0, role)
        pages[rows(target.get_base_page_indices(0))[ordinal]] = pages[rows(source.get_base_page_indices(0))[ordinal]]


@pytest.mark.parametrize("difference", ["prefix", "scope"])
@pytest.mark.parametrize("records", ["tokens", "check_codes"])
def test_a_page_of_another_prefix_or_scope_holding_the_same_tokens_fails_the_check(difference: str, records: str) -> None:
    manager = KVCacheManager(make_config([attention(0)], tokens_per_block=TPB))
    engine = FakeEngine(manager)
    second_block = list(range(1000, 1000 + TPB))
    first = TraceRequest(0, list(range(TPB)) + second_block, [7])
    # The same second block at the same positions, after another first block (or the same one, in another scope).
    other_prompt = list(range(500, 500 + TPB)) if difference == "prefix" else list(range(TPB))
    second = TraceRequest(1, other_prompt + second_block, [7])
    shared = difference == "prefix"  # a no-reuse run gives each request a scope of its own
    a, b = SimulatedBatchRequest(first, shared), SimulatedBatchRequest(second, shared)
    written_a, written_b = (a.tokens, b.tokens) if records == "tokens" else (a.check_codes, b.check_codes)
    cache_a, cache_b = computed(manager, engine, a, written_a), computed(manager, engine, b, written_b)
    engine.check(cache_b, written_b)
    copy_block(manager, cache_a, cache_b, 1)
    if records == "tokens":
        engine.check(cache_b, written_b)  # the token-and-position records cannot tell
    else:
        with pytest.raises(ContentError, match=r"wrong content at positions \[32, 33, "):
            engine.check(cache_b, written_b)
    cache_a.close()
    cache_b.close()
    manager.shutdown()
