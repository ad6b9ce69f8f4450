"""How much each request reuses in hybrid models, against an independent model (``tests/reuse_model.py``): seeded
random workloads (prompt families sharing a prefix, conversations whose next turn extends an earlier one, branches
inside and at the edge of blocks, suspended caches, evictions under small quotas) run through the real manager (cpu
backend, FakeEngine content checks, so a wrong page fails loudly) and the model; per request the reuse
(``num_committed_tokens`` of the new cache, ``probe_reuse``) and ``snapshot_points`` must agree, and after every
call the pages the KV events say are stored must be the ones the model stored (less what eviction removed)."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import KVCacheManager, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config, ssm
from tests.reuse_workload import SETUPS, run_workload


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_reuse_matches_the_model(name: str) -> None:
    for seed in range(5):
        run_workload(SETUPS[name], seed)


def test_a_narrow_page_dropped_without_an_event_leaves_the_model() -> None:
    # A page narrower than its block (a shorter sibling's, taken over) sends no KV event; a planned drop removed
    # one here and the model, which learnt removals from the events only, kept it: model 47, manager 45.
    run_workload(SETUPS["windows_scratch"], 4002, 150)


def serve(manager: KVCacheManager, engine: FakeEngine, tokens: list[int], drop_window: bool = False) -> int:
    """Admit, check, compute and commit ``tokens``, close; with ``drop_window`` the turn's window pages are then
    dropped (``plan_committed_block_drop``). How many tokens were reused."""
    cache = manager.create_kv_cache(None, tokens)
    reused = cache.num_committed_tokens
    assert manager.probe_reuse(None, tokens) == reused
    assert cache.resume() and cache.resize(len(tokens), reused)
    engine.step(cache, tokens)
    cache.commit(tokens[reused:])
    cache.stop_committing()
    plan = cache.plan_committed_block_drop() if drop_window else None
    cache.close()
    if plan is not None:
        plan.drop()
    return reused


@pytest.mark.parametrize("lacking_shares", [1, 2])
def test_a_partial_match_copies_from_a_sibling_with_every_groups_rows(lacking_shares: int) -> None:
    # Found by the seeded workloads (full_window_evicting): at the first mismatch the match took the child sharing
    # the most tokens (the first on a tie) even where that child had lost its window page, and fell back to a
    # block boundary, while a sibling sharing the request's next token had every layer group's rows.
    config = make_config([attention(0, 256), attention(1, 256, window=8)], tokens_per_block=4)
    manager = KVCacheManager(config)
    engine = FakeEngine(manager)
    prefix = list(range(1, 9))  # two blocks
    lacking = prefix + [50, 51, 52, 53][:lacking_shares] + [60, 61, 62, 63][lacking_shares:]
    serve(manager, engine, lacking, drop_window=True)  # the last two blocks lose their window pages
    assert serve(manager, engine, prefix + [50, 70, 71, 72]) == 4  # recomputes block 1 (its window page back)
    request = prefix + [50, 51, 80, 81]
    # Each child of block 1 shares the request's next token(s); only the second holds window rows for it.
    assert manager.probe_reuse(None, request) == 9
    assert serve(manager, engine, request) == 9


@pytest.mark.parametrize("goes_on", [True, False])
def test_a_snapshot_saved_inside_a_block_is_a_reuse_point_without_partial_reuse(goes_on: bool) -> None:
    # Found by the seeded workloads (full_ssm with commit(save_ssm_snapshot=True)): with partial reuse off (the
    # default with SSM layers) a saved snapshot inside a block went on a short tree block without attention rows,
    # while a short block is reused whole with its own rows only, so the saved point served no request (and its
    # slot stayed taken); a request starting with the saved tokens recomputed them.
    layers: list[LayerConfig] = [attention(0, 256), ssm(1, KIB, KIB // 4), attention(2, 256, window=6)]
    manager = KVCacheManager(make_config(layers, tokens_per_block=4, ssm_reuse_interval=8))
    engine = FakeEngine(manager)
    tokens = list(range(100, 130))
    cache = manager.create_kv_cache(None, tokens[:14])
    assert cache.resume()
    for end, save in ((14, False), (18, True), (30, False)):
        if end == 30 and not goes_on:
            break
        assert cache.resize(end, cache.history_length)
        engine.step(cache, tokens)
        cache.commit(tokens[cache.num_committed_tokens : end], save_ssm_snapshot=save)
        if save:
            assert manager.probe_reuse(None, tokens[:18] + [1, 2]) == 18  # while the cache lives on
    cache.close()
    longer = tokens[:18] + [7, 8, 9]
    assert manager.probe_reuse(None, longer) == 18
    assert serve(manager, engine, longer) == 18  # the FakeEngine checks the reused rows and states
