"""Partial reuse in hybrid models (issue #37): a reuse may end inside a block only where an SSM snapshot ends exactly
there, so a request diverging inside a snapshot interval starts from the last snapshot at or before the divergence.
The FakeEngine checks the reused SSM states and attention rows by content."""

from __future__ import annotations

from typing import Any, Sequence

import pytest

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config, ssm

TPB = 32


def hybrid() -> list[LayerConfig]:
    return [ssm(0), attention(1, 2 * KIB), ssm(2), attention(3, 2 * KIB, window=64)]


def tokens_from(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 104_729) % 50_000 for i in range(length)]


def manager_with(**snapshots: Any) -> tuple[KVCacheManager, FakeEngine]:
    manager = KVCacheManager(make_config(hybrid(), tokens_per_block=TPB, enable_partial_reuse=True, **snapshots))
    return manager, FakeEngine(manager)


def run(
    manager: KVCacheManager,
    engine: FakeEngine,
    tokens: Sequence[int],
    stops: Sequence[int] = (),
    snapshot_at: Sequence[int] = (),
) -> int:
    """Admit ``tokens``, check the reused prefix by content, compute and commit the rest one chunk per stop, check
    again and close; how many tokens were reused."""
    cache = manager.create_kv_cache(None, list(tokens), snapshot_at=snapshot_at)
    reused = cache.num_committed_tokens
    assert manager.probe_reuse(None, list(tokens)) == reused
    assert cache.resume()
    engine.check(cache, tokens)  # the SSM states and attention rows of the reused prefix are exactly these tokens'
    for end in [stop for stop in stops if stop > reused] + [len(tokens)]:
        if end <= cache.history_length:
            continue
        assert cache.resize(end, cache.history_length)
        engine.step(cache, tokens)
        cache.commit(list(tokens[cache.num_committed_tokens : end]))
    engine.check(cache, tokens)
    cache.close()
    return reused


def test_divergence_inside_a_snapshot_interval_reuses_up_to_the_last_snapshot_before_it() -> None:
    manager, engine = manager_with(ssm_reuse_interval=64, snapshot_prefill_chunks=False)
    first = tokens_from(1, 200)
    run(manager, engine, first, stops=(64, 128))  # snapshots at 64 and 128 only
    fork = first[:100] + tokens_from(2, 60)  # attention alone could reuse 100 tokens (a partial block)
    assert run(manager, engine, fork) == 64
    later_fork = first[:150] + tokens_from(3, 30)
    assert run(manager, engine, later_fork) == 128


def test_divergence_exactly_at_a_snapshot_reuses_all_of_it() -> None:
    manager, engine = manager_with(ssm_reuse_interval=64, snapshot_prefill_chunks=False)
    first = tokens_from(1, 200)
    run(manager, engine, first, stops=(64, 128))
    assert run(manager, engine, first[:128] + tokens_from(4, 40)) == 128


def test_forks_in_the_same_block_reuse_the_snapshot_at_or_before_the_fork() -> None:
    manager, engine = manager_with(commit_min_snapshot=True)
    prompt = tokens_from(5, 64)
    for length, expected in ((10, 0), (20, 10), (25, 20)):  # each turn extends the last one inside block 0
        assert run(manager, engine, prompt[:length]) == expected
    assert run(manager, engine, prompt[:25]) == 25  # the exact partial block
    assert run(manager, engine, prompt[:15] + tokens_from(6, 20)) == 10  # the state at 20 is past the fork
    assert run(manager, engine, prompt[:22] + tokens_from(7, 20)) == 20
    assert run(manager, engine, prompt[:5] + tokens_from(8, 20)) == 0


def test_a_snapshot_declared_inside_a_block_is_a_reuse_point_after_the_cache_moves_on() -> None:
    manager, engine = manager_with(snapshot_prefill_chunks=False, ssm_reuse_interval=0, commit_min_snapshot=True)
    first = tokens_from(9, 130)
    cache = manager.create_kv_cache(None, first, snapshot_at=[100])
    # The block boundary below, the point itself, and the prompt's last full block (commit_min_snapshot).
    assert cache.snapshot_points == (96, 100, 128)
    cache.close()
    run(manager, engine, first, stops=(100,), snapshot_at=[100])  # goes on to 130 past the point
    # The snapshot at 100 sits on a partial block of its own; the attention rows come from the full block 96..128.
    assert run(manager, engine, first[:110] + tokens_from(10, 20)) == 100


def test_the_end_of_a_prefill_chunk_inside_a_block_is_a_reuse_point() -> None:
    manager, engine = manager_with(ssm_reuse_interval=0)  # snapshot_prefill_chunks is on by default
    system = tokens_from(11, 70)
    run(manager, engine, system)  # one chunk ending at 70, inside block 2
    assert run(manager, engine, system + tokens_from(12, 30)) == 70


def test_without_a_snapshot_in_the_block_no_state_past_the_last_one_is_reused() -> None:
    manager, engine = manager_with(ssm_reuse_interval=64, snapshot_prefill_chunks=False)
    first = tokens_from(13, 110)
    run(manager, engine, first, stops=(64, 100))  # 100 and 110 are no snapshot points
    assert run(manager, engine, first[:105] + tokens_from(14, 10)) == 64
    assert run(manager, engine, first) == 64  # the whole of it: still the last snapshot


def test_partial_reuse_off_keeps_reuse_on_snapshot_block_boundaries() -> None:
    manager = KVCacheManager(make_config(hybrid(), tokens_per_block=TPB, commit_min_snapshot=True))
    engine = FakeEngine(manager)
    prompt = tokens_from(15, 64)
    run(manager, engine, prompt[:48], stops=(32,))
    assert manager.probe_reuse(None, prompt) == 32  # no snapshot inside a block: the one at 32


def test_debug_mode_checks_every_step_of_a_same_block_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_CACHE_MANAGER_V2_DEBUG", "1")  # every invariant after each state-changing call
    manager, engine = manager_with(commit_min_snapshot=True)
    prompt = tokens_from(16, 100)
    run(manager, engine, prompt[:70], stops=(40,))
    assert run(manager, engine, prompt[:50] + tokens_from(17, 20)) == 40
    assert run(manager, engine, prompt[:80] + tokens_from(18, 20)) == 70
    manager.clear_reusable_blocks()
    assert manager.probe_reuse(None, prompt) == 0


def test_a_planned_drop_of_a_turn_ending_inside_a_block_drops_that_snapshot() -> None:
    layers: list[LayerConfig] = [ssm(0), attention(1, 2 * KIB)]  # no window: the plan drops only the SSM endpoint
    config = make_config(layers, tokens_per_block=TPB, enable_partial_reuse=True, ssm_reuse_interval=32)
    manager = KVCacheManager(config)
    engine = FakeEngine(manager)
    prompt = tokens_from(19, 70)
    run(manager, engine, prompt, stops=(32,))  # snapshots at 32 and (the prompt's end) 70
    again = manager.create_kv_cache(None, prompt)
    assert again.num_committed_tokens == 70
    again.stop_committing()
    handle = again.plan_committed_block_drop()
    again.close()
    assert handle is not None
    handle.drop()
    assert manager.probe_reuse(None, prompt) == 32  # the turn's end is gone, the earlier snapshot stays
