"""Tokens given as a 1-D NumPy integer array (what an engine keeping its prompts in arrays passes, every step for
each waiting request when its scheduler orders them by ``probe_reuse``) are taken through NumPy's own conversion:
the same tokens as the list, at a cost that does not grow with Python calls per token (iterating the array made a
NumPy scalar per token and converted each: ~600 ns a token, against ~30 for a list, interpreted)."""

from __future__ import annotations

import numpy as np
import pytest

from kv_cache_manager_v2 import (AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, KVCacheManager,
                                 KVCacheManagerConfig)
from tests.helpers import profiled_calls

TPB = 16
C_CALLS = ("c_call",)  # calls of C functions from Python frames (a NumPy scalar's methods among them)


def _manager() -> KVCacheManager:
    kv = [BufferConfig("key", TPB * 64), BufferConfig("value", TPB * 64)]
    config = KVCacheManagerConfig(tokens_per_block=TPB, backend="cpu", layers=[AttentionLayerConfig(0, kv)],
                                  cache_tiers=[GpuCacheTierConfig(1 << 20)])
    return KVCacheManager(config)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint64])
def test_an_integer_array_reads_as_its_list(dtype: type) -> None:
    manager = _manager()
    try:
        prompt = list(range(1, 81)) + ([2**63 + 5] if dtype == np.uint64 else [])
        cache = manager.create_kv_cache(input_tokens=np.array(prompt, dtype=dtype))
        assert cache.resume() and cache.resize(len(prompt))
        cache.commit(np.array(prompt, dtype=dtype))
        assert cache.committed_tokens == prompt and all(type(token) is int for token in cache.committed_tokens)
        cache.close()
        assert manager.probe_reuse(None, np.array(prompt, dtype=dtype)) == len(prompt)
        assert manager.probe_reuse(None, np.array(prompt[:40] + [7] * 40, dtype=dtype)) == 40
    finally:
        manager.shutdown()


@pytest.mark.parametrize(("tokens", "message"), [
    (np.array([True, False]), r"input_tokens\[0\] must be an int or bytes token"),
    (np.array([1.0, 2.0]), r"input_tokens\[0\] must be an int or bytes token"),
    (np.array([[1, 2]]), "input_tokens must be a 1-D sequence of tokens"),
])
def test_other_arrays_are_refused_naming_the_argument(tokens: object, message: str) -> None:
    manager = _manager()
    try:
        with pytest.raises(TypeError, match=message):
            manager.probe_reuse(None, tokens)  # type: ignore[arg-type]
    finally:
        manager.shutdown()


def test_probing_an_array_makes_no_call_per_token() -> None:
    manager = _manager()
    try:
        short, long = np.arange(1, 101), np.arange(1, 2001)
        assert profiled_calls(lambda: manager.probe_reuse(None, short), C_CALLS) == profiled_calls(
            lambda: manager.probe_reuse(None, long), C_CALLS
        )
    finally:
        manager.shutdown()
