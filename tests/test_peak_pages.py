"""``KVCacheManager.peak_pages``: the most GPU pages one request holds at any step, per pool group, which a
guaranteed-no-evict admission (TensorRT-LLM's ``GUARANTEED_NO_EVICT``) reserves for it. Checked against the pages
real caches lock on an otherwise empty manager, step by step: a prompt prefilled in chunks, then decoded a token
or a few drafts at a time."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import (AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, KVCacheManager,
                                 KVCacheManagerConfig, SsmLayerConfig)
from kv_cache_manager_v2.testing import FakeEngine

TPB = 16


def _manager(window: int | None, sinks: int, ssm: bool, separate: bool) -> KVCacheManager:
    kv = [BufferConfig("key", TPB * 64), BufferConfig("value", TPB * 64)]
    other = [BufferConfig("key", TPB * 32), BufferConfig("value", TPB * 32)] if separate else kv  # own pool group
    layers: list[AttentionLayerConfig | SsmLayerConfig] = [
        AttentionLayerConfig(0, kv, sliding_window_size=window, num_sink_tokens=sinks if window else 0),
        AttentionLayerConfig(1, other),
    ]
    if ssm:
        layers.append(SsmLayerConfig(2, [BufferConfig("ssm_state", 512)]))
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, backend="cpu", layers=layers, cache_tiers=[GpuCacheTierConfig(4 << 20)]))


def _locked(manager: KVCacheManager) -> list[int]:
    return [usage.used for usage in manager.get_usage() if usage.level == 0]


def _observed_peak(manager: KVCacheManager, prompt: int, total: int, chunk: int, decode: int) -> list[int]:
    """The most pages a request locks while its prompt is computed in chunks of ``chunk`` (committed as computed)
    and the rest ``decode`` tokens a step."""
    tokens = list(range(1, total + 1))
    cache = manager.create_kv_cache(input_tokens=[])
    assert cache.resume()
    peak = _locked(manager)
    position = 0
    while position < total:
        end = min(position + (chunk if position < prompt else decode), prompt if position < prompt else total)
        assert cache.resize(end), cache.last_refusal
        peak = [max(a, b) for a, b in zip(peak, _locked(manager))]
        cache.commit(tokens[position:end])
        position = end
    cache.close()
    manager.clear_reusable_blocks()
    return peak


@pytest.mark.parametrize(("window", "sinks", "ssm", "separate"), [
    (None, 0, False, False), (40, 0, False, True), (64, 16, False, False), (24, 0, True, True),
])
def test_peak_pages_is_the_most_any_step_locks(window: int | None, sinks: int, ssm: bool, separate: bool) -> None:
    manager = _manager(window, sinks, ssm, separate)
    for total, prompt, chunk, decode in [(1, 1, 1, 1), (50, 50, 16, 1), (130, 97, 32, 1), (200, 120, 48, 4),
                                         (77, 40, 7, 3)]:
        expected = _observed_peak(manager, total, total, chunk, decode)  # all of it in chunks: the exact peak
        assert manager.peak_pages(total, chunk) == expected, (total, chunk)
        mixed = _observed_peak(manager, prompt, total, chunk, decode)  # then decoded a few tokens a step
        bound = manager.peak_pages(total, chunk)
        assert all(seen <= most for seen, most in zip(mixed, bound)), (total, prompt, chunk, mixed, bound)
    manager.shutdown()


def test_peak_pages_refuses_bad_arguments_and_records_nothing() -> None:
    manager = _manager(40, 0, False, True)
    with pytest.raises(ValueError, match="num_tokens"):
        manager.peak_pages(-1)
    with pytest.raises(ValueError, match="chunk_size"):
        manager.peak_pages(8, 0)
    with pytest.raises(TypeError, match="num_tokens"):
        manager.peak_pages(True)
    assert manager.peak_pages(2**70) == manager.peak_pages(2**24 * TPB)  # resize refuses anything longer
    assert manager.last_refusal is None
    manager.shutdown()


def test_a_no_evict_reservation_counts_against_admission_util() -> None:
    """Summed peaks within ``config.admission_util`` of the slots (``max_util_for_resume`` less the watermark's
    share) admit without a refusal; within ``max_util_for_resume`` alone, with a watermark, a resume is refused."""
    kv = [BufferConfig("key", TPB * 64), BufferConfig("value", TPB * 64)]
    manager = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, backend="cpu", layers=[AttentionLayerConfig(0, kv)], admission_watermark=0.3,
        cache_tiers=[GpuCacheTierConfig(10 * 2 * TPB * 64)]))
    total = manager.get_storage_statistics(0)[0].total
    config = manager.config
    assert total == 10 and int(total * config.max_util_for_resume) == 9 and int(total * config.admission_util) == 7
    running = manager.create_kv_cache(input_tokens=[])
    assert running.resume() and running.resize(8 * TPB)  # a running request at its peak of 8 pages
    assert manager.peak_pages(8 * TPB, TPB) == [8] and manager.peak_pages(TPB, TPB) == [1]
    newcomer = manager.create_kv_cache(input_tokens=[])  # 8 + 1 <= 9, but 9 > 7: the watermark refuses it
    assert not newcomer.resume()
    assert newcomer.last_refusal is not None and newcomer.last_refusal.by_watermark, newcomer.last_refusal
    newcomer.close()
    assert running.resize(6 * TPB)  # with the running request's peak 6 pages instead, 6 + 1 <= 7: admitted
    newcomer = manager.create_kv_cache(input_tokens=[])
    assert newcomer.resume() and newcomer.resize(TPB)
    for cache in (running, newcomer):
        cache.close()
    manager.shutdown()


def _compute_alone(manager: KVCacheManager, engine: FakeEngine, tokens: list[int], input_tokens: list[int]) -> bool:
    """Resume a new cache for ``tokens`` (reusing what matches ``input_tokens``), compute the rest a block at a
    time, committing as it goes, and check every position's K/V; False (the cache closed) when the resume is
    refused."""
    cache = manager.create_kv_cache(input_tokens=input_tokens)
    if not cache.resume():
        assert cache.last_refusal is not None and not cache.last_refusal.fits_empty_manager, cache.last_refusal
        cache.close()
        return False
    for begin in range(cache.history_length, len(tokens), TPB):
        end = min(begin + TPB, len(tokens))
        assert cache.resize(end, begin), cache.last_refusal
        engine.write(cache, tokens, begin, end)
        cache.commit(tokens[begin:end])
    engine.check(cache, tokens)
    cache.close()
    return True


def test_a_peak_over_admission_util_that_fits_alone_is_admitted_when_nothing_else_runs() -> None:
    """A request whose peak exceeds ``admission_util`` of the slots never fits a guaranteed-no-evict reservation
    beside others, but ``can_fit_in_chunks`` holds: admitted alone, its resume and every resize are accepted (resize
    is not bounded by the admission limit). With a reused prefix over the limit its resume is refused even alone
    (the matched pages are locked at once): created again without ``input_tokens`` it runs. README's
    GUARANTEED_NO_EVICT row says both."""
    kv = [BufferConfig("key", TPB * 64), BufferConfig("value", TPB * 64)]
    manager = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, backend="cpu", layers=[AttentionLayerConfig(0, kv)], admission_watermark=0.3,
        cache_tiers=[GpuCacheTierConfig(10 * 2 * TPB * 64)]))
    total = manager.get_storage_statistics(0)[0].total
    assert total == 10 and int(total * manager.config.admission_util) == 7
    tokens = list(range(1, 10 * TPB + 1))  # ten blocks: a peak of all ten slots
    assert manager.peak_pages(len(tokens), TPB) == [10] and manager.can_fit_in_chunks(len(tokens), TPB)
    engine = FakeEngine(manager)
    assert _compute_alone(manager, engine, tokens, [])
    assert not _compute_alone(manager, engine, tokens, tokens[:-1])  # nine matched pages: over the limit of 7
    refusal = manager.last_refusal
    assert refusal is not None and "create the request again without input tokens" in refusal.detail, refusal
    assert _compute_alone(manager, engine, tokens, [])
    manager.shutdown()
