"""Bad input changes nothing (SPEC §11), proven by a differential twin (``tests/fuzz/twin.py``): two managers from
one config run one seeded workload; one of them also gets bad calls from every public entry point
(``tests/fuzz/misuse.py``), each of which must raise the documented exception naming its argument, and everything
observable (``tests/fuzz/deep_state.py``) must stay equal between the two at every later step.

Below the twin, the defects it found, each as the smallest call that showed it.
"""

from __future__ import annotations

import random

import pytest

from kv_cache_manager_v2 import KVCacheManager, KVCacheRequest, RemoteTierStatistics
from tests.fuzz.configs import CONFIGS, FLAKY_REMOTE, TEXT_ONLY, FuzzConfig, mooncake_config
from tests.fuzz.misuse import BadCallChangedState, Misuse, misuses, multimodal_misuses
from tests.fuzz.twin import run_twins
from tests.fuzz.world import FuzzWorld
from tests.helpers import KIB, attention, make_config
from tests.mooncake_helpers import MooncakeCluster, require_mooncake

DIGEST = b"d" * 32  # a multimodal token
# Every fuzz config but the flaky remote ones (twins over one in-process store would share its content; the remote
# world is the real Mooncake store's below, a namespace per twin), and a text-only manager.
TWIN_CONFIGS = [config for config in CONFIGS if config.name not in FLAKY_REMOTE] + [TEXT_ONLY]
STEPS = 30


@pytest.mark.parametrize("config", [pytest.param(config, id=config.name) for config in TWIN_CONFIGS])
def test_bad_calls_change_nothing_a_twin_can_see(config: FuzzConfig) -> None:
    offered: set[str] = set()

    def catalogue(world: FuzzWorld, rng: random.Random, other: FuzzWorld) -> list[Misuse]:
        found = misuses(world, rng, other)
        offered.update(misuse.name for misuse in found)
        return found

    made = run_twins(config, seed=7, steps=STEPS, catalogue=catalogue)
    assert len(made) >= STEPS // 2 and len(set(made)) >= 10, made  # the catalogue was exercised, not skipped
    if config is TEXT_ONLY:  # its own bad calls are offered (whether a seed draws them depends on the catalogue's
        # size, so the next test draws them alone)
        assert any(name.startswith("text_only: ") for name in offered), sorted(offered)


def test_multimodal_tokens_refused_by_a_text_only_manager_change_nothing() -> None:
    """The text-only world's own bad calls alone (the whole catalogue draws them rarely): create, batch and commit
    with a multimodal token, each after a prefix the tree holds."""

    def catalogue(world: FuzzWorld, rng: random.Random, other: FuzzWorld) -> list[Misuse]:
        return multimodal_misuses(world, rng)

    made = run_twins(TEXT_ONLY, seed=7, steps=STEPS, catalogue=catalogue)
    expected = {"text_only: create multimodal", "text_only: batch multimodal", "text_only: commit multimodal"}
    assert expected <= set(made), made


@pytest.mark.parametrize("config", [pytest.param(config, id=config.name) for config in CONFIGS if config.name in ("full", "hybrid_ssm")])
def test_refused_local_handoffs_change_nothing(config: FuzzConfig) -> None:
    """The local handoff's refusals alone (the whole catalogue draws them rarely): a source of another scope or
    prompt, rows the manager cannot tell (``CacheView.known_tokens``), engines of another ``KVFormat``."""

    def catalogue(world: FuzzWorld, rng: random.Random, other: FuzzWorld) -> list[Misuse]:
        return [misuse for misuse in misuses(world, rng, other) if misuse.name.startswith("transfer: ")]

    made = run_twins(config, seed=11, steps=STEPS, misuse_rate=0.8, catalogue=catalogue)
    expected = {"transfer: foreign source", "transfer: other format", "transfer: one format"}
    assert expected <= set(made), made


def test_bad_calls_change_nothing_over_a_real_mooncake_store() -> None:
    """The remote world: both twins write through to one Mooncake store (master and storage node started here),
    each under its own namespace; a bad call that reached the store (a put, a fetch) would show in a later step."""
    seen: list[RemoteTierStatistics] = []

    def catalogue(world: FuzzWorld, rng: random.Random, other: FuzzWorld) -> list[Misuse]:
        statistics = world.manager.get_remote_tier_statistics()
        assert statistics is not None
        seen.append(statistics)
        return misuses(world, rng, other)

    cluster = MooncakeCluster(require_mooncake())
    try:
        made = run_twins(mooncake_config(cluster.master_address, cluster.metadata_url), 7, STEPS, catalogue=catalogue)
    finally:
        cluster.stop()
    assert len(made) >= STEPS // 2 and len(set(made)) >= 10, made
    last = seen[-1]
    # The store was in use: pages written through and looked up, without a failure.
    assert last.stored_pages > 0 and last.probed_pages > 0 and last.store_failures == 0, last



def _reuse_then_refuse(world: FuzzWorld) -> None:
    """What a check placed after a change would do: match a cached prefix (its pages move in the eviction order),
    close the cache, then raise."""
    world.manager.create_kv_cache(None, list(world.shared_prefixes[0])).close()
    raise ValueError("sham: raised after the prefix match")


def test_the_twin_sees_a_bad_call_that_only_moved_pages_in_the_eviction_order() -> None:
    """The check can fail: a "bad call" whose only trace is cached pages moving in the LRU is caught."""

    def sham(world: FuzzWorld, rng: random.Random, other: FuzzWorld) -> list[Misuse]:
        return [Misuse("sham", lambda: _reuse_then_refuse(world), (ValueError,), "sham")]

    with pytest.raises(BadCallChangedState, match=r"after the bad call: the twins differ after bad calls \['sham'\]"):
        run_twins(TWIN_CONFIGS[0], seed=7, steps=STEPS, catalogue=sham)


# --------------------------------------------------------------------------------- defects the twin found
def test_a_text_only_manager_refuses_multimodal_tokens_in_a_batch_as_create_kv_cache_does() -> None:
    """``text_only`` refused multimodal tokens in ``create_kv_cache`` and ``commit`` but not in
    ``create_kv_cache_batch``, which admitted a text-only cache holding one."""
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=64 * KIB, tokens_per_block=16, text_only=True))
    with pytest.raises(ValueError, match="input_tokens"):
        manager.create_kv_cache(None, [1, 2, DIGEST])
    with pytest.raises(ValueError, match=r"requests\[1\]\.input_tokens\[2\]"):
        manager.create_kv_cache_batch(
            [KVCacheRequest([1, 2, 3], capacity=3), KVCacheRequest([1, 2, DIGEST], capacity=3)]
        )
    assert manager.num_live_caches == 0
    manager.shutdown()


STREAM_PAST_64_BITS = 1 << 64  # a cudaStream_t is a pointer: 0 .. 2**64 - 1


def test_a_stream_handle_past_64_bits_is_refused_by_every_call_taking_one() -> None:
    """``resume(1 << 64)`` returned True and kept a stream handle no CUDA stream can have (a ``cudaStream_t`` is a
    pointer); the CUDA backend hands it to CuPy only where it first uses the stream, in a later call. Every call
    taking a stream now checks it with one helper (``as_stream_handle``)."""
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=64 * KIB, tokens_per_block=16))
    cache = manager.create_kv_cache(None, [1, 2, 3])
    with pytest.raises(ValueError, match="cuda_stream"):
        cache.resume(STREAM_PAST_64_BITS)
    assert not cache.is_active and cache.cuda_stream == 0
    with pytest.raises(ValueError, match="cuda_stream"):
        cache.cuda_stream = STREAM_PAST_64_BITS
    assert cache.cuda_stream == 0
    with pytest.raises(ValueError, match="cuda_stream"):
        manager.create_kv_cache_batch([KVCacheRequest([1, 2, 3], capacity=3)], cuda_stream=STREAM_PAST_64_BITS)
    assert manager.num_live_caches == 1
    assert cache.resume((1 << 64) - 1) and cache.cuda_stream == (1 << 64) - 1  # the largest handle is one
    cache.close()
    manager.shutdown()
