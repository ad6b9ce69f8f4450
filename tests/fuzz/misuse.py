"""A catalogue of bad calls over the public API (``KVCacheManager``, ``KVCache``, batching, planned drops, holds),
drawn at random against a fuzz world's live and closed caches. Each ``Misuse`` says which exception the docs promise
and a pattern its message must contain (the argument's name or the bad value); ``tests/fuzz/twin.py`` checks that
the call then changed nothing.

Bad values come in every wrong kind: float, str, None, NumPy bool/int/float, bool where an int is expected,
negative, NaN, out-of-range indices, wrong-length or read-only buffers, a bad token after a valid prefix (a check
made while walking the tree would have matched and held blocks by then), closed caches, calls in the wrong state.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Final

import numpy as np

import kv_cache_manager_v2
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    HalfOpenRange,
    KVCacheRequest,
    PageIndexMode,
    ReuseScope,
    ScratchDesc,
    _KVCache,
    disagg,
    gen_multimodal_cache_key_tokens,
)
from kv_cache_manager_v2._introspection import state_of
from tests.fuzz.model import CacheModel, Token, same_scope
from tests.fuzz.world import FuzzWorld


@dataclass(frozen=True)
class Misuse:
    name: str
    call: Callable[[], object]
    errors: tuple[type[Exception], ...]
    match: str  # regex the message must contain


TYPE_OR_VALUE: Final = (TypeError, ValueError)
# Not an index: each a wrong Python type for a ``SupportsIndex`` argument.
NOT_INDICES: Final[tuple[object, ...]] = (1.5, "3", None, np.float64(2.0), True, np.bool_(True), math.nan, [1], b"1")
BAD_LEVELS: Final[tuple[object, ...]] = (-1, 99, np.int64(99), 1 << 70)
DIGEST: Final = b"misuse-image".ljust(32, b".")  # a multimodal item no world's prompts hold
BAD_TOKENS: Final[tuple[object, ...]] = (2.5, None, True, np.float32(1.0), "7", np.bool_(False), (1, 2), 1j, object())


def _bad_prompt(world: FuzzWorld, rng: random.Random) -> tuple[list[object], int]:
    """A shared prefix the tree holds, with a bad token put at a random position; and that position."""
    prompt: list[object] = list(rng.choice(world.shared_prefixes))
    position = rng.randrange(len(prompt) + 1)
    prompt.insert(position, rng.choice(BAD_TOKENS))
    return prompt, position


class BadCallChangedState(AssertionError):
    """A bad call raised the wrong exception, named nothing, or left the twins different."""


def call_badly(misuse: Misuse) -> None:
    """Run ``misuse``: it must raise one of its exceptions, with its pattern in the message."""
    try:
        result = misuse.call()
    except misuse.errors as error:
        # Compiled, mypyc checks a parameter of a concrete type (``best_efforts: bool``) itself; its TypeError names
        # the type ("bool object expected; got str"), not the argument (tests/test_bad_inputs.py).
        by_mypyc = kv_cache_manager_v2.COMPILED and isinstance(error, TypeError) and " expected; got " in str(error)
        if not by_mypyc and not re.search(misuse.match, str(error), re.IGNORECASE):
            raise BadCallChangedState(f"{misuse.name}: {type(error).__name__} names nothing ({misuse.match!r}): {error}") from None
        return
    except Exception as error:  # noqa: BLE001
        raise BadCallChangedState(f"{misuse.name}: expected {misuse.errors}, got {type(error).__name__}: {error}") from error
    raise BadCallChangedState(f"{misuse.name}: expected {misuse.errors}, the call returned {result!r}")


def _pick(models: list[CacheModel], rng: random.Random) -> _KVCache | None:
    return rng.choice(models).cache if models else None


def manager_misuses(world: FuzzWorld, rng: random.Random) -> list[Misuse]:
    manager: Any = world.manager  # Any: the catalogue passes wrong types on purpose
    bad: Any = rng.choice(NOT_INDICES)
    not_none: Any = rng.choice([value for value in NOT_INDICES if value is not None])  # None: every cache, or the default
    level = rng.choice(BAD_LEVELS)
    prompt: Any
    prompt, position = _bad_prompt(world, rng)
    token = rf"input_tokens\[{position}\]|input_tokens"
    live_ids = [model.cache.id for model in world.live]
    valid: list[Token] = list(rng.choice(world.shared_prefixes))
    misuses = [
        Misuse("create: bad token", lambda: manager.create_kv_cache(None, prompt), TYPE_OR_VALUE, token),
        Misuse("probe: bad token", lambda: manager.probe_reuse(None, prompt), TYPE_OR_VALUE, token),
        Misuse("prefetch_remote: bad token", lambda: manager.prefetch_remote(None, prompt), TYPE_OR_VALUE, token),
        Misuse("create: tokens a str", lambda: manager.create_kv_cache(None, "hello"), (TypeError,), "input_tokens"),
        Misuse("create: 2-D tokens", lambda: manager.create_kv_cache(None, np.zeros((2, 3), np.int64)), (TypeError,), "input_tokens"),
        Misuse("create: bad id", lambda: manager.create_kv_cache(None, valid, id=not_none), (TypeError,), r"\bid\b"),
        Misuse("create: bad scope", lambda: manager.create_kv_cache("tenant"), (TypeError,), "reuse_scope|ReuseScope"),
        Misuse("create: scope lora_id", lambda: manager.create_kv_cache(ReuseScope(lora_id=not_none)), TYPE_OR_VALUE, "lora_id"),
        Misuse("create: callback", lambda: manager.create_kv_cache(None, valid, custom_priority_callback=5), (TypeError,), "custom_priority_callback"),
        Misuse("create: prompt length", lambda: manager.create_kv_cache(None, valid, expected_prompt_length=not_none), (TypeError,), "expected_prompt_length"),
        Misuse("create: negative prompt length", lambda: manager.create_kv_cache(None, valid, expected_prompt_length=-1), (ValueError,), "expected_prompt_length"),
        Misuse("create: snapshot_at", lambda: manager.create_kv_cache(None, list(world.shared_prefixes[0]), snapshot_at=[bad]), TYPE_OR_VALUE, "snapshot_at"),
        Misuse("create: negative snapshot_at", lambda: manager.create_kv_cache(None, list(world.shared_prefixes[0]), snapshot_at=[-3]), (ValueError,), "snapshot_at"),
        Misuse("batch: not requests", lambda: manager.create_kv_cache_batch([KVCacheRequest(list(world.shared_prefixes[0]), capacity=16), 5]), (TypeError,), r"requests\[1\]"),
        Misuse("batch: stream past 64 bits", lambda: manager.create_kv_cache_batch([KVCacheRequest(list(world.shared_prefixes[1]), capacity=40)], cuda_stream=1 << 64), (ValueError,), "cuda_stream"),
        Misuse("batch: cuda_stream", lambda: manager.create_kv_cache_batch([KVCacheRequest(list(world.shared_prefixes[1]), capacity=40)], cuda_stream=not_none), (TypeError,), "cuda_stream"),
        Misuse("batch: request bad token", lambda: manager.create_kv_cache_batch([KVCacheRequest(list(world.shared_prefixes[0]), capacity=48), KVCacheRequest(prompt, capacity=64)]), TYPE_OR_VALUE, "input_tokens"),
        Misuse("quota: bad level", lambda: manager.resize(level, 1024), TYPE_OR_VALUE, "level"),
        Misuse("quota: bad quota", lambda: manager.resize(0, bad), (TypeError,), "quota"),
        Misuse("quota: negative", lambda: manager.resize(manager.num_cache_levels - 1, -5), (ValueError,), "quota"),
        Misuse("get_quota", lambda: manager.get_quota(level), TYPE_OR_VALUE, "level"),
        Misuse("statistics", lambda: manager.get_storage_statistics(level), TYPE_OR_VALUE, "level"),
        Misuse("can_fit", lambda: manager.can_fit(bad), (TypeError,), "num_tokens"),
        Misuse("can_fit: chunk 0", lambda: manager.can_fit(16, 0), (ValueError,), "chunk_size"),
        Misuse("max_admissible", lambda: manager.max_admissible(-1), (ValueError,), "chunk_size"),
        Misuse("peak_pages", lambda: manager.peak_pages(bad), (TypeError,), "num_tokens"),
        Misuse("peak_pages: chunk 0", lambda: manager.peak_pages(16, 0), (ValueError,), "chunk_size"),
        Misuse("max_admissible: bound", lambda: manager.max_admissible(1, not_none), (TypeError,), "token_num_upper_bound"),
        Misuse("clamp", lambda: manager.clamp_max_seq_len_for_mem(bad, 64), (TypeError,), "batch_size"),
        Misuse("clamp: zero batch", lambda: manager.clamp_max_seq_len_for_mem(0, 64), (ValueError,), "batch_size"),
        Misuse("stats excluded", lambda: manager.mark_stats_excluded(not_none), (TypeError,), "kv_cache_id"),
        Misuse("clear stats excluded", lambda: manager.clear_stats_excluded(not_none), (TypeError,), "kv_cache_id"),
        Misuse("multimodal: digest", lambda: manager.gen_multimodal_cache_key_tokens(b"short", 4, 100), (ValueError,), "digest"),
        Misuse("multimodal: count", lambda: manager.gen_multimodal_cache_key_tokens(b"d" * 32, bad, 100), (TypeError,), "num_tokens"),
        Misuse("layer group id", lambda: manager.get_layer_group_id(level), TYPE_OR_VALUE, "layer"),
        Misuse("layer window", lambda: manager.get_layer_window(bad), (TypeError,), "layer_id"),
        Misuse("page stride: role", lambda: manager.get_page_stride(0, "nope"), (ValueError,), "nope|role"),
        Misuse("converter: layer", lambda: manager.get_page_index_converter(level, "key"), TYPE_OR_VALUE, "layer"),
        Misuse("pool base", lambda: manager.get_pool_base_address(99, 0, 0), (ValueError,), "pool_group|99"),
        Misuse("pool group index", lambda: manager.get_pool_group_index(level), TYPE_OR_VALUE, "layer_group"),
        Misuse("slot bytes", lambda: manager.get_slot_bytes(level), TYPE_OR_VALUE, "pool_group"),
        Misuse("page view: mode", lambda: manager.get_page_view(0, "key", "SHARED"), TYPE_OR_VALUE, "index_mode|PageIndexMode|data_role"),
        Misuse("aggregated pages", lambda: manager.get_aggregated_pages([bad]), TYPE_OR_VALUE, "buffers"),
    ]
    misuses += multimodal_misuses(world, rng)
    misuses += _value_misuses(world, rng)
    if live_ids:
        misuses.append(Misuse("create: live id", lambda: manager.create_kv_cache(None, valid, id=rng.choice(live_ids)), (ValueError,), r"\bid\b"))
        misuses.append(Misuse("batch: live id", lambda: manager.create_kv_cache_batch([KVCacheRequest(list(world.shared_prefixes[0]), capacity=48), KVCacheRequest([5, 6], capacity=8, id=live_ids[0])]), (ValueError,), r"\bid\b|already used"))
        misuses.append(Misuse("batch: duplicate ids", lambda: manager.create_kv_cache_batch([KVCacheRequest(list(world.shared_prefixes[0]), capacity=48, id=123_456), KVCacheRequest([5, 6], capacity=8, id=123_456)]), (ValueError,), r"\bid\b|already used"))
        misuses.append(Misuse("quota: best_efforts", lambda: manager.resize(0, manager.get_quota(0), best_efforts="yes"), (TypeError,), "best_efforts"))
        misuses.append(Misuse("create: text_only", lambda: manager.create_kv_cache(None, list(world.shared_prefixes[1]), text_only="yes"), (TypeError,), "text_only"))
        misuses.append(Misuse("create: request stats", lambda: manager.create_kv_cache(None, list(world.shared_prefixes[1]), enable_request_stats="yes"), (TypeError,), "enable_request_stats"))
        misuses.append(Misuse("create: preempted", lambda: manager.create_kv_cache(None, list(world.shared_prefixes[1]), preempted="yes"), (TypeError,), "preempted"))
        misuses.append(Misuse("create: lookup", lambda: manager.create_kv_cache(None, list(world.shared_prefixes[1]), lookup="yes"), (TypeError,), "lookup"))
        misuses.append(Misuse("create: readmission counting no lookup", lambda: manager.create_kv_cache(None, list(world.shared_prefixes[1]), preempted=True, lookup=False), (ValueError,), "preempted=True needs lookup=True"))
        misuses.append(Misuse("batch: readmission counting no lookup", lambda: manager.create_kv_cache_batch([KVCacheRequest(list(world.shared_prefixes[0]), capacity=48), _readmitted_save(list(world.shared_prefixes[1]))]), (ValueError,), r"requests\[1\]\.preempted=True"))
        misuses.append(Misuse("shutdown with open caches", manager.shutdown, (RuntimeError,), "still open"))
        misuses.append(Misuse("clear reusable with open caches", manager.clear_reusable_blocks, (RuntimeError,), "still open"))
    return misuses


def _readmitted_save(tokens: list[Token]) -> KVCacheRequest:
    """A batch request marked both a save (``lookup=False``) and a readmission after construction refused them."""
    request = KVCacheRequest(tokens, capacity=len(tokens), lookup=False)
    request.preempted = True
    return request


def _value_misuses(world: FuzzWorld, rng: random.Random) -> list[Misuse]:
    """The value types an engine builds and the converter it is handed: a non-integer bound, a negative scratch
    slot, a base index whose page index does not fit an int32 page table."""
    layer = next(layer for layer in world.manager.config.layers if isinstance(layer, AttentionLayerConfig))
    converter: Any = world.manager.get_page_index_converter(layer.layer_id, layer.buffers[0].role)
    bound: Any = rng.choice(NOT_INDICES)
    # The least base index whose page index overflows (2**31 itself where a layer has a pool of its own: scale 1).
    past_int32 = -(-(2**31) // (converter.scale * converter.expansion))
    return [
        Misuse("range: bound", lambda: disagg.KVSlice(64, HalfOpenRange(0, bound)), (TypeError,), r"HalfOpenRange\.end"),
        Misuse("scratch: negative slot", lambda: ScratchDesc(HalfOpenRange(0, 1), [rng.choice((-1, -7))]), (ValueError,), r"slot_ids\[0\]"),
        Misuse("converter: past int32", lambda: converter([0, past_int32], PageIndexMode.PER_LAYER), (ValueError,), r"base_indices\[1\]"),
    ]


def multimodal_misuses(world: FuzzWorld, rng: random.Random) -> list[Misuse]:
    """Multimodal tokens where only text is taken: ``text_only=True`` on one call, and in a ``text_only`` manager
    every way in (create, batch, commit), the stand-in token after a valid prefix the tree holds."""
    manager: Any = world.manager
    valid: list[Token] = list(rng.choice(world.shared_prefixes))
    image = gen_multimodal_cache_key_tokens(1 << 41, DIGEST, 2)
    prompt: Any = valid[: rng.randrange(len(valid) + 1)] + image + [7]
    misuses = [
        Misuse("create: text_only call, multimodal", lambda: manager.create_kv_cache(None, prompt, text_only=True), (ValueError,), "input_tokens"),
    ]
    if not manager.config.text_only:
        return misuses
    batch = [KVCacheRequest(list(world.shared_prefixes[0]), capacity=48), KVCacheRequest(prompt, capacity=64)]
    misuses += [
        Misuse("text_only: create multimodal", lambda: manager.create_kv_cache(None, prompt), (ValueError,), "input_tokens"),
        Misuse("text_only: batch multimodal", lambda: manager.create_kv_cache_batch(batch), (ValueError,), r"requests\[1\]\.input_tokens"),
    ]
    for model in world.live:
        if model.active and not model.stopped:
            cache: Any = model.cache
            room = cache.capacity - cache.num_committed_tokens
            tokens: list[object] = list(_tokens(world, max(room - 1, 0)))
            tokens.insert(rng.randrange(len(tokens) + 1), image[0])  # the digest (position 1 is an int id)
            misuses.append(Misuse("text_only: commit multimodal", lambda: cache.commit(tokens), (ValueError,), "accepted_input_tokens|capacity"))
            break
    return misuses


def cache_misuses(world: FuzzWorld, rng: random.Random) -> list[Misuse]:
    bad: Any = rng.choice(NOT_INDICES)
    not_none: Any = rng.choice([value for value in NOT_INDICES if value is not None])
    misuses: list[Misuse] = []
    active = [model for model in world.live if model.active]
    suspended = [model for model in world.live if not model.active]
    cache = _pick(world.live, rng)
    if cache is not None:
        live: Any = cache
        lg = rng.choice((-1, world.manager.num_layer_groups, np.int64(77), 1 << 70))
        misuses += [
            Misuse("page indices: layer group", lambda: live.get_base_page_indices(lg), TYPE_OR_VALUE, "layer_group"),
            Misuse("page indices: beam", lambda: live.get_base_page_indices(0, bad), TYPE_OR_VALUE, "beam"),
            Misuse("aggregated indices", lambda: live.get_aggregated_page_indices(lg), TYPE_OR_VALUE, "layer_group"),
            Misuse("front blocks", lambda: live.get_num_front_blocks_removed(bad), (TypeError,), "layer_group"),
            Misuse("scratch desc", lambda: live.get_scratch_desc(lg), TYPE_OR_VALUE, "layer_group"),
            Misuse("buffer: layer group", lambda: live.set_base_page_index_buf(0, lg, np.zeros(64, np.int32)), TYPE_OR_VALUE, "layer_group"),
            Misuse("buffer: beam", lambda: live.set_base_page_index_buf(bad, 0, np.zeros(64, np.int32)), TYPE_OR_VALUE, "beam"),
            Misuse("buffer: dtype", lambda: live.set_base_page_index_buf(0, 0, np.zeros(64, np.float32)), TYPE_OR_VALUE, "buf"),
            Misuse("buffer: read-only", lambda: live.set_base_page_index_buf(0, 0, _read_only(64)), TYPE_OR_VALUE, "buf"),
            Misuse("buffer: 2-D", lambda: live.set_base_page_index_buf(0, 0, np.zeros((8, 8), np.int32)), TYPE_OR_VALUE, "buf"),
            Misuse("hold: reason", lambda: live.hold(rng.choice((None, 3, b"x", ""))), (TypeError,), "reason"),
            Misuse("index mode", lambda: live.supports_index_mode("PER_LAYER"), (TypeError,), "mode|PageIndexMode"),
        ]
        if live.num_blocks > 1:
            misuses.append(Misuse("buffer: too short (at capacity)", lambda: live.set_base_page_index_buf(0, 0, np.zeros(live.num_blocks - 1, np.int32)), (ValueError,), "buf|short|block"))
    for model in active:
        misuses += _active_misuses(world, model, rng, bad, not_none)
    for model in suspended:
        misuses += _suspended_misuses(model.cache, rng, not_none)
    for model in world.closed[-3:]:
        misuses += _closed_misuses(model.cache)
    misuses += _foreign_source_misuses(world, active)
    return misuses


def _foreign_source_misuses(world: FuzzWorld, active: list[CacheModel]) -> list[Misuse]:
    """A local handoff whose two caches are not known to hold one prompt: another scope, a receiver whose tokens up
    to its history the manager does not know, a sender whose rows up to there are not known to hold them (committed
    tokens, then the input past them: ``CacheView.known_tokens``), or engines declaring other ``KVFormat``s. Its
    KV would be committed as the receiver's prompt (``disagg.plan_transfer`` refuses, naming the difference)."""
    manager: Any = world.manager
    misuses: list[Misuse] = []
    pairs = [(src, dst) for src in active for dst in active if src is not dst]
    for src, dst in pairs:
        receiver: Any = dst.cache
        length = receiver.history_length
        src_known, dst_known = state_of(src.cache).known_tokens(), state_of(receiver).known_tokens()
        known = len(dst_known) >= length and len(src_known) >= length
        if same_scope(src.scope, dst.scope) and known and src_known[:length] == dst_known[:length]:
            continue
        counts = disagg.cached_tokens_per_layer_group(receiver, length)
        plan = lambda s=src.cache, d=receiver, n=length, c=counts: disagg.plan_transfer(manager, s, manager, d, disagg.KVSlice(n), c)
        misuses.append(Misuse("transfer: foreign source", plan, (ValueError,), "another (prompt|scope)'s|is known to hold"))
        break
    # The formats are compared first, whatever the caches (any live one; compiled, a None cache is refused by
    # mypyc's own check of the parameter before any comparison).
    if not world.live:
        return misuses
    cache: Any = world.live[0].cache
    kv_slice = disagg.KVSlice(cache.history_length)
    counts = [0] * manager.num_layer_groups
    ours, theirs = disagg.KVFormat("bf16", "fuzz@1"), disagg.KVFormat("bf16", "fuzz@1", tensor_parallel_size=2)
    return misuses + [
        Misuse("transfer: other format", lambda: disagg.plan_transfer(manager, cache, manager, cache, kv_slice, counts, src_format=ours, dst_format=theirs), (ValueError,), "tensor-parallel size"),
        Misuse("transfer: one format", lambda: disagg.plan_transfer(manager, cache, manager, cache, kv_slice, counts, src_format=ours), (TypeError,), "dst_format"),
    ]


def _active_misuses(world: FuzzWorld, model: CacheModel, rng: random.Random, bad: Any, not_none: Any) -> list[Misuse]:
    act: Any = model.cache
    misuses = [
        Misuse("resize: capacity", lambda: act.resize(bad), (TypeError,), "capacity"),
        Misuse("resize: negative", lambda: act.resize(-1), (ValueError,), "capacity"),
        Misuse("resize: history type", lambda: act.resize(act.capacity + 3, not_none), (TypeError,), "history_length"),
        Misuse("resize: history beyond", lambda: act.resize(act.capacity + 5, act.capacity + 6), (ValueError,), "history"),
        Misuse("resize: history backwards", lambda: act.resize(act.capacity + 20, act.history_length - 1), (ValueError,), "history"),
        Misuse("resize: below committed", lambda: act.resize(act.num_committed_tokens - 1), (ValueError,), "capacity|committed"),
        Misuse("capacity setter", lambda: setattr(act, "capacity", bad), TYPE_OR_VALUE, "capacity"),
        Misuse("history setter", lambda: setattr(act, "history_length", act.capacity + 1), (ValueError,), "history"),
        Misuse("stop: flag", lambda: act.stop_committing("yes"), (TypeError,), "save_last_ssm_snapshot"),
        Misuse("offload: active", act.offload, (ValueError,), "active|suspended"),
        Misuse("held: resize", lambda: _held(act, lambda: act.resize(act.capacity + 16)), (RuntimeError,), "held"),
        Misuse("held: suspend", lambda: _held(act, act.suspend), (RuntimeError,), "held"),
        Misuse("held: close", lambda: _held(act, act.close), (RuntimeError,), "held"),
        Misuse("transfer: cached per group", lambda: disagg.cached_tokens_per_layer_group(act, -1), (ValueError,), "prompt_len"),
        Misuse("transfer: prompt_len type", lambda: disagg.cached_tokens_per_layer_group(act, not_none), (TypeError,), "prompt_len"),
        Misuse("prefetch: active", act.prefetch, (ValueError,), "active|suspended"),
    ]
    if 0 not in model.buffers:  # a registered table one block short of the resize: refused, nothing changed
        misuses.append(Misuse("resize: outgrows the table", lambda: _outgrow_table(act, world.tpb), (ValueError,), "buf|block|table"))
    if world.config.ssm and act.num_committed_tokens != act.capacity:
        misuses.append(Misuse("stop: snapshot not computed", lambda: act.stop_committing(True), (ValueError,), "save_last_ssm_snapshot"))
    if model.stopped:
        return misuses + [Misuse("commit after stop", lambda: act.commit([1]), (ValueError,), "stop|capacity")]
    return misuses + [
        Misuse("commit: beyond capacity", lambda: act.commit(_tokens(world, act.capacity - act.num_committed_tokens + 1)), (ValueError,), "capacity|tokens|stop"),
        Misuse("commit: bad token", lambda: act.commit(_with_bad_token(world, act, rng)), TYPE_OR_VALUE, "accepted_input_tokens"),
        Misuse("commit: beams", lambda: act.commit([], beam_search_indices=[bad]), TYPE_OR_VALUE, "beam"),
        Misuse("commit: is_end", lambda: act.commit([], is_end="yes"), TYPE_OR_VALUE, "is_end|stop"),
        Misuse("plan drop: committing", act.plan_committed_block_drop, (RuntimeError,), "stop_committing"),
    ]


def _suspended_misuses(sus: Any, rng: random.Random, not_none: Any) -> list[Misuse]:
    return [
        Misuse("resume: stream", lambda: sus.resume(not_none), (TypeError,), "cuda_stream"),
        Misuse("resume: stream past 64 bits", lambda: sus.resume(1 << 64), (ValueError,), "cuda_stream"),
        Misuse("stream setter: past 64 bits", lambda: setattr(sus, "cuda_stream", 1 << 64), (ValueError,), "cuda_stream"),
        Misuse("hold: suspended", lambda: sus.hold("misuse"), (ValueError,), "active"),
        Misuse("resize: suspended", lambda: sus.resize(sus.capacity + 1), (ValueError,), "suspended|active"),
        Misuse("commit: suspended", lambda: sus.commit([]), (ValueError,), "suspended|active"),
        Misuse("prefetch: target", lambda: sus.prefetch(rng.choice(BAD_LEVELS)), TYPE_OR_VALUE, "target|level"),
        Misuse("prefetch: evict flag", lambda: sus.prefetch(evict="yes"), (TypeError,), "evict"),
    ]


def _closed_misuses(closed: Any) -> list[Misuse]:
    return [
        Misuse("closed: resume", closed.resume, (ValueError,), "closed"),
        Misuse("closed: resize", lambda: closed.resize(16), (ValueError,), "closed"),
        Misuse("closed: commit", lambda: closed.commit([1]), (ValueError,), "closed"),
        Misuse("closed: suspend", closed.suspend, (ValueError,), "closed"),
        Misuse("closed: stop", closed.stop_committing, (ValueError,), "closed"),
        Misuse("closed: indices", lambda: closed.get_base_page_indices(0), (ValueError,), "closed"),
        Misuse("closed: buffer", lambda: closed.set_base_page_index_buf(0, 0, np.zeros(64, np.int32)), (ValueError,), "closed"),
        Misuse("closed: plan drop", closed.plan_committed_block_drop, (ValueError,), "closed"),
        Misuse("closed: prefetch", closed.prefetch, (ValueError,), "closed"),
        Misuse("closed: hold", lambda: closed.hold("x"), (ValueError,), "closed"),
    ]


def _outgrow_table(cache: _KVCache, tokens_per_block: int) -> object:
    """Register a table holding the cache's blocks exactly, resize one block past it, unregister."""
    cache.set_base_page_index_buf(0, 0, np.zeros(cache.num_blocks, np.int32))
    try:
        return cache.resize(cache.num_blocks * tokens_per_block + 1)
    finally:
        cache.set_base_page_index_buf(0, 0, None)


def _held(cache: _KVCache, call: Callable[[], object]) -> object:
    """``call`` while ``cache`` is held (the hold lifted afterwards: together they must change nothing)."""
    hold = cache.hold("misuse")
    try:
        return call()
    finally:
        hold.release()


def _read_only(length: int) -> np.ndarray[tuple[int], np.dtype[np.int32]]:
    table = np.zeros(length, np.int32)
    table.setflags(write=False)
    return table


def _tokens(world: FuzzWorld, count: int) -> list[Token]:
    """Tokens no prompt of the world uses (not from ``world._fresh``: its counter must move alike in both twins)."""
    return [900_000_000 + world.tpb * 7 + i for i in range(count)]


def _with_bad_token(world: FuzzWorld, cache: _KVCache, rng: random.Random) -> list[object]:
    """As many valid tokens as fit the capacity (full blocks among them), with one bad token at a random place."""
    room = cache.capacity - cache.num_committed_tokens
    tokens: list[object] = list(_tokens(world, max(room - 1, 0)))
    tokens.insert(rng.randrange(len(tokens) + 1), rng.choice(BAD_TOKENS))
    return tokens


def other_manager_misuses(world: FuzzWorld, other: FuzzWorld, rng: random.Random) -> list[Misuse]:
    """A cache of ``other`` (another manager) where one of ``world``'s is expected."""
    mine = [model.cache for model in world.live if model.active]
    theirs = [model.cache for model in other.live if model.active]
    if not mine or not theirs:
        return []
    manager, cache, foreign = world.manager, rng.choice(mine), rng.choice(theirs)
    plan: Any = disagg.plan_transfer
    counts = [0] * manager.num_layer_groups
    kv_slice = disagg.KVSlice(cache.history_length)
    return [
        Misuse("transfer: foreign source", lambda: plan(manager, foreign, manager, cache, kv_slice, counts), (ValueError,), "src_cache"),
        Misuse("transfer: foreign receiver", lambda: plan(manager, cache, manager, foreign, kv_slice, counts), (ValueError,), "dst_cache"),
    ]


def misuses(world: FuzzWorld, rng: random.Random, other: FuzzWorld | None = None) -> list[Misuse]:
    foreign = [] if other is None else other_manager_misuses(world, other, rng)
    return manager_misuses(world, rng) + cache_misuses(world, rng) + foreign

