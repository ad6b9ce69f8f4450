"""The radix tree of committed blocks: one root per reuse scope, children found by their tokens.

A child is found by its tokens, not by its chained SHA-256 key: the parent fixes the scope and the prefix, so
equal tokens under one parent mean an equal key. Children are indexed by the int ``hash(tokens)`` (the block's
``slot``), so removing a block hashes nothing (a tuple does not cache its hash). Ints hash to themselves, so slots
can be made to collide: a child whose slot holds other tokens is indexed by its SHA-256 key instead
(``_collision_slot``), every lookup compares tokens, and a parent that ever had such a child (``collided``) has its
misses looked up there too.

A block's SHA-256 key is computed when first asked for (KV events, the remote tier, a collision), then kept: with
neither events nor a remote tier, matching and committing compute none.

Only the last block of a path may be partial. A block keeps one page per life cycle (any of which may have
been dropped) and lives while it has a page, a child, or a cache that references it; a root likewise lives
while its scope has a block or a live cache. The tree owns the ``Block.pages`` / ``Page.block`` link: ``attach``
and ``detach`` are the only places it changes, and they record the KV events (stored / removed).
"""

from __future__ import annotations

from typing import Callable, Final, Iterator, Sequence

from .._observe.events import REMOVED, STORED, EventLog, KVEventKind
from .._base.hashing import ReuseScope, Token, block_key, root_key
from .child_groups import ChildGroup, longest_shared_prefix, shared_length, shared_prefix_length
from .page import MAX_SPARES_MADE_UP_FRONT, NO_CHILDREN, Block, BlockTokens, Page
from .._base.types import BlockOrdinal

# A block indexes its children by first token once it has this many (a shared system prompt's last block may have
# thousands); below that a partial match compares every child, and no block pays an index it does not need.
PARTIAL_INDEX_MIN_CHILDREN: Final = 8

# Slots of colliding children start here: above every ``hash()`` value, so they never meet a tuple's slot.
_COLLISION_SLOTS: Final = 1 << 64


class RadixTree:
    def __init__(
        self,
        tokens_per_block: int,
        num_life_cycles: int,
        events: EventLog,
        index_partial: bool = True,
        spare_blocks: int = 0,
    ) -> None:
        self.tokens_per_block = tokens_per_block
        # Whether blocks with many children index them by first token (only partial matching reads the index).
        self.index_partial = index_partial
        self.num_life_cycles = num_life_cycles
        self.events = events
        self._roots: dict[bytes, Block] = {}
        self.num_blocks: int = 0
        # Told of every page that becomes a block's content (the remote tier's write-through), after the event.
        self.attach_listener: Callable[[Page], None] | None = None
        # Partial reuse without SSM layers: a partial block's pages go to a sibling extending its tokens
        # (``partial_siblings.py``), so no block sits beside one that extends it.
        self.merges_partial_siblings: bool = False
        # Pruned block objects, handed out again as new children, up to ``spare_blocks`` of them (the manager asks
        # for one per GPU slot of its largest pool group, what a full cache holds), made here up to
        # MAX_SPARES_MADE_UP_FRONT. As with spare pages: a tree that grows or replaces pruned blocks then creates no
        # objects for the garbage collector to traverse.
        self.spare_block_limit = spare_blocks
        self.spare_blocks: list[Block] = []
        for _ in range(min(spare_blocks, MAX_SPARES_MADE_UP_FRONT)):
            spare = Block(b"", None, BlockOrdinal(-1), (), num_life_cycles, None)
            spare.attached = False
            self.spare_blocks.append(spare)

    def root(self, scope: ReuseScope | None) -> Block:
        key = root_key(scope)
        root = self._roots.get(key)
        if root is None:
            root = Block(key, None, BlockOrdinal(-1), (), self.num_life_cycles, scope)
            self._roots[key] = root
        return root

    def find_root(self, scope: ReuseScope | None) -> Block | None:
        return self._roots.get(root_key(scope))

    def child(self, parent: Block, tokens: BlockTokens) -> Block | None:
        """The child of ``parent`` holding ``tokens``, if there is one."""
        found = parent.at_slot(hash(tokens))
        if found is not None and found.tokens == tokens:
            return found
        if not parent.collided:
            return None
        return parent.at_slot(_collision_slot(block_key(parent.key, tokens)))

    def add_child(self, parent: Block, tokens: BlockTokens) -> Block:
        """The child of ``parent`` holding ``tokens``: the existing one (a rebase) or a new one."""
        slot = hash(tokens)
        existing = parent.at_slot(slot)
        if existing is not None and existing.tokens == tokens:
            return existing
        key = b""
        if existing is not None or parent.collided:
            key = block_key(parent.key, tokens)
            collision = _collision_slot(key)
            found = parent.at_slot(collision)
            if found is not None:
                return found
            if existing is not None:
                slot = collision
                parent.collided = True
        if self.spare_blocks:
            block = self.spare_blocks.pop()
            block.reuse(key, parent, BlockOrdinal(parent.ordinal + 1), tokens, slot)
        else:
            block = Block(key, parent, BlockOrdinal(parent.ordinal + 1), tokens, self.num_life_cycles, parent.scope, slot)
        if parent.child is None:
            parent.child = block
        elif parent.more_children is NO_CHILDREN:
            parent.more_children = {slot: block}
        else:
            parent.more_children[slot] = block
        index = parent.children_by_first
        if index is not None:
            _index_child(index, block)
        elif self.index_partial and len(parent.more_children) + 1 >= PARTIAL_INDEX_MIN_CHILDREN:
            index = {}
            for child in parent.children():
                _index_child(index, child)
            parent.children_by_first = index
        self.num_blocks += 1
        return block

    # ------------------------------------------------------------------------------------------ page links
    def attach(self, block: Block, page: Page, num_tokens: int = -1) -> None:
        """Make ``page`` the block's content of its life cycle (the slot must be free) and record it; ``num_tokens``:
        how many of the block's tokens the page holds, all of them unless given (a shorter sibling's page holds
        fewer: no event, no remote copy, as neither can say so). A lost page (its move failed) is never linked: its
        user keeps it out of the tree and frees it when letting go."""
        assert block.pages[page.life_cycle] is None and page.block is None
        if page.lost:
            return
        block.pages[page.life_cycle] = page
        page.block = block
        page.num_tokens = len(block.tokens) if num_tokens < 0 else num_tokens
        if not page.covers_its_block:
            return
        if self.events.enabled:
            record_page_event(self.events, STORED, page)
        listener = self.attach_listener
        if listener is not None:
            listener(page)

    def detach(self, page: Page) -> None:
        """The page store dropped ``page``: record it, unlink it from its block and prune what emptied."""
        block = page.block
        if block is None:
            return
        if self.events.enabled:
            record_page_event(self.events, REMOVED, page)
        block.pages[page.life_cycle] = None
        page.block = None
        self.prune(block)

    def prune(self, block: Block | None) -> None:
        """Detach ``block`` and then its ancestors while they are empty: no page, no child, no user.

        An empty root goes too (a cache counts as a user of its scope's root), so single-use scopes do not
        accumulate. A block already detached (pruned earlier through a descendant) is left alone.
        """
        while block is not None:
            if not block.attached or block.users > 0 or block.has_children() or block.has_any_page():
                return
            block.attached = False
            parent = block.parent
            if parent is None:
                del self._roots[block.key]
                return
            if parent.child is block:
                parent.child = None
            else:
                del parent.more_children[block.slot]
            index = parent.children_by_first
            if index is not None and block.tokens:
                siblings = index[block.tokens[0]]
                if len(siblings) == 1:
                    del index[block.tokens[0]]
                else:
                    siblings.remove(block)
            self.num_blocks -= 1
            self._keep_spare(block)
            block = parent

    def _keep_spare(self, block: Block) -> None:
        """Keep a block just pruned for reuse (up to ``spare_block_limit``), its links to others cut."""
        if len(self.spare_blocks) >= self.spare_block_limit:
            return
        block.parent = None
        block.more_children = NO_CHILDREN
        block.collided = False
        block.children_by_first = None
        block.scope = None
        block.tokens = ()
        self.spare_blocks.append(block)

    @property
    def num_roots(self) -> int:
        """Reuse scopes the tree holds a root for: those with committed blocks or live caches."""
        return len(self._roots)

    def roots(self) -> list[Block]:
        return list(self._roots.values())

    def clear(self) -> None:
        self._roots.clear()
        self.num_blocks = 0

    def longest_partial_child(self, parent: Block, tokens: Sequence[Token]) -> tuple[Block | None, int]:
        """Child of ``parent`` whose tokens share the longest common prefix with ``tokens`` (partial reuse); the
        first such child on a tie. Only children starting with ``tokens[0]`` can share anything: with many children
        only their ``ChildGroup`` is walked (``children_by_first``)."""
        limit = min(len(tokens), self.tokens_per_block)
        if limit == 0:
            return None, 0
        index = parent.children_by_first
        if index is None:
            return longest_shared_prefix(parent.children(), tokens, limit)
        group = index.get(tokens[0])
        if group is None:
            return None, 0
        return group.longest_shared(tokens, limit)

    def partial_children(self, parent: Block, tokens: Sequence[Token]) -> Iterator[tuple[Block, int]]:
        """Every child of ``parent`` sharing a start with ``tokens`` and how many tokens it shares, longest first
        (tree order on a tie), computed as far as the caller reads: a partial match may copy its rows from any of
        them, so the one sharing the most is not always the one whose pages serve (a layer group's page may be
        gone), yet it almost always is, and after a system prompt thousands of children may share a start."""
        limit = min(len(tokens), self.tokens_per_block)
        if limit == 0:
            return iter(())
        index = parent.children_by_first
        if index is not None:
            group = index.get(tokens[0])
            return iter(()) if group is None else group.shared_members(tokens, limit)
        found: list[tuple[Block, int]] = []
        for child in parent.children():  # unindexed: fewer than PARTIAL_INDEX_MIN_CHILDREN
            shared = shared_prefix_length(child.tokens, tokens, limit)
            if shared > 0:
                found.append((child, shared))
        found.sort(key=shared_length, reverse=True)
        return iter(found)


def _index_child(index: dict[Token, ChildGroup[Block]], child: Block) -> None:
    if child.tokens:
        siblings = index.get(child.tokens[0])
        if siblings is None:
            siblings = ChildGroup(1)
            index[child.tokens[0]] = siblings
        siblings.add(child)


def _collision_slot(key: bytes) -> int:
    """The slot of a child whose ``hash(tokens)`` slot holds other tokens: its SHA-256 key as an int, above every
    ``hash()`` value, so it meets neither a tuple's slot nor (SHA-256 being collision-free) another child's."""
    return _COLLISION_SLOTS + int.from_bytes(key, "big")


def record_page_event(events: EventLog, kind: KVEventKind, page: Page, previous_level: int = -1) -> None:
    """Record a KV event about a tree-owned page holding its whole block (callers test ``events.enabled`` first);
    stored events carry the block's tokens and its parent's key."""
    block = page.block
    if block is None or not page.covers_its_block:
        return
    stored = kind == STORED
    parent = block.parent
    parent_hash = parent.key if parent is not None and stored else None
    tokens: BlockTokens = block.tokens if stored else ()
    events.record(
        kind, page.life_cycle, block.key, parent_hash, tokens, block.scope, page.level, page.priority, previous_level
    )
