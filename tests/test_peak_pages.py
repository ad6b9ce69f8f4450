"""``KVCacheManager.peak_pages``: the most GPU pages one request holds at any step, per pool group, which a
guaranteed-no-evict admission (TensorRT-LLM's ``GUARANTEED_NO_EVICT``) reserves for it. Checked against the pages
real caches lock on an otherwise empty manager, step by step: a prompt prefilled in chunks, then decoded a token
or a few drafts at a time."""

from __future__ import annotations

import random

import pytest

from kv_cache_manager_v2 import (AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, KVCacheManager,
                                 KVCacheManagerConfig, SsmLayerConfig, SwaScratchReuseConfig)
from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2._model.admission_limits import any_offset_steps
from kv_cache_manager_v2.config import KVCacheDesc
from kv_cache_manager_v2.testing import FakeEngine

TPB = 16


def _manager(window: int | None, sinks: int, ssm: bool, separate: bool, rewind: int | None = None) -> KVCacheManager:
    kv = [BufferConfig("key", TPB * 64), BufferConfig("value", TPB * 64)]
    other = [BufferConfig("key", TPB * 32), BufferConfig("value", TPB * 32)] if separate else kv  # own pool group
    layers: list[AttentionLayerConfig | SsmLayerConfig] = [
        AttentionLayerConfig(0, kv, sliding_window_size=window, num_sink_tokens=sinks if window else 0),
        AttentionLayerConfig(1, other),
    ]
    if ssm:
        layers.append(SsmLayerConfig(2, [BufferConfig("ssm_state", 512)]))
    scratch = None if rewind is None else SwaScratchReuseConfig(rewind)  # SWA scratch reuse with that rewind
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, backend="cpu", layers=layers, cache_tiers=[GpuCacheTierConfig(4 << 20)],
        enable_swa_scratch_reuse=scratch is not None, swa_scratch_reuse=scratch))


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
        bound = manager.peak_pages(total, chunk)
        chunked = _observed_peak(manager, total, total, chunk, decode)  # all of it in chunks from the first token
        assert all(seen <= most for seen, most in zip(chunked, bound)), (total, chunk, chunked, bound)
        mixed = _observed_peak(manager, prompt, total, chunk, decode)  # then decoded a few tokens a step
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


def _locked_at_step(manager: KVCacheManager, end: int, computed: int) -> list[int]:
    """The GPU pages a fresh cache locks at a step ending at ``end`` that computes its last ``computed`` tokens."""
    cache = manager.create_kv_cache(input_tokens=[])
    assert cache.resume() and cache.resize(end, end - computed), cache.last_refusal
    locked = _locked(manager)
    cache.close()
    return locked


@pytest.mark.parametrize(("window", "sinks", "ssm", "separate", "rewind"), [
    (9, 0, False, True, None), (40, 4, True, True, None), (24, 0, False, False, None), (64, 16, False, False, None),
    (40, 0, False, True, 0), (24, 4, True, True, 5),
])
def test_peak_pages_is_the_most_a_step_starting_anywhere_locks(
    window: int, sinks: int, ssm: bool, separate: bool, rewind: int | None
) -> None:
    """A step of at most ``chunk_size`` tokens need not start at a multiple of it: a chunk after a reused prefix or
    a snapshot point, a decode step with its drafts. ``peak_pages`` is the most any of them locks (a step computing
    fewer tokens to the same end locks no more), with SWA scratch reuse too. Before, only the steps from the first
    token counted: window 24, 130 tokens in chunks of 32: 12 pages, where the 32 tokens ending at 129 lock 14."""
    manager = _manager(window, sinks, ssm, separate, rewind)
    for total, chunk in [(130, 32), (50, 16), (90, 24), (27, 6)]:
        bound = manager.peak_pages(total, chunk)
        most = [0] * len(bound)
        for end in range(1, total + 1):
            for computed in sorted({1, min(chunk, end)}):
                locked = _locked_at_step(manager, end, computed)
                most = [max(a, b) for a, b in zip(most, locked)]
        assert most == bound, (total, chunk, most, bound)
    manager.shutdown()


def test_a_no_evict_admission_decoding_with_drafts_is_never_refused() -> None:
    """GUARANTEED_NO_EVICT as the README has it, a sliding window only: prompts prefilled a block at a time, then
    a decode step of the last token and one draft, the rejected draft rewound. Before, ``peak_pages(23, 4)`` was
    2 pages, the limit of 6 slots admitted 3 requests, and their decode steps at 15 + 2 tokens locked 3 each: the
    third request's resize was refused (0 free of 7)."""
    tpb = 4
    kv = [BufferConfig("key", tpb * 64), BufferConfig("value", tpb * 64)]
    manager = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=tpb, backend="cpu", layers=[AttentionLayerConfig(0, kv, sliding_window_size=5)],
        cache_tiers=[GpuCacheTierConfig(7 * 2 * tpb * 64)]))
    limit = int(manager.get_storage_statistics(0)[0].total * manager.config.admission_util)
    prompt_len, max_new, drafts = 12, 10, 1
    peak = manager.peak_pages(prompt_len + max_new + drafts, max(tpb, 1 + drafts))
    caches: list[_KVCache] = []
    while (len(caches) + 1) * peak[0] <= limit:
        cache = manager.create_kv_cache(input_tokens=[])
        assert cache.resume()
        caches.append(cache)
    assert len(caches) >= 2
    for begin in range(0, prompt_len, tpb):
        for number, cache in enumerate(caches):
            assert cache.resize(begin + tpb), cache.last_refusal
            cache.commit([1000 * number + position for position in range(begin, begin + tpb)])
    for _ in range(max_new):
        for cache in caches:  # the last sampled token and its draft, every request in the step
            assert cache.resize(cache.num_committed_tokens + 1 + drafts), cache.last_refusal
        for cache in caches:  # the draft rejected: one token accepted, its row given back
            accepted = cache.num_committed_tokens + 1
            cache.commit([7])
            assert cache.resize(accepted)
    for cache in caches:
        cache.close()
    manager.shutdown()


def _brute_peak(manager: KVCacheManager, total: int, chunk: int) -> list[int]:
    """The most pages any step of at most ``chunk`` tokens ending anywhere up to ``total`` holds, per pool group,
    by asking the planner every end and every count of tokens computed."""
    planner = internals_of(manager).planner
    most = [0] * len(planner.layout.pool_groups)
    for end in range(1, total + 1):
        for computed in range(1, min(chunk, end) + 1):
            pages = planner.cache_pages(KVCacheDesc(end, end - computed), 1, 0)
            most = [max(a, b) for a, b in zip(most, pages)]
    return most


def _random_manager(rng: random.Random) -> KVCacheManager:
    """Several windows (some smaller than a block), sinks that may overlap the window, full attention, SSM states,
    layer groups sharing a pool group or not, scratch reuse with a rewind or none, 1 to 8 tokens a block."""
    tpb = rng.choice([1, 2, 3, 4, 8])
    layers: list[AttentionLayerConfig | SsmLayerConfig] = []
    for layer in range(rng.randint(1, 4)):
        size = tpb * rng.choice([16, 32])  # a size of its own puts the layer group in a pool group of its own
        kv = [BufferConfig("key", size), BufferConfig("value", size)]
        if rng.random() < 0.25:
            layers.append(AttentionLayerConfig(layer, kv))
        else:
            window = rng.choice([1, 2, 3, tpb - 1, tpb, tpb + 1, 2 * tpb + 1, rng.randint(1, 40)])
            sinks = rng.choice([0, 0, 1, tpb, rng.randint(1, 3 * tpb), window + tpb])
            layers.append(AttentionLayerConfig(layer, kv, sliding_window_size=max(1, window),
                                               num_sink_tokens=sinks or None))
    if rng.random() < 0.3:
        layers.append(SsmLayerConfig(len(layers), [BufferConfig("ssm_state", 512)]))
    scratch = SwaScratchReuseConfig(rng.choice([0, 1, tpb, rng.randint(0, 12)])) if rng.random() < 0.4 else None
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=tpb, backend="cpu", layers=layers, cache_tiers=[GpuCacheTierConfig(4 << 20)],
        ssm_reuse_interval=tpb * 64,  # a multiple of any block size, for the SSM layers' snapshots
        enable_swa_scratch_reuse=scratch is not None, swa_scratch_reuse=scratch))


@pytest.mark.parametrize("seed", range(6))
def test_peak_pages_is_the_brute_force_maximum(seed: int) -> None:
    """``peak_pages`` asks only the last block's worth of steps (every group's count of a step one block later is
    no smaller); the maximum over every step of at most ``chunk`` tokens ending anywhere agrees, on random configs
    with the edges of that reasoning: windows smaller than a block, chunks larger than the window, a chunk of 1, a
    request shorter than the chunk, sinks overlapping the window, scratch reuse, one token a block."""
    rng = random.Random(seed)
    for _ in range(12):
        manager = _random_manager(rng)
        for total, chunk in [(rng.randint(1, 90), rng.randint(1, 24)), (rng.randint(1, 12), rng.randint(8, 30)),
                             (rng.randint(40, 90), 1)]:
            assert manager.peak_pages(total, chunk) == _brute_peak(manager, total, chunk), (total, chunk)
        manager.shutdown()


@pytest.mark.parametrize(("window", "chunk"), [(131_072, 8_192), (4_096, 512), (1_024, 8_192), (40, 1)])
def test_peak_pages_asks_a_few_steps_whatever_the_length(window: int, chunk: int) -> None:
    """A scheduler asks ``peak_pages`` per request at admission: the steps it counts are a few per block index
    offset, not a few per block of the window. Before, a 131,072-token window (64 sink tokens) over 524,288
    tokens in chunks of 8,192 asked 787 steps (~14 ms), now at most 10."""
    tpb = 32
    kv = [BufferConfig("key", tpb * 64), BufferConfig("value", tpb * 64)]
    manager = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=tpb, backend="cpu", cache_tiers=[GpuCacheTierConfig(4 << 20)],
        layers=[AttentionLayerConfig(0, kv, sliding_window_size=window, num_sink_tokens=64),
                AttentionLayerConfig(1, kv)]))
    planner = internals_of(manager).planner
    for total in (chunk + 1, 100_000, 524_288):
        steps = any_offset_steps(planner, total, chunk)
        assert len(steps) <= 1 + 3 * len(planner.block_index_offsets()), (total, len(steps))
    manager.shutdown()


@pytest.mark.parametrize(("tpb", "windows", "rewind", "total", "chunk"), [
    (2, [(3, 1), (3, 1)], 1, 9, 8), (1, [(5, 0), (5, 0), (1, 0)], 0, 6, 14), (2, [(1, 0), (1, 0)], 7, 11, 12),
    (4, [(1, 6), (1, 6)], 0, 16, 27),
])
def test_peak_pages_with_scratch_reuse_counts_steps_computing_fewer_tokens(
    tpb: int, windows: list[tuple[int, int]], rewind: int, total: int, chunk: int
) -> None:
    """With SWA scratch reuse a step computing more tokens may lock fewer pages: more of its blocks leave the
    window within the step and share scratch slots (layer groups of windows sharing a pool group, a block a
    fraction of a slot). Before, ``peak_pages`` asked only each end's step computing the most tokens: tokens a
    block 2, two windows of 3 (1 sink token), rewind 1, 9 tokens in chunks of at most 8: 4 pages, where the step
    computing 4 tokens to 9 locks 5 (a no-evict reservation of 4 pages then had that step's resize refused)."""
    kv = [BufferConfig("key", tpb * 16), BufferConfig("value", tpb * 16)]
    layers: list[AttentionLayerConfig | SsmLayerConfig] = [
        AttentionLayerConfig(layer, kv, sliding_window_size=window, num_sink_tokens=sinks or None)
        for layer, (window, sinks) in enumerate(windows)
    ]
    manager = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=tpb, backend="cpu", layers=layers, cache_tiers=[GpuCacheTierConfig(4 << 20)],
        enable_swa_scratch_reuse=True, swa_scratch_reuse=SwaScratchReuseConfig(rewind)))
    bound = manager.peak_pages(total, chunk)
    most = [0] * len(bound)
    for end in range(1, total + 1):
        for computed in range(1, min(chunk, end) + 1):
            most = [max(a, b) for a, b in zip(most, _locked_at_step(manager, end, computed))]
    assert most == bound == _brute_peak(manager, total, chunk), (most, bound)
    manager.shutdown()
