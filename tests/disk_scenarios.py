"""Disk-tier scenarios that need a process of their own: ``python tests/disk_scenarios.py NAME DIRECTORY``.

``tests/test_disk_tier.py`` runs them in a private mount namespace on a small tmpfs (a real filesystem that
runs out of space), or as a process it kills. Each prints ``ok`` when every check passed. Self-contained: the
caller's ``PYTHONPATH`` picks the package (sources or the compiled build).
"""

from __future__ import annotations

import errno
import os
import sys
import time
from typing import Callable, Iterable

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)
from kv_cache_manager_v2.testing import FakeEngine

KIB = 1024
TPB = 16
SLOT = KIB  # one full-attention layer, K and V of 512 bytes per block
PROMPT_BLOCKS = 8


def manager_on(directory: str, disk_quota: int, max_quota: int | None = None) -> KVCacheManager:
    layers = [AttentionLayerConfig(0, [BufferConfig("key", SLOT // 2), BufferConfig("value", SLOT // 2)])]
    tiers = [GpuCacheTierConfig(2 * PROMPT_BLOCKS * SLOT), DiskCacheTierConfig(disk_quota, directory, max_quota)]
    return KVCacheManager(
        KVCacheManagerConfig(tokens_per_block=TPB, layers=layers, cache_tiers=tiers, backend="cpu")  # type: ignore[arg-type]
    )


def available(directory: str) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def prompt(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(PROMPT_BLOCKS * TPB)]


def serve_prompts(manager: KVCacheManager, engine: FakeEngine, seeds: range) -> None:
    """Compute, commit and close one prompt per seed: each pushes the previous ones' pages down to disk."""
    for seed in seeds:
        tokens = prompt(seed)
        cache = manager.create_kv_cache(input_tokens=tokens)
        assert cache.resume() and cache.resize(len(tokens))
        engine.step(cache, tokens)
        cache.commit(tokens)
        cache.close()


def check_reused(manager: KVCacheManager, engine: FakeEngine, seeds: Iterable[int]) -> None:
    """Each seed's prompt is matched whole and its pages read back as they were written (from disk, here)."""
    for seed in seeds:
        tokens = prompt(seed)
        assert manager.probe_reuse(None, tokens) == len(tokens)
        cache = manager.create_kv_cache(input_tokens=tokens)
        assert cache.resume()
        engine.check(cache, tokens)
        cache.close()


def fill(directory: str, name: str) -> None:
    """Write a file in ``directory`` until its filesystem is full."""
    chunk = b"\xff" * (64 * KIB)
    with open(os.path.join(directory, name), "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(chunk)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
    assert available(directory) < SLOT


def refused(directory: str) -> None:
    """A disk tier larger than its filesystem: a clear error at construction, nothing left behind."""
    before = available(directory)
    quota = 8 * before
    try:
        manager_on(directory, quota)
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
        message = str(error)
        assert repr(directory) in message and str(quota) in message and str(before) in message, message
        assert f"{quota - before} bytes short" in message, message
    else:
        raise AssertionError("a disk tier 8 times its filesystem was accepted")
    assert os.listdir(directory) == [] and available(directory) == before


def reserved(directory: str) -> None:
    """The disk tier's blocks are reserved at construction: a full filesystem later costs reuse, never SIGBUS."""
    before = available(directory)
    disk_slots = 32 * PROMPT_BLOCKS
    manager = manager_on(directory, disk_slots * SLOT, max_quota=2 * disk_slots * SLOT)
    assert before - available(directory) >= disk_slots * SLOT  # really allocated, not a sparse promise
    assert os.listdir(directory) == []
    fill(directory, "filler")
    engine = FakeEngine(manager)
    # 40 prompts of 8 blocks through 16 GPU slots: the disk tier fills up completely and starts dropping.
    serve_prompts(manager, engine, range(40))
    assert manager.get_storage_statistics(1)[0].free == 0
    oldest_kept = 40 - (disk_slots + 2 * PROMPT_BLOCKS) // PROMPT_BLOCKS
    check_reused(manager, engine, (oldest_kept, oldest_kept + 5))  # from disk pages written while it was full
    # Growing the disk tier needs blocks the full filesystem does not have: a soft False, nothing changed.
    assert not manager.resize(1, 2 * disk_slots * SLOT)
    refusal = manager.last_refusal
    assert refusal is not None and refusal.level == 1 and "filesystem" in refusal.detail
    assert manager.get_quota(1) == disk_slots * SLOT and manager.get_storage_statistics(1)[0].total == disk_slots
    os.remove(os.path.join(directory, "filler"))
    after_filler = available(directory)
    assert manager.resize(1, 2 * disk_slots * SLOT)
    assert after_filler - available(directory) >= disk_slots * SLOT
    # 40 more prompts: the first 32 land in the new upper half of the disk tier, the rest replace the oldest.
    serve_prompts(manager, engine, range(100, 140))
    # Shrinking drops the oldest pages, moves the kept ones out of the upper half (their content intact) and
    # gives the upper half's blocks back to the filesystem.
    assert manager.resize(1, disk_slots * SLOT)
    assert available(directory) >= after_filler
    for seed in (110, 120, 137):
        tokens = prompt(seed)
        cache = manager.create_kv_cache(input_tokens=tokens)
        assert cache.num_committed_tokens == len(tokens) and cache.resume()
        engine.check(cache, tokens)
        cache.close()
    manager.check_invariants()
    manager.shutdown()
    assert available(directory) == before and os.listdir(directory) == []


def killed(directory: str) -> None:
    """Build a manager whose disk tier holds pages, report, then wait to be killed."""
    manager = manager_on(directory, 32 * PROMPT_BLOCKS * SLOT)
    serve_prompts(manager, FakeEngine(manager), range(4))
    assert manager.get_storage_statistics(1)[0].free < 32 * PROMPT_BLOCKS
    print("ready", flush=True)
    time.sleep(600)


def shared(directory: str, first_seed: str) -> None:
    """One of two processes on one directory: serve prompts down to disk, wait until the other has too (a line on
    stdin), then serve its own from its disk pages. The two serve different prompts, so a page of the other's
    fails ``engine.check``."""
    manager = manager_on(directory, 32 * PROMPT_BLOCKS * SLOT)
    engine = FakeEngine(manager)
    seeds = range(int(first_seed), int(first_seed) + 12)  # the first 10 end on disk, past 2 prompts of GPU slots
    serve_prompts(manager, engine, seeds)
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    check_reused(manager, engine, seeds[:10])
    manager.shutdown()


def read_only(directory: str) -> None:
    """A disk tier on a read-only filesystem: an error naming the configured path and why, nothing left behind."""
    try:
        manager_on(directory, 32 * SLOT)
    except OSError as error:
        assert error.errno == errno.EROFS, error
        message = str(error)
        assert f"DiskCacheTierConfig.path {directory!r}" in message and "Read-only" in message, message
    else:
        raise AssertionError("a disk tier on a read-only filesystem was accepted")


SCENARIOS: dict[str, Callable[..., None]] = {"refused": refused, "reserved": reserved, "killed": killed, "shared": shared, "read_only": read_only}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
    print("ok", flush=True)
