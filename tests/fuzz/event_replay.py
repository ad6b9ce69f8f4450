"""The KV event stream replayed as a subscriber keeps it, checked against what the manager can serve.

A router knows the cache only through the events: after every operation (faults included: a failed disk move, a
remote fill that never landed) the replayed set of (layer group, block hash) -> tier must equal the tree's pages
that hold their whole block and kept their bytes, each on the tier it is on. The same stream as the wire carries it
(``kv_events.EventTranslator``: vLLM's events, a ``medium`` per tier, full blocks only) is replayed too, strictly (a
block stored twice in a medium, or removed from one it is not in, fails), and must hold those pages of full blocks,
each in its tier's ``medium``. Every instance of a world is replayed: twins sharing its store too."""

from __future__ import annotations

import os
from typing import Iterable, Mapping, TypeVar

from kv_cache_manager_v2 import CacheTier, KVCacheManager, KVEvent
from kv_cache_manager_v2._introspection import internals_of

Entry = tuple[int, bytes]  # (layer group, block hash)
WireEntry = tuple[int, int]  # (group_idx, the wire's block hash)
K = TypeVar("K", Entry, WireEntry)
V = TypeVar("V", int, str)
# The wire's medium of each tier, as the README says (not the adapter's table: a wrong entry there must fail).
MEDIUMS = {CacheTier.GPU_MEM: "GPU", CacheTier.HOST_MEM: "CPU", CacheTier.DISK: "STORAGE"}


class EventReplay:
    def __init__(self, manager: KVCacheManager) -> None:
        self.alive: dict[Entry, int] = {}  # -> the tier (cache level) the last event put the page on
        self.wire = WireReplay.of(manager)

    def follow(self, events: Iterable[KVEvent]) -> None:
        events = list(events)
        for event in events:
            entry = (event.layer_group_id, event.block_hash)
            if event.kind == "stored":
                assert entry not in self.alive, f"stored twice without a removal between: {event}"
                self.alive[entry] = event.level
            else:
                assert entry in self.alive, f"{event.kind} for a page never stored (or already removed): {event}"
                if event.kind == "removed":
                    del self.alive[entry]
                else:
                    self.alive[entry] = event.level
        if self.wire is not None:
            self.wire.follow(events)

    def check(self, manager: KVCacheManager) -> None:
        """Drain the manager's events, then compare the replay with its tree."""
        self.follow(manager.get_latest_events())
        servable: dict[Entry, int] = {}
        full: set[Entry] = set()
        stack = internals_of(manager).tree.roots()
        while stack:
            block = stack.pop()
            stack.extend(block.children())
            for page in block.pages:
                if page is not None and page.covers_its_block and not page.lost and not block.is_root:
                    servable[(int(page.life_cycle), block.key)] = int(page.level)
                    if len(block.tokens) == manager.tokens_per_block:
                        full.add((int(page.life_cycle), block.key))
        compare(servable, self.alive, "events", "tier", "(layer group, block hash)")
        if self.wire is not None:
            self.wire.check({entry: level for entry, level in servable.items() if entry in full})


class WireReplay:
    """The translated (wire) stream: (group, wire hash) -> the medium its last ``BlockStored`` named."""

    def __init__(self, manager: KVCacheManager) -> None:
        from kv_cache_manager_v2.kv_events import EventTranslator

        self.translator = EventTranslator.for_manager(manager)
        self.mediums = [MEDIUMS[tier.tier] for tier in manager.config.local_tiers]
        self.held: dict[WireEntry, str] = {}

    @classmethod
    def of(cls, manager: KVCacheManager) -> WireReplay | None:
        """None without the ``events`` extra (the wire's msgspec), unless ``CI`` is set: it installs it."""
        try:
            return cls(manager)
        except ImportError:
            if os.environ.get("CI"):
                raise
            return None

    def follow(self, events: list[KVEvent]) -> None:
        from kv_cache_manager_v2.kv_events import BlockRemoved, BlockStored

        for wire in self.translator.translate(events):
            assert isinstance(wire, (BlockStored, BlockRemoved)), f"no event may be lost in the fuzzer: {wire}"
            group = 0 if wire.group_idx is None else wire.group_idx
            for block_hash in wire.block_hashes:
                assert isinstance(block_hash, int), wire  # ours are ints (``wire_hash``)
                entry = (group, block_hash)
                held = self.held.get(entry)
                if isinstance(wire, BlockStored):
                    assert held is None and wire.medium is not None, f"wire: {entry} stored in {wire.medium}, in {held}"
                    self.held[entry] = wire.medium
                else:
                    assert held == wire.medium, f"wire: {entry} removed from {wire.medium}, in {held}"
                    del self.held[entry]

    def check(self, servable: dict[Entry, int]) -> None:
        """The wire must hold exactly ``servable``'s pages (of full blocks), each in its tier's medium."""
        from kv_cache_manager_v2.kv_events import wire_hash

        expected = {(group, wire_hash(key)): self.mediums[level] for (group, key), level in servable.items()}
        compare(expected, self.held, "the wire", "medium", "(group_idx, wire block hash)")


def compare(servable: Mapping[K, V], announced: Mapping[K, V], stream: str, where: str, entries: str) -> None:
    """``announced`` (a replayed stream) must equal ``servable`` (the tree): each entry, and where it is."""
    missing = {entry: place for entry, place in servable.items() if announced.get(entry) != place}
    extra = {entry: place for entry, place in announced.items() if servable.get(entry) != place}
    assert not missing and not extra, (
        f"{stream} disagree(s) with the tree on {len(missing)} servable pages (not announced, or on another {where}: "
        f"{sorted(missing.items())[:3]}) and {len(extra)} announced ones (not servable, or on another {where}: "
        f"{sorted(extra.items())[:3]}); entries are ({entries}, {where})"
    )
