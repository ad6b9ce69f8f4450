"""Snapshots the engine asks for (issue #37, TensorRT-LLM's older keywords): ``commit(save_ssm_snapshot=True)`` and
``stop_committing(save_last_ssm_snapshot=True)`` snapshot the SSM states at the committed length, inside a block
too; without partial reuse such a short last block is reused whole by a request starting with all its tokens."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import KVCacheManager, _introspection
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config, ssm

TPB = 8


def manager_with(partial_reuse: bool = False) -> KVCacheManager:
    layers: list[LayerConfig] = [attention(0, 2 * KIB), ssm(1)]
    return KVCacheManager(make_config(layers, tokens_per_block=TPB, enable_partial_reuse=partial_reuse,
                                      ssm_reuse_interval=0, mamba_save_last_snapshot=True,
                                      snapshot_prefill_chunks=False))


def tokens_from(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 104_729) % 50_000 for i in range(length)]


def commit_and_stop(manager: KVCacheManager, tokens: list[int], save_last: bool) -> None:
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens)
    cache.stop_committing(save_last_ssm_snapshot=save_last)
    cache.close()


@pytest.mark.parametrize("partial_reuse", [False, True])
def test_a_saved_last_snapshot_inside_a_block_is_reused_whole(partial_reuse: bool) -> None:
    manager = manager_with(partial_reuse)
    prompt = tokens_from(1, 2 * TPB + 3)
    commit_and_stop(manager, prompt, save_last=True)
    assert manager.probe_reuse(None, prompt) == len(prompt)
    assert manager.probe_reuse(None, prompt + tokens_from(2, 5)) == len(prompt)
    assert manager.probe_reuse(None, prompt[:-1]) == 0  # no snapshot at 18, nor at a block end
    manager.shutdown()


@pytest.mark.parametrize("partial_reuse", [False, True])
def test_an_unsaved_trailing_snapshot_serves_a_longer_request_only_with_partial_reuse(partial_reuse: bool) -> None:
    manager = manager_with(partial_reuse)
    prompt = tokens_from(3, 2 * TPB + 3)
    commit_and_stop(manager, prompt, save_last=False)  # the commits' end is a snapshot point: snapshot at 19
    assert manager.probe_reuse(None, prompt) == len(prompt)  # exactly its tokens: not reuse inside a block
    assert manager.probe_reuse(None, prompt + tokens_from(10, 5)) == (len(prompt) if partial_reuse else 0)
    manager.shutdown()


def test_a_short_snapshot_block_serves_a_request_whose_full_block_has_no_snapshot() -> None:
    manager = manager_with()
    shared, tail = tokens_from(4, TPB), tokens_from(5, TPB)
    commit_and_stop(manager, shared + tail + tokens_from(6, 3), save_last=True)  # snapshot at 19 only
    commit_and_stop(manager, shared + tail[:3], save_last=True)  # snapshot at 11, beside the full block
    assert manager.probe_reuse(None, shared + tail) == TPB + 3
    manager.shutdown()


def test_commit_can_save_a_snapshot_before_the_prompt_ends() -> None:
    manager = manager_with()
    prefix = tokens_from(7, TPB + 3)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(len(prefix))
    cache.commit(prefix, save_ssm_snapshot=True)
    assert cache.resize(2 * TPB, 2 * TPB)
    cache.close()
    assert manager.probe_reuse(None, prefix + tokens_from(8, 5)) == len(prefix)
    manager.shutdown()


def test_a_snapshot_request_short_of_the_computed_tokens_is_refused_changing_nothing() -> None:
    manager = manager_with()
    prompt = tokens_from(9, TPB + 3)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(len(prompt) + 2)
    with pytest.raises(ValueError, match="save_ssm_snapshot"):
        cache.commit(prompt, save_ssm_snapshot=True)
    assert cache.num_committed_tokens == 0
    cache.commit(prompt)
    with pytest.raises(ValueError, match="save_last_ssm_snapshot"):
        cache.stop_committing(save_last_ssm_snapshot=True)
    assert not cache.is_committing_stopped
    with pytest.raises(TypeError):  # compiled: mypyc's own message for a non-bool
        cache.stop_committing(save_last_ssm_snapshot=1)  # type: ignore[arg-type]
    cache.close()
    manager.shutdown()


def test_closing_hands_the_live_state_to_the_trailing_block_without_a_copy() -> None:
    manager = manager_with(partial_reuse=True)
    prompt = tokens_from(10, TPB + 3)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(len(prompt))
    ssm_group = _introspection.ssm_life_cycle_id(manager)
    assert ssm_group is not None
    live_slot = cache.get_ssm_block_base_index(ssm_group)
    cache.commit(prompt, is_end=True)
    cache.close()
    length, pages = _introspection.reuse_match_pages(manager, None, prompt, ssm_group, manager.enable_partial_match)
    assert length == len(prompt)
    assert pages[-1] is not None and pages[-1][0] == live_slot  # the live slot itself, now the tail's snapshot
    assert manager.probe_reuse(None, prompt) == len(prompt)
    manager.shutdown()


def test_stop_committing_publishes_the_trailing_block_while_the_cache_goes_on() -> None:
    manager = manager_with()
    prompt = tokens_from(11, TPB + 3)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(len(prompt))
    cache.commit(prompt)
    assert manager.probe_reuse(None, prompt) == 0  # before: only the cache's own pages hold the tail
    cache.stop_committing()
    assert manager.probe_reuse(None, prompt) == len(prompt)  # copies of its rows and of the live state
    attention_group = manager.get_layer_group_id(0)
    tail_slot = cache.get_base_page_indices(attention_group)[1]
    length, pages = _introspection.reuse_match_pages(manager, None, prompt, attention_group, False)
    assert length == len(prompt) and len(pages) == 2  # without partial matching, a partial block of exactly the rest
    assert pages[-1] is not None and pages[-1][0] != tail_slot  # the cache keeps its own page to write on
    assert cache.resize(len(prompt) + 4, len(prompt) + 4)  # it goes on computing past the committed tokens
    cache.close()
    assert manager.probe_reuse(None, prompt) == len(prompt)
    manager.shutdown()


@pytest.mark.parametrize("partial_reuse", [False, True])
def test_a_tail_published_by_stop_committing_holds_the_state_at_the_stop(partial_reuse: bool) -> None:
    manager = manager_with(partial_reuse)
    engine = FakeEngine(manager)
    tokens = tokens_from(12, 3 * TPB)
    stop = TPB + 3
    first = manager.create_kv_cache()
    assert first.resume() and first.resize(stop)
    engine.step(first, tokens)
    first.commit(tokens[:stop])
    first.stop_committing()
    assert first.resize(len(tokens), stop)  # decoding on, uncommitted, in the same block's page and live state
    engine.step(first, tokens)
    second = manager.create_kv_cache(None, tokens[:stop])
    assert second.num_committed_tokens == stop
    assert second.resume() and second.resize(len(tokens), stop)
    engine.step(second, tokens)  # checks the reused rows and SSM state against the first `stop` tokens
    first.close()
    second.close()
    manager.shutdown()
