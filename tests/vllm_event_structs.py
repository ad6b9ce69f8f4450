"""vLLM's KV event structs declared as vLLM 0.33 declares them (``vllm/distributed/kv_events.py``): the reference
encoder the golden bytes are checked against. Written here from the format facts; only the declarations matter
(struct options, field order, defaults)."""

from __future__ import annotations

from typing import Any, Union

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Union[int, None] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Union[tuple[Any, ...], None]], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    medium: Union[str, None]
    group_idx: Union[int, None] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
