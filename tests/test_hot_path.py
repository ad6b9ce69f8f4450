"""The bookkeeping hot path (issue #21): the O(1) resize/commit path agrees with the planned one, its stale-range
bound is safe and tight, a match computes no SHA-256 and a commit one per new block, and prompts whose block tokens
collide in ``hash()`` still get their own content."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np
import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2 import BAD_PAGE_INDEX, KVCacheManager, LayerGroupId, sequence_to_blockchain_keys
from kv_cache_manager_v2._manager.manager import KVCache
from kv_cache_manager_v2._model.life_cycle import NEVER, SsmLifeCycle, WindowedAttentionLifeCycle
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine

from tests.helpers import KIB, attention, make_config, profiled_calls, ssm


@pytest.mark.parametrize("tokens_per_block", [1, 4, 32])
@pytest.mark.parametrize("window", [1, 5, 64, 100])
@pytest.mark.parametrize("sink_blocks", [0, 1, 3])
def test_stale_steady_below_is_the_next_change(tokens_per_block: int, window: int, sink_blocks: int) -> None:
    life_cycle = WindowedAttentionLifeCycle(LayerGroupId(0), tokens_per_block, window, sink_blocks)
    for history in range(0, 400):
        below = life_cycle.stale_steady_below(history)
        assert below > history
        here = life_cycle.stale(history)
        for later in range(history, min(below, history + 200)):
            assert life_cycle.stale(later) == here, (history, later, below)
        # Tight where it matters: the window's first block moves exactly there (past the sinks' filling).
        if below < history + 200 and history >= sink_blocks * tokens_per_block:
            assert life_cycle.stale(below) != here or here[1] == here[0], (history, below)


def test_ssm_and_full_attention_never_change_their_stale_range() -> None:
    assert SsmLifeCycle(LayerGroupId(0), 32).stale_steady_below(12345) == NEVER


def _layers() -> list[LayerConfig]:
    return [attention(0, 2 * KIB), attention(1, 2 * KIB, window=48, sinks=5), ssm(2, 4 * KIB, KIB)]


def _state(manager: KVCacheManager, caches: list[KVCache | None]) -> list[object]:
    seen: list[object] = []
    for cache in caches:
        if cache is None:
            seen.append(None)
            continue
        seen.append((cache.status, cache.capacity, cache.history_length, cache.committed_tokens))
        if cache.is_active:
            for group in range(manager.num_layer_groups):
                seen.append(list(cache.get_base_page_indices(group)))
                seen.append(cache.get_num_front_blocks_removed(group))
    seen.append([(s.total, s.free, s.evictable) for s in manager.get_storage_statistics(0)])
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_fast_path_and_planned_path_leave_identical_state(seed: int) -> None:
    """Plain ints and lists take the O(1) path where it applies; NumPy ints and tuples always take the planned
    one. The same random steps on two managers must leave the same lengths, page tables and slot counts."""
    config = make_config(
        _layers(), gpu_quota=2 << 20, tokens_per_block=8, initial_pool_ratio=[0.4, 0.3, 0.3], ssm_reuse_interval=16
    )
    managers = [KVCacheManager(config) for _ in range(2)]
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]
    caches: list[list[KVCache | None]] = [[None] * 4, [None] * 4]
    next_token = 10_000

    def slow_int(value: int) -> np.int64:
        return np.int64(value)

    for step_number in range(400):
        slot = rng.randrange(4)
        first = caches[0][slot]
        if first is None:
            prompt = rng.choice(prefixes)[: rng.randrange(0, 40)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            for side, manager in enumerate(managers):
                opened = manager.create_kv_cache(None, prompt[:-1])
                assert opened.resume()
                caches[side][slot] = opened
            outcome = {caches[side][slot].resize(len(prompt) - 1, None) for side in range(2)}  # type: ignore[union-attr]
            assert len(outcome) == 1
            if outcome == {True}:
                for side in range(2):
                    cache = caches[side][slot]
                    assert cache is not None
                    rest = prompt[cache.num_committed_tokens : -1]
                    cache.commit(rest if side == 0 else tuple(rest))
        elif first.status == KVCache.Status.SUSPENDED:
            results = {caches[side][slot].resume() for side in range(2)}  # type: ignore[union-attr]
            assert len(results) == 1
        else:
            action = rng.random()
            if action < 0.05:
                for side in range(2):
                    caches[side][slot].close()  # type: ignore[union-attr]
                    caches[side][slot] = None
            elif action < 0.1:
                for side in range(2):
                    caches[side][slot].suspend()  # type: ignore[union-attr]
            else:
                capacity = first.capacity
                history = first.history_length
                step = 1 if action < 0.8 else rng.randrange(1, 12)
                ahead = rng.randrange(0, 3) if action > 0.95 else 0
                resized = []
                for side in range(2):
                    cache = caches[side][slot]
                    assert cache is not None
                    if side == 0:
                        resized.append(cache.resize(capacity + step + ahead, capacity))
                    else:
                        resized.append(cache.resize(slow_int(capacity + step + ahead), slow_int(capacity)))
                assert resized[0] == resized[1]
                if resized[0]:
                    tokens = list(range(next_token, next_token + step))
                    next_token += step
                    assert history <= capacity
                    for side in range(2):
                        cache = caches[side][slot]
                        assert cache is not None
                        cache.commit(tokens if side == 0 else tuple(tokens))
        assert _state(managers[0], caches[0]) == _state(managers[1], caches[1])
        if step_number % 50 == 0:
            managers[0].check_invariants()
    for side, manager in enumerate(managers):
        manager.check_invariants()
        for cache in caches[side]:
            if cache is not None:
                cache.close()
        manager.check_invariants()
        manager.shutdown()


@pytest.mark.parametrize("committing", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_history_step_then_capacity_step_equals_one_combined_resize(seed: int, committing: bool) -> None:
    """An engine that sets ``history_length`` and then grows the capacity (TensorRT-LLM's batching loop) takes the
    history-only step, which plans nothing; the same lengths in one ``resize(capacity, history)`` take the planned
    one. Both must leave the same page tables, slot counts and content, committing or not."""
    config = make_config(_layers(), gpu_quota=4 << 20, tokens_per_block=8, ssm_reuse_interval=16)
    managers = [KVCacheManager(config) for _ in range(2)]
    engines = [FakeEngine(manager) for manager in managers]
    rng = random.Random(seed)
    tokens = [rng.randrange(1000) for _ in range(400)]
    caches: list[list[KVCache | None]] = [[], []]
    for side, manager in enumerate(managers):
        for _ in range(3):
            opened = manager.create_kv_cache()
            assert opened.resume()
            if not committing:
                opened.stop_committing()  # stale pages are freed at once rather than held for a commit
            caches[side].append(opened)
    for _ in range(60):
        slot = rng.randrange(3)
        first = caches[0][slot]
        assert first is not None
        step = rng.choice([1, 3, 8, 13, 24])
        capacity = first.capacity + step
        if capacity > len(tokens):
            continue
        computed = first.capacity  # the previous step's input is computed: the history catches up with it
        commit_now = committing and rng.random() < 0.5  # a lagging commit: stale pages wait for it, held
        for side in range(2):
            stepping = caches[side][slot]
            assert stepping is not None
            if side == 0:  # the history first (its stale pages, uncommitted yet, are held), then the commit
                stepping.history_length = computed
            if commit_now:
                stepping.commit(tokens[stepping.num_committed_tokens : computed])
            assert stepping.resize(capacity) if side == 0 else stepping.resize(capacity, computed)
            engines[side].step(stepping, tokens)
        assert _state(managers[0], caches[0]) == _state(managers[1], caches[1])
    for side, manager in enumerate(managers):
        manager.check_invariants()
        for closing in caches[side]:
            assert closing is not None
            closing.close()
        manager.shutdown()


@pytest.mark.parametrize("events", [False, True])
def test_block_keys_are_computed_only_when_asked_for(events: bool) -> None:
    manager = KVCacheManager(
        make_config([attention(0, 2 * KIB)], gpu_quota=2 << 20, tokens_per_block=8, enable_kv_events=events)
    )
    shared = list(range(64))  # 8 blocks, cached by a first request
    first = manager.create_kv_cache(None, shared)
    assert first.resume() and first.resize(len(shared))
    first.commit(shared)
    first.close()
    prompt = shared + list(range(1000, 1041))  # 5 more full blocks and a partial one
    hit = manager.probe_reuse(None, prompt[:-1])
    assert hit == len(shared)
    cache = manager.create_kv_cache(None, prompt[:hit])
    assert cache.resume() and cache.resize(len(prompt))
    cache.commit(prompt[hit:])
    cache.close()
    tree = internals_of(manager).tree
    blocks = []
    node = tree.find_root(None)
    for begin in range(0, len(prompt), 8):
        assert node is not None
        node = tree.child(node, tuple(prompt[begin : begin + 8]))
        blocks.append(node)
    assert None not in blocks and len(blocks) == 14
    expected = [key for _, key in sequence_to_blockchain_keys(8, None, prompt)]
    if events:  # the stored events carried every key: computed as each block joined the tree
        assert [block.known_key for block in blocks if block is not None] == expected
        assert [event.block_hash for event in manager.get_latest_events() if event.kind == "stored"] == expected
    else:  # nobody asked: no SHA-256 at all, until a key is read
        assert all(block.known_key == b"" for block in blocks if block is not None)
        last = blocks[-1]
        assert last is not None and last.key == expected[-1]
        assert [block.known_key for block in blocks if block is not None] == expected
    manager.shutdown()


def test_prompts_whose_blocks_collide_in_hash_keep_their_own_content() -> None:
    manager = KVCacheManager(make_config([attention(0, 2 * KIB)], gpu_quota=2 << 20, tokens_per_block=4))
    engine = FakeEngine(manager)
    modulus = (1 << 61) - 1  # ints hash modulo this prime: these first blocks share one hash()
    prompts = [[1, 2, 3, 5 + n * modulus, 10 * n, 10 * n + 1, 10 * n + 2, 10 * n + 3, 7] for n in range(3)]
    assert len({hash(tuple(prompt[:4])) for prompt in prompts}) == 1
    for prompt in prompts:
        cache = manager.create_kv_cache(None, prompt)  # (the later ones reuse [1, 2, 3] partially)
        assert cache.resume() and cache.resize(len(prompt))
        engine.step(cache, prompt)
        cache.commit(prompt[cache.num_committed_tokens :])
        cache.close()
    manager.check_invariants()
    for prompt in prompts:
        assert manager.probe_reuse(None, prompt) == len(prompt)
        cache = manager.create_kv_cache(None, prompt)
        assert cache.num_committed_tokens == len(prompt) and cache.resume()
        engine.check(cache, prompt)  # each prompt's own pages, not a colliding one's
        cache.close()
    manager.clear_reusable_blocks()
    assert all(manager.probe_reuse(None, prompt) == 0 for prompt in prompts)
    manager.check_invariants()
    manager.shutdown()


def test_the_manager_keeps_no_list_the_caller_passed() -> None:
    """Token lists are read in place, not copied: changing one afterwards must change nothing inside."""
    manager = KVCacheManager(make_config([attention(0, 2 * KIB)], gpu_quota=2 << 20, tokens_per_block=8))
    engine = FakeEngine(manager)
    prompt = list(range(100, 120))
    expected = list(prompt)
    assert manager.probe_reuse(None, prompt) == 0
    cache = manager.create_kv_cache(None, prompt)
    assert cache.resume() and cache.resize(len(prompt))
    engine.step(cache, expected)
    chunk = prompt[:12]
    cache.commit(chunk)
    chunk[:] = [0] * 12
    rest = prompt[12:]
    cache.commit(rest)
    rest[:] = [0] * len(rest)
    prompt[:] = [0] * len(prompt)
    assert cache.committed_tokens == expected
    cache.close()
    again = manager.create_kv_cache(None, expected)
    assert again.num_committed_tokens == len(expected) and again.resume()
    engine.check(again, expected)
    again.close()
    manager.check_invariants()
    manager.shutdown()


def test_the_per_step_calls_are_defined_on_the_public_class_itself() -> None:
    # CPython specialises a call to a compiled method only for receivers of exactly the defining class; a method
    # inherited from CacheHandle costs an engine's every decode step the generic call path, and an inherited
    # property a subtype check per read.
    for name in ("resize", "commit", "capacity", "history_length"):
        assert name in vars(KVCache), f"KVCache.{name} is inherited: see _HOT_PATH_NOTE in _manager/manager.py"


@pytest.mark.skipif(kv_cache_manager_v2.COMPILED, reason="compiled code makes no calls a profiler sees")
def test_a_long_windowed_cache_costs_its_pages_not_its_blocks() -> None:
    """Suspend, resume, a refused resize and close of two sliding windows 2**16 blocks long make no call per block:
    calls per block there (the pages in block order, the release at close) made one such cache of
    ``MAX_BLOCKS_PER_CACHE`` blocks take ~10 s to refuse a resize and close (test_refusals.py)."""
    tpb, blocks = 32, 1 << 16
    layers: list[LayerConfig] = [attention(0, 8 * KIB, window=64), attention(1, 8 * KIB, window=160)]
    manager = KVCacheManager(make_config(layers, gpu_quota=64 * 16 * KIB))  # 64 slots: debug mode checks each
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(blocks * tpb, blocks * tpb - 1)

    def walk() -> None:
        cache.suspend()
        assert cache.resume()
        assert not cache.resize((blocks + 128) * tpb, blocks * tpb)  # a chunk of 128 blocks: more than the slots
        cache.close()

    calls = profiled_calls(walk)
    assert calls < blocks // 8, calls
    manager.shutdown()


Tracer = Callable[[FrameType, str, Any], Any]  # (typeshed's TraceFunction is private)


def _library_lines(call: Callable[[], object], module: str = "") -> int:
    """Lines of library code run while ``call()`` runs (those of files whose path ends with ``module``): a loop over
    blocks with no call inside counts here though ``profiled_calls`` misses it (interpreted code only). Debug mode's
    invariants (and what they call), which walk every block by design, are left out."""
    count = 0
    root = kv_cache_manager_v2.__file__.rsplit("/", 1)[0]

    def line(frame: FrameType, event: str, arg: object) -> Tracer:
        nonlocal count
        count += event == "line"
        return line

    def trace(frame: FrameType, event: str, arg: object) -> Tracer | None:
        name = frame.f_code.co_filename
        caller: FrameType | None = frame
        while caller is not None:
            if caller.f_code.co_filename.endswith("invariants.py"):
                return None
            caller = caller.f_back
        return line if name.startswith(root) and name.endswith(module + ".py") else None

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def _long_windowed_cache(engine: FakeEngine, manager: KVCacheManager, prompt: list[int], buffer: np.ndarray) -> KVCache:
    """A cache prefilled (by ``engine``) and committed through ``prompt`` in chunks of 64 blocks, ``buffer``
    registered for group 0."""
    cache = manager.create_kv_cache(None, prompt)
    cache.set_base_page_index_buf(0, LayerGroupId(0), buffer)
    assert cache.resume()
    for end in range(256, len(prompt) + 1, 256):
        assert cache.resize(end)
        engine.step(cache, prompt)
        assert cache.resize(end, end)
        cache.commit(prompt[cache.num_committed_tokens : end])  # (stale pages are held until committed)
    return cache


@pytest.mark.skipif(kv_cache_manager_v2.COMPILED, reason="compiled code runs no lines a tracer sees")
def test_a_long_windowed_cache_walks_its_pages_not_its_blocks() -> None:
    """Suspend and resume (the index table rebuilt, a registered buffer cleared and refilled) and the creation of a
    cache reusing a windowed prefix (adopting its pages, counting the reuse) run as many lines for a prefix of 2**12
    blocks as for one of 2**10: the stale range between the sinks and the window holds no page. (The prefix match
    itself walks every block.)"""
    tpb, window, sinks = 4, 64, 8
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=window, sinks=sinks), attention(1, 2 * KIB, window=4 * window)]
    walked: list[int] = []
    created: list[int] = []
    for blocks in (1 << 10, 1 << 12):
        manager = KVCacheManager(make_config(layers, gpu_quota=8 << 20, tokens_per_block=tpb))
        prompt = list(range(blocks * tpb))
        buffer = np.zeros(blocks + 8, np.int32)
        engine = FakeEngine(manager)
        cache = _long_windowed_cache(engine, manager, prompt, buffer)
        late = np.zeros(blocks + 8, np.int32)  # registered while active: the table, then BAD_PAGE_INDEX
        cache.set_base_page_index_buf(0, LayerGroupId(1), late)
        assert late.tolist() == list(cache.get_base_page_indices(LayerGroupId(1))) + [BAD_PAGE_INDEX] * 8
        walked.append(_library_lines(cache.suspend))
        assert set(buffer.tolist()) == {BAD_PAGE_INDEX}  # a suspended cache's buffer names no slot, to its end
        walked[-1] += _library_lines(cache.resume)
        assert list(buffer[:blocks]) == list(cache.get_base_page_indices(LayerGroupId(0)))
        engine.check(cache, prompt)  # every page of the sinks and windows back in the table, with its content
        cache.close()
        opened: list[KVCache] = []
        created.append(_library_lines(lambda: opened.append(manager.create_kv_cache(None, prompt)), "attention_state"))
        reused = opened[0]
        assert reused.resume() and reused.resize(len(prompt) + 1)
        assert reused.history_length == len(prompt)
        decoded = prompt + [7, 8]
        engine.step(reused, decoded)  # reads the reused sinks and windows
        assert reused.resize(len(prompt) + 2, len(prompt) + 1)
        engine.step(reused, decoded)
        reused.close()
        manager.shutdown()
    assert walked[1] - walked[0] < 64, walked  # (equal now; the old loops ran ~8 lines a block)
    assert created[1] - created[0] < 64, created
