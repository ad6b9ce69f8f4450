"""Prefill -> decode handoff misuse: buffers placed elsewhere in a slot (layer configs that differ:
test_same_layout.py), plans that outlive their caches, pickling, callbacks.

Every refusal here must leave both managers as they were; the content checks after a refusal prove it.
"""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest

from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2 import COMPILED, HalfOpenRange, KVCacheManager, ReuseScope
from kv_cache_manager_v2._storage.memory import cuda_device_available
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.disagg import (
    KVSlice,
    PrefillRequest,
    SourceBlock,
    SourcePlan,
    TransferPlan,
    cached_tokens_per_layer_group,
    check_same_layout_summary,
    complete_plan,
    execute,
    layout_summary,
    plan_source,
    plan_transfer,
    prepare_receiver,
)
from kv_cache_manager_v2.testing.fake_engine import ContentError
from tests.disagg_sides import TPB, Side, transfer
from tests.helpers import KIB, attention, make_config, seeded_prompt, ssm


# ------------------------------------------------------------------------------------------------ errors, pickling


def test_a_peer_placing_buffers_elsewhere_in_a_slot_is_refused() -> None:
    """The handshake compares where each buffer sits in a slot, not only slot sizes and layer configs: a peer of
    another package version that put values where we put keys (same sizes, same configs) would be sent slots whose
    keys it reads as values. Before: the two summaries compared equal (no placement entry)."""
    layers: list[LayerConfig] = [attention(0, window=64), attention(1)]
    ours = layout_summary(Side(layers).manager)
    what, value = ours[-1]
    assert what == "page format", ours
    pools, buffers = json.loads(value)
    keys = [buffer for buffer in buffers if buffer[1] == "key"]
    values = [buffer for buffer in buffers if buffer[1] == "value"]
    for key, other in zip(keys, values):  # another version: each layer's key and value swap places in the slot
        key[4], other[4] = other[4], key[4]
    theirs = ours[:-1] + ((what, json.dumps([pools, buffers])),)
    with pytest.raises(ValueError, match="layouts differ: page format"):
        check_same_layout_summary(theirs, ours)


def test_misuse_is_reported_clearly() -> None:
    layers: list[LayerConfig] = [attention(0, window=64), attention(1)]
    src = Side(layers)
    dst = Side(layers)
    prompt = seeded_prompt(20, 300)
    dst.warm(prompt[:128] + seeded_prompt(21, 10))
    src_cache = src.prefill(prompt)
    dst_cache = dst.manager.create_kv_cache(None, prompt)
    assert dst_cache.resume() and dst_cache.resize(300)  # history not preset
    counts = cached_tokens_per_layer_group(dst_cache, 300)
    with pytest.raises(ValueError, match=r"history_length 128, not prompt_len 300: call resize\(300, 300\)"):
        plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(300), counts)
    assert dst_cache.resize(300, 300)

    def plan(counts: list[int], kv_slice: KVSlice = KVSlice(300)) -> TransferPlan:
        return plan_transfer(src.manager, src_cache, dst.manager, dst_cache, kv_slice, counts)

    with pytest.raises(ValueError, match="one per layer group"):
        plan([0])
    with pytest.raises(ValueError, match=r"cached_per_group\[1\] = 100 is neither a multiple"):
        plan([0, 100])
    with pytest.raises(ValueError, match=r"cached_per_group\[1\] = 320 is outside"):
        plan([0, 320])
    with pytest.raises(ValueError, match=r"would overwrite block 0 of layer group 1, a reused \(committed\) page"):
        plan([0, 0])
    with pytest.raises(ValueError, match="token_range.beg 10 is not a multiple"):
        plan(counts, KVSlice(300, HalfOpenRange(10, 300)))
    with pytest.raises(ValueError, match="same cache"):
        plan_transfer(dst.manager, dst_cache, dst.manager, dst_cache, KVSlice(300), counts)
    with pytest.raises(ValueError, match="does not belong"):
        plan_transfer(dst.manager, src_cache, dst.manager, dst_cache, KVSlice(300), counts)
    with pytest.raises(ValueError, match=r"token_range \[0, 301\) must lie within the prompt"):
        KVSlice(300, HalfOpenRange(0, 301))
    with pytest.raises(ValueError, match="more than prompt_len 100"):
        cached_tokens_per_layer_group(dst_cache, 100)

    good = plan(counts)
    dst_cache.suspend()
    with pytest.raises(ValueError, match="dst_cache .* must be active"):
        execute(good)
    assert dst_cache.resume()
    execute(good)
    dst.engine.check(dst_cache, prompt)
    src_cache.close()
    dst_cache.close()


def test_complete_plan_refuses_sources_that_do_not_cover_the_receiver_s_blocks() -> None:
    """The receiver's half pairs what the sender offers with its slots; a source plan lacking a block (or listing
    one twice, or one not needed) is refused, never half applied. Before: ``complete_plan`` paired whatever came,
    and the missing blocks kept their slots' old bytes."""
    layers: list[LayerConfig] = [attention(0, window=64), attention(1)]
    src, dst = Side(layers), Side(layers)
    prompt = seeded_prompt(22, 300)
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    source = plan_source(src.manager, src_cache, KVSlice(300), counts)
    first = source.sources[0]
    unneeded = SourceBlock(first.layer_group, 1, first.pool_group, first.pool, first.src_slot, first.num_bytes, first.src_address)
    spoiled = {
        "lacks block 9 (pool 0) of layer group 1": source.sources[:-1],
        "moves block 9 (pool 0) of layer group 1 twice": source.sources + source.sources[-1:],
        "moves block 1 (pool 0) of layer group 0, which the receiver does not need": (unneeded, *source.sources),
    }
    for message, sources in spoiled.items():
        spoilt = SourcePlan(source.kv_slice, source.tokens_per_block, source.groups, tuple(sources), source.prompt_key)
        with pytest.raises(ValueError, match=re.escape(message)):
            complete_plan(dst.manager, dst_cache, spoilt)
    # A plan of another layout (a peer past the handshake lying) gets the handshake's text (test_same_layout.py).
    other_layouts = {
        "tokens_per_block is 16 on the sender, 32 on the receiver": SourcePlan(
            source.kv_slice, 16, source.groups, source.sources, source.prompt_key
        ),
        "number of layer groups is 1 on the sender, 2 on the receiver": SourcePlan(
            source.kv_slice, source.tokens_per_block, source.groups[:1], source.sources, source.prompt_key
        ),
    }
    for message, spoilt in other_layouts.items():
        with pytest.raises(ValueError, match=f"^layouts differ: {message}$"):
            complete_plan(dst.manager, dst_cache, spoilt)
    complete_plan(dst.manager, dst_cache, source)
    src_cache.close()
    dst_cache.close()


def test_a_plan_runs_once_and_never_after_either_cache_moved_on() -> None:
    """A plan describes the caches as they were: once the receiver decoded into the prompt's last block (or committed
    the prompt's pages, now shared), or the sender's live state moved past the prompt, its copies would overwrite
    newer bytes with stale ones. ``execute`` refuses those plans, and any plan a second time."""
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src = Side(layers)
    dst = Side(layers)
    prompt = seeded_prompt(30, 300)  # block 9 holds the prompt's last 12 tokens, then the decoded ones
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    plan = transfer(src, src_cache, dst, dst_cache, counts, 300)
    dst.decode(dst_cache, prompt)  # commits the prompt, then writes 3 decoded tokens into block 9
    with pytest.raises(ValueError, match="executed already"):
        execute(plan)
    dst.engine.check(dst_cache, prompt + seeded_prompt(999, 3))  # the decoded rows are still the receiver's own

    again, counts = dst.receive(prompt)  # a second receiver (it reuses the committed full blocks)
    fresh = plan_transfer(src.manager, src_cache, dst.manager, again, KVSlice(300), counts)
    assert again.resize(301, 301)
    with pytest.raises(ValueError, match="history_length 301, not prompt_len 300"):
        execute(fresh)
    other = Side(layers)
    late, counts = other.receive(prompt)
    moved = plan_transfer(src.manager, src_cache, other.manager, late, KVSlice(300), counts)
    assert src_cache.resize(301, 301)  # the sender went on past the prompt
    with pytest.raises(ValueError, match="src_cache .* history_length 301 since planning, 300 then"):
        execute(moved)
    for cache in (src_cache, dst_cache, again, late):
        cache.close()


def test_a_plan_never_overwrites_pages_the_receiver_committed_after_planning() -> None:
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src = Side(layers)
    dst = Side(layers)
    prompt = seeded_prompt(31, 300)
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    plan = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(300), counts)
    dst_cache.commit(prompt)  # (an engine bug) its pages enter the tree, shared, before their bytes came
    with pytest.raises(ValueError, match="block 0 of layer group 0 is a committed"):
        execute(plan)
    src_cache.close()
    dst_cache.close()


def test_plans_pickle_and_numpy_integers_are_accepted() -> None:
    layers: list[LayerConfig] = [attention(0, window=64), attention(1), ssm(2)]
    src = Side(layers, ssm_reuse_interval=TPB)
    dst = Side(layers, ssm_reuse_interval=TPB)
    prompt = seeded_prompt(22, 160)
    src_cache = src.prefill(prompt)
    dst_cache, _ = dst.receive(prompt)
    counts = np.asarray(cached_tokens_per_layer_group(dst_cache, np.int64(160)), dtype=np.int64)
    kv_slice = KVSlice(np.int64(160))
    assert kv_slice == KVSlice(160) and kv_slice.token_range == HalfOpenRange(0, 160)
    plan = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, kv_slice, list(counts))
    assert plan.is_local
    copy = pickle.loads(pickle.dumps(plan))
    assert isinstance(copy, TransferPlan) and not copy.is_local
    assert copy.descriptors == plan.descriptors and copy.groups == plan.groups and copy.kv_slice == plan.kv_slice
    assert pickle.loads(pickle.dumps(kv_slice)) == kv_slice
    with pytest.raises(ValueError, match="unpickled"):
        execute(copy)
    execute(plan, stream=np.int64(0))
    src_cache.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_device_available(), reason="CuPy sees no CUDA device")
def test_execute_on_the_cuda_backend_moves_the_planned_slots() -> None:
    import cupy

    layers: list[LayerConfig] = [attention(0, window=64), attention(1), ssm(2)]
    src = KVCacheManager(make_config(layers, backend="cuda", ssm_reuse_interval=TPB))
    dst = KVCacheManager(make_config(layers, backend="cuda", ssm_reuse_interval=TPB))
    prompt = seeded_prompt(23, 300)
    src_cache = src.create_kv_cache(None, prompt)
    assert src_cache.resume() and src_cache.resize(300)
    src_cache.commit(prompt)
    # stand-in for the prefill's kernels: a distinct byte pattern everywhere
    for pool in internals_of(src).store.gpu_pools():
        data = cupy.asarray(pool.array())
        data[...] = ((cupy.arange(data.size, dtype=cupy.uint64) * 2654435761) >> 11).astype(cupy.uint8)
    dst_cache = dst.create_kv_cache(None, prompt)
    assert dst_cache.resume() and dst_cache.resize(300, 300)
    plan = plan_transfer(src, src_cache, dst, dst_cache, KVSlice(300), cached_tokens_per_layer_group(dst_cache, 300))
    assert plan.blocks_per_layer_group == [3, 10, 1]
    execute(plan)
    cupy.cuda.Device().synchronize()
    for d in plan.descriptors:
        source = cupy.asarray(internals_of(src).store.pools(0, d.pool_group)[d.pool].array())
        target = cupy.asarray(internals_of(dst).store.pools(0, d.pool_group)[d.pool].array())
        begin_src = d.src_slot * d.num_bytes
        begin_dst = d.dst_slot * d.num_bytes
        assert bool(cupy.array_equal(source[begin_src : begin_src + d.num_bytes], target[begin_dst : begin_dst + d.num_bytes]))
    src_cache.close()
    dst_cache.close()


def test_prepare_receiver_short_of_gpu_memory_says_why() -> None:
    """Its None closes the cache it made, so the reason is the manager's (as its docstring and the README say)."""
    manager = KVCacheManager(make_config([attention(0, 4 * KIB)], gpu_quota=4 * 8 * KIB))  # 4 blocks of 32 tokens
    assert prepare_receiver(manager, list(range(1000))) is None
    refusal = manager.last_refusal
    assert refusal is not None and refusal.call == "KVCache.resize" and not refusal.fits_empty_manager
    assert manager.num_live_caches == 0
    manager.shutdown()


# ------------------------------------------------------------------------------------------------- re-entrancy


@pytest.mark.parametrize("side", ["src", "dst"])
def test_execute_from_a_callback_of_either_manager_is_refused_and_changes_nothing(side: str) -> None:
    """``execute`` runs both managers' pending copies: from a priority callback (here, of a cache of ``side``
    growing) it raises RuntimeError naming both calls; later, outside any call, it runs. Before: it ran inside the
    other call."""
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src, dst = Side(layers), Side(layers)
    prompt = seeded_prompt(1, 100)
    src_cache = src.prefill(prompt)
    dst_cache, counts = dst.receive(prompt)
    plan = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(100), counts)
    refusals: list[str] = []

    def priority(ordinal: int, life_cycle: object) -> int:
        try:
            execute(plan)
        except RuntimeError as error:
            refusals.append(str(error))
        return 35

    owner = src if side == "src" else dst
    grown = owner.manager.create_kv_cache(custom_priority_callback=priority)
    assert grown.resume() and grown.resize(TPB)
    assert refusals and all("disagg.execute was called while KVCache.resize is in flight" in r for r in refusals)
    with pytest.raises(ContentError):
        dst.engine.check(dst_cache, prompt)  # nothing was copied
    execute(plan)
    src_cache.close()
    grown.close()
    dst.decode(dst_cache, prompt)
    dst_cache.close()


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (dict(request_id=-1), ValueError, r"PrefillRequest.request_id must be in \[0, "),
        (dict(request_id=2**63), ValueError, r"PrefillRequest.request_id must be in \[0, "),
        (dict(request_id=True), TypeError, "PrefillRequest.request_id must be an integer, got bool"),
        (dict(request_id="3"), TypeError, "PrefillRequest.request_id must be an integer, got str"),
        (dict(tokens="abc"), TypeError, "PrefillRequest.tokens must be a sequence of tokens"),
        (dict(tokens=[1, True]), TypeError, r"PrefillRequest.tokens\[1\] must be an int or bytes token, got True"),
        (dict(tokens=[1, 2.0]), TypeError, r"PrefillRequest.tokens\[1\] must be an int or bytes token"),
        (dict(tokens=[1, b"image-digest"]), TypeError, r"PrefillRequest.tokens\[1\] must be an int \(a text token"),
        (dict(cached_per_group=[0, -32]), ValueError, r"PrefillRequest.cached_per_group\[1\] must be"),
        (dict(cached_per_group=[0, np.bool_(True)]), TypeError, r"PrefillRequest.cached_per_group\[1\] must be an integer"),
        (dict(cached_per_group=[0, 96]), ValueError, r"PrefillRequest.cached_per_group\[1\] = 96 is more than the prompt's 64"),
        (dict(cached_per_group=5), TypeError, "PrefillRequest.cached_per_group must be a sequence of integers"),
        # Compiled, the typed parameter refuses it first, in mypyc's words (as create_kv_cache's: test_error_texts).
        (dict(reuse_scope=3), TypeError, "ReuseScope" if COMPILED else "PrefillRequest.reuse_scope must be a ReuseScope or None, got 3"),
        (dict(read_timeout_s=0), ValueError, r"PrefillRequest.read_timeout_s must be in \(0, "),
        (dict(read_timeout_s=float("inf")), ValueError, r"PrefillRequest.read_timeout_s must be in \(0, "),
        (dict(read_timeout_s=True), TypeError, "PrefillRequest.read_timeout_s must be a number, got bool"),
    ],
)
def test_a_prefill_request_built_by_hand_is_checked(fields: dict[str, object], error: type[Exception], message: str) -> None:
    """A bridge from another transport builds its own requests. Before: every field was kept as given, so a bad
    id reached the decode side inside the answer (its read failed on a message it could not parse) and a bool or
    a bytes token went on to the sender's checks, naming no field."""
    good: dict[str, object] = dict(request_id=3, tokens=list(range(64)), cached_per_group=[0, 32])
    with pytest.raises(error, match=message):
        PrefillRequest(**{**good, **fields})  # type: ignore[arg-type]


def test_a_prefill_request_takes_numpy_numbers_as_plain_ones() -> None:
    tokens = np.arange(64, dtype=np.int64)
    request = PrefillRequest(np.int64(3), tokens, list(np.array([0, 32])), ReuseScope(lora_id=2), read_timeout_s=np.float32(1.5))
    assert (request.request_id, request.tokens, request.cached_per_group) == (3, list(range(64)), [0, 32])
    assert all(type(value) is int for value in (request.request_id, *request.tokens, *request.cached_per_group))
    assert type(request.read_timeout_s) is float and request.read_timeout_s == 1.5
    copy = pickle.loads(pickle.dumps(request))
    assert (copy.request_id, copy.tokens, copy.cached_per_group, copy.reuse_scope, copy.read_timeout_s) == (
        3, list(range(64)), [0, 32], ReuseScope(lora_id=2), 1.5
    )


def test_a_source_cache_of_another_prompt_or_scope_is_refused() -> None:
    """Both caches of a local handoff must hold one prompt in one reuse scope, as ``KVSender.send_sources`` requires
    across processes: the receiver commits the copied pages under its own tokens and scope, so another prompt's or
    scope's KV would be served to every later request reusing them. What the manager knows of a cache's prompt is its
    committed tokens, then its input past them (``tests/test_disagg_same_prompt.py``). Before: ``plan_transfer``
    copied another prompt's blocks 3-6 into the receiver (its check then failed: wrong content at positions 96...)."""
    layers: list[LayerConfig] = [attention(0), attention(1)]
    src, dst = Side(layers), Side(layers)
    prompt = seeded_prompt(40, 200)
    other = prompt[:40] + seeded_prompt(41, 160)  # shares the receiver's first block only
    dst.warm(prompt[:96])
    dst_cache, counts = dst.receive(prompt)
    assert counts == [96]
    src_cache = src.prefill(other)
    with pytest.raises(ValueError, match=r"src_cache \(cache \d+\) token 40 is \d+, dst_cache \(cache \d+\)'s is \d+: the"):
        plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(200), counts)
    src_cache.close()
    scoped = src.manager.create_kv_cache(ReuseScope(salt=1), prompt)  # the same tokens, another scope's KV
    assert scoped.resume() and scoped.resize(200)
    src.engine.step(scoped, prompt)
    with pytest.raises(ValueError, match=r"src_cache \(cache \d+\) is of ReuseScope\(lora_id=None, salt=1\), dst_cache"):
        plan_transfer(src.manager, scoped, dst.manager, dst_cache, KVSlice(200), counts)
    uncommitted = src.manager.create_kv_cache(None, prompt)  # nothing committed yet: its input is its prompt
    assert uncommitted.resume() and uncommitted.resize(200)
    src.engine.step(uncommitted, other)
    late = plan_transfer(src.manager, uncommitted, dst.manager, dst_cache, KVSlice(200), counts)
    uncommitted.commit(other[uncommitted.num_committed_tokens :])  # it computed another prompt than its input
    with pytest.raises(ValueError, match="token 40 is"):
        execute(late)
    sender = src.prefill(prompt)  # kept: a plan holds no handle, so a dropped sender would be closed
    plan = plan_transfer(src.manager, sender, dst.manager, dst_cache, KVSlice(200), counts)
    scoped.commit(prompt)
    execute(plan)
    dst.decode(dst_cache, prompt)  # refusals changed nothing: the receiver gets its own prompt's KV
    for cache in (scoped, uncommitted, sender, dst_cache):
        cache.close()
