"""Faults of a user's ``ColdPageCodec``: bad configuration is refused at construction with an error naming
``cold_page_codec`` and nothing allocated; a codec that raises while moving pages leaves no page servable whose slot
was never written (FakeEngine checks the content), and the manager stays consistent and usable."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

from kv_cache_manager_v2 import DiskCacheTierConfig, GpuCacheTierConfig, KVCacheManager
from kv_cache_manager_v2._base.types import PageContentLostError
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2._storage.page_codec import PaddingColdPageCodec
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.fuzz.checks import COUNTED
from tests.helpers import KIB, attention, make_config, seeded_prompt, serve_checked

TPB = 32
KV = 4 * KIB
BLOCKS = 4



class FaultyCodec(PaddingColdPageCodec):
    """Pads and flips every byte (a copy that skipped the codec shows); raises while ``failing`` is set."""

    def __init__(self) -> None:
        super().__init__({0: 12 * KIB})
        self.failing = ""

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        if self.failing == "encode":
            raise RuntimeError("encoder out of order")
        super().encode(layer_group_id, pages ^ 0xFF, encoded)  # type: ignore[operator]

    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        if self.failing == "decode":
            raise RuntimeError("decoder out of order")
        super().decode(layer_group_id, encoded, pages)
        pages ^= 0xFF  # type: ignore[operator]


def manager_with(codec: object, hot_blocks: int = 2 * BLOCKS) -> KVCacheManager:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(hot_blocks * 2 * KV), GpuCacheTierConfig(1 << 20)]
    config = make_config([attention(0, KV)], tiers=tiers, max_util_for_resume=1.0)
    return KVCacheManager(config, cold_page_codec=codec)  # type: ignore[arg-type]


def serve(manager: KVCacheManager, engine: FakeEngine, seed: int) -> None:
    serve_checked(manager, engine, seeded_prompt(seed, BLOCKS * TPB))


def test_a_decode_failing_on_resume_raises_and_its_pages_become_a_miss() -> None:
    codec = FaultyCodec()
    manager = manager_with(codec)
    engine = FakeEngine(manager)
    for seed in range(4):  # 0 and 1 go cold
        serve(manager, engine, seed)
    cache = manager.create_kv_cache(input_tokens=seeded_prompt(0)[:-1])
    codec.failing = "decode"
    with pytest.raises(PageContentLostError, match="decoder out of order"):
        cache.resume()
    codec.failing = ""
    assert cache.status == _KVCache.Status.SUSPENDED
    manager.check_invariants()
    with pytest.raises(PageContentLostError):
        cache.resume()
    cache.close()
    manager.check_invariants()
    assert manager.probe_reuse(None, seeded_prompt(0)[:-1]) == 0
    serve(manager, engine, 1)  # cold, decoded, checked
    serve(manager, engine, 0)  # recomputed
    assert manager.probe_reuse(None, seeded_prompt(0)[:-1]) == BLOCKS * TPB - 1


def test_an_encode_failing_on_eviction_drops_the_tree_pages_and_refuses_a_suspended_cache() -> None:
    codec = FaultyCodec()
    manager = manager_with(codec, hot_blocks=BLOCKS)
    engine = FakeEngine(manager)
    serve(manager, engine, 0)  # committed, on the hot tier
    codec.failing = "encode"
    tokens = seeded_prompt(9)
    waiting = manager.create_kv_cache()
    assert waiting.resume() and waiting.resize(len(tokens))  # evicts prompt 0 to the cold tier: the encodes fail
    engine.step(waiting, tokens)
    waiting.suspend()
    serve(manager, engine, 1)  # evicts the suspended cache's pages: lost too
    codec.failing = ""
    manager.check_invariants()
    assert manager.movement_counters.lost_pages == 2 * BLOCKS
    assert manager.probe_reuse(None, seeded_prompt(0)[:-1]) == 0
    with pytest.raises(PageContentLostError, match="encoder out of order"):
        waiting.resume()
    waiting.close()
    manager.check_invariants()
    for seed in (0, 2, 1):
        serve(manager, engine, seed)
    gpu, cold = manager.get_usage()
    assert gpu.held == cold.held == 0


class _Lazy(PaddingColdPageCodec):
    """Returns without writing what it was asked to (``which``: "encode" or "decode")."""

    def __init__(self, which: str) -> None:
        super().__init__({0: 12 * KIB})
        self.which = which

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        if self.which != "encode":
            super().encode(layer_group_id, pages, encoded)

    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        if self.which != "decode":
            super().decode(layer_group_id, encoded, pages)


class _Lossy(PaddingColdPageCodec):
    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        super().decode(layer_group_id, encoded, pages)
        pages[:, 0] = 0  # type: ignore[index]


class _Raising(PaddingColdPageCodec):
    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        raise RuntimeError("no encoder")


class _Sized:
    """A user codec (no base class) declaring ``size`` as it is; pads like the test codec."""

    def __init__(self, size: object) -> None:
        self.size = size

    def encoded_page_bytes(self, layer_group_id: int) -> int:
        return self.size  # type: ignore[return-value]

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        width = pages.shape[1]  # type: ignore[attr-defined]
        encoded[:, :width] = pages  # type: ignore[index]
        encoded[:, width:] = 0  # type: ignore[index]

    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        pages[:, :] = encoded[:, : pages.shape[1]]  # type: ignore[attr-defined, index]


@pytest.mark.parametrize(
    ("codec", "error", "match"),
    [
        (_Lazy("encode"), ValueError, r"cold_page_codec.*layer group 0.*exact bytes"),
        (_Lazy("decode"), ValueError, r"cold_page_codec.*layer group 0.*exact bytes"),
        (_Lossy({0: 12 * KIB}), ValueError, r"cold_page_codec.*layer group 0.*exact bytes"),
        (_Raising({0: 12 * KIB}), ValueError, r"cold_page_codec.*layer group 0.*RuntimeError: no encoder"),
        (_Sized(0), ValueError, r"cold_page_codec.encoded_page_bytes\(0\) must be positive, got 0"),
        (_Sized(-5), ValueError, r"cold_page_codec.encoded_page_bytes\(0\) must be positive, got -5"),
        (_Sized(True), TypeError, r"cold_page_codec.encoded_page_bytes\(0\)"),
        (_Sized(4096.0), TypeError, r"cold_page_codec.encoded_page_bytes\(0\)"),
        (_Sized(10**30), ValueError, r"cold_page_codec.encoded_page_bytes\(0\) is 10{30} bytes, more than"),
        (_Sized((1 << 20) + 1), ValueError, r"more than the largest cold tier holds \(1048576 bytes\)"),
    ],
)
def test_a_bad_codec_is_refused_at_construction_leaving_nothing_allocated(
    tmp_path: Path, codec: object, error: type[Exception], match: str
) -> None:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(8 * 2 * KV), DiskCacheTierConfig(1 << 20, str(tmp_path))]
    gc.collect()  # an earlier test's manager collected during this one would close its pool files here
    open_before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    with pytest.raises(error, match=match):
        KVCacheManager(make_config([attention(0, KV)], tiers=tiers), cold_page_codec=codec)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []
    if open_before:
        assert len(os.listdir("/proc/self/fd")) == open_before  # no pool file left open


def test_a_numpy_encoded_size_is_accepted_and_larger_than_the_page_is_fine() -> None:
    manager = manager_with(_Sized(np.int64(3 * 2 * KV)))
    engine = FakeEngine(manager)
    for seed in (0, 1, 2, 3, 0):
        serve(manager, engine, seed)
    manager.shutdown()


@pytest.mark.parametrize("blocks", [1, 2])
def test_the_lost_pages_warning_counts_in_english(caplog: pytest.LogCaptureFixture, blocks: int) -> None:
    """A suspended cache of ``blocks`` pages offloaded while the encoder fails: the warning names as many lost
    pages as the counters count, singular for one. Before: "1 page(s) lost"."""
    codec = FaultyCodec()
    manager = manager_with(codec)
    engine = FakeEngine(manager)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(blocks * TPB)
    engine.step(cache, seeded_prompt(3, blocks * TPB))
    cache.suspend()
    codec.failing = "encode"
    with caplog.at_level("WARNING", logger="kv_cache_manager_v2"):
        cache.offload()
    codec.failing = ""
    assert manager.movement_counters.lost_pages == blocks
    lost = [record.getMessage() for record in caplog.records if "page moves failed" in record.getMessage()]
    counts = [(int(match.group(1)), match.group(2), bool(match.group(3))) for match in COUNTED.finditer(lost[0])]
    assert len(lost) == 1 and counts == [(blocks, "page", blocks != 1)] and "(s)" not in lost[0], lost
    cache.close()
    manager.shutdown()
