"""KV events on the wire for KV-aware routers, in vLLM's ZMQ/msgpack format (needs the ``events`` extra:
pyzmq and msgspec). ``KVEventsPublisher`` publishes a manager's events; ``EventSubscriber`` and ``PrefixIndex``
are the reference consumer; ``python -m kv_cache_manager_v2 events-listen ENDPOINT`` prints a stream."""

import importlib.util

for _module in ("zmq", "msgspec"):
    if importlib.util.find_spec(_module) is None:
        raise ImportError(
            f"kv_cache_manager_v2.kv_events needs the 'events' extra ({_module} is missing): "
            "pip install 'kv_cache_manager_v2[events]'"
        )

from .adapter import EventTranslator, LayerGroupSpec, WireBlock, describe_layer_groups, wire_blocks, wire_hash
from .index import PrefixIndex
from .manager_publisher import KVEventsPublisher
from .publisher import ZmqEventPublisher
from .subscriber import EventSubscriber, Gap, ReceivedBatch, Restart
from .wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireEvent,
    WireFormatError,
    decode_batch,
    encode_batch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventSubscriber",
    "EventTranslator",
    "Gap",
    "KVEventsPublisher",
    "LayerGroupSpec",
    "PrefixIndex",
    "ReceivedBatch",
    "Restart",
    "WireBlock",
    "WireEvent",
    "WireFormatError",
    "ZmqEventPublisher",
    "decode_batch",
    "describe_layer_groups",
    "encode_batch",
    "wire_blocks",
    "wire_hash",
]
