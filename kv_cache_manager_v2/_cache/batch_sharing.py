"""Requests of one batch admission that have a common prefix share its pages instead of each allocating a copy.

Two requests of a batch with a common prompt prefix that the radix tree does not hold yet both match the same
blocks and, admitted one by one, each gets private pages for the rest of the prefix. Here the later request takes
the earlier one's pages for the full blocks of the common prefix that the earlier one computes in this very step
(inside its capacity), and its history starts after them. The engine writes the batch's new keys and values before
attention reads them (one forward over the batch, layer by layer; with ``FakeEngine``, step the requests in batch
order), so those blocks are computed once. Until then the rows are lent (``lent_rows.py``): an earlier request that
skips its step (cut below them, suspended, closed) gives them back to the later one's history. Either cache may
commit such a block first: the other then finds the same page in the tree. Only models whose layer groups are all
full attention share: a sliding window's stale and scratch ranges, or an SSM state at the shared end, would need
state the earlier request has not computed yet.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

from .._base.hashing import Token
from .._model.life_cycle import FullAttentionLifeCycle
from .kv_cache import CacheState
from .services import CacheServices


class BatchShare:
    """One request's planned share: blocks ``[begin, end)`` from an earlier request of the same batch. Candidates
    are the earlier requests on ``path`` (the planner's nodes it walked, one per block it agrees with someone on),
    longest share first, then in batch order (phase 2 takes the first one admitted: ``first_admitted``)."""

    def __init__(self, begin: int, path: list[SharedPrefix], position: int) -> None:
        self.begin = begin
        self.path = path
        self.position = position
        self.end = path[-1].block

    def first_admitted(self, admitted: Sequence[object | None]) -> tuple[int, int] | None:
        """(position, end) of the first candidate that ``admitted`` holds (not None at its position), if any."""
        path = self.path
        for depth in range(len(path) - 1, -1, -1):
            node = path[depth]
            deeper = path[depth + 1].positions if depth + 1 < len(path) else None
            for position in node.positions:
                if position >= self.position:
                    break  # offered after this request was planned
                if deeper is not None and position in deeper:
                    continue  # shares more: came earlier in the order
                if admitted[position] is not None:
                    return position, node.block
        return None


class SharedPrefix:
    """Requests of the batch (positions, in batch order) that agree up to ``block`` (the first block at which
    they may differ), and by their tokens there, those that agree one block further. Filed one block down only
    when a later request walks through (``SharePlanner.descend``), so an offer costs its first block only."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.positions: dict[int, None] = {}
        self.unfiled: list[int] = []
        self.next: dict[tuple[Token, ...], SharedPrefix] = {}


Key = TypeVar("Key")


def file_position(nodes: dict[Key, SharedPrefix], key: Key, block: int, position: int) -> None:
    """File request ``position`` as unfiled in the node of ``nodes`` under ``key`` (one agreeing up to ``block``),
    making that node on the first request that reaches it."""
    node = nodes.get(key)
    if node is None:
        node = SharedPrefix(block)
        nodes[key] = node
    node.positions[position] = None
    node.unfiled.append(position)


def batch_sharing_applies(services: CacheServices) -> bool:
    """Whether this manager's caches can share uncomputed prefix pages (every layer group is full attention)."""
    return all(type(life_cycle) is FullAttentionLifeCycle for life_cycle in services.life_cycles)


class SharePlanner:
    """Finds, request by request in batch order, the earlier request whose pages cover the most of this one's
    prefix. Requests are filed by their scope and tokens up to and including their first unmatched block, then
    block by block (``SharedPrefix``) as far as a later request agrees with them, so a request walks its own
    blocks once instead of comparing them with every earlier request (a batch behind one system prompt)."""

    def __init__(self, tokens_per_block: int) -> None:
        self._tpb = tokens_per_block
        self._roots: dict[tuple[object, tuple[Token, ...]], SharedPrefix] = {}
        # Per offered position: its tokens and how many of its blocks it computes in full (shareable).
        self._offers: dict[int, tuple[list[Token], int]] = {}

    def plan(
        self, position: int, cache: CacheState, tokens: list[Token], capacity_limit: int | None
    ) -> BatchShare | None:
        """The share of request ``position`` (None: nothing to share); ``capacity_limit``: its fixed capacity, or
        None when it is counted from the reused history (``num_new_tokens``)."""
        tpb = self._tpb
        begin = cache.history_length // tpb
        if len(tokens) < (begin + 1) * tpb:
            return None
        root = self._roots.get((cache.reuse_scope, tuple(tokens[: (begin + 1) * tpb])))
        limit = len(tokens) // tpb if capacity_limit is None else min(len(tokens), capacity_limit) // tpb
        if root is None or limit <= begin:
            return None
        path = [root]
        node = root
        while node.block < limit:
            block = node.block
            found = self.descend(node, tuple(tokens[block * tpb : (block + 1) * tpb]))
            if found is None:
                break
            path.append(found)
            node = found
        return BatchShare(begin, path, position)

    def descend(self, node: SharedPrefix, block_tokens: tuple[Token, ...]) -> SharedPrefix | None:
        """The requests of ``node`` that go on with ``block_tokens`` (filing its unfiled ones first)."""
        if node.unfiled:
            tpb = self._tpb
            block = node.block
            for position in node.unfiled:
                tokens, blocks = self._offers[position]
                if block < blocks:
                    file_position(node.next, tuple(tokens[block * tpb : (block + 1) * tpb]), block + 1, position)
            node.unfiled = []
        return node.next.get(block_tokens)

    def offer(self, position: int, cache: CacheState, tokens: list[Token], capacity: int) -> None:
        """Let later requests share the full blocks request ``position`` computes up to ``capacity``."""
        tpb = self._tpb
        begin = cache.history_length // tpb
        if min(len(tokens), capacity) < (begin + 1) * tpb:
            return
        file_position(self._roots, (cache.reuse_scope, tuple(tokens[: (begin + 1) * tpb])), begin + 1, position)
        self._offers[position] = (tokens, min(capacity, len(tokens)) // tpb)
