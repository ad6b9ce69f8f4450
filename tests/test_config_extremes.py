"""Extreme config values (SPEC §11): ids an engine numbers itself take any integer, and a window, sink count or
scratch rewind no cache can span is refused by the config (``tests/test_edge_sweep.py`` sweeps the 64-bit limit of
every other config integer)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    CacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheRequest,
    ReuseScope,
    SwaScratchReuseConfig,
)
from kv_cache_manager_v2._base.types import MAX_BLOCKS_PER_CACHE
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import seeded_prompt

TPB = 16
PROMPT = seeded_prompt(1, 100)
BUFFERS = [BufferConfig("key", 64)]


@pytest.mark.parametrize("value", [2**63, 2**64 - 1, np.uint64(2**64 - 1), -(2**63) - 1])
def test_ids_take_any_integer(value: int) -> None:
    assert KVCacheRequest(PROMPT, id=value).id == int(value)
    assert ReuseScope(lora_id=value).lora_id == int(value)


def spanning_config(layer: AttentionLayerConfig, rewind: int = 0) -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        TPB, layers=[layer], cache_tiers=[GpuCacheTierConfig(4 << 20)], backend="cpu",
        swa_scratch_reuse=SwaScratchReuseConfig(rewind),
    )


SPANS: dict[str, Callable[[int], KVCacheManagerConfig]] = {
    "sliding_window_size": lambda tokens: spanning_config(AttentionLayerConfig(0, BUFFERS, sliding_window_size=tokens)),
    "num_sink_tokens": lambda tokens: spanning_config(
        AttentionLayerConfig(0, BUFFERS, sliding_window_size=64, num_sink_tokens=tokens)
    ),
    "max_rewind_len": lambda tokens: spanning_config(AttentionLayerConfig(0, BUFFERS, sliding_window_size=64), tokens),
}


@pytest.mark.parametrize("tokens", [MAX_BLOCKS_PER_CACHE * TPB + 1, 2**31, 2**62])
@pytest.mark.parametrize("field", sorted(SPANS))
def test_a_span_no_cache_reaches_is_refused(field: str, tokens: int) -> None:
    """Accepted before, a window (sinks, rewind) of 2**31 tokens made ``max_admissible`` step through every token
    of the longest cache: hours, where the config could say at once that no cache spans it."""
    with pytest.raises(ValueError, match=field):
        SPANS[field](tokens)
    SPANS[field](MAX_BLOCKS_PER_CACHE * TPB)  # the longest cache's span itself is a legal (if useless) setting


@pytest.mark.parametrize(
    ("tiers", "named"),
    [
        ([GpuCacheTierConfig(2**63 - 1)], r"GpuCacheTierConfig\.quota 9223372036854775807"),
        ([GpuCacheTierConfig(1 << 20, 2**63 - 1)], r"GpuCacheTierConfig\.max_quota 9223372036854775807"),
        ([GpuCacheTierConfig(1 << 20), HostCacheTierConfig(2**63 - 1)], r"HostCacheTierConfig\.quota"),
    ],
)
def test_a_quota_no_machine_can_allocate_names_its_field(tiers: list[CacheTierConfig], named: str) -> None:
    """A quota just under 2**63 passed the config and failed in NumPy with "Unable to allocate 8.00 EiB", which
    names no setting; it is still a MemoryError (the config is legal, this machine is too small) naming it."""
    config = KVCacheManagerConfig(TPB, layers=[AttentionLayerConfig(0, BUFFERS)], cache_tiers=tiers, backend="cpu")
    with pytest.raises(MemoryError, match=named):
        KVCacheManager(config)


@pytest.mark.parametrize("scale_bytes", [4, 8, 100])
def test_a_buffer_under_a_byte_per_token_is_valid_and_the_fake_engine_refuses_it_up_front(scale_bytes: int) -> None:
    """A page is opaque bytes to the manager, so a per-block buffer (block scales: ``size`` below
    ``tokens_per_block``) is a valid page format and serves end to end; only the FakeEngine, which puts an 8-byte
    record in each token's row, cannot use it, and says so when it is made (4 bytes once passed, as 0 bytes a
    token, and failed at the first write in NumPy)."""
    layer = AttentionLayerConfig(0, [BufferConfig("key", 64 * TPB), BufferConfig("scale", scale_bytes)])
    manager = KVCacheManager(
        KVCacheManagerConfig(TPB, layers=[layer], cache_tiers=[GpuCacheTierConfig(1 << 20)], backend="cpu")
    )
    cache = manager.create_kv_cache(None, PROMPT)
    assert cache.resume() and cache.resize(len(PROMPT), len(PROMPT))
    cache.commit(PROMPT)
    cache.close()
    reused = manager.create_kv_cache(None, PROMPT)
    assert reused.committed_tokens == PROMPT
    reused.close()
    with pytest.raises(ValueError, match=r"layer 0 role 'scale': the FakeEngine needs token rows"):
        FakeEngine(manager)
    manager.shutdown()
