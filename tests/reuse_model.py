"""An independent reference model of how much of a prompt a hybrid model may reuse (SPEC §3, §4, §5, README "What an
engine can rely on", the config's and ``KVCache``'s docstrings), written from the documentation, not from the
prefix matcher: ``tests/test_reuse_model.py`` drives the real manager and compares every request's reuse with it.

The rules modelled:

- The tree holds committed blocks; a block's page of a layer group may be missing (never stored, or evicted).
  A match walks the request's full blocks through the tree (pages or not), then, with partial reuse, the longest
  common prefix of the rest with a child block: that is the walked length. The reuse is the longest length ``L``
  up to there that every layer group can serve:
  - full attention: a page for every block before ``L``; for the block ``L`` ends inside, a page of any child
    sharing those tokens that holds at least that many of them (one child for every group);
  - a sliding window ``W`` with ``S`` sink blocks: pages for the sinks and for every block from the stale
    range's end at history ``L`` on (SPEC §3's formula);
  - SSM: a snapshot exactly at ``L`` (``L == 0`` needs none).
  ``L`` ends inside a block only in the block where the walk stopped (partial reuse), where a page of a block
  passed (partial reuse, no SSM layers: one a shorter sibling left) stops, or, in a hybrid model
  without partial reuse, at a short block reused whole with its own rows: one saved on request (any depth) or a
  published trailing block holding exactly the request's tokens. ``reuse_match_backoff`` keeps ``L`` that many
  tokens short of what the tree holds along the request (the walk, or such a short block past it); the tree
  holds a block while a page of it or below it is cached, or while an open cache uses it (pages or not).
- Pages stored: a commit's completed blocks in every attention group; the SSM snapshot where a commit ends a
  computed chunk (at ``capacity``) on a block boundary that is on the reuse interval, inside the prompt
  (``snapshot_prefill_chunks``), one of ``snapshot_points``, or anywhere with the last-snapshot flags; with
  partial reuse, inside a block on a partial block of its own at a ``snapshot_at`` position or a prefill chunk's
  end. The trailing partial block: its attention rows, and the SSM state where the commits stopped at a snapshot
  point; published by ``stop_committing`` at once where that holds (without SSM layers: with partial reuse), else
  by ``close``. A snapshot saved on request goes inside a block on a short block (without partial reuse with a
  copy of the rows). Without SSM layers and with partial reuse, a block takes a shorter partial sibling's pages
  (the wider one stays), a partial block goes into a sibling extending it.
- SWA scratch reuse: a window's blocks a chunk leaves behind it (stale at the chunk's end) are never stored; without
  SSM layers ``snapshot_points`` are then the declared ``snapshot_at`` positions (snapped down to block boundaries).
- Which pages eviction removed, and which copies found no room (small quotas only), is not modelled: the test
  reads it from the manager's KV events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

Path = tuple[int, ...]  # a tree block: every token from the root to the block's end


@dataclass(frozen=True)
class Group:
    """A layer group as the documentation describes it: ``kind`` is "full", "window" or "ssm"."""

    kind: str
    window: int = 0
    sink_blocks: int = 0


@dataclass
class ReuseModel:
    tokens_per_block: int
    groups: Sequence[Group]
    partial_reuse: bool
    backoff: int = 0
    interval: int = 0
    last_snapshot: bool = False
    prefill_chunks: bool = True
    scratch: bool = False  # SWA scratch reuse (max_rewind_len 0)
    # Every tree block (full or partial) -> how many of its tokens each layer group's page holds.
    pages: dict[Path, dict[int, int]] = field(default_factory=dict)
    saved: set[Path] = field(default_factory=set)  # short blocks whose SSM states were saved on request
    copies: set[tuple[Path, int]] = field(default_factory=set)  # copies made since ``skipped`` was last asked
    live: list[Path] = field(default_factory=list)  # the full blocks each open cache committed (or reused)

    def skipped(self, stored: set[tuple[Path, int]]) -> None:
        """The copies the manager made no page for (no room: memory shortage is a soft failure) are not there."""
        for path, group in self.copies - stored:
            self.remove(path, group)
        self.copies.clear()

    # ---- what is stored

    @property
    def has_ssm(self) -> bool:
        return any(group.kind == "ssm" for group in self.groups)

    def snapshot_points(self, prompt_length: int, snapshot_at: Sequence[int]) -> tuple[int, ...]:
        """``KVCache.snapshot_points`` (partial reuse off): ``snapshot_at`` snapped down to block boundaries, and
        with the last-snapshot flags the end of the prompt's last full block; empty without SSM layers."""
        tpb = self.tokens_per_block
        if not self.has_ssm:
            # Scratch keeps no page for the blocks a chunk leaves behind a window: a chunk must end at a prefix
            # that later requests should reuse.
            if not (self.scratch and any(group.kind == "window" for group in self.groups)):
                return ()
            declared = {position // tpb * tpb for position in snapshot_at}
            if self.partial_reuse:
                declared.update(snapshot_at)
            return tuple(sorted(point for point in declared if point > 0))
        points = {position // tpb * tpb for position in snapshot_at}
        if self.partial_reuse:  # the positions themselves too: snapshotted on a partial block
            points.update(snapshot_at)
        if self.last_snapshot:
            points.add(prompt_length // tpb * tpb)
        return tuple(sorted(point for point in points if point > 0))

    def takes_snapshot(self, end: int, prompt_length: int, points: Sequence[int]) -> bool:
        """Whether a commit ending a computed chunk at ``end`` (a block boundary) snapshots the SSM states."""
        return (
            (self.interval > 0 and end % self.interval == 0)
            or self.last_snapshot
            or (self.prefill_chunks and end <= prompt_length)
            or end in points
        )

    @property
    def merges_siblings(self) -> bool:
        """Partial reuse without SSM layers: a block and a shorter partial sibling its tokens extend are one."""
        return self.partial_reuse and not self.has_ssm

    def siblings(self, path: Path) -> list[Path]:
        """The other tree blocks under ``path``'s parent."""
        begin = (len(path) - 1) // self.tokens_per_block * self.tokens_per_block
        return [
            key
            for key in self.pages
            if key != path and begin < len(key) <= begin + self.tokens_per_block and key[:begin] == path[:begin]
        ]

    def store(self, path: Path, group: int, covered: int, copy: bool = False) -> None:
        """A page of ``group`` holding the first ``covered`` tokens of block ``path`` joins the tree. With partial
        reuse (no SSM layers) a block extending a shorter partial sibling takes its pages and the sibling leaves
        the tree; a partial block whose sibling extends it goes into that sibling (the wider page stays).
        ``copy``: a new page (an SSM snapshot, a copy of rows), skipped where no tier has room for it."""
        if copy and group not in self.pages.get(path, {}):
            self.copies.add((path, group))
        if self.merges_siblings:
            for sibling in self.siblings(path):
                if len(sibling) > len(path) and sibling[: len(path)] == path:
                    held = self.pages[sibling]
                    held[group] = max(held.get(group, 0), covered)
                    return
        held = self.pages.setdefault(path, {})
        held[group] = max(held.get(group, 0), covered)
        if self.merges_siblings:
            for sibling in self.siblings(path):
                if len(sibling) < len(path) and path[: len(sibling)] == sibling:
                    for other, width in self.pages.pop(sibling).items():
                        held[other] = max(held.get(other, 0), width)

    def whole_pages(self) -> set[tuple[Path, int]]:
        """The pages holding all their block's tokens: those KV events describe."""
        tpb = self.tokens_per_block
        return {
            (path, group)
            for path, held in self.pages.items()
            for group, width in held.items()
            if width == (len(path) - 1) % tpb + 1
        }

    def narrow_pages(self) -> list[tuple[Path, int, int]]:
        """The pages narrower than their block (a shorter sibling's, taken over): ``(path, group, tokens held)``.
        They send no KV event, so whoever drives the model asks the manager whether they are still there."""
        tpb = self.tokens_per_block
        return [
            (path, group, width)
            for path, held in self.pages.items()
            for group, width in held.items()
            if width < (len(path) - 1) % tpb + 1
        ]

    def commit_chunk(self, tokens: Sequence[int], begin: int, end: int, prompt_length: int, points: Sequence[int]) -> None:
        """A commit of ``tokens[begin:end]`` that ends the computed chunk (``end`` is the capacity)."""
        tpb = self.tokens_per_block
        for block_end in range((begin // tpb + 1) * tpb, end + 1, tpb):
            for index, group in enumerate(self.groups):
                if group.kind != "ssm" and block_end // tpb - 1 not in self.scratch_blocks(group, begin, end):
                    self.store(tuple(tokens[:block_end]), index, tpb)
        if end % tpb == 0 and end > 0 and self.takes_snapshot(end, prompt_length, points):
            for index, group in enumerate(self.groups):
                if group.kind == "ssm":
                    self.store(tuple(tokens[:end]), index, tpb, copy=True)
        elif end % tpb and self.has_ssm and self.partial_reuse and self.mid_block_snapshot(end, prompt_length, points):
            for index, group in enumerate(self.groups):
                if group.kind == "ssm":
                    self.store(tuple(tokens[:end]), index, end % tpb, copy=True)

    def scratch_blocks(self, group: Group, begin: int, end: int) -> range:
        """The blocks of a chunk ``[begin, end)`` held only in scratch slots: stale at ``end`` (SPEC §3)."""
        if not self.scratch or group.kind != "window":
            return range(0)
        tpb = self.tokens_per_block
        blocks = -(-end // tpb)
        start = min(blocks, group.sink_blocks)
        return range(max(start, -(-begin // tpb)), max(start, (end + 1 - group.window) // tpb))

    def mid_block_snapshot(self, end: int, prompt_length: int, points: Sequence[int]) -> bool:
        """Hybrid with partial reuse: whether a commit ending a computed chunk at ``end``, inside a block, snapshots
        the SSM states on a partial block: at a ``snapshot_at`` position or a prefill chunk's end."""
        return end in points or (self.prefill_chunks and end <= prompt_length)

    def tail_snapshot(self, committed: int, prompt_length: int) -> bool:
        """Whether the SSM states at a trailing partial block's end go with it: where the commits stopped at a
        snapshot point (a prefill chunk's end inside the prompt, or any commit with the last-snapshot flags)."""
        return self.last_snapshot or (self.prefill_chunks and committed <= prompt_length)

    def tail_snapshot_at(self, committed: int, prompt_length: int, points: Sequence[int]) -> bool:
        return self.tail_snapshot(committed, prompt_length) or (self.partial_reuse and committed in points)

    def publishes_at_stop(self, committed: int, prompt_length: int, points: Sequence[int]) -> bool:
        """Whether ``stop_committing`` publishes the trailing partial block at once (else ``close`` does)."""
        if committed % self.tokens_per_block == 0:
            return False
        return self.tail_snapshot_at(committed, prompt_length, points) if self.has_ssm else self.partial_reuse

    def publish_tail(
        self, tokens: Sequence[int], committed: int, prompt_length: int, points: Sequence[int], copy: bool = False
    ) -> None:
        """The trailing partial block joins the tree: at ``close`` the cache's own pages (and live SSM state), at
        ``stop_committing`` in a hybrid model copies of them (the cache may go on writing)."""
        tpb = self.tokens_per_block
        if committed % tpb == 0:
            return
        path = tuple(tokens[:committed])
        for index, group in enumerate(self.groups):
            if group.kind != "ssm" or self.tail_snapshot_at(committed, prompt_length, points):
                self.store(path, index, committed % tpb, copy=copy and self.has_ssm)

    def save_snapshot(self, tokens: Sequence[int], committed: int) -> None:
        """``stop_committing(save_last_ssm_snapshot=True)`` (or ``commit(save_ssm_snapshot=True)``) where the
        commits reach ``capacity``: the SSM states at ``committed``, inside a block on a short block of their own;
        without partial reuse (which would copy the rows from a sibling) with a copy of the attention rows too."""
        tpb = self.tokens_per_block
        path = tuple(tokens[:committed])
        if committed % tpb:
            self.saved.add(path)
        for index, group in enumerate(self.groups):
            if group.kind == "ssm" or (committed % tpb and not self.partial_reuse):
                self.store(path, index, (committed - 1) % tpb + 1, copy=True)

    def remove(self, path: Path, group: int) -> None:
        held = self.pages.get(path)
        if held is not None:
            held.pop(group, None)
            if not held:
                del self.pages[path]
                self.saved.discard(path)

    # ---- what a request reuses

    def in_tree(self, path: Path) -> bool:
        """A block stays in the tree while it or a block below it has a page, or a live cache committed it."""
        return any(key[: len(path)] == path for key in self.pages) or any(
            len(live) >= len(path) and live[: len(path)] == path for live in self.live
        )

    def walked(self, tokens: Sequence[int]) -> int:
        tpb = self.tokens_per_block
        length = 0
        while length + tpb <= len(tokens) and self.in_tree(tuple(tokens[: length + tpb])):
            length += tpb
        if self.partial_reuse:
            rest = tuple(tokens[length:])
            best = 0
            # The children: blocks with a page or one below them, and blocks an open cache uses.
            children = {key[: length + tpb] for key in [*self.pages, *self.live] if len(key) > length}
            for key in children:
                if len(key) > length and key[:length] == tuple(tokens[:length]) and len(key) <= length + tpb:
                    common = 0
                    for mine, theirs in zip(key[length:], rest):
                        if mine != theirs:
                            break
                        common += 1
                    best = max(best, common)
            length += best
        return length

    def has_rows(self, tokens: Sequence[int], group: int, block: int, end: int) -> bool:
        """A page of ``group`` holding block ``block``'s tokens up to position ``end`` of ``tokens``."""
        tpb = self.tokens_per_block
        begin = block * tpb
        prefix = tuple(tokens[:end])
        for key, held in self.pages.items():
            if begin < len(key) <= begin + tpb and key[:end] == prefix and held.get(group, 0) >= end - begin:
                return True
        return False

    def held_blocks(self, group: Group, length: int) -> list[int]:
        """The blocks whose pages of an attention ``group`` a cache reusing ``length`` tokens holds: every block, or
        a window's sinks and the blocks from its stale range's end (SPEC §3)."""
        tpb = self.tokens_per_block
        blocks = -(-length // tpb)
        if group.kind != "window":
            return list(range(blocks))
        start = min(blocks, group.sink_blocks)
        return list(range(start)) + list(range(max(start, (length + 1 - group.window) // tpb), blocks))

    def serves(self, tokens: Sequence[int], length: int, own: Path | None) -> bool:
        """Whether every layer group serves ``length`` tokens. Inside a block, its rows come from one block holding
        them in every attention group: ``own`` where given (a short block reused whole), else any block sharing
        those tokens."""
        tpb = self.tokens_per_block
        blocks = -(-length // tpb)
        inside = length % tpb > 0
        attention = [index for index, group in enumerate(self.groups) if group.kind != "ssm"]
        for index, group in enumerate(self.groups):
            if group.kind == "ssm":
                if length and index not in self.pages.get(tuple(tokens[:length]), {}):
                    return False
                continue
            for block in self.held_blocks(group, length):
                if inside and block == blocks - 1:
                    continue  # below, for every group at once
                if not self.has_rows(tokens, index, block, (block + 1) * tpb):
                    return False
        if not inside:
            return True
        begin = (blocks - 1) * tpb
        sources = [own] if own is not None else self.siblings(tuple(tokens[:length])) + [tuple(tokens[:length])]
        return any(
            source[:length] == tuple(tokens[:length])
            and all(self.pages.get(source, {}).get(index, 0) >= length - begin for index in attention)
            for source in sources
        )

    def whole_partials(self, tokens: Sequence[int]) -> list[Path]:
        """Hybrid models without partial reuse: the short blocks reused whole, with their own rows: one saved on
        request (``save_ssm_snapshot``, ``save_last_ssm_snapshot``) whose tokens start the request's rest at any
        depth of the walk, or a published trailing block holding exactly the request's tokens."""
        if not self.has_ssm or self.partial_reuse:
            return []
        tpb = self.tokens_per_block
        found = []
        for key in self.pages:
            if len(key) % tpb and len(key) <= len(tokens) and tuple(tokens[: len(key)]) == key:
                if key in self.saved or len(key) == len(tokens):
                    found.append(key)
        return found

    def reuse(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` a new cache reuses: ``reuse_match_backoff`` tokens short of what
        the tree holds along them (the walk, or a short block reused whole past it), else the longest servable
        prefix of the tokens up to there."""
        longest = self.longest(tokens)
        limit = max(self.walked(tokens), longest) - self.backoff
        return longest if longest <= limit else self.longest(tokens[: max(0, limit)])

    def longest(self, tokens: Sequence[int]) -> int:
        tpb = self.tokens_per_block
        walked = self.walked(tokens)
        # Inside a block where the walk stopped; stepping back (partial reuse, no SSM layers) inside any block
        # passed, its rows from a block sharing them (itself where a narrower page stops, or a sibling: it may
        # have lost its pages while an open cache keeps it); with SSM layers whole blocks.
        candidates: list[tuple[int, Path | None]] = [
            (length, None)
            for length in range(walked, -1, -1)
            if length % tpb == 0
            or self.merges_siblings
            or (self.partial_reuse and length // tpb == walked // tpb)
        ]
        candidates += [(len(key), key) for key in self.whole_partials(tokens)]
        candidates.sort(key=lambda candidate: candidate[0], reverse=True)
        for length, own in candidates:
            if self.serves(tokens, length, own):
                return length
        return 0
