"""vLLM's KV event wire format (``vllm/distributed/kv_events.py``): what routers decode, byte for byte.

A batch is a msgpack array ``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch`` is an ``array_like``
msgspec struct). Each event is a msgpack map whose first key is ``"type"`` (the struct's tag: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``), then the fields in vLLM's declaration order; a field with a default is
left out while it holds that default (``omit_defaults``), a field without one is always there, ``None`` included.
Python dicts keep insertion order and msgspec writes them in that order, so plain dicts and lists encode to the
same bytes as vLLM's structs (``tests/test_kv_events_wire.py`` checks it against structs declared like vLLM's).
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from typing import Final, Union, final

from mypy_extensions import mypyc_attr

import msgspec

from .._base.types import FrozenValue
from .._base.wording import counted

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"
FULL_ATTENTION: Final = "full_attention"
SLIDING_WINDOW: Final = "sliding_window"
MAMBA: Final = "mamba"
# The sequence frame: an 8-byte big-endian signed integer; -1 (with an empty payload) ends a replay.
SEQ_BYTES: Final = 8
END_SEQ: Final = -1

# A block's hash as vLLM sends it: an int, or (its default since sha256 block hashing) the digest's bytes.
BlockHash = Union[int, bytes]

# One entry of ``extra_keys``: the keys besides token ids that went into a block's hash, or None.
ExtraKey = Union[tuple[object, ...], None]
# What an entry of ``extra_keys`` may hold (besides nil): hashable plain values.
EXTRA_KEY_PARTS: Final = (str, int, float, bytes)


@final
@dataclass(frozen=True)
class BlockStored(FrozenValue):
    """Blocks now cached in ``medium``, a chain: each block's parent is the previous one (the first's is
    ``parent_block_hash``, None at the start of a sequence); ``token_ids`` holds every block's tokens in order."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[ExtraKey, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@final
@dataclass(frozen=True)
class BlockRemoved(FrozenValue):
    """Blocks no longer cached in ``medium`` (of layer group ``group_idx``)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    group_idx: int | None = None


@final
@dataclass(frozen=True)
class AllBlocksCleared(FrozenValue):
    """Every block of this engine is gone: a subscriber forgets all it knows about it."""


WireEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@final
@dataclass(frozen=True)
class EventBatch(FrozenValue):
    """What one message carries: the events of one engine step, stamped with wall-clock seconds."""

    ts: float
    events: tuple[WireEvent, ...]
    data_parallel_rank: int | None = None


def event_to_wire(event: WireEvent) -> dict[str, object]:
    """The event as the map vLLM sends: ``type`` first, declared order, defaults left out."""
    if isinstance(event, BlockStored):
        stored: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            stored["extra_keys"] = [None if key is None else list(key) for key in event.extra_keys]
        if event.group_idx is not None:
            stored["group_idx"] = event.group_idx
        if event.kv_cache_spec_kind is not None:
            stored["kv_cache_spec_kind"] = event.kv_cache_spec_kind
        if event.kv_cache_spec_sliding_window is not None:
            stored["kv_cache_spec_sliding_window"] = event.kv_cache_spec_sliding_window
        return stored
    if isinstance(event, BlockRemoved):
        removed: dict[str, object] = {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
        if event.group_idx is not None:
            removed["group_idx"] = event.group_idx
        return removed
    return {"type": "AllBlocksCleared"}


def batch_to_wire(batch: EventBatch) -> list[object]:
    """The batch as vLLM's array, always three items (msgspec writes a None rank as nil even with
    ``omit_defaults``: array-like structs keep every position)."""
    return [batch.ts, [event_to_wire(event) for event in batch.events], batch.data_parallel_rank]


_ENCODER: Final = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of one message."""
    return _ENCODER.encode(batch_to_wire(batch))


@mypyc_attr(native_class=False)
class WireFormatError(ValueError):
    """A payload that is not a vLLM KV event batch (the message names what is wrong)."""


def decode_batch(payload: bytes) -> EventBatch:
    """Parse a payload from any vLLM-format publisher; WireFormatError when it is not one. Unknown event keys
    are ignored (newer publishers add optional fields); an unknown event type is an error."""
    try:
        wire: object = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as error:
        raise WireFormatError(f"not msgpack: {error}") from None
    if not isinstance(wire, list) or len(wire) not in (2, 3):
        raise WireFormatError(f"a batch is an array [ts, events, data_parallel_rank], got {_short(wire)}")
    ts, events = wire[0], wire[1]
    rank = wire[2] if len(wire) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
        raise WireFormatError(f"batch ts must be a finite number, got {_short(ts)}")
    if not isinstance(events, list):
        raise WireFormatError(f"batch events must be an array, got {_short(events)}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise WireFormatError(f"data_parallel_rank must be an int or nil, got {_short(rank)}")
    return EventBatch(float(ts), tuple(_decode_event(event) for event in events), rank)


def _decode_event(wire: object) -> WireEvent:
    if not isinstance(wire, dict):
        raise WireFormatError(f"an event is a map tagged 'type', got {_short(wire)}")
    kind = wire.get("type")
    if kind == "BlockStored":
        extra = wire.get("extra_keys")
        hashes = _hashes(wire)
        block_size = _int(wire, "block_size")
        if block_size < 1:
            raise WireFormatError(f"BlockStored.block_size must be >= 1, got {block_size}")
        return BlockStored(
            hashes,
            _optional_hash(wire),
            _ints(wire, "token_ids"),
            block_size,
            _optional_int(wire, "lora_id"),
            _optional_str(wire, "medium"),
            _optional_str(wire, "lora_name"),
            None if extra is None else _extra_keys(extra, len(hashes)),
            _optional_int(wire, "group_idx"),
            _optional_str(wire, "kv_cache_spec_kind"),
            _optional_int(wire, "kv_cache_spec_sliding_window"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(wire), _optional_str(wire, "medium"), _optional_int(wire, "group_idx"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise WireFormatError(f"unknown event type {_short(kind)}")


def _int(wire: dict[object, object], key: str) -> int:
    value = wire.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise WireFormatError(f"{wire.get('type')}.{key} must be an int, got {_short(value)}")
    return value


def _optional_int(wire: dict[object, object], key: str) -> int | None:
    return None if wire.get(key) is None else _int(wire, key)


def _optional_str(wire: dict[object, object], key: str) -> str | None:
    value = wire.get(key)
    if value is not None and not isinstance(value, str):
        raise WireFormatError(f"{wire.get('type')}.{key} must be a string or nil, got {_short(value)}")
    return value


def _ints(wire: dict[object, object], key: str) -> tuple[int, ...]:
    value = wire.get(key)
    if not isinstance(value, list) or not all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        raise WireFormatError(f"{wire.get('type')}.{key} must be an array of ints, got {_short(value)}")
    return tuple(value)


def _is_hash(value: object) -> bool:
    return isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool))


def _hashes(wire: dict[object, object]) -> tuple[BlockHash, ...]:
    value = wire.get("block_hashes")
    if not isinstance(value, list) or not all(_is_hash(item) for item in value):
        raise WireFormatError(f"{wire.get('type')}.block_hashes must be an array of ints or bytes, got {_short(value)}")
    return tuple(value)


def _optional_hash(wire: dict[object, object]) -> BlockHash | None:
    value = wire.get("parent_block_hash")
    if value is not None and not _is_hash(value):
        raise WireFormatError(f"BlockStored.parent_block_hash must be an int, bytes or nil, got {_short(value)}")
    return value  # type: ignore[return-value]


def _extra_keys(value: object, blocks: int) -> tuple[ExtraKey, ...]:
    """One entry per block (nil or an array of plain values: a multimodal hash, a LoRA name, a cache salt), so that
    a block's content stays a hashable key for a router's index."""
    if not isinstance(value, list):
        raise WireFormatError(f"BlockStored.extra_keys must be an array or nil, got {_short(value)}")
    if len(value) != blocks:
        raise WireFormatError(
            f"BlockStored.extra_keys has {counted(len(value), 'entry', 'entries')} for "
            f"{counted(blocks, 'block hash', 'block hashes')}"
        )
    keys: list[ExtraKey] = []
    for item in value:
        if item is not None and not isinstance(item, list):
            raise WireFormatError(f"an extra_keys entry must be an array or nil, got {_short(item)}")
        if item is not None and not all(part is None or isinstance(part, EXTRA_KEY_PARTS) for part in item):
            raise WireFormatError(f"an extra_keys entry holds strings, numbers, bytes or nil, got {_short(item)}")
        keys.append(None if item is None else tuple(item))
    return tuple(keys)


def _short(value: object) -> str:
    """``repr`` cut to 80 characters: a peer's payload may hold a million items."""
    text = reprlib.repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
