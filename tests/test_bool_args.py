"""Bools are not ints, in both modes: every integer parameter of the public API refuses ``True`` with a
``TypeError`` naming the parameter (SPEC §11).

Compiled, a parameter declared ``int`` is unboxed on entry: ``True`` arrived as a plain 1, so the check inside
saw nothing wrong and ``sequence_to_blockchain_keys(True, ...)`` hashed one-token blocks (issue #35, item 14).
The walk reads the annotations from the sources (compiled functions carry none) of every exported callable:
each integer parameter needs a call below or a reason in ``NOT_CHECKED``, so a new one cannot be missed.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
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
from tests.helpers import attention, make_config, ssm

REPO = Path(__file__).resolve().parent.parent
INTEGER_ANNOTATIONS = {"int", "SupportsIndex"}
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
}


def disagg_public_names() -> set[str]:
    """What ``disagg`` defines or re-exports explicitly (``import X as X``), not what it merely uses."""
    tree = ast.parse((REPO / "kv_cache_manager_v2" / "disagg.py").read_text())
    names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names if alias.asname == alias.name)
    return {name for name in names if not name.startswith("_")}


def exported() -> dict[str, object]:
    found = {name: getattr(kv_cache_manager_v2, name) for name in dir(kv_cache_manager_v2) if not name.startswith("_")}
    found.update({name: getattr(disagg, name) for name in disagg_public_names()})
    return {
        name: value for name, value in found.items()
        if (inspect.isclass(value) or inspect.isroutine(value))
        and str(getattr(value, "__module__", "")).startswith("kv_cache_manager_v2")
    }


def integer_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    return [
        arg.arg for arg in args
        if arg.annotation is not None
        and set(ast.unparse(arg.annotation).replace(" ", "").split("|")) - {"None"} <= INTEGER_ANNOTATIONS
    ]


def public_integer_parameters() -> Iterator[tuple[str, str]]:
    """``(callable, parameter)`` for every integer parameter of the exported functions, constructors and public
    methods (a dataclass's constructor takes its fields)."""
    for name, value in sorted(exported().items()):
        if not inspect.isclass(value):
            node = class_or_function_node(value)
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            yield from ((name, parameter) for parameter in integer_parameters(node))
            continue
        seen: set[str] = set()
        # The class and the package's classes it inherits from (KVCacheManager is written in layers).
        for owner in inspect.getmro(value):
            if not str(getattr(owner, "__module__", "")).startswith("kv_cache_manager_v2"):
                continue
            node = class_or_function_node(owner)
            assert isinstance(node, ast.ClassDef)
            for item in node.body:
                member = item.target.id if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) else (
                    item.name if isinstance(item, ast.FunctionDef) else None
                )
                if member is None or member in seen:
                    continue
                seen.add(member)
                yield from class_member_parameters(name, item)


def class_or_function_node(value: object) -> ast.stmt:
    module = str(getattr(value, "__module__"))
    tree = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
    return next(node for node in tree.body if getattr(node, "name", None) == getattr(value, "__name__"))


def class_member_parameters(name: str, item: ast.stmt) -> Iterator[tuple[str, str]]:
    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
        if set(ast.unparse(item.annotation).replace(" ", "").split("|")) - {"None"} <= INTEGER_ANNOTATIONS:
            yield name, item.target.id
    elif isinstance(item, ast.FunctionDef) and (item.name == "__init__" or not item.name.startswith("_")):
        decorators = [ast.unparse(decorator) for decorator in item.decorator_list]
        if "property" in decorators:
            return
        qualified = name if item.name == "__init__" else f"{name}.{item.name}"
        if f"{item.name}.setter" in decorators:  # ``cache.capacity = value``: the property names it
            if integer_parameters(item):
                yield qualified, item.name
            return
        yield from ((qualified, parameter) for parameter in integer_parameters(item))


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


Call = Callable[[World], tuple[Callable[..., object], dict[str, object]]]
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
    "RemoteCacheTierConfig": lambda w: (RemoteCacheTierConfig, dict(quota=0, backend=MOONCAKE, namespace="m")),
    "MooncakeStoreConfig": lambda w: (MooncakeStoreConfig, dict(
        master_address="m:1", metadata_url="http://meta", local_buffer_size=1 << 20)),
    "KVCacheDesc": lambda w: (KVCacheDesc, dict(capacity=8, history_length=4)),
    "BatchDesc": lambda w: (BatchDesc, dict(kv_caches=[], system_prompt_length=4)),
    "SwaScratchReuseConfig": lambda w: (SwaScratchReuseConfig, dict(max_rewind_len=4)),
    "KVCacheManagerConfig": lambda w: (KVCacheManagerConfig, dict(
        tokens_per_block=32, vocab_size=1000, cache_tiers=[GpuCacheTierConfig(1 << 20)], layers=[attention(0)],
        ssm_reuse_interval=512, reuse_match_backoff=0, max_kv_events=10)),
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
}


def walked() -> list[tuple[str, str]]:
    return [
        (owner, parameter) for owner, parameter in public_integer_parameters()
        if owner not in NOT_CHECKED and owner.partition(".")[0] not in NOT_CHECKED
    ]


def test_every_public_integer_parameter_has_a_call() -> None:
    missing = sorted({owner for owner, _ in walked() if owner not in CALLS})
    assert missing == [], f"add a valid call to CALLS (or a reason to NOT_CHECKED) for {missing}"
    assert len(walked()) >= 60  # the walk found the parameters (a broken walk finding none would pass)


def free_slots(world: World) -> list[int]:
    return [stats.free for manager in (world.manager, world.receiver) for stats in manager.get_storage_statistics(0)]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    made = World()
    yield made
    made.cache.close()
    made.received.close()
    made.manager.shutdown()
    made.receiver.shutdown()


@pytest.mark.parametrize(("owner", "parameter"), walked(), ids=[f"{o}-{p}" for o, p in walked()])
def test_true_is_refused_naming_the_parameter(world: World, owner: str, parameter: str) -> None:
    function, arguments = CALLS[owner](world)
    before = free_slots(world)
    with pytest.raises(TypeError, match=parameter):
        function(**{**arguments, parameter: True})
    assert free_slots(world) == before  # refused before anything changed


def test_the_issue_repro() -> None:
    with pytest.raises(TypeError, match="tokens_per_block"):
        list(sequence_to_blockchain_keys(True, None, [1, 2, 3]))
    assert [block for block, _ in sequence_to_blockchain_keys(np.int64(2), None, [1, 2, 3])] == [[1, 2], [3]]
