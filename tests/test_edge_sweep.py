"""An adversarial sweep of the public API (SPEC §11): every integer, float, token, flag and enum parameter of
``KVCacheManager``'s and ``KVCache``'s public methods, and of the config constructors, gets a generated set of bad
values (wrong types, ``True``, NumPy floats, negatives, zero where positive is required, 2**63, NaN/inf,
out-of-range ids), then a closed cache, a shut-down manager and another manager's cache.

Each bad call must raise ``TypeError`` / ``ValueError`` (``RuntimeError`` for a closed cache or a shut-down
manager) with the argument's name in the message, and change nothing a user can observe: per-tier storage
statistics and usage, every cache's lengths / status / page indices, reuse probes, the KV event log, the
invariants. NumPy integers holding a valid value must be accepted. ``tests/test_bad_inputs.py`` holds the
hand-picked rows (semantic misuse); this module generates the value classes per parameter kind, so a parameter
added to a row below gets all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import (
    disagg,
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheRequest,
    KVCacheStatus,
    OutOfPagesError,
    PageIndexMode,
    ReuseScope,
    SsmLayerConfig,
    SwaScratchReuseConfig,
)
from kv_cache_manager_v2._base.hashing import MAX_MULTIMODAL_ITEM_TOKENS
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.edge_values import TYPE, VALUE, beyond_int64_values, flag_values, float_values, int_values, mode_values, token_values
from tests.fuzz.checks import assert_unchanged, snapshot
from tests.helpers import KIB, attention, compute_prompt, kv, seeded_prompt, ssm

TPB = 16
PROMPT = seeded_prompt(1, 100)
DIGEST = bytes(32)


# ------------------------------------------------------------------------------------------- the world
def world_config() -> KVCacheManagerConfig:
    """An SWA group, a full group and an SSM group on GPU + host, KV events on: every kind of page index."""
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=48), attention(1, 4 * KIB), ssm(2, 8 * KIB, KIB)]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(4 << 20), HostCacheTierConfig(2 << 20)]
    return KVCacheManagerConfig(
        TPB, layers=layers, cache_tiers=tiers, backend="cpu", ssm_reuse_interval=32, enable_kv_events=True,
    )


class World:
    """A manager with an active (computed, committed) and a suspended cache, and a second manager's cache."""

    def __init__(self) -> None:
        self.manager = KVCacheManager(world_config())
        self.engine = FakeEngine(self.manager)
        self.active = compute_prompt(self.manager, self.engine, PROMPT, stops=(32, 64))
        self.suspended = compute_prompt(self.manager, self.engine, seeded_prompt(2, 40))
        self.suspended.suspend()
        self.other_manager = KVCacheManager(world_config())
        self.foreign = self.other_manager.create_kv_cache(None, PROMPT)
        self.manager.get_latest_events()

    def observe(self) -> dict[str, object]:
        """Everything observable, the event log drained (a bad call must add no event either)."""
        self.manager.check_invariants()
        probes: list[tuple[ReuseScope | None, list[int | bytes]]] = [
            (None, list(PROMPT)), (None, list(seeded_prompt(2, 40))),
        ]
        state = snapshot(self.manager, [self.active, self.suspended], probes)
        state["usage"] = self.manager.get_usage()
        state["events"] = self.manager.get_latest_events()
        state["scopes"] = self.manager.num_reuse_scopes
        state["other"] = snapshot(self.other_manager, [self.foreign], [])
        self.engine.check(self.active, PROMPT)
        return state

    def close(self) -> None:
        for cache in (self.active, self.suspended, self.foreign):
            cache.close()
        self.manager.check_invariants()
        self.manager.shutdown()
        self.other_manager.shutdown()


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    made = World()
    yield made
    made.close()


# ------------------------------------------------------------------------------------------- the rows
Target = Callable[[World], Callable[..., object]]
Values = list[tuple[str, object, tuple[type, ...]]]


@dataclass(frozen=True)
class Param:
    """One parameter of one public callable: how to reach it, a valid call, and the bad values of its kind."""

    owner: str
    target: Target
    valid: dict[str, object]
    name: str
    bad: Values


NUM_GROUPS = 3
NUM_LEVELS = 2
ROLE = "key"


def m(method: str) -> Target:
    return lambda w: getattr(w.manager, method)


def c(method: str) -> Target:
    return lambda w: getattr(w.active, method)


def setter(attribute: str) -> Target:
    return lambda w: lambda **kwargs: setattr(w.active, attribute, kwargs[attribute])


def index(bound: int, optional: bool = False) -> Values:
    return int_values(0, bound, optional)


def any_int(optional: bool = False) -> Values:
    """An integer without a range (a request id: the engine's own numbering)."""
    return int_values(None, None, optional)


def count(minimum: int = 0, optional: bool = False) -> Values:
    return int_values(minimum, None, optional)


def rows(owner: str, call: Target, valid: dict[str, object], /, **kinds: Values) -> list[Param]:
    return [Param(owner, call, valid, name, bad) for name, bad in kinds.items()]


PARAMS: list[Param] = [
    *rows("can_fit", m("can_fit"), dict(num_tokens=64, chunk_size=16), num_tokens=count(), chunk_size=count(1)),
    *rows(
        "can_fit_in_chunks", m("can_fit_in_chunks"), dict(num_tokens=64, chunk_size=16), num_tokens=count(),
        chunk_size=count(1),
    ),
    *rows("peak_pages", m("peak_pages"), dict(num_tokens=64, chunk_size=16), num_tokens=count(), chunk_size=count(1)),
    *rows(
        "clamp_max_seq_len_for_mem", m("clamp_max_seq_len_for_mem"), dict(batch_size=1, token_num_upper_bound=64),
        batch_size=count(1), token_num_upper_bound=count(),
    ),
    *rows(
        "max_admissible", m("max_admissible"), dict(chunk_size=16, token_num_upper_bound=64),
        chunk_size=count(1), token_num_upper_bound=count(optional=True),
    ),
    *rows("mark_stats_excluded", m("is_stats_excluded"), dict(kv_cache_id=5), kv_cache_id=any_int(optional=True)),
    *rows(
        "create_kv_cache", m("create_kv_cache"), dict(input_tokens=PROMPT, id=77, expected_prompt_length=100),
        input_tokens=token_values(), id=any_int(optional=True), expected_prompt_length=count(optional=True),
        text_only=flag_values(), enable_request_stats=flag_values(), preempted=flag_values(), lookup=flag_values(),
        snapshot_at=[("int", 5, TYPE), ("str", "5", TYPE), ("float-item", [1.5], TYPE), ("bool-item", [True], TYPE),
                     ("negative-item", [-1], VALUE)],
        reuse_scope=[("int", 1, TYPE), ("str", "scope", TYPE)],
    ),
    # A save (no lookup counted) is no readmission: the pair is refused.
    *rows("create_kv_cache", m("create_kv_cache"), dict(input_tokens=PROMPT, lookup=False),
          preempted=[("True-with-lookup-False", True, VALUE)]),
    *rows(
        "create_kv_cache_batch", m("create_kv_cache_batch"), dict(requests=[KVCacheRequest(PROMPT)], cuda_stream=0),
        cuda_stream=count(optional=True),
        requests=[("int", 5, TYPE), ("str", "x", TYPE), ("item", [5], TYPE), ("None-item", [None], TYPE)],
    ),
    *rows(
        "gen_multimodal_cache_key_tokens", m("gen_multimodal_cache_key_tokens"),
        dict(multi_modal_data_digest=DIGEST, num_tokens=4, id_offset=1000, token_offset=0),
        num_tokens=int_values(1, MAX_MULTIMODAL_ITEM_TOKENS + 1, False), id_offset=count(optional=True), token_offset=count(),
        multi_modal_data_digest=[("str", "x" * 32, TYPE), ("short", b"x", VALUE), ("None", None, TYPE)],
    ),
    *rows("get_layer_group_id", m("get_layer_group_id"), dict(layer_id=0), layer_id=index(3)),
    *rows("get_layer_window", m("get_layer_window"), dict(layer_id=0), layer_id=index(3)),
    *rows("get_pool_group_index", m("get_pool_group_index"), dict(layer_group_id=0), layer_group_id=index(NUM_GROUPS)),
    *rows(
        "get_pool_base_address", m("get_pool_base_address"), dict(pool_group=0, pool=0, level=0),
        pool_group=index(NUM_GROUPS), pool=index(64), level=index(NUM_LEVELS),
    ),
    *rows("get_slot_bytes", m("get_slot_bytes"), dict(pool_group=0), pool_group=index(NUM_GROUPS)),
    *rows("get_quota", m("get_quota"), dict(cache_level=0), cache_level=index(NUM_LEVELS)),
    *rows("get_storage_statistics", m("get_storage_statistics"), dict(cache_level=0), cache_level=index(NUM_LEVELS)),
    *[
        row
        for method in ("get_page_index_converter", "get_page_stride", "get_mem_pool_base_address",
                       "get_page_index_upper_bound", "get_page_view")
        for row in rows(
            method, m(method), dict(layer_id=0, data_role=ROLE), layer_id=index(3),
            data_role=[("int", 0, TYPE), ("unknown", "nope", VALUE), ("None", None, TYPE)],
        )
    ],
    *[
        row
        for method in ("get_page_index_upper_bound", "get_page_view")
        for row in rows(method, m(method), dict(layer_id=0, data_role=ROLE), index_mode=mode_values())
    ],
    *rows(
        "resize(manager)", m("resize"), dict(cache_level=1, quota=2 << 20),
        cache_level=index(NUM_LEVELS), quota=count(), best_efforts=flag_values(),
    ),
    *rows("supports_index_mode", m("supports_index_mode"), dict(mode=PageIndexMode.SHARED), mode=mode_values()),
    *[
        row
        for method in ("probe_reuse", "prefetch_remote")
        for row in rows(
            method, m(method), dict(input_tokens=PROMPT), input_tokens=token_values(),
            reuse_scope=[("int", 1, TYPE), ("str", "scope", TYPE)],
        )
    ],
    *rows("get_aggregated_pages", m("get_aggregated_pages"), dict(buffers=[]),
          buffers=[("int", 5, TYPE), ("item", [5], TYPE), ("str", "x", TYPE)]),
    # --- the cache
    *rows(
        "KVCache.resize", c("resize"), dict(capacity=len(PROMPT), history_length=len(PROMPT)),
        capacity=count(), history_length=count(optional=True),
    ),
    *rows("KVCache.resume", c("resume"), dict(cuda_stream=0), cuda_stream=count(optional=True)),
    *rows(
        "KVCache.commit", c("commit"), dict(accepted_input_tokens=[]),
        accepted_input_tokens=token_values(), is_end=flag_values(), save_ssm_snapshot=flag_values(),
        beam_search_indices=[("int", 0, TYPE), ("float-item", [0.5], TYPE), ("negative", [-1], VALUE)],
    ),
    *rows(
        "KVCache.get_base_page_indices", c("get_base_page_indices"), dict(layer_group_id=0, beam_id=0),
        layer_group_id=index(NUM_GROUPS), beam_id=index(1),
    ),
    *rows(
        "KVCache.get_aggregated_page_indices", c("get_aggregated_page_indices"), dict(layer_group_id=0, beam_id=0),
        layer_group_id=index(NUM_GROUPS), beam_id=index(1), valid_only=flag_values(),
    ),
    *rows("KVCache.get_num_front_blocks_removed", c("get_num_front_blocks_removed"), dict(layer_group_id=0),
          layer_group_id=index(NUM_GROUPS)),
    *rows("KVCache.get_scratch_desc", c("get_scratch_desc"), dict(layer_group_id=0), layer_group_id=index(NUM_GROUPS)),
    *rows(
        "KVCache.get_ssm_block_base_index", c("get_ssm_block_base_index"), dict(layer_group_id=2, beam=0),
        layer_group_id=index(NUM_GROUPS), beam=index(1),
    ),
    *rows(
        "KVCache.set_base_page_index_buf", c("set_base_page_index_buf"),
        dict(beam_idx=0, layer_group_id=0, buf=None), beam_idx=index(1), layer_group_id=index(NUM_GROUPS),
        buf=[("list", [0] * 8, TYPE), ("int", 5, TYPE), ("float-array", np.zeros(8, np.float32), (TypeError, ValueError)),
             ("short", np.zeros(1, np.int32), VALUE)],
    ),
    *rows("KVCache.prefetch", lambda w: w.suspended.prefetch, dict(target=1), target=index(NUM_LEVELS, optional=True),
          evict=flag_values()),
    *rows("KVCache.hold", c("hold"), dict(reason="x"), reason=[("int", 1, TYPE), ("None", None, TYPE)]),
    *rows("KVCache.stop_committing", c("stop_committing"), dict(), save_last_ssm_snapshot=flag_values()),
    *rows("KVCache.supports_index_mode", c("supports_index_mode"), dict(mode=PageIndexMode.SHARED), mode=mode_values()),
    *rows("KVCache.capacity=", setter("capacity"), dict(capacity=len(PROMPT)), capacity=count()),
    *rows("KVCache.history_length=", setter("history_length"), dict(history_length=len(PROMPT)),
          history_length=count()),
    *rows("KVCache.cuda_stream=", setter("cuda_stream"), dict(cuda_stream=0), cuda_stream=count()),
]


def made(constructor: Callable[..., object]) -> Target:
    return lambda w: constructor


BUFFERS = [BufferConfig("key", 64)]
CONFIG_PARAMS: list[Param] = [
    *rows("GpuCacheTierConfig", made(GpuCacheTierConfig), dict(quota=1 << 20, max_quota=2 << 20),
          quota=count(), max_quota=count(1, optional=True)),  # a quota too small for one slot: the manager says
    *rows("HostCacheTierConfig", made(HostCacheTierConfig), dict(quota=1 << 20), quota=count()),
    *rows("BufferConfig", made(BufferConfig), dict(role="key", size=64, tokens_per_block_override=16),
          size=count(1), tokens_per_block_override=count(1, optional=True),
          role=[("int", 1, TYPE), ("empty", "", VALUE), ("None", None, TYPE)]),
    *rows("AttentionLayerConfig", made(AttentionLayerConfig),
          dict(layer_id=0, buffers=BUFFERS, sliding_window_size=64, num_sink_tokens=4),
          layer_id=any_int(), sliding_window_size=count(1, optional=True), num_sink_tokens=count(optional=True),
          buffers=[("int", 5, TYPE), ("item", [5], TYPE), ("empty", [], VALUE)]),
    *rows("SsmLayerConfig", made(SsmLayerConfig), dict(layer_id=0, buffers=BUFFERS), layer_id=any_int()),
    *rows("KVCacheDesc", made(KVCacheDesc), dict(capacity=8, history_length=4), capacity=count(),
          history_length=count()),
    *rows("BatchDesc", made(BatchDesc), dict(kv_caches=[KVCacheDesc(8, 4)], system_prompt_length=4),
          system_prompt_length=count(), kv_caches=[("int", 5, TYPE), ("item", [5], TYPE)]),
    *rows("SwaScratchReuseConfig", made(SwaScratchReuseConfig), dict(max_rewind_len=4), max_rewind_len=count()),
    *rows("KVCacheRequest", made(KVCacheRequest), dict(input_tokens=PROMPT, id=5, capacity=128),
          id=any_int(optional=True), capacity=count(optional=True), input_tokens=token_values()),
    *rows("KVCacheRequest", made(KVCacheRequest), dict(input_tokens=PROMPT, num_new_tokens=8),
          num_new_tokens=count(optional=True)),
    *rows("KVCacheRequest", made(KVCacheRequest), dict(input_tokens=PROMPT), preempted=flag_values(),
          lookup=flag_values()),
    *rows("KVCacheRequest", made(KVCacheRequest), dict(input_tokens=PROMPT, lookup=False),
          preempted=[("True-with-lookup-False", True, VALUE)]),
    *rows("ReuseScope", made(ReuseScope), dict(lora_id=1), lora_id=any_int(optional=True)),
    *rows("KVCacheManagerConfig", made(KVCacheManagerConfig),
          dict(tokens_per_block=16, vocab_size=1000, cache_tiers=[GpuCacheTierConfig(1 << 20)],
               layers=[attention(0)], ssm_reuse_interval=512, reuse_match_backoff=0, max_kv_events=10),
          tokens_per_block=count(1), vocab_size=count(1, optional=True), ssm_reuse_interval=any_int(),  # checked only with SSM layers (test_config.py)
         
          reuse_match_backoff=count(), max_kv_events=count(1), max_util_for_resume=float_values(),
          admission_watermark=float_values(), enable_kv_events=flag_values(), backend=[
              ("int", 1, TYPE), ("unknown", "tpu", VALUE)],
          cache_tiers=[("int", 5, TYPE), ("item", [5], TYPE)], layers=[("int", 5, TYPE), ("item", [5], TYPE)]),
]
# Ids an engine numbers itself may be any integer (TensorRT-LLM's are unsigned 64-bit): test_ids_take_any_integer.
CONFIG_IDS = {("KVCacheRequest", "id"), ("ReuseScope", "lora_id")}
CONFIG_INTS = [p for p in CONFIG_PARAMS if type(p.valid.get(p.name)) is int and (p.owner, p.name) not in CONFIG_IDS]
CASES = [
    pytest.param(p, label, value, errors, id=f"{p.owner}-{p.name}-{label}")
    for p in PARAMS + CONFIG_PARAMS
    for label, value, errors in p.bad
] + [
    pytest.param(p, label, value, errors, id=f"{p.owner}-{p.name}-{label}")
    for p in CONFIG_INTS
    for label, value, errors in beyond_int64_values()
]


def close_made(result: object) -> None:
    """Close any cache a call handed out (a NumPy-argument call that succeeded, ``prepare_receiver``'s pair)."""
    items = result if isinstance(result, (list, tuple)) else [result]
    for item in items:
        if isinstance(item, KVCache):
            item.close()


@pytest.mark.parametrize(("param", "label", "value", "errors"), CASES)
def test_bad_value_is_refused_naming_it_and_changes_nothing(
    world: World, param: Param, label: str, value: object, errors: tuple[type, ...]
) -> None:
    call = param.target(world)
    before = world.observe()
    with pytest.raises(errors) as raised:
        close_made(call(**{**param.valid, param.name: value}))
    # Compiled: mypyc checks a parameter of a concrete type (``data_role: str``, ``text_only: bool | None``) itself,
    # and its TypeError names the type ("str object expected; got int"), not the argument (test_bad_inputs.py).
    by_mypyc = kv_cache_manager_v2.COMPILED and isinstance(raised.value, TypeError) and " expected; got " in str(raised.value)
    assert by_mypyc or param.name in str(raised.value), f"{param.owner}({param.name}={label}): {raised.value}"
    assert_unchanged(before, world.observe(), f"{param.owner}({param.name}={label})")


NUMPY_CASES = [
    pytest.param(p, id=f"{p.owner}-{p.name}")
    for p in PARAMS + CONFIG_PARAMS
    if type(p.valid.get(p.name)) is int
    and p.owner != "resize(manager)"  # its valid call needs every cache suspended: test_bad_inputs.py's NUMPY_ROWS
]


@pytest.mark.parametrize("param", NUMPY_CASES)
def test_numpy_integer_is_accepted(world: World, param: Param) -> None:
    valid = param.valid[param.name]
    assert isinstance(valid, int)
    for converted in (np.int64(valid), np.int32(valid), np.uint64(valid)):
        close_made(param.target(world)(**{**param.valid, param.name: converted}))
    world.manager.check_invariants()


UNBOUNDED = [
    pytest.param(p, id=f"{p.owner}-{p.name}")
    for p in PARAMS
    if type(p.valid.get(p.name)) is int and not any(label == "huge" for label, _, _ in p.bad)
    and p.owner != "resize(manager)"  # its valid call needs every cache suspended
]


@pytest.mark.parametrize("param", UNBOUNDED)
def test_a_huge_count_is_an_answer_or_a_refusal_naming_it(world: World, param: Param) -> None:
    """A count without an upper bound (tokens, ids, a stream) past 64 bits is a soft answer (False, 0, None) or a
    refusal naming it. Before, ``max_admissible(token_num_upper_bound=2**64)`` priced a 2**64-token
    ``KVCacheDesc`` and failed with that class's message instead of answering."""
    for value in (2**64, np.uint64(2**64 - 1), 2**63):
        try:
            close_made(param.target(world)(**{**param.valid, param.name: value}))
        except (TypeError, ValueError, OutOfPagesError) as error:  # the capacity setter's documented shortage
            assert isinstance(error, OutOfPagesError) or param.name in str(error), f"{param.owner}: {error}"
    world.manager.check_invariants()


def test_the_sweep_is_wide() -> None:
    assert len(CASES) > 600 and len(NUMPY_CASES) > 40  # a broken generator yielding nothing would pass
    assert len(CONFIG_INTS) > 15 and len(UNBOUNDED) > 10


# ------------------------------------------------------------------------------------------- whole-object misuse
CACHE_CALLS: dict[str, Callable[[KVCache], object]] = {
    "resize": lambda cache: cache.resize(8, 0),
    "resume": lambda cache: cache.resume(),
    "suspend": lambda cache: cache.suspend(),
    "commit": lambda cache: cache.commit([1]),
    "stop_committing": lambda cache: cache.stop_committing(),
    "get_base_page_indices": lambda cache: cache.get_base_page_indices(0),
    "get_aggregated_page_indices": lambda cache: cache.get_aggregated_page_indices(0),
    "set_base_page_index_buf": lambda cache: cache.set_base_page_index_buf(0, 0, None),
    "prefetch": lambda cache: cache.prefetch(0),
    "offload": lambda cache: cache.offload(),
    "hold": lambda cache: cache.hold("x"),
    "plan_committed_block_drop": lambda cache: cache.plan_committed_block_drop(),
    "capacity=": lambda cache: setattr(cache, "capacity", 8),
    "history_length=": lambda cache: setattr(cache, "history_length", 0),
    "cuda_stream=": lambda cache: setattr(cache, "cuda_stream", 0),
}


@pytest.mark.parametrize("name", sorted(CACHE_CALLS))
def test_a_closed_cache_refuses_every_change(world: World, name: str) -> None:
    closed = world.manager.create_kv_cache(None, PROMPT)
    closed.close()
    before = world.observe()
    with pytest.raises(ValueError, match=r"closed|CLOSED"):
        CACHE_CALLS[name](closed)
    assert closed.status == KVCacheStatus.CLOSED
    assert_unchanged(before, world.observe(), name)


MANAGER_CALLS: dict[str, Callable[[KVCacheManager], object]] = {
    "create_kv_cache": lambda manager: manager.create_kv_cache(None, PROMPT),
    "create_kv_cache_batch": lambda manager: manager.create_kv_cache_batch([KVCacheRequest(PROMPT)]),
    "probe_reuse": lambda manager: manager.probe_reuse(None, PROMPT),
    "prefetch_remote": lambda manager: manager.prefetch_remote(None, PROMPT),
    "resize": lambda manager: manager.resize(0, 1 << 20),
    "adjust": lambda manager: manager.adjust(),
    "can_fit": lambda manager: manager.can_fit(8),
    "can_fit_in_chunks": lambda manager: manager.can_fit_in_chunks(8, 4),
    "max_admissible": lambda manager: manager.max_admissible(),
    "peak_pages": lambda manager: manager.peak_pages(8, 4),
    "clamp_max_seq_len_for_mem": lambda manager: manager.clamp_max_seq_len_for_mem(1, 8),
    "clear_reusable_blocks": lambda manager: manager.clear_reusable_blocks(),
    "get_storage_statistics": lambda manager: manager.get_storage_statistics(0),
    "get_usage": lambda manager: manager.get_usage(),
    "get_quota": lambda manager: manager.get_quota(0),
    "get_latest_events": lambda manager: manager.get_latest_events(),
    "get_page_view": lambda manager: manager.get_page_view(0, ROLE),
    "get_pool_base_address": lambda manager: manager.get_pool_base_address(0, 0),
    "check_invariants": lambda manager: manager.check_invariants(),
}


@pytest.fixture(scope="module")
def shut_down() -> KVCacheManager:
    manager = KVCacheManager(world_config())
    compute_prompt(manager, FakeEngine(manager), PROMPT).close()
    manager.shutdown()
    return manager


@pytest.mark.parametrize("name", sorted(MANAGER_CALLS))
def test_a_shut_down_manager_refuses_every_state_call(shut_down: KVCacheManager, name: str) -> None:
    with pytest.raises(ValueError, match="shut down"):
        MANAGER_CALLS[name](shut_down)
    assert shut_down.is_shut_down
    shut_down.shutdown()  # a second shutdown is a no-op, not an error


def test_another_managers_cache_is_refused_by_the_handoff(world: World) -> None:
    receiver, counts = disagg.prepare_receiver(world.other_manager, PROMPT) or (None, [])
    assert receiver is not None
    try:
        before = world.observe()
        for src_manager, src, dst_manager, dst, match in [
            (world.manager, world.foreign, world.other_manager, receiver, "src_cache"),
            (world.manager, world.active, world.other_manager, world.active, "dst_cache"),
            (world.other_manager, world.active, world.manager, receiver, "src_cache"),
        ]:
            with pytest.raises(ValueError, match=match):
                disagg.plan_transfer(src_manager, src, dst_manager, dst, disagg.KVSlice(len(PROMPT)), counts)
        assert_unchanged(before, world.observe(), "plan_transfer")
    finally:
        receiver.close()
