"""Bools are not ints, in both modes: every integer parameter of the public API refuses ``True`` and
``numpy.True_`` with a ``TypeError`` naming the parameter and answers a NumPy integer as it answers the int; every
bool parameter refuses ``1`` and ``numpy.True_`` (SPEC §11).

Compiled, a parameter declared ``int`` is unboxed on entry: ``True`` arrived as a plain 1, so the check inside
saw nothing wrong and ``sequence_to_blockchain_keys(True, ...)`` hashed one-token blocks (issue #35, item 14).
The walk (``tests/public_parameters.py``: the package, ``disagg`` and the subpackages an engine imports) reads the
annotations from the sources (compiled functions carry none): each integer or bool parameter needs a call below
or a reason in ``NOT_CHECKED``, so a new one cannot be missed. ``tools/mode_parity.py``'s ``arguments`` scenario
makes the same calls in both modes and compares the answers.
"""

from __future__ import annotations

import io
from typing import Callable, Iterator

import numpy as np
import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DataRole,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HalfOpenRange,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheRequest,
    PageIndexConverter,
    MooncakeStoreConfig,
    RemoteCacheTierConfig,
    ReuseScope,
    SsmLayerConfig,
    SwaScratchReuseConfig,
    gen_multimodal_cache_key_tokens,
    sequence_to_blockchain_keys,
)
from kv_cache_manager_v2 import disagg
from kv_cache_manager_v2.kv_events import (
    EventSubscriber,
    EventTranslator,
    KVEventsPublisher,
    PrefixIndex,
    ZmqEventPublisher,
)
from kv_cache_manager_v2.kv_events.listen import listen
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import attention, make_config, ssm
from tests.public_parameters import INTEGER, public_parameters
from tools.parity.describe import outcome

DIGEST = bytes(32)
PROMPT = list(range(100))

# Integer parameters that are not argument-checked entry points, with the reason.
RECORDS = "a record the library fills in and hands out"
NOT_CHECKED: dict[str, str] = {
    **{name: RECORDS for name in (
        "IterationStats", "KVEvent", "KVCacheEvent", "KVCacheEventDiff", "KVCacheStoredBlockData",
        "UniqueToken", "KVCacheStatsDelta", "KVCacheIterationStatsDelta", "StorageStatistics",
        "AggregatedPageDesc", "ExpandedBuffer", "SsmSnapshotIterationStatsDelta",
        "GroupTransfer", "TransferDescriptor", "SourceBlock", "SourcePlan", "TransferPlan",
        "ReceivedKV", "Refusal", "PoolGroupUsage", "ReuseByTier",
    )},
    "LifeCycle": "the manager's rules for a layer group, handed to priority callbacks to read",
    "KVCacheEventManager.add_stored_event": "a hook the manager calls with its own layer group ids",
    "KVCacheEventManager.add_removed_event": "a hook the manager calls with its own layer group ids",
    "KVCacheEventManager.add_updated_event": "a hook the manager calls with its own layer group ids",
    "MooncakeStoreConfig.open": "the manager calls it with the tier's checked quota",
    "RemoteStoreConfig.open": "a Protocol",
    "ColdPageCodec.encoded_page_bytes": "a Protocol the manager calls with its own layer group ids",
    "ColdPageCodec.encode": "a Protocol the manager calls with its own layer group ids",
    "ColdPageCodec.decode": "a Protocol the manager calls with its own layer group ids",
    "KVSender": "needs a NIXL peer (tests/test_nixl_transport.py)",
    "KVReceiver": "needs a NIXL peer (tests/test_nixl_transport.py)",
    "NixlEndpoint": "needs a NIXL peer (tests/test_nixl_transport.py)",
    "MemoryStoreConfig.open": "the manager calls it with the tier's checked quota",
    "KVCache": "made by the manager (create_kv_cache), never by an engine",
    **{name: "interpreted in both modes (batching is not compiled); tests/test_batching_inputs.py checks it"
       for name in ("BatchedRequest", "BatchingOptions", "ContinuousBatcher", "StepBoundaryInterrupts")},
    **{name: RECORDS for name in ("ReceivedBatch", "Gap", "Restart", "LayerGroupSpec", "BlockStored",
                                  "BlockRemoved", "EventBatch")},
}


class World:
    """A manager with an SWA, a full attention and an SSM layer group, an active cache, and a local handoff."""

    def __init__(self) -> None:
        config = make_config([attention(0, window=64), attention(1), ssm(2)], ssm_reuse_interval=32)
        self.manager = KVCacheManager(config)
        self.cache = self.manager.create_kv_cache(None, PROMPT)
        assert self.cache.resume() and self.cache.resize(len(PROMPT), 0)
        self.cache.commit(PROMPT)
        self.receiver = KVCacheManager(config)
        prepared = disagg.prepare_receiver(self.receiver, PROMPT)
        assert prepared is not None
        self.received, self.counts = prepared
        self.plan = disagg.plan_transfer(
            self.manager, self.cache, self.receiver, self.received, disagg.KVSlice(len(PROMPT)), self.counts
        )
        self.engine = FakeEngine(self.manager)
        self.publishing = KVCacheManager(make_config([attention(0)], enable_kv_events=True))
        self.subscriber = EventSubscriber(SUBSCRIBED)  # connects: nothing needs to listen there
        self.index = PrefixIndex()

    def close(self) -> None:
        self.subscriber.close()
        self.cache.close()
        self.received.close()
        for manager in (self.manager, self.receiver, self.publishing):
            manager.shutdown()


Call = Callable[[World], tuple[Callable[..., object], dict[str, object]]]
SUBSCRIBED = "tcp://127.0.0.1:5999"
ANY_PORT = "tcp://127.0.0.1:*"
BUFFERS = [BufferConfig("key", 64)]
MOONCAKE = MooncakeStoreConfig("master:50051", "http://meta:8080/metadata")
# Each callable's valid arguments: the test replaces one integer parameter at a time by True.
CALLS: dict[str, Call] = {
    "AttentionLayerConfig": lambda w: (AttentionLayerConfig, dict(
        layer_id=0, buffers=BUFFERS, sliding_window_size=64, num_sink_tokens=4)),
    "SsmLayerConfig": lambda w: (SsmLayerConfig, dict(layer_id=0, buffers=BUFFERS)),
    "BufferConfig": lambda w: (BufferConfig, dict(role="key", size=64, tokens_per_block_override=16)),
    "GpuCacheTierConfig": lambda w: (GpuCacheTierConfig, dict(quota=1 << 20, max_quota=2 << 20)),
    "HostCacheTierConfig": lambda w: (HostCacheTierConfig, dict(quota=1 << 20, max_quota=2 << 20)),
    "DiskCacheTierConfig": lambda w: (DiskCacheTierConfig, dict(quota=1 << 20, path="/tmp", max_quota=2 << 20)),
    "RemoteCacheTierConfig": lambda w: (RemoteCacheTierConfig, dict(
        quota=0, backend=MOONCAKE, namespace="m", tensor_parallel_rank=1, tensor_parallel_size=2)),
    "MooncakeStoreConfig": lambda w: (MooncakeStoreConfig, dict(
        master_address="m:1", metadata_url="http://meta", local_buffer_size=1 << 20)),
    "KVCacheDesc": lambda w: (KVCacheDesc, dict(capacity=8, history_length=4)),
    "BatchDesc": lambda w: (BatchDesc, dict(kv_caches=[], system_prompt_length=4)),
    "SwaScratchReuseConfig": lambda w: (SwaScratchReuseConfig, dict(max_rewind_len=4)),
    "KVCacheManagerConfig": lambda w: (KVCacheManagerConfig, dict(
        tokens_per_block=32, vocab_size=1000, cache_tiers=[GpuCacheTierConfig(1 << 20)], layers=[attention(0)],
        ssm_reuse_interval=512, reuse_match_backoff=0, max_kv_events=10, rebalance_min_sampled_kv_caches=4)),
    "KVCacheRequest": lambda w: (KVCacheRequest, dict(input_tokens=PROMPT, id=5, capacity=128)),
    "ReuseScope": lambda w: (ReuseScope, dict(lora_id=1)),
    "KVFormat": lambda w: (disagg.KVFormat, dict(dtype="bf16", model="m", tensor_parallel_rank=1, tensor_parallel_size=2)),
    "KVCacheEventManager": lambda w: (KVCacheEventManager, dict(
        max_kv_event_entries=10, window_size=0, attention_dp_rank=0, mm_token_id_offset=1000)),
    "gen_multimodal_cache_key_tokens": lambda w: (gen_multimodal_cache_key_tokens, dict(
        id_offset=1000, multi_modal_data_digest=DIGEST, num_tokens=4, token_offset=0)),
    "sequence_to_blockchain_keys": lambda w: (
        lambda **kwargs: list(sequence_to_blockchain_keys(**kwargs)),
        dict(tokens_per_block=32, reuse_scope=None, tokens=PROMPT)),
    "KVCacheManager.create_kv_cache": lambda w: (w.manager.create_kv_cache, dict(
        input_tokens=PROMPT, id=77, expected_prompt_length=100)),
    "KVCacheManager.create_kv_cache_batch": lambda w: (w.manager.create_kv_cache_batch, dict(
        requests=[KVCacheRequest(PROMPT)], cuda_stream=0)),
    "KVCacheManager.gen_multimodal_cache_key_tokens": lambda w: (w.manager.gen_multimodal_cache_key_tokens, dict(
        multi_modal_data_digest=DIGEST, num_tokens=4, id_offset=1000, token_offset=0)),
    "KVCacheManager.get_layer_window": lambda w: (w.manager.get_layer_window, dict(layer_id=0)),
    "KVCacheManager.get_layer_group_id": lambda w: (w.manager.get_layer_group_id, dict(layer_id=0)),
    "KVCacheManager.get_pool_group_index": lambda w: (w.manager.get_pool_group_index, dict(layer_group_id=0)),
    "KVCacheManager.get_pool_base_address": lambda w: (w.manager.get_pool_base_address, dict(
        pool_group=0, pool=0, level=0)),
    "KVCacheManager.get_slot_bytes": lambda w: (w.manager.get_slot_bytes, dict(pool_group=0)),
    "KVCacheManager.get_page_index_converter": lambda w: (w.manager.get_page_index_converter, dict(
        layer_id=0, data_role=DataRole("key"))),
    "KVCacheManager.get_page_index_scale": lambda w: (w.manager.get_page_index_scale, dict(
        layer_id=0, data_role=DataRole("key"))),
    "KVCacheManager.get_life_cycle_pool_group_indices": lambda w: (w.manager.get_life_cycle_pool_group_indices, dict(
        cache_level=0)),
    "KVCacheManager.get_page_stride": lambda w: (w.manager.get_page_stride, dict(
        layer_id=0, data_role=DataRole("key"))),
    "KVCacheManager.get_mem_pool_base_address": lambda w: (w.manager.get_mem_pool_base_address, dict(
        layer_id=0, data_role=DataRole("key"))),
    "KVCacheManager.get_page_index_upper_bound": lambda w: (w.manager.get_page_index_upper_bound, dict(
        layer_id=0, data_role=DataRole("key"))),
    "KVCacheManager.get_page_view": lambda w: (w.manager.get_page_view, dict(layer_id=0, data_role=DataRole("key"))),
    "KVCacheManager.get_storage_statistics": lambda w: (w.manager.get_storage_statistics, dict(cache_level=0)),
    "KVCacheManager.get_quota": lambda w: (w.manager.get_quota, dict(cache_level=0)),
    "KVCacheManager.mark_stats_excluded": lambda w: (w.manager.mark_stats_excluded, dict(kv_cache_id=5)),
    "KVCacheManager.clear_stats_excluded": lambda w: (w.manager.clear_stats_excluded, dict(kv_cache_id=5)),
    "KVCacheManager.is_stats_excluded": lambda w: (w.manager.is_stats_excluded, dict(kv_cache_id=5)),
    "KVCacheManager.resize": lambda w: (w.manager.resize, dict(cache_level=0, quota=w.manager.get_quota(0))),
    "KVCacheManager.clamp_max_seq_len_for_mem": lambda w: (w.manager.clamp_max_seq_len_for_mem, dict(
        batch_size=1, token_num_upper_bound=128)),
    "KVCacheManager.can_fit": lambda w: (w.manager.can_fit, dict(num_tokens=128, chunk_size=32)),
    "KVCacheManager.can_fit_in_chunks": lambda w: (w.manager.can_fit_in_chunks, dict(num_tokens=128, chunk_size=32)),
    "KVCacheManager.max_admissible": lambda w: (w.manager.max_admissible, dict(
        chunk_size=32, token_num_upper_bound=128)),
    "KVCacheManager.peak_pages": lambda w: (w.manager.peak_pages, dict(num_tokens=128, chunk_size=32)),
    "KVCache.get_scratch_desc": lambda w: (w.cache.get_scratch_desc, dict(layer_group_id=0)),
    "KVCache.get_ssm_block_base_index": lambda w: (w.cache.get_ssm_block_base_index, dict(layer_group_id=2, beam=0)),
    "KVCache.get_num_front_blocks_removed": lambda w: (w.cache.get_num_front_blocks_removed, dict(layer_group_id=0)),
    "KVCache.get_base_page_indices": lambda w: (w.cache.get_base_page_indices, dict(layer_group_id=0, beam_id=0)),
    "KVCache.get_aggregated_page_indices": lambda w: (
        w.cache.get_aggregated_page_indices, dict(layer_group_id=0, beam_id=0)
    ),
    "KVCache.set_base_page_index_buf": lambda w: (w.cache.set_base_page_index_buf, dict(
        beam_idx=0, layer_group_id=0, buf=None)),
    "KVCache.resume": lambda w: (w.cache.resume, dict(cuda_stream=0)),
    "KVCache.resize": lambda w: (w.cache.resize, dict(capacity=len(PROMPT), history_length=len(PROMPT))),
    "KVSlice": lambda w: (disagg.KVSlice, dict(prompt_len=100)),
    "PrefillRequest": lambda w: (disagg.PrefillRequest, dict(request_id=3, tokens=PROMPT, cached_per_group=[0, 32, 0])),
    "HalfOpenRange": lambda w: (HalfOpenRange, dict(beg=0, end=4)),
    "PageIndexConverter": lambda w: (PageIndexConverter, dict(
        scale=2, expansion=1, layer_offset=1, scratch_pages_per_block=2, scratch_page_in_block=1)),
    "TransferPlan.descriptors_of": lambda w: (w.plan.descriptors_of, dict(layer_group=0)),
    "cached_tokens_per_layer_group": lambda w: (disagg.cached_tokens_per_layer_group, dict(
        cache=w.received, prompt_len=len(PROMPT))),
    "execute": lambda w: (disagg.execute, dict(plan=w.plan, stream=0)),
    "prepare_receiver": lambda w: (disagg.prepare_receiver, dict(
        manager=w.receiver, input_tokens=PROMPT, cuda_stream=0)),
    "align_block_lists": lambda w: (disagg.align_block_lists, dict(num_src_blocks=2, num_dst_blocks=2)),
    "KVCache.capacity": lambda w: (lambda capacity: setattr(w.cache, "capacity", capacity), dict(capacity=100)),
    "KVCache.history_length": lambda w: (
        lambda history_length: setattr(w.cache, "history_length", history_length), dict(history_length=100)),
    "KVCache.cuda_stream": lambda w: (lambda cuda_stream: setattr(w.cache, "cuda_stream", cuda_stream), dict(
        cuda_stream=0)),
    "KVCache.prefetch": lambda w: (w.cache.prefetch, dict(target=0, evict=False)),
    "KVCache.commit": lambda w: (w.cache.commit, dict(accepted_input_tokens=[], is_end=False, save_ssm_snapshot=False)),
    "KVCache.stop_committing": lambda w: (w.cache.stop_committing, dict(save_last_ssm_snapshot=False)),
    "KVCache.enable_swa_scratch_reuse": lambda w: (
        lambda enable_swa_scratch_reuse: setattr(w.cache, "enable_swa_scratch_reuse", enable_swa_scratch_reuse),
        dict(enable_swa_scratch_reuse=False)),
    "RemoteCacheTierConfig.write_through": lambda w: (RemoteCacheTierConfig, dict(
        quota=0, backend=MOONCAKE, namespace="m", write_through=False)),
    "EventSubscriber": lambda w: (EventSubscriber, dict(endpoint=SUBSCRIBED, last_seq=-1, replay_timeout_ms=10)),
    "EventSubscriber.receive": lambda w: (w.subscriber.receive, dict(timeout_ms=0)),
    "EventSubscriber.replay": lambda w: (w.subscriber.replay, dict(start=0, stop=1, timeout_ms=10)),
    "EventTranslator": lambda w: (EventTranslator, dict(
        groups=[], mediums=[], tokens_per_block=32, full_attention_only=False, multimodal_token_id=0)),
    "EventTranslator.for_manager": lambda w: (EventTranslator.for_manager, dict(
        manager=w.manager, full_attention_only=False)),
    "ZmqEventPublisher": lambda w: (ZmqEventPublisher, dict(endpoint=ANY_PORT, buffer_steps=4, data_parallel_rank=0, hwm=10)),
    "KVEventsPublisher": lambda w: (KVEventsPublisher, dict(
        manager=w.publishing, endpoint=ANY_PORT, buffer_steps=4, data_parallel_rank=0, full_attention_only=False,
        hwm=10)),
    "PrefixIndex.held_blocks": lambda w: (w.index.held_blocks, dict(group=0)),
    "PrefixIndex.reusable_tokens": lambda w: (w.index.reusable_tokens, dict(blocks=[], lora_id=1)),
    "listen": lambda w: (listen, dict(subscriber=w.subscriber, count=1, timeout_s=0.0, out=io.StringIO())),
    "FakeEngine.write": lambda w: (w.engine.write, dict(cache=w.cache, tokens=PROMPT, begin=96, end=100)),
}
# Where one callable has both a bool and integer parameters, or several bool parameters of one config: the key
# a bool parameter's call is under when it is not its owner's.
BOOL_CALL_KEYS = {("RemoteCacheTierConfig", "write_through"): "RemoteCacheTierConfig.write_through"}
INTEGER_VALUES: dict[str, object] = {"True": True, "numpy.True_": np.bool_(True)}
BOOL_VALUES: dict[str, object] = {"1": 1, "numpy.True_": np.bool_(True)}
RUNS_ONCE = {"execute": "a plan runs once, and the world has one"}
# Integer parameters whose valid call in CALLS passes no integer (None: the default the call documents), so the
# NumPy-integer comparison has no int to stand in for; their NumPy integers are covered by the refusal sweeps.
NO_INT_IN_VALID_CALL = {("KVCacheRequest", "num_new_tokens")}
MYPYC_TYPE_ERROR = " object expected; got "  # mypyc's own: "bool object expected; got int", "bool or None ..."


def checked(kinds: frozenset[str]) -> list[tuple[str, str]]:
    """``(call key, parameter)`` of the walked parameters of ``kinds``, but those ``NOT_CHECKED``."""
    return [
        (BOOL_CALL_KEYS.get((p.owner, p.name), p.owner), p.name) for p in public_parameters()
        if p.kinds <= kinds and p.owner not in NOT_CHECKED and p.owner.partition(".")[0] not in NOT_CHECKED
    ]


def walked() -> list[tuple[str, str]]:
    return checked(INTEGER)


def walked_bools() -> list[tuple[str, str]]:
    return checked(frozenset({"bool"}))


def test_every_public_integer_and_bool_parameter_has_a_call() -> None:
    missing = sorted({owner for owner, _ in walked() + walked_bools() if owner not in CALLS})
    assert missing == [], f"add a valid call to CALLS (or a reason to NOT_CHECKED) for {missing}"
    # the walk found the parameters (a broken walk finding none would pass)
    assert len(walked()) >= 80 and len(walked_bools()) >= 15


def free_slots(world: World) -> list[int]:
    return [stats.free for manager in (world.manager, world.receiver) for stats in manager.get_storage_statistics(0)]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    made = World()
    yield made
    made.close()


def cases(parameters: list[tuple[str, str]], values: dict[str, object]) -> list[tuple[str, str, object]]:
    return [(owner, parameter, value) for owner, parameter in parameters for value in values.values()]


def case_ids(parameters: list[tuple[str, str]], values: dict[str, object]) -> list[str]:
    return [f"{owner}-{parameter}-{label}" for owner, parameter in parameters for label in values]


@pytest.mark.parametrize(("owner", "parameter", "value"), cases(walked(), INTEGER_VALUES),
                         ids=case_ids(walked(), INTEGER_VALUES))
def test_a_bool_is_refused_naming_the_integer_parameter(world: World, owner: str, parameter: str, value: object) -> None:
    function, arguments = CALLS[owner](world)
    before = free_slots(world)
    with pytest.raises(TypeError, match=parameter):
        function(**{**arguments, parameter: value})
    assert free_slots(world) == before  # refused before anything changed


@pytest.mark.parametrize(("owner", "parameter", "value"), cases(walked_bools(), BOOL_VALUES),
                         ids=case_ids(walked_bools(), BOOL_VALUES))
def test_a_bool_parameter_refuses_what_is_not_a_bool(world: World, owner: str, parameter: str, value: object) -> None:
    """Interpreted, the function's own check names the parameter; compiled, mypyc may refuse it first, in its
    words (README's one accepted difference): at a compiled function's parameter, or where a non-native dataclass's
    ``__post_init__`` reads a bool field (``KVCacheRequest``'s)."""
    function, arguments = CALLS[owner](world)
    before = free_slots(world)
    with pytest.raises(TypeError) as raised:
        function(**{**arguments, parameter: value})
    assert parameter in str(raised.value) or (
        kv_cache_manager_v2.COMPILED and MYPYC_TYPE_ERROR in str(raised.value)), str(raised.value)
    assert free_slots(world) == before


def close_made(result: object) -> None:
    """Close what a call made: caches, publishers and subscribers (a pair, as ``prepare_receiver`` returns)."""
    for item in result if isinstance(result, (list, tuple)) else [result]:
        if isinstance(item, (kv_cache_manager_v2.KVCache, EventSubscriber, ZmqEventPublisher)):
            item.close()
        elif isinstance(item, KVEventsPublisher):
            item.shutdown()


def answer(world: World, owner: str, arguments: dict[str, object]) -> object:
    """What a call answers (its value described with its type, or its exception), whatever it made closed."""
    function, _ = CALLS[owner](world)
    described, result = outcome(lambda: function(**arguments))
    close_made(result)
    return described


@pytest.fixture(scope="module")
def numpy_world() -> Iterator[World]:
    made = World()
    yield made
    made.close()


def walked_with_ints() -> list[tuple[str, str]]:
    """``walked()`` but the calls that run once (``RUNS_ONCE``) and those passing no integer (``NO_INT_IN_VALID_CALL``):
    left out here rather than skipped (a skip is for a missing GPU or extra only)."""
    return [(o, p) for o, p in walked() if o not in RUNS_ONCE and (o, p) not in NO_INT_IN_VALID_CALL]


@pytest.mark.parametrize(("owner", "parameter"), walked_with_ints(), ids=[f"{o}-{p}" for o, p in walked_with_ints()])
def test_a_numpy_integer_answers_as_the_int(numpy_world: World, owner: str, parameter: str) -> None:
    """Compiled, an ``int`` parameter refused it in mypyc's words ("int object expected; got numpy.int64")."""
    _, arguments = CALLS[owner](numpy_world)
    valid = arguments.get(parameter)
    assert type(valid) is int, f"{owner}'s valid call passes {parameter}={valid!r}: add it to NO_INT_IN_VALID_CALL"
    plain = answer(numpy_world, owner, arguments)
    assert answer(numpy_world, owner, {**arguments, parameter: np.int64(valid)}) == plain


def test_the_issue_repro() -> None:
    with pytest.raises(TypeError, match="tokens_per_block"):
        list(sequence_to_blockchain_keys(True, None, [1, 2, 3]))
    assert [block for block, _ in sequence_to_blockchain_keys(np.int64(2), None, [1, 2, 3])] == [[1, 2], [3]]
