"""What a user can observe of a manager, compared before and after a call that must change nothing, and the
check that a documented invalid move raises ``ValueError``. ``tests/test_bad_inputs.py`` (its world,
``tests/bad_input_world.py``) uses them too."""

from __future__ import annotations

from typing import Callable, Sequence

from kv_cache_manager_v2 import KVCacheManager, KVCacheStatus, ReuseScope, _KVCache
from tests.fuzz.model import Token

def expect_value_error(call: Callable[[], object], what: str) -> None:
    """``call`` must raise ValueError (anything else propagates: a bug)."""
    try:
        call()
    except ValueError:
        return
    raise AssertionError(f"{what}: expected ValueError, nothing was raised")


Probe = tuple[ReuseScope | None, list[Token]]


def snapshot(manager: KVCacheManager, caches: Sequence[_KVCache], probes: Sequence[Probe]) -> dict[str, object]:
    """Everything a user can observe of the manager and ``caches`` without changing it."""
    state: dict[str, object] = {}
    for cache in caches:
        entry: list[object] = [cache.status, cache.capacity, cache.history_length, cache.num_committed_tokens]
        entry.append(cache.is_committing_stopped)
        if cache.status != KVCacheStatus.CLOSED:
            entry.extend(list(cache.get_base_page_indices(lg)) for lg in range(manager.num_layer_groups))
        state[f"cache {cache.id}"] = entry
    for level in range(manager.num_cache_levels):
        state[f"statistics {level}"] = manager.get_storage_statistics(level)
        state[f"quota {level}"] = manager.get_quota(level)
    state["probes"] = [manager.probe_reuse(scope, tokens) for scope, tokens in probes]
    counters = manager.movement_counters
    state["movement"] = (
        counters.onboarded_pages,
        counters.onboarded_bytes,
        counters.offloaded_pages,
        counters.offloaded_bytes,
        counters.copied_pages,
        counters.dropped_pages,
    )
    state["live caches"] = manager.num_live_caches
    return state


def assert_unchanged(before: dict[str, object], after: dict[str, object], what: str) -> None:
    if before != after:
        keys = before.keys() | after.keys()
        diff = {key: (before.get(key), after.get(key)) for key in keys if before.get(key) != after.get(key)}
        raise AssertionError(f"{what} changed state: {diff}")
