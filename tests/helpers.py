"""Small config builders shared by the tests, and ways to compute and commit a prompt."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Sequence

import pytest

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    GpuCacheTierConfig,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    ReuseScope,
    SsmLayerConfig,
)
from kv_cache_manager_v2._base.hashing import Token
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine

KIB = 1024
MIB = 1024 * KIB


def kv(size: int) -> list[BufferConfig]:
    return [BufferConfig("key", size), BufferConfig("value", size)]


def attention(layer_id: int, size: int = 4 * KIB, window: int | None = None, sinks: int | None = None) -> AttentionLayerConfig:
    return AttentionLayerConfig(layer_id, kv(size), sliding_window_size=window, num_sink_tokens=sinks)


def ssm(layer_id: int, state: int = 16 * KIB, conv: int = 2 * KIB) -> SsmLayerConfig:
    return SsmLayerConfig(layer_id, [BufferConfig("ssm_state", state), BufferConfig("conv_state", conv)])


def gemma_like_layers() -> list[LayerConfig]:
    """5 SWA layers with K/V of 16 KiB per block and 1 full layer with K/V of 32 KiB (SPEC §1's example)."""
    layers: list[LayerConfig] = [attention(i, 16 * KIB, window=128) for i in range(5)]
    layers.append(attention(5, 32 * KIB))
    return layers


def make_config(
    layers: Sequence[LayerConfig],
    gpu_quota: int = 32 * MIB,
    tiers: Sequence[CacheTierConfig] | None = None,
    tokens_per_block: int = 32,
    backend: str = "cpu",
    **kwargs: object,
) -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        layers=list(layers),
        cache_tiers=list(tiers) if tiers is not None else [GpuCacheTierConfig(gpu_quota)],
        backend=backend,
        **kwargs,  # type: ignore[arg-type]
    )


def compute_prompt(manager: KVCacheManager, engine: FakeEngine, tokens: list[int], stops: tuple[int, ...] = ()) -> KVCache:
    """Admit ``tokens`` with the manager's own prefix match, compute and commit them (one chunk per ``stops``
    entry, then the rest); the cache stays active. A chunk ending on the SSM interval leaves a snapshot there."""
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume()
    for end in [stop for stop in stops if stop > cache.history_length] + [len(tokens)]:
        assert cache.resize(end, cache.history_length)
        engine.step(cache, tokens)
        cache.commit(tokens[cache.num_committed_tokens : end])
    return cache


def seeded_prompt(seed: int, length: int = 128) -> list[int]:
    """A prompt of ``length`` tokens that differs from every other seed's from its first token."""
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def serve_checked(manager: KVCacheManager, engine: FakeEngine, tokens: list[int]) -> None:
    """Compute, commit and close one prompt, reusing what the tree has and checking the reused content first."""
    cache = manager.create_kv_cache(input_tokens=tokens[:-1])
    assert cache.resume() and cache.resize(len(tokens))
    engine.check(cache, tokens[: cache.history_length])
    engine.step(cache, tokens)
    cache.commit(tokens[cache.num_committed_tokens :])
    cache.close()
    manager.check_invariants()


IMAGE_DIGEST = hashlib.sha256(b"an image").digest()


def prefilled(manager: KVCacheManager, tokens: Sequence[Token], scope: ReuseScope | None = None) -> None:
    """One request that computes and commits ``tokens``, then closes."""
    cache = manager.create_kv_cache(scope, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens[cache.num_committed_tokens :])
    cache.close()


def public_modules() -> list[ModuleType]:
    """The package and its public submodules; ``kv_events`` only where the events extra is installed (always in CI,
    which installs it: its absence is an error there)."""
    import kv_cache_manager_v2
    from kv_cache_manager_v2 import disagg, testing

    modules: list[ModuleType] = [kv_cache_manager_v2, disagg, testing]
    if os.environ.get("CI") or all(importlib.util.find_spec(extra) is not None for extra in ("zmq", "msgspec")):
        modules.append(importlib.import_module("kv_cache_manager_v2.kv_events"))
    return modules


SMALL_SLOTS = 10
"""GPU slots of ``small_manager``: one layer of an 8 KiB K and an 8 KiB V page per block of 32 tokens."""


def small_manager(max_util_for_resume: float | None = None, typical_step: BatchDesc | None = None) -> KVCacheManager:
    """A manager of ``SMALL_SLOTS`` GPU slots, where a test can make a refusal by hand."""
    config = make_config([attention(0, 8 * KIB)], gpu_quota=SMALL_SLOTS * 16 * KIB, typical_step=typical_step)
    if max_util_for_resume is not None:
        config.max_util_for_resume = max_util_for_resume
    return KVCacheManager(config)


def status_once_reader_left(process: subprocess.Popen[bytes], within_s: float) -> int:
    """Close ``process``'s stdout (its reader leaves: nothing more is read) and return its exit status; fails the
    test when it still runs ``within_s`` seconds later (it did not notice)."""
    assert process.stdout is not None
    process.stdout.close()
    try:
        return process.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"still running {within_s} s after its reader left")


def profiled_calls(call: Callable[[], object], events: tuple[str, ...] = ("call", "c_call")) -> int:
    """How many profiler ``events`` (Python and C function calls by default) happen while ``call()`` runs: a count
    that grows with a loop's length where a timing would only be noisy (compiled code shows the profiler none)."""
    count = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal count
        count += event in events

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count
