"""Pages, the radix tree blocks that own them and the eviction lists they sit in (each links to the others).

A page is one block's worth of one life cycle in one slot of some tier; it keeps its identity when it moves
between tiers. Ownership: a page is *private* to one cache until its block is committed, then owned by a radix
tree block and shareable. Its use decides its state:
- locked (``lock_count > 0``): on the GPU, used by an active cache; never evicted;
- held (a suspended user, a claim, or private): may move to a colder tier, never dropped;
- droppable (committed, nobody uses it): reusable cache content, evicted and finally dropped under pressure.
"""

from __future__ import annotations

from typing import Final

from .._base.hashing import ReuseScope, Token, block_key
from .child_groups import ChildGroup
from .._base.types import MAX_PRIORITY, BlockOrdinal, CacheLevel, LifeCycleId, PoolGroupIndex, SlotId

NUM_PRIORITIES: Final = MAX_PRIORITY + 1

# Spare page and block objects made at construction, at most (``PageStore.spare_pages``, ``RadixTree.spare_blocks``):
# bounds what a very large GPU tier costs up front (~0.1 s and ~25 MiB compiled); past it objects are made as the
# cache first fills, and reused all the same.
MAX_SPARES_MADE_UP_FRONT: Final = 1 << 16


class Page:
    def __init__(
        self, life_cycle: LifeCycleId, pool_group: PoolGroupIndex, level: CacheLevel, slot: SlotId, priority: int
    ) -> None:
        self.life_cycle: LifeCycleId = life_cycle
        self.pool_group: PoolGroupIndex = pool_group
        self.level: CacheLevel = level
        self.slot: SlotId = slot
        self.priority: int = priority
        self.block: Block | None = None
        self.lock_count = 0
        self.hold_count = 0
        # Claims of a batch admission in progress: a claimed page stays where it is (never evicted).
        self.claim_count = 0
        # Intrusive links of the eviction list the page is in (``queue`` is None when in none).
        self.queue: PriorityLru | None = None
        self.prev: Page | None = None
        self.next: Page | None = None
        self.stamp = 0
        # How many times the object was given new content (``reuse``): who remembers a page across calls that may
        # free it (``LruOrder``) tells the page it knew from the object's next content.
        self.generation: int = 0
        # Undropped ``PlannedDropHandle``s naming this content (``_introspection.reuse_match_planned_drop_counts``).
        self.planned_drop_count: int = 0
        # While in a block: how many of its first tokens the page holds (its coverage). A block's own commit covers
        # all its tokens; a shorter partial sibling's page moved into it (``partial_siblings.py``) covers only that
        # sibling's tokens, so it serves a match ending within them, never one passing the block.
        self.num_tokens: int = 0
        # The slot never received the page's bytes (a disk read or write, or the cold-page codec, failed while
        # moving it: ``PageStore.run_recorded_copies``): the page must never be served; kept until its users let go.
        self.lost: bool = False

    def reuse(
        self, life_cycle: LifeCycleId, pool_group: PoolGroupIndex, level: CacheLevel, slot: SlotId, priority: int
    ) -> None:
        """Give a freed page object new content (``PageStore`` keeps freed ones as spares): a freed page is in
        no block, no eviction list and nobody's use, so only what says where it is and how it ranks changes."""
        self.life_cycle = life_cycle
        self.pool_group = pool_group
        self.level = level
        self.slot = slot
        self.priority = priority
        self.generation += 1
        self.planned_drop_count = 0
        self.num_tokens = 0
        self.lost = False

    @property
    def covers_its_block(self) -> bool:
        """Whether the page is in a block and holds all its tokens (what KV events and the remote tier describe)."""
        block = self.block
        return block is not None and self.num_tokens == len(block.tokens)


# A block's tokens: a tuple, so that it keys its parent's children and, holding only ints and bytes, leaves the
# garbage collector's tracking after one pass (a list of ints would be traversed by every collection).
BlockTokens = tuple[Token, ...]

# The ``more_children`` of every block with at most one child: most blocks have one (the next block of a prompt) or
# none, kept in ``Block.child``; a dict comes only with a second child (one allocation fewer per committed block, and
# one object fewer for the garbage collector to traverse). Never mutated.
NO_CHILDREN: Final[dict[int, Block]] = {}


class Block:
    def __init__(
        self,
        key: bytes,
        parent: Block | None,
        ordinal: BlockOrdinal,
        tokens: BlockTokens,
        num_life_cycles: int,
        scope: ReuseScope | None,
        slot: int = 0,
    ) -> None:
        # The key once computed (a root's is given), empty before: read ``key``.
        self.known_key: bytes = key
        self.slot: int = slot  # the slot its parent finds it at
        self.scope = scope
        self.parent = parent
        self.ordinal: BlockOrdinal = ordinal
        self.tokens: BlockTokens = tokens
        # The children, by slot: one in ``child`` (filled first, whenever it is free), the others in ``more_children``.
        self.child: Block | None = None
        self.more_children: dict[int, Block] = NO_CHILDREN
        # Whether a child was ever indexed by its collision slot: only then does a lookup that misses look there too.
        self.collided = False
        # Children by their first token, in insertion order, once there are PARTIAL_INDEX_MIN_CHILDREN of them:
        # partial matching then walks the ``ChildGroup`` of the children that share the first token.
        self.children_by_first: dict[Token, ChildGroup[Block]] | None = None
        self.pages: list[Page | None] = [None] * num_life_cycles
        self.users = 0
        self.attached: bool = True
        # An engine saved SSM snapshots here on request (``save_ssm_snapshot`` / ``save_last_ssm_snapshot``): a
        # declared reuse point, which a hybrid match without partial reuse may end on before the request's tokens do.
        self.saved_snapshot: bool = False

    def reuse(self, key: bytes, parent: Block, ordinal: BlockOrdinal, tokens: BlockTokens, slot: int) -> None:
        """Make a pruned block object a new child of ``parent`` (``RadixTree`` keeps pruned ones as spares): a
        pruned block has no page, child or user left, and ``_keep_spare`` cut its other links."""
        self.known_key = key
        self.slot = slot
        self.scope = parent.scope
        self.parent = parent
        self.ordinal = ordinal
        self.tokens = tokens
        self.attached = True
        self.saved_snapshot = False

    @property
    def key(self) -> bytes:
        """The chained SHA-256 block key: ``block_key(parent.key, tokens)``, computed on first use. Ancestors
        without one get theirs on the way, top-down (no recursion: a long prompt is a long chain)."""
        if self.known_key:
            return self.known_key
        pending: list[Block] = []
        block: Block | None = self
        while block is not None and not block.known_key:
            pending.append(block)
            block = block.parent
        assert block is not None, "a root always has its key"
        key = block.known_key
        for descendant in reversed(pending):
            key = block_key(key, descendant.tokens)
            descendant.known_key = key
        return key

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def has_children(self) -> bool:
        return self.child is not None or len(self.more_children) > 0

    def children(self) -> list[Block]:
        """Every child, ``child`` first."""
        result = [] if self.child is None else [self.child]
        result.extend(self.more_children.values())
        return result

    def at_slot(self, slot: int) -> Block | None:
        """The child at ``slot``, if any."""
        child = self.child
        if child is not None and child.slot == slot:
            return child
        return self.more_children.get(slot)

    def has_any_page(self) -> bool:
        for page in self.pages:
            if page is not None:
                return True
        return False


class PriorityLru:
    """Pages ordered by (priority, least recently queued): one intrusive list per priority, O(1) everything.

    ``mask`` has bit ``p`` set while priority ``p`` has pages, so the lowest non-empty list is one bit trick away.
    """

    def __init__(self) -> None:
        self.heads: list[Page | None] = [None] * NUM_PRIORITIES
        self.tails: list[Page | None] = [None] * NUM_PRIORITIES
        self.mask: int = 0
        self.size: int = 0

    def push(self, page: Page, stamp: int) -> None:
        """Append as most recently used of its priority."""
        priority = page.priority
        tail = self.tails[priority]
        page.queue = self
        page.stamp = stamp
        page.prev = tail
        page.next = None
        if tail is None:
            self.heads[priority] = page
            self.mask |= 1 << priority
        else:
            tail.next = page
        self.tails[priority] = page
        self.size += 1

    def remove(self, page: Page) -> None:
        priority = page.priority
        prev = page.prev
        nxt = page.next
        if prev is None:
            self.heads[priority] = nxt
        else:
            prev.next = nxt
        if nxt is None:
            self.tails[priority] = prev
        else:
            nxt.prev = prev
        if self.heads[priority] is None:
            self.mask &= ~(1 << priority)
        page.queue = None
        page.prev = None
        page.next = None
        self.size -= 1

    def restore(self, entries: list[tuple[int, Page]]) -> None:
        """Put pages of this list back where their earlier stamps place them, undoing refiles that should
        leave no trace; one pass over each priority's list (``entries``: (old stamp, page), pages in this list)."""
        for _, page in entries:
            self.remove(page)
        entries.sort(key=_stamp_of_entry)
        last: list[Page | None] = [None] * NUM_PRIORITIES  # per priority: the page restored last
        for stamp, page in entries:
            priority = page.priority
            previous = last[priority]
            node = self.heads[priority] if previous is None else previous.next
            while node is not None and node.stamp < stamp:
                node = node.next
            page.stamp = stamp
            self._insert_before(page, node)
            last[priority] = page

    def _insert_before(self, page: Page, node: Page | None) -> None:
        """Link ``page`` in front of ``node`` of its priority's list (at the tail when ``node`` is None)."""
        priority = page.priority
        prev = self.tails[priority] if node is None else node.prev
        page.queue = self
        page.prev = prev
        page.next = node
        if prev is None:
            self.heads[priority] = page
        else:
            prev.next = page
        if node is None:
            self.tails[priority] = page
        else:
            node.prev = page
        self.mask |= 1 << priority
        self.size += 1

    def first(self) -> Page | None:
        """The page to evict next: lowest priority, least recently queued."""
        mask = self.mask
        if mask == 0:
            return None
        return self.heads[(mask & -mask).bit_length() - 1]

    def __iter__(self) -> PriorityLruIterator:
        return PriorityLruIterator(self)


def _stamp_of_entry(entry: tuple[int, Page]) -> int:
    return entry[0]


class PriorityLruIterator:
    """Eviction order, for invariant checks and tests."""

    def __init__(self, queue: PriorityLru) -> None:
        self._queue = queue
        self._priority = 0
        self._page: Page | None = None

    def __iter__(self) -> PriorityLruIterator:
        return self

    def __next__(self) -> Page:
        page = self._page.next if self._page is not None else None
        while page is None:
            if self._priority >= NUM_PRIORITIES:
                raise StopIteration
            page = self._queue.heads[self._priority]
            self._priority += 1
        self._page = page
        return page
