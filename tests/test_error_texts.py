"""Error texts engines match on (TensorRT-LLM's wording): the call refused is named with its parentheses, open
caches are counted, bad pool ratios say which rule they broke; a refused call changes nothing."""

from __future__ import annotations

from typing import Callable

import pytest

from kv_cache_manager_v2 import COMPILED, KVCacheManager
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, compute_prompt, make_config


def test_clear_and_shutdown_name_the_call_and_count_open_caches() -> None:
    manager = KVCacheManager(make_config([attention(0, 2 * KIB)]))
    engine = FakeEngine(manager)
    tokens = list(range(64))
    caches = [compute_prompt(manager, engine, tokens)]
    caches += [manager.create_kv_cache(None, [1, 2, 3]) for _ in range(2)]
    with pytest.raises(RuntimeError) as cleared:
        manager.clear_reusable_blocks()
    assert "clear_reusable_blocks()" in str(cleared.value)
    assert "3 KV cache(s) still open" in str(cleared.value)
    with pytest.raises(RuntimeError) as shut:
        manager.shutdown()
    assert "shutdown()" in str(shut.value) and "3 KV cache(s) still open" in str(shut.value)
    for cache in caches:
        cache.close()
    assert manager.probe_reuse(None, tokens) == 64  # the refused calls cleared nothing
    manager.shutdown()


def test_pool_ratio_of_the_wrong_length_says_length() -> None:
    with pytest.raises(ValueError, match="initial_pool_ratio length must match the number of layer groups"):
        KVCacheManager(make_config([attention(0), attention(1, window=64)], initial_pool_ratio=[1.0]))


@pytest.mark.parametrize("weights", [[0.0, 1.0], [1.5, -0.5]])
def test_pool_ratio_weights_must_be_positive(weights: list[float]) -> None:
    with pytest.raises(ValueError, match="initial_pool_ratio values must be positive"):
        make_config([attention(0), attention(1, window=64)], initial_pool_ratio=weights)


def test_tokens_passed_where_the_reuse_scope_goes_say_where_tokens_go() -> None:
    """``create_kv_cache(prompt)`` is the first call an engine author writes, but ``reuse_scope`` comes first (as in
    TensorRT-LLM): the TypeError names the parameter tokens belong to, in every call taking a scope, and the
    refused call changes nothing."""
    import numpy as np

    from kv_cache_manager_v2 import KVCacheRequest, sequence_to_blockchain_keys

    manager = KVCacheManager(make_config([attention(0, 2 * KIB)]))
    prompt = [1, 2, 3]
    calls: list[Callable[[], object]] = [
        lambda: manager.create_kv_cache(prompt),  # type: ignore[arg-type]
        lambda: manager.create_kv_cache(np.array(prompt)),  # type: ignore[arg-type]
        lambda: manager.probe_reuse(prompt),  # type: ignore[arg-type]
        lambda: manager.prefetch_remote(prompt),  # type: ignore[arg-type]
        lambda: list(sequence_to_blockchain_keys(32, prompt, prompt)),  # type: ignore[arg-type]
        lambda: KVCacheRequest(prompt, prompt),  # type: ignore[arg-type]
    ]
    # Compiled, a parameter typed ReuseScope | None is refused by mypyc's own TypeError before the body runs
    # ("... ReuseScope ... expected"), as test_bad_inputs.py notes for other typed parameters.
    words = "ReuseScope" if COMPILED else r"reuse_scope must be a ReuseScope or None, got .*: tokens go in input_tokens"
    for call in calls:
        with pytest.raises(TypeError, match=words):
            call()
    assert manager.num_live_caches == 0
    manager.shutdown()


def test_committing_the_whole_sequence_over_a_reused_prefix_says_commit_appends() -> None:
    """adopt11v: a vLLM-style engine commits the request's whole token list, as vLLM's cache_blocks takes it; the
    error told it to resize, which would have filed the reused prefix a second time. It names the slice to pass,
    and the refused commit changes nothing."""
    manager = KVCacheManager(make_config([attention(0, 2 * KIB)]))
    engine = FakeEngine(manager)
    prompt = list(range(100, 140))
    compute_prompt(manager, engine, prompt).close()
    turn = prompt + [7] * 8
    cache = manager.create_kv_cache(None, turn)
    assert cache.resume() and cache.resize(len(turn))
    engine.step(cache, turn)
    with pytest.raises(ValueError, match=r"commit appends after num_committed_tokens: .*tokens\[40:end\]"):
        cache.commit(turn)
    assert (cache.num_committed_tokens, cache.history_length, cache.capacity) == (40, 40, 48)
    cache.commit(turn[cache.num_committed_tokens :])
    cache.close()
    assert manager.probe_reuse(None, turn) == 48
    manager.shutdown()
