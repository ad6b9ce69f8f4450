"""Iteration statistics per layer group and KV events for KV-aware routers.

Both are fed from the page store and the tree as things happen (in plain values: this layer sits below pages). Events are off by default and then cost one
attribute test per hook; the queue is bounded (the oldest events are dropped first). Another thread may drain
the events, or take the statistics, while the scheduler thread records them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Final, Literal, final

from .._base.hashing import ReuseScope, Token
from .._base.types import Sealed

# What happened to a block's page; a Literal so an event consumer's ``match`` / ``==`` on ``KVEvent.kind`` is
# checked. Exported as ``KVEventKind`` with the constants ``KV_EVENT_STORED`` / ``_REMOVED`` / ``_UPDATED``.
KVEventKind = Literal["stored", "removed", "updated"]
STORED: Final = "stored"
REMOVED: Final = "removed"
UPDATED: Final = "updated"


@final
@dataclass
class IterationStats(Sealed):
    """What one layer group did since the last ``get_iteration_stats`` (a page is one block of that group)."""

    layer_group_id: int
    allocated_pages: int = 0
    reused_full_blocks: int = 0
    reused_partial_blocks: int = 0
    missed_blocks: int = 0
    onboarded_pages: int = 0
    onboarded_bytes: int = 0
    offloaded_pages: int = 0
    offloaded_bytes: int = 0
    copied_pages: int = 0
    dropped_pages: int = 0
    generation_pages: int = 0  # allocated by decode steps (a resize to one token of input)
    # a readmission's lookup (``create_kv_cache(preempted=True)``), apart as vLLM's ``preempted_hits`` / queries
    preempted_reused_blocks: int = 0
    preempted_missed_blocks: int = 0


def stats_growth(later: IterationStats, earlier: IterationStats) -> IterationStats:
    """``later`` minus ``earlier``, field by field (each field of ``later`` is read once)."""
    return IterationStats(
        later.layer_group_id,
        later.allocated_pages - earlier.allocated_pages,
        later.reused_full_blocks - earlier.reused_full_blocks,
        later.reused_partial_blocks - earlier.reused_partial_blocks,
        later.missed_blocks - earlier.missed_blocks,
        later.onboarded_pages - earlier.onboarded_pages,
        later.onboarded_bytes - earlier.onboarded_bytes,
        later.offloaded_pages - earlier.offloaded_pages,
        later.offloaded_bytes - earlier.offloaded_bytes,
        later.copied_pages - earlier.copied_pages,
        later.dropped_pages - earlier.dropped_pages,
        later.generation_pages - earlier.generation_pages,
        later.preempted_reused_blocks - earlier.preempted_reused_blocks,
        later.preempted_missed_blocks - earlier.preempted_missed_blocks,
    )


@final
@dataclass(frozen=True)
class KVEvent(Sealed):
    """A change a KV-aware router cares about: a block's page of one layer group was ``"stored"``, ``"removed"`` or
    ``"updated"`` (moved to another tier: ``level`` is the new one; the event manager's ``KVCacheUpdatedData``, a
    removal plus a store on the vLLM wire). ``tokens`` and ``parent_hash`` come with stored events."""

    event_id: int
    kind: KVEventKind
    layer_group_id: int
    block_hash: bytes
    parent_hash: bytes | None
    tokens: tuple[Token, ...]
    scope: ReuseScope | None
    level: int
    priority: int

    def __reduce__(
        self,
    ) -> tuple[
        type[KVEvent], tuple[int, KVEventKind, int, bytes, bytes | None, tuple[Token, ...], ReuseScope | None, int, int]
    ]:
        return (
            KVEvent,
            (
                self.event_id,
                self.kind,
                self.layer_group_id,
                self.block_hash,
                self.parent_hash,
                self.tokens,
                self.scope,
                self.level,
                self.priority,
            ),
        )


class EventLog:
    """The bounded event queue ``get_latest_events`` drains (only when ``enabled``: nobody else drains it);
    ``sink`` (when set) also gets every event with the level an updated page left (-1 for other kinds): the
    ``KVCacheEventManager`` bridge."""

    def __init__(self, enabled: bool, max_events: int, sink: Callable[[KVEvent, int], None] | None = None) -> None:
        self.enabled: bool = enabled or sink is not None
        self._queued = enabled
        self._events: deque[KVEvent] = deque(maxlen=max(1, max_events))
        self._next_id = 0
        self._sink = sink

    def record(
        self,
        kind: KVEventKind,
        layer_group_id: int,
        block_hash: bytes,
        parent_hash: bytes | None,
        tokens: tuple[Token, ...],
        scope: ReuseScope | None,
        level: int,
        priority: int,
        previous_level: int = -1,
    ) -> None:
        """Record an event (callers test ``enabled`` first); plain values, so this layer knows nothing of pages."""
        event = KVEvent(self._next_id, kind, layer_group_id, block_hash, parent_hash, tokens, scope, level, priority)
        if self._queued:
            self._events.append(event)
        self._next_id += 1
        if self._sink is not None:
            self._sink(event, previous_level)

    def drain(self) -> list[KVEvent]:
        """The recorded events, oldest first, removing them; safe beside a thread that records.

        Each event is popped on its own (``deque.popleft`` is atomic): an event recorded meanwhile is either
        popped here or left for the next drain, never lost or returned twice. (Copying then clearing loses what
        is recorded between the two; swapping the deque loses an append that already holds the old one.)
        """
        events = self._events
        return [events.popleft() for _ in range(len(events))]
