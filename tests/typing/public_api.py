"""Typed usage of the public API, checked by ``mypy --strict`` (``tests/test_typing.py``); never executed.

Every ``# type: ignore[code]`` marks a line that must fail: with ``warn_unused_ignores`` (part of ``--strict``) an
ignore that mypy no longer needs is itself an error, so a type loosened back to ``object`` fails the check.
"""

from __future__ import annotations

from array import array
from typing import assert_type

import numpy as np
import numpy.typing as npt

from kv_cache_manager_v2 import (
    KVCache,
    KVCacheManager,
    KVCacheRequest,
    KVCacheStatus,
    MovementCounters,
    PageIndexConverter,
    ReuseScope,
    Token,
    TokenSequence,
    _KVCache,
)
from kv_cache_manager_v2.disagg import prepare_receiver


def tokens_accepted(manager: KVCacheManager, ids: npt.NDArray[np.int64], prompt: list[int]) -> None:
    assert_type(manager.create_kv_cache(None, prompt), KVCache)
    assert_type(manager.create_kv_cache(ReuseScope(lora_id=1), ids), KVCache)
    assert_type(manager.create_kv_cache(input_tokens=(1, 2, 3)), KVCache)
    assert_type(manager.create_kv_cache(), KVCache)
    multimodal: list[Token] = [b"image digest", 7, 8]
    assert_type(manager.probe_reuse(None, multimodal), int)
    assert_type(manager.probe_reuse(None, range(10)), int)
    assert_type(manager.probe_reuse(None, np.arange(10, dtype=np.int32)), int)
    assert_type(manager.prefetch_remote(None, ids), int)
    request = KVCacheRequest(prompt)
    assert_type(manager.create_kv_cache_batch([request, KVCacheRequest(ids, capacity=64)]), list[KVCache | None])
    assert_type(prepare_receiver(manager, ids), tuple[KVCache, list[int]] | None)
    cache = manager.create_kv_cache(None, prompt)
    cache.commit(prompt)
    cache.commit(ids)
    cache.commit(array("q", prompt))
    cache.commit(manager.gen_multimodal_cache_key_tokens(bytes(32), 4, id_offset=32_000))
    assert_type(cache.prefetch(), int)  # pages started moving
    assert_type(cache.prefetch(1), bool)  # TensorRT-LLM's form: whether none is left colder than level 1


def tokens_refused(manager: KVCacheManager, cache: KVCache, floats: npt.NDArray[np.float32]) -> None:
    manager.create_kv_cache(None, "hello")  # type: ignore[arg-type]
    manager.create_kv_cache(None, [1.5, 2.5])  # type: ignore[list-item]
    manager.create_kv_cache(None, floats)  # type: ignore[arg-type]
    manager.probe_reuse(None, "hello")  # type: ignore[arg-type]
    manager.probe_reuse(None, ["a", "b"])  # type: ignore[list-item]
    manager.prefetch_remote(None, "hello")  # type: ignore[arg-type]
    cache.prefetch(evict=1.0)  # type: ignore[call-overload]
    cache.prefetch(1.5)  # type: ignore[call-overload]
    cache.commit("hello")  # type: ignore[arg-type]
    cache.commit(42)  # type: ignore[arg-type]
    KVCacheRequest("hello")  # type: ignore[arg-type]
    prepare_receiver(manager, "hello")  # type: ignore[arg-type]


def names(manager: KVCacheManager, cache: _KVCache, sequence: TokenSequence) -> None:
    # The seed-era name is the same class; Token and TokenSequence are what the API is typed with.
    assert_type(cache, KVCache)
    assert_type(cache.status, KVCacheStatus)
    assert_type(manager.movement_counters, MovementCounters)
    assert_type(manager.get_page_index_converter(0, "key"), PageIndexConverter)
    assert_type(manager.get_page_index_converter(0, "key")(cache.get_base_page_indices(0)), list[int])
    assert_type(manager.create_kv_cache(None, sequence), KVCache)
    token: Token = 3
    token = b"digest"
    token = "text"  # type: ignore[assignment]
    assert_type(cache.capacity, int)
    cache.capacity = "16"  # type: ignore[assignment]
