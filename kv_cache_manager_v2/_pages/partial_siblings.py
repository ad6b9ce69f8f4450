"""Partial coverage of a tree block: where a partial block's pages go when a sibling extends its tokens.

With partial reuse and no SSM layers (``RadixTree.merges_partial_siblings``), no block sits beside a sibling whose
tokens start with its own: the longer block takes the shorter one's pages it lacks (each page keeps its
``num_tokens``), and of two pages of one life cycle the one covering more tokens stays. A match ending inside the
block then finds each life cycle's widest page in one place, and a page covering fewer tokens than the block never
serves a match passing it (``prefix_match``). SSM snapshots are states after exactly their block's tokens, so a
hybrid model keeps its partial blocks apart (never merged).
"""

from __future__ import annotations

from .page import Block, BlockTokens, Page
from .page_store import PageStore


def offer_page(store: PageStore, block: Block, page: Page, num_tokens: int) -> bool:
    """Make ``page``, holding the first ``num_tokens`` tokens of ``block``, the block's page of its life cycle
    unless the block's page covers at least as many (then nothing changes); a page it replaces leaves the tree.
    Returns whether ``page`` is now the block's. ``page`` may still be another block's: it moves."""
    current = block.pages[page.life_cycle]
    if current is page:
        return True
    if current is not None and current.num_tokens >= num_tokens:
        return False
    if current is not None:
        leave_tree(store, current)
    if page.block is not None:
        store.tree.detach(page)
    store.tree.attach(block, page, num_tokens)
    store.refile(page)
    return True


def leave_tree(store: PageStore, page: Page) -> None:
    """A page given way to a wider one (or to a recomputed GPU copy): out of the tree, freed unless a cache still
    uses it. It is then that cache's private page, freed when the cache lets go of it, and keeps its place in the
    eviction order (locked or claimed, it is in no list; held, it is in the held one already): leaving the tree is
    no use of it."""
    store.tree.detach(page)
    if page.lock_count == 0 and page.hold_count == 0 and page.claim_count == 0:
        store.free(page)


def longer_sibling(parent: Block, tokens: BlockTokens) -> Block | None:
    """A child of ``parent`` whose tokens start with ``tokens`` and run longer, if any (the first in order)."""
    index = parent.children_by_first
    if index is not None:
        group = index.get(tokens[0])
        return None if group is None else group.first_extending(tokens)
    for child in parent.children():
        if len(child.tokens) > len(tokens) and child.tokens[: len(tokens)] == tokens:
            return child
    return None


def absorb_shorter_siblings(store: PageStore, block: Block) -> None:
    """``block`` was committed: take over the pages of partial siblings whose tokens start its own where they
    cover more than the block's own page (or it has none); the others leave the tree, and so do the emptied
    siblings."""
    parent = block.parent
    if parent is None or (parent.child is block and not parent.more_children) or not block.tokens:
        return
    for sibling in _shorter_siblings(parent, block.tokens):
        for page in sibling.pages:
            if page is not None and not offer_page(store, block, page, page.num_tokens):
                leave_tree(store, page)
        store.tree.prune(sibling)


def _shorter_siblings(parent: Block, tokens: BlockTokens) -> list[Block]:
    """The children of ``parent`` whose tokens ``tokens`` starts with and runs past, in order (a new list: the
    caller prunes them)."""
    index = parent.children_by_first
    if index is not None:
        group = index.get(tokens[0])
        return [] if group is None else group.shorter_prefixes(tokens)
    return [
        child for child in parent.children()
        if 0 < len(child.tokens) < len(tokens) and child.tokens == tokens[: len(child.tokens)]
    ]
