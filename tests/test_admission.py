"""Admission as a chunked-prefill scheduler plans it (issue #38): batch requests sized in new tokens beyond what
the cache reuses, and the admission watermark that keeps part of the GPU tier free for running caches to grow."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import KVCacheManager, KVCacheManagerConfig, KVCacheRequest
from kv_cache_manager_v2.testing import FakeEngine

from tests.helpers import KIB, attention, make_config

TPB = 32
SLOTS = 10  # one 8 KiB K + 8 KiB V layer: 10 blocks of GPU quota


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def small_manager(admission_watermark: float = 0.0) -> KVCacheManager:
    return KVCacheManager(
        make_config(
            [attention(0, 8 * KIB)],
            gpu_quota=SLOTS * 16 * KIB,
            max_util_for_resume=1.0,
            admission_watermark=admission_watermark,
        )
    )


def publish(manager: KVCacheManager, engine: FakeEngine, tokens: list[int]) -> None:
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    engine.step(cache, tokens)
    cache.commit(tokens)
    cache.close()


# ------------------------------------------------------------------------------------------- num_new_tokens
def test_num_new_tokens_counts_from_the_reused_history() -> None:
    manager = small_manager()
    engine = FakeEngine(manager)
    prompt = tokens_of(1, 2 * TPB)
    publish(manager, engine, prompt)
    request = prompt + tokens_of(2, 3 * TPB)
    reusing, fresh = manager.create_kv_cache_batch(
        [KVCacheRequest(request, num_new_tokens=TPB), KVCacheRequest(tokens_of(3, 3 * TPB), num_new_tokens=TPB + 5)]
    )
    assert reusing is not None and fresh is not None
    assert (reusing.history_length, reusing.capacity) == (2 * TPB, 3 * TPB)  # 2 reused blocks + one chunk
    assert (fresh.history_length, fresh.capacity) == (0, TPB + 5)
    engine.step(reusing, request)  # the chunk's content checks against the reused prefix
    reusing.commit(request[2 * TPB : 3 * TPB])
    assert reusing.resize(4 * TPB) and reusing.num_committed_tokens == 3 * TPB
    reusing.close()
    fresh.close()


def test_num_new_tokens_stops_at_the_prompt_end_so_a_shared_system_prompt_batch_fits() -> None:
    """Four prompts behind a 3-block system prompt, a 4-block chunk, an 8-block GPU tier; the engine passes each
    prompt without its last token (it needs that token's logits). The first request computes the system prompt and
    its tail, the others share the system prompt and need one tail block each (4 + 3 * 1 = 7 blocks).
    Capacity = history + chunk reached 4 blocks past the later prompts' end, and the last two were refused with
    ``pages_over_limit``; capped at the input's end, it left out the last prompt token, which then needed a resize
    up right after admission. The chunk now ends at the prompt's end, the token after the input, also when the
    input is reused whole (a repeat: one token to compute, not a whole chunk)."""
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], gpu_quota=8 * 16 * KIB, max_util_for_resume=1.0))
    engine = FakeEngine(manager)
    system = tokens_of(30, 3 * TPB)
    prompts = [system + tokens_of(31 + i, TPB // 2 + i) for i in range(4)]
    requests = [KVCacheRequest(tokens[:-1], num_new_tokens=4 * TPB) for tokens in prompts]
    batch = manager.create_kv_cache_batch(requests)
    assert None not in batch, manager.last_batch_refusals
    caches = [cache for cache in batch if cache is not None]
    assert [cache.history_length for cache in caches] == [0] + [3 * TPB] * 3
    assert [cache.capacity for cache in caches] == [len(tokens) for tokens in prompts]
    for cache, tokens in zip(caches, prompts):  # in batch order: the first computes the shared system prompt
        engine.step(cache, tokens)
        cache.commit(tokens[cache.num_committed_tokens :])
    for cache, tokens in zip(caches, prompts):
        engine.check(cache, tokens)
        cache.close()
    manager.check_invariants()
    (again,) = manager.create_kv_cache_batch(requests[1:2])
    assert again is not None, manager.last_batch_refusals
    assert (again.history_length, again.capacity) == (len(prompts[1]) - 1, len(prompts[1]))
    engine.step(again, prompts[1])
    engine.check(again, prompts[1])
    again.close()
    manager.check_invariants()


def test_num_new_tokens_zero_admits_the_reused_prefix_only() -> None:
    manager = small_manager()
    engine = FakeEngine(manager)
    prompt = tokens_of(1, 2 * TPB)
    publish(manager, engine, prompt)
    (cache,) = manager.create_kv_cache_batch([KVCacheRequest(prompt + [7], num_new_tokens=0)])
    assert cache is not None and cache.capacity == cache.history_length == 2 * TPB
    cache.close()


def test_capacity_and_num_new_tokens_are_exclusive() -> None:
    with pytest.raises(ValueError, match="capacity .* or num_new_tokens"):
        KVCacheRequest([1, 2, 3], capacity=3, num_new_tokens=1)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        KVCacheRequest([1, 2, 3], num_new_tokens=-1)
    with pytest.raises(TypeError, match="num_new_tokens"):
        KVCacheRequest([1, 2, 3], num_new_tokens=True)
    manager = small_manager()
    request = KVCacheRequest([1, 2, 3], num_new_tokens=1)
    request.capacity = 3  # changed after construction: the batch checks again, before any change
    with pytest.raises(ValueError, match=r"requests\[1\] takes capacity"):
        manager.create_kv_cache_batch([KVCacheRequest([4, 5]), request])
    request.capacity = None
    request.num_new_tokens = -2
    with pytest.raises(ValueError, match=r"requests\[0\].num_new_tokens must be >= 0"):
        manager.create_kv_cache_batch([request])
    assert manager.last_batch_refusals == ()


# ------------------------------------------------------------------------------------------- watermark
def test_watermark_must_be_a_fraction_below_one() -> None:
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match="admission_watermark must be in"):
            make_config([attention(0, 8 * KIB)], admission_watermark=bad)
    for wrong_type in ("0.1", True):
        with pytest.raises(TypeError, match="admission_watermark"):
            make_config([attention(0, 8 * KIB)], admission_watermark=wrong_type)
    assert KVCacheManagerConfig.__dataclass_fields__["admission_watermark"].default == 0.0


def test_resume_refused_at_the_watermark_says_so() -> None:
    manager = small_manager(admission_watermark=0.3)  # at most 7 of 10 pages locked by an admission
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(6 * TPB)
    newcomer = manager.create_kv_cache()
    assert newcomer.resume() and newcomer.resize(2 * TPB)  # a resize may go past the watermark: 8 locked
    newcomer.suspend()
    assert not newcomer.resume()  # 6 + 2 > 7; without the watermark 8 of 10 would fit
    refusal = newcomer.last_refusal
    assert refusal is not None and refusal.call == "KVCache.resume" and refusal.by_watermark
    assert "watermark" in refusal.detail and refusal.fits_empty_manager
    assert manager.last_refusal == refusal
    running.close()
    newcomer.close()


def test_running_caches_grow_into_the_watermark() -> None:
    manager = small_manager(admission_watermark=0.5)
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(5 * TPB)  # the admission itself stays within 50%
    for capacity in range(5 * TPB + 1, SLOTS * TPB + 1):  # decode steps into the watermark, up to the whole tier
        assert running.resize(capacity), capacity
    assert running.last_refusal is None
    running.close()


def test_batch_admission_honours_the_watermark() -> None:
    manager = small_manager(admission_watermark=0.4)  # admissions may lock 6 of 10 pages
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(4 * TPB)
    results = manager.create_kv_cache_batch(
        [KVCacheRequest(tokens_of(1, 2 * TPB)), KVCacheRequest(tokens_of(2, TPB))]
    )
    assert results[0] is not None and results[1] is None  # 4 + 2 = 6 fits; a 7th page crosses the watermark
    first, second = manager.last_batch_refusals
    assert first is None and second is not None and second.by_watermark
    assert second.call == "create_kv_cache_batch"
    results[0].close()
    running.close()


def test_no_watermark_refuses_as_before() -> None:
    manager = small_manager()
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(9 * TPB)
    late = manager.create_kv_cache()
    assert late.resume()  # no pages to lock
    assert not late.resize(2 * TPB)
    refusal = late.last_refusal
    assert refusal is not None and not refusal.by_watermark and "watermark" not in refusal.detail
    late.close()
    running.close()


# ------------------------------------------------------------------------------------------- shared prefix
def big_manager(enable_partial_reuse: bool | None = None) -> KVCacheManager:
    return KVCacheManager(
        make_config(
            [attention(0, 8 * KIB), attention(1, 8 * KIB)],
            gpu_quota=64 * 32 * KIB,
            max_util_for_resume=1.0,
            enable_partial_reuse=enable_partial_reuse,
        )
    )


def free_gpu_pages(manager: KVCacheManager) -> int:
    return manager.get_usage()[0].free


def test_batch_requests_with_a_common_prefix_share_its_pages() -> None:
    manager = big_manager()
    engine = FakeEngine(manager)
    prefix = tokens_of(1, 3 * TPB)
    first_tokens, second_tokens = prefix + tokens_of(2, TPB + 5), prefix + tokens_of(3, 2 * TPB)
    free_before = free_gpu_pages(manager)
    first, second = manager.create_kv_cache_batch([KVCacheRequest(first_tokens), KVCacheRequest(second_tokens)])
    assert first is not None and second is not None
    assert (first.history_length, first.capacity) == (0, len(first_tokens))
    assert (second.history_length, second.capacity) == (3 * TPB, len(second_tokens))  # the prefix is first's
    assert list(second.get_base_page_indices(0))[:3] == list(first.get_base_page_indices(0))[:3]
    assert free_before - free_gpu_pages(manager) == 3 + 2 + 2  # 3 shared blocks + 2 + 2, not 5 + 5
    manager.check_invariants()
    engine.step(first, first_tokens)  # in batch order: the first request writes the shared blocks
    engine.step(second, second_tokens)  # reads them as its history
    second.commit(second_tokens)  # either may commit the shared blocks first
    first.commit(first_tokens)
    manager.check_invariants()
    first.close()
    engine.check(second, second_tokens)
    second.close()
    manager.check_invariants()
    assert manager.probe_reuse(None, prefix + [49_998]) == 3 * TPB
    assert free_gpu_pages(manager) == free_before - (3 + 2 + 2)  # committed once: 3 + 2 + 2 blocks cached


def test_a_sharer_outlives_the_request_that_computed_its_prefix() -> None:
    manager = big_manager()
    engine = FakeEngine(manager)
    prefix = tokens_of(4, 2 * TPB)
    first_tokens, second_tokens = prefix + tokens_of(5, 3), prefix + tokens_of(6, TPB)
    first, second = manager.create_kv_cache_batch([KVCacheRequest(first_tokens), KVCacheRequest(second_tokens)])
    assert first is not None and second is not None and second.history_length == 2 * TPB
    engine.step(first, first_tokens)
    engine.step(second, second_tokens)
    first.close()  # never committed: the shared pages stay with the second request
    manager.check_invariants()
    engine.check(second, second_tokens)
    second.commit(second_tokens)
    assert second.resize(len(second_tokens) + 1)
    second.close()
    manager.check_invariants()
    assert manager.probe_reuse(None, second_tokens + [1]) == len(second_tokens)


def test_num_new_tokens_counts_the_shared_prefix_as_reused() -> None:
    manager = big_manager()
    engine = FakeEngine(manager)
    prefix = tokens_of(7, 4 * TPB)
    first_tokens, second_tokens = prefix + tokens_of(8, 2 * TPB), prefix + tokens_of(9, 2 * TPB)
    chunk = 3 * TPB  # a chunked prefill: the first request computes 3 of the 4 common blocks in this step
    first, second = manager.create_kv_cache_batch(
        [KVCacheRequest(first_tokens, num_new_tokens=chunk), KVCacheRequest(second_tokens, num_new_tokens=chunk)]
    )
    assert first is not None and second is not None
    assert (first.history_length, first.capacity) == (0, chunk)
    assert (second.history_length, second.capacity) == (chunk, 2 * chunk)
    engine.step(first, first_tokens)
    engine.step(second, second_tokens)
    manager.check_invariants()
    first.close()
    second.close()


def test_a_sharer_commits_from_num_committed_tokens_and_a_commit_from_its_history_is_refused() -> None:
    """A request that shares an earlier one's prefix pages starts its history after them, not its commits:
    ``num_committed_tokens`` stays where its own reuse ended. Committing the step's tokens from ``history_length``
    (an engine reading history as committed) put them at the shared positions, and the shared pages, holding the
    prefix's K/V, entered the tree under those tokens' keys: a later prompt starting with them was served the
    prefix's K/V (FakeEngine: wrong content at every position). Such a commit is refused, naming the argument and
    the fix, and changes nothing, on the O(1) decode path too (fewer tokens than a block)."""
    manager = big_manager()
    engine = FakeEngine(manager)
    prefix = tokens_of(16, 2 * TPB)
    first_tokens, second_tokens = prefix + tokens_of(17, 2 * TPB), prefix + tokens_of(18, 2 * TPB)
    first, second = manager.create_kv_cache_batch([KVCacheRequest(first_tokens), KVCacheRequest(second_tokens)])
    assert first is not None and second is not None
    assert (second.num_committed_tokens, second.history_length) == (0, 2 * TPB)
    engine.step(first, first_tokens)
    engine.step(second, second_tokens)
    lengths = (second.num_committed_tokens, second.history_length, second.capacity)
    for wrong in (second_tokens[2 * TPB :], second_tokens[2 * TPB : 2 * TPB + 5]):
        with pytest.raises(ValueError, match=r"accepted_input_tokens\[0\] .*position 0 .*commit from "
                           r"num_committed_tokens \(0\)"):
            second.commit(wrong)
        assert (second.num_committed_tokens, second.history_length, second.capacity) == lengths
    second.commit(second_tokens[:5])  # from num_committed_tokens: accepted, on either path
    second.commit(second_tokens[5:])
    first.commit(first_tokens)
    first.close()
    second.close()
    manager.check_invariants()
    assert manager.probe_reuse(None, second_tokens[2 * TPB :] + [1]) == 0  # nothing published under wrong keys
    assert manager.probe_reuse(None, second_tokens + [1]) == len(second_tokens)


def test_no_sharing_when_the_earlier_request_is_refused() -> None:
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], gpu_quota=SLOTS * 16 * KIB, max_util_for_resume=1.0))
    engine = FakeEngine(manager)
    prefix = tokens_of(10, 2 * TPB)
    too_long = prefix + tokens_of(11, (SLOTS + 1) * TPB)
    fitting = prefix + tokens_of(12, TPB)
    refused, admitted, sized = manager.create_kv_cache_batch(
        [KVCacheRequest(too_long), KVCacheRequest(fitting), KVCacheRequest(prefix + tokens_of(13, TPB), num_new_tokens=TPB)]
    )
    assert refused is None and admitted is not None and sized is not None
    assert (admitted.history_length, admitted.capacity) == (0, len(fitting))  # computes its own prefix
    assert (sized.history_length, sized.capacity) == (2 * TPB, 3 * TPB)  # shares the second's, counts from there
    engine.step(admitted, fitting)
    engine.step(sized, prefix + tokens_of(13, TPB))
    manager.check_invariants()
    admitted.close()
    sized.close()


def test_partially_reused_block_is_shared_not_copied_twice() -> None:
    manager = big_manager(enable_partial_reuse=True)
    engine = FakeEngine(manager)
    prefix = tokens_of(14, 3 * TPB)
    publish(manager, engine, prefix[: TPB + 10])  # the tree holds one block and a partial one of the prefix
    first_tokens, second_tokens = prefix + [1, 2], prefix + [3, 4]
    first, second = manager.create_kv_cache_batch([KVCacheRequest(first_tokens), KVCacheRequest(second_tokens)])
    assert first is not None and second is not None
    assert first.history_length == TPB + 10 and second.history_length == 3 * TPB
    engine.step(first, first_tokens)
    engine.step(second, second_tokens)
    manager.check_invariants()
    first.commit(first_tokens[first.num_committed_tokens :])
    second.commit(second_tokens[second.num_committed_tokens :])
    first.close()
    second.close()
    manager.check_invariants()
    assert manager.probe_reuse(None, prefix + [5]) == 3 * TPB


def test_windowed_models_do_not_share() -> None:
    manager = KVCacheManager(make_config([attention(0, 8 * KIB), attention(1, 8 * KIB, window=TPB)], max_util_for_resume=1.0))
    prefix = tokens_of(15, 3 * TPB)
    first, second = manager.create_kv_cache_batch([KVCacheRequest(prefix + [1]), KVCacheRequest(prefix + [2])])
    assert first is not None and second is not None and second.history_length == 0
    first.close()
    second.close()
