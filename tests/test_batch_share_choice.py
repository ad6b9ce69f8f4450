"""Which earlier request of a batch a request shares its common prefix with (``_cache/batch_sharing.py``): the one
covering the most of its prefix, the earliest on a tie, the next one when that was refused. The planner files
requests block by block as later ones walk through (it compared each request with every earlier one sharing its
first block: quadratic behind one system prompt); this checks its choices against that rule, written out here
as it was, over seeded random batches with common prefixes of every depth, capacities cutting them short, and
refused requests."""

from __future__ import annotations

import random

from kv_cache_manager_v2 import KVCacheManager, KVCacheRequest

from tests.helpers import KIB, attention, make_config

TPB = 4
GPU_BLOCKS = 256


def request_tokens(rng: random.Random) -> list[int]:
    """Up to 6 full blocks, each one of two per position (mostly the first: long common prefixes), maybe a tail."""
    blocks = rng.randrange(1, 7)
    tokens: list[int] = []
    for index in range(blocks):
        choice = 0 if rng.random() < 0.75 else 1
        tokens += [1000 * index + 100 * choice + offset for offset in range(TPB)]
    return tokens + [9] * rng.randrange(TPB)


def expected_sources(requests: list[KVCacheRequest]) -> list[list[tuple[int, int]]]:
    """Per request, the candidate (position, end block) list, longest share first then in batch order: the rule
    the planner follows, for a batch whose requests reuse nothing from the tree."""
    offered: dict[tuple[int, ...], list[tuple[int, list[int], int]]] = {}
    result: list[list[tuple[int, int]]] = []
    for position, request in enumerate(requests):
        tokens = list(request.input_tokens)
        new_tokens = request.num_new_tokens
        capacity = len(tokens) if request.capacity is None else request.capacity
        limit = len(tokens) // TPB if new_tokens is not None else min(len(tokens), capacity) // TPB
        sources: list[tuple[int, int]] = []
        if len(tokens) >= TPB:
            for source, source_tokens, source_blocks in offered.get(tuple(tokens[:TPB]), []):
                end, last = 1, min(limit, source_blocks)
                while end < last and tokens[end * TPB : (end + 1) * TPB] == source_tokens[end * TPB : (end + 1) * TPB]:
                    end += 1
                if min(end, last) > 0:
                    sources.append((source, min(end, last)))
        sources.sort(key=lambda option: -option[1])
        result.append(sources)
        reused = sources[0][1] * TPB if sources else 0
        offer = reused + new_tokens if new_tokens is not None else capacity
        if min(len(tokens), offer) >= TPB:
            offered.setdefault(tuple(tokens[:TPB]), []).append((position, tokens, offer // TPB))
    return result


def random_request(rng: random.Random) -> KVCacheRequest:
    tokens = request_tokens(rng)
    draw = rng.random()
    if draw < 0.15:
        return KVCacheRequest(tokens, capacity=(GPU_BLOCKS + 1) * TPB)  # never fits: refused
    if draw < 0.4:
        return KVCacheRequest(tokens, capacity=rng.randrange(len(tokens), len(tokens) + 2 * TPB))
    if draw < 0.6:
        return KVCacheRequest(tokens, num_new_tokens=rng.randrange(1, len(tokens) + 1))
    return KVCacheRequest(tokens)


def test_a_batch_request_shares_with_the_earlier_request_covering_most_of_its_prefix() -> None:
    rng = random.Random(20261127)
    shared = 0
    for _ in range(60):
        config = make_config(
            [attention(0, KIB)], gpu_quota=GPU_BLOCKS * 2 * KIB, tokens_per_block=TPB, max_util_for_resume=1.0
        )
        manager = KVCacheManager(config)
        requests = [random_request(rng) for _ in range(rng.randrange(2, 9))]
        caches = manager.create_kv_cache_batch(requests)
        for position, (request, cache, sources) in enumerate(zip(requests, caches, expected_sources(requests))):
            refused = request.capacity == (GPU_BLOCKS + 1) * TPB
            assert (cache is None) == refused, position
            if cache is None:
                continue
            chosen = next(((source, end) for source, end in sources if caches[source] is not None), None)
            expected_history = 0 if chosen is None else chosen[1] * TPB
            assert cache.history_length == expected_history, (position, sources)
            if chosen is not None:
                source_cache = caches[chosen[0]]
                assert source_cache is not None
                pages = list(cache.get_base_page_indices(0))[: chosen[1]]
                assert pages == list(source_cache.get_base_page_indices(0))[: chosen[1]]
                shared += 1
        for cache in caches:
            if cache is not None:
                cache.close()
        manager.check_invariants()
        manager.shutdown()
    assert shared > 100  # the batches did share (142 times: at depths 1 to 5, 10 times past a refused source)
