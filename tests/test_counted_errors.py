"""Errors that count something say it in English at every count: "1 token", "2 tokens", never "1 tokens". Each
site is raised for real at a count of 1 and of 2 (the words at both are asserted), so a message written with a
fixed plural (or a fixed singular) fails one of the two."""

from __future__ import annotations

import re
from typing import Callable

import numpy as np
import pytest

from kv_cache_manager_v2 import KVCacheManager, RemoteCacheTierConfig, _introspection
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.kernels._checks import index_vector
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.helpers import attention, make_config

TPB = 32  # make_config's tokens per block


def _manager(groups: int = 1) -> KVCacheManager:
    layers: list[LayerConfig] = [attention(0), attention(1, window=64)]
    return KVCacheManager(make_config(layers[:groups]))


def _commit_past_capacity(count: int) -> None:
    cache = _manager().create_kv_cache()
    assert cache.resume()
    cache.commit([7] * count)  # capacity 0


def _layer_group_out_of_range(count: int) -> None:
    cache = _manager(count).create_kv_cache()
    _introspection.committed_page_is_linked(cache, 0, count)


def _buffer_outgrown_by_resize(count: int) -> None:
    cache = _manager().create_kv_cache()
    assert cache.resume() and cache.resize(count * TPB)
    cache.set_base_page_index_buf(0, 0, np.zeros(count, dtype=np.int32))
    cache.resize((count + 1) * TPB)


def _row_ids_of_the_wrong_length(count: int) -> None:
    index_vector([0] * (count + 1), "src_rows", count, 0, 10)


def _short_secret(count: int) -> None:
    RemoteCacheTierConfig(0, MemoryStoreConfig(), namespace="n", secret_key=bytes(count))


def _engine_given_too_few_tokens(count: int) -> None:
    manager = _manager()
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(count + 1)
    FakeEngine(manager).step(cache, list(range(count)))


SITES: dict[str, tuple[Callable[[int], None], type[Exception], str, str]] = {
    # site: (raise it at a count, the error, the words at 1, the words at 2)
    "KVCache.commit past capacity": (
        _commit_past_capacity, ValueError, "committing 1 token would exceed", "committing 2 tokens would exceed",
    ),
    "_introspection lc_id": (
        _layer_group_out_of_range, IndexError, "the manager has 1 layer group", "the manager has 2 layer groups",
    ),
    "KVCache.resize past a page index buffer": (
        _buffer_outgrown_by_resize, ValueError, "holds 1 entry, fewer than the 2 blocks of capacity 64",
        "holds 2 entries, fewer than the 3 blocks of capacity 96",
    ),
    "kernel row ids": (
        _row_ids_of_the_wrong_length, ValueError, "src_rows must have 1 entry, got 2",
        "src_rows must have 2 entries, got 3",
    ),
    "RemoteCacheTierConfig.secret_key": (_short_secret, ValueError, "got 1 byte", "got 2 bytes"),
    "FakeEngine.step": (_engine_given_too_few_tokens, ValueError, "tokens holds 1 token;", "tokens holds 2 tokens;"),
}


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("site", list(SITES))
def test_the_error_counts_in_english(site: str, count: int) -> None:
    """Before, at count 1: "committing 1 tokens", "has 1 layer groups", "holds 1 entries, fewer than the 2
    blocks", "must have 1 entries", "got 1 bytes", "tokens holds 1 tokens"."""
    raise_it, error, singular, plural = SITES[site]
    with pytest.raises(error) as raised:
        raise_it(count)
    words = singular if count == 1 else plural
    assert re.search(re.escape(words) + r"(?!\w)", str(raised.value)), raised.value  # "1 byte", not "1 bytes"
