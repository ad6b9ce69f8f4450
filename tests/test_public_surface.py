"""Issue #39: the public classes name only API. Internal collaborators are reached through the internal API
(``_introspection.internals_of`` / ``state_of``), never as attributes of the objects an engine holds."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import KVCache, KVCacheEventManager, KVCacheManager
from kv_cache_manager_v2.disagg import TransferPlan
from kv_cache_manager_v2._introspection import check_alive, internals_of, state_of
from kv_cache_manager_v2._cache.kv_cache import CacheState
from kv_cache_manager_v2._pages.page_store import PageStore
from kv_cache_manager_v2._pages.radix_tree import RadixTree
from kv_cache_manager_v2._model.planning import QuotaPlanner
from tests.helpers import attention, make_config

MANAGER_INTERNALS = ("page_store", "radix_tree", "quota_planner", "services", "call_guard", "check_alive")


@pytest.mark.parametrize("name", MANAGER_INTERNALS)
def test_the_manager_has_no_public_internal_collaborator(name: str) -> None:
    assert not hasattr(KVCacheManager, name)


def test_a_cache_handle_has_no_public_state() -> None:
    assert not hasattr(KVCache, "state")


def test_handoff_and_event_classes_name_no_internal_helper() -> None:
    assert not hasattr(TransferPlan, "endpoints")  # disagg's execute reads them through endpoints_of
    assert not hasattr(KVCacheEventManager, "note_hook_error")  # the bridge calls note_hook_error(event_manager, error)


def test_the_internal_api_reaches_the_collaborators() -> None:
    manager = KVCacheManager(make_config([attention(0, 256)], gpu_quota=64 * 256 * 16, tokens_per_block=16))
    internals = internals_of(manager)
    assert isinstance(internals.store, PageStore) and isinstance(internals.tree, RadixTree)
    assert isinstance(internals.planner, QuotaPlanner) and internals.services.store is internals.store
    cache = manager.create_kv_cache(None, [1, 2, 3])
    assert isinstance(state_of(cache), CacheState) and state_of(cache).id == cache.id
    cache.close()
    check_alive(manager)
    manager.shutdown()
    with pytest.raises(ValueError, match="shut down"):
        check_alive(manager)
