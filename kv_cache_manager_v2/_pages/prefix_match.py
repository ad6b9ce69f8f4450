"""The prefix match: the longest prefix of a request's tokens that every layer group can serve."""

from __future__ import annotations

import heapq
from typing import Iterator, final

from .._base.hashing import ReuseScope, Token
from .._model.life_cycle import LifeCycle
from .page import Block
from .radix_tree import RadixTree
from .._base.types import LifeCycleId


class Match:
    """Result of a prefix lookup: full tree blocks, then maybe one block reused partially (copy-on-write) and, in a
    hybrid model, the partial block whose SSM snapshot ends at ``length``."""

    def __init__(self, root: Block | None) -> None:
        self.root = root
        self.blocks: list[Block] = []
        # The block whose first ``length % tokens_per_block`` rows the attention groups copy.
        self.partial_source: Block | None = None
        # The partial block holding the SSM snapshot of a match ending inside a block (None otherwise).
        self.snapshot_source: Block | None = None
        self.length = 0
        # How far the request's tokens run along the tree (full blocks, then the longest shared start of a child when
        # partial reuse is on), whether or not their pages are still there: what ``reuse_match_backoff`` counts back
        # from, and TensorRT-LLM's ``_get_num_reusable_tokens_before_pruning``. ``attention_length``: the longest
        # prefix the attention groups alone could serve (``_before_hybrid_pruning``); ``length`` is the shorter one
        # SSM snapshots allow.
        self.walked_length = 0
        self.attention_length = 0

    def partial_blocks(self) -> list[Block]:
        """The blocks past the full ones whose pages the match uses (to hold them, or keep them while room is made)."""
        found: list[Block] = []
        for block in (self.partial_source, self.snapshot_source):
            if block is not None and block not in found:
                found.append(block)
        return found


class PrefixMatcher:
    """Walks the tree's full blocks, tries a partial last block, then keeps the longest length every life cycle
    can serve from the pages still there (each kind's ``servable``).

    Hybrid models (SSM groups beside attention): the match is the shortest of what each group can serve, and an SSM
    group can serve only a length where one of its snapshots ends. A block boundary needs the snapshot on that
    block; with partial reuse, a length inside a block needs a partial tree block ending exactly there with a
    snapshot (``_snapshot_ends``); the attention rows up to that length are copied from the child sharing the
    most tokens with the request, or from that partial block itself. A request diverging inside a
    snapshot interval therefore reuses up to the last snapshot at or before the divergence, never a state taken
    past it."""

    def __init__(self, tree: RadixTree, life_cycles: list[LifeCycle], tokens_per_block: int, partial_reuse: bool) -> None:
        self.match_backoff = 0  # reuse_match_backoff: tokens a match stays short of the longest cached prefix
        self.tree = tree
        self.life_cycles = life_cycles
        self.tokens_per_block = tokens_per_block
        self.partial_reuse = partial_reuse
        self.attention: list[LifeCycle] = [life_cycle for life_cycle in life_cycles if not life_cycle.is_ssm]
        self.ssm_ids: list[LifeCycleId] = [life_cycle.id for life_cycle in life_cycles if life_cycle.is_ssm]

    def match(self, scope: ReuseScope | None, tokens: list[Token]) -> Match:
        """Longest servable prefix of ``tokens``, at least ``match_backoff`` tokens short of the longest prefix the
        tree holds (``reuse_match_backoff``: state at a position reads that many tokens past it, so only positions
        that far inside the tokens the tree agrees on are valid; a match ending earlier, where pages are gone,
        keeps its length). The diagnostics stay those of the whole request."""
        match = self.longest(scope, tokens)
        # A short block reused whole (hybrid, no partial reuse) runs past the walk: the tree holds those tokens too.
        limit = max(match.walked_length, match.length) - self.match_backoff
        if match.length <= limit:
            return match
        shorter = self.longest(scope, tokens[: max(0, limit)])
        shorter.walked_length = match.walked_length
        shorter.attention_length = match.attention_length
        return shorter

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
        # (block the attention rows are copied from, block with the SSM snapshot or None, tokens reused), longest first
        partials: Iterator[tuple[Block, Block | None, int]] = iter(())
        # Children sharing a start with the rest, longest first: the rows a match ending inside the block copies
        # come from one of them holding them in every attention group (the longest one may have lost a page).
        children = SharedChildren(iter(()))
        longest_shared = 0
        if self.partial_reuse:
            rest = tokens[full * tpb : (full + 1) * tpb]
            children = SharedChildren(self.tree.partial_children(node, rest))
            first = children.get(0)
            if first is not None:
                longest_shared = first[1]
                if self.ssm_ids:
                    partials = _snapshot_partials(self._snapshot_ends(node, rest, longest_shared), children)
                else:
                    partials = _inner_partials(children)
        counts = [_page_counts(match.blocks, life_cycle.id) for life_cycle in self.life_cycles]
        match.walked_length = full * tpb + longest_shared
        match.attention_length = self._attention_length(full, children, counts)
        for copied, ending, partial_length in partials:
            length = full * tpb + partial_length
            if all(lc.servable(length, _extended(counts[lc.id], copied, lc.id, partial_length)) for lc in self.attention):
                match.length = length
                match.attention_length = max(match.attention_length, length)
                match.partial_source = copied
                match.snapshot_source = ending
                return match
        whole_partials = not self.partial_reuse and bool(self.ssm_ids)
        inside_full_blocks = self.partial_reuse and not self.ssm_ids
        for kept in range(full, -1, -1):
            parent = match.blocks[kept - 1] if kept else root
            if inside_full_blocks and kept < full and self._ends_inside(match, parent, tokens, kept, counts):
                break
            if whole_partials:
                ending = self._whole_snapshot_child(match.blocks[kept - 1] if kept else root, tokens, kept, counts)
                if ending is not None:
                    match.length = kept * tpb + len(ending.tokens)
                    match.attention_length = max(match.attention_length, match.length)
                    match.partial_source = match.snapshot_source = ending
                    break
            if all(lc.servable(kept * tpb, counts[lc.id]) for lc in self.life_cycles):
                match.length = kept * tpb
                break
        del match.blocks[match.length // tpb :]
        return match

    def _ends_inside(
        self, match: Match, parent: Block, tokens: list[Token], kept: int, counts: list[list[int]]
    ) -> bool:
        """Partial reuse without SSM layers, stepping back to block ``kept``: end the match inside it where a child
        of ``parent`` sharing a start with the request's tokens there holds the rows, the longest length every
        attention group can serve, its rows copied. That child is the block itself where one of its pages covering
        fewer tokens (a shorter sibling's, moved in) stops, or a sibling: the block may have lost its pages while an
        open cache keeps it in the tree. Returns whether one was found (``match`` then ends there)."""
        tpb = self.tokens_per_block
        rest = tokens[kept * tpb : (kept + 1) * tpb]
        for child, _, ends in _inner_partials(SharedChildren(self.tree.partial_children(parent, rest))):
            if ends == tpb:
                continue  # the whole block: ``kept + 1`` blocks, already refused
            length = kept * tpb + ends
            if all(lc.servable(length, _extended(counts[lc.id][: kept + 1], child, lc.id, ends)) for lc in self.attention):
                match.length = length
                match.attention_length = max(match.attention_length, length)
                match.partial_source = child
                return True
        return False

    def _whole_snapshot_child(self, node: Block, tokens: list[Token], kept: int, counts: list[list[int]]) -> Block | None:
        """Hybrid models without partial reuse: the longest partial child of ``node`` (block ``kept``) whose tokens
        all start the request's rest, holding every SSM group's snapshot and its own attention rows, and either
        ending exactly where the request does or saved there on request (``commit(save_ssm_snapshot=True)``,
        ``stop_committing(save_last_ssm_snapshot=True)``: the engine declared the point a reuse point). It is
        reused whole, as a short last block: no part of a block is copied. A snapshot taken only because commits
        ended there serves a longer request only with partial reuse (the user turned reuse inside a block off)."""
        tpb = self.tokens_per_block
        rest = tokens[kept * tpb : (kept + 1) * tpb]
        best: Block | None = None
        for child in node.children():
            length = len(child.tokens)
            if (
                length < tpb
                and length <= len(rest)
                and (child.saved_snapshot or length == len(tokens) - kept * tpb)
                and (best is None or length > len(best.tokens))
                and child.tokens == tuple(rest[:length])
                and all(child.pages[lc] is not None for lc in self.ssm_ids)
                and all(
                    lc.servable(kept * tpb + length, _extended(counts[lc.id][: kept + 1], child, lc.id, length))
                    for lc in self.attention
                )
            ):
                best = child
        return best

    def _attention_length(self, full: int, children: SharedChildren, counts: list[list[int]]) -> int:
        """The longest prefix every attention group can serve (SSM snapshots not asked): a partial child's shared
        rows on top of the full blocks where they serve, else the longest servable run of full blocks."""
        tpb = self.tokens_per_block
        for child, shared in children:
            if all(
                lc.servable(full * tpb + shared, _extended(counts[lc.id], child, lc.id, shared))
                for lc in self.attention
            ):
                return full * tpb + shared
        for kept in range(full, -1, -1):
            if all(lc.servable(kept * tpb, counts[lc.id]) for lc in self.attention):
                return kept * tpb
        return 0

    def _snapshot_ends(self, node: Block, rest: list[Token], longest: int) -> list[tuple[Block, int]]:
        """Hybrid models: the partial children of ``node`` whose tokens are a prefix of ``rest`` and that hold a
        snapshot of every SSM group, longest first. An SSM state is only valid where a snapshot was taken, and a
        partial block's snapshot is the state after all its tokens, so a reuse that ends inside a block must end
        exactly where such a block ends (the attention groups then copy that block's rows)."""
        found: list[tuple[Block, int]] = []
        for length in range(min(longest, self.tokens_per_block - 1), 0, -1):
            child = self.tree.child(node, tuple(rest[:length]))
            if child is not None and all(child.pages[lc] is not None for lc in self.ssm_ids):
                found.append((child, length))
        return found


def _extended(counts: list[int], block: Block, life_cycle: LifeCycleId, num_tokens: int) -> list[int]:
    """``counts`` with one more block, ``block``, read up to ``num_tokens`` tokens, at the end."""
    page = block.pages[life_cycle]
    return [*counts, counts[-1] + (1 if page is not None and page.num_tokens >= num_tokens else 0)]


@final
class SharedChildren:
    """``RadixTree.partial_children``'s answer, read from the tree's walk only as far as the match asks (the first
    child almost always serves), and readable again from the start."""

    def __init__(self, source: Iterator[tuple[Block, int]]) -> None:
        self._source = source
        self._read: list[tuple[Block, int]] = []

    def get(self, index: int) -> tuple[Block, int] | None:
        while len(self._read) <= index:
            item = next(self._source, None)
            if item is None:
                return None
            self._read.append(item)
        return self._read[index]

    def __iter__(self) -> Iterator[tuple[Block, int]]:
        index = 0
        item = self.get(0)
        while item is not None:
            yield item
            index += 1
            item = self.get(index)


def _snapshot_partials(
    ends: list[tuple[Block, int]], children: SharedChildren
) -> Iterator[tuple[Block, Block | None, int]]:
    """Per snapshot end (longest first), every child holding the rows up to it: rows [0, length) are the same in
    each (the snapshot's block among them)."""
    for ending, length in ends:
        for copied, shared in children:
            if shared < length:
                break  # longest first: no later child holds them
            yield copied, ending, length


def _inner_partials(children: SharedChildren) -> Iterator[tuple[Block, Block | None, int]]:
    """Every (child, where a match may end inside it) longest first, children in their order on a tie: a merge of
    each child's ends (``_inner_ends``), reading the next child only once every end already read that is longer
    than its shared tokens has been given out (so the first child that serves ends the walk)."""
    waiting: list[tuple[int, int, Block]] = []  # (-length, order read, child): a heap
    read = 0
    index = 0
    pending = children.get(0)
    while True:
        while pending is not None and (not waiting or pending[1] > -waiting[0][0]):  # a tie comes after: later
            child, shared = pending
            for ends in _inner_ends(child, shared):
                heapq.heappush(waiting, (-ends, read, child))
                read += 1
            index += 1
            pending = children.get(index)
        if not waiting:
            return
        length, _, child = heapq.heappop(waiting)
        yield child, None, -length


def _inner_ends(block: Block, longest: int) -> list[int]:
    """Where a match may end inside ``block``, reading at most ``longest`` of its tokens, longest first: there, or
    where one of its pages covering fewer tokens stops (past that, that life cycle has no rows)."""
    ends = {longest}
    for page in block.pages:
        if page is not None and 0 < page.num_tokens < longest:
            ends.add(page.num_tokens)
    return sorted(ends, reverse=True)


def _page_counts(chain: list[Block], life_cycle: LifeCycleId) -> list[int]:
    """``counts[k]``: how many of the first ``k`` blocks of ``chain`` still have a page of ``life_cycle`` holding
    all their tokens."""
    counts = [0]
    total = 0
    for block in chain:
        page = block.pages[life_cycle]
        if page is not None and page.num_tokens == len(block.tokens):
            total += 1
        counts.append(total)
    return counts
