"""The state of ``tests/eviction_model.py``'s model and what can be read of it: the pages of each tier, the radix
tree's blocks in their order, and the match a new request would get (the rules are in that module's docstring)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

Path = tuple[int, ...]  # a committed block: every token from the root to the block's end
Key = tuple[int, Path]  # (layer group, block)
Entry = tuple[int, int]  # (layer group, block ordinal) in one cache
PARTIAL_INDEX_MIN_CHILDREN = 8  # children a block has when partial matching starts finding them by first token


@dataclass
class ModelPage:
    life_cycle: int
    ordinal: int
    level: int
    priority: int
    stamp: int = -1
    path: Path | None = None  # the tree block it is the page of, None while private
    tokens: int | None = None  # how many of its block's tokens it holds when fewer than all (no KV event says so)
    users: set[int] = field(default_factory=set)
    copy_sources_for: set[int] = field(default_factory=set)  # caches that will copy its first rows (held, unlocked)


@dataclass
class ModelCache:
    tokens: list[int]
    priority: Callable[[int, int], int]  # (block ordinal, layer group) -> priority
    pages: dict[Entry, ModelPage]
    committed_blocks: int
    history: int
    active: bool = False
    copy_sources: dict[int, ModelPage] = field(default_factory=dict)  # per layer group: a partially reused block
    copied_from: Path | None = None  # that block
    capacity: int = 0
    prompt_length: int = 0  # the tokens it was created with
    ssm_source: ModelPage | None = None  # the snapshot a match ends on, until the first resume copies it


def filing_order(pages: Iterable[ModelPage]) -> list[ModelPage]:
    """Pages filed together: last block first, every layer group's page of a block together (the last layer group
    first), so the deepest block is evicted first in every layer group."""
    return sorted(pages, key=lambda page: (-page.ordinal, -page.life_cycle))


class EvictionTree:
    """The model's pages, tree and caches, and the match a request would get now (level 0 is the GPU)."""

    def __init__(
        self,
        slots: list[list[int]],
        tokens_per_block: int,
        windows: list[tuple[int, int] | None],
        pool_group_of: list[int],
        partial_reuse: bool = False,
        ssm: int | None = None,
        snapshot_interval: int = 0,
        snapshot_every_block: bool = False,
    ) -> None:
        self.slots = slots  # per tier, per pool group
        self.tpb = tokens_per_block
        self.windows = windows  # per layer group: (window, sink tokens), None for full attention
        self.pool_group_of = pool_group_of
        self.partial_reuse = partial_reuse
        self.ssm = ssm  # the SSM layer group, if any
        self.snapshot_interval = snapshot_interval
        self.snapshot_every_block = snapshot_every_block  # ``mamba_save_last_snapshot``
        self.attention = [lc for lc in range(len(windows)) if lc != ssm]
        self.tree: dict[Key, ModelPage] = {}
        self.caches: dict[int, ModelCache] = {}
        self.private: list[ModelPage] = []
        self._clock = itertools.count()
        self.moves = [0] * len(slots)  # pages moved into each tier by eviction
        self.drops = 0  # cached pages dropped by eviction
        self.refusals = 0  # resume / resize calls refused for room
        self.partial_matches = 0  # caches created reusing part of a block
        self.snapshot_matches = 0  # caches created starting from an SSM snapshot
        self._waiting: list[ModelPage] = []  # a resuming cache's pages still to onboard, in onboarding order
        # Per parent block, its children in the tree's order: the first place (None while empty, the next child to
        # join takes it), then the others in the order they joined.
        self._children: dict[Path, list[Path | None]] = {}
        self._by_arrival: set[Path] = set()  # parents whose children are in the order they joined (indexed)

    # -- what is observed ---------------------------------------------------------------------------------------
    def levels(self) -> dict[Key, int]:
        """Each tree block's page of each layer group that has one holding the whole block, and its tier."""
        return {key: page.level for key, page in self.tree.items() if page.tokens is None}

    def free(self, level: int, pool_group: int) -> int:
        used = sum(1 for page in self._pages() if page.level == level and self._group(page) == pool_group)
        return self.slots[level][pool_group] - used

    def match(self, tokens: list[int]) -> tuple[int, dict[int, ModelPage]]:
        """Tokens reusable now and, when the match ends inside a block (partial reuse), the block's page each layer
        group copies them from. Along the blocks the tree holds (pages or not), longest first: with partial reuse,
        inside the next block, where a child of the last one sharing the start of the rest serves (``_best_inside``);
        then the longest run of whole blocks every layer group can serve, or with partial reuse, inside the block
        stepped back to (rows from the block itself where a page of it holding fewer tokens ends, or from a
        sibling: the block may have lost its pages while a live cache keeps it in the tree)."""
        walked = self._walk(tokens)
        tpb = self.tpb
        if self.partial_reuse and tokens[walked * tpb : (walked + 1) * tpb]:
            found = self._best_inside(tokens, walked, True)
            if found is not None:
                return found
        for kept in range(walked, -1, -1):
            if self.partial_reuse and kept < walked:
                found = self._best_inside(tokens, kept, False)
                if found is not None:
                    return found
            if all(self._whole(lc, self._path(tokens, o)) for lc, o in self._needed(kept * tpb, kept)) and (
                self._snapshot(tokens, kept) is not None or kept == 0 or self.ssm is None
            ):
                return kept * tpb, {}
        return 0, {}

    def _best_inside(self, tokens: list[int], kept: int, at_walk: bool) -> tuple[int, dict[int, ModelPage]] | None:
        """The longest match ending inside block ``kept`` that some child sharing a start with the request's
        tokens there serves in every layer group (not necessarily the child sharing the most: README "How much a
        request reuses"), the first in ``_children_sharing``'s order on a tie; where the walk stopped
        (``at_walk``) it may end where the child's shared tokens end, stepping back only short of a whole block
        (``kept + 1`` whole blocks were refused already)."""
        best: tuple[int, dict[int, ModelPage]] | None = None
        for shared, path in self._children_sharing(tokens, kept):
            found = self._ending_inside(tokens, kept, path, shared, at_walk or shared < self.tpb)
            if found is not None and (best is None or found[0] > best[0]):
                best = found
        return best

    def _children_sharing(self, tokens: list[int], kept: int) -> list[tuple[int, Path]]:
        """The tree's blocks with pages under ``tokens``' first ``kept`` blocks that share a start with its next
        block, and how many tokens each shares: longest first, in the tree's order on a tie (several turns after one
        system prompt share a chat template's turn marker; README "How much a request reuses")."""
        tpb = self.tpb
        prefix, rest = tuple(tokens[: kept * tpb]), tuple(tokens[kept * tpb : (kept + 1) * tpb])
        order = {path: place for place, path in enumerate(self._children.get(prefix, []))}
        found = []
        for path in {path for _, path in self.tree}:
            if len(path) == (kept + 1) * tpb and path[: kept * tpb] == prefix:
                shared = next((i for i, (a, b) in enumerate(zip(path[kept * tpb :], rest)) if a != b), len(rest))
                if shared:
                    found.append((shared, path))
        return sorted(found, key=lambda child: (-child[0], order.get(child[1], len(order))))

    def _ending_inside(
        self, tokens: list[int], kept: int, path: Path, longest: int, at_longest: bool
    ) -> tuple[int, dict[int, ModelPage]] | None:
        """A match of ``kept`` whole blocks and the first tokens of block ``path``: at ``longest`` of them (if
        ``at_longest``) or where one of its pages holding fewer ends, the longest every layer group can serve."""
        pages = {lc: self.tree.get((lc, path)) for lc in range(len(self.windows))}
        ends = {page.tokens for page in pages.values() if page is not None and page.tokens is not None}
        ends = {end for end in ends if 0 < end < longest} | ({longest} if at_longest else set())
        for end in sorted(ends, reverse=True):
            length = kept * self.tpb + end
            if all(
                (page := pages[lc]) is not None and (page.tokens or self.tpb) >= end for lc in range(len(self.windows))
            ) and all(self._whole(lc, self._path(tokens, o)) for lc, o in self._needed(length, kept)):
                return length, {lc: page for lc, page in pages.items() if page is not None}
        return None

    def _snapshot(self, tokens: list[int], blocks: int) -> ModelPage | None:
        """The SSM snapshot at the end of ``tokens``' first ``blocks`` blocks."""
        if self.ssm is None or blocks == 0:
            return None
        return self.tree.get((self.ssm, self._path(tokens, blocks - 1)))

    def _whole(self, lc: int, path: Path) -> bool:
        page = self.tree.get((lc, path))
        return page is not None and page.tokens is None

    def _block_ends(self) -> set[Path]:
        """The tree's blocks with a page, and those a live cache committed (it uses them, pages or not)."""
        paths = {path for _, path in self.tree}
        for cache in self.caches.values():
            paths.update(self._path(cache.tokens, o) for o in range(cache.committed_blocks))
        return paths

    def _holds_block(self, block: Path) -> bool:
        """Whether the tree holds ``block``: a block stays while it or a descendant has a page or a live cache
        uses it."""
        return any(path[: len(block)] == block for path in self._block_ends())

    def _walk(self, tokens: list[int]) -> int:
        """Full blocks of ``tokens`` the tree holds as blocks, pages or not (``_holds_block``)."""
        ends = self._block_ends()
        count = 0
        while (count + 1) * self.tpb <= len(tokens) and any(
            path[: (count + 1) * self.tpb] == tuple(tokens[: (count + 1) * self.tpb]) for path in ends
        ):
            count += 1
        return count

    # -- the tree's order of children ------------------------------------------------------------------------
    def _prune_children(self) -> None:
        """Forget the blocks the tree no longer holds (pruned: the first place stays empty), and the order by
        arrival of a block pruned itself."""
        for parent, children in self._children.items():
            children[1:] = [path for path in children[1:] if path is not None and self._holds_block(path)]
            if children[0] is not None and not self._holds_block(children[0]):
                children[0] = None
            if parent and not self._holds_block(parent):
                self._by_arrival.discard(parent)

    def _join_children(self, path: Path) -> None:
        """A child joins its parent's order: in the first place if empty, else last; with partial reuse, once a
        block has ``PARTIAL_INDEX_MIN_CHILDREN`` children, last always (they are then found by first token, in the
        order they arrived: ``ChildGroup``)."""
        parent = path[: -self.tpb]
        children = self._children.setdefault(parent, [None])
        if path in children:
            return
        if children[0] is None and parent not in self._by_arrival:
            children[0] = path
        else:
            children.append(path)
        if self.partial_reuse and sum(child is not None for child in children) >= PARTIAL_INDEX_MIN_CHILDREN:
            self._by_arrival.add(parent)

    def _first_extending(self, tokens: list[int]) -> Path | None:
        """The first child (in the tree's order) of the block before ``tokens``' partial block whose tokens extend
        them: the block they were copied from, or (a match that stepped back from a block without pages that a
        live cache keeps) the request's own block."""
        prefix = tuple(tokens)
        children = self._children.get(prefix[: len(prefix) // self.tpb * self.tpb], [])
        return next(
            (path for path in children if path is not None and path[: len(prefix)] == prefix and self._holds_block(path)),
            None,
        )

    # -- helpers ------------------------------------------------------------------------------------------------
    def _path(self, tokens: list[int], ordinal: int) -> Path:
        return tuple(tokens[: (ordinal + 1) * self.tpb])

    def _stale(self, lc: int, history: int) -> range:
        """The blocks of layer group ``lc`` out of its window at ``history`` (SPEC §3: sink blocks never are)."""
        spec = self.windows[lc]
        if spec is None:
            return range(0)
        window, sinks = spec
        start = min(-(-history // self.tpb), -(-sinks // self.tpb))
        return range(start, max(start, (history + 1 - window) // self.tpb))

    def _needed(self, history: int, num_blocks: int) -> list[Entry]:
        """The (layer group, ordinal) pages a cache at ``history`` reads among its first ``num_blocks`` blocks."""
        return [
            (lc, o) for lc in self.attention for o in range(num_blocks) if o not in self._stale(lc, history)
        ]

    def _group(self, page: ModelPage) -> int:
        return self.pool_group_of[page.life_cycle]

    def _at(self, page: ModelPage, level: int, pool_group: int) -> bool:
        return page.level == level and self._group(page) == pool_group

    def _pages(self) -> Iterator[ModelPage]:
        return itertools.chain(self.tree.values(), self.private)
