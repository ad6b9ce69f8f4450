"""``KVCache.resumable_alone`` against what it predicts: the cache's own ``resume`` on an otherwise empty manager.

A scheduler picks preemption victims by it (``batching.ContinuousBatcher``), so an answer off by one page either
strands a request (True, then every resume refused) or spares a victim it could have taken (False, then the
resume fits). Every fuzzer setup, at the default ``max_util_for_resume`` and at two lower ones, grows one cache a
half block at a time past the limit (``resize`` is not bounded by it), with no history, the history one step
behind (sliding windows leave pages behind) and at half the capacity; at every size it asks the cache active,
suspends it, asks again, moves its pages to the colder tiers (``offload``: the resume must bring them back) and
resumes: the three answers must agree, and a refused resume must say ``fits_empty_manager=False``.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile

import pytest

from kv_cache_manager_v2 import KVCacheManager, _KVCache
from tests.fuzz.configs import CONFIGS, FuzzConfig
from tests.fuzz.faulty_tiers import FlakyCodec

HISTORY_MODES = ("none", "one step behind", "half")


def _history(mode: str, cache: _KVCache, capacity: int, step: int) -> int:
    if cache.has_scratch_slots:
        return cache.capacity  # each chunk starts where the previous one ended
    if mode == "none":
        return cache.history_length
    return max(cache.history_length, capacity - step if mode == "one step behind" else capacity // 2)


def _grow_and_compare(manager: KVCacheManager, mode: str, ssm: bool) -> tuple[list[str], bool]:
    """Disagreements between ``resumable_alone`` and the actual resume, one line each, for one cache grown until
    a resume is refused or the tier is full; and whether a resume was refused (the cache outgrew the limit)."""
    step = manager.tokens_per_block // 2
    cache = manager.create_kv_cache()
    assert cache.resume()
    found: list[str] = []
    stranded = False
    for size in range(1, 400):
        capacity = size * step
        history = cache.history_length if ssm else _history(mode, cache, capacity, step)
        if not cache.resize(capacity, history):
            break
        active_answer = cache.resumable_alone
        cache.suspend()
        suspended_answer = cache.resumable_alone
        cache.offload()
        resumed = cache.resume()
        if not active_answer == suspended_answer == resumed:
            found.append(f"{capacity}/{history}: alone {active_answer} active, {suspended_answer} suspended; resume {resumed}")
        if not resumed:
            refusal = cache.last_refusal
            assert refusal is not None and not refusal.fits_empty_manager, refusal
            stranded = True
            break
    cache.close()
    return found, stranded


@pytest.mark.parametrize("max_util", [None, 0.8, 0.5])
@pytest.mark.parametrize("config", CONFIGS, ids=[config.name for config in CONFIGS])
def test_resumable_alone_is_what_a_resume_on_an_empty_manager_does(config: FuzzConfig, max_util: float | None) -> None:
    directory = tempfile.mkdtemp(prefix="kvcm-alone-")
    try:
        built = config.build(directory)
        if max_util is not None:
            built = dataclasses.replace(built, max_util_for_resume=max_util)
        codec = None if config.cold_page_bytes is None else FlakyCodec(config.cold_page_bytes)
        manager = KVCacheManager(built, cold_page_codec=codec)
        found: list[str] = []
        try:
            for mode in HISTORY_MODES:
                lines, stranded = _grow_and_compare(manager, mode, config.ssm)
                found.extend(f"{mode}: {line}" for line in lines)
                if mode == "none" and max_util == 0.5:  # every page stays live: the cache outgrows half the tier
                    assert stranded, config.name
        finally:
            manager.shutdown()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert found == []
