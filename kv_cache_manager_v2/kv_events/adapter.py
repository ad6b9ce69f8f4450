"""The one place that knows both sides: our manager's KV events and layer groups in, vLLM wire events out.

Our events (``get_latest_events``) are per page: a block's page of one layer group was stored, removed, or updated
(moved to another tier). On the wire (vLLM's names, which we may not change):

- block hashes are 64-bit signed ints, the first 8 bytes (big-endian) of our chained SHA-256 block key (the same
  key for every layer group of a block; stable as long as the key scheme of ``_hashing`` is);
- a block's first parent is None on the wire (ours is the scope's root key), so scopes are told apart by
  ``lora_id`` and, for a salted scope, the salt in the first block's ``extra_keys``;
- ``medium`` is ``GPU``/``CPU``/``STORAGE`` from the page's tier; an update (a move between tiers) is a ``BlockRemoved`` from
  the old medium and a ``BlockStored`` in the new one (the translator remembers each published page's tier and
  tokens for that);
- every event carries ``group_idx``; stored ones ``kv_cache_spec_kind`` (``full_attention``, ``sliding_window``,
  ``mamba``) and the window; ``full_attention_only`` leaves the other groups out for routers without groups;
- only full blocks are published (as vLLM does); a partial last block and its later events are left out;
- a multimodal token (a digest) is ``multimodal_token_id`` in ``token_ids`` and its hex digest in the block's
  ``extra_keys`` entry (one entry per block: None when a block has no extra key);
- a lost event (the bounded log overflowed: an ``event_id`` skipped) resets the subscribers with
  ``AllBlocksCleared``; pages published before it are then forgotten until stored again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Mapping, Sequence, SupportsIndex, final

from .._observe.events import REMOVED, STORED, UPDATED, KVEvent
from .._base.hashing import ReuseScope, Token, check_tokens, root_key
from .._manager.manager import KVCacheManager
from .._base.types import CacheTier, FrozenValue, Sealed
from .._base.validation import as_bool, as_int, as_positive_int
from ..config import AttentionLayerConfig, SsmLayerConfig
from .wire import (
    FULL_ATTENTION,
    MAMBA,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExtraKey,
    WireEvent,
)

HASH_BYTES: Final = 8
MEDIUMS: Final = {CacheTier.GPU_MEM: MEDIUM_GPU, CacheTier.HOST_MEM: MEDIUM_CPU, CacheTier.DISK: MEDIUM_STORAGE}


@final
@dataclass(frozen=True)
class LayerGroupSpec(FrozenValue):
    """What a router learns about a layer group: its kind and (sliding window) its window in tokens."""

    group_idx: int
    kind: str
    sliding_window: int | None


@final
@dataclass(frozen=True)
class WireBlock(FrozenValue):
    """A full block as the wire shows it: token ids and its ``extra_keys`` entry."""

    token_ids: tuple[int, ...]
    extra_key: ExtraKey


def describe_layer_groups(manager: KVCacheManager) -> list[LayerGroupSpec]:
    """Each layer group's kind and window, from the manager's public layer grouping and layer configs."""
    layers = {layer.layer_id: layer for layer in manager.config.layers}
    specs: list[LayerGroupSpec] = []
    for group, layer_ids in enumerate(manager.layer_grouping):
        layer = layers[layer_ids[0]]
        if isinstance(layer, SsmLayerConfig):
            specs.append(LayerGroupSpec(group, MAMBA, None))
        elif isinstance(layer, AttentionLayerConfig) and layer.sliding_window_size is not None:
            specs.append(LayerGroupSpec(group, SLIDING_WINDOW, layer.sliding_window_size))
        else:
            specs.append(LayerGroupSpec(group, FULL_ATTENTION, None))
    return specs


def tier_mediums(manager: KVCacheManager) -> list[str]:
    """The wire medium of each cache level."""
    return [MEDIUMS[tier.tier] for tier in manager.config.local_tiers]


def wire_hash(key: bytes) -> int:
    """A block key as the 64-bit signed int the wire carries."""
    return int.from_bytes(key[:HASH_BYTES], "big", signed=True)


def wire_block(
    tokens: Sequence[Token], first_of_scope: ReuseScope | None, first: bool, multimodal_token_id: int
) -> WireBlock:
    """A block's token ids and extra key; the first block of a salted scope carries the salt."""
    ids: list[int] = []
    extra: list[object] = []
    for token in tokens:
        if isinstance(token, bytes):
            ids.append(multimodal_token_id)
            extra.append(token.hex())
        else:
            ids.append(token)
    if first and first_of_scope is not None and first_of_scope.salt is not None:
        extra.append(first_of_scope.salt)
    return WireBlock(tuple(ids), tuple(extra) if extra else None)


def wire_blocks(
    manager: KVCacheManager, reuse_scope: ReuseScope | None, input_tokens: Sequence[Token]
) -> list[WireBlock]:
    """The full blocks of a prompt as the wire would show them (what a router looks up in its index)."""
    tokens = check_tokens(input_tokens, "input_tokens")
    tpb = manager.tokens_per_block
    token_id = manager.config.vocab_size or 0
    return [
        wire_block(tokens[start : start + tpb], reuse_scope, start == 0, token_id)
        for start in range(0, len(tokens) - tpb + 1, tpb)
    ]


class _Published:
    """What the translator remembers of a published page: enough to announce it again in another medium."""

    def __init__(self, level: int, parent: int | None, block: WireBlock, lora_id: int | None) -> None:
        self.level = level
        self.parent = parent
        self.block = block
        self.lora_id = lora_id


@final
class EventTranslator(Sealed):
    """Turns the manager's events into wire events, in order; one per manager, fed every event from the start."""

    def __init__(
        self,
        groups: Sequence[LayerGroupSpec],
        mediums: Sequence[str],
        tokens_per_block: SupportsIndex,
        full_attention_only: bool = False,
        lora_names: Mapping[int, str] | None = None,
        multimodal_token_id: SupportsIndex = 0,
    ) -> None:
        self._tokens_per_block = as_positive_int(tokens_per_block, "tokens_per_block")
        self._multimodal_token_id = as_int(multimodal_token_id, "multimodal_token_id")
        only_full = as_bool(full_attention_only, "full_attention_only")
        self._groups: list[LayerGroupSpec] = list(groups)
        self._mediums: list[str] = list(mediums)
        self._published_groups: list[bool] = [g.kind == FULL_ATTENTION or not only_full for g in self._groups]
        self._lora_names: dict[int, str] = dict(lora_names or {})
        self._published: dict[tuple[int, bytes], _Published] = {}
        self._next_event_id = 0
        self._lost_events: int = 0

    @classmethod
    def for_manager(
        cls, manager: KVCacheManager, full_attention_only: bool = False, lora_names: Mapping[int, str] | None = None
    ) -> EventTranslator:
        """A translator for ``manager``'s layer groups, tiers and block size (what ``KVEventsPublisher`` builds)."""
        return cls(
            describe_layer_groups(manager),
            tier_mediums(manager),
            manager.tokens_per_block,
            full_attention_only,
            lora_names,
            manager.config.vocab_size or 0,
        )

    @property
    def lost_events(self) -> int:
        """Events missing between ``translate`` calls (each gap also sends ``AllBlocksCleared``)."""
        return self._lost_events

    @property
    def num_published_pages(self) -> int:
        """Pages announced and not removed since (what subscribers believe is cached)."""
        return len(self._published)

    def translate(self, events: Sequence[KVEvent]) -> list[WireEvent]:
        """The wire events for the manager's next ``events``: full blocks only, a tier move as a removal plus a
        store, an ``AllBlocksCleared`` first where event ids skip (lost events: what was published is unknown)."""
        out: list[WireEvent] = []
        for event in events:
            if event.event_id != self._next_event_id:
                self._lost_events += event.event_id - self._next_event_id
                self._published.clear()
                out.append(AllBlocksCleared())
            self._next_event_id = event.event_id + 1
            group = event.layer_group_id
            if not self._published_groups[group]:
                continue
            key = (group, event.block_hash)
            if event.kind == STORED:
                if len(event.tokens) != self._tokens_per_block:
                    continue
                parent = event.parent_hash
                first = parent is None or parent == root_key(event.scope)
                lora_id = None if event.scope is None else event.scope.lora_id
                page = _Published(
                    event.level,
                    None if first or parent is None else wire_hash(parent),
                    wire_block(event.tokens, event.scope, first, self._multimodal_token_id),
                    lora_id,
                )
                self._published[key] = page
                out.append(self._stored(group, wire_hash(event.block_hash), page))
            elif event.kind == REMOVED:
                removed = self._published.pop(key, None)
                if removed is not None:
                    out.append(BlockRemoved((wire_hash(event.block_hash),), self._mediums[removed.level], group))
            elif event.kind == UPDATED:
                updated = self._published.get(key)
                if updated is not None and self._mediums[updated.level] != self._mediums[event.level]:
                    block_hash = wire_hash(event.block_hash)
                    out.append(BlockRemoved((block_hash,), self._mediums[updated.level], group))
                    updated.level = event.level
                    out.append(self._stored(group, block_hash, updated))
        return out

    def forget_all(self) -> None:
        """Subscribers were told ``AllBlocksCleared``: nothing is published any more."""
        self._published.clear()

    def _stored(self, group: int, block_hash: int, page: _Published) -> BlockStored:
        spec = self._groups[group]
        return BlockStored(
            (block_hash,),
            page.parent,
            page.block.token_ids,
            self._tokens_per_block,
            page.lora_id,
            self._mediums[page.level],
            None if page.lora_id is None else self._lora_names.get(page.lora_id),
            (page.block.extra_key,),
            group,
            spec.kind,
            spec.sliding_window,
        )
