"""The prefix match: the longest prefix of a request's tokens that every layer group can serve."""

from __future__ import annotations

from .._base.hashing import ReuseScope, Token
from .._model.life_cycle import LifeCycle, ceil_div
from .page import Block
from .radix_tree import RadixTree
from .._base.types import LifeCycleId


class Match:
    """Result of a prefix lookup: full tree blocks, then maybe one block reused partially (copy-on-write)."""

    def __init__(self, root: Block | None) -> None:
        self.root = root
        self.blocks: list[Block] = []
        self.partial_source: Block | None = None
        self.length = 0


class PrefixMatcher:
    """Walks the tree's full blocks, tries a partial last block, then keeps the longest length every life cycle
    can serve from the pages still there (each kind's ``servable``)."""

    def __init__(self, tree: RadixTree, life_cycles: list[LifeCycle], tokens_per_block: int, partial_reuse: bool) -> None:
        self.match_backoff = 0  # reuse_match_backoff: tokens a match stays short of the longest cached prefix
        self.tree = tree
        self.life_cycles = life_cycles
        self.tokens_per_block = tokens_per_block
        self.partial_reuse = partial_reuse

    def match(self, scope: ReuseScope | None, tokens: list[Token]) -> Match:
        """Longest servable prefix of ``tokens``, at least ``match_backoff`` tokens short of the longest cached
        one (``reuse_match_backoff``)."""
        if self.match_backoff > 0:
            longest = self.longest(scope, tokens).length
            return self.longest(scope, tokens[: max(0, longest - self.match_backoff)])
        return self.longest(scope, tokens)

    def longest(self, scope: ReuseScope | None, tokens: list[Token]) -> Match:
        """Longest servable prefix of ``tokens``, no backoff."""
        tpb = self.tokens_per_block
        root = self.tree.find_root(scope)
        match = Match(root)
        if root is None:
            return match
        node = root
        for ordinal in range(len(tokens) // tpb):
            child = self.tree.child(node, tuple(tokens[ordinal * tpb : (ordinal + 1) * tpb]))
            if child is None:
                break
            match.blocks.append(child)
            node = child
        full = len(match.blocks)
        partial_length = 0
        if self.partial_reuse:
            rest = tokens[full * tpb : (full + 1) * tpb]
            if rest:
                source, partial_length = self.tree.longest_partial_child(node, rest)
                if source is not None and partial_length > 0:
                    match.partial_source = source
        candidates = [full * tpb + partial_length] if partial_length > 0 else []
        candidates.extend(k * tpb for k in range(full, -1, -1))
        chain = list(match.blocks)
        if match.partial_source is not None:
            chain.append(match.partial_source)
        counts = [_page_counts(chain, life_cycle.id) for life_cycle in self.life_cycles]
        for length in candidates:
            if all(lc.servable(length, counts[lc.id]) for lc in self.life_cycles):
                match.length = length
                break
        kept = ceil_div(match.length, tpb)
        if match.length % tpb == 0 or kept <= full:
            match.partial_source = None
        del match.blocks[min(kept, full) :]
        return match


def _page_counts(chain: list[Block], life_cycle: LifeCycleId) -> list[int]:
    """``counts[k]``: how many of the first ``k`` blocks of ``chain`` still have a page of ``life_cycle``."""
    counts = [0]
    total = 0
    for block in chain:
        if block.pages[life_cycle] is not None:
            total += 1
        counts.append(total)
    return counts
