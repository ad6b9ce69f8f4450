"""``KVCacheEventManager`` when user code fails: an ``attention_dp_gather`` that raises loses no event (they go out
with the next flush), and a subclass hook that raises in the middle of a commit neither interrupts the commit nor
loses or repeats an event (its error comes out of the next flush)."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Sequence

import pytest

from kv_cache_manager_v2 import (
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    KVCacheEvent,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheStoredBlockData,
    KVCacheStoredData,
)
from kv_cache_manager_v2.config import CacheTierConfig
from tests.helpers import KIB, attention, make_config

TPB = 32


def test_events_of_a_failed_gather_go_out_with_the_next_flush() -> None:
    failures = ["once"]

    def gather(mine: list[KVCacheEvent]) -> list[list[KVCacheEvent]]:
        if failures:
            failures.pop()
            mine.clear()  # a gather that even spoils its argument before failing takes nothing
            raise ConnectionError("a rank is unreachable")
        return [mine]

    events = KVCacheEventManager(100, attention_dp_rank=0, attention_dp_gather=gather)
    events.add_removed_event(b"a" * 32)
    with pytest.raises(ConnectionError, match="unreachable"):
        events.flush_iteration_events()
    assert events.get_latest_events() == []
    events.add_removed_event(b"b" * 32)
    events.flush_iteration_events()
    latest = events.get_latest_events()
    assert [e.data.block_hashes for e in latest] == [[b"a" * 32], [b"b" * 32]]  # type: ignore[union-attr]
    assert [e.event_id for e in latest] == [0, 1]
    events.flush_iteration_events()  # nothing left to deliver twice
    assert events.get_latest_events() == []


class FailingHook(KVCacheEventManager):
    """Records every stored block it is given, and raises on the ``fail_at``-th one (after recording it)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(1000)
        self.fail_at = fail_at
        self.calls = 0

    def add_stored_event(
        self, parent_hash: bytes | None, blocks: Sequence[KVCacheStoredBlockData], layer_group_id: int | None = None
    ) -> None:
        super().add_stored_event(parent_hash, blocks, layer_group_id)
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"hook failed on call {self.calls}")


def test_a_hook_that_raises_mid_commit_leaves_the_commit_whole_and_the_error_for_the_flush() -> None:
    hook = FailingHook(fail_at=3)
    manager = KVCacheManager(make_config([attention(0, 2 * KIB)], tiers=[GpuCacheTierConfig(64 * 4 * KIB)]), event_manager=hook)
    tokens = list(range(8 * TPB))
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens)  # 8 blocks stored: the third hook call raises, the commit still completes
    assert cache.num_committed_tokens == len(tokens) and hook.calls == 8
    manager.check_invariants()
    with pytest.raises(RuntimeError, match="hook failed on call 3"):
        hook.flush_iteration_events()
    stored = [e for e in hook.get_latest_events() if isinstance(e.data, KVCacheStoredData)]  # delivered before the raise
    hashes = [block.block_hash for e in stored for block in e.data.blocks]  # type: ignore[union-attr]
    assert len(hashes) == 8 and len(set(hashes)) == 8  # each block once: none lost, none repeated
    hook.flush_iteration_events()  # the error was raised once
    cache.close()
    assert manager.probe_reuse(None, tokens) == len(tokens)  # the tree took every block
    manager.check_invariants()
    manager.shutdown()


class FailingAtConstruction(KVCacheEventManager):
    """A hook the manager calls while it is being built, raising ``error``."""

    def __init__(self, hook: str, error: BaseException) -> None:
        super().__init__(10)
        self.hook = hook
        self.error = error

    def set_layer_group_window_sizes(self, window_sizes: dict[int, int]) -> None:
        if self.hook == "set_layer_group_window_sizes":
            raise self.error
        super().set_layer_group_window_sizes(window_sizes)

    def add_created_event(
        self, num_blocks_per_cache_level: Sequence[int], layer_group_ids: Sequence[int] | None = None
    ) -> None:
        if self.hook == "add_created_event":
            raise self.error
        super().add_created_event(num_blocks_per_cache_level, layer_group_ids)


@pytest.mark.parametrize("hook", ["set_layer_group_window_sizes", "add_created_event"])
@pytest.mark.parametrize("error", [RuntimeError("hook"), KeyboardInterrupt()], ids=["exception", "interrupt"])
def test_a_hook_failing_while_the_manager_is_built_leaves_no_pool_file_open(
    tmp_path: Path, hook: str, error: BaseException
) -> None:
    """Before: the tiers already built were never closed (one disk pool descriptor left open per attempt)."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(1 << 20), DiskCacheTierConfig(1 << 20, str(tmp_path))]
    gc.collect()
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(type(error)):
        KVCacheManager(make_config([attention(0)], tiers=tiers), event_manager=FailingAtConstruction(hook, error))
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == open_before and os.listdir(tmp_path) == []
