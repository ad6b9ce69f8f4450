"""A refusal's figures are checked against what actually makes room: over seeded small worlds (one or two pool
groups, windows, SSM, a host tier, ``max_util_for_resume`` and the watermark, the GPU quota shrunk at run time,
suspended caches, a held cache, batch admission; and the fuzzer's setups: disk tiers, a cold-page codec, scratch
reuse, SSM snapshots, remote fills), a refused resize/resume/batch request is retried while the other
caches close one by one. A refusal by room must not fit before ``available`` (the statistics) reaches
``pages_needed``, and with one pool group must fit once it does; a refusal by the admission limit must not fit
before the other caches released ``pages_over_limit`` locked pages, and must fit once they did and the room is
there; ``fits_empty_manager`` True must fit alone, False never. A refused quota shrink must not be accepted while
more pages than the new slots can neither be dropped nor moved, and must be once they are not (one pool group)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import pytest

from kv_cache_manager_v2 import (
    GpuCacheTierConfig, HostCacheTierConfig, KVCache, KVCacheManager, KVCacheRequest, KVCacheStatus, Refusal,
)
from kv_cache_manager_v2._introspection import state_of
from kv_cache_manager_v2.config import CacheTierConfig, KVCacheManagerConfig, LayerConfig
from tests.fuzz.checks import check_held_pages
from tests.fuzz.configs import CONFIGS
from tests.fuzz.faulty_tiers import FlakyCodec
from tests.helpers import KIB, attention, make_config, ssm

TPB = 32
WORLDS = 200  # of each kind: about 4 s for the four runs on the loaded 2-core VM
HOLD = "worlds: an outside writer"
World = Callable[[random.Random], KVCacheManager]


def world(rng: random.Random) -> KVCacheManager:
    layers: list[LayerConfig] = [attention(0, 8 * KIB)]
    kind = rng.randrange(4)
    if kind == 1:
        layers.append(attention(1, 8 * KIB, window=rng.choice([40, 64, 100])))
    elif kind == 2:
        layers.append(ssm(1))
    elif kind == 3:
        layers.append(attention(1, 8 * KIB, window=64, sinks=rng.choice([None, 8])))
    slot = 16 * KIB * len(layers)
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(rng.randint(8, 24) * slot)]
    if rng.random() < 0.4:
        tiers.append(HostCacheTierConfig(rng.randint(4, 30) * slot))
    return with_limits(rng, make_config(layers, tiers=tiers), None)


def with_limits(rng: random.Random, config: KVCacheManagerConfig, codec: FlakyCodec | None) -> KVCacheManager:
    """The manager of ``config``, its admission limits drawn."""
    if rng.random() < 0.5:
        config.max_util_for_resume = rng.choice([0.7, 0.9, 1.0])
    if rng.random() < 0.3:
        config.admission_watermark = rng.choice([0.1, 0.2])
    return KVCacheManager(config, cold_page_codec=codec)


def fuzz_world(directory: Path) -> World:
    """Worlds of the fuzzer's setups (disk tiers, a cold-page codec, scratch reuse, SSM snapshots, remote fills)."""
    def build(rng: random.Random) -> KVCacheManager:
        setup = CONFIGS[rng.randrange(len(CONFIGS))]
        scratch = directory / str(len(list(directory.iterdir())))
        scratch.mkdir()
        codec = None if setup.cold_page_bytes is None else FlakyCodec(setup.cold_page_bytes)
        return with_limits(rng, setup.build(str(scratch)), codec)

    return build


def prompt(rng: random.Random, length: int, prefix: list[int]) -> list[int]:
    shared = prefix[:length] if rng.random() < 0.5 else []
    return shared + [rng.randrange(50_000) for _ in range(length - len(shared))]


def populate(rng: random.Random, manager: KVCacheManager, prefix: list[int]) -> list[KVCache]:
    """Some caches, active or suspended, with committed (shareable) or only computed tokens."""
    caches: list[KVCache] = []
    for _ in range(rng.randint(1, 6)):
        length = rng.randint(1, 10) * rng.choice([TPB, 17, 40])
        tokens = prompt(rng, length, prefix)
        cache = manager.create_kv_cache(None, tokens)
        if not cache.resume():
            cache.close()
            continue
        if cache.resize(length, cache.history_length) and rng.random() < 0.7:
            cache.commit(tokens[cache.num_committed_tokens : length])
        if rng.random() < 0.3:
            cache.suspend()
        caches.append(cache)
    return caches


def locked_by_others(caches: list[KVCache], target: KVCache, refusal: Refusal) -> int:
    """GPU pages of the refusal's pool group active caches other than ``target`` lock, less those ``target`` keeps."""
    own = {id(page) for page in state_of(target).live_entries()}
    pages: set[int] = set()
    for cache in caches:
        if cache is not target and cache.status is KVCacheStatus.ACTIVE:
            pages.update(
                id(page) for page in state_of(cache).held_pages()
                if (page.level, page.pool_group) == (0, refusal.pool_group) and page.lock_count and id(page) not in own
            )
    return len(pages)


def refused_step(rng: random.Random, manager: KVCacheManager, caches: list[KVCache], prefix: list[int]) -> tuple[
    str, KVCache | None, Callable[[], bool]
]:
    """A call that may be refused: a batch request, a suspended cache's resume, or a new cache's resume or growth."""
    suspended = [cache for cache in caches if cache.status is KVCacheStatus.SUSPENDED]
    if rng.random() < 0.25:
        request = KVCacheRequest(prompt(rng, rng.randint(1, 16) * rng.choice([TPB, 23]), prefix))

        def admit() -> bool:
            admitted = manager.create_kv_cache_batch([request])[0]
            if admitted is not None:
                caches.append(admitted)
            return admitted is not None

        return "batch", None, admit
    if suspended and rng.random() < 0.5:
        cache = rng.choice(suspended)
        return "resume", cache, cache.resume
    length = rng.randint(1, 16) * rng.choice([TPB, 23])
    cache = manager.create_kv_cache(None, prompt(rng, length, prefix))
    caches.append(cache)
    if not cache.resume():
        return "resume", cache, cache.resume
    capacity = cache.history_length + length
    return "resize", cache, lambda: cache.resize(capacity, cache.history_length)


def shut_down(manager: KVCacheManager, caches: list[KVCache]) -> None:
    for cache in caches:
        if cache.status is not KVCacheStatus.CLOSED:
            cache.close()
    manager.shutdown()


def check_against_release(seed: int, make: World) -> None:
    rng = random.Random(seed)
    manager = make(rng)
    prefix = [rng.randrange(50_000) for _ in range(320)]
    caches = populate(rng, manager, prefix)
    release_one_by_one(rng, manager, caches, prefix, seed)
    shut_down(manager, caches)


def release_one_by_one(
    rng: random.Random, manager: KVCacheManager, caches: list[KVCache], prefix: list[int], seed: int
) -> None:
    """A refused step retried as the other caches close (a held one last, its hold released first)."""
    if rng.random() < 0.3:  # the GPU quota shrinks at run time; some caches come back
        for cache in caches:
            if cache.status is KVCacheStatus.ACTIVE:
                cache.suspend()
        manager.resize(0, int(manager.get_quota(0) * rng.uniform(0.4, 0.9)), best_efforts=True)
        for cache in caches:
            if rng.random() < 0.5:
                cache.resume()
    actives = [cache for cache in caches if cache.status is KVCacheStatus.ACTIVE]
    held = rng.choice(actives) if actives and rng.random() < 0.3 else None
    hold = None if held is None else held.hold(HOLD)
    try:
        retry_while_releasing(rng, manager, caches, prefix, seed, held, (lambda: None) if hold is None else hold.release)
    finally:
        if hold is not None:
            hold.release()


def retry_while_releasing(
    rng: random.Random, manager: KVCacheManager, caches: list[KVCache], prefix: list[int], seed: int,
    held: KVCache | None, let_go: Callable[[], None],
) -> None:
    call, target, attempt = refused_step(rng, manager, caches, prefix)
    if attempt():
        return
    refusal = manager.last_refusal
    assert refusal is not None, seed
    check_held_pages(refusal, [] if held is None else [held])
    if "GPU pages needed in pool group" in refusal.detail:  # the sentence carries the same figures
        assert refusal.detail.startswith(
            f"{refusal.pages_needed} GPU pages needed in pool group {refusal.pool_group}, {refusal.pages_available} free"
        ), (seed, refusal)
    by_room = refusal.fits_empty_manager and not refusal.pages_over_limit and not refusal.by_watermark
    single = len(manager.get_storage_statistics(0)) == 1
    locked = 0 if target is None else locked_by_others(caches, target, refusal)
    others = [cache for cache in caches if cache is not target and cache is not held]
    rng.shuffle(others)
    for cache in others + ([] if held is None else [held]):
        if cache is held:
            let_go()
        cache.close()
        available = manager.get_storage_statistics(0)[refusal.pool_group].available
        released = 0 if target is None else locked - locked_by_others(caches, target, refusal)
        fits = attempt()
        what = (seed, call, refusal, available, released, manager.last_refusal)
        assert refusal.fits_empty_manager or not fits, what
        if by_room and call != "batch":  # a batch's figures are those inside it, its matched pages claimed
            assert not fits or available >= refusal.pages_needed, what
            assert fits or not single or available < refusal.pages_needed, what
        if refusal.pages_over_limit and target is not None:
            assert not fits or released >= refusal.pages_over_limit, what
            assert fits or not single or released < refusal.pages_over_limit or available < refusal.pages_needed, what
        if fits:
            break
    else:
        assert not refusal.fits_empty_manager, (seed, call, refusal, manager.last_refusal)


def check_quota_shrink(seed: int, make: World) -> None:
    rng = random.Random(seed)
    manager = make(rng)
    caches = populate(rng, manager, [rng.randrange(50_000) for _ in range(320)])
    for cache in caches:
        if cache.status is KVCacheStatus.ACTIVE:
            cache.suspend()
    level = rng.randrange(manager.num_cache_levels)
    quota = max(16 * KIB, int(manager.get_quota(level) * rng.uniform(0.1, 0.9)))
    if manager.resize(level, quota):
        shut_down(manager, caches)
        return
    refusal = manager.last_refusal
    assert refusal is not None and refusal.held_pages == 0, seed
    staying = "neither be dropped nor moved" in refusal.detail
    single = len(manager.get_storage_statistics(level)) == 1
    rng.shuffle(caches)
    for cache in caches:
        cache.close()
        unavailable = manager.get_storage_statistics(level)[refusal.pool_group].unavailable
        fits = manager.resize(level, quota)
        what = (seed, refusal, unavailable, manager.last_refusal)
        assert refusal.fits_empty_manager or not fits, what
        if staying:
            assert not fits or unavailable <= refusal.pages_available, what
            assert fits or not single or unavailable > refusal.pages_available, what
        if fits:
            break
    else:
        assert not refusal.fits_empty_manager, (seed, refusal, manager.last_refusal)
    shut_down(manager, caches)


@pytest.mark.parametrize("fuzz_setups", [False, True])
@pytest.mark.parametrize("check", [check_against_release, check_quota_shrink])
def test_refusals_say_what_frees_room_in_random_worlds(
    check: Callable[[int, World], None], fuzz_setups: bool, tmp_path: Path
) -> None:
    make = fuzz_world(tmp_path) if fuzz_setups else world
    for seed in range(WORLDS // 2 if fuzz_setups else WORLDS):
        check(seed, make)
