"""What an engine asks before it admits (`can_fit`, `can_fit_in_chunks`, `max_admissible`) against what the calls do."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import pytest

from kv_cache_manager_v2 import BatchDesc, KVCacheManagerConfig, KVCacheDesc, KVCacheManager

from kv_cache_manager_v2.config import LayerConfig
from tests.fuzz.checks import check_fit_refusal
from tests.fuzz.configs import CONFIGS, FLAKY_REMOTE
from tests.helpers import KIB, SMALL_SLOTS, attention, make_config, small_manager, ssm

TPB = 32


def test_can_fit_and_max_admissible_answer_for_an_empty_manager() -> None:
    manager = small_manager()
    hog = manager.create_kv_cache()
    assert hog.resume() and hog.resize(9 * TPB)  # answers ignore other caches
    assert manager.can_fit(SMALL_SLOTS * TPB) and not manager.can_fit(SMALL_SLOTS * TPB + 1)
    assert manager.max_admissible() == SMALL_SLOTS * TPB
    assert manager.max_admissible(token_num_upper_bound=100) == 100
    hog.close()
    windowed = KVCacheManager(make_config([attention(0, 8 * KIB, window=2 * TPB)], gpu_quota=SMALL_SLOTS * 16 * KIB))
    assert windowed.can_fit(10**6)  # a window keeps its pages bounded ...
    assert not windowed.can_fit(10**6, chunk_size=SMALL_SLOTS * TPB)  # ... except for a chunk computed in one step
    cap = windowed.max_admissible(chunk_size=SMALL_SLOTS * TPB)  # in chunks from the start: 320, then 256
    assert cap == 18 * TPB and not windowed.can_fit_in_chunks(cap + 1, SMALL_SLOTS * TPB)


def test_a_request_computed_in_chunks_fits_where_can_fit_says_each_chunk_does() -> None:
    # can_fit(n, c) answers for the step computing the last c tokens (capacity n, history n - c); with a window,
    # pages are not monotone in the length, so an earlier chunk of a computation from the start may need more
    # (and its last chunk fewer, when c does not divide n). can_fit(end, end - start) for every chunk is the
    # answer for the whole computation: the manager refuses exactly the chunks it calls too big.
    tpb = 4
    step = BatchDesc([KVCacheDesc(capacity=20, history_length=19)] * 2)
    layers: list[LayerConfig] = [attention(0, KIB), attention(1, KIB, window=2 * tpb)]
    for num_tokens, chunk, whole in ((35, 3, False), (33, 4, True), (29, 9, True)):
        manager = KVCacheManager(make_config(layers, gpu_quota=24 * KIB, tokens_per_block=tpb, typical_step=step))
        chunks = [(start, min(start + chunk, num_tokens)) for start in range(0, num_tokens, chunk)]
        assert manager.can_fit(num_tokens, chunk) != whole  # the last chunk alone says otherwise
        cache = manager.create_kv_cache()
        assert cache.resume()
        for start, end in chunks:
            fits = manager.can_fit(end, end - start)
            assert cache.resize(end, start) == fits, (num_tokens, chunk, start, end)
            if not fits:
                break
            cache.commit(list(range(start, end)))
        assert all(manager.can_fit(end, end - start) for start, end in chunks) == whole
        assert manager.can_fit_in_chunks(num_tokens, chunk) == whole
        cache.close()


def test_can_fit_in_chunks_agrees_on_tight_tiers_where_a_middle_chunk_decides() -> None:
    """Small blocks, windows not a multiple of them, sinks, scratch reuse, GPU tiers around a window's peak and
    lengths far past the windows: the chunk that does not fit is often neither the first nor the last (a window's
    pages depend on where the chunk starts inside a block). Asking only the last whole step of the steady part
    (one period of 1) disagreed here in 21 of 1,440 cases."""
    for tpb in (4, 8):
        rng = random.Random(tpb // 4)
        for _ in range(60):
            layers: list[LayerConfig] = [
                attention(layer, KIB, window=rng.choice([5, 7, 9, 13, 21, 30]), sinks=rng.choice([None, 3, 9]))
                for layer in range(rng.choice([1, 2]))
            ]
            slots = rng.randrange(2, 12)
            scratch = rng.random() < 0.3
            config = make_config(layers, gpu_quota=slots * 2 * KIB * len(layers), tokens_per_block=tpb, enable_swa_scratch_reuse=scratch)
            try:
                manager = KVCacheManager(config)
            except ValueError:  # a tier below the constraint floors of this shape
                continue
            for _ in range(12):
                chunk, num_tokens = rng.randrange(1, 3 * tpb), rng.randrange(1, 1500)
                every = all(
                    manager.can_fit(min(start + chunk, num_tokens), min(start + chunk, num_tokens) - start)
                    for start in range(0, num_tokens, chunk)
                )
                assert manager.can_fit_in_chunks(num_tokens, chunk) == every, (layers, slots, scratch, num_tokens, chunk)
            manager.shutdown()


def _chunked_configs(directory: str) -> list[KVCacheManagerConfig]:
    return [config.build(directory) for config in CONFIGS if config.name not in (*FLAKY_REMOTE, "cold_codec")]


def test_can_fit_in_chunks_is_every_chunks_can_fit_from_a_few_steps(tmp_path: Path) -> None:
    """``can_fit_in_chunks(n, c)`` asks a bounded number of steps (the settling ones, one period of block
    offsets, the last): it equals ``can_fit(end, end - start)`` of every chunk over the fuzzer's configs (windows
    of 20, 24, 37 tokens with sinks, scratch reuse, SSM hybrids, several pool groups), lengths and
    chunks; and answers a length of millions at once."""
    rng = random.Random(7)
    checked = differ = 0
    for config in _chunked_configs(str(tmp_path)):
        manager = KVCacheManager(config)
        for _ in range(60):
            chunk = rng.choice([1, 3, 5, 16, 24, 40, 64, 100])
            num_tokens = rng.randrange(0, 900)
            every = manager.can_fit(0) and all(
                manager.can_fit(min(start + chunk, num_tokens), min(start + chunk, num_tokens) - start)
                for start in range(0, num_tokens, chunk)
            )
            assert manager.can_fit_in_chunks(num_tokens, chunk) == every, (config.layers, num_tokens, chunk)
            checked += 1
            differ += every != manager.can_fit(num_tokens, chunk)
        started = time.perf_counter()
        manager.can_fit_in_chunks(10**7, 1)  # ten million one-token steps, answered from a few hundred
        assert time.perf_counter() - started < 0.5
        manager.shutdown()
    assert checked > 400 and differ > 0, (checked, differ)  # where the last step alone answers otherwise


def test_can_fit_is_false_when_no_new_cache_of_a_hybrid_could_be_admitted(caplog: pytest.LogCaptureFixture) -> None:
    """A new cache's resume locks its SSM live state at once, within ``max_util_for_resume`` of the pool group: a
    GPU tier whose SSM pool group holds one slot (0.97 of it is no whole slot) refuses every admission, its
    refusal saying ``fits_empty_manager=False``. ``can_fit`` and ``max_admissible`` answered True and 80 tokens:
    an engine sizing its scheduler from them would wait forever. They now agree with the refusal, and the
    manager warns when it is built."""
    layers: list[LayerConfig] = [attention(0, 2 * KIB), ssm(1)]
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        manager = KVCacheManager(make_config(layers, gpu_quota=96 * KIB, tokens_per_block=16, initial_pool_ratio=[4, 1]))
    ssm_group = manager.get_pool_group_index(manager.get_layer_group_id(1))
    assert [usage.total for usage in manager.get_usage() if usage.pool_group == ssm_group] == [1]
    cache = manager.create_kv_cache()
    assert not cache.resume()
    assert cache.last_refusal is not None and not cache.last_refusal.fits_empty_manager
    cache.close()
    assert not manager.can_fit(10, 16) and manager.max_admissible(16) == 0
    why = manager.last_refusal  # a 0 is explained like a False: the shortest request's refusal
    assert why is not None and why.call == "KVCacheManager.max_admissible" and not why.fits_empty_manager, why
    assert why.pool_group == ssm_group and "locks 1 SSM live state in" in why.detail, why
    assert (
        f"no new cache can be admitted: its resume locks 1 SSM live state in pool group {ssm_group}, a GPU slot each; "
        f"an admission may lock at most 0 of its 1 slot (0.97: max_util_for_resume" in caplog.text
    ), caplog.text  # before: "... at most 0.97 of the SSM pool group's [1] ...", a Python list
    roomy = KVCacheManager(make_config(layers, gpu_quota=96 * KIB, tokens_per_block=16, max_util_for_resume=1.0,
                                       initial_pool_ratio=[4, 1]))
    assert roomy.can_fit(10, 16) and roomy.create_kv_cache().resume()


def test_a_cache_that_stopped_committing_fits_where_can_fit_says_its_step_does() -> None:
    """A cache alone on the manager whose committing stopped, moved by ``resize`` alone: the next chunk starting
    where the previous one ended (history moved by the resize, nothing committed), or the same chunk planned again
    longer (history kept). Its step fits exactly when ``can_fit(capacity, capacity - history)`` says a fresh
    request's does, and a refusal says ``fits_empty_manager=False``. The resize used to keep counting, and not count
    as room, the pages the step itself lets go of (the previous chunk's scratch slots the next one does not need,
    the pages of blocks a longer chunk puts in scratch): on the fuzzer's swa_scratch config a cache at capacity 54,
    history 27 was refused growing to 91 for good ("needs 21 GPU pages ... at most 20") where a fresh request's
    step holds 18."""
    rng = random.Random(5)
    steps = refused = 0
    for _ in range(40):
        tpb = rng.choice([4, 8, 16])
        windows = [rng.choice([None, 5, 9, 20, 37]) for _ in range(rng.choice([1, 2, 3]))]
        layers: list[LayerConfig] = [
            attention(layer, KIB, window=window, sinks=None if window is None else rng.choice([None, 3, 9]))
            for layer, window in enumerate(windows)
        ]
        slots = rng.randrange(4, 24)
        config = make_config(layers, gpu_quota=slots * 2 * KIB * len(layers), tokens_per_block=tpb, enable_swa_scratch_reuse=rng.random() < 0.8)
        try:
            manager = KVCacheManager(config)
        except ValueError:  # a tier below the constraint floors of this shape
            continue
        cache = manager.create_kv_cache()
        assert cache.resume()
        cache.stop_committing()
        for _ in range(30):
            again = not cache.has_scratch_slots and cache.capacity > cache.history_length and rng.random() < 0.4
            history = cache.history_length if again else cache.capacity
            capacity = cache.capacity + rng.randrange(1, 3 * tpb)
            fits = manager.can_fit(capacity, capacity - history)
            assert cache.resize(capacity, history) == fits, (layers, slots, cache.capacity, cache.history_length, capacity, history, manager.last_refusal)
            if not fits:
                assert cache.last_refusal is not None and not cache.last_refusal.fits_empty_manager, cache.last_refusal
            steps += 1
            refused += not fits
        cache.close()
        manager.shutdown()
    assert steps > 600 and 0 < refused < steps // 2, (steps, refused)


def test_max_admissible_is_a_cap_every_shorter_request_fits_under() -> None:
    """``max_admissible(chunk)`` was the longest N with ``can_fit(N, chunk)``, which a window makes no cap: at
    window 64 with 16 sink tokens, 16 tokens a block and 6 slots it answered 96 for chunks of 32 while 97 to 112
    tokens fit computed in chunks from the start (``can_fit_in_chunks``), and 2^28 for chunks of 16 while
    ``can_fit(97, 16)`` was False. It is now the longest request computed in chunks that fits, every shorter one
    fitting too, the number a scheduler compares a prompt plus its output with."""
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=64, sinks=16), attention(1, 2 * KIB, window=64, sinks=16)]
    manager = KVCacheManager(make_config(layers, gpu_quota=6 * 8 * KIB, tokens_per_block=16))
    assert [usage.total for usage in manager.get_usage()] == [6]
    assert manager.max_admissible(32) == 112
    for chunk in (1, 5, 16, 24, 32, 48, 96):
        cap = manager.max_admissible(chunk, token_num_upper_bound=400)
        assert all(manager.can_fit_in_chunks(n, chunk) for n in range(1, cap + 1)), chunk
        assert cap == 400 or not manager.can_fit_in_chunks(cap + 1, chunk), chunk
    manager.shutdown()


def test_clamp_max_seq_len_for_mem_answering_0_says_why() -> None:
    """A 0 from ``clamp_max_seq_len_for_mem`` is a refusal like ``max_admissible``'s. Before: it recorded nothing
    (``last_refusal`` None after ``clamp_max_seq_len_for_mem(11, 1000) == 0``)."""
    manager = small_manager()
    assert (manager.clamp_max_seq_len_for_mem(SMALL_SLOTS + 1, 0), manager.last_refusal) == (0, None)  # nothing asked
    assert manager.clamp_max_seq_len_for_mem(SMALL_SLOTS + 1, 1000) == 0
    check_fit_refusal(manager, "KVCacheManager.clamp_max_seq_len_for_mem")
    refusal = manager.last_refusal
    assert refusal is not None and (refusal.pages_needed, refusal.pages_available) == (SMALL_SLOTS + 1, SMALL_SLOTS)
    assert f"admitting {SMALL_SLOTS + 1} caches of one token needs {SMALL_SLOTS + 1} GPU pages in pool group 0" in refusal.detail
    assert manager.clamp_max_seq_len_for_mem(SMALL_SLOTS, 1000) > 0  # one fewer fits: the sentence's way out
    manager.shutdown()


def test_clamp_max_seq_len_for_mem_counts_what_the_batchs_resumes_may_lock() -> None:
    """Every cache of a hybrid's batch locks an SSM live state at its first resume, which ``max_util_for_resume``
    bounds: on a tier whose SSM group has 2 slots (1 admissible) two caches never run at once, whatever their length.
    Found integrating a hybrid engine from the docs: ``clamp_max_seq_len_for_mem(2, 100)`` answered 100 while the
    second cache's resume was refused. Before: ``assert 100 == 0``."""
    manager = KVCacheManager(make_config([attention(0), ssm(1), ssm(2)], gpu_quota=160 * KIB))
    ssm_pool_group = manager.get_pool_group_index(manager.get_layer_group_id(1))
    assert manager.get_storage_statistics()[ssm_pool_group].total == 2
    assert manager.clamp_max_seq_len_for_mem(1, 100) == 100
    assert manager.clamp_max_seq_len_for_mem(2, 100) == 0
    check_fit_refusal(manager, "KVCacheManager.clamp_max_seq_len_for_mem")
    refusal = manager.last_refusal
    assert refusal is not None and refusal.pool_group == ssm_pool_group
    # the states against the slots, as a page call's refusal reads the statistics; the limit (1) in the sentence
    assert (refusal.pages_needed, refusal.pages_available, refusal.pages_total) == (2, 2, 2)
    assert "at most 1 of its 2 slots" in refusal.detail
    assert "resuming 2 caches locks 2 SSM live states" in refusal.detail and "max_util_for_resume" in refusal.detail
    first, second = manager.create_kv_cache(), manager.create_kv_cache()  # what the answer stands for
    assert first.resume() and first.resize(2)
    assert not second.resume()
    for cache in (first, second):
        cache.close()
    manager.shutdown()
