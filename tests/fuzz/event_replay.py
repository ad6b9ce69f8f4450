"""The KV event stream replayed as a subscriber keeps it, checked against what the manager can serve.

A router knows the cache only through the events: after every operation (faults included: a failed disk move, a
remote fill that never landed) the replayed set of (layer group, block hash) -> tier must equal the tree's pages
that hold their whole block and kept their bytes, each on the tier it is on."""

from __future__ import annotations

from typing import Iterable

from kv_cache_manager_v2 import KVCacheManager, KVEvent
from kv_cache_manager_v2._introspection import internals_of

Entry = tuple[int, bytes]  # (layer group, block hash)


class EventReplay:
    def __init__(self) -> None:
        self.alive: dict[Entry, int] = {}  # -> the tier (cache level) the last event put the page on

    def follow(self, events: Iterable[KVEvent]) -> None:
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

    def check(self, manager: KVCacheManager) -> None:
        """Drain the manager's events, then compare the replay with its tree."""
        self.follow(manager.get_latest_events())
        servable: dict[Entry, int] = {}
        stack = internals_of(manager).tree.roots()
        while stack:
            block = stack.pop()
            stack.extend(block.children())
            for page in block.pages:
                if page is not None and page.covers_its_block and not page.lost and not block.is_root:
                    servable[(int(page.life_cycle), block.key)] = int(page.level)
        missing = {entry: level for entry, level in servable.items() if self.alive.get(entry) != level}
        extra = {entry: level for entry, level in self.alive.items() if servable.get(entry) != level}
        assert not missing and not extra, (
            f"events disagree with the tree on {len(missing)} servable pages (not announced, or on another tier: "
            f"{sorted(missing.items())[:3]}) and {len(extra)} announced ones (not servable, or on another tier: "
            f"{sorted(extra.items())[:3]}); entries are ((layer group, block hash), tier)"
        )
